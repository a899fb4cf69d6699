"""Compile keys and tuning table of the Hopper (sm_90a) attention backward. No compiler import here.

Two kernels (see bwd.py and bwd_postprocess.py):

``sm90_bwd`` (BwdConfig), the main kernel. Per (batch b, query head h, key block n):

    P  = exp2(S·scale_log2 − lse_log2)          S = q·kᵀ (or softcap·tanh(q·kᵀ·scale/softcap))
    dV = Σ_m Pᵀ·dO,   dP = dO·Vᵀ,   dS = P∘(dP − delta) [∘ (1 − tanh²)]
    dK = Σ_m dSᵀ·Q · scale,   dq_accum += dS·K (float32, unscaled, fragment order, see below)

    call: fn(stream, q, k, v, dout, lse_log2, delta, params, dq_accum, [dq_sem,] dk, dv)
      q        (B, Sq, H, D)      dtype
      k        (B, Sk, Hkv, D)    dtype
      v        (B, Sk, Hkv, Dv)   dtype
      dout     (B, Sq, H, Dv)     dtype
      lse_log2 (B, H, Sq)         float32  (+inf on rows that saw no key: from the preprocess)
      delta    (B, H, Sq)         float32  rowsum(out·dout)
      params   (4,)               float32  [softmax_scale, softcap (0 = off), window_left,
                                            window_right] (-1 = unbounded), batched=False
      dq_accum (B, H, Sq_pad·D)   float32  zero-filled by the caller;
                                            Sq_pad = ceil(Sq/tile_m)·tile_m. Input 7, aliased to
                                            output 0 (updated in place).
      dq_sem   (B, H, Sq_pad/tile_m) int32    deterministic configs only: zero-filled ordering
                                            counters, one per query block. Input 8, aliased to
                                            output 3 (the launcher takes it after dq_accum).
    outputs (after the alias): dk (B, Sk, Hdk, D), dv (B, Sk, Hdk, Dv) with Hdk = Hkv for MHA
      configs (gqa=False, dtype = input dtype) and Hdk = H for GQA configs (gqa=True, float32, one
      slice per query head; the caller sums each group of H/Hkv heads); group_heads configs take
      GQA inputs with gqa=False's outputs (one CTA per kv head sums its group itself,
      BwdConfig.group_heads); sink_grad configs (params
      (4 + H,): one learnable sink logit per query head after the four scalars) end with
      sink_part (B, H, ceil(Sk/tile_n)) float32: key block n's Σ_i e^{σ_h − lse_i}·Σ_j P_ij·dP_ij
      (BwdConfig.sink_grad).

Varlen configs (``varlen=True``, called by jax_fa4/backends/sm90.py) take packed sequences instead
(see ``varlen_bwd_config.varlen_attention_backward_signature``, the sm100 kernel's too): one CTA
per (work item, query head), a work item being one key block of one sequence, listed by the
caller.

``sm90_bwd_postprocess`` (BwdPostprocessConfig): dq (B, Sq, H, D) = dq_accum · softmax_scale in the
input dtype. ``fn(stream, dq_accum, params, dq)``.

dq_accum layout: per (b, h) a run of Sq_pad·D floats; m-block ``m`` owns [m·tile_m·D,
(m+1)·tile_m·D), split into one contiguous chunk per dQ warpgroup, each in the dQ WGMMA's
accumulator-fragment order (chunk c of 4 floats of thread t at float offset (c·128 + t)·4). The
postprocess rebuilds the same tiled MMA to undo it, so the two configs must agree on (tile_m,
head_dim): use ``BwdConfig.postprocess_config()``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

# the segment-id tables' call contract, shared with the sm100 backward
from jax_fa4.kernels.segments_config import with_segment_tables
# the table chooses configs (whose fields are the key): not part of any kernel's key
from jax_fa4.kernels.sm90.bwd_tuning import GROUP_HEADS_MIN_CTAS, TUNING_TABLE, tuning_for
from jax_fa4.kernels.spec import (FLOAT_DTYPES, NUM_PARAMS, SMEM_BUDGET_BYTES,
                                  KernelConfig, KernelSignature, TensorArg,
                                  attention_backward_signature, check_dtype_and_mask)
# the varlen backward's call contract, shared with the sm100 kernel (WORK_COLUMNS re-exported)
from jax_fa4.kernels.varlen_bwd_config import (WORK_COLUMNS,  # noqa: F401
                                               varlen_attention_backward_signature)

#: The head dims the kernel's code serves: the tuning table's (the only ones ``make`` and so the
#: API pick), and 192/192, which compiles without spills but has no table row until it has run
#: on a GPU (``jax_fa4.tools.variants.sm90_bwd_d192_candidates``: the GPU test's configs).
KERNEL_HEAD_DIMS = frozenset(TUNING_TABLE) | {(192, 192)}


def sink_smem_floats(num_mma_threads: int) -> int:
    """sink_grad's shared memory in floats: a running sum per MMA thread (the MMA warpgroups'
    registers are all taken), a partial per MMA warp, and 4 spare."""
    return num_mma_threads + num_mma_threads // 32 + 4


def _split(extent: int) -> tuple[int, int]:
    """Warpgroup layout (along this extent, along the other) of a 2-warpgroup GEMM whose M side
    is ``extent``: two 64-row atoms side by side when extent is 128, else split the other side."""
    return (2, 1) if extent == 128 else (1, 2)


@dataclass(frozen=True)
class BwdConfig(KernelConfig):
    """Compile key of the sm90 backward main kernel: everything that changes the generated code."""

    kernel_name: ClassVar[str] = "sm90_bwd"

    dtype: str = "bfloat16"
    head_dim: int = 128
    head_dim_v: int = 128
    mask: str = "none"  # "none" | "causal" | "local"
    has_softcap: bool = False
    # dk/dv float32 per query head (the caller sums the groups) instead of dtype per kv head
    gqa: bool = False
    deterministic: bool = False  # dQ chunks reduce-added in key-block order (dq_sem counters)
    # tuning (from TUNING_TABLE via `make`)
    tile_m: int = 64
    tile_n: int = 128
    stages: int = 2
    pds_stages: int = 2
    # compute Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (M = keys): each MMA warpgroup then holds Pᵀ and dSᵀ for
    # its 64 keys in exactly the registers the dV / dK GEMMs take as their A operand, so P never
    # goes to shared memory and dV, dK read only dO, Q from it; dSᵀ still goes to shared memory
    # for dQ. Costs 16 lse + 16 delta values per thread (one per query column) instead of 2 + 2.
    swap_sdp: bool = False
    # launch the key blocks of a (head, batch) from the last one down. The deterministic kernel's
    # dQ order follows the launch order (each key block waits only on earlier launches):
    # descending with a causal mask, which always launches reversed; ascending otherwise, which
    # must not (validate). Under a causal mask the last key blocks are the lightest, so this
    # launches light blocks first.
    reverse_launch: bool = False
    # each query block's lse_log2 and delta loaded into shared memory by a producer warp (cp.async,
    # as deep as the Q pipeline) instead of into registers by every MMA thread from global memory:
    # one global load per row instead of one per row and MMA warpgroup, and none in the MMA loop
    # (the swap_sdp loop's 16 column loads per thread become shared-memory reads)
    stats_smem: bool = False
    # each MMA thread adds its dQ fragment straight into dq_accum (red.global.add.v4.f32) instead
    # of handing it to the dQ warp through shared memory: no dQ buffer (tile_m·D·4 bytes), no
    # stores, fence or barriers per block; unordered, so never deterministic
    dq_red: bool = False
    # packed sequences (jax_fa4/backends/sm90.py, varlen_attention_backward_signature): per-sequence
    # offsets and lengths from cu_seqlens, key blocks from the caller's work list (which also
    # sets their launch order), dK / dV stored row by row inside each sequence
    varlen: bool = False
    # learnable sinks: params carries one sink logit σ_h per query head (length 4 + H) and the
    # kernel writes sink_part (B, H, X) float32, X = its grid's first extent (key blocks; varlen:
    # work rows): CTA x's Σ_i e^{σ_h − lse_i} Σ_{j in its keys} P_ij·dP_ij over every query row
    # i it visits. Summed over x and b that is Σ_i P_sink_i·rowsum(dO_i·O_i) with the output O in
    # float32 as the forward accumulated it (Σ_j P_ij dP_ij = dO_i·Σ_j P_ij V_j), so d sink no
    # longer takes the error of the 16-bit output that delta carries (jax_fa4/autodiff.py).
    sink_grad: bool = False
    # segment ids (jax_fa4/segments.py's backward tables): each key block visits the query
    # blocks [m_lo, m_hi) its table row names (intersected with the mask's), a block outside
    # the query tile's bulk is masked by each row's key span (and key-by-key ids in flagged
    # tiles), as in the forward (segments_attention_backward_signature). The plain loop only.
    segments: bool = False
    # GQA / MQA (H > Hkv) with one CTA per (key block, kv head) instead of per query head: the
    # CTA walks the query blocks of each of the H/Hkv query heads of its group in turn, its dK /
    # dV accumulators summing over all of them, and writes dK / dV once, in the input dtype per
    # kv head (the outputs of gqa=False): no float32 slice per query head, no group sum after
    # the kernel. H/Hkv times fewer, longer CTAs (the caller's rule: sm90/bwd_tuning.py).
    group_heads: bool = False
    # the MMA warpgroups' shared-memory operand fragments (the GEMM descriptors) built from
    # their warpgroup's slice of each tiled MMA rather than each thread's: a GMMA operand's
    # layout is the same for all 128 threads of a warpgroup, so the fragments are equal, and
    # from the warp-uniform index the descriptors stay in uniform registers instead of being
    # computed per thread and moved over (R2UR) between the WGMMAs of a block
    wg_fragments: bool = False
    # stats_smem with lse_log2 / delta arrays of at least Sq_pad rows whose rows past Sq hold
    # +inf / 0 (the caller pads them: KernelBackend.backward_main): the stats warp loads rows
    # without clamping them to Sq and the MMA threads read them without selecting +inf / 0 for
    # queries past Sq (the swapped loop's 16 + 16 per-column compare-and-selects a block)
    stats_padded: bool = False

    @classmethod
    def make(cls, dtype: str, head_dim: int, head_dim_v: int | None = None, mask: str = "none",
             has_softcap: bool = False, gqa: bool = False,
             deterministic: bool = False, sink_grad: bool = False,
             segments: bool = False, group_shape: tuple[int, int] | None = None,
             varlen: bool = False) -> BwdConfig:
        """The table's config of a problem kind. ``group_shape`` = (B·Hkv, Sk) of a GQA call:
        its group_heads form where the table's row allows it and it launches at least
        GROUP_HEADS_MIN_CTAS CTAs (``GROUP_HEADS_ANY``: wherever the row allows it).
        ``varlen``: the packed-sequence kernel, the plain loop in the work list's key-block
        order."""
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        t = tuning_for(head_dim, head_dim_v, mask)
        # swap_sdp spills with softcap (validate) and was measured slower deterministic
        # (benchmarks/results/bwd-variants-swap-nvidia-h200-2026-11-30.json): the plain loop
        # there, with the row's launch order and statistics from registers
        swap = t.swap_sdp and not has_softcap and not deterministic
        # sink_grad's per-column sums spill in the swapped loop (its 16 + 16 column statistics
        # are live there: hdim 128 GQA LDL 23, fp16 local LDL 2): the plain loop
        swap = swap and not sink_grad and not segments and not varlen
        # dq_red: with the row's swap_sdp where the row asks for it (measured only so); no fixed
        # order of the adds (deterministic) and no varlen form
        red = t.dq_red and (swap or not t.swap_sdp) and not deterministic and not varlen
        cfg = cls(dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, mask=mask,
                  has_softcap=bool(has_softcap), gqa=bool(gqa), deterministic=bool(deterministic),
                  tile_m=t.tile_m, tile_n=t.tile_n,
                  stages=t.red_stages if red and t.red_stages else t.stages,
                  pds_stages=t.pds_stages, swap_sdp=swap,
                  reverse_launch=((mask == "causal") if deterministic
                                  else t.reverse_launch and not swap and not varlen),
                  stats_smem=t.stats_smem and swap,
                  dq_red=red, sink_grad=bool(sink_grad),
                  segments=bool(segments), varlen=bool(varlen),
                  wg_fragments=t.wg_fragments,
                  stats_padded=t.stats_padded and t.stats_smem and swap)
        if (gqa and group_shape is not None and t.group_heads and not sink_grad
                and not segments):
            kv_heads, seqlen_k = group_shape
            if kv_heads * -(-seqlen_k // t.tile_n) >= GROUP_HEADS_MIN_CTAS:
                cfg = replace(cfg, gqa=False, group_heads=True)
        cfg.validate()
        return cfg

    # -- static checks ---------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming the first unsupported feature."""
        check_dtype_and_mask("sm90 backward", self.dtype, self.mask)
        if (self.head_dim, self.head_dim_v) not in KERNEL_HEAD_DIMS:
            supported = ", ".join(f"{d}/{dv}" for d, dv in sorted(KERNEL_HEAD_DIMS))
            raise ValueError(f"sm90 backward: head_dim/head_dim_v {self.head_dim}/"
                             f"{self.head_dim_v} not supported (supported: {supported})")
        if self.tile_m not in (64, 128) or self.tile_n not in (64, 128):
            raise ValueError(f"sm90 backward: tile {self.tile_m}x{self.tile_n} not supported "
                             "(tile_m, tile_n in {64, 128})")
        if self.head_dim % 16 or self.head_dim_v % 16:
            raise ValueError("sm90 backward: head dims must be multiples of 16")
        if self.swap_sdp and self.reverse_launch and not self.deterministic:
            raise ValueError("sm90 backward: swap_sdp with reverse_launch spills registers (hdim "
                             "128 with GQA); use reverse_launch=False")
        if self.deterministic and self.reverse_launch and self.mask != "causal":
            raise ValueError("sm90 backward: a deterministic kernel adds dQ in ascending key-block "
                             "order without a causal mask, so its key blocks must launch in that "
                             "order (reverse_launch=False)")
        if self.dq_red and (self.deterministic or self.varlen):
            raise ValueError("sm90 backward: dq_red adds dQ in no fixed order and has no varlen "
                             "form: not with deterministic or varlen")
        if self.varlen and (self.deterministic or self.swap_sdp or self.reverse_launch
                            or self.stats_smem):
            raise ValueError("sm90 backward: varlen is not implemented with deterministic, "
                             "swap_sdp, stats_smem or reverse_launch (the caller's work list "
                             "orders the key blocks)")
        if self.stages < 1 or self.pds_stages not in (1, 2):
            raise ValueError("sm90 backward: stages >= 1 and pds_stages in {1, 2} required")
        if self.swap_sdp and (self.tile_m, self.tile_n) != (64, 128):
            raise ValueError("sm90 backward: swap_sdp needs a 64x128 tile (one 64-key slice of Pᵀ "
                             f"per warpgroup), not {self.tile_m}x{self.tile_n}")
        if self.segments and (self.swap_sdp or self.varlen or self.deterministic):
            raise ValueError("sm90 backward: segment ids are implemented in the plain loop "
                             "(not swap_sdp), not varlen and not deterministic")
        if self.stats_padded and not self.stats_smem:
            raise ValueError("sm90 backward: stats_padded is a form of stats_smem's loads")
        if self.swap_sdp and self.sink_grad:
            raise ValueError("sm90 backward: swap_sdp with sink_grad spills registers (the sink "
                             "sums beside every column's lse and delta); use swap_sdp=False")
        if self.group_heads and (self.gqa or self.varlen or self.segments or self.sink_grad):
            raise ValueError("sm90 backward: group_heads writes dK / dV per kv head itself (not "
                             "with gqa's float32 slices per query head) and is implemented for "
                             "dense calls without segment ids or sink_grad")
        if self.group_heads and max(self.head_dim, self.head_dim_v) not in (96, 128, 192):
            raise ValueError("sm90 backward: group_heads puts an accumulator in local memory at "
                             f"head dims {self.head_dim}/{self.head_dim_v} (LDL 96 at 64 and 256)")
        if self.swap_sdp and self.has_softcap:
            raise ValueError("sm90 backward: swap_sdp with softcap spills registers (the tanh "
                             "derivative keeps every column's lse live); use swap_sdp=False")
        if self.swap_sdp and max(self.head_dim, self.head_dim_v) > 128:
            raise ValueError("sm90 backward: swap_sdp needs head dims <= 128 (registers: dK, dV "
                             "accumulators of 64 keys each), not "
                             f"{self.head_dim}/{self.head_dim_v}")
        # every GEMM's per-warpgroup N extent must be a multiple of 16 (8 for WGMMA, 16 for the
        # shared-memory swizzle atoms used by the transposed operands)
        lay = self.wg_layouts()
        sdp = (self.tile_n, self.tile_m) if self.swap_sdp else (self.tile_m, self.tile_n)
        for name, (m_ext, n_ext), (wm, wn) in (
                ("S/dP", sdp, lay["sdp"]),
                ("dK", (self.tile_n, self.head_dim), lay["dkv"]),
                ("dV", (self.tile_n, self.head_dim_v), lay["dkv"]),
                ("dQ", (self.tile_m, self.head_dim), lay["dq"])):
            if m_ext != 64 * wm or n_ext % (16 * wn):
                raise ValueError(f"sm90 backward: GEMM {name} {m_ext}x{n_ext} does not split over "
                                 f"warpgroups {wm}x{wn}")
        if self.smem_bytes() > SMEM_BUDGET_BYTES:
            raise ValueError(f"sm90 backward: {self.smem_bytes()} B of shared memory exceeds "
                             f"{SMEM_BUDGET_BYTES} B ({self.describe()})")

    # -- derived ---------------------------------------------------------------------------------
    num_mma_warpgroups: ClassVar[int] = 2
    num_threads: ClassVar[int] = 384  # producer warpgroup + 2 MMA warpgroups

    def wg_layouts(self) -> dict[str, tuple[int, int]]:
        """Warpgroup atom layout (along M, along N) of each GEMM: S, dP: (tile_m × tile_n), or
        with swap_sdp Sᵀ, dPᵀ: (tile_n × tile_m); dK, dV: (tile_n × D); dQ: (tile_m × D)."""
        sdp = _split(self.tile_n) if self.swap_sdp else _split(self.tile_m)
        return {"sdp": sdp, "dkv": _split(self.tile_n), "dq": _split(self.tile_m)}

    def smem_bytes(self) -> int:
        e = 2  # 16-bit elements
        q = self.stages * self.tile_m * self.head_dim * e
        do = self.stages * self.tile_m * self.head_dim_v * e
        k = self.tile_n * self.head_dim * e
        v = self.tile_n * self.head_dim_v * e
        pds = (1 if self.swap_sdp else 2) * self.pds_stages * self.tile_m * self.tile_n * e
        dq = 0 if self.dq_red else self.tile_m * self.head_dim * 4
        stats = 2 * self.stages * self.tile_m * 4 if self.stats_smem else 0
        sink = sink_smem_floats(self.num_mma_warpgroups * 128) * 4 if self.sink_grad else 0
        kv_ids = self.tile_n * 4 if self.segments else 0  # the key block's segment ids
        return q + do + k + v + pds + dq + stats + sink + kv_ids

    def postprocess_config(self) -> BwdPostprocessConfig:
        return BwdPostprocessConfig(dtype=self.dtype, head_dim=self.head_dim, tile_m=self.tile_m,
                                    varlen=self.varlen)

    # -- KernelConfig contract ------------------------------------------------------------------
    def signature(self) -> KernelSignature:
        if self.varlen:
            sig = varlen_attention_backward_signature(self.dtype, self.head_dim,
                                                      self.head_dim_v, self.tile_m, self.gqa)
        else:
            sig = attention_backward_signature(
                self.dtype, self.head_dim, self.head_dim_v, self.tile_m, self.gqa,
                counters=("dq_sem", 1) if self.deterministic else None)  # one per query block
        if self.segments:
            sig = with_segment_tables(sig, self.tile_m, self.tile_n)
        if not self.sink_grad:
            return sig
        # (the last output: params keeps its (4,) sample, a 4 + H run-time length is read as
        # such by the kernel, as in the forward)
        b, h = sig.inputs[0].sample_shape[0], sig.inputs[0].sample_shape[2]
        part = TensorArg("sink_part", "float32", (b, h, 5), (1, 1, 1), batched=not self.varlen)
        return KernelSignature(inputs=sig.inputs, outputs=(*sig.outputs, part),
                               aliases=sig.aliases)


