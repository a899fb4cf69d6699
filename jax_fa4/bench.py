"""Attention benchmark: jax-fa4 against cuDNN, XLA and the pure-JAX reference, in one process.

Usage::

    python -m jax_fa4.bench                      # default sweep: every anchor shape + latency
    python -m jax_fa4.bench --shapes anchors-main --out A.json       # the default sweep split
    python -m jax_fa4.bench --shapes anchors-more,latency --out B.json   # in two runs, and
    python -m jax_fa4.bench merge A.json B.json --out C.json         # joined into one file
    python -m jax_fa4.bench --shapes tiny        # a few small shapes (CPU smoke run)
    python -m jax_fa4.bench --shapes custom --B 2 --Sq 4096 --H 32 --Hkv 8 --D 128 \\
        --causal no,yes --window none,none --window 512,0
    python -m jax_fa4.bench --impls jax-fa4,cudnn --dtype fp16 --fwd-only --out /tmp/r.json

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
``benchmarks/readme_tables.py`` writes README's speed tables from the newest default-sweep file.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import itertools
import json
import math
import os
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

IMPLS = ("jax-fa4", "jax-fa4-det", "cudnn", "xla", "reference")
#: The jax-fa4 implementations and whether each passes ``deterministic=True``.
FA4_IMPLS = {"jax-fa4": False, "jax-fa4-det": True}
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

#: A non-decode shape whose device time at the ceilings is below this measures launch overhead.
LATENCY_FLOOR_S = 20e-6
#: What a row's figures measure (its ``measures`` key).
MEASURES = ("attention speed", "K/V bandwidth", "launch overhead")
#: How ``bwd_ms`` is derived (the result file's ``bwd_method``), and what that means.
BWD_METHOD = "fwdbwd_minus_training_fwd"
BWD_METHOD_TEXT = ("bwd_ms = fwdbwd_ms - train_fwd_ms: forward+backward minus the training forward "
                   "(the forward that also returns the residuals the backward reads, e.g. the "
                   "softmax statistics), for every implementation alike")
TIMING_ROTATION = "round r starts at program r mod n"
#: nvidia-smi fields recorded before and after the sweep (each None where the driver lacks it).
GPU_QUERY_FIELDS = ("name", "driver_version", "clocks.sm", "clocks.mem", "clocks.max.sm",
                    "clocks.max.mem", "temperature.gpu", "power.draw",
                    "clocks_throttle_reasons.active")

#: Keys of every row, in order (``tests/test_bench.py`` checks them).
ROW_KEYS = (
    "impl", "resolved_impl", "deterministic", "measures", "dtype", "B", "Sq", "Sk", "H", "Hkv",
    "D", "Dv", "causal", "window", "fwd_flops", "fwd_ms", "train_fwd_ms", "fwdbwd_ms", "bwd_ms",
    "fwd_us", "bwd_us", "fwd_tflops", "bwd_tflops", "fwd_tbps", "fwd_ratio_vs_cudnn",
    "bwd_ratio_vs_cudnn", "fwd_spread", "train_fwd_spread", "fwdbwd_spread", "iters", "rounds",
    "calls_per_dispatch", "input_sets", "compile_s", "residual_bytes", "peak_mem_bytes",
    "xla_mem_bytes", "custom_calls", "fwd_rel_err", "fwd_rel_err_vs", "skipped",
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

    def device_floor_s(self, itemsize: int) -> float:
        """A lower bound on one call's device time: its FLOPs or bytes at the H200 ceilings."""
        return max(self.fwd_flops() / CEILING_FLOPS, self.io_bytes(itemsize) / CEILING_BYTES)

    def measures(self, itemsize: int = 2) -> str:
        """What a row of this shape measures: decode (``Sq = 1``) reads K/V, so its figure is
        bandwidth; a latency shape (or any whose device time at the ceilings is under
        ``LATENCY_FLOOR_S``) times launch and dispatch overhead; the rest attention speed."""
        if self.Sq == 1:
            return "K/V bandwidth"
        if self in LATENCY_SHAPES or self.device_floor_s(itemsize) < LATENCY_FLOOR_S:
            return "launch overhead"
        return "attention speed"


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


def _unique(shapes: Sequence[Shape]) -> tuple[Shape, ...]:
    """``shapes`` without repeats, in first-seen order."""
    return tuple(dict.fromkeys(shapes))


