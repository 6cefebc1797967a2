"""The fencing token's layout (fastlock.tokens) agrees with the compiled core and the wire."""

import pytest

from fastlock import _core, protocol, tokens
from fastlock.wal import records


def test_the_python_layout_is_the_cores():
    assert tokens.TOKEN_EPOCH_SHIFT == _core.TOKEN_EPOCH_SHIFT
    assert tokens.MAX_EPOCH == _core.MAX_EPOCH == protocol.MAX_EPOCH
    assert tokens.COUNTER_MASK == _core.MAX_COUNTER
    assert (records.TOKEN_EPOCH_SHIFT, records.COUNTER_MASK) == (tokens.TOKEN_EPOCH_SHIFT, tokens.COUNTER_MASK)


def test_a_token_the_core_issues_reads_back_as_its_epoch_and_counter():
    table = _core.LockTable()
    table.set_epoch(7)
    table.advance_counter(41)
    assert table.acquire("a", b"o" * 16, 1, 1, 1000, 0, 0, None, 0) == _core.GRANTED
    token = table.last_token
    assert (tokens.epoch_of(token), tokens.counter_of(token)) == (7, 42)
    assert tokens.make_token(7, 42) == token
    assert tokens.format_token(token) == f"{token} (7/42)"


def test_the_largest_token_stays_below_2_63():
    top = tokens.make_token(tokens.MAX_EPOCH, tokens.COUNTER_MASK)
    assert top == 2**63 - 1
    assert (tokens.epoch_of(top), tokens.counter_of(top)) == (tokens.MAX_EPOCH, tokens.COUNTER_MASK)


@pytest.mark.parametrize("epoch, counter", [(-1, 0), (tokens.MAX_EPOCH + 1, 0), (0, -1), (0, tokens.COUNTER_MASK + 1)])
def test_make_token_refuses_what_does_not_fit(epoch, counter):
    with pytest.raises(ValueError, match="must be"):
        tokens.make_token(epoch, counter)