@dataclass(frozen=True)
class BwdPostprocessConfig(KernelConfig):
    """dq = dq_accum (fragment order, see module docstring) · softmax_scale, in the input dtype.

    Varlen (``varlen=True``): ``fn(stream, dq_accum, params, cu_seqlens_q, tile_seq, dq)`` with
    dq_accum (1, H, R·D) of the varlen main kernel, tile_seq (R / tile_m,) int32 the sequence
    owning each dq_accum tile (-1: none; sequence b owns the ceil(len_q(b) / tile_m) tiles from
    ``(cu_seqlens_q[b] + b·tile_m) // tile_m`` on) and dq (1, total_q, H, D) packed: each
    sequence's rows written in place, the rows outside every sequence zeros."""

    kernel_name: ClassVar[str] = "sm90_bwd_postprocess"

    dtype: str = "bfloat16"
    head_dim: int = 128
    tile_m: int = 64
    varlen: bool = False

    def validate(self) -> None:
        if self.dtype not in FLOAT_DTYPES:
            raise ValueError(f"sm90 bwd postprocess: dtype {self.dtype!r} not supported")
        if self.tile_m not in (64, 128) or self.head_dim % 16 or not 16 <= self.head_dim <= 256:
            raise ValueError(f"sm90 bwd postprocess: tile_m {self.tile_m} / head_dim "
                             f"{self.head_dim} not supported")
        wm, wn = _split(self.tile_m)
        if self.head_dim % (16 * wn):
            raise ValueError(f"sm90 bwd postprocess: head_dim {self.head_dim} does not split "
                             "over two warpgroups")

    def signature(self) -> KernelSignature:
        d, tm = self.head_dim, self.tile_m
        b, sq, h = 2, 256, 4
        if self.varlen:
            tq, tiles = 300, 300 // tm + b
            return KernelSignature(
                inputs=(TensorArg("dq_accum", "float32", (1, h, tiles * tm * d), (1, 1, tm * d),
                                  batched=False),
                        TensorArg("params", "float32", (NUM_PARAMS,), (NUM_PARAMS,), batched=False),
                        TensorArg("cu_seqlens_q", "int32", (b + 1,), (1,), batched=False),
                        TensorArg("tile_seq", "int32", (tiles,), (1,), batched=False)),
                outputs=(TensorArg("dq", self.dtype, (1, tq, h, d), (1, 1, 1, d),
                                   batched=False),),
            )
        return KernelSignature(
            inputs=(TensorArg("dq_accum", "float32", (b, h, sq * d), (1, 1, tm * d)),
                    TensorArg("params", "float32", (NUM_PARAMS,), (NUM_PARAMS,), batched=False)),
            outputs=(TensorArg("dq", self.dtype, (b, sq, h, d), (1, 1, 1, d)),),
        )


