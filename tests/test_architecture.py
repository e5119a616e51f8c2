"""The package's architecture: data flows one way (arguments -> validated
spec -> path choice -> kernel), so the import graph of npattn's modules,
function-local imports included, has no cycle."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

import npattn
from npattn.attention import choose_impl
from npattn.options import AUTO_CHUNKED_MIN_SCORES, make_spec

PACKAGE = pathlib.Path(npattn.__file__).parent
FILES = sorted(PACKAGE.rglob("*.py"))


def _module_name(path: pathlib.Path) -> str:
    """``options``, ``scores.alibi``; a package's ``__init__`` is the package
    (``scores``), the top one ``__init__``."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1] or ("__init__",)
    return ".".join(parts)


MODULES = {_module_name(path) for path in FILES}


def _resolve(candidates: list[str]) -> str | None:
    """The longest dotted prefix of the first candidate that names a module."""
    for dotted in candidates:
        parts = dotted.split(".")
        for end in range(len(parts), 0, -1):
            if ".".join(parts[:end]) in MODULES:
                return ".".join(parts[:end])
    return None


def _imports(path: pathlib.Path) -> set[str]:
    """The npattn modules ``path`` imports, at module level or inside a function."""
    package = list(path.relative_to(PACKAGE).parts[:-1])  # the folder the module lives in
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package[: len(package) - (node.level - 1)]
        elif (node.module or "").startswith("npattn"):
            base, node = [], ast.ImportFrom(module=node.module.removeprefix("npattn").lstrip("."), names=node.names)
        else:
            continue
        module = base + (node.module.split(".") if node.module else [])
        targets = [".".join(module + [alias.name]) for alias in node.names] if not node.module else []
        resolved = [_resolve([target]) for target in targets] or [_resolve([".".join(module)])]
        found.update(name for name in resolved if name)
    return found - {_module_name(path)}


GRAPH = {_module_name(path): _imports(path) for path in FILES}


def _cycle_from(start: str) -> list[str] | None:
    """A path of imports from ``start`` back to itself, or None."""
    stack = [(start, [start])]
    seen = set()
    while stack:
        module, path = stack.pop()
        for dep in GRAPH[module]:
            if dep == start:
                return path + [start]
            if dep not in seen:
                seen.add(dep)
                stack.append((dep, path + [dep]))
    return None


def test_the_import_graph_has_no_cycle():
    cycles = {module: cycle for module in GRAPH if (cycle := _cycle_from(module)) is not None}
    assert not cycles, f"import cycles: {cycles}"


def test_the_cycle_finder_finds_a_cycle():
    GRAPH["_a"], GRAPH["_b"] = {"_b"}, {"_a"}
    try:
        assert _cycle_from("_a") == ["_a", "_b", "_a"]
    finally:
        del GRAPH["_a"], GRAPH["_b"]


def test_validation_imports_no_kernel_and_the_layer_parts_import_one_way():
    assert GRAPH["options"] <= {"namespace"}
    assert "mha" not in GRAPH["kv_cache"]


def test_make_spec_validates_only_and_choose_impl_picks_the_path():
    x = np.zeros((1, 8, 1024, 8))  # 8 * 1024 * 1024 scores >= 2**21: the NumPy fast path pays
    spec = make_spec(x, x, x)
    assert spec.impl == "auto"
    chosen = choose_impl(spec)
    assert chosen.impl == "chunked" and chosen is not spec and spec.impl == "auto"
    assert choose_impl(make_spec(x[..., :10, :], x, x)).impl == "dense"
    forced = make_spec(x, x, x, impl="dense")
    assert choose_impl(forced) is forced
    _, residuals = npattn.attention_forward(x, x, x)
    assert residuals.spec.impl == "chunked"  # the residuals record the path taken, never "auto"


def test_choose_impl_resolves_a_recurring_spec_once_while_it_lives(monkeypatch):
    """A spec that recurs (``RECURRING_SPECS``, as ``scalar_call_spec``
    marks one it hands out again) resolves to the same spec for the same
    kernel (the fused CuPy path keeps its launch plans by spec), to another
    where the kernel differs (``NPATTN_FAST_NUMPY=0``: the size rule
    alone), and keeps none past its own life; a spec made for one call
    resolves anew each time."""
    import gc
    import weakref

    from npattn.options import RECURRING_SPECS

    x = np.zeros((1, 8, 1024, 8))  # 2**23 scores: the NumPy fast path's size, below the chunked rule's
    once, spec = make_spec(x, x, x), make_spec(x, x, x)
    assert choose_impl(once) is not choose_impl(once)
    RECURRING_SPECS.values(spec)
    chosen = choose_impl(spec)
    assert choose_impl(spec) is chosen and chosen.impl == "chunked"
    monkeypatch.setenv("NPATTN_FAST_NUMPY", "0")
    assert choose_impl(spec).impl == "dense"
    monkeypatch.delenv("NPATTN_FAST_NUMPY")
    assert choose_impl(spec) is chosen
    gone = weakref.ref(chosen)
    del spec, chosen
    gc.collect()
    assert gone() is None


def test_choose_impl_reads_the_documented_threshold(monkeypatch):
    monkeypatch.setenv("NPATTN_FAST_NUMPY", "0")  # the size rule alone
    big = np.broadcast_to(np.zeros((), dtype=np.float32), (1, 1, 4096, 1))  # no memory behind it
    wide = np.broadcast_to(np.zeros((), dtype=np.float32), (1, 1, AUTO_CHUNKED_MIN_SCORES // 4096 + 1, 1))
    assert choose_impl(make_spec(big, wide, wide, align="top_left")).impl == "chunked"
    assert choose_impl(make_spec(big, big, big)).impl == "dense"


#: Modules whose hot loops may stay long (CONVENTIONS §3: kernels aside).
KERNELS = {"dense", "chunked", "fast_numpy", "modes.jvp", "modes.second_order", "modes.numpy_kernels"}

#: Code lines (the docstring not counted) a function outside the kernels may take.
MAX_FUNCTION_LINES = 80


def _code_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    total = (function.end_lineno or function.lineno) - function.lineno + 1
    first = function.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        total -= (first.end_lineno or first.lineno) - first.lineno + 1
    return total


def test_functions_outside_the_kernels_read_at_once():
    long = {
        f"{_module_name(path)}.{node.name}": _code_lines(node)
        for path in FILES
        if _module_name(path) not in KERNELS
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _code_lines(node) > MAX_FUNCTION_LINES
    }
    assert not long, f"functions over {MAX_FUNCTION_LINES} code lines outside the kernels: {long}"


def test_every_package_ships_in_the_wheel():
    """pyproject's package list finds every package under npattn/ (a wheel
    built with ``packages = ["npattn"]`` alone left out its subpackages)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    setuptools = pytest.importorskip("setuptools")
    root = PACKAGE.parent
    if not (root / "pyproject.toml").exists():
        pytest.skip("npattn is not imported from its checkout")
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    shipped = set(setuptools.find_packages(where=str(root), include=config["packages"]["find"]["include"]))
    on_disk = {".".join(p.parent.relative_to(root).parts) for p in PACKAGE.rglob("__init__.py")}
    assert on_disk <= shipped, f"packages left out of the wheel: {sorted(on_disk - shipped)}"
    assert "cuda/*.cu" in config["package-data"]["npattn"], "the fused CuPy kernels' sources ship as package data"
