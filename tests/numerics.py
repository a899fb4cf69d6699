"""FA4's numerical acceptance rule for the test files: :func:`assert_fa4_close`.

The rule itself (``max|out - ref| <= m * max|pt - ref| + atol``, ``ref`` the float32
computation, ``pt`` the naive low-precision one) and its measurement, :func:`fa4_error`, live in
``jax_fa4.tools.fa4_rule``, which the benchmark scripts use too.
Also: :func:`random_qkv`, fresh normal q, k, v of given shapes.
"""

import jax
import jax.numpy as jnp

from jax_fa4.tools.fa4_rule import fa4_error


def random_qkv(b, sq, sk, h, hkv, d, dv=None, dtype=jnp.float32, seed=0):
    """q (b, sq, h, d), k (b, sk, hkv, d), v (b, sk, hkv, dv or d): standard normal, drawn in
    float32 and cast to ``dtype``."""
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (b, sq, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, sk, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, sk, hkv, dv or d), jnp.float32).astype(dtype)
    return q, k, v


def assert_fa4_close(out, ref, pt, *, softcap: bool = False, name: str = "out",
                     grad_scale: float | None = None) -> None:
    """Assert FA4's rule ``max|out - ref| <= m * max|pt - ref| + atol``
    (``jax_fa4.tools.fa4_rule``).

    Args:
        out: the result under test.
        ref: float32 computation from the same inputs (in its output dtype).
        pt: the naive low-precision computation.
        softcap: whether softcap was used (multiplier 3 instead of 2).
        name: what is compared, for the error message.
        grad_scale: for a gradient, the case's largest reference gradient entry
            (``jax_fa4.tools.fa4_rule.grad_scale``): the rule's slack for gradients dominated
            by cancellation.

    Raises:
        AssertionError: with the measured error, the bound and ``name`` when the rule fails
            (including when anything is NaN) or the shapes differ.
    """
    ref = jnp.asarray(ref)
    if not (jnp.shape(out) == ref.shape == jnp.shape(pt)):
        raise AssertionError(
            f"{name}: shapes differ: out {jnp.shape(out)}, ref {ref.shape}, pt {jnp.shape(pt)}"
        )
    e = fa4_error(out, ref, pt, softcap=softcap, grad_scale=grad_scale)
    if not e.passed:
        raise AssertionError(
            f"{name}: max|out - ref| = {e.err:.4g} exceeds the bound {e.bound:.4g} "
            f"= {3 if softcap else 2} * max|pt - ref| ({e.pt_err:.4g}) + atol ({e.atol:.4g})"
        )
