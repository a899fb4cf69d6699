"""The FFI binding on a CPU machine: lowering for CUDA, export, precompile, runtime discovery."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import jax_fa4
from jax_fa4 import backends
from jax_fa4.tools import precompile
from jax_fa4.ffi import runtime
from jax_fa4.ffi.cache import KernelCache
from jax_fa4.kernels.preprocess_config import PreprocessConfig
from jax_fa4.tools.variants import representative, variants
import compiled
from compiled import assert_no_local_memory, compiled_sass, needs_disassembler
from cuda_lowering import backward_specs


def _preprocess_inputs():
    o = jax.random.normal(jax.random.key(0), (2, 33, 4, 128), jnp.float32).astype(jnp.bfloat16)
    return o, o, jnp.zeros((2, 4, 33), jnp.float32)


def test_export_for_cuda_embeds_the_kernel(cache_dir):
    f = jax.jit(lambda o, d, l: backends.get("sm90").backward_preprocess(o, d, l))
    exported = jax.export.export(f, platforms=["cuda"],
                                 disabled_checks=jax_fa4.export_disabled_safety_checks())(
        *_preprocess_inputs())
    text = exported.mlir_module()
    assert "stablehlo.custom_call @CuteDSLRT_NvJaxCutlassCall_v2" in text
    assert "module = " in text and "key = " in text
    (entry,) = KernelCache(cache_dir).entries()
    # the whole object (plus framing) travels inside the serialized artifact
    obj = next((cache_dir / "sm_90a").glob("*.o")).read_bytes()
    assert len(exported.serialize()) > len(obj)
    assert entry["kernel"] == "bwd_preprocess"


def test_export_without_disabled_check_is_refused(cache_dir):
    f = jax.jit(lambda o, d, l: backends.get("sm90").backward_preprocess(o, d, l))
    with pytest.raises(ValueError, match="CuteDSLRT_NvJaxCutlassCall_v2"):
        jax.export.export(f, platforms=["cuda"])(*_preprocess_inputs())


def test_vmap_lowers_to_one_kernel_call(cache_dir):
    o, d, lse = _preprocess_inputs()
    f = jax.jit(jax.vmap(lambda o, d: backends.get("sm90").backward_preprocess(o, d, lse)))
    stacked = jnp.stack([o, o, o])
    exported = jax.export.export(f, platforms=["cuda"],
                                 disabled_checks=jax_fa4.export_disabled_safety_checks())(
        stacked, stacked)
    assert exported.mlir_module().count("CuteDSLRT_NvJaxCutlassCall_v2(") == 1
    assert exported.out_avals[0].shape == (3, 2, 4, 33)


def test_runtime_library_is_found_in_the_installed_wheel(monkeypatch):
    monkeypatch.delenv(runtime.ENV_RUNTIME_LIB, raising=False)
    path = runtime.find_runtime_library()
    assert path.name == "libcute_dsl_runtime.so" and path.is_file()


def test_runtime_library_env_var_must_point_at_a_file(monkeypatch, tmp_path):
    monkeypatch.setenv(runtime.ENV_RUNTIME_LIB, str(tmp_path / "missing.so"))
    with pytest.raises(runtime.RuntimeLibraryNotFoundError, match="JAX_FA4_CUTE_RUNTIME_LIB"):
        runtime.find_runtime_library()


def test_registration_loads_the_handlers_without_the_compiler(tmp_path):
    code = ("import sys\nfrom jax_fa4.ffi import runtime\nruntime.register_ffi_targets()\n"
            "assert 'cutlass' not in sys.modules\nprint('ok')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.stdout.strip() == "ok", res.stderr[-2000:]


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_precompile_builds_the_tiers_shipped_variants(shipped_cache, arch):
    """The run's kernel cache holds the tier's shipped variants (all with --exhaustive, else the
    representative ones), each with its arch and compile time; building the same selection
    again compiles nothing."""
    want = [v for v in (variants("default") if compiled.EXHAUSTIVE
                        else compiled.shipped_representatives()) if v.arch == arch]
    metas = {json.dumps(m["config"], sort_keys=True): m
             for m in (json.loads(p.read_text())
                       for p in (shipped_cache.root / arch).glob("*.json"))}
    for v in want:
        meta = metas.get(json.dumps(v.config.key_dict(), sort_keys=True))
        assert meta is not None, v.describe()
        assert meta["arch"] == arch and meta["compile_seconds"] > 0
    records = precompile.build(want, shipped_cache, progress=False)
    assert [r["status"] for r in records] == ["cached"] * len(want)



def test_precompile_from_cache_copies_instead_of_compiling(shipped_cache, tmp_path,
                                                           monkeypatch):
    """``build(source=...)`` (``--from-cache``): what another cache built for the same sources
    is copied byte for byte and nothing is compiled; a damaged source entry is compiled."""
    want = [v for v in compiled.shipped_representatives() if v.arch == "sm_90a"][:3]
    precompile.build(want, shipped_cache, progress=False)
    dest = KernelCache(tmp_path / "device")
    records = precompile.build(want, dest, progress=False, source=shipped_cache)
    assert [r["status"] for r in records] == ["copied"] * len(want)
    version = precompile.dsl_version()
    for v in want:
        assert (dest.get(v.config, v.arch, version).object_bytes
                == shipped_cache.get(v.config, v.arch, version).object_bytes)
    damaged = KernelCache(tmp_path / "damaged")
    with damaged.lock(want[0].config, "sm_90a", version):
        damaged.put(want[0].config, "sm_90a", version,
                    shipped_cache.get(want[0].config, "sm_90a", version).object_bytes)
    obj = next((tmp_path / "damaged" / "sm_90a").glob("*.o"))
    obj.write_bytes(obj.read_bytes()[:-1] + bytes([obj.read_bytes()[-1] ^ 1]))
    monkeypatch.setattr(precompile, "_compile_one", lambda v: (v, b"rebuilt", 0.5))
    records = precompile.build(want[:1], KernelCache(tmp_path / "other"), progress=False,
                               source=damaged)
    assert [r["status"] for r in records] == ["compiled"]

def test_precompile_representative_builds_the_rules_choice(tmp_path, capsys):
    """``--representative`` narrows the selection by ``variants.representative``."""
    args = ["--family", "bwd_preprocess", "--arch", "sm_90a", "--dtype", "bfloat16", "--head-dim",
            "64", "192", "--cache-dir", str(tmp_path), "--quiet"]
    want = representative(variants(families=["bwd_preprocess"], archs=["sm_90a"],
                                   dtypes=["bfloat16"], head_dims=[64, 192]))
    assert len(want) == 2
    assert precompile.main([*args, "--representative"]) == 0
    assert f"{len(want)} kernels in {tmp_path}: {len(want)} compiled" in capsys.readouterr().out
    names = sorted(p.name.split("-")[0] for p in tmp_path.glob("sm_90a/*.json"))
    assert names == ["bwd_preprocess"] * len(want)


def test_precompile_in_parallel_matches_serial(tmp_path):
    # one head dim: its two forms (zero_dq_accum or not) on two archs, four kernels
    args = ["--family", "bwd_preprocess", "--dtype", "bfloat16", "--head-dim", "64", "--quiet"]
    precompile.main([*args, "--cache-dir", str(tmp_path / "serial"), "--jobs", "1"])
    precompile.main([*args, "--cache-dir", str(tmp_path / "parallel"), "--jobs", "2"])
    names = [sorted(p.name for p in (tmp_path / d).glob("*/*.json"))
             for d in ("serial", "parallel")]
    assert names[0] == names[1] and len(names[0]) == 4


@needs_disassembler
@pytest.mark.parametrize("zero_dq_accum", [False, True])
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_preprocess_sass_has_no_local_memory(shipped_cache, arch, zero_dq_accum):
    """No local memory; the dq_accum clear (zero_dq_accum) stores 16 bytes at a time."""
    kernel = compiled_sass(shipped_cache, PreprocessConfig("bfloat16", 128, zero_dq_accum),
                           arch)
    assert kernel.arch == arch
    assert_no_local_memory(kernel)
    assert (kernel.count("STG.E.128") > 0) == zero_dq_accum


@pytest.mark.parametrize("deterministic", [False, True])
def test_grad_on_hopper_runs_the_backward_kernels(shipped_cache, monkeypatch, deterministic):
    """jax.grad through flash_attention(implementation="sm90") lowers to the forward, the
    preprocess and the two backward kernels (deterministic=True: the ordered-dQ main kernel)."""
    from jax_fa4.ffi import call

    monkeypatch.setenv("JAX_FA4_CACHE_DIR", str(shipped_cache.root))
    call.clear_memory_cache()
    ks = jax.random.split(jax.random.key(1), 3)
    q, k, v = (jax.random.normal(kk, (2, 77, 4, 128), jnp.float32).astype(jnp.bfloat16)
               for kk in ks)

    def loss(q, k, v):
        out = jax_fa4.flash_attention(q, k, v, causal=True, implementation="sm90",
                                      deterministic=deterministic)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    exported = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=["cuda"],
                                 disabled_checks=jax_fa4.export_disabled_safety_checks())(q, k, v)
    calls = exported.mlir_module().count("stablehlo.custom_call @CuteDSLRT_NvJaxCutlassCall_v2")
    # forward + preprocess + sm90_bwd + sm90_bwd_postprocess
    assert calls == 4
    # the ordered-dQ kernel's counters: one int32 per (batch, head, 64-row query block)
    assert ("tensor<2x4x2xi32>" in exported.mlir_module()) == deterministic
    assert [a.shape for a in exported.out_avals] == [q.shape, k.shape, v.shape]
    call.clear_memory_cache()


def test_jvp_on_hopper_runs_the_forward_kernel_once(shipped_cache, monkeypatch):
    """jax.jvp through flash_attention(implementation="sm90"): the primal output is the forward
    kernel's (one custom call, the same kernel as jax.grad's forward) and the tangent is the
    reference's JVP (no backward kernel)."""
    from jax_fa4.ffi import call

    monkeypatch.setenv("JAX_FA4_CACHE_DIR", str(shipped_cache.root))
    call.clear_memory_cache()
    ks = jax.random.split(jax.random.key(1), 3)
    q, k, v = (jax.random.normal(kk, (2, 77, 4, 128), jnp.float32).astype(jnp.bfloat16)
               for kk in ks)

    def jvp(q, k, v, tq, tk, tv):
        return jax.jvp(lambda *x: jax_fa4.flash_attention(*x, causal=True,
                                                          implementation="sm90"),
                       (q, k, v), (tq, tk, tv))

    exported = jax.export.export(jax.jit(jvp), platforms=["cuda"],
                                 disabled_checks=jax_fa4.export_disabled_safety_checks())(
        q, k, v, q, k, v)
    assert exported.mlir_module().count(
        "stablehlo.custom_call @CuteDSLRT_NvJaxCutlassCall_v2") == 1
    assert [a.shape for a in exported.out_avals] == [q.shape, q.shape]
    call.clear_memory_cache()


