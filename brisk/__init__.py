"""brisk: a fast, exact-attention LLM inference and serving engine on PyTorch.

The public names are imported lazily, so `import brisk.core` (which has no torch) stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "FinishReason", "__version__"]

_LAZY = {
    "LLM": "brisk.engine.llm",
    "RequestOutput": "brisk.engine.outputs",
    "CompletionOutput": "brisk.engine.outputs",
    "SamplingParams": "brisk.request",
    "FinishReason": "brisk.request",
}

if TYPE_CHECKING:
    from brisk.engine.llm import LLM
    from brisk.engine.outputs import CompletionOutput, RequestOutput
    from brisk.request import FinishReason, SamplingParams


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'brisk' has no attribute {name!r}")
