"""``python -m rolloutcore.cli``: the same as the ``rolloutcore`` console script."""

import sys

from rolloutcore.cli import main

sys.exit(main())
