"""The sm100 split backward's synchronisation protocol (jax_fa4/kernels/sm100/bwd_split.py, both
parts), checked on a CPU by the fused backward's discrete-event model.

The kernels compile here but never run (no Blackwell GPU), so their mbarrier / named-barrier
protocol must be right by construction. ``SplitCta`` transcribes every role of
``FlashAttentionBackwardSm100Split`` as a Python generator, statement for statement in the order of
the kernel's waits, arrives, MMA issues, commits, TMA copies and shared / tensor memory accesses,
with the kernel's method and barrier names, counts and parity formulas. The machine (a grid of
CTAs, one tensor pipe each executing its MMAs in issue order, commits that arrive when the MMAs
issued before them are done, TMA transactions, PipelineAsync, named barriers, random SM slots and
random schedules, the parity-alias / arrival-overrun / data-hazard checks) is
tests/test_sm100_bwd_protocol.py's ``BwdSim`` and pipelines, imported, not copied.

Modelled resources: the resident buffers (sR1, sR2), the S1 / S2 stages, the -lse / -delta stages
(dkdv), TMEM in cells of 32 lanes × 8 columns at bwd_split_config.tmem_offsets: X (Sᵀ / S) with
warpgroup w's 16-bit Pᵀ in its columns [32w, 32w + 16), Y (dPᵀ / dP) with the 16-bit dS likewise,
the TS GEMMs' A operand as its four 16-column k-blocks (views at +0 for k-blocks 0-1 and +16 for
2-3, 8 TMEM columns per k-block: columns +0, +8, +32, +40), the accumulators. Not modelled: the
memory model (fences), the MMAs' internal k-block loops, the arithmetic (emulated in
tests/sm100_emulation.py), layouts beyond column ranges (the streamed buffers' transposed views
are checked at trace time by bwd_split.check_transposed_view, tested below when the compiler is
importable).

Checks: no deadlock, parity alias, arrival overrun or hazard; at the end every barrier between
phases with the expected phase count and waits per warp; every compute warp stored its output
rows once; every wait of the kernel found blocked at least once over the random runs.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections import defaultdict, deque

import compiled
import pytest
from compiled import per_class
from test_sm100_bwd_protocol import (
    CELL,
    WARP,
    Barrier,
    BwdCta,
    BwdSim,
    PipelineAsync,
    PipelineTmaUmma,
    PipelineTmaUmmaTx,
    ProtocolError,
    Resource,
    check_barrier_ends,
    make_pipeline_state,
    work_table,
)

from jax_fa4.kernels.common.geometry import BwdBlocks, FwdBlocks

try:  # the CuTe-DSL compiler (test_transposed_views_checked_at_trace_time); a module global,
    import cutlass  # as the traced function's string annotations are evaluated in it
except ImportError:  # pragma: no cover - the compiler is optional
    cutlass = None
from jax_fa4.kernels.sm100.bwd_split_config import Sm100BwdSplitConfig

NUM_COMPUTE = 8 * WARP  # compute warps 0-7
TMEM_USERS = 8 + 1  # compute warps + the MMA warp at the TMEM named barriers
ROWS, COLS = Sm100BwdSplitConfig.tile_rows, Sm100BwdSplitConfig.tile_cols


class SplitCta(BwdCta):
    """One CTA of the split backward (``cfg.part``): resident block ``block``, output column
    half ``col_half`` (dkdv). ``omit``: names of waits the MMA warp skips (the tests' proof that
    the model sees what a missing wait breaks). Reuses BwdCta's TMEM cell helpers and store
    record."""

    def __init__(self, sim: BwdSim, cfg: Sm100BwdSplitConfig, blocks, cta_id: int, block: int,
                 col_half: int, head: int, omit: frozenset = frozenset(),
                 zero_padding: bool = False):
        self.sim, self.cfg, self.blocks, self.id = sim, cfg, blocks, cta_id
        self.zero_padding = zero_padding  # varlen: the ZERO_PADDING work row's CTA
        self.n_block, self.head, self.col_half, self.omit = block, head, col_half, omit
        self.dkdv = cfg.part == "dkdv"
        self.off = cfg.tmem_offsets()
        if self.dkdv:
            self.s_min, s_max = blocks.m_block_range(block)
        else:
            self.s_min, s_max = blocks.n_block_range(block)
        self.count = max(s_max - self.s_min, 0)
        self.live, self.retired = 0, False
        self.tensor_queue: deque = deque()
        self.mma_issued = self.mma_done = 0
        self.commits: dict = defaultdict(deque)
        self.tmem_freed = False
        self.stored: dict = defaultdict(int)
        p = f"c{cta_id}"

        def bar(name, count):
            b = Barrier(f"{p}.{name}", count)
            b.family = name
            return b

        # kernel(): mbarrier_init counts of mbar_sig
        self.s_full, self.p_full = bar("s_full", 1), bar("p_full", NUM_COMPUTE)
        self.dp_full, self.ds_full = bar("dp_full", 1), bar("ds_full", NUM_COMPUTE)
        self.acc_full = bar("acc_full", 1)
        self.pipeline_r = PipelineTmaUmmaTx(f"{p}.r", 1, copies=2)  # R1 and R2
        self.pipeline_s1 = PipelineTmaUmma(f"{p}.s1", cfg.stream_stages)
        self.pipeline_s2 = PipelineTmaUmma(f"{p}.s2", cfg.other_stages)
        self.pipeline_lse = PipelineAsync(f"{p}.lse", cfg.stream_stages, WARP, NUM_COMPUTE)
        self.pipelines = (self.pipeline_r, self.pipeline_s1, self.pipeline_s2,
                          self.pipeline_lse)
        for pl in self.pipelines:
            for b in pl.full + pl.empty:
                b.family = b.family.split(".", 1)[1]
        R = Resource
        self.sR1, self.sR2 = R(f"{p}.sR1"), R(f"{p}.sR2")
        self.sS1 = [R(f"{p}.sS1[{s}]") for s in range(cfg.stream_stages)]
        self.sS2 = [R(f"{p}.sS2[{s}]") for s in range(cfg.other_stages)]
        self.sLSE = [R(f"{p}.sLSE[:, {s}]") for s in range(cfg.stream_stages)]
        self.sDelta = [R(f"{p}.sDelta[:, {s}]") for s in range(cfg.stream_stages)]
        self.smem = set(itertools.chain((self.sR1, self.sR2), self.sS1, self.sS2, self.sLSE,
                                        self.sDelta))
        regions = sorted((v, k) for k, v in self.off.items())
        self.tmem = []
        for q in range(4):
            row = []
            for c in range(cfg.tmem_alloc_columns() // CELL):
                col = c * CELL
                base, name = max((r for r in regions if r[0] <= col), default=(0, "?"))
                res = R(f"{p}.TMEM[{name}+{col - base}:+{CELL}, lanes {32 * q}+]", tmem=True)
                res.tmem = self
                row.append(res)
            self.tmem.append(row)
        # the accumulators (name, TMEM column): dkdv dK_c, dV_c; dq dQ
        self.accs = ([("dK", self.off["dk"]), ("dV", self.off["dv"])] if self.dkdv
                     else [("dQ", self.off["dq"])])

    def a_cells(self, base: int) -> list:
        """The TS GEMMs' 16-bit A operand at X or Y (``base``): k-block k of 16 streamed rows at
        base + (0 if k < 2 else cw/2) + 8k (mma_warp_split's two views)."""
        cw = COLS // 2
        cols = [base + (0 if k < 2 else cw // 2) + 8 * k for k in range(COLS // 16)]
        return [r for c in cols for r in self.cells(self.ALL, c, c + 8)]

    # --- load warp (load_warp_split) ----------------------------------------------------------
    def load_warp(self):
        cfg = self.cfg
        s1_state = make_pipeline_state(True, cfg.stream_stages)
        s2_state = make_pipeline_state(True, cfg.other_stages)
        if self.count > 0:
            r_state = make_pipeline_state(True, 1)
            yield from self.pipeline_r.producer_acquire(r_state)
            yield ("tma_load", self.sR1, ("R1", self.n_block),
                   self.pipeline_r.producer_get_barrier(r_state))
            yield ("tma_load", self.sR2, ("R2", self.n_block),
                   self.pipeline_r.producer_get_barrier(r_state))
        for j in range(self.count):
            s_block = self.s_min + j
            yield from self.pipeline_s1.producer_acquire(s1_state)
            yield ("tma_load", self.sS1[s1_state.index], ("S1", s_block),
                   self.pipeline_s1.producer_get_barrier(s1_state))
            yield from self.pipeline_s2.producer_acquire(s2_state)
            yield ("tma_load", self.sS2[s2_state.index], ("S2", s_block),
                   self.pipeline_s2.producer_get_barrier(s2_state))
            if self.dkdv:  # stage_stats: the stats stage follows the S1 (Q) stage
                yield from self.pipeline_lse.producer_acquire(s1_state)
                yield ("access", [(self.sLSE[s1_state.index], ("lse", s_block), True),
                                  (self.sDelta[s1_state.index], ("delta", s_block), True)],
                       f"sLSE / sDelta[:, {s1_state.index}] of block {s_block}")
                yield from self.pipeline_lse.producer_commit(s1_state, WARP)
            s1_state.advance()
            s2_state.advance()

    # --- MMA warp (mma_warp_split) ------------------------------------------------------------
    def mma_warp(self):
        cfg, off, ALL, cells = self.cfg, self.off, self.ALL, self.cells
        x_cells = cells(ALL, off["s"], off["s"] + COLS)
        y_cells = cells(ALL, off["dp"], off["dp"] + COLS)
        o = cfg.out_cols
        (acc0, base0), *rest = self.accs
        acc0_cells = cells(ALL, base0, base0 + o)
        s1_state = make_pipeline_state(False, cfg.stream_stages)
        s1_release = make_pipeline_state(False, cfg.stream_stages)
        s2_state = make_pipeline_state(False, cfg.other_stages)
        if self.count > 0:
            r_state = make_pipeline_state(False, 1)
            yield from self.pipeline_r.consumer_wait(r_state)
        for j in range(self.count + 1):
            if j < self.count:
                yield from self.pipeline_s1.consumer_wait(s1_state)
                yield ("mma", [(self.sR1, ("R1", self.n_block)),
                               (self.sS1[s1_state.index], ("S1", self.s_min + j))],
                       [(r, ("X", j)) for r in x_cells], f"X{j} = R1·S1_{j}ᵀ")
                yield ("commit", self.s_full)
                s1_state.advance()
            if j > 0:
                if "ds_full" not in self.omit:
                    yield ("wait", self.ds_full, (j - 1) % 2, j - 1)
                acc = [(r, (acc0, j - 2)) for r in acc0_cells] if j > 1 else []
                yield ("mma", [(r, ("dS", j - 1)) for r in self.a_cells(off["dp"])]
                       + [(self.sS1[s1_release.index], ("S1", self.s_min + j - 1))] + acc,
                       [(r, (acc0, j - 1)) for r in acc0_cells], f"{acc0} += dS{j - 1}·S1")
                yield from self.pipeline_s1.consumer_release(s1_release)
                s1_release.advance()
            if j < self.count:
                yield from self.pipeline_s2.consumer_wait(s2_state)
                yield ("mma", [(self.sR2, ("R2", self.n_block)),
                               (self.sS2[s2_state.index], ("S2", self.s_min + j))],
                       [(r, ("Y", j)) for r in y_cells], f"Y{j} = R2·S2_{j}ᵀ")
                yield ("commit", self.dp_full)
                if "p_full" not in self.omit:
                    yield ("wait", self.p_full, j % 2, j)
                if self.dkdv:
                    (acc1, base1), = rest
                    acc1_cells = cells(ALL, base1, base1 + o)
                    acc = [(r, (acc1, j - 1)) for r in acc1_cells] if j > 0 else []
                    yield ("mma", [(r, ("P", j)) for r in self.a_cells(off["s"])]
                           + [(self.sS2[s2_state.index], ("S2", self.s_min + j))] + acc,
                           [(r, (acc1, j)) for r in acc1_cells], f"{acc1} += P{j}ᵀ·S2")
                yield from self.pipeline_s2.consumer_release(s2_state)
                s2_state.advance()
        if self.count > 0:
            yield ("commit", self.acc_full)

    # --- compute warps ------------------------------------------------------------------------
    def compute_warps(self, wg: int, quarter: int):
        cfg, off = self.cfg, self.off
        cw = COLS // 2
        lane = [quarter]
        lse = self.pipeline_lse
        lse_state = make_pipeline_state(False, cfg.stream_stages)
        x0, y0 = off["s"] + cw * wg, off["dp"] + cw * wg
        for j in range(self.count):
            s_block = self.s_min + j
            s = lse_state.index
            if self.dkdv:
                yield from lse.consumer_wait(lse_state)
            yield ("wait", self.s_full, j % 2, j)
            reads = [(r, ("X", j), False) for r in self.cells(lane, x0, x0 + cw)]
            if self.dkdv:
                reads.append((self.sLSE[s], ("lse", s_block), False))
            yield ("access", reads, f"ld X{j}")
            if self.dkdv:  # store_16bit: Pᵀ into the warpgroup's own X columns
                yield ("access", [(r, ("P", j), True) for r in
                                  self.cells(lane, x0, x0 + cw // 2)], f"st Pᵀ{j}")
            yield ("arrive", self.p_full, WARP)
            yield ("wait", self.dp_full, j % 2, j)
            reads = [(r, ("Y", j), False) for r in self.cells(lane, y0, y0 + cw)]
            if self.dkdv:
                reads.append((self.sDelta[s], ("delta", s_block), False))
                if cfg.has_softcap:
                    reads.append((self.sLSE[s], ("lse", s_block), False))
            yield ("access", reads, f"ld Y{j}")
            if self.dkdv:
                yield from lse.consumer_release(lse_state, WARP)
                lse_state.advance()
            yield ("access", [(r, ("dS", j), True) for r in self.cells(lane, y0, y0 + cw // 2)],
                   f"st dS{j}")
            yield ("arrive", self.ds_full, WARP)
        yield from self.epilogue(wg, quarter)

    def epilogue(self, wg: int, quarter: int):
        """store_acc of each accumulator (dkdv: dV then dK; dq: dQ), this warpgroup's half."""
        if self.count > 0:
            yield ("wait", self.acc_full, 0, 0)
        half = self.cfg.out_cols // 2
        for name, base in (self.accs[::-1] if self.dkdv else self.accs):
            if self.count > 0:
                yield ("access", [(r, (name, self.count - 1), False) for r in
                                  self.cells([quarter], base + half * wg,
                                             base + half * (wg + 1))], f"ld {name}")
        yield ("record", "outputs stored", self._record_store(wg, quarter))

    # --- kernel(): the warp-role dispatch (BwdCta.spawn, without reduce warps) ---------------
    tmem_users = TMEM_USERS
    reduce_warp_count = 0

    def compute_role(self, wg, q):
        yield from self.tmem_user(self.compute_warps(wg, q))
        if self.zero_padding and self.col_half == 0:  # plain global stores, no barrier
            yield ("record", "padding rows zeroed", self._record_padding(wg, q))

    # --- end of run ---------------------------------------------------------------------------
    def check_end(self):
        sim, c, cfg = self.sim, self.count, self.cfg
        p = f"c{self.id}"
        compute = [f"{p}.compute{wg}.{q}" for wg in range(2) for q in range(4)]
        mma, load = f"{p}.mma", f"{p}.load"

        def per_stage(stages):
            return [len(range(i, c, stages)) for i in range(stages)]

        want = {  # barrier -> (phases completed, {warp: waits})
            self.s_full: (c, dict.fromkeys(compute, c)),
            self.p_full: (c, {mma: c}),
            self.dp_full: (c, dict.fromkeys(compute, c)),
            self.ds_full: (c, {mma: c}),
            self.acc_full: (min(c, 1), dict.fromkeys(compute, min(c, 1))),
            self.pipeline_r.full[0]: (min(c, 1), {mma: min(c, 1)}),
            self.pipeline_r.empty[0]: (0, {load: min(c, 1)}),
        }
        rings = [(self.pipeline_s1, cfg.stream_stages, [mma], True),
                 (self.pipeline_s2, cfg.other_stages, [mma], True),
                 (self.pipeline_lse, cfg.stream_stages, compute, self.dkdv)]
        for pl, stages, consumers, used in rings:
            for i, k in enumerate(per_stage(stages)):
                k = k if used else 0
                want[pl.full[i]] = (k, dict.fromkeys(consumers, k))
                want[pl.empty[i]] = (k, {load: k})
        check_barrier_ends(sim, want)
        if dict(self.stored) != {(wg, q): 1 for wg in range(2) for q in range(4)}:
            sim.fail(f"CTA {self.id}: output stores {dict(self.stored)}")
        if not (self.retired and self.tmem_freed):
            sim.fail(f"CTA {self.id} did not finish")


def make_blocks(cfg: Sm100BwdSplitConfig, seqlen_q: int, seqlen_k: int, wl: int = -1,
                wr: int = -1):
    """kernel(): the part's block geometry (dkdv: BwdBlocks of 64 query rows × 128 keys; dq:
    FwdBlocks of 128 query rows × 64 keys), windows clamped as resolve_windows does."""
    window_left = window_right = 0
    if cfg.mask == "local":
        window_left = seqlen_k if wl < 0 or wl > seqlen_k else wl
        window_right = seqlen_q if wr < 0 or wr > seqlen_q else wr
    causal, local = cfg.mask == "causal", cfg.mask == "local"
    if cfg.part == "dkdv":
        return BwdBlocks(COLS, ROWS, causal, local, seqlen_q, seqlen_k, window_left,
                         window_right)
    return FwdBlocks(ROWS, COLS, causal, local, seqlen_q, seqlen_k, window_left, window_right)


def simulate(cfg: Sm100BwdSplitConfig, seqlen_q: int, seqlen_k: int, heads: int, slots: int,
             seed: int, wl: int = -1, wr: int = -1, omit: frozenset = frozenset()) -> BwdSim:
    """One launch: the grid (cfg.num_blocks × col_splits, heads) in linear-id order."""
    sim = BwdSim(random.Random(seed), slots, False)
    blocks = make_blocks(cfg, seqlen_q, seqlen_k, wl, wr)
    n = cfg.num_blocks(seqlen_k if cfg.part == "dkdv" else seqlen_q) * cfg.col_splits
    grid = [(x, h) for h in range(heads) for x in range(n)]
    ctas = [SplitCta(sim, cfg, blocks, i, x // cfg.col_splits, x % cfg.col_splits, h, omit)
            for i, (x, h) in enumerate(grid)]
    sim.pending.extend(ctas)
    try:
        sim.run()
        for cta in ctas:
            cta.check_end()
    except ProtocolError as e:
        raise ProtocolError(f"{cfg.describe()} seqlen_q={seqlen_q} seqlen_k={seqlen_k} "
                            f"window=({wl}, {wr}) heads={heads} slots={slots} seed={seed}: "
                            f"{e}") from None
    return sim


def simulate_varlen(cfg: Sm100BwdSplitConfig, lens: list[tuple[int, int]], heads: int,
                    slots: int, seed: int, wl: int = -1, wr: int = -1,
                    order: str = "sequence") -> BwdSim:
    """A varlen launch: the grid (work rows × col_splits, heads) of the work list the backend
    builds (Sm100Backend.split_varlen_backward: key blocks for dkdv in launch ``order``, query
    blocks with q and k swapped for dq) for sequences of (len_q, len_k) ``lens``; each CTA a
    SplitCta with its row's lengths (its own block geometry). Beyond :func:`simulate`'s checks:
    per head exactly the ZERO_PADDING row's first CTA's 8 compute warps zero the padding rows;
    spare rows (lengths 0) and blocks that see nothing keep the protocol (count = 0)."""
    import jax.numpy as jnp
    import numpy as np

    from jax_fa4.backends import sm90
    from jax_fa4.kernels.sm100.bwd import ZERO_PADDING

    assert cfg.varlen
    sim = BwdSim(random.Random(seed), slots, False)
    cu_q = np.concatenate([[0], np.cumsum([q for q, _ in lens])]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum([k for _, k in lens])]).astype(np.int32)
    window = {"none": (None, None), "causal": (None, 0)}.get(
        cfg.mask, (None if wl < 0 else wl, None if wr < 0 else wr))
    batch, pad = len(lens), 7
    if cfg.part == "dkdv":
        work = work_table(jnp.asarray(cu_q), jnp.asarray(cu_k),
                          sm90.work_items(int(cu_k[-1]) + pad, batch, ROWS), COLS, ROWS,
                          window, order)
    else:
        work = work_table(jnp.asarray(cu_k), jnp.asarray(cu_q),
                          sm90.work_items(int(cu_q[-1]) + pad, batch, ROWS), COLS, ROWS,
                          window, "sequence")
    work = np.asarray(work)
    grid = [(x, h) for h in range(heads) for x in range(work.shape[0] * cfg.col_splits)]
    ctas = []
    for i, (x, h) in enumerate(grid):
        seq, block, _, _, len_a, len_b, _, _ = (int(c) for c in work[x // cfg.col_splits])
        len_q, len_k = (len_a, len_b) if cfg.part == "dkdv" else (len_b, len_a)
        ctas.append(SplitCta(sim, cfg, make_blocks(cfg, len_q, len_k, wl, wr), i, block,
                             x % cfg.col_splits, h, zero_padding=seq == ZERO_PADDING))
    sim.pending.extend(ctas)
    try:
        sim.run()
        for cta in ctas:
            cta.check_end()
        for h in range(heads):
            zeroed = sim.padding_zeroed[h]
            if len(zeroed) != 8 or len({cta for cta, _, _ in zeroed}) != 1:
                sim.fail(f"head {h}: padding rows zeroed by {zeroed}")
    except ProtocolError as e:
        raise ProtocolError(f"{cfg.describe()} lens={lens} window=({wl}, {wr}) heads={heads} "
                            f"slots={slots} seed={seed}: {e}") from None
    sim.idle_ctas = sum(1 for c in ctas if c.count == 0 and c.blocks.seqlen_k > 0
                        and c.blocks.seqlen_q > 0)
    return sim


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------
RUNS = 40  # per case with ``--exhaustive``
#: the quick tier's runs per case (every wait is found blocked well within them; the mutation
#: checks below run schedules of their own)
QUICK_RUNS = 10


def stage_variants(part: str, head_dim: int = 256) -> list[Sm100BwdSplitConfig]:
    """The shipped stage counts and accepted others (the model's; shared memory would refuse
    more than two S1 stages at head dim 256, not at 192/192)."""
    base = Sm100BwdSplitConfig.make(part, "bfloat16", head_dim)
    return [base, dataclasses.replace(base, stream_stages=3, other_stages=2),
            dataclasses.replace(base, other_stages=2)]


def wait_sites(part: str) -> set:
    """Every (role, wait) the random runs must find blocked. Not in the set: r.empty (one stage,
    acquired once) and lse.empty (implied by s1.empty of the same stage: S1_j is released after
    the TS GEMM of dS_j, issued after every compute thread's ds_full_j arrival, which follows
    its lse release)."""
    sites = {("load", "s1.empty"), ("load", "s2.empty"), ("mma", "r.full"), ("mma", "s1.full"),
             ("mma", "s2.full"), ("mma", "ds_full"), ("mma", "p_full"),
             ("mma", "bar.TMEM_DEALLOC"), ("compute", "s_full"), ("compute", "dp_full"),
             ("compute", "acc_full"), ("compute", "bar.TMEM_ALLOC"),
             ("compute", "bar.TMEM_DEALLOC")}
    if part == "dkdv":
        sites.add(("compute", "lse.full"))
    return sites


#: The masks of the random-schedule checks, the richest first (its random windows, unbounded
#: sides included, reach the other masks' block ranges): the quick tier runs it alone
#: (tests/compiled.py), ``--exhaustive`` all three.
MASKS = per_class(["local", "causal", "none"], key=lambda mask: 0)


@pytest.mark.parametrize("head_dim", (256, 192))
@pytest.mark.parametrize("part", ("dkdv", "dq"))
@pytest.mark.parametrize("mask", MASKS)
def test_protocol_random_schedules(part, mask, head_dim):
    """Random grids (odd lengths, windows, 1-2 heads, 1 SM slot up to the whole grid) under
    random schedules: no deadlock, parity alias, arrival overrun or data hazard, every barrier's
    phase and wait counts at the end; every wait of the kernel found blocked at least once.
    Head dim 192/192: the same barrier protocol on the one-part grid (one dK/dV CTA per key
    block, its accumulators filling the 512 TMEM columns)."""
    assert stage_variants("dkdv", head_dim)[0].col_splits == (1 if head_dim == 192 else 2)
    rng = random.Random(f"split-{part}-{mask}" + ("" if head_dim == 256 else f"-d{head_dim}"))
    blocked = set()
    for _ in range(RUNS if compiled.EXHAUSTIVE else QUICK_RUNS):
        base = rng.choice(stage_variants(part, head_dim))
        cfg = dataclasses.replace(base, mask=mask, has_softcap=rng.random() < 0.3)
        sq = rng.choice((rng.randint(1, 3 * ROWS), rng.choice((COLS, ROWS, 2 * ROWS))))
        sk = rng.choice((rng.randint(1, 3 * ROWS), rng.choice((COLS, ROWS, 2 * ROWS))))
        wl = rng.choice((-1, 0, rng.randint(0, 300)))
        wr = rng.choice((-1, 0, rng.randint(0, 300)))
        heads = rng.choice((1, 1, 2))
        slots = rng.choice((1, 2, 3, 64))
        blocked |= simulate(cfg, sq, sk, heads, slots, rng.getrandbits(32), wl, wr).blocked
    missing = wait_sites(part) - blocked
    assert not missing, missing


@pytest.mark.parametrize("head_dim", (256, 192))
@pytest.mark.parametrize("part", ("dkdv", "dq"))
def test_protocol_long_sequence(part, head_dim):
    """Each stage variant over many streamed blocks (every ring wraps), one resident block."""
    for cfg in stage_variants(part, head_dim):
        for seed in range(3 if compiled.EXHAUSTIVE else 1):  # schedules: one in the quick tier
            simulate(cfg, 5 * ROWS - 3, 5 * ROWS - 3, 1, 1, seed)


@pytest.mark.parametrize("part", ("dkdv", "dq"))
def test_one_stream_stage_deadlocks_and_is_refused(part):
    """Why validate requires stream_stages >= 2: GEMM1_{j+1} waits for S1_{j+1} before the TS
    GEMM of dS_j releases S1_j's only stage, which the load warp needs for S1_{j+1}."""
    cfg = dataclasses.replace(Sm100BwdSplitConfig.make(part, "bfloat16", 256), stream_stages=1)
    with pytest.raises(ValueError, match="stream_stages"):
        cfg.validate()
    with pytest.raises(ProtocolError, match="deadlock"):
        simulate(cfg, 3 * ROWS, 3 * ROWS, 1, 1, 0)


@pytest.mark.parametrize("part", ("dkdv", "dq"))
@pytest.mark.parametrize("wait", ("p_full", "ds_full"))
def test_model_sees_a_missing_wait(part, wait):
    """The model is not blind: without the MMA warp's p_full wait GEMM1_{j+1} (or, dkdv, the dV
    GEMM reading Pᵀ) races the compute warps' X accesses; without ds_full the TS GEMM reads a dS
    not yet stored (a hazard or a wrong tag in some schedule: both messages say what the
    resource holds; not the end-of-run wait counts, which a skipped wait changes too)."""
    cfg = Sm100BwdSplitConfig.make(part, "bfloat16", 256)
    with pytest.raises(ProtocolError, match="holds"):
        for seed in range(20):
            simulate(cfg, 3 * ROWS, 3 * ROWS, 1, 1, seed, omit=frozenset({wait}))


def test_tmem_layout_fits_and_a_operands_in_own_columns():
    """The TMEM offsets: accumulators, X, Y disjoint and inside the allocation; each warpgroup's
    16-bit stores lie in columns it read itself, and the TS GEMM's k-block views cover exactly
    the two warpgroups' stores (a_cells)."""
    for part, d in itertools.product(("dkdv", "dq"), (192, 256)):
        cfg = Sm100BwdSplitConfig.make(part, "bfloat16", d)
        off = cfg.tmem_offsets()
        spans = sorted((v, v + (cfg.out_cols if k in ("dk", "dv", "dq") else COLS), k)
                       for k, v in off.items())
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            assert end <= start, (a, b)
        assert spans[-1][1] == cfg.tmem_columns() <= cfg.tmem_alloc_columns() <= 512
        cw = COLS // 2
        kblock_cols = sorted((0 if k < 2 else cw // 2) + 8 * k + c for k in range(COLS // 16)
                             for c in range(8))
        stored = sorted(cw * wg + c for wg in range(2) for c in range(cw // 2))
        assert kblock_cols == stored


def test_transposed_views_checked_at_trace_time():
    """bwd_split.check_transposed_view accepts the kernel's S1 / S2 views (the MN-major B of the
    TS GEMMs over the K-major buffers the TMA fills) and rejects a K-major view of the same
    shape (traced by the CuTe-DSL compiler on the CPU; skipped where it is not installed)."""
    if cutlass is None:
        pytest.skip("the CuTe-DSL compiler is not installed")
    from jax_fa4.ffi.compiler import set_target_arch

    set_target_arch("sm_100a")  # (the DSL keeps the last compile's arch: maybe sm_90a)
    import cutlass.cute as cute
    import cutlass.utils.blackwell_helpers as sm100_utils
    from cutlass.cute.nvgpu import tcgen05

    from jax_fa4.kernels.sm100.bwd_split import check_transposed_view

    dt = cutlass.BFloat16
    k_major, mn_major = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
    one = tcgen05.CtaGroup.ONE

    @cute.jit
    def probe(out_cols: cutlass.Constexpr, transposed: cutlass.Constexpr,
              dim: cutlass.Constexpr = 256):
        x_mma = sm100_utils.make_trivial_tiled_mma(dt, dt, k_major, k_major, cutlass.Float32,
                                                   one, (ROWS, COLS))
        major = mn_major if transposed else k_major
        source = tcgen05.OperandSource.TMEM if transposed else tcgen05.OperandSource.SMEM
        ts_mma = sm100_utils.make_trivial_tiled_mma(dt, dt, k_major, major, cutlass.Float32,
                                                    one, (ROWS, out_cols), source)
        loaded = sm100_utils.make_smem_layout_b(x_mma, (ROWS, COLS, dim), dt, 2)
        view = sm100_utils.make_smem_layout_b(ts_mma, (ROWS, dim, COLS), dt, 2)
        check_transposed_view(loaded, view, COLS, dim, out_cols, 2, "probe")

    cute.compile(probe, 128, True)  # dkdv's halves
    cute.compile(probe, 256, True)  # dq's full width
    cute.compile(probe, 192, True, 192)  # 192/192: both parts' full width (one part)
    with pytest.raises(ValueError, match="element"):
        cute.compile(probe, 128, False)
    with pytest.raises(ValueError, match="element"):
        cute.compile(probe, 192, False, 192)


@pytest.mark.parametrize("head_dim", (256, 192))
@pytest.mark.parametrize("part", ("dkdv", "dq"))
@pytest.mark.parametrize("mask", MASKS)
def test_protocol_varlen_random_schedules(part, mask, head_dim):
    """Varlen grids (empty sequences, sequences without queries or keys, random windows) on the
    backend's work lists under random schedules: the protocol holds for every work row, the
    padding rows are zeroed once per head, and CTAs with nothing to do (count = 0) ran beside
    busy ones (local windows and the spare rows). 192/192: one dK/dV CTA per work row."""
    rng = random.Random(f"split-varlen-{part}-{mask}"
                        + ("" if head_dim == 256 else f"-d{head_dim}"))
    for _ in range(RUNS // 4 if compiled.EXHAUSTIVE else QUICK_RUNS // 2):
        cfg = Sm100BwdSplitConfig.make(part, "bfloat16", head_dim, mask=mask,
                                       has_softcap=rng.random() < 0.3, gqa=rng.random() < 0.3)
        cfg = dataclasses.replace(cfg, varlen=True)

        def length():
            return rng.choice((0, 1, rng.randint(1, 3 * ROWS), rng.choice((COLS, ROWS))))

        lens = [(length(), length()) for _ in range(rng.randint(1, 4))]
        wl = rng.choice((-1, 0, rng.randint(0, 300)))
        wr = rng.choice((-1, 0, rng.randint(0, 300)))
        simulate_varlen(cfg, lens, rng.choice((1, 2)), rng.choice((1, 2, 3, 64)),
                        rng.getrandbits(32), wl, wr, rng.choice(("sequence", "heavy_first")))
    cfg = dataclasses.replace(Sm100BwdSplitConfig.make(part, "bfloat16", head_dim,
                                                       mask="local"), varlen=True)
    # key blocks no query sees (dkdv) and query blocks that see no key (dq) beside busy ones
    sim = simulate_varlen(cfg, [(ROWS, 4 * ROWS), (4 * ROWS, ROWS), (3 * ROWS - 1, 3 * ROWS),
                                (0, ROWS)], 1, 64, 0, wl=10, wr=0)
    assert sim.idle_ctas > 0
