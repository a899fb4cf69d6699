"""The Hopper forward kernel against the float32 reference, on an H100/H200 (kernels precompiled).

Through the public API (``jax_fa4.flash_attention(..., implementation="sm90", return_lse=True)``
under ``jax.jit``), compared with ``jax_fa4.reference.attention`` by FA4's rule
(tests/numerics.py): ``max|out - ref| <= 2·max|pt - ref| + atol`` (3× with softcap), where ref is
the float32 computation and pt the naive 16-bit one. lse is compared on its finite entries, and
its -inf entries (rows with no visible key) must match exactly; out must be 0 on those rows.

Fresh random inputs per case; device memory is filled with NaN before each kernel run so an
unwritten output element cannot pass. A few cases run the kernel twice and require bitwise
equal results (a moving result is a race).

Kernels needed in the cache: every ``FwdConfig`` from ``jax_fa4.kernels.sm90.fwd_config``'s
``shipped_configs()`` and ``jax_fa4.tools.variants``' ``sm90_fwd_fallback_configs()`` and
``sm90_fwd_option_configs()`` (precompile them on the CPU machine;
``python benchmarks/fwd_variants.py --precompile --with-tests`` builds the option configs).
The last tests call those configs directly (``jax_fa4.backends.sm90.call_forward``: the kernel
call, with the zeroed tile counter of a dynamic-tiles config), bypassing the API:
the serial (no intra-warpgroup overlap) mainloop, and the raw ``params`` contract.
"""

from __future__ import annotations

import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from jax_fa4 import reference
from numerics import assert_fa4_close

pytestmark = pytest.mark.gpu


def poison_device_memory(nbytes: int = 1 << 28) -> None:
    """Fill and free a large block so that fresh outputs start as NaN garbage, not zeros."""
    jnp.full((nbytes // 4,), jnp.nan, jnp.float32).block_until_ready().delete()


def _inputs(seed, b, sq, sk, h, hkv, d, dv, dtype):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (b, sq, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (b, sk, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, sk, hkv, dv), jnp.float32).astype(dtype)
    return q, k, v


def _kernel_fn(causal, window, softcap, softmax_scale):
    def f(q, k, v):
        return jax_fa4.flash_attention(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                       window_size=window, softcap=softcap, return_lse=True,
                                       implementation="sm90")
    return jax.jit(f)


def _check_lse(lse, ref_lse, pt_lse, softcap):
    lse, ref_lse, pt_lse = (np.asarray(x, np.float32) for x in (lse, ref_lse, pt_lse))
    assert lse.shape == ref_lse.shape
    assert not np.isnan(lse).any(), "lse has NaN"
    ref_inf = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), ref_inf, err_msg="lse -inf pattern differs")
    fin = ~ref_inf
    if fin.any():
        err = np.max(np.abs(lse[fin] - ref_lse[fin]))
        pt_err = np.max(np.abs(pt_lse[fin] - ref_lse[fin]))
        bound = ((3 if softcap else 2) * pt_err
                 + 1e-3 * max(1.0, float(np.max(np.abs(ref_lse[fin])))))
        assert err <= bound, f"lse: max err {err:.4g} > bound {bound:.4g} (pt err {pt_err:.4g})"
    return ref_inf


def check_forward(out, lse, ref, pt, softcap: float, name: str) -> None:
    """out (B, Sq, H, Dv) and lse (B, H, Sq) of a kernel against the float32 reference's and the
    16-bit one's ``(out, lse)`` pairs ``ref`` and ``pt``: no NaN, FA4's rule on out, lse on its
    finite entries with the same -inf pattern, and rows without a visible key exactly 0."""
    assert not np.isnan(np.asarray(out, np.float32)).any(), f"{name}: NaN in output"
    assert_fa4_close(out, ref[0], pt[0], softcap=softcap > 0, name=name)
    empty_rows = _check_lse(lse, ref[1], pt[1], softcap > 0)  # (b, h, sq)
    if empty_rows.any():  # rows with no visible key: exactly 0
        o = np.asarray(out, np.float32).transpose(0, 2, 1, 3)[empty_rows]
        assert np.all(o == 0), f"{name}: rows without visible keys are not 0"


