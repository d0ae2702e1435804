"""Sampling: logit processors, the batched sampler and logprobs (see sampler.py for the stage order)."""

from brisk.sample.logprobs import TokenLogprobs, prompt_logprobs
from brisk.sample.sampler import SamplerOutput, SamplingBatch, sample

__all__ = ["SamplerOutput", "SamplingBatch", "TokenLogprobs", "prompt_logprobs", "sample"]
