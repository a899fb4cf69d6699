"""The software exp2 of common/exp2.py, executed on the H200 (issue #7).

The exp2 probe kernel (``jax_fa4/kernels/exp2_probe.py``, test-only, precompiled for sm_90a by
``precompile --suite tests``) writes 2^x by the scalar ``exp2_sw`` and by MUFU (ex2.approx.ftz)
for 2^24 float32 inputs (tests/exp2_model.py's ``probe_inputs``: x in [-130, 8], every float32
in [-127, -126] and in [1, 2), integers and their neighbours, tiny magnitudes (the tiny negative
x of [-2^-30, -2^-126] included), ±0, subnormals, -inf, NaNs). The packed ``exp2_sw_x2`` needs
sm_100's f32x2 instructions and cannot run here: tests/test_exp2_probe.py compiles it for sm_100a.

Asserted of the device's ``exp2_sw``:
  * bit-identical to the numpy twin ``exp2_sw_numpy`` on every input, no exceptions (the twin
    performs the device's float32 operations one for one; tiny negative and subnormal x have
    floor -1 in the unflushed ``add.rm.f32`` reduction and give p(1)/2 = 0.99991...);
  * relative error vs float64 2^x below test_sm100_numerics.EXP2_REL_BOUND (2^-13) on
    [-126, 8] (printed); x <= -127, -inf and NaN give exactly +0.0; (-127, -126) in [0, 2^-126).
MUFU's relative error is printed beside it (and loosely bounded); odd lengths are handled.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_fa4.kernels.common.exp2 import exp2_sw_numpy
from jax_fa4.kernels.exp2_probe_config import Exp2ProbeConfig

from exp2_model import MUFU_REL_BOUND, check_exp2, mufu_rel_error, probe_inputs
from test_sm100_numerics import EXP2_REL_BOUND

ARCH = "sm_90a"


@jax.jit
def exp2_probe(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(software exp2, MUFU exp2) of a float32 vector, by the probe kernel (scalar form)."""
    from jax_fa4.ffi.call import call_kernel

    out = jax.ShapeDtypeStruct(x.shape, jnp.float32)
    sw, mufu = call_kernel(Exp2ProbeConfig(packed=False), ARCH, x, out_shapes=(out, out))
    return sw, mufu


def poison_device_memory(nbytes: int = 1 << 28) -> None:
    """Fill and free a large block so that fresh outputs start as NaN garbage, not zeros."""
    jnp.full((nbytes // 4,), jnp.nan, jnp.float32).block_until_ready().delete()


@functools.lru_cache(maxsize=1)
def _run() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x = probe_inputs()
    poison_device_memory()
    sw, mufu = exp2_probe(jnp.asarray(x))
    return x, np.asarray(sw), np.asarray(mufu)


def _first_mismatches(x, got, want, n=8) -> str:
    bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))[:n]
    return ", ".join(f"x={x[i]!r} ({x[i].view(np.uint32):#010x}): device "
                     f"{got[i].view(np.uint32):#010x}, expected {want[i].view(np.uint32):#010x}"
                     for i in bad)


def test_software_exp2_is_bit_exact():
    x, sw, _ = _run()
    assert x.size == 1 << 24
    twin = exp2_sw_numpy(x)
    diff = sw.view(np.uint32) != twin.view(np.uint32)
    assert not diff.any(), (f"{diff.sum()} of {x.size} differ from exp2_sw_numpy: "
                            f"{_first_mismatches(x, sw, twin)}")
    tiny_negative = (x < 0) & (x >= np.float32(-(2.0 ** -30)))
    print(f"\nexp2_sw on {ARCH}: bit-identical to exp2_sw_numpy on all {x.size} inputs "
          f"({tiny_negative.sum()} tiny negative or subnormal x giving p(1)/2)")


def test_software_exp2_values():
    x, sw, mufu = _run()
    worst = check_exp2(x, sw, EXP2_REL_BOUND)
    worst_mufu = mufu_rel_error(x, mufu)
    print(f"\nmax relative error on [-126, 8]: exp2_sw {worst:.3e} = 2^{math.log2(worst):.2f} "
          f"(bound {EXP2_REL_BOUND:.3e}); MUFU ex2.approx.ftz on [-125, 8] {worst_mufu:.3e} = "
          f"2^{math.log2(worst_mufu):.2f}")
    for special in (-np.inf, np.nan, -127.0, -1e30):
        sel = (np.isnan(x) if np.isnan(special) else x == np.float32(special))
        assert sel.any() and np.all(sw[sel].view(np.uint32) == 0), special
    assert np.all(mufu[np.isneginf(x)] == 0.0)
    assert worst_mufu < MUFU_REL_BOUND


@pytest.mark.parametrize("n", [1, 2, 3, 511, 513, 100_001])
def test_any_length(n):
    """Every element written, for any length (odd lengths: the last pair is half full)."""
    x = probe_inputs(1 << 20, seed=n, f_stride=128)[:n]
    poison_device_memory()
    sw, mufu = exp2_probe(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(sw).view(np.uint32),
                                  exp2_sw_numpy(x).view(np.uint32))
    assert np.asarray(mufu).shape == (n,)
