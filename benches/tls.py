"""What TLS costs: W1 and W2 over TLS against plain TCP, in one run, alternating rounds.

    python -m benches.tls [--rounds 5] [--duration 3] [--warmup 1] [--concurrency 32]
                          [--fsync never] [--mtls] [--uvloop | --no-uvloop] [--json PATH]

Starts two ``fastlock serve`` subprocesses with the same flags, one plain and
one with ``--tls-cert/--tls-key`` (certificates made for the run with trustme,
an ECDSA P-256 key as trustme issues; ``--mtls`` adds ``--tls-client-auth
required`` and a client certificate).  Each round runs W1 (one client,
acquire+release in sequence: pair latency) and W2 (``--concurrency`` clients,
each on its own lock: pairs/s) on both servers, the order of the two servers
swapped every round so that drift of a shared machine hits both alike.  The
report gives the median over rounds of each figure and the TLS/plain ratio,
and the cost of opening a connection (TCP connect + TLS handshake + HELLO,
``--connects`` times, one after another).

``--fsync never`` (the default here) keeps the disk out of the comparison;
W1 with ``--fsync always`` adds the same fsync to both sides.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benches import harness
from benches.load import FastlockSession, FastlockTarget


class TLSFastlockTarget(FastlockTarget):
    """A fastlock server with TLS, and clients that connect over TLS."""

    def __init__(self, certs: dict[str, str], *, mtls: bool, fsync: str) -> None:
        args = ["--tls-cert", certs["server_cert"], "--tls-key", certs["server_key"]]
        if mtls:
            args += ["--tls-ca", certs["ca"], "--tls-client-auth", "required"]
        super().__init__(fsync=fsync, extra_args=tuple(args))
        self.client_tls = {"tls_ca": certs["ca"]}
        if mtls:
            self.client_tls.update(tls_cert=certs["client_cert"], tls_key=certs["client_key"])
        self.name = f"fastlock fsync={fsync} {'mTLS' if mtls else 'TLS'}"

    async def open(self, idx: int) -> harness.Session:
        import fastlock
        client = await fastlock.connect(f"127.0.0.1:{self.port}", client_name=f"bench-{idx}", **self.client_tls)
        return FastlockSession(client, owned=True)


def make_certs(directory: str) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""
    try:
        import trustme
    except ImportError:
        sys.exit("benches.tls needs trustme (pip install '.[test]')")
    d = Path(directory)
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", common_name="bench-server")
    client = ca.issue_cert("bench-client", common_name="bench-client")
    paths = {k: str(d / f"{k}.pem") for k in ("ca", "server_cert", "server_key", "client_cert", "client_key")}
    ca.cert_pem.write_to_path(paths["ca"])
    server.cert_chain_pems[0].write_to_path(paths["server_cert"])
    server.private_key_pem.write_to_path(paths["server_key"])
    client.cert_chain_pems[0].write_to_path(paths["client_cert"])
    client.private_key_pem.write_to_path(paths["client_key"])
    return paths


async def connect_cost(port: int, tls: dict[str, Any], n: int) -> dict[str, float]:
    """Open and close ``n`` connections in sequence (connect + handshake + HELLO); µs percentiles."""
    import fastlock
    samples = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        client = await fastlock.connect(f"127.0.0.1:{port}", client_name="bench-connect", **tls)
        samples.append(time.perf_counter_ns() - t0)
        await client.close()
    return harness.latency_stats(samples)


def _median(rows: list[dict], key) -> float:
    values = [key(r) for r in rows if "pair_us" in r]
    return statistics.median(values) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.tls", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_args(ap)
    ap.set_defaults(workloads="W1,W2")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    ap.add_argument("--fsync", default="never", choices=("never", "interval", "always"),
                    help="both servers' --fsync (default never: leave the disk out)")
    ap.add_argument("--mtls", action="store_true", help="mutual TLS: the server requires client certificates")
    ap.add_argument("--connects", type=int, default=200, help="connections opened to measure the set-up cost")
    args = ap.parse_args(argv)
    wls = [w for w in harness.workloads_from_args(args) if w.name in ("W1", "W2")]
    busy = harness.wait_for_quiet(args.quiet_wait, log=lambda s: print(s, flush=True))
    print(f"benches.tls: {', '.join(w.name for w in wls)} x {args.rounds} alternating rounds, "
          f"{args.duration:g} s each after {args.warmup:g} s warmup; fsync={args.fsync}; uvloop={args.uvloop}; "
          f"machine busy before start: {busy:.0f}% of a core", flush=True)
    rows: dict[str, list[dict]] = {"plain": [], "tls": []}
    connects: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="fastlock-tls-bench-") as d:
        certs = make_certs(d)
        targets = {"plain": FastlockTarget(fsync=args.fsync),
                   "tls": TLSFastlockTarget(certs, mtls=args.mtls, fsync=args.fsync)}
        try:
            for t in targets.values():
                t.start()
            for rnd in range(args.rounds):
                order = ["plain", "tls"] if rnd % 2 == 0 else ["tls", "plain"]
                for key in order:
                    for wl in wls:
                        row = harness.run_workload(targets[key], wl, use_uvloop=args.uvloop)
                        row["round"] = rnd
                        rows[key].append(row)
                        print(f"  round {rnd + 1} {targets[key].name:<28} {wl.name}: {harness.one_line(row)}",
                              flush=True)
            # one client context for all the connections, as an application would keep it
            from fastlock.tls import client_context
            tls_ctx = client_context(certs["ca"], *(
                (certs["client_cert"], certs["client_key"]) if args.mtls else ()))
            for key, tls in (("plain", {}), ("tls", {"tls": tls_ctx})):
                connects[key] = harness.run_async(connect_cost(targets[key].port, tls, args.connects),
                                                  use_uvloop=args.uvloop)
        finally:
            for t in targets.values():
                t.stop()
    summary = {}
    for wl in wls:
        for key in ("plain", "tls"):
            mine = [r for r in rows[key] if r.get("workload") == wl.name]
            summary[(wl.name, key)] = {
                "pair_p50_us": _median(mine, lambda r: r["pair_us"]["p50"]),
                "pair_p99_us": _median(mine, lambda r: r["pair_us"]["p99"]),
                "pairs_per_s": _median(mine, lambda r: r["pairs_per_s"]),
                "server_cpu_pct": _median(mine, lambda r: r["server_cpu_pct"]),
                "client_cpu_pct": _median(mine, lambda r: r["client_cpu_pct"]),
                # CPU time per pair is steadier than pairs/s on a shared machine
                "server_cpu_us_per_pair": _median(mine, lambda r: r["server_cpu_pct"] * 1e4 / r["pairs_per_s"]),
                "client_cpu_us_per_pair": _median(mine, lambda r: r["client_cpu_pct"] * 1e4 / r["pairs_per_s"]),
                "errors": sum(r.get("error_count", 0) for r in mine),
            }
    tls_name = "mTLS" if args.mtls else "TLS"
    print()
    print(f"median of {args.rounds} rounds        plain TCP      {tls_name:<8}  {tls_name}/plain")
    for wl in wls:
        p, t = summary[(wl.name, "plain")], summary[(wl.name, "tls")]
        if wl.name == "W1":
            print(f"W1 pair p50 (us)          {p['pair_p50_us']:>10.0f}  {t['pair_p50_us']:>10.0f}  "
                  f"{t['pair_p50_us'] / p['pair_p50_us']:>8.2f}")
            print(f"W1 pair p99 (us)          {p['pair_p99_us']:>10.0f}  {t['pair_p99_us']:>10.0f}  "
                  f"{t['pair_p99_us'] / p['pair_p99_us']:>8.2f}")
        else:
            print(f"{wl.name} pairs/s ({wl.clients} clients) {p['pairs_per_s']:>10,.0f}  {t['pairs_per_s']:>10,.0f}  "
                  f"{t['pairs_per_s'] / p['pairs_per_s']:>8.2f}")
        for side in ("server", "client"):
            k = f"{side}_cpu_us_per_pair"
            print(f"{wl.name} {side} CPU us/pair      {p[k]:>10.1f}  {t[k]:>10.1f}  {t[k] / p[k]:>8.2f}")
        if p["errors"] or t["errors"]:
            print(f"  errors: plain {p['errors']}, {tls_name} {t['errors']}")
    if connects:
        p, t = connects["plain"], connects["tls"]
        print(f"connect+HELLO p50 (us)    {p['p50']:>10.0f}  {t['p50']:>10.0f}  {t['p50'] / p['p50']:>8.2f}")
    if args.json:
        harness.write_json(args.json, {"machine": harness.machine_info(), "busy_before_pct": busy,
                                       "args": vars(args), "rows": rows, "connects": connects,
                                       "summary": {f"{w} {k}": v for (w, k), v in summary.items()}})
        print(f"\nwrote {args.json}")
    return 1 if any(s["errors"] for s in summary.values()) else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
