"""The Hopper forward kernel with segment ids (``FwdConfig.segments``), on an H100/H200.

``jax_fa4.flash_attention(..., segment_ids=..., implementation="sm90")`` under ``jax.jit``
against ``jax_fa4.reference.attention`` with the same ids (float32 and 16-bit, FA4's rule; lse
with the same -inf pattern; rows that see no key exactly 0), in NaN-poisoned memory. Packed
documents (contiguous runs: each row's key span, unmasked bulk blocks, skipped blocks), ids
that are not contiguous (key-by-key compare), cross-attention pairs whose query ids no key has,
with causal, windows, softcap, GQA and sinks; gradients (the backward kernel with segment ids)
against the reference's; and a new packing under the same jit does not recompile.

Kernels needed in the cache: the shipped segment-id forward and backward configs.
"""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from jax_fa4 import reference
from jax_fa4.kernels.sm90 import fwd_config
from jax_fa4.tools.variants import sm90_fwd_segments_persistent_configs
from numerics import assert_fa4_close
from tests.gpu.test_sm90_fwd import _inputs, check_forward, poison_device_memory

pytestmark = pytest.mark.gpu


def packed(rng, b, s, docs):
    """(B, S) ids of ``docs`` documents per row at random cut points (ids any ints)."""
    ids = np.empty((b, s), np.int32)
    for row in range(b):
        cuts = np.sort(rng.choice(np.arange(1, s), size=docs - 1, replace=False))
        ids[row] = np.searchsorted(cuts, np.arange(s), side="right") * 3 + 5 * row
    return ids


def run(q_ids, kv_ids, *, h=4, hkv=2, d=128, dtype=jnp.bfloat16, causal=False,
        window=(None, None), softcap=0.0, sink=False, grads=False):
    b, sq = q_ids.shape
    sk = kv_ids.shape[1]
    seed = zlib.crc32(repr((q_ids.tobytes(), kv_ids.tobytes(), h, d, causal, window, softcap,
                            sink)).encode())
    q, k, v = _inputs(seed, b, sq, sk, h, hkv, d, d, dtype)
    sinks = (jax.random.normal(jax.random.key(seed + 1), (h,), jnp.float32) if sink else None)
    ids = (jnp.asarray(q_ids), jnp.asarray(kv_ids))
    kw = dict(causal=causal, window_size=window, softcap=softcap)

    def kernel(q, k, v, s):
        return jax_fa4.flash_attention(q, k, v, segment_ids=ids, learnable_sink=s,
                                       return_lse=True, implementation="sm90", **kw)

    ref_kw = dict(window=(window[0], 0) if causal else window, softcap=softcap,
                  q_segment_ids=ids[0], kv_segment_ids=ids[1])

    def ref(q, k, v, s, dtype=None):
        return reference.attention(q, k, v, learnable_sink=s, compute_dtype=dtype, **ref_kw)

    poison_device_memory()
    out, lse = jax.block_until_ready(jax.jit(kernel)(q, k, v, sinks))
    name = (f"segments b={b} sq={sq} sk={sk} h={h}/{hkv} d={d} {jnp.dtype(dtype).name} "
            f"causal={causal} window={window} softcap={softcap} sink={sink}")
    check_forward(out, lse, ref(q, k, v, sinks), ref(q, k, v, sinks, dtype), softcap, name)
    if not grads:
        return
    w = jax.random.normal(jax.random.key(seed + 2), out.shape, jnp.float32)

    def loss(f, *args):
        return jnp.sum(f(*args)[0].astype(jnp.float32) * w)

    argnums = (0, 1, 2, 3) if sink else (0, 1, 2)
    poison_device_memory()
    got = jax.jit(jax.grad(lambda *a: loss(kernel, *a), argnums=argnums))(q, k, v, sinks)
    want = jax.grad(lambda *a: loss(ref, *a), argnums=argnums)(q, k, v, sinks)
    pt = jax.grad(lambda *a: loss(lambda *x: ref(*x, dtype), *a), argnums=argnums)(q, k, v,
                                                                                    sinks)
    for gname, g, r, p in zip(("dq", "dk", "dv", "dsink"), got, want, pt):
        assert_fa4_close(g, r.astype(g.dtype), p, softcap=softcap > 0, name=f"{name} {gname}")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s,docs", [(1000, 3), (2048, 8), (4096, 5)])
def test_packed_documents(s, docs, causal):
    rng = np.random.default_rng(s + docs)
    ids = packed(rng, 2, s, docs)
    run(ids, ids, causal=causal)


