"""Attention benchmark: jax-fa4 against cuDNN, XLA and the pure-JAX reference, in one process.

Usage::

    python -m jax_fa4.bench                      # default sweep (anchor shapes, GQA, latency)
    python -m jax_fa4.bench --shapes anchors     # every shape of the peers' anchor tables
    python -m jax_fa4.bench --shapes tiny        # a few small shapes (CPU smoke run)
    python -m jax_fa4.bench --shapes custom --B 2 --Sq 4096 --H 32 --Hkv 8 --D 128 \\
        --causal no,yes --window none,none --window 512,0
    python -m jax_fa4.bench --impls jax-fa4,cudnn --dtype fp16 --fwd-only --out /tmp/r.json

Implementations (``--impls``), each a row per shape:

* ``jax-fa4``: ``jax_fa4.flash_attention(implementation=None)``. On a GPU with an FA4 kernel
  family (sm90 on compute capability 9.x, sm100 on 10.x) the forced kernel is lowered first; if
  that raises, the row is skipped with the error (the library would fall back to the reference,
  which is not what the row claims to measure). ``resolved_impl`` says what ``None`` picked,
  found by comparing its lowered program with the forced ones'.
* ``cudnn`` / ``xla``: ``jax.nn.dot_product_attention(implementation=...)``, GPU only. Skipped
  when ``Dv != D`` (it needs equal head dims) and for a causal or windowed mask with
  ``Sq != Sk`` (it aligns masks top-left, FA4 bottom-right: a different function).
* ``reference``: ``flash_attention(implementation="reference")``, skipped when its
  ``B·H·Sq·Sk`` float32 scores would exceed ``--reference-max-gb`` (XLA: ``--xla-max-gb``).

Method: every function is jitted and compiled once (compile time goes to ``compile_s``), warmed
up, then timed by wall clock as the median of ``--repeats`` rounds of back-to-back dispatches (as
many as fill ``--target-ms``; one more untimed round first; forward and forward+backward rounds
alternate, so drifting clocks or load bias their difference little), synchronised with
``block_until_ready`` at the end of each round (after every call on the CPU, whose executions may
overlap). Dispatches rotate over several random input sets, enough that together they exceed
twice the H200's 60 MB L2, so small shapes are not timed out of cache. On a GPU, a shape whose
device time would be short next to Python's dispatch (under ~200 µs at the measured ceilings) is
timed as one program that runs ``calls_per_dispatch`` calls on distinct input sets, each call
waiting on the previous one's outputs through an optimization barrier (no overlap, no fusion
across calls); times are per attention call. Forward+backward is ``jax.vjp`` with a random
cotangent, i.e. the gradient of ``sum(out * do)`` with respect to q, k, v, returning ``out`` too
(a training step uses it); ``bwd_ms = fwdbwd_ms - fwd_ms``. ``skipped`` holds why a row did not
run; a row whose backward alone failed keeps its forward figures and says ``backward: ...``.

FLOPs (the anchors' convention): forward ``2·B·H·Sq·Sk·(D+Dv)`` times the fraction of visible
(query, key) pairs: exactly 1/2 for causal with ``Sq == Sk`` and no window, otherwise counted
exactly from FA4's mask rule; backward is 2.5 × forward. ``fwd_tbps`` is the bytes of q, k, v
and out over the forward time (the figure that matters for decode, ``Sq = 1``).

Memory: ``xla_mem_bytes`` is XLA's compile-time footprint of the forward+backward program
(arguments + outputs + temporaries); ``peak_mem_bytes`` is the device allocator's high-water mark
during one forward+backward call minus the bytes in use before it. The allocator's peak cannot be
reset, so before the call a ballast buffer lifts the bytes in use to the old peak, making any new
allocation a new peak (None on the CPU, or when the ballast would not fit).

``fwd_rel_err`` compares each row's forward output with that of the reference (or cuDNN, or XLA:
``fwd_rel_err_vs`` names it) on the same inputs: ``|out - base| / |base|``.

Output: ``benchmarks/results/<gpu-slug>-<YYYY-MM-DD>.json`` (``--out`` overrides), a PNG of
TFLOP/s against sequence length with the same stem, and a table on stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import itertools
import json
import math
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import jax_fa4

Window = tuple[int | None, int | None]
Row = dict[str, Any]
Inputs = tuple[jax.Array, jax.Array, jax.Array, jax.Array]  # q, k, v, do

IMPLS = ("jax-fa4", "cudnn", "xla", "reference")
GPU_ONLY = ("cudnn", "xla")
#: Rotate input sets until they exceed twice the H200's 60 MB L2.
ROTATION_BYTES = 2 * 60 * 10**6
MAX_INPUT_SETS = 64
MAX_ITERS = 2000
#: Ceilings measured on an H200 (bf16 matrix product, device copy), for the chain estimate.
CEILING_FLOPS = 790e12
CEILING_BYTES = 4.3e12
#: On a GPU, one dispatch runs enough calls for this much device time (at the ceilings).
CHAIN_TARGET_S = 200e-6
MAX_CHAIN = 16
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}
#: FA4 kernel family per compute-capability major.
KERNEL_FOR_CC_MAJOR = {"9": "sm90", "10": "sm100"}
#: Order in which a row's forward output is compared: the first that ran is the base.
ERR_BASES = ("reference", "cudnn", "xla")
BACKWARD_FLOP_FACTOR = 2.5

#: Keys of every row, in order (``tests/test_bench.py`` checks them).
ROW_KEYS = (
    "impl", "resolved_impl", "dtype", "B", "Sq", "Sk", "H", "Hkv", "D", "Dv", "causal", "window",
    "fwd_flops", "fwd_ms", "fwdbwd_ms", "bwd_ms", "fwd_us", "bwd_us", "fwd_tflops", "bwd_tflops",
    "fwd_tbps", "fwd_ratio_vs_cudnn", "bwd_ratio_vs_cudnn", "fwd_spread", "fwdbwd_spread",
    "iters", "calls_per_dispatch", "input_sets", "compile_s", "peak_mem_bytes", "xla_mem_bytes",
    "custom_calls", "fwd_rel_err", "fwd_rel_err_vs", "skipped",
)


@dataclasses.dataclass(frozen=True)
class Shape:
    """One attention problem: q (B, Sq, H, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv)."""

    B: int
    Sq: int
    Sk: int
    H: int
    Hkv: int
    D: int
    Dv: int
    causal: bool
    window: Window = (None, None)

    @property
    def mask_window(self) -> Window:
        """The (left, right) window FA4 applies: causal forces right = 0."""
        return (self.window[0], 0) if self.causal else self.window

    @property
    def masked(self) -> bool:
        return self.mask_window != (None, None)

    def visible_fraction(self) -> float:
        """Fraction of (query, key) pairs FA4's mask keeps (bottom-right aligned)."""
        left, right = self.mask_window
        if (left, right) == (None, None):
            return 1.0
        if left is None and right == 0 and self.Sq == self.Sk:
            return 0.5  # the anchors' convention for causal: S²/2, not S(S+1)/2
        diag = np.arange(self.Sq, dtype=np.int64) + (self.Sk - self.Sq)
        lo = np.zeros_like(diag) if left is None else np.maximum(diag - left, 0)
        hi = np.full_like(diag, self.Sk - 1) if right is None else np.minimum(diag + right,
                                                                             self.Sk - 1)
        return float(np.maximum(hi - lo + 1, 0).sum()) / (self.Sq * self.Sk)

    def fwd_flops(self) -> float:
        return 2.0 * self.B * self.H * self.Sq * self.Sk * (self.D + self.Dv) * \
            self.visible_fraction()

    def io_bytes(self, itemsize: int) -> int:
        """Bytes of q, k, v read and out written, once each."""
        q = self.B * self.Sq * self.H * self.D
        kv = self.B * self.Sk * self.Hkv * (self.D + self.Dv)
        out = self.B * self.Sq * self.H * self.Dv
        return (q + kv + out) * itemsize

    def scores_bytes(self) -> int:
        """Bytes of the B·H·Sq·Sk float32 scores a materialising implementation holds."""
        return self.B * self.H * self.Sq * self.Sk * 4


