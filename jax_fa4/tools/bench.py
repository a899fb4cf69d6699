"""Attention benchmark: jax-fa4 against cuDNN, XLA and the pure-JAX reference, in one process.

Usage::

    python -m jax_fa4.tools.bench                      # default sweep: every anchor shape + latency
    python -m jax_fa4.tools.bench --shapes anchors-main --out A.json       # the default sweep split
    python -m jax_fa4.tools.bench --shapes anchors-more,latency --out B.json   # in two runs, and
    python -m jax_fa4.tools.bench merge A.json B.json --out C.json         # joined into one file
    python -m jax_fa4.tools.bench --shapes tiny        # a few small shapes (CPU smoke run)
    python -m jax_fa4.tools.bench --shapes custom --B 2 --Sq 4096 --H 32 --Hkv 8 --D 128 \\
        --causal no,yes --window none,none --window 512,0
    python -m jax_fa4.tools.bench --impls jax-fa4,cudnn --dtype fp16 --fwd-only --out /tmp/r.json
    python -m jax_fa4.tools.bench --shapes anchors --impls jax-fa4,cudnn,fa3-jax   # FA3 beside us
    python -m jax_fa4.tools.bench --dtype float8_e4m3fn      # the FP8 forward (anchors-main shapes)

Shape presets (``--shapes``, comma-separated to join several): ``anchors-main`` (the anchors
README's main table, 10 shapes), ``anchors-more`` (its "more shapes" table: GQA 32/8, head dims 96
and 192/128, two decode shapes), ``latency`` (B1·S128 and a decode shape), ``default`` (all three,
each shape once), ``anchors``, ``tiny``.

Implementations (``--impls``), each a row per shape:

* ``jax-fa4``: ``jax_fa4.flash_attention(implementation=None)``. On a GPU with an FA4 kernel
  family (sm90 on compute capability 9.x, sm100 on 10.x) the forced kernel is lowered first; if
  that raises, the row is skipped with the error (the library would fall back to the reference,
  which is not what the row claims to measure). ``resolved_impl`` says what ``None`` picked,
  found by comparing its lowered program with the forced ones'.
* ``jax-fa4-det``: the same with ``deterministic=True`` (rows say ``"deterministic": true``). It
  changes only the backward; its forward is timed too, as the backward figure needs it. Run on
  training shapes only: skipped for decode (``Sq = 1``) and latency shapes, and with
  ``--fwd-only``.
* ``cudnn`` / ``xla``: ``jax.nn.dot_product_attention(implementation=...)``, GPU only. Skipped
  when ``Dv != D`` (it needs equal head dims) and for a causal or windowed mask with
  ``Sq != Sk`` (it aligns masks top-left, FA4 bottom-right: a different function).
* ``reference``: ``flash_attention(implementation="reference")``, skipped when its
  ``B·H·Sq·Sk`` float32 scores would exceed ``--reference-max-gb`` (XLA: ``--xla-max-gb``).
* ``fa3-jax``: FlashAttention-3's JAX binding (PyPI ``flash-attn3-jax``, module
  ``flash_attn3_jax``: ``flash_mha``), an optional peer (:mod:`jax_fa4.tools.bench_peers`): in
  the default ``--impls`` when importable, else absent, and the result file's ``peers`` says
  why (asked for by ``--impls`` while not importable, its rows are skipped with that reason).
  Shapes its API cannot express (``Dv != D``) and those its kernels refuse (head dims above
  its build's) are rows skipped as ``refused: <message>``.

Checks: every row that ran records whether its forward output and gradients (on the first input
set) are finite (``finite``). On a shape where a peer ran, every row that ran is also checked
against the float32 reference by FA4's rule (``fa4_rule``, :mod:`jax_fa4.tools.fa4_rule`) on one
batch element and one key/value head with its query heads, and every row of the shape names the
best peer per direction (``best_peer_fwd``/``best_peer_bwd``: cuDNN or a peer, the highest
ratio to cuDNN among those whose results are finite and pass the rule) and its ratio
(``best_peer_fwd_ratio``/``best_peer_bwd_ratio``): the bar jax-fa4's ratio is held to.

FP8 (``--dtype float8_e4m3fn``, forward only: an FP8 call has no gradient): the bfloat16 inputs
are quantised to e4m3 with one scale per tensor (``per_tensor_e4m3``), so every FP8 row reads the
same e4m3 values: ``jax-fa4`` (``flash_attention`` with ``q_descale``/``k_descale``/``v_descale``,
bfloat16 out), ``cudnn`` (cuDNN's FP8 attention
through JAX's private module, e4m3 out; causal or no mask) and ``reference`` (float32 on the
dequantised inputs: the base of ``fwd_rel_err``); ``jax-fa4-bf16`` times our bfloat16 forward on
the unquantised inputs, and FP8 rows carry ``fwd_ratio_vs_bf16`` against it. Rows say
``"dtype": "float8_e4m3fn"`` (``"bf16"`` for the bfloat16 row).

Method: per shape, every implementation's programs are compiled first (compile time goes to
``compile_s``) and run once; then all of them, for every implementation, are timed together in
one rotation (``time_programs``): the inference forward (``jax.jit(fn)``), the training forward
(``jax.vjp(fn, q, k, v)``'s output and the residuals its pullback holds, returned from the
program, so the forward computes and keeps what the backward reads, e.g. the softmax statistics
an inference forward may skip; residuals that are q, k, v or out themselves are not returned,
``residual_bytes`` says how much is) and forward+backward (``jax.vjp`` with a random cotangent,
i.e. the gradient of ``sum(out * do)`` with respect to q, k, v, returning ``out`` too, as a
training step uses it). Each program is warmed up, then timed by wall clock as the median of its
rounds of back-to-back dispatches (as many as fill ``--target-ms``), synchronised with
``block_until_ready`` at the end of each round (after every call on the CPU, whose executions may
overlap). The rounds run one program after another; after an untimed first round, round r starts
at program r mod n, and the timed rounds (``--repeats`` rounded up to a multiple of n, the
``rounds`` key) let every program open as many rounds as every other, so drifting clocks or load,
and which program follows which, bias no implementation more than another. The result file's
``timing`` names each shape's programs and the order of every round. ``bwd_ms = fwdbwd_ms -
train_fwd_ms`` for every implementation alike (``bwd_method``); ``fwd_ms`` is the inference
forward.

Dispatches rotate over several random input sets, shared by the implementations, enough that
together they exceed twice the H200's 60 MB L2, so small shapes are not timed out of cache. On a
GPU, a shape whose device time would be short next to Python's dispatch (under ~200 µs at the
measured ceilings) is timed as one program that runs ``calls_per_dispatch`` calls on distinct
input sets, each call waiting on the previous one's outputs through an optimization barrier (no
overlap, no fusion across calls); times are per attention call. ``skipped`` holds why a row did
not run; a row whose backward alone failed keeps its forward figures and says ``backward: ...``.

``measures`` says what a row's figures mean: ``attention speed``, ``K/V bandwidth`` (decode,
``Sq = 1``: read ``fwd_tbps``) or ``launch overhead`` (a latency shape, or one whose device time
at the ceilings is under 20 µs: its TFLOP/s are not attention speed, and the printed table and
the plot leave them out).

FLOPs (the anchors' convention): forward ``2·B·H·Sq·Sk·(D+Dv)`` times the fraction of visible
(query, key) pairs: exactly 1/2 for causal with ``Sq == Sk`` and no window, otherwise counted
exactly from FA4's mask rule; backward is 2.5 × forward. ``fwd_tbps`` is the bytes of q, k, v
and out over the forward time (the figure that matters for decode, ``Sq = 1``).

Memory: ``xla_mem_bytes`` is XLA's compile-time footprint of the forward+backward program
(arguments + outputs + temporaries); ``peak_mem_bytes`` is the device allocator's high-water mark
during one forward+backward call minus the bytes in use before it. The allocator's peak cannot be
reset, so before the call a ballast buffer lifts the bytes in use to the old peak, making any new
allocation a new peak (None on the CPU, or when the ballast would not fit). The programs of all
implementations of one shape exist together; the input sets are shared.

``fwd_rel_err`` compares each row's forward output with that of the reference (or cuDNN, or XLA:
``fwd_rel_err_vs`` names it) on the same inputs: ``|out - base| / |base|``.

Output: ``benchmarks/results/<gpu-slug>-<YYYY-MM-DD>.json`` (``--out`` overrides), a PNG of
TFLOP/s against sequence length with the same stem, and a table on stdout. The file also holds
the GPU's state from nvidia-smi before and after the sweep (``gpu_state``: clocks, temperature,
power, throttle reasons), the driver and the versions of the stack (jax, jaxlib, the CUDA
plugin, cuDNN, and ``cute_dsl``: ``nvidia-cutlass-dsl`` when installed, the DSL versions the
kernel cache's entries were compiled with, and the CuTe-DSL runtime library).
``python -m jax_fa4.tools.readme_tables`` writes README's speed tables from the newest default-sweep
file.

This module parses the command line, builds, times and checks the programs and writes the result
file; the shapes and presets are in :mod:`jax_fa4.tools.bench_shapes`, the table, the plot and
``merge`` in :mod:`jax_fa4.tools.bench_report`, the GPU state and the versions in
:mod:`jax_fa4.tools.bench_env`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import math
import re
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from tqdm import tqdm

import jax_fa4
from jax_fa4.tools import bench_env, bench_peers, bench_report
from jax_fa4.tools.bench_report import Row
from jax_fa4.tools.bench_shapes import (
    DEFAULT_PARTS,
    LATENCY_SHAPES,
    PRESETS,
    Shape,
    Window,
    preset_shapes,
)

Inputs = tuple[jax.Array, jax.Array, jax.Array, jax.Array]  # q, k, v, do

IMPLS = ("jax-fa4", "jax-fa4-det", "cudnn", "xla", "reference")
#: Optional peers (:mod:`jax_fa4.tools.bench_peers`): in the default ``--impls`` when importable.
PEER_IMPLS = bench_peers.PEER_IMPLS
#: ``--dtype float8_e4m3fn``: FP8 rows of jax-fa4, cuDNN and the reference, and our bfloat16
#: forward on the same (unquantised) inputs (``jax-fa4-bf16``), forward only.
FP8 = "float8_e4m3fn"
FP8_IMPLS = ("jax-fa4", "cudnn", "jax-fa4-bf16", "reference")
#: The jax-fa4 implementations and whether each passes ``deterministic=True``.
FA4_IMPLS = {"jax-fa4": False, "jax-fa4-det": True, "jax-fa4-bf16": False}
GPU_ONLY = ("cudnn", "xla")
#: Rotate input sets until they exceed twice the H200's 60 MB L2.
ROTATION_BYTES = 2 * 60 * 10**6
MAX_INPUT_SETS = 64
MAX_ITERS = 2000
#: On a GPU, one dispatch runs enough calls for this much device time (at the ceilings).
CHAIN_TARGET_S = 200e-6
MAX_CHAIN = 16
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, FP8: jnp.float8_e4m3fn}
#: FA4 kernel family per compute-capability major.
KERNEL_FOR_CC_MAJOR = {"9": "sm90", "10": "sm100"}
#: Order in which a row's forward output is compared: the first that ran is the base.
ERR_BASES = ("reference", "cudnn", "xla")
BACKWARD_FLOP_FACTOR = 2.5

#: How ``bwd_ms`` is derived (the result file's ``bwd_method``), and what that means.
BWD_METHOD = "fwdbwd_minus_training_fwd"
BWD_METHOD_TEXT = ("bwd_ms = fwdbwd_ms - train_fwd_ms: forward+backward minus the training forward "
                   "(the forward that also returns the residuals the backward reads, e.g. the "
                   "softmax statistics), for every implementation alike")
TIMING_ROTATION = "round r starts at program r mod n"

#: Keys of every row, in order (``tests/test_bench.py`` checks them).
ROW_KEYS = (
    "impl", "resolved_impl", "deterministic", "measures", "dtype", "B", "Sq", "Sk", "H", "Hkv",
    "D", "Dv", "causal", "window", "fwd_flops", "fwd_ms", "train_fwd_ms", "fwdbwd_ms", "bwd_ms",
    "fwd_us", "bwd_us", "fwd_tflops", "bwd_tflops", "fwd_tbps", "fwd_ratio_vs_cudnn",
    "bwd_ratio_vs_cudnn", "fwd_ratio_vs_bf16", "fwd_spread", "train_fwd_spread",
    "fwdbwd_spread", "iters", "rounds",
    "calls_per_dispatch", "input_sets", "compile_s", "residual_bytes", "peak_mem_bytes",
    "xla_mem_bytes", "custom_calls", "fwd_rel_err", "fwd_rel_err_vs", "finite", "fa4_rule",
    "best_peer_fwd", "best_peer_fwd_ratio", "best_peer_bwd", "best_peer_bwd_ratio", "skipped",
)
#: Defaults of the custom shape flags (``--Sk``, ``--Hkv``, ``--Dv`` default to Sq, H, D).
CUSTOM_DEFAULTS = {"B": "4", "Sq": "8192", "H": "16", "D": "128"}


# -- command line ------------------------------------------------------------------------------
def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if any(x <= 0 for x in values):
        raise argparse.ArgumentTypeError(f"expected positive ints, got {text!r}")
    return values


def _bool_list(text: str) -> list[bool]:
    table = {"no": False, "yes": True, "0": False, "1": True, "false": False, "true": True}
    try:
        return [table[x.strip().lower()] for x in text.split(",")]
    except KeyError:
        raise argparse.ArgumentTypeError(f"expected comma-separated yes/no, got {text!r}") from None


def _window(text: str) -> Window:
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected LEFT,RIGHT (ints or none), got {text!r}")
    out: list[int | None] = []
    for p in parts:
        p = p.strip().lower()
        if p in ("none", "-1", ""):
            out.append(None)
        elif p.isdigit():
            out.append(int(p))
        else:
            raise argparse.ArgumentTypeError(f"window sides are ints >= 0 or none, got {text!r}")
    return out[0], out[1]


def _impl_list(text: str) -> list[str]:
    impls = [x.strip() for x in text.split(",")]
    known = tuple(dict.fromkeys(IMPLS + PEER_IMPLS + FP8_IMPLS))
    unknown = [x for x in impls if x not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown implementation(s) {unknown}; known: {known}")
    return impls


def _shapes_spec(text: str) -> str:
    """``custom``, or one or more preset names joined by commas (normalised: no spaces)."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    if names == ["custom"]:
        return "custom"
    unknown = [x for x in names if x not in PRESETS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown preset(s) {unknown or [text]}; known: {', '.join(PRESETS)}, or custom alone")
    return ",".join(names)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jax_fa4.tools.bench",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=_shapes_spec, default=None,
                   help=f"shape preset(s), comma-separated ({', '.join(PRESETS)}; default = "
                        f"{' + '.join(DEFAULT_PARTS)}; with --dtype {FP8}: anchors-main), or "
                        "custom from the shape flags below")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--impls", type=_impl_list, default=None,
                   help=f"comma-separated subset of {','.join(IMPLS + PEER_IMPLS)} (default: "
                        f"{','.join(IMPLS)}, and each of {','.join(PEER_IMPLS)} that is "
                        f"importable; with --dtype {FP8}: of {','.join(FP8_IMPLS)})")
    shape = p.add_argument_group("custom shapes (--shapes custom; comma lists are swept as a "
                                 "cartesian product)")
    for name, help_ in (("B", "batch"), ("Sq", "query length"),
                        ("Sk", "key length (default: Sq)"), ("H", "query heads"),
                        ("Hkv", "key/value heads (default: H)"), ("D", "q/k head dim"),
                        ("Dv", "value head dim (default: D)")):
        default = CUSTOM_DEFAULTS.get(name)
        shape.add_argument(f"--{name}", type=_int_list, default=None,
                           help=help_ + (f" (default: {default})" if default else ""))
    shape.add_argument("--causal", type=_bool_list, default=None,
                       help="yes, no or both as 'no,yes' (default: no)")
    shape.add_argument("--window", type=_window, action="append", default=None,
                       help="LEFT,RIGHT sliding window, each an int or none; repeatable "
                            "(default: none,none)")
    timing = p.add_argument_group("timing")
    timing.add_argument("--repeats", type=int, default=5,
                        help="timed rounds at least; rounded up to a multiple of the shape's "
                             "number of programs, so each program opens as many rounds as every "
                             "other; the median is kept")
    timing.add_argument("--target-ms", type=float, default=25.0,
                        help="wall time one program's round aims at (sets its calls per round)")
    timing.add_argument("--fwd-only", action="store_true", help="skip forward+backward")
    timing.add_argument("--reference-max-gb", type=float, default=4.0,
                        help="skip the reference above this many GB of float32 scores")
    # XLA's forward + backward holds several score-sized float32 arrays at once (S, P, dP,
    # dS): above 8 GB of scores (the 8k-token anchor shapes) it runs out of an H200's memory
    # after compiling and trying, which only costs the sweep time; the 2k-token shapes run
    timing.add_argument("--xla-max-gb", type=float, default=8.0,
                        help="skip XLA above this many GB of float32 scores")
    timing.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default: benchmarks/results/<gpu-slug>-<date>.json); the "
                        "PNG goes next to it")
    p.add_argument("--no-plot", dest="plot", action="store_false",
                   help="write no PNG (the JSON and the tables only)")
    args = p.parse_args(argv)
    if args.shapes is None:
        args.shapes = "anchors-main" if args.dtype == FP8 else "default"
    shape_flags = ("B", "Sq", "Sk", "H", "Hkv", "D", "Dv", "causal", "window")
    if args.shapes != "custom":
        given = [f"--{n}" for n in shape_flags if getattr(args, n) is not None]
        if given:
            p.error(f"{', '.join(given)} need --shapes custom")
    if args.repeats < 1 or args.target_ms <= 0:
        p.error("--repeats must be >= 1 and --target-ms > 0")
    allowed = FP8_IMPLS if args.dtype == FP8 else IMPLS + PEER_IMPLS
    if args.impls is None:
        args.impls = list(FP8_IMPLS) if args.dtype == FP8 else list(IMPLS) + [
            impl for impl, peer in bench_peers.load_peers().items() if peer.available]
    wrong = [x for x in args.impls if x not in allowed]
    if wrong:
        p.error(f"--impls {','.join(wrong)}: not with --dtype {args.dtype} (choose from "
                f"{','.join(allowed)})")
    if args.dtype == FP8:
        args.fwd_only = True  # an FP8 call has no gradient
    return args


