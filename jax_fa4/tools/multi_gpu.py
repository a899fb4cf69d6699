"""Multi-GPU correctness and scaling: sharded attention, ring attention, sharded training.

On the GPUs of one host (every visible device: ``CUDA_VISIBLE_DEVICES=0,1`` runs two), in one
process, writing what it measured after every part:

* **checks**: each case against the float32 reference by FA4's rule
  (:mod:`jax_fa4.tools.fa4_rule`, the naive bf16 computation as the rule's baseline), the
  outputs (out, lse) and the gradients (dq, dk, dv, cotangents on out and lse):
  ``flash_attention`` under ``jit`` with q, k, v sharded over the batch, over the heads (GQA:
  H = 4·Hkv with Hkv = N) and over both (N ≥ 4), causal and not (Sk ≠ Sq without a mask), where
  the compiled program must gather nothing; ring attention in ``shard_map``, causal with the
  zig-zag and the contiguous layout and not causal; the GPT example's ``--mesh`` runs (data
  parallel, and data × heads when N ≥ 2), whose losses with the kernels must track the reference
  implementation's over the same steps.
* **ring scaling**: ring attention at head dim 128 (B=1, H=32, Hkv=8, bf16), causal (zig-zag)
  and not, at 32k and 128k tokens (and 512k and 1M on 8 GPUs): time per forward and per
  forward+backward, TFLOP/s per GPU (the anchors' FLOP convention: a causal mask halves the
  FLOPs, the backward is 2.5x the forward) and ``efficiency``: the ring's TFLOP/s per GPU over
  the TFLOP/s of the single-GPU kernel on the per-device block (one ``flash_attention`` call on
  one GPU with q, k, v of S/N tokens, no mask). ``ideal_ms`` adds the single-GPU times of the
  calls that one device makes over the ring's steps (the slowest device's for causal), so
  ``kernel_share = ideal_ms / ms`` is the part of the ring's time its kernels take; the rest is
  K/V transfers that did not overlap, the merges and the launches between.
* **training scaling**: ``examples/train_gpt.py --mesh`` tokens/s on 1, 2, 4, ... N GPUs, each
  in its own process (data parallel with the batch growing with the GPUs, and data x heads),
  with ``scaling`` = tokens/s over N times the one-GPU figure.
* peak memory per device of every run (the allocator's high-water mark during it).

    python benchmarks/multi_gpu.py                          # everything, every visible GPU
    python benchmarks/multi_gpu.py --parts checks           # the correctness suite alone
    python benchmarks/multi_gpu.py --block-baselines 2,4,8  # one GPU: the single-GPU
                                                            # kernel on N-GPU rings' blocks
    python benchmarks/multi_gpu.py --smoke                  # tiny sizes (CPU, simulated devices)
    python benchmarks/multi_gpu.py --readme                 # docs/sharding.md's multi-GPU section

(``python -m jax_fa4.tools.multi_gpu`` is the same command.) The GPU tests run the same checks
(``tests/gpu/test_multi_gpu.py``), the CPU tests the whole run at ``--smoke`` sizes.
Writes ``benchmarks/results/multi-gpu-<gpu>-x<N>-<date>.json`` (or ``--out``) with the
command, the GPU count, the date and the versions; exits 1 when a check failed.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_fa4
from jax_fa4 import reference
from jax_fa4.parallel import ring
from jax_fa4.tools import bench
from jax_fa4.tools.bench_env import versions
from jax_fa4.tools.bench_harness import error_text, timing_parser
from jax_fa4.tools.bench_shapes import Shape
from jax_fa4.tools.fa4_rule import fa4_error
from jax_fa4.tools.readme_tables import markdown_table, render

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the checkout: jax_fa4/tools/ is two below

PARTS = ("checks", "ring", "train")
Record = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The problem sizes of a run (``SMOKE``: a few seconds on simulated CPU devices)."""
    seq: int = 1000  # sharded checks: Sq, and Sk under a causal mask
    seq_k: int = 1537  # sharded checks: Sk without a mask
    head_dim: int = 128
    ring_local: int = 1000  # ring checks: tokens per device
    ring_heads: tuple[int, int] = (8, 2)  # ring checks: (H, Hkv)
    scaling_seqs: tuple[int, ...] = (32768, 131072)
    scaling_seqs_8: tuple[int, ...] = (524288, 1048576)  # added with 8 or more devices
    scaling_heads: tuple[int, int] = (32, 8)
    tiny_gpt: bool = False  # train_gpt.py's TINY config instead of its GPU one
    check_steps: int = 30  # steps of the GPT checks
    speed_steps: int = 60  # steps of the tokens/s runs


FULL = Sizes()
SMOKE = Sizes(seq=40, seq_k=57, head_dim=32, ring_local=24, ring_heads=(4, 2),
              scaling_seqs=(256,), scaling_seqs_8=(), scaling_heads=(4, 2), tiny_gpt=True,
              check_steps=4, speed_steps=4)


