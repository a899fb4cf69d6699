"""The exp2 probe (test-only kernel running common/exp2.py's software exp2) on the CPU machine.

* Registration: built by ``precompile --suite tests --arch sm_90a --family exp2_probe`` (the
  scalar form only), never in the shipped default suite.
* The numpy device model of tests/exp2_model.py against the numpy twin ``exp2_sw_numpy``: equal
  bit for bit except on the twin's known gap (-2^-30 <= x <= -2^-126), and within the checks the
  GPU test (tests/gpu/test_exp2_device.py) applies to the device output.
* Compiles: the scalar form for sm_90a and sm_100a (FFMA polynomial, ``FADD.FTZ.RM`` reduction),
  the packed form for sm_100a (three FFMA2, ``FADD2.RM``), and libNVVM refuses the packed form
  for sm_90a (no f32x2 arithmetic before Blackwell).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jax_fa4.ffi.compiler import compiler_available
from jax_fa4.kernels.common.exp2 import exp2_sw_numpy
from jax_fa4.kernels.exp2_probe_config import Exp2ProbeConfig
from jax_fa4.variants import Variant, variants

from compiled import CUBIN_REPORT
from exp2_model import (TWIN_GAP, check_exp2, exp2_device_model, in_twin_gap, probe_inputs)
from test_sm100_numerics import EXP2_REL_BOUND

needs_compiler = pytest.mark.skipif(not compiler_available() or not CUBIN_REPORT.is_file(),
                                    reason="needs nvidia-cutlass-dsl and cubin_report.py")


def test_registered_for_the_tests_suite_only():
    assert variants("tests", archs=["sm_90a"], families=["exp2_probe"]) == [
        Variant(Exp2ProbeConfig(packed=False), "sm_90a")]
    assert variants("tests", archs=["sm_100a"], families=["exp2_probe"]) == []
    assert not [v for v in variants("default") if v.config.kernel_name == "exp2_probe"]
    sig = Exp2ProbeConfig().signature()
    assert [a.name for a in sig.inputs] == ["x"] and [a.name for a in sig.outputs] == ["sw", "mufu"]


def test_model_equals_twin_outside_its_gap():
    """The device model and exp2_sw_numpy agree bit for bit except where the twin's float64
    round-down misses add.rm (see tests/exp2_model.py); there the model gives p(1)/2."""
    x = probe_inputs(1 << 21, seed=1, f_stride=64)
    model, twin = exp2_device_model(x), exp2_sw_numpy(x)
    differ = model.view(np.uint32) != twin.view(np.uint32)
    gap = in_twin_gap(x)
    assert gap.sum() > 1000
    np.testing.assert_array_equal(differ, gap)
    assert np.all(twin[gap] == np.float32(1.0))
    # the model's value there is the twin's just outside the gap (f = x + 1 rounds to 1: p(1)/2)
    outside = np.nextafter(np.float32(TWIN_GAP[0]), np.float32(-np.inf))
    p1_half = exp2_sw_numpy(outside)
    assert np.all(model[gap] == p1_half) and abs(float(p1_half) - 0.99991) < 1e-5
    assert TWIN_GAP[0] == -(2.0 ** -30)


def test_model_passes_the_device_checks():
    """What the GPU test asserts of the device output holds for the model (so a failure there
    is the device's): value contract and the relative error bound of test_sm100_numerics."""
    x = probe_inputs(1 << 21, seed=2, f_stride=64)
    worst = check_exp2(x, exp2_device_model(x), EXP2_REL_BOUND)
    print(f"\nmodel: max relative error {worst:.3e} (bound {EXP2_REL_BOUND:.3e})")
    # the packed form (no flush in the reduction) differs only on negative subnormals
    packed = exp2_device_model(x, ftz_reduction=False)
    differ = packed.view(np.uint32) != exp2_device_model(x).view(np.uint32)
    assert np.all((x[differ] < 0) & (x[differ] > -np.finfo(np.float32).tiny))


def _sass(config: Exp2ProbeConfig, arch: str, tmp_path: Path) -> tuple[dict, str]:
    from jax_fa4.ffi.compiler import compile_config

    obj = tmp_path / "probe.o"
    obj.write_bytes(compile_config(config, arch).object_bytes)
    sass_dir = tmp_path / "sass"
    res = subprocess.run([sys.executable, str(CUBIN_REPORT), str(obj), "--json",
                          "--sass-out", str(sass_dir)], capture_output=True, text=True, check=True)
    records = [r for r in json.loads(res.stdout) if "Exp2Probe" in r["kernel"]]
    assert len(records) == 1, res.stdout
    return records[0], "\n".join(p.read_text() for p in sorted(sass_dir.iterdir()))


@needs_compiler
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_scalar_form_compiles(arch, tmp_path):
    """Two elements per thread: per element three FFMA (the polynomial), one FADD.FTZ.RM (the
    round-down reduction), one MUFU.EX2 (the comparison); no packed instructions."""
    rec, sass = _sass(Exp2ProbeConfig(packed=False), arch, tmp_path)
    ops = rec["ops"]
    print(f"\n{arch} scalar: {rec['reg']} regs, ops {dict(sorted(ops.items()))}")
    assert rec["arch"] == arch
    assert ops.get("FFMA", 0) == 6 and ops.get("MUFU.EX2", 0) == 2
    assert ops.get("FFMA2", 0) == 0 and ops.get("FADD2", 0) == 0
    assert len(re.findall(r"FADD\.FTZ\.RM\b", sass)) == 2
    assert ops.get("LDL", 0) == 0 and ops.get("STL", 0) == 0 and rec["stack"] == 0


@needs_compiler
def test_packed_form_compiles_for_sm100_with_ffma2(tmp_path):
    """exp2_sw_x2 for sm_100a: the polynomial of both elements in three FFMA2, the reduction in
    FADD2 (the round-down one without flush-to-zero), no scalar FFMA."""
    rec, sass = _sass(Exp2ProbeConfig(packed=True), "sm_100a", tmp_path)
    ops = rec["ops"]
    print(f"\nsm_100a packed: {rec['reg']} regs, ops {dict(sorted(ops.items()))}")
    assert ops.get("FFMA2", 0) == 3 and ops.get("FFMA", 0) == 0
    assert ops.get("FADD2", 0) == 3 and ops.get("MUFU.EX2", 0) == 2
    assert len(re.findall(r"FADD2\.RM\b", sass)) == 1 and "FADD2.FTZ" not in sass
    assert ops.get("LDL", 0) == 0 and ops.get("STL", 0) == 0 and rec["stack"] == 0


@needs_compiler
def test_packed_form_is_refused_for_sm90():
    """No f32x2 arithmetic on Hopper: the H200 can only run the scalar form. (Should a DSL
    release lower it, the packed form could run on the H200 too: add it to the tests suite.)"""
    from jax_fa4.ffi.compiler import compile_config

    with pytest.raises(Exception, match="F32x2 intrinsics are not supported"):
        compile_config(Exp2ProbeConfig(packed=True), "sm_90a")
