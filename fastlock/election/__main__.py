"""``python -m fastlock.election``: one election candidate (:mod:`fastlock.cli.candidate`)."""

import sys

from ..cli.candidate import main

sys.exit(main(sys.argv[1:]))
