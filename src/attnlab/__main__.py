"""`python -m attnlab ...`: the attnlab command (what ablation worker processes run)."""

import sys

from .cli import main

sys.exit(main())
