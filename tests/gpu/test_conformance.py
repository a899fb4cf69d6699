"""The conformance suite (tests/conformance.py) on the GPU, for real: every case on every kernel
backend of ``jax_fa4.backends.BACKENDS`` whose GPU is the default device (on an H100/H200: sm90),
through the public API under ``jax.jit`` with the backend forced, outputs in NaN-poisoned device
memory, checked against the float32 oracle by FA4's rule. A case the backend declines checks
what the API documents instead (``conformance.check_backend``); any other fallback to the
reference fails, whatever ``JAX_FA4_REQUIRE_GPU`` says.

Kernel backends of other GPU families skip here: tests/test_conformance.py checks their
lowering on any machine (and that the ``tests`` suite, this run's kernel cache, holds every
kernel these cases need).
"""

from __future__ import annotations

import pytest

from conformance import CASES, check_backend, gpu_is_default_device
from jax_fa4 import backends
from tests.gpu.test_sm90_fwd import poison_device_memory


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("name", [name for name, b in backends.BACKENDS.items()
                                  if b.compute_capability is not None])
def test_conformance_on_the_gpu(name, case):
    backend = backends.get(name)
    if not gpu_is_default_device(backend):
        pytest.skip(f"the default device is not a {backend.gpu_family} GPU "
                    "(tests/test_conformance.py checks the lowering)")
    check_backend(case, backend, before_run=poison_device_memory)
