"""FlashAttention backward for Blackwell (sm_100a) with 2-CTA MMAs (tcgen05 ``cta_group::2``).

The head-dim-128 and 192/128 backward of FA4's design (192: the "serial" layout at the end of
this docstring): a cluster of two CTAs (a *pair*) owns 256 consecutive
keys of one (batch, query head), each CTA 128 of them (its *own* key block n = blockIdx.x), and
both walk the same query blocks m of 128 rows. Same call contract, dq_accum layout and dK/dV
epilogue as the 1-CTA kernel (``bwd.py``, ``bwd_config.py``); deterministic configs use two
semaphore slots per query block (one per 64-row half, see the reduce warps).

Pair p = blockIdx.x // 2, rank r = blockIdx.x % 2 = the CTA's rank in its cluster; rank 0 is the
*leader*: it alone issues the MMAs and their commits, which read and write both CTAs' shared and
tensor memory at the same offsets. The query-block range is computed from the pair's 256-key
span (``BwdBlocks`` with tile_n 256 on p), so both CTAs run the same ``count`` iterations
(a deadlock otherwise); the element masks use each CTA's own keys 128·n + lane. Grid x is the
number of 128-key blocks rounded up to even; a block past seqlen_k runs with zero-filled loads
and fully masked P and skips its stores.

GEMMs per iteration (pair shapes M × N × K; A's M rows and B's N columns split between the CTAs;
"own" = the CTA's 128 keys; q-half r = queries [64r, 64r + 64) of the block):
    Sᵀ  = K·Qᵀ    256 × 128 × D   A sK (own keys × D)        B sQ   (q-half r × D)      SS
    dPᵀ = V·dOᵀ   256 × 128 × Dv  A sV (own keys × Dv)       B sdO  (q-half r × Dv)     SS
    dV += Pᵀ·dO   256 × Dv × 128  A Pᵀ in TMEM (own keys)    B sdOᵀ (Dv/2 cols r × 128) TS
    dK += dSᵀ·Q   256 × D × 128   A dSᵀ in TMEM (own keys)   B sQᵀ  (D/2 cols r × 128)  TS
    dQ  = dS·K    128 × D × 256   A sdS (q-half r × 256 keys) B sKᵀ (D/2 cols r × 256)  SS
Sᵀ, dPᵀ, dV, dK accumulate per CTA as 128 lanes (own keys) × N columns; dQ (M = 128 pair MMA)
lands *folded* in each CTA: lane l < 64 holds query 64r + l, columns [0, D/2); lane l ≥ 64 query
64r + l − 64, columns [D/2, D); D/2 TMEM columns.

Warps (512 threads per CTA): 0-3 dQ reduce; 4-11 compute (warpgroup w = query columns
[64w, 64w + 64) of Sᵀ / dPᵀ; thread = own key lane); 12 MMA (TMEM allocation in both CTAs, MMA
issue in the leader); 13 load; 14 relay; 15 idle.

Shared memory per CTA: sK, sV, sKᵀ (loaded once), sQ, sQᵀ, sdO, sdOᵀ (one stage each),
-lse_log2 / -delta of all 128 rows (``lse_stages``), sdS (q-half r × 256 keys as two 128-key
halves; half h holds the keys of CTA h), sdS_xchg (the q-half 1 − r of the own keys, sent to the
peer), the dQ reduce staging (``dq_stages`` × two (64, dq_cols) float32 boxes).

TMEM per CTA (512 columns): dK [0, 128), dV [128, 256), Sᵀ [256, 384) with 16-bit Pᵀ of
warpgroup w in Sᵀ's columns [64w, 64w + 32), dPᵀ [384, 512) with 16-bit dSᵀ of warpgroup w in
dPᵀ's columns [64w, 64w + 32) and dQ (64 columns) in dPᵀ's columns [64, 128). A warpgroup
overwrites only Sᵀ / dPᵀ columns it has read itself. dQ_j overwrites warpgroup 1's dSᵀ_j, which
dK_j (issued before dQ_j) reads: the tensor pipe executes the leader's MMAs in issue order.

Synchronisation (every signal once per iteration; phase = j % 2 unless said). "commit" = the
leader's ``tcgen05.commit`` with cta_group::2 and multicast mask 0b11 (one arrival on the
barrier at the same offset in both CTAs); "→ leader" = an arrival on the leader's barrier (a
remote ``mbarrier.arrive`` from the follower, cluster scope). Barriers counted per warp arrive
from one elected thread of each warp after the warp's tcgen05.wait::ld / wait::st / fences.
  TMA operands (PipelineTmaUmma, cluster layout (2)): each CTA's load warp waits its own empty
  barrier and copies its half-tiles with the 2-CTA TMA; the copies of both CTAs complete their
  bytes on the *leader's* full barrier, and only the leader arms it (arrive.expect_tx with twice
  the per-CTA bytes); the leader's MMA warp waits it; releases are commits.
    kv   (1 stage)   sK, sV, sKᵀ         never released
    q    (1 stage)   sQ                  released by the commit after Sᵀ_j
    qt   (1 stage)   sQᵀ                 released by the commit after dK_j
    do   (1 stage)   sdO                 released by the commit after dPᵀ_j
    dot  (1 stage)   sdOᵀ                released by the commit after dV_j
  lse (PipelineAsync, local, lse_stages): the load warp (32 producer threads) → the 256 compute
    threads of its own CTA.
  s_full   commit after Sᵀ_j                    → compute (both CTAs)
  p_full   compute → leader, 16 warp arrivals   Pᵀ_j stored (wait::st) and Sᵀ_j read
  dp_full  commit after dPᵀ_j                   → compute
  ds_full  compute → leader, 16 warp arrivals   dSᵀ_j in TMEM (wait::st), dPᵀ_j read, the own
                                                 q-half of dS_j in sdS (fence.proxy.async)
  xchg_full (each CTA, count 1 + 16 KB tx)      the peer's dS_j half has landed in this CTA's
                                                 sdS: the peer's sender thread arrives remotely
                                                 with expect_tx, then its DSMEM bulk copy
                                                 completes the bytes
  xchg_leader relay → leader, 2 warp arrivals   each CTA's relay warp waits its xchg_full_j and
                                                 forwards one arrival (a CTA can only wait on
                                                 its own barriers)
  ds_empty commit after dQ_j                    sdS and sdS_xchg free again (dQ_j read both
                                                 halves, and it ran after both copies landed)
  dq_full  commit after dQ_j                    → reduce (both CTAs)
  dq_empty reduce → leader, 8 warp arrivals     dQ_j drained from TMEM
  dkv_full commit after the last dK / dV MMA    → compute (epilogue)
Leader's MMA order, iteration j = 0 … count (count + 1 passes):
  j < count:  wait q full;   Sᵀ_j; commit s_full; release q
  j > 0:      wait ds_full_{j−1}, qt full;  dK += dSᵀ_{j−1}·Qᵀ; release qt
              wait xchg_leader_{j−1};       dQ_{j−1}; commit dq_full, ds_empty
  j < count:  j > 0: wait dq_empty_{j−1};  wait do full; dPᵀ_j; commit dp_full; release do
              wait p_full_j, dot full;      dV += Pᵀ_j·dOᵀ; release dot
  after:      count > 0: commit dkv_full
Compute warps (each CTA, warpgroup w), iteration j: wait lse_j, s_full_j; load Sᵀ columns
[64w, +64); mask, exp2 → P; store Pᵀ; → p_full; wait dp_full_j; load dPᵀ, dS = P∘(dP − δ);
release lse_j; store dSᵀ; j > 0: wait ds_empty_{j−1}; if w == r: dS → sdS half r, fence, →
ds_full; else: dS → sdS_xchg, fence, warpgroup barrier, one thread: remote expect_tx on the
peer's xchg_full, DSMEM bulk copy sdS_xchg → the peer's sdS half r; then → ds_full.
Relay warp (each CTA), iteration j: wait xchg_full_j; → xchg_leader.
Reduce warps (each CTA), iteration j: wait dq_full_j; per chunk of dq_cols columns, lanes 0-63
(warps 0-1) and 64-127 (warps 2-3) load their folded dQ rows, after the last chunk → dq_empty;
stage two (64, dq_cols) boxes in shared memory and TMA reduce-add them into dq_accum rows
128m + 64r …, columns c·dq_cols and D/2 + c·dq_cols. Deterministic: slot (m, r) of
dq_semaphore, turn = the pair's rank among the pairs that visit m.
Load order per iteration: Q, dO, lse, Qᵀ, dOᵀ (Q_j before Qᵀ_j: Qᵀ_{j−1}'s stage is freed by
the commit after dK_{j−1}, which the leader issues after Sᵀ_j, which needs Q_j; the other order
deadlocks). The ds_empty wait is implied in this MMA order (dp_full_j's commit follows dQ_{j−1},
which waited both copies) and kept as the buffer's own guard.
Start: barriers initialised, then a cluster barrier before any role runs (no remote arrive may
reach an uninitialised barrier). TMEM: allocated with cta_group::2 by the MMA warp of both CTAs,
freed after the dealloc barrier with the allocator's peer handshake. End: the load warp waits
the last phase of its q / qt / do / dot empty barriers and the relay warp the last ds_empty
(commits nobody else waits for, whose arrivals need not keep issue order), then a cluster
barrier, so no CTA exits while its peer may still signal it.

Varlen (``cfg.varlen``; shipped at 192/128, ``bwd_config.varlen_config``; called by
jax_fa4/backends/sm100.py with the varlen backward's contract,
varlen_bwd_config.varlen_attention_backward_signature): a work item is a pair's 256-key span of
one sequence (the caller's list built with ``work_tile_n`` = 256); grid (2W, H), CTA x' = 2x +
rank reads work row x = (sequence, pair index p within it, offsets, lengths, first dq_accum
tile); the own key block is 2p + rank of the sequence. The query-block range comes from the
pair's span on the sequence's lengths and windows (both CTAs, as above); element masks from the
own keys and the sequence's seqlen_k. TMA views and -lse / -delta rows start at the sequence's
first rows (tile rows past it: another sequence's, masked, or padding the caller zeroed: the
256 key and 128 query rows after the last sequence); a CTA without keys of its sequence runs its
peer's iterations fully masked and stores nothing; the others store dK / dV rows below seqlen_k;
query block m reduce-adds the 64-row box 2·(work[x, 6] + m) + rank of dq_accum. Spare rows,
sequences without queries and pairs no query block sees: count = 0 in both CTAs; the
ZERO_PADDING row's leader zeroes dK / dV outside every sequence after the TMEM dealloc barrier.
No barrier, role or phase changes (tests/test_sm100_bwd_2cta_protocol.py models varlen grids);
not deterministic.

Segment ids (``cfg.segments``; shipped at 192/128, ``bwd_config.segments_config``, its own tuning
row: one dQ staging buffer, the dense row's two would leave no room for the row-id stages;
called by jax_fa4/backends/sm100.py with jax_fa4/segments.py's backward tables for the 128 × 128
tile, the 1-CTA kernel's contract): both CTAs of pair p intersect the pair's mask range with
``pair_segment_range``, the envelope of key blocks 2p and 2p + 1's [m_lo, m_hi) of seg_keys (an
empty one ignored, a block 2p + 1 past the table none), so they run the same count; a pair
whose two ranges are empty takes count = 0. The per-CTA part is the 1-CTA kernel's, imported:
the load warp stages with each block's -lse / -delta its rows' ids and the flag "the own key
block lies outside the query block's bulk" (stage_stats, flags per own 128-key block, so the
two CTAs' flags may differ), and in a flagged block the compute warps mask every query column
whose id is not the own key's (softmax_p, segment_key). A CTA walks query blocks its own table
row excludes only when its peer's range holds them: no row there shares an id with its keys, so
they are masked there whole (P = dS = 0). The stages take tile_m × lse_stages + 4 int32 (1,040
B: 228,368 B in all at 192/128). No barrier, role or phase changes (the protocol model runs
segment-id grids); not deterministic.

Head dim 192 / Dv 128 (``serial``: FA4's layout, built from the same pieces). TMEM per CTA: dV
[0, 128), dK [128, 320), Sᵀ [320, 448) with Pᵀ (16-bit) *contiguous* in Sᵀ's first 64 columns
(warpgroup w at [32w, 32w + 32)), dPᵀ [384, 512) *overlapping Sᵀ's upper 64 columns*, dSᵀ (16-bit)
contiguous in dPᵀ's first 64 columns, dQ (96 columns, folded) at [416, 512) = dPᵀ's columns
[32, 128). Shared memory: one buffer holds Q_j, then Qᵀ_j (same size), one holds dO_j, then dOᵀ_j
(pipelines ``q`` and ``do``, one stage, two uses per iteration; no qt / dot pipelines); the rest
as head dim 128. Changes to the protocol:
  s_read   compute → leader, 16 warp arrivals   Sᵀ_j fully loaded (tcgen05.wait::ld): dPᵀ_j may
                                                 overwrite Sᵀ's upper half
  compute: after loading Sᵀ_j → s_read; a 256-thread named barrier (both warpgroups) before the
    Pᵀ stores (warpgroup 1 writes Sᵀ columns [32, 64) that warpgroup 0 loads) and another before
    the dSᵀ stores (likewise for dPᵀ's columns [32, 64)).
  Leader's MMA order, iteration j = 0 … count − 1 (no skew):
    j > 0: wait dq_empty_{j−1} (dQ_{j−1} drained: Sᵀ_j overwrites its columns [416, 448));
    wait q full (Q_j);   Sᵀ_j; commit s_full; release q
    wait s_read_j, do full (dO_j);  dPᵀ_j; commit dp_full; release do
    wait p_full_j, do full (dOᵀ_j); dV += Pᵀ_j·dOᵀ_j; release do
    wait ds_full_j, q full (Qᵀ_j);  dK += dSᵀ_j·Qᵀ_j; release q
    wait xchg_leader_j;             dQ_j; commit dq_full, ds_empty
    after: count > 0: commit dkv_full
  Load order per iteration: Q, dO, lse, Qᵀ, dOᵀ (through the q and do stages: Qᵀ_j waits the
  release after Sᵀ_j, dOᵀ_j the one after dPᵀ_j, Q_{j+1} the one after dK_j, dO_{j+1} the one
  after dV_j). dOᵀ_j must come after Q_j and lse_j: its stage is freed after dPᵀ_j, which waits
  s_read_j, i.e. the compute warps' Sᵀ_j loads (the other orders deadlock). dQ_j overwrites
  dSᵀ_j's upper half, read by dK_j (issued before it); dPᵀ_{j+1} and Sᵀ_{j+1} come after dQ_j
  and the dq_empty_j wait.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass._mlir.dialects import llvm, nvvm
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.cutlass_dsl import T, dsl_user_op

from jax_fa4.kernels.common.geometry import BwdBlocks, resolve_windows
from jax_fa4.kernels.common.layout import select_modes
from jax_fa4.kernels.common.views import sequence
from jax_fa4.kernels.segments_config import SEG_KEY_M_HI, SEG_KEY_M_LO
from jax_fa4.kernels.sm100.bwd import (COMPUTE_WARPS, LOAD_WARP, MMA_WARP, REDUCE_WARPS,
                                       ZERO_PADDING, Barrier, FlashAttentionBackwardSm100,
                                       ld_acquire_gpu, red_release_gpu_add, tmem_cols)
from jax_fa4.kernels.sm100.bwd_config import Sm100BwdConfig
from jax_fa4.kernels.spec import PARAM_SCALE, SMEM_CAPACITY_BYTES

RELAY_WARP = 14
LEADER = 0  # cluster rank of the CTA that issues the MMAs
BOTH_CTAS = 0b11  # multicast mask of the leader's commits
CLUSTER = nvvm.MemScopeKind.CLUSTER
#: named barriers (ids 1-3: bwd.Barrier): the warpgroup that sends its dS half to the peer;
#: both compute warpgroups (serial layout)
XCHG_BARRIER, COMPUTE_BARRIER = 4, 5
#: per-iteration warp arrivals on the leader's compute → MMA barriers (8 warps × 2 CTAs)
COMPUTE_ARRIVALS = 2 * len(COMPUTE_WARPS)
REDUCE_ARRIVALS = 2 * len(REDUCE_WARPS)


@dsl_user_op
def bulk_copy_to_peer(dst: cute.Pointer, src: cute.Pointer, mbar: cute.Pointer, peer: Int32,
                      num_bytes: int, *, loc=None, ip=None) -> None:
    """cp.async.bulk.shared::cluster.shared::cta of ``num_bytes`` from this CTA's ``src`` to the
    peer CTA's copy of ``dst`` (same offset), completing the bytes on the peer's copy of
    ``mbar`` (mapa of both addresses to cluster rank ``peer``)."""
    llvm.inline_asm(
        None,
        [dst.toint(loc=loc, ip=ip).ir_value(), src.toint(loc=loc, ip=ip).ir_value(),
         mbar.toint(loc=loc, ip=ip).ir_value(), Int32(peer).ir_value(loc=loc, ip=ip),
         Int32(num_bytes).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .b32 d, m;\n\t"
        "mapa.shared::cluster.u32 d, $0, $3;\n\t"
        "mapa.shared::cluster.u32 m, $2, $3;\n\t"
        "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes "
        "[d], [$1], $4, [m];\n\t}",
        "r,r,r,r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip)


@dsl_user_op
def st_shared_u32(ptr: cute.Pointer, val: Int32, *, loc=None, ip=None) -> None:
    llvm.inline_asm(
        None, [ptr.toint(loc=loc, ip=ip).ir_value(), Int32(val).ir_value(loc=loc, ip=ip)],
        "st.shared.u32 [$0], $1;", "r,r", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def ld_volatile_shared_u32(ptr: cute.Pointer, *, loc=None, ip=None) -> Int32:
    return Int32(llvm.inline_asm(
        T.i32(), [ptr.toint(loc=loc, ip=ip).ir_value()], "ld.volatile.shared.u32 $0, [$1];",
        "=r,r", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


def operand_view(storage, mem, layout: cute.ComposedLayout, dtype) -> cute.Tensor:
    """The swizzled shared-memory tensor ``layout`` over the buffer ``mem`` (a member of
    ``storage``), its address re-read (volatile) from ``storage.smem_anchor``: the MMA
    descriptors derived from it are computed where they are used. Derived once, the pair MMAs'
    48 descriptor pairs stay live across the loop and spill (the address arithmetic of a
    register copy is seen through by ptxas, a volatile load is not)."""
    anchor = storage.sK.data_ptr().toint()
    addr = ld_volatile_shared_u32(storage.smem_anchor.ptr) + (mem.data_ptr().toint() - anchor)
    ptr = cute.make_ptr(dtype, addr, cute.AddressSpace.smem, assumed_align=1024)
    return cute.make_tensor(cute.recast_ptr(ptr, layout.inner, dtype=dtype), layout.outer)


def commit(mbar: cute.Pointer) -> None:
    """The leader's tcgen05.commit (cta_group::2) arriving on ``mbar`` in both CTAs once the
    MMAs issued before it are complete."""
    with cute.arch.elect_one():
        tcgen05.commit(mbar, BOTH_CTAS, tcgen05.CtaGroup.TWO)


def arrive_leader(mbar: cute.Pointer) -> None:
    """One elected thread of the warp arrives on the leader's ``mbar`` (remote from the
    follower), cluster scope: it publishes the warp's writes (each thread fenced before)."""
    cute.arch.sync_warp()
    with cute.arch.elect_one():
        cute.arch.mbarrier_arrive(mbar, LEADER, scope=CLUSTER)


