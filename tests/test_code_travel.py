"""The user's own modules travel with the calls; installed packages are imported by name on the worker."""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
import textwrap
import uuid

import pytest
import torch
from torch.utils.data import TensorDataset

import rpcdl
import rpcdl.server.worker
from rpcdl.serialization.pickling import dumps, loads
from rpcdl.serialization.user_code import travels_by_value

MODULE = """
    import threading

    import torch
    from torch.utils.data import Dataset

    SCALE = 3
    _LOCK = threading.Lock()


    def locked_double(x):
        with _LOCK:
            return 2 * x


    def scale(x):
        return x * SCALE


    def set_scale(value):
        global SCALE
        SCALE = value


    class SquaresDataset(Dataset):
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

        def __getitem__(self, index):
            return torch.tensor(scale(index * index))


    def stack(samples):
        return torch.stack(samples)
"""

PACKAGE_HELPERS = """
    OFFSET = 100


    def shifted(index):
        return index + OFFSET
"""

PACKAGE_DATA = """
    import torch
    from torch.utils.data import Dataset

    from . import helpers
    from .helpers import shifted


    class ShiftedDataset(Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, index):
            return torch.tensor([shifted(index), helpers.OFFSET])
"""


@pytest.fixture
def users_code(tmp_path, monkeypatch):
    """Write a module and a package (not installed) to a folder of their own; import them here only."""
    tag = uuid.uuid4().hex[:8]
    names = {"module": f"mydata_{tag}", "package": f"mypkg_{tag}"}
    (tmp_path / f"{names['module']}.py").write_text(textwrap.dedent(MODULE))
    package = tmp_path / names["package"]
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "helpers.py").write_text(textwrap.dedent(PACKAGE_HELPERS))
    (package / "data.py").write_text(textwrap.dedent(PACKAGE_DATA))

    def import_them():
        monkeypatch.syspath_prepend(str(tmp_path))
        return importlib.import_module(names["module"]), importlib.import_module(f"{names['package']}.data")

    yield names, import_them
    for name in list(sys.modules):
        if name.startswith((names["module"], names["package"])):
            del sys.modules[name]


@pytest.mark.timeout(60)
def test_a_dataset_from_the_users_own_module_works_on_a_worker_that_cannot_import_it(spawn_workers, users_code):
    names, import_them = users_code
    workers = spawn_workers(2)  # started before the module's folder is on this process's sys.path
    mydata, _ = import_them()
    for worker in workers:
        assert rpcdl.rpc_sync(worker, importlib.util.find_spec, (names["module"],)) is None
    dataset = rpcdl.RPCDataset(workers, mydata.SquaresDataset, 10)
    batches = list(rpcdl.RPCDataloader(dataset, batch_size=4, collate_fn=mydata.stack))
    assert [batch.tolist() for batch in batches] == [[0, 3, 12, 27], [48, 75, 108, 147], [192, 243]]
    assert rpcdl.rpc_sync(workers[0], mydata.scale, (5,)) == 15
    instance = rpcdl.rpc_sync(workers[0], mydata.SquaresDataset, (4,))
    assert type(instance) is mydata.SquaresDataset  # the worker's copy of the class comes back as this one
    with pytest.raises(ModuleNotFoundError, match=r"could not travel with the call.*cannot pickle '_thread\.lock'"):
        rpcdl.rpc_sync(workers[0], mydata.locked_double, (4,))
    assert rpcdl.rpc_sync(workers[0], mydata.scale, (2,)) == 6
    first, second = (rpcdl.rpc_sync(workers[0], id, (mydata.scale,)) for _ in range(2))
    assert first == second  # rebuilt once on the worker, kept for the calls that follow


@pytest.mark.timeout(60)
def test_a_users_package_with_relative_imports_travels_too(spawn_workers, users_code):
    names, import_them = users_code
    (worker,) = spawn_workers(1)
    _, package_data = import_them()
    assert rpcdl.rpc_sync(worker, importlib.util.find_spec, (names["package"],)) is None
    dataset = rpcdl.RPCDataset([worker], package_data.ShiftedDataset)
    batches = list(rpcdl.RPCDataloader(dataset, batch_size=3))
    assert [batch[:, 0].tolist() for batch in batches] == [[100, 101, 102], [103, 104, 105]]


@pytest.mark.timeout(60)
def test_a_worker_that_can_import_the_users_module_uses_its_own(spawn_workers, users_code):
    _, import_them = users_code
    mydata, _ = import_them()
    (worker,) = spawn_workers(1)  # inherits this sys.path, as on a shared filesystem
    rpcdl.rpc_sync(worker, mydata.set_scale, (10,))
    assert rpcdl.rpc_sync(worker, mydata.scale, (5,)) == 50  # module state lives on between calls, as before
    assert mydata.SCALE == 3
    assert rpcdl.rpc_sync(worker, mydata.locked_double, (4,)) == 8  # its code cannot be pickled: it goes by name


def test_installed_packages_go_by_reference_and_the_users_code_by_value(users_code):
    _, import_them = users_code
    mydata, package_data = import_them()
    assert travels_by_value(mydata) and travels_by_value(package_data)
    for installed in (json, torch, torch.utils.data.dataset, rpcdl.server.worker, pytest):
        assert not travels_by_value(installed), installed.__name__
    payload, _ = dumps(TensorDataset)
    assert b"torch.utils.data.dataset" in payload and b"import_or_define" not in payload and len(payload) < 200
    payload, _ = dumps(mydata.SquaresDataset)
    assert b"import_or_define" in payload and b"__getitem__" in payload
    assert dumps(mydata.SquaresDataset)[0] == payload  # its code is pickled once and sent as it was
    assert loads(payload) is mydata.SquaresDataset  # imported here: taken by name


def test_code_sent_by_value_keeps_its_file_name_so_remote_tracebacks_name_the_file_and_line():
    def parse(text):
        return int(text)

    def make_adder(n):
        return lambda x: x + n

    rebuilt_parse, rebuilt_make_adder = loads(*dumps((parse, make_adder)))
    assert rebuilt_parse.__code__.co_filename == __file__  # cloudpickle 3.1.3 alone writes "<dynamic-code>"
    assert rebuilt_make_adder(1).__code__.co_filename == __file__  # nested code too
    with pytest.raises(ValueError) as raised:
        rebuilt_parse("x")
    assert raised.traceback[-1].path.name == "test_code_travel.py"
