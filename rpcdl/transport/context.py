"""What the message or call this thread handles is for: its peer, and the shared segment its answer goes in.

One value per thread, a tuple ``(peer, local_store, connection, segment)``:
the serialization layer reads the first three while it (un)pickles (see
``peer_context`` in :mod:`rpcdl.serialization.pickling`), :func:`rpcdl.transport.shm.empty`
the last while a worker's call runs. A worker running a call sets all four at
once (``rpcdl.server.call_runner.CallRunner.run``).

Threading: a :class:`threading.local`; whoever sets a value sets the previous one back when done.
"""

from __future__ import annotations

import threading

NO_CONTEXT: tuple = (None, None, None, None)  #: no peer, no store, no connection, no segment
SEGMENT = 3  #: the index of the segment in a context


class _ThreadContext(threading.local):
    value: tuple = NO_CONTEXT  #: (peer, local_store, connection, segment)


thread_context = _ThreadContext()  #: this thread's context: read and set ``thread_context.value``
