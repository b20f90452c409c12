"""Control-frame payloads round-trip through rpcdl.transport.control, the one place that encodes and decodes them."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

import rpcdl
from rpcdl.errors import ProtocolError
from rpcdl.transport.control import (
    DEFAULT_REJECTION,
    decode_rejected,
    decode_release,
    decode_stats,
    encode_rejected,
    encode_release,
    encode_stats,
)

UIDS = st.lists(st.integers(min_value=0, max_value=2**64 - 1), max_size=200)
JSON_SCALARS = st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.floats(allow_nan=False) | st.text()


@given(UIDS)
def test_release_ids_round_trip(uids):
    payload = encode_release(uids)
    assert len(payload) == 8 * len(uids)
    assert decode_release(payload) == tuple(uids)
    assert decode_release(memoryview(payload)) == tuple(uids)


@given(st.dictionaries(st.text(), JSON_SCALARS | st.lists(JSON_SCALARS, max_size=5), max_size=20))
def test_stats_round_trip(counters):
    assert decode_stats(encode_stats(counters)) == counters


@given(st.text())
def test_rejection_reasons_round_trip(reason):
    assert decode_rejected(encode_rejected(reason)) == (reason or DEFAULT_REJECTION)


def test_an_empty_rejection_means_the_worker_is_shutting_down():
    assert decode_rejected(encode_rejected()) == decode_rejected(b"") == "the worker is shutting down"
    assert decode_rejected(b"\xffhalf") == "\ufffdhalf"


@pytest.mark.parametrize("payload", [b"\x00" * 7, b"\x00" * 9])
def test_a_release_payload_of_partial_ids_is_a_protocol_error(payload):
    with pytest.raises(ProtocolError, match=f"whole 8-byte RRef ids, got {len(payload)} bytes"):
        decode_release(payload)


@pytest.mark.parametrize(
    ("payload", "says"), [(b"[1, 2]", "got a list"), (b"{nope", "do not parse"), (b"\xff", "do not parse")]
)
def test_a_stats_payload_that_is_not_a_json_object_is_a_protocol_error(payload, says):
    with pytest.raises(ProtocolError, match=says):
        decode_stats(payload)


def test_release_ids_out_of_range_are_refused():
    with pytest.raises(ValueError, match="RRef ids must be in"):
        encode_release([2**64])


@pytest.mark.timeout(30)
def test_stats_and_releases_cross_between_a_client_and_a_worker(embedded_worker):
    address = embedded_worker().address
    rref = rpcdl.remote(address, list, ((1, 2),))
    assert rref.to_here() == [1, 2]
    assert rpcdl.stats(address)["rrefs"] == 1
    del rref  # a RELEASE frame frees it on the worker, sent at the next send or within a second
    deadline = time.monotonic() + 10
    while rpcdl.stats(address)["rrefs"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rpcdl.stats(address)["rrefs"] == 0
