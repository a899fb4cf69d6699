"""The repository's layers: tests/ and benchmarks/ never import each other (what both need lives
in the package, ``jax_fa4.tools``), and the library (``jax_fa4`` outside ``tools/``) never imports
the tools. Kernel modules' own import rules (no JAX, configs never import kernels) are checked by
tests/test_cache_keys.py."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


#: Calls that put a folder on the import path or import a module by name or path.
_IMPORTING_CALLS = {"insert", "append", "extend", "import_module", "spec_from_file_location",
                    "run_path", "run_module", "SourceFileLoader", "__import__"}


def cross_imports(root) -> list[str]:
    """Where a file under ``root/tests`` imports one of ``root/benchmarks`` or the other way,
    by name (``import``, ``from ... import``) or through ``sys.path`` / ``importlib`` / ``runpy``
    with the other folder's path; a script under benchmarks/ may not touch ``sys.path`` at all.
    Also where the library (``jax_fa4`` outside ``tools/``) imports ``jax_fa4.tools``."""
    bench_files = sorted((root / "benchmarks").glob("*.py"))
    test_files = sorted((root / "tests").rglob("*.py"))
    names = {"tests": {p.stem for p in bench_files} | {"benchmarks"},
             "benchmarks": ({p.stem for p in test_files}
                            | {p.name for p in (root / "tests").rglob("*") if p.is_dir()}
                            | {"tests"})}
    found = []
    for side, files in (("tests", test_files), ("benchmarks", bench_files)):
        other = "benchmarks" if side == "tests" else "tests"
        for path in files:
            text = path.read_text()
            where = path.relative_to(root).as_posix()
            for node in sorted(ast.walk(ast.parse(text, str(path))),
                               key=lambda n: getattr(n, "lineno", 0)):
                if isinstance(node, ast.Import):
                    modules = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    modules = [node.module or ""]
                else:
                    modules = []
                for module in modules:
                    if module.split(".")[0] in names[side]:
                        found.append(f"{where}:{node.lineno} imports {module}")
                if isinstance(node, ast.Call):
                    func = node.func
                    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                    if name not in _IMPORTING_CALLS:
                        continue
                    source = ast.unparse(node)
                    touches_path = (name in ("insert", "append", "extend")
                                    and ast.unparse(func).startswith("sys.path"))
                    reaches = other in source.lower()
                    if ((touches_path and side == "benchmarks")
                            or ((touches_path or name not in ("insert", "append", "extend"))
                                and reaches)):
                        what = f"reaches {other}/" if reaches else "changes sys.path"
                        found.append(f"{where}:{node.lineno} {what}: {source[:80]}")
                elif isinstance(node, (ast.Assign, ast.AugAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    if any(ast.unparse(t).startswith("sys.path") for t in targets) and (
                            side == "benchmarks" or other in ast.unparse(node).lower()):
                        found.append(f"{where}:{node.lineno} changes sys.path: "
                                     f"{ast.unparse(node)[:80]}")
    for path in sorted((root / "jax_fa4").rglob("*.py")):
        text = path.read_text()
        # (an import of the tools names them: a file that never writes "tools" imports none)
        if "tools" in path.relative_to(root / "jax_fa4").parts or "tools" not in text:
            continue
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                package = ".".join(path.relative_to(root).with_suffix("").parts[:-node.level]
                                   if node.level else ())
                base = ".".join(x for x in (package, node.module or "") if x)
                modules = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            if any(m == "jax_fa4.tools" or m.startswith("jax_fa4.tools.") for m in modules):
                found.append(f"{path.relative_to(root).as_posix()}:{node.lineno} imports the tools")
    return found


def test_tests_and_benchmarks_do_not_import_each_other():
    """What both need lives in the package (``jax_fa4.tools``); the library never imports it."""
    assert (REPO / "benchmarks").is_dir() and (REPO / "tests" / "numerics.py").is_file()
    assert cross_imports(REPO) == []


def test_cross_imports_are_found(tmp_path):
    """The check above finds each way across (it would not pass on a tree that had one)."""
    for folder in ("tests/gpu", "benchmarks", "jax_fa4/tools", "jax_fa4/backends"):
        (tmp_path / folder).mkdir(parents=True)
    files = {
        "tests/numerics.py": "import jax\n",
        "tests/gpu/test_x.py": "import sys\nsys.path.insert(0, str(ROOT / 'benchmarks'))\n",
        "tests/test_y.py": "from multi_gpu import main\n",
        "tests/test_z.py": "import runpy\nrunpy.run_path('benchmarks/multi_gpu.py')\n",
        "benchmarks/multi_gpu.py": "import sys\nsys.path.insert(0, 'x')\nfrom numerics import e\n",
        "benchmarks/other.py": "import multi_gpu\nimport tests.numerics\n",
        "jax_fa4/backends/base.py": "from ..tools import bench\n",
        "jax_fa4/tools/bench.py": "import jax_fa4\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    found = cross_imports(tmp_path)
    assert [f.split(" ")[0] for f in found] == [
        "tests/gpu/test_x.py:2", "tests/test_y.py:1", "tests/test_z.py:2",
        "benchmarks/multi_gpu.py:2", "benchmarks/multi_gpu.py:3", "benchmarks/other.py:2",
        "jax_fa4/backends/base.py:1"], found


def kernel_imports_outside(root: Path) -> list[str]:
    """Where a module under ``root/jax_fa4/kernels`` imports JAX (``jax``, ``jaxlib``, ``flax``)
    or a part of the package outside ``jax_fa4.kernels`` (which would bring JAX in): kernels and
    their configs build with the DSL alone, on any machine, and their cache keys stay theirs."""
    found = []
    kernels = root / "jax_fa4" / "kernels"
    for path in sorted(kernels.rglob("*.py")):
        rel = path.relative_to(root)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                package = rel.with_suffix("").parts[:-node.level] if node.level else ()
                modules = [".".join(x for x in (*package, node.module or "") if x)]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in ("jax", "jaxlib", "flax") or (
                        top == "jax_fa4" and not module.startswith("jax_fa4.kernels")):
                    found.append(f"{rel.as_posix()}:{node.lineno} imports {module}")
    return found


def test_kernels_do_not_import_jax():
    assert (REPO / "jax_fa4" / "kernels" / "sm90").is_dir()
    assert kernel_imports_outside(REPO) == []


def test_kernel_imports_outside_are_found(tmp_path):
    """The check above finds a direct JAX import, a lazy one in a function and a relative import
    that leaves the kernels package."""
    kernels = tmp_path / "jax_fa4" / "kernels" / "sm90"
    kernels.mkdir(parents=True)
    (kernels / "a.py").write_text("import jax.numpy as jnp\nfrom jax_fa4.kernels import spec\n")
    (kernels / "b.py").write_text("def f():\n    from jax_fa4.backends import base\n")
    (kernels / "c.py").write_text("from ...options import x\nfrom .. import spec\n")
    found = kernel_imports_outside(tmp_path)
    assert [f.split(" ")[0] for f in found] == [
        "jax_fa4/kernels/sm90/a.py:1", "jax_fa4/kernels/sm90/b.py:2",
        "jax_fa4/kernels/sm90/c.py:1"], found
