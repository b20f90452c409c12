"""The package as users install it: the wheel's contents, and README's commands in CI."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


_BUILD_BACKEND = "setuptools>=77"  # pyproject.toml's [build-system] requires


def _has_build_backend() -> bool:
    """Whether this environment has the build backend pyproject.toml asks for, so no index is needed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major = int(version("setuptools").split(".")[0])
    except (PackageNotFoundError, ValueError):
        return False
    return major >= int(_BUILD_BACKEND.split(">=")[1])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel pip builds from the source tree, without the package index when the backend is installed.

    Built in this environment's setuptools (``--no-build-isolation``) when it is recent enough, as on a
    host without the index; otherwise pip fetches the backend, and a failure to reach the index skips.
    """
    assert _BUILD_BACKEND in (ROOT / "pyproject.toml").read_text()
    out = tmp_path_factory.mktemp("wheel")
    # a copy of the tree: a build in place leaves build/ behind, whose stale files a later build would ship
    source = tmp_path_factory.mktemp("source") / "rpcdl"
    skipped = shutil.ignore_patterns(".*", "build", "dist", "*.egg-info", "__pycache__", "tests", "benchmarks")
    shutil.copytree(ROOT, source, ignore=skipped)
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(source)]
    offline = _has_build_backend()
    if offline:
        command.insert(command.index("--no-deps"), "--no-build-isolation")
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    unreachable = ("No matching distribution", "Could not find a version", "Network is unreachable", "resolve")
    if result.returncode != 0 and not offline and any(sign in result.stderr for sign in unreachable):
        pytest.skip(f"building the wheel needs {_BUILD_BACKEND} from the package index, unreachable: {result.stderr}")
    assert result.returncode == 0, result.stderr
    (built,) = out.glob("rpcdl-*.whl")
    return built


def _source_packages() -> set[str]:
    """Every package of the source tree, as the wheel names it (``integrations/`` and ``configs/`` map into it)."""
    found = set()
    for folder, prefix in ((ROOT / "rpcdl", "rpcdl"), (ROOT / "integrations", "rpcdl/integrations")):
        for init in folder.rglob("__init__.py"):
            found.add("/".join([prefix, *init.parent.relative_to(folder).parts]))
    return found | {"rpcdl/configs"}


def test_wheel_holds_every_package_and_no_test_or_benchmark_harness(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for package in sorted(_source_packages()):
        assert f"{package}/__init__.py" in names, f"{package} is missing from the wheel (pyproject's packages)"
    assert not [name for name in names if name.startswith(("tests/", "benchmarks/"))]
    modules = {name.rsplit("/", 1)[-1] for name in names if name.startswith("rpcdl/")}
    for harness in ("netns_cluster.py", "cluster.py", "pki.py", "targets.py", "harness.py", "conftest.py"):
        assert harness not in modules, f"{harness} is test or benchmark harness, not what users run"
    assert "rpcdl/cli/bench/__init__.py" in names  # rpcdl bench stays: users measure their fleets with it
    report = zipfile.ZipFile(wheel).read("rpcdl/cli/bench/report.py").decode()
    assert "rpcdataloader" not in report and "TARGETS" not in report  # the project's own goals stay in benchmarks/


#: What users run: ``import rpcdl`` and its public submodules, the ``rpcdl`` command and each command it plugs
#: in, ``python -m rpcdl`` and ``python -m rpcdl.launch``, and the integrations. Every other module of the
#: wheel must be imported by one of these, directly or not.
_ENTRY_MODULES = (
    "rpcdl",
    "rpcdl.__main__",
    "rpcdl.launch",
    "rpcdl.samplers",
    "rpcdl.distributed",
    "rpcdl.cli",
    "rpcdl.cli.status",
    "rpcdl.cli.demo",
    "rpcdl.cli.bench",
    "rpcdl.integrations.lightning",
    "rpcdl.integrations.torchdata",
)


def _wheel_modules(archive: zipfile.ZipFile) -> dict[str, tuple[str, bool]]:
    """Every module of the wheel by dotted name: its file in the wheel, and whether it is a package."""
    modules = {}
    for name in archive.namelist():
        if name.startswith("rpcdl/") and name.endswith(".py"):
            parts = name[: -len(".py")].split("/")
            package = parts[-1] == "__init__"
            modules[".".join(parts[:-1] if package else parts)] = (name, package)
    return modules


def _imported(archive: zipfile.ZipFile, module: str, path: str, package: bool, known: set[str]) -> set[str]:
    """The wheel's modules that ``module`` imports anywhere (lazily too) or names in a string (a class path)."""
    here = module if package else module.rpartition(".")[0]
    named = set()
    for node in ast.walk(ast.parse(archive.read(path))):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = here.split(".")[: len(here.split(".")) - node.level + 1] if node.level else []
            source = ".".join([*base, *([node.module] if node.module else [])])
            named.add(source)
            named.update(f"{source}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("rpcdl."):
            named.add(node.value)
    found = set()
    for name in named:
        while name:
            if name in known:
                found.add(name)
            name = name.rpartition(".")[0]
    return found


def test_every_module_of_the_wheel_is_reached_from_what_users_run(wheel):
    archive = zipfile.ZipFile(wheel)
    modules = _wheel_modules(archive)
    known = set(modules)
    assert set(_ENTRY_MODULES) <= known, set(_ENTRY_MODULES) - known
    configs = [n for n in archive.namelist() if n.startswith("rpcdl/configs/") and n.endswith(".yaml")]
    reached: set[str] = set()
    waiting = list(_ENTRY_MODULES)
    for config in configs:  # LightningCLI configs name their classes: rpcdl demo trains through them
        waiting += re.findall(r"class_path:\s*(rpcdl\.[\w.]+)\.\w+", archive.read(config).decode())
    while waiting:
        module = waiting.pop()
        if module in reached or module not in known:
            continue
        reached.add(module)
        path, package = modules[module]
        waiting.extend(_imported(archive, module, path, package, known))
    assert sorted(known - reached) == [], "modules only tests or benchmarks use: move them to tests/ or benchmarks/"


def test_the_wheel_holds_one_socket_model_the_event_loop(wheel):
    archive = zipfile.ZipFile(wheel)
    names = archive.namelist()
    assert "rpcdl/transport/tls_stream.py" not in names
    wire = archive.read("rpcdl/transport/wire.py").decode()
    handshake = archive.read("rpcdl/transport/handshake.py").decode()
    dial = archive.read("rpcdl/rpc/dial.py").decode()
    assert "class FrameReader" not in wire and "def io_stream" not in wire and "def send_frame" not in wire
    assert "def client_negotiate" not in handshake and "def server_negotiate" not in handshake
    assert "def dial(" not in dial and "async def dial_on_loop(" in dial
    blocking = [
        name
        for name in names
        if name.startswith("rpcdl/")
        and name.endswith(".py")
        and re.search(r"FrameReader|client_negotiate|server_negotiate|TLSStream", archive.read(name).decode())
    ]
    assert blocking == [], f"the blocking socket model is named in {blocking}: tests/blocking_wire.py holds it"


def test_wheel_maps_integrations_into_the_package(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in (
        "rpcdl/__init__.py",
        "rpcdl/integrations/__init__.py",
        "rpcdl/integrations/lightning.py",
        "rpcdl/integrations/torchdata.py",
        "rpcdl/py.typed",
    ):
        assert expected in names, expected
    assert not any(name.startswith("integrations/") for name in names)
    assert any(name.startswith("rpcdl/configs/") and name.endswith(".yaml") for name in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "rpcdl = rpcdl.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_wheel_imports_its_integrations(wheel, tmp_path):
    zipfile.ZipFile(wheel).extractall(tmp_path)
    code = (
        "import rpcdl, rpcdl.integrations.torchdata, rpcdl.integrations.lightning;"
        "print(rpcdl.__file__); print(rpcdl.integrations.lightning.__file__)"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert all(line.startswith(str(tmp_path)) for line in result.stdout.split()), result.stdout


def _readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return [line for block in blocks for line in block.splitlines() if line.startswith("pip install")]


def test_ci_runs_readme_test_command():
    commands = _readme_commands()
    assert any(command.endswith("&& rpcdl demo") for command in commands)
    test_commands = [command for command in commands if command.endswith("&& pytest")]
    assert len(test_commands) == 1
    assert test_commands[0] in (ROOT / ".ci" / "run").read_text().splitlines()
