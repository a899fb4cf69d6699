"""Every test in this folder needs a Hopper GPU.

With ``JAX_FA4_REQUIRE_GPU=1`` (the GPU machine's runs) a test must exercise the kernels it
names: a call that would run the pure-JAX reference on a kernel implementation
(``jax_fa4.backends.base.reference_fallback``) fails the test, unless the test is marked
``reference_fallback`` (it checks the fallback on purpose). A kernel missing from the cache
already fails (``KernelNotAvailableError``), and tests/conftest.py fails the run when no Hopper
GPU is there.
"""

import pytest

from conftest import require_gpu


def pytest_configure(config):
    config.addinivalue_line("markers", "reference_fallback: the test expects a kernel "
                                       "implementation to fall back to the reference")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/gpu/" in str(item.fspath):
            item.add_marker(pytest.mark.gpu)


def refuse_reference_fallback(what: str, implementation: str, reason: str) -> None:
    """``jax_fa4.backends.base.reference_fallback`` in a GPU test that must run kernels."""
    raise AssertionError(f"JAX_FA4_REQUIRE_GPU=1: the {what} of this call would run the pure-JAX "
                         f"reference instead of the {implementation} kernels ({reason}); mark "
                         "the test reference_fallback if that is its point")


@pytest.fixture(autouse=True)
def _no_silent_reference(request, monkeypatch):
    if require_gpu() and not request.node.get_closest_marker("reference_fallback"):
        from jax_fa4.backends import base

        monkeypatch.setattr(base, "reference_fallback", refuse_reference_fallback)
    yield
