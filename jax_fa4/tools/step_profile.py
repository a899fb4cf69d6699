"""Per-kernel profile of a jitted step from a ``jax.profiler`` trace: what the GPU runs in one
step, grouped and classified, its busy time, idle gaps and host-side launches; and the side by
side of two implementations' steps (jax-fa4's against cuDNN's), per category and per layer.

``jax_fa4.tools.step_bench --profile DIR`` captures the traces (after its timed rounds) and calls
:func:`analyse` and :func:`compare`; this module also re-analyses saved traces::

    python -m jax_fa4.tools.step_profile DIR/<config>/jax-fa4 DIR/<config>/cudnn \\
        --hlo HLO/<config>-jax-fa4.hlo.txt --hlo HLO/<config>-cudnn.hlo.txt \\
        --steps 3 --layers 4 [--out table.md]

Reading the trace (``jax.profiler.ProfileData``, no TensorFlow): on a GPU, the kernels are the
events of the ``/device:GPU:N`` plane's ``Stream #..`` lines (CUPTI: kernels, memcpys, memsets),
each with the stats XLA's annotation gives it (``hlo_op``, ``hlo_module``, ``name`` = the JAX op
name, ``correlation_id`` to its launch call on a host line); on the CPU, the XLA CPU runtime's
thunk events (host lines, stat ``hlo_op``) stand in for kernels. Kernels of another HLO module
are dropped. The ``N`` traced steps run back to back, so a step is the k-th of ``N`` equal runs
of kernels in start order (``steps_consistent``: every run has the same kernel sequence).

Per step: ``span`` = first kernel start to last kernel end; ``busy`` = the union of kernel
intervals over all streams; ``idle`` = span - busy = the sum of the gaps where no kernel runs
(each gap with the kernel before and after it); ``attention`` = the time of the attention
kernels (categories ``attention: jax-fa4`` / ``attention: cuDNN``); ``around_attention`` =
span - attention. Scalars are the median over the traced steps; the kernel groups (by name with
instance numbers stripped) are means per step. A kernel's category comes from its HLO op (the
optimized HLO text: opcode, fusion kind, custom-call target, the ops inside a fusion) where the
trace names one, else from its name.

While a profiler trace runs, XLA runs its command buffers (CUDA graphs) op by op, so a
traced step launches every kernel from the host, where the timed step launches graphs: the
trace's gaps are an upper bound on the timed step's (``host.command_buffers_disabled`` records
XLA's warning). ``hlo.command_buffers`` counts the graphs of the timed step and the ops between
them.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import statistics
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

#: Category names, in table order.
OURS = "attention: jax-fa4"
CUDNN = "attention: cuDNN"
GEMM = "GEMM"
COPY = "XLA copy/transpose"
REDUCE = "XLA reduction fusion"
LOOP = "XLA loop fusion"
XLA_OTHER = "XLA other"
MEM = "memset/memcpy"
OTHER = "other"
CATEGORIES = (OURS, CUDNN, GEMM, COPY, REDUCE, LOOP, XLA_OTHER, MEM, OTHER)
ATTENTION = (OURS, CUDNN)

#: Kernel names of jax-fa4's CuTe-DSL kernels start with this (``@cute.kernel`` methods of the
#: classes under ``jax_fa4/kernels``; the rest of the name is the module path, the class and
#: its arguments' types after ``_object_at_``).
OUR_KERNEL_PREFIX = "kernel_cutlass_kernel_jax_fa4"
#: FFI target of jax-fa4's kernels (``jax_fa4.ffi.runtime.CALL_TARGET``; not imported, so that
#: the analysis runs without the FFI module).
OUR_CALL_TARGET = "CuteDSLRT_NvJaxCutlassCall_v2"
#: jax-fa4 kernel kinds by a class-name fragment, first match wins.
OUR_KINDS = (("Preprocess", "bwd preprocess"), ("Postprocess", "bwd postprocess"),
             ("Backward", "bwd"), ("Forward", "fwd"))
#: cuDNN's attention kernels: the fused attention graphs and their helper kernels in the
#: ``cudnn::fusion`` namespace (the backward's dO·O, dQ conversion and GQA head sum)
_CUDNN_ATTENTION = re.compile(r"sdpa|fmha|flash_fprop|flash_bprop|flash_attn|cudnn::fusion::",
                              re.I)
_GEMM_NAME = re.compile(r"gemm|nvjet|xmma|cublas|cutlass|matmul|triton_.*dot|wgmma", re.I)
_MEM_NAME = re.compile(r"^mem(cpy|set)|memset|memcpy", re.I)
#: Host calls that put work on a GPU stream (CUDA driver and runtime API names).
_LAUNCH_CALL = re.compile(r"^cu(da)?(LaunchKernel|LaunchCooperativeKernel|GraphLaunch|Memset|"
                          r"Memcpy)", re.I)
#: Ops inside a fusion that are bookkeeping, not work.
_TRIVIAL_OPS = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast"})
#: Ops that only move or reinterpret data.
_LAYOUT_OPS = frozenset({"copy", "transpose", "bitcast", "reshape", "convert", "copy-start",
                         "copy-done"})
TOP_GAPS = 8
TOP_ROWS = 15


# -- the trace ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Event:
    """One trace event: a kernel on a device line or a call on a host line."""

    name: str
    start_ns: float
    dur_ns: float
    stats: dict[str, Any]
    line: str
    plane: str

    @property
    def end_ns(self) -> float:
        return self.start_ns + self.dur_ns

    @property
    def hlo_op(self) -> str | None:
        value = self.stats.get("hlo_op")
        return None if value is None else str(value)


def find_xplane(log_dir: Path) -> Path:
    """The newest ``*.xplane.pb`` that ``jax.profiler.trace(log_dir)`` wrote."""
    found = sorted(Path(log_dir).rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no *.xplane.pb under {log_dir}")
    return found[-1]


def events_of(profile: Any) -> list[Event]:
    """Every event of a ``jax.profiler.ProfileData`` (planes -> lines -> events), flattened."""
    out = []
    for plane in profile.planes:
        for line in plane.lines:
            for ev in line.events:
                out.append(Event(ev.name, float(ev.start_ns), float(ev.duration_ns),
                                 dict(ev.stats), line.name, plane.name))
    return out


def load_events(path: Path) -> list[Event]:
    """The events of a trace file, or of the newest trace under a ``jax.profiler`` log dir."""
    from jax.profiler import ProfileData

    path = Path(path)
    return events_of(ProfileData.from_file(str(find_xplane(path) if path.is_dir() else path)))


def capture(run: Callable[[], None], log_dir: Path) -> Path:
    """Trace ``run()`` with ``jax.profiler.trace`` into ``log_dir`` (no Python tracer, no HLO
    protos in the trace: they are most of its size); the trace file's path. ``run`` must wait
    for its results."""
    import jax

    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    options.enable_hlo_proto = False
    log_dir.mkdir(parents=True, exist_ok=True)
    with jax.profiler.trace(str(log_dir), profiler_options=options):
        run()
    return find_xplane(log_dir)


# -- the HLO -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class HloOp:
    """One instruction of optimized HLO text."""

    name: str
    opcode: str
    shape: str
    kind: str | None = None
    target: str | None = None
    op_name: str | None = None
    fused_ops: frozenset[str] = frozenset()
    gemm: bool = False


_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")


def parse_hlo(text: str) -> tuple[dict[str, HloOp], dict[str, Any]]:
    """The instructions of optimized HLO text by name (a fusion with the ops inside it), and a
    summary: the module's name, its command buffers (``command_buffer`` computations XLA runs
    as CUDA graphs) and the entry's ops outside them."""
    comps: dict[str, list[tuple[str, str, str, str]]] = {}
    entry = None
    current: list[tuple[str, str, str, str]] | None = None
    module = None
    for line in text.splitlines():
        if line.startswith("HloModule "):
            module = line.split()[1].rstrip(",")
            continue
        head = _COMPUTATION.match(line)
        if head and " = " not in line:
            current = comps.setdefault(head.group(2), [])
            if head.group(1):
                entry = head.group(2)
            continue
        if line.startswith("}"):
            current = None
            continue
        inst = _INSTRUCTION.match(line)
        if inst and current is not None:
            current.append((inst.group(1), inst.group(3), inst.group(2), inst.group(4)))
    ops: dict[str, HloOp] = {}
    for insts in comps.values():
        for name, opcode, shape, rest in insts:
            kind = re.search(r"\bkind=(k\w+)", rest)
            calls = re.search(r"\bcalls=%?([\w.\-]+)", rest)
            target = re.search(r'custom_call_target="([^"]+)"', rest)
            op_name = re.search(r'op_name="([^"]*)"', rest)
            fused = frozenset(o for _, o, _, _ in comps.get(calls.group(1), [])
                              ) - _TRIVIAL_OPS if calls else frozenset()
            gemm = ("__triton_gemm" in rest or "dot" in fused or "convolution" in fused
                    or opcode in ("dot", "convolution")
                    or (target is not None and target.group(1).startswith("__cublas")))
            ops[name] = HloOp(name, opcode, shape, kind and kind.group(1),
                              target and target.group(1), op_name and op_name.group(1),
                              fused, gemm)
    graphs = [c for c in comps if c.startswith("command_buffer")]
    outside = []
    for name, opcode, _, rest in comps.get(entry or "", []):
        called = re.search(r"\bto_apply=%?([\w.\-]+)", rest)
        if opcode in _TRIVIAL_OPS or (called and called.group(1).startswith("command_buffer")):
            continue
        outside.append(name)
    summary = {"module": module, "command_buffers": len(graphs),
               "entry_ops_outside_command_buffers": len(outside),
               "entry_ops_outside_command_buffers_names": outside[:40]}
    return ops, summary


