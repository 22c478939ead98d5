"""``python -m etcslurm`` is the ``etcslurm`` command."""

import sys

from etcslurm.cli import main

sys.exit(main())
