"""``rpcdl bench`` with rpcdataloader and torch.distributed.rpc beside it, when they are installed, judged
against the project's targets (``targets.py``).

Takes the options of ``rpcdl bench`` (``--help``). Example::

    python benchmarks/compare.py --local-workers 2 --json results.json --plot results.png
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from baselines import available
from targets import judge

from rpcdl.cli.bench import main

if __name__ == "__main__":
    sys.exit(main(extra_systems=available(), judge=judge))