# -- kernels -----------------------------------------------------------------------------------
def device_kernels(events: Iterable[Event], module: str | None = None) -> list[Event]:
    """The kernels (memcpys and memsets too) in start order: the GPU planes' stream lines, else
    (a CPU trace) the XLA CPU runtime's thunk events; those of another HLO module dropped."""
    events = list(events)
    gpu = [e for e in events if e.plane.startswith("/device:GPU") and e.line.startswith("Stream #")]
    kernels = gpu or [e for e in events if e.plane.startswith("/host:") and e.hlo_op is not None
                      and not e.name.startswith("end: ")]
    if module is not None:
        kernels = [e for e in kernels if e.stats.get("hlo_module") in (None, module)]
    return sorted(kernels, key=lambda e: (e.start_ns, e.end_ns))


def short_name(name: str) -> str:
    """A kernel's group name: jax-fa4's without the argument types, XLA's without the instance
    number (``loop_add_fusion_3`` -> ``loop_add_fusion``)."""
    if name.startswith(OUR_KERNEL_PREFIX):
        rest = name[len(OUR_KERNEL_PREFIX):].split("_object_at_")[0]
        return "jax_fa4:" + rest.removeprefix("kernels")
    base = re.sub(r"([._]\d+)+$", "", name)
    return base[:160]


