"""``python -m workloads`` runs the ``mmcache`` command line."""

import sys

from workloads.cli import main

sys.exit(main())
