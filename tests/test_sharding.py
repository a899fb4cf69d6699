"""flash_attention under jax.jit with sharded inputs: each device runs its own shard.

The multi-device checks run in a subprocess with 4 simulated CPU devices
(``tests/multidevice_checks.py``, suite ``sharding``): this process has already initialised JAX
with one.
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest
from compiled import per_class
from conformance import normal

import jax_fa4
from jax_fa4.parallel import sharding

CHECKS = pathlib.Path(__file__).with_name("multidevice_checks.py")
TOL = 1e-5


class _ChecksProcess:
    """This test process's ``multidevice_checks.py``: started on the first request and kept for
    the rest of the test run (one interpreter for all the checks), answering one check at a time."""

    proc: subprocess.Popen | None = None
    stderr = None

    @classmethod
    def ask(cls, suite: str, case: str) -> dict:
        if cls.proc is None:
            env = dict(os.environ)
            # keep the suite's XLA settings (tests/conftest.py), not a device count set by anyone
            env["XLA_FLAGS"] = " ".join(
                f for f in env.get("XLA_FLAGS", "").split()
                if not f.startswith("--xla_force_host_platform_device_count"))
            cls.stderr = tempfile.TemporaryFile()
            cls.proc = subprocess.Popen([sys.executable, str(CHECKS)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=cls.stderr, text=True,
                                        env=env)
        cls.proc.stdin.write(f"{suite} {case}\n")
        cls.proc.stdin.flush()
        for line in cls.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        code = cls.proc.wait()
        cls.stderr.seek(0)
        err = cls.stderr.read()[-3000:].decode(errors="replace")
        cls.close()
        raise AssertionError(f"{CHECKS.name} ended (exit {code}) on {suite} {case}:\n{err}")

    @classmethod
    def close(cls) -> None:
        if cls.proc is not None:
            cls.proc.stdin.close()
            cls.proc.wait()
            cls.stderr.close()
            cls.proc = None


atexit.register(_ChecksProcess.close)


class multidevice_suite(dict):
    """The measurements of a ``multidevice_checks.py`` suite's checks by name, each asked of the
    checks process when a test first reads it: a pytest-xdist worker runs only the checks of the
    tests it was given, each once, and all of them in one interpreter."""

    def __init__(self, suite: str):
        super().__init__()
        self.suite = suite

    def __missing__(self, case: str) -> dict:
        self[case] = _ChecksProcess.ask(self.suite, case)
        return self[case]


@pytest.fixture(scope="module")
def suite():
    return multidevice_suite("sharding")


def _ok(result: dict) -> dict:
    assert "error" not in result, result.get("traceback", result.get("error"))
    return result


#: the quick tier runs one case per sharding (its first: GQA for batch and heads), --exhaustive
#: all (MHA with options over batch and heads too)
@pytest.mark.parametrize("case, spec", per_class([
    ("batch_and_heads_gqa", "P('data', None, 'model', None)"),
    ("batch_and_heads_mha_options", "P('data', None, 'model', None)"),
    ("batch_only", "P(('data', 'model'),)"),
    ("heads_only_bf16", "P(None, None, 'model', None)"),
], key=lambda case: case[1]))
def test_batch_and_head_sharding_needs_no_communication(suite, case, spec):
    r = _ok(suite[case])
    # No collective at all in the forward; in the backward nothing but the loss's scalar sum.
    assert r["fwd_collectives"] == {}, r["fwd_collectives"]
    assert set(r["grad_collectives"]) <= {"all-reduce"}, r["grad_collectives"]
    assert all(s.startswith("f32[]") for s in r["grad_collectives"].get("all-reduce", []))
    assert r["out_spec"] == spec
    assert r["grad_specs"] == [spec] * 3  # dq, dk, dv keep the inputs' sharding
    # float32: the same arithmetic; bfloat16: XLA may fuse the unsharded program differently.
    tol = TOL if r["dtype"] == "float32" else 2 ** -7 * max(1.0, r["scale"])
    assert r["out_err"] <= tol and r["grad_err"] <= tol, r


def test_sink_is_sharded_with_the_heads(suite):
    """A learnable sink on a kernel backend's route is the forward's own operand: each device's
    forward gets its heads' sinks ((H/2,) with heads over 2 devices) and computes them without
    any communication; results equal the unsharded reference's."""
    r = _ok(suite["sink_batch_heads"])
    assert r["fwd_collectives"] == {}, r["fwd_collectives"]
    # (the partitioner also traces the unsharded body once: [4])
    assert [2] in r["sink_shapes"] and set(map(tuple, r["sink_shapes"])) <= {(2,), (4,)}, r
    # the backward too (its sink's share by batch entry, summed over the batch outside)
    assert [2] in r["sink_bwd_shapes"] and set(map(tuple, r["sink_bwd_shapes"])) <= {(2,), (4,)}
    assert r["out_err"] <= TOL and r["grad_err"] <= TOL, r


