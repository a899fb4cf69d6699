"""Forward-kernel signatures the GPU families share beyond :mod:`jax_fa4.kernels.spec`'s dense,
paged and varlen ones (a config module: importable without the compiler, no kernel imports).
"""

from __future__ import annotations

import dataclasses

from jax_fa4.kernels.spec import KernelSignature


def with_max_logits(sig: KernelSignature) -> KernelSignature:
    """``sig`` (a dense or segment-id forward's) with a third output after lse: max_logits
    (B, H, Sq) float32, each row's largest visible score (the configs' ``max_logits`` field)."""
    lse = next(arg for arg in sig.outputs if arg.name == "lse")
    return dataclasses.replace(
        sig, outputs=sig.outputs + (dataclasses.replace(lse, name="max_logits"),))
