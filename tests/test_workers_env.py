"""``$RPCDL_WORKERS`` takes what ``workers=`` takes (issue 37, item 6): a file, dns://, redis://, addresses.

One function reads it (``rpcdl.data.sources.workers_from_environment``); the Lightning data module goes
through it. Real worker processes where a data module trains on what the variable names.
"""

from __future__ import annotations

import pytest

from rpcdl.data.sources import AddressList, DnsSource, FileSource, RedisRegistry, workers_from_environment


def test_unset_or_blank_is_none(monkeypatch):
    monkeypatch.delenv("RPCDL_WORKERS", raising=False)
    assert workers_from_environment() is None
    monkeypatch.setenv("RPCDL_WORKERS", "  \n")
    assert workers_from_environment() is None


def test_each_kind_of_source(monkeypatch, tmp_path):
    monkeypatch.setenv("RPCDL_WORKERS", "cpu01:6543, cpu02:6543\n cpu03:6543")
    source = workers_from_environment()
    assert isinstance(source, AddressList) and source.addresses() == ["cpu01:6543", "cpu02:6543", "cpu03:6543"]
    listing = tmp_path / "workers.txt"
    listing.write_text("# the fleet\ncpu01:6543\n")
    monkeypatch.setenv("JOB_DIR", str(tmp_path))
    monkeypatch.setenv("RPCDL_WORKERS", "$JOB_DIR/workers.txt")
    source = workers_from_environment()
    assert isinstance(source, FileSource) and source.addresses() == ["cpu01:6543"]
    listing.write_text("# the fleet\ncpu01:6543\ncpu02:6543\n")
    assert source.addresses() == ["cpu01:6543", "cpu02:6543"]  # a file is read again: watched
    monkeypatch.setenv("RPCDL_WORKERS", str(tmp_path / "not-yet.txt"))  # a file not written yet: waited for
    assert isinstance(workers_from_environment(), FileSource)
    monkeypatch.setenv("RPCDL_WORKERS", "dns://rpcdl-workers.ml.svc:6543")
    assert isinstance(workers_from_environment(), DnsSource)
    pytest.importorskip("redis")
    monkeypatch.setenv("RPCDL_WORKERS", "redis://10.0.0.5:6379/0?key=job7")
    assert isinstance(workers_from_environment(), RedisRegistry)


@pytest.mark.parametrize(
    ("value", "words"),
    [("cpu01:6543 cpu02", "malformed worker address"), ("dns://workers", "malformed"), ("redis://h:x", "port")],
)
def test_a_bad_value_names_the_variable(monkeypatch, value, words):
    monkeypatch.setenv("RPCDL_WORKERS", value)
    with pytest.raises(ValueError, match=r"\$RPCDL_WORKERS") as raised:
        workers_from_environment()
    assert words in str(raised.value) and "file path, dns://" in str(raised.value)


def test_the_data_module_follows_a_file_named_by_the_variable(monkeypatch, tmp_path, two_workers):
    """Before, ``RPCDL_WORKERS=/path/workers.txt`` was refused as a malformed address."""
    pytest.importorskip("lightning")
    from probe_dataset import probe_spec

    from rpcdl.integrations.lightning import RPCDataModule, resolve_workers

    listing = tmp_path / "workers.txt"
    listing.write_text(f"{two_workers[0]}\n")
    monkeypatch.setenv("RPCDL_WORKERS", str(listing))
    assert resolve_workers(None) == [two_workers[0]]
    data = RPCDataModule(train_dataset=probe_spec(8), batch_size=4)
    data.setup("fit")
    try:
        assert data.fleet is not None and data.fleet.changing and data.fleet.describe() == f"the file {listing}"
        assert sorted(i for batch in data.train_dataloader() for i in batch["index"].tolist()) == list(range(8))
        assert data.started_workers is None  # no local worker started
    finally:
        data.teardown("fit")
