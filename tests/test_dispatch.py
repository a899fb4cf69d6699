"""Implementation choice by GPU arch, with the device query faked (no GPU here)."""

from __future__ import annotations

import warnings

import pytest

from jax_fa4 import dispatch


@pytest.fixture
def capability(monkeypatch):
    def set_capability(cc):
        monkeypatch.setattr(dispatch, "gpu_compute_capability", lambda: cc)
    dispatch._warn_sm100_not_enabled.cache_clear()
    monkeypatch.delenv(dispatch.ENV_ENABLE_SM100, raising=False)
    return set_capability


@pytest.mark.parametrize("cc, expected", [(None, "reference"), ("9.0", "sm90"),
                                          ("8.0", "reference"), ("12.0", "reference")])
def test_default_follows_the_gpu(capability, cc, expected):
    capability(cc)
    assert dispatch.resolve_implementation(None) == expected


def test_blackwell_needs_opt_in_and_warns_once(capability, monkeypatch):
    capability("10.0")
    with pytest.warns(RuntimeWarning, match="JAX_FA4_ENABLE_SM100"):
        assert dispatch.resolve_implementation(None) == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call is silent
        assert dispatch.resolve_implementation(None) == "reference"
    monkeypatch.setenv(dispatch.ENV_ENABLE_SM100, "1")
    assert dispatch.resolve_implementation(None) == "sm100"
    assert dispatch.resolve_implementation("sm100") == "sm100"


@pytest.mark.parametrize("cc, forced", [("9.0", "sm100"), ("10.0", "sm90"), ("8.6", "sm90")])
def test_forcing_the_wrong_arch_says_why(capability, cc, forced):
    capability(cc)
    with pytest.raises(dispatch.ImplementationUnavailableError, match=f"has {cc}"):
        dispatch.resolve_implementation(forced)


def test_forcing_without_a_gpu_defers_to_lowering(capability):
    capability(None)
    assert dispatch.resolve_implementation("sm90") == "sm90"
    assert dispatch.resolve_implementation("reference") == "reference"
