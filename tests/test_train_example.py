"""examples/train_gpt.py: a few tiny CPU steps train (loss falls), alone and sharded, on
contiguous and on packed rows (``--pack``: segment ids).

Both runs go to the 4-device checks process (``tests/multidevice_checks.py``, suite
``train_example``: the script's ``main`` with ``--log-json``), one after the other in one test,
so that the run both checks read is made once.
"""

from __future__ import annotations

import numpy as np
import pytest

from test_sharding import multidevice_suite


def test_tiny_run_trains_and_a_mesh_run_matches_it():
    runs = multidevice_suite("train_example")
    single = runs["single"]
    assert "error" not in single, single.get("traceback")
    losses = np.array(single["losses"])
    assert len(losses) == 20 and np.all(np.isfinite(losses))
    assert losses[0] == pytest.approx(np.log(256), abs=0.6)  # starts near uniform over bytes
    assert losses[-5:].mean() < losses[:5].mean() - 1.0, losses
    assert single["implementation"] == "reference" and single["tokens_per_s"] > 0
    assert single["mesh"] is None

    # 2-way data x 2-way heads on 4 simulated devices: same seed, same losses.
    sharded = runs["mesh"]
    assert "error" not in sharded, sharded.get("traceback")
    assert sharded["mesh"] == {"data": 2, "model": 2}
    np.testing.assert_allclose(sharded["losses"], single["losses"], rtol=2e-4)


def test_packed_rows_train_alone_and_sharded():
    """--pack: rows packed with documents, segment ids to the attention, positions restarting
    per document; the loss falls, and 2-way data x 2-way heads gives the same losses (the ids
    follow the batch sharding)."""
    runs = multidevice_suite("train_example")
    single = runs["pack"]
    assert "error" not in single, single.get("traceback")
    assert single["packed"] is True
    losses = np.array(single["losses"])
    assert len(losses) == 20 and np.all(np.isfinite(losses))
    assert losses[-5:].mean() < losses[:5].mean() - 1.0, losses
    sharded = runs["pack_mesh"]
    assert "error" not in sharded, sharded.get("traceback")
    assert sharded["mesh"] == {"data": 2, "model": 2} and sharded["packed"] is True
    np.testing.assert_allclose(sharded["losses"], single["losses"], rtol=2e-4)
