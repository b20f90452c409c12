"""A worker's store of RRef objects as pure transitions (no sockets): what a disconnected holder leaves behind."""

from __future__ import annotations

import traceback

import pytest

from rpcdl.errors import RRefNotFound
from rpcdl.rpc.rref import RRefStore


class _Session:
    """A holder: what the worker passes for one client connection."""


def test_a_holder_that_disconnects_frees_its_objects_and_those_its_calls_complete_afterwards():
    store, leaving, staying = RRefStore(), _Session(), _Session()
    store.expect(1, leaving)
    store.complete(1, "made before")
    store.expect(2, leaving)  # its call still runs
    store.expect(3, staying)
    store.complete(3, "kept")
    assert store.release_holder(leaving) == 2 and len(store) == 2  # 2 waits for its call, 3 is another's
    store.complete(2, "made while it left")
    assert len(store) == 1
    # a call its session read before the disconnection was noticed, announced and run after: freed at once
    store.expect(4, leaving)
    assert len(store) == 2
    store.complete(4, "made after it left")
    assert len(store) == 1
    store.add("returned after it left", leaving)
    assert len(store) == 1 and store.resolve(3) == "kept"
    with pytest.raises(RRefNotFound):
        store.resolve(1)


def test_a_new_holder_is_not_taken_for_a_departed_one():
    store = RRefStore()
    store.release_holder(_Session())  # gone: its id may be reused by a new object
    for uid in range(2, 50):
        holder = _Session()  # often at the departed one's address
        store.expect(uid, holder)
        store.complete(uid, uid)
        assert store.resolve(uid) == uid


def test_an_error_kept_for_an_rref_is_raised_whole_each_time():
    store, holder = RRefStore(), _Session()
    store.expect(1, holder)
    store.complete(1, error=ValueError("the call creating it failed"))
    for _ in range(2):
        with pytest.raises(ValueError, match="the call creating it failed") as info:
            store.resolve(1)
        frames = [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
        assert frames == [test_an_error_kept_for_an_rref_is_raised_whole_each_time.__name__, "resolve"]  # a copy
