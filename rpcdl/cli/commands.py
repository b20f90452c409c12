"""The ``rpcdl`` command line: ``worker``, ``status``, ``demo`` and ``bench``."""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib
import importlib.util
import os
import signal
import ssl
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from ..local import START_METHODS, resolve_start_method, start_worker_process
from ..logs import FORMATS
from ..logs import configure as configure_logging
from ..server.admission import DEFAULT_MAX_SESSIONS
from ..transport.compression import COMPRESSION_ENV, MODES, resolve_mode
from ..transport.security import (
    TLS_CERT_ENV,
    TLS_KEY_ENV,
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    Token,
    default_server_tls,
    read_token_file,
    resolve_token,
    server_tls_context,
)
from .args import (
    host_problem,
    log_level,
    new_file,
    non_negative_float,
    port,
    positive_float,
    positive_int,
    registry_url,
)

# Modules with HELP, DESCRIPTION, add_arguments(parser) and run(args) -> int; they
# import their heavy dependencies inside run().
_PLUGGED_COMMANDS: list[str] = ["status", "demo", "bench"]

#: The port a worker listens on unless told otherwise, the seed's (rpcdataloader's) and the one the
#: deployment recipes open: a fixed port is one a firewall rule and a worker list can name.
DEFAULT_PORT = 6543


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``rpcdl worker`` (shared with ``python -m rpcdl.launch``)."""
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface to listen on (default: 127.0.0.1; 0.0.0.0 for all, which requires a token or --insecure)",
    )
    parser.add_argument(
        "--port",
        type=port,
        default=DEFAULT_PORT,
        help="port to listen on; 0 picks a free port (default: %(default)s; with --procs N, N ports from it)",
    )
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=120.0,
        help="seconds a client may stall in the middle of a transfer (default: %(default)s)",
    )
    parser.add_argument(
        "--parallel", type=positive_int, default=1, help="calls run at once in each process (default: %(default)s)"
    )
    parser.add_argument(
        "--max-sessions",
        type=positive_int,
        default=DEFAULT_MAX_SESSIONS,
        metavar="N",
        help="clients served at once by each process; one more is refused, once it proved its token, and its "
        "loader uses its other workers (rpcdl status is never refused) (default: %(default)s)",
    )
    parser.add_argument(
        "--procs",
        type=positive_int,
        default=1,
        help="worker processes to start, each on its own port (--port P: P, P+1, ...); one that dies once it served "
        "is logged with its signal or exit code and started again, after a backoff while it keeps dying; one that "
        "dies before it was ever ready (its port in use, say) stops them all with exit code 1 (default: %(default)s)",
    )
    parser.add_argument(
        "--start-method",
        choices=START_METHODS,
        help="how --procs starts its processes: 'forkserver' forks them from one process that imported torch once "
        "(less CPU at start, torch's memory shared), 'spawn' starts each as a new interpreter (default: forkserver "
        "on Linux, else spawn)",
    )
    parser.add_argument(
        "--address-file",
        metavar="FILE",
        type=new_file,
        help="list each worker's HOST:PORT in FILE, one line per live worker, once it is ready; a worker removes its "
        "line when it drains (--procs: the supervisor removes a dead process's line), under a file lock",
    )
    parser.add_argument(
        "--token-file",
        metavar="FILE",
        help=f"file holding the shared token (default: ${TOKEN_ENV} or ${TOKEN_FILE_ENV})",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="allow listening on a non-loopback interface without a token (trusted networks only)",
    )
    parser.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate chain")
    parser.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert (if not inside it)")
    parser.add_argument(
        "--advertise",
        metavar="HOST",
        help="host name to report in the ready line and address file (default: this machine's name "
        "when listening on a wildcard address, else --host)",
    )
    parser.add_argument(
        "--compression",
        choices=MODES,
        type=str.lower,
        help=f"lz4 compression of large answers, negotiated with each client; 'auto' turns it on where it pays "
        f"and never on loopback (default: ${COMPRESSION_ENV}, else auto; needs pip install 'rpcdl[compression]')",
    )
    parser.add_argument(
        "--threads", type=positive_int, default=1, help="torch.set_num_threads for each process (default: %(default)s)"
    )
    parser.add_argument(
        "--register",
        metavar="URL",
        type=registry_url,
        help="join the Redis registry redis://HOST:PORT[/DB]?key=KEY[&ttl=SECONDS] while serving: a heartbeat every "
        "ttl/3 s (ttl 15 s by default), the entry removed on SIGTERM; trainers read it with the same URL as their "
        "workers (needs pip install 'rpcdl[redis]')",
    )
    parser.add_argument(
        "--drain-timeout",
        "--grace",
        dest="grace",
        metavar="SECONDS",
        type=non_negative_float,
        default=30.0,
        help="on SIGTERM/SIGINT the worker stops taking calls, tells its clients it is leaving and gives the calls "
        "in flight this long to finish, then exits 0; a second signal stops it at once (default: %(default)s)",
    )
    parser.add_argument(
        "--log-level",
        type=log_level,
        default="INFO",
        help="level of rpcdl's own log on standard error (other libraries' stay at warnings): DEBUG, INFO, "
        "WARNING, ERROR or CRITICAL (default: %(default)s)",
    )
    parser.add_argument(
        "--log-format",
        choices=FORMATS,
        default="text",
        help="text: time, level, logger and message; json: one object per line, for log collectors "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--metrics-port",
        type=port,
        metavar="PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics on --host (0 picks a free port; with --procs N, "
        "process i uses PORT+i); default: no metrics",
    )
    parser.add_argument("--watch-pid", type=positive_int, help=argparse.SUPPRESS)


def package_version() -> str:
    """rpcdl's version: the installed distribution's, else the source tree's ``rpcdl.__version__``."""
    import importlib.metadata  # here: only --version and bench reports need it

    try:
        return importlib.metadata.version("rpcdl")
    except importlib.metadata.PackageNotFoundError:
        from .. import __version__

        return __version__


