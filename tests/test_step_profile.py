"""The step profile's reading of a trace (``jax_fa4.tools.step_profile``) on a synthetic GPU trace:
an XSpace text proto with a ``/device:GPU:0`` plane, read back through ``jax.profiler.ProfileData``
as a real trace is, whose kernels, gaps and launches are laid out by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from jax.profiler import ProfileData

from jax_fa4.tools import step_profile as sp

OUR_FWD = ("kernel_cutlass_kernel_jax_fa4kernelssm90flash_fwdFlashAttentionForwardSm90_object_at_"
           "_tensorptrbf16gmemalign16o1")
OUR_BWD = ("kernel_cutlass_kernel_jax_fa4kernelssm90bwdFlashAttentionBackwardSm90_object_at_"
           "_tensorptrbf16gmemalign16o2")
CUDNN_FWD = "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x128x128"
CUDNN_BWD = "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_7_64x128x128"
GEMM = "nvjet_hsh_256x128_64x4_2x1_v_bz_TNT"

# (line, kernel name, HLO op, start us, end us) of one step; a step starts every 1000 us.
OURS_STEP = [
    ("Stream #7(Kernel)", GEMM, "custom-call.1", 0, 100),
    ("Stream #7(Kernel)", "loop_transpose_fusion_2", "tf.2", 110, 130),
    ("Stream #7(Kernel)", OUR_FWD, "custom-call.7", 130, 230),
    ("Stream #9(Memset)", "Memset", "custom-call.7", 150, 160),  # overlaps: no busy time added
    ("Stream #7(Kernel)", "input_reduce_fusion", "rf", 250, 270),
    ("Stream #7(Kernel)", OUR_BWD, "custom-call.8", 270, 400),
    ("Stream #7(Kernel)", "loop_add_fusion_3", "af.3", 405, 420),
]
BASE_STEP = [
    ("Stream #7(Kernel)", GEMM, "custom-call.1", 0, 100),
    ("Stream #7(Kernel)", CUDNN_FWD, "custom-call.3", 102, 180),
    ("Stream #7(Kernel)", "input_reduce_fusion", "rf", 180, 200),
    ("Stream #7(Kernel)", CUDNN_BWD, "custom-call.4", 200, 340),
    ("Stream #7(Kernel)", "loop_add_fusion_5", "af.5", 340, 355),
]
#: Kernel index of ours whose launch call is made only after the GPU went idle before it.
LATE_LAUNCH = 4

OURS_HLO = """HloModule jit_step, is_scheduled=true

%fused_transpose (param_0: bf16[64,32]) -> bf16[32,64] {
  %param_0 = bf16[64,32]{1,0} parameter(0)
  ROOT %transpose.1 = bf16[32,64]{1,0} transpose(%param_0), dimensions={1,0}
}

%fused_reduce (param_0.1: f32[64,32]) -> f32[64] {
  %param_0.1 = f32[64,32]{1,0} parameter(0)
  %constant.2 = f32[] constant(0)
  ROOT %reduce.3 = f32[64]{0} reduce(%param_0.1, %constant.2), dimensions={1}, to_apply=%add
}

%fused_add (param_0.2: f32[64], param_1.2: f32[64]) -> f32[64] {
  %param_0.2 = f32[64]{0} parameter(0)
  %param_1.2 = f32[64]{0} parameter(1)
  ROOT %add.4 = f32[64]{0} add(%param_0.2, %param_1.2)
}

%command_buffer.1 (p.1: f32[64]) -> f32[64] {
  %p.1 = f32[64]{0} parameter(0)
  ROOT %af.3 = f32[64]{0} fusion(%p.1, %p.1), kind=kLoop, calls=%fused_add
}

