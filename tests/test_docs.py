"""The documentation builds without warnings, and its code examples run.

How a snippet is marked (docs/contributing.rst says the same to writers):

- In the ``.rst`` pages, every ``.. code-block:: python`` runs, unless it has
  the option ``:class: no-run`` (for snippets that need a cluster). The
  runnable snippets of one page form one script, run top to bottom in a fresh
  Python process, so later snippets use what earlier ones defined.
- In README.md, every fenced block opening with ```` ```python ```` runs, unless the
  line reads ```` ```python no-run ````.
- Docstring examples (``>>>``) of the public modules run as doctests, except the
  lines marked ``# doctest: +SKIP`` (those that need workers or a cluster).

Python examples spelled otherwise (``.. code:: python``, ``.. sourcecode::``)
are refused, so that no example escapes this test by its spelling.
"""

from __future__ import annotations

import doctest
import html
import importlib
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SCRIPT_TIMEOUT = 200

# The public names of DESIGN.md: each must be on an API page with its docstring.
PUBLIC_NAMES = {
    "rpcdl": [
        "RPCDataset", "RPCDataloader", "rpc_async", "rpc_sync", "remote", "RRef", "run_worker", "Worker",
        "shutdown", "ping", "stats", "set_random_seeds", "local_workers", "CachedDataset", "CacheLoader",
        "serve_metrics",
        "WorkerSource",
    ],
    "rpcdl.samplers": ["LoadBalancingDistributedSampler", "LoadBalancingDistributedBatchSampler"],
    "rpcdl.distributed": ["shard_workers", "distributed_loader"],
    "rpcdl.integrations.lightning": ["RPCDataModule"],
    "rpcdl.integrations.torchdata": ["RPCMapper", "RPCIterableDataset", "RPCMapperIterDataPipe"],
}  # fmt: skip
DOCTEST_MODULES = [
    "rpcdl.address",
    "rpcdl.checks",
    "rpcdl.errors",
    "rpcdl.forkserver",
    "rpcdl.local",
    "rpcdl.logs",
    "rpcdl.processes",
    "rpcdl.seeding",
    "rpcdl.transport.compression",
    "rpcdl.transport.control",
    "rpcdl.transport.handshake",
    "rpcdl.transport.security",
    "rpcdl.transport.shm",
    "rpcdl.transport.wire",
    "rpcdl.serialization.code_cache",
    "rpcdl.serialization.pickling",
    "rpcdl.serialization.user_code",
    "rpcdl.rpc.client",
    "rpcdl.rpc.invoke",
    "rpcdl.rpc.rref",
    "rpcdl.server.counters",
    "rpcdl.server.time_shares",
    "rpcdl.server.worker",
    "rpcdl.data.cache.cached",
    "rpcdl.data.dataloader",
    "rpcdl.data.dataset",
    "rpcdl.data.ranks",
    "rpcdl.data.elastic",
    "rpcdl.data.resume",
    "rpcdl.data.shares",
    "rpcdl.data.sources",
    "rpcdl.data.load_balancing",
    "rpcdl.data.chunked_pass",
    "rpcdl.data.flow",
    "rpcdl.data.trainer_metrics",
    "rpcdl.data.guard",
    "rpcdl.data.worker_pool",
    "rpcdl.data.records",
    "rpcdl.data.scheduling_policy",
    "rpcdl.data.sources",
    "rpcdl.integrations.lightning",
    "rpcdl.integrations.torchdata",
    "rpcdl.cli.args",
    "rpcdl.cli.status",
]


# ---------------------------------------------------------------------------- snippets


@dataclass
class Snippet:
    path: Path
    line: int  # 1-based line of the first code line
    code: str
    runnable: bool


