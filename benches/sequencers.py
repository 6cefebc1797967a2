"""What signed sequencers cost: verification per core (Ed25519 and HMAC-SHA256), signing,
and the grant path (W1 and W2 with and without sequencers) in one run.

    python -m benches.sequencers [--seconds 2] [--rounds 3] [--duration 3] [--warmup 1]
                                 [--concurrency 32] [--fsync never] [--fuzz N] [--skip-load]
                                 [--uvloop | --no-uvloop] [--json PATH]

1. **Verify and sign, one core**: ``fastlock.sequencer.verify`` (decode, key lookup,
   signature, name and expiry checks) and ``fastlock.sequencer.sign`` in a loop on this
   thread for ``--seconds`` each, for Ed25519 and HMAC-SHA256: operations per second and
   µs per operation.
2. **The grant path**: two ``fastlock serve`` subprocesses with the same flags and a
   credentials file holding an Ed25519 key; the clients of one ask for a sequencer with
   every grant (``connect(sequencers=True)``), those of the other do not.  Each round runs
   W1 (one client, acquire+release: pair latency) and W2 (``--concurrency`` clients, each on
   its own lock: pairs/s) on both, the order swapped every round; the report gives the
   median over rounds and the with/without ratio, and the server CPU µs per pair.
3. **The renewal path** (``--renewals``, on unless ``--skip-load``): one ``fastlock serve``
   with the key; one raw connection renews (a) one lease by EXTEND, without and with its
   ``sequencer`` flag (re-signed in the reply), in alternating blocks of 200 sequential
   requests: µs per round trip and server CPU µs per EXTEND; (b) ``--session-leases``
   leases (default 256, the most one session re-signs) through two client sessions, one
   attached with the flag and one without, keep-alives alternating: ms per keep-alive
   and server CPU µs per lease renewed.
4. ``--fuzz N``: N mutated sequencers through ``verify``
   (:mod:`fastlock._testbase.sequencer_fuzz`): how many were accepted (must be 0), refused
   by error class, and the time taken.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from benches import harness
from benches.load import FastlockSession, FastlockTarget


def per_core(seconds: float) -> dict[str, dict[str, float]]:
    """Verify and sign in a loop for ``seconds`` each: ops/s and µs/op per algorithm."""
    from fastlock import sequencer as S
    from fastlock.tokens import make_token

    out: dict[str, dict[str, float]] = {}
    for algorithm in ("ed25519", "hmac-sha256"):
        key = S.SigningKey.of(algorithm, bytes(range(32)))
        keys = {key.key_id: key.verify_key}
        expires = int(time.time() * 1000) + 3_600_000
        blob = S.encode(key, name="orders/42", token=make_token(1, 7), principal="app", expires_at_ms=expires)
        steps = (("verify", functools.partial(S.verify, blob, keys, name="orders/42")),
                 ("sign", functools.partial(S.sign, key, "orders/42", make_token(1, 7), "app", 0, 10_000)))
        for what, step in steps:
            n = 0
            end = time.perf_counter() + seconds
            started = time.perf_counter()
            while True:
                for _ in range(200):
                    step()
                n += 200
                if time.perf_counter() >= end:
                    break
            took = time.perf_counter() - started
            out[f"{what} {algorithm}"] = {"ops_per_s": n / took, "us_per_op": took / n * 1e6}
    return out


class SequencerTarget(FastlockTarget):
    """A fastlock server with a sequencer key; its clients ask for sequencers or not."""

    def __init__(self, credentials: str, *, sequencers: bool, fsync: str) -> None:
        super().__init__(fsync=fsync, extra_args=("--credentials", credentials))
        self.sequencers = sequencers
        self.name = f"fastlock fsync={fsync} {'with' if sequencers else 'without'} sequencers"

    async def open(self, idx: int) -> harness.Session:
        import fastlock
        client = await fastlock.connect(f"127.0.0.1:{self.port}", client_name=f"bench-{idx}",
                                        sequencers=self.sequencers)
        return FastlockSession(client, owned=True)


def _median(rows: list[dict], key) -> float:
    values = [key(r) for r in rows if "pair_us" in r]
    return statistics.median(values) if values else float("nan")


def grant_path(args: argparse.Namespace) -> tuple[dict, dict]:
    """W1/W2 with and without sequencers, alternating rounds: (rows, summary)."""
    from fastlock.auth import generate

    wls = [w for w in harness.workloads_from_args(args) if w.name in ("W1", "W2")]
    rows: dict[str, list[dict]] = {"without": [], "with": []}
    with tempfile.TemporaryDirectory(prefix="fastlock-seq-bench-") as d:
        generate(os.path.join(d, "c"), anonymous_prefix="")  # the bench's clients are the anonymous principal
        creds = os.path.join(d, "c", "credentials.toml")
        targets = {key: SequencerTarget(creds, sequencers=key == "with", fsync=args.fsync) for key in rows}
        try:
            for t in targets.values():
                t.start()
            for rnd in range(args.rounds):
                order = ["without", "with"] if rnd % 2 == 0 else ["with", "without"]
                for key in order:
                    for wl in wls:
                        row = harness.run_workload(targets[key], wl, use_uvloop=args.uvloop)
                        row["round"] = rnd
                        rows[key].append(row)
                        print(f"  round {rnd + 1} {targets[key].name:<40} {wl.name}: {harness.one_line(row)}",
                              flush=True)
        finally:
            for t in targets.values():
                t.stop()
    summary: dict[str, Any] = {}
    for wl in wls:
        for key in rows:
            mine = [r for r in rows[key] if r.get("workload") == wl.name]
            summary[f"{wl.name} {key}"] = {
                "pair_p50_us": _median(mine, lambda r: r["pair_us"]["p50"]),
                "pairs_per_s": _median(mine, lambda r: r["pairs_per_s"]),
                "server_cpu_us_per_pair": _median(mine, lambda r: r["server_cpu_pct"] * 1e4 / r["pairs_per_s"]),
                "errors": sum(r.get("error_count", 0) for r in mine),
            }
    return rows, summary


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _renewals(address: str, pid: int, seconds: float, session_leases: int) -> dict[str, dict[str, float]]:
    """The renewal path on the server at ``address`` (process ``pid``): see the module docstring (3)."""
    from fastlock import protocol as P
    from fastlock._testbase.cluster import RawNode

    node = await RawNode.open(address, token=None)
    out: dict[str, dict[str, float]] = {}
    try:
        owner = os.urandom(16)
        token = (await node.request(P.OP_ACQUIRE, "renew/one", owner, 60_000, 0, 0, None, False, 0, 0, True))[0]
        spent = {False: [0.0, 0.0, 0], True: [0.0, 0.0, 0]}  # flag -> [wall s, server CPU s, requests]
        end = time.perf_counter() + 2 * seconds
        while time.perf_counter() < end:
            for flag in (False, True):
                extra = (True,) if flag else ()
                cpu0, t0 = _cpu_seconds(pid), time.perf_counter()
                for _ in range(200):
                    await node.request(P.OP_EXTEND, "renew/one", token, owner, 60_000, *extra)
                row = spent[flag]
                row[0] += time.perf_counter() - t0
                row[1] += _cpu_seconds(pid) - cpu0
                row[2] += 200
        for flag, (wall, cpu, n) in spent.items():
            out[f"EXTEND {'with' if flag else 'without'}"] = {"us_per_request": wall / n * 1e6,
                                                              "server_cpu_us": cpu / n * 1e6}
        leases = []
        for i in range(session_leases):
            o = os.urandom(16)
            r = await node.request(P.OP_ACQUIRE, f"renew/{i}", o, 60_000, 0, 0, None, False, 0, 0, True)
            leases.append((f"renew/{i}", r[0], o))
        keys = {flag: os.urandom(16) for flag in (False, True)}
        for flag, key in keys.items():
            await node.request(P.OP_SESSION_OPEN, key, 60_000)
            for start in range(0, len(leases), 60):
                page = [[n, t, o, True] if flag else [n, t, o] for n, t, o in leases[start:start + 60]]
                await node.request(P.OP_SESSION_ATTACH, key, page, [])
        rounds = {False: [0.0, 0.0, 0], True: [0.0, 0.0, 0]}
        end = time.perf_counter() + 2 * seconds
        while time.perf_counter() < end:
            for flag, key in keys.items():
                cpu0, t0 = _cpu_seconds(pid), time.perf_counter()
                for _ in range(5):
                    reply = await node.request(P.OP_SESSION_KEEPALIVE, key)
                    assert reply["renewed"] == session_leases and bool(reply.get("sequencers")) == flag
                row = rounds[flag]
                row[0] += time.perf_counter() - t0
                row[1] += _cpu_seconds(pid) - cpu0
                row[2] += 5
        for flag, (wall, cpu, n) in rounds.items():
            out[f"keep-alive with {session_leases} leases {'with' if flag else 'without'}"] = {
                "ms_per_keepalive": wall / n * 1e3, "server_cpu_us_per_lease": cpu / n / session_leases * 1e6}
    finally:
        await node.close()
    return out


def renewal_path(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Run :func:`_renewals` against a fresh server with an Ed25519 key (``--fsync`` as given)."""
    import asyncio

    from fastlock._testbase.servers import ServerProcess
    from fastlock.auth import generate

    with tempfile.TemporaryDirectory(prefix="fastlock-seq-renew-") as d:
        generate(os.path.join(d, "c"), anonymous_prefix="")
        srv = ServerProcess(os.path.join(d, "data"), fsync=args.fsync,
                            args=["--credentials", os.path.join(d, "c", "credentials.toml")]).start()
        try:
            return asyncio.run(_renewals(srv.address, srv.pid, args.seconds, args.session_leases))
        finally:
            srv.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.sequencers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_args(ap)
    ap.set_defaults(workloads="W1,W2")
    ap.add_argument("--seconds", type=float, default=2.0, help="seconds per verify/sign measurement (default 2)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of W1/W2 (default 3)")
    ap.add_argument("--fsync", default="never", choices=("never", "interval", "always"),
                    help="both servers' --fsync (default never: leave the disk out)")
    ap.add_argument("--fuzz", type=int, default=0, metavar="N", help="also verify N mutated sequencers")
    ap.add_argument("--skip-load", action="store_true", help="only the per-core and fuzz parts (no servers)")
    ap.add_argument("--no-renewals", dest="renewals", action="store_false", help="leave out the renewal path")
    ap.add_argument("--no-grants", dest="grants", action="store_false", help="leave out the grant path (W1/W2)")
    ap.add_argument("--session-leases", type=int, default=256,
                    help="leases one session keep-alive renews in the renewal path (default 256)")
    args = ap.parse_args(argv)
    payload: dict[str, Any] = {"machine": harness.machine_info(), "args": vars(args)}
    print(f"benches.sequencers: verify/sign {args.seconds:g} s each on one core", flush=True)
    core = per_core(args.seconds)
    payload["per_core"] = core
    for what, r in core.items():
        print(f"  {what:<22} {r['ops_per_s']:>12,.0f} ops/s  {r['us_per_op']:>8.2f} us/op", flush=True)
    failed = False
    if args.fuzz:
        from fastlock._testbase.sequencer_fuzz import fuzz
        started = time.perf_counter()
        result = fuzz(args.fuzz)
        took = time.perf_counter() - started
        payload["fuzz"] = {**result._asdict(), "seconds": took}
        print(f"fuzz: {args.fuzz:,} mutants in {took:.1f} s: accepted {result.accepted}, refused "
              f"{result.refused:,}, unchanged {result.unchanged:,}; refusals {result.by_error}", flush=True)
        failed = result.accepted != 0
    if not args.skip_load and args.renewals:
        print(f"renewal path: EXTEND and session keep-alives without/with re-signing, fsync={args.fsync}", flush=True)
        renewals = renewal_path(args)
        payload["renewals"] = renewals
        for what, r in renewals.items():
            print("  " + f"{what:<40}" + "  ".join(f"{k} {v:,.1f}" for k, v in r.items()), flush=True)
    if not args.skip_load and args.grants:
        busy = harness.wait_for_quiet(args.quiet_wait, log=lambda s: print(s, flush=True))
        print(f"grant path: W1/W2 x {args.rounds} alternating rounds, {args.duration:g} s each after "
              f"{args.warmup:g} s warmup; fsync={args.fsync}; machine busy before start: {busy:.0f}% of a core",
              flush=True)
        rows, summary = grant_path(args)
        payload.update(rows=rows, summary=summary)
        print(f"\nmedian of {args.rounds} rounds         without        with   with/without")
        for wl in ("W1", "W2"):
            if f"{wl} without" not in summary:
                continue
            a, b = summary[f"{wl} without"], summary[f"{wl} with"]
            if wl == "W1":
                print(f"W1 pair p50 (us)          {a['pair_p50_us']:>10.0f}  {b['pair_p50_us']:>10.0f}  "
                      f"{b['pair_p50_us'] / a['pair_p50_us']:>8.2f}")
            else:
                print(f"W2 pairs/s                {a['pairs_per_s']:>10,.0f}  {b['pairs_per_s']:>10,.0f}  "
                      f"{b['pairs_per_s'] / a['pairs_per_s']:>8.2f}")
            print(f"{wl} server CPU us/pair      {a['server_cpu_us_per_pair']:>10.1f}  "
                  f"{b['server_cpu_us_per_pair']:>10.1f}  "
                  f"{b['server_cpu_us_per_pair'] / a['server_cpu_us_per_pair']:>8.2f}")
        failed = failed or any(s["errors"] for s in summary.values())
    if args.json:
        harness.write_json(args.json, payload)
        print(f"\nwrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