ENTRY %main.9 (p: bf16[64,32]) -> f32[64] {
  %p = bf16[64,32]{1,0} parameter(0)
  %custom-call.1 = bf16[64,32]{1,0} custom-call(%p), custom_call_target="__cublas$lt$matmul"
  %tf.2 = bf16[32,64]{1,0} fusion(%custom-call.1), kind=kLoop, calls=%fused_transpose, META
  %custom-call.7 = (bf16[32,64]{1,0}, f32[64]{0}) custom-call(%tf.2), custom_call_target="FA4"
  %get-tuple-element.1 = f32[64]{0} get-tuple-element(%custom-call.7), index=1
  %rf = f32[64]{0} fusion(%get-tuple-element.1), kind=kInput, calls=%fused_reduce
  %custom-call.8 = f32[64]{0} custom-call(%rf), custom_call_target="FA4"
  ROOT %call.1 = f32[64]{0} call(%custom-call.8), to_apply=%command_buffer.1
}
""".replace("FA4", sp.OUR_CALL_TARGET).replace(
    "META", 'metadata={op_name="jit(step)/transpose" stack_frame_id=2}')


def _value(v: Any) -> str:
    if isinstance(v, bool) or isinstance(v, int):
        return f"int64_value: {int(v)}"
    if isinstance(v, float):
        return f"double_value: {v}"
    return f'str_value: "{v}"'


def xspace(planes: dict[str, dict[str, list[tuple[str, float, float, dict[str, Any]]]]]) -> str:
    """XSpace text proto: plane -> line -> events (name, start ns, duration ns, stats)."""
    names: dict[str, int] = {}
    stat_ids: dict[str, int] = {}
    out = []
    for pid, (plane, lines) in enumerate(planes.items(), 1):
        body = []
        for lid, (line, events) in enumerate(lines.items(), 1):
            evs = []
            for name, start, dur, stats in events:
                mid = names.setdefault(name, len(names) + 1)
                st = " ".join(f"stats {{ metadata_id: {stat_ids.setdefault(k, len(stat_ids) + 1)}"
                              f" {_value(v)} }}" for k, v in stats.items())
                evs.append(f"events {{ metadata_id: {mid} offset_ps: {int(start * 1000)} "
                           f"duration_ps: {int(dur * 1000)} {st} }}")
            body.append(f'lines {{ id: {lid} name: "{line}" timestamp_ns: 0 {" ".join(evs)} }}')
        body += [f'event_metadata {{ key: {i} value {{ id: {i} name: "{n}" }} }}'
                 for n, i in names.items()]
        body += [f'stat_metadata {{ key: {i} value {{ id: {i} name: "{n}" }} }}'
                 for n, i in stat_ids.items()]
        out.append(f'planes {{ id: {pid} name: "{plane}" {" ".join(body)} }}')
    return "\n".join(out)


def gpu_trace(step: list[tuple[str, str, str, float, float]], steps: int,
              late: int | None = None, stray: bool = True) -> str:
    """``steps`` back-to-back copies of a step's kernels (the first at 100 us, one every
    1000 us), each launched from a host thread (``cuLaunchKernel`` with its correlation id,
    all before the step starts; kernel ``late`` 1 us before it starts), Python dispatch events,
    XLA's command-buffer warning, and (stray) one kernel of another module."""
    device: dict[str, list] = {}
    host: list = []
    corr = 0
    for s in range(steps):
        t0 = 100.0 + 1000.0 * s
        host.append(("PjitFunction(step)", t0 * 1e3 - 50e3, 40e3, {}))
        for i, (line, name, op, a, b) in enumerate(step):
            corr += 1
            start, dur = (t0 + a) * 1e3, (b - a) * 1e3
            device.setdefault(line, []).append(
                (name, start, dur, {"hlo_op": op, "hlo_module": "jit_step",
                                    "correlation_id": corr}))
            at = start - 1e3 if i == late else (t0 - 30 + i) * 1e3
            host.append(("cuLaunchKernel", at, 2e3, {"correlation_id": corr}))
    if stray:
        device["Stream #7(Kernel)"].append(("loop_convert_fusion", 1050e3, 1e3,
                                            {"hlo_op": "x", "hlo_module": "jit_other"}))
    host.append(("WARNING: CommandBuffer disabled when profiling", 0.0, 1.0, {}))
    return xspace({"/device:GPU:0": device, "/host:CPU": {"Host Threads/1": host}})


def events(text: str) -> list[sp.Event]:
    return sp.events_of(ProfileData.from_text_proto(text))


def test_hlo_ops_their_fused_ops_and_command_buffers() -> None:
    ops, summary = sp.parse_hlo(OURS_HLO)
    assert summary["module"] == "jit_step" and summary["command_buffers"] == 1
    # The entry's work outside the command buffer (parameters and tuple reads left out).
    assert summary["entry_ops_outside_command_buffers_names"] == [
        "custom-call.1", "tf.2", "custom-call.7", "rf", "custom-call.8"]
    t = ops["tf.2"]
    assert (t.opcode, t.kind, t.fused_ops, t.op_name) == (
        "fusion", "kLoop", frozenset({"transpose"}), "jit(step)/transpose")
    assert ops["custom-call.7"].target == sp.OUR_CALL_TARGET
    assert ops["custom-call.1"].gemm and not ops["rf"].gemm
    assert ops["af.3"].fused_ops == {"add"}