def run_case(b, sq, sk, h, hkv, d, dv=None, dtype=jnp.bfloat16, causal=False,
             window=(None, None), softcap=0.0, softmax_scale=None, repeat=False):
    dv = d if dv is None else dv
    seed = zlib.crc32(repr((b, sq, sk, h, hkv, d, dv, str(dtype), causal, window,
                            softcap)).encode())
    q, k, v = _inputs(seed, b, sq, sk, h, hkv, d, dv, dtype)
    fn = _kernel_fn(causal, window, softcap, softmax_scale)
    poison_device_memory()
    out, lse = fn(q, k, v)
    out, lse = jax.block_until_ready((out, lse))
    ref_window = (window[0], 0) if causal else window
    kw = dict(softmax_scale=softmax_scale, window=ref_window, softcap=softcap)
    name = f"out b={b} sq={sq} sk={sk} h={h}/{hkv} d={d}/{dv} {jnp.dtype(dtype).name} " \
           f"causal={causal} window={window} softcap={softcap}"
    assert out.shape == (b, sq, h, dv) and out.dtype == dtype
    check_forward(out, lse, reference.attention(q, k, v, **kw),
                  reference.attention(q, k, v, compute_dtype=dtype, **kw), softcap, name)
    if repeat:
        poison_device_memory()
        out2, lse2 = jax.block_until_ready(fn(q, k, v))
        np.testing.assert_array_equal(np.asarray(out2, np.float32), np.asarray(out, np.float32),
                                      err_msg=f"{name}: second run differs (race?)")
        np.testing.assert_array_equal(np.asarray(lse2), np.asarray(lse))


SEQLENS = [(1, 1), (113, 203), (1023, 1024), (2049, 2048)]
HEAD_DIMS = [(64, 64), (96, 96), (128, 128), (192, 128), (192, 192), (256, 256)]


# --- the anchor: hdim 128, bf16, no mask, all lengths, then causal -------------------------------
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", SEQLENS)
def test_hdim128(sq, sk, causal):
    b, h = (1, 2) if sq > 2000 else (2, 3)
    run_case(b, sq, sk, h, h, 128, causal=causal, repeat=(sq, sk) == (1023, 1024))


# --- every head dim ------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(113, 203), (1023, 1024)])
@pytest.mark.parametrize("d,dv", [x for x in HEAD_DIMS if x != (128, 128)])
def test_head_dims(d, dv, sq, sk, causal):
    run_case(2, sq, sk, 2, 2, d, dv, causal=causal)


@pytest.mark.parametrize("d,dv", HEAD_DIMS)
def test_head_dims_long(d, dv):
    run_case(1, 2049, 2048, 2, 1, d, dv, causal=d % 64 == 0)


