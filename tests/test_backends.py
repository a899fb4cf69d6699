"""The backend interface (jax_fa4/backends): the API, the options, the autodiff rules and the
registry name no GPU family, and a backend registered under a new name serves every entry point
(dense forward and backward, varlen, paged) with nothing else changed."""

from __future__ import annotations

import ast
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from conformance import normal
from jax_fa4 import backends
from jax_fa4.backends import base
from jax_fa4.backends.kernel import KernelBackend
from jax_fa4.ffi import sources

ARCH_NAME = re.compile(r"sm_?\d{2,3}", re.IGNORECASE)
#: Modules that must hold no architecture branch: the public API, the options, every autodiff
#: rule, the registry and what every backend shares.
FAMILY_FREE = ("jax_fa4.api", "jax_fa4.options", "jax_fa4.autodiff", "jax_fa4.backends",
               "jax_fa4.backends.base", "jax_fa4.backends.kernel", "jax_fa4.backends.decode",
               "jax_fa4.parallel.sharding", "jax_fa4.parallel.ring")


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes of a module, its classes and functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _registration_nodes(tree: ast.Module) -> set[int]:
    """The registry's registration: the imports of the backend modules and ``BACKENDS = ...``."""
    allowed = set()
    for node in tree.body:
        is_import = (isinstance(node, ast.ImportFrom)
                     and (node.module or "").startswith("jax_fa4.backends."))
        is_table = (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and node.target.id == "BACKENDS")
        if is_import or is_table:
            allowed.update(id(n) for n in ast.walk(node))
    return allowed


def _architecture_names(module: str, skip_registration: bool = True) -> list[tuple[int, str]]:
    """(line, text) of every name, attribute or string (docstrings aside) naming a GPU family."""
    path = sources.module_file(module)
    tree = ast.parse(path.read_text(), str(path))
    skip = _docstrings(tree)
    if module == "jax_fa4.backends" and skip_registration:
        skip |= _registration_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        texts = []
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            texts.append(node.value)
        elif isinstance(node, ast.Name):
            texts.append(node.id)
        elif isinstance(node, ast.Attribute):
            texts.append(node.attr)
        elif isinstance(node, ast.alias):
            texts += [node.name, node.asname or ""]
        elif isinstance(node, ast.ImportFrom):
            texts.append(node.module or "")
        found += [(node.lineno if hasattr(node, "lineno") else 0, t) for t in texts
                  if ARCH_NAME.search(t)]
    return found


@pytest.mark.parametrize("module", FAMILY_FREE)
def test_no_architecture_branch_outside_the_family_modules(module):
    assert _architecture_names(module) == [], (
        f"{module} names a GPU family; that belongs in its backend module")


def test_the_scan_sees_architecture_names():
    """The scan finds what it looks for: the family modules are full of them, and the registry's
    one registration is all it has."""
    assert _architecture_names("jax_fa4.backends.sm90")
    lines = sorted({line for line, _ in _architecture_names("jax_fa4.backends",
                                                             skip_registration=False)})
    assert lines and lines[-1] - lines[0] < 12, lines  # the imports and the table, one place


def test_registry():
    """Every registered backend is a Backend under its own name; kernel backends name a compile
    target and a GPU family of their own; the reference is the default of every entry point."""
    assert backends.names()[0] == base.REFERENCE
    assert backends.get(base.REFERENCE) is base.REFERENCE_BACKEND
    families = set()
    for name, backend in backends.BACKENDS.items():
        assert isinstance(backend, base.Backend) and backend.name == name
        if isinstance(backend, KernelBackend):
            assert backend.arch and backend.compute_capability and backend.capability_text
            families.add(backend.compute_capability)
    assert len(families) == len(backends.BACKENDS) - 1


