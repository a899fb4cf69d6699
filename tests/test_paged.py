"""Attention over a paged KV cache against dense attention on each sequence's gathered keys."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from extreme_cases import oracle, window_visible
from jax_fa4 import autodiff, backends, options, reference
from jax_fa4.api import flash_attention_paged
from jax_fa4.backends import base, decode

TOL = dict(atol=2e-5, rtol=2e-5)


def _cache(b, sq, h, hkv, d, dv, page_size, num_pages, max_pages, seqused, seed):
    """Random q and cache; each sequence gets distinct pages in shuffled order, and the
    page-table entries past its used pages hold -1 (or stale pages), which must be ignored."""
    rng = np.random.default_rng(seed)

    def randn(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32))

    q = randn(b, sq, h, d)
    k_cache, v_cache = randn(num_pages, page_size, hkv, d), randn(num_pages, page_size, hkv, dv)
    table = rng.permutation(num_pages)[: b * max_pages].reshape(b, max_pages).astype(np.int32)
    seqused = np.asarray(seqused, np.int32)
    for row, n in enumerate(seqused):
        used = -(-n // page_size)
        table[row, used:] = -1 if row % 2 else table[row, used:]  # garbage past the used pages
    return q, k_cache, v_cache, table, seqused


def dense_per_sequence(q, k_cache, v_cache, table, seqused, sink=None, *, window=(None, None),
                       softcap=0.0, softmax_scale=None):
    """Each sequence's attention on its first seqused_k keys, gathered by hand: the float64
    oracle of tests/extreme_cases.py, as float32 (NumPy: no XLA program per sequence length);
    a sequence without keys gives out 0 and lse the sink (or -inf)."""
    b, sq, h, d = q.shape
    dv = v_cache.shape[-1]
    q, k_cache, v_cache = (np.asarray(x, np.float32) for x in (q, k_cache, v_cache))
    sink = None if sink is None else np.asarray(sink, np.float32)
    scale = 1 / np.sqrt(d) if softmax_scale is None else softmax_scale
    out = np.zeros((b, sq, h, dv), np.float32)
    lse = np.full((b, h, sq), -np.inf, np.float32)
    for row in range(b):
        n = int(seqused[row])
        if n == 0:
            if sink is not None:
                lse[row] = sink[:, None]
            continue
        pages = table[row, : -(-n // k_cache.shape[1])]
        k = np.concatenate([k_cache[p] for p in pages])[:n]
        v = np.concatenate([v_cache[p] for p in pages])[:n]
        o, l = oracle(q[row:row + 1], k[None], v[None], window_visible(sq, n, window)[None],
                      scale, softcap, sink)
        out[row], lse[row] = o[0], l[0]
    return out, lse


def _assert_close(got, want, name):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert not np.isnan(got).any(), name
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=name)
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], err_msg=name, **TOL)


CASES = [  # (sq, h, hkv, d, dv, page_size, kwargs, with_sink)
    (1, 4, 2, 16, 8, 16, dict(), False),  # decode step, GQA
    (4, 2, 1, 8, 8, 32, dict(causal=True, softcap=2.0), True),  # prefill chunk, MQA
    (3, 4, 4, 8, 16, 16, dict(causal=True, window_size=(5, 0), softmax_scale=0.5), True),
]
SEQUSED = (1, 37, 0, 64, 2)  # incl. 1 (a single key; with Sq > 1 and causal: rows without keys)


def _ref_options(kwargs):
    left, right = kwargs.get("window_size", (None, None))
    if kwargs.get("causal"):
        right = 0
    return dict(window=(left, right), softcap=kwargs.get("softcap", 0.0),
                softmax_scale=kwargs.get("softmax_scale"))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_dense_per_sequence(case):
    """Dense-gather and split-KV forms against each sequence's keys gathered by hand."""
    sq, h, hkv, d, dv, page_size, kwargs, with_sink = case
    max_pages = 64 // page_size + 1
    q, k_cache, v_cache, table, seqused = _cache(len(SEQUSED), sq, h, hkv, d, dv, page_size,
                                                 num_pages=5 * max_pages + 3,
                                                 max_pages=max_pages, seqused=SEQUSED, seed=0)
    sink = jnp.asarray(np.linspace(-1.0, 2.0, h), jnp.float32) if with_sink else None
    want_out, want_lse = dense_per_sequence(q, k_cache, v_cache, table, seqused, sink,
                                            **_ref_options(kwargs))
    out, lse = flash_attention_paged(q, k_cache, v_cache, table, seqused, learnable_sink=sink,
                                     return_lse=True, **kwargs)
    assert out.shape == (len(SEQUSED), sq, h, dv) and lse.shape == (len(SEQUSED), h, sq)
    _assert_close(out, want_out, "dense out")
    _assert_close(lse, want_lse, "dense lse")
    # Split-KV: one page per chunk, so several chunks and a padded last one.
    opts = options.options(q.shape[-1], softmax_scale=kwargs.get("softmax_scale"),
                           causal=kwargs.get("causal", False),
                           window_size=kwargs.get("window_size", (None, None)),
                           softcap=kwargs.get("softcap", 0.0), implementation=None)
    for pages_per_block in (1, 2):
        out_s, lse_s = autodiff._paged_jit(q, k_cache, v_cache, jnp.asarray(table),
                                           jnp.asarray(seqused), sink, opts,
                                           ("reference", pages_per_block))
        _assert_close(out_s, want_out, f"split({pages_per_block}) out")
        _assert_close(lse_s, want_lse, f"split({pages_per_block}) lse")


