"""``python -m fastlock.wal dump [--lock NAME] [--state] DIR``: the same as
``fastlock wal dump`` (:func:`fastlock.cli.admin.wal_dump_command`)."""

import sys

from ..cli import main

sys.exit(main(["wal", *sys.argv[1:]]))
