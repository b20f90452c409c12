"""Remote references: objects that stay on a worker, named by an id.

A worker keeps the objects behind RRefs in its :class:`RRefStore`. The process
that created a reference (by :func:`rpcdl.remote`, ``rpc_async(..., rref=True)``
or by receiving an RRef a worker returned) holds it; when it holds it no more,
the worker is told to free the object. Copies of an RRef that reach other
processes by plain pickling are borrowed: they can be used but do not free.
An RRef sent in a call to its owner arrives there as the object itself.
"""

from __future__ import annotations

import os
import secrets
import threading
import weakref
from typing import Any, Generic, TypeVar

from ..errors import RRefNotFound
from ..serialization.pickling import current_connection, current_peer

T = TypeVar("T")
_MISSING = object()


def new_uid() -> int:
    """A fresh reference id, unique with overwhelming probability."""
    return secrets.randbits(63) | 1


class _Calls:
    """How an RRef reaches its owner: :mod:`rpcdl.rpc.client` installs its ``rpc_sync`` when it loads.

    (The client makes and receives RRefs, so it imports this module; this one
    must not import the client back.) A remote RRef exists only once a client
    connection has made or received it, so the client is there to use.
    """

    def __init__(self) -> None:
        self.rpc_sync: Any = None


_calls = _Calls()


def install_rpc_sync(rpc_sync: Any) -> None:
    """Let RRefs fetch their object with ``rpc_sync`` (called once by :mod:`rpcdl.rpc.client`)."""
    _calls.rpc_sync = rpc_sync


class _Entry:
    __slots__ = ("error", "holder", "ready", "released", "value")

    def __init__(self, holder: object):
        self.value: Any = None
        self.error: BaseException | None = None
        self.ready = threading.Event()
        self.holder = holder
        self.released = False


class RRefStore:
    """The objects a worker keeps for remote references, by id.

    Entries are announced (:meth:`expect`) in the order calls arrive, so a call
    using a reference waits for the call creating it, and are freed when their
    holder releases them or disconnects.
    """

    def __init__(self):
        self._entries: dict[int, _Entry] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def expect(self, uid: int, holder: object) -> None:
        with self._lock:
            self._entries.setdefault(uid, _Entry(holder))

    def complete(self, uid: int, value: Any = None, error: BaseException | None = None) -> None:
        with self._lock:
            entry = self._entries.get(uid)
            if entry is None:
                return
            if entry.released:
                del self._entries[uid]
            else:
                entry.value, entry.error = value, error
        entry.ready.set()

    def add(self, value: Any, holder: object) -> int:
        uid = new_uid()
        entry = _Entry(holder)
        entry.value = value
        entry.ready.set()
        with self._lock:
            self._entries[uid] = entry
        return uid

    def resolve(self, uid: int, timeout: float | None = None) -> Any:
        entry = self._entries.get(uid)
        if entry is None:
            raise RRefNotFound(f"this worker holds no object for RRef {uid:#x}: it was freed, or the worker restarted")
        if not entry.ready.is_set() and not entry.ready.wait(timeout):  # set: no lock to take
            raise TimeoutError(f"the call creating RRef {uid:#x} did not finish within {timeout}s")
        if entry.error is not None:
            raise entry.error
        return entry.value

    def release(self, uid: int) -> None:
        with self._lock:
            entry = self._entries.get(uid)
            if entry is None:
                return
            if entry.ready.is_set():
                del self._entries[uid]
            else:
                entry.released = True

    def release_holder(self, holder: object) -> int:
        """Free every entry held by ``holder`` (a disconnected client); return how many."""
        with self._lock:
            uids = [uid for uid, entry in self._entries.items() if entry.holder is holder]
        for uid in uids:
            self.release(uid)
        return len(uids)


class StoreView:
    """A worker's store as seen while (un)pickling one connection's messages."""

    __slots__ = ("holder", "store", "timeout")

    def __init__(self, store: RRefStore, holder: object, timeout: float):
        self.store, self.holder, self.timeout = store, holder, timeout

    def add(self, value: Any) -> int:
        return self.store.add(value, self.holder)

    def resolve(self, uid: int) -> Any:
        return self.store.resolve(uid, self.timeout)


class _Handle:
    """The shared state of every RRef object naming one remote object in this process."""

    __slots__ = ("__weakref__", "connection", "owner", "uid")

    def __init__(self, owner: str, uid: int, connection: Any):
        self.owner, self.uid, self.connection = owner, uid, connection


_handles: weakref.WeakValueDictionary[tuple[str, int], _Handle] = weakref.WeakValueDictionary()
_handles_lock = threading.Lock()


def _release(connection: Any, uid: int, pid: int) -> None:
    if os.getpid() == pid:
        connection.release(uid)


