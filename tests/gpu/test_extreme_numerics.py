"""Extreme numerics on the Hopper kernels (issue #24): the cases of tests/extreme_cases.py
(scores up to 8e37, softcap with huge logits, rows with no visible key under causal Sq > Sk,
windows, varlen and paged) through the API with ``implementation="sm90"`` under ``jax.jit``:
no NaN, rows without keys exactly 0 with lse -inf (or the sink), the other rows and the
gradients against a float64 oracle by FA4's rule (tests/numerics.py). Device memory is filled
with NaN before every kernel run, so a row the kernels should write and do not is caught.

The segment-id cases run on the CPU only (tests/test_extreme_numerics.py): no kernel takes
segment ids yet, and a forced ``implementation="sm90"`` refuses them.

Kernels needed in the cache: the head-dim-128 dense, varlen and paged configs of the shipped
rows (``--suite tests``).
"""

from __future__ import annotations

import pytest

from extreme_cases import CASES, check_case
from tests.gpu.test_sm90_fwd import poison_device_memory

pytestmark = pytest.mark.gpu

#: Every case but the segment-id ones. Scores of 1e9 and more without a softcap once gave NaN
#: here (the one-FFMA exponent's rounding near 2^31); the forward now takes an exact exponent in
#: such key blocks and the backward's lse_log2 a margin (common/softmax.py, preprocess_config).
KERNEL_CASES = [case for case in CASES if case.segments is None]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: c.name)
def test_extreme_case_sm90(case):
    check_case(case, "sm90", before_run=poison_device_memory)