# -- helpers -----------------------------------------------------------------------------------
def normal(key: jax.Array, shape: tuple[int, ...], dtype=jnp.bfloat16,
           sharding: Any = None) -> jax.Array:
    """Standard normal ``shape`` drawn in float32, cast to ``dtype``, made where ``sharding``
    puts it (default: the first device)."""
    draw = jax.jit(lambda k: jax.random.normal(k, shape, jnp.float32).astype(dtype),
                   out_shardings=sharding)
    return draw(key)


def mesh_of(devices: Sequence[jax.Device], shape: tuple[int, ...],
            names: tuple[str, ...]) -> jax.sharding.Mesh:
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape),
                         devices=list(devices))


def oracles(q, k, v, ct_out, ct_lse, causal: bool) -> tuple[Record, Record]:
    """(ref, pt): out, lse and the gradients of ``sum(out·ct_out) + sum(lse·ct_lse)`` from the
    float32 reference on the upcast inputs (out and gradients rounded to the inputs' dtype, as
    FA4's rule compares them) and from the naive computation in the inputs' dtype."""
    window = (None, 0) if causal else (None, None)

    def run(compute_dtype, *inputs) -> Record:
        program = grad_program(lambda q, k, v: reference.attention(
            q, k, v, window=window, compute_dtype=compute_dtype), ct_out, ct_lse)
        results = results_record(program(*inputs))
        return {n: x if n == "lse" else x.astype(ct_out.dtype) for n, x in results.items()}

    return run(jnp.float32, *(x.astype(jnp.float32) for x in (q, k, v))), run(q.dtype, q, k, v)


def compare(got: Record, ref: Record, pt: Record) -> Record:
    """FA4's rule on every entry of ``got``: {name: {err, bound, passed}}."""
    errors = {}
    for name, value in got.items():
        e = fa4_error(value, ref[name], pt[name])
        errors[name] = {"err": e.err, "bound": e.bound, "passed": e.passed}
    return errors


def poison(devices: Sequence[jax.Device], nbytes: int = 1 << 28) -> None:
    """Fill and free a block on every GPU, so that fresh outputs start as NaN, not zeros."""
    for device in devices:
        if device.platform == "cpu":
            continue
        jnp.full((nbytes // 4,), jnp.nan, jnp.float32, device=device).block_until_ready().delete()


def rel_diff(a, b) -> float:
    """max|a - b| over max(1, max|b|)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b))) / max(1.0, float(np.max(np.abs(b))))


def collective_counts(compiled: Any) -> dict[str, int]:
    return {op: len(shapes) for op, shapes in bench.collectives(compiled.as_text()).items()}


def peak_run(devices: Sequence[jax.Device], run: Callable[[], Any], need: int = 0) -> list:
    """``run()``'s peak allocator bytes per device (None where not exact)."""
    return bench.peak_bytes_per_device(devices, lambda: jax.block_until_ready(run()), need)


def qkv_cotangents(seed: int, b: int, sq: int, sk: int, h: int, hkv: int, d: int):
    ks = jax.random.split(jax.random.key(seed), 5)
    return (normal(ks[0], (b, sq, h, d)), normal(ks[1], (b, sk, hkv, d)),
            normal(ks[2], (b, sk, hkv, d)), normal(ks[3], (b, sq, h, d)),
            normal(ks[4], (b, h, sq), jnp.float32))


def grad_program(attention: Callable, ct_out, ct_lse) -> Callable:
    """jit of ``(q, k, v) -> ((dq, dk, dv), (out, lse))`` for ``attention -> (out, lse)``."""
    def loss(q, k, v):
        out, lse = attention(q, k, v)
        value = (jnp.sum(out.astype(jnp.float32) * ct_out.astype(jnp.float32))
                 + jnp.sum(lse * ct_lse))
        return value, (out, lse)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))


def results_record(program_out) -> Record:
    (dq, dk, dv), (out, lse) = program_out
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def one_device(program: Callable, device: jax.Device, *inputs) -> Record:
    """``program``'s results with every input on ``device`` alone."""
    return results_record(program(*(jax.device_put(x, device) for x in inputs)))


