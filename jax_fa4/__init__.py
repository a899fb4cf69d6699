"""jax-fa4: FlashAttention-4 for JAX.

CuTe-DSL attention kernels for NVIDIA GPUs, called from XLA as FFI custom calls, with a pure-JAX
reference that runs everywhere else.
"""

from jax_fa4.api import AttentionOptions, flash_attention
from jax_fa4.dispatch import ImplementationUnavailableError
from jax_fa4.ffi.runtime import export_disabled_safety_checks

__version__ = "0.1.0"

__all__ = [
    "AttentionOptions",
    "ImplementationUnavailableError",
    "export_disabled_safety_checks",
    "flash_attention",
]
