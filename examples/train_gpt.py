"""Train a small GPT (Flax NNX) whose attention is jax_fa4.flax.MultiHeadAttention.

    python examples/train_gpt.py                        # --tiny on CPU, the GPU config on GPUs
    python examples/train_gpt.py --tiny --steps 20      # a few minutes at most on a CPU
    python examples/train_gpt.py --mesh                 # data parallel over all local devices
    python examples/train_gpt.py --mesh 2x4             # 2-way data x 4-way heads (tensor parallel)
    python examples/train_gpt.py --log-json run.json    # per-step losses, to compare runs
    python examples/train_gpt.py --pack                 # rows packed with documents, segment ids

Byte-level language model (vocabulary of 256) on ``examples/data/corpus.txt``: learned position
embeddings, pre-LayerNorm blocks of causal GQA attention and a GELU MLP, tied output embedding,
AdamW with warmup and cosine decay, one ``jax.jit`` train step. On a Hopper GPU the attention runs
jax-fa4's kernels (bfloat16); on a CPU it runs the pure-JAX reference (float32).

``--mesh`` builds a ``jax.sharding.Mesh`` with axes ("data", "model"): the batch is split over
"data"; attention heads and the MLP hidden units over "model" (Megatron-style), so q, k and v
arrive at flash_attention sharded over batch and heads and each device runs its own shard.

``--pack`` trains on packed rows, as the JAX trainers (MaxText, Levanter) do: each row of
``seq_len`` tokens holds several documents (corpus passages of seq_len/8 to seq_len/2 bytes, each
with its next-byte targets), the attention gets their ``segment_ids`` (a token attends only
within its document; on Hopper the segment-id kernels, forward and backward) and the position
embeddings restart at each document.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

try:
    from tqdm import tqdm
except ImportError:  # a bare machine: plain progress lines instead of the bar
    tqdm = None

import jax_fa4
from jax_fa4.backends import select
from jax_fa4.flax import MultiHeadAttention

CORPUS = pathlib.Path(__file__).parent / "data" / "corpus.txt"


@dataclasses.dataclass(frozen=True)
class Config:
    seq_len: int
    batch: int
    d_model: int
    layers: int
    heads: int
    kv_heads: int
    lr: float
    dtype: str


TINY = Config(seq_len=128, batch=16, d_model=128, layers=3, heads=4, kv_heads=2, lr=3e-3,
              dtype="float32")
GPU = Config(seq_len=512, batch=64, d_model=512, layers=6, heads=8, kv_heads=4, lr=1e-3,
             dtype="bfloat16")


# -- the model ---------------------------------------------------------------------------------
class Block(nnx.Module):
    def __init__(self, cfg: Config, implementation: str | None, rngs: nnx.Rngs):
        d, dtype = cfg.d_model, jnp.dtype(cfg.dtype)
        self.ln1 = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
        self.attn = MultiHeadAttention(
            num_heads=cfg.heads, in_features=d, num_kv_heads=cfg.kv_heads, causal=True,
            decode=False, use_bias=False, dtype=dtype, implementation=implementation, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
        self.mlp_in = nnx.Linear(d, 4 * d, dtype=dtype, rngs=rngs)
        self.mlp_out = nnx.Linear(4 * d, d, dtype=dtype, rngs=rngs)

    def __call__(self, x, segment_ids=None):
        x = x + self.attn(self.ln1(x), segment_ids=segment_ids)
        return x + self.mlp_out(nnx.gelu(self.mlp_in(self.ln2(x))))


class GPT(nnx.Module):
    def __init__(self, cfg: Config, implementation: str | None, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.embed = nnx.Embed(256, cfg.d_model, dtype=dtype, rngs=rngs)
        self.pos = nnx.Embed(cfg.seq_len, cfg.d_model, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, implementation, rngs) for _ in range(cfg.layers)])
        self.ln_f = nnx.LayerNorm(cfg.d_model, dtype=dtype, rngs=rngs)

    def __call__(self, tokens, segment_ids=None, positions=None):
        """(B, T) uint8 -> logits (B, T, 256) float32; packed rows: the tokens' document ids
        and in-document positions, (B, T) int32 each."""
        positions = jnp.arange(tokens.shape[1]) if positions is None else positions
        x = self.embed(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x, segment_ids)
        return self.embed.attend(self.ln_f(x)).astype(jnp.float32)


# -- sharding ----------------------------------------------------------------------------------
def make_mesh(spec: str | None) -> jax.sharding.Mesh | None:
    """``None``: no mesh; ``"auto"``: all devices on "data"; ``"DxM"``: data x model."""
    if spec is None:
        return None
    n = jax.device_count()
    data, model = (n, 1) if spec == "auto" else (int(x) for x in spec.lower().split("x"))
    if data * model != n:
        raise SystemExit(f"--mesh {spec}: {data} x {model} != {n} devices")
    return jax.make_mesh((data, model), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)


def param_spec(path: str, ndim: int) -> P:
    """Megatron-style: heads and MLP hidden units over "model", everything else replicated."""
    if "/attn/" in path and any(f"/{n}/" in path for n in ("query", "key", "value")):
        return P(None, "model", None) if ndim == 3 else P("model", None)  # kernel / bias
    if "/attn/out/" in path:
        return P("model", None, None) if ndim == 3 else P()
    if "/mlp_in/" in path:
        return P(None, "model") if ndim == 2 else P("model")
    if "/mlp_out/" in path:
        return P("model", None) if ndim == 2 else P()
    return P()


def shard_params(params, mesh):
    def place(path, x):
        name = "/" + "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path) + "/"
        return NamedSharding(mesh, param_spec(name, x.ndim))
    shardings = jax.tree_util.tree_map_with_path(place, params)
    return jax.device_put(params, shardings), shardings


# -- data --------------------------------------------------------------------------------------
def load_corpus() -> np.ndarray:
    return np.frombuffer(CORPUS.read_bytes(), dtype=np.uint8)


def batches(data: np.ndarray, cfg: Config, seed: int):
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - cfg.seq_len - 1, cfg.batch)
        idx = starts[:, None] + np.arange(cfg.seq_len + 1)
        chunk = data[idx]
        yield chunk[:, :-1], chunk[:, 1:]


def packed_batches(data: np.ndarray, cfg: Config, seed: int):
    """Rows packed with documents: (tokens, targets, segment ids, positions), each (B, T).

    A row is filled with passages of the corpus (random starts, lengths T/8 to T/2, the last
    one cut to fit), each with its own next-byte targets; the ids number the documents of a
    row and the positions restart at 0 in each."""
    rng = np.random.default_rng(seed)
    t = cfg.seq_len
    while True:
        x = np.empty((cfg.batch, t), np.uint8)
        y = np.empty_like(x)
        ids = np.empty((cfg.batch, t), np.int32)
        pos = np.empty((cfg.batch, t), np.int32)
        for row in range(cfg.batch):
            filled, doc = 0, 0
            while filled < t:
                n = min(int(rng.integers(t // 8, t // 2 + 1)), t - filled)
                start = int(rng.integers(0, len(data) - n - 1))
                x[row, filled:filled + n] = data[start:start + n]
                y[row, filled:filled + n] = data[start + 1:start + n + 1]
                ids[row, filled:filled + n] = doc
                pos[row, filled:filled + n] = np.arange(n)
                filled, doc = filled + n, doc + 1
        yield x, y, ids, pos


# -- training ----------------------------------------------------------------------------------
def train(cfg: Config, *, steps: int, seed: int, implementation: str | None,
          mesh_spec: str | None, progress: bool = True, pack: bool = False) -> dict:
    mesh = make_mesh(mesh_spec)
    if mesh is not None:
        d, m = mesh.shape["data"], mesh.shape["model"]
        if cfg.batch % d or cfg.heads % m or cfg.kv_heads % m:
            raise SystemExit(f"--mesh {mesh_spec}: batch {cfg.batch} must divide by {d}, heads "
                             f"{cfg.heads} and kv_heads {cfg.kv_heads} by {m}")
    model = GPT(cfg, implementation, nnx.Rngs(seed))
    graphdef, params = nnx.split(model, nnx.Param)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    warmup = max(1, min(100, steps // 10))
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(steps, warmup + 1),
                                                  end_value=cfg.lr / 10)
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1))

    def loss_fn(params, x, y, *packing):
        logits = nnx.merge(graphdef, params)(x, *packing)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step_fn(params, opt_state, x, y, *packing):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y, *packing)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    if mesh is None:
        opt_state = tx.init(params)
        step = jax.jit(step_fn, donate_argnums=(0, 1))
        put_batch = jnp.asarray
    else:
        params, p_shardings = shard_params(params, mesh)
        opt_state = jax.jit(tx.init)(params)  # moments follow the params' shardings
        replicated = NamedSharding(mesh, P())
        o_shardings = jax.tree.map(
            lambda x: x.sharding if isinstance(x.sharding, NamedSharding) else replicated,
            opt_state)
        opt_state = jax.device_put(opt_state, o_shardings)
        step = jax.jit(step_fn, donate_argnums=(0, 1),
                       out_shardings=(p_shardings, o_shardings, replicated))
        batch_sharding = NamedSharding(mesh, P("data", None))
        put_batch = lambda a: jax.device_put(a, batch_sharding)  # noqa: E731

    data = (packed_batches if pack else batches)(load_corpus(), cfg, seed)
    losses: list[float] = []
    tokens_per_step = cfg.batch * cfg.seq_len
    bar = tqdm(range(steps), unit="step") if progress and tqdm else range(steps)
    t_first = time.perf_counter()
    t_start = None
    for i in bar:
        params, opt_state, loss = step(params, opt_state, *map(put_batch, next(data)))
        losses.append(float(loss))
        if i == 0:
            t_start = time.perf_counter()  # after the compile
            compile_s = t_start - t_first
        elif progress:
            rate = i * tokens_per_step / (time.perf_counter() - t_start)
            if tqdm:
                bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{rate:,.0f}")
            elif i % 50 == 0 or i == steps - 1:
                print(f"step {i}: loss {losses[-1]:.3f}, {rate:,.0f} tokens/s", flush=True)
    elapsed = time.perf_counter() - (t_start or t_first)
    return {
        "config": dataclasses.asdict(cfg),
        "steps": steps,
        "seed": seed,
        "implementation": select(implementation),
        "mesh": None if mesh is None else dict(mesh.shape),
        "packed": pack,
        "devices": jax.device_count(),
        "device_kind": jax.devices()[0].device_kind,
        "params": n_params,
        "compile_s": round(compile_s, 2) if steps else None,
        "tokens_per_s": round((steps - 1) * tokens_per_step / elapsed) if steps > 1 else None,
        "losses": losses,
        # the allocator's high-water mark on each device (None where it does not say)
        "peak_bytes_per_device": [(d.memory_stats() or {}).get("peak_bytes_in_use")
                                  for d in jax.local_devices()],
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action=argparse.BooleanOptionalAction, default=None,
                   help="the small CPU config (default: on when the backend is a CPU)")
    p.add_argument("--steps", type=int, default=None, help="default 300 tiny, 2000 otherwise")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mesh", nargs="?", const="auto", default=None, metavar="DxM",
                   help="shard over all local devices: 'auto' (data only) or DATAxMODEL")
    p.add_argument("--implementation", choices=["auto", "reference", "sm90", "sm100"],
                   default="auto", help="attention implementation (auto: kernel on a GPU)")
    p.add_argument("--batch", type=int, default=None, help="override the config's batch size")
    p.add_argument("--layers", type=int, default=None,
                   help="override the config's number of blocks")
    p.add_argument("--log-json", type=pathlib.Path, default=None, metavar="PATH",
                   help="write the per-step losses and the run's settings here")
    p.add_argument("--pack", action="store_true",
                   help="rows packed with documents: segment ids and per-document positions")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    args = p.parse_args(argv)

    tiny = args.tiny if args.tiny is not None else jax.default_backend() == "cpu"
    cfg = TINY if tiny else GPU
    if args.batch:
        cfg = dataclasses.replace(cfg, batch=args.batch)
    if args.layers:
        cfg = dataclasses.replace(cfg, layers=args.layers)
    steps = args.steps if args.steps is not None else (300 if tiny else 2000)
    implementation = None if args.implementation == "auto" else args.implementation
    print(f"jax-fa4 {jax_fa4.__version__}: {'tiny' if tiny else 'gpu'} config, "
          f"{jax.device_count()} x {jax.devices()[0].device_kind}, attention implementation "
          f"{select(implementation)}")
    result = train(cfg, steps=steps, seed=args.seed, implementation=implementation,
                   mesh_spec=args.mesh, progress=args.progress, pack=args.pack)
    losses = result["losses"]
    if losses:
        k = max(1, min(10, len(losses) // 4))
        print(f"{result['params']:,} parameters; loss {np.mean(losses[:k]):.3f} (first {k} "
              f"steps) -> {np.mean(losses[-k:]):.3f} (last {k}); "
              f"{result['tokens_per_s'] or 0:,} tokens/s after {result['compile_s']} s compile")
        if not math.isfinite(losses[-1]):
            raise SystemExit("loss is not finite")
    if args.log_json:
        args.log_json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