# --- the kernel route, with the paged kernel's contract emulated on the CPU ----------------------
def emulated_paged_kernel(config, arch, q, k_tiles, v_tiles, params, table, seqused, *,
                          out_shapes):
    """What the sm90 paged forward kernel computes (spec.paged_attention_forward_signature):
    key block n of entry b is cache tile table[b, n]; entry b has seqused[b] keys (clamped to
    its table row's), with the causal / window rule aligned to them; tiles past them are never
    read (garbage indices)."""
    assert config.paged and arch == "sm_90a"
    if config.qo_head_major:  # q (B, H, Sq, D) in, out (B, H, Sq, Dv) back
        q = q.transpose(0, 2, 1, 3)
        out_shapes = (jax.ShapeDtypeStruct(out_shapes[0].shape[:1] + out_shapes[0].shape[2:3]
                                           + out_shapes[0].shape[1:2] + out_shapes[0].shape[3:],
                                           out_shapes[0].dtype), out_shapes[1])
    scale, softcap, left, right = (float(x) for x in params)
    tile_n = config.tile_n
    b, sq, _, d = q.shape
    blocks, hkv = table.shape[1], k_tiles.shape[2]
    seqused = jnp.clip(seqused, 0, blocks * tile_n)  # the kernel clamps to its table row
    tiles = np.clip(np.asarray(table), 0, k_tiles.shape[1] // tile_n - 1)

    def gather(cache):
        t = cache[0].reshape(-1, tile_n, hkv, cache.shape[3])
        return jnp.asarray(t[tiles]).reshape(b, blocks * tile_n, hkv, cache.shape[3])

    q_ids, q_pos, kv_ids = base.paged_mask_data(seqused, sq, jnp.arange(blocks * tile_n))
    out, lse = reference.attention(
        q, gather(k_tiles), gather(v_tiles), softmax_scale=scale,
        window=(None if left < 0 else int(left), None if right < 0 else int(right)),
        softcap=softcap, q_segment_ids=q_ids, kv_segment_ids=kv_ids, q_positions=q_pos)
    assert (out.shape, lse.shape) == tuple(s.shape for s in out_shapes)
    out = out.astype(out_shapes[0].dtype)
    return (out.transpose(0, 2, 1, 3) if config.qo_head_major else out), lse


@pytest.mark.parametrize("sq,h,hkv,d,page_size,max_pages,seqused,kwargs,splits", [
    # decode step, GQA packed, 256-key pages = 4 kernel blocks each, split into 4 chunks
    (1, 8, 2, 64, 256, 16, (3000, 1, 0), dict(), 4),
    # a chunk of 3 queries, causal: neither packed nor split, rows without keys
    (3, 4, 2, 64, 128, 3, (2, 300, 129), dict(causal=True), 1),
    # head dim 256: 64-key blocks, 64-key pages; window, softcap and a sink
    (2, 2, 1, 256, 64, 5, (70, 320), dict(window_size=(40, 3), softcap=5.0), 1),
])
def test_kernel_route_with_an_emulated_kernel(monkeypatch, sq, h, hkv, d, page_size, max_pages,
                                              seqused, kwargs, splits):
    """The wrapper around the paged kernel (page table -> tile table, decode packing/split,
    per-chunk seqused_k, the lse merge and the sink) against each sequence's dense attention."""
    from jax_fa4.ffi import call

    monkeypatch.setattr(call, "call_kernel", emulated_paged_kernel)
    b = len(seqused)
    q, k_cache, v_cache, table, seqused = _cache(b, sq, h, hkv, d, d, page_size,
                                                 num_pages=b * max_pages + 2,
                                                 max_pages=max_pages, seqused=seqused, seed=3)
    q, k_cache, v_cache = (x.astype(jnp.bfloat16) for x in (q, k_cache, v_cache))
    sink = jnp.asarray(np.linspace(-1.0, 1.0, h), jnp.float32) if kwargs.get("softcap") else None
    opts = options.options(q.shape[-1], softmax_scale=None, causal=kwargs.get("causal", False),
                           window_size=kwargs.get("window_size", (None, None)),
                           softcap=kwargs.get("softcap", 0.0), implementation=None)
    opts = dataclasses.replace(opts, implementation="sm90")
    sm90 = backends.get("sm90")
    config = sm90.paged_plan(q, k_cache, v_cache, jnp.asarray(table), opts)
    assert not isinstance(config, str), config
    plan = decode.plan(q.shape, (b, max_pages * page_size, hkv, d), opts.window,
                               key_block=config.tile_n)
    assert (plan.splits if plan else 1) == splits
    out, lse = sm90.paged_forward(q, k_cache, v_cache, jnp.asarray(table), jnp.asarray(seqused),
                                  sink, opts, config)
    want_out, want_lse = dense_per_sequence(q.astype(jnp.float32), k_cache.astype(jnp.float32),
                                            v_cache.astype(jnp.float32), table, seqused, sink,
                                            **_ref_options(kwargs))
    _assert_close(lse, want_lse, "lse")
    got = np.asarray(out.astype(jnp.float32))
    np.testing.assert_allclose(got, want_out, atol=2e-2, rtol=2e-2)  # bf16 rounding (+ merge)


def test_kernel_config_per_architecture():
    """Hopper: the 64-row, head-major decode tile with 64-key blocks, two CTAs per SM (one at
    head dim 256); Blackwell: its table's config, paged; the reference: its own chunking."""
    opts = options.options(128, softmax_scale=None, causal=True, window_size=(None, None),
                           softcap=0.0, implementation=None)
    table = jnp.zeros((1, 4), jnp.int32)
    for d, tile_n in ((128, 64), (256, 64)):
        q = jnp.zeros((1, 1, 2, d), jnp.bfloat16)
        cache = jnp.zeros((4, 128, 2, d), jnp.bfloat16)
        sm90 = backends.get("sm90").paged_plan(
            q, cache, cache, table, dataclasses.replace(opts, implementation="sm90"))
        sm100 = backends.get("sm100").paged_plan(
            q, cache, cache, table, dataclasses.replace(opts, implementation="sm100"))
        assert (sm90.kernel_name, sm90.paged, sm90.tile_m, sm90.tile_n) == (
            "sm90_fwd", True, 64, tile_n)
        assert sm90.qo_head_major and sm90.ctas_per_sm == (1 if d == 256 else 2)
        # one causal query sees every key: the unmasked kernel (decode.kernel_window)
        assert (sm100.kernel_name, sm100.paged, sm100.mask) == ("sm100_fwd", True, "none")
    assert backends.get("reference").paged_plan(q, cache, cache, table, opts) is None  # dense


def test_kernel_config_refuses_pages_smaller_than_its_key_block():
    q = jnp.zeros((1, 1, 2, 128), jnp.bfloat16)
    cache = jnp.zeros((4, 32, 2, 128), jnp.bfloat16)
    opts = dataclasses.replace(
        options.options(128, softmax_scale=None, causal=False, window_size=(None, None),
                        softcap=0.0, implementation=None), implementation="sm90")
    assert "page_size 32 is not a multiple" in backends.get("sm90").paged_plan(
        q, cache, cache, jnp.zeros((1, 4), jnp.int32), opts)


def test_long_context_takes_the_split_path(monkeypatch):
    """Above _DENSE_MAX_KEYS key slots the public function scans over page chunks."""
    monkeypatch.setattr(base, "_DENSE_MAX_KEYS", 32)
    monkeypatch.setattr(base, "_SPLIT_KEYS", 32)  # 2 pages of 16 per chunk: 3 chunks
    calls = []
    real = base.paged_reference
    monkeypatch.setattr(base, "paged_reference",
                        lambda *a: calls.append(a[-1]) or real(*a))
    q, k_cache, v_cache, table, seqused = _cache(2, 2, 2, 2, 8, 8, 16, num_pages=12,
                                                 max_pages=5, seqused=(70, 9), seed=1)
    out = flash_attention_paged(q, k_cache, v_cache, table, seqused, causal=True)
    assert calls == [2]  # pages per chunk = _SPLIT_KEYS // page_size
    want, _ = dense_per_sequence(q, k_cache, v_cache, table, seqused, window=(None, 0))
    _assert_close(out, want, "out")


def test_new_seqused_and_page_table_do_not_retrace():
    q, k_cache, v_cache, table, seqused = _cache(2, 1, 2, 1, 8, 8, 16, num_pages=8,
                                                 max_pages=3, seqused=(5, 40), seed=2)
    traces = []

    @jax.jit
    def step(q, table, seqused):
        traces.append(None)
        return flash_attention_paged(q, k_cache, v_cache, table, seqused, causal=True)

    for used, tab in (((5, 40), table), ((33, 1), table[::-1]), ((48, 17), table)):
        out = step(q, jnp.asarray(tab), jnp.asarray(used, jnp.int32))
        want, _ = dense_per_sequence(q, k_cache, v_cache, tab, np.asarray(used),
                                     window=(None, 0))
        _assert_close(out, want, f"out {used}")
    assert len(traces) == 1


def test_vmap():
    q, k_cache, v_cache, table, seqused = _cache(2, 1, 2, 2, 8, 8, 16, num_pages=6,
                                                 max_pages=2, seqused=(5, 20), seed=3)
    def f(q):
        return flash_attention_paged(q, k_cache, v_cache, table, seqused)

    qs = jnp.stack([q, 2 * q])
    out = jax.vmap(f)(qs)
    for i in range(2):
        np.testing.assert_allclose(out[i], f(qs[i]), **TOL)


def test_gradient_raises():
    q, k_cache, v_cache, table, seqused = _cache(1, 1, 2, 2, 8, 8, 16, num_pages=2,
                                                 max_pages=2, seqused=(20,), seed=4)
    with pytest.raises(NotImplementedError, match="forward only"):
        jax.grad(lambda q: flash_attention_paged(q, k_cache, v_cache, table, seqused).sum())(q)
    # Not differentiating through it (stop_gradient) is fine.
    g = jax.grad(lambda q: flash_attention_paged(jax.lax.stop_gradient(q), k_cache, v_cache,
                                                 table, seqused).sum() + q.sum())(q)
    np.testing.assert_array_equal(g, np.ones(q.shape))


@pytest.mark.parametrize("mutate, exc, words", [
    (lambda a: {**a, "q": a["q"][0]}, ValueError, ["q", "rank 4", "(B, Sq, H, D)"]),
    (lambda a: {**a, "k_cache": a["k_cache"][..., :4]}, ValueError, ["k_cache head_dim"]),
    (lambda a: {**a, "v_cache": a["v_cache"][:1]}, ValueError,
     ["v_cache", "(num_pages, page_size, Hkv)"]),
    (lambda a: {**a, "q": a["q"][:, :, :3]}, ValueError, ["H=3", "Hkv=2"]),
    (lambda a: {**a, "v_cache": a["v_cache"].astype(jnp.float16)}, TypeError, ["v", "float32"]),
    (lambda a: {**a, "page_table": a["page_table"].astype(np.int64)}, TypeError,
     ["page_table", "int32"]),
    (lambda a: {**a, "page_table": a["page_table"][:1]}, ValueError,
     ["page_table", "(B, max_pages)", "B = 2"]),
    (lambda a: {**a, "seqused_k": a["seqused_k"][:, None]}, ValueError, ["seqused_k", "(B,)"]),
    (lambda a: {**a, "seqused_k": np.array([3, 99], np.int32)}, ValueError,
     ["seqused_k", "[0, max_pages * page_size = 32]"]),
    (lambda a: {**a, "page_table": np.array([[0, 9], [2, 3]], np.int32)}, ValueError,
     ["page_table", "num_pages = 4"]),
    (lambda a: {**a, "learnable_sink": jnp.zeros((2,))}, ValueError, ["learnable_sink", "(4,)"]),
    (lambda a: {**a, "implementation": "sm90"}, jax_fa4.ImplementationUnavailableError,
     ["sm90", "paged"]),
])
def test_bad_inputs_raise_clear_errors(mutate, exc, words):
    q, k_cache, v_cache, table, seqused = _cache(2, 1, 4, 2, 8, 8, 16, num_pages=4,
                                                 max_pages=2, seqused=(20, 3), seed=5)
    table = np.array([[0, 1], [2, 3]], np.int32)
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, page_table=table, seqused_k=seqused)
    args = mutate(args)
    kwargs = {key: args.pop(key) for key in ("learnable_sink", "implementation") if key in args}
    with pytest.raises(exc) as info:
        flash_attention_paged(*args.values(), **kwargs)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


