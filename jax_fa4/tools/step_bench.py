"""Whole training step benchmark: a small decoder's jitted step with jax-fa4's attention against
the same step with cuDNN's (``jax.nn.dot_product_attention(implementation="cudnn")``).

Usage::

    python -m jax_fa4.tools.step_bench                        # every config, on a GPU
    python -m jax_fa4.tools.step_bench --configs b8s2k-16-4-d128,b2s8k-16-4-d128
    python -m jax_fa4.tools.step_bench --out step.json --profile prof --hlo hlo
    python -m jax_fa4.tools.step_bench --smoke                # tiny sizes on the CPU
    JAX_FA4_CACHE_DIR=.device/kernel-cache python -m jax_fa4.tools.step_bench --precompile
                                                              # its kernels, on any machine

The model (plain JAX, bfloat16 parameters and activations): token embedding; ``--layers``
(default 4) pre-norm blocks, each RMSNorm -> fused QKV projection (one GEMM to ``H + 2 Hkv``
heads of dim ``D``, split along the head axis: q, k, v keep the projection output's strides as
a user's model does) -> RoPE on q and k -> causal attention on (B, S, heads, D) with GQA ->
output projection -> residual; RMSNorm -> SwiGLU MLP (hidden ``8/3 d_model`` rounded up to a
multiple of 256: 5632 at d_model 2048) -> residual; final RMSNorm, a 32k-vocabulary LM head
(untied) and the mean cross-entropy (logits and softmax in float32).

Attention is ``jax_fa4.flash_attention(q, k, v, causal=True)`` (``jax-fa4``; as a user calls it,
``implementation=None``), ``jax.nn.dot_product_attention(q, k, v, is_causal=True,
implementation="cudnn")`` (``cudnn``, GPU only; GQA: K/V with fewer heads, as jax.nn takes
them) or the same with ``implementation="xla"`` (``xla``). Packed rows (a config with
``packed``): each row is cut into documents of S/16 to S/2 tokens (512-4096 at S = 8192, the
last cut to fit; fixed cuts), RoPE positions restart at each document, and ours gets
``segment_ids``. ``jax.nn.dot_product_attention`` has no segment ids: its ``query_seq_lengths`` /
``key_value_seq_lengths`` pad each row's end, which is not documents, and a dense (B, 1, S, S)
mask is a materialised bias, not the flash kernel; so packed configs time ours only and the
result says why (``skipped``).

The step is ``jax.jit`` of loss + grad + SGD update with the parameters donated; it also
returns the loss and the gradient norm of each layer's QKV projection (a check that both
attentions compute the same thing: the first step's losses and norms are compared, same
parameters, same batch). One step per implementation, built in the same process; XLA's GEMM
autotuning is left at its default (on).

Timing (the rules of ``jax_fa4.tools.bench``): per config, every implementation's step is
compiled first (``compile_s``) and run once (the first-step check), then ``--warmup`` steps;
then rounds, one per implementation after another: an untimed first round, then
``--rounds`` rounded up to a multiple of the number of implementations (each opens as many
rounds), round r starting at implementation r mod n. A round is ``--steps`` back-to-back steps
(each feeding the next its parameters), synchronised with ``block_until_ready`` at the end;
the figure is the median round's time per step. The token batches rotate over
``BATCHES`` sets. ``step_speedup`` = the baseline's step time / ours (the baseline is cuDNN on a
GPU, XLA in ``--smoke``). "Attention alone" times, at the config's shape, the attention's
training forward and forward+backward with ``jax_fa4.tools.bench``'s programs and rotation
(input sets rotated past twice the L2); ``attn_bwd_ms`` = forward+backward - training forward.

``--profile DIR`` traces ``--profile-steps`` back-to-back steps of each implementation per
config with ``jax.profiler.trace`` after the timed rounds (``DIR/<config>/<impl>``), each trace
right after ``--profile-warmup`` untraced steps of the same implementation, so that each runs
at the clocks its own load sets rather than those of a GPU left idle while the previous trace
was written (without them the same GEMMs took 1–6 % less time in the baseline's trace, taken
second, than in ours, while the timed steps agreed within 1 %), and reads
them with ``jax_fa4.tools.step_profile``: per implementation (``profile`` in its entry) the
kernels of one step grouped by name and category (GEMM, XLA fusions, copies / transposes with
their HLO ops, attention kernels, memsets / memcpys), busy time, span, idle gaps, host-side
launches; per config (``profile``, ``profile_table``) ours against the baseline per category
and per layer, "around the attention" (span - attention kernels) and the kernels only one side
runs; ``DIR/profile.md`` collects the tables and ``DIR/<config>/<impl>/step-kernels.json`` holds
the median traced step's kernels in order. ``--hlo DIR`` writes each step's optimized
HLO (``DIR/<config>-<impl>.hlo.txt``). The result file holds, per implementation, counts of
copies, transposes, fusions and custom-call targets in that HLO (``hlo_counts``).

Output: ``benchmarks/results/step-<gpu-slug>-<YYYY-MM-DD>.json`` (``--out`` overrides), with the
command, the GPU's state before and after (clocks), the stack's versions and the date
(``jax_fa4.tools.bench_env``), and a markdown table on stdout. The exit status is 1 when a
config, or an implementation's step, failed to build (each is recorded in the result file).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_fa4
from jax_fa4.ffi import runtime
from jax_fa4.tools import bench, bench_env, bench_report, step_profile
from jax_fa4.tools.bench_shapes import Shape, document_lengths

Params = dict[str, Any]

VOCAB = 32768
SMOKE_VOCAB = 512
ROPE_THETA = 10000.0
LEARNING_RATE = 1e-3
#: Token batches a timed round rotates over.
BATCHES = 4
#: Custom-call target of jax-fa4's kernels.
FA4_CUSTOM_CALL = runtime.CALL_TARGET
IMPLS = ("jax-fa4", "cudnn", "xla")
#: Relative agreement of the first step's loss and QKV gradient norms between implementations.
LOSS_RTOL = 1e-2
GRAD_RTOL = 5e-2


@dataclasses.dataclass(frozen=True)
class Config:
    """One decoder and batch: B rows of S tokens, H query heads, Hkv key/value heads of dim D."""

    name: str
    B: int
    S: int
    d_model: int
    H: int
    Hkv: int
    D: int
    layers: int = 4
    vocab: int = VOCAB
    packed: bool = False

    @property
    def mlp_hidden(self) -> int:
        """SwiGLU hidden width: 8/3 d_model rounded up to a multiple of 256 (of 32 when small)."""
        step = 256 if self.d_model >= 1024 else 32
        return step * -(-(8 * self.d_model // 3) // step)

    def shape(self) -> Shape:
        """The attention call's shape (causal self-attention)."""
        return Shape(self.B, self.S, self.S, self.H, self.Hkv, self.D, self.D, True)


