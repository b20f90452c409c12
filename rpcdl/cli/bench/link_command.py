"""``rpcdl bench --link``: checks the options and credentials, measures, prints (and saves) the report.

Threading model: runs in the command's one thread (see :mod:`rpcdl.cli.bench.link`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ...transport.security import TLS_CA_ENV, TOKEN_ENV, TOKEN_FILE_ENV, client_tls_context, read_token_file
from ..args import silent_worker
from .link import LinkSizes, format_link, measure_link


def _use_credentials(args: argparse.Namespace) -> str | None:
    """Make ``--token-file`` and ``--tls-ca`` this process's credentials; a sentence if one cannot work."""
    if args.token_file:
        try:
            read_token_file(args.token_file)
        except ValueError as exc:
            return f"--token-file: {exc}"
        os.environ.pop(TOKEN_ENV, None)  # the file given here wins over the environment's token
        os.environ[TOKEN_FILE_ENV] = args.token_file
    if args.tls_ca:
        try:
            client_tls_context(args.tls_ca)
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            return f"--tls-ca: cannot load {args.tls_ca!r} as PEM certificates: {reason}"
        os.environ[TLS_CA_ENV] = args.tls_ca
    return None


def run_link(args: argparse.Namespace) -> int:
    """Run ``rpcdl bench --workers ... --link``; return the exit code."""
    if not args.workers:
        print("rpcdl bench: --link measures running workers: name them with --workers HOST:PORT ...", file=sys.stderr)
        return 2
    problem = _use_credentials(args) or silent_worker(args.workers, timeout=10.0)
    if problem:
        print(f"rpcdl bench: {problem}", file=sys.stderr)
        return 2
    sizes = LinkSizes.quick() if args.quick else LinkSizes(seconds=args.link_seconds)
    if args.rounds:
        sizes.rounds = args.rounds
    started = time.time()
    report = measure_link(args.workers, sizes, progress=(lambda line: None) if args.no_progress else print)
    print(f"rpcdl bench --link: {len(args.workers)} worker(s), {sizes.rounds} round(s), medians")
    print(format_link(report))
    if args.json:
        document = {
            "command": " ".join(["rpcdl", *sys.argv[1:]]),
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
            "seconds": round(time.time() - started, 1),
            "link": report.as_dict(),
        }
        with open(args.json, "w") as handle:
            json.dump(document, handle, indent=2)
    return 0
