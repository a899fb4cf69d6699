"""The Hopper varlen forward and backward kernels against the float32 reference, on an H100/H200.

``jax_fa4.flash_attention_varlen(..., implementation="sm90", return_lse=True)`` (the varlen
forward kernel on packed sequences) is compared by FA4's rule (tests/numerics.py) with the
reference on the same packed batch (segment ids and per-sequence positions: each sequence sees
only its own keys, causal / windows aligned bottom-right per sequence). Lengths include 0, 1,
odd ones, one above a tile and Sq != Sk per sequence; padding tokens sit before cu_seqlens[0]
and after cu_seqlens[-1] (out 0, lse -inf). Outputs land in NaN-poisoned memory, so a row the
kernel should write and does not is caught.

Gradients (``run_varlen_grad_case``) run the varlen backward kernel
(``bwd_config.varlen_config``) after the forward, likewise in poisoned memory.

Kernels needed in the cache: the forward and backward ``varlen_config`` of every shipped row
(``--suite default``).
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from jax_fa4 import reference
from jax_fa4.backends import base
from numerics import assert_fa4_close
from tests.gpu.test_sm90_fwd import check_forward, poison_device_memory

pytestmark = pytest.mark.gpu

PAD_FRONT, PAD_BACK = 3, 5


def _cu(lengths, front):
    return jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]) + front, jnp.int32)


def run_varlen_case(lens_q, lens_k, h, hkv, d, dv, dtype=jnp.bfloat16, causal=False,
                    window=(None, None), softcap=0.0, sink=False):
    seed = zlib.crc32(repr((lens_q, lens_k, h, hkv, d, dv, causal, window, softcap)).encode())
    tq = PAD_FRONT + sum(lens_q) + PAD_BACK
    tk = PAD_FRONT + sum(lens_k) + PAD_BACK
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (tq, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (tk, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (tk, hkv, dv), jnp.float32).astype(dtype)
    cu_q, cu_k = _cu(lens_q, PAD_FRONT), _cu(lens_k, PAD_FRONT)
    learnable_sink = jnp.linspace(-1.0, 3.0, h, dtype=jnp.float32) if sink else None
    fn = jax.jit(lambda q, k, v, cu_q, cu_k: jax_fa4.flash_attention_varlen(
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, window_size=window,
        softcap=softcap, learnable_sink=learnable_sink, return_lse=True, implementation="sm90"))
    poison_device_memory()
    out, lse = jax.block_until_ready(fn(q, k, v, cu_q, cu_k))
    seg = base.varlen_segments(cu_q, cu_k, tq, tk)
    kw = dict(window=(window[0], 0) if causal else window, softcap=softcap,
              learnable_sink=learnable_sink, **seg._asdict())
    valid = np.asarray(seg.q_segment_ids[0] >= 0)
    name = (f"varlen lens_q={lens_q} lens_k={lens_k} h={h}/{hkv} d={d}/{dv} causal={causal} "
            f"window={window} softcap={softcap} sink={sink}")
    assert out.shape == (tq, h, dv) and lse.shape == (h, tq)
    out32 = np.asarray(out, np.float32)
    assert (out32[~valid] == 0).all() and np.isneginf(np.asarray(lse)[:, ~valid]).all(), name

    def tokens(pair):  # the sequences' tokens as one batch entry: (1, n, H, Dv), (1, H, n)
        o, lse_ = pair
        return o[0][valid][None], lse_[0][:, valid][None]

    check_forward(out[valid][None], lse[:, valid][None],
                  tokens(reference.attention(q[None], k[None], v[None], **kw)),
                  tokens(reference.attention(q[None], k[None], v[None], compute_dtype=dtype,
                                             **kw)), softcap, name)


LENS_Q = (1, 0, 300, 1023, 5, 129)
LENS_K = (1, 7, 517, 1023, 2049, 0)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_hdim128(causal):
    run_varlen_case(LENS_Q, LENS_K, 4, 2, 128, 128, causal=causal)


@pytest.mark.parametrize("d,dv", [(64, 64), (96, 96), (192, 128), (192, 192), (256, 256)])
def test_varlen_head_dims(d, dv):
    run_varlen_case(LENS_Q, LENS_K, 2, 1, d, dv, causal=d % 64 == 0)


def test_varlen_window_softcap_fp16():
    run_varlen_case(LENS_Q, LENS_K, 4, 4, 128, 128, dtype=jnp.float16, window=(64, 3),
                    softcap=20.0)


def test_varlen_sink_and_equal_lengths():
    run_varlen_case((256, 256, 256), (256, 256, 256), 4, 2, 128, 128, causal=True, sink=True)


def run_varlen_grad_case(lens_q, lens_k, h, hkv, d, dv, dtype=jnp.bfloat16, causal=False,
                         window=(None, None), softcap=0.0, sink=None):
    """jax.grad through flash_attention_varlen on Hopper: the varlen forward kernel, the
    preprocess, the varlen backward kernel (only each sequence's own blocks) and the
    postprocess, four kernels in the HLO. dq, dk, dv (and with a learnable ``sink`` (H,) dsink)
    by FA4's rule against jax.grad through the float32 reference on the same packed batch (the
    16-bit reference as pt), in NaN-poisoned memory; padding tokens get exactly zero
    gradient."""
    tq = PAD_FRONT + sum(lens_q) + PAD_BACK
    tk = PAD_FRONT + sum(lens_k) + PAD_BACK
    seed = zlib.crc32(repr((lens_q, lens_k, h, hkv, d, dv, causal, window, softcap)).encode())
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (tq, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (tk, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (tk, hkv, dv), jnp.float32).astype(dtype)
    w = jax.random.normal(ks[3], (tq, h, dv), jnp.float32)
    cu_q, cu_k = _cu(lens_q, PAD_FRONT), _cu(lens_k, PAD_FRONT)
    seg = base.varlen_segments(cu_q, cu_k, tq, tk)
    ref_window = (window[0], 0) if causal else window

    s0 = jnp.zeros((h,), jnp.float32) if sink is None else sink

    def grads(attn, dtype_in, poison=False):
        f = lambda q, k, v, s: jnp.sum(attn(q, k, v, s).astype(jnp.float32) * w)  # noqa: E731
        fn = jax.jit(jax.grad(f, argnums=(0, 1, 2, 3)))
        args = [x.astype(dtype_in) for x in (q, k, v)] + [s0]
        if poison:
            poison_device_memory()
        return fn, jax.block_until_ready(fn(*args))

    def sink_of(s):
        return None if sink is None else s

    fn, got = grads(lambda q, k, v, s: jax_fa4.flash_attention_varlen(
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, window_size=window,
        softcap=softcap, learnable_sink=sink_of(s), implementation="sm90"), dtype, poison=True)
    assert fn.lower(q, k, v, s0).as_text().count("CuteDSLRT_NvJaxCutlassCall_v2") == 4
    kw = dict(window=ref_window, softcap=softcap, **seg._asdict())
    _, ref = grads(lambda q, k, v, s: reference.attention(
        q[None], k[None], v[None], learnable_sink=sink_of(s), **kw)[0][0], jnp.float32)
    _, pt = grads(lambda q, k, v, s: reference.attention(
        q[None], k[None], v[None], compute_dtype=dtype, learnable_sink=sink_of(s),
        **kw)[0][0], dtype)
    valid_q = np.asarray(seg.q_segment_ids[0] >= 0)
    valid_k = np.asarray(seg.kv_segment_ids[0] >= 0)
    name = (f"varlen grad lens_q={lens_q} lens_k={lens_k} h={h}/{hkv} d={d}/{dv} "
            f"causal={causal} window={window} softcap={softcap}")
    for gname, g, r, p, valid in zip(("dq", "dk", "dv"), got, ref, pt,
                                     (valid_q, valid_k, valid_k)):
        g32 = np.asarray(g, np.float32)
        assert (g32[~valid] == 0).all(), f"{name} {gname}: padding tokens got a gradient"
        assert_fa4_close(g[valid], r.astype(g.dtype)[valid], p[valid], name=f"{name} {gname}")
    if sink is not None:  # (pt: tests/attention_properties.py's dsink_pt_of)
        from attention_properties import dsink_pt_of

        ref_out, ref_lse = reference.attention(*(x[None].astype(jnp.float32) for x in (q, k, v)),
                                               learnable_sink=sink, **kw)
        assert_fa4_close(got[3], ref[3], dsink_pt_of(pt[3], ref[3], ref_out, ref_lse, sink,
                                                     w[None], None), name=f"{name} dsink")


# lengths 0 and 1, a key-only sequence (its dK, dV are 0), a query-only one (its dQ is 0),
# odd lengths around the tiles, Sq != Sk per sequence
GRAD_LENS_Q = (1, 0, 300, 517, 129, 64, 3)
GRAD_LENS_K = (7, 1, 517, 300, 129, 0, 3)


@pytest.mark.parametrize("hkv", [4, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_grad_hdim128(causal, hkv):
    run_varlen_grad_case(GRAD_LENS_Q, GRAD_LENS_K, 4, hkv, 128, 128, causal=causal)


@pytest.mark.parametrize("d,dv,hkv,causal", [(64, 64, 2, True), (64, 64, 2, False),
                                             (96, 96, 2, False), (192, 128, 1, True),
                                             (256, 256, 2, True)])
def test_varlen_grad_head_dims(d, dv, hkv, causal):
    run_varlen_grad_case(GRAD_LENS_Q, GRAD_LENS_K, 2, hkv, d, dv, causal=causal)


def test_varlen_grad_window_softcap_fp16():
    run_varlen_grad_case(GRAD_LENS_Q, GRAD_LENS_K, 4, 4, 128, 128, dtype=jnp.float16,
                         window=(64, 3), softcap=20.0)


def test_varlen_grad_long_unequal_gqa_local():
    run_varlen_grad_case((2049, 5, 700), (1500, 2100, 33), 4, 1, 128, 128, window=(300, 0))
