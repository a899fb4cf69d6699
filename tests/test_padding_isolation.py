"""Padding isolation on the pure-JAX reference (CPU): NaN / Inf in storage a call does not use
changes no valid output, lse or gradient (issue #24; the checks: tests/padding_checks.py).

* varlen, forward and backward: NaN / +Inf / -Inf in the padding tokens before
  ``cu_seqlens[0]`` and after ``cu_seqlens[-1]`` of q, k, v, and in the padding rows of the
  cotangents (dout, dlse); one input at a time and all together. Valid out, lse, dq, dk, dv and
  dsink must equal, bit for bit, the same call with finite random padding; padding rows keep
  out 0 and lse -inf, and padding tokens get exactly 0 gradient (api.py: "no gradient"). Causal
  and not, GQA / MQA, a window with softcap, a sink; the naive and the key-blocked reference.
* paged KV decode (forward only): NaN / Inf in the pages no used page-table entry names (pages
  in no table, stale pages after a sequence's used ones; -1 entries too) and in the slots of the
  last used page past ``seqused_k``. Sq = 1 and Sq = 3 (causal), GQA, a sink; the dense-gather
  and the split-KV reference.

Without the reference's ``jnp.where`` on loaded values (jax_fa4/reference.py ``_zero_unseen``)
masked scores still multiplied padding values by an exact 0 (P·V, dS·K, dSᵀ·Q, Pᵀ·dO), and
0·NaN is NaN; without the varlen backward's ``where`` on dout (jax_fa4/backends/base.py) a NaN
cotangent in a padding row reached delta and so the sink's gradient.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from compiled import per_class

from jax_fa4 import autodiff, options
from jax_fa4.api import flash_attention_paged, flash_attention_varlen
from jax_fa4.backends import base
from padding_checks import paged_isolation_failures, varlen_isolation_failures

# Per sequence (len_q, len_k): Sq < Sk, an empty sequence, length 1, Sq > Sk (rows without keys
# under causal), a query-only sequence; padding before the first and after the last sequence.
LENS_Q = (3, 0, 1, 5, 2)
LENS_K = (5, 4, 1, 3, 0)
PAD_FRONT, PAD_BACK = 2, 3

VARLEN_CASES = {  # name: (h, hkv, d, dv, flash_attention_varlen options, with_sink)
    "mha": (2, 2, 8, 8, dict(), False),
    "gqa-causal": (4, 2, 16, 8, dict(causal=True), False),
    "mqa-window-softcap": (2, 1, 8, 16, dict(window_size=(3, 1), softcap=2.0), False),
    "gqa-causal-sink": (4, 2, 8, 8, dict(causal=True), True),
    "mha-sink": (2, 2, 8, 8, dict(), True),
}


def _varlen_attend(kwargs):
    def attend(q, k, v, sink, cu_q, cu_k):
        return flash_attention_varlen(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K),
                                      learnable_sink=sink, return_lse=True,
                                      implementation="reference", **kwargs)
    return attend


@pytest.mark.parametrize("case", VARLEN_CASES)
def test_varlen_padding_isolated(case):
    """Forward and backward, the naive reference (the whole score matrix at once)."""
    h, hkv, d, dv, kwargs, with_sink = VARLEN_CASES[case]
    failures = varlen_isolation_failures(_varlen_attend(kwargs), LENS_Q, LENS_K, PAD_FRONT,
                                         PAD_BACK, h, hkv, d, dv, with_sink=with_sink)
    assert not failures, f"varlen {case}:\n" + "\n".join(failures)


@pytest.mark.parametrize("case", ["gqa-causal", "gqa-causal-sink"])
def test_varlen_padding_isolated_blocked(case, monkeypatch):
    """The key-blocked reference (online softmax forward, blocked backward), 4-key blocks so
    padding shares a block with valid keys."""
    monkeypatch.setattr(base, "reference_block_k", lambda sq, sk: 4)
    h, hkv, d, dv, kwargs, with_sink = VARLEN_CASES[case]
    # other padding than the naive test: new shapes, so no naive trace is reused
    failures = varlen_isolation_failures(_varlen_attend(kwargs), LENS_Q, LENS_K, 1, 5,
                                         h, hkv, d, dv, with_sink=with_sink, seed=1)
    assert not failures, f"varlen blocked {case}:\n" + "\n".join(failures)


# Valid keys per entry: mid-page, exactly one page, a single key, none, the whole table.
SEQUSED = (37, 16, 1, 0, 64)
PAGE_SIZE, MAX_PAGES = 16, 4

PAGED_CASES = {  # name: (sq, h, hkv, d, dv, flash_attention_paged options, with_sink)
    "decode-gqa": (1, 4, 2, 16, 8, dict(), False),
    "decode-mqa-sink": (1, 4, 1, 8, 8, dict(), True),
    "chunk3-causal-gqa": (3, 4, 2, 8, 16, dict(causal=True), False),
    "chunk3-causal-window-sink": (3, 2, 2, 8, 8, dict(causal=True, window_size=(5, 0),
                                                      softcap=2.0), True),
}


@pytest.mark.parametrize("case, pages_per_block", per_class(  # quick tier: one case per form
    [(c, p) for c in reversed(PAGED_CASES) for p in (None, 1, 3)], key=lambda case: case[1]),
    ids=str)
def test_paged_padding_isolated(case, pages_per_block):
    """Forward of a paged call: the dense gather (``None``) and the split-KV scan over chunks of
    1 and 3 pages (3: the last chunk is padded past the table)."""
    sq, h, hkv, d, dv, kwargs, with_sink = PAGED_CASES[case]
    if pages_per_block is None:
        def attend(q, k, v, table, used, sink):
            return flash_attention_paged(q, k, v, table, used, learnable_sink=sink,
                                         return_lse=True, implementation="reference", **kwargs)
    else:
        opts = options.options(d, softmax_scale=None, causal=kwargs.get("causal", False),
                               window_size=kwargs.get("window_size", (None, None)),
                               softcap=kwargs.get("softcap", 0.0), implementation="reference")

        def attend(q, k, v, table, used, sink):
            return autodiff._paged_jit(q, k, v, table, used, sink, opts,
                                       ("reference", pages_per_block))
    failures = paged_isolation_failures(attend, len(SEQUSED), sq, h, hkv, d, dv, PAGE_SIZE,
                                        MAX_PAGES, SEQUSED, with_sink=with_sink)
    assert not failures, f"paged {case} pages_per_block={pages_per_block}:\n" + "\n".join(
        failures)


def test_poison_helpers_detect_a_leak():
    """The checks themselves: a call that lets padding through fails them with counts."""
    def leaky(q, k, v, sink, cu_q, cu_k):  # out = q + sum of all v (padding included)
        out = q[..., :v.shape[-1]] + jnp.sum(v, axis=(0, 1))[None, None]
        return out, jnp.zeros(q.shape[1::-1], jnp.float32)

    failures = varlen_isolation_failures(leaky, (2,), (3,), 1, 1, 2, 2, 4, 4)
    assert any(f.startswith("poisoned v: out:") and "non-finite" in f for f in failures)