def segments_config(dtype: str, head_dim: int, head_dim_v: int | None = None,
                    mask: str = "none", has_softcap: bool = False, gqa: bool = False,
                    sink_grad: bool = False) -> BwdConfig:
    """The backward with segment ids for a problem kind: the plain loop of the table's tile,
    64 query rows at most (the rows' key spans and ids stay in registers through the block: a
    128-row tile spilled at head dim 64 with a window, softcap, GQA and a sink)."""
    cfg = BwdConfig.make(dtype, head_dim, head_dim_v, mask, has_softcap, gqa,
                         sink_grad=sink_grad, segments=True)
    if cfg.tile_m > 64:
        cfg = replace(cfg, tile_m=64)
        cfg.validate()
    return cfg


#: A ``group_shape`` that takes the group_heads form wherever the table's row allows it.
GROUP_HEADS_ANY = (1 << 30, 1)


def shipped_configs() -> list[KernelConfig]:
    """Every backward variant the package precompiles (main kernels and their postprocesses)."""
    out: list[KernelConfig] = []
    for dtype in FLOAT_DTYPES:
        for (d, dv), row in TUNING_TABLE.items():
            for mask in row:
                for softcap in (False, True):
                    for gqa in (False, True):
                        for sink in (False, True):  # (a learnable sink: sink_grad)
                            for det in (False, True):
                                out.append(BwdConfig.make(dtype, d, dv, mask, softcap, gqa,
                                                          deterministic=det, sink_grad=sink))
                                if gqa and row[mask].group_heads and not sink:
                                    out.append(BwdConfig.make(
                                        dtype, d, dv, mask, softcap, gqa, deterministic=det,
                                        group_shape=GROUP_HEADS_ANY))
                            out.append(varlen_config(dtype, d, dv, mask, softcap, gqa,
                                                     sink_grad=sink))
                            out.append(segments_config(dtype, d, dv, mask, softcap, gqa,
                                                       sink_grad=sink))
    return _with_postprocess(out)


