"""The sm100 2-CTA backward kernel's synchronisation protocol, checked on a CPU by a discrete-event
model.

jax_fa4/kernels/sm100/bwd_2cta.py (head dims 128 and 192 / Dv 128, tcgen05 ``cta_group::2``) can
be compiled here but never run (no Blackwell GPU): its protocol across the two CTAs of a cluster
must be right by construction. Its specification is the module docstring of bwd_2cta.py (warp roles,
the leader's MMA order, every barrier with its count and arrivers, the DSMEM exchange of dS, the
relay warp, TMEM offsets, the deterministic dQ order); this file transcribes it role by role as
Python generators (load_warp, mma_warp, compute_warps + epilogue, relay_warp, reduce_warps) and runs
whole grids of clusters under random schedules. Both variants of the docstring are modelled,
selected by the config: head dim 128 (below) and the *serial* layout of head dim 192 / Dv 128
(``Sm100BwdConfig.serial``, see "Serial layout" further down).

The machine is the 1-CTA backward model's (tests/test_sm100_bwd_protocol.py: BwdSim, with the
forward model's Barrier, Resource, PipelineState, PipelineTmaUmma; PipelineAsync, Reduce,
imported, not copied) extended by ``PairSim``:
  * clusters of two CTAs (rank 0 the leader, rank 1 the follower) launched together into two SM
    slots (cluster linear order: pair fastest, then head), each CTA's warps starting at its own
    random later time (the CTAs of a cluster are co-scheduled, not in lockstep); a slot frees
    when all of its CTA's warps have exited; each CTA has its own mbarriers, shared
    memory and TMEM, one tensor pipe per pair (the leader's): the leader's MMAs execute in issue
    order and read / write the resources of both CTAs at the same offsets;
  * tcgen05.commit with multicast mask 0b11: once the pipe's earlier MMAs have completed, one
    arrival on the barrier at the same offset in each CTA; the commits' arrivals in issue order
    (``in_order_commits``, the default, an assumption on the hardware) or, to probe it, those
    onto different barriers in any order;
  * 2-CTA TMA: each CTA's load warp waits its own empty barrier, writes its own shared memory,
    and completes its bytes on the *leader's* full barrier, which only the leader arms
    (arrive.expect_tx of 2 × the per-CTA copies; a CTA's bytes may land before the arm: the
    transaction count goes negative, as the hardware allows); releases are multicast commits;
  * remote arrives (follower → leader: p_full, ds_full, dq_empty, xchg_leader; the TMEM dealloc
    handshake both ways), executed at once by the arriving warp;
  * the DSMEM exchange: the sender thread's remote arrive.expect_tx on the peer's xchg_full, then
    a bulk copy that reads the sender's sdS_xchg and writes the peer's sdS half (sender's rank)
    from issue to completion, completing its bytes on the peer's xchg_full at a random later time;
  * barrier initialisation as an event of each CTA (warp 12): an arrive, transaction or wait on a
    barrier before its CTA initialised it is an error, and so is one after its CTA exited;
    the cluster barriers (after init, before exit: every warp of both CTAs) and the CTA's named
    barriers (TMEM_ALLOC / TMEM_DEALLOC, REDUCE, the sender warpgroup's XCHG) by cumulative count;
  * TMEM: the cta_group::2 allocation is a rendezvous of both MMA warps; each MMA warp frees its
    CTA's TMEM after the CTA's dealloc barrier and the peer handshake (arrive on the peer's
    tmem_dealloc barrier, wait its own): no MMA of the pair may be in flight then, and no TMEM
    access may follow;
  * the dQ reduce: TMA reduce-adds of two (64, dq_cols) boxes per chunk as one bulk group
    (rows 128m + 64r, columns c·dq_cols and D/2 + c·dq_cols), the deterministic semaphore slot
    (m, r) with turn = the pair's rank among the pairs visiting m (``BwdBlocks.dq_rank`` with
    tile_n 256 on the pair index).
Actors: one per warp (an mbarrier arrive of a warp counts 1 on the warp-counted barriers, 32 on
the thread-counted lse / dealloc ones): reduce 0-3, compute 4-11 (warpgroup w = query columns
[64w, 64w + 64), warp % 4 = key lane quarter), MMA 12, load 13, relay 14, idle 15.

Resources (tags of the last write; asynchronous accesses hold them from issue to completion):
per CTA sK, sV, sKᵀ, the sQ / sQᵀ / sdO / sdOᵀ stages, sLSE / sDelta stages, sdS[half][key
quarter], sdS_xchg[key quarter], the dQ staging rows of each reduce warp, TMEM cells of 32 lanes ×
32 columns (8 in dQ's columns [448, 512)) at the docstring's offsets: dK [0, 128), dV [128, 256),
Sᵀ [256, 384) with Pᵀ of warpgroup w in [64w, 64w + 32), dPᵀ [384, 512) with dSᵀ of warpgroup w
in [64w, 64w + 32) and dQ in [64, 128). Tags name the iteration, and for shared memory the m-block,
the q-half / column half and the key owner: dQ_j must read, in both CTAs, both sdS halves as
(dS_j, keys of CTA h, q-half of the CTA).

Checks (the 1-CTA model's): try_wait.parity exactly as the hardware, and every wait names the
phase it means (a wait passing with another number of phases completed, or pending two phases
behind, is a parity alias); an actor's n-th arrive (a commit's, a TMA's or DSMEM copy's bytes)
lands in phase n; data hazards and stale reads; at the end no deadlock, every barrier between
phases with the expected phases and waits per warp, each compute warp read dK / dV of its last
iteration (and stored them once unless its CTA lies past seqlen_k), TMEM allocated and freed in
both CTAs, each dq_accum element (b, h, m, row half, column chunk) added exactly once by each pair
visiting m, in rank order when deterministic (recorded at completion), semaphores at their final
counts; no CTA exits while a commit, TMA transaction, DSMEM copy or remote arrive may still
reach it.

Not modelled: the memory model (fences, wait::ld / wait::st, cluster-scope release of the remote
arrives: an access happens where its fence completes it), layouts beyond the column / lane /
quarter granularity above, the MMAs' k-block loops, the arithmetic, element masks (a CTA past
seqlen_k runs the same protocol with zero-filled loads). The tensor pipe executes the leader's
MMAs in issue order (dQ_j overwrites warpgroup 1's dSᵀ_j, which the earlier dK_j reads).

Checked under random schedules over random grids (masks none / causal / local with random
windows, odd lengths up to 3 query × 4 key blocks, an odd key-block count: a CTA past seqlen_k,
1-2 heads, one cluster up to the whole grid resident, softcap, deterministic, the dq_cols /
dq_stages pairs that fit shared memory, every load order with Q before Qᵀ). Mutation tests: each
protocol element the kernel relies on, removed, makes the model fail (see the tests at the end).

Serial layout (head dim 192 / Dv 128, ``cfg.serial``; PairCta.mma_warp_serial and the serial
branches of load_warp / compute_warps / check_end), as the docstring's last section specifies:
  * TMEM at ``cfg.tmem_offsets()``: dV [0, 128), dK [128, 320), Sᵀ [320, 448) with 16-bit Pᵀ
    contiguous in its first 64 columns (warpgroup w stores [32w, 32w + 32)), dPᵀ [384, 512) over
    Sᵀ's upper 64 columns, dSᵀ contiguous in dPᵀ's first 64 columns, the folded dQ (96 columns,
    8-column cells) at [416, 512) = dPᵀ's [32, 128); the dV / dK TS MMAs read Pᵀ / dSᵀ from the
    contiguous 64 columns; the epilogue reads Dv / 2 = 64 dV and D / 2 = 96 dK columns per
    warpgroup;
  * s_read (compute → leader, 16 warp arrivals after the Sᵀ_j loads), the 256-thread COMPUTE
    named barrier before the Pᵀ stores and before the dSᵀ stores (by cumulative count);
  * the leader's serialized order (no skew): j > 0: dq_empty_{j−1}; Q_j, Sᵀ_j, s_full, release q;
    s_read_j, dO_j, dPᵀ_j, dp_full, release do; p_full_j, dOᵀ_j, dV_j, release do; ds_full_j,
    Qᵀ_j, dK_j, release q; xchg_leader_j, dQ_j, dq_full + ds_empty; then dkv_full;
  * one q and one do pipeline, each used twice per iteration (Q_j then Qᵀ_j into one buffer,
    dO_j then dOᵀ_j into another: the same stage ring, consecutive PipelineStates; tags tell the
    two uses apart), no qt / dot pipelines; load order Q, dO, lse, Qᵀ, dOᵀ (the kernel's,
    SERIAL_LOAD_ORDER; the random tests use every order that runs, SERIAL_LOAD_ORDERS); the
    exit drain waits the last phase of every stage of q / do.empty (each released 2·count
    times) and the relay warp the last ds_empty, as for head dim 128;
  * the dQ reduce over D / 2 = 96 folded columns in dq_cols chunks (8: 12 chunks, two boxes
    each), dq_accum checked over all 192 columns.
Checked by the same machinery and end checks under random schedules (all masks, deterministic
on / off, softcap, every (dq_cols, dq_stages) the config accepts: (8, 1), (8, 2), (16, 1)), with
reordered and lagging commit arrivals, and by mutations: no s_read wait (dPᵀ_j overwrites Sᵀ_j's
upper half before warpgroup 1 loaded it), no named barrier before the Pᵀ / dSᵀ stores
(warpgroup 1 overwrites Sᵀ / dPᵀ columns [32, 64) that warpgroup 0 has not loaded), the
dq_empty wait moved after Sᵀ_j or removed (Sᵀ_j overwrites dQ_{j−1}'s columns [416, 448) while
the reduce warps drain them), each of the four q / do releases issued before its MMA, the
exit drain removed, and the head-dim-128 mutations of shared elements (2 × tx, multicast, relay,
pair-uniform m range, ds_empty wait). No deadlock or hazard in the unmutated serial protocol
(also not in ~3000 further random runs, a quarter with reordered commit arrivals, while the
model was written). Findings:
  * the load warp must issue dOᵀ_j after Q_j and lse_j, or every schedule deadlocks: dOᵀ_j's
    stage is freed by the commit after dPᵀ_j, issued after s_read_j, which needs the compute
    warps to have loaded Sᵀ_j (Q_j) after waiting lse_j
    (test_serial_load_order_dot_after_q_and_lse); the kernel's order satisfies it;
  * as for head dim 128, the ds_empty wait is redundant (dp_full_j's commit follows dQ_{j−1}),
    and with the kernel's load order so is the placement of the release after dV_j (dO_{j+1}'s
    load follows Q_{j+1}'s, which waits the release after dK_j): the mutation is caught only
    with dO loaded before Q; a missing relay shows as a hazard only on few schedules (dQ_j
    follows dK_j, by then the DSMEM copy has mostly landed).

Varlen (``simulate_varlen``; bwd_2cta.py's varlen mode, shipped at 192/128): the grid is the
backend's work list with 256 keys per item (jax_fa4.backends.sm90.work_table, both launch orders)
× heads over random packed batches; work row x is cluster x (CTAs 2x + rank), both PairCtas with
the row's sequence lengths, the pair's query-block range from the row's pair index p (tile_n 256),
own key block 2p + rank, its first dq_accum tile (the mode changes no barrier, role or phase:
spare rows, sequences without queries, pairs no query block sees run count = 0 in both CTAs, a
CTA without keys of its sequence runs its peer's iterations with masked keys and stores nothing).
Checked: every 64-row box of a sequence's dq_accum tiles gets the adds of exactly that sequence's
pairs visiting it, the ZERO_PADDING pair's leader (its 8 compute warps, after the TMEM dealloc
barrier) zeroes the padding rows once per head, and the end checks above; under random schedules
(masks, windows, softcap, GQA, dQ tunings, the serial and the head-dim-128 layouts), on edge
batches (pairs whose second CTA has no keys, empty sequences, sequences without queries or keys,
a window leaving a pair unseen, commit arrivals in issue order and reordered), and by the
mutation of per-CTA query-block ranges (deadlock: the pair range is needed per sequence too).

Found while the model was written (each now in the kernel's docstring or code):
  * Q_j must be loaded before Qᵀ_j, or the pair deadlocks (test_load_order_q_before_qt); the
    kernel's order is Q, dO, lse, Qᵀ, dOᵀ;
  * the ds_empty wait is redundant in this MMA order (dp_full_j's commit follows dQ_{j−1}, which
    waited for both DSMEM copies): removing it is caught only by the barrier bookkeeping; with
    LOAD_ORDER (Qᵀ_{j+1} loaded before dOᵀ_{j+1}) so is the placement of dOᵀ's release;
  * exit: the leader's last commits onto q / qt / do / dot.empty and ds_empty were waited by no
    one, so the final cluster barrier covered them only if commit arrivals keep issue order;
    the kernel now drains them (load warp, relay warp) before that barrier
    (test_exit_with_lagging_commit_arrivals, with and without the drain).
"""

from __future__ import annotations

import itertools
import random
from collections import defaultdict, deque
from functools import partial

import compiled
import pytest
from compiled import per_class
from test_sm100_bwd_protocol import (WARP, BwdCta, BwdSim, PipelineAsync, Reduce,
                                     check_barrier_ends, first_tiles, padding_zeroed_once,
                                     random_ids, varlen_work)
from test_sm100_fwd_protocol import (
    Barrier,
    PipelineState,
    PipelineTmaUmma,
    ProtocolError,
    Resource,
    make_pipeline_state,
)

from jax_fa4.kernels.common.geometry import BwdBlocks
from jax_fa4.kernels.sm100.bwd_config import Sm100BwdConfig, segments_config, varlen_config