def test_deterministic_backward_lowers_with_its_counters(cache_dir):
    """The ordered-dQ kernel's extra operand (int32 counters, aliased in place) goes through
    the JAX wrapper, the alias check and the CUDA lowering."""
    from typing import NamedTuple

    class Opts(NamedTuple):
        softmax_scale: float | None = None
        window: tuple = (None, 0)
        softcap: float = 0.0
        deterministic: bool = True

    b, sq, sk, h, d = 2, 300, 517, 4, 128
    args = backward_specs(b, sq, sk, h, d)
    f = jax.jit(lambda *a: backends.get("sm90").backward(*a, Opts()))
    exported = jax.export.export(f, platforms=["cuda"],
                                 disabled_checks=jax_fa4.export_disabled_safety_checks())(*args)
    text = exported.mlir_module()
    assert text.count("stablehlo.custom_call @CuteDSLRT_NvJaxCutlassCall_v2") == 2
    assert "tensor<2x4x5xi32>" in text  # one counter per query block: ceil(300 / 64) = 5
    assert [a.shape for a in exported.out_avals] == [(b, sq, h, d), (b, sk, h, d), (b, sk, h, d)]
    names = {e["kernel"] for e in KernelCache(cache_dir).entries()}
    assert names == {"sm90_bwd", "sm90_bwd_postprocess"}


