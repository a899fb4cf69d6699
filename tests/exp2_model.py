"""The exp2 probe's inputs and its checks, shared by tests/test_exp2_probe.py (CPU) and
tests/gpu/test_exp2_device.py (the H200 run of the exp2 probe kernel,
``jax_fa4/kernels/exp2_probe.py``).

The reference for the device's bits is the numpy twin ``exp2_sw_numpy`` of ``common/exp2.py``
itself: it performs the device function's float32 operations one for one (range reduction
``add.rm`` as ``2^23 + 2^22 + floor(x)``, exact subtractions, correctly rounded FMAs, the integer
exponent add), and both device forms (scalar ``add.rm.f32``, packed ``add.rm.f32x2``, neither
flushing subnormals) compute exactly that. The inputs here therefore include the cases where an
emulation or a reduction most easily goes wrong: tiny negative x (-2^-30 <= x <= -2^-126, where
a float64 sum rounds to 2^23 + 2^22 before any round-down) and negative subnormals (which an
``.ftz`` reduction flushes to zero). All of them have floor(x) = -1 and give p(1)/2 = 0.99991...
"""

from __future__ import annotations

import numpy as np

F32_TINY = float(np.finfo(np.float32).tiny)  # 2^-126, the smallest normal float32
#: MUFU ex2.approx.ftz's relative error is not what is under test: a loose bound (the PTX ISA
#: gives about 2 ulp), checked where its result is a normal float32.
MUFU_REL_BOUND = 2.0 ** -20


def _around(values: np.ndarray, ulps: int) -> np.ndarray:
    """Each value and its ``ulps`` float32 neighbours on both sides."""
    out = [values]
    lo = hi = values
    for _ in range(ulps):
        lo = np.nextafter(lo, np.float32(-np.inf))
        hi = np.nextafter(hi, np.float32(np.inf))
        out += [lo, hi]
    return np.concatenate(out)


def probe_inputs(size: int = 1 << 24, seed: int = 0, f_stride: int = 1) -> np.ndarray:
    """``size`` float32 inputs over everything softmax feeds the exp2 (x in [-130, 8]) and its
    edges, the rest filled with uniform samples:

    * every float32 in [-127, -126] (subnormal results) and in [1, 2) (every reduced argument f
      on the 2^-23 grid through the polynomial; every ``f_stride``-th one for smaller sets);
    * each integer in [-130, 8] (f = 0, exact) and its 64 float32 neighbours on each side (values
      just below integers: f just below 1), plus j - 1e-6, j - 2e-7, j + 2e-7;
    * magnitudes from 2^-149 to 8 of both signs (logarithmic): the tiny negative x of
      [-2^-30, -2^-126] and the subnormals; ±0, ±2^-126, -2^-30 and its neighbours;
    * -inf, NaNs (quiet and signalling, both signs), very negative values (-FLT_MAX, -1e30, -1000).
    """
    rng = np.random.default_rng(seed)
    ints = np.arange(-130, 9).astype(np.float32)
    one_f = np.arange(0x3F800000, 0x40000000, f_stride, dtype=np.uint32).view(np.float32)  # [1, 2)
    lo_bits, hi_bits = np.float32([-126.0, -127.0]).view(np.uint32)
    denormal_results = np.arange(lo_bits, hi_bits + 1, dtype=np.uint32).view(np.float32)
    mags = np.exp2(np.linspace(-149.0, 3.0, 1 << 16)).astype(np.float32)
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFBFFFFF, 0x7FFFFFFF],
                    np.uint32).view(np.float32)
    special = np.concatenate([
        np.float32([-np.inf, -np.finfo(np.float32).max, -1e30, -1000.0, -200.0, -128.0,
                    -127.5, -127.0, -126.0, -0.0, 0.0, 8.0]),
        nans,
        np.uint32([1, 2, 0x007FFFFF, 0x00800000]).view(np.float32),  # ± subnormals, 2^-126
        -np.uint32([1, 2, 0x007FFFFF, 0x00800000]).view(np.float32),
        _around(np.float32([-(2.0 ** -30)]), 2),  # where a float64 sum stops rounding to 2^23+2^22
    ])
    parts = [
        special, denormal_results, one_f, _around(ints, 64),
        (ints[:, None] + np.float32([-1e-6, -2e-7, 2e-7])).ravel().astype(np.float32),
        mags, -mags,
    ]
    fixed = np.concatenate(parts)
    if fixed.size > size:
        raise ValueError(f"probe_inputs: size {size} < the {fixed.size} fixed inputs")
    fill = rng.uniform(-130.0, 8.0, size - fixed.size).astype(np.float32)
    x = np.concatenate([fixed, fill])
    return x[rng.permutation(x.size)]


def check_exp2(x: np.ndarray, sw: np.ndarray, rel_bound: float) -> float:
    """Assert the software exp2's value contract on (x, sw); returns the max relative error.

    * x <= -127 (-inf included) and NaN: exactly +0.0;
    * x in (-127, -126): 0 <= sw < 2^-126, absolute error below 2^-126;
    * x in [-126, 8]: relative error vs float64 2^x below ``rel_bound``.
    """
    x = np.asarray(x, np.float32)
    sw = np.asarray(sw, np.float32)
    zero = np.isnan(x) | (x <= np.float32(-127.0))
    bits = sw.view(np.uint32)
    assert np.all(bits[zero] == 0), f"not +0.0 at x = {x[zero & (bits != 0)][:8]}"
    mid = (x > np.float32(-127.0)) & (x < np.float32(-126.0))
    ref = np.exp2(x[mid].astype(np.float64))
    got = sw[mid].astype(np.float64)
    assert np.all((got >= 0) & (got < F32_TINY)), "(-127, -126): result not in [0, 2^-126)"
    assert np.all(np.abs(got - ref) < F32_TINY)
    normal = (x >= np.float32(-126.0)) & (x <= np.float32(8.0))
    rel = np.abs(sw[normal].astype(np.float64) / np.exp2(x[normal].astype(np.float64)) - 1.0)
    worst = float(rel.max())
    assert worst < rel_bound, (f"max relative error {worst:.3e} at x = "
                               f"{x[normal][rel.argmax()]!r}, bound {rel_bound:.3e}")
    return worst


def mufu_rel_error(x: np.ndarray, mufu: np.ndarray) -> float:
    """Max relative error of MUFU's ex2.approx.ftz on x in [-125, 8] (normal results)."""
    x = np.asarray(x, np.float32)
    sel = (x >= np.float32(-125.0)) & (x <= np.float32(8.0))
    ref = np.exp2(x[sel].astype(np.float64))
    return float(np.max(np.abs(np.asarray(mufu, np.float32)[sel].astype(np.float64) / ref - 1.0)))
