"""``python -m benches.client_path``: the fake server's prepared replies answer the client's
requests (checked in the warm-up), a request the fake did not prepare for is refused, and
both the lock client's and the echo client's runs print a figure."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import msgpack
import pytest

# benches/ is not installed with the package: import it from the source tree
# (appended, so that ``fastlock`` itself still comes from the installed package)
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

from benches import client_path  # noqa: E402


@pytest.mark.parametrize("echo", [False, True])
def test_a_short_run_prints_the_client_cpu_per_pair(capsys, echo):
    assert client_path.main(["--pairs", "300", "--rounds", "2"] + (["--echo"] if echo else [])) == 0
    out = capsys.readouterr().out
    assert out.startswith("echo: client CPU" if echo else "fastlock: client CPU")
    assert "of 2 rounds of 300" in out


def test_the_profile_counts_the_clients_python_level_calls(capsys):
    assert client_path.main(["--pairs", "200", "--profile"]) == 0
    out = capsys.readouterr().out
    assert "client Python-level calls per pair:" in out
    assert "acquire (client.py:" in out


class _Sink:
    def __init__(self) -> None:
        self.replies: list[bytes] = []

    def data_received(self, data: bytes) -> None:
        self.replies.append(data)


async def _checked_write(frame: list) -> list[bytes]:
    sink = _Sink()
    fake = client_path._FakeServer(sink, asyncio.get_running_loop(), 41, 42, 10_000)
    fake.prepare(7, 1, checked=True)
    fake.write(msgpack.packb(frame))
    await asyncio.sleep(0)  # the reply's call_soon
    return sink.replies


def test_the_checked_fake_answers_the_prepared_request_with_a_grant():
    replies = asyncio.run(_checked_write([7, 41, "k", b"o" * 16, 10_000, -1, 0, None]))
    assert [msgpack.unpackb(r) for r in replies] == [[7, 0, [(1 << 40) + 1, 10_000, 0]]]


@pytest.mark.parametrize("frame", [[8, 41, "k"], [7, 42, "k", 1, b"o"]])
def test_the_checked_fake_refuses_a_request_it_did_not_prepare_for(frame):
    with pytest.raises(AssertionError, match="not the one prepared"):
        asyncio.run(_checked_write(frame))
