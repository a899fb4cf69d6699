"""The kernel variants the package ships, by suite: what ``precompile`` builds and CI compiles.

A *variant* is a (kernel config, arch) pair. Families enumerate their configs from the dtypes and
head dims asked for; a suite picks the families and the grid:

* ``tests``: exactly what the GPU test suite runs (small, for the device workflow);
* ``default``: every shipped variant for the common head dims.

:func:`representative` picks, by a fixed rule, the few variants of a set that the quick test
tier compiles and SASS-checks in place of all of them (see its docstring).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass

from jax_fa4.ffi.compiler import SUPPORTED_ARCHS
from jax_fa4.kernels.exp2_probe_config import Exp2ProbeConfig
from jax_fa4.kernels.preprocess_config import PreprocessConfig
from jax_fa4.kernels.sm90 import bwd_config, fwd_config
from jax_fa4.kernels.sm90.bwd_config import BwdConfig, with_swap_sdp, without_swap_sdp
from jax_fa4.kernels.sm90.bwd_pair_config import BwdPairConfig
from jax_fa4.kernels.sm90.fwd_config import FP8_DTYPE, FwdConfig
from jax_fa4.kernels.sm100 import bwd_config as sm100_bwd_config
from jax_fa4.kernels.sm100 import bwd_split_config as sm100_bwd_split_config
from jax_fa4.kernels.sm100 import fwd_config as sm100_fwd_config
from jax_fa4.kernels.spec import FLOAT_DTYPES, MASK_KINDS, KernelConfig

HEAD_DIMS = (64, 96, 128, 192, 256)
SUITES = ("tests", "default")


@dataclass(frozen=True)
class Variant:
    config: KernelConfig
    arch: str

    def describe(self) -> str:
        return f"{self.arch} {self.config.describe()}"


def _preprocess(dtypes: Sequence[str], head_dims: Sequence[int]) -> Iterable[KernelConfig]:
    for dtype in (d for d in dtypes if d in FLOAT_DTYPES):  # (no FP8 backward)
        for dv in head_dims:
            for zero_dq_accum in (False, True):  # (True: the dense backward's)
                yield PreprocessConfig(dtype, dv, zero_dq_accum)


def _sm90_fwd(dtypes: Sequence[str], head_dims: Sequence[int]) -> Iterable[KernelConfig]:
    for cfg in fwd_config.shipped_configs():
        if cfg.dtype in dtypes and cfg.head_dim in head_dims:
            yield cfg


# -- test-only configs: what the tests compile and run beyond the shipped set -------------------
# (kept here, outside the kernel config modules: they are in no product dispatch, and editing them
# rekeys no kernel)
def sm90_fwd_fallback_configs() -> list[FwdConfig]:
    """The simpler serial mainloop (no intra-warpgroup overlap) at hdim 128 bf16: a cross-check
    for the GPU tests, and a fallback should the overlapped mainloop misbehave."""
    return [FwdConfig.make("bfloat16", 128, 128, mask, softcap, intra_wg_overlap=False)
            for mask in MASK_KINDS for softcap in (False, True)]


def sm90_fwd_option_configs() -> list[FwdConfig]:
    """Representative configs of the v2 tuning options (some are table defaults now): ping-pong,
    3 consumer warpgroups at hdim 64 (tile 192×128, 3-way ping-pong), conditional rescaling, a
    wider key tile at hdim 128, ping-pong at hdim 192/256, persistent scheduling (static and
    with dynamic tiles: O in its own buffer and in Q's, with and without ping-pong). The compile
    test checks their SASS and the GPU tests (tests/gpu/test_sm90_fwd.py) run them against the
    reference: precompile them for it."""
    m = FwdConfig.make
    return [
        m("bfloat16", 64, 64, "none", tile_m=192),
        m("bfloat16", 64, 64, "causal", tile_m=192, pingpong=True, rescale_threshold=8.0),
        m("bfloat16", 64, 64, "local", True, tile_m=192, pingpong=True),
        m("bfloat16", 64, 64, "none", pingpong=True),
        m("bfloat16", 128, 128, "none", rescale_threshold=8.0),
        m("bfloat16", 128, 128, "causal", pingpong=True),
        m("bfloat16", 128, 128, "none", pingpong=True, rescale_threshold=8.0),
        m("bfloat16", 128, 128, "local", pingpong=True, rescale_threshold=8.0),
        m("bfloat16", 128, 128, "causal", pingpong=True, tile_n=176),
        m("float16", 128, 128, "causal", True, pingpong=True, rescale_threshold=8.0),
        m("bfloat16", 192, 128, "causal", pingpong=True),
        m("bfloat16", 192, 192, "none", pingpong=True),
        m("bfloat16", 256, 256, "none", pingpong=True),
        m("bfloat16", 256, 256, "causal", pingpong=True, rescale_threshold=8.0),
        # persistent: few CTAs (odd counts) so each loops over many tiles in the tests' shapes
        m("bfloat16", 128, 128, "causal", pingpong=True, num_sms=7),
        m("bfloat16", 64, 64, "none", tile_m=192, pingpong=True, rescale_threshold=8.0, num_sms=5),
        m("bfloat16", 128, 128, "local", intra_wg_overlap=False, num_sms=3),
        m("bfloat16", 256, 256, "causal", pingpong=True, num_sms=132),
        m("bfloat16", 128, 128, "causal", pingpong=True, num_sms=7, dynamic_tiles=True),
        m("bfloat16", 64, 64, "none", tile_m=192, pingpong=True, rescale_threshold=8.0, num_sms=5,
          dynamic_tiles=True),
        m("bfloat16", 128, 128, "local", intra_wg_overlap=False, num_sms=3, dynamic_tiles=True),
        m("bfloat16", 256, 256, "causal", pingpong=True, num_sms=132, dynamic_tiles=True),
    ]


def persistent_segments(cfg: FwdConfig, num_sms: int = 132, dynamic: bool = True) -> FwdConfig:
    """A segment-id forward config (fwd_config.segments_config's) on the persistent grid of
    ``num_sms`` CTAs, with dynamic tiles or not: the form no table row takes until a
    same-process A/B picks it (``benchmarks/segments_bench.py``)."""
    out = dataclasses.replace(cfg, num_sms=num_sms, dynamic_tiles=dynamic)
    out.validate()
    return out


def sm90_fwd_segments_persistent_configs() -> list[FwdConfig]:
    """The persistent segment-id forwards the GPU tests run (tests/gpu/test_segments.py's
    ``persistent`` cases: few CTAs, so each loops over many tiles, static and dynamic, and the
    132-CTA dynamic form the benchmark times) and the compile test checks."""
    seg = fwd_config.segments_config
    return [
        persistent_segments(seg("bfloat16", 128, 128, "causal"), 7, dynamic=False),
        persistent_segments(seg("bfloat16", 128, 128, "causal"), 7),
        persistent_segments(seg("bfloat16", 64, 64, "none"), 5),
        persistent_segments(seg("bfloat16", 128, 128, "local", True), 3, dynamic=False),
        # the benchmark's shapes (segments_bench.py): head dims 128 and 64, causal and not
        *(persistent_segments(seg("bfloat16", d, d, mask)) for d in (128, 64)
          for mask in ("none", "causal")),
    ]


#: (dtype, head_dim, head_dim_v, mask, softcap, gqa) of the cases in tests/gpu/test_sm90_bwd.py
SM90_BWD_GPU_MAINS = (
    [("bfloat16", 128, 128, m, cap, False) for m in MASK_KINDS for cap in (False, True)]
    + [("bfloat16", 128, 128, "none", False, True), ("bfloat16", 128, 128, "causal", False, True),
       ("bfloat16", 128, 128, "causal", True, True)]
    + [("float16", 128, 128, m, False, False) for m in MASK_KINDS]
    + [("float16", 128, 128, "none", True, False)]
    + [("bfloat16", 64, 64, m, False, False) for m in MASK_KINDS]
    + [("bfloat16", 64, 64, "none", False, True)]
    + [("bfloat16", 96, 96, "none", False, False), ("bfloat16", 96, 96, "local", False, False),
       ("bfloat16", 96, 96, "causal", False, True)]
    + [("bfloat16", 192, 128, "none", False, False), ("bfloat16", 192, 128, "causal", False, False),
       ("bfloat16", 192, 128, "local", False, True)]
    + [("bfloat16", 256, 256, "none", False, False), ("bfloat16", 256, 256, "causal", False, False),
       ("bfloat16", 256, 256, "local", False, True)]
    + [("float16", 256, 256, "none", False, False)]
)

#: deterministic (ordered dQ) variants the GPU test runs: MHA and GQA, every mask kind
SM90_BWD_GPU_DETERMINISTIC = [
    ("bfloat16", 128, 128, "causal", False, False), ("bfloat16", 128, 128, "none", False, True),
    ("bfloat16", 64, 64, "local", False, False), ("bfloat16", 256, 256, "causal", False, False),
]

#: the problems whose OPT_IN_FORMS the GPU test runs (forms the tuning table may not pick)
SM90_BWD_GPU_SWAP = [
    ("bfloat16", 128, 128, "none", False, False), ("bfloat16", 128, 128, "causal", False, False),
    ("bfloat16", 128, 128, "none", False, True), ("bfloat16", 96, 96, "local", False, False),
    ("float16", 128, 128, "none", False, False),
]

#: The forms of a table kernel that tests/gpu/test_sm90_bwd.py checks against the reference on
#: the SM90_BWD_GPU_SWAP problems, whatever the table picks (name -> config transform): the
#: transposed S / dP loop and the statistics through shared memory, each alone and together
#: (dQ through the dQ warp), the table's kernel with dQ added by the MMA threads (dq_red), the
#: table's kernel with one CTA per kv head walking its group's query heads (group_heads, which
#: no tuning row picks before it has run on a GPU), the table's kernel with its operand
#: descriptors from warpgroup slices (wg_fragments), and that with row statistics padded past
#: Sq where it reads them through shared memory (stats_padded; both in some rows now). The
#: loop forms keep their statistics unpadded (as they were measured).
OPT_IN_FORMS: dict[str, Callable[[BwdConfig], BwdConfig]] = {
    "swap": lambda cfg: dataclasses.replace(with_swap_sdp(cfg), stats_smem=False,
                                            stats_padded=False, dq_red=False),
    "stats": lambda cfg: dataclasses.replace(without_swap_sdp(cfg), stats_smem=True,
                                             stats_padded=False, dq_red=False),
    "swap+stats": lambda cfg: dataclasses.replace(with_swap_sdp(cfg), stats_smem=True,
                                                  stats_padded=False, dq_red=False),
    "red": lambda cfg: dataclasses.replace(cfg, dq_red=True),
    "group": lambda cfg: dataclasses.replace(cfg, gqa=False, group_heads=True),
    "wgfrag": lambda cfg: dataclasses.replace(cfg, wg_fragments=True),
    "wgfrag+pad": lambda cfg: dataclasses.replace(cfg, wg_fragments=True,
                                                  stats_padded=cfg.stats_smem),
}


def sm90_bwd_d192_candidates() -> list[BwdConfig]:
    """Head dims 192/192: backward kernels that compile without spills but have not run on a GPU,
    so the tuning table has no row for them and the API runs the reference's backward there.
    The 192/128 row's tile and depths (64×64, 2 Q/dO stages, 2 P/dS buffers, reversed launch),
    MHA and GQA, every mask kind, dQ through the dQ warp and added by the MMA threads (dq_red):
    tests/gpu/test_sm90_bwd.py runs them against the reference, the first step to a table row."""
    out = []
    for mask, gqa, dq_red in itertools.product(MASK_KINDS, (False, True), (False, True)):
        cfg = BwdConfig(dtype="bfloat16", head_dim=192, head_dim_v=192, mask=mask, gqa=gqa,
                        tile_m=64, tile_n=64, stages=2, pds_stages=2, reverse_launch=True,
                        dq_red=dq_red)
        cfg.validate()
        out.append(cfg)
    return out


#: (dtype, head_dim, head_dim_v, mask, softcap, gqa) of the problems whose split-operand pair
#: (BwdPairConfig, not picked by the tuning table until it has run and been timed) the GPU test
#: runs against the reference: tests/gpu/test_sm90_bwd.py::test_pair_kernel_matches_reference
SM90_BWD_GPU_PAIR = (
    [("bfloat16", 256, 256, m, False, gqa) for m in MASK_KINDS for gqa in (False, True)]
    + [("bfloat16", 256, 256, "none", True, False), ("float16", 256, 256, "causal", False, False),
       ("bfloat16", 128, 128, "none", False, False), ("bfloat16", 128, 128, "causal", False, True),
       ("bfloat16", 192, 128, "causal", False, False), ("bfloat16", 192, 128, "none", False, True),
       ("bfloat16", 192, 128, "local", False, False)]
)


def sm90_bwd_pair_candidates() -> list[BwdPairConfig]:
    """The split-operand pair configs of SM90_BWD_GPU_PAIR (2 Q / dO stages, 2 P / dS exchange
    buffers), without and with lookahead; GQA problems also in their group_heads form."""
    return [BwdPairConfig.of(BwdConfig.make(*v), lookahead=la, group_heads=grouped)
            for la in (False, True) for v in SM90_BWD_GPU_PAIR
            for grouped in ((False, True) if v[5] else (False,))]


def _with_postprocess(mains: Iterable[BwdConfig]) -> list[KernelConfig]:
    """``mains``, then each one's dQ postprocess config once."""
    mains = list(mains)
    return [*mains, *dict.fromkeys(c.postprocess_config() for c in mains)]


def sm90_bwd_gpu_configs() -> list[KernelConfig]:
    """The configs tests/gpu/test_sm90_bwd.py runs (main kernels, then their postprocesses);
    that test checks it needs nothing else."""
    mains = [BwdConfig.make(*v) for v in SM90_BWD_GPU_MAINS]
    mains += [BwdConfig.make(*v, deterministic=True) for v in SM90_BWD_GPU_DETERMINISTIC]
    for form in OPT_IN_FORMS.values():
        mains += [form(BwdConfig.make(*v)) for v in SM90_BWD_GPU_SWAP]
    mains += sm90_bwd_d192_candidates()
    mains += sm90_bwd_pair_candidates()
    for cfg in mains:
        cfg.validate()
    return _with_postprocess(mains)


def _sm90_fwd_tests(dtypes: Sequence[str], head_dims: Sequence[int]) -> Iterable[KernelConfig]:
    yield from _sm90_fwd(dtypes, head_dims)
    yield from sm90_fwd_fallback_configs()  # the GPU tests cross-check the serial mainloop
    yield from sm90_fwd_option_configs()  # performance options awaiting validation
    yield from sm90_fwd_segments_persistent_configs()  # (likewise)
    for cfg in fwd_config.decode_option_configs():  # decode-tile options (decode_bench.py),
        yield cfg  # in both out dtypes (split-KV chunks and sinks come back in float32)
        yield dataclasses.replace(cfg, out_f32=True)


def _sm90_bwd(dtypes: Sequence[str], head_dims: Sequence[int]) -> Iterable[KernelConfig]:
    for cfg in bwd_config.shipped_configs():
        if cfg.dtype in dtypes and cfg.head_dim in head_dims:
            yield cfg


#: The backward problem kinds that the GPU tests' calls through the API reach, by test module.
#: The GPU suite runs on a cache of only the tests suite (README, "Development"), where a kernel
#: missing fails its test with KernelNotAvailableError (JAX_FA4_REQUIRE_GPU=1). Kinds, not
#: configs: :func:`backward_kind_config` turns each into the main kernel the sm90 backend picks
#: for it (BwdConfig.make, varlen_config, segments_config: the tuning table's choice), so a tuning
#: change moves them with the product. Each entry is exactly what its module's calls reach:
#: tests/test_gpu_suite_kernels.py lowers those calls for CUDA (each extreme-numerics case at its
#: dtype, the case lists, runners' parameters, the sanitizer groups, ...) and fails on a kind
#: missing here or listed but reached no more, naming it. test_properties.py: its explicit
#: examples (the drawn cases range over every shipped bfloat16 kernel, all of which the tests
#: suite holds: _sm90_bwd_tests). Listed here, outside
#: every kernel's import closure: editing the table rekeys nothing.
#: Notation: ``"<bf16|fp16> <head dim>[/<head dim v>] <none|causal|local> [softcap] [gqa] [sink]
#: [det|segments|varlen]"`` (gqa: fewer kv heads than query heads; sink: a learnable sink, the
#: sink_grad kernel; det: deterministic=True; segments: segment ids; varlen: packed sequences).
GPU_API_BACKWARD: dict[str, tuple[str, ...]] = {
    "tests/gpu/test_extreme_numerics.py": (
        "bf16 128 none gqa", "bf16 128 none gqa sink", "bf16 128 none softcap gqa",
        "bf16 128 none softcap gqa sink", "bf16 128 causal gqa", "bf16 128 causal gqa sink",
        "bf16 128 local gqa", "bf16 128 local softcap gqa sink", "fp16 128 none gqa",
        "fp16 128 causal gqa", "fp16 128 causal gqa sink", "fp16 128 causal softcap gqa",
        "fp16 128 local gqa", "fp16 128 local softcap gqa", "bf16 128 none gqa segments",
        "bf16 128 causal gqa sink segments", "bf16 128 none gqa varlen",
        "bf16 128 causal gqa varlen", "bf16 128 causal gqa sink varlen",
        "fp16 128 local softcap gqa varlen",
    ),
    "tests/gpu/test_padding_isolation.py": (
        "bf16 64 none varlen", "bf16 64 causal varlen", "bf16 128 none gqa varlen",
        "bf16 128 causal gqa varlen", "bf16 128 causal gqa sink varlen", "bf16 256 causal varlen",
    ),
    "tests/gpu/test_properties.py": (
        "bf16 64 none gqa", "bf16 128 causal gqa sink", "bf16 128 local softcap sink varlen",
    ),
    "tests/gpu/test_varlen.py": (
        "bf16 64 none varlen", "bf16 64 causal varlen", "bf16 96 none varlen",
        "bf16 128 none varlen", "bf16 128 none gqa varlen", "bf16 128 causal varlen",
        "bf16 128 causal gqa varlen", "bf16 128 local gqa varlen",
        "bf16 192/128 causal gqa varlen", "bf16 256 causal varlen",
        "fp16 128 local softcap varlen",
    ),
    "tests/gpu/test_single_rounding.py": (
        "bf16 64 none sink", "bf16 64 none gqa sink", "bf16 64 causal gqa sink",
        "bf16 64 local sink", "bf16 192/128 none gqa sink", "bf16 192/128 local softcap gqa sink",
        "bf16 256 causal gqa sink", "bf16 256 local sink", "bf16 128 none gqa sink varlen",
        "bf16 256 none gqa sink varlen", "bf16 256 causal gqa sink varlen",
    ),
    "tests/gpu/test_segments.py": (
        "bf16 128 causal gqa segments", "bf16 128 causal gqa sink segments",
    ),
    "tests/gpu/sanitizer_cases.py": (
        "bf16 64 none", "bf16 64 causal gqa", "bf16 96 local", "bf16 128 none",
        "bf16 128 causal gqa", "bf16 128 local softcap", "bf16 192/128 causal",
        "bf16 256 none softcap", "bf16 256 causal", "bf16 64 none softcap segments",
        "bf16 96 local segments", "bf16 128 causal gqa sink segments", "bf16 128 none varlen",
        "bf16 128 causal varlen", "bf16 128 causal gqa varlen",
        "bf16 128 local softcap gqa varlen",
    ),
    "tests/gpu/test_sm90_bwd.py": (
        "bf16 128 none gqa", "bf16 128 none gqa sink", "bf16 128 causal gqa",
        "bf16 128 causal gqa sink", "bf16 64 causal det",
    ),
    "tests/gpu/test_preprocess.py": (
        "bf16 128 none gqa", "bf16 128 causal gqa", "bf16 128 causal gqa det",
    ),
    "tests/gpu/test_max_logits.py": (
        "bf16 128 causal gqa det",
    ),
}

#: The backward kinds that tests/gpu/test_conformance.py reaches through the conformance cases
#: (tests/conformance.py) and no module of GPU_API_BACKWARD holds. tests/test_conformance.py
#: checks both ways: the ``tests`` suite holds every kernel of the cases, and each kind listed
#: here is one a case reaches.
GPU_CONFORMANCE_BACKWARD: tuple[str, ...] = ("fp16 64 none segments",
                                                 "fp16 192/128 none varlen")

_SHORT_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
_KIND_FLAGS = ("softcap", "gqa", "sink", "det", "segments", "varlen")


def backward_kind_config(kind: str) -> BwdConfig:
    """The sm90 backward main kernel of a problem kind in GPU_API_BACKWARD's notation: what the
    backend picks for it (dense, deterministic, segment-id and varlen calls alike)."""
    words = kind.split()
    if len(words) < 3 or words[0] not in _SHORT_DTYPES or not set(words[3:]) <= set(_KIND_FLAGS):
        raise ValueError(f"not a backward kind: {kind!r}")
    dims = [int(x) for x in words[1].split("/")]
    flags = set(words[3:])
    problem = (_SHORT_DTYPES[words[0]], dims[0], dims[-1], words[2], "softcap" in flags,
               "gqa" in flags)
    sink = "sink" in flags
    if "varlen" in flags:
        return bwd_config.varlen_config(*problem, sink_grad=sink)
    if "segments" in flags:
        return bwd_config.segments_config(*problem, sink_grad=sink)
    return BwdConfig.make(*problem, deterministic="det" in flags, sink_grad=sink)


def backward_kind(config: BwdConfig) -> str:
    """The problem kind of an sm90 backward main config, in GPU_API_BACKWARD's notation."""
    short = {v: k for k, v in _SHORT_DTYPES.items()}[config.dtype]
    dims = (str(config.head_dim) if config.head_dim == config.head_dim_v
            else f"{config.head_dim}/{config.head_dim_v}")
    on = {"softcap": config.has_softcap, "gqa": config.gqa, "sink": config.sink_grad,
          "det": config.deterministic, "segments": config.segments, "varlen": config.varlen}
    return " ".join([short, dims, config.mask, *(f for f in _KIND_FLAGS if on[f])])


def _sm90_bwd_tests(dtypes: Sequence[str], head_dims: Sequence[int]) -> Iterable[KernelConfig]:
    kinds = dict.fromkeys([*(k for module in GPU_API_BACKWARD.values() for k in module),
                           *GPU_CONFORMANCE_BACKWARD])
    mains = [backward_kind_config(k) for k in kinds]
    extra = [*mains, *(c.postprocess_config() for c in mains)]
    # the Hypothesis property tests (tests/gpu/test_properties.py) draw bfloat16 problems of
    # every kind: every shipped bfloat16 backward
    drawn = _sm90_bwd(("bfloat16",), head_dims)
    for cfg in dict.fromkeys([*sm90_bwd_gpu_configs(), *extra, *drawn]):
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
    # the backward at head dims 192/192 and 256: a dK/dV and a dQ kernel (bwd_split_config.py)
    "sm100_bwd_split": (("sm_100a",), _filtered(sm100_bwd_split_config.shipped_configs), _none),
    # Test-only: runs the arch-independent software exp2 (common/exp2.py) on the H200
    # (tests/gpu/test_exp2_device.py); never shipped.
    "exp2_probe": (("sm_90a",), _none, _exp2_probe_tests),
}

#: Instructions (SASS opcode prefixes) every variant of a kernel kind must contain: the tensor
#: cores and TMA it is built on (``precompile --check`` and the compile tests check them; see
#: :func:`required_sass` for what depends on the config).
REQUIRED_SASS: dict[str, tuple[str, ...]] = {
    "bwd_preprocess": (),
    "sm90_fwd": ("HGMMA", "UTMALDG", "MUFU.EX2"),
    "sm90_bwd": ("HGMMA", "UTMALDG", "MUFU.EX2"),
    # the pair: dQ from the MMA registers, dP − delta by st.async, P / dS by one bulk copy
    "sm90_bwd_pair": ("HGMMA", "UTMALDG", "MUFU.EX2", "REDG.E.ADD.F32x4", "STAS", "UBLKCP"),
    "sm90_bwd_postprocess": (),
    "sm100_fwd": ("UTCHMMA", "UTCBAR", "LDTM", "UTCATOMSWS", "UTMALDG", "MUFU.EX2"),
    "sm100_bwd": ("UTCHMMA", "UTCBAR", "LDTM", "STTM", "UTCATOMSWS", "UTMALDG", "UTMAREDG"),
    "sm100_bwd_split": ("UTCHMMA", "UTCBAR", "LDTM", "STTM", "UTCATOMSWS", "UTMALDG",
                        "MUFU.EX2"),
    "exp2_probe": (),
}

def required_sass(config: KernelConfig) -> tuple[str, ...]:
    """REQUIRED_SASS of ``config``'s kind, plus what its options imply: the sm90 backward's dQ
    reduce-add, a bulk copy from shared memory (UBLKRED) or with ``dq_red`` the MMA threads'
    vector reductions (REDG ... F32x4); a float32-out forward's 8-byte stores from registers
    (STG.E.64: the accumulators' column pairs, not one float at a time); a forward with dynamic
    tiles, the global atomic add that claims them (ATOMG.E.ADD)."""
    need = REQUIRED_SASS.get(config.kernel_name, ())
    if config.kernel_name == "sm90_bwd":
        need += ("REDG.E.ADD.F32x4",) if config.dq_red else ("UBLKRED",)
    if getattr(config, "out_f32", False):
        need += ("STG.E.64",)
    if getattr(config, "dynamic_tiles", False):
        need += ("ATOMG.E.ADD",)
    if getattr(config, "fp8", False):  # e4m3 WGMMAs are QGMMA, not HGMMA
        need = tuple("QGMMA" if x == "HGMMA" else x for x in need)
    return need


#: what the GPU tests need: (dtypes, head dims) per suite
_SUITE_GRID = {
    "tests": (FLOAT_DTYPES + (FP8_DTYPE,), HEAD_DIMS),
    "default": (FLOAT_DTYPES + (FP8_DTYPE,), HEAD_DIMS),
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


#: Config flags that make a mode, in precedence order (a paged decode tile counts as paged).
_MODE_FLAGS = (("paged", "paged"), ("qo_head_major", "decode"), ("varlen", "varlen"),
               ("deterministic", "deterministic"))


def variant_mode(config: KernelConfig) -> str:
    """``"paged"``, ``"decode"`` (a head-major decode tile), ``"varlen"``, ``"deterministic"``
    or ``"dense"``: the first of the config's mode flags that is set."""
    for field, mode in _MODE_FLAGS:
        if getattr(config, field, False):
            return mode
    return "dense"


def head_dim_class(config: KernelConfig) -> str:
    """``"128"``, or ``"192/128"`` when the value head dim differs from the query/key one."""
    d, dv = getattr(config, "head_dim", None), getattr(config, "head_dim_v", None)
    if d is not None and dv is not None and d != dv:
        return f"{d}/{dv}"
    return str(d if d is not None else dv)


def variant_class(variant: Variant) -> tuple[str, str, str, str]:
    """(arch, kernel kind, head-dim class, mode): the classes :func:`representative` covers."""
    config = variant.config
    return variant.arch, config.kernel_name, head_dim_class(config), variant_mode(config)


def family_mode_class(variant: Variant) -> tuple[str, str, str]:
    """(arch, kernel kind, mode): the classes of the quick test tier, one compile each, so a
    new kernel family or mode adds one kernel per arch to it, a new option or head dim none."""
    return variant.arch, variant.config.kernel_name, variant_mode(variant.config)


def variant_features(variant: Variant) -> frozenset[tuple[str, object]]:
    """(field, value) of every config field but the head dims (those make the class)."""
    config = variant.config
    return frozenset((f.name, getattr(config, f.name)) for f in dataclasses.fields(config)
                     if f.name not in ("head_dim", "head_dim_v"))


def representative(selected: Sequence[Variant], prefer: Collection[Variant] = (), *,
                   every_value: bool = True,
                   classes: Callable[[Variant], Hashable] = variant_class) -> list[Variant]:
    """A small subset of ``selected`` that still exercises every kernel family's code paths.

    The rule (deterministic, in ``selected``'s order):

    1. one variant of every class of ``classes`` (by default :func:`variant_class`: arch ×
       kernel kind × head-dim class × mode: dense, varlen, paged, decode, deterministic;
       the quick test tier passes :func:`family_mode_class`), the one that adds the most
       (field, value) pairs of its config not yet covered within its (arch, kernel kind),
       a variant of ``prefer`` (already compiled elsewhere) winning over any other;
    2. then, per (arch, kernel kind), more variants until every value that any config field
       takes in ``selected`` (dtype, mask, softcap, GQA, tile shapes, options...) appears in at
       least one chosen variant: each time the one that covers the most missing pairs.

    So a change that breaks one head dim, one mode, or one value of any option of a family breaks
    a chosen variant, while the set stays ~8 % of the shipped one. ``every_value=False`` stops
    after step 1 (one variant per class): with ``classes=family_mode_class`` that is the quick
    test tier's sample: one kernel per arch × kind × mode, each adding the most option values
    not yet covered.
    """
    prefer = set(prefer)
    by_kind: dict[tuple[str, str], list[Variant]] = {}
    for v in dict.fromkeys(selected):
        by_kind.setdefault(variant_class(v)[:2], []).append(v)
    chosen: list[Variant] = []
    for members in by_kind.values():
        covered: set = set()
        picked: list[Variant] = []

        def take(v: Variant) -> None:
            picked.append(v)
            covered.update(variant_features(v))

        groups: dict[Hashable, list[Variant]] = {}
        for v in members:
            groups.setdefault(classes(v), []).append(v)
        for candidates in groups.values():
            take(max(candidates, key=lambda v: (v in prefer, len(variant_features(v) - covered))))
        needed = set().union(*(variant_features(v) for v in members)) if every_value else set()
        while needed - covered:
            take(max(members, key=lambda v: (len(variant_features(v) - covered), v in prefer)))
        chosen.extend(sorted(picked, key=members.index))
    return chosen