def classify(name: str, op: HloOp | None) -> str:
    """A kernel's category from its name and HLO op (None where the trace names none)."""
    target = op.target if op else None
    if _MEM_NAME.search(name):  # also where an attention call issues it
        return MEM
    if name.startswith(OUR_KERNEL_PREFIX) or target == OUR_CALL_TARGET:
        return OURS
    if (target or "").startswith("__cudnn$fmha") or _CUDNN_ATTENTION.search(name):
        return CUDNN
    if (op and op.gemm) or _GEMM_NAME.search(name):
        return GEMM
    if op is not None:
        if op.opcode in ("copy", "transpose", "copy-start") or op.fused_ops & {"copy",
                                                                               "transpose"}:
            return COPY
        if op.opcode == "reduce" or op.kind == "kInput" or "reduce" in op.fused_ops:
            return REDUCE
        if op.opcode == "fusion":
            return LOOP
        return XLA_OTHER if op.opcode != "custom-call" else OTHER
    low = name.lower()
    if "transpose" in low or "copy" in low:
        return COPY
    if "reduce" in low or low.startswith("input_"):
        return REDUCE
    if "fusion" in low or low.startswith("loop_"):
        return LOOP
    return OTHER


def our_kind(name: str) -> str | None:
    """fwd / bwd / bwd preprocess / bwd postprocess for a jax-fa4 kernel name, else None."""
    if not name.startswith(OUR_KERNEL_PREFIX):
        return None
    return next((kind for frag, kind in OUR_KINDS if frag in name), "other")