TILE = 128  # keys per CTA, query rows per block
PAIR_TILE = 2 * TILE  # keys per pair
N_COMPUTE_WARPS = 8
N_REDUCE_WARPS = 4
TMEM_USERS = N_REDUCE_WARPS + N_COMPUTE_WARPS + 1  # warps at TMEM_ALLOC / TMEM_DEALLOC
WARPS_PER_CTA = 16
DQ_CELL = 8  # TMEM column granularity inside dQ's columns (dq_cols may be 8)
CELL = 32  # elsewhere

#: The load warp's order of the per-block loads (one of LOAD_ORDERS: Q before Qᵀ).
LOAD_ORDER = ("q", "lse", "do", "qt", "dot")
LOAD_ORDERS = [o for o in itertools.permutations(LOAD_ORDER) if o.index("q") < o.index("qt")]
#: Serial layout (head dim 192): the kernel's order; "qt" / "dot" are the q / do pipelines'
#: second use of each iteration (Qᵀ_j into Q_j's buffer, dOᵀ_j into dO_j's).
SERIAL_LOAD_ORDER = ("q", "do", "lse", "qt", "dot")
#: The serial orders that run: Q before Qᵀ, dO before dOᵀ (the stage's next use), and dOᵀ
#: after Q and lse (test_serial_load_order_dot_after_q_and_lse).
SERIAL_LOAD_ORDERS = [o for o in itertools.permutations(SERIAL_LOAD_ORDER)
                      if o.index("q") < o.index("qt") and o.index("do") < o.index("dot")
                      and max(o.index("q"), o.index("lse")) < o.index("dot")]

#: Mutations of the protocol (each must make the model fail, see the tests).
MUTATIONS = ("tx_single", "no_multicast", "no_relay", "own_m_range", "no_dq_empty_wait",
             "no_cluster_sync", "xchg_no_ds_empty_wait", "early_release_q",
             "early_release_qt", "early_release_do", "early_release_dot", "no_exit_drain",
             # serial layout only
             "no_s_read_wait", "no_p_barrier", "no_ds_barrier", "late_dq_empty_wait")


