"""Lowering a program for CUDA on any machine, with the kernels it asks for recorded, not built.

A program that calls the package's kernels is lowered for the CUDA platform
(``jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))``: the lowering a GPU's jit
runs, without jax.export's serialisation and checks, which the GPU tests do not go through) with
``jax_fa4.ffi.call.kernel_object`` replaced: each kernel's lowering records its (config, arch)
and embeds a placeholder naming it instead of a compiled object, so nothing is compiled and no
GPU or kernel cache is needed. The default device's compute capability
(``backends.gpu_compute_capability``) is set too: None (the default) lowers the program as on a
machine without a GPU, ``"9.0"`` as on a Hopper (where ``implementation=None`` picks sm90).

tests/test_conformance.py lowers the conformance cases this way (every kernel a shipped variant);
tests/test_gpu_suite_kernels.py the GPU suite's calls (every kernel in the ``tests`` suite).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import pytest

from jax_fa4 import backends
from jax_fa4.ffi import call
from jax_fa4.kernels.spec import KernelConfig

#: The custom call every kernel of the package lowers to.
CUSTOM_CALL = "stablehlo.custom_call @CuteDSLRT_NvJaxCutlassCall_v2"


def placeholder(config: KernelConfig, arch: str) -> str:
    """What stands for the object of (config, arch) in a lowered program."""
    return f"lowering placeholder: {arch} {config.describe()}"


class Lowered(NamedTuple):
    kernels: list  # (config, arch) of every kernel object the lowering asked for, in order
    objects: list  # the ``module`` attribute of every kernel custom call in the lowered text


@contextlib.contextmanager
def recording_kernels(compute_capability: str | None = None
                      ) -> Iterator[list[tuple[KernelConfig, str]]]:
    """Within the block, a kernel's lowering appends its (config, arch) to the yielded list and
    embeds :func:`placeholder` as its object; the default device is a GPU of
    ``compute_capability`` (None: no GPU)."""
    kernels: list[tuple[KernelConfig, str]] = []

    def kernel_object(config, arch, cache=None):
        kernels.append((config, arch))
        return placeholder(config, arch).encode()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(call, "kernel_object", kernel_object)
        mp.setattr(backends, "gpu_compute_capability", lambda: compute_capability)
        yield kernels


def custom_call_objects(text: str) -> list[str]:
    """The ``module`` attribute (the object, here a placeholder) of every kernel custom call in
    the lowered module ``text``."""
    return [line.split('module = "', 1)[1].split('"', 1)[0]
            for line in text.splitlines() if CUSTOM_CALL in line]


def lower_for_cuda(program: Callable, *args, compute_capability: str | None = None) -> Lowered:
    """``jax.jit(program)`` lowered for CUDA on ``args`` (arrays or ``jax.ShapeDtypeStruct``)
    within :func:`recording_kernels`. Raises what tracing raises (e.g. the
    ``ImplementationUnavailableError`` of a forced call the backend declines)."""
    with recording_kernels(compute_capability) as kernels:
        text = jax.jit(program).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return Lowered(list(kernels), custom_call_objects(text))


def backward_specs(b: int, sq: int, sk: int, h: int, d: int, dtype=jnp.bfloat16) -> tuple:
    """``Backend.backward``'s array arguments as shapes: q, k, v, out, lse, dout, delta,
    lse_log2 of an MHA call (B, Sq / Sk, H, D)."""
    x = lambda s: jax.ShapeDtypeStruct((b, s, h, d), dtype)  # noqa: E731
    rows = jax.ShapeDtypeStruct((b, h, sq), jnp.float32)
    return x(sq), x(sk), x(sk), x(sq), rows, x(sq), rows, rows
