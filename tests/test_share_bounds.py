"""What a principal can make the server hold beyond its leases, against real servers.

Running lock-delays count as leases (per-principal quota and --max-leases) until they
end; the bytes of key values are bounded per principal and in all; per-lease log lines
on hot paths are rate limited.
"""

from __future__ import annotations

import os
import re
import time

import msgpack
from test_limits import Raw, acquire_args, error_of
from test_shares import wait_for

from fastlock import protocol as P
from fastlock._testbase import CredentialsDir
from fastlock.errors import LimitExceeded
from fastlock.protocol.ops import KEY_UPSERT, OP_KEY_DELETE, OP_KEY_GET, OP_KEY_PUT

LONG_TTL_MS = P.MAX_TTL_MS  # 1 hour: nothing expires during a test


def _limit(reply, flag: str) -> None:
    code, message = error_of(reply)
    assert code == LimitExceeded.code, reply
    assert flag in message, message


def _all_expired(raw: Raw) -> bool:
    return raw.call(P.OP_STATUS)[2]["locks_held"] == 0


def _flood_with_lock_delays(raw: Raw, op: int, rounds: int, per_round: int, lock_delay_ms: int) -> tuple[int, list]:
    """Acquire ``per_round`` fresh names a round with a 1 ms TTL and a lock-delay, wait for
    them to expire, again; stop at the first refusal.  Returns (names granted, refusal)."""
    granted = 0
    for r in range(rounds):
        if op == P.OP_ACQUIRE_MANY:
            replies = [raw.call(op, [[f"d{r}/{k}", False] for k in range(per_round)], os.urandom(16), 1, 0,
                                lock_delay_ms, None)]
        else:
            replies = [raw.call(op, f"d{r}/{k}", os.urandom(16), 1, 0, lock_delay_ms, None) for k in range(per_round)]
        for reply in replies:
            if reply[1] != 0:
                return granted, reply
            granted += per_round if op == P.OP_ACQUIRE_MANY else 1
        wait_for("the leases to expire", lambda: _all_expired(raw))
    return granted, None


def test_running_lock_delays_count_against_the_lease_quota(server_factory):
    """A 1 ms lease with a 60 s lock-delay leaves a lock entry for 60 s: it counts as a
    lease of its principal until the delay ends, so expiring leases cannot pile up
    entries beyond the quota (ACQUIRE_MANY and ACQUIRE alike)."""
    srv = server_factory("delays", args=["--max-leases-per-principal", "40"])
    with Raw(srv.address) as raw:
        granted, refusal = _flood_with_lock_delays(raw, P.OP_ACQUIRE_MANY, 20, 10, 60_000)
        assert granted == 40
        _limit(refusal, "--max-leases-per-principal")
        _limit(raw.call(P.OP_ACQUIRE, *acquire_args("one-more")), "--max-leases-per-principal")
        st = raw.call(P.OP_STATUS)[2]
        assert st["locks_held"] == 0
        (usage,) = st["principals"]
        assert usage["lock_delays"] == 40 and usage["leases"] == 0


def test_running_lock_delays_count_against_max_leases(server_factory):
    """With no per-principal quota (one principal), the global --max-leases counts the
    running lock-delays too."""
    srv = server_factory("global", args=["--max-leases", "30"])
    with Raw(srv.address) as raw:
        granted, refusal = _flood_with_lock_delays(raw, P.OP_ACQUIRE, 20, 10, 60_000)
        assert granted == 30
        _limit(refusal, "--max-leases")
        _limit(raw.call(P.OP_ACQUIRE_MANY, [["m/0", False]], os.urandom(16), LONG_TTL_MS, 0, 0, None), "--max-leases")


def test_a_lock_delay_stops_counting_when_it_ends(server_factory):
    srv = server_factory("ends", args=["--max-leases-per-principal", "5"])
    with Raw(srv.address) as raw:
        granted, refusal = _flood_with_lock_delays(raw, P.OP_ACQUIRE_MANY, 5, 5, 1_500)
        assert granted == 5
        _limit(raw.call(P.OP_ACQUIRE, *acquire_args("after")), "--max-leases-per-principal")
        wait_for("the lock-delays to end",
                  lambda: raw.call(P.OP_ACQUIRE, *acquire_args("after", ttl_ms=LONG_TTL_MS))[1] == 0)
        assert raw.call(P.OP_STATUS)[2]["principals"][0]["lock_delays"] == 0


def test_lease_expiries_log_a_bounded_number_of_lines_with_a_summary(server_factory):
    """Thousands of leases expiring within a second write ten lines a second at most,
    and a later line says how many were left out."""
    srv = server_factory("quiet")
    with Raw(srv.address, timeout=30) as raw:
        start = time.monotonic()
        for r in range(40):
            assert raw.call(P.OP_ACQUIRE_MANY, [[f"e{r}/{k}", False] for k in range(64)], os.urandom(16), 1, 0, 0,
                            None)[1] == 0
        wait_for("2,560 leases to expire", lambda: _all_expired(raw))
        lines = [line for line in srv.lines if "lease expired:" in line]
        assert len(lines) <= 10 * (2 + (time.monotonic() - start)), len(lines)
        # the next expiry after the interval reports what was left out
        summary = re.compile(r"lease expired: .*\((\d+) more like this in the last 1 s\)")

        def summarised() -> bool:
            raw.call(P.OP_ACQUIRE, *acquire_args("tick", ttl_ms=1))
            return any(summary.search(line) for line in srv.lines)

        wait_for("a summary line", summarised)
        left_out = sum(int(m.group(1)) for line in srv.lines if (m := summary.search(line)))
        assert left_out >= 2_560 - len(lines)