@pytest.mark.parametrize("name", ["sm90", "sm100"])
@pytest.mark.parametrize("sq, window, mask", [(1, (None, 0), "none"), (1, (None, None), "none"),
                                              (2, (None, 0), "causal"), (1, (3, 0), "local")])
def test_a_causal_decode_step_runs_the_unmasked_paged_kernel(name, sq, window, mask):
    """One query under a causal mask sees every key, so the paged call packs its GQA heads into
    one tile's rows (decode.kernel_window): the kernel must then be the unmasked one, or it masks
    packed row j as query j (an entry with fewer keys than the group got lse -inf; the GPU
    conformance case paged-decode-gqa-d128-bf16 found it)."""
    q = jax.ShapeDtypeStruct((2, sq, 8, 128), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((4, 128, 2, 128), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((2, 2), jnp.int32)
    opts = options.AttentionOptions(0.1, window, 0.0, name, forced=True)
    config = backends.get(name).paged_plan(q, cache, cache, table, opts)
    assert not isinstance(config, str), config
    assert config.mask == mask and config.paged


# -- bad paged metadata values: refused wherever they are known at the call ------------------------
@pytest.mark.parametrize("which, value, words", [
    ("seqused_k", [3, 99], ["seqused_k[1]=99 exceeds", "[0, max_pages * page_size = 32]"]),
    ("seqused_k", [-2, 3], ["seqused_k[0]=-2 is negative", "[0, max_pages * page_size = 32]"]),
    ("page_table", [[0, 9], [2, 3]], ["page_table[0, 1]=9", "outside [0, num_pages = 4)",
                                       "seqused_k[0]=20"]),
    ("page_table", [[0, 1], [-1, 3]], ["page_table[1, 0]=-1", "outside [0, num_pages = 4)"]),
])
@pytest.mark.parametrize("as_device_array", [False, True])
def test_bad_paged_metadata_names_the_index(which, value, words, as_device_array):
    q, k_cache, v_cache, _, seqused = _cache(2, 1, 4, 2, 8, 8, 16, num_pages=4, max_pages=2,
                                             seqused=(20, 3), seed=5)
    args = dict(page_table=np.array([[0, 1], [2, 3]], np.int32), seqused_k=seqused)
    args[which] = np.array(value, np.int32)
    if as_device_array:
        args = {key: jnp.asarray(x) for key, x in args.items()}
    with pytest.raises(ValueError) as info:
        flash_attention_paged(q, k_cache, v_cache, args["page_table"], args["seqused_k"])
    for w in words:
        assert w in str(info.value), (w, str(info.value))


@pytest.mark.parametrize("which, value, words", [
    ("seqused_k", [3, 99], ["seqused_k[1]=99 exceeds"]),
    ("seqused_k", [-2, 3], ["seqused_k[0]=-2 is negative"]),
    ("page_table", [[0, 9], [2, 3]], ["page_table[0, 1]=9", "outside [0, num_pages = 4)"]),
    ("page_table", [[0, 1], [-1, 3]], ["page_table[1, 0]=-1"]),
])
def test_validate_checks_traced_paged_metadata(which, value, words):
    """validate=True: under jit the same rule and message, raised when the program runs; an
    unused page's entry (batch entry 1 uses one page) may still hold anything."""
    q, k_cache, v_cache, _, seqused = _cache(2, 1, 4, 2, 8, 8, 16, num_pages=4, max_pages=2,
                                             seqused=(20, 3), seed=5)

    @jax.jit
    def run(table, used):
        return flash_attention_paged(q, k_cache, v_cache, table, used, validate=True)

    good = dict(table=jnp.asarray([[0, 1], [2, 99]], jnp.int32), used=jnp.asarray(seqused))
    assert run(**good).shape == q.shape
    bad = dict(good, **{"table" if which == "page_table" else "used":
                        jnp.asarray(np.array(value, np.int32))})
    with pytest.raises(Exception) as info:
        jax.block_until_ready(run(**bad))
    for w in words:
        assert w in str(info.value), (w, str(info.value)[-500:])


def test_unused_pages_may_hold_anything_and_traced_metadata_is_not_checked():
    q, k_cache, v_cache, _, seqused = _cache(2, 1, 4, 2, 8, 8, 16, num_pages=4, max_pages=2,
                                             seqused=(20, 3), seed=5)
    # batch entry 1 uses one page: its second entry is never read
    table = jnp.asarray([[0, 1], [2, 99]], jnp.int32)
    flash_attention_paged(q, k_cache, v_cache, table, jnp.asarray(seqused))
    bad = jnp.asarray([[0, 9], [2, 3]], jnp.int32)
    paged = jax.jit(lambda t: flash_attention_paged(q, k_cache, v_cache, t, jnp.asarray(seqused)))
    out = paged(bad)
    assert out.shape == q.shape
