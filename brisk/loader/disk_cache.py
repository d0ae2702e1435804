"""brisk's on-disk cache: what is slow to derive from a file and the same every time (the merges a
SentencePiece vocabulary implies). Entries are plain numpy arrays keyed by a hash of their inputs,
written atomically; a missing, unreadable or unwritable cache only costs the derivation again.

Where: $BRISK_CACHE_DIR, else $XDG_CACHE_HOME/brisk, else ~/.cache/brisk.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    if env := os.environ.get("BRISK_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "brisk"


def _path(kind: str, key: str) -> Path:
    return cache_dir() / kind / f"{key}.npy"


def load_array(kind: str, key: str) -> np.ndarray | None:
    """The array stored under (kind, key), or None (absent or unreadable: the caller derives it)."""
    path = _path(kind, key)
    try:
        return np.load(path, allow_pickle=False)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("ignoring the unreadable cache entry %s (%s); deriving it again", path, e)
        return None


def store_array(kind: str, key: str, value: np.ndarray) -> None:
    """Store `value` under (kind, key): written to a temporary file and renamed, so a reader never
    sees half an entry; a cache that cannot be written is skipped with a debug line."""
    path = _path(kind, key)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            np.save(f, value, allow_pickle=False)
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        log.debug("not caching %s: %s", path, e)
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
