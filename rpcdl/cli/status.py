"""``rpcdl status``: the workers' counters, once or live, as a table or JSON; without torch.

The workers are named as trainers name them: addresses, files listing them
(read as the command starts), and sources (``dns://``, ``redis://``), which
are asked for their addresses (:func:`rpcdl.data.sources.worker_source`)
before each reading; a source that lists no worker keeps a row of its own,
with why. Each source is asked by its own thread (``rpcdl-status-SOURCE``),
which writes only its own slot of a list made for one reading; then every
worker is asked at once on this process's event loop (``rpcdl-loop``,
through :func:`rpcdl.cli.probe.ask_many`: no thread per worker), so one
silent worker costs its timeout once, not once per worker. The main thread
waits for them all (a source for at most the timeout: one that answers later
writes a slot nobody reads again) and owns every reading and the table. A
worker that cannot be asked keeps its row, with its state (refused, token
mismatch, ...) and the reason in the last column.
"""

from __future__ import annotations

import argparse
import json
import ssl
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, TextIO

from ..transport.security import (
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    Token,
    client_tls_context,
    default_client_tls,
    read_token_file,
    resolve_token,
)
from .args import Deprecated, add_workers_argument, existing_file, is_source, positive_float, worker_list
from .probe import Answer, Reach, ask_many

HELP = "show the counters of running workers (once, or live with --watch)"
DESCRIPTION = (
    "Ask each worker for its counters and print them as a table (or JSON). It imports no torch and does not "
    "count itself as one of the workers' clients. Exit code 0 when every worker answered, else 1 (with "
    "--watch: in the last reading before Ctrl-C)."
)

