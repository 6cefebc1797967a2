"""End-to-end load: fastlock against the msgpack echo floor (issue 2, item 9).

    python -m benches.load [--duration 3] [--warmup 1] [--concurrency 32]
                           [--fsync never,always] [--uvloop | --no-uvloop]
                           [--shared-connection] [--json PATH] [--quick]

Starts a ``python -m fastlock serve`` subprocess per fsync mode (free port,
throwaway data dir, stopped afterwards) and the echo server, runs W1/W2/W3 from
:mod:`benches.harness` in ONE client process (asyncio tasks, one connection per
client unless ``--shared-connection``), and prints every figure with its ratio
to the floor and the targets of issue 2:

- W1: pair p50 / echo pair p50 <= 2.  The echo "pair" is two sequential round
  trips shaped like an acquire and a release, so the ratio is per operation
  (each lock call vs one echo round trip).
- W2: fastlock requests/s >= 40 % of the echo floor's requests/s, a pair
  counting as 2 requests on both sides.
- W3: hand-offs/s >= 90 % of 1 / (hold + echo round trip p50), and Jain >= 0.99.
  The bound is also shown with the *measured* hold (asyncio.sleep(0.001)
  oversleeps), which is the one the verdict uses, and beside the *measured
  hand-off floor*: one echo client that holds, then does one round trip, in a
  loop.  Its cycle minus its measured hold is the *cold* round trip (both
  processes idle during the hold must wake up; the W1 round trip is taken hot),
  and 1/(measured hold + cold round trip) is the rate no server can beat here.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

from benches import harness
from benches.echo import EchoTarget

FASTLOCK_TTL = harness.DEFAULT_TTL
FASTLOCK_WAIT = harness.DEFAULT_WAIT


# --------------------------------------------------------------------------- #
# the fastlock driver
# --------------------------------------------------------------------------- #

class FastlockSession(harness.Session):
    """acquire(name, ttl=10 s, wait=5 s) / release(lease) on one fastlock client."""

    def __init__(self, client, owned: bool) -> None:
        self.client = client
        self.owned = owned            # close the client with the session?
        self.leases: dict[str, Any] = {}
        self.round_trips = 0
        self.wasted = 0

    async def acquire(self, name: str) -> int:
        self.round_trips += 1
        lease = await self.client.acquire(name, ttl=FASTLOCK_TTL, wait=FASTLOCK_WAIT)
        self.leases[name] = lease
        return lease.fencing_token

    async def release(self, name: str) -> None:
        self.round_trips += 1
        await self.client.release(self.leases.pop(name))

    async def close(self) -> None:
        if self.owned:
            await self.client.close()


class FastlockTarget(harness.Target):
    """``python -m fastlock serve`` as a subprocess; clients from ``fastlock.connect``."""

    system = "fastlock"
    fencing = True
    notes = "FIFO waiters, server-side blocking acquire, fencing token per grant"

    def __init__(self, *, fsync: str = "always", shared_connection: bool = False,
                 python: str | None = None, extra_args: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.fsync = fsync
        self.shared_connection = shared_connection
        self.python = python or sys.executable
        self.extra_args = tuple(extra_args)
        self.port: int | None = None
        self._shared = None
        self.name = f"fastlock fsync={fsync}" + (" 1conn" if shared_connection else "")

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["fsync"] = self.fsync
        d["shared_connection"] = self.shared_connection
        return d

    def start(self) -> None:
        d = self.make_tmpdir()
        argv = [self.python, "-m", "fastlock", "serve", "--listen", "127.0.0.1:0",
                "--data-dir", os.path.join(d, "data"), "--fsync", self.fsync, *self.extra_args]
        srv = harness.ServerProcess("fastlock", argv, log_path=os.path.join(d, "server.log"), cwd=d,
                                    env=_env_with_fastlock())
        self.servers.append(srv)
        self.port = srv.start(ready_regex=r"listening on 127\.0\.0\.1:(\d+)")

    async def open(self, idx: int) -> harness.Session:
        import fastlock
        addr = f"127.0.0.1:{self.port}"
        if self.shared_connection:
            if self._shared is None or idx == 0:
                self._shared = await fastlock.connect(addr, client_name="bench")
            return FastlockSession(self._shared, owned=(idx == 0))
        return FastlockSession(await fastlock.connect(addr, client_name=f"bench-{idx}"), owned=True)


def _env_with_fastlock() -> dict[str, str]:
    """The environment for the server: finds the same fastlock package as this process
    (an installed one, or the source tree's when run from a checkout)."""
    import importlib.util
    env = dict(os.environ)
    spec = importlib.util.find_spec("fastlock")
    if spec is not None and spec.origin:
        root = os.path.dirname(os.path.dirname(os.path.abspath(spec.origin)))
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def fastlock_available() -> str | None:
    """None if ``import fastlock`` gives a client with ``connect``, else why not."""
    try:
        import fastlock
    except Exception as e:  # noqa: BLE001 - any import failure means "not built yet"
        return f"import fastlock failed: {type(e).__name__}: {e}"
    if not hasattr(fastlock, "connect"):
        return "fastlock.connect does not exist yet"
    return None


# --------------------------------------------------------------------------- #
# report
# --------------------------------------------------------------------------- #

def _get(rows: list[dict], target: str, wl: str) -> dict | None:
    for r in rows:
        if r.get("target") == target and r.get("workload") == wl and "pair_us" in r:
            return r
    return None


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) and not math.isnan(a) else float("nan")


