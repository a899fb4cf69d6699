"""The sm100 backward kernel's synchronisation protocol, checked on a CPU by a discrete-event model.

jax_fa4/kernels/sm100/bwd.py can be compiled here but never run (no Blackwell GPU): its mbarrier,
named-barrier, bulk-group and semaphore protocol must be right by construction. This file
transcribes every role of the kernel as a Python generator, statement for statement in the order
of the kernel's waits, arrives, MMA issues, commits, TMA copies, TMA reduce-adds, semaphore
operations and shared / tensor memory accesses, with the kernel's method names (load_warp,
mma_warp, compute_warps + epilogue, reduce_warps; PipelineTmaUmma / PipelineAsync's
producer_acquire / producer_commit / consumer_wait / consumer_release) and barrier names, counts
and parity formulas, and runs a whole grid of CTAs (key blocks × heads) under random schedules.

The machine is the forward model's (tests/test_sm100_fwd_protocol.py: Barrier, Resource, Sim,
PipelineState, PipelineTmaUmma, imported, not copied) extended by ``BwdSim``:
  * several CTAs at once, each with its own tensor pipe (tcgen05 MMAs execute and complete in
    issue order per CTA; a tcgen05.commit arrives once the CTA's MMAs issued before it are done),
    its own mbarriers, shared memory and TMEM; CTAs launch in linear-id order (key block fastest,
    then head) into a random number of SM slots, a slot frees when all of the CTA's warps exit
    (the launch-order assumption of docs/kernels/sm100.md);
  * arrive.expect_tx of several TMA copies (K and V share one kv stage: transaction count 2);
  * PipelineAsync (cutlass/pipeline/sm90.py): full = 32 producer-thread arrivals (the load warp's
    producer_commit), empty = 256 consumer-thread arrivals (every compute thread's
    consumer_release), waits with the PipelineState parity;
  * TMA reduce-adds (cp.reduce.async.bulk.tensor) as bulk async-groups of the issuing thread: the
    shared-memory read completes at a random later time, the global add after it;
    cp.async.bulk.wait_group N [.read] waits for all but N of the thread's groups to have read
    (.read) or completed; the add of key block n into dq_accum[b, h, m, chunk] is recorded when it
    completes;
  * the deterministic semaphore: ``ld.global.acquire`` spin until dq_semaphore[b, h, m] == turn,
    ``red.release.add 1``; a spinner whose semaphore has passed its turn hangs forever (error);
  * named barriers (bar.sync) by cumulative arrival count (TMEM_ALLOC, TMEM_DEALLOC, REDUCE).
Actors: one per warp (a warp's threads behave identically; an mbarrier arrive of a warp counts
32): the load warp (13), the MMA warp (12, its elected thread), the 8 compute warps (4-11: warpgroup
wg = query columns [64wg, 64wg+64), warp % 4 = TMEM lane quarter = key rows), the 4 reduce warps
(0-3: lane quarter = dQ query rows). Each warp of a warpgroup runs on its own: the kernel has no
warpgroup barrier in the compute warps.

Checks (as the forward model's): try_wait.parity passes exactly as the hardware does, and every
wait also names the phase index it means (j behind j % 2, j − 1 behind (j − 1) % 2,
PipelineState.count // stages [− 1 for producers]); a wait passing with another number of phases
completed, or pending with its barrier two phases ahead, is a parity alias; an actor's n-th arrive
(a commit's n-th arrival, a TMA's bytes) must land in phase n. Data: every buffer is a resource
with the tag of its last write, each reader names the tag it expects; asynchronous accesses (MMA
reads / writes, TMA loads, TMA reduce-add reads of the dQ staging) hold their resource from issue
to completion, a conflicting overlapping access is a hazard. Resources: sK, sV, the sQ / sdO /
sLSE / sDelta stages, sdS (per compute warpgroup × key lane quarter: the rows a warp stores), the
sdQ staging stages (per reduce warp's 32 rows), TMEM in cells of 32 lanes × 8 columns at the
kernel's offsets (Sᵀ, Pᵀ in Sᵀ's columns [64w, 64w+32) and the dV MMA's two Pᵀ views (base Sᵀ+0
for k-blocks 0-3, Sᵀ+32 for 4-7, 8 columns per k-block), dPᵀ with dQ in its first D columns, dK,
dV). Teardown: TMEM freed only after every TMEM user passed the dealloc barrier, no MMA in flight;
a CTA exits with no TMA reduce-add still reading its shared memory. At the end: no deadlock; every
barrier between phases with the expected phase count and the expected waits per warp; each
compute warp read dK / dV of the last query block; every dQ contribution (key block n → query
block m, chunk c) added exactly once, and for deterministic configs in rank order, the adds of
rank r completing only after those of rank r − 1 (recorded at completion: a release before the
adds completed shows as an out-of-order add).

Not modelled (cannot be, here): the memory model (fence.proxy.async between st.shared and the
tensor core / TMA, the visibility of TMA reduce-add results behind red.release / ld.acquire, the
tcgen05.wait::ld / wait::st fences: an access is modelled at the point the kernel's fence
completes it), TMEM / shared-memory layouts beyond column ranges (the dV MMA's Pᵀ k-block
placement is modelled as 8 columns per 16-element k-block), the MMAs' internal k-block loop, the
arithmetic. The tensor pipe is assumed to execute a CTA's MMAs in issue order, so a later MMA
may overwrite what an earlier one reads (the forward model's assumption; FA4 relies on it too).

Varlen (``simulate_varlen``): the grid is the backend's work list (jax_fa4.backends.sm90.
work_table, both launch orders) × heads over random packed batches; each CTA is the same BwdCta
with its work row's sequence lengths, key block and first dq_accum tile (the kernel's varlen mode
changes no barrier, role or phase: spare rows, sequences without queries and key blocks no query
block sees run count = 0), its dQ adds checked against its own sequence's tiles (tiles of two
sequences never coincide), and the ZERO_PADDING item's compute warps zeroing the padding rows
after the TMEM dealloc barrier, once per head.

Checked under random schedules (random per-unit speeds, re-drawn now and then) over random grids:
masks none / causal / local (random windows, -1 = unbounded), odd lengths up to 3 query × 4 key
blocks, 1-2 heads, 1 SM slot up to the whole grid resident, softcap on / off, deterministic on /
off, the shipped tunings of d64 / d96 / d128 and accepted stage-count variants (q_stages ≠
do_stages, dq_stages 1-3, dq_cols 16 / 32). Found: ``q_stages=1`` (then accepted by
Sm100BwdConfig.validate, shipped nowhere) deadlocks on every schedule once a CTA visits two query
blocks; validate now refuses it (test_one_q_stage_deadlocks_and_is_refused). Redundant in the
current MMA order (mutating them changes no outcome): the ds_empty wait (dp_full_j's commit follows
dK_{j−1}) and the lse.empty wait (q.empty of the same stage comes later).
"""

from __future__ import annotations

import itertools
import random
import re
from collections import defaultdict, deque
from functools import partial

import jax
import pytest
import compiled
from compiled import per_class
from test_sm100_fwd_protocol import (
    Barrier,
    PipelineState,
    PipelineTmaUmma,
    ProtocolError,
    Resource,
    Sim,
    make_pipeline_state,
)

from jax_fa4.backends import sm90
from jax_fa4.kernels.common.geometry import BwdBlocks
from jax_fa4.kernels.sm100.bwd_config import TUNING_TABLE, Sm100BwdConfig

WARP = 32
NUM_COMPUTE = 8 * WARP  # compute warps 4-11
NUM_REDUCE = 4 * WARP  # reduce warps 0-3
TMEM_USERS = 4 + 8 + 1  # warps at the TMEM_ALLOC / TMEM_DEALLOC named barriers
CELL = 8  # TMEM columns per modelled cell
TILE = 128  # tile_m = tile_n

#: The backend's varlen tables the launches are built from, under one jit each (static: the
#: int, window and order arguments): called eagerly, each of their operations compiled anew
#: for every new shape of the random grids (most of the varlen checks' time); jitted, one
#: program per shape gives the same integers, as inside the backend's calls.
work_table = jax.jit(sm90.work_table, static_argnums=(2, 3, 4, 5, 6))
first_tiles = jax.jit(sm90.first_tiles, static_argnums=1)