def split_steps(kernels: Sequence[Event], steps: int) -> tuple[list[list[Event]], bool]:
    """The kernels of ``steps`` back-to-back steps (start order) cut into equal runs, and
    whether every run has the same sequence of kernel names. Leftover kernels (a count that
    ``steps`` does not divide) are dropped, and the runs are then not consistent."""
    per = len(kernels) // max(steps, 1)
    runs = [list(kernels[i * per:(i + 1) * per]) for i in range(steps)] if per else []
    names = [[short_name(k.name) for k in run] for run in runs]
    consistent = bool(runs) and len(kernels) == per * steps and all(n == names[0] for n in names)
    return runs, consistent


# -- one step ----------------------------------------------------------------------------------
def _label(k: Event, ops: dict[str, HloOp]) -> dict[str, Any]:
    op = ops.get(k.hlo_op or "")
    return {"kernel": short_name(k.name), "hlo_op": k.hlo_op, "category": classify(k.name, op)}


def timeline(run: Sequence[Event], ops: dict[str, HloOp]) -> dict[str, Any]:
    """Span, busy time (union over streams), the gaps where no kernel runs (largest first,
    each with the kernel before and after it and where it starts in the step), in us."""
    order = sorted(run, key=lambda e: (e.start_ns, e.end_ns))
    first, end, last = order[0].start_ns, order[0].end_ns, order[0]
    seg, busy, gaps = first, 0.0, []
    for k in order[1:]:
        if k.start_ns > end:
            gaps.append({"us": (k.start_ns - end) / 1e3, "at_us": (end - first) / 1e3,
                         "before": _label(last, ops), "after": _label(k, ops),
                         "_prev": last, "_next": k})
            busy += end - seg
            seg, end, last = k.start_ns, k.end_ns, k
        elif k.end_ns > end:
            end, last = k.end_ns, k
    busy += end - seg
    gaps.sort(key=lambda g: -g["us"])
    return {"span_us": (end - first) / 1e3, "busy_us": busy / 1e3,
            "idle_us": (end - first - busy) / 1e3, "gaps": gaps}


def step_figures(run: Sequence[Event], ops: dict[str, HloOp],
                 launches: dict[Any, Event]) -> dict[str, Any]:
    """One step's scalars (us): span, busy, idle, per category, attention, around attention,
    the gaps next to an attention kernel, and the gaps whose next kernel was launched from the
    host only after the GPU had gone idle (``launch_bound``; None without launch records)."""
    tl = timeline(run, ops)
    cats = dict.fromkeys(CATEGORIES, 0.0)
    for k in run:
        cats[classify(k.name, ops.get(k.hlo_op or ""))] += k.dur_ns / 1e3
    attention = sum(cats[c] for c in ATTENTION)
    near = sum(g["us"] for g in tl["gaps"]
               if g["before"]["category"] in ATTENTION or g["after"]["category"] in ATTENTION)
    bound = None
    if launches:
        bound = 0.0
        for g in tl["gaps"]:
            call = launches.get(g["_next"].stats.get("correlation_id"))
            if call is not None and call.start_ns >= g["_prev"].end_ns:
                bound += g["us"]
    return {"span_us": tl["span_us"], "busy_us": tl["busy_us"], "idle_us": tl["idle_us"],
            "attention_us": attention, "around_attention_us": tl["span_us"] - attention,
            "idle_next_to_attention_us": near, "idle_launch_bound_us": bound,
            "kernels": len(run), "categories_us": cats, "_timeline": tl}


def host_summary(events: Sequence[Event], steps: int) -> dict[str, Any]:
    """Host side: the Python dispatch of each step (``PjitFunction`` events), the calls that
    put work on a GPU stream (count and us per step by name), and whether XLA ran its command
    buffers op by op under the profiler."""
    host = [e for e in events if not e.plane.startswith("/device:")]
    dispatch = [e.dur_ns / 1e3 for e in host if e.name.startswith("PjitFunction(")]
    calls: dict[str, list[float]] = {}
    for e in host:
        if _LAUNCH_CALL.match(e.name):
            calls.setdefault(e.name, []).append(e.dur_ns / 1e3)
    return {"python_dispatch_us": dispatch,
            "python_dispatch_median_us": statistics.median(dispatch) if dispatch else None,
            "launch_calls_per_step": {n: {"count": len(v) / steps, "us": sum(v) / steps}
                                      for n, v in sorted(calls.items())},
            "command_buffers_disabled": any(e.name.startswith("WARNING: CommandBuffer disabled")
                                            for e in host)}


