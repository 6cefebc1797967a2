"""Nemesis: a primary and a standby (or an etcd-arbitrated group of three) under a cycle of faults,
clients holding locks through it all.

    python -m benches.nemesis --duration S [--seed N] [--failover-after F] [--workers W]
        [--ttl 8] [--wait 20] [--request-timeout 5] [--promotion-grace 2] [--kinds kill,pause,...]
        [--json PATH] [--keep DIR]
    python -m benches.nemesis --group etcd [--coordinator-ttl 1] --duration S [the same options]
    python -m benches.nemesis --report DIR      # the report of a run kept with --keep DIR

What runs
---------
Two real ``fastlock serve`` processes on 127.0.0.1, nodes ``a`` and ``b``,
each on a fixed port with its own data dir, and in front of each a
:class:`fastlock._testbase.TcpProxy` that labels a standby's replication
connection.  ``a`` starts as the primary, ``b`` as ``--standby-of`` a's
PROXY with ``--failover-after F --promotion-grace G``, so the replication
link can be cut without touching the clients' own connections.

``--workers`` worker PROCESSES each open ``fastlock.connect(a, b)`` (both
node addresses, ``request_timeout`` as given) and loop: pick one of
``--locks`` lock names (default twice the workers; seeded RNG), ``async with client.lock(name, ttl=TTL,
wait=WAIT)``, and while holding, every 0.2 s, a fenced write to one SQLite
store (:class:`fastlock.fencing.SQLiteFence`: accepted only if the token is at
least the highest seen for that lock) of a row (lock, token, holding,
monotonic time read inside the transaction).  Holds are short (0.05-0.5 s)
or, one in seven, long (2.5-4 s: past the first renewal at TTL/3 minus
10-20 % jitter, so renewals meet faults).  Each
worker logs every grant, write, lost lease and error (type and message) as
JSON lines; the controller reads them after the run.

TTL: 8 s by default, longer than ``--failover-after`` (1 s) plus the client's
``request_timeout`` (5 s), the README's condition for ``lock()`` to keep a
lease across a failover: a renewal stuck on a dead or frozen primary is given
up after at most ``request_timeout`` (each renewal attempt after at most TTL/3)
and retried on the new primary, which keeps the lease until its replicated
deadline (its last renewal plus the TTL): a renewal sent at about TTL/3 whose
attempt hangs for TTL/3 still has about a third of the TTL for the retry.  WAIT:
20 s, longer than any outage the bound below allows, so an acquire that
fails (rather than waits) during a fault is a failure to ride through it.

The nemesis
-----------
A controller cycles through the fault kinds (``--kinds``, in a seeded
shuffled order per round), one fault at a time, each against the current
primary P with standby S:

``kill``       SIGKILL P.  S promotes itself after F.
``pause``      SIGSTOP P until S has promoted (past the failover window),
               plus a random 0-1 s, then SIGCONT: P resumes fenced.
``partition``  black-hole the replication link (or, one time in two, reset it
               and hold reconnections) until S has promoted, plus 0-1 s, then
               heal: P is alive, fenced, and reachable by clients throughout.
``promote``    ``fastlock promote --server S`` with P alive: P confirms it
               steps down (``deposed``).

A surviving old primary lingers a random 0-1.5 s (clients may still reach
it), then is re-paired the documented way (README, "Replication and
failover"): stopped (SIGTERM) and restarted on the SAME port with the same
data dir as ``--standby-of`` the new primary's proxy, where its
``deposed.json``/``node-state.json`` let it follow the higher epoch.  The
controller then waits, at most ``--heal-timeout`` s, for a healthy cluster:
one primary, unfenced and past its grace, with its standby attached, synced
and ``pair_confirmed``, and a grant to the prober (below) since the re-pair;
then lets the load run 0.5-1.5 s (seeded) before the next fault.  A cluster
that does not heal in time ends the run (reported).

The etcd group (``--group etcd``)
--------------------------------
One throwaway etcd member (``tests/etcdserver.py``: the ``etcd`` binary) and
three nodes ``a``, ``b``, ``c``, each ``fastlock serve --coordinator
etcd://PROXY/PREFIX --node-id NAME --coordinator-ttl T --promotion-grace G``
on a fixed port, where PROXY is that node's own :class:`TcpProxy` to etcd
(so one node can be cut off from etcd alone).  ``a`` starts first and takes
the key; the workers list all three addresses.  The same workers, prober,
checks and figures; the failover bound is T (the etcd lease) instead of F.
Fault kinds (``GROUP_KINDS``), each against the primary P etcd names:

``kill``          SIGKILL P, restart it after a random 0-1.5 s with the same
                  flags, as a supervisor would (it may come back before or
                  after another node took the key); wait for a node to be an
                  unfenced primary at a higher epoch.
``pause``         SIGSTOP P until another node is primary at a higher epoch,
                  plus 0-1 s, then SIGCONT: P steps down and follows by itself.
``partition``     black-hole P's link to etcd (or, one time in two, reset it
                  and hold reconnections) until another node is primary, plus
                  0-1 s, then heal; clients still reach P throughout.
``kill-standby``  SIGKILL a standby, restart it after 0-1.5 s: no failover.
``etcd-restart``  SIGKILL etcd and start it again on the same ports and
                  data: no failover (the lease and the key survive).

After each, the controller waits (``--heal-timeout``) for a healthy group:
the primary holds the key, may grant and is past its grace, both others are
synced standbys of it, and the prober was granted something since.

W2 workers (``NemesisConfig.pair_workers``, 0 here; :mod:`benches.shard_nemesis` sets it)
are more processes, after the prober: one-shot ``acquire`` + ``release`` pairs on 16 names of
their own, ``pair_pause`` s apart, logged and checked as the others' grants are.

Checks and figures
------------------
Safety (:mod:`fastlock._testbase.history`), each violation listed:

* the store's accepted writes: tokens never go backwards per lock in commit
  order; no token accepted from two holdings; no two critical sections
  (a holding's accepted writes) overlap (:func:`check_store`);
* the grants workers received: no token granted twice; no grant sent after
  another was received carries a lower token (:func:`check_grants`).

Availability (the acceptance figures of issue 10, reported and checked):

* leases lost by ``lock()`` holders (``lease.lost`` set while holding), with
  TTL > F + request_timeout; and releases that failed at ``lock()``'s exit
  (it swallows ``LeaseLost``/``ConnectionLost`` and sets ``lease.lost``).
  Counted apart, and only these: leases the fault's old primary granted
  between the fault and its own fence - the grant reached its client after
  the fault began, its acquire was sent before the moment the old primary's
  log says it stopped granting ("role: primary fenced", or a role change away
  from primary; a kill: the kill itself), and its token's epoch is below the
  promoted node's (:func:`benches.nemesis.report.granted_before_fence`).
  With asynchronous replication their records may never have reached the
  standby; its grace period, not the lease, protects the lock.  A fault after
  which the old primary never fenced exempts nothing;
* grants that reached a client after the standby promoted but carry an
  older epoch's token (decided by the old primary just before it froze or
  lost its link, acknowledged after the promotion): a lease the new primary
  never knew, returned as granted;
* locks the primary still shows held after every worker stopped (orphans:
  a release acknowledged by a primary whose record never reached the standby
  leaves the replicated lease held until its TTL on the new primary);
* errors surfaced to worker code: from ``lock()`` entry (acquires whose
  ``wait`` covered the outage), from its exit (the release), and exceptions
  the event loop saw unretrieved, each by type with sample messages;
* per kill, the longest window without any grant, from the SIGKILL until the
  cluster is healthy again, against the bound F + G + 1 s; the same window
  for every other fault, and outside faults (the baseline).  A *prober*
  process (one more worker) takes and releases a fresh, uncontended lock
  every 50 ms with one-shot ``acquire``/``release``, so that the windows
  measure the cluster, not the workers' contention; its errors count too;
* errors by the fault window they fell in (or "steady");
* stale writes the fence refused (a holder that still acted as the holder);
* two holders believing they held one lock at once (client view,
  :func:`check_holdings`); meaningful as a violation only with G >= TTL.

Figures are printed at the end, and written as JSON with ``--json``.
``tests/test_nemesis.py`` runs a short version in CI.

Bounds: every wait has a deadline; the run stops starting faults after
``--duration`` s, then waits at most ``--heal-timeout`` s; workers get
SIGTERM (finish the current holding, release) and SIGKILL after 15 s; every
server and worker is stopped by PID in ``finally`` blocks and at exit.
"""

from benches.nemesis.cluster import GROUP_KINDS, KINDS, Fault, Nemesis, NemesisConfig, report_again, run_nemesis
from benches.nemesis.report import build_report, print_report

__all__ = ["GROUP_KINDS", "KINDS", "Fault", "Nemesis", "NemesisConfig", "build_report", "print_report", "report_again",
           "run_nemesis"]
