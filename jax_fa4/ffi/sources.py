"""The package's import graph, read from its source files (``ast``; nothing is imported).

A kernel's generated code depends on exactly the package modules its launcher module imports,
transitively: :func:`closure` lists them, and the kernel cache hashes their files into its keys
(:func:`jax_fa4.ffi.cache.kernel_source_fingerprint`). The same graph lets the tests find import
cycles (:func:`import_graph`, :func:`cycles`).

What counts as an import of module ``m``: every ``import`` / ``from ... import`` statement in
``m``'s file, at any depth (inside functions and ``if`` blocks too), relative ones resolved
against ``m``'s package; ``from pkg import name`` is the module ``pkg.name`` when that is a
module, else ``pkg``. Only modules of the package (files under ``root``) count. The parent
packages that Python runs first (``jax_fa4/__init__.py`` for any ``jax_fa4.x``) do not: they hold
no kernel code, and ``jax_fa4/__init__.py`` is the JAX API.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable, Mapping
from pathlib import Path

PACKAGE = "jax_fa4"
#: Modules of tuning tables: they choose configs, and what they choose reaches the generated code
#: only as config fields, which are in the key themselves. :func:`closure` does not enter them,
#: so a table edit recompiles only the configs it changed (tests/test_cache_keys.py checks that
#: only config modules import them).
TUNING_MODULES = frozenset({
    "jax_fa4.kernels.sm90.fwd_tuning",
    "jax_fa4.kernels.sm90.bwd_tuning",
    "jax_fa4.kernels.sm100.fwd_tuning",
    "jax_fa4.kernels.sm100.bwd_tuning",
})
#: The directory holding the ``jax_fa4`` package (a checkout's root, or site-packages).
ROOT = Path(__file__).resolve().parent.parent.parent


def module_file(name: str, root: Path = ROOT) -> Path | None:
    """The file of module ``name`` under ``root`` (``a/b.py`` or ``a/b/__init__.py``), or None."""
    base = root.joinpath(*name.split("."))
    for path in (base.parent / f"{base.name}.py", base / "__init__.py"):
        if path.is_file():
            return path
    return None


def module_name(path: Path, root: Path = ROOT) -> str:
    """The dotted name of the module in ``path`` (a file under ``root``)."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_names(tree: ast.AST, package: str) -> Iterable[tuple[str, str | None]]:
    """(module, name or None) of every import statement in ``tree``, relative ones resolved."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                yield base, alias.name


@functools.cache
def direct_imports(name: str, root: Path = ROOT) -> frozenset[str]:
    """The package modules that module ``name`` imports itself (see the module doc)."""
    path = module_file(name, root)
    if path is None:
        raise ModuleNotFoundError(f"no module {name!r} under {root}")
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for base, attr in _imported_names(ast.parse(path.read_bytes(), str(path)), package):
        if base != PACKAGE and not base.startswith(PACKAGE + "."):
            continue
        if attr is not None and attr != "*" and module_file(f"{base}.{attr}", root):
            found.add(f"{base}.{attr}")
        elif module_file(base, root):
            found.add(base)
    found.discard(name)
    return frozenset(found)


@functools.cache
def closure(name: str, root: Path = ROOT) -> tuple[str, ...]:
    """Module ``name`` and every package module it imports, transitively (sorted names), except
    the :data:`TUNING_MODULES`."""
    seen, todo = {name}, [name]
    while todo:
        for dep in direct_imports(todo.pop(), root):
            if dep not in seen and dep not in TUNING_MODULES:
                seen.add(dep)
                todo.append(dep)
    return tuple(sorted(seen))


def import_graph(root: Path = ROOT, under: str = PACKAGE) -> dict[str, frozenset[str]]:
    """module -> the package modules it imports, for every module of package ``under``."""
    top = root.joinpath(*under.split("."))
    return {module_name(p, root): direct_imports(module_name(p, root), root)
            for p in sorted(top.rglob("*.py"))}


def cycles(graph: Mapping[str, Iterable[str]]) -> list[tuple[str, ...]]:
    """The import cycles of ``graph``: its strongly connected components of more than one module
    (Tarjan's algorithm), each sorted; edges leaving the graph's modules are ignored."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[tuple[str, ...]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(tuple(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)
