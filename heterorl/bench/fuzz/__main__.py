"""``python -m heterorl.bench.fuzz``: the same command line as ``heterorl bench fuzz``."""

import sys

from .cli import main

sys.exit(main())