def test_persistent_segments_forward_lowers_with_its_counter(cache_dir, monkeypatch):
    """The segment-id forward on the persistent grid with dynamic tiles
    (variants.persistent_segments, in no table row) through the backend's segments_forward: the
    call adds the zeroed tile counter after the segment tables (the backend's call_forward),
    aliased to an output, one custom call beside the tables' XLA ops."""
    from typing import NamedTuple

    from jax_fa4.kernels.sm90 import fwd_config
    from jax_fa4.tools.variants import persistent_segments

    class Opts(NamedTuple):
        softmax_scale: float | None = None
        window: tuple = (None, 0)
        softcap: float = 0.0

    table_config = fwd_config.segments_config
    monkeypatch.setattr(fwd_config, "segments_config",
                        lambda *a, **kw: persistent_segments(table_config(*a, **kw)))
    b, s, h, d = 2, 300, 4, 128
    bf = jnp.bfloat16
    args = (*(jax.ShapeDtypeStruct((b, s, h, d), bf) for _ in range(3)),
            jax.ShapeDtypeStruct((b, s), jnp.int32))
    f = jax.jit(lambda q, k, v, ids: backends.get("sm90").segments_forward(q, k, v, ids, ids,
                                                                           Opts()))
    exported = jax.export.export(f, platforms=["cuda"],
                                 disabled_checks=jax_fa4.export_disabled_safety_checks())(*args)
    text = exported.mlir_module()
    assert text.count("stablehlo.custom_call @CuteDSLRT_NvJaxCutlassCall_v2") == 1
    assert "tensor<1xi32>" in text and "output_operand_aliases" in text
    assert [a.shape for a in exported.out_avals] == [(b, s, h, d), (b, h, s)]
    entry, = KernelCache(cache_dir).entries()
    assert entry["config"]["num_sms"] == 132 and entry["config"]["segments"]


