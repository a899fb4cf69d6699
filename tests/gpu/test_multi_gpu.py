"""Several GPUs: the multi-GPU run's correctness checks, one test each.

The checks of ``jax_fa4.tools.multi_gpu``: sharded ``flash_attention`` (batch, heads with GQA,
both), ring attention (causal zig-zag and contiguous, non-causal), forward and backward against
the float32 reference by FA4's rule, and the GPT example's ``--mesh`` runs against the reference
implementation (the module's docstring). Needs at least two GPUs (skipped otherwise); the
``gpu`` marker comes from tests/gpu/conftest.py. ``python benchmarks/multi_gpu.py`` runs the
same checks and records them.
"""

from __future__ import annotations

import jax
import pytest

from jax_fa4.tools import multi_gpu

pytestmark = pytest.mark.skipif(len(jax.devices()) < 2, reason="needs at least 2 GPUs")

CASES = multi_gpu.check_cases(jax.devices(), multi_gpu.FULL)


@pytest.mark.parametrize("name", list(CASES))
def test_multi_gpu_check(name):
    record = CASES[name]()
    assert record["passed"], record
