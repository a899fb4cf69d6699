"""FA4's numerical acceptance rule, shared by the test files.

``ref`` is attention computed in float32 from the same (low-precision) inputs and ``pt`` the
same naive attention computed in the low precision. A result passes when

    max|out - ref| <= m * max|pt - ref| + atol,   atol = 2 * max|(ref + 0.3 - 0.3) - ref|,

with ``m = 2`` (``3`` with softcap). ``atol`` is evaluated in ``ref``'s own dtype, so it is
the rounding granularity of that dtype near 0.3. The same rule applies to dq, dk and dv.
Also: :func:`random_qkv`, fresh normal q, k, v of given shapes.
"""

from typing import NamedTuple

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
    e = fa4_error(out, ref, pt, softcap=softcap)
    if not e.passed:
        raise AssertionError(
            f"{name}: max|out - ref| = {e.err:.4g} exceeds the bound {e.bound:.4g} "
            f"= {3 if softcap else 2} * max|pt - ref| ({e.pt_err:.4g}) + atol ({e.atol:.4g})"
        )


class Fa4Error(NamedTuple):
    """One comparison by FA4's rule: ``passed`` is ``err <= bound`` (False when NaN)."""
    err: float  # max|out - ref|
    bound: float  # m * pt_err + atol
    pt_err: float  # max|pt - ref|
    atol: float

    @property
    def passed(self) -> bool:
        return bool(self.err <= self.bound)


def fa4_error(out, ref, pt, *, softcap: bool = False) -> Fa4Error:
    """FA4's rule (module docstring) measured on same-shaped ``out``, ``ref`` and ``pt``."""
    ref = jnp.asarray(ref)
    ref32 = np.asarray(ref, np.float32)
    atol = 2 * float(np.max(np.abs(np.asarray(ref + 0.3 - 0.3, np.float32) - ref32)))
    err = float(np.max(np.abs(np.asarray(out, np.float32) - ref32)))
    pt_err = float(np.max(np.abs(np.asarray(pt, np.float32) - ref32)))
    return Fa4Error(err, (3 if softcap else 2) * pt_err + atol, pt_err, atol)
