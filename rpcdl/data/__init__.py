"""Datasets and loaders on workers: RPCDataset, RPCDataloader, the scheduler, samplers, cache, distributed helpers.

Threading: the data layer runs no thread of its own, but for one per fleet
over a changing worker source (:mod:`rpcdl.data.sources`). The threads that advance
loaders' and remote maps' iterators do the work; each module says what it
keeps, who owns it and how the others reach it. In short: a pool's workers and
calls are guarded by the pool's lock (:mod:`rpcdl.data.worker_pool`); a pass belongs
to the thread advancing it (:mod:`rpcdl.data.scheduler`); other threads (the
connections', reading answers) only put events on queues (:mod:`rpcdl.data.events`);
a loader's epochs are its :class:`~rpcdl.data.epoch_book.EpochBook`'s, under its lock.
"""
