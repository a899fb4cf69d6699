"""``JAX_FA4_REQUIRE_GPU=1`` (the GPU machine's runs): GPU tests fail instead of skipping, and a
kernel implementation that would run the pure-JAX reference is reported
(``jax_fa4.backends.base.reference_fallback``) and, in the GPU suite, refused."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from conftest import hopper_available
from jax_fa4 import autodiff
from jax_fa4.backends import base
from jax_fa4.options import AttentionOptions

REPO = Path(__file__).resolve().parents[1]


def _pytest(env_value: str) -> subprocess.CompletedProcess:
    # (the environment's pytest plugins stay out: the run needs none, and loading them is most
    # of its start-up)
    env = dict(os.environ, JAX_FA4_REQUIRE_GPU=env_value, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/gpu/test_preprocess.py"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(hopper_available(), reason="checks the run without a Hopper GPU")
def test_a_required_gpu_run_fails_without_a_hopper_gpu():
    required = _pytest("1")
    assert required.returncode != 0
    assert "JAX_FA4_REQUIRE_GPU=1 but no NVIDIA Hopper GPU" in required.stdout + required.stderr
    optional = _pytest("0")
    assert optional.returncode == 0, optional.stdout[-2000:]
    assert "skipped" in optional.stdout and "passed" not in optional.stdout


def _shapes(d: int, dv: int, dtype=jnp.bfloat16) -> tuple:
    b, sq, h = 1, 16, 2
    f32 = jnp.float32
    return (jax.ShapeDtypeStruct((b, sq, h, d), dtype), jax.ShapeDtypeStruct((b, sq, h, d), dtype),
            jax.ShapeDtypeStruct((b, sq, h, dv), dtype),
            jax.ShapeDtypeStruct((b, sq, h, dv), dtype),
            jax.ShapeDtypeStruct((b, h, sq), f32), jax.ShapeDtypeStruct((b, sq, h, dv), dtype),
            jax.ShapeDtypeStruct((b, h, sq), f32), jax.ShapeDtypeStruct((b, h, sq), f32))


def _sm90_backward(d: int, dv: int) -> None:
    """Trace autodiff.backward_chain (what the gradient's partitioned body runs) for sm90."""
    opts = AttentionOptions(0.1, (None, None), 0.0, "sm90", forced=False)
    jax.eval_shape(lambda *args: autodiff.backward_chain(*args, opts), *_shapes(d, dv)[:7])


def test_a_kernel_call_falling_back_to_the_reference_is_reported(monkeypatch, caplog):
    """An sm90 backward at head dims 192/192 (no sm90 backward kernel yet) runs the reference:
    the fallback is logged, and the GPU suite's hook turns it into a failure; at 128, and for
    the reference implementation itself, nothing is reported."""
    caplog.set_level(logging.INFO, logger="jax_fa4")
    _sm90_backward(192, 192)
    messages = [r.getMessage() for r in caplog.records]
    assert any("backward on sm90 runs the pure-JAX reference" in m for m in messages), messages
    from gpu.conftest import refuse_reference_fallback

    monkeypatch.setattr(base, "reference_fallback", refuse_reference_fallback)
    with pytest.raises(AssertionError, match="JAX_FA4_REQUIRE_GPU=1: the backward"):
        _sm90_backward(192, 192)
    _sm90_backward(128, 128)
    q, k, v = _shapes(128, 128, jnp.float32)[:3]  # float32: no kernel takes it
    with pytest.raises(AssertionError, match="the forward of this call"):
        jax.eval_shape(lambda *a: autodiff.forward_chain(*a, AttentionOptions(
            0.1, (None, None), 0.0, "sm90", forced=False)), q, k, v)
    jax.eval_shape(lambda *a: autodiff.forward_chain(*a, AttentionOptions(
        0.1, (None, None), 0.0, "reference", forced=False)), q, k, v)