class FlashAttentionBackwardSm100TwoCta(FlashAttentionBackwardSm100):
    def __init__(self, cfg: Sm100BwdConfig):
        if not cfg.two_cta:
            raise ValueError("FlashAttentionBackwardSm100TwoCta needs a two_cta config")
        super().__init__(cfg)
        self.lse_stages = cfg.lse_stages
        self.q_half = self.tile_m // 2  # queries of sQ / sdO / sdS per CTA
        self.xchg_bytes = self.q_half * self.tile_n * 2  # the dS half sent to the peer
        # setmaxnreg per warpgroup: 4·reduce + 8·compute + 4·other = 2048 (64K registers / 32)
        self.reduce_regs, self.compute_regs, self.other_regs = 72, 160, 120
        self.serial = cfg.serial
        if self.serial:  # 16-bit Pᵀ / dSᵀ contiguous in their region's first 64 columns
            self.p16_stride = self.cols_per_wg // 2

    # ---------------------------------------------------------------------------------------------
    # Host side
    # ---------------------------------------------------------------------------------------------
    def tiled_mmas(self):
        """The five pair MMAs (cta_group::2), as (tiler, tiled MMA): Sᵀ, dPᵀ, dV, dK, dQ."""
        dt = self.dtype
        D, Dv, tm, tn2 = self.hdim, self.hdimv, self.tile_m, 2 * self.tile_n
        K_MAJOR, MN_MAJOR = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        cta, tmem_a = tcgen05.CtaGroup.TWO, tcgen05.OperandSource.TMEM
        out = []
        for tiler, a_major, b_major, a_src in (
                ((tn2, tm, D), K_MAJOR, K_MAJOR, None),  # Sᵀ = K·Qᵀ
                ((tn2, tm, Dv), K_MAJOR, K_MAJOR, None),  # dPᵀ = V·dOᵀ
                ((tn2, Dv, tm), K_MAJOR, MN_MAJOR, tmem_a),  # dV += Pᵀ·dO
                ((tn2, D, tm), K_MAJOR, MN_MAJOR, tmem_a),  # dK += dSᵀ·Q
                ((tm, D, tn2), MN_MAJOR, MN_MAJOR, None)):  # dQ = dS·K
            if const_expr(a_src is None):
                mma = sm100_utils.make_trivial_tiled_mma(dt, dt, a_major, b_major, Float32, cta,
                                                         tiler[:2])
            else:
                mma = sm100_utils.make_trivial_tiled_mma(dt, dt, a_major, b_major, Float32, cta,
                                                         tiler[:2], a_src)
            out.append((tiler, mma))
        return out

    def shared_storage(self, sQ_l, sQt_l, sK_l, sKt_l, sV_l, sdO_l, sdOt_l, sdS_l, sdQ_l):
        """The kernel's shared storage (a ``cute.struct``): barriers, the lse / delta stages
        (with segment ids, the row-id and flag stages), then the 1 KB-aligned operand buffers.
        Serial: Qᵀ lives in sQ's buffer and dOᵀ in sdO's
        (no sQt / sdOt, no qt / dot pipelines)."""
        dt, tm = self.dtype, self.tile_m
        MemRange, Align = cute.struct.MemRange, cute.struct.Align
        I64 = cutlass.Int64

        def buf(dtype, n):
            return Align[MemRange[dtype, n], 1024]

        fields = {"mbar_kv": MemRange[I64, 2], "mbar_q": MemRange[I64, 2 * self.q_stages],
                  "mbar_do": MemRange[I64, 2 * self.do_stages]}
        if not self.serial:
            fields.update(mbar_qt=MemRange[I64, 2 * self.q_stages],
                          mbar_dot=MemRange[I64, 2 * self.do_stages])
        fields.update(
            mbar_lse=MemRange[I64, 2 * self.lse_stages], mbar_sig=MemRange[I64, 11],
            mbar_dealloc=I64, tmem_holding_buf=Int32,
            smem_anchor=Int32,  # sK's address, re-read by the MMA warp (operand_view)
            sLSE=Align[MemRange[Float32, tm * self.lse_stages], 16],
            sDelta=Align[MemRange[Float32, tm * self.lse_stages], 16])
        if self.segments:  # the rows' ids and the blocks' mask flags (bwd.py's segment_stages)
            fields.update(sSegIds=Align[MemRange[Int32, tm * self.lse_stages], 16],
                          sSegMask=Align[MemRange[Int32, max(self.lse_stages, 4)], 16])
        fields.update(
            sK=buf(dt, cute.cosize(sK_l)), sV=buf(dt, cute.cosize(sV_l)),
            sKt=buf(dt, cute.cosize(sKt_l)))
        if self.serial:
            fields.update(sQ=buf(dt, max(cute.cosize(sQ_l), cute.cosize(sQt_l))),
                          sdO=buf(dt, max(cute.cosize(sdO_l), cute.cosize(sdOt_l))))
        else:
            fields.update(sQ=buf(dt, cute.cosize(sQ_l)), sQt=buf(dt, cute.cosize(sQt_l)),
                          sdO=buf(dt, cute.cosize(sdO_l)), sdOt=buf(dt, cute.cosize(sdOt_l)))
        fields.update(sdS=buf(dt, cute.cosize(sdS_l)), sXchg=buf(dt, cute.cosize(sdS_l) // 2),
                      sdQ=buf(Float32, cute.cosize(sdQ_l)))
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    def transposed_buffers(self, storage):
        """The shared buffers of Qᵀ and dOᵀ (serial: Q's and dO's)."""
        if self.serial:
            return storage.sQ, storage.sdO
        return storage.sQt, storage.sdOt

    @cute.jit
    def __call__(self, stream: cuda.CUstream, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                 mdO: cute.Tensor, mLSE: cute.Tensor, mDelta: cute.Tensor, mParams: cute.Tensor,
                 mdQacc: cute.Tensor, mSem: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
                 mCuSeqlensK: cute.Tensor | None = None, mWork: cute.Tensor | None = None,
                 mSegTiles: cute.Tensor | None = None, mSegKeys: cute.Tensor | None = None,
                 mSegRows: cute.Tensor | None = None, mKvIds: cute.Tensor | None = None):
        for mode, names, args in (
                (self.varlen, "cu_seqlens_k and work", (mCuSeqlensK, mWork)),
                (self.segments, "seg_tiles, seg_keys, seg_rows and kv_ids",
                 (mSegTiles, mSegKeys, mSegRows, mKvIds))):
            if const_expr(any((t is not None) != mode for t in args)):
                raise TypeError(f"2-CTA backward: {names} come with their mode's configs only")
            if const_expr(mode and any(t.element_type != Int32 for t in args)):
                raise TypeError(f"2-CTA backward: {names} must be int32")
        mQ, mK, mV, mdO, mLSE, mDelta, mdQacc, mSem, mdK, mdV = self.input_views(
            mQ, mK, mV, mdO, mLSE, mDelta, mParams, mdQacc, mSem, mdK, mdV)
        tn, nc = self.tile_n, self.dq_cols
        dt = self.dtype
        (st_tiler, st_mma), (dpt_tiler, dpt_mma), (dv_tiler, dv_mma), (dk_tiler, dk_mma), \
            (dq_tiler, dq_mma) = self.tiled_mmas()
        cluster_vmnk = cute.tiled_divide(cute.make_layout((2, 1, 1)), (st_mma.thr_id.shape,))

        # per-CTA operand layouts (the pair MMAs split A's rows and B's columns)
        sK_l = sm100_utils.make_smem_layout_a(st_mma, st_tiler, dt, 1)
        sQ_l = sm100_utils.make_smem_layout_b(st_mma, st_tiler, dt, self.q_stages)
        sV_l = sm100_utils.make_smem_layout_a(dpt_mma, dpt_tiler, dt, 1)
        sdO_l = sm100_utils.make_smem_layout_b(dpt_mma, dpt_tiler, dt, self.do_stages)
        sdOt_l = sm100_utils.make_smem_layout_b(dv_mma, dv_tiler, dt, self.do_stages)
        sQt_l = sm100_utils.make_smem_layout_b(dk_mma, dk_tiler, dt, self.q_stages)
        sKt_l = sm100_utils.make_smem_layout_b(dq_mma, dq_tiler, dt, 1)
        sdS_l = sm100_utils.make_smem_layout_a(dq_mma, dq_tiler, dt, 1)  # (q-half, 256 keys)
        tP_l = sm100_utils.make_smem_layout_a(dv_mma, dv_tiler, dt, 1)  # Pᵀ / dSᵀ in TMEM
        # dQ reduce staging: (64, dq_cols) float32 boxes, K-major swizzled, two per stage
        sdQ_atom = sm100_utils.make_smem_layout_atom(
            sm100_utils.get_smem_layout_atom_ab(cute.nvgpu.OperandMajorMode.K, Float32,
                                                (self.q_half, nc)), Float32)
        sdQ_l = cute.tile_to_shape(sdQ_atom, (self.q_half, nc, 2 * self.dq_stages),
                                   order=(1, 0, 2))

        g2s = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.TWO)
        vmnk = cluster_vmnk.shape
        tma_atom_K, tma_K = cute.nvgpu.make_tiled_tma_atom_A(
            g2s, mK, cute.select(sK_l, mode=[0, 1, 2]), st_tiler, st_mma, vmnk)
        tma_atom_V, tma_V = cute.nvgpu.make_tiled_tma_atom_A(
            g2s, mV, cute.select(sV_l, mode=[0, 1, 2]), dpt_tiler, dpt_mma, vmnk)
        tma_atom_Q, tma_Q = cute.nvgpu.make_tiled_tma_atom_B(
            g2s, mQ, cute.select(sQ_l, mode=[0, 1, 2]), st_tiler, st_mma, vmnk)
        tma_atom_dO, tma_dO = cute.nvgpu.make_tiled_tma_atom_B(
            g2s, mdO, cute.select(sdO_l, mode=[0, 1, 2]), dpt_tiler, dpt_mma, vmnk)
        # the column-major operands: (D, S, H, B) views of the same tensors
        tma_atom_Qt, tma_Qt = cute.nvgpu.make_tiled_tma_atom_B(
            g2s, select_modes(mQ, (1, 0, 2, 3)), cute.select(sQt_l, mode=[0, 1, 2]), dk_tiler,
            dk_mma, vmnk)
        tma_atom_dOt, tma_dOt = cute.nvgpu.make_tiled_tma_atom_B(
            g2s, select_modes(mdO, (1, 0, 2, 3)), cute.select(sdOt_l, mode=[0, 1, 2]),
            dv_tiler, dv_mma, vmnk)
        tma_atom_Kt, tma_Kt = cute.nvgpu.make_tiled_tma_atom_B(
            g2s, select_modes(mK, (1, 0, 2, 3)), cute.select(sKt_l, mode=[0, 1, 2]), dq_tiler,
            dq_mma, vmnk)
        tma_atom_dQ, tma_dQ = cpasync.make_tiled_tma_atom(
            cpasync.CopyReduceBulkTensorTileS2GOp(), mdQacc, cute.select(sdQ_l, mode=[0, 1]),
            (self.q_half, nc))

        def pair_bytes(layout):  # both CTAs' copies complete on the leader's barrier
            return 2 * cute.size_in_bytes(dt, cute.select(layout, mode=[0, 1, 2]))

        self.tx_kv = pair_bytes(sK_l) + pair_bytes(sV_l) + pair_bytes(sKt_l)
        self.tx_q, self.tx_qt = pair_bytes(sQ_l), pair_bytes(sQt_l)
        self.tx_do, self.tx_dot = pair_bytes(sdO_l), pair_bytes(sdOt_l)
        if const_expr(self.serial and (self.tx_q != self.tx_qt or self.tx_do != self.tx_dot)):
            raise ValueError("serial layout: Qᵀ / dOᵀ must fill the Q / dO stages exactly")

        SharedStorage = self.shared_storage(sQ_l, sQt_l, sK_l, sKt_l, sV_l, sdO_l, sdOt_l,
                                            sdS_l, sdQ_l)
        if const_expr(SharedStorage.__sizeof__() > SMEM_CAPACITY_BYTES):
            raise ValueError(f"sm100 2-CTA backward: {SharedStorage.__sizeof__()} B of shared "
                             f"storage exceed {SMEM_CAPACITY_BYTES} B")
        if const_expr(cute.cosize(sdS_l) * 2 != 2 * self.xchg_bytes):
            raise ValueError("sdS must hold two 128-key halves of the exchange size")

        # grid x: 128-key blocks rounded up to whole pairs
        grid = (cute.ceil_div(mK.shape[0], 2 * tn) * 2, mQ.shape[2], mQ.shape[3])
        if const_expr(self.varlen):  # one pair per (work item, query head)
            grid = (2 * mWork.shape[0], mQ.shape[2], 1)
        self.kernel(
            tma_Q, tma_Qt, tma_K, tma_Kt, tma_V, tma_dO, tma_dOt, tma_dQ, mdK, mdV, mLSE,
            mDelta, mParams, mSem,
            tma_atom_Q, tma_atom_Qt, tma_atom_K, tma_atom_Kt, tma_atom_V, tma_atom_dO,
            tma_atom_dOt, tma_atom_dQ,
            sQ_l, sQt_l, sK_l, sKt_l, sV_l, sdO_l, sdOt_l, sdS_l, sdQ_l, tP_l,
            st_mma, dpt_mma, dv_mma, dk_mma, dq_mma, SharedStorage, mCuSeqlensK, mWork,
            mSegTiles, mSegKeys, mSegRows, mKvIds,
        ).launch(grid=grid, block=[self.cfg.num_threads, 1, 1], cluster=[2, 1, 1],
                 stream=stream, min_blocks_per_mp=1)

    # ---------------------------------------------------------------------------------------------
    # Device side
    # ---------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mQt: cute.Tensor, mK: cute.Tensor, mKt: cute.Tensor,
               mV: cute.Tensor, mdO: cute.Tensor, mdOt: cute.Tensor, mdQacc: cute.Tensor,
               mdK: cute.Tensor, mdV: cute.Tensor, mLSE: cute.Tensor, mDelta: cute.Tensor,
               mParams: cute.Tensor, mSem: cute.Tensor,
               tma_atom_Q: cute.CopyAtom, tma_atom_Qt: cute.CopyAtom, tma_atom_K: cute.CopyAtom,
               tma_atom_Kt: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
               tma_atom_dO: cute.CopyAtom, tma_atom_dOt: cute.CopyAtom,
               tma_atom_dQ: cute.CopyAtom,
               sQ_l: cute.ComposedLayout, sQt_l: cute.ComposedLayout, sK_l: cute.ComposedLayout,
               sKt_l: cute.ComposedLayout, sV_l: cute.ComposedLayout,
               sdO_l: cute.ComposedLayout, sdOt_l: cute.ComposedLayout,
               sdS_l: cute.ComposedLayout, sdQ_l: cute.ComposedLayout,
               tP_l: cute.ComposedLayout,
               st_mma: cute.TiledMma, dpt_mma: cute.TiledMma, dv_mma: cute.TiledMma,
               dk_mma: cute.TiledMma, dq_mma: cute.TiledMma, SharedStorage: cutlass.Constexpr,
               mCuSeqlensK: cute.Tensor | None, mWork: cute.Tensor | None,
               mSegTiles: cute.Tensor | None, mSegKeys: cute.Tensor | None,
               mSegRows: cute.Tensor | None, mKvIds: cute.Tensor | None):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        n_block, head, batch = cute.arch.block_idx()
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        pair = n_block // 2
        if warp_idx == LOAD_WARP:
            for atom in (tma_atom_Q, tma_atom_Qt, tma_atom_K, tma_atom_Kt, tma_atom_V,
                         tma_atom_dO, tma_atom_dOt, tma_atom_dQ):
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        cluster_vmnk = cute.tiled_divide(cute.make_layout((2, 1, 1)), (st_mma.thr_id.shape,))

        # TMA → MMA pipelines: the leader arms (twice the per-CTA bytes), both CTAs' copies
        # complete on the leader's full barrier, the releases are multicast commits
        one_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)

        def tma_pipeline(mbars, stages, tx):
            return pipeline.PipelineTmaUmma.create(
                barrier_storage=mbars.data_ptr(), num_stages=stages, producer_group=one_thread,
                consumer_group=one_thread, tx_count=tx, cta_layout_vmnk=cluster_vmnk,
                defer_sync=True)

        pipeline_kv = tma_pipeline(storage.mbar_kv, 1, self.tx_kv)
        pipeline_q = tma_pipeline(storage.mbar_q, self.q_stages, self.tx_q)
        pipeline_do = tma_pipeline(storage.mbar_do, self.do_stages, self.tx_do)
        if const_expr(self.serial):  # Qᵀ / dOᵀ through the Q / dO stages (same byte counts)
            pipeline_qt, pipeline_dot = pipeline_q, pipeline_do
        else:
            pipeline_qt = tma_pipeline(storage.mbar_qt, self.q_stages, self.tx_qt)
            pipeline_dot = tma_pipeline(storage.mbar_dot, self.do_stages, self.tx_dot)
        pipeline_lse = pipeline.PipelineAsync.create(
            barrier_storage=storage.mbar_lse.data_ptr(), num_stages=self.lse_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     32 * len(COMPUTE_WARPS)),
            defer_sync=True)
        sig = storage.mbar_sig.data_ptr()
        s_full, p_full, dp_full, ds_full, ds_empty = sig, sig + 1, sig + 2, sig + 3, sig + 4
        dq_full, dq_empty, dkv_full, xchg_full, xchg_leader = (sig + 5, sig + 6, sig + 7,
                                                               sig + 8, sig + 9)
        s_read = sig + 10  # serial only
        if warp_idx == 0:
            with cute.arch.elect_one():
                for bar, count in ((s_full, 1), (p_full, COMPUTE_ARRIVALS), (dp_full, 1),
                                   (ds_full, COMPUTE_ARRIVALS), (ds_empty, 1), (dq_full, 1),
                                   (dq_empty, REDUCE_ARRIVALS), (dkv_full, 1), (xchg_full, 1),
                                   (xchg_leader, 2), (s_read, COMPUTE_ARRIVALS)):
                    cute.arch.mbarrier_init(bar, count)
        tmem_users = 32 * (len(COMPUTE_WARPS) + len(REDUCE_WARPS) + 1)
        tmem = utils.TmemAllocator(
            storage.tmem_holding_buf.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=int(Barrier.TMEM_ALLOC),
                                                       num_threads=tmem_users),
            allocator_warp_id=MMA_WARP, is_two_cta=True,
            two_cta_tmem_dealloc_mbar_ptr=storage.mbar_dealloc.ptr)
        dealloc_barrier = pipeline.NamedBarrier(barrier_id=int(Barrier.TMEM_DEALLOC),
                                                num_threads=tmem_users)
        # every barrier of both CTAs is initialised before any CTA signals its peer
        cute.arch.mbarrier_init_fence()
        cute.arch.cluster_arrive_relaxed()
        cute.arch.cluster_wait()

        sQ = storage.sQ.get_tensor(sQ_l.outer, swizzle=sQ_l.inner)
        qt_mem, dot_mem = self.transposed_buffers(storage)
        sQt = qt_mem.get_tensor(sQt_l.outer, swizzle=sQt_l.inner)
        sK = storage.sK.get_tensor(sK_l.outer, swizzle=sK_l.inner)
        sKt = storage.sKt.get_tensor(sKt_l.outer, swizzle=sKt_l.inner)
        sV = storage.sV.get_tensor(sV_l.outer, swizzle=sV_l.inner)
        sdO = storage.sdO.get_tensor(sdO_l.outer, swizzle=sdO_l.inner)
        sdOt = dot_mem.get_tensor(sdOt_l.outer, swizzle=sdOt_l.inner)
        sdS = storage.sdS.get_tensor(sdS_l.outer, swizzle=sdS_l.inner)
        # the exchange buffer holds sdS's first key half only (its layout, its swizzle phase)
        sXchg = storage.sXchg.get_tensor(sdS_l.outer, swizzle=sdS_l.inner)
        sdQ = storage.sdQ.get_tensor(sdQ_l.outer, swizzle=sdQ_l.inner)
        sLSE = storage.sLSE.get_tensor(cute.make_layout((self.tile_m, self.lse_stages)))
        sDelta = storage.sDelta.get_tensor(cute.make_layout((self.tile_m, self.lse_stages)))

        # run-time scalars, identical in every role
        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
        # varlen: both CTAs of the pair read work row x // 2 = (sequence, pair index p within
        # it, its rows' offsets in the packed q and k, its lengths, its first dq_accum tile);
        # the CTA's own key block is 2p + rank of the sequence. Spare and padding rows:
        # lengths 0, count 0 in both CTAs.
        seq, q_offset, k_offset, dq_tile0 = None, None, None, None
        if const_expr(self.varlen):
            item = n_block // 2
            batch = Int32(0)
            seq, pair = mWork[item, 0], mWork[item, 1]
            n_block = 2 * pair + rank
            q_offset, k_offset = mWork[item, 2], mWork[item, 3]
            seqlen_q, seqlen_k = mWork[item, 4], mWork[item, 5]
            dq_tile0 = mWork[item, 6]
        window_left, window_right = resolve_windows(mParams, seqlen_q, seqlen_k, self.is_local)
        head_kv = head // (mQ.shape[2] // mK.shape[2])
        # element masks per own 128-key block; query-block range and dQ turn per 256-key pair
        blocks = BwdBlocks(self.tile_m, self.tile_n, self.is_causal, self.is_local,
                           seqlen_q, seqlen_k, window_left, window_right)
        pair_blocks = BwdBlocks(self.tile_m, 2 * self.tile_n, self.is_causal, self.is_local,
                                seqlen_q, seqlen_k, window_left, window_right)
        m_min, m_max = pair_blocks.m_block_range(pair)
        # segment ids: the pair walks the union of its two key blocks' table ranges (one range
        # for both CTAs); each CTA stages its own block's mask flags and compares its own keys'
        # ids (the 1-CTA kernel's stage_stats / softmax_p)
        load_segs, compute_segs = None, None
        if const_expr(self.segments):
            seg_lo, seg_hi = self.pair_segment_range(mSegKeys, batch, pair)
            m_min = cutlass.max(m_min, seg_lo)
            m_max = cutlass.min(m_max, seg_hi)
            sSegIds, sSegMask = self.segment_stages(storage, self.lse_stages)
            load_segs = (mSegTiles, mSegRows, sSegIds, sSegMask, n_block)
            compute_segs = (mKvIds, sSegIds, sSegMask)
        count = cutlass.max(m_max - m_min, 0)

        wg_idx = warp_idx // 4
        if wg_idx == 0:  # dQ reduce warps
            cute.arch.setmaxregister_decrease(self.reduce_regs)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            self.reduce_warps_2cta(mdQacc, mSem, sdQ, tma_atom_dQ, st_mma, tmem_ptr, dq_full,
                                   dq_empty, head, batch, pair, rank, m_min, count,
                                   pair_blocks, tidx, warp_idx, dq_tile0)
            cute.arch.fence_view_async_tmem_load()
            dealloc_barrier.arrive_and_wait()
        elif wg_idx < 3:  # compute warps
            cute.arch.setmaxregister_increase(self.compute_regs)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            self.compute_warps_2cta(mdK, mdV, mParams, sdS, sXchg, storage, sLSE, sDelta,
                                    st_mma, tmem_ptr, pipeline_lse, s_full, p_full, dp_full,
                                    ds_full, ds_empty, dkv_full, xchg_full, s_read, head,
                                    head_kv, batch, n_block, rank, m_min, count, blocks, tidx,
                                    warp_idx, k_offset, segs=compute_segs)
            cute.arch.fence_view_async_tmem_load()
            dealloc_barrier.arrive_and_wait()
            if const_expr(self.varlen):
                # the leader of the ZERO_PADDING pair (count = 0: no TMEM, no barrier touched)
                if seq == ZERO_PADDING and rank == LEADER:
                    self.zero_padding_dkv(mdK, mdV, mCuSeqlensK, head, head_kv, tidx)
        else:
            cute.arch.setmaxregister_decrease(self.other_regs)
            if warp_idx == LOAD_WARP:
                self.load_warp_2cta(mQ, mQt, mK, mKt, mV, mdO, mdOt, mLSE, mDelta, sQ, sQt, sK,
                                    sKt, sV, sdO, sdOt, sLSE, sDelta, tma_atom_Q, tma_atom_Qt,
                                    tma_atom_K, tma_atom_Kt, tma_atom_V, tma_atom_dO,
                                    tma_atom_dOt, st_mma, dpt_mma, dv_mma, dk_mma, dq_mma,
                                    pipeline_kv, pipeline_q, pipeline_qt, pipeline_do,
                                    pipeline_dot, pipeline_lse, head, head_kv, batch, pair,
                                    rank, m_min, count, seqlen_q, tidx, q_offset, k_offset,
                                    seg=load_segs)
            if warp_idx == MMA_WARP:
                tmem.allocate(self.tmem_alloc_cols)
                tmem.wait_for_alloc()
                tmem_ptr = tmem.retrieve_ptr(Float32)
                tmem.relinquish_alloc_permit()
                if rank == LEADER:
                    self.mma_warp_2cta(storage, sQ_l, sQt_l, sK_l, sKt_l, sV_l, sdO_l, sdOt_l,
                                       sdS_l, tP_l, st_mma, dpt_mma, dv_mma, dk_mma, dq_mma,
                                       tmem_ptr, pipeline_kv,
                                       pipeline_q, pipeline_qt, pipeline_do, pipeline_dot,
                                       s_full, p_full, dp_full, ds_full, ds_empty, dq_full,
                                       dq_empty, dkv_full, xchg_leader, s_read, count)
                dealloc_barrier.arrive_and_wait()
                tmem.free(tmem_ptr)
            if warp_idx == RELAY_WARP:
                # forward "the peer's dS half landed here" to the leader's MMA warp
                for j in cutlass.range(count, unroll=1):
                    cute.arch.mbarrier_wait(xchg_full, j % 2)
                    with cute.arch.elect_one():
                        cute.arch.mbarrier_arrive(xchg_leader, LEADER, scope=CLUSTER)
                if count > 0:  # the last ds_empty commit, waited by nobody else (as above)
                    cute.arch.mbarrier_wait(ds_empty, (count - 1) % 2)
        # no CTA leaves while its peer may still signal it or read / write its memory
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()

    @cute.jit
    def pair_segment_range(self, mSegKeys: cute.Tensor, batch: Int32, pair: Int32
                           ) -> tuple[Int32, Int32]:
        """[lo, hi): the query blocks the segment tables list for key block 2·pair or
        2·pair + 1 (the envelope of their two [m_lo, m_hi) ranges, an empty one ignored; a
        block past the last one, a grid rounded up to whole pairs, has none); lo >= hi when
        neither has any. Both CTAs compute it alike."""
        n_blocks = mSegKeys.shape[1]
        first, second = 2 * pair, cutlass.min(2 * pair + 1, n_blocks - 1)
        lo0, hi0 = mSegKeys[batch, first, SEG_KEY_M_LO], mSegKeys[batch, first, SEG_KEY_M_HI]
        lo1, hi1 = mSegKeys[batch, second, SEG_KEY_M_LO], mSegKeys[batch, second, SEG_KEY_M_HI]
        has1 = hi1 > lo1 and 2 * pair + 1 < n_blocks
        none = Int32(2**31 - 1)  # an empty range's lo: above every block
        lo = cutlass.min(lo0 if hi0 > lo0 else none, lo1 if has1 else none)
        hi = cutlass.max(hi0 if hi0 > lo0 else Int32(0), hi1 if has1 else Int32(0))
        return lo, hi

    # --- load warp (both CTAs) ---------------------------------------------------------------
    @cute.jit
    def load_warp_2cta(self, mQ, mQt, mK, mKt, mV, mdO, mdOt, mLSE, mDelta, sQ, sQt, sK, sKt,
                       sV, sdO, sdOt, sLSE, sDelta, tma_atom_Q, tma_atom_Qt, tma_atom_K,
                       tma_atom_Kt, tma_atom_V, tma_atom_dO, tma_atom_dOt,
                       st_mma: cute.TiledMma, dpt_mma: cute.TiledMma, dv_mma: cute.TiledMma,
                       dk_mma: cute.TiledMma, dq_mma: cute.TiledMma, pipeline_kv, pipeline_q,
                       pipeline_qt, pipeline_do, pipeline_dot, pipeline_lse, head: Int32,
                       head_kv: Int32, batch: Int32, pair: Int32, rank: Int32, m_min: Int32,
                       count: Int32, seqlen_q: Int32, tidx: Int32,
                       q_offset: Int32 | None = None, k_offset: Int32 | None = None,
                       seg: cutlass.Constexpr = None):
        """This CTA's halves of every operand tile (the MMAs' slice ``rank`` of the pair
        tiles); the bytes land on the leader's full barriers. -lse / -delta of all 128 rows
        with plain loads (as the 1-CTA kernel). Varlen: TMA views from the sequence's first
        rows, ``q_offset`` / ``k_offset``. ``seg`` (segment ids: stage_stats' tables, stages
        and the own key block): the rows' ids and the own block's mask flags too."""
        D, Dv, tm, tn2 = self.hdim, self.hdimv, self.tile_m, 2 * self.tile_n
        st_thr, dpt_thr = st_mma.get_slice(rank), dpt_mma.get_slice(rank)
        dv_thr, dk_thr, dq_thr = dv_mma.get_slice(rank), dk_mma.get_slice(rank), \
            dq_mma.get_slice(rank)

        def part(atom, s, g):
            return cpasync.tma_partition(atom, 0, cute.make_layout(1),
                                         cute.group_modes(s, 0, 3), cute.group_modes(g, 0, 3))

        tKsK, tKgK = part(tma_atom_K, sK, st_thr.partition_A(cute.local_tile(
            sequence(mK, head_kv, batch, k_offset), (tn2, D), (pair, 0))))
        tVsV, tVgV = part(tma_atom_V, sV, dpt_thr.partition_A(cute.local_tile(
            sequence(mV, head_kv, batch, k_offset), (tn2, Dv), (pair, 0))))
        tKtsKt, tKtgKt = part(tma_atom_Kt, sKt, dq_thr.partition_B(cute.local_tile(
            sequence(mKt, head_kv, batch, k_offset, 1), (D, tn2), (0, pair))))
        tQsQ, tQgQ = part(tma_atom_Q, sQ, st_thr.partition_B(cute.local_tile(
            sequence(mQ, head, batch, q_offset), (tm, D), (None, 0))))
        tQtsQt, tQtgQt = part(tma_atom_Qt, sQt, dk_thr.partition_B(cute.local_tile(
            sequence(mQt, head, batch, q_offset, 1), (D, tm), (0, None))))
        tdOsdO, tdOgdO = part(tma_atom_dO, sdO, dpt_thr.partition_B(cute.local_tile(
            sequence(mdO, head, batch, q_offset), (tm, Dv), (None, 0))))
        tdOtsdOt, tdOtgdOt = part(tma_atom_dOt, sdOt, dv_thr.partition_B(cute.local_tile(
            sequence(mdOt, head, batch, q_offset, 1), (Dv, tm), (0, None))))
        lane = tidx % 32
        Producer = pipeline.PipelineUserType.Producer
        q_state = pipeline.make_pipeline_state(Producer, self.q_stages)
        qt_state = pipeline.make_pipeline_state(Producer, self.q_stages)
        do_state = pipeline.make_pipeline_state(Producer, self.do_stages)
        dot_state = pipeline.make_pipeline_state(Producer, self.do_stages)
        lse_state = pipeline.make_pipeline_state(Producer, self.lse_stages)
        # (the whole warp calls the TMA pipeline / copy ops: they elect one thread inside)
        if count > 0:
            kv_state = pipeline.make_pipeline_state(Producer, 1)
            pipeline_kv.producer_acquire(kv_state)
            bar = pipeline_kv.producer_get_barrier(kv_state)
            cute.copy(tma_atom_K, tKgK, tKsK[None, 0], tma_bar_ptr=bar)
            cute.copy(tma_atom_V, tVgV, tVsV[None, 0], tma_bar_ptr=bar)
            cute.copy(tma_atom_Kt, tKtgKt, tKtsKt[None, 0], tma_bar_ptr=bar)
        for j in cutlass.range(count, unroll=1):
            m_block = m_min + j
            self.tma_load(pipeline_q, q_state, tma_atom_Q, tQgQ[None, m_block], tQsQ)
            q_state.advance()
            self.tma_load(pipeline_do, do_state, tma_atom_dO, tdOgdO[None, m_block], tdOsdO)
            do_state.advance()
            self.stage_stats(mLSE, mDelta, sLSE, sDelta, pipeline_lse, lse_state, m_block, head,
                             batch, seqlen_q, lane, q_offset, seg=seg)
            lse_state.advance()
            if const_expr(self.serial):  # Qᵀ / dOᵀ into the Q / dO buffers, next stage uses
                self.tma_load(pipeline_q, q_state, tma_atom_Qt, tQtgQt[None, m_block], tQtsQt)
                q_state.advance()
                self.tma_load(pipeline_do, do_state, tma_atom_dOt, tdOtgdOt[None, m_block],
                              tdOtsdOt)
                do_state.advance()
            else:
                self.tma_load(pipeline_qt, qt_state, tma_atom_Qt, tQtgQt[None, m_block],
                              tQtsQt)
                qt_state.advance()
                self.tma_load(pipeline_dot, dot_state, tma_atom_dOt, tdOtgdOt[None, m_block],
                              tdOtsdOt)
                dot_state.advance()
        # the last releases (the leader's commits) are waited by nobody else: wait them here,
        # so that no commit can reach this CTA's barriers after it exits (the final cluster
        # barrier orders only what its threads have seen)
        drain = [(pipeline_q, q_state, self.q_stages), (pipeline_do, do_state, self.do_stages)]
        if const_expr(not self.serial):
            drain += [(pipeline_qt, qt_state, self.q_stages),
                      (pipeline_dot, dot_state, self.do_stages)]
        for pipe, st, stages in drain:
            for _ in cutlass.range_constexpr(stages):
                pipe.sync_object_empty.wait(st.index, st.phase)
                st.advance()

    # --- MMA warp (leader) -------------------------------------------------------------------
    @cute.jit
    def mma_warp_2cta(self, storage, sQ_l, sQt_l, sK_l, sKt_l, sV_l, sdO_l, sdOt_l, sdS_l, tP_l,
                      st_mma: cute.TiledMma,
                      dpt_mma: cute.TiledMma, dv_mma: cute.TiledMma, dk_mma: cute.TiledMma,
                      dq_mma: cute.TiledMma, tmem_ptr, pipeline_kv, pipeline_q, pipeline_qt,
                      pipeline_do, pipeline_dot, s_full, p_full, dp_full, ds_full, ds_empty,
                      dq_full, dq_empty, dkv_full, xchg_leader, s_read, count: Int32):
        """The pair's MMAs, in the order of the module docstring; every commit arrives in both
        CTAs. The descriptors address this CTA's shared / tensor memory; the peer's operands
        and accumulators sit at the same offsets."""
        D, Dv, tm, tn2 = self.hdim, self.hdimv, self.tile_m, 2 * self.tile_n
        st_thr, dpt_thr = st_mma.get_slice(0), dpt_mma.get_slice(0)
        dv_thr, dk_thr, dq_thr = dv_mma.get_slice(0), dk_mma.get_slice(0), dq_mma.get_slice(0)
        dt = self.dtype
        # operand fragments (smem descriptors) are rebuilt from a re-read address at each GEMM
        st_shared_u32(storage.smem_anchor.ptr, storage.sK.data_ptr().toint())

        def acc(thr, shape, offset):
            fake = thr.make_fragment_C(thr.partition_shape_C(shape))
            return cute.make_tensor(tmem_ptr + offset, fake.layout)

        tStS = acc(st_thr, (tn2, tm), self.tmem_s)
        tPtP = acc(dpt_thr, (tn2, tm), self.tmem_dp)
        tVtV = acc(dv_thr, (tn2, Dv), self.tmem_dv)
        tKtK = acc(dk_thr, (tn2, D), self.tmem_dk)
        tQtQ = acc(dq_thr, (tm, D), self.tmem_dq)
        # Pᵀ / dSᵀ (16-bit) in TMEM: query columns [0, 64) at the region's 32-bit columns
        # [0, 32), [64, 128) at [64, 96): two views each, k-blocks split between them
        half = self.cols_per_wg // 2

        def a_views(thr, base):
            fake = thr.make_fragment_A(cute.make_tensor(tmem_ptr, tP_l.outer))[
                None, None, None, 0]
            return [cute.make_tensor(cute.recast_ptr(tmem_ptr + base + off,
                                                     dtype=fake.element_type), fake.layout)
                    for off in (0, self.p16_stride - half)]

        tVrP, tKrdS = a_views(dv_thr, self.tmem_s), a_views(dk_thr, self.tmem_dp)

        Consumer = pipeline.PipelineUserType.Consumer
        q_state = pipeline.make_pipeline_state(Consumer, self.q_stages)
        qt_state = pipeline.make_pipeline_state(Consumer, self.q_stages)
        do_state = pipeline.make_pipeline_state(Consumer, self.do_stages)
        dot_state = pipeline.make_pipeline_state(Consumer, self.do_stages)
        qt_mem, dot_mem = self.transposed_buffers(storage)
        if count > 0:
            kv_state = pipeline.make_pipeline_state(Consumer, 1)
            pipeline_kv.consumer_wait(kv_state)
        if const_expr(self.serial):
            # one iteration at a time (dPᵀ overlaps Sᵀ's upper half, dQ dSᵀ's and Sᵀ's);
            # Qᵀ / dOᵀ come through the Q / dO stages right after Q / dO
            for j in cutlass.range(count, unroll=1):
                if j > 0:
                    cute.arch.mbarrier_wait(dq_empty, (j - 1) % 2)  # Sᵀ_j overwrites dQ_{j-1}
                pipeline_q.consumer_wait(q_state)
                self.gemm_ss(st_mma, tStS, st_thr.make_fragment_A(
                    operand_view(storage, storage.sK, sK_l, dt)), st_thr.make_fragment_B(
                    operand_view(storage, storage.sQ, sQ_l, dt)), q_state.index)
                commit(s_full)
                pipeline_q.consumer_release(q_state)
                q_state.advance()
                cute.arch.mbarrier_wait(s_read, j % 2)  # Sᵀ_j loaded: dPᵀ_j may overwrite
                pipeline_do.consumer_wait(do_state)
                self.gemm_ss(dpt_mma, tPtP, dpt_thr.make_fragment_A(
                    operand_view(storage, storage.sV, sV_l, dt)), dpt_thr.make_fragment_B(
                    operand_view(storage, storage.sdO, sdO_l, dt)), do_state.index)
                commit(dp_full)
                pipeline_do.consumer_release(do_state)
                do_state.advance()
                cute.arch.mbarrier_wait(p_full, j % 2)
                pipeline_do.consumer_wait(do_state)
                self.gemm_ts_halves(dv_mma, tVtV, tVrP[0], tVrP[1], dv_thr.make_fragment_B(
                    operand_view(storage, dot_mem, sdOt_l, dt)), do_state.index, j > 0)
                pipeline_do.consumer_release(do_state)
                do_state.advance()
                cute.arch.mbarrier_wait(ds_full, j % 2)
                pipeline_q.consumer_wait(q_state)
                self.gemm_ts_halves(dk_mma, tKtK, tKrdS[0], tKrdS[1], dk_thr.make_fragment_B(
                    operand_view(storage, qt_mem, sQt_l, dt)), q_state.index, j > 0)
                pipeline_q.consumer_release(q_state)
                q_state.advance()
                cute.arch.mbarrier_wait(xchg_leader, j % 2)
                self.gemm_ss(dq_mma, tQtQ, dq_thr.make_fragment_A(
                    operand_view(storage, storage.sdS, sdS_l, dt)), dq_thr.make_fragment_B(
                    operand_view(storage, storage.sKt, sKt_l, dt)), 0)
                commit(dq_full)
                commit(ds_empty)
        else:
            for j in cutlass.range(count + 1, unroll=1):
                if j < count:
                    # Sᵀ_j = K·Q_jᵀ
                    pipeline_q.consumer_wait(q_state)
                    self.gemm_ss(st_mma, tStS, st_thr.make_fragment_A(
                        operand_view(storage, storage.sK, sK_l, dt)), st_thr.make_fragment_B(
                        operand_view(storage, storage.sQ, sQ_l, dt)), q_state.index)
                    commit(s_full)
                    pipeline_q.consumer_release(q_state)
                    q_state.advance()
                if j > 0:
                    # dK += dSᵀ_{j-1}·Q_{j-1} (dSᵀ in TMEM, both CTAs' compute warps done with
                    # dPᵀ_{j-1}); then dQ_{j-1} = dS·K once both dS halves landed in both CTAs
                    cute.arch.mbarrier_wait(ds_full, (j - 1) % 2)
                    pipeline_qt.consumer_wait(qt_state)
                    self.gemm_ts_halves(dk_mma, tKtK, tKrdS[0], tKrdS[1],
                                        dk_thr.make_fragment_B(
                                            operand_view(storage, qt_mem, sQt_l, dt)),
                                        qt_state.index, j > 1)
                    pipeline_qt.consumer_release(qt_state)
                    qt_state.advance()
                    cute.arch.mbarrier_wait(xchg_leader, (j - 1) % 2)
                    self.gemm_ss(dq_mma, tQtQ, dq_thr.make_fragment_A(
                        operand_view(storage, storage.sdS, sdS_l, dt)), dq_thr.make_fragment_B(
                        operand_view(storage, storage.sKt, sKt_l, dt)), 0)
                    commit(dq_full)
                    commit(ds_empty)
                if j < count:
                    if j > 0:
                        # the reduce warps of both CTAs drained dQ_{j-1} from dPᵀ's columns
                        cute.arch.mbarrier_wait(dq_empty, (j - 1) % 2)
                    # dPᵀ_j = V·dO_jᵀ
                    pipeline_do.consumer_wait(do_state)
                    self.gemm_ss(dpt_mma, tPtP, dpt_thr.make_fragment_A(
                        operand_view(storage, storage.sV, sV_l, dt)), dpt_thr.make_fragment_B(
                        operand_view(storage, storage.sdO, sdO_l, dt)), do_state.index)
                    commit(dp_full)
                    pipeline_do.consumer_release(do_state)
                    do_state.advance()
                    # dV += Pᵀ_j·dO_j once Pᵀ_j is in both CTAs' TMEM
                    cute.arch.mbarrier_wait(p_full, j % 2)
                    pipeline_dot.consumer_wait(dot_state)
                    self.gemm_ts_halves(dv_mma, tVtV, tVrP[0], tVrP[1], dv_thr.make_fragment_B(
                        operand_view(storage, dot_mem, sdOt_l, dt)), dot_state.index, j > 0)
                    pipeline_dot.consumer_release(dot_state)
                    dot_state.advance()
        if count > 0:
            commit(dkv_full)

    @cute.jit
    def gemm_ss(self, mma: cute.TiledMma, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor,
                stage: Int32):
        """acc = A·B[stage] over all k-blocks (A: one stage; the first k-block overwrites)."""
        for k in cutlass.range_constexpr(cute.size(a, mode=[2])):
            mma.set(tcgen05.Field.ACCUMULATE, k > 0)
            cute.gemm(mma, acc, a[None, None, k, 0], b[None, None, k, stage], acc)

    # --- compute warps (both CTAs) -----------------------------------------------------------
    @cute.jit
    def compute_warps_2cta(self, mdK, mdV, mParams, sdS, sXchg, storage, sLSE, sDelta,
                           st_mma: cute.TiledMma, tmem_ptr, pipeline_lse, s_full, p_full,
                           dp_full, ds_full, ds_empty, dkv_full, xchg_full, s_read,
                           head: Int32, head_kv: Int32, batch: Int32, n_block: Int32,
                           rank: Int32, m_min: Int32, count: Int32, blocks: BwdBlocks,
                           tidx: Int32, warp_idx: Int32, k_offset: Int32 | None = None,
                           segs: cutlass.Constexpr = None):
        """Pᵀ and dSᵀ of the own keys (as the 1-CTA kernel), dSᵀ also into TMEM (the dK MMA's
        A operand); warpgroup w == rank writes its dS (the own query half) into sdS's own key
        half, the other warpgroup sends its dS to the peer through sdS_xchg. Varlen: dK / dV
        stored to the sequence's rows from ``k_offset`` on, below its seqlen_k. ``segs``
        (segment ids: kv_ids, the id and flag stages): the own key's id compared with each
        row's in the blocks flagged for this CTA (the 1-CTA kernel's softmax_p)."""
        tm, tn, cw = self.tile_m, self.tile_n, self.cols_per_wg
        wg = (warp_idx - COMPUTE_WARPS[0]) // 4  # 0 or 1: query columns [cw·wg, cw·wg + cw)
        lane_row = tidx % 128  # this thread's own key (TMEM lane)
        st_thr = st_mma.get_slice(0)
        acc_layout = st_thr.make_fragment_C(st_thr.partition_shape_C((2 * tn, tm))).layout
        scale = mParams[PARAM_SCALE]
        scale_log2, tanh_in_scale, inv_scale_log2 = self.softmax_scales(mParams)
        key = n_block * tn + lane_row
        seg = None
        if const_expr(segs is not None):
            seg = self.segment_key(segs, batch, key, blocks.seqlen_k)
        # dS as the dQ MMA's A operand: (query of the half, pair key), query-contiguous; the
        # exchange buffer has the layout of the first key half (same bytes, same swizzle)
        sdS0 = sdS[None, None, None, 0]
        ds_layout = cute.composition(sdS0.layout, cute.make_layout((self.q_half, 2 * tn)))
        sdS_qk = cute.make_tensor(sdS0.iterator, ds_layout)
        sXchg_qk = cute.make_tensor(sXchg[None, None, None, 0].iterator, ds_layout)
        compute_barrier = pipeline.NamedBarrier(barrier_id=COMPUTE_BARRIER,
                                                num_threads=32 * len(COMPUTE_WARPS))
        lse_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                 self.lse_stages)
        for j in cutlass.range(count, unroll=1):
            m_block = m_min + j
            pipeline_lse.consumer_wait(lse_state)
            # ---- Pᵀ = exp2(Sᵀ·scale_log2 − lse) → TMEM (Sᵀ's columns) ----
            cute.arch.mbarrier_wait(s_full, j % 2)
            rP = cute.make_rmem_tensor((cw,), Float32)
            self.load_wg_cols(rP, tmem_ptr, acc_layout, self.tmem_s, wg, lane_row, 0, cw)
            if const_expr(self.serial):
                arrive_leader(s_read)  # dPᵀ_j may now overwrite Sᵀ_j's upper half
            self.softmax_p(rP, tmem_ptr, acc_layout, blocks, m_block, n_block, key, wg,
                           lane_row, scale_log2, tanh_in_scale, sLSE, lse_state.index, seg=seg)
            if const_expr(self.serial):
                # warpgroup 1's Pᵀ goes to Sᵀ columns [32, 64), which warpgroup 0 loads
                compute_barrier.arrive_and_wait()
            self.store_16bit(rP, tmem_ptr, acc_layout, self.tmem_s, wg, lane_row)
            cute.arch.fence_view_async_tmem_store()
            arrive_leader(p_full)
            # ---- dSᵀ = Pᵀ∘(dPᵀ − delta) [∘ (1 − t²)] → TMEM (dPᵀ's columns) ----
            cute.arch.mbarrier_wait(dp_full, j % 2)
            rdS = cute.make_rmem_tensor((cw,), self.dtype)
            self.softmax_ds(rdS, rP, tmem_ptr, acc_layout, wg, lane_row, inv_scale_log2, sLSE,
                            sDelta, lse_state.index)
            pipeline_lse.consumer_release(lse_state)
            lse_state.advance()
            if const_expr(self.serial):
                # warpgroup 1's dSᵀ goes to dPᵀ columns [32, 64), which warpgroup 0 loads
                compute_barrier.arrive_and_wait()
            self.store_16bit(rdS, tmem_ptr, acc_layout, self.tmem_dp, wg, lane_row)
            cute.arch.fence_view_async_tmem_store()
            # ---- dS → shared memory: own query half here, the other one to the peer ----
            if j > 0:
                # dQ_{j-1} read sdS (both halves) and ran after both exchange copies landed
                cute.arch.mbarrier_wait(ds_empty, (j - 1) % 2)
            if wg == rank:
                cute.autovec_copy(rdS, sdS_qk[None, rank * tn + lane_row])
                cute.arch.fence_proxy("async.shared", space="cta")  # st.shared -> UMMA reads
            else:
                cute.autovec_copy(rdS, sXchg_qk[None, lane_row])
                cute.arch.fence_proxy("async.shared", space="cta")  # st.shared -> bulk copy
                pipeline.NamedBarrier(barrier_id=XCHG_BARRIER, num_threads=128).arrive_and_wait()
                if lane_row == 0:
                    peer = rank ^ 1
                    cute.arch.mbarrier_arrive_and_expect_tx(xchg_full, self.xchg_bytes, peer)
                    # into the peer's sdS at the key half of this CTA (its rank)
                    # (16 KB per half: a multiple of the 1 KB swizzle period)
                    bulk_copy_to_peer(storage.sdS.data_ptr() + rank * (self.xchg_bytes // 2),
                                      storage.sXchg.data_ptr(), xchg_full, peer,
                                      self.xchg_bytes)
            arrive_leader(ds_full)

        # ---- epilogue: dK · scale, dV -> global (this CTA's keys; rows past seqlen_k skipped)
        self.epilogue(mdK, mdV, tmem_ptr, acc_layout, dkv_full, scale, head, head_kv, batch,
                      n_block, count, key, lane_row, wg, k_offset, blocks.seqlen_k)

    # --- dQ reduce warps (both CTAs) ---------------------------------------------------------
    @cute.jit
    def reduce_warps_2cta(self, mdQacc, mSem, sdQ, tma_atom_dQ, st_mma: cute.TiledMma,
                          tmem_ptr, dq_full, dq_empty, head: Int32, batch: Int32, pair: Int32,
                          rank: Int32, m_min: Int32, count: Int32, pair_blocks: BwdBlocks,
                          tidx: Int32, warp_idx: Int32, dq_tile0: Int32 | None = None):
        """dQ_j of this CTA's query half, folded in TMEM (lane l < 64: row l, columns
        [0, D/2); lane l >= 64: row l − 64, columns [D/2, D)): per chunk of dq_cols columns
        each thread loads its lane, the chunk is staged as two (64, dq_cols) boxes and
        reduce-added into dq_accum rows 128m + 64·rank … by two TMA reduce-adds (varlen: tile
        ``dq_tile0 + m`` of the sequence's)."""
        tm, D, nc, qh = self.tile_m, self.hdim, self.dq_cols, self.q_half
        num_chunks = D // 2 // nc
        st_thr = st_mma.get_slice(0)
        # plain lane × column view of TMEM (the folding is ours to interpret, see above)
        lane_cols = st_thr.make_fragment_C(st_thr.partition_shape_C((2 * self.tile_n, tm))).layout
        ld = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(nc)), Float32),
            tmem_cols(tmem_ptr, lane_cols, 0, nc))
        thr_ld = ld.get_slice(tidx)
        tTc = ld.get_slice(0).partition_D(cute.make_identity_tensor((128, nc)))
        row, box = tidx % qh, tidx // qh  # box 0: columns [0, D/2), box 1: [D/2, D)
        gdQ = cute.local_tile(mdQacc[None, None, head, batch], (qh, nc), (None, None))
        tdQsdQ, tdQgdQ = cpasync.tma_partition(tma_atom_dQ, 0, cute.make_layout(1),
                                               cute.group_modes(sdQ, 0, 2),
                                               cute.group_modes(gdQ, 0, 2))
        reduce_barrier = pipeline.NamedBarrier(barrier_id=int(Barrier.REDUCE),
                                               num_threads=32 * len(REDUCE_WARPS))
        stage = Int32(0)
        for j in cutlass.range(count, unroll=1):
            m_block = m_min + j
            dq_tile = m_block if const_expr(dq_tile0 is None) else dq_tile0 + m_block
            row_block = 2 * dq_tile + rank  # this CTA's 64-row box of dq_accum
            cute.arch.mbarrier_wait(dq_full, j % 2)
            for c in cutlass.range_constexpr(num_chunks):
                r = cute.make_rmem_tensor(tTc.shape, Float32)
                cute.copy(ld, thr_ld.partition_S(
                    tmem_cols(tmem_ptr, lane_cols, self.tmem_dq + c * nc, nc)), r)
                cute.arch.fence_view_async_tmem_load()
                if const_expr(c == num_chunks - 1):
                    arrive_leader(dq_empty)  # dPᵀ's columns free for dPᵀ_{j+1}
                rv = cute.make_rmem_tensor((nc,), Float32)
                for i in cutlass.range_constexpr(nc):
                    rv[tTc[i][1]] = r[i]
                # staging buffer `stage` free: the reduce-adds that last read it have finished
                if warp_idx == 0:
                    cute.arch.cp_async_bulk_wait_group(self.dq_stages - 1, read=True)
                reduce_barrier.arrive_and_wait()
                cute.autovec_copy(rv, sdQ[row, None, 2 * stage + box])
                cute.arch.fence_proxy("async.shared", space="cta")  # st.shared -> TMA reads
                reduce_barrier.arrive_and_wait()
                if warp_idx == 0:
                    with cute.arch.elect_one():
                        if const_expr(self.deterministic and c == 0):
                            # this pair's turn on this query half (pairs in increasing order)
                            turn = BwdBlocks.dq_rank(pair_blocks, m_block, pair)
                            sem_ptr = mSem[None, head, batch].iterator + 2 * m_block + rank
                            seen = ld_acquire_gpu(sem_ptr)
                            while seen != turn:
                                seen = ld_acquire_gpu(sem_ptr)
                        cute.copy(tma_atom_dQ, tdQsdQ[None, 2 * stage],
                                  tdQgdQ[None, row_block, c])
                        cute.copy(tma_atom_dQ, tdQsdQ[None, 2 * stage + 1],
                                  tdQgdQ[None, row_block, num_chunks + c])
                        cute.arch.cp_async_bulk_commit_group()
                        if const_expr(self.deterministic and c == num_chunks - 1):
                            # every reduce-add of this half performed, then the next turn
                            cute.arch.cp_async_bulk_wait_group(0, read=False)
                            red_release_gpu_add(
                                mSem[None, head, batch].iterator + 2 * m_block + rank, 1)
                stage = (stage + 1) % self.dq_stages
        if warp_idx == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=True)

