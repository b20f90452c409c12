"""The package uses other libraries through their public names only.

A private attribute of torch, CPython, lz4, cloudpickle or ssl can change in
any minor release of them; rpcdl supports a range of versions, so it reads
none. Checked statically over every module the wheel ships: an attribute
with a leading underscore read from a module imported from another package
(``torch._C``), or any ``getattr(..., "_name")`` on an object that is not
rpcdl's own (``getattr(os.environ, "_data")``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted([*(ROOT / "rpcdl").rglob("*.py"), *(ROOT / "integrations").rglob("*.py")])


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def foreign_private_uses(source: str) -> list[str]:
    """``module._name`` on modules imported from other packages, and ``getattr(x, "_name")`` on anything but
    ``self``, ``cls`` and this file's own names."""
    tree = ast.parse(source)
    foreign: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "rpcdl":
                    foreign.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] != "rpcdl":
            foreign.update(alias.asname or alias.name for alias in node.names)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in foreign:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
            and not (isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls"))
        ):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("path", SHIPPED, ids=lambda path: str(path.relative_to(ROOT)))
def test_no_module_reads_another_librarys_private_names(path):
    assert foreign_private_uses(path.read_text()) == []


@pytest.mark.parametrize(
    "source",
    [
        "import torch\nF = torch._C.Future\n",
        "import os\ndata = getattr(os.environ, '_data', None)\n",
        "import lz4.block as blocks\npath = blocks._block.__file__\n",
        "import cloudpickle\nseen = getattr(cloudpickle.cloudpickle, '_PICKLE_BY_VALUE_MODULES', ())\n",
        "def read(tls):\n    return getattr(tls, '_sslobj', None)\n",
    ],
    ids=["torch-C", "environ-data", "lz4-block", "cloudpickle-registry", "sslobj"],
)
def test_the_check_sees_the_internals_it_looks_for(source):
    assert foreign_private_uses(source)


def test_the_check_lets_own_and_public_names_pass():
    source = (
        "import torch\nfrom .calls import _copy\n"
        "class A:\n    def f(self):\n        return getattr(self, '_x', None), torch.futures.Future, _copy\n"
    )
    assert foreign_private_uses(source) == []
