"""``python -m fastlock.demo``: the same as ``fastlock demo`` (:mod:`fastlock.cli.demo`)."""

import sys

from .cli.demo import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
