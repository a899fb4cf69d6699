"""The sm100 forward kernel's synchronisation protocol, checked on a CPU by a discrete-event model.

jax_fa4/kernels/sm100/flash_fwd.py ("v2") can be compiled here but never run (no Blackwell GPU):
its mbarrier protocol must be right by construction. This file transcribes every role of the
kernel as a Python generator, statement for statement in the order of the kernel's waits, arrives,
MMA issues, commits, TMA copies and shared / tensor memory accesses (the functions carry the
kernel's method names: load_warp / load_kv, mma_warp / mma_tile_pingpong / mma_tile_single /
gemm_qk / gemm_pv, softmax_wg, correction_wg_loop, epilogue_warp, slot, and PipelineTmaUmma's
producer_acquire / consumer_wait / consumer_release), and runs the roles of one persistent CTA
under many random schedules.

The model
  * An actor per role: the load warp, the MMA warp (its one elected thread), each softmax
    warpgroup, the correction warpgroup, the epilogue warp (dense only). The threads of a
    warpgroup behave identically, so a warpgroup is one actor whose mbarrier arrive counts 128.
  * Asynchronous units, stepped by the scheduler at arbitrary later times: the tensor core
    (tcgen05 MMAs of the MMA thread execute and complete in issue order), tcgen05.commit (arrives
    once every MMA issued before it has completed; commits onto one barrier fire in order), TMA
    loads (complete in any order, each completing its transaction bytes on its full barrier) and
    TMA stores (their shared-memory read finishes at any later time).
  * mbarriers with a phase counter: a phase completes when its pending arrival count and its
    transaction count reach 0. ``mbarrier.try_wait.parity(P)`` passes iff the current (incomplete)
    phase's parity differs from P, exactly as the hardware does; the kernel's parity formulas
    (slot(), count / pvs / sums / tiles, PipelineState.phase) are transcribed, not recomputed.
  * Phase oracle. Every wait also names the phase index it means, from the same counters as
    its parity but undivided (``use(t, count + j)`` behind ``slot``'s parity, ``pvs`` behind
    ``pvs % 2``, ``sums - 1`` behind ``(sums + 1) % 2``, PipelineState.count // stages, ...).
    Checked: a wait for phase k passes only with exactly k + 1 phases completed; while it is
    pending, k or k + 1 phases have completed, never fewer and never more (a barrier two phases
    ahead of its waiter is a parity alias: the wait would miss a phase or pass early).
    Every arriver of this kernel arrives once per phase, so an actor's n-th arrive on a barrier
    (a commit's, a TMA transaction's, when it lands) must land in phase n (an arriver a phase
    ahead would complete the wrong phase of a multi-arriver barrier such as p_full). At the end,
    every barrier is between phases and was waited on, phase by phase, by exactly one role (the
    "empty"-style waits, producer_acquire / sum_empty / o_stored, pass phase −1 first and never
    wait for the last: the same count).
  * Data: every buffer the protocol hands over is a resource holding a tag of the value written
    last: the Q stages, the K/V ring stages, the S buffers' lower and upper halves in TMEM (P_b
    aliases S_b's upper half), the O tiles in TMEM, sScale[:, b], sSum[:, t] and sO[t]. Each
    writer tags its write with (work tile, Q tile, key block); each reader names the tag it
    expects. Asynchronous accesses occupy their resource from issue to completion (an MMA's reads
    and writes, a TMA load's write, a TMA store's read); a thread access that overlaps one of them
    conflicting (read / write or write / anything) is a hazard, and so is a TMA copy overlapping an
    MMA on the same resource. MMAs among themselves are ordered by the tensor pipe (they execute
    atomically at their in-order completion). The correction warpgroup's O rescale is taken every
    time (the warp vote's "some row needs it" branch: a superset of the other's accesses).
  * Teardown: the softmax / correction warpgroups and the MMA warp meet at the dealloc barrier,
    then the MMA warp frees TMEM; no MMA may still be in flight then.

Checked under random schedules (per run, random weights make some roles or units much slower
than others, re-drawn now and then), over random work lists of persistent tiles with n_blocks in
{0, 1, 2, 3, 5} (0: a varlen tile past its sequence's end, an empty causal / local range), for
q_tiles in {1, 2}, kv_stages in {2, 3, 5}, dense (epilogue warp TMA-stores sO) and varlen (no
epilogue warp; the correction warpgroup stores its rows itself): every run finishes (no
deadlock), no parity alias / arrival overrun, every read sees the intended value, every barrier
ends between phases, every output tile is produced exactly once from the right O.
"""

from __future__ import annotations

import itertools
import random
from collections import defaultdict, deque

import compiled
import pytest
from compiled import per_class

LANES = 128  # threads of a warpgroup (one per TMEM lane / query row)
N_BLOCKS_CHOICES = (0, 1, 2, 3, 5)


class ProtocolError(AssertionError):
    pass


