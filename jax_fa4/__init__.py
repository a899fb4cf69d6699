"""jax-fa4: FlashAttention-4 for JAX.

CuTe-DSL attention kernels for NVIDIA GPUs, called from XLA as FFI custom calls, with a pure-JAX
reference that runs everywhere else.
"""

from jax_fa4.api import flash_attention, flash_attention_paged, flash_attention_varlen
from jax_fa4.backends.base import ImplementationUnavailableError
from jax_fa4.ffi.runtime import export_disabled_safety_checks
from jax_fa4.nn import dot_product_attention
from jax_fa4.options import AttentionOptions
from jax_fa4.parallel.ring import ring_attention, unzigzag, zigzag

__version__ = "0.1.0"

__all__ = [
    "AttentionOptions",
    "ImplementationUnavailableError",
    "dot_product_attention",
    "export_disabled_safety_checks",
    "flash_attention",
    "flash_attention_paged",
    "flash_attention_varlen",
    "ring_attention",
    "unzigzag",
    "zigzag",
]


def __getattr__(name: str):
    """``jax_fa4.flax`` (the Flax layers) loads on first use: importing Flax is slow."""
    if name == "flax":
        import importlib

        return importlib.import_module("jax_fa4.flax")
    raise AttributeError(f"module 'jax_fa4' has no attribute {name!r}")