CONFIGS = {c.name: c for c in (
    Config("b2s8k-16-4-d128", 2, 8192, 2048, 16, 4, 128),
    Config("b8s2k-16-4-d128", 8, 2048, 2048, 16, 4, 128),
    Config("b8s2k-16-16-d128", 8, 2048, 2048, 16, 16, 128),
    Config("b2s8k-8-4-d256", 2, 8192, 2048, 8, 4, 256),
    Config("b8s2k-32-8-d64", 8, 2048, 2048, 32, 8, 64),
    Config("b2s8k-16-4-d128-packed", 2, 8192, 2048, 16, 4, 128, packed=True),
)}
SMOKE_CONFIGS = {c.name: c for c in (
    Config("smoke", 2, 128, 128, 4, 2, 32, layers=2, vocab=SMOKE_VOCAB),
    Config("smoke-packed", 2, 128, 128, 4, 2, 32, layers=2, vocab=SMOKE_VOCAB, packed=True),
)}


# -- the model ---------------------------------------------------------------------------------
def init_params(cfg: Config, key: jax.Array) -> Params:
    """bfloat16 parameters: normal(0, 1) embedding, weights normal(0, 1/sqrt(fan_in)), the
    residual outputs' scaled by 1/sqrt(2 layers); RMSNorm scales 1."""
    d, f, qkv = cfg.d_model, cfg.mlp_hidden, (cfg.H + 2 * cfg.Hkv) * cfg.D
    keys = iter(jax.random.split(key, 2 + 4 * cfg.layers))
    out_scale = 1.0 / math.sqrt(2 * cfg.layers)

    def w(shape: tuple[int, ...], scale: float = 1.0) -> jax.Array:
        std = scale / math.sqrt(shape[0])
        return (jax.random.normal(next(keys), shape, jnp.float32) * std).astype(jnp.bfloat16)

    ones = jnp.ones((d,), jnp.bfloat16)
    layers = [{"ln1": ones, "wqkv": w((d, qkv)), "wo": w((cfg.H * cfg.D, d), out_scale),
               "ln2": ones, "w_gate_up": w((d, 2 * f)), "w_down": w((f, d), out_scale)}
              for _ in range(cfg.layers)]
    embed = jax.random.normal(next(keys), (cfg.vocab, d), jnp.float32).astype(jnp.bfloat16)
    return {"embed": embed, "layers": layers, "ln_f": ones, "head": w((d, cfg.vocab))}


def rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    """RMSNorm with the statistics in float32, the result in x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array) -> jax.Array:
    """Rotary embedding (rotate-half form) of x (B, S, heads, D) at positions (B, S)."""
    half = x.shape[-1] // 2
    freq = ROPE_THETA ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions.astype(jnp.float32)[:, :, None, None] * freq
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array | None], jax.Array]


def attention_fn(impl: str, implementation: str | None = None) -> AttentionFn:
    """Causal attention of one implementation on (q, k, v, segment ids or None);
    ``implementation`` is jax-fa4's (``None``: as a user calls it)."""
    if impl == "jax-fa4":
        def fa4(q: jax.Array, k: jax.Array, v: jax.Array, ids: jax.Array | None) -> jax.Array:
            return jax_fa4.flash_attention(q, k, v, causal=True, segment_ids=ids,
                                           implementation=implementation)
        return fa4
    if impl not in ("cudnn", "xla"):
        raise ValueError(f"unknown implementation {impl!r}; known: {IMPLS}")

    def jax_nn(q: jax.Array, k: jax.Array, v: jax.Array, ids: jax.Array | None) -> jax.Array:
        if ids is not None:
            raise ValueError("jax.nn.dot_product_attention has no segment ids")
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
    return jax_nn


def forward_loss(params: Params, cfg: Config, attention: AttentionFn, tokens: jax.Array,
                 targets: jax.Array, positions: jax.Array, ids: jax.Array | None) -> jax.Array:
    """Mean next-token cross-entropy (float32) of the decoder on tokens (B, S)."""
    b, s = tokens.shape
    x = params["embed"][tokens]
    for layer in params["layers"]:
        h = rms_norm(x, layer["ln1"]) @ layer["wqkv"]
        h = h.reshape(b, s, cfg.H + 2 * cfg.Hkv, cfg.D)
        q = rope(h[:, :, :cfg.H], positions)
        k = rope(h[:, :, cfg.H:cfg.H + cfg.Hkv], positions)
        v = h[:, :, cfg.H + cfg.Hkv:]
        o = attention(q, k, v, ids).reshape(b, s, cfg.H * cfg.D)
        x = x + o @ layer["wo"]
        gate, up = jnp.split(rms_norm(x, layer["ln2"]) @ layer["w_gate_up"], 2, axis=-1)
        x = x + (jax.nn.silu(gate) * up) @ layer["w_down"]
    logits = (rms_norm(x, params["ln_f"]) @ params["head"]).astype(jnp.float32)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)


def make_step(cfg: Config, impl: str, implementation: str | None = None
              ) -> Callable[..., Any]:
    """The jitted training step of one implementation: (params, tokens, targets, positions,
    ids) -> (new params, loss, QKV gradient norm per layer); params donated."""
    attention = attention_fn(impl, implementation)

    def step(params: Params, tokens: jax.Array, targets: jax.Array, positions: jax.Array,
             ids: jax.Array | None) -> tuple[Params, jax.Array, jax.Array]:
        loss, grads = jax.value_and_grad(forward_loss)(params, cfg, attention, tokens, targets,
                                                       positions, ids)
        new = jax.tree.map(lambda p, g: (p - LEARNING_RATE * g).astype(p.dtype), params, grads)
        norms = jnp.stack([jnp.linalg.norm(g["wqkv"].astype(jnp.float32))
                           for g in grads["layers"]])
        return new, loss, norms

    return jax.jit(step, donate_argnums=0)