# -- a backend registered under a new name ----------------------------------------------------
class RecordingBackend(base.Backend):
    """The reference under another name, recording which entry points ran."""

    name = "test-backend"

    def __init__(self, declines: str | None = None):
        self.calls: list[str] = []
        self.declines = declines

    def supports_forward(self, q, k, v, opts):
        return self.declines

    def forward(self, q, k, v, opts):
        self.calls.append("forward")
        return super().forward(q, k, v, opts)

    def backward(self, *args):
        self.calls.append("backward")
        return super().backward(*args)

    def varlen_forward(self, *args):
        self.calls.append("varlen_forward")
        return super().varlen_forward(*args)

    def varlen_backward(self, *args):
        self.calls.append("varlen_backward")
        return super().varlen_backward(*args)

    def paged_forward(self, *args):
        self.calls.append("paged_forward")
        return super().paged_forward(*args)


@pytest.fixture
def registered(monkeypatch):
    backend = RecordingBackend()
    monkeypatch.setitem(backends.BACKENDS, backend.name, backend)
    return backend


def _qkv(b=2, s=24, h=4, hkv=2, d=16, seed=0):
    return normal(f"backends {seed}", [(b, s, h, d), (b, s, hkv, d), (b, s, hkv, d)],
                  jnp.float32)


def _close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)


def test_a_registered_backend_serves_the_dense_forward_and_backward(registered):
    q, k, v = _qkv()

    def loss(implementation):
        return lambda q, k, v: jnp.sum(jax_fa4.flash_attention(
            q, k, v, causal=True, implementation=implementation) ** 2)

    # (jitted: one program each, not an XLA program per operation)
    got = jax.jit(jax.value_and_grad(loss(registered.name), argnums=(0, 1, 2)))(q, k, v)
    assert set(registered.calls) == {"forward", "backward"}
    _close(got, jax.jit(jax.value_and_grad(loss("reference"), argnums=(0, 1, 2)))(q, k, v))


def test_a_registered_backend_serves_varlen_and_paged(registered):
    q, k, v = (np.asarray(x)[0] for x in _qkv(b=1, s=20))  # (NumPy: sliced without XLA)
    cu = np.array([0, 7, 20], np.int32)

    def varlen(implementation):
        return lambda q: jnp.sum(jax_fa4.flash_attention_varlen(
            q, k, v, cu, cu, 13, 13, causal=True, implementation=implementation))

    got = jax.jit(jax.value_and_grad(varlen(registered.name)))(q)
    assert set(registered.calls) == {"varlen_forward", "varlen_backward"}
    _close(got, jax.jit(jax.value_and_grad(varlen("reference")))(q))

    cache = k.reshape(5, 4, 2, 16)
    table = np.array([[0, 1, 2], [3, 4, 0]], np.int32)
    seqused = np.array([12, 5], np.int32)
    qp = q[:4].reshape(2, 2, 4, 16)
    out = jax_fa4.flash_attention_paged(qp, cache, cache, table, seqused,
                                        implementation=registered.name)
    assert registered.calls[-1] == "paged_forward"
    _close(out, jax_fa4.flash_attention_paged(qp, cache, cache, table, seqused,
                                              implementation="reference"))


def test_a_declining_backend_raises_when_forced_and_falls_back_when_picked(monkeypatch,
                                                                           caplog):
    """Forced: ImplementationUnavailableError with its reason. Picked by the GPU (a faked
    capability of its own): the reference runs, reported through reference_fallback."""
    backend = RecordingBackend(declines="no kernel for this test")
    backend.compute_capability, backend.capability_text = "99", "99.x"
    monkeypatch.setitem(backends.BACKENDS, backend.name, backend)
    q, k, v = _qkv()
    with pytest.raises(jax_fa4.ImplementationUnavailableError, match="no kernel for this test"):
        jax_fa4.flash_attention(q, k, v, implementation=backend.name)
    monkeypatch.setattr(backends, "gpu_compute_capability", lambda: "99.0")
    caplog.set_level(logging.INFO, logger="jax_fa4")
    out = jax_fa4.flash_attention(q, k, v)
    assert backend.calls == []
    assert any("forward on test-backend runs the pure-JAX reference: no kernel for this test"
               in r.getMessage() for r in caplog.records)
    _close(out, jax_fa4.flash_attention(q, k, v, implementation="reference"))
