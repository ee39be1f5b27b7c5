"""``python -m rolloutcore``: the same as the ``rolloutcore`` console script."""

import sys

from rolloutcore.cli import main

sys.exit(main())
