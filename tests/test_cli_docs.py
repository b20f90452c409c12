"""The reference pages of the command line's surroundings: every ``RPCDL_*`` variable on one page."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_EXAMPLES_ONLY = {"RPCDL_EXAMPLE_SECONDS", "RPCDL_SURELY_NOT_SET"}  # names in docstring examples, read by nobody


def _variables_in_code() -> set[str]:
    names = set()
    for folder in ("rpcdl", "integrations"):
        for path in (ROOT / folder).rglob("*.py"):
            names |= set(re.findall(r"\bRPCDL_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(encoding="utf-8")))
    return names - _EXAMPLES_ONLY


def test_every_variable_the_code_reads_is_on_the_reference_page_and_no_other():
    page = (ROOT / "docs" / "environment.rst").read_text(encoding="utf-8")
    documented = set(re.findall(r"^``(RPCDL_[A-Z0-9_]+)``$", page, flags=re.MULTILINE))
    in_code = {name for name in _variables_in_code() if not name.endswith("_")}  # "RPCDL_MAX_" prefixes in messages
    assert in_code - documented == set(), "variables read by the code but missing from docs/environment.rst"
    assert documented - in_code == set(), "variables on docs/environment.rst that the code does not read"
    assert "environment" in (ROOT / "docs" / "index.rst").read_text(encoding="utf-8")


def test_every_command_spells_the_credentials_options_alike():
    import contextlib
    import io

    from rpcdl.cli import build_parser

    expected = {"--token-file": "FILE", "--tls-ca": "PEM", "--tls-cert": "PEM", "--tls-key": "PEM"}
    seen = set()
    for name in ("worker", "status", "demo", "bench"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            build_parser().parse_args([name, "--help"])
        for option, metavar in re.findall(
            r"^\s+(--token-file|--tls-ca|--tls-cert|--tls-key) (\S+)", out.getvalue(), re.M
        ):
            seen.add((name, option))
            assert metavar == expected[option], (name, option, metavar)
    assert {
        ("status", "--token-file"),
        ("bench", "--tls-ca"),
        ("bench", "--token-file"),
        ("demo", "--token-file"),
    } <= seen
