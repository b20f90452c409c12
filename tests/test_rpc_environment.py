"""The environment variables a call reads: asked again on every call (see rpcdl.rpc.environment)."""

from __future__ import annotations

from rpcdl.rpc.environment import Variables


def test_a_change_mid_process_is_seen_by_the_next_ask(monkeypatch):
    variables = Variables("RPCDL_TEST_FIRST_UNSET", "RPCDL_TEST_SECOND_UNSET")
    monkeypatch.delenv("RPCDL_TEST_FIRST_UNSET", raising=False)
    monkeypatch.delenv("RPCDL_TEST_SECOND_UNSET", raising=False)
    assert variables.unset()
    monkeypatch.setenv("RPCDL_TEST_SECOND_UNSET", "1")  # the last one: every name is asked
    assert not variables.unset()
    monkeypatch.delenv("RPCDL_TEST_SECOND_UNSET")
    assert variables.unset()


def test_an_empty_value_counts_as_set(monkeypatch):
    monkeypatch.setenv("RPCDL_TEST_EMPTY", "")
    assert not Variables("RPCDL_TEST_EMPTY").unset()
