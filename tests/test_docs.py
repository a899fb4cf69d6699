"""The repository's documents: every link and every path they cite exists in the checkout, and
they describe the code, not the history of its making (which git and the result files keep)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# a path into the checkout's top folders, as docs write it (also package-relative in
# ARCHITECTURE.md: `backends/sm90.py`); `<...>` marks a placeholder, `*` a glob
_PATH = re.compile(r"(?<![\w/.<>-])((?:benchmarks|docs|jax_fa4|tests|tools|examples|backends|"
                   r"kernels|ffi|parallel)/[\w./*<>-]*[\w*>])")
_DIARY = re.compile(r"\b(sessions?|lent|lending|device.minutes)\b", re.IGNORECASE)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _exists(target: str, doc: Path = ROOT / "README.md") -> bool:
    """``target`` relative to the checkout, the package or the citing document; a module's
    attribute (``ffi/sources.TUNING_MODULES``) counts as its module."""
    bases = (ROOT, ROOT / "jax_fa4", doc.parent)
    if "*" in target:
        return any(any(base.glob(target)) for base in bases)
    module = re.sub(r"\.[A-Za-z_]\w*$", ".py", target)
    return any((base / t).exists() for base in bases for t in (target, module))


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_links_and_cited_paths_exist(doc):
    text = doc.read_text()
    missing = [f"link {t}" for t in _LINK.findall(text)
               if not re.match(r"[a-z]+:", t) and not (doc.parent / t).exists()]
    missing += [f"path {t}" for t in (m.rstrip(".") for m in _PATH.findall(text))
                if "<" not in t and not _exists(t, doc)]
    assert not missing, f"{_rel(doc)} cites what the checkout does not hold: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_docs_describe_the_code_not_its_history(doc):
    found = [line.strip() for line in doc.read_text().splitlines() if _DIARY.search(line)]
    assert not found, f"{_rel(doc)}: {found}"


def test_the_checks_see_a_missing_path_and_a_diary_line(tmp_path):
    """The two checks above, on a document that breaks each rule."""
    text = "See [the notes](docs/NOTES.md), `benchmarks/results/gone.json`; session 3 found it."
    assert _LINK.findall(text) == ["docs/NOTES.md"]
    assert not _exists(_PATH.findall(text)[1]) and _DIARY.search(text)
