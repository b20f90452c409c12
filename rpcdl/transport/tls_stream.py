"""A TLS connection that one thread may read while another writes.

OpenSSL forbids using one ``SSL`` object from two threads at once, and
Python's :class:`ssl.SSLSocket` adds no lock. rpcdl reads a connection in one
thread while another sends on it (a worker answers while its reader waits for
the next call; a client sends calls while its reader waits for answers). Done
on a bare ``SSLSocket``, the two threads clobber the object's state: a read
that merely timed out is then reported as an end of file, and a healthy
connection is dropped within a second or two of idling.

:class:`TLSStream` keeps the socket non-blocking and runs every ``SSL`` call
under one lock, which it never holds while waiting: a thread waits for its
socket to be readable or writable outside the lock, then retries. The receive
and send timeouts of :func:`rpcdl.transport.wire.io_stream` are kept here, the
kernel's being of no use to a non-blocking socket.

Threading model: any number of threads; at most one inside OpenSSL at a time.
"""

from __future__ import annotations

import errno
import select
import socket
import ssl
import threading
import time


class TLSStream:
    """An :class:`ssl.SSLSocket`, safe to read and write from two threads at once.

    Args:
        sock: a connected TLS socket whose handshake is done.
        receive_timeout: seconds a read waits for data before raising
            :class:`BlockingIOError` (``None``: forever).
        send_timeout: seconds a send waits for room before raising
            :class:`BlockingIOError` (``None``: forever).

    Example::

        >>> stream = TLSStream(context.wrap_socket(sock), receive_timeout=0.1, send_timeout=120)  # doctest: +SKIP
        >>> stream.sendall(b"hello")  # doctest: +SKIP
    """

    def __init__(self, sock: ssl.SSLSocket, receive_timeout: float | None, send_timeout: float | None):
        sock.setblocking(False)
        self._tls = sock
        self._lock = threading.Lock()
        self.receive_timeout = receive_timeout
        self.send_timeout = send_timeout

    def fileno(self) -> int:
        return self._tls.fileno()

    def pending(self) -> int:
        """Bytes decrypted and not read yet (a poll of the socket does not see them)."""
        with self._lock:
            return self._tls.pending()

    def recv_into(self, buffer, nbytes: int = 0) -> int:
        """Read into ``buffer`` (its first ``nbytes``, or all of it) as much as has arrived; 0 at the end of the stream.

        OpenSSL gives at most one record (16 KiB) per read: records already
        arrived are read in one go, under one turn of the lock, so a large
        buffer costs one call here and not one per record.
        """
        view = memoryview(buffer).cast("B")
        if nbytes:
            view = view[:nbytes]
        return self._retry(lambda: self._read_records(view), self.receive_timeout)

    def _read_records(self, view: memoryview) -> int:
        """Records into ``view`` until it is full or none is left to read; raises ``SSLWantReadError`` if none was."""
        read = self._read(view.nbytes, view)
        if not read:
            return 0
        size = view.nbytes
        while read < size:
            try:
                more = self._read(size - read, view[read:])
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                break
            if not more:
                break
            read += more
        return read

    def _read(self, size: int, view: memoryview) -> int:
        """One record into ``view``; 0 at the end (a peer that closed without a TLS close_notify included, as
        :class:`ssl.SSLSocket` has it with ``suppress_ragged_eofs``)."""
        return self._tls.recv_into(view, size)

    def send(self, data) -> int:
        """Send ``data`` whole (TLS cannot send part of a record); return its length.

        When the socket is full the same data is offered again, as OpenSSL requires.
        """
        return self._retry(lambda: self._tls.send(data), self.send_timeout)

    def _retry(self, operation, timeout: float | None):
        """Run ``operation`` under the lock until OpenSSL can complete it, waiting outside the lock."""
        deadline = None
        while True:
            with self._lock:
                try:
                    return operation()
                except ssl.SSLWantReadError:
                    event = select.POLLIN
                except ssl.SSLWantWriteError:
                    event = select.POLLOUT
            if deadline is None and timeout is not None:
                deadline = time.monotonic() + timeout
            self._wait(event, deadline)

    def sendall(self, data) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            sent = self.send(view)
            view = view[sent:]

    def shutdown(self, how: int) -> None:
        """Shut the TCP connection down (waking a thread that waits on it); no TLS close_notify."""
        socket.socket.shutdown(self._tls, how)

    def close(self) -> None:
        self._tls.close()

    def getpeername(self):
        return self._tls.getpeername()

    def _wait(self, event: int, deadline: float | None) -> None:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise BlockingIOError(errno.EAGAIN, "timed out")
        poller = select.poll()
        poller.register(self._tls, event)
        if not poller.poll(None if remaining is None else max(remaining * 1000, 1)):
            raise BlockingIOError(errno.EAGAIN, "timed out")
