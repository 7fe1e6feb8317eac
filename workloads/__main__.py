"""``python -m workloads`` runs the ``mmcache`` command line."""

import sys

from .cli import main

sys.exit(main())