def add_version_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--version``: print rpcdl's version and exit."""
    parser.add_argument("--version", action=_Version, help="show rpcdl's version and exit")


class _Version(argparse.Action):
    """``--version``, looked up only when asked for: reading the installed metadata takes tens of
    milliseconds, of the half second ``rpcdl status`` may take."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"rpcdl {package_version()}")  # on standard output, as argparse's own version action
        parser.exit()


class _Mistake(Exception):
    """A worker option (or its environment variable) that cannot work: the message says why."""


def _credentials(args: argparse.Namespace) -> tuple[Token | None, ssl.SSLContext | None]:
    """The token and TLS context the options (or the environment) name; raises :class:`_Mistake`."""
    try:
        token = read_token_file(args.token_file) if args.token_file else resolve_token()
    except ValueError as exc:
        where = "--token-file" if args.token_file else f"${TOKEN_FILE_ENV}"
        raise _Mistake(f"{where}: {exc}") from None
    if args.tls_key and not args.tls_cert:
        raise _Mistake("--tls-key needs --tls-cert (the certificate chain the key belongs to)")
    try:
        ssl_context = server_tls_context(args.tls_cert, args.tls_key) if args.tls_cert else default_server_tls()
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        if args.tls_cert:
            where, cert, key = "--tls-cert", args.tls_cert, args.tls_key
        else:
            where, cert, key = f"${TLS_CERT_ENV}", os.environ[TLS_CERT_ENV], os.environ.get(TLS_KEY_ENV)
        files = f"{cert!r} (key {key!r})" if key else repr(cert)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise _Mistake(f"{where}: cannot load the certificate chain {files}: {reason}") from None
    return token, ssl_context


def _print_mistake(message: str) -> NoReturn:
    print(f"rpcdl worker: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def run_worker_command(
    args: argparse.Namespace, argv: Sequence[str], fail: Callable[[str], NoReturn] | None = None
) -> int:
    """Run the worker described by parsed ``rpcdl worker`` arguments; return the exit code.

    Args:
        args: the parsed options (see :func:`add_worker_arguments`).
        argv: the command line they came from (``--procs`` passes it on to each process).
        fail: reports a mistake in the options and exits with code 2, as
            :meth:`argparse.ArgumentParser.error` does (the default prints one line).

    Returns:
        0 once stopped by SIGTERM or SIGINT (``--procs`` restarts a process that dies once it served, and
        says why); 1 when a port cannot be bound, or a process of ``--procs`` dies before it was ever ready.
    """
    fail = fail or getattr(args, "fail", None) or _print_mistake
    configure_logging(args.log_level, args.log_format)
    problem = host_problem(args.host) if args.host else None
    if problem:
        fail(f"--host {problem}")
    try:
        token, ssl_context = _credentials(args)
        resolve_mode(args.compression)
    except _Mistake as exc:
        fail(str(exc))
    except (ImportError, ValueError) as exc:
        fail(str(exc).replace("compression=", "--compression ", 1))
    if args.register is not None and importlib.util.find_spec("redis") is None:
        fail("--register needs redis-py: pip install 'rpcdl[redis]' (or pip install redis)")
    if args.start_method is not None and args.procs == 1:
        fail("--start-method is how --procs N starts its processes: give it with --procs 2 or more")
    if args.procs > 1:
        try:
            args.start_method = resolve_start_method(args.start_method)
        except ValueError as exc:
            fail(str(exc).replace("start_method=", "--start-method ", 1))
        return _run_worker_processes(args, argv)
    from ..server.worker import run_worker

    try:
        run_worker(
            args.host,
            args.port,
            args.timeout,
            args.parallel,
            token=token,
            insecure=args.insecure,
            ssl_context=ssl_context,
            num_threads=args.threads,
            address_file=args.address_file,
            grace=args.grace,
            advertise=args.advertise,
            watch_pid=args.watch_pid,
            compression=args.compression,
            metrics_port=args.metrics_port,
            register=args.register,
            max_sessions=args.max_sessions,
        )
    except OSError as exc:  # not a usage mistake: one line, exit 1 (another port is the user's choice)
        if isinstance(exc, PermissionError) and exc.errno is None:
            fail(str(exc))  # but rpcdl's own refusal (no token for a non-loopback address) is one: exit 2
        if exc.errno is not None:  # from the system: binding the worker's port failed
            print(f"{_prog(args)}: error: cannot listen on {args.host}:{args.port}: {exc.strerror}", file=sys.stderr)
        else:  # one that names its port and reason (the metrics port in use, say)
            print(f"{_prog(args)}: error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        fail(str(exc))  # a refusal that explains itself (no token for a non-loopback address, say)
    for signum in (signal.SIGTERM, signal.SIGINT):  # stopped gracefully: a repeated signal changes nothing now
        signal.signal(signum, signal.SIG_IGN)
    return 0


#: Seconds the fork server of ``--procs`` may take to answer (its first start waits for its import of torch).
_FORK_TIMEOUT = 300.0


def _prog(args: argparse.Namespace) -> str:
    return getattr(args, "prog", None) or "rpcdl worker"


def _run_worker_processes(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Start ``--procs`` worker processes and keep them running until a signal (see :mod:`rpcdl.server.supervisor`)."""
    from ..server.draining import SAME_SIGNAL_WINDOW
    from ..server.process import StopSignals
    from ..server.supervisor import ChildProcess, Supervisor

    child_argv = list(argv)
    for option in ("--procs", "--port", "--watch-pid", "--start-method"):
        child_argv = _without_option(child_argv, option)
    follow = ["--watch-pid", str(os.getpid())]  # a supervisor killed outright: its children drain and exit
    environment = dict(os.environ)

    def start_child(index: int) -> ChildProcess:
        port = args.port + index if args.port else 0
        command = ["worker", *child_argv, "--port", str(port), *follow]
        if args.metrics_port is not None:  # one metrics port per child, as one port per worker
            metrics_port = args.metrics_port + index if args.metrics_port else 0
            command = [*_without_option(command, "--metrics-port"), "--metrics-port", str(metrics_port)]
        # their own process group: a Ctrl-C in the terminal reaches the supervisor only, which drains them once;
        # their standard output through the supervisor, which learns each one's address from its ready line
        return start_worker_process(command, environment, args.start_method, _FORK_TIMEOUT, process_group=0)

    stop = StopSignals().install()
    try:
        supervisor = Supervisor(start_child, args.procs, args.grace, address_file=args.address_file)
        return supervisor.run(lambda: stop.received, lambda: stop.again(SAME_SIGNAL_WINDOW))
    finally:
        stop.restore()