_ONCE = [
    ("worker", lambda c: c["address"]),
    ("state", lambda c: c["state"]),
    ("pid", lambda c: c["pid"]),
    ("up s", lambda c: f"{c['uptime_s']:.0f}"),
    ("clients", lambda c: c["clients"]),
    ("served", lambda c: c["calls_served"]),
    ("failed", lambda c: c["calls_failed"]),
    ("in flight", lambda c: c["calls_in_flight"]),
    ("busy s", lambda c: f"{c['busy_s']:.1f}"),
    ("MB in", lambda c: f"{c['bytes_in'] / 1e6:.1f}"),
    ("MB out", lambda c: f"{c['bytes_out'] / 1e6:.1f}"),
    ("rrefs", lambda c: c["rrefs"]),
    ("transport", lambda c: c["transport"]),
]
_LIVE = [
    ("worker", lambda c: c["address"]),
    ("state", lambda c: c["state"]),
    ("busy %", lambda c: f"{c['busy_percent']:.0f}"),
    ("batches/s", lambda c: f"{c['batches_per_second']:.1f}"),
    ("MB/s", lambda c: f"{c['mb_per_second']:.2f}"),
    ("clients", lambda c: c["clients"]),
    ("in flight", lambda c: c["calls_in_flight"]),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``rpcdl status``."""
    parser.add_argument(
        "addresses",
        nargs="*",
        type=worker_list,
        metavar="WORKERS",
        help="workers to ask, in the forms --workers takes (or name them with --workers); a source is asked for "
        "its workers before each reading",
    )
    add_workers_argument(parser, "workers to ask")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print JSON instead of the table (redirect it to keep it); with --watch, one JSON object per line",
    )
    parser.add_argument(
        "--watch",
        action="store_true",
        help="ask again every --interval seconds and show rates over the last interval: busy %%, batches/s, "
        "MB/s; Ctrl-C stops",
    )
    parser.add_argument(
        "--interval",
        type=positive_float,
        default=2.0,
        metavar="SECONDS",
        help="seconds between two readings of --watch (default: %(default)s)",
    )
    parser.add_argument(
        "--token-file",
        metavar="FILE",
        type=existing_file,
        help=f"file holding the workers' token (default: ${TOKEN_ENV} or ${TOKEN_FILE_ENV})",
    )
    parser.add_argument(
        "--tls-ca",
        metavar="PEM",
        type=existing_file,
        help="CA file to verify TLS workers with (default: $RPCDL_TLS_CA)",
    )
    parser.add_argument(
        "--answer-timeout",
        type=positive_float,
        default=5.0,
        metavar="SECONDS",
        help="seconds each worker (and each source) has to answer; one that does not is a 'timeout' row "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--timeout",
        type=positive_float,
        dest="answer_timeout",
        action=Deprecated,
        new="--answer-timeout",
        help=argparse.SUPPRESS,
    )


def run(args: argparse.Namespace) -> int:
    """Run ``rpcdl status`` with parsed arguments; return the exit code (0: every worker answered)."""
    workers = list(dict.fromkeys([entry for listed in args.addresses for entry in listed] + list(args.workers or [])))
    if not workers:
        args.fail("name the workers to ask: rpcdl status HOST:PORT ... (or --workers)")
    try:
        token = read_token_file(args.token_file) if args.token_file else resolve_token()
        tls = client_tls_context(args.tls_ca) if args.tls_ca else default_client_tls()
    except (OSError, ValueError) as exc:
        args.fail(str(exc))
    if not args.watch:
        readings = [reading(answer) for answer in ask_all(workers, token, tls, args.answer_timeout)]
        if args.json:
            print(json.dumps({"workers": readings}, indent=2))
        else:
            print(format_table(readings, _ONCE), end="")
        return exit_code(readings)
    return _watch(workers, token, tls, args, sys.stdout)


def exit_code(readings: Sequence[dict[str, Any]]) -> int:
    """0 when every worker answered its counters (a draining one included), else 1.

    Example::

        >>> exit_code([{"state": "up"}, {"state": "draining"}]), exit_code([{"state": "refused"}])
        (0, 1)
    """
    answered = (Reach.UP.value, "draining")
    return 0 if readings and all(row["state"] in answered for row in readings) else 1


def _watch(
    workers: list[str], token: Token | None, tls: ssl.SSLContext | None, args: argparse.Namespace, out: TextIO
) -> int:
    previous: dict[str, Answer] = {}
    clear = not args.json and out.isatty()
    readings: list[dict[str, Any]] = []
    try:
        while True:
            started = time.monotonic()
            answers = ask_all(workers, token, tls, args.answer_timeout)
            readings = [reading(answer, previous.get(answer.address)) for answer in answers]
            previous.update((answer.address, answer) for answer in answers if answer.reach is Reach.UP)
            if args.json:
                out.write(json.dumps({"time": time.time(), "workers": readings}) + "\n")
            else:
                stamp = time.strftime("%H:%M:%S")
                title = f"rpcdl status  {stamp}  every {args.interval:g}s  (Ctrl-C stops)\n"
                out.write(("\x1b[H\x1b[2J" if clear else "\n") + title + format_table(readings, _LIVE))
            out.flush()
            time.sleep(max(0.0, args.interval - (time.monotonic() - started)))
    except KeyboardInterrupt:
        return exit_code(readings)


def ask_all(workers: Sequence[str], token: Token | None, tls: ssl.SSLContext | None, timeout: float) -> list[Answer]:
    """Ask every worker at once (on the event loop, see :func:`rpcdl.cli.probe.ask_many`); return their answers in
    the order given.

    Args:
        workers: ``"host:port"`` addresses and sources (``dns://...``, ``redis://...``): each source is asked
            for its workers first (see :func:`resolve_sources`).
        token: the shared secret, or ``None``.
        tls: a client TLS context, or ``None``.
        timeout: seconds each source, then each worker, gets.

    Returns:
        one :class:`~rpcdl.cli.probe.Answer` per worker, and one per source that lists none.

    Example::

        >>> [a.reach.value for a in ask_all(["127.0.0.1:1"], None, None, 1.0)]  # doctest: +SKIP
        ['refused']
    """
    entries = resolve_sources(workers, timeout)
    addresses = [entry for entry in entries if not isinstance(entry, Answer)]
    asked = iter(ask_many(addresses, token, tls, timeout))
    return [entry if isinstance(entry, Answer) else next(asked) for entry in entries]


def resolve_sources(workers: Sequence[str], timeout: float) -> list[str | Answer]:
    """Replace each source in ``workers`` by the addresses it lists now, each address once.

    Sources are asked at once, a thread each (``rpcdl-status-SOURCE``), as a
    trainer asks them (:func:`rpcdl.data.sources.worker_source`). A source that
    lists no worker, cannot be read or does not answer within ``timeout`` is
    an :class:`~rpcdl.cli.probe.Answer` (``unreachable``, or ``timeout``) with why.

    Args:
        workers: addresses and sources.
        timeout: seconds each source gets.

    Returns:
        addresses, in the order given, and the answers of sources that listed none.

    Example::

        >>> resolve_sources(["127.0.0.1:7000", "127.0.0.1:7000"], 1.0)
        ['127.0.0.1:7000']
    """
    found: list[list[str] | Answer | None] = [None] * len(workers)

    def list_workers(index: int, source: str) -> None:
        found[index] = _source_addresses(source)

    threads = []
    for index, entry in enumerate(workers):
        if not is_source(entry):
            found[index] = [entry]
            continue
        thread = threading.Thread(target=list_workers, args=(index, entry), name=f"rpcdl-status-{entry}", daemon=True)
        thread.start()
        threads.append(thread)
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    result: list[str | Answer] = []
    for entry, listed in zip(workers, found, strict=True):
        if listed is None:
            reason = f"{entry} did not list its workers within {timeout:g}s"
            result.append(Answer(entry, Reach.TIMEOUT, reason=reason, at=time.monotonic()))
        elif isinstance(listed, Answer):
            result.append(listed)
        else:
            result.extend(address for address in listed if address not in result)
    return result


def _source_addresses(source: str) -> list[str] | Answer:
    """The addresses ``source`` lists now, or an answer saying why it lists none."""
    from ..data.sources import worker_source  # no torch on this path: the sources need only the standard library

    try:
        listing = worker_source(source)
        addresses = list(listing.addresses())
    except Exception as exc:  # a malformed URL, redis-py missing, a registry's own error
        return Answer(source, Reach.UNREACHABLE, reason=f"{source}: {exc}", at=time.monotonic())
    if addresses:
        return addresses
    why = getattr(listing, "last_error", None) or f"{source} lists no worker now"
    return Answer(source, Reach.UNREACHABLE, reason=why, at=time.monotonic())


def reading(answer: Answer, before: Answer | None = None) -> dict[str, Any]:
    """One worker's row: its counters with ``address``, ``state`` and ``note``, plus rates.

    The rates (``busy_percent`` of its ``parallel`` slots, ``calls_per_second``,
    ``batches_per_second`` made for loaders, ``mb_per_second`` out) are over
    the interval since ``before`` when it is the same worker process, else
    over its whole uptime.

    Args:
        answer: the worker's answer now.
        before: its previous answer, if any.

    Returns:
        a JSON-ready dict; a worker that could not be asked has only ``address``, ``state`` and ``note``.
    """
    row: dict[str, Any] = {"address": answer.address, "state": answer.reach.value, "note": answer.reason}
    if answer.reach is not Reach.UP:
        return row
    now = answer.counters
    row.update(now)
    row["address"] = answer.address  # as asked (the worker's own may be its advertised name)
    if now.get("draining"):
        row["state"] = "draining"
    then = before.counters if before is not None and before.reach is Reach.UP else {}
    if then.get("pid") != now.get("pid") or then.get("uptime_s", 0) >= now["uptime_s"]:
        then = {"uptime_s": 0.0, "busy_s": 0.0, "calls_served": 0, "calls_failed": 0, "bytes_out": 0, "batches": 0}
    seconds = max(now["uptime_s"] - then["uptime_s"], 1e-9)
    calls = now["calls_served"] + now["calls_failed"] - then["calls_served"] - then["calls_failed"]
    busy = 100.0 * (now["busy_s"] - then["busy_s"]) / seconds / max(now.get("parallel", 1), 1)
    row["busy_percent"] = min(busy, 100.0)  # a call's time counts when it ends: some of it may precede the interval
    row["calls_per_second"] = calls / seconds
    row["batches_per_second"] = (now.get("batches", 0) - then.get("batches", 0)) / seconds  # 0 from an older worker
    row["mb_per_second"] = (now["bytes_out"] - then["bytes_out"]) / 1e6 / seconds
    return row


def format_table(readings: Sequence[dict[str, Any]], columns: Sequence[tuple[str, Any]]) -> str:
    """Lay ``readings`` out in ``columns`` (header, how to show a row's value), a ``note`` column last.

    Every row has every column: a worker that could not be asked shows ``-``
    where it has no value, and why in the note.

    Example::

        >>> print(format_table([{"address": "a:1", "state": "refused", "note": "connection refused"}],
        ...                    [("worker", lambda c: c["address"]), ("pid", lambda c: c["pid"])]), end="")
        worker  pid  note
        a:1     -    connection refused
    """
    rows = []
    for row in readings:
        cells = []
        for _, show in columns:
            try:
                cells.append(str(show(row)))
            except (KeyError, TypeError, ValueError):
                cells.append("-")
        rows.append([*cells, row.get("note", "")])
    headers = [name for name, _ in columns] + ["note"]
    widths = [max(len(line[i]) for line in [headers, *rows]) for i in range(len(headers))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in [headers, *rows]
    ]
    return "\n".join(lines) + "\n"