def custom_shapes(args: argparse.Namespace) -> list[Shape]:
    """The cartesian product of the shape flags (Sk, Hkv, Dv default to Sq, H, D)."""
    def get(name: str) -> list[int]:
        return getattr(args, name) or _int_list(CUSTOM_DEFAULTS[name])

    shapes = []
    for B, Sq, H, D, causal, window in itertools.product(
            get("B"), get("Sq"), get("H"), get("D"), args.causal or [False],
            args.window or [(None, None)]):
        for Sk, Hkv, Dv in itertools.product(args.Sk or [Sq], args.Hkv or [H], args.Dv or [D]):
            if H % Hkv:
                raise SystemExit(f"H={H} is not a multiple of Hkv={Hkv}")
            shapes.append(Shape(B, Sq, Sk, H, Hkv, D, Dv, causal, window))
    return shapes


# -- the implementations -----------------------------------------------------------------------
def _fa4_fn(shape: Shape, implementation: str | None, deterministic: bool = False,
            fp8: bool = False) -> Callable[..., jax.Array]:
    """``flash_attention`` on (q, k, v), or (``fp8``) on e4m3 (q, k, v) and their descales."""
    if fp8:
        def fp8_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_descale: jax.Array,
                          k_descale: jax.Array, v_descale: jax.Array) -> jax.Array:
            return jax_fa4.flash_attention(q, k, v, causal=shape.causal, window_size=shape.window,
                                           q_descale=q_descale, k_descale=k_descale,
                                           v_descale=v_descale, implementation=implementation)
        return fp8_attention

    def attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return jax_fa4.flash_attention(q, k, v, causal=shape.causal, window_size=shape.window,
                                       deterministic=deterministic,
                                       implementation=implementation)
    return attention


