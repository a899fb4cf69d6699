"""The multi-GPU run (``benchmarks/multi_gpu.py``, ``jax_fa4.tools.multi_gpu``): its checks, ring
scaling and report on 4 simulated CPU devices (the reference implementation runs), and the pieces
that decide pass or fail and the scaling figures.

The script's GPU runs (issue #25) need a machine of several GPUs; here it must run end to end,
record what it measured, and fail a wrong result.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from jax_fa4.tools import multi_gpu
from test_sharding import multidevice_suite


@pytest.fixture(scope="module")
def smoke():
    result = multidevice_suite("multi_gpu")["checks_and_ring"]
    assert "error" not in result, result.get("traceback", result.get("error"))
    return result


def test_smoke_run_passes_its_checks_and_records_them(smoke):
    report = smoke["report"]
    assert smoke["status"] == 0
    assert report["device_count"] == 4 and report["platform"] == "cpu"
    assert report["command"] and report["versions"]["jax"] and report["date"]
    assert set(report["checks"]) == {"sharded_batch_heads_causal", "ring_causal_zigzag"}
    for name, check in report["checks"].items():
        assert check["passed"], (name, check)
        # FA4's rule on the outputs and every gradient, with a real bound
        assert set(check["errors"]) == {"out", "lse", "dq", "dk", "dv"}, name
        assert all(0 < e["bound"] and e["err"] <= e["bound"] for e in check["errors"].values())
    sharded = report["checks"]["sharded_batch_heads_causal"]
    assert sharded["mesh"] == {"data": 2, "model": 2} and sharded["gathered"] == []
    assert set(sharded["rel_diff_vs_one_gpu"]) == {"out", "dq", "dk", "dv"}
    assert all(x <= 1e-2 for x in sharded["rel_diff_vs_one_gpu"].values())
    ring = report["checks"]["ring_causal_zigzag"]
    assert ring["collectives"].get("collective-permute", 0) > 0, ring["collectives"]
    # the ring against one GPU's kernels as FA4's baseline runs on GPUs only
    assert ring["errors_vs_one_gpu"] == {}


def test_smoke_run_measures_ring_scaling(smoke):
    rows = smoke["report"]["ring"]
    assert [(r["seq"], r["causal"]) for r in rows] == [(256, True)]  # --masks causal
    for r in rows:
        assert "error" not in r, r
        assert r["devices"] == 4 and r["shape"]["local"] == 64
        assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0
        assert r["fwd_efficiency"] > 0 and r["fwd_bwd_kernel_share"] > 0
        # the unmasked block (the efficiency's denominator) and the zig-zag's three calls
        assert set(r["block"]) == {"block", "diagonal", "earlier", "later"}
        assert len(r["peak_bytes_per_device"]) == 4


def test_compare_fails_a_wrong_result():
    ref = {"out": jnp.linspace(-1.0, 1.0, 64, dtype=jnp.float32)}
    pt = {"out": ref["out"].astype(jnp.bfloat16).astype(jnp.float32)}
    assert multi_gpu.compare(pt, ref, pt)["out"]["passed"]
    wrong = {"out": pt["out"].at[7].add(0.05)}
    errors = multi_gpu.compare(wrong, ref, pt)["out"]
    assert not errors["passed"] and errors["err"] > errors["bound"]
    nan = {"out": pt["out"].at[3].set(jnp.nan)}
    assert not multi_gpu.compare(nan, ref, pt)["out"]["passed"]


def test_ideal_ring_time_takes_the_slowest_device():
    blocks = {"block": {"fwd_ms": 4.0}, "diagonal": {"fwd_ms": 2.5},
              "earlier": {"fwd_ms": 2.0}, "later": {"fwd_ms": 2.2}}
    assert multi_gpu.ideal_ms(blocks, 8, False, "fwd_ms") == 32.0
    # step 0 (the causal diagonal), then 7 half blocks, every one as slow as the slower kind
    assert np.isclose(multi_gpu.ideal_ms(blocks, 8, True, "fwd_ms"), 2.5 + 7 * 2.2)


def test_child_processes_see_the_first_devices(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4 --xla_foo=1")
    env = multi_gpu.child_env(2)
    assert env["XLA_FLAGS"].split() == ["--xla_foo=1", "--xla_force_host_platform_device_count=2"]
    assert env["PYTHONPATH"].split(":")[0] == str(multi_gpu.ROOT)


def test_check_cases_follow_the_device_count():
    devices = [object()] * 4
    assert "sharded_batch_heads_full" in multi_gpu.check_cases(devices, multi_gpu.SMOKE)
    two = multi_gpu.check_cases(devices[:2], multi_gpu.SMOKE)
    assert "sharded_batch_heads_full" not in two and "gpt_mesh_data_x_heads" in two
    assert "gpt_mesh_data_x_heads" not in multi_gpu.check_cases(devices[:1], multi_gpu.SMOKE)
    assert multi_gpu.scaling_seqs(multi_gpu.FULL, 4) == (32768, 131072)
    assert multi_gpu.scaling_seqs(multi_gpu.FULL, 8)[-1] == 1 << 20


def test_readme_section_matches_the_newest_result():
    assert multi_gpu.main(["--check-readme"]) == 0


def test_readme_section_follows_the_result(tmp_path):
    report = json.loads(multi_gpu.newest_report().read_text())
    report["train"] = [dict(report["train"][0], devices=8, tokens_per_s=4_000_000,
                            scaling=0.85)] if report["train"] else report["train"]
    report["checks"]["ring_full"] = {"passed": False, "error": "boom"}
    text = multi_gpu.readme_section(report, "x.json")
    assert "failed: ring_full" in text
    if report["train"]:
        assert "| 8 | 1x1 | 64 | 4,000,000 | 0.85 |" in text


def test_bad_arguments_are_refused_by_name(capsys):
    for argv, word in ((["--masks", "diagonal"], "--masks"),
                       (["--parts", "ring,speed"], "--parts")):
        with pytest.raises(SystemExit):
            multi_gpu.parse_args(argv)
        assert word in capsys.readouterr().err
    assert multi_gpu.parse_args(["--masks", "causal"]).causal == [True]
    assert multi_gpu.parse_args([]).causal == [False, True]