def _mark(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "MISS")


def floor_figures(rows: list[dict], hold_s: float) -> dict[str, float]:
    """Echo round trip and rate, and the W3 hand-off bound derived from them."""
    w1 = _get(rows, EchoTarget.name, "W1")
    w2 = _get(rows, EchoTarget.name, "W2")
    w3 = _get(rows, EchoTarget.name, "W3")
    out = {"rtt_p50_us": float("nan"), "pair_p50_us": float("nan"), "w2_requests_per_s": float("nan"),
           "w3_handoff_floor_per_s": float("nan"), "cold_rtt_us": float("nan")}
    if w3 and w3["handoffs_per_s"] > 0:
        # per hand-off the floor spends its (measured) hold plus one round trip that
        # starts from idle processes: that remainder is the cold round trip
        out["w3_handoff_floor_per_s"] = w3["handoffs_per_s"]
        out["cold_rtt_us"] = 1e6 / w3["handoffs_per_s"] - w3["hold_measured_us"]["mean"]
    if w1:
        out["rtt_p50_us"] = w1["acquire_us"]["p50"]
        out["pair_p50_us"] = w1["pair_us"]["p50"]
    if w2:
        out["w2_requests_per_s"] = w2["requests_per_s"]
    out["w3_bound_per_s"] = 1.0 / (hold_s + out["rtt_p50_us"] / 1e6)
    return out


def compare(rows: list[dict], hold_s: float) -> list[dict[str, Any]]:
    """One verdict per lock target and workload: figure, ratio to the floor, target."""
    fl = floor_figures(rows, hold_s)
    verdicts = []
    for r in rows:
        if r.get("is_floor") or "pair_us" not in r:
            continue
        v: dict[str, Any] = {"target": r["target"], "workload": r["workload"]}
        if r["workload"] == "W1":
            ratio = _ratio(r["pair_us"]["p50"], fl["pair_p50_us"])
            v.update(figure=f"pair p50 {r['pair_us']['p50']:.0f} us (per op {r['pair_us']['p50'] / 2:.0f} us)",
                     ratio=ratio, goal="<= 2.0x echo (per op)",
                     ok=None if math.isnan(ratio) else ratio <= 2.0)
        elif r["workload"] == "W2":
            ratio = _ratio(r["requests_per_s"], fl["w2_requests_per_s"])
            v.update(figure=f"{r['pairs_per_s']:,.0f} pairs/s = {r['requests_per_s']:,.0f} req/s",
                     ratio=ratio, goal=">= 0.40x echo req/s",
                     ok=None if math.isnan(ratio) else ratio >= 0.40)
        elif r["workload"] == "W3":
            bound = fl["w3_bound_per_s"]
            hold_meas = r["hold_measured_us"]["mean"] / 1e6 if r.get("hold_measured_us", {}).get("n") else hold_s
            bound_meas = 1.0 / (hold_meas + fl["rtt_p50_us"] / 1e6)
            ratio = _ratio(r["handoffs_per_s"], bound)
            ratio_meas = _ratio(r["handoffs_per_s"], bound_meas)
            v.update(figure=(f"{r['handoffs_per_s']:,.0f} hand-offs/s, {r['owner_changes_per_s']:,.0f} owner "
                             f"changes/s, jain {r['jain']:.3f}"),
                     ratio_handoff_floor=_ratio(r["handoffs_per_s"],
                                                1.0 / (hold_meas + fl["cold_rtt_us"] / 1e6)),
                     ratio=ratio, ratio_measured_hold=ratio_meas, bound_per_s=bound,
                     bound_measured_hold_per_s=bound_meas,
                     goal=">= 0.90x 1/(hold+rtt), jain >= 0.99",
                     ok=None if math.isnan(ratio_meas) else (ratio_meas >= 0.90 and r["jain"] >= 0.99))
        verdicts.append(v)
    return verdicts