def _jax_nn_fn(shape: Shape, implementation: str) -> Callable[..., jax.Array]:
    left, right = shape.mask_window
    kwargs: dict[str, Any] = {"is_causal": right == 0}
    if left is not None or right not in (None, 0):
        # jax.nn's window is (left, right) around the diagonal; "unbounded" is the full length.
        kwargs["local_window_size"] = (shape.Sk if left is None else left,
                                       shape.Sk if right is None else right)

    def attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return jax.nn.dot_product_attention(q, k, v, implementation=implementation, **kwargs)
    return attention


def cudnn_fp8_fn(causal: bool, head_dim: int) -> Callable[..., jax.Array]:
    """cuDNN's FP8 flash attention, the only FP8 attention JAX has, through its private module
    ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention(use_fp8=True)``: e4m3 q,
    k, v (B, S, H, D) and scalar float32 descales -> e4m3 out (output scale 1), causal or no
    mask, softmax scale 1/sqrt(head_dim)."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    mask = cudnn.MaskType.CAUSAL if causal else cudnn.MaskType.NO_MASK

    def cudnn_fp8(q: jax.Array, k: jax.Array, v: jax.Array, q_descale: jax.Array,
                  k_descale: jax.Array, v_descale: jax.Array) -> jax.Array:
        one = jnp.ones((1, 1, 1, 1), jnp.float32)
        params = {key: one for key in cudnn.fp8_params_keys}
        params.update(descale_q=q_descale.reshape(1, 1, 1, 1),
                      descale_k=k_descale.reshape(1, 1, 1, 1),
                      descale_v=v_descale.reshape(1, 1, 1, 1))
        out, _, _ = cudnn.dot_product_attention(q, k, v, fp8_params=params,
                                                scale=1.0 / math.sqrt(head_dim), mask_type=mask,
                                                use_fp8=True, qkv_layout="BTNH")
        return out
    return cudnn_fp8


def per_tensor_e4m3(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(x in e4m3, its descale as a float32 scalar): :func:`jax_fa4.fp8.quantize` with one
    scale for the whole tensor (what cuDNN's FP8 attention takes)."""
    from jax_fa4 import fp8

    x8, descale = fp8.quantize(x.reshape(1, -1, 1, x.shape[-1]))
    return x8.reshape(x.shape), descale[0, 0]


