"""Exceptions raised by rpcdl: every one derives from :class:`RPCDLError`.

Two families matter to callers:

* Infrastructure failures (:class:`WorkerUnavailable`, :class:`ConnectionLost`,
  :class:`WorkerTimeout`, :class:`ProtocolError`): the worker or the network
  failed; the same call may succeed elsewhere. :func:`is_transient` says so.
* :class:`LimitExceeded`: a message would break a frame limit; the data, not
  the worker, is at fault, so it is not transient either.
* Exceptions raised by user code on a worker: re-raised locally with their own
  type, the remote traceback in ``exc.remote_traceback`` and the worker's address
  in ``exc.rpcdl_worker``. :class:`RemoteError` stands in when the type does not
  exist on the client.
"""

from __future__ import annotations

from typing import Any


class RPCDLError(Exception):
    """Base class of the errors rpcdl raises itself."""


class ProtocolError(RPCDLError, ConnectionError):
    """The peer sent bytes that break the protocol (bad magic, version, length)."""


class FrameTooLarge(ProtocolError):
    """A frame received announces more than this side's limits; its connection is closed.

    Attributes:
        call_id: the call the frame belongs to.
    """

    def __init__(self, message: str, call_id: int):
        super().__init__(message)
        self.call_id = call_id

    def __reduce__(self):
        return type(self), (str(self), self.call_id)

    def as_limit_exceeded(self, what: str) -> LimitExceeded:
        """The error for the call whose answer this was: the sender's limits are higher than this side's."""
        return LimitExceeded(
            f"{what} past this process's limits ({self}): the sender's limits are higher; set the same "
            "RPCDL_MAX_BUFFERS and RPCDL_MAX_MESSAGE_BYTES for the workers and the trainers"
        )


class AuthenticationError(RPCDLError, PermissionError):
    """The handshake failed because the tokens of client and worker differ."""


class WorkerUnavailable(RPCDLError, ConnectionError):
    """The worker could not be reached, or refused new calls while shutting down."""


class WorkerLeaving(WorkerUnavailable):
    """The worker is leaving (it was sent SIGTERM or SIGINT, or told to drain): it takes no new calls.

    Transient (:func:`rpcdl.errors.is_transient`): make the call on another worker, at once.
    Raised for a call made to a worker after its ``LEAVING`` notice reached this
    process, and for a call the worker rejected because it drains; calls that
    were in flight when it began to leave get their answers. See
    :func:`rpcdl.rpc.client.is_leaving` and
    :func:`rpcdl.rpc.client.add_leaving_listener`.

    Attributes:
        address: the worker, ``"host:port"``.

    Example::

        >>> try:  # doctest: +SKIP
        ...     rpcdl.rpc_sync(leaving_worker, min, (1, 2))
        ... except rpcdl.WorkerLeaving as exc:
        ...     print(exc.address, rpcdl.errors.is_transient(exc))
        127.0.0.1:6543 True
    """

    def __init__(self, message: str, address: str = ""):
        super().__init__(message)
        self.address = address

    def __reduce__(self):
        return type(self), (str(self), self.address)


class SessionsFull(WorkerUnavailable):
    """The worker refused the connection: it serves as many clients (sessions) as it takes (``max_sessions``).

    Transient (:func:`rpcdl.errors.is_transient`), but not retried on the spot:
    sessions last, so a loader sends its batches to its other workers at once
    and probes this one in the background until it takes the connection.

    Example::

        >>> try:  # doctest: +SKIP
        ...     rpcdl.rpc_sync(full_worker, min, (1, 2))
        ... except rpcdl.errors.SessionsFull as exc:
        ...     print(rpcdl.errors.is_transient(exc))
        True
    """


class UnknownHost(RPCDLError, LookupError):
    """A worker's host name does not resolve: a typo or a name not made yet; never retried as a worker not
    started yet (a source such as ``dns://NAME:PORT`` waits for its name instead)."""


class SourceReadError(RPCDLError):
    """A worker source could not be read now (a file missing or half-written, a name that does not resolve, a
    registry that cannot be reached): not an empty list. The fleet (:class:`rpcdl.data.sources.Fleet`) keeps
    its last list and asks again later; the message says what failed.

    Example::

        >>> from rpcdl.data.sources import FileSource
        >>> FileSource("/no/such/workers.txt").addresses()
        Traceback (most recent call last):
          ...
        rpcdl.errors.SourceReadError: the file /no/such/workers.txt does not exist
    """


class RegistryReset(RPCDLError):
    """A Redis registry's epoch changed or went away (its server restarted without its data): its members are
    registering again, and what it lists now is not the fleet yet (:class:`rpcdl.registry.RegistryReader`)."""