# ---------------------------------------------------------------------------------------------
# PipelineTmaUmma with cluster layout (2): the pair's view of two CTAs' PipelineTmaUmma barriers
# ---------------------------------------------------------------------------------------------
class PairTmaUmma:
    """``per_cta[r]`` holds CTA r's full / empty barriers (the forward model's PipelineTmaUmma).
    Producers (both CTAs' load warps) wait their own empty barrier, only the leader arms its full
    barrier with the bytes of both CTAs' ``copies`` copies; the leader's MMA warp waits the
    leader's full barrier; consumer_release is a commit multicast to both CTAs' empty barriers."""

    def __init__(self, per_cta: list[PipelineTmaUmma], copies: int, mut: frozenset):
        self.per_cta, self.copies, self.mut = per_cta, copies, mut

    def producer_acquire(self, state: PipelineState, rank: int):
        yield ("wait", self.per_cta[rank].empty[state.index], state.phase,
               state.count // state.stages - 1)
        if rank == 0:  # arrive.expect_tx(2 × per-CTA bytes)
            tx = self.copies * (1 if "tx_single" in self.mut else 2)
            yield ("arrive_tx", self.per_cta[0].full[state.index], tx)

    def producer_get_barrier(self, state: PipelineState) -> Barrier:
        return self.per_cta[0].producer_get_barrier(state)  # the leader's, in both CTAs

    def consumer_wait(self, state: PipelineState):
        yield from self.per_cta[0].consumer_wait(state)

    def consumer_release(self, state: PipelineState):
        targets = self.per_cta[:1] if "no_multicast" in self.mut else self.per_cta
        yield ("commit2", tuple(pl.empty[state.index] for pl in targets))


# ---------------------------------------------------------------------------------------------
# Machine: the 1-CTA backward model's BwdSim, for clusters of two CTAs
# ---------------------------------------------------------------------------------------------
class PairSim(BwdSim):
    def __init__(self, rng: random.Random, slots: int, deterministic: bool,
                 in_order_commits: bool = True):
        super().__init__(rng, slots, deterministic)
        self.in_order_commits = in_order_commits
        self.owner: dict = {}  # barrier -> its CTA
        self.copies: list = []  # DSMEM bulk copies in flight
        self.starting: list = []  # launched CTAs whose warps have not started yet
        self.units.append("dsmem")

    # --- barriers: initialised, not exited ------------------------------------------------------
    def _check_target(self, bar: Barrier, who: str):
        cta = self.owner[bar]
        if not cta.initialised:
            self.fail(f"{who}: {bar.name} used before CTA {cta.id} initialised its barriers")
        if cta.retired:
            self.fail(f"{who}: {bar.name} used after CTA {cta.id} exited")

    def _arrive(self, bar: Barrier, n: int, phase: int, who: str, tx: int = 0):
        self._check_target(bar, who)
        super()._arrive(bar, n, phase, who, tx)

    def complete_tma_load(self, i: int):
        self._check_target(self.tma_loads[i][2], "TMA transaction")
        super().complete_tma_load(i)

    def _retire(self, cta):
        pipe = cta.leader
        for _, bars, _ in pipe.commitq:
            if any(self.owner[b] is cta for b in bars):
                self.fail(f"CTA {cta.id} exits while a commit onto {[b.name for b in bars]} "
                          "may still arrive")
        if any(self.owner[bar] is cta for _, _, bar, _ in self.tma_loads):
            self.fail(f"CTA {cta.id} exits while a TMA copy may still complete bytes on it")
        for src, dst, _, bar, _ in self.copies:
            if self.owner[bar] is cta or any(r in cta.smem for r in src + dst):
                self.fail(f"CTA {cta.id} exits while a DSMEM copy touches it")
        super()._retire(cta)

    # --- operations ---------------------------------------------------------------------------
    def execute(self, actor: str, op):
        kind = op[0]
        cta = self.actor_cta[actor]
        if kind == "wait":
            self._check_target(op[1], actor)
        if kind == "init":  # mbarrier_init of every barrier of the CTA (+ fence)
            self.log.append(f"{actor}: init")
            cta.initialised = True
        elif kind == "tma_load_at":  # 2-CTA TMA: own smem, bytes on ``bar`` (phase given)
            _, res, tag, bar, phase = op
            self.log.append(f"{actor}: tma_load {res} {tag} -> {bar.name}")
            self._check_free(res, "tma", True)
            res.inflight.append(("tma", True))
            self.tma_loads.append((res, tag, bar, phase))
        elif kind == "commit2":  # tcgen05.commit cta_group::2 (multicast onto ``bars``)
            bars = op[1]
            self.log.append(f"{actor}: commit {[b.name for b in bars]}")
            phases = []
            for b in bars:
                phases.append(self.arrives["commit", b])
                self.arrives["commit", b] += 1
            cta.commitq.append((cta.mma_issued, bars, phases))
        elif kind == "bulk_copy":  # cp.async.bulk.shared::cluster.shared::cta, complete_tx
            _, src, dst, tag, bar, phase = op
            self.log.append(f"{actor}: bulk copy {src[0]} -> {dst[0]} ({bar.name})")
            for res in src:
                self._check_free(res, "dsmem", False)
                res.inflight.append(("dsmem", False))
            for res in dst:
                self._check_free(res, "dsmem", True)
                res.inflight.append(("dsmem", True))
            self.copies.append((src, dst, tag, bar, phase))
        elif kind == "tma_reduce2":  # two reduce-adds, one bulk group
            _, boxes, expected, contrib = op
            for stage, key in boxes:
                for res in stage:
                    self._check_free(res, "tma", False)
                    res.inflight.append(("tma", False))
                self.reduces.append(Reduce(actor, self.groups[actor], stage, expected, key,
                                           contrib))
            self.log.append(f"{actor}: tma reduce-add {[k for _, k in boxes]}")
            self.groups[actor] += 1
        elif kind == "tmem_alloc":  # tcgen05.alloc.cta_group::2: collective, after both
            cta.tmem_allocated = cta.peer.tmem_allocated = True  # MMA warps issued it
        else:
            super().execute(actor, op)

    def _check_free(self, res: Resource, unit: str, write: bool):
        if res.tmem and not res.tmem.tmem_allocated:
            self.fail(f"{unit}: {res} accessed before the TMEM was allocated")
        super()._check_free(res, unit, write)

    # --- asynchronous units -------------------------------------------------------------------
    def ready_commits(self, pipe) -> list[int]:
        q = pipe.commitq
        if self.in_order_commits:
            return [0] if q and q[0][0] <= pipe.mma_done else []
        out, seen = [], set()
        for i, (seq, bars, _) in enumerate(q):
            if bars not in seen and seq <= pipe.mma_done:
                out.append(i)
            seen.add(bars)
        return out

    def commit_weight(self, bars) -> float:
        return self.weights["commit"]

    def fire_commit2(self, pipe, i: int):
        _, bars, phases = pipe.commitq[i]
        del pipe.commitq[i]
        self.log.append(f"c{pipe.id}.commit: arrives on {[b.name for b in bars]}")
        for b, phase in zip(bars, phases):
            self._arrive(b, 1, phase, "tcgen05.commit")

    def complete_copy(self, i: int):
        src, dst, tag, bar, phase = self.copies.pop(i)
        self.log.append(f"dsmem: copy into {dst[0]} {tag} completes on {bar.name}")
        for res in src:
            self._check_tag(res, tag, "DSMEM copy")
            res.inflight.remove(("dsmem", False))
        for res in dst:
            res.tag = tag
            res.inflight.remove(("dsmem", True))
        self._check_target(bar, "DSMEM copy")
        if bar.completed != phase:
            self.fail(f"DSMEM bytes for phase {phase} of {bar.name} land in phase "
                      f"{bar.completed}")
        bar.tx -= 1
        self._maybe_complete(bar)

    # --- scheduler ----------------------------------------------------------------------------
    # --- event kinds beyond the 1-CTA model's (BwdSim.run fires them) -------------------------
    launch_unit = "cluster"

    def pipe_events(self, cta, events: list):
        """Only the leader has a tensor pipe (it issues the pair's MMAs and commits)."""
        if cta.rank:
            return
        if cta.tensor_queue:
            events.append((self.weights[f"tensor{cta.id}"], partial(self.complete_mma_of, cta)))
        for i in self.ready_commits(cta):
            events.append((self.commit_weight(cta.commitq[i][1]),
                           partial(self.fire_commit2, cta, i)))

    def copy_events(self, events: list):
        for i in range(len(self.copies)):
            events.append((self.weights["dsmem"], partial(self.complete_copy, i)))

    def launch_events(self, events: list):
        if self.pending and len(self.resident) + 2 <= self.slots:
            events.append((self.weights["launch"], self.launch_next))
        for cta in self.starting:
            events.append((self.weights[f"start{cta.id}"], partial(self.start_cta, cta)))

    def launch_next(self):
        """The cluster takes two SM slots at once; its CTAs start at their own later times."""
        pair = self.pending.popleft()
        self.log.append(f"launch cluster of CTAs {[c.id for c in pair]}")
        for cta in pair:
            self.resident.append(cta)
            self.launched.append(cta)
            self.starting.append(cta)
            self.weights[f"start{cta.id}"] = 10 ** self.rng.uniform(-3, 0)
        self.weights[f"tensor{pair[0].id}"] = 10 ** self.rng.uniform(-2.5, 0)

    def start_cta(self, cta):
        """The CTA's warps start (the two CTAs of a cluster skewed)."""
        self.log.append(f"CTA {cta.id} starts")
        self.starting.remove(cta)
        cta.spawn()

    def unfinished(self) -> bool:
        return bool(self.actors or self.pending or self.starting)


# ---------------------------------------------------------------------------------------------
# One CTA of the 2-CTA kernel (jax_fa4/kernels/sm100/bwd_2cta.py)
# ---------------------------------------------------------------------------------------------
class PairCta:
    def __init__(self, sim: PairSim, cfg: Sm100BwdConfig, cta_id: int, pair: int, rank: int,
                 head: int, m_min: int, count: int, in_range: bool, turn, mut: frozenset,
                 load_order=None, batch: int = 0, dq_tile0: int = 0, contrib=None,
                 zero_padding: bool = False):
        """``dq_tile0``, ``contrib``, ``zero_padding``: varlen (one work row; ``pair`` is the
        pair index within its sequence): the sequence's first dq_accum tile, what its adds are
        recorded as ((sequence, pair)), and whether it is the ZERO_PADDING item (the leader's
        compute warps zero the dK / dV rows outside every sequence after the TMEM dealloc
        barrier)."""
        self.sim, self.cfg, self.id, self.pair, self.rank = sim, cfg, cta_id, pair, rank
        self.n_block = 2 * pair + rank
        self.head, self.batch, self.mut = head, batch, mut
        self.dq_tile0, self.zero_padding = dq_tile0, zero_padding
        self.contrib = pair if contrib is None else contrib
        self.m_min, self.count, self.in_range, self.turn = m_min, count, in_range, turn
        self.load_order = load_order or (SERIAL_LOAD_ORDER if cfg.serial else LOAD_ORDER)
        self.D, self.Dv = cfg.head_dim, cfg.head_dim_v
        self.serial = cfg.serial  # head dim 192: the serial layout and MMA order
        self.off = cfg.tmem_offsets()
        self.live, self.retired, self.initialised = 0, False, False
        self.tmem_allocated = self.tmem_freed = False
        self.tensor_queue: deque = deque()  # the leader's is the pair's pipe (shared, see link)
        self.mma_issued = self.mma_done = 0
        self.commitq: list = []
        self.stored: dict = defaultdict(int)
        self.reduce_syncs = [0] * N_REDUCE_WARPS
        self.xchg_syncs = [0] * 4
        self.compute_syncs = [0] * N_COMPUTE_WARPS  # the serial layout's COMPUTE barrier
        p = self.p = f"c{cta_id}"

        def bar(name, count):
            b = Barrier(f"{p}.{name}", count)
            b.family = name
            return b

        # mbarrier_init counts (warp-counted ones: one elected thread per warp)
        self.s_full, self.p_full = bar("s_full", 1), bar("p_full", 2 * N_COMPUTE_WARPS)
        self.dp_full, self.ds_full = bar("dp_full", 1), bar("ds_full", 2 * N_COMPUTE_WARPS)
        self.xchg_full, self.xchg_leader = bar("xchg_full", 1), bar("xchg_leader", 2)
        self.ds_empty, self.dq_full = bar("ds_empty", 1), bar("dq_full", 1)
        self.dq_empty = bar("dq_empty", 2 * N_REDUCE_WARPS)
        self.dkv_full = bar("dkv_full", 1)
        self.tmem_dealloc = bar("tmem_dealloc", WARP)
        self.bars = [self.s_full, self.p_full, self.dp_full, self.ds_full, self.xchg_full,
                     self.xchg_leader, self.ds_empty, self.dq_full, self.dq_empty, self.dkv_full,
                     self.tmem_dealloc]
        if self.serial:  # Sᵀ_j loaded by all 16 compute warps of the pair
            self.s_read = bar("s_read", 2 * N_COMPUTE_WARPS)
            self.bars.append(self.s_read)
        # serial: no qt / dot pipelines (Qᵀ / dOᵀ go through the q / do stages)
        self.tma_names = ("q", "do") if self.serial else ("q", "qt", "do", "dot")
        self.tma = {name: PipelineTmaUmma(f"{p}.{name}", stages) for name, stages in
                    (("kv", 1), ("q", cfg.q_stages), ("qt", cfg.q_stages),
                     ("do", cfg.do_stages), ("dot", cfg.do_stages))
                    if name == "kv" or name in self.tma_names}
        self.pipeline_lse = PipelineAsync(f"{p}.lse", cfg.lse_stages, WARP,
                                          N_COMPUTE_WARPS * WARP)
        for pl in list(self.tma.values()) + [self.pipeline_lse]:
            for b in pl.full + pl.empty:
                b.family = b.family.split(".", 1)[1]
                self.bars.append(b)
        for b in self.bars:
            sim.owner[b] = self
        # shared memory
        R = Resource
        self.sK, self.sV, self.sKt = R(f"{p}.sK"), R(f"{p}.sV"), R(f"{p}.sKt")
        self.sQ = [R(f"{p}.sQ[{s}]") for s in range(cfg.q_stages)]
        self.sQt = [R(f"{p}.sQt[{s}]") for s in range(cfg.q_stages)]
        self.sdO = [R(f"{p}.sdO[{s}]") for s in range(cfg.do_stages)]
        self.sdOt = [R(f"{p}.sdOt[{s}]") for s in range(cfg.do_stages)]
        if self.serial:  # one buffer holds Q_j, then Qᵀ_j; one dO_j, then dOᵀ_j
            self.sQt, self.sdOt = self.sQ, self.sdO
        self.sLSE = [R(f"{p}.sLSE[:, {s}]") for s in range(cfg.lse_stages)]
        self.sDelta = [R(f"{p}.sDelta[:, {s}]") for s in range(cfg.lse_stages)]
        # segment ids: the rows' ids and the own block's mask flag, staged with -lse / -delta
        self.sSeg = [R(f"{p}.sSegIds[:, {s}] / sSegMask[{s}]") for s in range(cfg.lse_stages)
                     if cfg.segments]
        # sdS half h = keys of CTA h (× this CTA's q-half); key quarter q = rows a warp stores
        self.sdS = [[R(f"{p}.sdS[half {h}][keys {32 * q}+]") for q in range(4)]
                    for h in range(2)]
        self.sdS_xchg = [R(f"{p}.sdS_xchg[keys {32 * q}+]") for q in range(4)]
        # dQ staging: stage s, box b (lanes 64b…), rows of reduce warp w (= 2b + w % 2)
        self.sdQ = [[R(f"{p}.sdQ[{s}][box {w // 2}][rows {32 * (w % 2)}+]") for w in range(4)]
                    for s in range(cfg.dq_stages)]
        self.smem = set(itertools.chain(
            (self.sK, self.sV, self.sKt), self.sQ, self.sQt, self.sdO, self.sdOt, self.sLSE,
            self.sDelta, self.sSeg, itertools.chain.from_iterable(self.sdS), self.sdS_xchg,
            itertools.chain.from_iterable(self.sdQ)))
        # TMEM: cells of 32 lanes × CELL columns (DQ_CELL in dQ's columns)
        dq = self.off["dq"]
        bounds = list(range(0, dq, CELL)) + list(range(dq, 512 + 1, DQ_CELL))
        regions = sorted((v, k) for k, v in self.off.items())
        self.tmem = []
        for q in range(4):
            row = []
            for lo, hi in itertools.pairwise(bounds):
                base, name = max(r for r in regions if r[0] <= lo)
                res = R(f"{p}.TMEM[{name}+{lo - base}:{hi - base}, lanes {32 * q}+]", tmem=True)
                res.tmem = self
                row.append((lo, hi, res))
            self.tmem.append(row)
        self._cells: dict = {}

    def link(self, peer: PairCta):
        self.peer = peer
        self.leader = self if self.rank == 0 else peer
        self.both = (self.leader, self.leader.peer)
        if self.rank:
            self.tensor_queue = self.leader.tensor_queue  # one pipe per pair

    def cells(self, quarters, lo: int, hi: int) -> list:
        key = (tuple(quarters), lo, hi)
        out = self._cells.get(key)
        if out is None:
            out = [res for q in quarters for a, b, res in self.tmem[q] if lo <= a and b <= hi]
            assert sum(b - a for q in quarters for a, b, _ in self.tmem[q]
                       if lo <= a and b <= hi) == (hi - lo) * len(quarters), key
            self._cells[key] = out
        return out

    ALL = (0, 1, 2, 3)

    def pair_cells(self, lo: int, hi: int, tag) -> list:
        """(cell, tag) of TMEM columns [lo, hi), all lanes, in both CTAs (a pair MMA operand)."""
        return [(r, tag) for c in self.both for r in c.cells(self.ALL, lo, hi)]

    def pair_pipe(self, name: str) -> PairTmaUmma:
        copies = 3 if name == "kv" else 1  # sK, sV, sKᵀ share the kv stage
        return PairTmaUmma([c.tma[name] for c in self.both], copies, self.mut)

    def commit(self, *names):
        targets = self.both[:1] if "no_multicast" in self.mut else self.both
        for name in names:
            yield ("commit2", tuple(getattr(c, name) for c in targets))

    # --- load warp (13) -----------------------------------------------------------------------
    def load_warp(self):
        """The docstring fixes no order of the per-block loads: ``load_order`` (Q before Qᵀ:
        the commit that frees Qᵀ_{j−1}'s stage follows Sᵀ_j, which needs Q_j). Serial: Qᵀ_j /
        dOᵀ_j through the q / do pipelines, the use after Q_j / dO_j (same PipelineState)."""
        cfg, r = self.cfg, self.rank
        lse = self.pipeline_lse
        if self.count > 0:
            kv = self.pair_pipe("kv")
            st = make_pipeline_state(True, 1)
            yield from kv.producer_acquire(st, r)
            bar = kv.producer_get_barrier(st)
            for res, tag in ((self.sK, ("K", self.n_block)), (self.sV, ("V", self.n_block)),
                             (self.sKt, ("Kt", self.pair, r))):
                yield ("tma_load_at", res, tag, bar, 0)
        bufs = {"q": self.sQ, "do": self.sdO, "qt": self.sQt, "dot": self.sdOt}
        pipes = {n: (self.pair_pipe(n), make_pipeline_state(True, len(bufs[n])))
                 for n in self.tma_names}
        if self.serial:  # one pipeline (and producer state) per buffer, two uses
            pipes["qt"], pipes["dot"] = pipes["q"], pipes["do"]
        lse_state = make_pipeline_state(True, cfg.lse_stages)
        for j in range(self.count):
            m = self.m_min + j
            for name in self.load_order:
                if name != "lse":
                    pl, st = pipes[name]
                    yield from pl.producer_acquire(st, r)
                    yield ("tma_load_at", bufs[name][st.index], (name, m, r),
                           pl.producer_get_barrier(st), st.count // st.stages)
                    st.advance()
                else:  # -lse_log2 / -delta of all 128 rows
                    yield from lse.producer_acquire(lse_state)
                    s = lse_state.index
                    staged = [(self.sLSE[s], ("lse", m), True),
                              (self.sDelta[s], ("delta", m), True)]
                    if cfg.segments:  # stage_stats: the rows' ids, the own block's flag
                        staged.append((self.sSeg[s], ("ids", m), True))
                    yield ("access", staged, f"sLSE / sDelta[:, {s}] of m={m}")
                    yield from lse.producer_commit(lse_state, WARP)
                    lse_state.advance()
        if "no_exit_drain" in self.mut:
            return
        # the kernel's drain: wait the last phase of every stage of the four (serial: two)
        # empty barriers (the last releases are commits nobody else waits for)
        for name in self.tma_names:
            pl, st = pipes[name]
            for _ in range(st.stages):
                yield ("wait", pl.per_cta[r].empty[st.index], st.phase,
                       st.count // st.stages - 1)
                st.advance()

    # --- MMA warp (12): the leader's issue order ----------------------------------------------
    def mma_warp(self):
        if self.serial:
            yield from self.mma_warp_serial()
            return
        cfg, off, D, mut = self.cfg, self.off, self.D, self.mut
        L, F = self.both
        pq, pqt, pdo, pdot = (self.pair_pipe(n) for n in ("q", "qt", "do", "dot"))
        sq, sqt = make_pipeline_state(False, cfg.q_stages), make_pipeline_state(False, cfg.q_stages)
        sdo, sdot = (make_pipeline_state(False, cfg.do_stages),
                     make_pipeline_state(False, cfg.do_stages))
        both = self.both
        n0, n1 = L.n_block, F.n_block

        def smem(attr, st, name, m_block):
            """The stage of a TMA operand in both CTAs, as each CTA's load warp tagged it."""
            return [(getattr(c, attr)[st.index], (name, m_block, c.rank)) for c in both]

        count = self.count
        if count > 0:
            kv = self.pair_pipe("kv")
            yield from kv.consumer_wait(make_pipeline_state(False, 1))
        for j in range(count + 1):
            m = self.m_min + j
            if j < count:
                yield from pq.consumer_wait(sq)
                if "early_release_q" in mut:
                    yield from pq.consumer_release(sq)
                yield ("mma", [(L.sK, ("K", n0)), (F.sK, ("K", n1))]
                       + smem("sQ", sq, "q", m),
                       self.pair_cells(off["s"], off["s"] + TILE, ("S", j)), f"S{j} = K·Q{j}ᵀ")
                yield from self.commit("s_full")
                if "early_release_q" not in mut:
                    yield from pq.consumer_release(sq)
                sq.advance()
            if j > 0:
                yield ("wait", L.ds_full, (j - 1) % 2, j - 1)
                yield from pqt.consumer_wait(sqt)
                if "early_release_qt" in mut:
                    yield from pqt.consumer_release(sqt)
                ds_t = [(r, t) for lo in (0, 64) for r, t in
                        self.pair_cells(off["dp"] + lo, off["dp"] + lo + 32, ("dSt", j - 1))]
                acc = self.pair_cells(off["dk"], off["dk"] + D, ("dK", j - 2)) if j > 1 else []
                yield ("mma", ds_t + smem("sQt", sqt, "qt", m - 1) + acc,
                       self.pair_cells(off["dk"], off["dk"] + D, ("dK", j - 1)),
                       f"dK += dSᵀ{j - 1}·Qᵀ")
                if "early_release_qt" not in mut:
                    yield from pqt.consumer_release(sqt)
                sqt.advance()
                if "no_relay" not in mut:
                    yield ("wait", L.xchg_leader, (j - 1) % 2, j - 1)
                sds = [(c.sdS[h][q], ("dS", j - 1, h, c.rank))
                       for c in both for h in range(2) for q in range(4)]
                yield ("mma", sds + [(L.sKt, ("Kt", self.pair, 0)),
                                     (F.sKt, ("Kt", self.pair, 1))],
                       self.pair_cells(off["dq"], off["dq"] + D // 2, ("dQ", j - 1)),
                       f"dQ{j - 1} = dS·K")
                yield from self.commit("dq_full", "ds_empty")
            if j < count:
                if j > 0 and "no_dq_empty_wait" not in mut:
                    yield ("wait", L.dq_empty, (j - 1) % 2, j - 1)
                yield from pdo.consumer_wait(sdo)
                if "early_release_do" in mut:
                    yield from pdo.consumer_release(sdo)
                yield ("mma", [(L.sV, ("V", n0)), (F.sV, ("V", n1))]
                       + smem("sdO", sdo, "do", m),
                       self.pair_cells(off["dp"], off["dp"] + TILE, ("dP", j)),
                       f"dP{j} = V·dO{j}ᵀ")
                yield from self.commit("dp_full")
                if "early_release_do" not in mut:
                    yield from pdo.consumer_release(sdo)
                sdo.advance()
                yield ("wait", L.p_full, j % 2, j)
                yield from pdot.consumer_wait(sdot)
                if "early_release_dot" in mut:
                    yield from pdot.consumer_release(sdot)
                p_t = [(r, t) for lo in (0, 64) for r, t in
                       self.pair_cells(off["s"] + lo, off["s"] + lo + 32, ("P", j))]
                acc = (self.pair_cells(off["dv"], off["dv"] + self.Dv, ("dV", j - 1)) if j > 0
                       else [])
                yield ("mma", p_t + smem("sdOt", sdot, "dot", m) + acc,
                       self.pair_cells(off["dv"], off["dv"] + self.Dv, ("dV", j)),
                       f"dV += P{j}ᵀ·dOᵀ")
                if "early_release_dot" not in mut:
                    yield from pdot.consumer_release(sdot)
                sdot.advance()
        if count > 0:
            yield from self.commit("dkv_full")

    def mma_warp_serial(self):
        """Serial layout (head dim 192): one iteration at a time, no skew. dPᵀ_j overwrites Sᵀ_j's
        upper half (after s_read_j), dQ_j dSᵀ_j's upper half (dK_j, issued before it, read it),
        Sᵀ_{j+1} dQ_j's columns [416, 448) (after dq_empty_j). Qᵀ_j / dOᵀ_j are the q / do
        pipelines' next use after Q_j / dO_j (same stage ring, consecutive states)."""
        cfg, off, D, Dv, mut = self.cfg, self.off, self.D, self.Dv, self.mut
        L, F = both = self.both
        pq, pdo = self.pair_pipe("q"), self.pair_pipe("do")
        sq = make_pipeline_state(False, cfg.q_stages)
        sdo = make_pipeline_state(False, cfg.do_stages)
        n0, n1 = L.n_block, F.n_block

        def smem(attr, st, name, m_block):
            return [(getattr(c, attr)[st.index], (name, m_block, c.rank)) for c in both]

        def operand(pl, st, early):
            """consumer_wait; the ``early`` mutation releases before the MMA is issued."""
            yield from pl.consumer_wait(st)
            if early in mut:
                yield from pl.consumer_release(st)

        def release(pl, st, early):
            if early not in mut:
                yield from pl.consumer_release(st)
            st.advance()

        count = self.count
        if count > 0:
            kv = self.pair_pipe("kv")
            yield from kv.consumer_wait(make_pipeline_state(False, 1))
        for j in range(count):
            m = self.m_min + j
            dq_wait = (j > 0 and not {"no_dq_empty_wait", "late_dq_empty_wait"} & mut,
                       j > 0 and "late_dq_empty_wait" in mut)
            if dq_wait[0]:  # dQ_{j−1} drained: Sᵀ_j overwrites its columns [416, 448)
                yield ("wait", L.dq_empty, (j - 1) % 2, j - 1)
            yield from operand(pq, sq, "early_release_q")  # Q_j
            yield ("mma", [(L.sK, ("K", n0)), (F.sK, ("K", n1))] + smem("sQ", sq, "q", m),
                   self.pair_cells(off["s"], off["s"] + TILE, ("S", j)), f"S{j} = K·Q{j}ᵀ")
            yield from self.commit("s_full")
            yield from release(pq, sq, "early_release_q")
            if dq_wait[1]:
                yield ("wait", L.dq_empty, (j - 1) % 2, j - 1)
            if "no_s_read_wait" not in mut:  # Sᵀ_j loaded: dPᵀ_j may overwrite its upper half
                yield ("wait", L.s_read, j % 2, j)
            yield from operand(pdo, sdo, "early_release_do")  # dO_j
            yield ("mma", [(L.sV, ("V", n0)), (F.sV, ("V", n1))] + smem("sdO", sdo, "do", m),
                   self.pair_cells(off["dp"], off["dp"] + TILE, ("dP", j)),
                   f"dP{j} = V·dO{j}ᵀ")
            yield from self.commit("dp_full")
            yield from release(pdo, sdo, "early_release_do")
            yield ("wait", L.p_full, j % 2, j)
            yield from operand(pdo, sdo, "early_release_dot")  # dOᵀ_j
            acc = self.pair_cells(off["dv"], off["dv"] + Dv, ("dV", j - 1)) if j > 0 else []
            yield ("mma", self.pair_cells(off["s"], off["s"] + 64, ("P", j))  # contiguous Pᵀ
                   + smem("sdOt", sdo, "dot", m) + acc,
                   self.pair_cells(off["dv"], off["dv"] + Dv, ("dV", j)), f"dV += P{j}ᵀ·dOᵀ")
            yield from release(pdo, sdo, "early_release_dot")
            yield ("wait", L.ds_full, j % 2, j)
            yield from operand(pq, sq, "early_release_qt")  # Qᵀ_j
            acc = self.pair_cells(off["dk"], off["dk"] + D, ("dK", j - 1)) if j > 0 else []
            yield ("mma", self.pair_cells(off["dp"], off["dp"] + 64, ("dSt", j))  # dSᵀ
                   + smem("sQt", sq, "qt", m) + acc,
                   self.pair_cells(off["dk"], off["dk"] + D, ("dK", j)), f"dK += dSᵀ{j}·Qᵀ")
            yield from release(pq, sq, "early_release_qt")
            if "no_relay" not in mut:
                yield ("wait", L.xchg_leader, j % 2, j)
            sds = [(c.sdS[h][q], ("dS", j, h, c.rank))
                   for c in both for h in range(2) for q in range(4)]
            yield ("mma", sds + [(L.sKt, ("Kt", self.pair, 0)), (F.sKt, ("Kt", self.pair, 1))],
                   self.pair_cells(off["dq"], off["dq"] + D // 2, ("dQ", j)), f"dQ{j} = dS·K")
            yield from self.commit("dq_full", "ds_empty")
        if count > 0:
            yield from self.commit("dkv_full")

    # --- compute warps (4-11) -----------------------------------------------------------------
    def compute_warps(self, wg: int, quarter: int):
        cfg, off, r = self.cfg, self.off, self.rank
        L = self.leader
        lse = self.pipeline_lse
        lane = (quarter,)
        lse_state = make_pipeline_state(False, cfg.lse_stages)
        serial, mut = self.serial, self.mut
        col = 64 * wg  # the warpgroup's query columns of Sᵀ / dPᵀ
        # 16-bit Pᵀ / dSᵀ: serial contiguous in the region's first 64 columns, else in the
        # warpgroup's own columns
        col16 = 32 * wg if serial else col
        for j in range(self.count):
            m = self.m_min + j
            yield from lse.consumer_wait(lse_state)
            s = lse_state.index
            yield ("wait", self.s_full, j % 2, j)
            stats = [(self.sLSE[s], ("lse", m), False)]
            if cfg.segments:  # softmax_p: the own block's mask flag and the rows' ids
                stats.append((self.sSeg[s], ("ids", m), False))
            yield ("access", [(c, ("S", j), False) for c in
                              self.cells(lane, off["s"] + col, off["s"] + col + 64)]
                   + stats, f"ld Sᵀ{j}; sLSE")
            if serial:
                yield ("arrive", L.s_read, 1)  # dPᵀ_j may overwrite Sᵀ_j's upper half
                if "no_p_barrier" not in mut:  # warpgroup 1's Pᵀ: Sᵀ columns [32, 64)
                    yield from self.compute_sync(wg, quarter)
            yield ("access", [(c, ("P", j), True) for c in
                              self.cells(lane, off["s"] + col16, off["s"] + col16 + 32)],
                   f"st Pᵀ{j}")
            yield ("arrive", L.p_full, 1)
            yield ("wait", self.dp_full, j % 2, j)
            reads = [(c, ("dP", j), False) for c in
                     self.cells(lane, off["dp"] + col, off["dp"] + col + 64)]
            reads.append((self.sDelta[s], ("delta", m), False))
            if cfg.has_softcap:
                reads.append((self.sLSE[s], ("lse", m), False))
            yield ("access", reads, f"ld dPᵀ{j}; sDelta")
            yield from lse.consumer_release(lse_state, WARP)
            lse_state.advance()
            if serial and "no_ds_barrier" not in mut:  # warpgroup 1's dSᵀ: dPᵀ columns [32, 64)
                yield from self.compute_sync(wg, quarter)
            yield ("access", [(c, ("dSt", j), True) for c in
                              self.cells(lane, off["dp"] + col16, off["dp"] + col16 + 32)],
                   f"st dSᵀ{j}")
            if j > 0 and not (wg != r and "xchg_no_ds_empty_wait" in self.mut):
                yield ("wait", self.ds_empty, (j - 1) % 2, j - 1)
            if wg == r:  # the own q-half: sdS half r
                yield ("access", [(self.sdS[r][quarter], ("dS", j, r, r), True)],
                       f"st dS{j} -> sdS half {r}")
            else:  # the peer's q-half: sdS_xchg, then to the peer's sdS half r
                tag = ("dS", j, r, wg)
                yield ("access", [(self.sdS_xchg[quarter], tag, True)], f"st dS{j} -> sdS_xchg")
                self.xchg_syncs[quarter] += 1
                yield ("bar_arrive", (self.id, "XCHG"))
                yield ("bar_wait", (self.id, "XCHG"), 4 * self.xchg_syncs[quarter])
                if quarter == 0:  # the sender thread
                    peer = self.peer
                    yield ("arrive_tx", peer.xchg_full, 1)
                    yield ("bulk_copy", list(self.sdS_xchg), list(peer.sdS[r]), tag,
                           peer.xchg_full, j)
            yield ("arrive", L.ds_full, 1)
        yield from self.epilogue(wg, quarter)

    def compute_sync(self, wg: int, quarter: int):
        """The serial layout's 256-thread named barrier of both compute warpgroups."""
        w = 4 * wg + quarter
        self.compute_syncs[w] += 1
        yield ("bar_arrive", (self.id, "COMPUTE"))
        yield ("bar_wait", (self.id, "COMPUTE"), N_COMPUTE_WARPS * self.compute_syncs[w])

    def epilogue(self, wg: int, quarter: int):
        off = self.off
        if self.count > 0:
            yield ("wait", self.dkv_full, 0, 0)
            for which, width in (("dv", self.Dv), ("dk", self.D)):
                base = off[which] + width // 2 * wg
                yield ("access", [(c, (which[0] + which[1].upper(), self.count - 1), False)
                                  for c in self.cells((quarter,), base, base + width // 2)],
                       f"ld {which}")
        if self.in_range:  # a CTA past seqlen_k skips its stores
            yield ("record", "dK / dV stored", self._record_store(wg, quarter))

    def _record_store(self, wg, quarter):
        def record():
            self.stored[wg, quarter] += 1
        return record

    _record_padding = BwdCta._record_padding  # (sim.padding_zeroed[head] += (id, wg, quarter))

    # --- relay warp (14) ----------------------------------------------------------------------
    def relay_warp(self):
        if "no_relay" in self.mut:
            return
        for j in range(self.count):
            yield ("wait", self.xchg_full, j % 2, j)
            yield ("arrive", self.leader.xchg_leader, 1)
        if self.count > 0 and "no_exit_drain" not in self.mut:  # the last ds_empty commit
            yield ("wait", self.ds_empty, (self.count - 1) % 2, self.count - 1)

    # --- dQ reduce warps (0-3) ----------------------------------------------------------------
    def reduce_sync(self, w: int):
        self.reduce_syncs[w] += 1
        yield ("bar_arrive", (self.id, "REDUCE"))
        yield ("bar_wait", (self.id, "REDUCE"), 4 * self.reduce_syncs[w])

    def reduce_warps(self, w: int):
        cfg, off, r = self.cfg, self.off, self.rank
        nc = cfg.dq_cols
        chunks = self.D // 2 // nc
        stage = 0
        for j in range(self.count):
            m = self.m_min + j
            # dq_semaphore[b, h, m, r]; the 64-row box (m, r) of dq_accum (varlen: the
            # sequence's tile dq_tile0 + m)
            slot = (self.batch, self.head, (self.dq_tile0 + m, r))
            yield ("wait", self.dq_full, j % 2, j)
            for c in range(chunks):
                lo = off["dq"] + c * nc
                yield ("access", [(x, ("dQ", j), False) for x in self.cells((w,), lo, lo + nc)],
                       f"ld dQ{j} chunk {c}")
                if c == chunks - 1:
                    yield ("arrive", self.leader.dq_empty, 1)
                if w == 0:
                    yield ("bulk_wait", cfg.dq_stages - 1, True)
                yield from self.reduce_sync(w)
                yield ("access", [(self.sdQ[stage][w], ("dQ", j, c), True)],
                       f"sdQ[{stage}] = dQ{j} chunk {c}")
                yield from self.reduce_sync(w)
                if w == 0:  # the elected thread
                    if cfg.deterministic and c == 0:
                        yield ("sem_wait", slot, self.turn(m))
                    boxes = [(self.sdQ[stage][0:2], slot + (c,)),
                             (self.sdQ[stage][2:4], slot + (chunks + c,))]
                    yield ("tma_reduce2", boxes, ("dQ", j, c), self.contrib)
                    if cfg.deterministic and c == chunks - 1:
                        yield ("bulk_wait", 0, False)
                        yield ("sem_add", slot)
                stage = (stage + 1) % cfg.dq_stages
        if w == 0:
            yield ("bulk_wait", 0, True)

    # --- kernel(): the warp-role dispatch -----------------------------------------------------
    def spawn(self):
        sim, p = self.sim, self.p
        cluster = ("cluster", self.leader.id)
        alloc, dealloc = (self.id, "TMEM_ALLOC"), (self.id, "TMEM_DEALLOC")
        mut = self.mut
        n_cluster = 2 * WARPS_PER_CTA

        def cluster_sync(k):  # barrier.cluster.arrive + wait, every warp of both CTAs
            yield ("bar_arrive", cluster)
            yield ("bar_wait", cluster, k * n_cluster)

        def start():
            if "no_cluster_sync" in mut:  # only the CTA's own threads synchronise
                yield ("bar_arrive", (self.id, "SYNC"))
                yield ("bar_wait", (self.id, "SYNC"), WARPS_PER_CTA)
            else:
                yield from cluster_sync(1)

        def role(gen, tmem=False, after=()):
            yield from start()
            if tmem:
                yield ("bar_arrive", alloc)  # wait_for_alloc
                yield ("bar_wait", alloc, TMEM_USERS)
            yield from gen
            if tmem:
                yield ("bar_arrive", dealloc)
                yield ("bar_wait", dealloc, TMEM_USERS)
            yield from after
            yield from cluster_sync(1 if "no_cluster_sync" in mut else 2)

        def zero_padding(wg, q):  # varlen: zero_padding_dkv, plain global stores, no barrier
            if self.zero_padding and self.rank == 0:
                yield ("record", "padding dK / dV zeroed", self._record_padding(wg, q))

        def mma_role():
            yield ("init",)
            yield from start()
            yield ("bar_arrive", ("tmem_alloc2", self.leader.id))  # cta_group::2 alloc
            yield ("bar_wait", ("tmem_alloc2", self.leader.id), 2)
            yield ("tmem_alloc",)
            yield ("bar_arrive", alloc)
            yield ("bar_wait", alloc, TMEM_USERS)
            if self.rank == 0:
                yield from self.mma_warp()
            yield ("bar_arrive", dealloc)
            yield ("bar_wait", dealloc, TMEM_USERS)
            yield ("arrive", self.peer.tmem_dealloc, WARP)  # the allocator's peer handshake
            yield ("wait", self.tmem_dealloc, 0, 0)
            yield ("tmem_free",)
            yield from cluster_sync(1 if "no_cluster_sync" in mut else 2)

        for w in range(N_REDUCE_WARPS):
            sim.spawn(f"{p}.reduce{w}", role(self.reduce_warps(w), True), self)
        for wg in range(2):
            for q in range(4):
                sim.spawn(f"{p}.compute{wg}.{q}",
                          role(self.compute_warps(wg, q), True, zero_padding(wg, q)), self)
        sim.spawn(f"{p}.mma", mma_role(), self)
        sim.spawn(f"{p}.load", role(self.load_warp()), self)
        sim.spawn(f"{p}.relay", role(self.relay_warp()), self)
        sim.spawn(f"{p}.idle", role(iter(())), self)

    # --- end of run ---------------------------------------------------------------------------
    def check_end(self):
        sim, c, cfg, p = self.sim, self.count, self.cfg, self.p
        lead = self.rank == 0
        compute = [f"{p}.compute{wg}.{q}" for wg in range(2) for q in range(4)]
        reduce = [f"{p}.reduce{w}" for w in range(4)]
        mma, load, relay = f"{p}.mma", f"{p}.load", f"{p}.relay"
        c1 = min(c, 1)
        drain = int("no_exit_drain" not in self.mut)  # the load / relay warps' exit waits

        def per_stage(stages, uses=c):
            return [len(range(i, uses, stages)) for i in range(stages)]

        # barrier -> (phases completed, {warp: waits}); leader-only barriers stay idle in the
        # follower
        want = {
            self.s_full: (c, dict.fromkeys(compute, c)),
            self.p_full: (c if lead else 0, {mma: c} if lead else {}),
            self.dp_full: (c, dict.fromkeys(compute, c)),
            self.ds_full: (c if lead else 0, {mma: c} if lead else {}),
            self.xchg_full: (c, {relay: c}),
            self.xchg_leader: (c if lead else 0, {mma: c} if lead else {}),
            self.ds_empty: (c, {**dict.fromkeys(compute, max(c - 1, 0)), relay: c1 * drain}),
            self.dq_full: (c, dict.fromkeys(reduce, c)),
            self.dq_empty: (c if lead else 0, {mma: max(c - 1, 0)} if lead else {}),
            self.dkv_full: (c1, dict.fromkeys(compute, c1)),
            self.tmem_dealloc: (1, {mma: 1}),
            self.tma["kv"].full[0]: (c1 if lead else 0, {mma: c1} if lead else {}),
            self.tma["kv"].empty[0]: (0, {load: c1}),
        }
        if self.serial:
            want[self.s_read] = (c if lead else 0, {mma: c} if lead else {})
        uses = 2 * c if self.serial else c  # serial: Q_j, Qᵀ_j (dO_j, dOᵀ_j) through one ring
        for name in self.tma_names:
            stages = cfg.q_stages if name in ("q", "qt") else cfg.do_stages
            pl = self.tma[name]
            for i, k in enumerate(per_stage(stages, uses)):
                want[pl.full[i]] = (k if lead else 0, {mma: k} if lead else {})
                want[pl.empty[i]] = (k, {load: k + drain})
        for i, k in enumerate(per_stage(cfg.lse_stages)):
            want[self.pipeline_lse.full[i]] = (k, dict.fromkeys(compute, k))
            want[self.pipeline_lse.empty[i]] = (k, {load: k})
        assert set(want) == set(self.bars)
        check_barrier_ends(sim, want)
        want_stored = {(wg, q): 1 for wg in range(2) for q in range(4)} if self.in_range else {}
        if dict(self.stored) != want_stored:
            sim.fail(f"CTA {self.id}: dK / dV stores {dict(self.stored)}")
        if not (self.retired and self.tmem_allocated and self.tmem_freed):
            sim.fail(f"CTA {self.id} did not finish")


# ---------------------------------------------------------------------------------------------
# A launch: the grid (key blocks rounded up to even, heads) of one (seqlen_q, seqlen_k, mask)
# ---------------------------------------------------------------------------------------------
def make_blocks(cfg: Sm100BwdConfig, seqlen_q, seqlen_k, wl, wr, tile_n) -> BwdBlocks:
    """kernel(): windows clamped as the kernel does (0 unless local; -1 or too wide = unbounded)."""
    window_left = window_right = 0
    if cfg.mask == "local":
        window_left = seqlen_k if wl < 0 or wl > seqlen_k else wl
        window_right = seqlen_q if wr < 0 or wr > seqlen_q else wr
    return BwdBlocks(TILE, tile_n, cfg.mask == "causal", cfg.mask == "local", seqlen_q,
                     seqlen_k, window_left, window_right)


def simulate(cfg: Sm100BwdConfig, seqlen_q: int, seqlen_k: int, heads: int, slots: int,
             seed: int, wl: int = -1, wr: int = -1, mut=(), in_order_commits: bool = True,
             load_order=None) -> PairSim:
    mut = frozenset(mut)
    assert mut <= set(MUTATIONS), mut
    sim = PairSim(random.Random(seed), slots, cfg.deterministic, in_order_commits)
    pairs = make_blocks(cfg, seqlen_q, seqlen_k, wl, wr, PAIR_TILE)  # ranges, ranks per pair
    own = make_blocks(cfg, seqlen_q, seqlen_k, wl, wr, TILE)
    n_blocks = -(-seqlen_k // TILE)
    n_pairs = -(-n_blocks // 2)  # grid x = n_blocks rounded up to even
    ranges = {p: pairs.m_block_range(p) for p in range(n_pairs)}
    ctas = []
    for h in range(heads):
        for p in range(n_pairs):  # cluster linear order
            cluster = []
            for r in range(2):
                n = 2 * p + r
                lo, hi = own.m_block_range(n) if "own_m_range" in mut else ranges[p]
                cluster.append(PairCta(sim, cfg, len(ctas) + r, p, r, h, lo, max(hi - lo, 0),
                                       n * TILE < seqlen_k,
                                       lambda m, p=p: pairs.dq_rank(m, p), mut,
                                       load_order))
            cluster[0].link(cluster[1])
            cluster[1].link(cluster[0])
            ctas += cluster
            sim.pending.append(cluster)
        for m in range(pairs.num_m_blocks()):
            for r in range(2):
                sim.visitors[0, h, (m, r)] = [p for p in range(n_pairs)
                                              if ranges[p][0] <= m < ranges[p][1]]
    what = (f"{cfg.describe()} seqlen_q={seqlen_q} seqlen_k={seqlen_k} window=({wl}, {wr}) "
            f"heads={heads} slots={slots} seed={seed} mut={sorted(mut)} "
            f"load_order={load_order or LOAD_ORDER} in_order_commits={in_order_commits}")
    run_checked(sim, cfg, ctas, what)
    return sim


def run_checked(sim: PairSim, cfg: Sm100BwdConfig, ctas: list, what: str, more=None):
    """Run the launch, then the end checks: every CTA's (check_end), each dq_accum element
    added once by each visiting pair (``sim.visitors``; in rank order when deterministic), the
    semaphores' final counts, and ``more()``; a failure names the launch (``what``)."""
    try:
        sim.run()
        for cta in ctas:
            cta.check_end()
        chunks = cfg.head_dim // cfg.dq_cols
        for key, ps in sim.visitors.items():
            for c in range(chunks):
                got = sim.dq_accum.get(key + (c,), [])
                if (got if cfg.deterministic else sorted(got)) != ps:
                    sim.fail(f"dq_accum{key + (c,)} got adds from pairs {got}, expected {ps}")
            if cfg.deterministic and sim.sems[key] != len(ps):
                sim.fail(f"dq_semaphore{key} ends at {sim.sems[key]}")
        if more is not None:
            more()
    except ProtocolError as e:
        raise ProtocolError(f"{what}: {e}") from None


def simulate_varlen(cfg: Sm100BwdConfig, lens: list[tuple[int, int]], heads: int, slots: int,
                    seed: int, wl: int = -1, wr: int = -1, order: str = "sequence",
                    in_order_commits: bool = True, mut=()) -> PairSim:
    """A varlen launch of the 2-CTA kernel (``cfg.varlen``): the work list the backend builds
    for it (jax_fa4.backends.sm90.work_table with 256 keys per item, launch ``order``) over
    sequences of (len_q, len_k) ``lens`` packed back to back, then 7 padding tokens; work row x
    is cluster x of each head (CTAs 2x + rank), both CTAs with the row's sequence lengths (their
    own BwdBlocks: the kernel's per-sequence windows), the pair's query-block range from the
    pair index p = work[x, 1] (tile_n 256), own key block 2p + rank (stores iff it holds keys
    of the sequence) and first dq_accum tile. Checks beyond :func:`simulate`'s: each 64-row box
    of a dq_accum tile gets the adds of exactly the pairs of its own sequence that visit it
    (tiles of two sequences never coincide), and per head exactly the 8 compute warps of the
    ZERO_PADDING pair's leader zero the padding rows; spare rows (lengths 0), pairs no query
    block sees, and pairs whose second CTA has no keys keep every barrier's protocol."""
    import jax.numpy as jnp
    import numpy as np

    from jax_fa4.kernels.sm100.bwd import ZERO_PADDING

    assert cfg.varlen and cfg.two_cta and cfg.work_tile_n == PAIR_TILE
    mut = frozenset(mut)
    assert mut <= set(MUTATIONS), mut
    sim = PairSim(random.Random(seed), slots, False, in_order_commits)
    cu_q, work = varlen_work(cfg.mask, lens, wl, wr, order, PAIR_TILE)
    ctas = []
    for h in range(heads):
        for x in range(work.shape[0]):  # cluster linear order: the pair fastest, then head
            seq, p, _, _, len_q, len_k, tile0, _ = (int(c) for c in work[x])
            ranges = [make_blocks(cfg, len_q, len_k, wl, wr, PAIR_TILE).m_block_range(p)] * 2
            if "own_m_range" in mut:
                own = make_blocks(cfg, len_q, len_k, wl, wr, TILE)
                ranges = [own.m_block_range(2 * p + r) for r in range(2)]
            cluster = [PairCta(sim, cfg, len(ctas) + r, p, r, h, lo, max(hi - lo, 0),
                               (2 * p + r) * TILE < len_k, None, mut, batch=0,
                               dq_tile0=tile0, contrib=(seq, p),
                               zero_padding=seq == ZERO_PADDING)
                       for r, (lo, hi) in enumerate(ranges)]
            cluster[0].link(cluster[1])
            cluster[1].link(cluster[0])
            ctas += cluster
            sim.pending.append(cluster)
    first = np.asarray(first_tiles(jnp.asarray(cu_q), TILE))
    for b, (len_q, len_k) in enumerate(lens):
        pairs = make_blocks(cfg, len_q, len_k, wl, wr, PAIR_TILE)
        ranges = {p: pairs.m_block_range(p) for p in range(-(-len_k // PAIR_TILE))}
        for h in range(heads):
            for m in range(pairs.num_m_blocks()):
                for r in range(2):
                    key = (0, h, (int(first[b]) + m, r))
                    assert key not in sim.visitors, f"dq_accum box {key} of two sequences"
                    sim.visitors[key] = [(b, p) for p, (lo, hi) in ranges.items()
                                         if lo <= m < hi]
    what = (f"{cfg.describe()} lens={lens} window=({wl}, {wr}) order={order} heads={heads} "
            f"slots={slots} seed={seed} in_order_commits={in_order_commits} "
            f"mut={sorted(mut)}")
    run_checked(sim, cfg, ctas, what, partial(padding_zeroed_once, sim, heads))
    # pairs with keys that run no iteration (no query block sees them), and CTAs without keys
    # of their sequence next to a peer with some
    sim.idle_pairs = sum(1 for c in ctas if c.rank == 0 and c.count == 0 and c.in_range)
    sim.keyless_followers = sum(1 for c in ctas if c.rank == 1 and not c.in_range
                                and c.peer.in_range)
    return sim


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------
MASKS = ("none", "causal", "local")
#: (mask, deterministic) of the random-schedule checks, the richest mask of each first: the quick
#: tier runs one per ``deterministic`` value (tests/compiled.py), ``--exhaustive`` all six.
SCHEDULES = per_class([(m, d) for m in ("local", "causal", "none") for d in (False, True)],
                      key=lambda case: case[1])
RUNS = 12  # per (mask, deterministic) case


def make_cfg(mask="none", deterministic=False, softcap=False, **over) -> Sm100BwdConfig:
    cfg = Sm100BwdConfig.make("bfloat16", 128, 128, mask, softcap, deterministic=deterministic,
                              **over)
    assert cfg.two_cta
    return cfg


#: (dq_cols, dq_stages) within the shared memory limit (8 columns: the shipped tuning)
DQ_TUNINGS = ((8, 1), (8, 2), (8, 3), (8, 4), (16, 1), (16, 2), (32, 1))


def random_case(rng: random.Random, mask: str, deterministic: bool):
    dq_cols, dq_stages = rng.choice(DQ_TUNINGS)
    cfg = make_cfg(mask, deterministic, rng.random() < 0.3, dq_cols=dq_cols,
                   dq_stages=dq_stages)
    seqlen_q = rng.choice((rng.randint(1, 3 * TILE), rng.choice((TILE, 2 * TILE, 3 * TILE))))
    seqlen_k = rng.choice((rng.randint(1, 4 * TILE), rng.choice((TILE, 3 * TILE, 4 * TILE))))
    wl = rng.choice((-1, 0, rng.randint(0, 300)))
    wr = rng.choice((-1, 0, rng.randint(0, 300)))
    heads = rng.choice((1, 1, 2))
    n_ctas = heads * 2 * -(-seqlen_k // PAIR_TILE)
    slots = rng.choice((2, 3, 4, n_ctas))
    return cfg, seqlen_q, seqlen_k, heads, slots, wl, wr, rng.choice(LOAD_ORDERS)


def wait_sites(deterministic: bool) -> set:
    """Every (role, wait) the schedules must have found blocked. Not in the set: kv.empty (one
    stage, acquired once: passes phase −1), qt.full and dot.full (Qᵀ_j / dOᵀ_j are loaded an
    iteration's compute ahead of dK_j / dV_j: they block only when a load lags that far, about
    one run in 40 for dOᵀ, not seen for Qᵀ), ds_empty (the compute warps wait for it after
    dp_full_j, whose commit follows dQ_{j−1}'s: with commit arrivals in issue order it cannot
    block), lse.empty (the lse stage of block j + 2 is acquired after the load warp's q stage of
    j + 2, released by the commit after Sᵀ_{j+2}, issued after ds_full_{j+1}, which follows
    every compute warp's lse release of block j)."""
    sites = {("load", "q.empty"), ("load", "qt.empty"), ("load", "do.empty"),
             ("load", "dot.empty"),
             ("mma", "kv.full"), ("mma", "q.full"), ("mma", "do.full"), ("mma", "ds_full"),
             ("mma", "xchg_leader"),
             ("mma", "dq_empty"), ("mma", "p_full"), ("mma", "tmem_dealloc"),
             ("mma", "bar.TMEM_DEALLOC"),
             ("compute", "lse.full"), ("compute", "s_full"), ("compute", "dp_full"),
             ("compute", "dkv_full"), ("compute", "bar.TMEM_ALLOC"), ("compute", "bar.XCHG"),
             ("relay", "xchg_full"),
             ("reduce", "dq_full"), ("reduce", "bar.REDUCE"), ("reduce", "bulk_wait.read")}
    if deterministic:
        sites |= {("reduce", "dq_semaphore"), ("reduce", "bulk_wait.all")}
    return sites


@pytest.mark.parametrize("mask, deterministic", SCHEDULES, ids=lambda c: str(c))
def test_protocol_random_schedules(mask, deterministic):
    """Random grids (odd lengths, a CTA past seqlen_k, windows, 1-2 heads, one cluster up to the
    whole grid resident) under random schedules: no deadlock, parity alias, arrival overrun,
    data hazard, early exit or use of an uninitialised barrier; every dQ element added once per
    visiting pair (in rank order when deterministic); and, over the runs of the case, every wait
    that can block was found blocked at least once."""
    rng = random.Random(f"2cta-{mask}-{deterministic}")
    blocked = set()
    for _ in range(RUNS):
        cfg, sq, sk, heads, slots, wl, wr, order = random_case(rng, mask, deterministic)
        blocked |= simulate(cfg, sq, sk, heads, slots, rng.getrandbits(32), wl, wr,
                            load_order=order).blocked
    missing = wait_sites(deterministic) - blocked
    assert not missing, missing


def test_protocol_long_sequence():
    """Several query blocks per pair (every stage ring wraps, the dQ staging too), causal with a
    fully masked block for rank 1, one key block past seqlen_k."""
    for seed in range(3):
        simulate(make_cfg("causal", dq_cols=8, dq_stages=1), 5 * TILE - 3, 3 * TILE - 5, 1, 2,
                 seed)


def test_deterministic_many_clusters_concurrently():
    """Deterministic dQ order with every cluster of two heads resident at once (the spins
    really interleave): adds per (query block, row half) in pair-rank order, no deadlock."""
    cfg = make_cfg("none", deterministic=True, dq_cols=32, dq_stages=1)
    sim = simulate(cfg, 2 * TILE, 6 * TILE, 2, 12, 0)
    assert ("reduce", "dq_semaphore") in sim.blocked
    simulate(make_cfg("local", deterministic=True, dq_cols=16), 3 * TILE + 5, 6 * TILE - 7, 1,
             6, 1, wl=150, wr=40)


def test_pair_m_range_and_rank_cover_both_ctas():
    """Block arithmetic: the pair's query-block range (tile_n 256 on the pair index) contains the
    range of each of its CTAs (a CTA never misses a block it has keys for), and dq_rank on pairs
    is the pair's index among the pairs visiting m."""
    rng = random.Random(7)
    for _ in range(400):
        mask = rng.choice(MASKS)
        cfg = make_cfg(mask)
        sq, sk = rng.randint(1, 1000), rng.randint(1, 1000)
        wl, wr = rng.choice((-1, rng.randint(0, 400))), rng.choice((-1, rng.randint(0, 400)))
        pairs = make_blocks(cfg, sq, sk, wl, wr, PAIR_TILE)
        own = make_blocks(cfg, sq, sk, wl, wr, TILE)
        n_pairs = -(-sk // PAIR_TILE)
        for p in range(n_pairs):
            lo, hi = pairs.m_block_range(p)
            for n in (2 * p, 2 * p + 1):
                a, b = own.m_block_range(n)
                if n * TILE < sk and a < b:
                    assert lo <= a and b <= hi, (mask, sq, sk, wl, wr, p, n)
        for m in range(pairs.num_m_blocks()):
            vis = [p for p in range(n_pairs)
                   if pairs.m_block_range(p)[0] <= m < pairs.m_block_range(p)[1]]
            assert vis == list(range(vis[0], vis[0] + len(vis))) if vis else True
            for k, p in enumerate(vis):
                assert pairs.dq_rank(m, p) == k, (mask, sq, sk, wl, wr, m, p)


@pytest.mark.parametrize("serial, seeds", [(False, 4), (True, 2)], ids=("d128", "serial"))
def test_reordered_commit_arrivals(serial, seeds):
    """With commit arrivals onto different barriers in any order (instead of the pipe's issue
    order), the protocol still runs without deadlock, alias or hazard, up to the exit (see
    test_exit_with_lagging_commit_arrivals)."""
    cfg = (make_serial_cfg if serial else make_cfg)("causal", True)
    for seed in range(seeds):
        try:
            simulate(cfg, 3 * TILE, 4 * TILE, 1, 4, seed, in_order_commits=False)
        except ProtocolError as e:
            assert "exits while a commit" in str(e), e


class LaggingCommitSim(PairSim):
    """Commit arrivals onto the empty barriers (q / qt / do / dot.empty, ds_empty) lag far
    behind the others (allowed when commit arrivals may reorder)."""

    def commit_weight(self, bars) -> float:
        return self.weights["commit"] * (1e-4 if "empty" in bars[0].family else 1)


@pytest.mark.parametrize("serial, seeds", [(False, 10), (True, 5)], ids=("d128", "serial"))
def test_exit_with_lagging_commit_arrivals(monkeypatch, serial, seeds):
    """Commit arrivals out of issue order, the empty barriers' far behind: the kernel's exit
    drain (the load warp waits the last phase of its TMA pipelines' empty barriers: q / qt / do /
    dot, serial: q / do, each released twice per iteration; the relay warp the last ds_empty)
    keeps every CTA alive until the last commit reached it. Without the drain a CTA exits while
    a trailing multicast commit may still arrive on its barriers."""
    import test_sm100_bwd_2cta_protocol as this

    monkeypatch.setattr(this, "PairSim", LaggingCommitSim)
    cfg = (make_serial_cfg if serial else make_cfg)("causal")
    for seed in range(seeds):
        simulate(cfg, 2 * TILE, 2 * TILE, 1, 2, seed, in_order_commits=False)
    failed = 0
    for seed in range(seeds):
        try:
            simulate(cfg, 2 * TILE, 2 * TILE, 1, 2, seed, in_order_commits=False,
                     mut=frozenset({"no_exit_drain"}))
        except ProtocolError as e:
            assert "exits while a commit" in str(e), e
            failed += 1
    assert failed > 0


# --- mutations: each removed protocol element makes the model fail ----------------------------
def fails(mut, cfg=None, sq=2 * TILE, sk=2 * TILE, heads=1, slots=2, seeds=range(12),
          match=None, **kw):
    """The mutated protocol fails on some schedule for a reason matching ``match`` (other
    failures, e.g. the end checks' barrier counts, are passed over)."""
    cfg = cfg or make_cfg("none")
    other = None
    for seed in seeds:
        try:
            simulate(cfg, sq, sk, heads, slots, seed, mut=[mut], **kw)
        except ProtocolError as e:
            if match is None or any(s in str(e) for s in match):
                return str(e)
            other = other or e
    raise AssertionError(f"mutation {mut} was not caught as {match}; other failure: {other}")


def test_mutation_tx_not_doubled():
    """The leader expects only its own bytes: the phase completes on one CTA's copies, the
    other's land in the next phase (or the MMA reads a buffer still being written)."""
    fails("tx_single", match=("land in phase", "while an in-flight tma", "expecting"))


def test_mutation_commit_without_multicast():
    """Commits arrive only on the leader's barriers: the follower's waits never pass."""
    fails("no_multicast", match=("deadlock",))


def test_mutation_missing_relay():
    """dQ_j does not wait for the exchanged dS halves to have landed (no relay): the dQ MMA
    reads an sdS half that the DSMEM copy still writes, or a stale one."""
    fails("no_relay", sq=3 * TILE, match=("dsmem", "expecting"))


def test_mutation_m_range_not_pair_uniform():
    """Each CTA computes its own 128-key query-block range: under causal the CTAs of a pair run
    different iteration counts."""
    fails("own_m_range", cfg=make_cfg("causal"), match=("deadlock", "phases completed",
                                                          "expecting", "too many arrivals"))


def test_mutation_missing_dq_empty_wait():
    """dPᵀ_{j+1} overwrites dQ_j's TMEM columns while the reduce warps still drain them."""
    fails("no_dq_empty_wait", sq=3 * TILE, match=("TMEM[dq", "expecting ('dQ'"))


def test_mutation_no_cluster_sync_after_init():
    """Without the cluster barrier after barrier init (a CTA-local barrier instead), the
    follower's TMA transactions (or remote arrives) reach the leader's barriers before the
    leader, started later, initialised them."""
    fails("no_cluster_sync", sq=TILE, sk=TILE, seeds=range(80), match=("before CTA",))


def test_mutation_xchg_buffer_reused_before_copy_landed():
    """The sending warpgroup writes sdS_xchg without waiting ds_empty_{j−1}. Caught only by the
    end checks (ds_empty waited by 4 of the 8 compute warps), never as a hazard: in the leader's
    MMA order the wait is redundant. The sender writes sdS_xchg_j after dp_full_j, whose commit
    follows dQ_{j−1}, issued after xchg_leader_{j−1}, i.e. after both copies of j − 1 landed
    (with commit arrivals in any order too: a commit waits for every earlier MMA). The same
    holds for the own sdS half. It guards an MMA order issuing dPᵀ_j before dQ_{j−1} (FA4's)."""
    err = fails("xchg_no_ds_empty_wait", sq=4 * TILE, seeds=range(6), match=("waits",))
    assert "ds_empty" in err, err


@pytest.mark.parametrize("which", ("q", "qt", "do", "dot"))
def test_mutation_operand_released_before_its_mma(which):
    """The commit releasing sQ / sQᵀ / sdO / sdOᵀ issued before the MMA that reads it: the load
    warp's next TMA overwrites the stage while the MMA reads it."""
    # the dOᵀ_{j+1} load right after dO_{j+1}: with Qᵀ_{j+1} in between (LOAD_ORDER), the
    # load waits the commit after dK_j, which follows dV_j, and the early release goes unseen
    order = ("q", "lse", "do", "dot", "qt") if which == "dot" else None
    fails(f"early_release_{which}", sq=3 * TILE, match=("while an in-flight", "expecting"),
          load_order=order)


def test_load_order_q_before_qt():
    """The load warp must issue Q_j before Qᵀ_j (the docstring leaves the order open): Qᵀ_j's
    stage is freed by the commit after dK_{j−1}, which the leader issues after Sᵀ_j, which
    waits for Q_j: every schedule deadlocks once the pair visits two query blocks."""
    cfg = make_cfg("none")
    with pytest.raises(ProtocolError, match="deadlock"):
        simulate(cfg, 2 * TILE, 2 * TILE, 1, 2, 0, load_order=("qt", "q", "lse", "do", "dot"))
    simulate(cfg, 2 * TILE, 2 * TILE, 1, 2, 0, load_order=("q", "qt", "lse", "do", "dot"))


# --- head dim 192 / Dv 128: the serial layout ---------------------------------------------------
def make_serial_cfg(mask="none", deterministic=False, softcap=False, **over) -> Sm100BwdConfig:
    cfg = Sm100BwdConfig.make("bfloat16", 192, 128, mask, softcap, deterministic=deterministic,
                              **over)
    assert cfg.two_cta and cfg.serial
    return cfg


def _serial_dq_tunings() -> tuple:
    """(dq_cols, dq_stages) the serial config accepts (dq_cols divides D/2 = 96, shared memory)."""
    out = []
    for dq_cols, dq_stages in itertools.product((8, 16, 32), (1, 2, 3, 4)):
        try:
            make_serial_cfg(dq_cols=dq_cols, dq_stages=dq_stages)
        except ValueError:
            continue
        out.append((dq_cols, dq_stages))
    return tuple(out)


SERIAL_DQ_TUNINGS = _serial_dq_tunings()
SERIAL_RUNS = 6  # per (mask, deterministic) case


def serial_random_case(rng: random.Random, mask: str, deterministic: bool):
    dq_cols, dq_stages = rng.choice(SERIAL_DQ_TUNINGS)
    cfg = make_serial_cfg(mask, deterministic, rng.random() < 0.3, dq_cols=dq_cols,
                          dq_stages=dq_stages)
    _, seqlen_q, seqlen_k, heads, slots, wl, wr, _ = random_case(rng, mask, deterministic)
    return cfg, seqlen_q, seqlen_k, heads, slots, wl, wr, rng.choice(SERIAL_LOAD_ORDERS)


def serial_wait_sites(deterministic: bool) -> set:
    """As wait_sites, for the serial layout: no qt / dot pipelines; s_read (the leader) and the
    COMPUTE named barrier added."""
    sites = wait_sites(deterministic) - {("load", "qt.empty"), ("load", "dot.empty")}
    return sites | {("mma", "s_read"), ("compute", "bar.COMPUTE")}


def test_serial_config():
    """The config the serial model runs: head dim 192 / Dv 128, 2-CTA, the docstring's TMEM map
    (dV, dK, Sᵀ, dPᵀ over Sᵀ's upper half, the folded dQ at dPᵀ's columns [32, 128)), one q and
    one do stage, and the dQ tunings that fit shared memory."""
    cfg = make_serial_cfg()
    assert cfg.tmem_offsets() == {"dv": 0, "dk": 128, "s": 320, "dp": 384, "dq": 416}
    assert cfg.tmem_columns() == 512 and (cfg.q_stages, cfg.do_stages) == (1, 1)
    assert (cfg.dq_cols, cfg.dq_stages) in SERIAL_DQ_TUNINGS and (8, 1) in SERIAL_DQ_TUNINGS
    assert not make_cfg().serial
    cta = PairCta(PairSim(random.Random(0), 2, False), cfg, 0, 0, 0, 0, 0, 1, True,
                  lambda m: 0, frozenset())
    assert set(cta.tma) == {"kv", "q", "do"} and cta.sQt is cta.sQ and cta.sdOt is cta.sdO


@pytest.mark.parametrize("mask, deterministic", SCHEDULES, ids=lambda c: str(c))
def test_serial_protocol_random_schedules(mask, deterministic):
    """test_protocol_random_schedules for head dim 192 (the serial layout and MMA order), over
    the dq_cols / dq_stages pairs that fit shared memory and the load orders that run."""
    rng = random.Random(f"2cta-serial-{mask}-{deterministic}")
    blocked = set()
    for _ in range(SERIAL_RUNS):
        cfg, sq, sk, heads, slots, wl, wr, order = serial_random_case(rng, mask, deterministic)
        blocked |= simulate(cfg, sq, sk, heads, slots, rng.getrandbits(32), wl, wr,
                            load_order=order).blocked
    missing = serial_wait_sites(deterministic) - blocked
    assert not missing, missing


def test_serial_protocol_long_sequence():
    """Serial layout, several query blocks per pair (the q / do stages wrap 2 × count times,
    the dQ staging too), causal, one key block past seqlen_k."""
    simulate(make_serial_cfg("causal", dq_cols=16, dq_stages=1), 5 * TILE - 3, 3 * TILE - 5,
             1, 2, 0)


def test_serial_load_order_dot_after_q_and_lse():
    """Serial layout: the load warp must issue dOᵀ_j after Q_j and lse_j. dOᵀ_j's stage is freed
    by the commit after dPᵀ_j, which the leader issues after s_read_j: the compute warps load
    Sᵀ_j (which needs Q_j) after waiting lse_j. The kernel's order Q, dO, lse, Qᵀ, dOᵀ runs."""
    cfg = make_serial_cfg()
    for order in (("q", "do", "dot", "lse", "qt"), ("do", "lse", "dot", "q", "qt")):
        assert order not in SERIAL_LOAD_ORDERS
        with pytest.raises(ProtocolError, match="deadlock"):
            simulate(cfg, 2 * TILE, 2 * TILE, 1, 2, 0, load_order=order)
    assert SERIAL_LOAD_ORDER in SERIAL_LOAD_ORDERS
    simulate(cfg, 2 * TILE, 2 * TILE, 1, 2, 0, load_order=SERIAL_LOAD_ORDER)


def test_serial_mutation_missing_s_read_wait():
    """The leader issues dPᵀ_j without waiting s_read_j: dPᵀ_j overwrites Sᵀ_j's upper half
    (columns [64, 128) = dPᵀ's [0, 64)) before warpgroup 1 loaded it."""
    err = fails("no_s_read_wait", cfg=make_serial_cfg(), match=("expecting ('S'",
                                                                  "in-flight tensor write"))
    assert "compute1" in err and "TMEM[dp+" in err, err


def test_serial_mutation_missing_p_barrier():
    """No named barrier before the Pᵀ stores: warpgroup 1's Pᵀ_j (Sᵀ columns [32, 64))
    overwrites Sᵀ_j columns that warpgroup 0 has not loaded yet."""
    err = fails("no_p_barrier", cfg=make_serial_cfg(), match=("expecting ('S'",))
    assert "compute0" in err and "TMEM[s+32:64" in err and "holds ('P'" in err, err


def test_serial_mutation_missing_ds_barrier():
    """No named barrier before the dSᵀ stores: warpgroup 1's dSᵀ_j (dPᵀ columns [32, 64))
    overwrites dPᵀ_j columns that warpgroup 0 has not loaded yet."""
    err = fails("no_ds_barrier", cfg=make_serial_cfg(), match=("expecting ('dP'",))
    assert "compute0" in err and "holds ('dSt'" in err, err


@pytest.mark.parametrize("mut", ("late_dq_empty_wait", "no_dq_empty_wait"))
def test_serial_mutation_dq_empty_wait(mut):
    """dq_empty_{j−1} waited only after Sᵀ_j (before dPᵀ_j), or not at all: Sᵀ_j overwrites
    dQ_{j−1}'s columns [416, 448) while the reduce warps still drain them."""
    err = fails(mut, cfg=make_serial_cfg(), sq=3 * TILE, match=("TMEM[dq", "expecting ('dQ'"))
    assert "reduce" in err or "tensor" in err, err


@pytest.mark.parametrize("which", ("q", "qt", "do", "dot"))
def test_serial_mutation_operand_released_before_its_mma(which):
    """Serial layout: a release of the q / do stage issued before the MMA reading it (q: Sᵀ_j's
    Q_j, qt: dK_j's Qᵀ_j, do: dPᵀ_j's dO_j, dot: dV_j's dOᵀ_j): the load warp's next TMA into
    the buffer (Qᵀ_j, Q_{j+1}, dOᵀ_j, dO_{j+1}) overwrites it while the MMA reads it."""
    # dO_{j+1} loaded before Q_{j+1}: with the kernel's order, dO_{j+1} follows Q_{j+1}, whose
    # load waits the commit after dK_j (after dV_j), and the early release goes unseen
    order = ("do", "q", "lse", "qt", "dot") if which == "dot" else None
    fails(f"early_release_{which}", cfg=make_serial_cfg(), sq=3 * TILE,
          match=("while an in-flight", "expecting"), load_order=order)


@pytest.mark.parametrize("mut, match, kw", [
    ("tx_single", ("land in phase", "while an in-flight tma", "expecting"), {}),
    ("no_multicast", ("deadlock",), {}),
    # dQ_j follows dK_j here: the copy has mostly landed, few schedules show the race
    ("no_relay", ("dsmem", "expecting"), {"seeds": range(12, 40)}),
    ("own_m_range", ("deadlock", "phases completed", "expecting", "too many arrivals"),
     {"mask": "causal"}),
    ("xchg_no_ds_empty_wait", ("ds_empty(",), {"sq": 3 * TILE, "seeds": range(4)}),
], ids=("tx_single", "no_multicast", "no_relay", "own_m_range", "xchg_no_ds_empty_wait"))
def test_serial_mutations_shared_with_d128(mut, match, kw):
    """The head-dim-128 mutations of elements the serial layout shares (2-CTA TMA bytes,
    multicast commits, the relay, the pair-uniform query-block range; the ds_empty wait,
    redundant here too: caught only by the end checks)."""
    kw = dict(kw)
    fails(mut, cfg=make_serial_cfg(kw.pop("mask", "none")), match=match, **kw)


# ---------------------------------------------------------------------------------------------
# Varlen (the 2-CTA kernel's varlen mode: bwd_config.varlen_config at 192/128)
# ---------------------------------------------------------------------------------------------
def varlen_cfg(d: int, mask: str, softcap: bool = False, gqa: bool = False,
               **over) -> Sm100BwdConfig:
    """A 2-CTA varlen config: 192/128 (the shipped varlen_config, the serial layout) or 128 (the
    head-dim-128 layout in its varlen mode, which the kernel builds but nothing ships)."""
    if d == 192 and not over:
        cfg = varlen_config("bfloat16", 192, 128, mask, softcap, gqa)
    else:
        cfg = Sm100BwdConfig.make("bfloat16", d, 128, mask, softcap, gqa, varlen=True, **over)
    assert cfg.two_cta and cfg.varlen and cfg.serial == (d == 192)
    return cfg


def random_varlen_lens(rng: random.Random) -> list[tuple[int, int]]:
    """1-4 sequences: lengths 0, 1, odd ones, whole blocks; key lengths up to 5 blocks, among
    them pair spans whose second CTA has no keys (len_k mod 256 in [1, 128])."""
    def len_q():
        return rng.choice((0, 1, rng.randint(1, 3 * TILE), rng.choice((TILE, 2 * TILE))))

    def len_k():
        return rng.choice((0, 1, rng.randint(1, 5 * TILE), rng.choice((PAIR_TILE, 3 * TILE)),
                           PAIR_TILE * rng.randint(0, 1) + rng.randint(1, TILE)))
    return [(len_q(), len_k()) for _ in range(rng.randint(1, 4))]


VARLEN_RUNS = 10  # per mask


@pytest.mark.parametrize("mask", per_class(["local", "causal", "none"], key=lambda m: 0))
def test_varlen_protocol_random_schedules(mask):
    """Random packed batches (empty sequences, sequences without keys or without queries, odd
    lengths, pairs whose second CTA has no keys, random windows), both launch orders, the
    serial layout (192/128, shipped) and the head-dim-128 one, random dQ tunings, softcap, GQA:
    no deadlock, parity alias, arrival overrun, hazard or early exit; every dQ contribution
    added once into its own sequence's tile box; the padding rows zeroed once per head; and
    among the runs pairs no query block sees and CTAs without keys next to a peer with some."""
    rng = random.Random(f"2cta-varlen-{mask}")
    idle = keyless = 0
    for _ in range(VARLEN_RUNS):
        serial = rng.random() < 0.7
        dq_cols, dq_stages = rng.choice(SERIAL_DQ_TUNINGS if serial else DQ_TUNINGS)
        cfg = varlen_cfg(192 if serial else 128, mask, rng.random() < 0.3, rng.random() < 0.3,
                         dq_cols=dq_cols, dq_stages=dq_stages)
        heads = rng.choice((1, 1, 2))
        slots = rng.choice((2, 4, 6, 200))
        wl = rng.choice((-1, 0, rng.randint(0, 300)))
        wr = rng.choice((-1, 0, rng.randint(0, 300)))
        sim = simulate_varlen(cfg, random_varlen_lens(rng), heads, slots, rng.getrandbits(32),
                              wl, wr, rng.choice(("sequence", "heavy_first")))
        idle += sim.idle_pairs
        keyless += sim.keyless_followers
    assert idle > 0 and keyless > 0, (idle, keyless)


#: per head: pairs whose second CTA has no keys (300, 100 and 633 keys: spans 256-511, 0-255,
#: 512-767), and pairs no query block sees (the sequence without queries; under the window
#: (10, 0) the first pair of the 633-key sequence, whose 259 queries see keys 364 on)
VARLEN_EDGE_LENS = [(TILE, 300), (0, 2 * TILE), (0, 0), (5, 0), (3 * TILE - 1, 100),
                    (2 * TILE + 3, 5 * TILE - 7)]


#: (slots, launch order) of the edge grid; the quick tier runs two of the four (each order and
#: each residency once, the first also with reordered commit arrivals) and only the shipped
#: (serial, 192/128) layout, ``--exhaustive`` all
EDGE_RUNS = per_class([(2, "sequence"), (200, "heavy_first"), (2, "heavy_first"),
                       (200, "sequence")], key=lambda run: run[1])


@pytest.mark.parametrize("serial", per_class([True, False], key=lambda serial: 0),
                         ids=lambda serial: "serial" if serial else "d128")
def test_varlen_protocol_edge_sequences(serial):
    """Pairs whose second CTA has no keys, a sequence without queries, an empty one, one
    without keys, a local window leaving a pair unseen; two heads, every cluster resident and
    one at a time, both launch orders, commit arrivals in issue order and reordered (then at
    most a CTA exiting under a lagging commit, as for dense grids): the idle and keyless CTAs
    keep the protocol next to busy ones."""
    cfg = varlen_cfg(192 if serial else 128, "local")
    for seed, (slots, order) in enumerate(EDGE_RUNS):
        sim = simulate_varlen(cfg, VARLEN_EDGE_LENS, 2, slots, seed, wl=10, wr=0, order=order)
        assert sim.keyless_followers == 2 * 3 and sim.idle_pairs == 2 * 2, (
            sim.keyless_followers, sim.idle_pairs)
        if seed and not compiled.EXHAUSTIVE:
            continue  # the quick tier reorders the commit arrivals of the first grid only
        try:
            simulate_varlen(cfg, VARLEN_EDGE_LENS, 2, slots, seed, wl=10, wr=0, order=order,
                            in_order_commits=False)
        except ProtocolError as e:
            assert "exits while a commit" in str(e), e


def test_varlen_mutation_m_range_not_pair_uniform():
    """In the varlen mode too the pair's CTAs must walk the range of the pair's 256-key span:
    with each CTA's own 128-key range (causal, a sequence whose pair's CTAs see different
    query blocks) the pair deadlocks or miscounts."""
    lens = [(3 * TILE, 2 * TILE), (TILE + 9, 300)]
    cfg = varlen_cfg(192, "causal")
    for seed in range(3):
        simulate_varlen(cfg, lens, 1, 4, seed)
    with pytest.raises(ProtocolError, match="deadlock|phases completed|expecting|too many"):
        simulate_varlen(cfg, lens, 1, 4, 0, mut={"own_m_range"})



# ---------------------------------------------------------------------------------------------
# Segment ids (the 2-CTA kernel's segment-id mode: bwd_config.segments_config at 192/128)
# ---------------------------------------------------------------------------------------------
#: the kernel's lo of an empty range (pair_segment_range): above every query block
NO_BLOCK = 2**31 - 1


def pair_segment_range(keys, batch: int, pair: int) -> tuple[int, int]:
    """bwd_2cta.pair_segment_range: the envelope of key blocks 2p and 2p + 1's [m_lo, m_hi) of
    the seg_keys table (an empty one ignored; a block past the table's last has none)."""
    from jax_fa4.kernels.segments_config import SEG_KEY_M_HI, SEG_KEY_M_LO

    found = [(int(keys[batch, n, SEG_KEY_M_LO]), int(keys[batch, n, SEG_KEY_M_HI]))
             for n in (2 * pair, 2 * pair + 1) if n < keys.shape[1]]
    found = [(lo, hi) for lo, hi in found if hi > lo]
    if not found:
        return NO_BLOCK, 0
    return min(lo for lo, _ in found), max(hi for _, hi in found)


def block_segment_range(keys, batch: int, n: int) -> tuple[int, int]:
    """Key block n's own [m_lo, m_hi) of the seg_keys table ((0, 0) past its last block)."""
    from jax_fa4.kernels.segments_config import SEG_KEY_M_HI, SEG_KEY_M_LO

    if n >= keys.shape[1]:
        return 0, 0
    return int(keys[batch, n, SEG_KEY_M_LO]), int(keys[batch, n, SEG_KEY_M_HI])


def simulate_segments(cfg: Sm100BwdConfig, q_ids, kv_ids, heads: int, slots: int, seed: int,
                      wl: int = -1, wr: int = -1, mut=()) -> PairSim:
    """A launch of the 2-CTA kernel with segment ids (``cfg.segments``): the dense grid of
    (B, Sq) ``q_ids`` / (B, Sk) ``kv_ids`` (pairs fastest, then heads, then batch rows), both
    CTAs of pair p walking the mask's range of its 256 keys within :func:`pair_segment_range`
    of jax_fa4.segments.backward_tables' 128-key table, as kernel() intersects them (mutation
    ``own_m_range``: each CTA its own block's mask range within its own table row). Checked as
    :func:`simulate`'s launches (each 64-row dq_accum box gets exactly the adds of the pairs
    whose range holds its block). Counts on the returned sim: ``split_pairs`` (pairs whose two
    key blocks have different non-empty table ranges), ``half_empty_pairs`` (one block's range
    empty, the other's not) and ``idle_pairs`` (the tables leave the pair no query block its
    mask range has)."""
    import jax.numpy as jnp
    import numpy as np

    from jax_fa4 import segments

    assert cfg.segments and cfg.two_cta and not cfg.deterministic
    mut = frozenset(mut)
    assert mut <= set(MUTATIONS), mut
    (b, seqlen_q), seqlen_k = q_ids.shape, kv_ids.shape[1]
    keys = np.asarray(segments.backward_tables(jnp.asarray(q_ids), jnp.asarray(kv_ids), TILE,
                                               TILE)[1])
    sim = PairSim(random.Random(seed), slots, False)
    pairs = make_blocks(cfg, seqlen_q, seqlen_k, wl, wr, PAIR_TILE)
    own = make_blocks(cfg, seqlen_q, seqlen_k, wl, wr, TILE)
    n_pairs = -(-seqlen_k // PAIR_TILE)
    ranges = {}
    for i in range(b):
        for p in range(n_pairs):
            (lo, hi), (slo, shi) = pairs.m_block_range(p), pair_segment_range(keys, i, p)
            ranges[i, p] = (max(lo, slo), min(hi, shi))
    ctas = []
    sim.split_pairs = sim.half_empty_pairs = sim.idle_pairs = 0
    for i in range(b):
        for h in range(heads):
            for p in range(n_pairs):
                cluster = []
                for r in range(2):
                    n = 2 * p + r
                    lo, hi = ranges[i, p]
                    if "own_m_range" in mut:
                        (a, z), (slo, shi) = own.m_block_range(n), block_segment_range(keys, i, n)
                        lo, hi = max(a, slo), min(z, shi)
                    cluster.append(PairCta(sim, cfg, len(ctas) + r, p, r, h, lo,
                                           max(hi - lo, 0), n * TILE < seqlen_k, None, mut,
                                           batch=i))
                cluster[0].link(cluster[1])
                cluster[1].link(cluster[0])
                ctas += cluster
                sim.pending.append(cluster)
                if h == 0:
                    own_ranges = [block_segment_range(keys, i, n) for n in (2 * p, 2 * p + 1)]
                    full = [hi > lo for lo, hi in own_ranges]
                    sim.split_pairs += all(full) and own_ranges[0] != own_ranges[1]
                    sim.half_empty_pairs += full[0] != full[1]
                    mask_lo, mask_hi = pairs.m_block_range(p)
                    sim.idle_pairs += mask_hi > mask_lo and ranges[i, p][1] <= ranges[i, p][0]
            for m in range(pairs.num_m_blocks()):
                for r in range(2):
                    sim.visitors[i, h, (m, r)] = [p for p in range(n_pairs)
                                                  if ranges[i, p][0] <= m < ranges[i, p][1]]
    what = (f"{cfg.describe()} ids={np.asarray(q_ids).tolist()} / "
            f"{np.asarray(kv_ids).tolist()} window=({wl}, {wr}) heads={heads} slots={slots} "
            f"seed={seed} mut={sorted(mut)}")
    run_checked(sim, cfg, ctas, what)
    return sim


def segments_cfg(d: int, mask: str, softcap: bool = False, gqa: bool = False
                 ) -> Sm100BwdConfig:
    """A 2-CTA segment-id config: 192/128 (the shipped segments_config, serial layout, one dQ
    staging buffer) or 128 (the head-dim-128 2-CTA layout in the segment-id mode, which the
    kernel builds but nothing ships: the dense table's tuning)."""
    if d == 192:
        cfg = segments_config("bfloat16", 192, 128, mask, softcap, gqa)
    else:
        cfg = Sm100BwdConfig.make("bfloat16", d, d, mask, softcap, gqa, segments=True)
    assert cfg.two_cta and cfg.segments and cfg.serial == (d == 192)
    return cfg


#: random grids per mask with ``--exhaustive``; the quick tier runs the first half (among them
#: pairs with two ranges, with one empty range, and idle pairs)
SEGMENT_RUNS = 12


@pytest.mark.parametrize("mask", per_class(["local", "causal", "none"], key=lambda m: 0))
def test_segments_protocol_random_schedules(mask):
    """Segment ids (packed documents, ids anywhere, padding, query / key ids of other lengths,
    ids only some keys hold) over random grids under random schedules, the serial layout
    (192/128, shipped) and the head-dim-128 one: the pair's range from the union of its two
    key blocks' table ranges changes no barrier, role or phase (no deadlock, parity alias,
    overrun or hazard; the row ids staged with -lse / -delta and read with them), every dQ
    contribution is added once; among the runs, pairs whose two blocks have different ranges,
    pairs with one empty range, and pairs the tables leave idle."""
    rng = random.Random(f"2cta-segments-{mask}")
    split = half = idle = 0
    for _ in range(SEGMENT_RUNS if compiled.EXHAUSTIVE else SEGMENT_RUNS // 2):
        cfg = segments_cfg(192 if rng.random() < 0.7 else 128, mask, rng.random() < 0.3,
                           rng.random() < 0.3)
        b = rng.choice((1, 2))
        seqlen_q = rng.choice((rng.randint(1, 4 * TILE), 3 * TILE))
        seqlen_k = rng.choice((seqlen_q, rng.randint(1, 6 * TILE)))
        q_ids, kv_ids = random_ids(rng, b, seqlen_q, seqlen_k)
        heads = rng.choice((1, 2))
        slots = rng.choice((2, 4, 200))
        wl = rng.choice((-1, 0, rng.randint(0, 300)))
        wr = rng.choice((-1, 0, rng.randint(0, 300)))
        sim = simulate_segments(cfg, q_ids, kv_ids, heads, slots, rng.getrandbits(32), wl, wr)
        split += sim.split_pairs
        half += sim.half_empty_pairs
        idle += sim.idle_pairs
    assert split > 0 and half > 0 and idle > 0, (split, half, idle)


def edge_segment_ids():
    """(q_ids, kv_ids) of one batch row, 512 queries and 763 keys (six key blocks, the last
    partial): queries 0-191 id 0, 192-511 id 1; keys 0-191 id 0, 192-383 id 1, 384 on id 7
    (no query has it). Key block 0's range is query blocks [0, 2), block 1's [0, 4) (pair 0:
    different ranges), block 2's [1, 4) and block 3's empty (pair 1: one empty range), blocks
    4 and 5 empty (pair 2: idle)."""
    import numpy as np

    q_ids = np.array([[0] * 192 + [1] * 320], np.int32)
    kv_ids = np.array([[0] * 192 + [1] * 192 + [7] * 379], np.int32)
    return q_ids, kv_ids


@pytest.mark.parametrize("d", per_class([192, 128], key=lambda d: 0))  # quick tier: 192 (shipped)
def test_segments_pair_range_edges(d):
    """The tables' ranges of the edge ids (:func:`edge_segment_ids`) are as designed, and the
    pair walks their union: both CTAs of pair 0 the blocks [0, 4), pair 1 [1, 4), pair 2 none;
    two heads, one cluster resident and all of them, commit arrivals in issue order."""
    import jax.numpy as jnp
    import numpy as np

    from jax_fa4 import segments

    q_ids, kv_ids = edge_segment_ids()
    keys = np.asarray(segments.backward_tables(jnp.asarray(q_ids), jnp.asarray(kv_ids), TILE,
                                               TILE)[1])
    assert [block_segment_range(keys, 0, n) for n in range(6)] == [
        (0, 2), (0, 4), (1, 4), (0, 0), (0, 0), (0, 0)]
    assert [pair_segment_range(keys, 0, p) for p in range(3)] == [(0, 4), (1, 4), (NO_BLOCK, 0)]
    # (contiguous ids: the 256-key tables' key ranges are these envelopes; the kernel still
    # reads the 128-key tables, whose bulk is per own block)
    keys256 = np.asarray(segments.backward_tables(jnp.asarray(q_ids), jnp.asarray(kv_ids), TILE,
                                                  PAIR_TILE)[1])
    assert [block_segment_range(keys256, 0, p) for p in range(3)] == [(0, 4), (1, 4), (0, 0)]
    cfg = segments_cfg(d, "none")
    for seed, slots in enumerate((2, 200)):
        sim = simulate_segments(cfg, q_ids, kv_ids, 2, slots, seed)
        assert (sim.split_pairs, sim.half_empty_pairs, sim.idle_pairs) == (1, 1, 1)


@pytest.mark.parametrize("d", [192, 128])
def test_segments_mutation_per_cta_range(d):
    """The pair must walk one range for both CTAs: with each CTA's own key block's range (its
    table row and its 128-key mask range) the pair of the edge ids whose blocks' ranges differ
    deadlocks or miscounts."""
    q_ids, kv_ids = edge_segment_ids()
    cfg = segments_cfg(d, "none")
    with pytest.raises(ProtocolError, match="deadlock|phases completed|expecting|too many"):
        simulate_segments(cfg, q_ids, kv_ids, 1, 4, 0, mut={"own_m_range"})
