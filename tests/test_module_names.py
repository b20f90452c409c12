"""Each module name means one thing across the package: no two modules (or packages) share a base name."""

from __future__ import annotations

import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = (ROOT / "rpcdl", ROOT / "integrations")  # integrations/ installs as rpcdl.integrations


def module_names() -> dict[str, list[str]]:
    """Each base name, and the modules and packages (relative to the repository) that carry it."""
    found: dict[str, list[str]] = collections.defaultdict(list)
    for source in SOURCES:
        for path in sorted(source.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            if path.name in ("__init__.py", "__main__.py"):
                if path.name == "__init__.py" and path.parent not in SOURCES:
                    found[path.parent.name].append(str(path.parent.relative_to(ROOT)))
                continue
            found[path.stem].append(str(path.relative_to(ROOT)))
    return found


def test_the_walk_finds_the_modules_it_looks_for():
    names = module_names()
    assert names["dataloader"] == ["rpcdl/data/dataloader.py"]
    assert "rpcdl/metrics" in names["metrics"]  # a package counts as a module of its name
    assert "lightning" in names


def test_no_two_modules_share_a_base_name():
    shared = {name: paths for name, paths in module_names().items() if len(paths) > 1}
    assert not shared, f"rename one of each so its name says what it holds: {shared}"
