"""The benchmark's shapes: :class:`Shape` (one attention problem: its FLOPs under FA4's mask,
the bytes it moves, what a row of it measures) and the presets ``python -m jax_fa4.tools.bench
--shapes`` sweeps (the anchors README's tables, latency shapes, a tiny CPU set).

Shared by the sweep (:mod:`jax_fa4.tools.bench`), the merging of result files
(:mod:`jax_fa4.tools.bench_report`) and the scripts under ``benchmarks/``; it needs NumPy only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

Window = tuple[int | None, int | None]

#: Ceilings measured on an H200 (bf16 matrix product, device copy): a call's device-time floor.
CEILING_FLOPS = 790e12
CEILING_BYTES = 4.3e12
#: A non-decode shape whose device time at the ceilings is below this measures launch overhead.
LATENCY_FLOOR_S = 20e-6
#: What a row's figures measure (its ``measures`` key).
MEASURES = ("attention speed", "K/V bandwidth", "launch overhead")


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
#: The anchors README's head dim 96 pair (in its "more shapes" table).
D96_SHAPES = (Shape(4, 8192, 8192, 16, 16, 96, 96, False),
              Shape(4, 8192, 8192, 16, 16, 96, 96, True))
#: The anchors README's head dims 192/128 pair (in its "more shapes" table).
D192_SHAPES = (Shape(4, 8192, 8192, 16, 16, 192, 128, False),
               Shape(4, 8192, 8192, 16, 16, 192, 128, True))
#: The anchors README's "more shapes" table.
ANCHOR_EXTRA_SHAPES = GQA_SHAPES + D96_SHAPES + D192_SHAPES + (
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


def preset_shapes(spec: str) -> tuple[Shape, ...]:
    """The shapes of a comma-separated list of presets, each once, in order."""
    return _unique([s for name in spec.split(",") for s in PRESETS[name]])


def document_lengths(rng: np.random.Generator, s: int, doc_min: int, doc_max: int) -> list[int]:
    """One packed row of ``s`` tokens cut into documents of ``doc_min`` to ``doc_max`` tokens
    (the last takes the rest; a tail shorter than ``doc_min`` joins the document before it)."""
    lens: list[int] = []
    while s - sum(lens) > doc_max:
        lens.append(int(rng.integers(doc_min, doc_max + 1)))
    rest = s - sum(lens)
    if rest < doc_min and lens:
        lens[-1] += rest
    else:
        lens.append(rest)
    return lens