# -- data --------------------------------------------------------------------------------------
def documents(cfg: Config) -> list[list[int]]:
    """Each row's document lengths: S/16 to S/2 tokens (512 to 4096 at 8k, as
    benchmarks/segments_bench.py cuts), the same cuts in every run."""
    rng = np.random.default_rng(cfg.B * cfg.S + cfg.D)
    return [document_lengths(rng, cfg.S, cfg.S // 16, cfg.S // 2) for _ in range(cfg.B)]


def make_batches(cfg: Config, count: int, seed: int = 0
                 ) -> tuple[list[tuple[jax.Array, ...]], list[list[int]] | None]:
    """``count`` batches (tokens, targets, positions, segment ids or None), each (B, S), and
    the documents of packed rows (None for unpacked)."""
    rng = np.random.default_rng(seed)
    docs = documents(cfg) if cfg.packed else None
    if docs is None:
        positions = np.broadcast_to(np.arange(cfg.S, dtype=np.int32), (cfg.B, cfg.S))
        ids = None
    else:
        positions = np.stack([np.concatenate([np.arange(n) for n in row]) for row in docs])
        ids = jnp.asarray(np.stack([np.repeat(np.arange(len(row)), row) for row in docs]),
                          jnp.int32)
    pos = jnp.asarray(positions, jnp.int32)
    batches = []
    for _ in range(count):
        seq = rng.integers(0, cfg.vocab, (cfg.B, cfg.S + 1))
        batches.append((jnp.asarray(seq[:, :-1], jnp.int32), jnp.asarray(seq[:, 1:], jnp.int32),
                        pos, ids))
    jax.block_until_ready(batches)
    return batches, docs


# -- HLO ---------------------------------------------------------------------------------------
def hlo_counts(text: str) -> dict[str, Any]:
    """Copies, transposes and fusions in optimized HLO text (every computation), and the
    custom-call targets with their counts."""
    targets: dict[str, int] = {}
    for name in re.findall(r'custom_call_target="([^"]+)"', text):
        targets[name] = targets.get(name, 0) + 1
    return {op: len(re.findall(rf"\b{op}(?:-start)?\(", text))
            for op in ("copy", "transpose", "fusion")} | {"custom_calls": targets}


# -- timing ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Runner:
    """One implementation's compiled step and the parameters it owns (donated every step)."""

    impl: str
    compiled: Any
    params: Params
    hlo: str

    def run(self, batch: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        self.params, loss, norms = self.compiled(self.params, *batch)
        return loss, norms

    def steps(self, batches: Sequence[tuple[jax.Array, ...]], steps: int, first: int = 0) -> None:
        """``steps`` back-to-back steps on batches ``first``, ``first + 1``, ... (cycled),
        synchronised at the end."""
        for i in range(first, first + steps):
            self.run(batches[i % len(batches)])
        jax.block_until_ready(self.params)

    def round_ms(self, batches: Sequence[tuple[jax.Array, ...]], steps: int, first: int) -> float:
        """Time per step of ``steps`` back-to-back steps, synchronised at the end."""
        t0 = time.perf_counter()
        self.steps(batches, steps, first)
        return (time.perf_counter() - t0) / steps * 1e3


def time_steps(runners: Sequence[Runner], batches: Sequence[tuple[jax.Array, ...]],
               rounds: int, steps: int) -> tuple[list[list[float]], list[list[int]]]:
    """Per runner, the ms per step of each timed round; and the order of every round (an
    untimed first round, then ``timed_rounds`` rounds, round r starting at runner r mod n)."""
    n = len(runners)
    samples: list[list[float]] = [[] for _ in runners]
    orders = []
    for r in range(bench.timed_rounds(rounds, n) + 1):
        order = [(r + j) % n for j in range(n)]
        orders.append(order)
        for i in order:
            ms = runners[i].round_ms(batches, steps, r * steps)
            if r:
                samples[i].append(ms)
    return samples, orders


def attention_alone(cfg: Config, impls: Sequence[str], ids: jax.Array | None,
                    args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Training forward and forward+backward of the attention call alone at the config's shape,
    timed with ``jax_fa4.tools.bench``'s rotation; per implementation."""
    shape = cfg.shape()
    sets = bench.make_inputs(shape, jnp.bfloat16, jax.random.key(args.seed + 1), 1)
    out: dict[str, dict[str, Any]] = {}
    programs: list[bench.Program] = []
    owners: list[tuple[str, str]] = []
    for impl in impls:
        attention = attention_fn(impl)

        def train_fwd(q: jax.Array, k: jax.Array, v: jax.Array, ids: jax.Array | None,
                      attention: AttentionFn = attention) -> Any:
            return bench._train_fwd(lambda q, k, v: attention(q, k, v, ids))(q, k, v)

        def fwdbwd(q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array,
                   ids: jax.Array | None, attention: AttentionFn = attention) -> Any:
            return bench._fwd_bwd(lambda q, k, v: attention(q, k, v, ids))(q, k, v, do)

        # The segment ids are an argument (traced, as in the step), not a constant.
        for kind, fn in (("train_fwd", train_fwd), ("fwdbwd", fwdbwd)):
            prog_sets = [(*(s[:3] if kind == "train_fwd" else s), ids) for s in sets]
            compiled = jax.jit(fn).lower(*prog_sets[0]).compile()
            programs.append(bench.make_program(fn, compiled, prog_sets, 1))
            owners.append((impl, kind))
    timings = bench.time_programs(programs, repeats=args.rounds, target_s=args.attn_target_ms / 1e3,
                                  sync_each=jax.devices()[0].platform == "cpu")
    for (impl, kind), t in zip(owners, timings):
        out.setdefault(impl, {})[f"attn_{kind}_ms"] = t.ms
        out[impl][f"attn_{kind}_spread"] = round(t.spread, 4)
    for row in out.values():
        row["attn_bwd_ms"] = row["attn_fwdbwd_ms"] - row["attn_train_fwd_ms"]
    return out


def rel_diff(a: Any, b: Any) -> float:
    """max |a - b| / max |b| over arrays (float)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def skip_reason(impl: str, cfg: Config, platform: str) -> str | None:
    """Why ``impl`` does not run ``cfg`` here (None: run it)."""
    if impl in ("cudnn", "xla") and cfg.packed:
        return ("jax.nn.dot_product_attention has no segment ids (query_seq_lengths / "
                "key_value_seq_lengths pad each row's end, not documents; a dense mask is a "
                "materialised bias, not the flash kernel): packed rows time jax-fa4 only")
    if impl == "cudnn" and platform != "gpu":
        return f"cuDNN runs only on a CUDA GPU (device platform is {platform})"
    return None


def run_config(cfg: Config, impls: Sequence[str], args: argparse.Namespace,
               platform: str) -> dict[str, Any]:
    """Compile, check and time every implementation's step for one config; the result entry."""
    entry: dict[str, Any] = {
        "config": cfg.name, **{k: v for k, v in dataclasses.asdict(cfg).items() if k != "name"},
        "mlp_hidden": cfg.mlp_hidden, "tokens_per_step": cfg.B * cfg.S, "impls": {},
        "skipped": {}}
    batches, docs = make_batches(cfg, BATCHES, args.seed)
    entry["documents"] = docs
    params0 = init_params(cfg, jax.random.key(args.seed))
    entry["params"] = int(sum(x.size for x in jax.tree.leaves(params0)))
    runners: list[Runner] = []
    first: dict[str, tuple[float, list[float]]] = {}
    for impl in impls:
        reason = skip_reason(impl, cfg, platform)
        if reason is not None:
            entry["skipped"][impl] = reason
            continue
        t0 = time.perf_counter()
        try:
            compiled = make_step(cfg, impl).lower(params0, *batches[0]).compile()
        except Exception as err:
            entry["skipped"][impl] = f"compile: {bench_env.error_text(err)}"
            continue
        compile_s = time.perf_counter() - t0
        hlo = compiled.as_text()
        runner = Runner(impl, compiled, jax.tree.map(jnp.copy, params0), hlo)
        loss, norms = runner.run(batches[0])  # the first step: same params, same batch
        first[impl] = (float(loss), [float(x) for x in norms])
        for i in range(args.warmup):
            runner.run(batches[(i + 1) % len(batches)])
        jax.block_until_ready(runner.params)
        counts = hlo_counts(hlo)
        entry["impls"][impl] = {"compile_s": round(compile_s, 2), "loss_step0": first[impl][0],
                                "qkv_grad_norms_step0": first[impl][1], "hlo_counts": counts}
        if impl == "jax-fa4" and platform == "gpu" and FA4_CUSTOM_CALL not in counts[
                "custom_calls"]:
            entry["impls"][impl]["warning"] = "no jax-fa4 kernel in the step: reference fallback"
        if args.hlo is not None:
            args.hlo.mkdir(parents=True, exist_ok=True)
            (args.hlo / f"{cfg.name}-{impl}.hlo.txt").write_text(hlo)
        runners.append(runner)
    del params0
    if not runners:
        return entry
    samples, orders = time_steps(runners, batches, args.rounds, args.steps)
    entry["round_orders"] = [[runners[i].impl for i in order] for order in orders]
    for runner, xs in zip(runners, samples):
        med = statistics.median(xs)
        entry["impls"][runner.impl].update(
            step_ms=med, step_spread=round((max(xs) - min(xs)) / med, 4), step_rounds_ms=xs,
            tokens_per_s=cfg.B * cfg.S / med * 1e3)
    if args.profile is not None:
        profile_config(cfg, runners, batches, entry, args)
    for runner in runners:
        runner.params = None  # free the parameters before the attention-alone inputs
    if not args.no_attention:
        try:
            alone = attention_alone(cfg, [r.impl for r in runners], batches[0][3], args)
        except Exception as err:  # the step's figures stay
            entry["attention_alone_error"] = bench_env.error_text(err)
            alone = {}
        for impl, row in alone.items():
            row_step = entry["impls"][impl]
            row_step.update(row)
            row_step["attention_share_of_step"] = (
                cfg.layers * row["attn_fwdbwd_ms"] / row_step["step_ms"])
    compare(entry, first)
    return entry


def profile_config(cfg: Config, runners: Sequence[Runner],
                   batches: Sequence[tuple[jax.Array, ...]], entry: dict[str, Any],
                   args: argparse.Namespace) -> None:
    """Trace ``--profile-steps`` back-to-back steps of each implementation into
    ``DIR/<config>/<impl>`` and analyse them (``jax_fa4.tools.step_profile``): the profile in
    ``entry["impls"][impl]["profile"]``, the median step's kernels in
    ``DIR/<config>/<impl>/step-kernels.json``; with ours and a baseline, their comparison in
    ``entry["profile"]`` and its markdown tables in ``entry["profile_table"]``."""
    profiles: dict[str, dict[str, Any]] = {}
    for runner in runners:
        where = args.profile / cfg.name / runner.impl
        row = entry["impls"][runner.impl]

        runner.steps(batches, args.profile_warmup)  # the GPU at this implementation's clocks
        try:
            trace = step_profile.capture(
                functools.partial(runner.steps, batches, args.profile_steps), where)
            profile = step_profile.analyse(step_profile.load_events(trace), runner.hlo,
                                           args.profile_steps, cfg.layers)
        except Exception as err:  # a failed trace keeps the timings
            row["trace_error"] = bench_env.error_text(err)
            continue
        row["trace_dir"] = str(where)
        kernels = profile.pop("median_step_kernels", None)
        if kernels is not None:
            (where / "step-kernels.json").write_text(json.dumps(kernels) + "\n")
        row["profile"] = profile
        if jax.devices()[0].platform == "gpu" and profile.get("source") == "host thunks":
            row["profile_warning"] = "no GPU kernels in the trace (CUPTI): host thunks read"
        if "error" not in profile:
            profiles[runner.impl] = profile
    base = next((i for i in ("cudnn", "xla") if i in profiles), None)
    if "jax-fa4" in profiles and base is not None:
        entry["profile"] = step_profile.compare(profiles["jax-fa4"], profiles[base], cfg.layers)
        entry["profile_table"] = step_profile.markdown(cfg.name, base, profiles["jax-fa4"],
                                                       profiles[base], entry["profile"])


def compare(entry: dict[str, Any], first: dict[str, tuple[float, list[float]]]) -> None:
    """Ours against the baseline (the first other implementation that ran): speed-ups and the
    first step's agreement."""
    rows = entry["impls"]
    base = next((i for i in ("cudnn", "xla") if i in rows), None)
    entry["baseline"] = base
    if "jax-fa4" not in rows or base is None:
        return
    ours, other = rows["jax-fa4"], rows[base]
    entry["step_speedup"] = other["step_ms"] / ours["step_ms"]
    for key in ("attn_train_fwd_ms", "attn_bwd_ms", "attn_fwdbwd_ms"):
        if key in ours and key in other and ours[key] > 0:
            entry[key.replace("_ms", "_speedup")] = other[key] / ours[key]
    loss_diff = rel_diff(first["jax-fa4"][0], first[base][0])
    grad_diff = rel_diff(first["jax-fa4"][1], first[base][1])
    entry["check"] = {"loss_rel_diff": loss_diff, "qkv_grad_norm_rel_diff": grad_diff,
                      "loss_rtol": LOSS_RTOL, "grad_rtol": GRAD_RTOL,
                      "agree": loss_diff <= LOSS_RTOL and grad_diff <= GRAD_RTOL}


# -- report ------------------------------------------------------------------------------------
def _f(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def markdown_table(entries: Sequence[dict[str, Any]]) -> str:
    """One line per config: step ms (ours / baseline), speed-up, attention alone."""
    lines = ["| config | step ms, ours / baseline | step speed-up | attention alone fwd / bwd "
             "speed-up | attention share of our step | compile s, ours / baseline | agree |",
             "|---|---|---|---|---|---|---|"]
    for e in entries:
        rows = e["impls"]
        ours, base = rows.get("jax-fa4", {}), rows.get(e.get("baseline") or "", {})
        step = f"{_f(ours.get('step_ms'), '.2f')} / {_f(base.get('step_ms'), '.2f')}"
        attn = (f"{_f(e.get('attn_train_fwd_speedup'), '.2f')}x / "
                f"{_f(e.get('attn_bwd_speedup'), '.2f')}x")
        comp = f"{_f(ours.get('compile_s'), '.1f')} / {_f(base.get('compile_s'), '.1f')}"
        agree = e.get("check", {}).get("agree")
        lines.append(f"| {e['config']} ({e.get('baseline') or 'ours only'}) | {step} | "
                     f"{_f(e.get('step_speedup'), '.3f')}x | {attn} | "
                     f"{_f(ours.get('attention_share_of_step'), '.2f')} | {comp} | "
                     f"{'–' if agree is None else agree} |")
    return "\n".join(lines)


def write_profile_tables(where: Path | None, entries: Sequence[dict[str, Any]]) -> None:
    """``DIR/profile.md``: every profiled config's side-by-side tables so far."""
    tables = [e["profile_table"] for e in entries if "profile_table" in e]
    if where is not None and tables:
        where.mkdir(parents=True, exist_ok=True)
        (where / "profile.md").write_text("\n".join(tables))


# -- kernels ahead of the GPU run ---------------------------------------------------------------
def precompile(configs: Sequence[Config], implementation: str = "sm90") -> int:
    """Build every kernel the configs' steps with jax-fa4's attention lower to, on any machine
    (no GPU): each step is exported for CUDA with ``implementation`` forced, which compiles the
    kernels its custom calls carry into the kernel cache (``$JAX_FA4_CACHE_DIR``) when they are
    missing. The attention-alone programs call the same kernels. Returns the number of kernel
    custom calls over all steps."""
    calls = 0
    for cfg in configs:
        params = jax.eval_shape(lambda key: init_params(cfg, key), jax.random.key(0))
        b, s = cfg.B, cfg.S
        tokens = jax.ShapeDtypeStruct((b, s), jnp.int32)
        ids = tokens if cfg.packed else None
        step = make_step(cfg, "jax-fa4", implementation)
        exported = jax.export.export(step, platforms=["cuda"],
                                     disabled_checks=runtime.export_disabled_safety_checks())(
            params, tokens, tokens, tokens, ids)
        n = exported.mlir_module().count(f"stablehlo.custom_call @{FA4_CUSTOM_CALL}")
        print(f"{cfg.name}: {n} kernel calls in the step", flush=True)
        calls += n
    return calls


# -- command line ------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jax_fa4.tools.step_bench",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=None,
                   help=f"comma-separated config names (default: all): {', '.join(CONFIGS)}; "
                        f"with --smoke: {', '.join(SMOKE_CONFIGS)}")
    p.add_argument("--smoke", action="store_true",
                   help="tiny configs (runs on a CPU; implementations jax-fa4 and xla)")
    p.add_argument("--impls", default=None,
                   help="comma-separated, jax-fa4 first (default: jax-fa4,cudnn on a GPU, "
                        "jax-fa4,xla otherwise or with --smoke)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 4)")
    p.add_argument("--rounds", type=int, default=7,
                   help="timed rounds at least (rounded up to a multiple of the implementations)")
    p.add_argument("--steps", type=int, default=10, help="steps per round")
    p.add_argument("--warmup", type=int, default=2, help="steps after the first, untimed")
    p.add_argument("--attn-target-ms", type=float, default=25.0,
                   help="wall time of one attention-alone round")
    p.add_argument("--no-attention", action="store_true", help="skip the attention-alone timing")
    p.add_argument("--profile", type=Path, default=None,
                   help="trace steps with jax.profiler into DIR/<config>/<impl> and write the "
                        "per-kernel side by side (DIR/profile.md, the result file)")
    p.add_argument("--profile-steps", type=int, default=3,
                   help="back-to-back steps per trace (the figures are their median)")
    p.add_argument("--profile-warmup", type=int, default=10,
                   help="untraced steps of the same implementation right before each trace")
    p.add_argument("--hlo", type=Path, default=None,
                   help="write each step's optimized HLO to DIR/<config>-<impl>.hlo.txt")
    p.add_argument("--precompile", action="store_true",
                   help="build the kernels the configs' steps need into the kernel cache "
                        "($JAX_FA4_CACHE_DIR; any machine, no GPU) and exit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default: benchmarks/results/step-<gpu-slug>-<date>.json)")
    args = p.parse_args(argv)
    table = SMOKE_CONFIGS if args.smoke else CONFIGS
    names = list(table) if args.configs is None else [
        x.strip() for x in args.configs.split(",") if x.strip()]
    unknown = [x for x in names if x not in table]
    if unknown or not names:
        p.error(f"unknown config(s) {unknown}; known: {', '.join(table)}")
    configs = [table[x] for x in names]
    if args.layers is not None:
        configs = [dataclasses.replace(c, layers=args.layers) for c in configs]
    args.config_list = configs
    if args.impls is not None:
        args.impls = [x.strip() for x in args.impls.split(",") if x.strip()]
        wrong = [x for x in args.impls if x not in IMPLS]
        if wrong:
            p.error(f"unknown implementation(s) {wrong}; known: {', '.join(IMPLS)}")
    if min(args.rounds, args.steps, args.profile_steps) < 1 or min(args.warmup,
                                                                   args.profile_warmup) < 0:
        p.error("--rounds, --steps and --profile-steps must be >= 1, --warmup and "
                "--profile-warmup >= 0")
    return args


TIMING_METHOD = ("per config, every implementation's step compiled first, run once (the "
                 "first-step check) and warmed up; then rounds of --steps back-to-back steps, "
                 "one implementation after another, an untimed first round, round r starting "
                 "at implementation r mod n; the median round's time per step is kept")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the configs and write the result file."""
    start = time.perf_counter()
    args = parse_args(argv)
    if args.precompile:
        precompile(args.config_list)
        return 0
    device = jax.devices()[0]
    platform = device.platform
    if args.impls is None:
        args.impls = ["jax-fa4", "cudnn" if platform == "gpu" and not args.smoke else "xla"]
    print(f"jax {jax.__version__} on {device.device_kind} ({platform}); "
          f"{len(args.config_list)} configs x {args.impls}", flush=True)
    out = bench_report.result_path(args.out, device.device_kind, prefix="step-")
    record = bench_env.RunRecord(
        device, bench_report.run_command("jax_fa4.tools.step_bench", argv))
    entries: list[dict[str, Any]] = []

    def write(complete: bool) -> None:
        report = {
            **record.header(complete),
            "settings": {"impls": args.impls, "rounds": args.rounds, "steps": args.steps,
                         "warmup": args.warmup, "attn_target_ms": args.attn_target_ms,
                         "batches": BATCHES, "learning_rate": LEARNING_RATE, "smoke": args.smoke,
                         "xla_gpu_autotune": "default (on)"},
            "model": ("pre-norm decoder: RMSNorm, fused QKV (GQA), RoPE, causal attention, "
                      "SwiGLU MLP (hidden 8/3 d_model rounded up to 256), untied LM head, "
                      "float32 cross-entropy; bf16 params and activations; SGD, params "
                      "donated"),
            "timing": {"method": TIMING_METHOD, "attention_alone": bench.TIMING_METHOD,
                       "attn_bwd": "attn_fwdbwd_ms - attn_train_fwd_ms"},
            "complete": complete,
            "wall_s": round(time.perf_counter() - start, 1),
            "configs": entries,
        }
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(report, indent=1) + "\n")
        tmp.replace(out)

    for cfg in args.config_list:
        t0 = time.perf_counter()
        try:
            entry = run_config(cfg, args.impls, args, platform)
        except Exception as err:  # one failing config keeps the others
            entry = {"config": cfg.name, "impls": {}, "error": bench_env.error_text(err)}
        entry["wall_s"] = round(time.perf_counter() - t0, 1)
        entries.append(entry)
        print(f"[{len(entries)}/{len(args.config_list)}] {cfg.name}: "
              f"speed-up {_f(entry.get('step_speedup'), '.3f')} "
              f"{json.dumps({k: v.get('step_ms') for k, v in entry['impls'].items()})} "
              f"({entry['wall_s']} s){' ' + entry['error'] if 'error' in entry else ''}",
              flush=True)
        write(complete=False)
        write_profile_tables(args.profile, entries)
    write(complete=True)
    print(markdown_table(entries))
    for e in entries:
        if "profile_table" in e:
            print("\n" + e["profile_table"])
    print(f"wrote {out}; total wall time {time.perf_counter() - start:.1f} s")
    failed = [f"{e['config']}: {e['error']}" for e in entries if "error" in e]
    failed += [f"{e['config']} {impl}: {why}" for e in entries
               for impl, why in e.get("skipped", {}).items() if why.startswith("compile:")]
    for line in failed:
        print(f"FAILED {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