@pytest.mark.parametrize("d", [64, 96, 192, 256])
def test_head_dims(d):
    rng = np.random.default_rng(d)
    ids = packed(rng, 1, 1500, 4)
    run(ids, ids, d=d, causal=d % 128 == 0)


@pytest.mark.parametrize("opts", [dict(window=(100, 0)), dict(window=(300, 40), softcap=20.0),
                                  dict(causal=True, sink=True, h=6, hkv=1),
                                  dict(dtype=jnp.float16, softcap=10.0, h=8, hkv=8)],
                         ids=["window", "window-softcap", "causal-sink-mqa", "fp16-softcap"])
def test_options(opts):
    rng = np.random.default_rng(len(repr(opts)))
    ids = packed(rng, 2, 1333, 5)
    run(ids, ids, **opts)


def test_non_contiguous_ids():
    """The same id in separate runs: those tiles compare ids key by key."""
    rng = np.random.default_rng(3)
    ids = (packed(rng, 2, 900, 9) // 3) % 3  # runs of 3 ids that repeat
    run(ids, ids, causal=True)
    q_ids = rng.integers(0, 4, (2, 333)).astype(np.int32)
    kv_ids = rng.integers(0, 4, (2, 517)).astype(np.int32)
    run(q_ids, kv_ids)


def test_cross_attention_with_missing_ids():
    """Query ids no key has: those rows see nothing (out 0, lse -inf)."""
    rng = np.random.default_rng(4)
    q_ids = packed(rng, 2, 700, 4)
    kv_ids = packed(rng, 2, 1100, 4)
    q_ids[:, -50:] = -1  # padding queries: no key has id -1
    run(q_ids, kv_ids)


def _persistent_id(cfg) -> str:
    return (f"d{cfg.head_dim}-{cfg.mask}{'-softcap' if cfg.has_softcap else ''}-"
            f"{cfg.num_sms}ctas{'-dyn' if cfg.dynamic_tiles else ''}")


@pytest.mark.parametrize("cfg", sm90_fwd_segments_persistent_configs(), ids=_persistent_id)
def test_persistent_forward(cfg, monkeypatch):
    """The persistent form of the segment-id forward (variants.persistent_segments: a grid of
    num_sms CTAs walking the tiles, statically or claiming them from a counter; O in its own
    buffer) in place of the table's one-tile-per-CTA config: packed documents (each tile's
    key-block range clipped to its segment table by both the producer and the consumers), then
    cross-attention whose last query tiles share no id with any key (tiles without a key
    block, which must keep the two sides in step), GQA, in NaN-poisoned memory."""
    base = dataclasses.replace(cfg, num_sms=0, dynamic_tiles=False)
    table_config, used = fwd_config.segments_config, []

    def segments_config(*args, **kwargs):
        got = table_config(*args, **kwargs)
        used.append(got == base)
        return cfg if got == base else got

    monkeypatch.setattr(fwd_config, "segments_config", segments_config)
    rng = np.random.default_rng(cfg.num_sms + cfg.head_dim)
    ids = packed(rng, 2, 2048, 8)
    kind = dict(d=cfg.head_dim, causal=cfg.mask == "causal",
                window=(200, 30) if cfg.mask == "local" else (None, None),
                softcap=5.0 if cfg.has_softcap else 0.0)
    run(ids, ids, **kind)
    q_ids = packed(rng, 2, 700, 4)  # query ids no key has: tiles without a visible key block
    q_ids[:, -200:] = -1
    run(q_ids, packed(rng, 2, 1100, 4), **kind)
    assert any(used), "the persistent config was not reached"


@pytest.mark.parametrize("sink", [False, True])
def test_gradients(sink):
    rng = np.random.default_rng(5)
    ids = packed(rng, 2, 777, 4)
    run(ids, ids, causal=True, sink=sink, grads=True)


def test_new_packing_does_not_recompile():
    rng = np.random.default_rng(6)
    q, k, v = _inputs(0, 2, 1024, 1024, 4, 4, 128, 128, jnp.bfloat16)
    f = jax.jit(lambda q, k, v, ids: jax_fa4.flash_attention(q, k, v, segment_ids=ids,
                                                             implementation="sm90"))
    for docs in (2, 7, 3):
        jax.block_until_ready(f(q, k, v, jnp.asarray(packed(rng, 2, 1024, docs))))
    assert f._cache_size() == 1
