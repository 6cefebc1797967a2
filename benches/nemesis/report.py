"""The nemesis's report: the checks and figures of a finished run (see :mod:`benches.nemesis`)."""

from __future__ import annotations

import bisect
import dataclasses
import json
import re
import sqlite3
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from fastlock.tokens import epoch_of

if TYPE_CHECKING:  # pragma: no cover
    from benches.nemesis.cluster import Nemesis

#: fault kinds after which no node is expected to promote (group "etcd"; "move": benches.shard_nemesis)
NO_FAILOVER_KINDS = ("kill-standby", "etcd-restart", "move")

#: a server log line (text format) saying the node stopped granting as a primary: it fenced
#: itself (or its arbiter fenced it), or it left the primary role (fastlock/roles.py's lines)
_STOPPED_GRANTING = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ \S+: "
                               r"role: (?:primary fenced$|primary -> )")


def fence_times(log_text: str, wall_minus_monotonic: float) -> list[float]:
    """The moments (``time.monotonic()`` of this host, sorted) at which a server's log says
    it stopped granting as a primary; ``wall_minus_monotonic``: ``time.time() -
    time.monotonic()`` here (the log's local wall-clock time, to the millisecond)."""
    import datetime

    out = []
    for line in log_text.splitlines():
        m = _STOPPED_GRANTING.match(line)
        if m:
            wall = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append(wall - wall_minus_monotonic)
    return sorted(out)


def set_fence_times(faults: list, fences: dict[str, list[float]]) -> None:
    """Fill each fault's ``fenced_s``: 0 for a kill of the primary (a dead node grants
    nothing), else the first moment at or after the fault, and before the next fault, at
    which its old primary's log (``fences``: node name -> :func:`fence_times`) says it
    stopped granting; None if it did not (it kept serving: nothing it granted is exempt)."""
    for n, f in enumerate(faults):
        if f.kind == "kill":
            f.fenced_s = 0.0
            continue
        until = faults[n + 1].at if n + 1 < len(faults) else float("inf")
        times = fences.get(f.old_primary, [])
        i = bisect.bisect_left(times, f.at)
        f.fenced_s = times[i] - f.at if i < len(times) and times[i] < until else None


def granted_before_fence(grant: dict, faults: list) -> bool:
    """Is ``grant`` (a worker's "grant" event: ``token``, ``sent``, ``at``) one a fault's old
    primary made between the fault and its own fence - the only lost leases the verdict
    exempts?  It reached its client at or after the fault began, its acquire was sent
    before the old primary's fence (``fenced_s``), and its token is of an epoch below the
    promoted node's (any epoch when nothing promoted).  With asynchronous replication such
    a grant may never have reached the standby; the promoted node's grace period, not the
    lease, protects the lock."""
    for f in faults:
        if f.fenced_s is None or grant["at"] < f.at or grant["sent"] > f.at + f.fenced_s:
            continue
        if not struck(f, grant):
            continue
        if f.new_epoch is None or (grant["token"] >> 40) < f.new_epoch:
            return True
    return False

def struck(fault, grant: dict) -> bool:
    """Could ``fault`` have touched ``grant``?  Yes unless the fault struck one shard group
    (``fault.group``) and the grant names another (a sharded run's grants carry ``group``)."""
    return not fault.group or not grant.get("group") or grant["group"] == fault.group


class LateGrants(NamedTuple):
    """Grants of an older epoch that reached their client after a promotion, as samples."""

    unknown: list[dict]  #: not shown known to the new primary: DESIGN invariant 10's breach
    known: list[dict]  #: released cleanly at the end: the new primary knew the lease


