"""The protocol fuzzer of ``benches/fuzz.py``, driven by hypothesis for a short run (~20 s).

Every operation from every principal kind (two clients with different ACLs, the
anonymous client, a replica, an admin) against one real server: no crash, no
internal error reply, and no state change - nor any success - from requests the
principal is not granted (checked by an admin snapshot before and after each
unauthorised round).  The long run is ``python -m benches.fuzz --requests 1000000``.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# benches/ is not installed with the package: import it from the source tree
# (appended, so that ``fastlock`` itself still comes from the installed package)
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

from benches.fuzz import Figures, fuzz_rounds, make_specs, rss_kib, server_crashed, start_server, unclassified_ops  # noqa: E402

BUDGET_S = 20.0


def test_fuzzer_has_a_policy_for_every_protocol_op():
    # a new operation without a policy would only fail the fuzz run when hypothesis happens to
    # draw it (a flaky KeyError); this names it at once
    assert unclassified_ops() == set()


def test_fuzz_every_op_with_every_principal(tmp_path):
    specs = make_specs()
    server = start_server(tmp_path, specs)
    figures = Figures()
    owners: list[bytes] = []
    deadline = time.monotonic() + BUDGET_S
    try:
        @settings(max_examples=400, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
        @given(st.integers(min_value=0, max_value=2**32 - 1))
        def one_round(seed):
            # a seed rather than st.randoms(): the requests also depend on the server's
            # answers (owner keys of granted leases), which a replay cannot reproduce
            if time.monotonic() > deadline:
                return
            rng = random.Random(seed)
            asyncio.run(asyncio.wait_for(
                fuzz_rounds(server.address, specs, rng, 1, 32, figures, owners, server), 30))
            assert not figures.crashes and not server_crashed(server), "\n".join(server.lines[-30:])
            assert figures.internal_errors == 0, figures.examples
            assert figures.unauthorised_successes == 0, figures.examples
            assert figures.unauthorised_state_changes == 0, figures.examples
            assert figures.quota_breaches == 0, figures.examples

        one_round()
        assert figures.requests > 5_000, figures.as_dict()  # the run did fuzz
        assert rss_kib(server.pid) < 200 * 1024
    finally:
        server.stop()
    print(f"\nfuzz: {figures.requests} requests, {figures.refused} refused, {figures.rounds} rounds")
