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

#: Known gap (issue #24, open): scores of 1e9 and more without a softcap. The kernels' softmax
#: exponent is one FFMA, s·scale·log2 e − round(m·scale·log2 e); past 2^24 that rounding is whole
#: units of the exponent (±128 near 2^31): P = inf or 0, so NaN outputs or empty rows. An exact
#: per-row fallback was built and measured this session (session 22): right on every case here,
#: but 5–15 % slower forward and ~11 % slower head dim 128 backward (the branch inside the
#: unrolled softmax), so it was taken out; docs/NOTES.md has the next attempt (one warp-uniform
#: branch per block around the unchanged fast path). Softcap bounds the logits: those pass.
BEYOND_FFMA = pytest.mark.xfail(
    strict=True, reason="scores >= 1e9: the one-FFMA exponent loses whole units (issue #24)")

KERNEL_CASES = [
    pytest.param(case, marks=BEYOND_FFMA) if (case.score or 0) >= 1e9 and not case.softcap
    else case
    for case in CASES if case.segments is None]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: c.name)
def test_extreme_case_sm90(case):
    check_case(case, "sm90", before_run=poison_device_memory)
