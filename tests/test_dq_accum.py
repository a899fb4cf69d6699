"""The dense backward's float32 dQ accumulator comes zero-filled from the preprocess kernel.

The main backward kernel adds dQ into ``dq_accum`` (B, H, Sq_pad·D) in place. Were it an XLA
fill, XLA would merge the fills of a model's layers into one kernel at the start of the
backward (seen in a 4-layer step's optimized HLO: one fusion writing all four layers'
buffers), keeping every layer's buffer alive at once. So the preprocess kernel
(``PreprocessConfig.zero_dq_accum``) returns it: each layer's accumulator is made by that
layer's preprocess. Lowered for CUDA without compiling (tests/cuda_lowering.py): the main
kernel's ``dq_accum`` operand is the preprocess call's third result, and no float32 fill of that
shape is left in the program.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from cuda_lowering import CUSTOM_CALL, recording_kernels

import jax_fa4

#: index of dq_accum among the main backward kernel's inputs (spec.attention_backward_signature)
DQ_ACCUM_INPUT = 7


def _calls(text: str) -> list[tuple[str, str, list[str]]]:
    """(result name, placeholder object, operands) of every kernel custom call in ``text``."""
    calls = []
    for line in text.splitlines():
        if CUSTOM_CALL not in line:
            continue
        result = line.split("=", 1)[0].strip().split(":")[0]
        operands = line.split(CUSTOM_CALL + "(", 1)[1].split(")", 1)[0]
        module = line.split('module = "', 1)[1].split('"', 1)[0]
        calls.append((result, module, [o.strip() for o in operands.split(",")]))
    return calls


def _lower_grad(compute_capability: str, b, s, h, hkv, d, **kwargs) -> str:
    sd = jax.ShapeDtypeStruct
    q, kv = sd((b, s, h, d), jnp.bfloat16), sd((b, s, hkv, d), jnp.bfloat16)

    def loss(q, k, v):
        out = jax_fa4.flash_attention(q, k, v, **kwargs)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    with recording_kernels(compute_capability):
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(
            lowering_platforms=("cuda",)).as_text()


def _assert_accumulator_from_preprocess(text: str, main_family: str, b: int, s: int,
                                        h: int) -> None:
    calls = _calls(text)
    pre = [c for c in calls if "bwd_preprocess(" in c[1]]
    main = [c for c in calls if f"{main_family}(" in c[1]]
    assert len(pre) == 1 and "zero_dq_accum=True" in pre[0][1], pre
    assert len(main) == 1, [c[1] for c in calls]
    assert main[0][2][DQ_ACCUM_INPUT] == f"{pre[0][0]}#2"
    # no float32 fill as long as an accumulator (B, H, Sq_pad·D) (the lse cotangent's zeros
    # are (B, H, Sq))
    fills = [int(n) for n in re.findall(
        rf"stablehlo.broadcast_in_dim .* -> tensor<{b}x{h}x(\d+)xf32>", text)]
    assert all(n <= s for n in fills), fills


@pytest.mark.parametrize("case", [
    dict(b=2, s=1000, h=4, hkv=4, d=64),
    dict(b=2, s=777, h=8, hkv=2, d=128, causal=True),
    dict(b=1, s=333, h=4, hkv=4, d=128, deterministic=True),
    dict(b=1, s=513, h=4, hkv=4, d=256, causal=True),
    dict(b=2, s=300, h=4, hkv=2, d=96, learnable_sink=jnp.zeros(4, jnp.float32)),
], ids=["d64", "d128-gqa-causal", "d128-deterministic", "d256-causal", "d96-sink"])
def test_sm90_backward_takes_the_preprocess_accumulator(case):
    case = dict(case)
    dims = {k: case.pop(k) for k in ("b", "s", "h", "hkv", "d")}
    text = _lower_grad("9.0", **dims, **case)
    _assert_accumulator_from_preprocess(text, "sm90_bwd", dims["b"], dims["s"], dims["h"])


def test_sm90_segment_backward_takes_the_preprocess_accumulator():
    b, s, h = 2, 500, 4
    ids = jnp.concatenate([jnp.zeros((b, 200), jnp.int32), jnp.ones((b, s - 200), jnp.int32)], 1)
    text = _lower_grad("9.0", b, s, h, h, 128, causal=True, segment_ids=ids)
    _assert_accumulator_from_preprocess(text, "sm90_bwd", b, s, h)


def test_sm100_backward_takes_the_preprocess_accumulator():
    text = _lower_grad("10.0", 2, 640, 4, 2, 128, causal=True, implementation="sm100")
    _assert_accumulator_from_preprocess(text, "sm100_bwd", 2, 640, 4)


def test_sm100_split_backward_has_no_accumulator():
    """Head dim 256 on sm100 (a dK/dV and a dQ kernel, each output written once): the
    preprocess clears nothing."""
    text = _lower_grad("10.0", 1, 300, 4, 4, 256, implementation="sm100")
    pre = [c for c in _calls(text) if "bwd_preprocess(" in c[1]]
    assert len(pre) == 1 and "zero_dq_accum=False" in pre[0][1]
