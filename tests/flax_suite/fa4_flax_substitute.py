"""A pytest plugin that runs Flax's own attention tests on jax-fa4's Flax layers.

Loaded with ``-p fa4_flax_substitute`` by ``tests/test_flax_suite.py`` in a pytest of its own,
over test files taken from the installed Flax version's source distribution. Before any test
module is imported it puts jax-fa4's layers in place of Flax's (:data:`SUBSTITUTES`), so the
tests' ``nnx.MultiHeadAttention(...)``, ``nn.MultiHeadDotProductAttention(...)`` and
``nn.MultiHeadAttention(...)`` build ours. The tests that need what the layers refuse on purpose
(:data:`REFUSALS`: attention-probability dropout, ``sow_weights=True``) must raise our error with
our message: each is then reported as an expected failure (xfail), and as a failure if it
raises anything else or passes. With ``FA4_FLAX_SUITE_REPORT=<path>`` the plugin writes each
test's outcome and the number of calls of jax-fa4's attention it made to that JSON file.
"""

from __future__ import annotations

import functools
import json
import os
import re
from typing import Any

import pytest

#: (Flax module, attribute) -> name of the replacement in jax_fa4.flax.
SUBSTITUTES = {
    ("flax.nnx", "MultiHeadAttention"): "MultiHeadAttention",
    ("flax.linen", "MultiHeadDotProductAttention"): "LinenMultiHeadAttention",
    ("flax.linen", "MultiHeadAttention"): "LinenMultiHeadAttentionAlias",
}

_SOW = (ValueError, r"^sow_weights=True needs the attention weights, which FlashAttention never "
                    r"materialises")
_DROPOUT = (NotImplementedError, r"^jax_fa4 attention has no attention-probability dropout")

#: The documented refusals: (test file name, test class, test name) -> (error, message regex).
REFUSALS: dict[tuple[str, str, str], tuple[type[Exception], str]] = {
    ("attention_test.py", "TestMultiHeadAttention", "test_multihead_sow_attention_weights"): _SOW,
    ("linen_attention_test.py", "AttentionTest", "test_multihead_sow_attention_weights"): _SOW,
    ("linen_attention_test.py", "AttentionTest", "test_mixed_precision_multihead_attention0"):
        _SOW,
    ("linen_attention_test.py", "AttentionTest", "test_mixed_precision_multihead_attention1"):
        _SOW,
    ("linen_attention_test.py", "AttentionTest", "test_multihead_self_attention_w_dropout"):
        _DROPOUT,
    ("linen_attention_test.py", "AttentionTest",
     "test_multihead_self_attention_explicit_dropout"): _DROPOUT,
}

_calls: dict[str, int] = {}  # node id -> calls of jax-fa4's attention
_outcomes: dict[str, str] = {}  # node id -> passed / failed / xfailed / skipped
_current: list[str] = []  # the node id of the test running


def refusal_key(item: pytest.Item) -> tuple[str, str, str]:
    """The :data:`REFUSALS` key of a collected test."""
    return (item.path.name, item.cls.__name__ if item.cls else "", item.name)


def pytest_configure(config: pytest.Config) -> None:
    import importlib

    import jax_fa4.flax as fa4_flax

    for (module_name, attr), ours in SUBSTITUTES.items():
        module = importlib.import_module(module_name)
        if not hasattr(module, attr):
            raise pytest.UsageError(f"{module_name} has no {attr} to replace: update "
                                    f"{__file__}'s SUBSTITUTES")
        setattr(module, attr, getattr(fa4_flax, ours))
    call = fa4_flax.AttentionFn.__call__

    @functools.wraps(call)
    def counted(self, *args: Any, **kwargs: Any):
        if _current:
            _calls[_current[0]] = _calls.get(_current[0], 0) + 1
        return call(self, *args, **kwargs)

    fa4_flax.AttentionFn.__call__ = counted


def _expect_refusal(test, error: type[Exception], pattern: str):
    """``test`` (a unittest method) must raise ``error`` matching ``pattern``: then xfail."""

    @functools.wraps(test)
    def run(self):
        try:
            test(self)
        except error as e:
            if re.search(pattern, str(e)):
                pytest.xfail(f"documented refusal: {type(e).__name__}: {e}")
            raise
        pytest.fail(f"expected jax_fa4's refusal {error.__name__} matching {pattern!r}, but the "
                    "test passed: remove it from REFUSALS if the layer now supports this")

    return run


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        expected = REFUSALS.get(refusal_key(item))
        if expected is not None:
            setattr(item.cls, item.name, _expect_refusal(getattr(item.cls, item.name),
                                                         *expected))
            item.obj = getattr(item.instance, item.name)  # collection bound the original


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    _current[:] = [item.nodeid]
    try:
        return (yield)
    finally:
        _current.clear()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        outcome = "failed"
    elif hasattr(report, "wasxfail"):
        outcome = "xfailed"
    elif report.skipped:
        outcome = "skipped"
    elif report.when == "call":
        outcome = "passed"
    else:
        return
    if _outcomes.get(report.nodeid) != "failed":
        _outcomes[report.nodeid] = outcome


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get("FA4_FLAX_SUITE_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump({"outcomes": _outcomes, "attention_calls": _calls}, f, indent=1)
