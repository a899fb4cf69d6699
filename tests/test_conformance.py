"""The conformance suite (tests/conformance.py) on every registered backend, as each can run here.

Each (backend, case) of ``jax_fa4.backends.BACKENDS`` × ``conformance.CASES`` is exercised by
what the backend is:

* a backend that runs on any device (the reference): the case runs for real and is checked
  against the float32 oracle (``conformance.check_backend``);
* a kernel backend whose GPU is the default device: tests/gpu/test_conformance.py runs the case
  on it (skipped here, with that pointer);
* a kernel backend whose GPU is absent: compile-only. The forced call (its gradient, or the
  forward of a paged case) is lowered for CUDA with placeholder kernel objects
  (tests/cuda_lowering.py: nothing is compiled): every custom call is one of the backend's
  kernels, every kernel config it asks for is a shipped variant (so the exhaustive tier
  compiles and SASS-checks it), a served backward lowers to the backend's backward kernels,
  and declined calls do what the API documents.

The GPU suite's kernel cache is the ``tests`` suite of ``jax_fa4.tools.variants``; the last tests
check that it holds every kernel the GPU cases of the validated kernel backends need (the GPU
suite's other calls: tests/test_gpu_suite_kernels.py), and that the backward kinds it builds for
the cases alone (``GPU_CONFORMANCE_BACKWARD``) are ones a case reaches.
"""

from __future__ import annotations

import functools

import jax
import pytest

import jax_fa4
from compiled import per_class
from conformance import (CASES, Case, check_backend, check_declines, gpu_is_default_device,
                         watch_fallbacks)
from cuda_lowering import lower_for_cuda, placeholder
from jax_fa4 import backends
from jax_fa4.tools.variants import GPU_CONFORMANCE_BACKWARD, Variant, backward_kind, variants


@functools.cache
def lowered(name: str, case: Case):
    """(the kernels (config, arch) the forced call asks for, the custom calls' objects in the
    lowered text, the fallbacks and warnings reported), or the ImplementationUnavailableError
    the call raised; the call lowered for CUDA as on a machine without a GPU
    (``cuda_lowering.lower_for_cuda``), once per process."""
    backend = backends.get(name)
    backward_reason = case.reasons(backend, case.forced_options(name))[1]
    attention = case.attention(name)
    program = attention
    if case.differentiable:
        program = jax.grad(lambda q, k, v: sum(x.sum() for x in attention(q, k, v)),
                           argnums=(0, 1, 2))
    with watch_fallbacks(expected=case.differentiable and backward_reason is not None
                         ) as watched:
        try:
            kernels, objects = lower_for_cuda(program, *case.shapes())
        except jax_fa4.ImplementationUnavailableError as err:
            return err
    return kernels, objects, watched


@functools.cache
def _variants(suite: str, arch: str) -> frozenset[Variant]:
    return frozenset(variants(suite, archs=[arch]))


def _check_lowering(backend, case: Case) -> None:
    opts = case.forced_options(backend.name)
    forward_reason, backward_reason = case.reasons(backend, opts)
    result = lowered(backend.name, case)
    if forward_reason is not None:
        assert isinstance(result, jax_fa4.ImplementationUnavailableError), result
        assert forward_reason in str(result)
        return
    assert not isinstance(result, Exception), result
    kernels, objects, watched = result
    assert kernels and {arch for _, arch in kernels} == {backend.arch}, kernels
    assert sorted(objects) == sorted(placeholder(c, a) for c, a in kernels), objects
    shipped = _variants("default", backend.arch)
    unshipped = [c.describe() for c, a in kernels if Variant(c, a) not in shipped]
    assert not unshipped, f"kernels not in jax_fa4.tools.variants' shipped set: {unshipped}"
    check_declines(backend, watched, backward_reason if case.differentiable else None)
    if case.differentiable and backward_reason is None:
        configs = {c for c, _ in kernels}
        assert set(case.backward_kernels(backend, opts)) <= configs, configs


def _conformance_params() -> list:
    """(backend name, case) of the test below: every case on every kernel backend (each case
    lowers to that backend's kernels for it); on the backend that runs the cases for real here,
    the reference (its options and shapes checked against an oracle by tests/test_reference.py
    and tests/test_extreme_numerics.py), the quick tier runs one case per kind, the layout
    (dense, segment ids, varlen, paged) and the dtype (16-bit inputs: FA4's rule; float32:
    float32 agreement), ``--exhaustive`` every case."""
    params = []
    for name, backend in backends.BACKENDS.items():
        cases = CASES if backend.compute_capability is not None else per_class(
            CASES, key=lambda case: (type(case), case.dtype))
        params += [pytest.param(name, case, id=f"{name}-{case.name}") for case in cases]
    return params


@pytest.mark.parametrize("name, case", _conformance_params())
def test_conformance(name, case):
    backend = backends.get(name)
    if backend.compute_capability is None:
        check_backend(case, backend)
    elif gpu_is_default_device(backend):
        pytest.skip(f"the default device is a {backend.gpu_family} GPU: "
                    "tests/gpu/test_conformance.py runs the case on it")
    else:
        _check_lowering(backend, case)


@pytest.mark.parametrize("name", [name for name, b in backends.BACKENDS.items()
                                  if b.compute_capability is not None and b.enable_env is None])
def test_gpu_suite_holds_every_kernel_of_the_cases(name):
    """A validated kernel backend (not opt-in) runs the cases in the GPU suite, whose kernel
    cache is the ``tests`` suite of its arch: a kernel missing there would fail the GPU run with
    KernelNotAvailableError."""
    backend = backends.get(name)
    suite = _variants("tests", backend.arch)
    missing = {}
    for case in CASES:
        result = lowered(name, case)
        if isinstance(result, Exception):  # declined: no kernel runs
            continue
        kernels = result[0]
        missing[case.name] = [c.describe() for c, a in kernels if Variant(c, a) not in suite]
    assert missing and not any(missing.values()), {k: v for k, v in missing.items() if v}


def test_listed_conformance_backward_kinds_are_reached():
    """Each kind of variants.GPU_CONFORMANCE_BACKWARD (the sm90 backward kernels the ``tests``
    suite builds for the cases alone) is one a case's sm90 gradient reaches: none compiled for
    nothing once its case goes (the test above names any missing)."""
    reached = set()
    for case in CASES:
        result = lowered("sm90", case)
        if not isinstance(result, Exception):
            reached |= {backward_kind(c) for c, _ in result[0] if c.kernel_name == "sm90_bwd"}
    assert set(GPU_CONFORMANCE_BACKWARD) <= reached, set(GPU_CONFORMANCE_BACKWARD) - reached