_CODE_BLOCK = re.compile(r"^(?P<indent>\s*)\.\. code-block::\s*(?P<language>\S*)\s*$")
_OPTION = re.compile(r"^\s*:(?P<name>[\w-]+):\s*(?P<value>.*)$")
_FORBIDDEN = re.compile(r"^\s*\.\. (code|sourcecode|testcode|doctest)::\s*(python|py)?\s*$", re.M)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def rst_snippets(path: Path) -> list[Snippet]:
    """The ``.. code-block:: python`` blocks of an rst file (not those shown inside other blocks)."""
    lines = path.read_text().splitlines()
    snippets, i = [], 0
    while i < len(lines):
        line = lines[i]
        i += 1
        match = _CODE_BLOCK.match(line)
        if not match and not line.rstrip().endswith("::"):
            continue
        indent = _indent(line)
        options = {}
        while match and i < len(lines) and (option := _OPTION.match(lines[i])):
            options[option.group("name")] = option.group("value").split()
            i += 1
        body_start = i
        while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > indent):
            i += 1
        if not match or match.group("language") != "python":
            continue  # a literal block or another language: skipped, with whatever it shows
        body = lines[body_start:i]
        first = next((n for n, text in enumerate(body) if text.strip()), 0)
        width = min(_indent(t) for t in body if t.strip())
        code = "\n".join(t[width:] for t in body[first:]).rstrip() + "\n"
        runnable = "no-run" not in options.get("class", [])
        snippets.append(Snippet(path, body_start + first + 1, code, runnable))
    return snippets


def markdown_snippets(path: Path) -> list[Snippet]:
    """The ```` ```python ```` blocks of a Markdown file."""
    lines = path.read_text().splitlines()
    snippets, i = [], 0
    while i < len(lines):
        info = lines[i].strip()
        i += 1
        if not info.startswith("```python"):
            continue
        start = i
        while i < len(lines) and lines[i].strip() != "```":
            i += 1
        snippets.append(Snippet(path, start + 1, "\n".join(lines[start:i]) + "\n", "no-run" not in info.split()))
        i += 1
    return snippets


def doc_pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.rst") if "_build" not in p.parts)


def runnable_pages() -> dict[str, list[Snippet]]:
    pages = {}
    for path in [*doc_pages(), ROOT / "README.md"]:
        snippets = markdown_snippets(path) if path.suffix == ".md" else rst_snippets(path)
        if any(s.runnable for s in snippets):
            pages[str(path.relative_to(ROOT))] = [s for s in snippets if s.runnable]
    return pages


def page_script(snippets: list[Snippet]) -> str:
    """One script of a page's snippets; each line keeps its place through ``# line`` markers."""
    parts = []
    for snippet in snippets:
        parts.append(f"# --- {snippet.path.relative_to(ROOT)}, line {snippet.line}\n{snippet.code}")
    return "\n".join(parts)


