"""Property-based tests (Hypothesis) of the Hopper kernels (``implementation="sm90"``) on an
H100/H200: the properties of tests/test_properties.py, drawn from the kernels' space (head dims
64, 96, 128, 192/128, 192, 256; lengths across their tiles, up to 700; GQA ratios up to 4; pages
of 64, 128 and 256 keys) and checked against the same naive float32 / bfloat16 oracle
(tests/attention_properties.py). Outputs land in NaN-poisoned memory, so a row a kernel should
write and does not is caught.

Segment ids run the forward and backward kernels with segment ids.

Default profile ``jax-fa4-gpu`` (more examples than the CPU file, derandomized); choose another
with ``JAX_FA4_HYPOTHESIS_PROFILE`` (e.g. ``jax-fa4-explore``). Kernels needed in the cache:
every shipped forward, backward, varlen and paged config (``--suite default``).
"""

from __future__ import annotations

import pytest
from hypothesis import example, given

from attention_properties import (GPU_PROFILE, GPU_SPACE, DenseCase, Heads, Options, PagedCase,
                                  VarlenCase, check_dense, check_paged, check_varlen,
                                  dense_cases, paged_cases, profile, varlen_cases)
from tests.gpu.test_sm90_fwd import poison_device_memory

pytestmark = pytest.mark.gpu

IMPLEMENTATION = "sm90"


@profile(GPU_PROFILE)
@given(case=dense_cases(GPU_SPACE))
# always covered: causal with Sq > Sk (rows 0-5 see no key: out 0, lse = sink, -inf for the
# sink's -inf head) with a decode-like MQA shape, and Sq = Sk = 1 (dq is exactly 0 in ref; the
# CPU file's regression)
@example(DenseCase(b=2, sq=9, sk=3, heads=Heads(h=4, hkv=1, d=128, dv=128),
                   opts=Options(causal=True), sink="extreme", lse_grad=True, seed=1))
@example(DenseCase(b=1, sq=1, sk=1, heads=Heads(h=2, hkv=1, d=64, dv=64), opts=Options(),
                   sink=None, lse_grad=False, seed=0))
def test_dense_matches_naive(case):
    """flash_attention on the forward and backward kernels (the sink in the forward's
    softmax)."""
    check_dense(case, IMPLEMENTATION, GPU_SPACE, before_call=poison_device_memory)


@profile(GPU_PROFILE, weight=0.5)
@given(case=dense_cases(GPU_SPACE, segments=True))
def test_segment_ids_match_naive(case):
    """flash_attention(segment_ids=...) on the forward and backward kernels with segment ids
    (packed and arbitrary ids)."""
    check_dense(case, IMPLEMENTATION, GPU_SPACE, before_call=poison_device_memory)


@profile(GPU_PROFILE)
@given(case=varlen_cases(GPU_SPACE))
# the CPU file's d sink regression (an empty key sequence first, an empty query one last)
@example(VarlenCase(lens_q=(11, 7, 0), lens_k=(0, 12, 7), pad_q=(1, 0), pad_k=(0, 2),
                    max_slack=0, heads=Heads(h=1, hkv=1, d=128, dv=128),
                    opts=Options(causal=True, window=(5, None), softcap=30.0), sink="normal",
                    lse_grad=True, seed=1010981))
def test_varlen_matches_naive(case):
    """flash_attention_varlen on the varlen forward and backward kernels."""
    check_varlen(case, IMPLEMENTATION, GPU_SPACE, before_call=poison_device_memory)


@profile(GPU_PROFILE)
@given(case=paged_cases(GPU_SPACE))
# always covered: an empty entry, a partly used last page, -1 table entries, a decode step
@example(PagedCase(sq=1, seqused=(100, 0, 128), page_size=64, max_pages=3, spare_pages=1,
                   heads=Heads(h=8, hkv=2, d=128, dv=128), opts=Options(window=(70, None)),
                   sink="normal", stale_entries=False, seed=2))
def test_paged_matches_naive(case):
    """flash_attention_paged on the paged kernel (decode packing and split-KV included)."""
    check_paged(case, IMPLEMENTATION, GPU_SPACE, before_call=poison_device_memory)