def _mha(B: int, S: int, H: int, D: int, causal: bool) -> Shape:
    return Shape(B, S, S, H, H, D, D, causal)


#: The 10 shapes of the anchors README's main table (B, S, H, D, causal), in its order.
ANCHOR_SHAPES = tuple(_mha(B, S, H, D, c) for B, S, H, D in (
    (4, 8192, 32, 64), (16, 2048, 16, 128), (4, 8192, 16, 128), (2, 16384, 16, 128),
    (4, 8192, 8, 256)) for c in (False, True))
GQA_SHAPES = (Shape(4, 8192, 8192, 32, 8, 128, 128, False),
              Shape(4, 8192, 8192, 32, 8, 128, 128, True))
#: The anchors README's "more shapes" table.
ANCHOR_EXTRA_SHAPES = GQA_SHAPES + (
    Shape(4, 8192, 8192, 16, 16, 96, 96, False), Shape(4, 8192, 8192, 16, 16, 96, 96, True),
    Shape(4, 8192, 8192, 16, 16, 192, 128, False), Shape(4, 8192, 8192, 16, 16, 192, 128, True),
    Shape(64, 1, 8192, 32, 8, 128, 128, False), Shape(128, 1, 32768, 32, 8, 128, 128, False),
)
LATENCY_SHAPES = (Shape(1, 128, 128, 16, 16, 128, 128, False),
                  Shape(64, 1, 8192, 32, 8, 128, 128, False))