# ---------------------------------------------------------------------------------------------
# Machine: mbarriers, resources, asynchronous units, scheduler
# ---------------------------------------------------------------------------------------------
class Barrier:
    """One mbarrier: ``count`` arrivals (+ transaction bytes) complete a phase."""

    __slots__ = ("completed", "count", "family", "name", "pending", "tx")

    def __init__(self, name: str, count: int):
        self.name, self.count = name, count
        self.family = name.split("[")[0]  # "p_full", "kv.empty", ...
        self.pending, self.tx, self.completed = count, 0, 0  # completed phases

    def __repr__(self):
        return f"{self.name}(completed={self.completed}, pending={self.pending}, tx={self.tx})"


class Resource:
    """A buffer handed over by the protocol: the tag of its last write, its in-flight async
    accesses [(unit, is_write)]."""

    __slots__ = ("inflight", "name", "tag", "tmem")

    def __init__(self, name: str, tmem: bool = False):
        self.name, self.tag, self.inflight, self.tmem = name, None, [], tmem

    def __repr__(self):
        return self.name


class Sim:
    """Actors (generators yielding operations) plus the tensor core, commits, TMA; a random
    scheduler."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.actors: dict[str, list] = {}  # name -> [generator, pending op]
        self.tensor_queue: deque = deque()  # issued MMAs, in order: (reads, writes, what)
        self.mma_issued = 0
        self.mma_done = 0
        self.commits: dict[Barrier, deque] = defaultdict(deque)  # bar -> (mma seq, phase)
        self.tma_loads: list = []  # in flight: (resource, tag, barrier, phase)
        self.tma_stores: list = []  # in flight: (actor, resource, expected tag)
        self.waits: dict = defaultdict(int)  # (actor, barrier) -> waits passed
        self.arrives: dict = defaultdict(int)  # (actor or "commit", barrier) -> arrivals
        self.named: dict[str, int] = defaultdict(int)
        self.tmem_freed = False
        self.log: deque = deque(maxlen=40)
        self.weights: dict[str, float] = {}
        self.steps = 0
        self.blocked: set = set()  # (actor, barrier family) of waits found blocked: coverage

    # --- errors -------------------------------------------------------------------------------
    def fail(self, msg: str):
        raise ProtocolError(msg + "\n  last events:\n    " + "\n    ".join(self.log))

    # --- barriers -----------------------------------------------------------------------------
    def _arrive(self, bar: Barrier, n: int, phase: int, who: str, tx: int = 0):
        if bar.completed != phase:
            self.fail(f"{who}: arrival meant for phase {phase} of {bar.name} lands in phase "
                      f"{bar.completed} (arriver {'ahead' if phase > bar.completed else 'late'})")
        bar.pending -= n
        bar.tx += tx
        if bar.pending < 0:
            self.fail(f"{who}: too many arrivals on {bar!r}")
        self._maybe_complete(bar)

    def _maybe_complete(self, bar: Barrier):
        if bar.pending == 0 and bar.tx == 0:
            bar.completed += 1
            bar.pending = bar.count

    def _check_pending_wait(self, actor: str, op):
        _, bar, _, phase = op
        if not phase <= bar.completed <= phase + 1:
            self.fail(f"{actor}: waits for phase {phase} of {bar.name} (parity {op[2]}) but "
                      f"{bar.completed} phases have completed: parity alias")

    # --- resources ----------------------------------------------------------------------------
    def _free_tmem(self, unit, actor: str) -> None:
        """tcgen05.dealloc by ``actor`` on ``unit`` (this CTA, or one CTA of a grid): every MMA
        issued there must have completed."""
        if unit.tensor_queue:
            self.fail(f"{actor}: TMEM freed with {len(unit.tensor_queue)} MMAs in flight")
        unit.tmem_freed = True

    def _issue_mma(self, unit, reads, writes, what) -> None:
        """tcgen05.mma issued on ``unit``'s tensor pipe (anything with ``tensor_queue`` and
        ``mma_issued``: the CTA here, one CTA of a grid in the backward model): its operands
        are busy until it completes, in issue order."""
        for res, _ in reads:
            self._check_free(res, "tensor", False)
        for res, _ in writes:
            self._check_free(res, "tensor", True)
        for res, _ in reads:
            res.inflight.append(("tensor", False))
        for res, _ in writes:
            res.inflight.append(("tensor", True))
        unit.tensor_queue.append((reads, writes, what))
        unit.mma_issued += 1

    def _check_free(self, res: Resource, unit: str, write: bool):
        if res.tmem and self.tmem_freed:
            self.fail(f"{unit}: {res} accessed after the TMEM was freed")
        for other, other_write in res.inflight:
            if (write or other_write) and not (unit == other == "tensor"):
                self.fail(f"{unit}: {'writes' if write else 'reads'} {res} while an in-flight "
                          f"{other} {'write' if other_write else 'read'} holds it")

    def _check_tag(self, res: Resource, expected, who: str):
        if res.tag != expected:
            self.fail(f"{who}: reads {res} expecting {expected}, holds {res.tag}")

    # --- operations ---------------------------------------------------------------------------
    def enabled(self, actor: str, op) -> bool:
        kind = op[0]
        if kind == "wait":
            return op[1].completed % 2 != op[2]  # mbarrier.try_wait.parity
        if kind == "store_wait_read":  # cp.async.bulk.wait_group.read 0
            return not any(s[0] == actor for s in self.tma_stores)
        if kind == "bar_wait":  # named barrier (bar.sync)
            return self.named[op[1]] >= op[2]
        return True

    def execute(self, actor: str, op):
        kind = op[0]
        args = op[1:2] if kind == "record" else op[1:]
        self.log.append(f"{actor}: {kind} {', '.join(map(str, args))}")
        if kind == "wait":
            _, bar, _, phase = op
            if bar.completed != phase + 1:
                self.fail(f"{actor}: wait (parity {op[2]}) meant for phase {phase} of "
                          f"{bar.name} passes with {bar.completed} phases completed")
            self.waits[actor, bar] += 1
        elif kind == "arrive":  # mbarrier.arrive by every thread of the actor
            _, bar, n = op
            self._arrive(bar, n, self.arrives[actor, bar], actor)
            self.arrives[actor, bar] += 1
        elif kind == "arrive_tx":  # mbarrier.arrive.expect_tx (one thread)
            bar = op[1]
            self._arrive(bar, 1, self.arrives[actor, bar], actor, tx=1)
            self.arrives[actor, bar] += 1
        elif kind == "read":
            _, res, expected = op
            self._check_free(res, actor, False)
            self._check_tag(res, expected, actor)
        elif kind == "write":
            _, res, tag = op
            self._check_free(res, actor, True)
            res.tag = tag
        elif kind == "mma":  # tcgen05.mma issue
            self._issue_mma(self, *op[1:])
        elif kind == "commit":  # tcgen05.commit: arrives once the MMAs issued so far complete
            bar = op[1]
            self.commits[bar].append((self.mma_issued, self.arrives["commit", bar]))
            self.arrives["commit", bar] += 1
        elif kind == "tma_load":  # after arrive_tx on ``bar`` by this actor
            _, res, tag, bar = op
            self._check_free(res, "tma", True)
            res.inflight.append(("tma", True))
            self.tma_loads.append((res, tag, bar, self.arrives[actor, bar] - 1))
        elif kind == "tma_store":
            _, res, expected = op
            self._check_free(res, "tma", False)
            res.inflight.append(("tma", False))
            self.tma_stores.append((actor, res, expected))
        elif kind == "bar_arrive":
            self.named[op[1]] += 1
        elif kind == "tmem_free":
            self._free_tmem(self, actor)
        elif kind in ("store_wait_read", "bar_wait"):
            pass
        elif kind == "record":  # bookkeeping of the model (no kernel operation)
            op[2]()
        else:
            raise ValueError(kind)

    # --- asynchronous units -------------------------------------------------------------------
    def complete_mma(self, unit=None, label: str = "tensor"):
        """The oldest MMA of ``unit``'s tensor pipe (default: this CTA's) completes."""
        unit = self if unit is None else unit
        reads, writes, what = unit.tensor_queue.popleft()
        self.log.append(f"{label}: completes {what}")
        for res, expected in reads:
            self._check_tag(res, expected, f"{label} ({what})")
            res.inflight.remove(("tensor", False))
        for res, tag in writes:
            res.tag = tag
            res.inflight.remove(("tensor", True))
        unit.mma_done += 1

    def fire_commit(self, bar: Barrier, unit=None, label: str = "commit"):
        """The oldest pending tcgen05.commit of ``unit`` onto ``bar`` arrives."""
        unit = self if unit is None else unit
        _, phase = unit.commits[bar].popleft()
        self.log.append(f"{label}: arrives on {bar.name}")
        self._arrive(bar, 1, phase, "tcgen05.commit")

    def complete_tma_load(self, i: int):
        res, tag, bar, phase = self.tma_loads.pop(i)
        self.log.append(f"tma: load into {res} {tag} completes on {bar.name}")
        res.tag = tag
        res.inflight.remove(("tma", True))
        if bar.completed != phase:
            self.fail(f"TMA bytes for phase {phase} of {bar.name} land in phase {bar.completed}")
        bar.tx -= 1
        self._maybe_complete(bar)

    def complete_tma_store(self, i: int):
        _, res, expected = self.tma_stores.pop(i)
        self.log.append(f"tma: store from {res} has read it")
        self._check_tag(res, expected, "TMA store")
        res.inflight.remove(("tma", False))

    # --- scheduler ----------------------------------------------------------------------------
    def spawn(self, name: str, gen):
        self.actors[name] = [gen, None]
        self.weights[name] = 1.0
        self._advance(name)

    def _advance(self, name: str):
        entry = self.actors[name]
        entry[1] = next(entry[0], None)

    def _draw_weights(self):
        for k in itertools.chain(self.actors, ("tensor", "commit", "tma", "store")):
            self.weights[k] = 10 ** self.rng.uniform(-2.5, 0)

    def run(self, max_steps: int = 200_000):
        rng = self.rng
        self._draw_weights()
        w = self.weights
        while True:
            self.steps += 1
            if self.steps > max_steps:
                self.fail("no progress bound reached (livelock?)")
            if rng.random() < 0.01:
                self._draw_weights()
            events = []
            for name, (_, op) in self.actors.items():
                if op is None:
                    continue
                runnable = self.enabled(name, op)
                if runnable:
                    events.append((w[name], 0, name))
                if op[0] == "wait":
                    self._check_pending_wait(name, op)
                    if not runnable:
                        self.blocked.add((name, op[1].family))
            if self.tensor_queue:
                events.append((w["tensor"], 1, None))
            for bar, q in self.commits.items():
                if q and q[0][0] <= self.mma_done:
                    events.append((w["commit"], 2, bar))
            for i in range(len(self.tma_loads)):
                events.append((w["tma"], 3, i))
            for i in range(len(self.tma_stores)):
                events.append((w["store"], 4, i))
            if not events:
                break
            _, kind, arg = rng.choices(events, weights=[e[0] for e in events])[0]
            if kind == 0:
                self.execute(arg, self.actors[arg][1])
                self._advance(arg)
            elif kind == 1:
                self.complete_mma()
            elif kind == 2:
                self.fire_commit(arg)
            elif kind == 3:
                self.complete_tma_load(arg)
            else:
                self.complete_tma_store(arg)
        stuck = {n: op for n, (_, op) in self.actors.items() if op is not None}
        if stuck:
            self.fail("deadlock: " + "; ".join(
                f"{n} at {op[0]} {', '.join(map(repr, op[1:]))}" for n, op in stuck.items()))


# ---------------------------------------------------------------------------------------------
# cutlass.pipeline.PipelineTmaUmma and PipelineState (cutlass/pipeline/{helpers,sm100}.py)
# ---------------------------------------------------------------------------------------------
class PipelineState:
    """(count, index, phase); the model reads the stage's phase index off ``count``."""

    def __init__(self, stages: int, count: int, index: int, phase: int):
        self.stages, self.count, self.index, self.phase = stages, count, index, phase

    def advance(self):
        self.count += 1
        self.index += 1
        if self.index == self.stages:
            self.index, self.phase = 0, self.phase ^ 1

    def clone(self):
        return PipelineState(self.stages, self.count, self.index, self.phase)


