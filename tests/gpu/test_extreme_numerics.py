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
#: units of the exponent (±128 near 2^31): P = inf or 0, so NaN outputs or empty rows. Two exact
#: fallbacks were built and measured: a per-row branch (session 22: forward −5 … −15 %, head dim
#: 128 backward −11 %) and one warp-uniform vote per key block around the unchanged fast path
#: (session 23: forward −6 … −13 % at head dims 64–128, decode and head dim 256 unchanged); both
#: taken out (docs/perf-log.md). The backward's lse_log2 margin on huge rows (preprocess_config)
#: stays: it keeps the rebuilt P <= 1 wherever the forward is finite. Softcap bounds the logits:
#: those cases pass.
BEYOND_FFMA = pytest.mark.xfail(
    strict=True, reason="scores >= 1e9: the one-FFMA exponent loses whole units (issue #24)")

KERNEL_CASES = [
    pytest.param(case, marks=BEYOND_FFMA) if (case.score or 0) >= 1e9 and not case.softcap
    else case
    for case in CASES if case.segments is None]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: c.name)
def test_extreme_case_sm90(case):
    check_case(case, "sm90", before_run=poison_device_memory)