PRESETS: dict[str, tuple[Shape, ...]] = {
    "default": ANCHOR_SHAPES + GQA_SHAPES + LATENCY_SHAPES,
    "anchors": ANCHOR_SHAPES + ANCHOR_EXTRA_SHAPES,
    "tiny": (
        _mha(1, 64, 2, 32, False), _mha(1, 64, 2, 32, True),
        _mha(1, 128, 2, 32, False), _mha(1, 128, 2, 32, True),
        Shape(1, 128, 128, 4, 2, 32, 32, True, (32, None)),
        Shape(4, 1, 1024, 4, 2, 32, 32, False),
    ),
}
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
    unknown = [x for x in impls if x not in IMPLS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown implementation(s) {unknown}; known: {IMPLS}")
    return impls


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jax_fa4.bench",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", choices=(*PRESETS, "custom"), default="default",
                   help="shape preset, or custom from the shape flags below")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--impls", type=_impl_list, default=list(IMPLS),
                   help=f"comma-separated subset of {','.join(IMPLS)}")
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
    timing.add_argument("--repeats", type=int, default=5, help="rounds; the median is kept")
    timing.add_argument("--target-ms", type=float, default=40.0,
                        help="wall time one round aims at (sets the calls per round)")
    timing.add_argument("--fwd-only", action="store_true", help="skip forward+backward")
    timing.add_argument("--reference-max-gb", type=float, default=4.0,
                        help="skip the reference above this many GB of float32 scores")
    timing.add_argument("--xla-max-gb", type=float, default=20.0,
                        help="skip XLA above this many GB of float32 scores")
    timing.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default: benchmarks/results/<gpu-slug>-<date>.json); the "
                        "PNG goes next to it")
    args = p.parse_args(argv)
    shape_flags = ("B", "Sq", "Sk", "H", "Hkv", "D", "Dv", "causal", "window")
    if args.shapes != "custom":
        given = [f"--{n}" for n in shape_flags if getattr(args, n) is not None]
        if given:
            p.error(f"{', '.join(given)} need --shapes custom")
    if args.repeats < 1 or args.target_ms <= 0:
        p.error("--repeats must be >= 1 and --target-ms > 0")
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
def _fa4_fn(shape: Shape, implementation: str | None) -> Callable[..., jax.Array]:
    def attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return jax_fa4.flash_attention(q, k, v, causal=shape.causal, window_size=shape.window,
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


def static_skip_reason(impl: str, shape: Shape, platform: str,
                       args: argparse.Namespace) -> str | None:
    """Why ``impl`` does not run ``shape`` here, decided before compiling (None: try it)."""
    gb = shape.scores_bytes() / 1e9
    if impl in GPU_ONLY:
        if platform != "gpu":
            return f"{impl} runs only on a CUDA GPU (device platform is {platform})"
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
    if isinstance(err, SkipRow):
        return str(err)
    lines = [ln for ln in str(err).splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:400]


_CUSTOM_CALL = re.compile(r'custom_call @([\w$.\-]+)|call_target_name = "([^"]+)"')


def custom_call_targets(hlo_text: str) -> dict[str, int]:
    """Custom-call targets in a lowered module and how often each occurs."""
    counts: dict[str, int] = {}
    for m in _CUSTOM_CALL.finditer(hlo_text):
        name = m.group(1) or m.group(2)
        counts[name] = counts.get(name, 0) + 1
    return counts


# -- measuring ---------------------------------------------------------------------------------
def chain_length(shape: Shape, itemsize: int, platform: str) -> int:
    """Attention calls per dispatch: 1, except on a GPU for shapes whose device time (by a lower
    bound from the ceilings) is short enough that Python's dispatch would be timed instead."""
    if platform != "gpu":
        return 1
    floor_s = max(shape.fwd_flops() / CEILING_FLOPS, shape.io_bytes(itemsize) / CEILING_BYTES)
    return max(1, min(MAX_CHAIN, math.ceil(CHAIN_TARGET_S / max(floor_s, 1e-9))))


def make_inputs(shape: Shape, dtype: Any, key: jax.Array, multiple_of: int) -> list[Inputs]:
    """Random input sets, enough that together they exceed ``ROTATION_BYTES`` (at least 2), and
    a multiple of ``multiple_of``."""
    dims = ((shape.B, shape.Sq, shape.H, shape.D), (shape.B, shape.Sk, shape.Hkv, shape.D),
            (shape.B, shape.Sk, shape.Hkv, shape.Dv), (shape.B, shape.Sq, shape.H, shape.Dv))
    set_bytes = sum(math.prod(d) for d in dims) * jnp.dtype(dtype).itemsize
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


def time_programs(programs: Sequence[Program], *, repeats: int, target_s: float,
                  sync_each: bool) -> list[Timing]:
    """Median wall time per attention call of each program.

    Rounds of the programs alternate (forward, forward+backward, forward, ...), so a drift in
    clocks or load biases their difference as little as possible; a first untimed round of each
    settles clocks, then ``repeats`` rounds of each are timed. Each round starts one program
    later than the one before (round r runs programs r, r+1, ... mod their number): the program
    that runs right after another one's heavy round (clocks pulled down by power, its inputs out
    of L2) is a different one every round, not always the first (on the H200 a backward
    kernel timed first in every round measured 7% slower, with 4x the spread, than the same
    kernel timed second).
    """
    iters = [_round_iters(p, target_s) for p in programs]
    samples: list[list[float]] = [[] for _ in programs]
    count = len(programs)
    for r in range(repeats + 1):
        for j in range(count):
            i = (r + j) % count
            ms = _round_ms(programs[i], iters[i], r * iters[i], sync_each)
            if r:
                samples[i].append(ms)
    timings = []
    for n, xs in zip(iters, samples):
        med = statistics.median(xs)
        timings.append(Timing(med, (max(xs) - min(xs)) / med, n))
    return timings


def peak_bytes(device: jax.Device, run: Callable[[], None], need: int) -> int | None:
    """Allocator bytes in use at the peak of ``run()`` minus those in use before it.

    The high-water mark cannot be reset, so a ballast buffer first lifts the bytes in use to the
    old mark; ``need`` (bytes the run may allocate) decides whether that fits.
    """
    stats = device.memory_stats() or {}
    if "peak_bytes_in_use" not in stats:
        run()
        return None
    gap = stats["peak_bytes_in_use"] - stats["bytes_in_use"]
    ballast = None
    if gap > 0 and stats["peak_bytes_in_use"] + need + 2**30 < stats.get("bytes_limit", 0):
        try:  # the allocator may still refuse (fragmentation): then measure without it
            ballast = jnp.zeros((gap,), jnp.uint8, device=device)
            ballast.block_until_ready()
        except jax.errors.JaxRuntimeError:
            ballast = None
    stats = device.memory_stats()
    base, mark = stats["bytes_in_use"], stats["peak_bytes_in_use"]
    run()
    new_peak = device.memory_stats()["peak_bytes_in_use"]
    exact = ballast is not None or gap <= 0 or new_peak > mark
    del ballast
    return new_peak - base if exact else None


def _empty_row(impl: str, shape: Shape, dtype_name: str) -> Row:
    row: Row = dict.fromkeys(ROW_KEYS)
    row.update(impl=impl, dtype=dtype_name, B=shape.B, Sq=shape.Sq, Sk=shape.Sk, H=shape.H,
               Hkv=shape.Hkv, D=shape.D, Dv=shape.Dv, causal=shape.causal,
               window=list(shape.window), fwd_flops=shape.fwd_flops())
    return row


def _lower(fn: Callable[..., jax.Array], inputs: Inputs, fwd_only: bool) -> tuple[Any, Any]:
    """Lowered forward, and lowered forward+backward or the error that raised (None: fwd only)."""
    q, k, v, do = inputs
    fwd = jax.jit(fn).lower(q, k, v)
    if fwd_only:
        return fwd, None
    try:
        return fwd, jax.jit(_fwd_bwd(fn)).lower(q, k, v, do)
    except Exception as err:
        return fwd, err


def lower_impl(impl: str, shape: Shape, kernel: str | None, inputs: Inputs, fwd_only: bool
               ) -> tuple[Callable[..., jax.Array], Any, Any, str | None]:
    """The attention function of ``impl``, its ``_lower``, and (jax-fa4) what it resolved to.

    For jax-fa4 on a GPU with a kernel family, the forced kernel is lowered first: a forward that
    cannot lower raises :class:`SkipRow`, a backward that cannot lower replaces the
    forward+backward by its error.
    """
    if impl != "jax-fa4":
        fn = _fa4_fn(shape, "reference") if impl == "reference" else _jax_nn_fn(shape, impl)
        return (fn, *_lower(fn, inputs, fwd_only), None)
    forced_text, forced_bwd_error = None, None
    if kernel is not None:
        try:
            forced_fwd, forced_fb = _lower(_fa4_fn(shape, kernel), inputs, fwd_only)
        except Exception as err:
            raise SkipRow(_error_text(err)) from err
        forced_text = forced_fwd.as_text()
        if isinstance(forced_fb, Exception):
            forced_bwd_error = SkipRow(_error_text(forced_fb))
    fn = _fa4_fn(shape, None)
    fwd, fb = _lower(fn, inputs, fwd_only)
    text = fwd.as_text()
    if text == forced_text:
        resolved = kernel
    elif text == jax.jit(_fa4_fn(shape, "reference")).lower(*inputs[:3]).as_text():
        resolved = "reference"
    else:
        resolved = "unknown"
    return fn, fwd, forced_bwd_error or fb, resolved


def bench_impl(impl: str, shape: Shape, arg_sets: list[Inputs], chain: int, ctx: BenchContext
               ) -> tuple[Row, jax.Array | None]:
    """One row, and the forward output on the first input set (None when skipped).

    A backward that cannot run leaves the forward figures and says so in ``skipped``.
    """
    row = _empty_row(impl, shape, ctx.dtype_name)
    reason = static_skip_reason(impl, shape, ctx.device.platform, ctx.args)
    if reason is not None:
        row["skipped"] = reason
        return row, None
    fwd_sets = [a[:3] for a in arg_sets]
    t0 = time.perf_counter()
    try:
        fn, fwd_l, fb_l, row["resolved_impl"] = lower_impl(impl, shape, ctx.kernel, arg_sets[0],
                                                           ctx.args.fwd_only)
        fwd = fwd_l.compile()
        fwd_program = make_program(fn, fwd, fwd_sets, chain)
    except Exception as err:
        row["skipped"] = _error_text(err)
        return row, None
    fb, fb_program = None, None
    try:
        if isinstance(fb_l, Exception):
            raise fb_l
        if fb_l is not None:
            fb = fb_l.compile()
            fb_program = make_program(_fwd_bwd(fn), fb, arg_sets, chain)
    except Exception as err:
        fb = None
        row["skipped"] = f"backward: {_error_text(err)}"
    row["compile_s"] = round(time.perf_counter() - t0, 3)
    row["custom_calls"] = custom_call_targets((fb_l if fb is not None else fwd_l).as_text())
    mem = (fb or fwd).memory_analysis()
    if mem is not None:
        row["xla_mem_bytes"] = (mem.argument_size_in_bytes + mem.output_size_in_bytes
                                + mem.temp_size_in_bytes - mem.alias_size_in_bytes)
    row.update(input_sets=len(arg_sets), calls_per_dispatch=chain)
    timing = dict(repeats=ctx.args.repeats, target_s=ctx.args.target_ms / 1e3,
                  sync_each=ctx.device.platform == "cpu")
    full, full_args = (fb, arg_sets[0]) if fb is not None else (fwd, fwd_sets[0])
    try:
        row["peak_mem_bytes"] = peak_bytes(
            ctx.device, lambda: jax.block_until_ready(full(*full_args)),
            row["xla_mem_bytes"] or 0)
        t_fwd, *t_fb = time_programs([fwd_program] + ([fb_program] if fb_program else []),
                                     **timing)
        row.update(fwd_ms=t_fwd.ms, fwd_spread=round(t_fwd.spread, 4), iters=t_fwd.iters)
        if t_fb:
            row.update(fwdbwd_ms=t_fb[0].ms, fwdbwd_spread=round(t_fb[0].spread, 4))
        out = fwd(*fwd_sets[0])
    except Exception as err:
        row["skipped"] = _error_text(err)
        row.update(fwd_ms=None, fwdbwd_ms=None)
        return row, None
    _derive(row, shape, jnp.dtype(ctx.dtype).itemsize)
    return row, out


def _derive(row: Row, shape: Shape, itemsize: int) -> None:
    """Times in µs, TFLOP/s and TB/s from the measured milliseconds."""
    flops = row["fwd_flops"]
    row["fwd_us"] = row["fwd_ms"] * 1e3
    row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
    row["fwd_tbps"] = shape.io_bytes(itemsize) / row["fwd_ms"] / 1e9
    if row["fwdbwd_ms"] is not None:
        row["bwd_ms"] = row["fwdbwd_ms"] - row["fwd_ms"]
        row["bwd_us"] = row["bwd_ms"] * 1e3
        if row["bwd_ms"] > 0:
            row["bwd_tflops"] = BACKWARD_FLOP_FACTOR * flops / row["bwd_ms"] / 1e9


def compare_rows(rows: list[Row], outputs: dict[str, jax.Array]) -> None:
    """Fill the ratios to cuDNN and the forward error against the first base that ran."""
    cudnn = next((r for r in rows if r["impl"] == "cudnn" and r["fwd_ms"] is not None), None)
    base_impl = next((name for name in ERR_BASES if name in outputs), None)
    for row in rows:
        if row["fwd_ms"] is None:
            continue
        if cudnn is not None:
            row["fwd_ratio_vs_cudnn"] = cudnn["fwd_ms"] / row["fwd_ms"]
            if row["bwd_tflops"] is not None and cudnn["bwd_tflops"] is not None:
                row["bwd_ratio_vs_cudnn"] = row["bwd_tflops"] / cudnn["bwd_tflops"]
        if base_impl is not None and row["impl"] in outputs:
            base = outputs[base_impl].astype(jnp.float32)
            diff = outputs[row["impl"]].astype(jnp.float32) - base
            row["fwd_rel_err"] = float(jnp.linalg.norm(diff) / jnp.linalg.norm(base))
            row["fwd_rel_err_vs"] = base_impl


@dataclasses.dataclass
class BenchContext:
    args: argparse.Namespace
    device: jax.Device
    kernel: str | None
    dtype: Any
    dtype_name: str


def run_sweep(shapes: Sequence[Shape], ctx: BenchContext,
              on_shape_done: Callable[[list[Row]], None] | None = None) -> list[Row]:
    """Every (shape, implementation) row, shape by shape, with progress on stderr.

    ``on_shape_done(rows)`` is called with the rows so far after each shape (to save partial
    results: a run stopped early keeps what it measured)."""
    rows: list[Row] = []
    key = jax.random.key(ctx.args.seed)
    impls = ctx.args.impls
    with tqdm(total=len(shapes) * len(impls), desc="bench", unit="row", file=sys.stderr,
              disable=None) as bar:
        for shape in shapes:
            key, sub = jax.random.split(key)
            arg_sets = None
            chain = chain_length(shape, jnp.dtype(ctx.dtype).itemsize, ctx.device.platform)
            if any(static_skip_reason(i, shape, ctx.device.platform, ctx.args) is None
                   for i in impls):
                arg_sets = make_inputs(shape, ctx.dtype, sub, chain)
            shape_rows, outputs = [], {}
            for impl in impls:
                bar.set_postfix_str(f"{impl} {_shape_label(dataclasses.asdict(shape))}")
                if arg_sets is None:
                    row, out = _empty_row(impl, shape, ctx.dtype_name), None
                    row["skipped"] = static_skip_reason(impl, shape, ctx.device.platform,
                                                        ctx.args)
                else:
                    row, out = bench_impl(impl, shape, arg_sets, chain, ctx)
                if out is not None:
                    outputs[impl] = out
                shape_rows.append(row)
                bar.update()
            compare_rows(shape_rows, outputs)
            for row in shape_rows:
                bar.write(f"[{len(rows) + 1}/{bar.total}] {_row_line(row)}")
                rows.append(row)
            del arg_sets, outputs
            if on_shape_done is not None:
                on_shape_done(rows)
    return rows


# -- reporting ---------------------------------------------------------------------------------
def _shape_label(r: dict[str, Any]) -> str:
    """Compact shape text of a row (or of ``dataclasses.asdict(shape)``)."""
    heads = f"{r['H']}" if r["H"] == r["Hkv"] else f"{r['H']}/{r['Hkv']}"
    dims = f"{r['D']}" if r["D"] == r["Dv"] else f"{r['D']}/{r['Dv']}"
    seq = f"{r['Sq']}" if r["Sq"] == r["Sk"] else f"{r['Sq']}x{r['Sk']}"
    left, right = r["window"]
    parts = [f"B{r['B']}", f"S{seq}", f"H{heads}", f"D{dims}"]
    parts += ["causal"] if r["causal"] else []
    parts += [] if (left, right) == (None, None) else [f"win{left},{right}"]
    return " ".join(parts)


def _fmt_time(ms: float | None) -> str:
    if ms is None:
        return "-"
    return f"{ms * 1e3:.1f}us" if ms < 1 else f"{ms:.3f}ms"


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _row_line(row: Row) -> str:
    head = f"{row['impl']:>9} {_shape_label(row):<34}"
    if row["skipped"] and row["fwd_ms"] is None:
        return f"{head} skipped: {row['skipped']}"
    line = (f"{head} fwd {_fmt_time(row['fwd_ms'])} {_fmt(row['fwd_tflops'], '.3g')} TF/s  "
            f"bwd {_fmt_time(row['bwd_ms'])} {_fmt(row['bwd_tflops'], '.3g')} TF/s")
    return line + (f"  ({row['skipped']})" if row["skipped"] else "")


def print_table(rows: list[Row]) -> None:
    """A plain-text table of every row (times in µs below 1 ms)."""
    header = ("shape", "impl", "fwd", "fwd TF/s", "bwd", "bwd TF/s", "x cuDNN f/b", "err",
              "peak MiB", "skipped")
    lines = [header]
    for r in rows:
        impl = r["impl"] + (f" ({r['resolved_impl']})" if r["resolved_impl"] else "")
        ratio = ("-" if r["fwd_ratio_vs_cudnn"] is None else
                 f"{r['fwd_ratio_vs_cudnn']:.2f}/{_fmt(r['bwd_ratio_vs_cudnn'], '.2f')}")
        peak = None if r["peak_mem_bytes"] is None else r["peak_mem_bytes"] / 2**20
        lines.append((_shape_label(r), impl, _fmt_time(r["fwd_ms"]), _fmt(r["fwd_tflops"], ".3g"),
                      _fmt_time(r["bwd_ms"]), _fmt(r["bwd_tflops"], ".3g"), ratio,
                      _fmt(r["fwd_rel_err"], ".1e"), _fmt(peak, ".0f"),
                      (r["skipped"] or "")[:70]))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for n, line in enumerate(lines):
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))


