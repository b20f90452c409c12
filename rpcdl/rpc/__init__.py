"""Calls: a connection to a worker, the calls in flight on it, ``rpc_async``/``rpc_sync``/``remote`` and RRefs."""