# -- checks ------------------------------------------------------------------------------------
def sharded_check(devices: Sequence[jax.Device], layout: str, causal: bool,
                  sizes: Sizes, seed: int = 0) -> Record:
    """``flash_attention`` with q, k, v sharded over the batch, the heads or both."""
    n = len(devices)
    if layout == "batch":
        mesh, spec, (b, h, hkv) = mesh_of(devices, (n,), ("data",)), P("data"), (2 * n, 8, 2)
    elif layout == "heads":  # GQA: every device holds whole groups of 4 query heads
        mesh, spec, (b, h, hkv) = (mesh_of(devices, (n,), ("model",)), P(None, None, "model"),
                                   (2, 4 * n, n))
    else:
        mesh = mesh_of(devices, (2, n // 2), ("data", "model"))
        spec, (b, h, hkv) = P("data", None, "model"), (4, 2 * n, n // 2)
    sq = sizes.seq
    sk = sq if causal else sizes.seq_k
    q, k, v, ct_out, ct_lse = qkv_cotangents(seed, b, sq, sk, h, hkv, sizes.head_dim)
    program = grad_program(lambda q, k, v: jax_fa4.flash_attention(
        q, k, v, causal=causal, return_lse=True), ct_out, ct_lse)
    placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
    compiled = program.lower(*placed).compile()
    poison(devices)
    got = results_record(compiled(*placed))
    errors = compare(got, *oracles(q, k, v, ct_out, ct_lse, causal))
    # Each device runs the same kernels on its rows / heads: one GPU agrees to rounding.
    one = one_device(program, devices[0], q, k, v)
    vs_one = {n: rel_diff(got[n], one[n]) for n in ("out", "dq", "dk", "dv")}
    counts = collective_counts(compiled)
    gathered = sorted(op for op in ("all-gather", "all-to-all") if op in counts)
    return {"shape": dict(B=b, Sq=sq, Sk=sk, H=h, Hkv=hkv, D=sizes.head_dim),
            "mesh": dict(mesh.shape), "spec": str(spec), "errors": errors,
            "rel_diff_vs_one_gpu": vs_one, "collectives": counts, "gathered": gathered,
            "passed": (not gathered and all(e["passed"] for e in errors.values())
                       and all(x <= 1e-2 for x in vs_one.values()))}


def ring_check(devices: Sequence[jax.Device], causal: bool, layout: str, sizes: Sizes,
               seed: int = 1) -> Record:
    """``ring_attention`` over all devices against attention over the whole sequence."""
    n = len(devices)
    mesh = mesh_of(devices, (n,), ("sp",))
    h, hkv = sizes.ring_heads
    s = sizes.ring_local * n
    q, k, v, ct_out, ct_lse = qkv_cotangents(seed, 2, s, s, h, hkv, sizes.head_dim)
    zig = causal and layout == "zigzag"
    to = (lambda x, axis=1: ring.zigzag(x, n, axis=axis)) if zig else (lambda x, axis=1: x)
    back = (lambda x, axis=1: ring.unzigzag(x, n, axis=axis)) if zig else (lambda x, axis=1: x)
    split = jax.shard_map(
        lambda q, k, v: ring.ring_attention(q, k, v, axis_name="sp", causal=causal,
                                            layout=layout, return_lse=True),
        mesh=mesh, in_specs=P(None, "sp"), out_specs=(P(None, "sp"), P(None, None, "sp")))

    def attention(q, k, v):
        out, lse = split(to(q), to(k), to(v))
        return back(out), back(lse, axis=2)

    program = grad_program(attention, ct_out, ct_lse)
    placed = [jax.device_put(x, NamedSharding(mesh, P(None, "sp"))) for x in (q, k, v)]
    compiled = program.lower(*placed).compile()
    poison(devices)
    got = results_record(compiled(*placed))
    ref, pt = oracles(q, k, v, ct_out, ct_lse, causal)
    errors = compare(got, ref, pt)
    # On GPUs, FA4's rule with one GPU's kernels on the whole sequence as the baseline: the
    # ring is as accurate as one GPU (out and gradients; elsewhere the one-device result is the
    # float32-accurate reference, no baseline for a 16-bit result).
    vs_one: Record = {}
    if devices[0].platform != "cpu":
        one = one_device(grad_program(lambda q, k, v: jax_fa4.flash_attention(
            q, k, v, causal=causal, return_lse=True), ct_out, ct_lse), devices[0], q, k, v)
        vs_one = compare({n: got[n] for n in ("out", "dq", "dk", "dv")}, ref, one)
    return {"shape": dict(B=2, S=s, H=h, Hkv=hkv, D=sizes.head_dim), "devices": n,
            "layout": layout if causal else "contiguous", "errors": errors,
            "errors_vs_one_gpu": vs_one, "collectives": collective_counts(compiled),
            "passed": all(e["passed"] for e in (*errors.values(), *vs_one.values()))}


def load_train_gpt():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import train_gpt
    finally:
        sys.path.remove(str(ROOT / "examples"))
    return train_gpt


def gpt_check(mesh_spec: str, sizes: Sizes) -> Record:
    """The GPT example on every device (``--mesh mesh_spec``), with the kernels and with the
    reference implementation, same seed and data: the losses must agree to bf16 rounding."""
    train_gpt = load_train_gpt()
    cfg = train_gpt.TINY if sizes.tiny_gpt else train_gpt.GPU
    runs = {impl or "auto": train_gpt.train(cfg, steps=sizes.check_steps, seed=0,
                                            implementation=impl, mesh_spec=mesh_spec,
                                            progress=False)
            for impl in (None, "reference")}
    kernel, ref = (np.array(runs[i]["losses"]) for i in ("auto", "reference"))
    k = max(1, len(kernel) // 6)
    rel = float(np.max(np.abs(kernel - ref) / np.abs(ref)))
    learned = bool(kernel[-k:].mean() < kernel[:k].mean() - (1.0 if not sizes.tiny_gpt else 0))
    # no drift: the last steps' mean loss within 2 % of the reference's
    drift = float(abs(kernel[-k:].mean() - ref[-k:].mean()) / ref[-k:].mean())
    return {"mesh": runs["auto"]["mesh"], "implementation": runs["auto"]["implementation"],
            "steps": sizes.check_steps, "max_rel_loss_diff": rel, "last_steps_drift": drift,
            "first_losses": kernel[:k].tolist(), "last_losses": kernel[-k:].tolist(),
            "reference_last_losses": ref[-k:].tolist(), "learned": learned,
            "passed": bool(np.all(np.isfinite(kernel)) and rel <= 0.03 and drift <= 0.02
                           and learned)}


def check_cases(devices: Sequence[jax.Device], sizes: Sizes) -> dict[str, Callable[[], Record]]:
    n = len(devices)
    cases: dict[str, Callable[[], Record]] = {}
    layouts = ["batch", "heads"] + (["batch_heads"] if n >= 4 and n % 2 == 0 else [])
    for layout in layouts:
        for causal in (False, True):
            cases[f"sharded_{layout}_{'causal' if causal else 'full'}"] = (
                lambda layout=layout, causal=causal: sharded_check(devices, layout, causal,
                                                                   sizes))
    for name, causal, layout in (("ring_causal_zigzag", True, "zigzag"),
                                 ("ring_causal_contiguous", True, "contiguous"),
                                 ("ring_full", False, "contiguous")):
        cases[name] = lambda causal=causal, layout=layout: ring_check(devices, causal, layout,
                                                                      sizes)
    cases["gpt_mesh_data"] = lambda: gpt_check("auto", sizes)
    if n >= 2 and n % 2 == 0:
        cases["gpt_mesh_data_x_heads"] = lambda: gpt_check(f"{n // 2}x2", sizes)
    return cases


# -- ring scaling ------------------------------------------------------------------------------
def timed(programs: Sequence[tuple[Any, tuple]], args) -> list[float]:
    """Median ms per call of each (compiled, args), rounds rotating as in jax_fa4.tools.bench."""
    progs = [bench.Program(c, [a], 1) for c, a in programs]
    return [t.ms for t in bench.time_programs(progs, repeats=args.repeats,
                                              target_s=args.target_ms / 1e3, sync_each=False)]


def fwd_and_fwd_bwd(attention: Callable, q, k, v, ct) -> tuple[Any, Any]:
    """Compiled forward ``(q, k, v) -> out`` and forward+backward ``(q, k, v, ct) -> grads``."""
    fwd = jax.jit(attention).lower(q, k, v).compile()
    fwd_bwd = jax.jit(lambda q, k, v, ct: jax.vjp(attention, q, k, v)[1](ct))
    return fwd, fwd_bwd.lower(q, k, v, ct).compile()


def block_times(device: jax.Device, local: int, causal: bool, h: int, hkv: int, d: int,
                args, ring_size: int = 2) -> Record:
    """Single-GPU times of the calls a ring device makes on blocks of ``local`` tokens: the
    whole block without a mask (``block``) and, when causal, the zig-zag's step 0 (``diagonal``,
    a causal block) and, on rings of more than one device, its half blocks (``earlier``: q x the
    first half of k; ``later``: the second half of q x k)."""
    key = jax.random.split(jax.random.key(7), 4)
    put = lambda x: jax.device_put(x, device)  # noqa: E731
    q, k, v, ct = (put(normal(key[0], (1, local, h, d))), put(normal(key[1], (1, local, hkv, d))),
                   put(normal(key[2], (1, local, hkv, d))), put(normal(key[3], (1, local, h, d))))
    c = local // 2
    calls = {"block": ((q, k, v, ct), False, local, local)}
    if causal:
        calls["diagonal"] = ((q, k, v, ct), True, local, local)
    if causal and ring_size > 1:
        calls |= {"earlier": ((q, k[:, :c], v[:, :c], ct), False, local, c),
                  "later": ((q[:, c:], k, v, ct[:, c:]), False, c, local)}
    forwards, backwards, flops = [], [], {}
    for name, ((q_, k_, v_, ct_), masked, sq, sk) in calls.items():
        f, fb = fwd_and_fwd_bwd(lambda q, k, v, m=masked: jax_fa4.flash_attention(
            q, k, v, causal=m), q_, k_, v_, ct_)
        forwards.append((f, (q_, k_, v_)))
        backwards.append((fb, (q_, k_, v_, ct_)))
        flops[name] = Shape(1, sq, sk, h, hkv, d, d, masked).fwd_flops()
    # forwards and forward+backwards timed apart: as many rounds as programs in each group
    fwd_ms, fwd_bwd_ms = timed(forwards, args), timed(backwards, args)
    out: Record = {}
    for i, name in enumerate(calls):
        out[name] = {"fwd_ms": fwd_ms[i], "fwd_bwd_ms": fwd_bwd_ms[i],
                     "fwd_tflops": flops[name] / fwd_ms[i] / 1e9,
                     "fwd_bwd_tflops": (flops[name] * (1 + bench.BACKWARD_FLOP_FACTOR)
                                        / fwd_bwd_ms[i] / 1e9)}
    return out


def ideal_ms(blocks: Record, n: int, causal: bool, key: str) -> float:
    """The single-GPU kernel time of the slowest ring device's calls (``key``: fwd_ms or
    fwd_bwd_ms): n whole blocks, or when causal the diagonal and n - 1 half blocks."""
    if not causal:
        return n * blocks["block"][key]
    if n == 1:
        return blocks["diagonal"][key]
    return blocks["diagonal"][key] + (n - 1) * max(blocks["earlier"][key],
                                                    blocks["later"][key])


def ring_scaling(devices: Sequence[jax.Device], seq: int, causal: bool, sizes: Sizes,
                 args) -> Record:
    n = len(devices)
    h, hkv = sizes.scaling_heads
    d = sizes.head_dim
    mesh = mesh_of(devices, (n,), ("sp",))
    sharding = NamedSharding(mesh, P(None, "sp"))
    ks = jax.random.split(jax.random.key(3), 4)
    # Random tokens in the zig-zag layout already (the order of random data is immaterial).
    q, k, v, ct = (normal(ks[0], (1, seq, h, d), sharding=sharding),
                   normal(ks[1], (1, seq, hkv, d), sharding=sharding),
                   normal(ks[2], (1, seq, hkv, d), sharding=sharding),
                   normal(ks[3], (1, seq, h, d), sharding=sharding))
    attention = jax.shard_map(
        lambda q, k, v: ring.ring_attention(q, k, v, axis_name="sp", causal=causal),
        mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    fwd, fwd_bwd = fwd_and_fwd_bwd(attention, q, k, v, ct)
    fwd_ms, fwd_bwd_ms = timed([(fwd, (q, k, v)), (fwd_bwd, (q, k, v, ct))], args)
    flops = Shape(1, seq, seq, h, hkv, d, d, causal).fwd_flops()
    per_gpu = {"fwd": flops / n / fwd_ms / 1e9,
               "fwd_bwd": flops * (1 + bench.BACKWARD_FLOP_FACTOR) / n / fwd_bwd_ms / 1e9}
    blocks = block_times(devices[0], seq // n, causal, h, hkv, d, args, n)
    mem = fwd_bwd.memory_analysis()
    record = {
        "seq": seq, "causal": causal, "layout": "zigzag" if causal else "contiguous",
        "devices": n, "shape": dict(B=1, H=h, Hkv=hkv, D=d, local=seq // n),
        "fwd_ms": fwd_ms, "fwd_bwd_ms": fwd_bwd_ms,
        "fwd_tflops_per_gpu": per_gpu["fwd"], "fwd_bwd_tflops_per_gpu": per_gpu["fwd_bwd"],
        "block": blocks,
        "fwd_efficiency": per_gpu["fwd"] / blocks["block"]["fwd_tflops"],
        "fwd_bwd_efficiency": per_gpu["fwd_bwd"] / blocks["block"]["fwd_bwd_tflops"],
        "fwd_ideal_ms": ideal_ms(blocks, n, causal, "fwd_ms"),
        "fwd_bwd_ideal_ms": ideal_ms(blocks, n, causal, "fwd_bwd_ms"),
        "fwd_collectives": collective_counts(fwd),
        "fwd_bwd_xla_bytes": None if mem is None else {
            "arguments": mem.argument_size_in_bytes, "outputs": mem.output_size_in_bytes,
            "temporaries": mem.temp_size_in_bytes},
    }
    record["fwd_kernel_share"] = record["fwd_ideal_ms"] / fwd_ms
    record["fwd_bwd_kernel_share"] = record["fwd_bwd_ideal_ms"] / fwd_bwd_ms
    record["peak_bytes_per_device"] = peak_run(devices, lambda: fwd_bwd(q, k, v, ct))
    return record


def scaling_seqs(sizes: Sizes, n: int) -> tuple[int, ...]:
    return sizes.scaling_seqs + (sizes.scaling_seqs_8 if n >= 8 else ())


def block_baselines(device: jax.Device, counts: Sequence[int], sizes: Sizes, args) -> list:
    """The single-GPU side of N-GPU ring scaling, measured on one GPU: the block kernels'
    TFLOP/s (the efficiency's denominator) and the ideal ring times."""
    h, hkv = sizes.scaling_heads
    d = sizes.head_dim
    rows = []
    for n in counts:
        for seq in scaling_seqs(sizes, n):
            for causal in args.causal:
                blocks = block_times(device, seq // n, causal, h, hkv, d, args, n)
                rows.append({"devices": n, "seq": seq, "causal": causal, "block": blocks,
                             "fwd_ideal_ms": ideal_ms(blocks, n, causal, "fwd_ms"),
                             "fwd_bwd_ideal_ms": ideal_ms(blocks, n, causal, "fwd_bwd_ms")})
                print(f"  block baseline N={n} S={seq} {'causal' if causal else 'full'}: "
                      f"{blocks['block']['fwd_tflops']:.0f} / "
                      f"{blocks['block']['fwd_bwd_tflops']:.0f} TFLOP/s (fwd / fwd+bwd)",
                      flush=True)
    return rows


# -- training scaling --------------------------------------------------------------------------
def child_env(count: int) -> dict[str, str]:
    """The environment of a process that sees the first ``count`` devices of this one."""
    env = dict(os.environ)
    if jax.default_backend() == "cpu":
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={count}"])
    else:
        visible = env.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(jax.device_count())]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[:count])
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def train_run(count: int, mesh_spec: str, sizes: Sizes, batch_per_data: int) -> Record:
    """examples/train_gpt.py in a process that sees ``count`` devices."""
    data = count if mesh_spec == "auto" else int(mesh_spec.split("x")[0])
    with tempfile.TemporaryDirectory() as tmp:
        log = pathlib.Path(tmp) / "run.json"
        cmd = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--mesh", mesh_spec,
               "--batch", str(batch_per_data * data), "--steps", str(sizes.speed_steps),
               "--no-progress", "--log-json", str(log),
               "--tiny" if sizes.tiny_gpt else "--no-tiny"]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, env=child_env(count), capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd[1:])} exited with {done.returncode}: "
                               f"{done.stderr.strip().splitlines()[-1:]}")
        result = json.loads(log.read_text())
    return {"devices": count, "mesh": result["mesh"], "batch": batch_per_data * data,
            "tokens_per_s": result["tokens_per_s"], "compile_s": result["compile_s"],
            "last_loss": result["losses"][-1], "steps": result["steps"],
            "peak_bytes_per_device": result.get("peak_bytes_per_device"),
            "wall_s": round(time.perf_counter() - t0, 1)}


def train_scaling(n: int, sizes: Sizes) -> list[Record]:
    train_gpt = load_train_gpt()
    base = (train_gpt.TINY if sizes.tiny_gpt else train_gpt.GPU).batch
    counts = [c for c in (1, 2, 4, 8, 16, 32) if c <= n]
    runs = []
    for count in counts:
        for spec in ["auto"] + ([f"{count // 2}x2"] if count >= 2 else []):
            runs.append(train_run(count, spec, sizes, base))
            print(f"  train {count} device(s), mesh {runs[-1]['mesh']}: "
                  f"{runs[-1]['tokens_per_s']:,} tokens/s", flush=True)
    one = next(r["tokens_per_s"] for r in runs if r["devices"] == 1)
    for r in runs:
        r["scaling"] = r["tokens_per_s"] / (r["devices"] * one) if one else None
    return runs


# -- the multi-GPU section of docs/sharding.md --------------------------------------------------
SECTION_DOC = ROOT / "docs" / "sharding.md"  # the file whose multi-GPU section --readme writes
RESULTS = ROOT / "benchmarks" / "results"
RING_GOAL, TRAIN_GOAL = 0.90, 0.95  # issue #25: ring at 128k on 8 GPUs; training vs linear


def newest_report(results: pathlib.Path = RESULTS) -> pathlib.Path:
    """The result file of the most GPUs, the newest among those (ties: the later name)."""
    found = []
    for path in sorted(results.glob("multi-gpu-*.json")):
        report = json.loads(path.read_text())
        found.append((report["device_count"], report["date"], path.name, path))
    if not found:
        raise SystemExit(f"no multi-gpu-*.json in {results}")
    return max(found)[3]


def _tokens(seq: int) -> str:
    return f"{seq >> 20}M" if seq >= 1 << 20 and seq % (1 << 20) == 0 else f"{seq // 1024}k"


def _gib(values: Sequence[int | None] | None) -> str:
    known = [v for v in values or () if v is not None]
    return f"{max(known) / 2**30:.1f}" if known else "-"


def readme_section(report: Record, name: str) -> str:
    """The multi-GPU section of docs/sharding.md, every figure from ``report`` (a file named
    ``name``)."""
    n, gpu, day = report["device_count"], report["gpu"], report["date"][:10]
    lines = [f"Generated by `python benchmarks/multi_gpu.py --readme` from `{name}` "
             f"({n} x {gpu}, {day})."]
    if n < 2:
        lines.append("No machine of several GPUs has run it yet: the multi-GPU checks and "
                     "scaling below are the one-GPU side only (the checks' code paths on one "
                     "device, a ring of one, training on one GPU), and the goals (ring "
                     f"attention at >= {RING_GOAL:.2f} of the single-GPU kernel at 128k tokens "
                     f"on 8 GPUs, training at >= {TRAIN_GOAL:.2f}x linear) are not measured.")
    checks = report["checks"]
    passed = [c for c, r in checks.items() if r["passed"]]
    failed = [c for c in checks if c not in passed]
    lines += ["", f"Checks against the float32 reference by FA4's rule: {len(passed)} of "
              f"{len(checks)} passed" + (f"; failed: {', '.join(failed)}" if failed else "")
              + f" ({', '.join(checks)})."]
    ring_rows = [r for r in report["ring"] if "error" not in r]
    if ring_rows:
        s = ring_rows[0]["shape"]
        lines += ["", f"Ring attention (B=1, H={s['H']}, Hkv={s['Hkv']}, D={s['D']}, bf16; "
                  "TFLOP/s per GPU; efficiency: over the single-GPU kernel on the per-device "
                  "block):", ""]
        body = [[_tokens(r["seq"]), "causal" if r["causal"] else "full",
                 str(r["devices"]), f"{r['fwd_ms']:.1f}", f"{r['fwd_tflops_per_gpu']:.0f}",
                 f"{r['fwd_efficiency']:.2f}", f"{r['fwd_bwd_ms']:.1f}",
                 f"{r['fwd_bwd_tflops_per_gpu']:.0f}", f"{r['fwd_bwd_efficiency']:.2f}",
                 _gib(r.get("peak_bytes_per_device"))] for r in ring_rows]
        lines += markdown_table(["tokens", "mask", "GPUs", "fwd ms", "TFLOP/s", "efficiency",
                         "fwd+bwd ms", "TFLOP/s", "efficiency", "peak GiB/GPU"], body)
    if report["train"]:
        lines += ["", "`examples/train_gpt.py --mesh` (the batch grows with the data axis):", ""]
        body = [[str(r["devices"]), "x".join(str(v) for v in r["mesh"].values()),
                 str(r["batch"]), f"{r['tokens_per_s']:,}", f"{r['scaling']:.2f}",
                 _gib(r.get("peak_bytes_per_device"))] for r in report["train"]]
        lines += markdown_table(["GPUs", "data x model", "batch", "tokens/s", "vs linear",
                         "peak GiB/GPU"], body)
    if report.get("block_baselines"):
        lines += ["", "The single-GPU kernel on the per-device blocks of larger rings, measured "
                  "on one GPU (what an N-GPU ring's efficiency is measured against):", ""]
        body = [[str(r["devices"]), _tokens(r["seq"]), "causal" if r["causal"] else "full",
                 f"{r['block']['block']['fwd_tflops']:.0f}",
                 f"{r['block']['block']['fwd_bwd_tflops']:.0f}", f"{r['fwd_ideal_ms']:.1f}",
                 f"{r['fwd_bwd_ideal_ms']:.1f}"] for r in report["block_baselines"]]
        lines += markdown_table(["GPUs", "tokens", "mask", "block fwd TFLOP/s",
                         "block fwd+bwd TFLOP/s", "kernel-only fwd ms",
                         "kernel-only fwd+bwd ms"], body)
    return "\n".join(lines)


def readme_main(check: bool, result: pathlib.Path | None,
                readme: pathlib.Path = SECTION_DOC) -> int:
    """Rewrite (or with ``check``, compare) the ``multi-gpu`` section of docs/sharding.md."""
    path = result or newest_report()
    try:
        name = path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        name = path.name
    current = readme.read_text()
    new = render(current, {"multi-gpu": readme_section(json.loads(path.read_text()), name)})
    if check:
        if current != new:
            sys.stdout.writelines(difflib.unified_diff(current.splitlines(True),
                                                       new.splitlines(True), str(readme),
                                                       "generated"))
            print(f"{readme}'s multi-GPU section is not what {path.name} generates: run "
                  "python benchmarks/multi_gpu.py --readme", file=sys.stderr)
            return 1
        return 0
    readme.write_text(new)
    print(f"{readme}: multi-GPU section from {path.name}")
    return 0


# -- the run -----------------------------------------------------------------------------------
def default_out(report: Record) -> pathlib.Path:
    slug = "".join(ch if ch.isalnum() else "-" for ch in report["gpu"].lower()).strip("-")
    return (ROOT / "benchmarks" / "results"
            / f"multi-gpu-{slug}-x{report['device_count']}-{datetime.date.today()}.json")


def parse_args(argv: Sequence[str] | None):
    p = timing_parser(__doc__.splitlines()[0])
    p.set_defaults(repeats=3, target_ms=200.0)
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma-separated parts to run, of {', '.join(PARTS)}")
    p.add_argument("--checks", help="comma-separated check names (default: all)")
    p.add_argument("--seqs", help="comma-separated ring scaling lengths (default: 32k, 128k; "
                   "and 512k, 1M on 8 or more GPUs)")
    p.add_argument("--masks", default="full,causal",
                   help="ring scaling and block baselines: full, causal or both (default)")
    p.add_argument("--block-baselines", metavar="N,N,...",
                   help="also time, on the first GPU, the single-GPU kernel on the per-device "
                        "blocks of N-GPU rings")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (the CPU tests)")
    p.add_argument("--readme", action="store_true",
                   help="run nothing: rewrite docs/sharding.md's multi-GPU section from the result "
                        "file of the most GPUs (the newest of those), or from --result")
    p.add_argument("--check-readme", action="store_true",
                   help="like --readme, but exit 1 (with a diff) when docs/sharding.md differs")
    p.add_argument("--result", type=pathlib.Path, help="the result file for --readme")
    args = p.parse_args(argv)
    args.parts = [x for x in args.parts.split(",") if x]
    masks = [x for x in args.masks.split(",") if x]
    if not masks or set(masks) - {"full", "causal"}:
        p.error(f"--masks: expected full, causal or both, got {args.masks!r}")
    args.causal = [m == "causal" for m in ("full", "causal") if m in masks]
    bad = sorted(set(args.parts) - set(PARTS))
    if bad:
        p.error(f"--parts: unknown {bad}; choose from {', '.join(PARTS)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.readme or args.check_readme:
        return readme_main(args.check_readme, args.result)
    sizes = SMOKE if args.smoke else FULL
    if args.seqs:
        seqs = tuple(int(s) for s in args.seqs.split(","))
        sizes = dataclasses.replace(sizes, scaling_seqs=seqs, scaling_seqs_8=())
    devices = jax.devices()
    n = len(devices)
    t0 = time.perf_counter()
    report: Record = {
        "gpu": devices[0].device_kind, "device_count": n, "platform": jax.default_backend(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": list(sys.orig_argv), "versions": versions(),
        "sizes": dataclasses.asdict(sizes), "checks": {}, "ring": [], "train": [],
        "block_baselines": [],
    }
    out = args.out or default_out(report)
    print(f"jax-fa4 {jax_fa4.__version__}: {n} x {devices[0].device_kind}; parts "
          f"{', '.join(args.parts)}", flush=True)

    def save() -> None:
        report["wall_s"] = round(time.perf_counter() - t0, 1)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1) + "\n")

    failed = 0
    if "checks" in args.parts:
        cases = check_cases(devices, sizes)
        wanted = args.checks.split(",") if args.checks else list(cases)
        unknown = sorted(set(wanted) - set(cases))
        if unknown:
            raise SystemExit(f"--checks: unknown {unknown}; on {n} devices: {', '.join(cases)}")
        for name in wanted:
            t = time.perf_counter()
            try:
                holder: list[Record] = []
                peaks = peak_run(devices, lambda: holder.append(cases[name]()))
                record = holder[0] | {"peak_bytes_per_device": peaks}
            except Exception as err:  # a crash is a failed check, recorded with its reason
                record = {"passed": False, "error": error_text(err)}
            record["wall_s"] = round(time.perf_counter() - t, 1)
            report["checks"][name] = record
            failed += not record["passed"]
            worst = max((e["err"] / e["bound"] for e in record.get("errors", {}).values()
                         if e["bound"]), default=None)
            print(f"  {'PASS' if record['passed'] else 'FAIL'} {name}"
                  + (f" (worst err/bound {worst:.2f})" if worst is not None else "")
                  + (f": {record['error']}" if "error" in record else "")
                  + f" [{record['wall_s']} s]", flush=True)
            save()
    if "train" in args.parts:
        try:
            report["train"] = train_scaling(n, sizes)
        except Exception as err:
            report["train_error"] = error_text(err)
            print(f"  train: {report['train_error']}", flush=True)
        save()
    if "ring" in args.parts:
        for seq in scaling_seqs(sizes, n):
            for causal in args.causal:
                try:
                    r = ring_scaling(devices, seq, causal, sizes, args)
                    print(f"  ring S={seq} {'causal' if causal else 'full'} on {n}: fwd "
                          f"{r['fwd_ms']:.2f} ms ({r['fwd_tflops_per_gpu']:.0f} TFLOP/s/GPU, "
                          f"efficiency {r['fwd_efficiency']:.2f}), fwd+bwd "
                          f"{r['fwd_bwd_ms']:.2f} ms ({r['fwd_bwd_tflops_per_gpu']:.0f}, "
                          f"{r['fwd_bwd_efficiency']:.2f})", flush=True)
                except Exception as err:
                    r = {"seq": seq, "causal": causal, "devices": n, "error": error_text(err)}
                    print(f"  ring S={seq} causal={causal}: {r['error']}", flush=True)
                report["ring"].append(r)
                save()
    if args.block_baselines:
        counts = [int(c) for c in args.block_baselines.split(",")]
        report["block_baselines"] = block_baselines(devices[0], counts, sizes, args)
        save()
    save()
    print(f"wrote {out} ({report['wall_s']} s); {failed} check(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
