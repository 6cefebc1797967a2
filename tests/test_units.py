"""The shared rules of fastlock.units: seconds, milliseconds and addresses."""

import math

import pytest

from fastlock.errors import InvalidArgument, WrongArgumentType
from fastlock.units import DEFAULT_PORT, check_seconds, format_address, monotonic_ms, parse_address, seconds_to_ms


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1, -0.001])
def test_check_seconds_refuses_non_finite_and_negative(bad):
    with pytest.raises(InvalidArgument):
        check_seconds(bad, "ttl")


@pytest.mark.parametrize("bad", [True, "1", None, [1]])
def test_check_seconds_refuses_non_numbers(bad):
    with pytest.raises(WrongArgumentType):
        check_seconds(bad, "ttl")


def test_check_seconds_zero_none_and_maximum():
    with pytest.raises(InvalidArgument):
        check_seconds(0, "ttl")
    assert check_seconds(0, "wait", allow_zero=True) == 0.0
    assert check_seconds(None, "wait", allow_none=True) is None
    with pytest.raises(InvalidArgument, match="at most 5"):
        check_seconds(6, "ttl", maximum=5)


def test_seconds_to_ms_rounds_up_below_one_ms():
    assert seconds_to_ms(0.0001, "ttl") == 1
    assert seconds_to_ms(1.5, "ttl") == 1500
    assert seconds_to_ms(None, "wait", allow_none=True) == -1
    assert seconds_to_ms(0, "wait", allow_zero=True) == 0


@pytest.mark.parametrize("text, expected", [
    ("127.0.0.1:7000", ("127.0.0.1", 7000)),
    ("localhost", ("localhost", DEFAULT_PORT)),
    ("[::1]:9", ("::1", 9)),
    ("[::1]", ("::1", DEFAULT_PORT)),
    (":8000", ("127.0.0.1", 8000)),
    (("10.0.0.1", 5), ("10.0.0.1", 5)),
])
def test_parse_address_accepts(text, expected):
    assert parse_address(text) == expected


@pytest.mark.parametrize("text", ["::1:80", "[::1:80", "h:x", "h:70000", "h:0"])
def test_parse_address_refuses(text):
    with pytest.raises(InvalidArgument):
        parse_address(text)


def test_parse_address_listener_rules():
    assert parse_address("127.0.0.1:0", default_port=None, allow_port_zero=True) == ("127.0.0.1", 0)
    with pytest.raises(InvalidArgument, match="HOST:PORT"):
        parse_address("localhost", default_port=None)


def test_format_address_round_trips():
    for addr in [("127.0.0.1", 1), ("::1", 2)]:
        assert parse_address(format_address(addr)) == addr


def test_monotonic_ms_does_not_go_backwards():
    a = monotonic_ms()
    assert monotonic_ms() >= a