def plot(rows: list[Row], path: Path, title: str) -> None:
    """TFLOP/s against key length per implementation: forward and backward panels.

    Colour: implementation; marker: head dims; hollow and dashed: causal. A line joins rows that
    differ only in batch and length (decode rows, Sq = 1, apart).
    """
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    colors = {"jax-fa4": "tab:red", "cudnn": "tab:green", "xla": "tab:blue",
              "reference": "tab:gray"}
    measured = [r for r in rows if r["fwd_tflops"] is not None]
    head_dims = sorted({(r["D"], r["Dv"]) for r in measured})
    markers = "os^DvPX*"
    marker_of = {hd: markers[i % len(markers)] for i, hd in enumerate(head_dims)}
    fig = Figure(figsize=(13, 5.5), layout="constrained")
    axes = fig.subplots(1, 2, sharex=True)
    for ax, key, name in ((axes[0], "fwd_tflops", "forward"), (axes[1], "bwd_tflops", "backward")):
        lines: dict[tuple, list[Row]] = {}
        for r in measured:
            if r[key] is not None:
                line = (r["impl"], r["H"], r["Hkv"], r["D"], r["Dv"], r["causal"],
                        tuple(r["window"]), r["Sq"] == 1)
                lines.setdefault(line, []).append(r)
        for members in lines.values():
            members.sort(key=lambda r: r["Sk"])
            first = members[0]
            color = colors.get(first["impl"], "black")
            ax.plot([r["Sk"] for r in members], [r[key] for r in members], color=color,
                    linestyle="--" if first["causal"] else "-",
                    marker=marker_of[(first["D"], first["Dv"])], markersize=7,
                    markerfacecolor="none" if first["causal"] else color)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length Sk")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
        if not lines:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center")
    handles = [Line2D([], [], color=c, label=i) for i, c in colors.items()
               if any(r["impl"] == i for r in measured)]
    handles += [Line2D([], [], color="black", linestyle="none", marker=marker_of[hd],
                       label=f"D={hd[0]}" + (f"/Dv={hd[1]}" if hd[0] != hd[1] else ""))
                for hd in head_dims]
    handles.append(Line2D([], [], color="black", marker="o", markerfacecolor="none",
                          linestyle="--", label="causal"))
    axes[1].legend(handles=handles, loc="best", fontsize=8)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def driver_version() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


