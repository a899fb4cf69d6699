"""FA4's acceptance rule (jax_fa4/tools/fa4_rule.py): its bound, and the gradients' slack for
cancellation, which must admit rounding noise on near-zero entries and nothing larger."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_fa4.tools.fa4_rule import GRAD_SLACK, fa4_error, grad_scale


def test_bound_is_twice_pt_error_plus_the_rounding_of_0_3():
    ref = jnp.array([0.51, -1.03, 2.07], jnp.bfloat16)
    pt = ref + jnp.array([2 ** -7, 0, 0], jnp.bfloat16)
    e = fa4_error(ref + jnp.array([0, 2 ** -6, 0], jnp.bfloat16), ref, pt)
    assert e.bound == 2 * e.pt_err + e.atol and e.passed
    softcapped = fa4_error(ref, ref, pt, softcap=True)
    assert softcapped.bound == 3 * softcapped.pt_err + softcapped.atol
    assert not fa4_error(ref + jnp.array([0, 0, 2 ** -3], jnp.bfloat16), ref, pt).passed
    assert not fa4_error(jnp.full(3, jnp.nan, jnp.bfloat16), ref, pt).passed


def test_gradient_slack_admits_cancellation_noise_only():
    """A gradient that is exactly 0 in float32 (``ref``), computed as a difference of close
    numbers (``got``: noise of 1e-4), in a case whose largest gradient entry is 8: the rule's
    own atol (float32's, ~6e-8) rejects the noise, the slack ``2⁻¹² · 8`` (~2e-3) admits it;
    an error of a tenth of an entry of size 8 fails with or without the slack."""
    ref = np.zeros(16, np.float32)
    got = np.full(16, 1e-4, np.float32)
    scale = grad_scale(ref, np.array([8.0, -3.0], np.float32), np.zeros(0, np.float32))
    assert scale == 8.0
    assert not fa4_error(got, ref, ref).passed
    e = fa4_error(got, ref, ref, grad_scale=scale)
    assert e.passed and e.atol == GRAD_SLACK * 8.0
    big_ref = np.array([8.0, 1.0], np.float32)
    assert not fa4_error(big_ref + 0.8, big_ref, big_ref, grad_scale=scale).passed
    # the slack only ever raises atol
    assert fa4_error(got, ref, ref, grad_scale=0.0).atol == fa4_error(got, ref, ref).atol
