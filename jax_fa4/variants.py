"""The kernel variants the package ships, by suite: what ``precompile`` builds and CI compiles.

A *variant* is a (kernel config, arch) pair. Families enumerate their configs from the dtypes and
head dims asked for; a suite picks the families and the grid:

* ``tests``: exactly what the GPU test suite runs (small, for the device workflow);
* ``default``: every shipped variant for the common head dims.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from jax_fa4.ffi.compiler import SUPPORTED_ARCHS
from jax_fa4.kernels.exp2_probe_config import Exp2ProbeConfig
from jax_fa4.kernels.preprocess_config import PreprocessConfig
from jax_fa4.kernels.sm90 import bwd_config, fwd_config
from jax_fa4.kernels.sm100 import bwd_config as sm100_bwd_config
from jax_fa4.kernels.sm100 import fwd_config as sm100_fwd_config
from jax_fa4.kernels.spec import FLOAT_DTYPES, KernelConfig

HEAD_DIMS = (64, 96, 128, 192, 256)
SUITES = ("tests", "default")


@dataclass(frozen=True)
class Variant:
    config: KernelConfig
    arch: str

    def describe(self) -> str:
        return f"{self.arch} {self.config.describe()}"


def _preprocess(dtypes: Sequence[str], head_dims: Sequence[int]) -> Iterable[KernelConfig]:
    for dtype in dtypes:
        for dv in head_dims:
            yield PreprocessConfig(dtype, dv)


def _sm90_fwd(dtypes: Sequence[str], head_dims: Sequence[int]) -> Iterable[KernelConfig]:
    for cfg in fwd_config.shipped_configs():
        if cfg.dtype in dtypes and cfg.head_dim in head_dims:
            yield cfg


def _sm90_fwd_tests(dtypes: Sequence[str], head_dims: Sequence[int]) -> Iterable[KernelConfig]:
    yield from _sm90_fwd(dtypes, head_dims)
    yield from fwd_config.fallback_configs()  # the GPU tests cross-check the serial mainloop
    yield from fwd_config.option_test_configs()  # performance options awaiting validation
    yield from fwd_config.decode_option_configs()  # decode-tile options (decode_bench.py)


def _sm90_bwd(dtypes: Sequence[str], head_dims: Sequence[int]) -> Iterable[KernelConfig]:
    for cfg in bwd_config.shipped_configs():
        if cfg.dtype in dtypes and cfg.head_dim in head_dims:
            yield cfg


def _sm90_bwd_tests(dtypes: Sequence[str], head_dims: Sequence[int]) -> Iterable[KernelConfig]:
    for cfg in bwd_config.test_variants():
        if cfg.dtype in dtypes and cfg.head_dim in head_dims:
            yield cfg


def _filtered(configs: Callable[[], Iterable[KernelConfig]]):
    def enumerate_configs(dtypes: Sequence[str], head_dims: Sequence[int]):
        return (c for c in configs() if c.dtype in dtypes and c.head_dim in head_dims)
    return enumerate_configs


def _none(dtypes: Sequence[str], head_dims: Sequence[int]) -> Iterable[KernelConfig]:
    return ()


def _exp2_probe_tests(dtypes: Sequence[str], head_dims: Sequence[int]) -> Iterable[KernelConfig]:
    yield Exp2ProbeConfig(packed=False)  # the f32x2 form does not lower for sm_90a


#: family name -> (archs it is shipped for, config enumerator, the tests suite's enumerator)
FAMILIES: dict[str, tuple[tuple[str, ...], Callable[..., Iterable[KernelConfig]],
                          Callable[..., Iterable[KernelConfig]]]] = {
    "bwd_preprocess": (SUPPORTED_ARCHS, _preprocess, _preprocess),
    "sm90_fwd": (("sm_90a",), _sm90_fwd, _sm90_fwd_tests),
    "sm90_bwd": (("sm_90a",), _sm90_bwd, _sm90_bwd_tests),
    # Blackwell kernels are compiled and inspected here but cannot run on any GPU we have, so
    # the GPU test suite needs none of them.
    "sm100_fwd": (("sm_100a",), _filtered(sm100_fwd_config.shipped_configs), _none),
    "sm100_bwd": (("sm_100a",), _filtered(sm100_bwd_config.shipped_configs), _none),
    # Test-only: runs the arch-independent software exp2 (common/exp2.py) on the H200
    # (tests/gpu/test_exp2_device.py); never shipped.
    "exp2_probe": (("sm_90a",), _none, _exp2_probe_tests),
}

#: what the GPU tests need: (dtypes, head dims) per suite
_SUITE_GRID = {
    "tests": (FLOAT_DTYPES, HEAD_DIMS),
    "default": (FLOAT_DTYPES, HEAD_DIMS),
}


def variants(suite: str = "default", *, archs: Sequence[str] | None = None,
             dtypes: Sequence[str] | None = None, head_dims: Sequence[int] | None = None,
             families: Sequence[str] | None = None) -> list[Variant]:
    """The variants of ``suite``, optionally narrowed to some archs, dtypes, head dims, families."""
    if suite not in SUITES:
        raise ValueError(f"suite must be one of {SUITES}, got {suite!r}")
    suite_dtypes, suite_dims = _SUITE_GRID[suite]
    dtypes = tuple(dtypes or suite_dtypes)
    head_dims = tuple(head_dims or suite_dims)
    for name in families or ():
        if name not in FAMILIES:
            raise ValueError(f"unknown kernel family {name!r}; known: {sorted(FAMILIES)}")
    for arch in archs or ():
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(f"arch must be one of {SUPPORTED_ARCHS}, got {arch!r}")
    out: list[Variant] = []
    for name, (family_archs, shipped, for_tests) in FAMILIES.items():
        if families and name not in families:
            continue
        enumerate_configs = for_tests if suite == "tests" else shipped
        configs = list(dict.fromkeys(enumerate_configs(dtypes, head_dims)))
        for arch in family_archs:
            if archs and arch not in archs:
                continue
            out.extend(Variant(c, arch) for c in configs)
    return out