# ---------------------------------------------------------------------------------------------
# bytes of key values


def _put(raw: Raw, key: str, size: int, fill: bytes = b"v") -> list:
    return raw.call(OP_KEY_PUT, key, fill * size, None, 0, None, KEY_UPSERT)


def _key_bytes(raw: Raw) -> int:
    (row,) = raw.call(P.OP_STATUS)[2]["principals"]
    return row["key_bytes"]


def test_a_principals_key_value_bytes_are_bounded(server_factory):
    """Every put counts the bytes it stores (a replacement the difference); a delete
    gives them back; a refused put changes nothing."""
    srv = server_factory("kbytes", args=["--max-key-bytes-per-principal", "200000"])
    with Raw(srv.address) as raw:
        for i in range(3):
            assert _put(raw, f"k/{i}", 65_536)[1] == 0
        _limit(_put(raw, "k/3", 65_536), "--max-key-bytes-per-principal")
        assert raw.call(OP_KEY_GET, "k/3")[2] is None and _key_bytes(raw) == 196_608
        # replacing a value counts only what it adds: the same size again fits, a larger one not
        assert _put(raw, "k/0", 65_536, b"w")[1] == 0
        assert _put(raw, "k/3", 3_392)[1] == 0 and _key_bytes(raw) == 200_000  # exactly the quota
        _limit(_put(raw, "k/3", 3_393, b"w"), "--max-key-bytes-per-principal")
        assert raw.call(OP_KEY_GET, "k/3")[2]["value"] == b"v" * 3_392
        assert raw.call(OP_KEY_DELETE, "k/1")[2] is True
        assert _key_bytes(raw) == 134_464
        assert _put(raw, "k/4", 65_536)[1] == 0


def test_key_value_bytes_of_all_principals_are_capped(server_factory):
    srv = server_factory("kglobal", args=["--max-key-bytes", "150000"])
    with Raw(srv.address) as raw:
        assert _put(raw, "a", 65_536)[1] == 0 and _put(raw, "b", 65_536)[1] == 0
        _limit(_put(raw, "c", 65_536), "--max-key-bytes")
        assert raw.call(P.OP_STATUS)[2]["principals"][0]["key_bytes"] == 131_072


def test_anonymous_upserting_64_kib_values_stops_at_its_share(server_factory, tmp_path):
    """The finding at the defaults: anonymous puts 64 KiB values; it stops at a sixteenth
    of --max-key-bytes (16 MiB: 256 values), and ``app`` still puts."""
    creds = CredentialsDir(tmp_path / "credentials", replicas=1)
    srv = server_factory("kflood", fsync="never", args=["--credentials", creds.file])
    with Raw(srv.address, timeout=30) as raw:
        raw.sock.sendall(b"".join(msgpack.packb([i + 1, OP_KEY_PUT, f"flood/{i}", b"x" * 65_536, None, 0, None,
                                                 KEY_UPSERT], use_bin_type=True) for i in range(300)))
        raw.next_id = 301
        replies = [raw.recv() for _ in range(300)]
        assert sum(r[1] == 0 for r in replies) == 256
        assert all(r[1] == LimitExceeded.code and "--max-key-bytes-per-principal" in r[2] for r in replies if r[1])
    with Raw(srv.address, credential=creds.token("app")) as app:
        assert _put(app, "app/1", 65_536)[1] == 0


def _snapshots(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("snap-") and p.name.endswith(".snap"))


def _put_40_values(raw: Raw) -> None:
    for i in range(40):
        assert _put(raw, f"big/{i}", 65_536)[1] == 0


def test_the_log_is_snapshotted_by_bytes_as_well_as_by_records(server_factory):
    """40 puts of 64 KiB are 40 records (far from --snapshot-every) but 2.6 MB of log:
    with --snapshot-every-bytes 1 MiB a snapshot is written, and the next one follows the
    next MiB; with 0 (records only) none is."""
    srv = server_factory("bybytes", fsync="never", args=["--snapshot-every-bytes", str(1 << 20)])
    with Raw(srv.address, timeout=30) as raw:
        _put_40_values(raw)

        def snapshotted() -> list[str]:
            raw.call(P.OP_STATUS)  # a batch end, where a due snapshot starts
            return _snapshots(srv.data_dir) if len(_snapshots(srv.data_dir)) >= 2 else []

        taken = wait_for("snapshots by bytes", snapshotted)
        assert len(taken) == 2, taken  # 2.6 MB at one per MiB; two kept (older ones compacted away)
    records_only = server_factory("byrecords", fsync="never", args=["--snapshot-every-bytes", "0"])
    with Raw(records_only.address, timeout=30) as raw:
        _put_40_values(raw)
        raw.call(P.OP_STATUS)
        assert _snapshots(records_only.data_dir) == []