class ForkServerExited(RPCDLError, RuntimeError):
    """A fork server (:class:`rpcdl.forkserver.ForkServer`) exited before it answered a request.

    Attributes:
        code: its exit code. 0: it had been idle for its ``idle_timeout`` and left as the request came, so
            a new server may serve it; 1: it could not import what it preloads (its error is on standard error).
    """

    def __init__(self, message: str, code: int | None):
        super().__init__(message)
        self.code = code

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.code)


class ConnectionLost(RPCDLError, ConnectionError):
    """The connection to a worker broke while a call was in flight."""


class HelloUnanswered(ConnectionLost):
    """The peer closed the connection after the client's hello without sending a byte.

    An rpcdl worker does that only when it cannot take the connection now; a
    server of another protocol (an rpcdataloader worker, say) every time.
    """


class WorkerFull(ConnectionLost):
    """The worker refused the connection: it holds as many connections in their handshake as it admits.

    Transient (a flood, or many clients connecting at once): the connection is
    retried (see ``rpcdl.rpc.dial`` and SECURITY.md).

    Attributes:
        pending: the connections in their handshake the worker said it held
            (``None`` with TLS, whose refusal does not say).
        limit: the most it admits at once (``None`` with TLS).
    """

    def __init__(self, peer: str, pending: int | None = None, limit: int | None = None):
        counts = f"{pending} of its limit of {limit}" if pending is not None else "it refused the TLS handshake"
        super().__init__(
            f"the worker {peer} is full of pending handshakes ({counts}: a flood of connections, or more "
            "clients connecting at once than it admits); it will be retried"
        )
        self.peer = peer
        self.pending = pending
        self.limit = limit

    def __reduce__(self) -> tuple:
        return type(self), (self.peer, self.pending, self.limit)


class WorkerTimeout(RPCDLError, TimeoutError, RuntimeError):
    """No answer came from a worker within the call's timeout.

    Also a :class:`RuntimeError`, as the error of torch's DataLoader when a batch times out.
    """


class WorkerHung(WorkerTimeout):
    """A worker stopped answering while the others went on (stopped, hung): a loader takes it out and sends
    its calls elsewhere before their timeout, and probes it until it answers again."""


class LimitExceeded(RPCDLError, ValueError):
    """A message would break a frame limit (:class:`rpcdl.transport.wire.Limits`).

    Raised by the side that would send it: the client for a call's function
    and arguments, the worker for an answer (then re-raised on the client like
    any exception of the call). The message names the limit and how to raise
    it. It is the user's data, not a failure of the worker: never retried.
    """


class DatasetMismatch(RPCDLError, RuntimeError):
    """A worker's copy of an :class:`~rpcdl.RPCDataset` differs in length from the others'."""


class RRefNotFound(RPCDLError, LookupError):
    """The worker holds no object under this reference (freed, or the worker restarted)."""


class CacheUnavailable(RPCDLError, RuntimeError):
    """The cache's store (a Redis server) failed and the cache was told to raise (``on_error="raise"``)."""


class RemoteError(RPCDLError, RuntimeError):
    """An exception raised on a worker whose type cannot be rebuilt locally.

    Attributes:
        type_name: qualified name of the remote exception type.
        remote_traceback: the traceback formatted on the worker.
    """

    def __init__(self, type_name: str, message: str, remote_traceback: str = ""):
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.remote_traceback = remote_traceback

    def __reduce__(self):
        return type(self), (self.type_name, str(self.args[0]).partition(": ")[2], self.remote_traceback)


class ChunkFailed(RPCDLError):
    """A worker's answer to a chunk of items (a loader's batches, a remote map's items) when some raised.

    It carries every item's value (``None`` where it failed) and the errors in
    place; the loader and the maps unpack it and raise each error at its own
    item (see :mod:`rpcdl.data.chunked_pass`), so a training loop never sees it.

    Args:
        values: one per item of the chunk.
        errors: index in the chunk -> the error's report (``rpcdl.serialization.pickling.dump_exception``).
        seconds: how long the chunk took on the worker.
        nbytes: the size of the values, as :func:`rpcdl.data.chunks.answer_bytes` counts it.
    """

    def __init__(self, values: list[Any], errors: dict[int, bytes], seconds: float, nbytes: int = 0):
        super().__init__(f"{len(errors)} of the {len(values)} items of a chunk raised")
        self.values, self.errors, self.seconds, self.nbytes = values, errors, seconds, nbytes

    def __reduce__(self):
        return type(self), (self.values, self.errors, self.seconds, self.nbytes)


def remote_origin(exc: BaseException) -> str | None:
    """Return the worker address an exception was raised on, or ``None`` if local."""
    return getattr(exc, "rpcdl_worker", None)


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is an infrastructure failure worth retrying on another worker.

    Exceptions raised by user code on a worker are never transient, even when
    their type is, say, :class:`ConnectionError`.
    """
    if remote_origin(exc) is not None:
        return False
    return isinstance(exc, (ConnectionError, TimeoutError)) and not isinstance(exc, AuthenticationError)