# ---------------------------------------------------------------------------------------------
# cutlass.pipeline.PipelineAsync (sm90.py) and PipelineTmaUmma with several TMA copies per stage
# ---------------------------------------------------------------------------------------------
class PipelineAsync:
    """full[i]: ``producers`` thread arrivals (producer_commit); empty[i]: ``consumers`` thread
    arrivals (consumer_release); both waits are try_wait.parity(state.phase)."""

    def __init__(self, name: str, stages: int, producers: int, consumers: int):
        self.full = [Barrier(f"{name}.full[{i}]", producers) for i in range(stages)]
        self.empty = [Barrier(f"{name}.empty[{i}]", consumers) for i in range(stages)]

    def producer_acquire(self, state: PipelineState):
        yield ("wait", self.empty[state.index], state.phase, state.count // state.stages - 1)

    def producer_commit(self, state: PipelineState, threads: int):
        yield ("arrive", self.full[state.index], threads)

    def consumer_wait(self, state: PipelineState):
        yield ("wait", self.full[state.index], state.phase, state.count // state.stages)

    def consumer_release(self, state: PipelineState, threads: int):
        yield ("arrive", self.empty[state.index], threads)


class PipelineTmaUmmaTx(PipelineTmaUmma):
    """PipelineTmaUmma whose stage is filled by ``copies`` TMA copies (one expect_tx of their
    summed bytes: the model's transaction count is the number of copies)."""

    def __init__(self, name: str, stages: int, copies: int):
        super().__init__(name, stages)
        self.copies = copies

    def producer_acquire(self, state: PipelineState):
        for op in super().producer_acquire(state):
            yield op + (self.copies,) if op[0] == "arrive_tx" else op


# ---------------------------------------------------------------------------------------------
# Machine: the forward model's Sim, for a grid of CTAs
# ---------------------------------------------------------------------------------------------
class Reduce:
    """One in-flight TMA reduce-add (its own bulk async-group)."""

    __slots__ = ("actor", "contrib", "expected", "key", "read_done", "seq", "stage")

    def __init__(self, actor, seq, stage, expected, key, contrib):
        self.actor, self.seq, self.stage, self.expected = actor, seq, stage, expected
        self.key, self.contrib = key, contrib
        self.read_done = False


def role_of(actor: str) -> str:
    """'c3.compute1.2' -> 'compute', 'c0.reduce0' -> 'reduce'."""
    return re.sub(r"[\d.]", "", actor.split(".", 1)[1])


class BwdSim(Sim):
    def __init__(self, rng: random.Random, slots: int, deterministic: bool):
        super().__init__(rng)
        self.slots, self.deterministic = slots, deterministic
        self.pending: deque = deque()  # CTAs not launched yet, in launch order
        self.resident: list = []  # launched, some warp still running
        self.launched: list = []
        self.actor_cta: dict = {}
        self.reduces: list[Reduce] = []
        self.groups: dict = defaultdict(int)  # bulk async-groups committed per thread
        self.sems: dict = defaultdict(int)  # dq_semaphore[b, h, m]
        self.dq_accum: dict = defaultdict(list)  # (b, h, m, chunk) -> key blocks, in add order
        self.visitors: dict = {}  # (b, h, m) -> key blocks visiting m, in rank order
        self.padding_zeroed: dict = defaultdict(list)  # varlen: head -> (cta, wg, quarter)
        self.units = ["commit", "tma", "reduce_read", "reduce_write", "launch"]

    # --- actors -------------------------------------------------------------------------------
    def spawn(self, name: str, gen, cta=None):
        self.actors[name] = [gen, None]
        self.actor_cta[name] = cta
        self.weights[name] = 10 ** self.rng.uniform(-2.5, 0)
        cta.live += 1
        self._advance(name)

    def _advance(self, name: str):
        entry = self.actors[name]
        op = entry[1] = next(entry[0], None)
        if op is None:
            del self.actors[name]
            cta = self.actor_cta[name]
            cta.live -= 1
            if cta.live == 0:
                self._retire(cta)
            return
        kind = op[0]
        if kind == "wait":
            self._check_pending_wait(name, op)
        elif kind == "sem_wait":
            self._check_sem(name, op)
        if kind in ("wait", "bar_wait", "bulk_wait", "sem_wait") and not self.enabled(name, op):
            family = {"wait": lambda: op[1].family, "bar_wait": lambda: f"bar.{op[1][1]}",
                      "bulk_wait": lambda: f"bulk_wait.{'read' if op[2] else 'all'}",
                      "sem_wait": lambda: "dq_semaphore"}[kind]()
            self.blocked.add((role_of(name), family))

    def _retire(self, cta):
        self.resident.remove(cta)
        if cta.tensor_queue:
            self.fail(f"CTA {cta.id} exits with {len(cta.tensor_queue)} MMAs in flight")
        if any(r.actor.startswith(f"c{cta.id}.") and not r.read_done for r in self.reduces):
            self.fail(f"CTA {cta.id} exits while a TMA reduce-add still reads its sdQ")
        if any(res in cta.smem for res, *_ in self.tma_loads):
            self.fail(f"CTA {cta.id} exits with a TMA load into its shared memory in flight")
        cta.retired = True

    def _draw_weights(self):
        for k in itertools.chain(self.actors, self.units,
                                 (f"tensor{c.id}" for c in self.launched)):
            self.weights[k] = 10 ** self.rng.uniform(-2.5, 0)

    # --- barriers -----------------------------------------------------------------------------
    def _maybe_complete(self, bar: Barrier):
        before = bar.completed
        super()._maybe_complete(bar)
        if bar.completed != before:  # waiters must not fall two phases behind (parity alias)
            for name, (_, op) in self.actors.items():
                if op[0] == "wait" and op[1] is bar:
                    self._check_pending_wait(name, op)

    def _check_sem(self, actor: str, op):
        if self.sems[op[1]] > op[2]:
            self.fail(f"{actor}: spins for turn {op[2]} of dq_semaphore{op[1]}, which is already "
                      f"{self.sems[op[1]]}: it never sees its turn")

    def _check_free(self, res: Resource, unit: str, write: bool):
        if res.tmem and res.tmem.tmem_freed:
            self.fail(f"{unit}: {res} accessed after the TMEM was freed")
        for other, other_write in res.inflight:
            if (write or other_write) and not (unit == other == "tensor"):
                self.fail(f"{unit}: {'writes' if write else 'reads'} {res} while an in-flight "
                          f"{other} {'write' if other_write else 'read'} holds it")

    # --- operations ---------------------------------------------------------------------------
    def enabled(self, actor: str, op) -> bool:
        kind = op[0]
        if kind == "wait":
            return op[1].completed % 2 != op[2]
        if kind == "bar_wait":
            return self.named[op[1]] >= op[2]
        if kind == "bulk_wait":  # cp.async.bulk.wait_group n [.read]: every bulk group of the
            _, n, read = op  # thread but the n most recent has read its source (.read) / completed
            older = self.groups[actor] - n
            return not any(r.actor == actor and r.seq < older and not (read and r.read_done)
                           for r in self.reduces)
        if kind == "sem_wait":  # while (ld.acquire(sem) != turn)
            return self.sems[op[1]] == op[2]
        return True

    def execute(self, actor: str, op):
        kind = op[0]
        if kind in ("wait", "arrive", "bar_arrive", "bar_wait", "record", "tma_load"):
            return super().execute(actor, op)
        cta = self.actor_cta[actor]
        self.log.append(f"{actor}: {kind} " + (op[-1] if kind in ("mma", "access") else
                                                ", ".join(map(str, op[1:]))))
        if kind == "access":  # thread loads / stores (shared memory, tcgen05.ld / st)
            for res, tag, write in op[1]:
                self._check_free(res, actor, write)
                if write:
                    res.tag = tag
                else:
                    self._check_tag(res, tag, actor)
        elif kind == "arrive_tx":  # mbarrier.arrive.expect_tx(bytes of op[2] copies)
            bar = op[1]
            self._arrive(bar, 1, self.arrives[actor, bar], actor, tx=op[2] if len(op) > 2 else 1)
            self.arrives[actor, bar] += 1
        elif kind == "mma":
            self._issue_mma(cta, *op[1:])
        elif kind == "commit":
            bar = op[1]
            cta.commits[bar].append((cta.mma_issued, self.arrives["commit", bar]))
            self.arrives["commit", bar] += 1
        elif kind == "tma_reduce":  # cp.reduce.async.bulk.tensor.add + commit_group
            _, stage, expected, key, contrib = op
            for res in stage:
                self._check_free(res, "tma", False)
                res.inflight.append(("tma", False))
            self.reduces.append(Reduce(actor, self.groups[actor], stage, expected, key, contrib))
            self.groups[actor] += 1
        elif kind == "sem_add":  # red.release.gpu.add 1
            self.sems[op[1]] += 1
            for name, (_, other) in self.actors.items():
                if other[0] == "sem_wait" and other[1] == op[1]:
                    self._check_sem(name, other)
        elif kind == "tmem_free":
            self._free_tmem(cta, actor)
        elif kind in ("bulk_wait", "sem_wait"):
            pass
        else:
            raise ValueError(kind)

    # --- asynchronous units -------------------------------------------------------------------
    def complete_mma_of(self, cta):
        self.complete_mma(cta, f"c{cta.id}.tensor")

    def fire_commit_of(self, cta, bar: Barrier):
        self.fire_commit(bar, cta, f"c{cta.id}.commit")

    def complete_reduce_read(self, r: Reduce):
        self.log.append(f"tma: reduce-add of {r.key} from {r.actor} has read {r.stage[0].name}")
        for res in r.stage:
            self._check_tag(res, r.expected, f"TMA reduce-add from {r.actor}")
            res.inflight.remove(("tma", False))
        r.read_done = True

    def complete_reduce_write(self, r: Reduce):
        self.log.append(f"tma: reduce-add of key block {r.contrib} into dq_accum{r.key} done")
        self.reduces.remove(r)
        done = self.dq_accum[r.key]
        want = self.visitors.get(r.key[:3], [])
        if r.contrib not in want or r.contrib in done:
            self.fail(f"key block {r.contrib} adds into dq_accum{r.key} again or unexpectedly "
                      f"(visitors {want}, added {done})")
        if self.deterministic and want[len(done)] != r.contrib:
            self.fail(f"deterministic order broken: key block {r.contrib} adds into "
                      f"dq_accum{r.key} after {done} (order {want})")
        done.append(r.contrib)

    # --- scheduler ----------------------------------------------------------------------------
    def run(self, max_steps: int = 400_000):
        """Fire one enabled event at a time, drawn by the (re-drawn now and then) weights, until
        none is left; then fail unless every actor finished (deadlock)."""
        rng, actors, weights, enabled = self.rng, self.actors, self.weights, self.enabled
        self._draw_weights()
        while True:
            self.steps += 1
            if self.steps > max_steps:
                self.fail("no progress bound reached (livelock?)")
            if rng.random() < 0.01:
                self._draw_weights()
            # (weight, fire): an actor's step as its name (the most events, each step: no
            # callable built for them), the other events as callables
            events: list = [(weights[name], name) for name, (_, op) in actors.items()
                            if enabled(name, op)]
            for cta in self.launched:
                self.pipe_events(cta, events)
            for i in range(len(self.tma_loads)):
                events.append((self.weights["tma"], partial(self.complete_tma_load, i)))
            self.copy_events(events)
            for r in self.reduces:
                if r.read_done:
                    events.append((self.weights["reduce_write"],
                                   partial(self.complete_reduce_write, r)))
                else:
                    events.append((self.weights["reduce_read"],
                                   partial(self.complete_reduce_read, r)))
            self.launch_events(events)
            if not events:
                break
            fire = rng.choices([fire for _, fire in events], weights=[w for w, _ in events])[0]
            if fire.__class__ is str:
                self.step_actor(fire)
            else:
                fire()
        if self.unfinished():
            self.fail("deadlock: " + "; ".join(
                f"{n} at {op[0]} {', '.join(map(repr, op[1:3]))}"
                for n, (_, op) in self.actors.items())
                + (f"; {len(self.pending)} {self.launch_unit}s never launched"
                   if self.pending else ""))

    # --- the event kinds (PairSim, the 2-CTA model, overrides these) ---------------------------
    launch_unit = "CTA"

    def step_actor(self, name: str):
        self.execute(name, self.actors[name][1])
        self._advance(name)

    def pipe_events(self, cta, events: list):
        """The CTA's tensor pipe: complete its oldest MMA; fire a commit whose MMAs are done."""
        if cta.tensor_queue:
            events.append((self.weights[f"tensor{cta.id}"], partial(self.complete_mma_of, cta)))
        for bar, q in cta.commits.items():
            if q and q[0][0] <= cta.mma_done:
                events.append((self.weights["commit"], partial(self.fire_commit_of, cta, bar)))

    def copy_events(self, events: list):
        """Shared-memory copies between CTAs (none in the 1-CTA kernel)."""

    def launch_events(self, events: list):
        if self.pending and len(self.resident) < self.slots:
            events.append((self.weights["launch"], self.launch_next))

    def launch_next(self):
        cta = self.pending.popleft()
        self.log.append(f"launch CTA {cta.id} (n_block {cta.n_block}, head {cta.head})")
        self.resident.append(cta)
        self.launched.append(cta)
        self.weights[f"tensor{cta.id}"] = 10 ** self.rng.uniform(-2.5, 0)
        cta.spawn()

    def unfinished(self) -> bool:
        return bool(self.actors or self.pending)


# ---------------------------------------------------------------------------------------------
# One CTA of the kernel (jax_fa4/kernels/sm100/bwd.py, FlashAttentionBackwardSm100)
# ---------------------------------------------------------------------------------------------
class BwdCta:
    def __init__(self, sim: BwdSim, cfg: Sm100BwdConfig, blocks: BwdBlocks, cta_id: int,
                 n_block: int, head: int, batch: int = 0, dq_tile0: int = 0, contrib=None,
                 zero_padding: bool = False, seg_range: tuple[int, int] | None = None):
        """``dq_tile0``, ``contrib``, ``zero_padding``: varlen (one work row): the sequence's
        first dq_accum tile, the (sequence, key block) its adds are recorded as, and whether it
        is the ZERO_PADDING item (its compute warps zero the dK / dV rows outside every
        sequence after the TMEM dealloc barrier). ``seg_range``: segment ids, the key block's
        [m_lo, m_hi) of the seg_keys table, intersected with the mask's range as kernel() does
        (its load warp then also stages the rows' ids and the block's mask flag with -lse /
        -delta, which the compute warps read with sLSE)."""
        self.sim, self.cfg, self.blocks, self.id = sim, cfg, blocks, cta_id
        self.n_block, self.head, self.batch = n_block, head, batch
        self.dq_tile0, self.zero_padding = dq_tile0, zero_padding
        self.contrib = n_block if contrib is None else contrib
        self.D = cfg.head_dim
        self.off = cfg.tmem_offsets()
        self.m_min, m_max = blocks.m_block_range(n_block)
        if seg_range is not None:
            assert cfg.segments
            self.m_min, m_max = max(self.m_min, seg_range[0]), min(m_max, seg_range[1])
        self.count = max(m_max - self.m_min, 0)
        self.live, self.retired = 0, False
        self.tensor_queue: deque = deque()
        self.mma_issued = self.mma_done = 0
        self.commits: dict = defaultdict(deque)
        self.tmem_freed = False
        self.stored: dict = defaultdict(int)
        self.reduce_syncs = [0] * 4
        p = f"c{cta_id}"

        def bar(name, count):
            b = Barrier(f"{p}.{name}", count)
            b.family = name
            return b

        # kernel(): mbarrier_init counts of mbar_sig
        self.s_full, self.p_full = bar("s_full", 1), bar("p_full", NUM_COMPUTE)
        self.dp_full, self.ds_full = bar("dp_full", 1), bar("ds_full", NUM_COMPUTE)
        self.ds_empty, self.dq_full = bar("ds_empty", 1), bar("dq_full", 1)
        self.dq_empty, self.dkv_full = bar("dq_empty", NUM_REDUCE), bar("dkv_full", 1)
        self.pipeline_kv = PipelineTmaUmmaTx(f"{p}.kv", 1, copies=2)  # K and V
        self.pipeline_q = PipelineTmaUmma(f"{p}.q", cfg.q_stages)
        self.pipeline_do = PipelineTmaUmma(f"{p}.do", cfg.do_stages)
        self.pipeline_lse = PipelineAsync(f"{p}.lse", cfg.q_stages, WARP, NUM_COMPUTE)
        self.pipelines = (self.pipeline_kv, self.pipeline_q, self.pipeline_do, self.pipeline_lse)
        for pl in self.pipelines:
            for b in pl.full + pl.empty:
                b.family = b.family.split(".", 1)[1]
        # shared memory
        R = Resource
        self.sK, self.sV = R(f"{p}.sK"), R(f"{p}.sV")
        self.sQ = [R(f"{p}.sQ[{s}]") for s in range(cfg.q_stages)]
        self.sdO = [R(f"{p}.sdO[{s}]") for s in range(cfg.do_stages)]
        self.sLSE = [R(f"{p}.sLSE[:, {s}]") for s in range(cfg.q_stages)]
        self.sDelta = [R(f"{p}.sDelta[:, {s}]") for s in range(cfg.q_stages)]
        # segment ids: the rows' ids and the block's mask flag, staged with -lse / -delta
        self.sSeg = [R(f"{p}.sSegIds[:, {s}] / sSegMask[{s}]") for s in range(cfg.q_stages)]
        # sdS (tm, tn): warp (wg, quarter) stores query rows [64wg, 64wg+64) of its 32 keys
        self.sdS = [[R(f"{p}.sdS[rows {64 * wg}+, keys {32 * q}+]") for q in range(4)]
                    for wg in range(2)]
        # dQ staging: reduce warp w writes rows [32w, 32w+32) of the stage
        self.sdQ = [[R(f"{p}.sdQ[{s}][rows {32 * w}+]") for w in range(4)]
                    for s in range(cfg.dq_stages)]
        self.smem = set(itertools.chain(
            (self.sK, self.sV), self.sQ, self.sdO, self.sLSE, self.sDelta, self.sSeg,
            itertools.chain.from_iterable(self.sdS), itertools.chain.from_iterable(self.sdQ)))
        # TMEM (512 columns allocated): cells of 32 lanes × CELL columns
        regions = sorted((v, k) for k, v in self.off.items() if k != "dq")
        self.tmem = []
        for q in range(4):
            row = []
            for c in range(512 // CELL):
                col = c * CELL
                base, name = max((r for r in regions if r[0] <= col), default=(0, "?"))
                res = R(f"{p}.TMEM[{name}+{col - base}:+{CELL}, lanes {32 * q}+]", tmem=True)
                res.tmem = self
                row.append(res)
            self.tmem.append(row)

    def cells(self, quarters, lo: int, hi: int) -> list:
        assert lo % CELL == 0 and hi % CELL == 0, (lo, hi)
        return [self.tmem[q][c] for q in quarters for c in range(lo // CELL, hi // CELL)]

    ALL = range(4)

    # --- load warp ----------------------------------------------------------------------------
    def load_warp(self):
        pipeline_kv, pipeline_q = self.pipeline_kv, self.pipeline_q
        pipeline_do, pipeline_lse = self.pipeline_do, self.pipeline_lse
        q_state = make_pipeline_state(True, self.cfg.q_stages)
        do_state = make_pipeline_state(True, self.cfg.do_stages)
        if self.count > 0:
            kv_state = make_pipeline_state(True, 1)
            yield from pipeline_kv.producer_acquire(kv_state)
            yield ("tma_load", self.sK, ("K", self.n_block),
                   pipeline_kv.producer_get_barrier(kv_state))
            yield ("tma_load", self.sV, ("V", self.n_block),
                   pipeline_kv.producer_get_barrier(kv_state))
        for j in range(self.count):
            m_block = self.m_min + j
            yield from pipeline_q.producer_acquire(q_state)
            yield ("tma_load", self.sQ[q_state.index], ("Q", m_block),
                   pipeline_q.producer_get_barrier(q_state))
            yield from pipeline_do.producer_acquire(do_state)
            yield ("tma_load", self.sdO[do_state.index], ("dO", m_block),
                   pipeline_do.producer_get_barrier(do_state))
            # -lse_log2 / -delta of the block's rows; the lse stage follows the Q stage
            yield from pipeline_lse.producer_acquire(q_state)
            staged = [(self.sLSE[q_state.index], ("lse", m_block), True),
                      (self.sDelta[q_state.index], ("delta", m_block), True)]
            if self.cfg.segments:  # stage_stats: the rows' ids, the block's mask flag
                staged.append((self.sSeg[q_state.index], ("ids", m_block), True))
            yield ("access", staged,
                   f"sLSE / sDelta[:, {q_state.index}] = -lse / -delta of m={m_block}")
            yield from pipeline_lse.producer_commit(q_state, WARP)
            q_state.advance()
            do_state.advance()

    # --- MMA warp -----------------------------------------------------------------------------
    def mma_warp(self):
        cfg, D, off = self.cfg, self.D, self.off
        pipeline_kv, pipeline_q, pipeline_do = self.pipeline_kv, self.pipeline_q, self.pipeline_do
        s_full, p_full, dp_full, ds_full = self.s_full, self.p_full, self.dp_full, self.ds_full
        ds_empty, dq_full, dq_empty, dkv_full = (self.ds_empty, self.dq_full, self.dq_empty,
                                                 self.dkv_full)
        ALL, cells = self.ALL, self.cells
        n = self.n_block
        sdS_all = [(r, None) for r in itertools.chain.from_iterable(self.sdS)]
        cw = TILE // 2
        # the dV MMA's Pᵀ operand: views at Sᵀ + 0 (k-blocks 0-3) and Sᵀ + cw/2 (4-7), a k-block
        # of 16 16-bit query columns = 8 32-bit TMEM columns
        num_kb_p = TILE // 16
        p_cols = [off["s"] + (0 if k < num_kb_p // 2 else cw // 2) + 8 * k
                  for k in range(num_kb_p)]

        q_state = make_pipeline_state(False, cfg.q_stages)
        q_release = make_pipeline_state(False, cfg.q_stages)
        do_state = make_pipeline_state(False, cfg.do_stages)
        if self.count > 0:
            kv_state = make_pipeline_state(False, 1)
            yield from pipeline_kv.consumer_wait(kv_state)
        for j in range(self.count + 1):
            if j < self.count:
                # Sᵀ_j = K·Q_jᵀ
                yield from pipeline_q.consumer_wait(q_state)
                yield ("mma", [(self.sK, ("K", n)), (self.sQ[q_state.index],
                                                     ("Q", self.m_min + j))],
                       [(r, ("S", j)) for r in cells(ALL, off["s"], off["s"] + TILE)],
                       f"S{j} = K·Q{j}ᵀ")
                yield ("commit", s_full)
                q_state.advance()
            if j > 0:
                yield ("wait", ds_full, (j - 1) % 2, j - 1)
                ds = [(r, ("dS", j - 1)) for r, _ in sdS_all]
                yield ("mma", ds + [(self.sK, ("K", n))],
                       [(r, ("dQ", j - 1)) for r in cells(ALL, off["dq"], off["dq"] + D)],
                       f"dQ{j - 1} = dS·K")
                yield ("commit", dq_full)
                dk_cells = cells(ALL, off["dk"], off["dk"] + D)
                acc = [(r, ("dK", j - 2)) for r in dk_cells] if j > 1 else []
                yield ("mma", ds + [(self.sQ[q_release.index], ("Q", self.m_min + j - 1))] + acc,
                       [(r, ("dK", j - 1)) for r in dk_cells], f"dK += dSᵀ·Q{j - 1}")
                yield ("commit", ds_empty)
                yield from pipeline_q.consumer_release(q_release)
                q_release.advance()
            if j < self.count:
                if j > 0:
                    yield ("wait", dq_empty, (j - 1) % 2, j - 1)
                yield from pipeline_do.consumer_wait(do_state)
                yield ("mma", [(self.sV, ("V", n)), (self.sdO[do_state.index],
                                                     ("dO", self.m_min + j))],
                       [(r, ("dP", j)) for r in cells(ALL, off["dp"], off["dp"] + TILE)],
                       f"dP{j} = V·dO{j}ᵀ")
                yield ("commit", dp_full)
                yield ("wait", p_full, j % 2, j)
                dv_cells = cells(ALL, off["dv"], off["dv"] + D)
                acc = [(r, ("dV", j - 1)) for r in dv_cells] if j > 0 else []
                p_reads = [(r, ("P", j)) for c in p_cols for r in cells(ALL, c, c + 8)]
                yield ("mma", p_reads + [(self.sdO[do_state.index], ("dO", self.m_min + j))]
                       + acc, [(r, ("dV", j)) for r in dv_cells], f"dV += P{j}ᵀ·dO{j}")
                yield from pipeline_do.consumer_release(do_state)
                do_state.advance()
        if self.count > 0:
            yield ("commit", dkv_full)

    # --- compute warps ------------------------------------------------------------------------
    def compute_warps(self, wg: int, quarter: int):
        cfg, off = self.cfg, self.off
        cw = TILE // 2
        lse = self.pipeline_lse
        lane = [quarter]
        lse_state = make_pipeline_state(False, cfg.q_stages)
        for j in range(self.count):
            m_block = self.m_min + j
            yield from lse.consumer_wait(lse_state)
            s = lse_state.index
            # ---- Pᵀ = exp2(Sᵀ·scale_log2 − lse) ----
            yield ("wait", self.s_full, j % 2, j)
            stats = [(self.sLSE[s], ("lse", m_block), False)]
            if cfg.segments:  # softmax_p: the mask flag and the rows' ids
                stats.append((self.sSeg[s], ("ids", m_block), False))
            yield ("access", [(r, ("S", j), False) for r in
                              self.cells(lane, off["s"] + cw * wg, off["s"] + cw * wg + cw)]
                   + stats, f"ld Sᵀ{j}; sLSE")
            yield ("access", [(r, ("P", j), True) for r in
                              self.cells(lane, off["s"] + cw * wg, off["s"] + cw * wg + cw // 2)],
                   f"st Pᵀ{j}")
            yield ("arrive", self.p_full, WARP)
            # ---- dSᵀ = Pᵀ∘(dPᵀ − delta) [∘ (1 − t²)] ----
            yield ("wait", self.dp_full, j % 2, j)
            reads = [(r, ("dP", j), False) for r in
                     self.cells(lane, off["dp"] + cw * wg, off["dp"] + cw * wg + cw)]
            reads.append((self.sDelta[s], ("delta", m_block), False))
            if cfg.has_softcap:
                reads.append((self.sLSE[s], ("lse", m_block), False))
            yield ("access", reads, f"ld dPᵀ{j}; sDelta")
            yield from lse.consumer_release(lse_state, WARP)
            lse_state.advance()
            if j > 0:
                yield ("wait", self.ds_empty, (j - 1) % 2, j - 1)
            yield ("access", [(self.sdS[wg][quarter], ("dS", j), True)], f"st dS{j}")
            yield ("arrive", self.ds_full, WARP)
        yield from self.epilogue(wg, quarter)

    def epilogue(self, wg: int, quarter: int):
        D, off = self.D, self.off
        if self.count > 0:
            yield ("wait", self.dkv_full, 0, 0)
        for which in ("dV", "dK"):
            base, half = off["dv" if which == "dV" else "dk"], D // 2
            if self.count > 0:
                yield ("access", [(r, (which, self.count - 1), False) for r in
                                  self.cells([quarter], base + half * wg, base + half * wg + half)],
                       f"ld {which}")
        yield ("record", "dK / dV stored", self._record_store(wg, quarter))

    def _record_padding(self, wg, quarter):
        def record():
            self.sim.padding_zeroed[self.head].append((self.id, wg, quarter))
        return record

    def _record_store(self, wg, quarter):
        def record():
            self.stored[wg, quarter] += 1
        return record

    # --- dQ reduce warps ----------------------------------------------------------------------
    def reduce_sync(self, w: int):
        """reduce_barrier.arrive_and_wait() (bar.sync REDUCE, 128 threads = 4 warps)."""
        self.reduce_syncs[w] += 1
        yield ("bar_arrive", (self.id, "REDUCE"))
        yield ("bar_wait", (self.id, "REDUCE"), 4 * self.reduce_syncs[w])

    def reduce_warps(self, w: int):
        cfg, off = self.cfg, self.off
        nc = cfg.dq_cols
        num_chunks = self.D // nc
        key0 = (self.batch, self.head)
        stage = 0
        for j in range(self.count):
            m_block = self.m_min + j
            dq_tile = self.dq_tile0 + m_block  # varlen: the sequence's tiles
            yield ("wait", self.dq_full, j % 2, j)
            for c in range(num_chunks):
                yield ("access", [(r, ("dQ", j), False) for r in
                                  self.cells([w], off["dq"] + c * nc, off["dq"] + (c + 1) * nc)],
                       f"ld dQ{j} chunk {c}")
                if c == num_chunks - 1:
                    yield ("arrive", self.dq_empty, WARP)
                if w == 0:
                    yield ("bulk_wait", cfg.dq_stages - 1, True)
                yield from self.reduce_sync(w)
                yield ("access", [(self.sdQ[stage][w], ("dQ", j, c), True)],
                       f"sdQ[{stage}] = dQ{j} chunk {c}")
                yield from self.reduce_sync(w)
                if w == 0:  # the elected thread
                    if cfg.deterministic and c == 0:
                        turn = self.blocks.dq_rank(m_block, self.n_block)
                        yield ("sem_wait", key0 + (m_block,), turn)
                    yield ("tma_reduce", self.sdQ[stage], ("dQ", j, c), key0 + (dq_tile, c),
                           self.contrib)
                    if cfg.deterministic and c == num_chunks - 1:
                        yield ("bulk_wait", 0, False)
                        yield ("sem_add", key0 + (m_block,))
                stage = (stage + 1) % cfg.dq_stages
        if w == 0:
            yield ("bulk_wait", 0, True)

    # --- kernel(): the warp-role dispatch -----------------------------------------------------
    #: warps at the TMEM_ALLOC / TMEM_DEALLOC named barriers, and the dQ reduce warps among them
    tmem_users = TMEM_USERS
    reduce_warp_count = 4

    def tmem_user(self, gen):
        """A warp's role between the TMEM allocation and deallocation barriers."""
        alloc, dealloc = (self.id, "TMEM_ALLOC"), (self.id, "TMEM_DEALLOC")
        yield ("bar_arrive", alloc)  # tmem.wait_for_alloc()
        yield ("bar_wait", alloc, self.tmem_users)
        yield from gen
        yield ("bar_arrive", dealloc)  # dealloc_barrier.arrive_and_wait()
        yield ("bar_wait", dealloc, self.tmem_users)

    def mma_role(self):
        yield ("record", "tmem.allocate", lambda: None)
        yield from self.tmem_user(self.mma_warp())
        yield ("tmem_free",)

    def compute_role(self, wg, q):
        yield from self.tmem_user(self.compute_warps(wg, q))
        if self.zero_padding:  # zero_padding_dkv: plain global stores, no barrier
            yield ("record", "padding dK / dV zeroed", self._record_padding(wg, q))

    def spawn(self):
        sim, p = self.sim, f"c{self.id}"
        for w in range(self.reduce_warp_count):
            sim.spawn(f"{p}.reduce{w}", self.tmem_user(self.reduce_warps(w)), self)
        for wg in range(2):
            for q in range(4):
                sim.spawn(f"{p}.compute{wg}.{q}", self.compute_role(wg, q), self)
        sim.spawn(f"{p}.mma", self.mma_role(), self)
        sim.spawn(f"{p}.load", self.load_warp(), self)

    # --- end of run ---------------------------------------------------------------------------
    def check_end(self):
        sim, c, cfg = self.sim, self.count, self.cfg
        p = f"c{self.id}"
        compute = [f"{p}.compute{wg}.{q}" for wg in range(2) for q in range(4)]
        reduce = [f"{p}.reduce{w}" for w in range(4)]
        mma, load = f"{p}.mma", f"{p}.load"

        def per_stage(stages):
            return [len(range(i, c, stages)) for i in range(stages)]

        # barrier -> (phases completed, {warp: waits})
        want = {
            self.s_full: (c, dict.fromkeys(compute, c)),
            self.p_full: (c, {mma: c}),
            self.dp_full: (c, dict.fromkeys(compute, c)),
            self.ds_full: (c, {mma: c}),
            self.ds_empty: (c, dict.fromkeys(compute, max(c - 1, 0))),
            self.dq_full: (c, dict.fromkeys(reduce, c)),
            self.dq_empty: (c, {mma: max(c - 1, 0)}),
            self.dkv_full: (min(c, 1), dict.fromkeys(compute, min(c, 1))),
            self.pipeline_kv.full[0]: (min(c, 1), {mma: min(c, 1)}),
            self.pipeline_kv.empty[0]: (0, {load: min(c, 1)}),
        }
        for pl, stages, consumers in ((self.pipeline_q, cfg.q_stages, [mma]),
                                      (self.pipeline_do, cfg.do_stages, [mma]),
                                      (self.pipeline_lse, cfg.q_stages, compute)):
            for i, k in enumerate(per_stage(stages)):
                want[pl.full[i]] = (k, dict.fromkeys(consumers, k))
                want[pl.empty[i]] = (k, {load: k})
        check_barrier_ends(sim, want)
        if dict(self.stored) != {(wg, q): 1 for wg in range(2) for q in range(4)}:
            sim.fail(f"CTA {self.id}: dK / dV stores {dict(self.stored)}")
        if not (self.retired and self.tmem_freed):
            sim.fail(f"CTA {self.id} did not finish")


def check_barrier_ends(sim: BwdSim, want: dict) -> None:
    """At the end of a run: every barrier of ``want`` (barrier -> (phases completed, {warp:
    waits})) between phases, with that many phases completed and exactly those waits per warp
    (warps with 0 waits left out)."""
    waits = defaultdict(dict)
    for (actor, bar), k in sim.waits.items():
        waits[bar][actor] = k
    for bar, (phases, waiters) in want.items():
        if bar.pending != bar.count or bar.tx:
            sim.fail(f"{bar!r} ends inside a phase")
        if bar.completed != phases:
            sim.fail(f"{bar!r}: {bar.completed} phases completed, expected {phases}")
        waiters = {a: k for a, k in waiters.items() if k}
        if waits[bar] != waiters:
            sim.fail(f"{bar!r}: waits {waits[bar]}, expected {waiters}")


# ---------------------------------------------------------------------------------------------
# A launch: the grid (key blocks, heads) of one (seqlen_q, seqlen_k, mask, window)
# ---------------------------------------------------------------------------------------------
def make_blocks(cfg: Sm100BwdConfig, seqlen_q, seqlen_k, wl=-1, wr=-1) -> BwdBlocks:
    """kernel(): windows clamped as the kernel does (0 unless local; -1 or too wide = unbounded)."""
    window_left = window_right = 0
    if cfg.mask == "local":
        window_left = seqlen_k if wl < 0 or wl > seqlen_k else wl
        window_right = seqlen_q if wr < 0 or wr > seqlen_q else wr
    return BwdBlocks(TILE, TILE, cfg.mask == "causal", cfg.mask == "local", seqlen_q, seqlen_k,
                     window_left, window_right)


def simulate(cfg: Sm100BwdConfig, seqlen_q: int, seqlen_k: int, heads: int, slots: int,
             seed: int, wl: int = -1, wr: int = -1, launch_order=None) -> BwdSim:
    sim = BwdSim(random.Random(seed), slots, cfg.deterministic)
    blocks = make_blocks(cfg, seqlen_q, seqlen_k, wl, wr)
    n_blocks = -(-seqlen_k // TILE)
    grid = [(n, h) for h in range(heads) for n in range(n_blocks)]  # linear CTA id order
    if launch_order is not None:
        grid = launch_order(grid)
    ctas = [BwdCta(sim, cfg, blocks, i, n, h) for i, (n, h) in enumerate(grid)]
    sim.pending.extend(ctas)
    ranges = {n: blocks.m_block_range(n) for n in range(n_blocks)}
    for h in range(heads):
        for m in range(blocks.num_m_blocks()):
            sim.visitors[0, h, m] = [n for n in range(n_blocks) if ranges[n][0] <= m < ranges[n][1]]
    what = (f"{cfg.describe()} seqlen_q={seqlen_q} seqlen_k={seqlen_k} window=({wl}, {wr}) "
            f"heads={heads} slots={slots} seed={seed}")
    run_checked(sim, cfg, ctas, what)
    return sim


def simulate_segments(cfg: Sm100BwdConfig, q_ids, kv_ids, heads: int, slots: int, seed: int,
                      wl: int = -1, wr: int = -1) -> BwdSim:
    """A launch with segment ids (``cfg.segments``): the dense grid (key blocks, heads, batch)
    of (B, Sq) ``q_ids`` / (B, Sk) ``kv_ids``, each CTA's query blocks the mask's range within
    its row of jax_fa4.segments.backward_tables' key table, as the kernel intersects them.
    Checked as :func:`simulate`'s launches (each dq_accum tile gets exactly the adds of the key
    blocks whose range holds it); key blocks that share no id with any query run count = 0."""
    import jax.numpy as jnp
    import numpy as np

    from jax_fa4 import segments
    from jax_fa4.kernels.segments_config import SEG_KEY_M_HI, SEG_KEY_M_LO

    assert cfg.segments and not cfg.deterministic
    (b, seqlen_q), seqlen_k = q_ids.shape, kv_ids.shape[1]
    keys = np.asarray(segments.backward_tables(jnp.asarray(q_ids), jnp.asarray(kv_ids), TILE,
                                               TILE)[1])
    sim = BwdSim(random.Random(seed), slots, False)
    blocks = make_blocks(cfg, seqlen_q, seqlen_k, wl, wr)
    n_blocks = -(-seqlen_k // TILE)
    grid = [(n, h, i) for i in range(b) for h in range(heads) for n in range(n_blocks)]
    ctas = [BwdCta(sim, cfg, blocks, x, n, h, batch=i,
                   seg_range=(int(keys[i, n, SEG_KEY_M_LO]), int(keys[i, n, SEG_KEY_M_HI])))
            for x, (n, h, i) in enumerate(grid)]
    sim.pending.extend(ctas)
    for i in range(b):
        ranges = {n: (max(lo, int(keys[i, n, SEG_KEY_M_LO])),
                      min(hi, int(keys[i, n, SEG_KEY_M_HI])))
                  for n, (lo, hi) in ((n, blocks.m_block_range(n)) for n in range(n_blocks))}
        for h in range(heads):
            for m in range(blocks.num_m_blocks()):
                sim.visitors[i, h, m] = [n for n, (lo, hi) in ranges.items() if lo <= m < hi]
    what = (f"{cfg.describe()} ids={q_ids.tolist()} / {kv_ids.tolist()} window=({wl}, {wr}) "
            f"heads={heads} slots={slots} seed={seed}")
    run_checked(sim, cfg, ctas, what)

    def mask_count(cta):
        lo, hi = blocks.m_block_range(cta.n_block)
        return max(hi - lo, 0)

    sim.idle_ctas = sum(1 for c in ctas if c.count == 0 < mask_count(c))
    sim.segment_cut = sum(1 for c in ctas if 0 < c.count < mask_count(c))
    return sim


def run_checked(sim: BwdSim, cfg: Sm100BwdConfig, ctas: list, what: str, more=None) -> None:
    """Run the launch and check its end: every CTA (BwdCta.check_end), every dq_accum tile's adds
    (in rank order and the semaphores' end values when deterministic), then ``more()``;
    a ProtocolError names the launch (``what``)."""
    try:
        sim.run()
        for cta in ctas:
            cta.check_end()
        for (b, h, m), ns in sim.visitors.items():
            for c in range(cfg.head_dim // cfg.dq_cols):
                got = sim.dq_accum.get((b, h, m, c), [])
                if (got if cfg.deterministic else sorted(got)) != ns:
                    sim.fail(f"dq_accum[{b}, {h}, {m}, chunk {c}] got adds from {got}, "
                             f"expected {ns}")
            if cfg.deterministic and sim.sems[b, h, m] != len(ns):
                sim.fail(f"dq_semaphore[{b}, {h}, {m}] ends at {sim.sems[b, h, m]}")
        if more is not None:
            more()
    except ProtocolError as e:
        raise ProtocolError(f"{what}: {e}") from None


def varlen_work(mask: str, lens: list[tuple[int, int]], wl: int, wr: int, order: str,
                tile_n: int):
    """(cu_seqlens_q, work list) the backend builds for sequences of (len_q, len_k) ``lens``
    packed back to back, then 7 padding tokens: jax_fa4.backends.sm90.work_table with
    ``tile_n`` keys per item (a 2-CTA pair's 256 too), launch ``order``, as numpy arrays."""
    import jax.numpy as jnp
    import numpy as np

    pad = 7
    cu_q = np.concatenate([[0], np.cumsum([q for q, _ in lens])]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum([k for _, k in lens])]).astype(np.int32)
    total_k, batch = int(cu_k[-1]) + pad, len(lens)
    window = {"none": (None, None), "causal": (None, 0)}.get(
        mask, (None if wl < 0 else wl, None if wr < 0 else wr))
    work = np.asarray(work_table(jnp.asarray(cu_q), jnp.asarray(cu_k),
                                 sm90.work_items(total_k, batch, tile_n), TILE, tile_n, window,
                                 order))
    return cu_q, work


def padding_zeroed_once(sim: BwdSim, heads: int):
    """The check that per head exactly one CTA's 8 compute warps zeroed the padding rows."""
    for h in range(heads):
        zeroed = sim.padding_zeroed[h]
        if len(zeroed) != 8 or len({cta for cta, _, _ in zeroed}) != 1:
            sim.fail(f"head {h}: padding rows zeroed by {zeroed}")


def simulate_varlen(cfg: Sm100BwdConfig, lens: list[tuple[int, int]], heads: int, slots: int,
                    seed: int, wl: int = -1, wr: int = -1, order: str = "sequence") -> BwdSim:
    """A varlen launch (``cfg.varlen``): the grid (work rows, heads) of the work list the
    backend builds (jax_fa4.backends.sm90.work_table, launch ``order``) for sequences of
    (len_q, len_k) ``lens`` packed back to back, then 7 padding tokens; CTA (x, h) is one
    BwdCta with work row x's sequence lengths (its own BwdBlocks, the kernel's per-sequence
    windows), key block and first dq_accum tile. Checks beyond :func:`simulate`'s: each
    dq_accum tile gets the adds of exactly the key blocks of its own sequence that visit it
    (tiles of two sequences never coincide), and per head exactly the ZERO_PADDING CTA's 8
    compute warps zero the padding rows; spare rows (lengths 0) and key blocks no query block
    sees keep every barrier's protocol (count = 0, checked by BwdCta.check_end)."""
    import jax.numpy as jnp
    import numpy as np

    from jax_fa4.kernels.sm100.bwd import ZERO_PADDING

    assert cfg.varlen
    sim = BwdSim(random.Random(seed), slots, False)
    cu_q, work = varlen_work(cfg.mask, lens, wl, wr, order, TILE)
    grid = [(x, h) for h in range(heads) for x in range(work.shape[0])]  # linear CTA id order
    ctas = []
    for i, (x, h) in enumerate(grid):
        seq, n, _, _, len_q, len_k, tile0, _ = (int(c) for c in work[x])
        blocks = make_blocks(cfg, len_q, len_k, wl, wr)
        ctas.append(BwdCta(sim, cfg, blocks, i, n, h, dq_tile0=tile0, contrib=(seq, n),
                           zero_padding=seq == ZERO_PADDING))
    sim.pending.extend(ctas)
    first = np.asarray(first_tiles(jnp.asarray(cu_q), TILE))
    for b, (len_q, len_k) in enumerate(lens):
        blocks = make_blocks(cfg, len_q, len_k, wl, wr)
        ranges = {n: blocks.m_block_range(n) for n in range(-(-len_k // TILE))}
        for h in range(heads):
            for m in range(blocks.num_m_blocks()):
                key = (0, h, int(first[b]) + m)
                assert key not in sim.visitors, f"dq_accum tile {key} of two sequences"
                sim.visitors[key] = [(b, n) for n, (lo, hi) in ranges.items() if lo <= m < hi]
    what = (f"{cfg.describe()} lens={lens} window=({wl}, {wr}) order={order} heads={heads} "
            f"slots={slots} seed={seed}")
    run_checked(sim, cfg, ctas, what, partial(padding_zeroed_once, sim, heads))
    sim.idle_ctas = sum(1 for c in ctas if c.count == 0 and c.blocks.seqlen_k > 0)
    return sim


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------
def _configs() -> list[Sm100BwdConfig]:
    """The shipped tunings (one per head dim) and accepted variants of the stage counts (q_stages
    ≠ do_stages among them: the Q / lse and dO rings must not share stage indices)."""
    out = []
    for (d, dv) in TUNING_TABLE:
        if d != dv:  # 2-CTA only (192/128, the serial layout: test_sm100_bwd_2cta_protocol.py)
            continue
        cfg = Sm100BwdConfig.make("bfloat16", d, dv)
        if cfg.two_cta:  # served by the 2-CTA kernel (test_sm100_bwd_2cta_protocol.py): this
            # model checks the 1-CTA kernel at that head dim (q_stages >= 2, D-column dQ boxes)
            cfg = Sm100BwdConfig.make("bfloat16", d, dv, two_cta=False, q_stages=2,
                                      do_stages=1, dq_cols=16, dq_stages=2)
        out.append(cfg)
    for d, over in ((64, {"q_stages": 3, "do_stages": 3, "dq_stages": 3}),
                    (64, {"q_stages": 3, "do_stages": 2}),
                    (64, {"do_stages": 3, "dq_stages": 1, "dq_cols": 16}),
                    (96, {"q_stages": 3, "do_stages": 1, "dq_stages": 1}),
                    (128, {"two_cta": False, "q_stages": 2, "dq_cols": 32, "dq_stages": 3})):
        try:
            out.append(Sm100BwdConfig.make("bfloat16", d, d, **over))
        except ValueError:
            pass
    assert not any(c.two_cta for c in out)  # this model is the 1-CTA kernel's
    return out


CONFIGS = _configs()
MASKS = ("none", "causal", "local")
#: (mask, deterministic) of the random-schedule checks, the richest mask of each first: the quick
#: tier runs one per ``deterministic`` value (tests/compiled.py), ``--exhaustive`` all six.
SCHEDULES = per_class([(m, d) for m in ("local", "causal", "none") for d in (False, True)],
                      key=lambda case: case[1])
RUNS = 60  # per (mask, deterministic) case with ``--exhaustive``
#: the quick tier's runs per case (every wait is found blocked well within them; the mutation
#: checks below run schedules of their own)
QUICK_RUNS = 20


def random_case(rng: random.Random, mask: str, deterministic: bool):
    base = rng.choice(CONFIGS)
    cfg = Sm100BwdConfig.make("bfloat16", base.head_dim, base.head_dim_v, mask,
                              has_softcap=rng.random() < 0.3, deterministic=deterministic,
                              q_stages=base.q_stages, do_stages=base.do_stages,
                              dq_cols=base.dq_cols, dq_stages=base.dq_stages,
                              two_cta=base.two_cta)
    seqlen_q = rng.choice((rng.randint(1, 3 * TILE), rng.choice((TILE, 2 * TILE, 3 * TILE))))
    seqlen_k = rng.choice((rng.randint(1, 4 * TILE), rng.choice((TILE, 2 * TILE, 3 * TILE))))
    wl = rng.choice((-1, 0, rng.randint(0, 300)))
    wr = rng.choice((-1, 0, rng.randint(0, 300)))
    heads = rng.choice((1, 1, 2))
    n_ctas = heads * -(-seqlen_k // TILE)
    slots = rng.choice((1, 2, 3, n_ctas))
    return cfg, seqlen_q, seqlen_k, heads, slots, wl, wr


def wait_sites(deterministic: bool) -> set:
    """Every (role, wait) the schedules must have found blocked. Not in the set: kv.empty (one
    stage, acquired once: passes phase −1) and lse.empty (implied by q.empty of the same stage:
    Q_j is released after dK_j, issued after every compute thread's ds_full_j arrival, which
    follows its lse release of block j) cannot block; ds_empty_{j−1} blocks only when commit
    arrivals onto different barriers reorder (about 1 run in 150): the compute warps wait for it
    after dp_full_j, whose commit follows dP_j, issued after dK_{j−1}."""
    sites = {("load", "q.empty"), ("load", "do.empty"),
             ("mma", "kv.full"), ("mma", "q.full"), ("mma", "do.full"), ("mma", "ds_full"),
             ("mma", "dq_empty"), ("mma", "p_full"), ("mma", "bar.TMEM_DEALLOC"),
             ("compute", "lse.full"), ("compute", "s_full"), ("compute", "dp_full"),
             ("compute", "dkv_full"), ("compute", "bar.TMEM_ALLOC"),
             ("compute", "bar.TMEM_DEALLOC"),
             ("reduce", "dq_full"), ("reduce", "bar.REDUCE"), ("reduce", "bulk_wait.read"),
             ("reduce", "bar.TMEM_ALLOC"), ("reduce", "bar.TMEM_DEALLOC")}
    if deterministic:
        sites |= {("reduce", "dq_semaphore"), ("reduce", "bulk_wait.all")}
    return sites


@pytest.mark.parametrize("mask, deterministic", SCHEDULES, ids=lambda c: str(c))
def test_protocol_random_schedules(mask, deterministic):
    """Random grids (odd lengths, windows, 1-2 heads, 1 SM slot up to the whole grid at once)
    under random schedules: no deadlock, parity alias, arrival overrun or data hazard; every dQ
    contribution added once (in rank order when deterministic); and, over the runs of the case,
    every wait of the kernel was found blocked at least once (each wait mattered)."""
    rng = random.Random(f"{mask}-{deterministic}")
    blocked = set()
    for _ in range(RUNS if compiled.EXHAUSTIVE else QUICK_RUNS):
        cfg, sq, sk, heads, slots, wl, wr = random_case(rng, mask, deterministic)
        blocked |= simulate(cfg, sq, sk, heads, slots, rng.getrandbits(32), wl, wr).blocked
    missing = wait_sites(deterministic) - blocked
    assert not missing, missing


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.describe())
def test_protocol_every_config_long_sequence(cfg):
    """Each stage-count variant over 5 query blocks (every stage ring wraps), one key block."""
    for seed in range(3):
        simulate(cfg, 5 * TILE - 3, TILE, 1, 1, seed)


def test_deterministic_many_ctas_concurrently():
    """Deterministic dQ order with every key block of two heads resident at once (the spins
    really interleave): adds per query block in rank order, no deadlock."""
    cfg = Sm100BwdConfig.make("bfloat16", 64, 64, "none", deterministic=True)
    for seed in range(4):
        sim = simulate(cfg, 3 * TILE, 4 * TILE, 2, 8, seed)
        assert ("reduce", "dq_semaphore") in sim.blocked
    cfg = Sm100BwdConfig.make("bfloat16", 64, 64, "local", deterministic=True)
    for seed in range(4):
        simulate(cfg, 3 * TILE + 5, 4 * TILE - 7, 1, 4, seed, wl=150, wr=40)


def test_deterministic_relies_on_launch_order():
    """The launch-order assumption is needed (the model can see the hang it prevents): with one
    SM slot and the key blocks launched from the last, the first CTA spins forever."""
    cfg = Sm100BwdConfig.make("bfloat16", 64, 64, "none", deterministic=True)
    with pytest.raises(ProtocolError, match="deadlock"):
        simulate(cfg, TILE, 2 * TILE, 1, 1, 0, launch_order=lambda g: g[::-1])
    simulate(cfg, TILE, 2 * TILE, 1, 2, 0, launch_order=lambda g: g[::-1])  # both resident: fine


def test_one_q_stage_deadlocks_and_is_refused():
    """Why Sm100BwdConfig.validate requires q_stages >= 2: with one Q stage the MMA warp issues
    Sᵀ_{j+1} (waiting for Q_{j+1}) before dK_j, whose commit releases Q_j's only stage, which the
    load warp needs for Q_{j+1}: every schedule deadlocks once a CTA visits two query blocks."""
    import dataclasses

    cfg = dataclasses.replace(Sm100BwdConfig.make("bfloat16", 64, 64), q_stages=1)
    with pytest.raises(ValueError, match="q_stages"):
        cfg.validate()
    with pytest.raises(ProtocolError, match="deadlock"):
        simulate(cfg, 2 * TILE, TILE, 1, 1, 0)


# ---------------------------------------------------------------------------------------------
# Segment ids (the 1-CTA kernel's segment-id mode: bwd_config.segments_config)
# ---------------------------------------------------------------------------------------------
def random_ids(rng: random.Random, b: int, seqlen_q: int, seqlen_k: int):
    """(q_ids, kv_ids) of one kind: packed documents, ids anywhere, packed documents ending in
    padding (the API's reserved ids), or query / key ids drawn apart (always when Sq != Sk)."""
    import numpy as np

    from jax_fa4.segments import PADDING_KV_ID, PADDING_Q_ID

    gen = np.random.default_rng(rng.getrandbits(32))
    kind = "pair" if seqlen_q != seqlen_k else rng.choice(("packed", "random", "padding", "pair"))
    if kind == "pair":
        # (ids 3 and 4 only in the keys: their blocks no query block visits)
        return (gen.integers(0, 3, (b, seqlen_q)).astype(np.int32),
                np.sort(gen.integers(0, 5, (b, seqlen_k)), axis=1).astype(np.int32))
    ids = np.cumsum(gen.random((b, seqlen_q)) < 3 / seqlen_q, axis=1).astype(np.int32)
    if kind == "random":
        ids = gen.integers(0, 3, (b, seqlen_q)).astype(np.int32)
    q_ids, kv_ids = ids.copy(), ids.copy()
    if kind == "padding":
        pad = gen.integers(0, seqlen_q + 1)
        q_ids[:, seqlen_q - pad:], kv_ids[:, seqlen_q - pad:] = PADDING_Q_ID, PADDING_KV_ID
    return q_ids, kv_ids


def mode_runs(quick: int) -> int:
    """Random grids per case of the segment-id and varlen checks: ``quick`` in the quick tier,
    30 with ``--exhaustive`` (each mode changes only the key blocks' query-block ranges)."""
    return RUNS // 2 if compiled.EXHAUSTIVE else quick


@pytest.mark.parametrize("mask", per_class(["local", "causal", "none"], key=lambda m: 0))
def test_protocol_segments_random_schedules(mask):
    """Segment ids (packed documents, ids anywhere, padding, query / key ids of other lengths)
    over random grids under random schedules: the key blocks' query-block ranges cut by the
    tables change no barrier, role or phase (no deadlock, parity alias, overrun or hazard; the
    row ids staged with -lse / -delta and read with them), every dQ contribution is added once;
    among the CTAs, key blocks the tables cut short and ones they leave with no query block."""
    from jax_fa4.kernels.sm100.bwd_config import segments_config

    rng = random.Random(f"segments-{mask}")
    idle = cut = 0
    for _ in range(mode_runs(quick=12)):  # (each grid compiles its tables: the most time here)
        d = rng.choice((64, 96, 128))
        cfg = segments_config("bfloat16", d, d, mask, has_softcap=rng.random() < 0.3)
        b = rng.choice((1, 2))
        seqlen_q = rng.choice((rng.randint(1, 4 * TILE), 3 * TILE))
        seqlen_k = rng.choice((seqlen_q, rng.randint(1, 4 * TILE)))
        q_ids, kv_ids = random_ids(rng, b, seqlen_q, seqlen_k)
        heads = rng.choice((1, 2))
        slots = rng.choice((1, 2, 3, 64))
        wl = rng.choice((-1, 0, rng.randint(0, 300)))
        wr = rng.choice((-1, 0, rng.randint(0, 300)))
        sim = simulate_segments(cfg, q_ids, kv_ids, heads, slots, rng.getrandbits(32), wl, wr)
        idle, cut = idle + sim.idle_ctas, cut + sim.segment_cut
    assert idle > 0 and cut > 0, (idle, cut)


# ---------------------------------------------------------------------------------------------
# Varlen (the 1-CTA kernel's varlen mode: bwd_config.varlen_config)
# ---------------------------------------------------------------------------------------------
def random_lens(rng: random.Random) -> list[tuple[int, int]]:
    """1-4 sequences of 0 to 3 query / key blocks' lengths (empty ones included)."""
    def length():
        return rng.choice((0, 1, rng.randint(1, 3 * TILE), rng.choice((TILE, 2 * TILE))))
    return [(length(), length()) for _ in range(rng.randint(1, 4))]


@pytest.mark.parametrize("mask", per_class(["local", "causal", "none"], key=lambda m: 0))
def test_protocol_varlen_random_schedules(mask):
    """Random packed batches (empty sequences, sequences without keys or without queries,
    random windows) under random schedules, both launch orders: no deadlock, parity alias,
    arrival overrun or hazard; every dQ contribution added once into its own sequence's tile;
    the padding rows zeroed once per head; and CTAs whose key block no query block sees (count
    = 0 with keys: a local window, or a sequence without queries) were among them."""
    from jax_fa4.kernels.sm100.bwd_config import varlen_config

    rng = random.Random(f"varlen-{mask}")
    idle = 0
    for _ in range(mode_runs(quick=6)):  # (CTAs no query block sees come within a few grids)
        d = rng.choice((64, 96, 128))
        cfg = varlen_config("bfloat16", d, d, mask, has_softcap=rng.random() < 0.3,
                            gqa=rng.random() < 0.3)
        lens = random_lens(rng)
        heads = rng.choice((1, 1, 2))
        slots = rng.choice((1, 2, 3, 64))
        wl = rng.choice((-1, 0, rng.randint(0, 300)))
        wr = rng.choice((-1, 0, rng.randint(0, 300)))
        sim = simulate_varlen(cfg, lens, heads, slots, rng.getrandbits(32), wl, wr,
                              rng.choice(("sequence", "heavy_first")))
        idle += sim.idle_ctas
    assert idle > 0


def test_protocol_varlen_key_blocks_no_query_sees():
    """A local window that leaves key blocks without a visiting query block, a sequence without
    queries, an empty sequence and one without keys, all CTAs resident: the idle CTAs keep the
    protocol next to busy ones (count = 0 in every role, zero dK / dV rows)."""
    from jax_fa4.kernels.sm100.bwd_config import varlen_config

    cfg = varlen_config("bfloat16", 64, 64, "local")
    for seed in range(3 if compiled.EXHAUSTIVE else 1):  # schedules: one in the quick tier
        sim = simulate_varlen(cfg, [(TILE, 4 * TILE), (0, 2 * TILE), (0, 0), (5, 0),
                                    (3 * TILE - 1, 3 * TILE)], 2, 64, seed, wl=10, wr=0)
        assert sim.idle_ctas >= 2 * (2 + 2)  # per head: 2 unseen key blocks, 2 without queries