def format_report(rows: list[dict], hold_s: float) -> str:
    fl = floor_figures(rows, hold_s)
    L = []
    L.append("W1  one client, sequential acquire+release (latency of the pair, hold excluded)")
    L.append(f"  {'target':<26} {'p50':>8} {'p90':>8} {'p99':>8} {'max':>8} {'acq p50':>8} {'rel p50':>8}"
             f" {'x floor':>8} {'cpu cl/srv %':>13}")
    for r in rows:
        if r.get("workload") == "W1" and "pair_us" in r:
            p = r["pair_us"]
            L.append(f"  {r['target']:<26} {p['p50']:>8.0f} {p['p90']:>8.0f} {p['p99']:>8.0f} {p['max']:>8.0f} "
                     f"{r['acquire_us']['p50']:>8.0f} {r['release_us']['p50']:>8.0f} "
                     f"{_ratio(p['p50'], fl['pair_p50_us']):>8.2f} "
                     f"{r['client_cpu_pct']:>6.0f}/{r['server_cpu_pct']:<6.0f}")
    L.append("  (us; echo 'acquire'/'release' are one round trip each: echo round trip p50 = "
             f"{fl['rtt_p50_us']:.0f} us)")
    L.append("")
    L.append("W2  N clients on distinct locks (a pair = 2 requests)")
    L.append(f"  {'target':<26} {'clients':>7} {'pairs/s':>10} {'req/s':>10} {'pair p50':>9} {'pair p99':>9}"
             f" {'x floor':>8} {'cpu cl/srv %':>13}")
    for r in rows:
        if r.get("workload") == "W2" and "pair_us" in r:
            L.append(f"  {r['target']:<26} {r['clients']:>7} {r['pairs_per_s']:>10,.0f} {r['requests_per_s']:>10,.0f} "
                     f"{r['pair_us']['p50']:>9.0f} {r['pair_us']['p99']:>9.0f} "
                     f"{_ratio(r['requests_per_s'], fl['w2_requests_per_s']):>8.2f} "
                     f"{r['client_cpu_pct']:>6.0f}/{r['server_cpu_pct']:<6.0f}")
    L.append("")
    L.append(f"W3  N clients on ONE lock, hold {hold_s * 1e3:g} ms; bound 1/(hold + echo rtt) = "
             f"{fl['w3_bound_per_s']:,.0f}/s; cold round trip (echo, 1 client: hold, then 1 round trip) = "
             f"{fl['cold_rtt_us']:,.0f} us")
    L.append(f"  {'target':<26} {'handoff/s':>9} {'chg/s':>7} {'tta p50':>8} {'tta p99':>8} {'jain':>6} "
             f"{'hold ms':>7} {'x bound':>7} {'x bnd(meas)':>11} {'x floor':>7} {'wasted/acq':>10} "
             f"{'cpu cl/srv %':>13}")
    for r in rows:
        if r.get("workload") == "W3" and "pair_us" in r and not r.get("is_floor"):
            hm = r["hold_measured_us"]["mean"] / 1e3
            bound_meas = 1.0 / (hm / 1e3 + fl["rtt_p50_us"] / 1e6)
            L.append(f"  {r['target']:<26} {r['handoffs_per_s']:>9,.0f} {r['owner_changes_per_s']:>7,.0f} "
                     f"{r['time_to_acquire_us']['p50']:>8.0f} {r['time_to_acquire_us']['p99']:>8.0f} "
                     f"{r['jain']:>6.3f} {hm:>7.2f} {_ratio(r['handoffs_per_s'], fl['w3_bound_per_s']):>7.2f} "
                     f"{_ratio(r['handoffs_per_s'], bound_meas):>11.2f} "
                     f"{_ratio(r['handoffs_per_s'], 1e6 / (hm * 1e3 + fl['cold_rtt_us'])):>7.2f} "
                     f"{(r.get('wasted_round_trips_per_acquire') or 0):>10.2f} "
                     f"{r['client_cpu_pct']:>6.0f}/{r['server_cpu_pct']:<6.0f}")
    L.append("  (tta = time to acquire, us; chg/s = owner changes/s; x bnd(meas) uses the measured hold; "
             "x floor = ratio to 1/(measured hold + cold round trip), "
             "the floor when processes go idle between hand-offs)")
    busy = [r for r in rows if r.get("other_cpu_pct", 0) > 20]
    if busy:
        L.append("")
        L.append("Noise: other processes used > 20 % of a core during " +
                 ", ".join(f"{r['target']} {r['workload']} ({r['other_cpu_pct']:.0f} %)" for r in busy))
    errs = [r for r in rows if r.get("error_count")]
    if errs:
        L.append("")
        L.append("Errors:")
        for r in errs:
            L.append(f"  {r.get('target')} {r.get('workload')}: {r.get('errors')[:3]}")
    verdicts = compare(rows, hold_s)
    if verdicts:
        L.append("")
        L.append("Targets (issue 2)")
        for v in verdicts:
            extra = ""
            if v["workload"] == "W3":
                extra = (f" (x{v['ratio_measured_hold']:.2f} with the measured hold; x{v['ratio_handoff_floor']:.2f}"
                         " of 1/(measured hold + cold round trip))")
            L.append(f"  {_mark(v['ok']):<4} {v['target']:<26} {v['workload']} {v['figure']}: "
                     f"x{v['ratio']:.2f}{extra}; target {v['goal']}")
    return "\n".join(L)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.load", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_args(ap)
    ap.add_argument("--fsync", default="never,always",
                    help="comma list of fastlock --fsync modes to run (default never,always)")
    ap.add_argument("--shared-connection", action="store_true",
                    help="all fastlock clients share one pipelined connection (default: one each)")
    ap.add_argument("--no-floor", dest="floor", action="store_false", help="skip the echo floor")
    ap.add_argument("--no-fastlock", dest="fastlock", action="store_false", help="run the echo floor only")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run (`make bench`): 1 s per workload after 0.5 s warmup, --fsync never only")
    args = ap.parse_args(argv)
    if args.quick:
        args.duration, args.warmup, args.fsync = 1.0, 0.5, "never"
    wls = harness.workloads_from_args(args)
    rows: list[dict] = []
    busy = harness.wait_for_quiet(args.quiet_wait, log=lambda s: print(s, flush=True))
    print(f"benches.load: {', '.join(w.name for w in wls)}; {args.duration:g} s each after {args.warmup:g} s "
          f"warmup; uvloop={args.uvloop}; machine busy before start: {busy:.0f}% of a core", flush=True)
    if args.floor:
        rows += harness.run_target(EchoTarget(use_uvloop=args.uvloop), wls,
                                   use_uvloop=args.uvloop, log=lambda s: print(s, flush=True))
    if args.fastlock:
        why = fastlock_available()
        if why:
            print(f"fastlock skipped: {why}", flush=True)
        else:
            for mode in [m.strip() for m in args.fsync.split(",") if m.strip()]:
                t = FastlockTarget(fsync=mode, shared_connection=args.shared_connection)
                rows += harness.run_target(t, wls, use_uvloop=args.uvloop, log=lambda s: print(s, flush=True))
    hold_s = args.hold / 1e3
    print()
    print(format_report(rows, hold_s))
    if args.json:
        harness.write_json(args.json, {"machine": harness.machine_info(), "busy_before_pct": busy,
                                       "args": vars(args), "rows": rows,
                                       "floor": floor_figures(rows, hold_s), "verdicts": compare(rows, hold_s)})
        print(f"\nwrote {args.json}")
    return 1 if any(r.get("workload") == "start" for r in rows) else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # servers were stopped by the finally blocks on the way out
        print("interrupted", file=sys.stderr)
        sys.exit(130)