def test_dynamic_tiles_forward_lowers_with_its_counter(cache_dir):
    """The persistent forward with dynamic tiles gets one more operand, an int32 counter that
    XLA zero-fills for each call and the kernel updates in place (an input/output alias), through
    the backend's call, export and vmap; the same config with static tiles gets none."""
    from typing import NamedTuple

    from jax_fa4.kernels.sm90.fwd_config import FwdConfig

    class Opts(NamedTuple):
        softmax_scale: float | None = None
        window: tuple = (None, 0)
        softcap: float = 0.0

    b, sq, sk, h, d = 2, 300, 517, 4, 128
    bf = jnp.bfloat16
    args = (jax.ShapeDtypeStruct((b, sq, h, d), bf), jax.ShapeDtypeStruct((b, sk, h, d), bf),
            jax.ShapeDtypeStruct((b, sk, h, d), bf))
    static = FwdConfig.make("bfloat16", d, d, "causal", num_sms=132)
    texts = {}
    for cfg in (static, dataclasses.replace(static, dynamic_tiles=True)):
        f = jax.jit(lambda q, k, v, cfg=cfg: backends.get("sm90").kernel_forward(
            q, k, v, Opts(), config=cfg))
        exported = jax.export.export(f, platforms=["cuda"],
                                     disabled_checks=jax_fa4.export_disabled_safety_checks())(
            *args)
        assert [a.shape for a in exported.out_avals] == [(b, sq, h, d), (b, h, sq)]
        texts[cfg.dynamic_tiles] = exported.mlir_module()
    for dynamic, text in texts.items():
        assert text.count("stablehlo.custom_call @CuteDSLRT_NvJaxCutlassCall_v2") == 1
        assert ("tensor<1xi32>" in text) == dynamic
        assert ("output_operand_aliases" in text) == dynamic
    # vmap folds the mapped axis into the batch; the counter stays one int32
    f = jax.jit(jax.vmap(lambda q, k, v: backends.get("sm90").kernel_forward(
        q, k, v, Opts(), config=dataclasses.replace(static, dynamic_tiles=True))))
    stacked = [jax.ShapeDtypeStruct((3, *a.shape), a.dtype) for a in args]
    exported = jax.export.export(f, platforms=["cuda"],
                                 disabled_checks=jax_fa4.export_disabled_safety_checks())(
        *stacked)
    text = exported.mlir_module()
    assert text.count("CuteDSLRT_NvJaxCutlassCall_v2(") == 1 and "tensor<1xi32>" in text
    assert "tensor<6x300x4x128xbf16>" in text
    assert [a.shape for a in exported.out_avals] == [(3, b, sq, h, d), (3, b, h, sq)]