#: The presets the default sweep is made of; ``--shapes anchors-main`` and ``--shapes
#: anchors-more,latency`` split it in two (``merge`` joins the two files into a default one).
DEFAULT_PARTS = ("anchors-main", "anchors-more", "latency")
PRESETS: dict[str, tuple[Shape, ...]] = {
    "anchors-main": ANCHOR_SHAPES,
    "anchors-more": ANCHOR_EXTRA_SHAPES,
    "latency": LATENCY_SHAPES,
    "default": _unique(ANCHOR_SHAPES + ANCHOR_EXTRA_SHAPES + LATENCY_SHAPES),
    "anchors": ANCHOR_SHAPES + ANCHOR_EXTRA_SHAPES,
    # One shape per kind of row (unmasked, masked GQA, decode), small enough for a CPU.
    "tiny": (
        _mha(1, 64, 2, 32, False),
        Shape(1, 128, 128, 4, 2, 32, 32, True, (32, None)),
        Shape(2, 1, 256, 4, 2, 32, 32, False),
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


def preset_shapes(spec: str) -> tuple[Shape, ...]:
    """The shapes of a comma-separated list of presets, each once, in order."""
    return _unique([s for name in spec.split(",") for s in PRESETS[name]])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jax_fa4.bench",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=_shapes_spec, default="default",
                   help=f"shape preset(s), comma-separated ({', '.join(PRESETS)}; default = "
                        f"{' + '.join(DEFAULT_PARTS)}), or custom from the shape flags below")
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
    timing.add_argument("--repeats", type=int, default=5,
                        help="timed rounds at least; rounded up to a multiple of the shape's "
                             "number of programs, so each program opens as many rounds as every "
                             "other; the median is kept")
    timing.add_argument("--target-ms", type=float, default=25.0,
                        help="wall time one program's round aims at (sets its calls per round)")
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
def _fa4_fn(shape: Shape, implementation: str | None, deterministic: bool = False
            ) -> Callable[..., jax.Array]:
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


def static_skip_reason(impl: str, shape: Shape, platform: str,
                       args: argparse.Namespace) -> str | None:
    """Why ``impl`` does not run ``shape`` here, decided before compiling (None: try it)."""
    gb = shape.scores_bytes() / 1e9
    if impl == "jax-fa4-det":
        if getattr(args, "fwd_only", False):
            return "deterministic=True changes only the backward (--fwd-only)"
        if shape.Sq == 1 or shape in LATENCY_SHAPES:
            return ("deterministic=True changes only the backward: timed on training shapes "
                    "only (not decode, not latency)")
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


def _lower(fn: Callable[..., jax.Array], inputs: Inputs, fwd_only: bool) -> Lowered:
    """``fn``'s lowered forward, training forward and forward+backward."""
    q, k, v, do = inputs
    fwd = jax.jit(fn).lower(q, k, v)
    if fwd_only:
        return Lowered(fn, fwd, None, None)
    try:
        train = jax.jit(_train_fwd(fn)).lower(q, k, v)
        return Lowered(fn, fwd, train, jax.jit(_fwd_bwd(fn)).lower(q, k, v, do))
    except Exception as err:
        return Lowered(fn, fwd, err, err)


def lower_impl(impl: str, shape: Shape, kernel: str | None, inputs: Inputs, fwd_only: bool
               ) -> Lowered:
    """The attention function of ``impl``, its lowered programs, and (jax-fa4, jax-fa4-det)
    what ``implementation=None`` resolved to.

    For jax-fa4 on a GPU with a kernel family, the forced kernel is lowered first: a forward that
    cannot lower raises :class:`SkipRow`, a backward that cannot lower replaces the training
    forward and forward+backward by its error.
    """
    if impl not in FA4_IMPLS:
        fn = _fa4_fn(shape, "reference") if impl == "reference" else _jax_nn_fn(shape, impl)
        return _lower(fn, inputs, fwd_only)
    det = FA4_IMPLS[impl]
    forced_text, forced_bwd_error = None, None
    if kernel is not None:
        try:
            forced = _lower(_fa4_fn(shape, kernel, det), inputs, fwd_only)
        except Exception as err:
            raise SkipRow(_error_text(err)) from err
        forced_text = forced.fwd.as_text()
        if isinstance(forced.fwd_bwd, Exception):
            forced_bwd_error = SkipRow(_error_text(forced.fwd_bwd))
    lowered = _lower(_fa4_fn(shape, None, det), inputs, fwd_only)
    text = lowered.fwd.as_text()
    if text == forced_text:
        resolved = kernel
    elif text == jax.jit(_fa4_fn(shape, "reference", det)).lower(*inputs[:3]).as_text():
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


def prepare_impl(impl: str, shape: Shape, arg_sets: list[Inputs], chain: int,
                 ctx: BenchContext) -> Prepared:
    """Compile ``impl``'s forward, training forward and forward+backward for ``shape``, measure
    its memory and run each program once (a program that cannot run skips the row, or its
    backward, here rather than in the shared timing).

    A backward that cannot run leaves the forward programs and says so in ``skipped``.
    """
    row = _empty_row(impl, shape, ctx.dtype_name)
    reason = static_skip_reason(impl, shape, ctx.device.platform, ctx.args)
    if reason is not None:
        row["skipped"] = reason
        return Prepared(row, {})
    fwd_sets = [a[:3] for a in arg_sets]
    t0 = time.perf_counter()
    try:
        low = lower_impl(impl, shape, ctx.kernel, arg_sets[0], ctx.args.fwd_only)
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
        for program in programs.values():  # one run each: a failure skips the row here
            jax.block_until_ready(program.compiled(*program.groups[0]))
        out = fwd(*fwd_sets[0])
    except Exception as err:
        row["skipped"] = _error_text(err)
        return Prepared(row, {})
    return Prepared(row, programs, out)


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
    itemsize = jnp.dtype(ctx.dtype).itemsize
    for prep in prepared:
        if prep.row["fwd_ms"] is not None:
            _derive(prep.row, itemsize)
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
            if any(static_skip_reason(i, shape, ctx.device.platform, ctx.args) is None
                   for i in impls):
                arg_sets = make_inputs(shape, ctx.dtype, sub, chain)
            label = _shape_label(dataclasses.asdict(shape))
            prepared: list[Prepared] = []
            for impl in impls:
                bar.set_postfix_str(f"compile {impl} {label}")
                if arg_sets is None:
                    row = _empty_row(impl, shape, ctx.dtype_name)
                    row["skipped"] = static_skip_reason(impl, shape, ctx.device.platform,
                                                        ctx.args)
                    prepared.append(Prepared(row, {}))
                else:
                    prepared.append(prepare_impl(impl, shape, arg_sets, chain, ctx))
                bar.update()
            bar.set_postfix_str(f"time {label}")
            record = time_shape(prepared, ctx)
            if record is not None:
                records.append({"shape": label, **record})
            shape_rows = [p.row for p in prepared]
            compare_rows(shape_rows, {p.row["impl"]: p.out for p in prepared
                                      if p.out is not None and p.row["fwd_ms"] is not None})
            for row in shape_rows:
                bar.write(f"[{len(rows) + 1}/{bar.total}] {_row_line(row)}")
                rows.append(row)
            del arg_sets, prepared
            if on_shape_done is not None:
                on_shape_done(rows, records)
    return rows, records


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


def _rate(row: Row, key: str) -> str:
    """A row's TFLOP/s as printed: only where the row measures attention speed (a launch-
    overhead row's TFLOP/s is not a speed, a decode row's figure is its TB/s)."""
    if row["measures"] == "attention speed":
        return _fmt(row[key], ".3g")
    if row[key] is None:
        return "-"
    if row["measures"] == "K/V bandwidth":
        return f"{row['fwd_tbps']:.3g} TB/s" if key == "fwd_tflops" else "(decode)"
    return "(latency)"


def _row_line(row: Row) -> str:
    head = f"{row['impl']:>11} {_shape_label(row):<34}"
    if row["skipped"] and row["fwd_ms"] is None:
        return f"{head} skipped: {row['skipped']}"
    line = (f"{head} fwd {_fmt_time(row['fwd_ms'])} {_rate(row, 'fwd_tflops')}  "
            f"bwd {_fmt_time(row['bwd_ms'])} {_rate(row, 'bwd_tflops')}  [{row['measures']}]")
    return line + (f"  ({row['skipped']})" if row["skipped"] else "")


def print_table(rows: list[Row]) -> None:
    """A plain-text table of every row (times in µs below 1 ms). TFLOP/s are printed for rows
    that measure attention speed only; decode rows show TB/s, latency rows their times."""
    header = ("shape", "impl", "measures", "fwd", "fwd TF/s", "bwd", "bwd TF/s", "x cuDNN f/b",
              "err", "peak MiB", "skipped")
    lines = [header]
    for r in rows:
        impl = r["impl"] + (f" ({r['resolved_impl']})" if r["resolved_impl"] else "")
        ratio = ("-" if r["fwd_ratio_vs_cudnn"] is None else
                 f"{r['fwd_ratio_vs_cudnn']:.2f}/{_fmt(r['bwd_ratio_vs_cudnn'], '.2f')}")
        peak = None if r["peak_mem_bytes"] is None else r["peak_mem_bytes"] / 2**20
        lines.append((_shape_label(r), impl, r["measures"], _fmt_time(r["fwd_ms"]),
                      _rate(r, "fwd_tflops"), _fmt_time(r["bwd_ms"]), _rate(r, "bwd_tflops"),
                      ratio, _fmt(r["fwd_rel_err"], ".1e"), _fmt(peak, ".0f"),
                      (r["skipped"] or "")[:70]))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for n, line in enumerate(lines):
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))


