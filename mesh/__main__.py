"""Allow ``python -m mesh ...``, the mesh commands without the shardpool package."""

import sys

from mesh.cli.parser import main

sys.exit(main())