def _groups(runs: Sequence[Sequence[Event]], ops: dict[str, HloOp]) -> dict[str, dict[str, Any]]:
    """Kernels by group name (``short_name``; a name whose kernels fall in two categories, such
    as the CPU's ``ynn_fusion`` (dots and reductions), gets the second's in brackets): count and
    us per step, mean us, category, the HLO ops and JAX op names behind them; longest first."""
    out: dict[str, dict[str, Any]] = {}
    n = len(runs)
    for run in runs:
        for k in run:
            op = ops.get(k.hlo_op or "")
            category = classify(k.name, op)
            key = short_name(k.name)
            if key in out and out[key]["category"] != category:
                key = f"{key} ({category})"
            g = out.setdefault(key, {"category": category, "count": 0.0, "us": 0.0,
                                     "hlo_ops": set(), "op_names": set()})
            g["count"] += 1 / n
            g["us"] += k.dur_ns / 1e3 / n
            if k.hlo_op:
                g["hlo_ops"].add(k.hlo_op)
            op_name = (op and op.op_name) or k.stats.get("name") or k.stats.get("op_name")
            if op_name:
                g["op_names"].add(str(op_name))
            kind = our_kind(k.name)
            if kind:
                g["kind"] = kind
    for g in out.values():
        g["mean_us"] = g["us"] / g["count"] if g["count"] else 0.0
        g["hlo_ops"] = sorted(g["hlo_ops"])[:12]
        g["op_names"] = sorted(g["op_names"])[:4]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["us"]))


def _copies(runs: Sequence[Sequence[Event]], ops: dict[str, HloOp]) -> list[dict[str, Any]]:
    """The copy / transpose kernels by HLO op: us per step, shape, JAX op name, the ops inside
    the fusion and whether it only moves data (``layout_only``: copies, transposes, bitcasts,
    reshapes, converts)."""
    rows: dict[str, dict[str, Any]] = {}
    for run in runs:
        for k in run:
            op = ops.get(k.hlo_op or "")
            if classify(k.name, op) != COPY:
                continue
            key = k.hlo_op or k.name
            row = rows.setdefault(key, {"hlo_op": k.hlo_op, "kernel": short_name(k.name),
                                        "shape": op.shape if op else None,
                                        "fused_ops": sorted(op.fused_ops) if op else [],
                                        "layout_only": bool(op) and (
                                            op.fused_ops or {op.opcode}) <= _LAYOUT_OPS,
                                        "op_name": (op and op.op_name) or k.stats.get("name"),
                                        "us": 0.0})
            row["us"] += k.dur_ns / 1e3 / len(runs)
    return sorted(rows.values(), key=lambda r: -r["us"])


def kernel_rows(run: Sequence[Event], ops: dict[str, HloOp]) -> list[dict[str, Any]]:
    """A step's kernels in start order: start (us from the step's first), duration, line,
    group name, HLO op, category."""
    t0 = min(k.start_ns for k in run)
    return [{"at_us": round((k.start_ns - t0) / 1e3, 3), "us": round(k.dur_ns / 1e3, 3),
             "line": k.line, **_label(k, ops)} for k in run]