def test_sink_under_vmap_joins_around_the_forward(suite):
    """Under vmap the sink arrives per folded batch entry, (B, H): the forward runs without it
    and it joins in float32 afterwards (a kernel's params hold one sink per head per call)."""
    r = _ok(suite["sink_vmap"])
    assert r["sink_shapes"] and all(shape is None for shape in r["sink_shapes"]), r
    assert r["sink_bwd_shapes"] == [], r  # (B, H) sinks: d sink from delta, no kernel rows
    assert r["out_err"] <= TOL and r["grad_err"] <= TOL, r


@pytest.mark.parametrize("case", ["segments_kernel_batch_heads",
                                  "segments_reference_batch_heads"])
def test_segment_ids_shard_with_the_batch(suite, case):
    """Segment ids (B, S) follow q's batch sharding: each device runs the segment-id kernels
    (emulated here) or the reference on its own batch rows and heads with its rows' ids, no
    communication in the forward, results equal to the unsharded reference's (out, max logits
    and gradients, a sink included)."""
    r = _ok(suite[case])
    assert r["fwd_collectives"] == {}, r["fwd_collectives"]
    assert r["out_spec"] == "P('data', None, 'model', None)"
    tol = 2 ** -7 * max(1.0, r["scale"])  # bf16 inputs, float32 emulation
    assert r["out_err"] <= tol and r["grad_err"] <= tol, r
    assert r["max_logits_err"] <= 1e-5 * max(1.0, r["scale"]), r
    if case == "segments_kernel_batch_heads":
        kinds = {name for name, _ in r["kernel_shapes"]}
        assert {"sm90_fwd", "sm90_bwd"} <= kinds, kinds
        # each device's forward: its 2 batch rows and 2 of the 4 query heads (the partitioner
        # may also trace the whole batch once)
        fwd = [shapes for name, shapes in r["kernel_shapes"] if name == "sm90_fwd"]
        assert [[2, 96, 2, 64], [2, 96, 1, 64], [2, 96, 1, 64]] in fwd, fwd


def test_segment_ids_under_sequence_sharding_are_gathered(suite):
    """q, k, v and the ids sharded over the sequence under jit (no ring): the generic rule
    gathers them before the segment-id kernels (emulated), never a wrong answer."""
    r = _ok(suite["segments_kernel_seq_sharded"])
    assert "all-gather" in r["fwd_collectives"], r["fwd_collectives"]
    tol = 2 ** -7 * max(1.0, r["scale"])
    assert r["out_err"] <= tol and r["grad_err"] <= tol, r
    assert r["max_logits_err"] <= 1e-5 * max(1.0, r["scale"]), r
    fwd = [shapes for name, shapes in r["kernel_shapes"] if name == "sm90_fwd"]
    assert fwd and all(shapes[0][1] == 96 for shapes in fwd), fwd  # whole sequences


def test_max_logits_shard_like_lse(suite):
    r = _ok(suite["max_logits_batch_heads"])
    assert r["fwd_collectives"] == {}, r["fwd_collectives"]
    assert r["max_logits_spec"] == "P('data', 'model')", r
    assert r["out_err"] <= TOL and r["max_logits_err"] <= TOL, r


def test_forward_mode_keeps_batch_and_head_sharding(suite):
    """jax.jvp under jit with q, k, v and their tangents sharded over batch and heads: the
    tangent (the reference's JVP) keeps the sharding, nothing is gathered, and it equals the
    unsharded program's."""
    r = _ok(suite["jvp_batch_and_heads"])
    assert r["collectives"] == {}, r["collectives"]
    # (the spec may drop its trailing unsharded axis: the same sharding)
    assert r["tangent_spec"] in ("P('data', None, 'model', None)", "P('data', None, 'model')"), r
    assert r["out_err"] <= TOL and r["tangent_err"] <= TOL * max(1.0, r["scale"]), r


@pytest.mark.parametrize("case", ["shard_map_grad_batch", "shard_map_grad_heads_invariant_kv"])
def test_grad_inside_shard_map(suite, case):
    """jax.grad inside shard_map equals the unsharded gradient: batch-sharded q, k, v, and
    head-sharded q with k, v invariant across the devices (their gradients summed)."""
    r = _ok(suite[case])
    assert r["grad_err"] <= TOL * max(1.0, r["scale"]), r


def test_dot_product_attention_shards_like_flash_attention(suite):
    """jax_fa4.dot_product_attention with padded lengths (segment ids) under jit with batch and
    head shardings: no collective in the forward, only the loss's scalar sum in the gradient,
    the unsharded program's results."""
    r = _ok(suite["dot_product_attention_batch_heads"])
    assert r["fwd_collectives"] == {}, r["fwd_collectives"]
    assert set(r["grad_collectives"]) <= {"all-reduce"}, r["grad_collectives"]
    assert all(s.startswith("f32[]") for s in r["grad_collectives"].get("all-reduce", []))
    assert r["out_spec"] == "P('data', None, 'model', None)", r
    assert r["out_err"] <= TOL and r["grad_err"] <= TOL, r


def test_vmapped_axes_stay_sharded(suite):
    for case in ("vmap", "vmap_sharded_mapped_axis"):
        r = _ok(suite[case])
        assert r["fwd_collectives"] == {}, (case, r["fwd_collectives"])
        assert r["out_err"] <= TOL


