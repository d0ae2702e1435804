"""A tiny random model behind the whole engine, and proposers that are right or wrong on purpose."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from brisk.config import CacheConfig, ModelConfig, SchedulerConfig, SpecConfig
from brisk.engine.llm_engine import LLMEngine
from brisk.engine.speculative import Speculator
from brisk.loader.tokenizer import Tokenizer
from brisk.model.llama import LlamaForCausalLM
from brisk.speculative.base import Draft, DraftRequest, Proposer

VOCAB = 16
CFG = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def tiny_model(seed: int = 0, scale: float = 0.5) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(CFG, max_positions=256)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, scale)
    return model.eval()


def tiny_tokenizer() -> Tokenizer:
    backend = Backend(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w1"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend, bos_token_id=None, eos_token_id=0, add_bos=False, chat_template=None)


def tiny_engine(model: LlamaForCausalLM, spec: SpecConfig | None = None, blocks: int = 64,
                budget: int = 32, seqs: int = 8, caching: bool = True) -> LLMEngine:
    return LLMEngine(model, tiny_tokenizer(), CacheConfig(block_size=4, num_kv_blocks=blocks,
                                                           enable_prefix_caching=caching),
                     SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs, max_model_len=128),
                     speculative=spec)


class FixedProposer(Proposer):
    """Drafts drawn from a fixed distribution `q` over the vocabulary, whatever the context: a
    deliberately wrong draft. With `point_mass`, the draws are handed over as deterministic."""

    name = "fixed"
    draft_cost = 0.0

    def __init__(self, q: torch.Tensor, point_mass: bool = False, seed: int = 0) -> None:
        self.q = q
        self.point_mass = point_mass
        self.gen = torch.Generator().manual_seed(seed)
        self.released: list[str] = []

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        out = []
        for r in requests:
            tokens = torch.multinomial(self.q, r.num_drafts, replacement=True, generator=self.gen).tolist()
            out.append(Draft(tokens, None if self.point_mass else self.q.expand(len(tokens), -1).clone()))
        return out

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


class OracleProposer(Proposer):
    """Drafts the known greedy continuation of each request (from a plain run): always right."""

    name = "oracle"
    draft_cost = 0.0

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], wrong: bool = False) -> None:
        self.continuations = continuations  # prompt -> its greedy output
        self.wrong = wrong  # propose a token off by one instead: never accepted

    def _token(self, t: int) -> int:
        return (t + 1) % VOCAB if self.wrong else t

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        out = []
        for r in requests:
            for prompt, cont in self.continuations.items():
                if tuple(r.token_ids[:len(prompt)]) == prompt:
                    done = len(r.token_ids) - len(prompt)
                    out.append(Draft([self._token(t) for t in cont[done:done + r.num_drafts]]))
                    break
        return out

    def release(self, request_id: str) -> None:
        pass


def with_proposer(engine: LLMEngine, proposer: object, k: int | str = 3) -> LLMEngine:
    """Swap a test proposer into an engine's speculator; costs fixed (not timed) so that draft
    lengths under "auto" depend on the seeded sampler alone."""
    engine.spec = Speculator(SpecConfig(method="ngram", num_speculative_tokens=k), proposer,  # type: ignore[arg-type]
                             measure_costs=False)
    return engine


def run(engine: LLMEngine, prompts: list[list[int]], params: object) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)  # type: ignore[arg-type]
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
        engine.scheduler.check_invariants()
    return out
