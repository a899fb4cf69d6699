"""Several GPUs: benchmarks/multi_gpu.py's correctness checks, one test each.

Sharded ``flash_attention`` (batch, heads with GQA, both), ring attention (causal zig-zag and
contiguous, non-causal), forward and backward against the float32 reference by FA4's rule, and
the GPT example's ``--mesh`` runs against the reference implementation (the script's
docstring). Needs at least two GPUs (skipped otherwise); the ``gpu`` marker comes from
tests/gpu/conftest.py. ``python benchmarks/multi_gpu.py`` runs the same checks and records them.
"""

from __future__ import annotations

import pathlib
import sys

import jax
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import multi_gpu  # noqa: E402

sys.path.pop(0)

pytestmark = pytest.mark.skipif(len(jax.devices()) < 2, reason="needs at least 2 GPUs")

CASES = multi_gpu.check_cases(jax.devices(), multi_gpu.FULL)


@pytest.mark.parametrize("name", list(CASES))
def test_multi_gpu_check(name):
    record = CASES[name]()
    assert record["passed"], record
