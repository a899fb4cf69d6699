"""examples/train_gpt.py: a few tiny CPU steps train (loss falls), alone and sharded."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_gpt.py"


def train(tmp_path, *args: str, devices: int = 1) -> dict:
    log = tmp_path / f"run-{len(list(tmp_path.iterdir()))}.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = [f for f in env.get("XLA_FLAGS", "").split()  # keep tests/conftest.py's settings
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--no-progress",
                           "--log-json", str(log), *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(log.read_text())


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return train(tmp_path_factory.mktemp("single"), "--steps", "20", "--seed", "0")


def test_tiny_run_trains(single):
    losses = np.array(single["losses"])
    assert len(losses) == 20 and np.all(np.isfinite(losses))
    assert losses[0] == pytest.approx(np.log(256), abs=0.6)  # starts near uniform over bytes
    assert losses[-5:].mean() < losses[:5].mean() - 1.0, losses
    assert single["implementation"] == "reference" and single["tokens_per_s"] > 0


def test_mesh_run_matches_single_device(single, tmp_path):
    # 2-way data x 2-way heads on 4 simulated devices: same seed, same losses.
    sharded = train(tmp_path, "--steps", "20", "--seed", "0", "--mesh", "2x2", devices=4)
    assert sharded["mesh"] == {"data": 2, "model": 2}
    np.testing.assert_allclose(sharded["losses"], single["losses"], rtol=2e-4)
