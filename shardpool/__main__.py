"""Allow ``python -m shardpool``."""

import sys

from shardpool.cli import main

sys.exit(main())
