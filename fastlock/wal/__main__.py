"""``python -m fastlock.wal dump [--lock NAME] [--state] DIR``: see :func:`fastlock.wal.dump.main`."""

import sys

from .dump import main

sys.exit(main())
