"""Remote references: objects that stay on a worker, named by an id.

A worker keeps the objects behind RRefs in its :class:`RRefStore`. The process
that created a reference (by :func:`rpcdl.remote`, ``rpc_async(..., rref=True)``
or by receiving an RRef a worker returned) holds it; when it holds it no more,
the worker is told to free the object. Copies of an RRef that reach other
processes by plain pickling are borrowed: they can be used but do not free.
An RRef sent in a call to its owner arrives there as the object itself.

Threading model:

* **The worker's store** (:class:`RRefStore`): its entries and its shared
  objects (their records and holder counts) are guarded by its lock, taken by
  every access; the calls running on the worker's threads wait for an entry's
  object on the entry's own event, and for a shared object being built on the
  record's own event. A shared object's value or error is written once, by
  the thread that builds it, before that event is set, and read only after.
* **This process's handles** (:class:`Handle`, one per remote object, shared by
  every RRef naming it): the registry ``_handles`` is guarded by
  ``_handles_lock``, taken by every access. A handle's death is noticed by a
  weak reference's callback, which may run in any thread, at any allocation
  (the thread may hold any lock, this one included): so it only appends to two
  lock-free queues (:class:`collections.deque`, whose ``append`` is atomic),
  the registry's ``_gone`` (pruned under the lock by the next thread that
  takes it) and its connection's releases (drained by the event loop, which
  sends them with the next frames or on its tick). It takes no lock, does no I/O and changes nothing else.
* Fetching an object (:meth:`RRef.to_here`) is a synchronous call
  (:func:`rpcdl.rpc.invoke.call_and_wait`) in the calling thread.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import os
import secrets
import threading
import time
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
_SAY_WAITING_EVERY = 10.0  # seconds between two lines saying a call waits for another's build of a shared object
log = logging.getLogger("rpcdl.worker")


def new_uid() -> int:
    """A fresh reference id, unique with overwhelming probability."""
    return secrets.randbits(63) | 1


class _Entry:
    __slots__ = ("error", "holder", "ready", "released", "shared", "value")

    def __init__(self, holder: object, shared: _Shared | None = None):
        self.value: Any = None
        self.error: BaseException | None = None
        self.ready = threading.Event()
        self.holder = holder
        self.released = False
        self.shared = shared  # the shared object's record this entry holds a count of, if any


class _Shared:
    """One object shared by the entries of every holder that sent the same definition (see :meth:`RRefStore.share`).

    ``holders`` counts the entries naming it and the calls building or awaiting
    it; at zero the store forgets it, and the object goes with its last entry.
    """

    __slots__ = ("error", "holders", "key", "ready", "value")

    def __init__(self, key: bytes):
        self.key = key
        self.value: Any = None
        self.error: BaseException | None = None
        self.ready = threading.Event()  # set once built, or once the build raised
        self.holders = 0


class RRefStore:
    """The objects a worker keeps for remote references, by id.

    Entries are announced (:meth:`expect`) in the order calls arrive, so a call
    using a reference waits for the call creating it, and are freed when their
    holder releases them or disconnects. A holder that disconnected
    (:meth:`release_holder`) holds nothing any more: an entry announced or added
    for it later (a call its session had read already, run after the
    disconnection was noticed) is freed as soon as it is complete.

    An object may also be shared (:meth:`share`): the holders that send the same
    definition (the same bytes, under the same credentials) get entries of
    their own naming one object, built once and freed with the last entry.

    Threading model: every field is guarded by ``_lock``, taken by every
    access; an entry's object is awaited on the entry's own event, a shared
    object being built on its record's.

    Args:
        secret: the credentials every client of this worker proved (its token's
            secret), or ``None``: a shared object's key is a digest of its
            definition under them, so only clients holding them share it.
    """

    def __init__(self, secret: bytes | None = None):
        self._secret = secret
        self._entries: dict[int, _Entry] = {}
        self._shared: dict[bytes, _Shared] = {}
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

    def shared_count(self) -> int:
        """How many shared objects the store keeps (each built once, for every holder of its definition)."""
        with self._lock:
            return len(self._shared)

    def sharing(self, kind: str, definition: bytes) -> int:
        """How many calls build, await or hold the one object of ``definition`` (0: none is kept).

        Example::

            >>> store = RRefStore()
            >>> _ = store.share("list", b"recipe", lambda: [0] * 3, holder="trainer-1")
            >>> store.sharing("list", b"recipe"), store.sharing("list", b"other")
            (1, 0)
        """
        with self._lock:
            record = self._shared.get(self._key(kind, definition))
            return 0 if record is None else record.holders

    def share(self, kind: str, definition: bytes, build: Callable[[], Any], holder: object) -> tuple[int, Any]:
        """Add an entry for ``holder`` naming the one object built from ``definition``; build it if none is kept.

        Holders that send the same ``definition`` bytes for the same ``kind``
        (under the store's credentials) share one object: the first builds it
        (``build()``, in the calling thread), those arriving meanwhile wait for
        that build, and the object is freed when the last entry naming it is
        released. A build that raises raises for every call waiting for it,
        and is not kept: the next call builds again.

        Args:
            kind: what the definition defines (a namespace: two kinds never share).
            definition: the bytes defining the object (the pickled recipe the holder sent).
            build: makes the object from ``definition``.
            holder: the connection holding the new entry.

        Returns:
            ``(uid, object)``: the new entry's id and the shared object.

        Raises:
            Exception: what ``build`` raised, here or in the call that built it.

        Example::

            >>> store = RRefStore()
            >>> a = store.share("list", b"recipe", lambda: [0] * 3, holder="trainer-1")
            >>> b = store.share("list", b"recipe", lambda: [0] * 3, holder="trainer-2")
            >>> a[1] is b[1], store.shared_count()
            (True, 1)
        """
        key = self._key(kind, definition)
        with self._lock:
            record = self._shared.get(key)
            builds = record is None
            if record is None:
                record = self._shared[key] = _Shared(key)
            record.holders += 1  # the object stays while this call builds, awaits or holds it
        if builds:
            try:
                record.value = build()
            except BaseException as exc:
                record.error = exc
                with self._lock:
                    self._unshare(record)
                    if self._shared.get(key) is record:  # not kept: the next call builds again
                        del self._shared[key]
                record.ready.set()
                raise
            record.ready.set()
        else:
            self._await_build(record, kind)
            if record.error is not None:
                with self._lock:
                    self._unshare(record)
                raise raisable(record.error)  # the record's error stays free of this frame
        uid = new_uid()
        entry = _Entry(holder, record)
        entry.value = record.value
        entry.ready.set()
        with self._lock:
            if self._holder_gone(holder):
                self._unshare(record)
            else:
                self._entries[uid] = entry
        return uid, record.value

    def _key(self, kind: str, definition: bytes) -> bytes:
        named = kind.encode() + b"\0" + definition
        if self._secret is None:
            return hashlib.sha256(named).digest()
        return hmac.new(self._secret, named, hashlib.sha256).digest()

    def _await_build(self, record: _Shared, kind: str) -> None:
        """Wait for another call's build of ``record``, saying every few seconds what is awaited."""
        started = time.monotonic()
        while not record.ready.wait(_SAY_WAITING_EVERY):
            log.info(
                "a call waits for another client's build of the same %s (for %.0fs): it shares that one",
                kind,
                time.monotonic() - started,
            )

    def _unshare(self, record: _Shared) -> None:
        """One holder of ``record`` less (under ``_lock``); the last one forgets it."""
        record.holders -= 1
        if not record.holders and self._shared.get(record.key) is record:
            del self._shared[record.key]

    def _drop(self, uid: int, entry: _Entry) -> None:
        """Forget entry ``uid`` (under ``_lock``), and its count of the shared object it names."""
        del self._entries[uid]
        if entry.shared is not None:
            self._unshare(entry.shared)

    def complete(self, uid: int, value: Any = None, error: BaseException | None = None) -> None:
        with self._lock:
            entry = self._entries.get(uid)
            if entry is None:
                return
            if entry.released:
                self._drop(uid, entry)
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
                self._drop(uid, entry)
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

    def share(self, kind: str, definition: bytes, build: Callable[[], Any]) -> tuple[int, Any]:
        """:meth:`RRefStore.share` for this connection's holder."""
        return self.store.share(kind, definition, build, self.holder)


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


def shared_rref(kind: str, definition: bytes, build: Callable[[], T]) -> RRef[T]:
    """Run on a worker, in a call: a reference to the one object every client sending ``definition`` shares.

    The first call builds it (``build()``), calls that arrive meanwhile wait
    for that build; each caller holds its own reference, and the object is
    freed once no caller holds one (see ``RRefStore.share``). Returned
    from the call, it reaches the caller as a remote reference it holds.

    Args:
        kind: what the definition defines (objects of two kinds are never shared).
        definition: the bytes the caller sent that define the object (a pickled recipe).
        build: makes the object (it may raise: then every call waiting for it raises).

    Returns:
        an RRef to the shared object, for the caller.

    Raises:
        RuntimeError: not called by a worker running a call.

    Example::

        >>> def build_shared(recipe: bytes) -> RRef:  # sent to a worker with rpcdl.rpc_sync
        ...     return shared_rref("my.lookup_table", recipe, lambda: pickle.loads(recipe))
    """
    view = current_peer()[1]
    if not isinstance(view, StoreView):
        raise RuntimeError("shared_rref() runs on a worker, in a call: send it there with rpcdl.rpc_sync")
    uid, value = view.share(kind, definition, build)
    rref: RRef[T] = RRef(value)
    rref._uid_in_store = uid  # pickled in the answer as the entry just added, which the caller holds
    return rref


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