def versions() -> dict[str, Any]:
    """Versions of the stack, each probe guarded."""
    found: dict[str, Any] = {"python": sys.version.split()[0], "jax": jax.__version__}
    for dist in ("jaxlib", "jax-fa4", "jax-cuda13-plugin", "jax-cuda12-plugin",
                 "nvidia-cudnn-cu13", "nvidia-cudnn-cu12", "nvidia-cutlass-dsl"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    found["jax_fa4"] = jax_fa4.__version__
    try:
        from jax._src.lib import cuda_versions
    except ImportError:
        cuda_versions = None
    if cuda_versions is not None:
        for name, probe in (("cudnn", "cudnn_get_version"),
                            ("cuda_runtime", "cuda_runtime_get_version"),
                            ("cuda_driver", "cuda_driver_get_version")):
            try:
                found[name] = getattr(cuda_versions, probe)()
            except Exception:  # a missing or failing probe only leaves the entry out
                pass
    return found


def main(argv: Sequence[str] | None = None) -> int:
    start = time.perf_counter()
    args = parse_args(argv)
    shapes = custom_shapes(args) if args.shapes == "custom" else list(PRESETS[args.shapes])
    device = jax.devices()[0]
    ctx = BenchContext(args, device, device_kernel(device), DTYPES[args.dtype], args.dtype)
    print(f"jax {jax.__version__} on {device.device_kind} ({device.platform}); "
          f"{len(shapes)} shapes x {len(args.impls)} impls, {args.dtype}", flush=True)
    today = datetime.date.today().isoformat()
    out = args.out or Path("benchmarks/results") / f"{_slug(device.device_kind)}-{today}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    command = list(sys.orig_argv) if argv is None else ["python", "-m", "jax_fa4.bench", *argv]
    driver, package_versions = driver_version(), versions()

    def write(rows: list[Row], complete: bool) -> None:
        report = {
            "gpu": device.device_kind,
            "platform": device.platform,
            "driver": driver,
            "versions": package_versions,
            "command": command,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "settings": {"shapes": args.shapes, "dtype": args.dtype, "impls": args.impls,
                         "repeats": args.repeats, "target_ms": args.target_ms,
                         "fwd_only": args.fwd_only, "rotation_bytes": ROTATION_BYTES,
                         "backward_flop_factor": BACKWARD_FLOP_FACTOR},
            "complete": complete,  # False while the sweep runs: a stopped run keeps its rows
            "wall_s": round(time.perf_counter() - start, 1),
            "rows": rows,
        }
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(report, indent=1) + "\n")
        tmp.replace(out)

    rows = run_sweep(shapes, ctx, on_shape_done=lambda rows: write(rows, complete=False))
    write(rows, complete=True)
    png = out.with_suffix(".png")
    plot(rows, png, f"{device.device_kind}, {args.dtype}, {today}")
    print_table(rows)
    print(f"wrote {out} and {png}; total wall time {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
