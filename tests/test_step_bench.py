"""The whole-step benchmark (``jax_fa4.tools.step_bench``) end to end on tiny CPU configs."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import pytest

from jax_fa4.tools import step_bench
from test_bench import two_input_sets  # noqa: F401  (a fixture)

ENTRY_KEYS = {"config", "B", "S", "d_model", "H", "Hkv", "D", "layers", "vocab", "packed",
              "mlp_hidden", "tokens_per_step", "impls", "skipped", "documents", "params",
              "round_orders", "baseline", "wall_s"}
IMPL_KEYS = {"compile_s", "loss_step0", "qkv_grad_norms_step0", "hlo_counts", "step_ms",
             "step_spread", "step_rounds_ms", "tokens_per_s"}
ATTN_KEYS = {"attn_train_fwd_ms", "attn_fwdbwd_ms", "attn_bwd_ms", "attention_share_of_step"}


@pytest.mark.usefixtures("two_input_sets")
def test_smoke_run_writes_the_result_and_both_models_agree(tmp_path: Path) -> None:
    out = tmp_path / "step.json"
    hlo = tmp_path / "hlo"
    prof = tmp_path / "profile"
    assert step_bench.main(["--smoke", "--layers", "1", "--rounds", "1", "--steps", "1",
                            "--warmup", "0", "--attn-target-ms", "1", "--hlo", str(hlo),
                            "--profile", str(prof), "--profile-steps", "2", "--profile-warmup", "1",
                            "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["complete"] and report["settings"]["impls"] == ["jax-fa4", "xla"]
    assert {"gpu", "versions", "gpu_state", "command", "date", "timing"} <= set(report)
    dense, packed = report["configs"]
    assert ENTRY_KEYS <= set(dense) and ENTRY_KEYS <= set(packed)
    for impl in ("jax-fa4", "xla"):
        assert IMPL_KEYS | ATTN_KEYS <= set(dense["impls"][impl])
        assert dense["impls"][impl]["step_ms"] > 0
        assert (hlo / f"smoke-{impl}.hlo.txt").read_text().startswith("HloModule")
    # Timed rounds: rounded up to every implementation opening one, after an untimed round.
    assert dense["round_orders"] == [["jax-fa4", "xla"], ["xla", "jax-fa4"], ["jax-fa4", "xla"]]
    assert dense["baseline"] == "xla" and dense["step_speedup"] > 0
    check = dense["check"]
    assert check["agree"], check
    assert check["loss_rel_diff"] <= step_bench.LOSS_RTOL
    assert check["qkv_grad_norm_rel_diff"] <= step_bench.GRAD_RTOL
    # Packed rows: ours only, the baseline's reason recorded; documents of S/16..S/2 tokens.
    assert set(packed["impls"]) == {"jax-fa4"} and "segment ids" in packed["skipped"]["xla"]
    assert all(sum(row) == packed["S"] for row in packed["documents"])
    assert all(n <= packed["S"] // 2 for row in packed["documents"] for n in row)
    assert "step_speedup" not in packed
    # --profile: each step traced and read (on the CPU the XLA runtime's thunks are the kernels),
    # ours against the baseline side by side; packed rows: ours alone, no comparison.
    for impl in ("jax-fa4", "xla"):
        p = dense["impls"][impl]["profile"]
        assert p["source"] == "host thunks" and p["steps"] == 2 and p["kernels_per_step"] > 0
        step = p["step_us"]
        assert 0 < step["busy_us"] <= step["span_us"]
        assert step["idle_us"] == pytest.approx(step["span_us"] - step["busy_us"])
        assert step["attention_us"] == 0  # no attention kernel on the CPU: XLA fusions
        assert step["around_attention_us"] == pytest.approx(step["span_us"])
        assert p["per_layer_us"]["span_us"] == pytest.approx(step["span_us"])  # one layer
        assert sum(g["count"] for g in p["groups"].values()) == pytest.approx(
            p["kernels_per_step"])
        assert p["hlo"]["module"] == "jit_step"
        kernels = json.loads((prof / "smoke" / impl / "step-kernels.json").read_text())
        assert len(kernels) == p["kernels_per_step"]
        assert list((prof / "smoke" / impl).rglob("*.xplane.pb"))
    cmp = dense["profile"]
    assert cmp["step_us"]["span_us"]["diff"] == pytest.approx(
        dense["impls"]["jax-fa4"]["profile"]["step_us"]["span_us"]
        - dense["impls"]["xla"]["profile"]["step_us"]["span_us"])
    assert "profile" in packed["impls"]["jax-fa4"] and "profile" not in packed
    tables = (prof / "profile.md").read_text()
    assert tables == dense["profile_table"] and tables.startswith("### smoke: jax-fa4 vs xla")


def test_the_first_step_check_sees_a_different_attention(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The agreement check can fail: a baseline without the causal mask disagrees."""
    real = step_bench.attention_fn

    def patched(impl: str, implementation: str | None = None) -> step_bench.AttentionFn:
        if impl != "xla":
            return real(impl, implementation)
        return lambda q, k, v, ids: jax.nn.dot_product_attention(q, k, v, implementation="xla")

    monkeypatch.setattr(step_bench, "attention_fn", patched)
    out = tmp_path / "step.json"
    assert step_bench.main(["--smoke", "--configs", "smoke", "--layers", "1", "--rounds", "1",
                            "--steps", "1", "--warmup", "0", "--no-attention",
                            "--out", str(out)]) == 0
    check = json.loads(out.read_text())["configs"][0]["check"]
    assert not check["agree"], check
    assert check["qkv_grad_norm_rel_diff"] > step_bench.GRAD_RTOL


