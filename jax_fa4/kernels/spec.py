"""What the binding needs to know about a kernel, without importing JAX or the compiler.

Every kernel the package ships is described by a *kernel config*: a frozen dataclass that holds
exactly what changes the generated code (dtype, head dim, mask kind, tile shape, ...) and nothing
that does not (batch size, sequence lengths, head counts, the softmax scale's value). It is the
compile key: one compiled object per (config, arch) serves every shape.

A config class derives from :class:`KernelConfig` and provides

* ``kernel_name``: a short family name (``"bwd_preprocess"``, ``"sm90_fwd"``), used in cache file
  names and error messages;
* ``signature()``: the tensors the kernel takes and produces, in call order, as
  :class:`TensorArg` (rank, dtype, per-dimension divisibility guarantees and a representative shape
  to compile with);
* ``validate()``: raises ValueError naming what the config does not support (the default
  accepts everything; configs that check themselves in ``__post_init__`` keep it).

A config module imports neither ``cutlass`` nor any kernel module: the runtime path looks kernels
up in the cache by config and never imports the compiler when the cache has them. The kernel
module imports its config; :mod:`jax_fa4.kernels.registry` names each family's launcher module,
which the compiler imports only when it compiles. The cache key hashes the config
(:meth:`KernelConfig.key_dict`), the arch, the toolchain, and the files of the launcher module's
import closure (:func:`jax_fa4.ffi.sources.closure`): editing a helper rekeys exactly the
kernels that import it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

# Dtype names shared by the binding and the kernels (numpy-style names).
FLOAT_DTYPES = ("bfloat16", "float16")
# Compile-time mask kinds of the attention kernels (window sizes are run-time values).
MASK_KINDS = ("none", "causal", "local")

#: log2(e): softmax runs in base 2 (``exp(x) = exp2(x·LOG2_E)``, ``lse_log2 = lse·LOG2_E``).
LOG2_E = math.log2(math.e)
#: ln(2) = 1 / LOG2_E: base-2 quantities back to natural log units.
LN2 = math.log(2.0)

#: Shared memory one CTA may opt into on sm_90 and sm_100: 227 KiB, the SM's 228 KiB less the
#: 1 KiB the system reserves per CTA (:data:`SMEM_SYSTEM_RESERVE_BYTES`, which the cubin lists as
#: ``.nv.shared.reserved`` static memory). A kernel whose whole storage is sized exactly checks
#: against it (the sm100 forward; the sm100 2-CTA backward's storage; the SASS checks).
SMEM_CAPACITY_BYTES = 227 * 1024
#: The per-CTA system reserve, outside :data:`SMEM_CAPACITY_BYTES`.
SMEM_SYSTEM_RESERVE_BYTES = 1024
#: What a config's ``smem_bytes()`` estimate may plan for: the capacity less 1 KiB for what the
#: estimate leaves out (the mbarriers and the alignment padding of the shared storage). The sm90
#: forward and backward and the sm100 backward configs check against it.
SMEM_BUDGET_BYTES = SMEM_CAPACITY_BYTES - 1024

# The float32 parameter vector of the attention kernels (``params``): run-time scalars that do
# not change the generated code, written by ``jax_fa4.backends.kernel.kernel_params`` and read
# by the kernels at these slots.
#: softmax scale (``1/sqrt(head_dim)`` by default)
PARAM_SCALE = 0
#: softcap (0: off; the kernels read it only when their config has softcap)
PARAM_SOFTCAP = 1
#: left window size (-1: unbounded)
PARAM_WINDOW_LEFT = 2
#: right window size (-1: unbounded)
PARAM_WINDOW_RIGHT = 3
#: The number of scalar slots; the learnable sink of query head ``h`` follows at
#: ``PARAM_SINKS + h`` (forward and backward kernels of sink variants).
NUM_PARAMS = 4
PARAM_SINKS = NUM_PARAMS


@dataclass(frozen=True)
class TensorArg:
    """One tensor of a kernel's signature.

    Attributes:
      name: the argument's name (for error messages).
      dtype: numpy-style dtype name, e.g. ``"bfloat16"``, ``"float32"``, ``"int32"``.
      sample_shape: a representative shape used when compiling. Dimensions the generated code does
        not specialise on may take any value at run time.
      divisibility: per dimension, a number the run-time extent is guaranteed to be a multiple of
        (1 = nothing guaranteed). Dimensions fixed by the config (head_dim) give their full extent.
      batched: the leading axis is the batch (``jax.vmap`` folds mapped axes into it); False for
        small parameter tensors shared by the whole call.
    """

    name: str
    dtype: str
    sample_shape: tuple[int, ...]
    divisibility: tuple[int, ...]
    batched: bool = True

    def __post_init__(self) -> None:
        if len(self.sample_shape) != len(self.divisibility):
            raise ValueError(f"{self.name}: sample_shape and divisibility differ in rank")
        for extent, div in zip(self.sample_shape, self.divisibility):
            if div < 1 or extent % div:
                raise ValueError(f"{self.name}: divisibility {self.divisibility} does not divide "
                                 f"sample shape {self.sample_shape}")

    @property
    def rank(self) -> int:
        return len(self.sample_shape)


@dataclass(frozen=True)
class KernelSignature:
    """A kernel's tensors in call order.

    ``aliases`` maps an input index to an output index that shares its buffer (an accumulator the
    caller initialises, e.g. zeros, and the kernel updates in place). The launcher then receives the
    aliased tensor once, as the input: its outputs are the non-aliased ones.
    """

    inputs: tuple[TensorArg, ...]
    outputs: tuple[TensorArg, ...]
    aliases: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class KernelConfig:
    """Base class of kernel configs (compile keys). Subclasses are frozen dataclasses."""

    kernel_name: ClassVar[str] = ""

    def signature(self) -> KernelSignature:  # pragma: no cover - abstract
        raise NotImplementedError

    def validate(self) -> None:
        """Raise ValueError naming the first unsupported feature (default: none)."""

    def key_dict(self) -> dict[str, Any]:
        """The config as a plain dict, with the family name: what the cache key hashes."""
        return {"kernel": self.kernel_name, **dataclasses.asdict(self)}

    def describe(self) -> str:
        fields = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(self).items())
        return f"{self.kernel_name}({fields})"


def check_dtype_and_mask(kernel: str, dtype: str, mask: str) -> None:
    """ValueError naming an unsupported dtype or mask kind of an attention kernel config."""
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"{kernel}: dtype {dtype!r} not supported (one of {FLOAT_DTYPES})")
    if mask not in MASK_KINDS:
        raise ValueError(f"{kernel}: mask kind {mask!r} not supported (one of {MASK_KINDS})")


def lookup_tuning(table: dict[tuple[int, int], dict[str, Any]], head_dim: int, head_dim_v: int,
                  mask: str, kernel: str, unsupported_hint: str = "") -> Any:
    """The tuning-table entry of (head dims, mask kind); ValueError naming what is unsupported."""
    row = table.get((head_dim, head_dim_v))
    if row is None:
        supported = ", ".join(f"{d}/{dv}" for d, dv in table)
        raise ValueError(f"{kernel}: head_dim/head_dim_v {head_dim}/{head_dim_v} not supported "
                         f"(supported: {supported}{unsupported_hint})")
    if mask not in row:
        raise ValueError(f"{kernel}: mask kind {mask!r} not supported (one of {MASK_KINDS})")
    return row[mask]


def attention_forward_signature(dtype: str, head_dim: int, head_dim_v: int) -> KernelSignature:
    """``fn(stream, q, k, v, params, out, lse)`` of every forward attention kernel: q (B, Sq, H, D),
    k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv), params float32 [scale, softcap, window_left,
    window_right], out (B, Sq, H, Dv), lse (B, H, Sq) float32; B, S and H dynamic."""
    d, dv = head_dim, head_dim_v
    b, sq, sk, h, hkv = 2, 256, 256, 4, 2
    return KernelSignature(
        inputs=(
            TensorArg("q", dtype, (b, sq, h, d), (1, 1, 1, d)),
            TensorArg("k", dtype, (b, sk, hkv, d), (1, 1, 1, d)),
            TensorArg("v", dtype, (b, sk, hkv, dv), (1, 1, 1, dv)),
            TensorArg("params", "float32", (NUM_PARAMS,), (NUM_PARAMS,), batched=False),
        ),
        outputs=(
            TensorArg("out", dtype, (b, sq, h, dv), (1, 1, 1, dv)),
            TensorArg("lse", "float32", (b, h, sq), (1, 1, 1)),
        ),
    )


def paged_attention_forward_signature(dtype: str, head_dim: int, head_dim_v: int,
                                      tile_n: int) -> KernelSignature:
    """``fn(stream, q, k_cache, v_cache, params, page_table, seqused_k, out, lse)`` of the paged
    forward kernels: the cache as one batch entry of ``tile_n``-key tiles, k_cache
    (1, T·tile_n, Hkv, D) and v_cache (1, T·tile_n, Hkv, Dv) (shared by the batch, so not
    batched); page_table (B, max_blocks) int32 names the cache tile of each key block and
    seqused_k (B,) int32 the keys of each batch entry; the rest as in
    :func:`attention_forward_signature`."""
    d, dv = head_dim, head_dim_v
    b, sq, h, hkv, tiles, blocks = 2, 64, 4, 2, 8, 4
    return KernelSignature(
        inputs=(
            TensorArg("q", dtype, (b, sq, h, d), (1, 1, 1, d)),
            TensorArg("k_cache", dtype, (1, tiles * tile_n, hkv, d), (1, tile_n, 1, d),
                      batched=False),
            TensorArg("v_cache", dtype, (1, tiles * tile_n, hkv, dv), (1, tile_n, 1, dv),
                      batched=False),
            TensorArg("params", "float32", (NUM_PARAMS,), (NUM_PARAMS,), batched=False),
            TensorArg("page_table", "int32", (b, blocks), (1, 1)),
            TensorArg("seqused_k", "int32", (b,), (1,)),
        ),
        outputs=(
            TensorArg("out", dtype, (b, sq, h, dv), (1, 1, 1, dv)),
            TensorArg("lse", "float32", (b, h, sq), (1, 1, 1)),
        ),
    )


def varlen_attention_forward_signature(dtype: str, head_dim: int, head_dim_v: int
                                       ) -> KernelSignature:
    """``fn(stream, q, k, v, params, cu_seqlens_q, cu_seqlens_k, out, lse)`` of the varlen
    forward kernels: q (1, total_q, H, D), k (1, total_k, Hkv, D), v (1, total_k, Hkv, Dv) and
    out (1, total_q, H, Dv) are the sequences packed as one batch entry; cu_seqlens_q / _k
    (batch + 1,) int32 their boundaries; lse (batch, H, max_seqlen_q) float32 (its shape sets the
    grid). out rows outside every sequence are written as 0. Nothing is batched (``jax.vmap``
    over them is refused)."""
    d, dv = head_dim, head_dim_v
    tq, tk, h, hkv, b, mq = 300, 400, 4, 2, 3, 128
    return KernelSignature(
        inputs=(
            TensorArg("q", dtype, (1, tq, h, d), (1, 1, 1, d), batched=False),
            TensorArg("k", dtype, (1, tk, hkv, d), (1, 1, 1, d), batched=False),
            TensorArg("v", dtype, (1, tk, hkv, dv), (1, 1, 1, dv), batched=False),
            TensorArg("params", "float32", (NUM_PARAMS,), (NUM_PARAMS,), batched=False),
            TensorArg("cu_seqlens_q", "int32", (b + 1,), (1,), batched=False),
            TensorArg("cu_seqlens_k", "int32", (b + 1,), (1,), batched=False),
        ),
        outputs=(
            TensorArg("out", dtype, (1, tq, h, dv), (1, 1, 1, dv), batched=False),
            TensorArg("lse", "float32", (b, h, mq), (1, 1, 1), batched=False),
        ),
    )


def attention_backward_signature(dtype: str, head_dim: int, head_dim_v: int, tile_m: int,
                                 gqa: bool, counters: tuple[str, int] | None = None
                                 ) -> KernelSignature:
    """``fn(stream, q, k, v, dout, lse_log2, delta, params, dq_accum, [counters,] dk, dv)`` of the
    backward main kernels. dq_accum (B, H, Sq_pad·D) float32 is input 7, aliased to output 0
    (Sq_pad a multiple of ``tile_m``); dk, dv are (B, Sk, Hkv, ·) in ``dtype``, or float32 per
    query head (B, Sk, H, ·) when ``gqa``. ``counters`` = (name, per_query_block) adds the int32
    (B, H, per_query_block·Sq_pad/tile_m) ordering counters of a deterministic kernel as input 8,
    aliased to output 3."""
    d, dv, tm = head_dim, head_dim_v, tile_m
    b, sq, sk, h, hkv = 2, 256, 256, 4, 2
    hdk = h if gqa else hkv
    dkv_dtype = "float32" if gqa else dtype
    accum = TensorArg("dq_accum", "float32", (b, h, sq * d), (1, 1, tm * d))
    inputs = (
        TensorArg("q", dtype, (b, sq, h, d), (1, 1, 1, d)),
        TensorArg("k", dtype, (b, sk, hkv, d), (1, 1, 1, d)),
        TensorArg("v", dtype, (b, sk, hkv, dv), (1, 1, 1, dv)),
        TensorArg("dout", dtype, (b, sq, h, dv), (1, 1, 1, dv)),
        TensorArg("lse_log2", "float32", (b, h, sq), (1, 1, 1)),
        TensorArg("delta", "float32", (b, h, sq), (1, 1, 1)),
        TensorArg("params", "float32", (NUM_PARAMS,), (NUM_PARAMS,), batched=False),
        accum,
    )
    outputs = (
        accum,
        TensorArg("dk", dkv_dtype, (b, sk, hdk, d), (1, 1, 1, d)),
        TensorArg("dv", dkv_dtype, (b, sk, hdk, dv), (1, 1, 1, dv)),
    )
    if counters is None:
        return KernelSignature(inputs=inputs, outputs=outputs, aliases=((7, 0),))
    name, per_block = counters
    sem = TensorArg(name, "int32", (b, h, per_block * sq // tm), (1, 1, per_block))
    return KernelSignature(inputs=(*inputs, sem), outputs=(*outputs, sem),
                           aliases=((7, 0), (8, 3)))