@pytest.mark.parametrize("case", ["heads_indivisible_gqa", "mqa_heads"])
def test_heads_that_cannot_split_like_kv_heads_are_replicated(suite, case):
    # q heads split n ways but Hkv not divisible by n: q is gathered, results stay right.
    r = _ok(suite[case])
    assert "all-gather" in r["fwd_collectives"]
    assert r["out_err"] <= TOL and r["grad_err"] <= TOL


def test_sequence_sharding_is_replicated_under_auto_axes(suite):
    r = _ok(suite["seq_sharded_auto"])
    assert "all-gather" in r["fwd_collectives"]  # documented: gathered, never wrong
    assert r["out_err"] <= TOL and r["grad_err"] <= TOL


def test_explicit_axes_keep_batch_and_heads_and_reject_sequence(suite):
    r = _ok(suite["explicit_batch_heads"])
    assert r["out_spec"] == "P('data', None, 'model', None)" and r["out_err"] <= TOL
    err = suite["explicit_seq_raises"]["error"]
    assert err.startswith("ValueError") and "ring_attention" in err and "shard_map" in err


# -- single device: the operations are inlined, everything else unchanged ----------------------
def _qkv(b=2, s=16, h=4, hkv=2, d=8):
    return normal("sharding", [(b, s, h, d), (b, s, hkv, d), (b, s, hkv, d)], jnp.float32)


def test_forward_and_backward_are_partitionable_operations():
    q, k, v = _qkv()
    jaxpr = jax.make_jaxpr(jax.grad(lambda q, k, v: jax_fa4.flash_attention(q, k, v).sum(),
                                    argnums=(0, 1, 2)))(q, k, v)
    text = str(jaxpr)
    assert "jax_fa4_attention_fwd" in text and "jax_fa4_attention_bwd" in text


def test_single_device_lowering_has_no_partitioning_call():
    q, k, v = _qkv()
    hlo = jax.jit(lambda q, k, v: jax_fa4.flash_attention(q, k, v)).lower(q, k, v).as_text()
    assert "CustomSPMDPartitioning" not in hlo


def test_nested_vmap_adds_leading_batch_dims():
    q, k, v = _qkv()
    stack = lambda x: jnp.stack([jnp.stack([x, -x]), jnp.stack([2 * x, x])])  # noqa: E731
    f = jax.vmap(jax.vmap(lambda q, k, v: jax_fa4.flash_attention(q, k, v, causal=True)))
    got = f(stack(q), stack(k), stack(v))
    want = jax_fa4.flash_attention(stack(q).reshape(-1, *q.shape[1:]),
                                   stack(k).reshape(-1, *k.shape[1:]),
                                   stack(v).reshape(-1, *v.shape[1:]), causal=True)
    assert got.shape == (2, 2, *q.shape)
    assert jnp.allclose(got.reshape(want.shape), want, atol=1e-6)


def test_sharding_rule_replicates_sequence_and_head_dim():
    types = [SimpleNamespace(shape=s) for s in ((3, 2, 16, 4, 8), (3, 2, 16, 2, 8),
                                                (3, 2, 16, 2, 8))]  # one vmapped axis
    rule = sharding._forward_rule(None, None, types, None)
    assert set(rule.need_replication_factors) == {"sq", "sk", "d", "dv"}
    assert rule.operand_mappings[0] == ("b0", "b1", "sq", "h", "d")
    assert rule.operand_mappings[1] == ("b0", "b1", "sk", "hkv", "d")
    assert rule.result_mappings == (("b0", "b1", "sq", "h", "dv"), ("b0", "b1", "h", "sq"))


def test_fp8_shards_over_batch_and_heads(suite):
    """An FP8 call under jit with e4m3 q, k, v sharded over batch and heads and the (B, Hkv)
    descales like k's batch and heads: no communication, each device's own rows and heads
    (the kernel route's inputs recorded, the kernel stubbed), the reference backend's result
    equal to the unsharded one, out bfloat16 sharded like q."""
    r = _ok(suite["fp8_reference_batch_heads"])
    assert r["fwd_collectives"] == {}, r["fwd_collectives"]
    assert r["out_spec"] == "P('data', None, 'model', None)" and r["out_dtype"] == "bfloat16"
    assert r["out_err"] <= 2 ** -8 * max(1.0, r["scale"]), r
    r = _ok(suite["fp8_kernel_batch_heads"])
    assert r["fwd_collectives"] == {}, r["fwd_collectives"]
    fwd = [shapes for name, dtype, shapes in r["kernel_shapes"] if dtype == "float8_e4m3fn"]
    # q (2 rows, 2 of 4 heads), k and v (1 of 2 kv heads), v as stored (B, Sk, Hkv, Dv)
    assert [[2, 64, 2, 64], [2, 64, 1, 64], [2, 64, 1, 64]] in fwd, fwd


def test_fp8_vmap(suite):
    r = _ok(suite["fp8_vmap"])
    assert r["out_err"] <= 1e-6 * max(1.0, r["scale"]), r