def fp8_input_sets(arg_sets: Sequence[Inputs]) -> list[tuple[Any, ...]]:
    """Each bfloat16 set (q, k, v, do) as the FP8 rows' (q8, k8, v8, q_descale, k_descale,
    v_descale, None): per-tensor scales, so jax-fa4, cuDNN and the reference read the same e4m3
    values (the kernel's speed does not depend on the descales' granularity); no cotangent."""
    out = []
    for q, k, v, _ in arg_sets:
        quantised = [per_tensor_e4m3(x) for x in (q, k, v)]
        out.append(tuple(x8 for x8, _ in quantised) + tuple(d for _, d in quantised) + (None,))
    jax.block_until_ready(out)
    return out


def _train_fwd(fn: Callable[..., jax.Array]) -> Callable[..., Any]:
    """The training forward: ``out`` and the residuals ``jax.vjp`` keeps for the backward.

    Returning the pullback's leaves from a jitted program forces the forward to compute and
    keep what the backward reads (for cuDNN and jax-fa4 the softmax statistics, which an
    inference forward may skip). Leaves that are ``q``, ``k``, ``v`` or ``out`` themselves are
    left out: a training step holds those anyway, and returning an input from a program would
    time a copy of it.
    """
    def train_forward(q: jax.Array, k: jax.Array, v: jax.Array) -> Any:
        out, pullback = jax.vjp(fn, q, k, v)
        kept = (q, k, v, out)
        residuals = [x for x in jax.tree.leaves(pullback)
                     if isinstance(x, jax.Array) and not any(x is y for y in kept)]
        return out, residuals
    return train_forward


def residual_bytes(fn: Callable[..., jax.Array], q: jax.Array, k: jax.Array, v: jax.Array
                   ) -> int:
    """Bytes of the residuals ``_train_fwd(fn)`` returns beside ``out`` (traced, not run)."""
    _, residuals = jax.eval_shape(_train_fwd(fn), q, k, v)
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in residuals)


def _fwd_bwd(fn: Callable[..., jax.Array]) -> Callable[..., Any]:
    def fwd_bwd(q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array) -> Any:
        out, pullback = jax.vjp(fn, q, k, v)
        return out, pullback(do)
    return fwd_bwd


def device_kernel(device: jax.Device) -> str | None:
    """The FA4 kernel family for this device, None when it is not a GPU with one."""
    if device.platform != "gpu":
        return None
    cc = getattr(device, "compute_capability", None) or ""
    return KERNEL_FOR_CC_MAJOR.get(str(cc).split(".")[0])


def static_skip_reason(impl: str, shape: Shape, platform: str, args: argparse.Namespace,
                       peers: Mapping[str, bench_peers.Peer] | None = None) -> str | None:
    """Why ``impl`` does not run ``shape`` here, decided before compiling (None: try it).
    A peer (``PEER_IMPLS``) needs its module in ``peers``; else the reason is why it is not
    there."""
    gb = shape.scores_bytes() / 1e9
    if impl in PEER_IMPLS:
        peer = (peers or {}).get(impl) or bench_peers.Peer(
            impl, *bench_peers.PEER_MODULES[impl], reason=f"{impl}: its module was not loaded")
        if not peer.available:
            return peer.reason
        return bench_peers.static_refusal(impl, shape, getattr(args, "dtype", "bf16"))
    if impl == "jax-fa4-det":
        if getattr(args, "fwd_only", False):
            return "deterministic=True changes only the backward (--fwd-only)"
        if shape.Sq == 1 or shape in LATENCY_SHAPES:
            return ("deterministic=True changes only the backward: timed on training shapes "
                    "only (not decode, not latency)")
    if impl in GPU_ONLY:
        if platform != "gpu":
            return f"{impl} runs only on a CUDA GPU (device platform is {platform})"
        if getattr(args, "dtype", None) == FP8 and shape.window != (None, None):
            return ("cuDNN's FP8 attention (JAX's private API) is timed with a causal mask or "
                    "none, not a window")
        if shape.Dv != shape.D:
            return "jax.nn.dot_product_attention needs the value head dim equal to D"
        if shape.masked and shape.Sq != shape.Sk:
            return ("jax.nn.dot_product_attention aligns causal/window masks top-left and FA4 "
                    "bottom-right: with Sq != Sk they compute different functions")
    if impl == "xla" and gb > args.xla_max_gb:
        return f"XLA materialises {gb:.1f} GB of float32 scores (> --xla-max-gb {args.xla_max_gb})"
    if impl == "reference" and gb > args.reference_max_gb:
        return (f"reference: {gb:.1f} GB of float32 scores (> --reference-max-gb "
                f"{args.reference_max_gb}); too slow and memory-hungry")
    return None


class SkipRow(Exception):
    """A row that cannot run; the message is the reason recorded."""


def _error_text(err: BaseException) -> str:
    """Why a row was skipped: a :class:`SkipRow`'s message as it is, any other error's type and
    first line."""
    return str(err) if isinstance(err, SkipRow) else bench_env.error_text(err)


_CUSTOM_CALL = re.compile(r'custom_call @([\w$.\-]+)|call_target_name = "([^"]+)"')


def custom_call_targets(hlo_text: str) -> dict[str, int]:
    """Custom-call targets in a lowered module and how often each occurs."""
    counts: dict[str, int] = {}
    for m in _CUSTOM_CALL.finditer(hlo_text):
        name = m.group(1) or m.group(2)
        counts[name] = counts.get(name, 0) + 1
    return counts


#: The collectives XLA may insert into a sharded program, as they appear in compiled HLO text.
COLLECTIVES = ("all-gather", "all-to-all", "all-reduce", "collective-permute", "reduce-scatter")


