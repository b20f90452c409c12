"""Same-host shared memory for answers: the socket carries headers, a segment carries the batches.

When a client and a worker share a host, a large answer crossing loopback TCP
costs two copies through the kernel and a system call per chunk. Here the
worker's side of each connection owns one **segment**: an anonymous file from
``memfd_create`` of ``RPCDL_SHM_BYTES`` bytes (default ``DEFAULT_BYTES``;
``0`` turns shared memory off), mapped by both processes. The worker copies an
answer's large out-of-band buffers (``MIN_SPAN_BYTES`` and up) into free
spans of it and sends a frame whose buffers are ``(offset, length)``
descriptors (the ``IN_SEGMENT`` flag of :mod:`rpcdl.transport.wire`); the
client hands out numpy views of its own mapping at those offsets, with no
copy. When the last view of a span is collected, the client queues the span's
offset and sends it back in a ``SEGMENT_RELEASE`` frame on its next frame (or
within a second when idle), and the worker frees it.

Choices, and why:

* **memfd, never a name.** The segment has no path in ``/dev/shm``, so no
  SIGKILL of either side can leave one behind: its memory goes when the last
  descriptor and the last mapping go, the kernel's bookkeeping.
* **Learned in the handshake, not guessed from the address.** The client's
  hello offers shared memory; after both sides have proved the token (inside
  the authenticated handshake, see :mod:`rpcdl.transport.handshake`), the client
  sends its host identity (boot id, pid and network namespaces); a worker with
  the same identity makes the segment, writes a random nonce in its first page
  and offers ``(pid, fd, size, nonce)``. The client opens
  ``/proc/<pid>/fd/<fd>``, maps it and checks the nonce; only then does it
  confirm. Opening that exact segment and reading the nonce is the proof of
  the same host, pid namespace and permissions. Anything failing leaves the
  connection on the socket, logged at DEBUG. The network namespace is part of
  the identity so that a worker reached through another namespace (how the
  cluster-in-a-box simulates hosts) stays on its link.
* **Compression forced on wins.** A connection whose compression mode is
  ``"on"`` (both sides asked for it) keeps its answers on the socket, to be
  compressed; ``"auto"`` never compresses on loopback anyway.
* **Bounded, never blocking.** Spans come from a first-fit allocator over the
  segment under one lock. A buffer that finds no room (the trainer still
  holds many batches) goes over the socket as before: never a wait, never a
  deadlock. The worker's memory for a connection is the segment's size at most.
* **Collated in place.** While a worker runs a call for a connection with a
  segment, :func:`rpcdl.transport.shm.empty` hands out tensors in free spans of it; the loader's
  default collate stacks each batch there (``rpcdl.data.fetch``), so the
  answer is already in the segment and is sent as a descriptor with no copy at
  all. A span is freed once the worker's tensor is gone and the client has
  released every view of it it was handed.
* **Pinned memory.** A call that asks for ``pin_memory`` where CUDA exists gets
  its buffers copied out of the segment into pinned memory (the socket path's
  ``torch.empty(..., pin_memory=True)``), and the span is released at once.

Threading: a :class:`WorkerSegment` is used by the threads running its
connection's calls (collating into it, placing answers) and its reader
(releasing spans); its allocator is guarded by one lock and copies happen
outside it. Finalizers of the worker's tensors in it only append to a deque,
drained under the lock (a garbage collection may run them while the lock is held). A :class:`ClientSegment`
hands out views on the thread reading its connection; finalizers of views may
run on any thread: they take no lock and change nothing another thread owns,
only drop the span's pages from this process's own mapping (``madvise``, at
once, so a trainer's memory does not grow with the batches it dropped) and
append the span to a deque, which whichever thread sends next drains
(:meth:`ClientSegment.release_frames`) to tell the worker.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import math
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from ..checks import environment_number
from ..errors import ProtocolError
from .context import SEGMENT, thread_context
from .control import drain, encode_span_release
from .gathered import as_view
from .wire import IN_SEGMENT, NOT_IN_SEGMENT, Frame, Kind

log = logging.getLogger("rpcdl.shm")

SHM_BYTES_ENV = "RPCDL_SHM_BYTES"
DEFAULT_BYTES = 256 << 20  #: bytes of a connection's segment unless ``RPCDL_SHM_BYTES`` says otherwise
MIN_BYTES = 1 << 20  #: the smallest segment allowed (besides 0, off)
MIN_SPAN_BYTES = 64 << 10  #: buffers this large go through the segment; smaller ones ride the socket
HEADER_BYTES = 4096  #: the segment's first page: the nonce
NONCE_BYTES = 32
_ALIGN = 4096
_cuda: bool | None = None


def can_pin() -> bool:
    """Whether pinned memory can be had here (CUDA exists); asked once per process."""
    global _cuda
    if _cuda is None:
        import torch

        _cuda = torch.cuda.is_available()
    return _cuda


def resolve_bytes(value: int | None = None) -> int:
    """The size of each connection's segment: ``value``, else ``RPCDL_SHM_BYTES``, else ``DEFAULT_BYTES``.

    Raises:
        ValueError: not a whole number of bytes, 0 (off) or at least ``MIN_BYTES``.

    Example::

        >>> resolve_bytes(0)
        0
    """
    where = "shared_memory"
    if value is None:
        value = environment_number(
            SHM_BYTES_ENV, DEFAULT_BYTES, int, "a whole number of bytes (0 turns shared memory off)"
        )
        where = SHM_BYTES_ENV
    if isinstance(value, bool) or not isinstance(value, int) or (value != 0 and value < MIN_BYTES):
        raise ValueError(
            f"{where} must be 0 (shared memory off) or a segment size of at least {MIN_BYTES} bytes "
            f"(default {DEFAULT_BYTES}), got {value!r}"
        )
    return value


def host_identity() -> bytes:
    """32 bytes equal in two processes of one boot, pid namespace and network namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            parts = [boot.read().strip(), os.readlink("/proc/self/ns/pid"), os.readlink("/proc/self/ns/net")]
    except OSError:
        parts = [f"unknown {os.getpid()} {os.urandom(8).hex()}"]  # never equal to another process's
    return hashlib.sha256("\n".join(parts).encode()).digest()


