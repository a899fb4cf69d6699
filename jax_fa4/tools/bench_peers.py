"""Peers the benchmark times beside jax-fa4 and cuDNN when they are importable, and the checks
that decide whether a peer's figure counts.

``fa3-jax``: FlashAttention-3's JAX binding, the PyPI distribution ``flash-attn3-jax`` (module
``flash_attn3_jax``): FA3's Hopper C++ kernels behind an XLA FFI call,
``flash_mha(q, k, v, softmax_scale, is_causal, window_size)`` on BSHD tensors with a custom VJP.
It is optional and never a dependency: :func:`load_peers` imports it if it can, and a sweep
without it records why (the result file's ``peers``). What its API cannot express (a value head
dim other than D, a dtype other than bf16/fp16) is refused before compiling
(:func:`static_refusal`); what its kernels refuse (e.g. head dims above those its wheel was built
for) is recorded from the error they raise.

Checks (every row of a shape on which a peer ran, :func:`check_slice`): whether the forward
output and the gradients are finite, and whether they agree with the float32 reference by FA4's
rule (:mod:`jax_fa4.tools.fa4_rule`), on one batch element and one key/value head with its query
heads (attention is independent across them, so the slice of the full call's results is exact).
:func:`best_peers` then names, per shape, the peer with the highest ratio to cuDNN among those
whose results are finite and pass the rule: the bar jax-fa4's ratio is held to.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jax_fa4 import reference
from jax_fa4.tools.bench_env import error_text
from jax_fa4.tools.bench_shapes import Shape
from jax_fa4.tools.fa4_rule import fa4_error

FA3 = "fa3-jax"
#: Optional implementations timed as peers: row name -> (module, PyPI distribution).
PEER_MODULES = {FA3: ("flash_attn3_jax", "flash-attn3-jax")}
PEER_IMPLS = tuple(PEER_MODULES)
#: The implementations a shape's best peer is chosen from (cuDNN's ratio to itself is 1).
BAR_PEERS = ("cudnn",) + PEER_IMPLS
#: The dtypes ``flash_mha`` takes.
FA3_DTYPES = ("bf16", "fp16")
GRADS = ("dq", "dk", "dv")

Row = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Peer:
    """An optional implementation: its module when importable, else why not."""

    impl: str
    module_name: str
    distribution: str
    module: Any = None
    version: str | None = None
    reason: str | None = None  # why it is not available (None: it is)

    @property
    def available(self) -> bool:
        return self.module is not None

    def record(self) -> dict[str, Any]:
        """What the result file's ``peers`` says about it."""
        return {"module": self.module_name, "distribution": self.distribution,
                "available": self.available, "version": self.version,
                "path": getattr(self.module, "__file__", None), "reason": self.reason}


def load_peer(impl: str) -> Peer:
    """Import ``impl``'s module (any error means unavailable, with the error as the reason)."""
    name, dist = PEER_MODULES[impl]
    try:
        module = importlib.import_module(name)
    except Exception as err:  # a missing module, or one whose native library fails to load
        return Peer(impl, name, dist, reason=(
            f"{name} is not importable ({error_text(err)}); install {dist} or put its "
            "unpacked wheel on PYTHONPATH (docs/development.md)"))
    if not callable(getattr(module, "flash_mha", None)):
        return Peer(impl, name, dist, reason=f"{name} has no flash_mha")
    return Peer(impl, name, dist, module, getattr(module, "__version__", None))


def load_peers() -> dict[str, Peer]:
    """Every peer, imported if it can be."""
    return {impl: load_peer(impl) for impl in PEER_IMPLS}


#: The largest head dim flash_attn3_jax's kernels take (its 0.2.3 wheel checks it at run time,
#: raising; jax_fa4.tools.bench records that per shape, benchmarks/bwd_variants.py skips it).
FA3_MAX_HEAD_DIM = 128


def static_refusal(impl: str, shape: Shape, dtype_name: str) -> str | None:
    """Why ``impl``'s API cannot express ``shape`` (None: try it; its kernels may still
    refuse, and that error is recorded)."""
    if impl != FA3:
        return None
    if shape.Dv != shape.D:
        return "refused: flash_mha takes k and v of one shape (Dv != D)"
    if dtype_name not in FA3_DTYPES:
        return f"refused: flash_mha runs {' and '.join(FA3_DTYPES)} only, not {dtype_name}"
    return None


def fa3_fn(module: Any, shape: Shape) -> Callable[..., jax.Array]:
    """``module.flash_mha`` on (q, k, v) with FA4's mask of ``shape``: causal when the window
    is (unbounded, 0), otherwise ``window_size`` (left, right) with -1 for an unbounded side
    (both align the diagonal bottom-right, as FA4 does); softmax scale 1/sqrt(D)."""
    left, right = shape.mask_window
    causal = left is None and right == 0
    window = (-1, -1) if causal else (-1 if left is None else left,
                                      -1 if right is None else right)
    scale = 1.0 / math.sqrt(shape.D)

    def fa3_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return module.flash_mha(q, k, v, softmax_scale=scale, is_causal=causal,
                                window_size=window)
    return fa3_attention


# -- checks ------------------------------------------------------------------------------------
def finite(out: jax.Array | None, grads: Sequence[jax.Array] | None) -> dict[str, bool] | None:
    """Whether the forward output and each gradient is finite everywhere (None: nothing ran)."""
    if out is None:
        return None
    found = {"out": bool(jnp.isfinite(out).all())}
    for name, g in zip(GRADS, grads or ()):
        found[name] = bool(jnp.isfinite(g).all())
    return found