def run_script(name: str, script: str, directory: Path) -> subprocess.CompletedProcess:
    path = directory / (re.sub(r"\W", "_", name) + ".py")
    path.write_text(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RPCDL_")}
    return subprocess.run(
        [sys.executable, str(path)], cwd=directory, env=env, capture_output=True, text=True, timeout=SCRIPT_TIMEOUT
    )


@pytest.mark.timeout(SCRIPT_TIMEOUT + 30)
@pytest.mark.parametrize("page", sorted(runnable_pages()))
def test_page_examples_run(page, tmp_path):
    result = run_script(page, page_script(runnable_pages()[page]), tmp_path)
    assert result.returncode == 0, f"the examples of {page} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"


def test_every_python_block_is_checked():
    """Python examples are written as ``code-block:: python`` (run unless ``no-run``), and most run."""
    total = runnable = 0
    for path in doc_pages():
        text = path.read_text()
        assert not _FORBIDDEN.search(text), f"{path}: write python examples as `.. code-block:: python`"
        snippets = rst_snippets(path)
        total += len(snippets)
        runnable += sum(s.runnable for s in snippets)
    readme = markdown_snippets(ROOT / "README.md")
    assert readme and all(s.runnable for s in readme), "README's python example must run"
    assert total and runnable >= 0.75 * total, f"only {runnable} of {total} python examples run"


def test_snippet_parser_reads_options_and_bodies(tmp_path):
    page = tmp_path / "page.rst"
    page.write_text(
        "Title\n=====\n\n.. code-block:: python\n\n   x = 1\n\n   y = x\n\ntext\n\n"
        ".. code-block:: python\n   :class: no-run\n   :caption: on a cluster\n\n   connect()\n\n"
        ".. code-block:: rst\n\n   .. code-block:: python\n\n      shown()\n\nA literal block::\n\n"
        "   .. code-block:: python\n\n      shown()\n"
    )
    first, second = rst_snippets(page)
    assert (first.code, first.line, first.runnable) == ("x = 1\n\ny = x\n", 6, True)
    assert (second.code, second.runnable) == ("connect()\n", False)


# ---------------------------------------------------------------------------- docstrings


@pytest.mark.parametrize("module_name", DOCTEST_MODULES)
def test_docstring_examples(module_name, monkeypatch):
    monkeypatch.delenv("RPCDL_WORKERS", raising=False)
    module = importlib.import_module(module_name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(module, module_name):
        runner.run(test)
    results = runner.summarize(verbose=False)
    assert results.failed == 0, f"{results.failed} docstring examples of {module_name} failed (see the output)"


# ---------------------------------------------------------------------------- the build


@pytest.fixture(scope="module", autouse=True)
def sphinx_build(request, tmp_path_factory):
    """Start ``sphinx-build -W`` when the module starts, if a selected test needs it.

    It runs in the background while the page scripts run; :func:`built_html` waits for it.
    """
    if not any("built_html" in getattr(item, "fixturenames", ()) for item in request.session.items):
        yield None
        return
    output = tmp_path_factory.mktemp("html")
    log = output.parent / f"{output.name}.log"
    with open(log, "w") as stream:
        process = subprocess.Popen(
            [sys.executable, "-m", "sphinx", "-W", "-q", "-b", "html", str(DOCS), str(output)],
            stdout=stream, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        yield process, output, log
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


@pytest.fixture(scope="module")
def built_html(sphinx_build):
    process, output, log = sphinx_build
    returncode = process.wait(timeout=300)
    assert returncode == 0, f"sphinx-build -W failed:\n{log.read_text()[-6000:]}"
    return output


_TYPOGRAPHY = str.maketrans({"\u2019": "'", "\u2018": "'", "\u201c": '"', "\u201d": '"', "\u2026": "..."})


def _page_text(path: Path) -> str:
    """The text of an HTML page, tags dropped, Sphinx's smart quotes and ellipses undone."""
    text = re.sub(r"<[^>]+>", " ", path.read_text())
    return re.sub(r"\s+", " ", html.unescape(text)).translate(_TYPOGRAPHY)


def _first_sentence(obj) -> str:
    doc = (obj.__doc__ or "").strip()
    assert doc, f"{obj!r} has no docstring"
    first = doc.split("\n\n")[0]
    first = re.sub(r"``([^`]*)``", r"\1", first)  # rendered as code, without the backquotes
    first = re.sub(r":\w+:`~?([^`]*)`", lambda m: m.group(1).rsplit(".", 1)[-1], first)
    return re.sub(r"\s+", " ", first).strip()


def test_docs_build_without_warnings_and_document_the_public_api(built_html):
    pages = {path: path.read_text() for path in (built_html / "api").glob("*.html")}
    for module_name, names in PUBLIC_NAMES.items():
        module = importlib.import_module(module_name)
        for name in names:
            anchor = f'id="{module_name}.{name}"'
            page = next((p for p, text in pages.items() if anchor in text), None)
            assert page is not None, f"{module_name}.{name} is on no API page"
            summary = re.sub(r"\s", "", _first_sentence(getattr(module, name)))  # tags split words
            text = re.sub(r"\s", "", _page_text(page))
            assert summary[:50] in text, f"the docstring of {module_name}.{name} is not on {page.name}"
    everything = "".join(pages.values())
    for module_name in ("rpcdl", "rpcdl.integrations.lightning", "rpcdl.integrations.torchdata"):
        for name in importlib.import_module(module_name).__all__:  # new exports get documented too
            assert f'id="{module_name}.{name}"' in everything, f"{module_name}.{name} is on no API page"
    launch = (built_html / "api" / "rpc.html").read_text()
    assert 'id="module-rpcdl.launch"' in launch
    cli = _page_text(built_html / "api" / "cli.html")
    for option in ("--address-file", "--port", "--token-file", "--procs"):
        assert option in cli  # generated from the parser


def test_pictures_are_in_the_build(built_html):
    page = (built_html / "pictures.html").read_text()
    images = re.findall(r'<img [^>]*src="([^"]+)"', page)
    assert any("architecture" in src for src in images) and any("timeline" in src for src in images), images
    for src in images:
        assert (built_html / src).is_file(), src


def test_readme_lists_every_guide_and_the_environment_page():
    readme = (ROOT / "README.md").read_text()
    pages = [*sorted((ROOT / "docs" / "guides").glob("*.rst")), ROOT / "docs" / "environment.rst"]
    missing = [str(page.relative_to(ROOT)) for page in pages if f"]({page.relative_to(ROOT)})" not in readme]
    assert missing == []
