"""Backend choice by GPU arch (jax_fa4.backends.select), with the device query faked (no GPU
here)."""

from __future__ import annotations

import warnings

import pytest

from jax_fa4 import backends
from jax_fa4.backends.sm100 import ENABLE_ENV


@pytest.fixture
def capability(monkeypatch):
    def set_capability(cc):
        monkeypatch.setattr(backends, "gpu_compute_capability", lambda: cc)
    backends._warn_not_enabled.cache_clear()
    monkeypatch.delenv(ENABLE_ENV, raising=False)
    return set_capability


@pytest.mark.parametrize("cc, expected", [(None, "reference"), ("9.0", "sm90"),
                                          ("8.0", "reference"), ("12.0", "reference")])
def test_default_follows_the_gpu(capability, cc, expected):
    capability(cc)
    assert backends.select(None) == expected


def test_blackwell_needs_opt_in_and_warns_once(capability, monkeypatch):
    capability("10.0")
    with pytest.warns(RuntimeWarning, match="JAX_FA4_ENABLE_SM100"):
        assert backends.select(None) == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call is silent
        assert backends.select(None) == "reference"
    monkeypatch.setenv(ENABLE_ENV, "1")
    assert backends.select(None) == "sm100"
    assert backends.select("sm100") == "sm100"


@pytest.mark.parametrize("cc, forced", [("9.0", "sm100"), ("10.0", "sm90"), ("8.6", "sm90")])
def test_forcing_the_wrong_arch_says_why(capability, cc, forced):
    capability(cc)
    with pytest.raises(backends.ImplementationUnavailableError, match=f"has {cc}"):
        backends.select(forced)


def test_forcing_without_a_gpu_defers_to_lowering(capability):
    capability(None)
    assert backends.select("sm90") == "sm90"
    assert backends.select("reference") == "reference"