def test_precompile_exports_each_step_with_the_kernels_forced(monkeypatch) -> None:
    """--precompile exports every config's step for CUDA with the Hopper kernels forced: its
    lowering asks the kernel cache for the forward, preprocess, backward and postprocess of
    each layer (stubbed here: no kernel is compiled), segment-id kernels for packed rows."""
    from jax_fa4.ffi import call

    asked = []

    def kernel_object(config, arch, cache=None):
        asked.append((config.kernel_name, arch, getattr(config, "segments", False)))
        return b"stub"

    monkeypatch.setattr(call, "kernel_object", kernel_object)
    monkeypatch.setattr(call, "register_ffi_targets", lambda: None)
    import dataclasses

    # (head dim 64: the kernels' smallest; shapes stay abstract, nothing is allocated)
    configs = [dataclasses.replace(step_bench.SMOKE_CONFIGS[n], D=64)
               for n in ("smoke", "smoke-packed")]
    calls = step_bench.precompile(configs)
    layers = sum(c.layers for c in configs)
    assert calls == 4 * layers, (calls, asked)
    assert {arch for _, arch, _ in asked} == {"sm_90a"}
    kinds = {name for name, _, _ in asked}
    assert {"sm90_fwd", "sm90_bwd"} <= kinds, kinds
    assert any(segments for _, _, segments in asked)  # the packed config's kernels
    asked.clear()
    assert step_bench.main(["--precompile", "--configs", "b8s2k-16-4-d128", "--layers", "1"]) == 0
    assert len(asked) == 4, asked


def test_a_step_that_fails_to_compile_fails_the_run(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A config whose step cannot be built is recorded and makes the exit status 1."""
    def broken(impl: str, implementation: str | None = None) -> step_bench.AttentionFn:
        def attention(q, k, v, ids):
            raise RuntimeError("no attention here")
        return attention

    monkeypatch.setattr(step_bench, "attention_fn", broken)
    out = tmp_path / "step.json"
    assert step_bench.main(["--smoke", "--configs", "smoke", "--layers", "1", "--rounds", "1",
                            "--steps", "1", "--warmup", "0", "--no-attention",
                            "--out", str(out)]) == 1
    entry = json.loads(out.read_text())["configs"][0]
    assert "no attention here" in json.dumps(entry)