def plot(rows: list[Row], path: Path, title: str) -> None:
    """TFLOP/s against key length per implementation: forward and backward panels, for the rows
    that measure attention speed only (decode and latency rows are in the table, not here).

    Colour: implementation; marker: head dims; hollow and dashed: causal. A line joins rows that
    differ only in batch and length.
    """
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    colors = {"jax-fa4": "tab:red", "jax-fa4-det": "tab:orange", "cudnn": "tab:green",
              "xla": "tab:blue", "reference": "tab:gray"}
    measured = [r for r in rows
                if r["fwd_tflops"] is not None and r.get("measures") == "attention speed"]
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
    fig.suptitle(f"{title} (attention-speed rows; decode and latency rows: see the table)")
    fig.savefig(path, dpi=110)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def _nvidia_smi(fields: Sequence[str]) -> list[list[str]] | None:
    """``nvidia-smi --query-gpu=FIELDS`` as one list of values per GPU, None when it fails."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}",
                              "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    values = [[x.strip() for x in ln.split(",")] for ln in lines]
    return values if values and all(len(v) == len(fields) for v in values) else None


def _smi_value(text: str) -> str | float | None:
    """A number where nvidia-smi printed one; None for its "[N/A]"-style placeholders."""
    if not text or text.startswith("[") or text.lower() in ("n/a", "not supported"):
        return None
    try:
        return float(text)
    except ValueError:
        return text


def gpu_state(fields: Sequence[str] = GPU_QUERY_FIELDS) -> list[dict[str, Any]] | None:
    """Name, driver, clocks, temperature, power and throttle reasons of each GPU (nvidia-smi),
    None without nvidia-smi. Fields are asked for together, else one by one: a field this driver
    does not know is None (the throttle reasons are also tried under their newer name,
    ``clocks_event_reasons.active``)."""
    if shutil.which("nvidia-smi") is None:
        return None
    together = _nvidia_smi(fields)
    if together is not None:
        return [dict(zip(fields, map(_smi_value, gpu))) for gpu in together]
    columns: dict[str, list[Any] | None] = {}
    for field in fields:
        got = _nvidia_smi([field])
        if got is None and field == "clocks_throttle_reasons.active":
            got = _nvidia_smi(["clocks_event_reasons.active"])
        columns[field] = None if got is None else [_smi_value(v[0]) for v in got]
    count = max((len(c) for c in columns.values() if c is not None), default=0)
    if count == 0:
        return None
    return [{f: (c[i] if c is not None and i < len(c) else None) for f, c in columns.items()}
            for i in range(count)]


def driver_version(state: list[dict[str, Any]] | None = None) -> str | None:
    """The NVIDIA driver version (from ``gpu_state``), None without nvidia-smi."""
    state = gpu_state(("driver_version",)) if state is None else state
    value = state[0].get("driver_version") if state else None
    return None if value is None else str(value)


def cute_dsl_versions() -> dict[str, Any]:
    """Where the CuTe-DSL kernels and runtime come from: ``nvidia-cutlass-dsl``'s version when
    installed; the DSL versions recorded in the kernel cache's entries (a machine with only the
    runtime library runs kernels compiled elsewhere), with their counts; the runtime library."""
    from jax_fa4.ffi import cache as kernel_cache
    from jax_fa4.ffi import runtime

    found: dict[str, Any] = {"nvidia-cutlass-dsl": None, "kernel_cache": None,
                             "kernel_cache_dsl_versions": {},
                             "runtime_library": os.environ.get(runtime.ENV_RUNTIME_LIB)}
    try:
        found["nvidia-cutlass-dsl"] = importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        store = kernel_cache.KernelCache()
        found["kernel_cache"] = str(store.root)
        counts: dict[str, int] = {}
        for meta in store.entries():
            version = str(meta.get("dsl_version"))
            counts[version] = counts.get(version, 0) + 1
        found["kernel_cache_dsl_versions"] = dict(sorted(counts.items()))
    except Exception as err:  # an unreadable cache only leaves the versions out
        found["kernel_cache_error"] = _error_text(err)
    if found["runtime_library"] is None:
        try:
            found["runtime_library"] = str(runtime.find_runtime_library())
        except Exception:
            pass
    return found


def versions() -> dict[str, Any]:
    """Versions of the stack, each probe guarded."""
    found: dict[str, Any] = {"python": sys.version.split()[0], "jax": jax.__version__}
    for dist in ("jaxlib", "jax-fa4", "jax-cuda13-plugin", "jax-cuda13-pjrt",
                 "jax-cuda12-plugin", "jax-cuda12-pjrt", "nvidia-cudnn-cu13",
                 "nvidia-cudnn-cu12", "nvidia-cutlass-dsl"):
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
    try:
        found["cute_dsl"] = cute_dsl_versions()
    except Exception as err:
        found["cute_dsl"] = {"error": _error_text(err)}
    return found


TIMING_METHOD = ("per shape, every implementation is compiled first; then all their programs "
                 "(inference forward, training forward, forward+backward) are timed in one "
                 "rotation: rounds of one program after another, one untimed round first, the "
                 "median per program kept")


def main(argv: Sequence[str] | None = None) -> int:
    """The sweep; ``merge A.json B.json --out C.json`` joins result files instead."""
    argv_list = list(sys.argv[1:] if argv is None else argv)
    if argv_list[:1] == ["merge"]:
        return merge_main(argv_list[1:])
    start = time.perf_counter()
    args = parse_args(argv_list)
    shapes = custom_shapes(args) if args.shapes == "custom" else list(preset_shapes(args.shapes))
    device = jax.devices()[0]
    ctx = BenchContext(args, device, device_kernel(device), DTYPES[args.dtype], args.dtype)
    print(f"jax {jax.__version__} on {device.device_kind} ({device.platform}); "
          f"{len(shapes)} shapes x {len(args.impls)} impls, {args.dtype}", flush=True)
    today = datetime.date.today().isoformat()
    out = args.out or Path("benchmarks/results") / f"{_slug(device.device_kind)}-{today}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    command = list(sys.orig_argv) if argv is None else ["python", "-m", "jax_fa4.bench", *argv]
    state_before = gpu_state()
    driver, package_versions = driver_version(state_before), versions()

    def write(rows: list[Row], records: list[Row], complete: bool) -> None:
        report = {
            "gpu": device.device_kind,
            "platform": device.platform,
            "driver": driver,
            "versions": package_versions,
            "gpu_state": {"before": state_before,
                          "after": gpu_state() if complete else None},
            "command": command,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "settings": {"shapes": args.shapes, "dtype": args.dtype, "impls": args.impls,
                         "repeats": args.repeats, "target_ms": args.target_ms,
                         "fwd_only": args.fwd_only, "rotation_bytes": ROTATION_BYTES,
                         "backward_flop_factor": BACKWARD_FLOP_FACTOR},
            "bwd_method": BWD_METHOD,
            "bwd_method_text": BWD_METHOD_TEXT,
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
    png = out.with_suffix(".png")
    plot(rows, png, f"{device.device_kind}, {args.dtype}, {today}")
    print_table(rows)
    print(f"wrote {out} and {png}; total wall time {time.perf_counter() - start:.1f} s")
    return 0


# -- merging result files ----------------------------------------------------------------------
#: Settings two result files must share to be merged (the shapes are what they split).
MERGE_SAME_SETTINGS = ("dtype", "impls", "repeats", "target_ms", "fwd_only", "rotation_bytes",
                       "backward_flop_factor")


def _shape_key(row: Row) -> tuple:
    return (row["B"], row["Sq"], row["Sk"], row["H"], row["Hkv"], row["D"], row["Dv"],
            row["causal"], tuple(row["window"]))


def _merge_view(key: str, value: Any) -> Any:
    """What must agree between merged runs: the versions, with the CuTe-DSL entry reduced to its
    versions (the kernel cache's entry counts may differ between two machines)."""
    if key != "versions" or not isinstance(value, dict) or "cute_dsl" not in value:
        return value
    dsl = value["cute_dsl"] or {}
    return {**value, "cute_dsl": (dsl.get("nvidia-cutlass-dsl"),
                                  sorted(dsl.get("kernel_cache_dsl_versions") or {}))}


def merge_reports(reports: Sequence[dict[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    """One result file from several runs of the same stack that split a sweep's shapes.

    The runs must agree on GPU, driver, versions, the timing settings and the method fields; a
    shape may appear in one run only; every run must be complete. The merged ``settings.shapes``
    is the preset whose shapes the parts cover exactly (e.g. ``anchors-main`` +
    ``anchors-more,latency`` give ``default``), else the parts' specs joined by ``+``.
    """
    if len(reports) < 2:
        raise ValueError("merge needs two or more result files")
    first = reports[0]
    for name, rep in zip(names, reports):
        if not rep.get("complete"):
            raise ValueError(f"{name} is not complete (a stopped run)")
        for key in ("gpu", "platform", "driver", "versions", "bwd_method"):
            if _merge_view(key, rep.get(key)) != _merge_view(key, first.get(key)):
                raise ValueError(f"{name} differs from {names[0]} in {key!r}: "
                                 f"{rep.get(key)!r} vs {first.get(key)!r}")
        for key in MERGE_SAME_SETTINGS:
            if rep["settings"].get(key) != first["settings"].get(key):
                raise ValueError(f"{name} differs from {names[0]} in settings.{key}")
    seen: dict[tuple, str] = {}
    for name, rep in zip(names, reports):
        for key in {_shape_key(r) for r in rep["rows"]}:
            if key in seen:
                raise ValueError(f"shape {key} is in both {seen[key]} and {name}")
            seen[key] = name
    specs = [rep["settings"]["shapes"] for rep in reports]
    covered = {_shape_key(r) for rep in reports for r in rep["rows"]}
    merged_spec = "+".join(specs)
    for preset, members in PRESETS.items():
        keys = {_shape_key(dataclasses.asdict(s) | {"window": list(s.window)}) for s in members}
        if "custom" not in specs and keys == covered:
            merged_spec = preset
            break
    order = {_shape_key(dataclasses.asdict(s) | {"window": list(s.window)}): i
             for i, s in enumerate(preset_shapes(merged_spec))} if merged_spec in PRESETS else {}
    rows = [r for rep in reports for r in rep["rows"]]
    rows.sort(key=lambda r: order.get(_shape_key(r), len(order)))  # stable: impl order kept
    merged = {key: first[key] for key in first if key not in ("rows", "timing", "gpu_state",
                                                              "command", "date", "wall_s")}
    merged.update(
        settings={**first["settings"], "shapes": merged_spec},
        date=max(rep["date"] for rep in reports),
        wall_s=round(sum(rep.get("wall_s") or 0 for rep in reports), 1),
        command=[rep.get("command") for rep in reports],
        gpu_state=[rep.get("gpu_state") for rep in reports],
        timing={**(first.get("timing") or {}),
                "shapes": [s for rep in reports for s in (rep.get("timing") or {}).get(
                    "shapes", [])]},
        merged_from=[{"file": name, "shapes": rep["settings"]["shapes"], "date": rep["date"],
                      "wall_s": rep.get("wall_s")} for name, rep in zip(names, reports)],
        complete=True,
        rows=rows,
    )
    return merged


def merge_main(argv: Sequence[str]) -> int:
    """``python -m jax_fa4.bench merge A.json B.json [...] --out C.json``."""
    p = argparse.ArgumentParser(prog="python -m jax_fa4.bench merge",
                                description=merge_reports.__doc__.split("\n\n")[0])
    p.add_argument("files", type=Path, nargs="+")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    reports = [json.loads(f.read_text()) for f in args.files]
    try:
        merged = merge_reports(reports, [f.name for f in args.files])
    except ValueError as err:
        p.error(str(err))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(merged, indent=1) + "\n")
    plot(merged["rows"], args.out.with_suffix(".png"),
         f"{merged['gpu']}, {merged['settings']['dtype']}, {merged['date'][:10]}")
    print(f"wrote {args.out}: {len(merged['rows'])} rows, shapes {merged['settings']['shapes']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