def old_epoch_grants_after_promotion(grants: list[dict], faults: list, released_ok: set[str]) -> LateGrants:
    """Grants (workers' "grant" events: ``token``, ``sent``, ``at``, ``holding``, ``lock``; times
    in seconds of this host's monotonic clock) whose acquire was sent before a fault's promotion
    (``at + promoted_s``), that reached the client after it, and whose token's epoch is below the
    promoted node's.

    Such a grant was decided by the old primary (before it froze or lost etcd), or it is a lease
    the new primary knew (replicated) handed back with its old token: the old primary refuses to
    acknowledge a grant once fenced, the client repeats the acquire with the same owner key at
    the new primary, which returns the replicated lease.  Only a node holding that token accepts
    its release, so a holding in ``released_ok`` (it ended without a LeaseLost and its release
    did not fail) was known to the new primary: counted in ``known``.  The rest are ``unknown``.
    The promotion moment is when the bench saw the new primary (a status poll), a little after
    the node's own PROMOTED line, so a handed-back lease may land on either side of it: that is
    why the release, not the time, tells the two apart.
    """
    unknown, known = [], []
    for g in grants:
        for f in faults:
            if (f.new_epoch is not None and f.promoted_s is not None and g["at"] > f.at + f.promoted_s
                    and g["sent"] < f.at + f.promoted_s and epoch_of(g["token"]) < f.new_epoch and struck(f, g)):
                (known if g["holding"] in released_ok else unknown).append(
                    {"holding": g["holding"], "lock": g["lock"], "token_epoch": epoch_of(g["token"]),
                     "new_epoch": f.new_epoch, "fault": f.index, "kind": f.kind,
                     "after_promotion_s": round(g["at"] - f.at - f.promoted_s, 3)})
    return LateGrants(unknown, known)


def _longest_gap(times: list[float], start: float, end: float, clip: bool = False) -> float | None:
    """The longest interval from ``start`` without any of ``times`` (sorted):
    up to the first time after ``end``, or with ``clip`` up to ``end`` at most;
    None if no time follows ``start``."""
    i = bisect.bisect_right(times, start)
    if i >= len(times):
        return None
    gap, prev = 0.0, start
    while i < len(times):
        gap = max(gap, (min(times[i], end) if clip else times[i]) - prev)
        if times[i] > end:
            break
        prev = times[i]
        i += 1
    return gap


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}s"


# =========================================================================== the report


def _read_events(root: Path, workers: int) -> list[dict]:
    """The event logs of ``workers`` worker processes (W3 workers, the prober, W2 workers)."""
    events = []
    for i in range(workers):
        path = root / f"worker-{i}.jsonl"
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            try:
                ev = json.loads(line)
            except ValueError:  # a line cut by SIGKILL
                continue
            ev["worker"] = i
            events.append(ev)
    return events


_NUMBERS = re.compile(r"\d+(\.\d+)?")


def _normalise(msg: str) -> str:
    return _NUMBERS.sub("N", msg or "")[:200]


