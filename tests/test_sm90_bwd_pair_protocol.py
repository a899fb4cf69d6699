"""The sm90 split-operand pair's exchange protocol (jax_fa4/kernels/sm90/bwd_pair.py), checked on
a CPU by a discrete-event model under random schedules.

The kernel's two CTAs hand each other data every query block: rank 1 stores dP − delta into
rank 0's buffer C with ``st.async`` (bytes completing on rank 0's dpd_full), rank 0 copies P and
dS of exchange stage s into rank 1's D[s] with one bulk copy (completing on rank 1's
pds_full[s]); dpd_empty and pds_empty[s] hand the buffers back (remote arrives of the 8 MMA warps
of the reader). A wrong count, phase or order there hangs the GPU or reads another block's data,
and only shows as a timeout or a wrong gradient on the device. This model transcribes the
module docstring's signal table and per-iteration order for the MMA warps of both ranks (the
Q / dO pipelines and GEMMs are local to a CTA and left out), runs it under many random
interleavings with asynchronous stores and copies landing at random later times, and checks:

* no deadlock, for every iteration count and both exchange depths;
* every read of C (rank 0) and of D[s] (rank 1, and rank 0's own GEMMs) sees the current
  iteration's data, and no buffer is written while a read of it or an asynchronous write into it
  is in flight;
* a parity wait never succeeds on a barrier that has run past the awaited phase (the ABA of
  parity waits) and no barrier's arrivals exceed its count;
* when the final cluster barrier is reached, nothing is in flight towards either CTA.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from jax_fa4.kernels.sm90 import bwd_pair

WARPS = bwd_pair.MMA_WARPS
C_BYTES = 64 * 128 * 4  # tile_m · tile_n floats of dP − delta
WARP_C_BYTES = C_BYTES // WARPS
D_BYTES = 2 * 64 * 128 * 2  # P and dS, 16-bit


class ProtocolError(AssertionError):
    pass


@dataclass
class Barrier:
    """An mbarrier: ``count`` arrivals and a transaction count (which may go negative) per phase;
    ``completed`` phases so far."""

    name: str
    count: int
    pending: int = 0
    tx: int = 0
    completed: int = 0

    def __post_init__(self):
        self.pending = self.count

    def arrive(self, tx: int = 0) -> None:
        if self.pending == 0:
            raise ProtocolError(f"{self.name}: more arrivals than its count in a phase")
        self.pending -= 1
        self.tx += tx
        self._complete()

    def complete_tx(self, nbytes: int) -> None:
        self.tx -= nbytes
        self._complete()

    def _complete(self) -> None:
        if self.pending == 0 and self.tx == 0:
            self.completed += 1
            self.pending = self.count

    def ready(self, phase: int) -> bool:
        """A parity wait for phase index ``phase`` (parity phase % 2) passes now; raises if the
        barrier ran past it (the waiter could not tell)."""
        if self.completed > phase + 1:
            raise ProtocolError(f"{self.name}: parity wait for phase {phase} after "
                                f"{self.completed} completed phases")
        return self.completed == phase + 1


@dataclass
class Cta:
    rank: int
    bars: dict = field(default_factory=dict)
    tags: dict = field(default_factory=dict)  # buffer -> the iteration whose data it holds
    busy: dict = field(default_factory=dict)  # buffer -> what reads or writes it in flight
    writing: dict = field(default_factory=dict)  # buffer -> an asynchronous write in flight
    readers: dict = field(default_factory=dict)  # buffer -> the warps whose GEMMs read it
    gemm_reads: dict = field(default_factory=dict)  # warp -> the buffers its GEMMs read
    exited: bool = False


class Model:
    def __init__(self, count: int, pds: int, seed: int, pre_barrier: bool = True,
                 lookahead: bool = False):
        self.count, self.pds, self.pre_barrier = count, pds, pre_barrier
        self.lookahead = lookahead
        self.rng = random.Random(seed)
        self.cta = [Cta(0), Cta(1)]
        for cta in self.cta:
            cta.bars["dpd_full"] = Barrier(f"r{cta.rank}.dpd_full", 1)
            cta.bars["dpd_empty"] = Barrier(f"r{cta.rank}.dpd_empty", WARPS)
            for s in range(pds):
                cta.bars[f"pds_full{s}"] = Barrier(f"r{cta.rank}.pds_full{s}", 1)
                cta.bars[f"pds_empty{s}"] = Barrier(f"r{cta.rank}.pds_empty{s}", WARPS)
        self.inflight: list = []  # asynchronous stores / copies: (target cta, landing fn)
        self.named = {0: 0, 1: 0}  # rank 0's PDS named barrier (its two uses): arrivals so far
        self.cluster = 0

    # -- shared-memory accesses -----------------------------------------------------------------
    def write(self, cta: Cta, buf: str, tag: int) -> None:
        if cta.exited:
            raise ProtocolError(f"write into r{cta.rank}.{buf} after the CTA exited")
        if cta.busy.get(buf):
            raise ProtocolError(f"r{cta.rank}.{buf} written while {cta.busy[buf]} is in flight")
        if cta.readers.get(buf):
            raise ProtocolError(f"r{cta.rank}.{buf} written while GEMMs of warps "
                                f"{sorted(cta.readers[buf])} read it")
        cta.tags[buf] = tag

    def start_gemm(self, cta: Cta, w: int, bufs: list, want: int) -> None:
        """Warp ``w``'s warpgroup's GEMMs read ``bufs`` (data of iteration ``want``) from their
        issue until the warp's wait for them (``end_gemm``)."""
        for buf in bufs:
            self.read(cta, buf, want)
            cta.readers.setdefault(buf, set()).add(w)
        cta.gemm_reads[w] = bufs

    def end_gemm(self, cta: Cta, w: int) -> None:
        for buf in cta.gemm_reads.pop(w):
            cta.readers[buf].discard(w)

    def read(self, cta: Cta, buf: str, want: int) -> None:
        if cta.writing.get(buf):
            raise ProtocolError(f"r{cta.rank}.{buf} read while {cta.busy[buf]} is in flight")
        if cta.tags.get(buf) != want:
            raise ProtocolError(f"r{cta.rank}.{buf} holds iteration {cta.tags.get(buf)}, "
                                f"expected {want}")

    # -- the roles (the module docstring's per-iteration order) ---------------------------------
    def rank0_warp(self, w: int):
        c0, c1 = self.cta
        if w == 0 and self.count:  # MMA thread 0 arms dpd_full for iteration 0
            c0.bars["dpd_full"].arrive(tx=C_BYTES)
        for j in range(self.count):
            s = j % self.pds
            if self.pds == 1 and self.pre_barrier:  # named barrier PDS: all GEMMs of j − 1 done
                self.named[1] += 1
                yield lambda target=(j + 1) * WARPS: self.named[1] >= target
            if j >= self.pds:
                yield lambda j=j, s=s: c0.bars[f"pds_empty{s}"].ready(j // self.pds - 1)
            self.write(c0, f"P{s}.{w}", j)
            if self.lookahead and j > 0:  # wait_group(0): the GEMMs of j − 1 ran under P(j)
                self.end_gemm(c0, w)
            yield lambda j=j: c0.bars["dpd_full"].ready(j)
            if w == 0 and j + 1 < self.count:
                c0.bars["dpd_full"].arrive(tx=C_BYTES)
            self.read(c0, f"C.{w}", j)  # (thread t reads what rank 1's thread t stored)
            c1.bars["dpd_empty"].arrive()
            self.write(c0, f"dS{s}.{w}", j)
            self.named[0] += 1  # named barrier PDS over the 8 MMA warps
            target = (j + 1) * WARPS
            yield lambda target=target: self.named[0] >= target
            if w == 0:  # remote arrive.expect_tx, then the bulk copy of D[s]
                c1.bars[f"pds_full{s}"].arrive(tx=D_BYTES)
                self.bulk_copy(s, j)
            self.start_gemm(c0, w, [f"dS{s}.{src}" for src in range(WARPS)], j)  # dK, dQ
            if not self.lookahead:
                yield None  # the GEMMs run; wait_group(0)
                self.end_gemm(c0, w)
        if self.lookahead and self.count:
            yield None
            self.end_gemm(c0, w)
        for k in range(min(self.pds, self.count)):
            j = self.count - 1 - k
            yield lambda j=j: c0.bars[f"pds_empty{j % self.pds}"].ready(j // self.pds)

    def rank1_warp(self, w: int):
        c0, c1 = self.cta
        for j in range(self.count):
            s = j % self.pds
            yield None  # dP GEMM, − delta
            if j >= 1:
                yield lambda j=j: c1.bars["dpd_empty"].ready(j - 1)
            self.st_async(w, j)
            yield lambda j=j, s=s: c1.bars[f"pds_full{s}"].ready(j // self.pds)
            self.start_gemm(c1, w, [f"{x}{s}.{src}" for x in ("P", "dS")
                                    for src in range(WARPS)], j)  # dV and dQ
            yield None  # the GEMMs run; wait_group(0)
            self.end_gemm(c1, w)
            c0.bars[f"pds_empty{s}"].arrive()
        if self.count:
            yield lambda: c1.bars["dpd_empty"].ready(self.count - 1)

    # -- asynchronous stores and copies -----------------------------------------------------------
    def st_async(self, w: int, j: int) -> None:
        c0 = self.cta[0]
        buf = f"C.{w}"
        self.write(c0, buf, -1)  # (its old data is gone once the stores start)
        c0.busy[buf] = c0.writing[buf] = f"st.async of r1 warp {w}"

        def land():
            c0.busy[buf] = c0.writing[buf] = None
            self.write(c0, buf, j)
            c0.bars["dpd_full"].complete_tx(WARP_C_BYTES)
        self.inflight.append((c0, land))

    def bulk_copy(self, s: int, j: int) -> None:
        c0, c1 = self.cta
        srcs = [f"{x}{s}.{w}" for x in ("P", "dS") for w in range(WARPS)]
        for buf in srcs:
            self.read(c0, buf, j)
            c0.busy[buf] = "the bulk copy (reading)"
            self.write(c1, buf, -1)
            c1.busy[buf] = c1.writing[buf] = "the bulk copy (writing)"

        def land():
            for buf in srcs:
                c0.busy[buf] = None
                c1.busy[buf] = c1.writing[buf] = None
                self.write(c1, buf, j)
            c1.bars[f"pds_full{s}"].complete_tx(D_BYTES)
        self.inflight.append((c1, land))

    # -- the scheduler ----------------------------------------------------------------------------
    def run(self) -> None:
        actors = [self.rank0_warp(w) for w in range(WARPS)] + \
                 [self.rank1_warp(w) for w in range(WARPS)]
        waiting = [None] * len(actors)  # the condition each actor waits on (None: runnable)
        live = list(range(len(actors)))
        while live or self.inflight:
            runnable = [i for i in live if waiting[i] is None or waiting[i]()]
            choices = [("actor", i) for i in runnable] + \
                      [("land", k) for k in range(len(self.inflight))]
            if not choices:
                raise ProtocolError("deadlock: " + ", ".join(
                    f"{b.name} {b.completed} phases, {b.pending} arrivals and {b.tx} B pending"
                    for c in self.cta for b in c.bars.values()))
            kind, i = self.rng.choice(choices)
            if kind == "land":
                self.inflight.pop(i)[1]()
                continue
            try:
                waiting[i] = next(actors[i])
            except StopIteration:
                live.remove(i)
        # every warp of both CTAs is at the final cluster barrier: nothing may be in flight
        for cta in self.cta:
            cta.exited = True
            for b in cta.bars.values():
                if b.pending != b.count or b.tx:
                    raise ProtocolError(f"{b.name}: a phase still open at exit "
                                        f"({b.pending} arrivals, {b.tx} B pending)")


@pytest.mark.parametrize("pds,lookahead", [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize("count", [0, 1, 2, 3, 5])
def test_exchange_protocol_holds_under_random_schedules(count, pds, lookahead):
    for seed in range(60):
        Model(count, pds, seed, lookahead=lookahead).run()


def test_lookahead_needs_two_exchange_buffers():
    """What BwdPairConfig.validate enforces: with one buffer, rank 0's P of the next block
    would be written while the bulk copy or rank 1 may still read D, or its dS while the
    previous block's GEMMs read it."""
    with pytest.raises(ProtocolError):
        for seed in range(60):
            Model(4, 1, seed, lookahead=True).run()


def test_model_catches_an_overwritten_exchange_buffer():
    """The model can fail: with one exchange buffer, rank 0 writing the next block's dS without
    first meeting at the named barrier lets one warpgroup overwrite the dS that the other's dK
    and dQ GEMMs of the previous block still read."""
    with pytest.raises(ProtocolError, match="holds iteration"):
        for seed in range(60):
            Model(4, 1, seed, pre_barrier=False).run()
