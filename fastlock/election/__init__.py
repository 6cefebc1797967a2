"""Leader election: the library lives in :mod:`fastlock.client.election`.

``from fastlock.election import Election, Term, Leader`` keeps working.  Running
``python -m fastlock.election`` starts one candidate process that prints JSON
lines (:mod:`fastlock.cli.candidate`; used by the tests and
``benches/election_failover.py``)::

    python -m fastlock.election --server 127.0.0.1:7420 --name leader --id node-a
"""

from __future__ import annotations

from ..client.election import Election, Leader, Term

__all__ = ["Election", "Term", "Leader"]