def build_report(nem: Nemesis, elapsed: float) -> dict:
    from fastlock._testbase import GrantRecord, Holding, StoreWrite, check_grants, check_holdings, check_store

    cfg = nem.cfg
    processes = cfg.workers + 1 + cfg.pair_workers
    events = _read_events(nem.root, processes)
    grants = [e for e in events if e["ev"] == "grant"]
    conn = sqlite3.connect(nem.store, timeout=10)
    try:
        rows = conn.execute("SELECT seq, lock, token, holding, at FROM writes").fetchall()
    finally:
        conn.close()
    store_violations = check_store(StoreWrite(*r) for r in rows)
    # the prober's locks are all fresh: its grants are checked as one sequence (one per shard group: each
    # group has its own token counter)
    grant_violations = check_grants(GrantRecord(f"probe/*@{g.get('group', '')}" if g.get("probe") else g["lock"],
                                                g["token"], g["holding"], g["sent"], g["at"]) for g in grants)
    ends = {e["holding"]: e["at"] for e in events if e["ev"] == "end"}
    holdings = [Holding(g["lock"], g["token"], g["holding"], g["at"], ends[g["holding"]])
                for g in grants if g["holding"] in ends]
    holder_overlaps = check_holdings(holdings)

    lost_during = [e for e in events if e["ev"] == "end" and e["reason"] == "lost"]
    release_failed = [e for e in events if e["ev"] == "release_failed"]
    stale = [e for e in events if e["ev"] == "write" and not e["ok"]]
    errors = [e for e in events if e["ev"] == "error"]
    loop_errors = [e for e in events if e["ev"] == "loop_error"]
    not_acquired = [e for e in events if e["ev"] == "not_acquired"]

    def by_type(evs: list[dict]) -> dict:
        out: dict[str, dict] = {}
        for e in evs:
            key = f"{e.get('op', '-')}:{e.get('type') or 'LockNotAcquired'}"
            slot = out.setdefault(key, {"count": 0, "messages": Counter()})
            slot["count"] += 1
            slot["messages"][_normalise(e.get("msg") or "")] += 1
        return {k: {"count": v["count"], "messages": v["messages"].most_common(4)} for k, v in sorted(out.items())}

    wall_minus_monotonic = time.time() - time.monotonic()
    set_fence_times(nem.faults, {name: fence_times(path.read_text(errors="replace"), wall_minus_monotonic)
                                 for name in nem.nodes if (path := nem.root / f"{name}.log").exists()})
    grant_times = sorted(g["at"] for g in grants)
    group_grant_times: dict[str, list[float]] = {}
    for g in grants:
        if g.get("group"):
            group_grant_times.setdefault(g["group"], []).append(g["at"])
    for times in group_grant_times.values():
        times.sort()
    windows = []  # (start, end, fault) of every fault, until healthy (or the next fault)
    for n, f in enumerate(nem.faults):
        end = f.at + (f.healthy_s if f.healthy_s is not None else cfg.heal_timeout)
        if n + 1 < len(nem.faults):
            end = min(end, nem.faults[n + 1].at)
        windows.append((f.at, end, f))
    fault_rows = []
    for start, end, f in windows:
        times = group_grant_times.get(f.group, grant_times)  # a shard group's fault: that group's grants
        i = bisect.bisect_right(times, start)
        f.first_grant_s = times[i] - start if i < len(times) else None
        f.no_grant_s = _longest_gap(times, start, end)
        fault_rows.append(dataclasses.asdict(f))
    steady_gap = 0.0  # the longest window without grants outside every fault window: the baseline
    prev = grant_times[0] if grant_times else nem.stopped_at
    for start, end, _ in windows + [(nem.stopped_at, nem.stopped_at, None)]:
        if start > prev:
            steady_gap = max(steady_gap, _longest_gap(grant_times, prev, start, clip=True) or 0.0)
        prev = max(prev, end)
    bound = cfg.failover_s + cfg.promotion_grace + 1.0
    kills = [f for f in nem.faults if f.kind == "kill"]
    kill_windows = [f.no_grant_s for f in kills]
    over_bound = [f.index for f in kills if f.no_grant_s is None or f.no_grant_s > bound]

    def phase_of(t: float) -> str:
        for start, end, f in windows:
            if start <= t <= end:
                return f.kind
        return "steady"

    grant_of = {g["holding"]: g for g in grants}

    def granted_mid_fault(e: dict) -> bool:
        """Was this holding granted by a fault's old primary between the fault and its own fence?"""
        g = grant_of.get(e.get("holding"))
        return g is not None and granted_before_fence(g, nem.faults)

    released_ok = ({e["holding"] for e in events if e["ev"] == "end" and e["reason"] != "lost"}
                   - {e["holding"] for e in release_failed})
    late_grants, known_late_grants = old_epoch_grants_after_promotion(grants, nem.faults, released_ok)
    lost_mid = [e for e in lost_during if granted_mid_fault(e)]
    failed_mid = [e for e in release_failed if granted_mid_fault(e)]
    errors_by_fault = {}
    for e in errors + loop_errors:
        slot = errors_by_fault.setdefault(phase_of(e["at"]), Counter())
        slot[f"{e.get('op', 'loop')}:{e.get('type')}"] += 1
    for e in lost_during + release_failed:
        slot = errors_by_fault.setdefault(phase_of(e["at"]), Counter())
        slot["lease lost" if e["ev"] == "end" else "release failed"] += 1
    # an acquire that failed after its whole wait ran out is a wait that ran out, whatever the error
    ran_out = [e for e in errors if e["op"] in ("acquire", "probe-acquire", "pair-acquire")
               and e["at"] - e["sent"] >= cfg.wait - 0.1]
    # a release refused as LeaseLost for a grant the new primary never knew (made mid-fault, never replicated)
    unreplicated = [e for e in errors if e["op"] in ("release", "probe-release", "pair-release")
                    and e["type"] == "LeaseLost" and granted_mid_fault(e)]
    # a LockNotAcquired before the wait ran out is an error surfaced early, not a wait that ran out
    # (0.1 s of slack: the server's wait timer works in whole milliseconds of its own clock)
    early_refusals = [e for e in not_acquired if e["at"] - e["sent"] < cfg.wait - 0.1]
    not_acquired = [e for e in not_acquired if e not in early_refusals]
    counted = [e for e in errors if e not in ran_out and e not in unreplicated]
    counted += [dict(e, type="LockNotAcquired") for e in early_refusals]
    connection_lost = [e for e in counted if e["type"] == "ConnectionLost"]
    counter_msgs = Counter()
    for i in range(processes):
        path = nem.root / f"worker-{i}.log"
        if path.exists():
            for line in path.read_text(errors="replace").splitlines():
                if " WARNING " in line or " ERROR " in line:
                    counter_msgs[_normalise(line.split(" ", 4)[-1])] += 1

    report = {
        "config": dataclasses.asdict(nem.cfg),
        "elapsed_s": round(elapsed, 1),
        "aborted": nem.aborted,
        "faults": len(nem.faults),
        "faults_by_kind": dict(Counter(f.kind + (f"/{f.mode}" if f.mode else "") for f in nem.faults)),
        "faults_without_promotion": [f.index for f in nem.faults
                                     if f.promoted_s is None and f.kind not in NO_FAILOVER_KINDS],
        "grants": len(grants),
        "grants_by_worker": dict(sorted(Counter("probe" if g.get("probe") else f"w{g['worker']}"
                                                for g in grants).items())),
        "store_rows": len(rows),
        "safety": {
            "violations": len(store_violations) + len(grant_violations),
            "store": store_violations[:20],
            "grants": grant_violations[:20],
        },
        "availability": {
            "ttl_s": cfg.ttl,
            "ttl_exceeds_failover_plus_request_timeout": cfg.ttl > cfg.failover_s + cfg.request_timeout,
            "leases_lost": len(lost_during) - len(lost_mid),
            "releases_failed_at_exit": len(release_failed) - len(failed_mid),
            "leases_lost_granted_mid_fault": len(lost_mid),
            "releases_failed_granted_mid_fault": len(failed_mid),
            "held_after_workers_stopped": nem.leftover,
            "stale_writes_refused": len(stale),
            "connection_lost_surfaced": len(connection_lost),
            "errors_surfaced": len(counted),
            "errors_by_op_and_type": by_type(counted),
            "waits_ran_out": len(not_acquired) + len(ran_out),
            "waits_ran_out_by_type": by_type(not_acquired + ran_out),
            "releases_refused_unreplicated_grant": len(unreplicated),
            "old_epoch_grants_after_promotion": len(late_grants),
            "old_epoch_grant_samples": late_grants[:20],
            "old_epoch_grants_known_to_new_primary": len(known_late_grants),
            "old_epoch_grant_known_samples": known_late_grants[:20],
            "errors_by_fault_kind": {k: dict(v) for k, v in sorted(errors_by_fault.items())},
            "loop_errors": len(loop_errors),
            "loop_error_messages": Counter(_normalise(e["msg"]) for e in loop_errors).most_common(4),
            "holders_overlapping_client_view": len(holder_overlaps),
            "holder_overlap_samples": holder_overlaps[:5],
            "outage_bound_s": bound,
            "kill_no_grant_s": [None if w is None else round(w, 3) for w in kill_windows],
            "kill_no_grant_max_s": max((w for w in kill_windows if w is not None), default=None),
            "kills_over_bound": over_bound,
            "no_grant_max_s_by_kind": {k: round(max(f.no_grant_s or 0.0 for f in nem.faults if f.kind == k), 3)
                                       for k in sorted({f.kind for f in nem.faults})},
            "steady_no_grant_max_s": round(steady_gap, 3),
        },
        "client_log_warnings": counter_msgs.most_common(8),
        "fault_log": fault_rows,
    }
    return report