# --- GQA / MQA -----------------------------------------------------------------------------------
@pytest.mark.parametrize("h,hkv", [(4, 2), (6, 1), (8, 8)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_mqa(h, hkv, causal):
    run_case(2, 255, 383, h, hkv, 128, causal=causal)


# --- masks that leave rows / whole tiles without keys; sliding windows --------------------------
@pytest.mark.parametrize("sq,sk", [(203, 113), (1023, 64), (300, 1), (64, 1000)])
def test_causal_more_queries_than_keys(sq, sk):
    run_case(2, sq, sk, 2, 2, 128, causal=True)


@pytest.mark.parametrize("window", [(0, 0), (64, 0), (17, 3), (None, 5), (200, None), (1, 130),
                                    (1000, 1000)])
def test_local(window):
    run_case(2, 113, 203, 2, 1, 128, window=window)


@pytest.mark.parametrize("window", [(17, 3), (None, 5), (200, None)])
def test_local_long(window):
    run_case(2, 1023, 1024, 2, 1, 128, window=window, repeat=window == (17, 3))


@pytest.mark.parametrize("d,dv", [(64, 64), (192, 128), (256, 256)])
def test_local_head_dims(d, dv):
    run_case(2, 1023, 1024, 2, 2, d, dv, window=(100, 20))


@pytest.mark.parametrize("window", [(0, 0), (3, None), (None, 2)])
def test_local_more_queries_than_keys(window):
    run_case(2, 203, 113, 2, 1, 128, window=window)


def test_causal_with_left_window():
    run_case(2, 1023, 1024, 2, 2, 128, causal=True, window=(256, None))


# --- softcap -------------------------------------------------------------------------------------
# --- decode shapes: GQA packing, split-KV, the head-major decode tile (jax_fa4/backends) ---------
@pytest.fixture(params=[False, True], ids=["tile128", "decode-tile"])
def decode_tile(request, monkeypatch):
    """Both forward tiles behind the decode rewrite (the 64-row decode tile is the default)."""
    monkeypatch.setenv("JAX_FA4_DECODE_TILE", "1" if request.param else "0")
    return request.param


def _decode_options():
    from jax_fa4.kernels.sm90.fwd_config import DECODE_OPTIONS

    return list(DECODE_OPTIONS)


@pytest.fixture(params=["0", "1", *_decode_options()],
                ids=lambda p: {"0": "tile128", "1": "decode-tile"}.get(p, p))
def decode_tile_or_option(request, monkeypatch):
    """The decode tests at hdim 128 bf16 also run each decode-tile alternative
    (fwd_config.DECODE_OPTIONS: one CTA per SM; two with one 128-key stage)."""
    monkeypatch.setenv("JAX_FA4_DECODE_TILE", request.param)
    return request.param


@pytest.mark.parametrize("b,sq,h,hkv,sk,causal", [
    (4, 1, 32, 8, 8192, True),  # the decode anchor's form: 4 heads packed, 8 chunks
    (3, 1, 8, 1, 5000, False),  # MQA: 8 heads packed, 4 chunks of 1250 keys
    (2, 3, 16, 4, 4096, False),  # 12 packed rows, 4 chunks
    (2, 16, 8, 2, 2048, False),  # 32 packed rows, 2 chunks
    (1, 40, 8, 2, 3000, False),  # 80 packed rows: the 128-row training tile, 2 chunks
    (2, 2, 4, 4, 16384, False),  # MHA: 16 chunks only
])
def test_decode(b, sq, h, hkv, sk, causal, decode_tile_or_option):
    run_case(b, sq, sk, h, hkv, 128, causal=causal, repeat=True)


@pytest.mark.parametrize("d,dv", HEAD_DIMS)
def test_decode_head_dims(d, dv, decode_tile):
    run_case(2, 1, 4096, 16, 4, d, dv, causal=True)


def test_decode_fp16_softcap(decode_tile):
    run_case(2, 1, 4096, 8, 2, 128, dtype=jnp.float16, softcap=30.0)


@pytest.mark.parametrize("mask", ["none", "causal", "local"])
@pytest.mark.parametrize("sq,sk", [(113, 203), (1023, 1024)])
def test_softcap(mask, sq, sk):
    window = (50, 10) if mask == "local" else (None, None)
    run_case(2, sq, sk, 2, 2, 128, causal=mask == "causal", window=window, softcap=15.0)


def test_softcap_other_head_dim():
    run_case(2, 1023, 1024, 2, 2, 64, causal=True, softcap=30.0, softmax_scale=0.2)


# --- fp16, custom scale --------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(113, 203), (2049, 2048)])
def test_fp16(sq, sk, causal):
    run_case(1, sq, sk, 2, 2, 128, dtype=jnp.float16, causal=causal)


def test_softmax_scale():
    run_case(2, 1023, 1024, 2, 2, 128, softmax_scale=0.5 / math.sqrt(128))


# --- raw kernel contract, and the serial (no-overlap) mainloop ----------------------------------
def _call_config(cfg, q, k, v, scale, softcap=0.0, window=(-1, -1)):
    from jax_fa4.backends.sm90 import call_forward

    params = jnp.array([scale, softcap, window[0], window[1]], jnp.float32)
    b, sq, h, _ = q.shape
    out_shapes = (jax.ShapeDtypeStruct((b, sq, h, v.shape[3]), q.dtype),
                  jax.ShapeDtypeStruct((b, h, sq), jnp.float32))
    return call_forward(cfg, q, k, v, params, out_shapes=out_shapes)


@pytest.mark.parametrize("mask,softcap,window", [
    ("none", 0.0, (-1, -1)), ("causal", 0.0, (-1, -1)), ("local", 0.0, (37, 5)),
    ("none", 20.0, (-1, -1)), ("causal", 20.0, (-1, -1)), ("local", 20.0, (-1, 0)),
    ("local", 0.0, (-1, -1)),
])
@pytest.mark.parametrize("overlap", [False, True])
def test_raw_kernel(mask, softcap, window, overlap):
    if overlap and mask != "local":
        pytest.skip("the overlapped mainloop is covered through the API")
    from jax_fa4.kernels.sm90.fwd_config import FwdConfig

    cfg = FwdConfig.make("bfloat16", 128, 128, mask, softcap > 0, intra_wg_overlap=overlap)
    b, sq, sk, h, hkv, d = 2, 1023, 1024, 4, 2, 128
    q, k, v = _inputs(17 + len(mask), b, sq, sk, h, hkv, d, d, jnp.bfloat16)
    scale = 1 / math.sqrt(d)
    poison_device_memory()
    fn = jax.jit(lambda q, k, v: _call_config(cfg, q, k, v, scale, softcap, window))
    out, lse = jax.block_until_ready(fn(q, k, v))
    ref_window = {"none": (None, None), "causal": (None, 0)}.get(
        mask, tuple(None if w < 0 else w for w in window))
    kw = dict(softmax_scale=scale, window=ref_window, softcap=softcap)
    ref_out, ref_lse = reference.attention(q, k, v, **kw)
    pt_out, pt_lse = reference.attention(q, k, v, compute_dtype=jnp.bfloat16, **kw)
    assert_fa4_close(out, ref_out, pt_out, softcap=softcap > 0, name=f"raw {cfg.describe()}")
    _check_lse(lse, ref_lse, pt_lse, softcap > 0)


# --- v2 tuning options (ping-pong, 3 consumer warpgroups, conditional rescaling) ----------------
def _option_configs():
    from jax_fa4.tools.variants import sm90_fwd_option_configs

    return sm90_fwd_option_configs()


def _option_id(cfg):
    parts = [cfg.dtype[:4], f"{cfg.head_dim}-{cfg.head_dim_v}", cfg.mask,
             f"{cfg.tile_m}x{cfg.tile_n}"]
    parts += ["pp"] * cfg.pingpong + [f"rs{cfg.rescale_threshold:g}"] * (cfg.rescale_threshold > 0)
    parts += ["softcap"] * cfg.has_softcap + ["serial"] * (not cfg.intra_wg_overlap)
    parts += [f"persist{cfg.num_sms}"] * (cfg.num_sms > 0) + ["dyn"] * cfg.dynamic_tiles
    return "-".join(parts)


# (b, sq, sk, h, hkv, scale multiplier): odd lengths, more queries than keys (empty causal rows),
# several M tiles and key blocks; scale ×8 makes the row max jump by far more than the rescale
# threshold (8 log2 units) between key blocks, so both branches of the conditional rescale run.
OPTION_SHAPES = [(2, 113, 203, 4, 2, 1.0), (2, 1023, 1024, 4, 2, 1.0), (1, 2049, 2048, 2, 1, 8.0),
                 (2, 203, 113, 2, 2, 1.0)]


@pytest.mark.parametrize("shape", OPTION_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("cfg", _option_configs(), ids=_option_id)
def test_v2_options(cfg, shape):
    """Each v2 option config, called directly, against the float32 reference (FA4's rule), with
    the -inf lse / zero rows of rows without keys, and bitwise-repeatable (a race moves it)."""
    b, sq, sk, h, hkv, mult = shape
    d, dv = cfg.head_dim, cfg.head_dim_v
    dtype = jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float16
    softcap = 20.0 if cfg.has_softcap else 0.0
    window = {"none": (-1, -1), "causal": (-1, 0), "local": (37, 5)}[cfg.mask]
    seed = zlib.crc32(repr((cfg.describe(), shape)).encode())
    q, k, v = _inputs(seed, b, sq, sk, h, hkv, d, dv, dtype)
    scale = mult / math.sqrt(d)
    fn = jax.jit(lambda q, k, v: _call_config(cfg, q, k, v, scale, softcap, window))
    poison_device_memory()
    out, lse = jax.block_until_ready(fn(q, k, v))
    ref_window = {"none": (None, None), "causal": (None, 0), "local": window}[cfg.mask]
    kw = dict(softmax_scale=scale, window=ref_window, softcap=softcap)
    name = f"{_option_id(cfg)} shape={shape}"
    check_forward(out, lse, reference.attention(q, k, v, **kw),
                  reference.attention(q, k, v, compute_dtype=dtype, **kw), softcap, name)
    poison_device_memory()
    out2, lse2 = jax.block_until_ready(fn(q, k, v))
    np.testing.assert_array_equal(np.asarray(out2, np.float32), np.asarray(out, np.float32),
                                  err_msg=f"{name}: second run differs (race?)")
    np.testing.assert_array_equal(np.asarray(lse2), np.asarray(lse))
