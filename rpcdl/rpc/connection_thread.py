"""A connection's own thread, ``rpcdl-connection-HOST:PORT``: it opens the connection, then serves it.

Threading model: the thread calls only public methods of its
:class:`~rpcdl.rpc.connection.Connection`, which states who owns what (the
connection's lock guards its state; this thread owns the socket's life). Its
one state of its own is a local variable: when it last flushed releases.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable
from typing import Any

from ..transport.security import Token
from .connection import RELEASE_TICK, Connection
from .live_threads import start_live_thread


def thread_name(address: str) -> str:
    """The name of the thread of a connection to ``address``."""
    return f"rpcdl-connection-{address}"


def start_connection(
    address: str,
    token: Token | None,
    ssl_context: ssl.SSLContext | None,
    timeout: float,
    *,
    grace: float,
    on_close: Callable[[Connection], Any],
) -> Connection:
    """A new :class:`~rpcdl.rpc.connection.Connection` (same arguments), its thread started: it opens in the
    background, and calls made meanwhile wait for it."""
    connection = Connection(address, token, ssl_context, timeout, grace=grace, on_close=on_close)
    start_live_thread(lambda: serve(connection), name=thread_name(address))
    return connection


def serve(connection: Connection) -> None:
    """Open ``connection``, then, until it closes: read the background answers, fail overdue calls, flush
    deferred frames and RRef releases. The body of the connection's thread."""
    opened = None
    try:
        opened = connection.connect()
        if opened is None:
            return
        released_at = time.monotonic()
        while (chores := connection.await_chores()) is not None:
            if chores.overdue:
                connection.expire_overdue()
            if chores.releases_waiting and chores.now - released_at > RELEASE_TICK:
                released_at = chores.now
                connection.flush()
            elif chores.deferred_due:
                connection.flush()  # frames deferred by a thread that went on with something else
            connection.read_background()
            connection.read_while_idle()
    except BaseException as exc:  # nothing waits in silence: the calls fail with it
        connection.close(f"the thread of the connection to worker {connection.address} failed: {exc!r}")
        raise
    finally:
        if opened is not None:
            connection.finish(opened)
