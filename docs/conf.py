"""Sphinx configuration of the rpcdl documentation.

Build it with ``sphinx-build -W -b html docs docs/_build/html``. Code examples
are executed by ``tests/test_docs.py``: see :doc:`contributing` for how a
snippet is marked as runnable or not.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import Directive, directives

import rpcdl

# rpcdl is imported as installed (pip install -e ".[docs]"): rpcdl.integrations
# exists only through the package-dir mapping of pyproject.toml.
ROOT = Path(__file__).resolve().parent.parent

project = "rpcdl"
author = "rpcdl developers"
copyright = "rpcdl developers"
release = rpcdl.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_parser",  # SECURITY.md is included as it is (security.rst)
]

exclude_patterns = ["_build", "figures/*.py"]
templates_path: list[str] = []
root_doc = "index"

# Every cross-reference to rpcdl must resolve; other projects' names stay plain
# text (no intersphinx: the build needs no network).
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(?!rpcdl\.)\w+\..+"),  # dotted names of other packages: torch..., collections.abc...
    (r"py:.*", r"(.*\.)?(T|X|_T)"),  # type variables
    (r"py:.*", r".*\._\w+"),  # private helpers named in signatures
]

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autodoc_default_options = {"show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_attr_annotations = True

html_theme = "alabaster"
html_title = f"rpcdl {release}"
html_theme_options = {
    "description": "PyTorch datasets on remote CPU workers",
    "fixed_sidebar": True,
    "page_width": "1100px",
    "sidebar_width": "240px",
}
html_static_path: list[str] = []

# The plot of `rpcdl bench --plot`, shown by `.. bench-plot::` when it is committed.
BENCH_PLOT = ROOT / "benchmarks" / "results.png"


class CommandHelp(Directive):
    """``.. command-help:: worker``: the ``--help`` of an ``rpcdl`` command, generated at build time.

    ``launch`` gives the help of ``python -m rpcdl.launch``; no argument, the
    help of ``rpcdl`` itself. The text is what the command prints, so it
    cannot drift from the code.
    """

    optional_arguments = 1
    has_content = False

    def run(self) -> list[nodes.Node]:
        from rpcdl import cli, launch

        name = self.arguments[0] if self.arguments else ""
        if name == "launch":
            text = _help_text(launch.main, ["--help"])
        else:
            text = _help_text(cli.main, [name, "--help"] if name else ["--help"])
        return [nodes.literal_block(text, text, language="text")]


def _help_text(main, argv: list[str]) -> str:
    """What ``main(argv)`` prints before argparse exits, wrapped at 88 columns."""
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "88"
    stream = io.StringIO()
    try:
        with contextlib.redirect_stdout(stream):
            main(argv)
    except SystemExit:
        pass
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved
    return stream.getvalue()


class BenchPlot(Directive):
    """``.. bench-plot::``: the committed plot of ``rpcdl bench --plot``, else the directive's content.

    The content says how to make the plot; it is shown while none is committed.
    """

    has_content = True
    option_spec = {"alt": directives.unchanged}

    def run(self) -> list[nodes.Node]:
        if BENCH_PLOT.is_file():
            here = Path(self.state.document.current_source).parent
            uri = os.path.relpath(BENCH_PLOT, here)
            return [nodes.image(uri=uri, alt=self.options.get("alt", "rpcdl bench --plot"), width="100%")]
        container = nodes.container()
        self.state.nested_parse(self.content, self.content_offset, container)
        return list(container.children)


def setup(app) -> dict:
    directives.register_directive("command-help", CommandHelp)
    directives.register_directive("bench-plot", BenchPlot)
    return {"parallel_read_safe": True}