def _without_option(argv: list[str], option: str) -> list[str]:
    result, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == option:
            skip = True
        elif not item.startswith(option + "="):
            result.append(item)
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rpcdl",
        description="Run PyTorch datasets on remote CPU workers and stream ready batches to training.",
    )
    add_version_argument(parser)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    worker = commands.add_parser(
        "worker",
        help="serve calls from trainers",
        description="Start an rpcdl worker. When ready it prints its HOST:PORT on one line of standard output. "
        "SIGTERM or SIGINT stop it after the calls in flight finish.",
    )
    add_worker_arguments(worker)
    worker.set_defaults(fail=worker.error, prog=worker.prog)

    for name in _PLUGGED_COMMANDS:
        module = importlib.import_module(f"rpcdl.cli.{name}")
        sub = commands.add_parser(name, help=module.HELP, description=module.DESCRIPTION)
        module.add_arguments(sub)
        sub.set_defaults(handler=module.run, fail=sub.error)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rpcdl`` command; the process that runs it skips its last garbage collections at
    exit (:func:`skip_collections_at_exit`)."""
    skip_collections_at_exit()
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "worker":
        return run_worker_command(args, argv[argv.index("worker") + 1 :])
    return args.handler(args)


def skip_collections_at_exit() -> None:
    """Have this process skip the interpreter's last garbage collections when it exits.

    Those collections walk every object torch made: about a second on a slow
    host, which every stop of a worker process waited for, while the system
    frees the process's memory whatever they would find. So, at exit, this
    freezes the collector (:func:`gc.freeze`); the exit hooks and reference
    counting work as before. The ``rpcdl`` command and
    ``python -m rpcdl.launch`` call it as they start.

    Example::

        >>> skip_collections_at_exit()  # doctest: +SKIP
    """
    atexit.unregister(gc.freeze)  # once, however many commands this process ran
    atexit.register(gc.freeze)


if __name__ == "__main__":
    sys.exit(main())
