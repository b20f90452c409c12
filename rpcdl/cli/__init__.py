"""The command line, the top layer: ``rpcdl worker | status | demo | bench`` (and ``python -m rpcdl.launch``).

It may load the integrations (the demo trains through Lightning); nothing below it imports it.
"""

from __future__ import annotations

from .commands import (
    add_version_argument,
    add_worker_arguments,
    build_parser,
    main,
    run_worker_command,
    skip_collections_at_exit,
)

__all__ = [
    "add_version_argument",
    "add_worker_arguments",
    "build_parser",
    "main",
    "run_worker_command",
    "skip_collections_at_exit",
]
