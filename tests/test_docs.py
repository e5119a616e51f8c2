"""The documentation stays true to the code.

- every public name (``npattn.__all__``, ``npattn.distributed.__all__``'s
  functions, ``npattn.diagnostics.__all__``) has an entry in docs/api.rst,
  and every entry there names an object that exists;
- the README's set-up commands are the two that .ci/run runs, its quickstart
  runs as written, and its map of the documentation names pages that exist;
- the docs build command is the same in the README and the getting-started
  page (.ci/run runs the build itself, with warnings as errors).

The ``>>>`` examples of the pages run as doctests:
``python -m pytest --doctest-glob="*.rst" docs``.
"""

from __future__ import annotations

import importlib
import pathlib
import re

import pytest

import npattn
import npattn.diagnostics
import npattn.distributed

REPO = pathlib.Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
README = (REPO / "README.md").read_text(encoding="utf-8")
BUILD_COMMAND = "python -m sphinx -W --keep-going -b html docs docs/_build/html"
SETUP_COMMANDS = ['pip install -e ".[test,mpi]" && python -m npattn', "python -m pytest"]


def api_entries() -> set[str]:
    """Fully qualified names documented in docs/api.rst: autosummary entries
    (under the current ``.. currentmodule::``) and ``auto*::`` directives."""
    names, module, in_autosummary = set(), "", False
    for line in (DOCS / "api.rst").read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if match := re.match(r"\.\. currentmodule:: (\S+)", stripped):
            module, in_autosummary = match.group(1), False
        elif match := re.match(r"\.\. auto(?:data|function|class|exception|module):: (\S+)", stripped):
            names.add(match.group(1))
            in_autosummary = False
        elif stripped.startswith(".. autosummary::"):
            in_autosummary = True
        elif in_autosummary and line.startswith("   ") and stripped and not stripped.startswith(":"):
            names.add(f"{module}.{stripped}")
        elif in_autosummary and stripped and not line.startswith(" "):
            in_autosummary = False
    return names


def resolve(qualified: str):
    module_name, _, attr = qualified.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError):
        return importlib.import_module(qualified)


def test_every_public_name_is_in_the_api_reference():
    documented = api_entries()
    missing = [name for name in npattn.__all__ if f"npattn.{name}" not in documented]
    assert not missing, f"add these names of npattn.__all__ to docs/api.rst: {missing}"


def test_distributed_and_diagnostics_names_are_in_the_api_reference():
    documented = api_entries()
    missing = [
        f"npattn.distributed.{name}"
        for name in npattn.distributed.__all__
        if f"npattn.distributed.{name}" not in documented
    ]
    # The diagnostics functions are documented where users call them, as npattn.<name>.
    missing += [
        f"npattn.diagnostics.{name}"
        for name in npattn.diagnostics.__all__
        if f"npattn.diagnostics.{name}" not in documented and f"npattn.{name}" not in documented
    ]
    assert not missing, f"add these names to docs/api.rst: {missing}"


def test_every_api_entry_exists():
    entries = api_entries()
    assert len(entries) > len(npattn.__all__)
    for name in sorted(entries):
        resolve(name)  # raises for a name that no longer exists


def test_readme_setup_commands_are_those_ci_runs():
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    for command in SETUP_COMMANDS:
        assert command in README, command
        assert command in ci, command


def test_docs_build_command_is_stated_where_promised():
    assert BUILD_COMMAND in README
    assert BUILD_COMMAND in (DOCS / "getting_started.rst").read_text(encoding="utf-8")


def test_readme_documentation_map_names_existing_pages():
    pages = set(re.findall(r"\]\((docs/[\w/]+\.rst)\)", README))
    assert pages, "the README's documentation map is gone"
    for page in pages:
        assert (REPO / page).is_file(), page
    on_disk = {f"docs/{p.name}" for p in DOCS.glob("*.rst") if p.name != "index.rst"}
    assert on_disk <= pages, f"pages missing from the README's map: {sorted(on_disk - pages)}"


def test_readme_quickstart_runs(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")  # the quickstart ends with plot_attention
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)
    assert blocks, "the README has no python quickstart"
    monkeypatch.chdir(tmp_path)  # plot_attention writes maps.png here
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert "(2, 8, 128, 64) (2, 8, 128) (2, 8, 128, 64) (2, 2, 128, 64)" in out
    assert "attention weights (2, 8, 10, 10) float64" in out and "row sums: ok" in out
    assert (tmp_path / "maps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
