"""FA4's numerical acceptance rule, shared by the test suite and the benchmark scripts.

``ref`` is attention computed in float32 from the same (low-precision) inputs and ``pt`` the
same naive attention computed in the low precision. A result passes when

    max|out - ref| <= m * max|pt - ref| + atol,   atol = 2 * max|(ref + 0.3 - 0.3) - ref|,

with ``m = 2`` (``3`` with softcap). ``atol`` is evaluated in ``ref``'s own dtype, so it is
the rounding granularity of that dtype near 0.3. The same rule applies to dq, dk and dv.

Gradients whose exact value is 0 or dominated by cancellation (e.g. dk of a row that sees one
key beside a sink: ``dS = P·(dP − delta)`` is a small difference of close numbers, and delta
comes from the 16-bit output) take an absolute slack relative to the case:
``atol = max(atol, GRAD_SLACK · grad_scale)``, ``GRAD_SLACK = 2⁻¹²`` and ``grad_scale`` the
largest ``|entry|`` of the case's reference dq, dk and dv together (d sink, a sum over every
row: its own largest entry). It is 16 times finer than a bfloat16 ulp of that largest entry, so
it admits the rounding noise of near-zero entries and nothing of the size of a real error of
the large ones.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np


class Fa4Error(NamedTuple):
    """One comparison by FA4's rule: ``passed`` is ``err <= bound`` (False when NaN)."""
    err: float  # max|out - ref|
    bound: float  # m * pt_err + atol
    pt_err: float  # max|pt - ref|
    atol: float

    @property
    def passed(self) -> bool:
        return bool(self.err <= self.bound)


#: A gradient's absolute slack, relative to the case's largest reference gradient entry.
GRAD_SLACK = 2.0 ** -12


def grad_scale(*ref_grads) -> float:
    """The largest ``|entry|`` of a case's reference gradients (``fa4_error``'s ``grad_scale``)."""
    return max((float(np.max(np.abs(np.asarray(g, np.float32)))) for g in ref_grads
                if np.size(g)), default=0.0)


def fa4_error(out, ref, pt, *, softcap: bool = False, grad_scale: float | None = None
              ) -> Fa4Error:
    """FA4's rule (module docstring) measured on same-shaped ``out``, ``ref`` and ``pt``;
    ``grad_scale`` (gradients only): the case's largest reference gradient entry, which sets
    the slack of a gradient dominated by cancellation."""
    ref = jnp.asarray(ref)
    ref32 = np.asarray(ref, np.float32)
    atol = 2 * float(np.max(np.abs(np.asarray(ref + 0.3 - 0.3, np.float32) - ref32)))
    if grad_scale is not None:
        atol = max(atol, GRAD_SLACK * grad_scale)
    err = float(np.max(np.abs(np.asarray(out, np.float32) - ref32)))
    pt_err = float(np.max(np.abs(np.asarray(pt, np.float32) - ref32)))
    return Fa4Error(err, (3 if softcap else 2) * pt_err + atol, pt_err, atol)
