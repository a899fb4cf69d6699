"""FlashAttention backward for Hopper (sm_90a): the split-operand CTA pair (``sm90_bwd_pair``).

Same call contract, dq_accum layout and postprocess as the one-CTA kernel (bwd.py,
bwd_config.py); only the main kernel's inside differs.

Why a pair. At head dim 256 one CTA's dK and dV accumulators for 64 keys take 128 of the 240
registers an MMA thread has, so the one-CTA kernel walks 64-key blocks, and every query block's
dQ is added into the float32 dq_accum once per 64 keys: S²·D·4 / 64 bytes of reductions per
head, the wall of that kernel. The pair gives one 128-key block to a cluster of two CTAs and
splits the work by operand, not by keys: each CTA holds one of the two accumulators (64 keys of
dK or of dV per warpgroup: the same 128 registers), loads one of Q / dO and one of K / V, and
every dQ addition covers 128 keys.

Roles. Cluster (2, 1, 1); key block n = blockIdx.x // 2 (128 keys), rank r = blockIdx.x % 2.
Both ranks walk the same query blocks m (the range of the 128-key block; unmasked, from the
same rotated start). Per query block, with D, Dv = the head dims (128/128, 192/128, 256/256):

  rank 0  buffers: A = Q stages, B = K, C = dP − delta (float32, written by rank 1), D = P, dS
          S = Q·Kᵀ; P = exp2(S·scale_log2 − lse_log2) [softcap: tanh first], 0 outside the
          mask; dS = P∘(dP − delta) [∘ (1 − t²)]; P, dS → D[s] (stmatrix) → rank 1's D[s]
          (one bulk copy); dK += dSᵀ·Q; dQ[:, :D/2] = dS·K[:, :D/2].
  rank 1  buffers: A = dO stages, B = V, C = K[:, D/2:], D = P, dS (copied from rank 0)
          dP = dO·Vᵀ; dP − delta → rank 0's C (st.async from the registers, fragment order);
          dV += Pᵀ·dO; dQ[:, D/2:] = dS·K[:, D/2:].

GEMM work per query block: rank 0 S, dK and half of dQ; rank 1 dP, dV and the other half (2.5
of the five GEMMs each). Each MMA thread adds its dQ quarter-row fragment into dq_accum with
``red.global.add.v4.f32`` at the offsets the one-CTA dQ GEMM's fragment order gives it (rank r's
half is the one-CTA warpgroup r's chunk, warpgroup w's quarter that chunk's registers
[w·q, (w + 1)·q), q = tile_m·D / 512), so the postprocess is unchanged. The shared-memory
regions A–D have the same offsets in both CTAs (a struct of raw buffers, viewed per rank).

Warps: warpgroup 0 = producer (warp 0 issues the TMA loads: this rank's K / V / K-half once on
one mbarrier armed with this rank's bytes, then Q (rank 0) or dO (rank 1) of every query block
through that operand's ``stages``-deep pipeline); warpgroups 1, 2 = MMA, 64-row S / dP (two
64-column halves), 64-key dK / dV (two key halves) and dQ-half (two D/4-column quarters) per
warpgroup.

Signals (mbarriers at the same offsets in both CTAs; "remote": the peer's copy, cluster scope;
j = the iteration, s = j mod pds_stages):
  kv           local, 1 + tx     the producer's K / V loads
  dpd_full     rank 0, 1 + tx    rank 0's MMA thread 0 arms it (expect_tx tile_m·tile_n·4) for
                                  iteration 0 and, after its wait of j, for j + 1; rank 1's
                                  st.async stores complete the bytes
  dpd_empty    rank 1, 8         each rank-0 MMA warp, once it has read C (remote arrive,
                                  release.cluster); rank 1 waits it before storing j + 1
  pds_full[s]  rank 1, 1 + tx    rank 0's thread 0: remote arrive.expect_tx, then the bulk copy
                                  of D[s] (P and dS, 2·tile_m·tile_n·2 bytes)
  pds_empty[s] rank 0, 8         each rank-1 MMA warp once its dV / dQ GEMMs on D[s] are
                                  complete; rank 0 waits it before writing D[s] again (its own
                                  dK / dQ GEMMs on D[s] are complete by then too)
Iteration j:
  rank 0: wait Q_j; S; P, mask; j ≥ pds: wait pds_empty[s]; P → D[s]; wait dpd_full (thread 0
          arms j + 1); C → registers; → dpd_empty; dS → D[s]; fence, named barrier; thread 0:
          → pds_full[s] + bulk copy; dK, dQ-half GEMMs; wait; release Q_j; dQ adds.
  rank 1: wait dO_j; dP; dP − delta; j ≥ 1: wait dpd_empty; st.async → rank 0's C; wait
          pds_full[s]; dV, dQ-half GEMMs; wait; release dO_j; → pds_empty[s]; dQ adds.
With one exchange buffer (pds_stages = 1) rank 0 meets at the named barrier PDS before writing
P: both warpgroups' dK / dQ GEMMs of block j − 1, which read D's dS, are then complete.
``lookahead`` (pds_stages = 2): each rank issues the next block's first GEMM before this
block's others: rank 0 issues S(j + 1) before dK(j), dQ(j) and waits for S(j + 1) alone
(wait_group 2) at the top of iteration j + 1, so its exponentials run under dK(j), dQ(j),
whose completion (wait_group 0), Q_j's release and dQ(j)'s adds follow P(j + 1)'s store; rank 1
issues dP(j + 1) right after its st.async of block j, before waiting for P and dS of block j.
``group_heads`` (GQA): one cluster per (key block, kv head), grid y = kv heads; every role walks
the group's query heads' blocks as one run of positions (``head_at``, as the one-CTA kernel's
group_heads form), so the exchange's iterations, phases and lookahead go on across heads; dK / dV
sum over the group and are stored per kv head in the input dtype.
Waits on a peer's arrivals use cluster-scoped acquire (``mbarrier_wait_cluster``).
The order of pds_full(j) after every rank-0 warp's read of C already keeps rank 1's stores of
block j + 1 out of C until it has been read; dpd_empty is the buffer's own guard.
The exchange is checked by a discrete-event model (tests/test_sm90_bwd_pair_protocol.py).
Start: every barrier initialised, then a cluster barrier before any role runs. End: rank 0
waits the pds_empty arrivals of its last min(pds_stages, count) iterations and rank 1 the last
dpd_empty, then every thread of both CTAs meets at a cluster barrier: no CTA exits while its
peer may still signal it. Epilogue per rank: dK (rank 0, ·softmax_scale) or dV (rank 1) through
B and a TMA store (MHA), or float32 from registers (GQA, per query head).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import cpasync, warpgroup

from jax_fa4.kernels.common.cluster import (bulk_copy_to_cluster, mbarrier_wait_cluster,
                                            peer_address, st_async_v4_f32,
                                            trap_unless_cluster_of)
from jax_fa4.kernels.common.convert import convert_f32_pairs
from jax_fa4.kernels.common.geometry import BwdBlocks, resolve_windows
from jax_fa4.kernels.common.layout import acc_view_mn, select_modes, transpose_mn
from jax_fa4.kernels.common.operands import check_backward_operands
from jax_fa4.kernels.common.scores import score_scales
from jax_fa4.kernels.common.views import seq_major, sequence
from jax_fa4.kernels.sm90.bwd import (_MMA_REGS, _PRODUCER_REGS, FlashAttentionBackwardSm90,
                                      NamedBarrier, red_add_v4_f32, thread_idx_x_again)
from jax_fa4.kernels.sm90.bwd_common import dq_fragment_view
from jax_fa4.kernels.sm90.bwd_pair_config import BwdPairConfig
from jax_fa4.kernels.sm90.common import make_smem_layout, wgmma
from jax_fa4.kernels.spec import PARAM_SCALE

CLUSTER = nvvm.MemScopeKind.CLUSTER
#: mbarrier slots after the producer pipeline's: kv, dpd_full, dpd_empty, then pds_full[s],
#: pds_empty[s] per exchange stage
KV, DPD_FULL, DPD_EMPTY, PDS_BASE = 0, 1, 2, 3
MMA_WARPS = 8  # arrivals per iteration on dpd_empty / pds_empty (one per MMA warp)


class FlashAttentionBackwardSm90Pair(FlashAttentionBackwardSm90):
    def __init__(self, cfg: BwdPairConfig):
        if not isinstance(cfg, BwdPairConfig):
            raise TypeError(f"FlashAttentionBackwardSm90Pair needs a BwdPairConfig, got {cfg!r}")
        super().__init__(cfg)
        # dQ columns per rank (D/2) and per warpgroup (D/4); floats of a thread's dQ quarter
        self.dq_half = self.hdim // 2
        self.dq_quarter_regs = self.tile_m * self.dq_half // self.num_mma_threads
        self.dpd_regs = self.tile_m * self.tile_n // self.num_mma_threads
        self.pds_bytes = 2 * self.tile_m * self.tile_n * self.dtype.width // 8  # P and dS
        self.lookahead = cfg.lookahead  # (bwd_pair_config.BwdPairConfig)

    # ---------------------------------------------------------------------------------------------
    # Host side
    # ---------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, stream: cuda.CUstream, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                 mdO: cute.Tensor, mLSE: cute.Tensor, mDelta: cute.Tensor, mParams: cute.Tensor,
                 mdQacc: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor):
        check_backward_operands(self.dtype, self.gqa, mQ, mK, mV, mdO, mLSE, mDelta, mParams,
                                mdQacc, mdK, mdV)
        D, Dv, tm, tn, dt = self.hdim, self.hdimv, self.tile_m, self.tile_n, self.dtype
        mQ, mK, mdK = seq_major(mQ, D), seq_major(mK, D), seq_major(mdK, D)
        mV, mdO, mdV = seq_major(mV, Dv), seq_major(mdO, Dv), seq_major(mdV, Dv)
        mLSE, mDelta, mdQacc = [select_modes(t, (2, 1, 0)) for t in (mLSE, mDelta, mdQacc)]

        mma_sdp, mma_dk, mma_dv, _ = self._tiled_mmas()
        mma_dqh = self._tiled_mma_dq_half()
        (sQ_layout, sdO_layout, sK_layout, sV_layout, sKh_layout,
         sPdS_layout) = self._pair_smem_layouts()

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(
            g2s, mQ, cute.select(sQ_layout, mode=[0, 1]), (tm, D))
        tma_atom_dO, tma_dO = cpasync.make_tiled_tma_atom(
            g2s, mdO, cute.select(sdO_layout, mode=[0, 1]), (tm, Dv))
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(g2s, mK, sK_layout, (tn, D))
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(g2s, mV, sV_layout, (tn, Dv))
        tma_atom_Kh, tma_Kh = cpasync.make_tiled_tma_atom(g2s, mK, sKh_layout,
                                                          (tn, self.dq_half))
        tma_atom_dK, tma_dK, tma_atom_dV, tma_dV = None, mdK, None, mdV
        if const_expr(not self.gqa):
            s2g = cpasync.CopyBulkTensorTileS2GOp()
            tma_atom_dK, tma_dK = cpasync.make_tiled_tma_atom(s2g, mdK, sK_layout, (tn, D))
            tma_atom_dV, tma_dV = cpasync.make_tiled_tma_atom(s2g, mdV, sV_layout, (tn, Dv))
        self.tx_bytes_q = tm * D * dt.width // 8
        self.tx_bytes_do = tm * Dv * dt.width // 8
        self.tx_bytes_k = tn * D * dt.width // 8
        self.tx_bytes_v = tn * Dv * dt.width // 8
        self.tx_bytes_kh = tn * self.dq_half * dt.width // 8
        # regions A (Q or dO stages) and B (K or V): the larger of the ranks' buffers; C: rank
        # 0's float32 dP − delta, or rank 1's half of K
        a_elems = max(cute.cosize(sQ_layout), cute.cosize(sdO_layout))
        b_elems = max(cute.cosize(sK_layout), cute.cosize(sV_layout))
        c_floats = max(tm * tn, cute.cosize(sKh_layout) * dt.width // 32)

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            mbar_do: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            mbar_sig: cute.struct.MemRange[cutlass.Int64, PDS_BASE + 2 * self.pds_stages]
            sA: cute.struct.Align[cute.struct.MemRange[dt, a_elems], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[dt, b_elems], 1024]
            sC: cute.struct.Align[cute.struct.MemRange[Float32, c_floats], 1024]
            sD: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sPdS_layout)], 1024]

        n_blocks = cute.ceil_div(mK.shape[0], tn)
        # a cluster per (key block, query head, batch); group_heads: per kv head
        heads = mK.shape[2] if const_expr(self.group_heads) else mQ.shape[2]
        self.kernel(
            tma_Q, tma_K, tma_V, tma_Kh, tma_dO, tma_dK, tma_dV, mLSE, mDelta, mParams, mdQacc,
            tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_Kh, tma_atom_dO, tma_atom_dK,
            tma_atom_dV, sQ_layout, sdO_layout, sK_layout, sV_layout, sKh_layout, sPdS_layout,
            mma_sdp, mma_dk, mma_dv, mma_dqh, SharedStorage,
        ).launch(grid=(2 * n_blocks, heads, mQ.shape[3]),
                 block=[self.num_threads, 1, 1], cluster=[2, 1, 1], stream=stream,
                 min_blocks_per_mp=1)

    def _tiled_mma_dq_half(self):
        """dQ[:, half] = dS·K[:, half]: M = tile_m queries, N = D/2 (a D/4 quarter per
        warpgroup), K = tile_n keys; A = dS (K-major), B = the K half read transposed."""
        K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        return sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, K, MN, Float32,
                                                 (1, 2, 1), (64, self.dq_half // 2))

    def _pair_smem_layouts(self):
        """Q and dO stages (region A of rank 0 / 1), K and V (region B), rank 1's K half
        (region C), and region D's P / dS pairs: D[2s] = P, D[2s + 1] = dS of exchange stage s
        (one contiguous copy)."""
        dt, tm, tn, D, Dv = self.dtype, self.tile_m, self.tile_n, self.hdim, self.hdimv
        sQ = make_smem_layout(dt, tm, D, D, self.stages)
        sdO = make_smem_layout(dt, tm, Dv, Dv, self.stages)
        # K's swizzle atom no wider than a warpgroup's dQ columns (D/4), so that rank 0's view of
        # its first half is a canonical MN-major B operand of the dQ GEMM (as rank 1's K half)
        quarter = self.dq_half // 2
        sK = make_smem_layout(dt, tn, D, quarter)
        sV = make_smem_layout(dt, tn, Dv, Dv)
        sKh = make_smem_layout(dt, tn, self.dq_half, quarter)
        mms = tn // self.wg_sdp[1]  # (= tn // wg_dkv[0]: 64)
        sPdS = make_smem_layout(dt, tm, tn, mms, 2 * self.pds_stages)
        return sQ, sdO, sK, sV, sKh, sPdS

    # ---------------------------------------------------------------------------------------------
    # Device side
    # ---------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mKh: cute.Tensor,
               mdO: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, mLSE: cute.Tensor,
               mDelta: cute.Tensor, mParams: cute.Tensor, mdQacc: cute.Tensor,
               tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
               tma_atom_Kh: cute.CopyAtom, tma_atom_dO: cute.CopyAtom, tma_atom_dK,
               tma_atom_dV, sQ_layout: cute.ComposedLayout, sdO_layout: cute.ComposedLayout,
               sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               sKh_layout: cute.ComposedLayout, sPdS_layout: cute.ComposedLayout,
               mma_sdp: cute.TiledMma, mma_dk: cute.TiledMma, mma_dv: cute.TiledMma,
               mma_dqh: cute.TiledMma, SharedStorage: cutlass.Constexpr):
        trap_unless_cluster_of(2)
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_Kh, tma_atom_dO):
                cpasync.prefetch_descriptor(atom)
            if const_expr(not self.gqa):
                cpasync.prefetch_descriptor(tma_atom_dK)
                cpasync.prefetch_descriptor(tma_atom_dV)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)

        def tma_pipeline(mbars, tx: int):  # Q (rank 0) or dO (rank 1) stages
            return pipeline.PipelineTmaAsync.create(
                barrier_storage=mbars.data_ptr(), num_stages=self.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, MMA_WARPS),
                tx_count=tx, defer_sync=True)

        pipeline_q = tma_pipeline(storage.mbar_q, self.tx_bytes_q)
        pipeline_do = tma_pipeline(storage.mbar_do, self.tx_bytes_do)
        sig = storage.mbar_sig.data_ptr()
        if warp_idx == 1:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(sig + KV, 1)
                cute.arch.mbarrier_init(sig + DPD_FULL, 1)
                cute.arch.mbarrier_init(sig + DPD_EMPTY, MMA_WARPS)
                for s in cutlass.range_constexpr(self.pds_stages):
                    cute.arch.mbarrier_init(sig + PDS_BASE + 2 * s, 1)
                    cute.arch.mbarrier_init(sig + PDS_BASE + 2 * s + 1, MMA_WARPS)
        # every barrier of both CTAs is initialised before any CTA signals its peer
        cute.arch.mbarrier_init_fence()
        cute.arch.cluster_arrive_relaxed()
        cute.arch.cluster_wait()

        # regions A and B as each rank's buffers
        sQ = storage.sA.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sA.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sK = storage.sB.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sB.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sD = storage.sD.get_tensor(sPdS_layout.outer, swizzle=sPdS_layout.inner)
        sC = storage.sC.get_tensor(cute.make_layout(self.tile_m * self.tile_n))
        sKh = cute.make_tensor(cute.recast_ptr(storage.sC.data_ptr(), sKh_layout.inner,
                                               dtype=self.dtype), sKh_layout.outer)

        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
        window_left, window_right = resolve_windows(mParams, seqlen_q, seqlen_k, self.is_local)
        x, head, batch = cute.arch.block_idx()
        n_block = x // 2
        group, head, head_kv, head_dkv = self.cta_heads(head, mQ.shape[2], mK.shape[2])
        block_info = BwdBlocks(self.tile_m, self.tile_n, self.is_causal, self.is_local,
                               seqlen_q, seqlen_k, window_left, window_right)
        m_block_min, m_block_max = block_info.m_block_range(n_block)

        if warp_idx < 4:  # producer warpgroup
            cute.arch.setmaxregister_decrease(_PRODUCER_REGS)
            if warp_idx == 0:
                self.load_pair(rank, mQ, mdO, mK, mV, mKh, sQ, sdO, sK, sV, sKh, tma_atom_Q,
                               tma_atom_dO, tma_atom_K, tma_atom_V, tma_atom_Kh, pipeline_q,
                               pipeline_do, sig + KV,
                               n_block, head, head_kv, batch, m_block_min, m_block_max, group)
        else:  # MMA warpgroups
            cute.arch.setmaxregister_increase(_MMA_REGS)
            self.mma_pair(rank, mdK, mdV, mLSE, mDelta, mParams, mdQacc, sQ, sdO, sK, sV, sC,
                          sKh, sD, tma_atom_dK, tma_atom_dV, mma_sdp, mma_dk, mma_dv, mma_dqh,
                          pipeline_q, pipeline_do, sig, tidx - 128, n_block, head, head_dkv, batch,
                          m_block_min, m_block_max, seqlen_q, seqlen_k, block_info, group)
        # no CTA exits while its peer may still signal it (every role has waited the last
        # signals it receives)
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()

    @cute.jit
    def load_pair(self, rank: Int32, mQ: cute.Tensor, mdO: cute.Tensor, mK: cute.Tensor,
                  mV: cute.Tensor, mKh: cute.Tensor, sQ: cute.Tensor, sdO: cute.Tensor,
                  sK: cute.Tensor, sV: cute.Tensor, sKh: cute.Tensor,
                  tma_atom_Q: cute.CopyAtom, tma_atom_dO: cute.CopyAtom,
                  tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
                  tma_atom_Kh: cute.CopyAtom, pipeline_q, pipeline_do, kv_bar: cute.Pointer,
                  n_block: Int32, head: Int32, head_kv: Int32, batch: Int32,
                  m_block_min: Int32, m_block_max: Int32, group=None):
        """The TMA warp: rank 0 loads K once and Q of every visited query block, rank 1 V and
        K's second half once and dO of every visited query block (of ``head``, or with
        ``group`` of the group's query heads in turn: the MMA loops' positions)."""
        D, Dv, tn = self.hdim, self.hdimv, self.tile_n
        one = cute.make_layout(1)
        if m_block_max > m_block_min:
            gK = cute.local_tile(sequence(mK, head_kv, batch), (tn, D), (n_block, 0))
            gV = cute.local_tile(sequence(mV, head_kv, batch), (tn, Dv), (n_block, 0))
            gKh = cute.local_tile(sequence(mKh, head_kv, batch), (tn, self.dq_half),
                                  (n_block, 1))
            tKsK, tKgK = cpasync.tma_partition(tma_atom_K, 0, one, cute.group_modes(sK, 0, 2),
                                               cute.group_modes(gK, 0, 2))
            tVsV, tVgV = cpasync.tma_partition(tma_atom_V, 0, one, cute.group_modes(sV, 0, 2),
                                               cute.group_modes(gV, 0, 2))
            tKhsKh, tKhgKh = cpasync.tma_partition(tma_atom_Kh, 0, one,
                                                   cute.group_modes(sKh, 0, 2),
                                                   cute.group_modes(gKh, 0, 2))
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(
                    kv_bar, self.tx_bytes_k if rank == 0 else self.tx_bytes_v + self.tx_bytes_kh)
            if rank == 0:
                cute.copy(tma_atom_K, tKgK, tKsK, tma_bar_ptr=kv_bar)
            else:
                cute.copy(tma_atom_V, tVgV, tVsV, tma_bar_ptr=kv_bar)
                cute.copy(tma_atom_Kh, tKhgKh, tKhsKh, tma_bar_ptr=kv_bar)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
            start = self.first_visit(n_block, m_block_min, m_block_max)
            for it in cutlass.range(m_block_min, self.loop_end(m_block_min, m_block_max, group),
                                    unroll=1):
                pos, head_it = self.head_at(it, head, m_block_min, m_block_max, group)
                m_block = self.m_block_at(pos, start, m_block_min, m_block_max)
                if rank == 0:
                    self.load_row_block(tma_atom_Q, mQ, sQ, pipeline_q, state, D, head_it,
                                        batch, m_block)
                else:
                    self.load_row_block(tma_atom_dO, mdO, sdO, pipeline_do, state, Dv, head_it,
                                        batch, m_block)
                state.advance()

    def load_row_block(self, tma_atom: cute.CopyAtom, mX: cute.Tensor, sX: cute.Tensor,
                       pipeline_x, state, d: int, head: Int32, batch: Int32, m_block: Int32):
        """Producer warp: query block ``m_block`` of ``mX`` (Q on rank 0, dO on rank 1; ``d``
        columns) of ``head`` into ``sX``'s stage of ``state``, through ``pipeline_x``."""
        gX = cute.local_tile(sequence(mX, head, batch), (self.tile_m, d), (None, 0))
        tXsX, tXgX = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1),
                                           cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2))
        pipeline_x.producer_acquire(state)
        cute.copy(tma_atom, tXgX[None, m_block], tXsX[None, state.index],
                  tma_bar_ptr=pipeline_x.producer_get_barrier(state))

    @cute.jit
    def load_rows(self, mX: cute.Tensor, x: cute.Tensor, tScS_mn: cute.Tensor, m_block: Int32,
                  seqlen_q: Int32, head: Int32, batch: Int32, outside: Float32):
        """This thread's rows of query block ``m_block`` of ``mX`` (lse_log2 or delta) into
        ``x``; rows past seqlen_q get ``outside`` (the loads stay in bounds)."""
        for r in cutlass.range_constexpr(cute.size(x)):
            row = m_block * self.tile_m + tScS_mn[r, 0][0]
            v = mX[cutlass.min(row, seqlen_q - 1), head, batch]
            x[r] = v if row < seqlen_q else outside

    @cute.jit
    def load_next_rows(self, mX: cute.Tensor, x: cute.Tensor, tScS_mn: cute.Tensor, it: Int32,
                       end: Int32, start: Int32, m_block_min: Int32, m_block_max: Int32,
                       seqlen_q: Int32, head: Int32, batch: Int32, outside: Float32,
                       group=None):
        """``load_rows`` of loop position ``it + 1``'s query block and head (past the last
        position: the last one's, unused)."""
        pos, head_it = self.head_at(cutlass.min(it + 1, end - 1), head, m_block_min,
                                    m_block_max, group)
        self.load_rows(mX, x, tScS_mn, self.m_block_at(pos, start, m_block_min, m_block_max),
                       seqlen_q, head_it, batch, outside)

    @cute.jit
    def dq_quarter_view(self, mdQacc: cute.Tensor, rank: Int32, head: Int32, batch: Int32,
                        wg_idx: Int32, tidx_in_wg: Int32) -> cute.Tensor:
        """This thread's dQ floats of every query block in dq_accum, (4, q / 4, m_block), q =
        dq_quarter_regs: the one-CTA dQ warpgroup ``rank``'s chunk (its D/2 columns), registers
        [wg_idx·q, (wg_idx + 1)·q) of its fragment (dq_fragment_view's order)."""
        gdQacc = mdQacc[None, head, batch]
        q = self.dq_quarter_regs
        chunk = self.tile_m * self.dq_half  # floats of one one-CTA warpgroup's chunk
        return cute.make_tensor(
            gdQacc.iterator + (rank * chunk + wg_idx * q * 128 + tidx_in_wg * 4),
            cute.make_layout((4, q // 4, gdQacc.shape[0] // (2 * chunk)),
                             stride=(1, 512, 2 * chunk)))

    @cute.jit
    def add_dq(self, acc: cute.Tensor, mdQacc: cute.Tensor, rank: Int32, head: Int32,
               batch: Int32, wg_idx: Int32, tidx_in_wg: Int32, m_block: Int32):
        """``red.global.add.v4.f32`` of this thread's dQ quarter of query block ``m_block`` of
        ``head`` into dq_accum."""
        v = self.dq_quarter_view(mdQacc, rank, head, batch, wg_idx, tidx_in_wg)[None, None,
                                                                              m_block]
        for c in cutlass.range_constexpr(self.dq_quarter_regs // 4):
            red_add_v4_f32(v[None, c].iterator, acc[4 * c], acc[4 * c + 1], acc[4 * c + 2],
                           acc[4 * c + 3])

    def fragments(self, sA: cute.Tensor, sB: cute.Tensor, sB_half: cute.Tensor,
                  sD: cute.Tensor, mma_sdp: cute.TiledMma, mma_acc: cute.TiledMma,
                  mma_dqh: cute.TiledMma, tidx: Int32):
        """A rank's GEMM operands (shared-memory descriptors): the first GEMM's A = sA (Q or
        dO stages) and B = sB (K or V); the accumulated GEMM's A = D's P or dS read transposed
        and B = sA transposed; dQ's A = D's dS and B = the rank's half of K transposed. Then the
        first GEMM's and the dQ quarter's accumulator shapes and the first GEMM's (row, column)
        coordinates of this thread's elements."""
        tm, tn = self.tile_m, self.tile_n
        thr_sdp = mma_sdp.get_slice(tidx)
        thr_acc = mma_acc.get_slice(tidx)
        thr_dqh = mma_dqh.get_slice(tidx)
        return (thr_sdp.make_fragment_A(thr_sdp.partition_A(sA)),
                thr_sdp.make_fragment_B(thr_sdp.partition_B(sB)),
                thr_acc.make_fragment_A(thr_acc.partition_A(transpose_mn(sD))),
                thr_acc.make_fragment_B(thr_acc.partition_B(transpose_mn(sA))),
                thr_dqh.make_fragment_A(thr_dqh.partition_A(sD)),
                thr_dqh.make_fragment_B(thr_dqh.partition_B(transpose_mn(sB_half))),
                thr_sdp.partition_shape_C((tm, tn)),
                thr_dqh.partition_shape_C((tm, self.dq_half)),
                acc_view_mn(thr_sdp.partition_C(cute.make_identity_tensor((tm, tn)))))

    @cute.jit
    def first_gemm(self, pipeline_x, state, mma: cute.TiledMma, tA: cute.Tensor,
                   tB: cute.Tensor, acc_shape: cutlass.Constexpr) -> cute.Tensor:
        """A block's first GEMM, S = Q·Kᵀ (rank 0) or dP = dO·Vᵀ (rank 1): wait for the stage of
        Q or dO, issue, wait for the result."""
        pipeline_x.consumer_wait(state)
        acc = cute.make_rmem_tensor(acc_shape, Float32)
        wgmma(mma, acc, tA[None, None, None, state.index], tB, zero_init=True)
        warpgroup.wait_group(0)
        return acc

    @cute.jit
    def mma_pair(self, rank: Int32, mdK: cute.Tensor, mdV: cute.Tensor, mLSE: cute.Tensor,
                 mDelta: cute.Tensor, mParams: cute.Tensor, mdQacc: cute.Tensor,
                 sQ: cute.Tensor, sdO: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor,
                 sC: cute.Tensor, sKh: cute.Tensor, sD: cute.Tensor, tma_atom_dK, tma_atom_dV,
                 mma_sdp: cute.TiledMma, mma_dk: cute.TiledMma, mma_dv: cute.TiledMma,
                 mma_dqh: cute.TiledMma, pipeline_q, pipeline_do, sig: cute.Pointer, tidx: Int32,
                 n_block: Int32, head: Int32, head_dkv: Int32, batch: Int32,
                 m_block_min: Int32, m_block_max: Int32, seqlen_q: Int32, seqlen_k: Int32,
                 block_info: BwdBlocks, group=None):
        """The MMA warpgroups of either rank: the query-block loop (with ``group``: over the
        group's query heads' blocks in turn), the end-of-loop waits and the epilogue (dK on
        rank 0, dV on rank 1)."""
        tn, D, Dv = self.tile_n, self.hdim, self.hdimv
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        tidx_in_wg = tidx % 128
        count = self.loop_end(m_block_min, m_block_max, group) - m_block_min  # iterations
        if rank == 0:
            acc_dK = cute.make_rmem_tensor(mma_dk.get_slice(tidx).partition_shape_C((tn, D)),
                                           Float32)
            acc_dK.fill(0.0)
            if count > 0:
                self.loop_s(mLSE, mParams, mdQacc, sQ, sK, sC, sD, mma_sdp, mma_dk, mma_dqh,
                            acc_dK, pipeline_q, sig, tidx, wg_idx, tidx_in_wg, n_block, head,
                            batch, m_block_min, m_block_max, seqlen_q, block_info, group)
                # the peer's pds_empty arrivals of the last min(pds_stages, count) iterations
                for k in cutlass.range_constexpr(self.pds_stages):
                    j = count - 1 - k
                    if j >= 0:
                        mbarrier_wait_cluster(sig + PDS_BASE + 2 * (j % self.pds_stages) + 1,
                                              (j // self.pds_stages) % 2)
            scale = mParams[PARAM_SCALE]
            for i in cutlass.range_constexpr(cute.size(acc_dK)):
                acc_dK[i] = acc_dK[i] * scale
            self.store_pair(acc_dK, mdK, sK, tma_atom_dK, mma_dk, (tn, D), n_block, head_dkv,
                            batch, seqlen_k)
        else:
            acc_dV = cute.make_rmem_tensor(mma_dv.get_slice(tidx).partition_shape_C((tn, Dv)),
                                           Float32)
            acc_dV.fill(0.0)
            if count > 0:
                self.loop_dp(mDelta, mdQacc, sdO, sV, sC, sKh, sD, mma_sdp, mma_dv, mma_dqh,
                             acc_dV, pipeline_do, sig, tidx, wg_idx, tidx_in_wg, n_block, head,
                             batch, m_block_min, m_block_max, seqlen_q, group)
                # the peer's dpd_empty arrival of the last iteration
                mbarrier_wait_cluster(sig + DPD_EMPTY, (count - 1) % 2)
            self.store_pair(acc_dV, mdV, sV, tma_atom_dV, mma_dv, (tn, Dv), n_block, head_dkv,
                            batch, seqlen_k)

    @cute.jit
    def loop_s(self, mLSE: cute.Tensor, mParams: cute.Tensor, mdQacc: cute.Tensor,
               sQ: cute.Tensor, sK: cute.Tensor, sC: cute.Tensor, sD: cute.Tensor,
               mma_sdp: cute.TiledMma, mma_dk: cute.TiledMma, mma_dqh: cute.TiledMma,
               acc_dK: cute.Tensor, pipeline_q, sig: cute.Pointer, tidx: Int32, wg_idx: Int32,
               tidx_in_wg: Int32, n_block: Int32, head: Int32, batch: Int32,
               m_block_min: Int32, m_block_max: Int32, seqlen_q: Int32,
               block_info: BwdBlocks, group=None):
        """Rank 0's query-block loop: S, P, dS, dK and dQ's first half (module docstring)."""
        tm, tn, pds = self.tile_m, self.tile_n, self.pds_stages
        sK_half = cute.local_tile(sK, (tn, self.dq_half), (0, 0))
        (tSrQ, tSrK, tdKrdSt, tdKrQt, tdQrdS, tdQrKt, acc_S_shape, acc_dQ_shape,
         tScS_mn) = self.fragments(sQ, sK, sK_half, sD, mma_sdp, mma_dk, mma_dqh, tidx)
        st_atom = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        st_thr = cute.make_tiled_copy_C(st_atom, mma_sdp).get_slice(tidx)
        tXsD = st_thr.partition_D(sD)
        # dP − delta in C: this thread's floats in fragment order (dq_fragment_view's)
        sC_wg = cute.local_tile(sC, (128 * self.dpd_regs,), (wg_idx,))
        tCsC = dq_fragment_view(sC_wg, self.dpd_regs, tidx_in_wg)

        scales = score_scales(mParams[PARAM_SCALE], mParams, self.has_softcap, inverse=True)
        scale_log2, tanh_in_scale = scales.scale_log2, scales.tanh_in_scale
        inv_scale_log2 = scales.inv_scale_log2
        kv_tail = BwdBlocks.kv_tail(block_info, n_block)
        num_rows = cute.size(tScS_mn, mode=[0])
        lse = cute.make_rmem_tensor(num_rows, Float32)
        zeros = cute.make_rmem_tensor(num_rows, Float32)
        zeros.fill(0.0)
        start = self.first_visit(n_block, m_block_min, m_block_max)
        self.load_rows(mLSE, lse, tScS_mn, self.m_block_at(m_block_min, start, m_block_min,
                                                             m_block_max),
                       seqlen_q, head, batch, Float32.inf)
        dpd_full, dpd_empty = sig + DPD_FULL, sig + DPD_EMPTY
        dpd_bytes = tm * tn * 4
        if tidx == 0:  # iteration 0's bytes
            cute.arch.mbarrier_arrive_and_expect_tx(dpd_full, dpd_bytes)
        cute.arch.mbarrier_wait(sig + KV, 0)
        # state: the Q stage of the block whose dK GEMM comes next (released after it);
        # ahead (lookahead): the newest Q stage waited for
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        ahead = state.clone()
        acc_S = cute.make_rmem_tensor(acc_S_shape, Float32)
        acc_dQ = cute.make_rmem_tensor(acc_dQ_shape, Float32)
        # (lookahead: the query block and head whose dQ is in flight)
        m_prev, h_prev = Int32(0), head
        end = self.loop_end(m_block_min, m_block_max, group)
        if const_expr(self.lookahead):  # S of the first block
            acc_S = self.first_gemm(pipeline_q, ahead, mma_sdp, tSrQ, tSrK, acc_S_shape)
        for it in cutlass.range(m_block_min, end, unroll=1):
            j = it - m_block_min
            pos, head_it = self.head_at(it, head, m_block_min, m_block_max, group)
            m_block = self.m_block_at(pos, start, m_block_min, m_block_max)
            s = j % pds
            if const_expr(self.lookahead):
                if j > 0:
                    warpgroup.wait_group(2)  # S(j), issued before dK(j − 1) and dQ(j − 1)
            else:
                acc_S = self.first_gemm(pipeline_q, state, mma_sdp, tSrQ, tSrK, acc_S_shape)
            s_mn = acc_view_mn(acc_S)
            self.scores_to_p(s_mn, lse, scale_log2, tanh_in_scale, per_col=False)
            if self.block_needs_mask(block_info, m_block, n_block, kv_tail):
                self.mask_p(s_mn, tScS_mn, m_block, n_block, block_info)
            # P -> D[s] once the peer is done with it (one exchange buffer: and both
            # warpgroups' dK / dQ GEMMs of the previous block, which read its dS)
            if const_expr(pds == 1):
                cute.arch.barrier(barrier_id=int(NamedBarrier.PDS),
                                  number_of_threads=self.num_mma_threads)
            if j >= pds:
                mbarrier_wait_cluster(sig + PDS_BASE + 2 * s + 1, (j // pds - 1) % 2)
            rP = cute.make_rmem_tensor(acc_S.layout, self.dtype)
            convert_f32_pairs(acc_S, rP, self.is_bf16)
            cute.copy(st_thr, st_thr.retile(rP), tXsD[None, None, None, 2 * s])
            if const_expr(self.lookahead):
                if j > 0:  # the previous block's dK / dQ GEMMs ran under this block's P
                    warpgroup.wait_group(0)
                    pipeline_q.consumer_release(state)
                    state.advance()
                    self.add_dq(acc_dQ, mdQacc, Int32(0), h_prev, batch, wg_idx, tidx_in_wg,
                                m_prev)
            # dP − delta from the peer -> registers, C back to the peer
            acc_dP = cute.make_rmem_tensor(acc_S_shape, Float32)
            mbarrier_wait_cluster(dpd_full, j % 2)
            if tidx == 0 and it + 1 < end:
                cute.arch.mbarrier_arrive_and_expect_tx(dpd_full, dpd_bytes)
            cute.autovec_copy(tCsC, cute.make_tensor(acc_dP.iterator,
                                                     cute.make_layout((4, self.dpd_regs // 4))))
            cute.arch.sync_warp()
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive(dpd_empty, 1, scope=CLUSTER)
            # dS = P∘(dP − delta) [∘ (1 − t²)] -> D[s]
            self.dp_to_ds(s_mn, acc_view_mn(acc_dP), lse, zeros, inv_scale_log2,
                          per_col=False)
            # the next block's lse (past the last one: any block, unused)
            self.load_next_rows(mLSE, lse, tScS_mn, it, end, start, m_block_min, m_block_max,
                                seqlen_q, head, batch, Float32.inf, group)
            rdS = cute.make_rmem_tensor(acc_dP.layout, self.dtype)
            convert_f32_pairs(acc_dP, rdS, self.is_bf16)
            cute.copy(st_thr, st_thr.retile(rdS), tXsD[None, None, None, 2 * s + 1])
            cute.arch.fence_proxy("async.shared", space="cta")  # st.shared -> WGMMA, bulk copy
            cute.arch.barrier(barrier_id=int(NamedBarrier.PDS),
                              number_of_threads=self.num_mma_threads)
            if tidx == 0:  # P and dS of stage s -> the peer's D[s]
                full = sig + PDS_BASE + 2 * s
                cute.arch.mbarrier_arrive_and_expect_tx(full, self.pds_bytes, 1,
                                                        scope=CLUSTER)
                src = sD[None, None, 2 * s].iterator
                bulk_copy_to_cluster(peer_address(src, Int32(1)), src,
                                     peer_address(full, Int32(1)), self.pds_bytes)
            if const_expr(self.lookahead):  # S of the next block first
                if it + 1 < end:
                    ahead.advance()
                    pipeline_q.consumer_wait(ahead)
                    wgmma(mma_sdp, acc_S, tSrQ[None, None, None, ahead.index], tSrK,
                          zero_init=True)
            # dK += dSᵀ·Q, dQ[:, :D/2] = dS·K[:, :D/2]
            wgmma(mma_dk, acc_dK, tdKrdSt[None, None, None, 2 * s + 1],
                  tdKrQt[None, None, None, state.index], zero_init=False)
            wgmma(mma_dqh, acc_dQ, tdQrdS[None, None, None, 2 * s + 1], tdQrKt, zero_init=True)
            if const_expr(self.lookahead):
                m_prev, h_prev = m_block, head_it
            else:
                warpgroup.wait_group(0)
                pipeline_q.consumer_release(state)
                state.advance()
                self.add_dq(acc_dQ, mdQacc, Int32(0), head_it, batch, wg_idx, tidx_in_wg,
                            m_block)
        if const_expr(self.lookahead):  # the last block's dK / dQ
            warpgroup.wait_group(0)
            pipeline_q.consumer_release(state)
            self.add_dq(acc_dQ, mdQacc, Int32(0), h_prev, batch, wg_idx, tidx_in_wg, m_prev)

    @cute.jit
    def loop_dp(self, mDelta: cute.Tensor, mdQacc: cute.Tensor, sdO: cute.Tensor,
                sV: cute.Tensor, sC: cute.Tensor, sKh: cute.Tensor, sD: cute.Tensor,
                mma_sdp: cute.TiledMma, mma_dv: cute.TiledMma, mma_dqh: cute.TiledMma,
                acc_dV: cute.Tensor, pipeline_do, sig: cute.Pointer, tidx: Int32,
                wg_idx: Int32, tidx_in_wg: Int32, n_block: Int32, head: Int32, batch: Int32,
                m_block_min: Int32, m_block_max: Int32, seqlen_q: Int32, group=None):
        """Rank 1's query-block loop: dP − delta to the peer, dV and dQ's second half."""
        pds = self.pds_stages
        (tdPrdO, tdPrV, tdVrPt, tdVrdOt, tdQrdS, tdQrKt, acc_S_shape, acc_dQ_shape,
         tScS_mn) = self.fragments(sdO, sV, sKh, sD, mma_sdp, mma_dv, mma_dqh, tidx)
        # the peer's C and dpd_full, this thread's first float of C there
        c_peer = peer_address(sC.iterator, Int32(0)) + (
            (wg_idx * 128 * self.dpd_regs + tidx_in_wg * 4) * 4)
        dpd_full_peer = peer_address(sig + DPD_FULL, Int32(0))
        num_rows = cute.size(tScS_mn, mode=[0])
        delta = cute.make_rmem_tensor(num_rows, Float32)
        start = self.first_visit(n_block, m_block_min, m_block_max)
        self.load_rows(mDelta, delta, tScS_mn, self.m_block_at(m_block_min, start, m_block_min,
                                                               m_block_max),
                       seqlen_q, head, batch, Float32(0.0))
        cute.arch.mbarrier_wait(sig + KV, 0)
        # state: the dO stage of the block whose dV GEMM comes next; ahead (lookahead): the
        # newest dO stage waited for
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        ahead = state.clone()
        acc_dP = cute.make_rmem_tensor(acc_S_shape, Float32)
        if const_expr(self.lookahead):  # dP of the first block
            acc_dP = self.first_gemm(pipeline_do, ahead, mma_sdp, tdPrdO, tdPrV, acc_S_shape)
        end = self.loop_end(m_block_min, m_block_max, group)
        for it in cutlass.range(m_block_min, end, unroll=1):
            j = it - m_block_min
            pos, head_it = self.head_at(it, head, m_block_min, m_block_max, group)
            m_block = self.m_block_at(pos, start, m_block_min, m_block_max)
            s = j % pds
            # dP = dO·Vᵀ (lookahead: issued in the previous iteration, complete), dP − delta
            # -> the peer's C
            if const_expr(not self.lookahead):
                acc_dP = self.first_gemm(pipeline_do, state, mma_sdp, tdPrdO, tdPrV,
                                         acc_S_shape)
            dp_mn = acc_view_mn(acc_dP)
            for r in cutlass.range_constexpr(cute.size(dp_mn, mode=[0])):
                for c in cutlass.range_constexpr(cute.size(dp_mn, mode=[1])):
                    dp_mn[r, c] = dp_mn[r, c] - delta[r]
            self.load_next_rows(mDelta, delta, tScS_mn, it, end, start, m_block_min,
                                m_block_max, seqlen_q, head, batch, Float32(0.0), group)
            if j >= 1:
                mbarrier_wait_cluster(sig + DPD_EMPTY, (j - 1) % 2)
            for c in cutlass.range_constexpr(self.dpd_regs // 4):
                st_async_v4_f32(c_peer + c * 512 * 4, acc_dP[4 * c], acc_dP[4 * c + 1],
                                acc_dP[4 * c + 2], acc_dP[4 * c + 3], dpd_full_peer)
            if const_expr(self.lookahead):  # the next block's dP runs while P, dS come
                if it + 1 < end:
                    ahead.advance()
                    pipeline_do.consumer_wait(ahead)
                    wgmma(mma_sdp, acc_dP, tdPrdO[None, None, None, ahead.index], tdPrV,
                          zero_init=True)
            # dV += Pᵀ·dO, dQ[:, D/2:] = dS·K[:, D/2:] once P and dS have landed in D[s]
            mbarrier_wait_cluster(sig + PDS_BASE + 2 * s, (j // pds) % 2)
            wgmma(mma_dv, acc_dV, tdVrPt[None, None, None, 2 * s],
                  tdVrdOt[None, None, None, state.index], zero_init=False)
            acc_dQ = cute.make_rmem_tensor(acc_dQ_shape, Float32)
            wgmma(mma_dqh, acc_dQ, tdQrdS[None, None, None, 2 * s + 1], tdQrKt, zero_init=True)
            warpgroup.wait_group(0)  # (lookahead: the next block's dP too)
            pipeline_do.consumer_release(state)
            state.advance()
            cute.arch.sync_warp()
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive(sig + PDS_BASE + 2 * s + 1, 0, scope=CLUSTER)
            self.add_dq(acc_dQ, mdQacc, Int32(1), head_it, batch, wg_idx, tidx_in_wg, m_block)

    @cute.jit
    def store_pair(self, acc: cute.Tensor, mX: cute.Tensor, sX: cute.Tensor, tma_atom_X,
                   mma_x: cute.TiledMma, tile: cutlass.Constexpr, n_block: Int32,
                   head_dkv: Int32, batch: Int32, seqlen_k: Int32):
        """The rank's accumulator (dK on rank 0, dV on rank 1) of the key block: float32 from
        registers (GQA), else converted, stmatrix into its K / V buffer ``sX`` (read by no GEMM
        any more) and one TMA store."""
        tidx = thread_idx_x_again() - 128
        if const_expr(self.gqa):
            self.store_dkv_f32(acc, mX, mma_x.get_slice(tidx), tile, n_block, head_dkv, batch,
                               seqlen_k)
        else:
            r16 = cute.make_rmem_tensor(acc.layout, self.dtype)
            convert_f32_pairs(acc, r16, self.is_bf16)
            epi_barrier = int(NamedBarrier.EPILOGUE)
            cute.arch.barrier(barrier_id=epi_barrier, number_of_threads=self.num_mma_threads)
            st_atom = cute.make_copy_atom(
                cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
            st = cute.make_tiled_copy_C(st_atom, mma_x).get_slice(tidx)
            cute.copy(st, st.retile(r16), st.partition_D(sX))
            cute.arch.fence_proxy("async.shared", space="cta")  # st.shared -> TMA store
            cute.arch.barrier(barrier_id=epi_barrier, number_of_threads=self.num_mma_threads)
            if tidx < 32:
                g = cute.local_tile(sequence(mX, head_dkv, batch), tile, (n_block, 0))
                t_s, t_g = cpasync.tma_partition(tma_atom_X, 0, cute.make_layout(1),
                                                 cute.group_modes(sX, 0, 2),
                                                 cute.group_modes(g, 0, 2))
                cute.copy(tma_atom_X, t_s, t_g)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)


def make_launcher(cfg: BwdPairConfig):
    """The `@cute.jit` launcher ``fn(stream, q, k, v, dout, lse_log2, delta, params, dq_accum,
    dk, dv)`` of a pair config (dq_accum updated in place; bwd.make_launcher's dense contract)."""
    kernel = FlashAttentionBackwardSm90Pair(cfg)

    @cute.jit
    def sm90_bwd_pair(stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor,
                      dout: cute.Tensor, lse_log2: cute.Tensor, delta: cute.Tensor,
                      params: cute.Tensor, dq_accum: cute.Tensor, dk: cute.Tensor,
                      dv: cute.Tensor):
        kernel(stream, q, k, v, dout, lse_log2, delta, params, dq_accum, dk, dv)

    return sm90_bwd_pair