def holding_handle(owner: str, uid: int, connection: Any) -> _Handle:
    """The handle of a reference this process holds: freeing it frees the remote object."""
    with _handles_lock:
        handle = _handles.get((owner, uid))
        if handle is None or handle.connection is None:
            handle = _Handle(owner, uid, connection)
            weakref.finalize(handle, _release, connection, uid, os.getpid())
            _handles[(owner, uid)] = handle
        return handle


def borrowed_handle(owner: str, uid: int) -> _Handle:
    """The handle of a reference this process uses without holding it."""
    with _handles_lock:
        handle = _handles.get((owner, uid))
        if handle is None:
            handle = _Handle(owner, uid, None)
            _handles[(owner, uid)] = handle
        return handle


class RRef(Generic[T]):
    """A reference to an object, local or living on a worker.

    ``RRef(value)`` makes a local reference; a worker function that returns one
    sends back a remote reference to ``value``, which stays on the worker.
    :func:`rpcdl.remote` and ``rpc_async(..., rref=True)`` return remote references.

    Example::

        >>> rref = rpcdl.remote("127.0.0.1:6543", torch.ones, (3,))  # doctest: +SKIP
        >>> rpcdl.rpc_sync(rref.owner(), torch.sum, (rref,))  # arrives as the tensor  # doctest: +SKIP
        tensor(3.)
        >>> rref.to_here()  # doctest: +SKIP
        tensor([1., 1., 1.])
    """

    __slots__ = ("__weakref__", "_handle", "_uid_in_store", "_value")

    def __init__(self, value: T = _MISSING):  # type: ignore[assignment]
        self._value = value
        self._handle: _Handle | None = None
        self._uid_in_store: int | None = None

    @classmethod
    def _from_handle(cls, handle: _Handle) -> RRef:
        rref = cls()
        rref._handle = handle
        return rref

    def is_owner(self) -> bool:
        """Whether the object lives in this process."""
        return self._handle is None

    def owner(self) -> str:
        """The ``host:port`` of the worker holding the object, ``""`` if it is local."""
        return self._handle.owner if self._handle is not None else ""

    def local_value(self) -> T:
        """Return the object when it lives in this process.

        Raises:
            RuntimeError: the object lives on a worker; use :meth:`to_here`.
        """
        if self._handle is not None:
            raise RuntimeError(f"this RRef is owned by worker {self._handle.owner}; use to_here() to fetch a copy")
        return self._value

    def to_here(self, timeout: float = 120.0) -> T:
        """Return the object, copied from its worker when it lives on one."""
        if self._handle is None:
            return self._value
        if _calls.rpc_sync is None:
            raise RuntimeError("RRef.to_here() needs rpcdl.rpc.client: import rpcdl.rpc.client first")
        connection = self._handle.connection
        credentials = connection.credentials() if connection is not None else {}
        return _calls.rpc_sync(self._handle.owner, _identity, (self,), timeout=timeout, **credentials)

    def __repr__(self) -> str:
        if self._handle is None:
            return f"RRef(local {type(self._value).__name__})"
        return f"RRef(owner={self._handle.owner!r}, id={self._handle.uid:#x})"

    def __reduce__(self):
        peer, store = current_peer()
        if self._handle is None:
            if store is None:
                return RRef, (self._value,)
            if self._uid_in_store is None:
                self._uid_in_store = store.add(self._value)
            return _rref_from_wire, ("sender", self._uid_in_store)
        if peer is not None and peer == self._handle.owner:
            return _rref_from_wire, ("recipient", self._handle.uid)
        return _rref_from_wire, ("other", self._handle.uid, self._handle.owner)


def _identity(value: Any) -> Any:
    return value


def remote_id(rref: RRef) -> int:
    """The id of a remote reference on its owner: a call to the owner can name the object by it.

    The caller keeps ``rref`` alive until the call is sent (while it holds the
    reference, the owner keeps the object). On the owner, :func:`resolve_here`
    turns the id back into the object.

    Raises:
        ValueError: ``rref`` is local (it has no owner to name it to).
    """
    handle = rref._handle
    if handle is None:
        raise ValueError("a local RRef has no remote id: it is not kept by a worker")
    return handle.uid


def resolve_here(uid: int) -> Any:
    """The object a worker keeps under ``uid`` (:func:`remote_id`), for the call being run on it.

    Raises:
        RRefNotFound: this process is not a worker running a call, or it holds
            no object under ``uid`` (freed, or the worker restarted).
    """
    store = current_peer()[1]
    if store is None:
        raise RRefNotFound(f"RRef {uid:#x} was sent to its owner, but this process is not an rpcdl worker")
    return store.resolve(uid)


def _rref_from_wire(kind: str, uid: int, owner: str | None = None) -> Any:
    if kind == "recipient":
        return resolve_here(uid)
    if kind == "sender":
        peer = current_peer()[0]
        if peer is None:
            raise RRefNotFound(f"RRef {uid:#x} arrived outside an rpcdl call")
        return RRef._from_handle(holding_handle(peer, uid, current_connection()))
    return RRef._from_handle(borrowed_handle(owner, uid))