@pytest.mark.parametrize("name,op,category", [
    (OUR_FWD, None, sp.OURS),
    ("anything", sp.HloOp("custom-call.7", "custom-call", "f32[]", target=sp.OUR_CALL_TARGET),
     sp.OURS),
    (CUDNN_BWD, None, sp.CUDNN),
    # its backward's helpers, inside a command buffer (the op names no custom call)
    ("void cudnn::fusion::compute_dot_do_o_specialized<true, 128>(void const*, void const*)",
     sp.HloOp("command_buffer_1", "command-buffer", "f32[]"), sp.CUDNN),
    ("void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*, unsigned int)", None,
     sp.CUDNN),
    ("cudnn_kernel", sp.HloOp("c", "custom-call", "f32[]", target="__cudnn$fmhaSoftmax"),
     sp.CUDNN),
    (GEMM, None, sp.GEMM),
    ("MemcpyD2D", None, sp.MEM),
    ("Memset", None, sp.MEM),
    ("loop_transpose_fusion_2", None, sp.COPY),
    ("loop_add_fusion", sp.HloOp("f", "fusion", "f32[]", kind="kLoop",
                                 fused_ops=frozenset({"add", "copy"})), sp.COPY),
    ("loop_add_fusion", sp.HloOp("f", "fusion", "f32[]", kind="kLoop",
                                 fused_ops=frozenset({"add"})), sp.LOOP),
    ("input_reduce_fusion", None, sp.REDUCE),
    ("loop_add_fusion_3", None, sp.LOOP),
    ("some_kernel", None, sp.OTHER),
])
def test_categories(name: str, op: sp.HloOp | None, category: str) -> None:
    assert sp.classify(name, op) == category


def test_group_names() -> None:
    assert sp.short_name(OUR_FWD) == "jax_fa4:sm90flash_fwdFlashAttentionForwardSm90"
    assert sp.short_name("loop_add_fusion_3") == "loop_add_fusion"
    assert sp.short_name("wrapped_convert.13") == "wrapped_convert"
    assert sp.our_kind(OUR_BWD) == "bwd" and sp.our_kind(GEMM) is None


def test_one_implementation_s_step_figures() -> None:
    evs = events(gpu_trace(OURS_STEP, steps=2, late=LATE_LAUNCH))
    kernels = sp.device_kernels(evs, "jit_step")
    assert len(kernels) == 2 * len(OURS_STEP)  # the other module's kernel is dropped
    prof = sp.analyse(evs, OURS_HLO, steps=2, layers=2)
    assert prof["source"] == "gpu streams"
    assert prof["steps_consistent"] and prof["kernels_per_step"] == len(OURS_STEP)
    step = prof["step_us"]
    assert step["span_us"] == pytest.approx(420)
    # Busy: 0-100, 110-230 (the memset overlaps), 250-400, 405-420; gaps 10 + 20 + 5.
    assert step["busy_us"] == pytest.approx(385)
    assert step["idle_us"] == pytest.approx(35)
    assert step["attention_us"] == pytest.approx(100 + 130)
    assert step["around_attention_us"] == pytest.approx(420 - 230)
    assert step["idle_next_to_attention_us"] == pytest.approx(20 + 5)
    assert step["idle_launch_bound_us"] == pytest.approx(20)
    assert prof["per_layer_us"]["around_attention_us"] == pytest.approx(190 / 2)
    assert prof["step_spans_us"] == pytest.approx([420, 420])
    cats = prof["categories_us"]
    assert cats[sp.GEMM] == pytest.approx(100) and cats[sp.COPY] == pytest.approx(20)
    assert cats[sp.OURS] == pytest.approx(230) and cats[sp.MEM] == pytest.approx(10)
    assert cats[sp.REDUCE] == pytest.approx(20) and cats[sp.LOOP] == pytest.approx(15)
    assert sum(cats.values()) == pytest.approx(395)
    gaps = prof["largest_gaps"]
    assert [round(g["us"]) for g in gaps] == [20, 10, 5]
    assert gaps[0]["at_us"] == pytest.approx(230)
    assert gaps[0]["before"]["category"] == sp.OURS
    assert gaps[0]["after"] == {"kernel": "input_reduce_fusion", "hlo_op": "rf",
                                "category": sp.REDUCE}
    fwd = prof["groups"]["jax_fa4:sm90flash_fwdFlashAttentionForwardSm90"]
    assert (fwd["count"], fwd["us"], fwd["kind"]) == (pytest.approx(1), pytest.approx(100), "fwd")
    copies = prof["copies_transposes"]
    assert [c["hlo_op"] for c in copies] == ["tf.2"]
    assert copies[0]["layout_only"] and copies[0]["op_name"] == "jit(step)/transpose"
    host = prof["host"]
    assert host["python_dispatch_median_us"] == pytest.approx(40)
    assert host["launch_calls_per_step"]["cuLaunchKernel"] == {
        "count": pytest.approx(len(OURS_STEP)), "us": pytest.approx(2 * len(OURS_STEP))}
    assert host["command_buffers_disabled"]
    rows = prof["median_step_kernels"]
    assert [r["at_us"] for r in rows] == [0, 110, 130, 150, 250, 270, 405]


