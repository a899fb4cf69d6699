"""Device helpers for CTAs of one cluster that hand data to each other through distributed shared
memory (sm_90a and later): the peer's address of a shared-memory location, asynchronous stores
into the peer's shared memory that complete bytes on the peer's mbarrier, and a cluster-scoped
mbarrier wait (the acquire that pairs with a peer's ``release.cluster`` arrive)."""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def trap_unless_cluster_of(ctas: int, *, loc=None, ip=None) -> None:
    """``trap`` (a launch error, not a hang) when the CTA's cluster does not hold ``ctas`` CTAs:
    a launch that dropped the cluster dimensions would wait forever on its peer's signals."""
    llvm.inline_asm(
        None, [Int32(ctas).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .u32 n;\n\t.reg .pred p;\n\t"
        "mov.u32 n, %cluster_nctarank;\n\t"
        "setp.ne.u32 p, n, $0;\n\t"
        "@p trap;\n\t}",
        "r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip)


@dsl_user_op
def peer_address(ptr: cute.Pointer, peer: Int32, *, loc=None, ip=None) -> Int32:
    """``mapa.shared::cluster``: the shared::cluster address of this CTA's shared-memory
    location ``ptr`` in the CTA of cluster rank ``peer`` (same offset there)."""
    return Int32(llvm.inline_asm(
        T.i32(), [ptr.toint(loc=loc, ip=ip).ir_value(), Int32(peer).ir_value(loc=loc, ip=ip)],
        "mapa.shared::cluster.u32 $0, $1, $2;", "=r,r,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip))


@dsl_user_op
def st_async_v4_f32(addr: Int32, a: Float32, b: Float32, c: Float32, d: Float32,
                    mbar_addr: Int32, *, loc=None, ip=None) -> None:
    """``st.async`` of four floats (16 bytes) to the shared::cluster address ``addr`` (a peer
    CTA's shared memory, from ``peer_address``), completing 16 bytes of the transaction count
    of the mbarrier at shared::cluster address ``mbar_addr`` (in the same CTA as ``addr``)."""
    llvm.inline_asm(
        None,
        [Int32(addr).ir_value(loc=loc, ip=ip), Float32(a).ir_value(loc=loc, ip=ip),
         Float32(b).ir_value(loc=loc, ip=ip), Float32(c).ir_value(loc=loc, ip=ip),
         Float32(d).ir_value(loc=loc, ip=ip), Int32(mbar_addr).ir_value(loc=loc, ip=ip)],
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [$0], {$1, $2, $3, $4}, "
        "[$5];",
        "r,f,f,f,f,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip)


@dsl_user_op
def mbarrier_try_wait_cluster(mbar: cute.Pointer, phase: Int32, *, loc=None, ip=None
                              ) -> Boolean:
    """One ``mbarrier.try_wait.parity.acquire.cluster`` on this CTA's ``mbar``: true once the
    phase of parity ``phase`` has completed. Cluster scope makes the writes a peer CTA released
    before its arrive (``mbarrier_arrive(..., scope=CLUSTER)``) visible to this thread."""
    done = Int32(llvm.inline_asm(
        T.i32(), [mbar.toint(loc=loc, ip=ip).ir_value(), Int32(phase).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [$1], $2;\n\t"
        "selp.u32 $0, 1, 0, p;\n\t}",
        "=r,r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip))
    return Boolean(done != 0)


@cute.jit
def mbarrier_wait_cluster(mbar: cute.Pointer, phase: Int32) -> None:
    """Wait, with cluster-scoped acquire, until the phase of parity ``phase`` of ``mbar``
    (this CTA's) has completed."""
    done = mbarrier_try_wait_cluster(mbar, phase)
    while not done:
        done = mbarrier_try_wait_cluster(mbar, phase)


@dsl_user_op
def bulk_copy_to_cluster(dst_addr: Int32, src: cute.Pointer, mbar_addr: Int32, num_bytes: int,
                         *, loc=None, ip=None) -> None:
    """``cp.async.bulk.shared::cluster.shared::cta`` of ``num_bytes`` from this CTA's shared
    memory at ``src`` to the shared::cluster address ``dst_addr`` (``peer_address``), completing
    the bytes on the mbarrier at shared::cluster address ``mbar_addr`` (in the destination
    CTA). The source may be overwritten once the destination's barrier has completed."""
    llvm.inline_asm(
        None,
        [Int32(dst_addr).ir_value(loc=loc, ip=ip), src.toint(loc=loc, ip=ip).ir_value(),
         Int32(mbar_addr).ir_value(loc=loc, ip=ip), Int32(num_bytes).ir_value(loc=loc, ip=ip)],
        "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes "
        "[$0], [$1], $3, [$2];",
        "r,r,r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip)