class SpanAllocator:
    """First-fit spans of a range ``[start, end)``, aligned to pages, with free neighbours merged.

    Not thread-safe: its owner holds a lock.

    Example::

        >>> spans = SpanAllocator(0, 3 * 4096)
        >>> spans.take(5000), spans.take(4096), spans.take(1)
        (0, 8192, None)
    """

    def __init__(self, start: int, end: int):
        self._free: list[list[int]] = [[start, end - start]] if end > start else []
        self._used: dict[int, int] = {}

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    @property
    def spans_in_use(self) -> int:
        return len(self._used)

    def take(self, size: int) -> int | None:
        """The offset of a free span of ``size`` bytes (rounded up to pages), or ``None`` if none is free."""
        size = -(-max(size, 1) // _ALIGN) * _ALIGN
        for index, (offset, length) in enumerate(self._free):
            if length >= size:
                if length == size:
                    del self._free[index]
                else:
                    self._free[index] = [offset + size, length - size]
                self._used[offset] = size
                return offset
        return None

    def give(self, offset: int) -> None:
        """Free the span at ``offset``.

        Raises:
            KeyError: no span in use starts there.
        """
        size = self._used.pop(offset)
        index = 0
        while index < len(self._free) and self._free[index][0] < offset:
            index += 1
        self._free.insert(index, [offset, size])
        if index + 1 < len(self._free) and offset + size == self._free[index + 1][0]:
            self._free[index][1] += self._free.pop(index + 1)[1]
        if index > 0 and self._free[index - 1][0] + self._free[index - 1][1] == offset:
            self._free[index - 1][1] += self._free.pop(index)[1]


@dataclasses.dataclass(frozen=True)
class Offer:
    """What a worker tells a client of its segment: where to open it and what to find there."""

    pid: int
    fd: int
    size: int
    nonce: bytes


class WorkerSegment:
    """The worker's segment for one connection: copies answers in, frees spans the client releases.

    Args:
        size: bytes of the segment, its first page included.

    Raises:
        OSError: the segment cannot be made (no ``memfd_create``, no memory).
    """

    def __init__(self, size: int):
        self.size = size
        self._fd = os.memfd_create("rpcdl-answers", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, size)
            self._map = mmap.mmap(self._fd, size)
        except BaseException:
            os.close(self._fd)
            raise
        self.nonce = os.urandom(NONCE_BYTES)
        self._map[:NONCE_BYTES] = self.nonce
        self._lock = threading.Lock()
        self._spans = SpanAllocator(HEADER_BYTES, size)
        self._holders: dict[int, int] = {}  # span offset -> the worker's tensor (1) + views handed to the client
        self._dropped: collections.deque[int] = collections.deque()  # spans whose worker tensor is gone
        self._base = np.frombuffer(self._map, np.uint8, 1).ctypes.data
        self._closed = False
        self.answers_in_segment = 0
        self.buffers_in_segment = 0
        self.buffers_on_socket = 0  # large ones that found no room
        self.buffers_in_place = 0  # of those in the segment: collated there, not copied

    def offer(self) -> Offer:
        return Offer(os.getpid(), self._fd, self.size, self.nonce)

    def place(self, frame: Frame) -> bool:
        """Copy ``frame``'s large buffers into free spans and mark the frame so; return whether any went in."""
        if frame.buffer_bytes < MIN_SPAN_BYTES:
            return False  # all small: they ride the socket, and the counters do not change
        offsets, placed, missed = [], 0, 0
        for buffer in frame.buffers:
            view = as_view(buffer)
            offset = None
            if view.nbytes >= MIN_SPAN_BYTES:
                offset, copy = self._span_for(view)
                if offset is None:
                    missed += 1
                else:
                    if copy:
                        self._map[offset : offset + view.nbytes] = view
                    placed += 1
            offsets.append(NOT_IN_SEGMENT if offset is None else offset)
        with self._lock:
            self.answers_in_segment += bool(placed)
            self.buffers_in_segment += placed
            self.buffers_on_socket += missed
        if not placed:
            return False
        frame.offsets = offsets
        frame.flags |= IN_SEGMENT
        return True

    def _span_for(self, view: memoryview) -> tuple[int | None, bool]:
        """The span to hand the client for ``view`` (one of ours: no copy), and whether to copy it there."""
        offset = np.frombuffer(view, np.uint8, 1).ctypes.data - self._base
        with self._lock:
            self._collect_dropped()
            if self._closed:
                return None, False
            if offset in self._holders:  # collated in place by empty()
                self._holders[offset] += 1
                self.buffers_in_place += 1
                return offset, False
            offset = self._spans.take(view.nbytes)
            if offset is not None:
                self._holders[offset] = 1
            return offset, True

    def empty(self, nbytes: int) -> np.ndarray | None:
        """A writable ``uint8`` array in a free span, freed once it is gone and the client released it; or ``None``."""
        with self._lock:
            self._collect_dropped()
            offset = None if self._closed else self._spans.take(nbytes)
            if offset is None:
                return None
            self._holders[offset] = 1
        array = np.frombuffer(self._map, np.uint8, nbytes, offset)
        weakref.finalize(array, self._dropped.append, offset)  # not the lock: a GC may run this under it
        return array

    def _drop(self, offset: int) -> bool:
        """Let go of one hold on the span at ``offset`` (the caller holds the lock); return whether it was held."""
        holders = self._holders.get(offset)
        if holders is None:
            return False
        if holders > 1:
            self._holders[offset] = holders - 1
        else:
            del self._holders[offset]
            self._spans.give(offset)
        return True

    def _collect_dropped(self) -> None:
        """Let go of the spans whose worker tensor is gone (the caller holds the lock)."""
        while self._dropped:
            self._drop(self._dropped.popleft())

    def release(self, offsets: tuple[int, ...]) -> None:
        """Free the spans the client released.

        Raises:
            ProtocolError: one of them is not a span in use (a broken client).
        """
        with self._lock:
            self._collect_dropped()
            for offset in offsets:
                if not self._drop(offset):
                    raise ProtocolError(f"the client released span {offset} of its segment, not one in use")

    def state(self) -> dict[str, int]:
        """The segment's counters, for the worker's stats."""
        with self._lock:
            self._collect_dropped()
            used, spans = self._spans.used_bytes, self._spans.spans_in_use
        return {
            "segment_bytes": self.size,
            "bytes_in_use": used,
            "spans_in_use": spans,
            "answers_in_segment": self.answers_in_segment,
            "buffers_in_segment": self.buffers_in_segment,
            "buffers_on_socket": self.buffers_on_socket,
            "buffers_in_place": self.buffers_in_place,
        }

    def close(self) -> None:
        """Stop placing answers and close the descriptor; the mapping goes with this object."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        os.close(self._fd)


class ClientSegment:
    """The client's mapping of its worker's segment: views out, released offsets back.

    Make one with :meth:`open`.
    """

    def __init__(self, memory: mmap.mmap):
        self.size = len(memory)
        self._map = memory
        self._released: collections.deque[int] = collections.deque()  # span offsets, appended by finalizers
        self.base_address = np.frombuffer(memory, np.uint8, 1).ctypes.data

    @classmethod
    def open(cls, offer: Offer) -> ClientSegment | None:
        """Map the segment ``offer`` names if this process can open it and finds the nonce; else ``None``."""
        try:
            fd = os.open(f"/proc/{offer.pid}/fd/{offer.fd}", os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            log.debug("shared memory not used: cannot open the worker's segment: %s", exc)
            return None
        try:
            if os.fstat(fd).st_size != offer.size or offer.size < HEADER_BYTES:
                log.debug("shared memory not used: the segment is not %d bytes", offer.size)
                return None
            memory = mmap.mmap(fd, offer.size)
        except OSError as exc:
            log.debug("shared memory not used: cannot map the worker's segment: %s", exc)
            return None
        finally:
            os.close(fd)
        if memory[:NONCE_BYTES] != offer.nonce:
            log.debug("shared memory not used: the segment does not hold the worker's nonce")
            memory.close()
            return None
        return cls(memory)

    def contains(self, address: int) -> bool:
        """Whether memory at ``address`` lies in this mapping (``tensor.data_ptr()``, say)."""
        return self.base_address <= address < self.base_address + self.size

    def view(self, offset: int, size: int) -> np.ndarray:
        """A writable ``uint8`` view of the span at ``offset``; released once collected.

        Raises:
            ProtocolError: the span is not inside the segment's data.
        """
        if offset < HEADER_BYTES or offset % _ALIGN or offset + size > self.size:
            raise ProtocolError(f"the worker sent span {offset}+{size}, outside its segment of {self.size} bytes")
        array = np.frombuffer(self._map, np.uint8, size, offset)
        weakref.finalize(array, self._let_go, offset, size)
        return array

    def _let_go(self, offset: int, size: int) -> None:
        # A finalizer (see the module): our pages of the span leave this process's RSS now (the data stays in
        # the segment, the worker's); the span itself goes back with the next frame sent.
        self._map.madvise(mmap.MADV_DONTNEED, offset, size)
        self._released.append(offset)

    def copy_out(self, offset: int, size: int, into: Any) -> Any:
        """Copy the span at ``offset`` into ``into`` (pinned memory, say) and release the span now."""
        np.copyto(np.frombuffer(memoryview(into).cast("B"), np.uint8), self.view(offset, size))
        return into

    def release_frames(self) -> list[Frame]:
        """A ``SEGMENT_RELEASE`` frame of the spans released since the last call, or none."""
        offsets = drain(self._released)
        return [Frame(Kind.SEGMENT_RELEASE, payload=encode_span_release(offsets))] if offsets else []

    @property
    def releases_waiting(self) -> bool:
        return bool(self._released)


def empty(shape: tuple[int, ...], dtype: Any) -> Any:
    """A new CPU tensor in the shared segment of the call this thread answers, or ``None`` if there is none.

    ``None`` also where the segment has no room or the tensor is smaller than
    ``MIN_SPAN_BYTES``: the caller allocates as usual then.
    """
    segment = thread_context.value[SEGMENT]
    if segment is None:
        return None
    nbytes = math.prod(shape) * dtype.itemsize  # not numpy's prod: it costs microseconds per batch
    array = segment.empty(nbytes) if nbytes >= MIN_SPAN_BYTES else None
    if array is None:
        return None
    import torch

    return torch.from_numpy(array).view(dtype).view(shape)


def receiver(
    segment: ClientSegment | None, pins: Callable[[int], bool], allocate: Callable[[int, int], Any]
) -> Callable[[int, int, int], Any] | None:
    """What a :class:`~rpcdl.transport.frame_protocol.FrameProtocol` calls for a buffer in the segment.

    Args:
        segment: the connection's segment, or ``None`` (then no receiver).
        pins: whether the call with this id wants pinned memory.
        allocate: memory for a buffer of that call, pinned where asked.
    """
    if segment is None:
        return None

    def receive(call_id: int, offset: int, size: int) -> Any:
        if pins(call_id):
            return segment.copy_out(offset, size, allocate(call_id, size))
        return segment.view(offset, size)

    return receive