def test_steps_that_differ_are_not_consistent() -> None:
    other = [*OURS_STEP[:-1], (*OURS_STEP[-1][:1], "loop_multiply_fusion_3",
                                *OURS_STEP[-1][2:])]
    text = xspace({"/device:GPU:0": {"Stream #7": [
        (name, (1000 * s + a) * 1e3, (b - a) * 1e3, {"hlo_op": op})
        for s, step in enumerate((OURS_STEP, other)) for _, name, op, a, b in step]}})
    assert not sp.analyse(events(text), OURS_HLO, steps=2, layers=2)["steps_consistent"]
    # A step count that does not divide the kernels.
    three = sp.analyse(events(gpu_trace(OURS_STEP, steps=2, stray=False)), None, 3, 2)
    assert not three["steps_consistent"]


def test_side_by_side_per_layer_and_one_sided_kernels(tmp_path: Path) -> None:
    ours = sp.analyse(events(gpu_trace(OURS_STEP, 3, late=LATE_LAUNCH)), OURS_HLO, 3, 2)
    base = sp.analyse(events(gpu_trace(BASE_STEP, 3)), "HloModule jit_step\n", 3, 2)
    assert base["step_us"]["span_us"] == pytest.approx(355)
    assert base["step_us"]["attention_us"] == pytest.approx(78 + 140)
    assert base["step_us"]["idle_launch_bound_us"] == pytest.approx(0)
    cmp = sp.compare(ours, base, layers=2)
    around = cmp["step_us"]["around_attention_us"]
    assert around["diff"] == pytest.approx(190 - 137)
    assert around["diff_per_layer"] == pytest.approx((190 - 137) / 2)
    assert cmp["categories_us"][sp.COPY]["diff_per_layer"] == pytest.approx(10)
    assert sp.CUDNN in cmp["categories_us"] and sp.XLA_OTHER not in cmp["categories_us"]
    assert set(cmp["only_ours"]) == {"loop_transpose_fusion", "Memset",
                                     "jax_fa4:sm90flash_fwdFlashAttentionForwardSm90",
                                     "jax_fa4:sm90bwdFlashAttentionBackwardSm90"}
    assert set(cmp["only_base"]) == {CUDNN_FWD, CUDNN_BWD}
    assert cmp["changed"]["nvjet_hsh_256x128_64x4_2x1_v_bz_TNT"]["diff_us"] == pytest.approx(0)
    table = sp.markdown("cfg", "cudnn", ours, base, cmp)
    assert "| around_attention | 190.0 | 137.0 | +53.0 | +26.5 |" in table
    assert "| XLA copy/transpose | 20.0 | 0.0 | +20.0 | +10.0 |" in table
    assert "`loop_transpose_fusion`" in table and "(layout only)" in table
    # The command line re-reads saved trace files and HLO.
    paths = []
    for name, step, hlo in (("ours", OURS_STEP, OURS_HLO), ("base", BASE_STEP, "")):
        trace = tmp_path / f"{name}.xplane.pb"
        trace.write_bytes(ProfileData.text_proto_to_serialized_xspace(gpu_trace(step, 3)))
        (tmp_path / f"{name}.hlo").write_text(hlo or "HloModule jit_step\n")
        paths.append(trace)
    out = tmp_path / "table.md"
    assert sp.main([str(paths[0]), str(paths[1]), "--hlo", str(tmp_path / "ours.hlo"),
                    "--hlo", str(tmp_path / "base.hlo"), "--steps", "3", "--layers", "2",
                    "--out", str(out)]) == 0
    assert "| around_attention | 190.0 | 137.0 | +53.0 | +26.5 |" in out.read_text()
