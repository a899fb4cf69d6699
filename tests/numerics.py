"""FA4's numerical acceptance rule, shared by the test files.

``ref`` is attention computed in float32 from the same (low-precision) inputs and ``pt`` the
same naive attention computed in the low precision. A result passes when

    max|out - ref| <= m * max|pt - ref| + atol,   atol = 2 * max|(ref + 0.3 - 0.3) - ref|,

with ``m = 2`` (``3`` with softcap). ``atol`` is evaluated in ``ref``'s own dtype, so it is
the rounding granularity of that dtype near 0.3. The same rule applies to dq, dk and dv.
Also: :func:`random_qkv`, fresh normal q, k, v of given shapes.
"""

import jax
import jax.numpy as jnp
import numpy as np


def random_qkv(b, sq, sk, h, hkv, d, dv=None, dtype=jnp.float32, seed=0):
    """q (b, sq, h, d), k (b, sk, hkv, d), v (b, sk, hkv, dv or d): standard normal, drawn in
    float32 and cast to ``dtype``."""
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (b, sq, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, sk, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, sk, hkv, dv or d), jnp.float32).astype(dtype)
    return q, k, v


def assert_fa4_close(out, ref, pt, *, softcap: bool = False, name: str = "out") -> None:
    """Assert FA4's rule ``max|out - ref| <= m * max|pt - ref| + atol`` (see module docstring).

    Args:
        out: the result under test.
        ref: float32 computation from the same inputs (in its output dtype).
        pt: the naive low-precision computation.
        softcap: whether softcap was used (multiplier 3 instead of 2).
        name: what is compared, for the error message.

    Raises:
        AssertionError: with the measured error, the bound and ``name`` when the rule fails
            (including when anything is NaN) or the shapes differ.
    """
    ref = jnp.asarray(ref)
    if not (jnp.shape(out) == ref.shape == jnp.shape(pt)):
        raise AssertionError(
            f"{name}: shapes differ: out {jnp.shape(out)}, ref {ref.shape}, pt {jnp.shape(pt)}"
        )
    ref32 = np.asarray(ref, np.float32)
    atol = 2 * float(np.max(np.abs(np.asarray(ref + 0.3 - 0.3, np.float32) - ref32)))
    err = float(np.max(np.abs(np.asarray(out, np.float32) - ref32)))
    pt_err = float(np.max(np.abs(np.asarray(pt, np.float32) - ref32)))
    mult = 3 if softcap else 2
    bound = mult * pt_err + atol
    if not err <= bound:
        raise AssertionError(
            f"{name}: max|out - ref| = {err:.4g} exceeds the bound {bound:.4g} "
            f"= {mult} * max|pt - ref| ({pt_err:.4g}) + atol ({atol:.4g})"
        )
