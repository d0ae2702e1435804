"""loader/disk_cache.py and what uses it: the merges a SentencePiece vocabulary implies, derived
once and read back (the same merges), a damaged or foreign entry derived again, an unwritable
cache only skipped."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from brisk.loader import disk_cache, tokenizer


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BRISK_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


VOCAB = {t: i for i, t in enumerate(["a", "b", "c", "ab", "bc", "abc", "ca", "cab", "▁", "▁a"])}
SCORES = {t: -float(i) for t, i in VOCAB.items()}


def test_arrays_round_trip_and_missing_is_none(_cache: Path) -> None:
    assert disk_cache.cache_dir() == _cache
    assert disk_cache.load_array("k", "x") is None
    disk_cache.store_array("k", "x", np.arange(6, dtype=np.int32).reshape(3, 2))
    assert np.array_equal(disk_cache.load_array("k", "x"), np.arange(6).reshape(3, 2))
    assert [p.name for p in (_cache / "k").iterdir()] == ["x.npy"]  # no temporary left behind


def test_derived_merges_are_cached_and_read_back(monkeypatch: pytest.MonkeyPatch, _cache: Path) -> None:
    first = tokenizer._derived_merges(VOCAB, SCORES)
    assert first == tokenizer._derive_merges(VOCAB, SCORES) and ("a", "b") in first
    (entry,) = (_cache / "merges").iterdir()

    def fail(*_: object) -> None:
        raise AssertionError("derived again although cached")

    monkeypatch.setattr(tokenizer, "_derive_merges", fail)
    assert tokenizer._derived_merges(VOCAB, SCORES) == first
    # another ranking of the same vocabulary is another entry
    monkeypatch.undo()
    monkeypatch.setenv("BRISK_CACHE_DIR", str(_cache))
    other = tokenizer._derived_merges(VOCAB, None)
    assert other == tokenizer._derive_merges(VOCAB, None) and len(list((_cache / "merges").iterdir())) == 2
    assert entry.exists()


@pytest.mark.parametrize("damage", [b"not an npy file", "foreign"])
def test_a_damaged_or_foreign_entry_is_derived_again(_cache: Path, damage: object) -> None:
    tokenizer._derived_merges(VOCAB, SCORES)
    (entry,) = (_cache / "merges").iterdir()
    if isinstance(damage, bytes):
        entry.write_bytes(damage)
    else:  # ids past this vocabulary
        np.save(entry, np.array([[0, 99]], dtype=np.int32))
    assert tokenizer._derived_merges(VOCAB, SCORES) == tokenizer._derive_merges(VOCAB, SCORES)
    assert np.load(entry).shape == (len(tokenizer._derive_merges(VOCAB, SCORES)), 2)  # rewritten


def test_an_unwritable_cache_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache directory would be")
    monkeypatch.setenv("BRISK_CACHE_DIR", str(blocker))
    assert tokenizer._derived_merges(VOCAB, SCORES) == tokenizer._derive_merges(VOCAB, SCORES)
