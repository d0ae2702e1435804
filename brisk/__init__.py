"""brisk: a fast, exact-attention LLM inference and serving engine on PyTorch."""

from brisk.engine.llm import LLM
from brisk.engine.outputs import CompletionOutput, RequestOutput
from brisk.request import FinishReason, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "FinishReason", "__version__"]
