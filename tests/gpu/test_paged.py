"""The Hopper paged-KV forward kernel against the float32 reference, on an H100/H200.

``jax_fa4.flash_attention_paged(..., implementation="sm90", return_lse=True)`` (the paged
kernel, with decode shapes GQA-packed and split by jax_fa4/backends/decode.py) is compared by FA4's
rule (tests/numerics.py) with the reference on each sequence's keys: the cache pages gathered in
page-table order, keys at or past ``seqused_k[b]`` masked, causal / windows aligned to
``seqused_k[b]``. Pages are shuffled across sequences; page-table entries past a sequence's used
pages hold -1 or stale pages (never read). Outputs land in NaN-poisoned memory.

Kernels needed in the cache: ``paged_config`` of every shipped row (``--suite default``).
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
from tests.gpu.test_sm90_fwd import check_forward, poison_device_memory

pytestmark = pytest.mark.gpu


def _paged_inputs(seed, b, sq, h, hkv, d, dv, page_size, max_pages, seqused, dtype):
    rng = np.random.default_rng(seed)
    num_pages = b * max_pages + 3
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (b, sq, h, d), jnp.float32).astype(dtype)
    k_cache = jax.random.normal(kk, (num_pages, page_size, hkv, d), jnp.float32).astype(dtype)
    v_cache = jax.random.normal(kv, (num_pages, page_size, hkv, dv), jnp.float32).astype(dtype)
    table = rng.permutation(num_pages)[: b * max_pages].reshape(b, max_pages).astype(np.int32)
    seqused = np.asarray(seqused, np.int32)
    for row, n in enumerate(seqused):
        if row % 2:
            table[row, -(-n // page_size):] = -1  # never read
    return q, k_cache, v_cache, jnp.asarray(table), jnp.asarray(seqused)


def _reference(q, k_cache, v_cache, table, seqused, compute_dtype, **kw):
    k, v = base.gather_pages(k_cache, table), base.gather_pages(v_cache, table)
    q_ids, q_pos, kv_ids = base.paged_mask_data(seqused, q.shape[1], jnp.arange(k.shape[1]))
    return reference.attention(q, k, v, compute_dtype=compute_dtype, q_segment_ids=q_ids,
                               kv_segment_ids=kv_ids, q_positions=q_pos, **kw)


def run_paged_case(b, sq, h, hkv, d, dv, page_size, max_pages, seqused, dtype=jnp.bfloat16,
                   causal=False, window=(None, None), softcap=0.0, sink=False, repeat=False):
    seed = zlib.crc32(repr((b, sq, h, hkv, d, dv, page_size, max_pages, seqused, causal,
                            window, softcap, sink)).encode())
    q, k_cache, v_cache, table, used = _paged_inputs(seed, b, sq, h, hkv, d, dv, page_size,
                                                     max_pages, seqused, dtype)
    learnable_sink = jnp.linspace(-1.0, 3.0, h, dtype=jnp.float32) if sink else None
    fn = jax.jit(lambda *a: jax_fa4.flash_attention_paged(
        *a, causal=causal, window_size=window, softcap=softcap, learnable_sink=learnable_sink,
        return_lse=True, implementation="sm90"))
    poison_device_memory()
    out, lse = jax.block_until_ready(fn(q, k_cache, v_cache, table, used))
    ref_window = (window[0], 0) if causal else window
    kw = dict(window=ref_window, softcap=softcap, learnable_sink=learnable_sink)
    name = (f"paged b={b} sq={sq} h={h}/{hkv} d={d}/{dv} page={page_size} seqused={seqused} "
            f"causal={causal} window={window} softcap={softcap} sink={sink}")
    assert out.shape == (b, sq, h, dv) and out.dtype == dtype
    check_forward(out, lse, _reference(q, k_cache, v_cache, table, used, jnp.float32, **kw),
                  _reference(q, k_cache, v_cache, table, used, dtype, **kw), softcap, name)
    if repeat:
        poison_device_memory()
        out2, lse2 = jax.block_until_ready(fn(q, k_cache, v_cache, table, used))
        np.testing.assert_array_equal(np.asarray(out2, np.float32), np.asarray(out, np.float32),
                                      err_msg=f"{name}: second run differs (race?)")
        np.testing.assert_array_equal(np.asarray(lse2), np.asarray(lse))


@pytest.mark.parametrize("b,sq,h,hkv,page_size,max_pages,seqused", [
    # the decode anchor's form: 4 heads packed, split; one sequence uses every page, one 1 key
    (4, 1, 32, 8, 128, 64, (8192, 1, 4099, 777)),
    # MQA, 256-key pages (four kernel blocks each), an empty sequence
    (3, 1, 8, 1, 256, 20, (5000, 0, 257)),
    # 16 queries × 4 heads = 64 packed rows: the decode tile full
    (2, 16, 32, 8, 128, 24, (3000, 2049)),
    # MHA: split only
    (2, 2, 4, 4, 128, 64, (8000, 129)),
])
def test_paged_decode(b, sq, h, hkv, page_size, max_pages, seqused):
    run_paged_case(b, sq, h, hkv, 128, 128, page_size, max_pages, seqused, repeat=b == 4)


def _decode_options():
    from jax_fa4.kernels.sm90.fwd_config import DECODE_OPTIONS

    return list(DECODE_OPTIONS)


@pytest.mark.parametrize("option", _decode_options())
def test_paged_decode_options(option, monkeypatch):
    """The decode-tile alternatives (fwd_config.DECODE_OPTIONS) on paged decode: the anchor's
    form and MQA with 256-key pages and an empty sequence."""
    monkeypatch.setenv("JAX_FA4_DECODE_TILE", option)
    run_paged_case(4, 1, 32, 8, 128, 128, 128, 64, (8192, 1, 4099, 777), repeat=True)
    run_paged_case(3, 1, 8, 1, 128, 128, 256, 20, (5000, 0, 257))


def test_paged_causal_chunk():
    """4 new queries, causal: neither packed nor split; a sequence with fewer keys than queries
    has rows without keys (out 0, lse -inf)."""
    run_paged_case(3, 4, 16, 4, 128, 128, 128, 4, (300, 3, 129), causal=True)


def test_paged_prefill_chunk_many_tiles():
    """A 200-query chunk: several 64-row query tiles per head, causal, odd lengths."""
    run_paged_case(2, 200, 4, 2, 128, 128, 128, 8, (1000, 201), causal=True)


@pytest.mark.parametrize("d,dv,page_size", [(64, 64, 128), (96, 96, 128), (192, 128, 128),
                                            (192, 192, 128), (256, 256, 64)])
def test_paged_head_dims(d, dv, page_size):
    run_paged_case(2, 1, 8, 2, d, dv, page_size, 4096 // page_size, (4096, 1500))


def test_paged_window_softcap_fp16():
    run_paged_case(2, 3, 8, 2, 128, 128, 128, 8, (1000, 77), dtype=jnp.float16,
                   window=(100, 1), softcap=20.0)


def test_paged_sink():
    run_paged_case(3, 1, 16, 4, 128, 128, 128, 32, (4000, 0, 130), sink=True)
