"""Sphinx configuration of the npattn documentation.

Build (warnings are errors, as in CI)::

    python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

from __future__ import annotations

import pathlib
import shutil

import npattn

project = "npattn"
author = "The npattn developers"
copyright = "The npattn developers (MIT License)"
release = npattn.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "numpydoc",
]

# The API reference's stubs are generated at build time into docs/generated/
# (gitignored): every public name appears in api.rst and nowhere else.
autosummary_generate = True
autosummary_imported_members = False
autodoc_default_options = {"members": False}
autodoc_typehints = "none"  # signatures as written; types are in the numpydoc sections
autodoc_member_order = "bysource"

# numpydoc: no automatic member tables (they would need stubs of their own).
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_attributes_as_param_list = False
numpydoc_xref_param_type = False

templates_path = ["_templates"]
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
source_suffix = {".rst": "restructuredtext"}
root_doc = "index"
default_role = "code"

html_theme = "alabaster"
html_title = f"npattn {release}"
html_static_path: list[str] = []
html_theme_options = {"description": "Framework-free masked attention with hand-derived backward passes"}


def _skip_namedtuple_fields(app, what, name, obj, skip, options):
    """NamedTuple fields are listed in the class's own Attributes section;
    their generated docstrings ("Alias for field number 0") add nothing."""
    doc = getattr(obj, "__doc__", None) or ""
    if doc.startswith("Alias for field number"):
        return True
    return None


_BUILTINS = (int, float, str, tuple, list, dict, bool)


def _drop_builtin_docstrings(app, what, name, obj, options, lines):
    """A module constant without a ``#:`` comment would show its type's
    docstring (``int([x]) -> integer ...``); show nothing instead."""
    if what in ("data", "attribute") and type(obj) in _BUILTINS:
        first = (type(obj).__doc__ or "").strip().splitlines()[0]
        if any(first in line for line in lines):
            lines[:] = []


def setup(app):
    # Stubs of the API reference are generated afresh on every build, so that
    # a name removed from api.rst leaves no stale page behind (a warning,
    # hence an error, in a -W build). Here rather than at import, so that
    # pytest's --doctest-modules importing this file deletes nothing.
    shutil.rmtree(pathlib.Path(__file__).with_name("generated"), ignore_errors=True)
    app.connect("autodoc-skip-member", _skip_namedtuple_fields)
    app.connect("autodoc-process-docstring", _drop_builtin_docstrings)
