"""Padding isolation on the Hopper kernels (``implementation="sm90"``), on an H100/H200.

The checks of tests/test_padding_isolation.py (shared code: tests/padding_checks.py) on the
varlen forward + backward kernels and the paged decode / chunk kernel, bf16, head dims 64, 128
and 256: NaN / +Inf / -Inf in storage the call does not use must leave every valid out, lse,
dq, dk, dv (and dsink) equal to the same call with finite random values there; padding rows
keep out 0 / lse -inf and padding tokens get exactly 0 gradient.

The shapes put the padding inside a kernel tile: the last sequence ends a few rows into a
128-row query tile and mid-way through every key block size (64–176), the totals are not
multiples of 128, and 200 padding tokens follow it (more than one tile, so a whole-tile load
reads poisoned memory rather than stopping at the tensor's end); 5 padding tokens precede the
first sequence. Paged: page sizes 64, 128 and 256 with ``seqused_k`` mid-page and mid key
block, -1 and stale table entries past the used pages, long enough contexts for split-KV.

Expected to fail on kernels that load whole tiles and mask scores only (then ``0·NaN`` in P·V,
dS·K, dSᵀ·Q, Pᵀ·dO, or a NaN dO row in the preprocess's delta): each failure lists, per poisoned
input and result, how many valid elements turned non-finite or changed. dq is compared with a
small tolerance (the default backward adds dQ across key blocks with atomics, in arrival
order); everything else bit for bit.

Kernels needed in the cache: the varlen forward / backward and paged configs of the shipped
rows used here (``--suite default``).
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

import jax_fa4
from padding_checks import paged_isolation_failures, varlen_isolation_failures

pytestmark = pytest.mark.gpu

#: The implementation under test (a module constant, so the harness can be dry-run elsewhere).
IMPLEMENTATION = "sm90"
DTYPE = jnp.bfloat16
#: dq: (rtol, atol as a fraction of max |dq|): about two bf16 ulps, for atomics' order.
DQ_TOLERANCE = {"dq": (2.0 ** -6, 1e-3)}

# Ends: 77, 78, 378, 508 query tokens (508 % 128 = 124) and 100, 107, 364, 554 keys; the last
# sequence has 130 queries (2 rows into its second 128-row tile) and 190 keys (mid-block for
# key blocks of 64, 80, 96, 112, 128, 176).
LENS_Q = (77, 1, 300, 130)
LENS_K = (100, 7, 257, 190)
PAD_FRONT, PAD_BACK = 5, 200

VARLEN_CASES = {  # name: (h, hkv, d, causal, with_sink)
    "d128-gqa": (4, 2, 128, False, False),
    "d128-gqa-causal": (4, 2, 128, True, False),
    "d64": (2, 2, 64, False, False),
    "d64-causal": (2, 2, 64, True, False),
    "d256-causal": (2, 2, 256, True, False),
    "d128-gqa-causal-sink": (4, 2, 128, True, True),
}


@pytest.mark.parametrize("case", VARLEN_CASES)
def test_varlen_padding_isolated(case):
    """The varlen forward, preprocess, backward and postprocess kernels."""
    h, hkv, d, causal, with_sink = VARLEN_CASES[case]

    def attend(q, k, v, sink, cu_q, cu_k):
        return jax_fa4.flash_attention_varlen(
            q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), causal=causal,
            learnable_sink=sink, return_lse=True, implementation=IMPLEMENTATION)

    failures = varlen_isolation_failures(attend, LENS_Q, LENS_K, PAD_FRONT, PAD_BACK, h, hkv,
                                         d, d, dtype=DTYPE, with_sink=with_sink,
                                         tolerances=DQ_TOLERANCE)
    assert not failures, (f"varlen {case} (lens_q={LENS_Q} lens_k={LENS_K}, padding "
                          f"{PAD_FRONT} + {PAD_BACK}):\n" + "\n".join(failures))


PAGED_CASES = {  # name: (b, sq, h, hkv, d, page_size, max_pages, seqused, causal, with_sink)
    "decode-d64-page128": (3, 1, 8, 2, 64, 128, 10, (1000, 70, 333), False, False),
    "decode-d128-page256": (3, 1, 8, 2, 128, 256, 8, (1500, 1, 300), False, False),
    "decode-d256-page64": (2, 1, 8, 2, 256, 64, 32, (1500, 90), False, False),
    # 4 queries, causal: a sequence with fewer keys than queries has rows without keys
    "chunk4-causal-d128-page128": (3, 4, 16, 4, 128, 128, 4, (300, 3, 129), True, False),
    "decode-d128-page128-sink": (3, 1, 16, 4, 128, 128, 32, (4000, 0, 130), False, True),
}


@pytest.mark.parametrize("case", PAGED_CASES)
def test_paged_padding_isolated(case):
    """The paged kernel (decode: GQA-packed, split-KV where the tiles would not fill the GPU)."""
    b, sq, h, hkv, d, page_size, max_pages, seqused, causal, with_sink = PAGED_CASES[case]

    def attend(q, k_cache, v_cache, table, used, sink):
        return jax_fa4.flash_attention_paged(q, k_cache, v_cache, table, used, causal=causal,
                                             learnable_sink=sink, return_lse=True,
                                             implementation=IMPLEMENTATION)

    failures = paged_isolation_failures(attend, b, sq, h, hkv, d, d, page_size, max_pages,
                                        seqused, dtype=DTYPE, with_sink=with_sink)
    assert not failures, (f"paged {case} (page_size={page_size} seqused={seqused}):\n"
                          + "\n".join(failures))