def analyse(events: Sequence[Event], hlo_text: str | None, steps: int, layers: int
            ) -> dict[str, Any]:
    """One implementation's traced steps: per-step scalars (median over steps, and each
    step's span), per layer, per category, the kernel groups, the copies / transposes, the
    largest gaps of the median step, the host side, the HLO's command buffers, and the median
    step's kernels in order (``median_step_kernels``, for a file of its own)."""
    ops, hlo = parse_hlo(hlo_text) if hlo_text else ({}, {})
    kernels = device_kernels(events, hlo.get("module"))
    runs, consistent = split_steps(kernels, steps)
    if not runs:
        return {"error": f"{len(kernels)} kernels in the trace for {steps} steps",
                "host": host_summary(events, steps), "hlo": hlo}
    launches = {e.stats["correlation_id"]: e for e in events
                if not e.plane.startswith("/device:") and "correlation_id" in e.stats}
    figures = [step_figures(run, ops, launches) for run in runs]
    order = sorted(range(len(figures)), key=lambda i: figures[i]["span_us"])
    mid = figures[order[len(order) // 2]]
    scalars = ("span_us", "busy_us", "idle_us", "attention_us", "around_attention_us",
               "idle_next_to_attention_us", "idle_launch_bound_us")
    step = {key: (statistics.median(f[key] for f in figures)
                  if figures[0][key] is not None else None) for key in scalars}
    cats = {c: statistics.median(f["categories_us"][c] for f in figures) for c in CATEGORIES}
    gaps = [{k: v for k, v in g.items() if not k.startswith("_")}
            for g in mid["_timeline"]["gaps"][:TOP_GAPS]]
    return {
        "steps": len(runs), "steps_consistent": consistent, "layers": layers,
        "kernels_per_step": len(runs[0]), "kernels_in_trace": len(kernels),
        "source": "gpu streams" if any(k.plane.startswith("/device:GPU") for k in kernels)
        else "host thunks",
        "step_us": step, "step_spans_us": [f["span_us"] for f in figures],
        "per_layer_us": {k: (v / layers if v is not None else None) for k, v in step.items()},
        "categories_us": cats, "largest_gaps": gaps, "groups": _groups(runs, ops),
        "copies_transposes": _copies(runs, ops), "host": host_summary(events, steps),
        "hlo": hlo, "median_step_kernels": kernel_rows(runs[order[len(order) // 2]], ops)}


# -- two implementations side by side ----------------------------------------------------------
def compare(ours: dict[str, Any], base: dict[str, Any], layers: int) -> dict[str, Any]:
    """Ours against the baseline: each scalar and category per step and per layer (ours -
    baseline), and the kernel groups only one side runs or whose time differs most."""
    def diff(a: float | None, b: float | None) -> dict[str, float | None]:
        d = None if a is None or b is None else a - b
        return {"ours": a, "base": b, "diff": d, "diff_per_layer": None if d is None
                else d / layers}

    step = {k: diff(ours["step_us"][k], base["step_us"][k]) for k in ours["step_us"]}
    cats = {c: diff(ours["categories_us"][c], base["categories_us"][c]) for c in CATEGORIES
            if ours["categories_us"][c] or base["categories_us"][c]}
    go, gb = ours["groups"], base["groups"]

    def brief(g: dict[str, Any]) -> dict[str, Any]:
        return {k: g[k] for k in ("category", "count", "us", "hlo_ops", "op_names") if k in g}

    only_ours = {n: brief(g) for n, g in go.items() if n not in gb}
    only_base = {n: brief(g) for n, g in gb.items() if n not in go}
    both = sorted((n for n in go if n in gb), key=lambda n: -abs(go[n]["us"] - gb[n]["us"]))
    changed = {n: {"category": go[n]["category"], "ours_count": go[n]["count"],
                   "base_count": gb[n]["count"], "ours_us": go[n]["us"], "base_us": gb[n]["us"],
                   "diff_us": go[n]["us"] - gb[n]["us"]} for n in both[:TOP_ROWS]}
    return {"layers": layers, "step_us": step, "categories_us": cats,
            "only_ours": only_ours, "only_base": only_base, "changed": changed}


def _n(x: float | None, spec: str = ".1f") -> str:
    return "–" if x is None else format(x, spec)


def markdown(config: str, base_name: str, ours: dict[str, Any], base: dict[str, Any],
             cmp: dict[str, Any]) -> str:
    """The side-by-side tables of one config (us per step and per layer)."""
    lines = [f"### {config}: jax-fa4 vs {base_name} ({cmp['layers']} layers, us; median of "
             f"{ours.get('steps')} / {base.get('steps')} traced steps)", "",
             f"Kernels from {ours.get('source')} / {base.get('source')}; steps consistent: "
             f"{ours.get('steps_consistent')} / {base.get('steps_consistent')}; kernels per "
             f"step: {ours.get('kernels_per_step')} / {base.get('kernels_per_step')}.", "",
             f"| per step | jax-fa4 | {base_name} | diff | diff per layer |",
             "|---|---|---|---|---|"]
    for key, row in cmp["step_us"].items():
        lines.append(f"| {key[:-3]} | {_n(row['ours'])} | {_n(row['base'])} | "
                     f"{_n(row['diff'], '+.1f')} | {_n(row['diff_per_layer'], '+.1f')} |")
    lines += ["", f"| category | jax-fa4 | {base_name} | diff | diff per layer |",
              "|---|---|---|---|---|"]
    for cat, row in cmp["categories_us"].items():
        lines.append(f"| {cat} | {_n(row['ours'])} | {_n(row['base'])} | "
                     f"{_n(row['diff'], '+.1f')} | {_n(row['diff_per_layer'], '+.1f')} |")
    for title, rows in (("only jax-fa4 runs", cmp["only_ours"]),
                        (f"only {base_name} runs", cmp["only_base"])):
        lines += ["", f"| {title} | category | count / step | us / step | count / layer | "
                  "us / layer | HLO ops |", "|---|---|---|---|---|---|---|"]
        for name, g in list(rows.items())[:TOP_ROWS]:
            lines.append(f"| `{name[:90]}` | {g['category']} | {_n(g['count'], '.1f')} | "
                         f"{_n(g['us'])} | {_n(g['count'] / cmp['layers'], '.2f')} | "
                         f"{_n(g['us'] / cmp['layers'])} | {', '.join(g['hlo_ops'][:4])} |")
    lines += ["", f"| both run, largest differences | category | count ours / {base_name} | "
              f"us ours / {base_name} | diff |", "|---|---|---|---|---|"]
    for name, g in cmp["changed"].items():
        lines.append(f"| `{name[:90]}` | {g['category']} | {_n(g['ours_count'], '.1f')} / "
                     f"{_n(g['base_count'], '.1f')} | {_n(g['ours_us'])} / {_n(g['base_us'])} | "
                     f"{_n(g['diff_us'], '+.1f')} |")
    for label, prof in (("jax-fa4", ours), (base_name, base)):
        lines += ["", f"Largest gaps of {label}'s median step (us at us: before -> after):"]
        lines += [f"- {g['us']:.1f} at {g['at_us']:.0f}: `{g['before']['kernel'][:60]}` "
                  f"({g['before']['hlo_op']}) -> `{g['after']['kernel'][:60]}` "
                  f"({g['after']['hlo_op']})" for g in prof.get("largest_gaps", [])[:5]]
        copies = prof.get("copies_transposes", [])[:8]
        if copies:
            lines += [f"Copies / transposes of {label} (us per step, HLO op, shape, op name):"]
            lines += [f"- {c['us']:.1f} `{c['hlo_op']}` {c['shape']} {c['op_name']}"
                      f"{' (layout only)' if c['layout_only'] else ''}" for c in copies]
        host = prof.get("host", {})
        hlo = prof.get("hlo", {})
        lines.append(f"Host: Python dispatch {_n(host.get('python_dispatch_median_us'))} us a "
                     f"step; command buffers run op by op in the trace: "
                     f"{host.get('command_buffers_disabled')}; HLO command buffers "
                     f"{hlo.get('command_buffers')}, entry ops outside them "
                     f"{hlo.get('entry_ops_outside_command_buffers')}.")
    return "\n".join(lines) + "\n"


# -- command line ------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """Re-analyse two saved traces (ours, then the baseline) and print the tables."""
    p = argparse.ArgumentParser(prog="python -m jax_fa4.tools.step_profile",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("ours", type=Path, help="jax-fa4's trace (log dir or .xplane.pb)")
    p.add_argument("base", type=Path, help="the baseline's trace")
    p.add_argument("--hlo", type=Path, action="append", default=[],
                   help="optimized HLO text, ours then the baseline's (twice)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--base-name", default="cudnn")
    p.add_argument("--config", default="step")
    p.add_argument("--out", type=Path, default=None, help="also write the tables here")
    args = p.parse_args(argv)
    if len(args.hlo) not in (0, 2):
        p.error("--hlo goes twice (ours, then the baseline's) or not at all")
    texts = [h.read_text() for h in args.hlo] or [None, None]
    profs = [analyse(load_events(t), h, args.steps, args.layers)
             for t, h in zip((args.ours, args.base), texts)]
    for prof in profs:
        if "error" in prof:
            raise SystemExit(prof["error"])
    table = markdown(args.config, args.base_name, *profs,
                     compare(profs[0], profs[1], args.layers))
    print(table)
    if args.out is not None:
        args.out.write_text(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