def slice_heads(shape: Shape) -> int:
    """Query heads of the checked slice: those that share the first key/value head."""
    return shape.H // shape.Hkv


def slice_scores_bytes(shape: Shape) -> int:
    """Bytes of the float32 scores the reference holds for the checked slice."""
    return slice_heads(shape) * shape.Sq * shape.Sk * 4


def _slice(results: Mapping[str, jax.Array], g: int) -> dict[str, jax.Array]:
    """Batch element 0, the first key/value head and its ``g`` query heads."""
    heads = {"out": g, "dq": g, "dk": 1, "dv": 1}
    return {name: x[:1, :, :heads[name]] for name, x in results.items()}


def oracles(shape: Shape, q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array
            ) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """(ref, pt) on the checked slice: out and the gradients of ``sum(out * do)`` from the
    float32 reference on the upcast inputs, rounded to the inputs' dtype as FA4's rule compares
    them, and from the naive computation in the inputs' dtype (the rule's baseline)."""
    g = slice_heads(shape)
    q, k, v, do = q[:1, :, :g], k[:1, :, :1], v[:1, :, :1], do[:1, :, :g]

    def run(compute_dtype: Any, *args: jax.Array) -> dict[str, jax.Array]:
        def attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            return reference.attention(q, k, v, window=shape.mask_window,
                                       compute_dtype=compute_dtype)[0]

        def program(q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array) -> dict:
            out, pullback = jax.vjp(attention, q, k, v)
            return dict(zip(("out",) + GRADS, (out, *pullback(do.astype(out.dtype)))))

        return {n: x.astype(q.dtype) for n, x in jax.jit(program)(*args).items()}

    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
    return run(jnp.float32, *f32), run(q.dtype, q, k, v, do)


def _number(x: float) -> float | None:
    return x if math.isfinite(x) else None


def rule_check(got: Mapping[str, jax.Array], ref: Mapping[str, jax.Array],
               pt: Mapping[str, jax.Array], g: int) -> dict[str, Any]:
    """FA4's rule on the slice of each of ``got`` (full-call out and gradients): per name
    {err, bound, passed} (a non-finite err is recorded as None, and fails), and ``passed``."""
    found: dict[str, Any] = {}
    for name, value in _slice(got, g).items():
        e = fa4_error(value, ref[name], pt[name])
        found[name] = {"err": _number(e.err), "bound": _number(e.bound), "passed": e.passed}
    found["passed"] = all(found[n]["passed"] for n in got)
    return found


def check_slice_text(shape: Shape) -> str:
    """What the rule's comparison covers (the ``fa4_rule`` entry's ``vs``)."""
    g = slice_heads(shape)
    return (f"float32 reference, batch 0, key/value head 0 with its {g} query "
            f"head{'s' if g > 1 else ''}")


def check_slice(shape: Shape, rows: Sequence[Row], results: Mapping[str, tuple[Any, Any]],
                inputs: tuple[jax.Array, ...], max_gb: float) -> None:
    """Fill ``finite`` of every row that ran, and (when a peer row ran) ``fa4_rule`` of every
    row that ran: ``results`` maps an impl to (out, grads or None) on the first input set
    ``inputs`` (q, k, v, do). The reference is skipped (``fa4_rule`` says why) when the slice's
    float32 scores would exceed ``max_gb``."""
    for row in rows:
        if row["impl"] in results:
            row["finite"] = finite(*results[row["impl"]])
    if not any(impl in results for impl in PEER_IMPLS):
        return
    gb = slice_scores_bytes(shape) / 1e9
    if gb > max_gb:
        for row in rows:
            if row["impl"] in results:
                row["fa4_rule"] = {"vs": None, "passed": None, "skipped": (
                    f"the reference's slice holds {gb:.1f} GB of float32 scores "
                    f"(> --reference-max-gb {max_gb})")}
        return
    ref, pt = oracles(shape, *inputs)
    g = slice_heads(shape)
    for row in rows:
        if row["impl"] not in results:
            continue
        out, grads = results[row["impl"]]
        got = {"out": out, **dict(zip(GRADS, grads or ()))}
        row["fa4_rule"] = {"vs": check_slice_text(shape), **rule_check(got, ref, pt, g)}


def counts(row: Row, part: str) -> bool:
    """Whether a row's ``part`` (``fwd``: its output; ``bwd``: its gradients) may stand as a
    peer's figure: finite, and passing FA4's rule where it was checked."""
    names = ("out",) if part == "fwd" else GRADS
    found, rule = row.get("finite") or {}, row.get("fa4_rule") or {}
    if not all(found.get(n) is True for n in names):
        return False
    return all((rule.get(n) or {}).get("passed", True) is not False for n in names)


def best_peers(rows: Sequence[Row]) -> None:
    """Per direction, the best peer of a shape's rows (highest ratio to cuDNN among
    ``BAR_PEERS`` whose figure counts: :func:`counts`), written to every row of the shape as
    ``best_peer_fwd``/``best_peer_fwd_ratio`` (``bwd`` likewise). Only where it means
    something: cuDNN's figure exists and a peer besides cuDNN was in the sweep."""
    if not any(r["impl"] in PEER_IMPLS for r in rows):
        return
    for part in ("fwd", "bwd"):
        key = f"{part}_ratio_vs_cudnn"
        if not any(r["impl"] == "cudnn" and r[key] is not None for r in rows):
            continue
        candidates = [r for r in rows if r["impl"] in BAR_PEERS and r[key] is not None
                      and counts(r, part)]
        if not candidates:
            continue
        best = max(candidates, key=lambda r: r[key])
        for row in rows:
            row[f"best_peer_{part}"] = best["impl"]
            row[f"best_peer_{part}_ratio"] = best[key]