def varlen_config(dtype: str, head_dim: int, head_dim_v: int | None = None, mask: str = "none",
                  has_softcap: bool = False, gqa: bool = False,
                  sink_grad: bool = False) -> BwdConfig:
    """The varlen backward config of a problem kind: the table's tile and stages (its key blocks
    launch in the work list's order)."""
    return BwdConfig.make(dtype, head_dim, head_dim_v, mask, has_softcap, gqa,
                          sink_grad=sink_grad, varlen=True)


def _with_postprocess(mains: list[BwdConfig]) -> list[KernelConfig]:
    post = []
    for c in mains:
        p = c.postprocess_config()
        if p not in post:
            post.append(p)
    return [*mains, *post]


def with_swap_sdp(cfg: BwdConfig) -> BwdConfig:
    """``cfg`` with swap_sdp on and, unless deterministic, the forward launch order (reversed,
    swap_sdp spills at hdim 128 with GQA: see validate)."""
    return replace(cfg, swap_sdp=True, reverse_launch=cfg.reverse_launch and cfg.deterministic)


def with_stats_smem(cfg: BwdConfig, on: bool = True) -> BwdConfig:
    """``cfg`` with its row statistics through shared memory (BwdConfig.stats_smem) or not."""
    return replace(cfg, stats_smem=on)


def without_swap_sdp(cfg: BwdConfig) -> BwdConfig:
    """``cfg`` with the plain loop (S, dP not transposed) in the launch order make() gives the
    plain loop (deterministic: reversed exactly under a causal mask)."""
    if not cfg.swap_sdp:
        return cfg
    t = tuning_for(cfg.head_dim, cfg.head_dim_v, cfg.mask)
    reverse = (cfg.mask == "causal") if cfg.deterministic else t.reverse_launch
    return replace(cfg, swap_sdp=False, reverse_launch=reverse)


def swap_sdp_config(*problem) -> BwdConfig:
    """The table's config for ``problem`` (BwdConfig.make's arguments) with swap_sdp on."""
    cfg = with_swap_sdp(BwdConfig.make(*problem))
    cfg.validate()
    return cfg
