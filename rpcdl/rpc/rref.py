"""Remote references: objects that stay on a worker, named by an id.

A worker keeps the objects behind RRefs in its :class:`RRefStore`. The process
that created a reference (by :func:`rpcdl.remote`, ``rpc_async(..., rref=True)``
or by receiving an RRef a worker returned) holds it; when it holds it no more,
the worker is told to free the object. Copies of an RRef that reach other
processes by plain pickling are borrowed: they can be used but do not free.
An RRef sent in a call to its owner arrives there as the object itself.

Threading model:

* **The worker's store** (:class:`RRefStore`): its entries are guarded by its
  lock, taken by every access; the calls running on the worker's threads wait
  for an entry's object on the entry's own event.
* **This process's handles** (:class:`Handle`, one per remote object, shared by
  every RRef naming it): the registry ``_handles`` is guarded by
  ``_handles_lock``, taken by every access. A handle's death is noticed by a
  weak reference's callback, which may run in any thread, at any allocation
  (the thread may hold any lock, this one included): so it only appends to two
  lock-free queues (:class:`collections.deque`, whose ``append`` is atomic),
  the registry's ``_gone`` (pruned under the lock by the next thread that
  takes it) and its connection's releases (drained by whichever thread sends
  on it next). It takes no lock, does no I/O and changes nothing else.
* Fetching an object (:meth:`RRef.to_here`) is a synchronous call
  (:func:`rpcdl.rpc.invoke.call_and_wait`) in the calling thread.
"""

from __future__ import annotations

import collections
import os
import secrets
import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from ..errors import RRefNotFound
from ..serialization.pickling import current_connection, current_peer
from ..transport.control import drain
from .calls import raisable
from .invoke import call_and_wait

T = TypeVar("T")
_MISSING = object()


def new_uid() -> int:
    """A fresh reference id, unique with overwhelming probability."""
    return secrets.randbits(63) | 1


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
    holder releases them or disconnects. A holder that disconnected
    (:meth:`release_holder`) holds nothing any more: an entry announced or added
    for it later (a call its session had read already, run after the
    disconnection was noticed) is freed as soon as it is complete.

    Threading model: every field is guarded by ``_lock``, taken by every
    access; an entry's object is awaited on the entry's own event.
    """

    def __init__(self):
        self._entries: dict[int, _Entry] = {}
        self._lock = threading.Lock()
        # holders released, by id, weakly (no callback: pruned under the lock); a live one is compared by identity
        self._gone: dict[int, weakref.ref] = {}

    def _holder_gone(self, holder: object) -> bool:
        ref = self._gone.get(id(holder))
        return ref is not None and ref() is holder

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def expect(self, uid: int, holder: object) -> None:
        with self._lock:
            entry = self._entries.setdefault(uid, _Entry(holder))
            if self._holder_gone(holder):
                entry.released = True  # freed once complete

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
            if not self._holder_gone(holder):
                self._entries[uid] = entry
        return uid

    def resolve(self, uid: int, timeout: float | None = None) -> Any:
        with self._lock:
            entry = self._entries.get(uid)
        if entry is None:
            raise RRefNotFound(f"this worker holds no object for RRef {uid:#x}: it was freed, or the worker restarted")
        if not entry.ready.is_set() and not entry.ready.wait(timeout):  # set: no lock to take
            raise TimeoutError(f"the call creating RRef {uid:#x} did not finish within {timeout}s")
        if entry.error is not None:
            raise raisable(entry.error)  # the entry's error stays free of this frame, which holds the entry
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
        """Free every entry held by ``holder`` (a disconnected client), and those it is given later; return how
        many it held."""
        with self._lock:
            self._gone = {key: ref for key, ref in self._gone.items() if ref() is not None}
            self._gone[id(holder)] = weakref.ref(holder)
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


class Holder(Protocol):
    """What a reference held over a connection needs of it (a :class:`~rpcdl.rpc.connection.Connection`)."""

    @property
    def closed(self) -> bool: ...  # a retried call then holds the object anew, over its new connection

    def release(self, uid: int) -> None: ...  # this process let go of object ``uid``: queue its release

    def credentials(self) -> dict[str, Any]: ...  # the token and TLS options, for calls on the owner


class Handle:
    """The shared state of every RRef object naming one remote object in this process.

    Args:
        owner: the worker keeping the object, ``"host:port"``.
        uid: the object's id there.
        connection: the connection that created or received it when this process holds the object (then the
            object is freed once no handle names it), or ``None`` when it only borrows it.
    """

    __slots__ = ("__weakref__", "connection", "owner", "uid")

    def __init__(self, owner: str, uid: int, connection: Holder | None):
        self.owner, self.uid, self.connection = owner, uid, connection


_handles: dict[tuple[str, int], weakref.ref[Handle]] = {}  # guarded by _handles_lock
_handles_lock = threading.Lock()
_gone: collections.deque[tuple[str, int]] = collections.deque()  # handles that died: a lock-free queue


def _when_gone(key: tuple[str, int], connection: Holder | None) -> Callable[[weakref.ref], None]:
    """The callback of a handle's weak reference: two atomic appends, nothing else (it runs in any thread, at
    any allocation, maybe in a thread holding a lock)."""
    pid = os.getpid()

    def gone(_: weakref.ref) -> None:
        _gone.append(key)
        if connection is not None and os.getpid() == pid:  # a forked child frees nothing of its parent's
            connection.release(key[1])

    return gone


def _handle(owner: str, uid: int, connection: Holder | None) -> Handle:
    """The live handle of ``(owner, uid)`` (under ``_handles_lock``); a new one if there is none, or if
    ``connection`` holds the object and the handle there is borrowed or held over a connection closed since
    (a call retried on a new connection: the worker frees the object when ``connection`` lets it go)."""
    for key in drain(_gone):  # forget the handles that died, unless their key names a newer one
        ref = _handles.get(key)
        if ref is not None and ref() is None:
            del _handles[key]
    key = (owner, uid)
    ref = _handles.get(key)
    handle = ref() if ref is not None else None
    if handle is None or (
        connection is not None
        and handle.connection is not connection
        and (handle.connection is None or handle.connection.closed)
    ):
        handle = Handle(owner, uid, connection)
        _handles[key] = weakref.ref(handle, _when_gone(key, connection))
    return handle


def holding_handle(owner: str, uid: int, connection: Holder) -> Handle:
    """The handle of a reference this process holds (over ``connection``): freeing it frees the remote object."""
    with _handles_lock:
        return _handle(owner, uid, connection)


def borrowed_handle(owner: str, uid: int) -> Handle:
    """The handle of a reference this process uses without holding it."""
    with _handles_lock:
        return _handle(owner, uid, None)


def held_rref(owner: str, uid: int, connection: Holder) -> RRef:
    """A remote reference to the object ``uid`` on ``owner`` that this process holds, over ``connection``.

    Example::

        >>> rref = held_rref("127.0.0.1:6543", new_uid(), connection)  # doctest: +SKIP
    """
    return _rref_of(holding_handle(owner, uid, connection))


def _rref_of(handle: Handle) -> RRef:
    rref = RRef()
    rref._handle = handle
    return rref


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
        self._handle: Handle | None = None
        self._uid_in_store: int | None = None

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
        connection = self._handle.connection
        credentials = connection.credentials() if connection is not None else {}
        return call_and_wait(self._handle.owner, _identity, (self,), timeout=timeout, **credentials)

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
        return _rref_of(holding_handle(peer, uid, current_connection()))
    return _rref_of(borrowed_handle(owner, uid))