def print_report(r: dict) -> None:
    a, s = r["availability"], r["safety"]
    cfg = r["config"]
    failover = (f"group etcd, coordinator_ttl {cfg['coordinator_ttl']} s" if cfg.get("group") == "etcd"
                else f"failover_after {cfg['failover_after']} s")
    print(f"\nnemesis: {r['faults']} faults in {r['elapsed_s']} s (seed {cfg['seed']}, {failover}, "
          f"promotion_grace {cfg['promotion_grace']} s, ttl {cfg['ttl']} s, "
          f"wait {cfg['wait']} s, request_timeout {cfg['request_timeout']} s, {cfg['workers']} workers)")
    if r["aborted"]:
        print(f"  ABORTED: {r['aborted']}")
    print("  faults by kind:      " + ", ".join(f"{k} {v}" for k, v in sorted(r["faults_by_kind"].items())))
    if r["faults_without_promotion"]:
        print(f"  no promotion after faults {r['faults_without_promotion']}")
    print(f"  grants:              {r['grants']} ("
          + ", ".join(f"{k} {v}" for k, v in r["grants_by_worker"].items()) + f"); store rows {r['store_rows']}")
    print(f"  SAFETY violations:   {s['violations']}")
    for v in s["store"] + s["grants"]:
        print(f"    - {v}")
    print(f"  leases lost by lock() holders (ttl > F + request_timeout: "
          f"{a['ttl_exceeds_failover_plus_request_timeout']}): {a['leases_lost']}; releases failed at lock() exit "
          f"(lease.lost set by the exit): {a['releases_failed_at_exit']}")
    print(f"    not counted above - granted by the old primary between the fault and its own fence (its log; "
          f"maybe never replicated): {a['leases_lost_granted_mid_fault']} lost, "
          f"{a['releases_failed_granted_mid_fault']} failed releases")
    print(f"  locks still held on the primary after every worker stopped (orphans): {a['held_after_workers_stopped']}")
    print(f"  stale writes refused by the fence: {a['stale_writes_refused']}")
    print(f"  errors surfaced to worker code: {a['errors_surfaced']} (ConnectionLost {a['connection_lost_surfaced']}); "
          f"loop errors: {a['loop_errors']}")
    for key, v in a["errors_by_op_and_type"].items():
        print(f"    {key}: {v['count']}")
        for msg, n in v["messages"]:
            print(f"        {n:4d} x {msg}")
    print(f"  acquires whose {cfg['wait']:g} s wait ran out: {a['waits_ran_out']}")
    for key, v in a["waits_ran_out_by_type"].items():
        print(f"    {key}: {v['count']}")
        for msg, n in v["messages"][:2]:
            print(f"        {n:4d} x {msg}")
    late = a["old_epoch_grant_samples"]
    print(f"  grants of an older epoch delivered after the standby promoted: {a['old_epoch_grants_after_promotion']}"
          + "".join(f"\n    - fault {g['fault']} ({g['kind']}): {g['holding']} {g['lock']!r} epoch {g['token_epoch']} "
                    f"< {g['new_epoch']}, {g['after_promotion_s']} s after the promotion" for g in late[:5]))
    if a.get("old_epoch_grants_known_to_new_primary"):
        print(f"    not counted above - replicated leases the new primary handed to the client that had asked the "
              f"old one (released cleanly at their end): {a['old_epoch_grants_known_to_new_primary']}")
    if a["releases_refused_unreplicated_grant"]:
        print(f"  releases refused (LeaseLost) for grants made mid-fault, never replicated: "
              f"{a['releases_refused_unreplicated_grant']}")
    for msg, n in a["loop_error_messages"]:
        print(f"    loop: {n} x {msg}")
    print("  errors and lost leases by fault window: " + "; ".join(
        f"{k}: " + ", ".join(f"{t} {n}" for t, n in sorted(v.items())) for k, v in a["errors_by_fault_kind"].items()))
    print(f"  holders overlapping (client view): {a['holders_overlapping_client_view']}")
    for v in a["holder_overlap_samples"][:3]:
        print(f"    - {v}")
    print(f"  longest window without a grant after each kill "
          f"(bound failover + grace + 1 s = {a['outage_bound_s']:.1f} s): "
          + ", ".join("-" if w is None else f"{w:.2f}" for w in a["kill_no_grant_s"])
          + (f"; over the bound: faults {a['kills_over_bound']}" if a["kills_over_bound"] else ""))
    print("  longest window without a grant, by fault kind: "
          + ", ".join(f"{k} {v:.2f}" for k, v in a["no_grant_max_s_by_kind"].items())
          + f"; outside faults (baseline): {a['steady_no_grant_max_s']:.2f}")
    print("  fault log (s after the fault: promoted / old primary fenced / ended / re-paired / healthy / first grant "
          "/ longest no-grant):")
    for f in r["fault_log"]:
        kind = f["kind"] + (f"/{f['mode']}" if f["mode"] else "")
        print(f"    {f['index']:3d} {kind:20s} {f['old_primary']}->{f['new_primary']}  {_s(f['promoted_s']):>7} "
              f"{_s(f.get('fenced_s')):>7} {_s(f['ended_s']):>7} {_s(f['repaired_s']):>7} {_s(f['healthy_s']):>7} "
              f"{_s(f['first_grant_s']):>7} {_s(f['no_grant_s']):>7}  {f['note']}")
    if r["client_log_warnings"]:
        print("  client log warnings (normalised):")
        for msg, n in r["client_log_warnings"]:
            print(f"    {n:5d} x {msg}")


