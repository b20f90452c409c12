"""Caching a dataset's samples: in process memory or in redis.

Threading: see each module (:mod:`~rpcdl.data.cache.cached`, :mod:`~rpcdl.data.cache.backends`,
:mod:`~rpcdl.data.cache.redis_server`); this package face holds no state.
"""