def collectives(hlo_text: str) -> dict[str, list[str]]:
    """Result shapes of each collective in compiled HLO text, e.g. ``{"all-reduce": ["f32[]"]}``
    (an async pair ``-start``/``-done`` counts once)."""
    found: dict[str, list[str]] = {}
    for op in COLLECTIVES:
        shapes = re.findall(rf"^\s*\S+ = (.+?) {op}(?:-start)?\(", hlo_text, re.M)
        if shapes:
            found[op] = shapes
    return found


# -- measuring ---------------------------------------------------------------------------------
def chain_length(shape: Shape, itemsize: int, platform: str) -> int:
    """Attention calls per dispatch: 1, except on a GPU for shapes whose device time (by a lower
    bound from the ceilings) is short enough that Python's dispatch would be timed instead."""
    if platform != "gpu":
        return 1
    floor_s = shape.device_floor_s(itemsize)
    return max(1, min(MAX_CHAIN, math.ceil(CHAIN_TARGET_S / max(floor_s, 1e-9))))


def make_inputs(shape: Shape, dtype: Any, key: jax.Array, multiple_of: int) -> list[Inputs]:
    """Random input sets (q, k, v, do), enough that together they exceed ``ROTATION_BYTES`` (at
    least 2), and a multiple of ``multiple_of``. For float8_e4m3fn: bfloat16 sets, counted by
    the bytes of their e4m3 q, k, v (:func:`fp8_input_sets` quantises them)."""
    dims = ((shape.B, shape.Sq, shape.H, shape.D), (shape.B, shape.Sk, shape.Hkv, shape.D),
            (shape.B, shape.Sk, shape.Hkv, shape.Dv), (shape.B, shape.Sq, shape.H, shape.Dv))
    set_bytes = sum(math.prod(d) for d in dims) * jnp.dtype(dtype).itemsize
    if jnp.dtype(dtype) == jnp.float8_e4m3fn:
        set_bytes = sum(math.prod(d) for d in dims[:3])
        dtype = jnp.bfloat16
    n = min(MAX_INPUT_SETS, max(2, -(-ROTATION_BYTES // set_bytes)))
    n = multiple_of * -(-n // multiple_of)
    sets = []
    for set_key in jax.random.split(key, n):
        q, k, v, do = (jax.random.normal(kk, d, dtype)
                       for kk, d in zip(jax.random.split(set_key, 4), dims))
        sets.append((q, k, v, do))
    jax.block_until_ready(sets)
    return sets


def chained(fn: Callable[..., Any]) -> Callable[..., list[Any]]:
    """A program that applies ``fn`` to each of its argument tuples in turn.

    An optimization barrier makes each call's inputs wait for the previous call's outputs, so
    the calls neither overlap nor fuse with each other; every output is returned (none is dead).
    """
    def program(*arg_tuples: tuple[jax.Array, ...]) -> list[Any]:
        outs: list[Any] = []
        for args in arg_tuples:
            if outs:
                args, _ = jax.lax.optimization_barrier((args, outs[-1]))
            outs.append(fn(*args))
        return outs
    return program


@dataclasses.dataclass(frozen=True)
class Program:
    """A compiled program to time and the argument tuples it rotates over."""

    compiled: Any
    groups: list[tuple]  # positional arguments of each dispatch
    calls: int  # attention calls per dispatch


def make_program(fn: Callable[..., Any], single: Any, arg_sets: Sequence[tuple[jax.Array, ...]],
                 chain: int) -> Program:
    """``single`` (``fn`` compiled for one call) as is, or ``fn`` chained ``chain`` times."""
    if chain == 1:
        return Program(single, [tuple(a) for a in arg_sets], 1)
    groups = [tuple(arg_sets[i:i + chain]) for i in range(0, len(arg_sets) - chain + 1, chain)]
    return Program(jax.jit(chained(fn)).lower(*groups[0]).compile(), groups, chain)


@dataclasses.dataclass(frozen=True)
class Timing:
    ms: float  # median per attention call
    spread: float  # (max - min) / median over the rounds
    iters: int  # dispatches per round


def _round_iters(program: Program, target_s: float) -> int:
    """Warm ``program`` up (three calls), then size a round to ``target_s`` from one timed call."""
    for args in program.groups[:3]:
        jax.block_until_ready(program.compiled(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(program.compiled(*program.groups[0]))
    once = time.perf_counter() - t0
    return max(1, min(MAX_ITERS, round(target_s / max(once, 1e-7))))


def _round_ms(program: Program, iters: int, first: int, sync_each: bool) -> float:
    """Wall time per attention call of one round of ``iters`` back-to-back dispatches."""
    out = None
    t0 = time.perf_counter()
    for i in range(first, first + iters):
        out = program.compiled(*program.groups[i % len(program.groups)])
        if sync_each:
            jax.block_until_ready(out)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / (iters * program.calls) * 1e3


def timed_rounds(repeats: int, count: int) -> int:
    """Timed rounds for ``count`` programs: ``repeats`` rounded up to a multiple of ``count``, so
    that every program opens a round (and as many as every other)."""
    return count * -(-repeats // count)


def time_programs(programs: Sequence[Program], *, repeats: int, target_s: float,
                  sync_each: bool, order_log: list[list[int]] | None = None) -> list[Timing]:
    """Median wall time per attention call of each program.

    The programs (every implementation's forward, training forward and forward+backward for one
    shape) run in rounds, one round of each program after another, so a drift in clocks or load
    biases their differences as little as possible; a first untimed round settles clocks, then
    ``timed_rounds(repeats, n)`` rounds are timed. Round r starts at program r mod n (runs
    programs r, r+1, ... mod n): the program that runs right after another one's heavy round
    (clocks pulled down by power, its inputs out of L2) is a different one every round, and each
    program opens as many timed rounds as every other (on the H200 a backward kernel timed first
    in every round measured 7% slower, with 4x the spread, than the same kernel timed second).
    ``order_log``, when given, receives the program indices of each round in the order they ran
    (the untimed first round included).
    """
    iters = [_round_iters(p, target_s) for p in programs]
    samples: list[list[float]] = [[] for _ in programs]
    count = len(programs)
    for r in range(timed_rounds(repeats, count) + 1):
        order = [(r + j) % count for j in range(count)]
        if order_log is not None:
            order_log.append(order)
        for i in order:
            ms = _round_ms(programs[i], iters[i], r * iters[i], sync_each)
            if r:
                samples[i].append(ms)
    timings = []
    for n, xs in zip(iters, samples):
        med = statistics.median(xs)
        timings.append(Timing(med, (max(xs) - min(xs)) / med, n))
    return timings


def peak_bytes(device: jax.Device, run: Callable[[], None], need: int) -> int | None:
    """Allocator bytes in use at the peak of ``run()`` minus those in use before it, on
    ``device`` (see :func:`peak_bytes_per_device`)."""
    return peak_bytes_per_device([device], run, need)[0]


def peak_bytes_per_device(devices: Sequence[jax.Device], run: Callable[[], None],
                          need: int) -> list[int | None]:
    """Per device, allocator bytes in use at the peak of ``run()`` minus those in use before it
    (None where the allocator does not say, or where the figure would not be exact).

    The high-water mark cannot be reset, so a ballast buffer on each device first lifts the
    bytes in use to the old mark; ``need`` (bytes the run may allocate per device) decides
    whether that fits.
    """
    stats = [device.memory_stats() or {} for device in devices]
    if any("peak_bytes_in_use" not in s for s in stats):
        run()
        return [None] * len(devices)
    ballast, exact_before = [], []
    for device, s in zip(devices, stats):
        gap = s["peak_bytes_in_use"] - s["bytes_in_use"]
        buf = None
        if gap > 0 and s["peak_bytes_in_use"] + need + 2**30 < s.get("bytes_limit", 0):
            try:  # the allocator may still refuse (fragmentation): then measure without it
                buf = jnp.zeros((gap,), jnp.uint8, device=device)
                buf.block_until_ready()
            except jax.errors.JaxRuntimeError:
                buf = None
        ballast.append(buf)
        exact_before.append(buf is not None or gap <= 0)
    before = [device.memory_stats() for device in devices]
    run()
    result: list[int | None] = []
    for device, s, exact in zip(devices, before, exact_before):
        new_peak = device.memory_stats()["peak_bytes_in_use"]
        exact = exact or new_peak > s["peak_bytes_in_use"]
        result.append(new_peak - s["bytes_in_use"] if exact else None)
    del ballast
    return result


def row_dtype(impl: str, dtype_name: str) -> str:
    """The dtype a row of ``impl`` runs in (``jax-fa4-bf16`` is the bfloat16 row of an FP8
    sweep)."""
    return "bf16" if impl == "jax-fa4-bf16" else dtype_name


def _empty_row(impl: str, shape: Shape, dtype_name: str) -> Row:
    dtype_name = row_dtype(impl, dtype_name)
    row: Row = dict.fromkeys(ROW_KEYS)
    row.update(impl=impl, deterministic=FA4_IMPLS.get(impl, False),
               measures=shape.measures(jnp.dtype(DTYPES.get(dtype_name, jnp.bfloat16)).itemsize),
               dtype=dtype_name, B=shape.B, Sq=shape.Sq, Sk=shape.Sk, H=shape.H, Hkv=shape.Hkv,
               D=shape.D, Dv=shape.Dv, causal=shape.causal, window=list(shape.window),
               fwd_flops=shape.fwd_flops())
    return row


@dataclasses.dataclass(frozen=True)
class Lowered:
    """An implementation's lowered programs. ``train_fwd`` (the training forward) and ``fwd_bwd``
    are None with ``--fwd-only``, or the exception that kept them from lowering."""

    fn: Callable[..., jax.Array]
    fwd: Any
    train_fwd: Any
    fwd_bwd: Any
    resolved: str | None = None


def _lower(fn: Callable[..., jax.Array], inputs: tuple[Any, ...], fwd_only: bool) -> Lowered:
    """``fn``'s lowered forward, training forward and forward+backward; ``inputs`` is ``fn``'s
    arguments and the cotangent ``do`` (q, k, v, do; or FP8's six arguments and None)."""
    *fwd_args, do = inputs
    fwd = jax.jit(fn).lower(*fwd_args)
    q, k, v = fwd_args[:3]
    if fwd_only:
        return Lowered(fn, fwd, None, None)
    try:
        train = jax.jit(_train_fwd(fn)).lower(q, k, v)
        return Lowered(fn, fwd, train, jax.jit(_fwd_bwd(fn)).lower(q, k, v, do))
    except Exception as err:
        return Lowered(fn, fwd, err, err)


def lower_impl(impl: str, shape: Shape, kernel: str | None, inputs: tuple[Any, ...],
               fwd_only: bool, fp8: bool = False,
               peers: Mapping[str, bench_peers.Peer] | None = None) -> Lowered:
    """The attention function of ``impl``, its lowered programs, and (jax-fa4, jax-fa4-det,
    jax-fa4-bf16) what ``implementation=None`` resolved to. ``fp8``: the FP8 forward's function
    (six arguments: e4m3 q, k, v and their descales; cuDNN's through its private FP8 API).
    ``peers``: the loaded peers, whose module a peer's row calls.

    For jax-fa4 on a GPU with a kernel family, the forced kernel is lowered first: a forward that
    cannot lower raises :class:`SkipRow`, a backward that cannot lower replaces the training
    forward and forward+backward by its error.
    """
    if impl not in FA4_IMPLS:
        if impl == "reference":
            fn = _fa4_fn(shape, "reference", fp8=fp8)
        elif fp8 and impl == "cudnn":
            fn = cudnn_fp8_fn(shape.causal, shape.D)
        elif impl == bench_peers.FA3:
            fn = bench_peers.fa3_fn((peers or {})[impl].module, shape)
        else:
            fn = _jax_nn_fn(shape, impl)
        return _lower(fn, inputs, fwd_only)
    det = FA4_IMPLS[impl]
    forced_text, forced_bwd_error = None, None
    if kernel is not None:
        try:
            forced = _lower(_fa4_fn(shape, kernel, det, fp8), inputs, fwd_only)
        except Exception as err:
            raise SkipRow(_error_text(err)) from err
        forced_text = forced.fwd.as_text()
        if isinstance(forced.fwd_bwd, Exception):
            forced_bwd_error = SkipRow(_error_text(forced.fwd_bwd))
    lowered = _lower(_fa4_fn(shape, None, det, fp8), inputs, fwd_only)
    text = lowered.fwd.as_text()
    if text == forced_text:
        resolved = kernel
    elif text == jax.jit(_fa4_fn(shape, "reference", det, fp8)).lower(*inputs[:-1]).as_text():
        resolved = "reference"
    else:
        resolved = "unknown"
    if forced_bwd_error is not None:
        return dataclasses.replace(lowered, train_fwd=forced_bwd_error,
                                   fwd_bwd=forced_bwd_error, resolved=resolved)
    return dataclasses.replace(lowered, resolved=resolved)


#: The programs timed per implementation, in their order within a shape's timing group.
PROGRAM_KINDS = ("fwd", "train_fwd", "fwdbwd")


@dataclasses.dataclass
class Prepared:
    """One implementation compiled for one shape: its row so far and the programs to time."""

    row: Row
    programs: dict[str, Program]  # by kind: fwd, and train_fwd + fwdbwd when the backward runs
    out: jax.Array | None = None  # forward output on the first input set
    grads: tuple[jax.Array, ...] | None = None  # (dq, dk, dv) on the first input set


def prepare_impl(impl: str, shape: Shape, arg_sets: list[Inputs], chain: int,
                 ctx: BenchContext) -> Prepared:
    """Compile ``impl``'s forward, training forward and forward+backward for ``shape``, measure
    its memory and run each program once (a program that cannot run skips the row, or its
    backward, here rather than in the shared timing).

    A backward that cannot run leaves the forward programs and says so in ``skipped``. A
    peer's row that its module cannot run (an error while lowering, compiling or running it)
    says ``refused: <the error>`` (``backward refused: ...`` for its backward alone).
    """
    prepared = _prepare_impl(impl, shape, arg_sets, chain, ctx)
    skipped = prepared.row["skipped"]
    if impl in PEER_IMPLS and skipped and not skipped.startswith("refused"):
        static = static_skip_reason(impl, shape, ctx.device.platform, ctx.args, ctx.peers)
        if skipped != static:
            prepared.row["skipped"] = (f"backward refused: {skipped[len('backward: '):]}"
                                       if skipped.startswith("backward: ")
                                       else f"refused: {skipped}")
    return prepared


def _prepare_impl(impl: str, shape: Shape, arg_sets: list[Inputs], chain: int,
                  ctx: BenchContext) -> Prepared:
    row = _empty_row(impl, shape, ctx.dtype_name)
    reason = static_skip_reason(impl, shape, ctx.device.platform, ctx.args, ctx.peers)
    if reason is not None:
        row["skipped"] = reason
        return Prepared(row, {})
    fwd_sets = [a[:-1] for a in arg_sets]
    t0 = time.perf_counter()
    try:
        low = lower_impl(impl, shape, ctx.kernel, arg_sets[0], ctx.args.fwd_only,
                         fp8=row["dtype"] == FP8, peers=ctx.peers)
        row["resolved_impl"] = low.resolved
        fwd = low.fwd.compile()
        programs = {"fwd": make_program(low.fn, fwd, fwd_sets, chain)}
    except Exception as err:
        row["skipped"] = _error_text(err)
        return Prepared(row, {})
    fb = None
    try:
        for lowered in (low.train_fwd, low.fwd_bwd):
            if isinstance(lowered, Exception):
                raise lowered
        if low.fwd_bwd is not None:
            programs["train_fwd"] = make_program(_train_fwd(low.fn), low.train_fwd.compile(),
                                                 fwd_sets, chain)
            fb = low.fwd_bwd.compile()
            programs["fwdbwd"] = make_program(_fwd_bwd(low.fn), fb, arg_sets, chain)
            row["residual_bytes"] = residual_bytes(low.fn, *fwd_sets[0])
    except Exception as err:
        fb = None
        programs = {"fwd": programs["fwd"]}
        row["skipped"] = f"backward: {_error_text(err)}"
    row["compile_s"] = round(time.perf_counter() - t0, 3)
    row["custom_calls"] = custom_call_targets(
        (low.fwd_bwd if fb is not None else low.fwd).as_text())
    mem = (fb or fwd).memory_analysis()
    if mem is not None:
        row["xla_mem_bytes"] = (mem.argument_size_in_bytes + mem.output_size_in_bytes
                                + mem.temp_size_in_bytes - mem.alias_size_in_bytes)
    row.update(input_sets=len(arg_sets), calls_per_dispatch=chain)
    full, full_args = (fb, arg_sets[0]) if fb is not None else (fwd, fwd_sets[0])
    try:
        row["peak_mem_bytes"] = peak_bytes(
            ctx.device, lambda: jax.block_until_ready(full(*full_args)),
            row["xla_mem_bytes"] or 0)
        grads = None
        for kind, program in programs.items():  # one run each: a failure skips the row here
            result = jax.block_until_ready(program.compiled(*program.groups[0]))
            if kind == "fwdbwd":  # (out, (dq, dk, dv)) of the first set (a chain: its first)
                grads = tuple((result[0] if program.calls > 1 else result)[1])
            del result
        out = fwd(*fwd_sets[0])
    except Exception as err:
        row["skipped"] = _error_text(err)
        return Prepared(row, {})
    return Prepared(row, programs, out, grads)


def time_shape(prepared: Sequence[Prepared], ctx: BenchContext) -> Row | None:
    """Time every program of every prepared implementation of one shape in one rotation
    (``time_programs``) and fill the rows; returns the timing record of the shape (the
    programs, by ``impl kind``, and the order of each round), None when nothing ran."""
    programs: list[Program] = []
    owners: list[tuple[Prepared, str]] = []
    for prep in prepared:
        for kind in PROGRAM_KINDS:
            if kind in prep.programs:
                programs.append(prep.programs[kind])
                owners.append((prep, kind))
    if not programs:
        return None
    orders: list[list[int]] = []
    try:
        timings = time_programs(programs, repeats=ctx.args.repeats,
                                target_s=ctx.args.target_ms / 1e3,
                                sync_each=ctx.device.platform == "cpu", order_log=orders)
    except Exception as err:
        for prep in prepared:
            if prep.programs:
                prep.row["skipped"] = f"timing: {_error_text(err)}"
                prep.row.update(fwd_ms=None, fwdbwd_ms=None)
                prep.out = None
        return {"programs": [f"{p.row['impl']} {k}" for p, k in owners], "error": str(err)}
    for (prep, kind), t in zip(owners, timings):
        row = prep.row
        row[f"{kind}_ms"] = t.ms
        row[f"{kind}_spread"] = round(t.spread, 4)
        if kind == "fwd":
            row["iters"] = t.iters
        row["rounds"] = len(orders) - 1
    for prep in prepared:
        if prep.row["fwd_ms"] is not None:
            _derive(prep.row, jnp.dtype(DTYPES[prep.row["dtype"]]).itemsize)
    return {"programs": [f"{p.row['impl']} {k}" for p, k in owners],
            "untimed_first_round": True, "round_orders": orders}


def _derive(row: Row, itemsize: int) -> None:
    """Times in µs, TFLOP/s and TB/s from the measured milliseconds; ``bwd_ms`` is forward+
    backward minus the training forward (``BWD_METHOD``)."""
    flops = row["fwd_flops"]
    shape = row_shape(row)
    row["fwd_us"] = row["fwd_ms"] * 1e3
    row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
    row["fwd_tbps"] = shape.io_bytes(itemsize) / row["fwd_ms"] / 1e9
    if row["fwdbwd_ms"] is not None and row["train_fwd_ms"] is not None:
        row["bwd_ms"] = row["fwdbwd_ms"] - row["train_fwd_ms"]
        row["bwd_us"] = row["bwd_ms"] * 1e3
        if row["bwd_ms"] > 0:
            row["bwd_tflops"] = BACKWARD_FLOP_FACTOR * flops / row["bwd_ms"] / 1e9


def row_shape(row: Row) -> Shape:
    """The shape of a row."""
    return Shape(row["B"], row["Sq"], row["Sk"], row["H"], row["Hkv"], row["D"], row["Dv"],
                 row["causal"], tuple(row["window"]))


def compare_rows(rows: list[Row], outputs: dict[str, jax.Array]) -> None:
    """Fill the ratios to cuDNN (and, in an FP8 sweep, to our bfloat16 forward) and the forward
    error against the first base that ran. An FP8 sweep's only base is the reference on the
    dequantised inputs (cuDNN writes e4m3), and the bfloat16 row is compared with nothing.
    Then, where a peer ran, the best peer per direction (:func:`bench_peers.best_peers`, from
    the rows' ``finite`` and ``fa4_rule``)."""
    cudnn = next((r for r in rows if r["impl"] == "cudnn" and r["fwd_ms"] is not None), None)
    bf16 = next((r for r in rows if r["impl"] == "jax-fa4-bf16" and r["fwd_ms"] is not None),
                None)
    fp8 = any(r["dtype"] == FP8 for r in rows)
    bases = ("reference",) if fp8 else ERR_BASES
    base_impl = next((name for name in bases if name in outputs), None)
    for row in rows:
        if row["fwd_ms"] is None:
            continue
        if cudnn is not None:
            row["fwd_ratio_vs_cudnn"] = cudnn["fwd_ms"] / row["fwd_ms"]
            if row["bwd_tflops"] is not None and cudnn["bwd_tflops"] is not None:
                row["bwd_ratio_vs_cudnn"] = row["bwd_tflops"] / cudnn["bwd_tflops"]
        if bf16 is not None and row["dtype"] == FP8:
            row["fwd_ratio_vs_bf16"] = bf16["fwd_ms"] / row["fwd_ms"]
        if base_impl is not None and row["impl"] in outputs and not (
                fp8 and row["dtype"] != FP8):
            base = outputs[base_impl].astype(jnp.float32)
            diff = outputs[row["impl"]].astype(jnp.float32) - base
            row["fwd_rel_err"] = float(jnp.linalg.norm(diff) / jnp.linalg.norm(base))
            row["fwd_rel_err_vs"] = base_impl
    bench_peers.best_peers(rows)


@dataclasses.dataclass
class BenchContext:
    args: argparse.Namespace
    device: jax.Device
    kernel: str | None
    dtype: Any
    dtype_name: str
    peers: dict[str, bench_peers.Peer] = dataclasses.field(default_factory=dict)


def run_sweep(shapes: Sequence[Shape], ctx: BenchContext,
              on_shape_done: Callable[[list[Row], list[Row]], None] | None = None
              ) -> tuple[list[Row], list[Row]]:
    """Every (shape, implementation) row, shape by shape, with progress on stderr; and the
    timing record of each shape (``time_shape``; its ``shape`` names it).

    Per shape, every implementation is compiled first, then all their programs are timed
    together in one rotation. ``on_shape_done(rows, records)`` is called after each shape (to
    save partial results: a run stopped early keeps what it measured)."""
    rows: list[Row] = []
    records: list[Row] = []
    key = jax.random.key(ctx.args.seed)
    impls = ctx.args.impls
    with tqdm(total=len(shapes) * len(impls), desc="bench", unit="row", file=sys.stderr,
              disable=None) as bar:
        for shape in shapes:
            key, sub = jax.random.split(key)
            arg_sets = None
            chain = chain_length(shape, jnp.dtype(ctx.dtype).itemsize, ctx.device.platform)
            fp8_sets = None
            if any(static_skip_reason(i, shape, ctx.device.platform, ctx.args, ctx.peers)
                   is None for i in impls):
                arg_sets = make_inputs(shape, ctx.dtype, sub, chain)
                if ctx.dtype_name == FP8:
                    fp8_sets = fp8_input_sets(arg_sets)
            label = bench_report.shape_label(dataclasses.asdict(shape))
            prepared: list[Prepared] = []
            for impl in impls:
                bar.set_postfix_str(f"compile {impl} {label}")
                if arg_sets is None:
                    row = _empty_row(impl, shape, ctx.dtype_name)
                    row["skipped"] = static_skip_reason(impl, shape, ctx.device.platform,
                                                        ctx.args, ctx.peers)
                    prepared.append(Prepared(row, {}))
                else:
                    sets = fp8_sets if row_dtype(impl, ctx.dtype_name) == FP8 else arg_sets
                    prepared.append(prepare_impl(impl, shape, sets, chain, ctx))
                bar.update()
            bar.set_postfix_str(f"time {label}")
            record = time_shape(prepared, ctx)
            if record is not None:
                records.append({"shape": label, **record})
            shape_rows = [p.row for p in prepared]
            ran = [p for p in prepared if p.out is not None and p.row["fwd_ms"] is not None]
            if ctx.dtype_name != FP8:
                bench_peers.check_slice(shape, shape_rows,
                                        {p.row["impl"]: (p.out, p.grads) for p in ran},
                                        arg_sets[0] if arg_sets else (),
                                        ctx.args.reference_max_gb)
            compare_rows(shape_rows, {p.row["impl"]: p.out for p in ran})
            for row in shape_rows:
                bar.write(f"[{len(rows) + 1}/{bar.total}] {bench_report.row_line(row)}")
                rows.append(row)
            del arg_sets, fp8_sets, prepared
            if on_shape_done is not None:
                on_shape_done(rows, records)
    return rows, records


TIMING_METHOD = ("per shape, every implementation is compiled first; then all their programs "
                 "(inference forward, training forward, forward+backward) are timed in one "
                 "rotation: rounds of one program after another, one untimed round first, the "
                 "median per program kept")


def main(argv: Sequence[str] | None = None) -> int:
    """The sweep; ``merge A.json B.json --out C.json`` joins result files instead."""
    argv_list = list(sys.argv[1:] if argv is None else argv)
    if argv_list[:1] == ["merge"]:
        return bench_report.merge_main(argv_list[1:])
    start = time.perf_counter()
    args = parse_args(argv_list)
    shapes = custom_shapes(args) if args.shapes == "custom" else list(preset_shapes(args.shapes))
    device = jax.devices()[0]
    peers = bench_peers.load_peers()
    ctx = BenchContext(args, device, device_kernel(device), DTYPES[args.dtype], args.dtype,
                       peers)
    print(f"jax {jax.__version__} on {device.device_kind} ({device.platform}); "
          f"{len(shapes)} shapes x {len(args.impls)} impls, {args.dtype}", flush=True)
    out = bench_report.result_path(args.out, device.device_kind)
    record = bench_env.RunRecord(device, bench_report.run_command("jax_fa4.tools.bench", argv))

    def write(rows: list[Row], records: list[Row], complete: bool) -> None:
        report = {
            **record.header(complete),
            "settings": {"shapes": args.shapes, "dtype": args.dtype, "impls": args.impls,
                         "repeats": args.repeats, "target_ms": args.target_ms,
                         "fwd_only": args.fwd_only, "rotation_bytes": ROTATION_BYTES,
                         "backward_flop_factor": BACKWARD_FLOP_FACTOR},
            "bwd_method": BWD_METHOD,
            "bwd_method_text": BWD_METHOD_TEXT,
            "peers": {impl: {**peer.record(), "timed": impl in args.impls}
                      for impl, peer in peers.items()},
            "timing": {"method": TIMING_METHOD, "rotation": TIMING_ROTATION,
                       "shapes": records},
            "complete": complete,  # False while the sweep runs: a stopped run keeps its rows
            "wall_s": round(time.perf_counter() - start, 1),
            "rows": rows,
        }
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(report, indent=1) + "\n")
        tmp.replace(out)

    rows, records = run_sweep(
        shapes, ctx, on_shape_done=lambda rows, records: write(rows, records, complete=False))
    write(rows, records, complete=True)
    written = str(out)
    if args.plot:
        png = out.with_suffix(".png")
        today = datetime.date.today().isoformat()
        bench_report.plot(rows, png, f"{device.device_kind}, {args.dtype}, {today}")
        written += f" and {png}"
    bench_report.print_table(rows)
    bench_report.print_bar(rows)
    print(f"wrote {written}; total wall time {time.perf_counter() - start:.1f} s")
    return 0



if __name__ == "__main__":
    raise SystemExit(main())
