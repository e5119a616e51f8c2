"""Loaded before pytest collects anything: imports ``npattn`` first.

pyproject's ``--import-mode=importlib`` imports a module whose doctests it
collects by its file. Where the package is not yet imported (a run whose
first paths are ``npattn/fast_cupy.py`` and tests that import ``npattn`` only
inside their functions), pytest imports the package, whose ``__init__``
imports that module, and then runs the module's file a second time: the
package's other modules then hold one copy and ``sys.modules`` another, so
that a test's monkeypatch of the one misses the other. Imported here, every
module the package imports is found in ``sys.modules`` and reused.
"""

import npattn  # noqa: F401
