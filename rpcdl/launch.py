"""``python -m rpcdl.launch``: start a worker, with rpcdataloader's command line.

Example::

    $ RPCDL_TOKEN_FILE=~/.rpcdl-token python -m rpcdl.launch --host=0.0.0.0 --port=6543
    node07:6543

It accepts every option of ``rpcdl worker`` (see ``--help``); ``--port``
defaults to 6543 there too, as in rpcdataloader.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .cli import add_version_argument, add_worker_arguments, run_worker_command, skip_collections_at_exit


def main(argv: Sequence[str] | None = None) -> int:
    skip_collections_at_exit()
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m rpcdl.launch",
        description="Run an rpcdl worker (rpcdataloader-compatible launcher). Prints HOST:PORT when ready.",
    )
    add_version_argument(parser)
    add_worker_arguments(parser)
    parser.set_defaults(prog=parser.prog)
    return run_worker_command(parser.parse_args(argv), argv, fail=parser.error)


if __name__ == "__main__":
    sys.exit(main())