def make_pipeline_state(producer: bool, stages: int) -> PipelineState:
    """Producers start with phase 1 (their first empty waits pass), consumers with 0."""
    return PipelineState(stages, 0, 0, 1 if producer else 0)


class PipelineTmaUmma:
    """full[i]: 1 arrival (arrive.expect_tx) + the TMA bytes; empty[i]: 1 arrival
    (tcgen05.commit)."""

    def __init__(self, name: str, stages: int):
        self.full = [Barrier(f"{name}.full[{i}]", 1) for i in range(stages)]
        self.empty = [Barrier(f"{name}.empty[{i}]", 1) for i in range(stages)]

    def producer_acquire(self, state: PipelineState):
        yield ("wait", self.empty[state.index], state.phase, state.count // state.stages - 1)
        yield ("arrive_tx", self.full[state.index])

    def producer_get_barrier(self, state: PipelineState) -> Barrier:
        return self.full[state.index]

    def consumer_wait(self, state: PipelineState):
        yield ("wait", self.full[state.index], state.phase, state.count // state.stages)

    def consumer_release(self, state: PipelineState):
        yield ("commit", self.empty[state.index])


# ---------------------------------------------------------------------------------------------
# The kernel's roles (jax_fa4/kernels/sm100/flash_fwd.py, FlashAttentionForwardSm100)
# ---------------------------------------------------------------------------------------------
class ForwardModel:
    """One persistent CTA working through ``work`` (n_blocks per work tile, n_min = 0)."""

    def __init__(self, sim: Sim, q_tiles: int, kv_stages: int, varlen: bool, work: list[int]):
        self.sim, self.q_tiles, self.kv_stages, self.varlen = sim, q_tiles, kv_stages, varlen
        self.work = list(work)
        Q = range(q_tiles)
        # kernel(): mbarrier_init counts
        self.bars = {
            "s_full": [Barrier(f"s_full[{b}]", 1) for b in range(2)],
            "stats_full": [Barrier(f"stats_full[{b}]", LANES) for b in range(2)],
            "p_full": [Barrier(f"p_full[{b}]", 2 * LANES) for b in range(2)],
            "o_full": [Barrier(f"o_full[{t}]", 1) for t in Q],
            "sum_full": [Barrier(f"sum_full[{t}]", LANES) for t in Q],
            "sum_empty": [Barrier(f"sum_empty[{t}]", LANES) for t in Q],
            "o_staged": [Barrier(f"o_staged[{t}]", LANES) for t in Q],
            "o_stored": [Barrier(f"o_stored[{t}]", 1) for t in Q]}
        self.pipeline_q = PipelineTmaUmma("q", q_tiles)
        self.pipeline_kv = PipelineTmaUmma("kv", kv_stages)
        # shared memory
        self.sQ = [Resource(f"sQ[{s}]") for s in range(q_tiles)]
        self.sKV = [Resource(f"sKV[{s}]") for s in range(kv_stages)]
        self.sScale = [Resource(f"sScale[:, {b}]") for b in range(2)]
        self.sSum = [Resource(f"sSum[:, {t}]") for t in Q]
        self.sO = [Resource(f"sO[{t}]") for t in Q]
        # TMEM: S_b = columns [b·tile_n, (b+1)·tile_n); P_b aliases its upper half (S_hi)
        self.tS_lo = [Resource(f"S{b}[lower half]", tmem=True) for b in range(2)]
        self.tS_hi = [Resource(f"S{b}[upper half]=P{b}", tmem=True) for b in range(2)]
        self.tO = [Resource(f"O{t}", tmem=True) for t in Q]
        # what left the CTA: (tile, q tile) -> number of stores of that output tile
        self.stored: dict = defaultdict(int)

    # --- shared by the roles ------------------------------------------------------------------
    def slot(self, t, count):
        if self.q_tiles == 2:
            return t, count % 2
        return count % 2, (count // 2) % 2

    def use(self, t, count):
        """The model's phase index behind slot(t, count)'s parity: which use of the S buffer (and
        of its s_full / stats_full / p_full barriers) key block ``count`` is."""
        return count if self.q_tiles == 2 else count // 2

    def tiles(self):
        """The persistent loop: (idx, n_blocks) per work tile (n_max = n_blocks, n_min = 0)."""
        return enumerate(self.work)

    # --- load warp ----------------------------------------------------------------------------
    def load_warp(self):
        pipeline_q = self.pipeline_q
        q_state = make_pipeline_state(True, self.q_tiles)
        kv_state = make_pipeline_state(True, self.kv_stages)
        for idx, n_blocks in self.tiles():
            if n_blocks > 0:
                for t in range(self.q_tiles):
                    yield from pipeline_q.producer_acquire(q_state)
                    yield ("tma_load", self.sQ[q_state.index], ("Q", idx, t),
                           pipeline_q.producer_get_barrier(q_state))
                    q_state.advance()
                    if t == 0:
                        yield from self.load_kv(("K", idx, 0), kv_state)
                for j in range(n_blocks):
                    if self.q_tiles == 2:
                        yield from self.load_kv(("V", idx, j), kv_state)
                    if j + 1 < n_blocks:
                        yield from self.load_kv(("K", idx, j + 1), kv_state)
                    if self.q_tiles == 1:
                        yield from self.load_kv(("V", idx, j), kv_state)

    def load_kv(self, tag, kv_state: PipelineState):
        yield from self.pipeline_kv.producer_acquire(kv_state)
        yield ("tma_load", self.sKV[kv_state.index], tag,
               self.pipeline_kv.producer_get_barrier(kv_state))
        kv_state.advance()

    # --- MMA warp -----------------------------------------------------------------------------
    def mma_warp(self):
        # (the kernel's mma_tile_* return the advanced pipeline states; here they advance in place)
        q_state = make_pipeline_state(False, self.q_tiles)
        kv_state = make_pipeline_state(False, self.kv_stages)
        count = 0
        for idx, n_blocks in self.tiles():
            if n_blocks > 0:
                if self.q_tiles == 2:
                    yield from self.mma_tile_pingpong(q_state, kv_state, count, n_blocks, idx)
                else:
                    yield from self.mma_tile_single(q_state, kv_state, count, n_blocks, idx)
                count += n_blocks

    def gemm_qk(self, q_stage, buf, kv_index, s_full, blk):
        """S[buf] = Q[q_stage]·Kᵀ (``blk`` = (tile, q tile, key block): the model's tags)."""
        idx, t, j = blk
        yield ("mma", [(self.sQ[q_stage], ("Q", idx, t)), (self.sKV[kv_index], ("K", idx, j))],
               [(self.tS_lo[buf], ("S", idx, t, j)), (self.tS_hi[buf], ("S", idx, t, j))],
               f"S{buf} = Q{t}·K{j}ᵀ of tile {idx}")
        yield ("commit", s_full[buf])

    def gemm_pv(self, o_tile, buf, kv_index, accumulate, o_full, blk):
        """O[o_tile] (+)= P[buf]·V."""
        idx, t, j = blk
        reads = [(self.tS_hi[buf], ("P", idx, t, j)), (self.sKV[kv_index], ("V", idx, j))]
        if accumulate:  # O as the correction warpgroup left it for block j
            reads.append((self.tO[o_tile], ("O rescaled", idx, t, j)))
        yield ("mma", reads, [(self.tO[o_tile], ("O", idx, t, j))],
               f"O{o_tile} {'+' if accumulate else ''}= P{buf}·V{j} of tile {idx}")
        yield ("commit", o_full[o_tile])

    def mma_tile_pingpong(self, q_state, kv_state, count, n_blocks, idx):
        pipeline_q, pipeline_kv = self.pipeline_q, self.pipeline_kv
        s_full, p_full, o_full = self.bars["s_full"], self.bars["p_full"], self.bars["o_full"]
        q_states = [q_state.clone()]
        q_state.advance()
        q_states.append(q_state.clone())
        q_state.advance()
        yield from pipeline_q.consumer_wait(q_states[0])
        yield from pipeline_kv.consumer_wait(kv_state)  # K_0
        yield from self.gemm_qk(q_states[0].index, 0, kv_state.index, s_full, (idx, 0, 0))
        yield from pipeline_q.consumer_wait(q_states[1])
        yield from self.gemm_qk(q_states[1].index, 1, kv_state.index, s_full, (idx, 1, 0))
        yield from pipeline_kv.consumer_release(kv_state)
        kv_state.advance()
        if n_blocks == 1:
            for t in range(2):
                yield from pipeline_q.consumer_release(q_states[t])
        for j in range(1, n_blocks):
            v_state = kv_state.clone()
            yield from pipeline_kv.consumer_wait(v_state)  # V_{j-1}
            kv_state.advance()
            yield from pipeline_kv.consumer_wait(kv_state)  # K_j
            for t in range(2):
                yield ("wait", p_full[t], (count + j - 1) % 2, self.use(t, count + j - 1))
                yield from self.gemm_pv(t, t, v_state.index, j > 1, o_full, (idx, t, j - 1))
                yield from self.gemm_qk(q_states[t].index, t, kv_state.index, s_full,
                                        (idx, t, j))
            yield from pipeline_kv.consumer_release(v_state)
            yield from pipeline_kv.consumer_release(kv_state)
            kv_state.advance()
            if j + 1 == n_blocks:
                for t in range(2):
                    yield from pipeline_q.consumer_release(q_states[t])
        yield from pipeline_kv.consumer_wait(kv_state)  # V_last
        for t in range(2):
            yield ("wait", p_full[t], (count + n_blocks - 1) % 2,
                   self.use(t, count + n_blocks - 1))
            yield from self.gemm_pv(t, t, kv_state.index, n_blocks > 1, o_full,
                                    (idx, t, n_blocks - 1))
        yield from pipeline_kv.consumer_release(kv_state)
        kv_state.advance()

    def mma_tile_single(self, q_state, kv_state, count, n_blocks, idx):
        pipeline_q, pipeline_kv = self.pipeline_q, self.pipeline_kv
        s_full, p_full, o_full = self.bars["s_full"], self.bars["p_full"], self.bars["o_full"]
        yield from pipeline_q.consumer_wait(q_state)
        yield from pipeline_kv.consumer_wait(kv_state)  # K_0
        yield from self.gemm_qk(0, count % 2, kv_state.index, s_full, (idx, 0, 0))
        yield from pipeline_kv.consumer_release(kv_state)
        kv_state.advance()
        if n_blocks == 1:
            yield from pipeline_q.consumer_release(q_state)
        for j in range(n_blocks):
            if j + 1 < n_blocks:
                yield from pipeline_kv.consumer_wait(kv_state)  # K_{j+1}
                yield from self.gemm_qk(0, (count + j + 1) % 2, kv_state.index, s_full,
                                        (idx, 0, j + 1))
                yield from pipeline_kv.consumer_release(kv_state)
                kv_state.advance()
                if j + 2 == n_blocks:
                    yield from pipeline_q.consumer_release(q_state)
            buf, phase = self.slot(0, count + j)
            yield ("wait", p_full[buf], phase, self.use(0, count + j))
            yield from pipeline_kv.consumer_wait(kv_state)  # V_j
            yield from self.gemm_pv(0, buf, kv_state.index, j > 0, o_full, (idx, 0, j))
            yield from pipeline_kv.consumer_release(kv_state)
            kv_state.advance()
        q_state.advance()

    # --- softmax warpgroups -------------------------------------------------------------------
    def softmax_wg(self, t):
        bars = self.bars
        s_full, stats_full, p_full = bars["s_full"], bars["stats_full"], bars["p_full"]
        sum_full, sum_empty = bars["sum_full"], bars["sum_empty"]
        count = 0
        sums = 0
        for idx, n_blocks in self.tiles():
            for j in range(n_blocks):
                buf, phase = self.slot(t, count + j)
                yield ("wait", s_full[buf], phase, self.use(t, count + j))
                # cute.copy(ld_s, S[buf]) (the whole row: both halves)
                yield ("read", self.tS_lo[buf], ("S", idx, t, j))
                yield ("read", self.tS_hi[buf], ("S", idx, t, j))
                # row_max_step; sScale[lane, buf] = acc_scale
                yield ("write", self.sScale[buf], ("scale", idx, t, j))
                yield ("arrive", stats_full[buf], LANES)
                # exponentiate: P chunks stored into the upper half of S[buf]
                yield ("write", self.tS_hi[buf], ("P", idx, t, j))
                yield ("arrive", p_full[buf], LANES)
            count += n_blocks
            if n_blocks > 0:
                yield ("wait", sum_empty[t], (sums + 1) % 2, sums - 1)
                yield ("write", self.sSum[t], ("1/sum", idx, t))
                yield ("arrive", sum_full[t], LANES)
                sums += 1

    # --- correction warpgroup -----------------------------------------------------------------
    def correction_wg_loop(self):
        bars = self.bars
        stats_full, p_full, o_full = bars["stats_full"], bars["p_full"], bars["o_full"]
        sum_full, sum_empty = bars["sum_full"], bars["sum_empty"]
        o_staged, o_stored = bars["o_staged"], bars["o_stored"]
        count = 0
        pvs = 0
        sums = 0
        tiles = 0
        for idx, n_blocks in self.tiles():
            for j in range(n_blocks):
                for t in range(self.q_tiles):
                    buf, phase = self.slot(t, count + j)
                    yield ("wait", stats_full[buf], phase, self.use(t, count + j))
                    if j > 0:
                        yield ("read", self.sScale[buf], ("scale", idx, t, j))  # acc_scale
                        yield ("wait", o_full[t], pvs % 2, pvs)
                        # vote_any(acc_scale != 1): rescale_o (modelled as always taken)
                        yield ("read", self.tO[t], ("O", idx, t, j - 1))
                        yield ("write", self.tO[t], ("O rescaled", idx, t, j))
                    yield ("arrive", p_full[buf], LANES)
                if j > 0:
                    pvs += 1
            count += n_blocks
            # ---- epilogue ----
            for t in range(self.q_tiles):
                if n_blocks > 0:
                    yield ("wait", sum_full[t], sums % 2, sums)
                    yield ("read", self.sSum[t], ("1/sum", idx, t))  # inv_sum
                    yield ("arrive", sum_empty[t], LANES)
                    yield ("wait", o_full[t], pvs % 2, pvs)  # the tile's last P·V
                if not self.varlen:
                    yield ("wait", o_stored[t], (tiles + 1) % 2, tiles - 1)
                if n_blocks > 0:
                    yield ("read", self.tO[t], ("O", idx, t, n_blocks - 1))  # ld_o
                if self.varlen:  # each thread stores its row to global memory
                    yield ("record", f"rows of {idx}.{t} stored", self._record_store(idx, t))
                else:
                    yield ("write", self.sO[t], ("O out", idx, t))  # smem_store
                    yield ("arrive", o_staged[t], LANES)
            if n_blocks > 0:
                pvs += 1
                sums += 1
            tiles += 1

    def _record_store(self, idx, t):
        def record():
            self.stored[idx, t] += 1
        return record

    # --- epilogue warp ------------------------------------------------------------------------
    def epilogue_warp(self):
        o_staged, o_stored = self.bars["o_staged"], self.bars["o_stored"]
        tiles = 0
        for idx, _ in self.tiles():
            for t in range(self.q_tiles):
                yield ("wait", o_staged[t], tiles % 2, tiles)
                yield ("tma_store", self.sO[t], ("O out", idx, t))
                yield ("record", f"tile {idx}.{t} stored", self._record_store(idx, t))
                yield ("store_wait_read",)  # cp_async_bulk_wait_group(0, read=True)
                yield ("arrive", o_stored[t], 1)
            tiles += 1

    # --- kernel(): the warp-role dispatch -----------------------------------------------------
    def spawn(self):
        sim = self.sim
        tmem_users = self.q_tiles + 2  # softmax warpgroups, correction warpgroup, MMA warp

        def then_dealloc(gen):
            yield from gen
            yield ("bar_arrive", "dealloc")
            yield ("bar_wait", "dealloc", tmem_users)

        def mma_role():
            yield from then_dealloc(self.mma_warp())
            yield ("tmem_free",)

        for t in range(self.q_tiles):
            sim.spawn(f"softmax{t}", then_dealloc(self.softmax_wg(t)))
        sim.spawn("correction", then_dealloc(self.correction_wg_loop()))
        sim.spawn("mma", mma_role())
        if not self.varlen:
            sim.spawn("epilogue", self.epilogue_warp())
        sim.spawn("load", self.load_warp())

    def check_end(self):
        sim = self.sim
        assert not sim.tensor_queue and not sim.tma_loads and not sim.tma_stores
        assert not any(sim.commits.values())
        every = list(self.bars.values()) + [self.pipeline_q.full, self.pipeline_q.empty,
                                           self.pipeline_kv.full, self.pipeline_kv.empty]
        waits = defaultdict(list)
        for (_actor, bar), n in sim.waits.items():
            waits[bar].append(n)
        for bar in itertools.chain.from_iterable(every):
            if bar.pending != bar.count or bar.tx:
                sim.fail(f"{bar!r} ends inside a phase")
            # one waiting role, which waited on every phase (the producer-side "empty" waits
            # pass phase -1 first and never wait on the last phase: the same number)
            if bar.completed and waits[bar] != [bar.completed]:
                sim.fail(f"{bar!r}: waits per role {waits[bar]}, expected one role waiting on "
                         f"each of its {bar.completed} phases")
        want = {(idx, t): 1 for idx, _ in self.tiles() for t in range(self.q_tiles)}
        if dict(self.stored) != want:
            sim.fail(f"output tiles stored {dict(self.stored)}, expected each once")
        for t in range(self.q_tiles):
            done = [(idx, n) for idx, n in self.tiles() if n > 0]
            if done and self.tO[t].tag != ("O", done[-1][0], t, done[-1][1] - 1):
                sim.fail(f"O{t} ends as {self.tO[t].tag}")


def simulate(q_tiles: int, kv_stages: int, varlen: bool, work: list[int], seed: int) -> Sim:
    sim = Sim(random.Random(seed))
    model = ForwardModel(sim, q_tiles, kv_stages, varlen, work)
    model.spawn()
    try:
        sim.run()
        model.check_end()
    except ProtocolError as e:
        raise ProtocolError(f"q_tiles={q_tiles} kv_stages={kv_stages} varlen={varlen} "
                            f"work={work} seed={seed}: {e}") from None
    return sim


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------
#: (q_tiles, kv_stages, varlen): the quick tier runs one kv_stages per (q_tiles, varlen)
#: (tests/compiled.py), ``--exhaustive`` all twelve.
CASES = per_class([(q, s, v) for q in (1, 2) for s in (3, 2, 5) for v in (False, True)],
                  key=lambda case: (case[0], case[2]))
RUNS_PER_CASE = 250  # with ``--exhaustive``
#: the quick tier's runs per case (every wait is found blocked well within them; the mutation
#: check below runs schedules of its own)
QUICK_RUNS_PER_CASE = 80


def wait_sites(q_tiles: int, varlen: bool) -> set:
    """Every (role, barrier) wait of the kernel."""
    sites = {("load", "q.empty"), ("load", "kv.empty"), ("mma", "q.full"), ("mma", "kv.full"),
             ("mma", "p_full"), ("correction", "stats_full"), ("correction", "o_full"),
             ("correction", "sum_full")}
    sites |= {(f"softmax{t}", b) for t in range(q_tiles) for b in ("s_full", "sum_empty")}
    if not varlen:
        sites |= {("correction", "o_stored"), ("epilogue", "o_staged")}
    return sites


@pytest.mark.parametrize("q_tiles,kv_stages,varlen", CASES)
def test_protocol_random_schedules(q_tiles, kv_stages, varlen):
    """No deadlock, parity alias, arrival overrun or data hazard under random schedules over
    random persistent work lists; and the schedules were adversarial enough that every wait of
    the kernel was found blocked in some run (each wait mattered at least once)."""
    rng = random.Random(f"{q_tiles}-{kv_stages}-{varlen}")
    blocked = set()
    for _ in range(RUNS_PER_CASE if compiled.EXHAUSTIVE else QUICK_RUNS_PER_CASE):
        work = [rng.choice(N_BLOCKS_CHOICES) for _ in range(rng.randint(1, 6))]
        blocked |= simulate(q_tiles, kv_stages, varlen, work, rng.getrandbits(32)).blocked
    assert blocked == wait_sites(q_tiles, varlen), wait_sites(q_tiles, varlen) ^ blocked


@pytest.mark.parametrize("q_tiles", (1, 2))
def test_protocol_every_short_work_list(q_tiles):
    """Every work list of up to 3 tiles over N_BLOCKS_CHOICES (tile-boundary cases: a tile of 0
    or 1 block between longer ones), a few schedules each."""
    seed = itertools.count()
    for k in (1, 2, 3):
        for work in itertools.product(N_BLOCKS_CHOICES, repeat=k):
            for kv_stages in (2, 3):
                for varlen in (False, True):
                    simulate(q_tiles, kv_stages, varlen, list(work), next(seed))


def test_model_catches_a_missing_empty_wait():
    """The machine itself: a producer that skips the consumer's release overruns the ring (a
    TMA write into a stage an MMA still reads, or a parity alias), on some schedule."""

    def run(seed):
        sim = Sim(random.Random(seed))
        full, empty = Barrier("full", 1), Barrier("empty", 1)
        stage = Resource("stage")

        def producer():
            for i in range(4):
                yield ("arrive_tx", full)
                yield ("tma_load", stage, i, full)

        def consumer():
            for i in range(4):
                yield ("wait", full, i % 2, i)
                yield ("mma", [(stage, i)], [], f"read {i}")
                yield ("commit", empty)

        sim.spawn("producer", producer())
        sim.spawn("consumer", consumer())
        sim.run()

    with pytest.raises(ProtocolError):
        for seed in range(50):
            run(seed)
