"""``python -m rpcdl`` is the ``rpcdl`` command."""

import sys

from .cli import main

sys.exit(main())
