"""The public API on CPU: input checks, dispatch, autodiff, jit/vmap, all through the reference.

Results and gradients against the float32 reference, option by option: the conformance suite
(tests/test_conformance.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from jax_fa4.backends import ImplementationUnavailableError
from numerics import random_qkv


def _qkv(b=2, sq=37, sk=53, h=4, hkv=2, d=32, dv=None, dtype=jnp.float32, seed=0):
    return random_qkv(b, sq, sk, h, hkv, d, dv, dtype, seed)


# -- bad input: each error names the argument and says what was expected ------------------------
@pytest.mark.parametrize("mutate, exc, words", [
    (lambda q, k, v: (q[0], k, v), ValueError, ["q", "rank 4", "(B, Sq, H, D)"]),
    (lambda q, k, v: (q, k[None], v), ValueError, ["k", "rank 4"]),
    (lambda q, k, v: (q, k[:1], v[:1]), ValueError, ["batch"]),
    (lambda q, k, v: (q, k[..., :16], v), ValueError, ["head_dim", "32"]),
    (lambda q, k, v: (q[:, :, :3], k, v), ValueError, ["H=3", "Hkv=2"]),
    (lambda q, k, v: (q, k, v[:, :5]), ValueError, ["v", "(Sk, Hkv)"]),
    (lambda q, k, v: (q.astype(jnp.int32), k, v), TypeError, ["q", "dtype", "int32"]),
    (lambda q, k, v: (q, k.astype(jnp.bfloat16), v), TypeError, ["k", "float32", "bfloat16"]),
    (lambda q, k, v: (q.tolist(), k, v), TypeError, ["q", "jax.Array", "list"]),
])
def test_bad_arrays_raise_clear_errors(mutate, exc, words):
    with pytest.raises(exc) as info:
        jax_fa4.flash_attention(*mutate(*_qkv()))
    for w in words:
        assert w in str(info.value), (w, str(info.value))


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(window_size=(-1, None)), ValueError, ["window_size left", ">= 0", "-1"]),
    (dict(window_size=(None, -3)), ValueError, ["window_size right", "-3"]),
    (dict(window_size=(2,)), ValueError, ["window_size", "pair"]),
    (dict(window_size=(1.5, None)), TypeError, ["window_size left", "int"]),
    (dict(softcap=-1.0), ValueError, ["softcap", ">= 0", "-1.0"]),
    (dict(softcap=float("nan")), ValueError, ["softcap", "finite"]),
    (dict(softmax_scale=0.0), ValueError, ["softmax_scale", "> 0"]),
    (dict(softmax_scale="1"), TypeError, ["softmax_scale", "str"]),
    (dict(causal=1), TypeError, ["causal", "bool"]),
    (dict(deterministic="yes"), TypeError, ["deterministic", "bool", "str"]),
    (dict(implementation="cuda"), ValueError, ["implementation", "'sm90'", "'cuda'"]),
])
def test_bad_options_raise_clear_errors(kwargs, exc, words):
    with pytest.raises(exc) as info:
        jax_fa4.flash_attention(*_qkv(), **kwargs)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


# -- results and dispatch ----------------------------------------------------------------------
def test_fully_masked_rows_give_zero_and_neg_inf_lse():
    q, k, v = _qkv(sq=40, sk=10)  # causal, bottom-right: the first 30 queries see no key
    out, lse = jax_fa4.flash_attention(q, k, v, causal=True, return_lse=True)
    assert np.all(np.asarray(out[:, :30]) == 0) and np.all(np.isneginf(np.asarray(lse[:, :, :30])))
    grads = jax.grad(lambda q, k, v: jax_fa4.flash_attention(q, k, v, causal=True).sum(),
                     argnums=(0, 1, 2))(q, k, v)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)


def test_forced_kernel_without_gpu_fails_when_lowered_for_cpu():
    q, k, v = _qkv(d=128, dtype=jnp.bfloat16)  # a shape the sm90 forward kernel serves
    with pytest.raises(ImplementationUnavailableError, match="lowered for cpu"):
        jax.jit(lambda q, k, v: jax_fa4.flash_attention(q, k, v, implementation="sm90"))(q, k, v)


def test_forced_kernel_that_cannot_serve_the_call_says_why():
    q, k, v = _qkv(d=40, dtype=jnp.bfloat16)
    with pytest.raises(ImplementationUnavailableError, match="head_dim/head_dim_v 40/40"):
        jax_fa4.flash_attention(q, k, v, implementation="sm90")
    with pytest.raises(ImplementationUnavailableError, match="bfloat16 or float16"):
        jax_fa4.flash_attention(*_qkv(d=128), implementation="sm90")


def test_default_implementation_on_cpu_is_reference():
    q, k, v = _qkv(dtype=jnp.bfloat16)
    hlo = jax.jit(lambda q, k, v: jax_fa4.flash_attention(q, k, v)).lower(q, k, v).as_text()
    assert "custom_call" not in hlo


def test_vmap_folds_extra_axes():
    q, k, v = _qkv(b=1)
    qs, ks, vs = (jnp.stack([x, x * 0.5, -x]) for x in (q, k, v))
    got = jax.vmap(lambda q, k, v: jax_fa4.flash_attention(q, k, v, causal=True))(qs, ks, vs)
    for i in range(3):
        want = jax_fa4.flash_attention(qs[i], ks[i], vs[i], causal=True)
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-6)


def test_import_does_not_load_the_compiler():
    import subprocess
    import sys

    code = "import sys, jax_fa4; assert 'cutlass' not in sys.modules; print('ok')"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.stdout.strip() == "ok", res.stderr
