"""The exp2 probe (test-only kernel running common/exp2.py's software exp2) on the CPU machine.

* Registration: built by ``precompile --suite tests --arch sm_90a --family exp2_probe`` (the
  scalar form only), never in the shipped default suite.
* The numpy twin ``exp2_sw_numpy`` (the bit-exact reference the GPU test,
  tests/gpu/test_exp2_device.py, compares the device output to) passes the value checks that
  test applies, on the same kind of inputs (tests/exp2_model.py).
* Compiles: the scalar form for sm_90a and sm_100a (FFMA polynomial, ``FADD.RM`` reduction without
  flush-to-zero), the packed form for sm_100a (three FFMA2, ``FADD2.RM``), and libNVVM refuses the
  packed form for sm_90a (no f32x2 arithmetic before Blackwell).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from jax_fa4.ffi.compiler import compiler_available
from jax_fa4.kernels.common.exp2 import POLY_COEFFS, exp2_sw_numpy, fma_f32
from jax_fa4.kernels.exp2_probe_config import Exp2ProbeConfig
from jax_fa4.tools.variants import Variant, variants

from compiled import compiled_sass, needs_disassembler
from exp2_model import check_exp2, probe_inputs
from test_sm100_numerics import EXP2_REL_BOUND

needs_compiler = pytest.mark.skipif(not compiler_available(), reason="needs nvidia-cutlass-dsl")


def test_registered_for_the_tests_suite_only():
    assert variants("tests", archs=["sm_90a"], families=["exp2_probe"]) == [
        Variant(Exp2ProbeConfig(packed=False), "sm_90a")]
    assert variants("tests", archs=["sm_100a"], families=["exp2_probe"]) == []
    assert not [v for v in variants("default") if v.config.kernel_name == "exp2_probe"]
    sig = Exp2ProbeConfig().signature()
    assert [a.name for a in sig.inputs] == ["x"] and [a.name for a in sig.outputs] == ["sw", "mufu"]


def test_twin_passes_the_device_checks():
    """What the GPU test asserts of the device output (whose bits must equal the twin's) holds
    for the twin, so a failure there is the device's: the value contract and the relative error
    bound of test_sm100_numerics. The tiny negative and subnormal inputs give p(1)/2."""
    x = probe_inputs(1 << 21, seed=2, f_stride=64)
    twin = exp2_sw_numpy(x)
    worst = check_exp2(x, twin, EXP2_REL_BOUND)
    print(f"\ntwin: max relative error {worst:.3e} (bound {EXP2_REL_BOUND:.3e})")
    tiny_negative = (x < 0) & (x >= np.float32(-(2.0 ** -30)))
    assert tiny_negative.sum() > 1000
    c0, c1, c2, c3 = (np.float32(c) for c in POLY_COEFFS)
    one = np.float32(1.0)
    p1_half = fma_f32(fma_f32(fma_f32(c3, one, c2), one, c1), one, c0) / np.float32(2.0)
    assert np.all(twin[tiny_negative] == p1_half) and abs(float(p1_half) - 0.99991) < 1e-5


def _sass(config: Exp2ProbeConfig, arch: str, cache):
    k = compiled_sass(cache, config, arch)
    assert "Exp2Probe" in k.name, k.name
    return k, k.sass


@needs_compiler
@needs_disassembler
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_scalar_form_compiles(arch, shipped_cache):
    """Two elements per thread: per element three FFMA (the polynomial), one FADD.RM (the
    round-down reduction, no flush-to-zero: subnormal x keeps floor -1, as in the packed form and
    the twin), one MUFU.EX2 (the comparison); no packed instructions, no FTZ on any FADD."""
    k, sass = _sass(Exp2ProbeConfig(packed=False), arch, shipped_cache)
    print(f"\n{arch} scalar: {k.registers} regs, ops {dict(sorted(k.opcodes.items()))}")
    assert k.arch == arch
    assert k.count("FFMA") == 6 and k.count("MUFU.EX2") == 2
    assert k.count("FFMA2") == 0 and k.count("FADD2") == 0
    assert len(re.findall(r"\bFADD\.RM\b", sass)) == 2 and "FADD.FTZ.RM" not in sass
    assert not re.search(r"\bFADD2?\.\S*FTZ", sass)
    assert k.count("LDL") == 0 and k.count("STL") == 0 and k.stack == 0


@needs_compiler
@needs_disassembler
def test_packed_form_compiles_for_sm100_with_ffma2(shipped_cache):
    """exp2_sw_x2 for sm_100a: the polynomial of both elements in three FFMA2, the reduction in
    FADD2 (the round-down one without flush-to-zero), no scalar FFMA."""
    k, sass = _sass(Exp2ProbeConfig(packed=True), "sm_100a", shipped_cache)
    print(f"\nsm_100a packed: {k.registers} regs, ops {dict(sorted(k.opcodes.items()))}")
    assert k.count("FFMA2") == 3 and k.count("FFMA") == 0
    assert k.count("FADD2") == 3 and k.count("MUFU.EX2") == 2
    assert len(re.findall(r"\bFADD2\.RM\b", sass)) == 1 and "FADD2.FTZ" not in sass
    assert k.count("LDL") == 0 and k.count("STL") == 0 and k.stack == 0


@needs_compiler
def test_packed_form_is_refused_for_sm90():
    """No f32x2 arithmetic on Hopper: the H200 can only run the scalar form. (Should a DSL
    release lower it, the packed form could run on the H200 too: add it to the tests suite.)"""
    from jax_fa4.ffi.compiler import compile_config

    with pytest.raises(Exception, match="F32x2 intrinsics are not supported"):
        compile_config(Exp2ProbeConfig(packed=True), "sm_90a")
