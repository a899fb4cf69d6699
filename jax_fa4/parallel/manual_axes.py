"""Varying manual mesh axes (``shard_map``'s ``check_vma`` types), across JAX versions."""

from __future__ import annotations

import jax
from jax import lax


def varying_axes(x) -> frozenset:
    """The manual mesh axes ``x`` varies over (empty outside ``shard_map``)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # JAX >= 0.10; earlier versions call it vma
    return frozenset(getattr(mat, "varying", None) or getattr(aval, "vma", None) or ())


def vary_like(xs, *refs) -> tuple:
    """``xs`` marked varying over every manual axis some of ``refs`` varies over."""
    axes = frozenset().union(*(varying_axes(r) for r in refs))
    out = []
    for x in xs:
        missing = tuple(sorted(axes - varying_axes(x), key=str))
        out.append(lax.pcast(x, missing, to="varying") if missing else x)
    return tuple(out)
