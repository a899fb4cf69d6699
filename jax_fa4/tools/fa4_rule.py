"""FA4's numerical acceptance rule, shared by the test suite and the benchmark scripts.

``ref`` is attention computed in float32 from the same (low-precision) inputs and ``pt`` the
same naive attention computed in the low precision. A result passes when

    max|out - ref| <= m * max|pt - ref| + atol,   atol = 2 * max|(ref + 0.3 - 0.3) - ref|,

with ``m = 2`` (``3`` with softcap). ``atol`` is evaluated in ``ref``'s own dtype, so it is
the rounding granularity of that dtype near 0.3. The same rule applies to dq, dk and dv.
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


def fa4_error(out, ref, pt, *, softcap: bool = False) -> Fa4Error:
    """FA4's rule (module docstring) measured on same-shaped ``out``, ``ref`` and ``pt``."""
    ref = jnp.asarray(ref)
    ref32 = np.asarray(ref, np.float32)
    atol = 2 * float(np.max(np.abs(np.asarray(ref + 0.3 - 0.3, np.float32) - ref32)))
    err = float(np.max(np.abs(np.asarray(out, np.float32) - ref32)))
    pt_err = float(np.max(np.abs(np.asarray(pt, np.float32) - ref32)))
    return Fa4Error(err, (3 if softcap else 2) * pt_err + atol, pt_err, atol)
