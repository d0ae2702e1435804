"""Pure-decode steps at static shapes (runtime/decode_graphs.py): the same logits and the same greedy
tokens as the ordinary step, on the CPU without capture and on CUDA as replayed graphs; padding rows
touch no block a request owns; steps the graphs cannot serve run eagerly."""

from __future__ import annotations

import random

import pytest
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from brisk.config import CacheConfig, ModelConfig, SchedulerConfig
from brisk.engine.llm_engine import LLMEngine
from brisk.loader.tokenizer import Tokenizer
from brisk.model.base import CausalLM
from brisk.model.gemma3 import Gemma3ForCausalLM
from brisk.model.llama import LlamaForCausalLM
from brisk.request import SamplingParams
from brisk.runtime.decode_graphs import MIN_WIDTH, bucket
from brisk.runtime.paged_runner import PagedModelRunner
from tests.runtime.test_paged_runner import Step

LLAMA = ModelConfig(vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256)
# sliding and full layers: two KV groups, sliding tables with NO_BLOCK before the window
GEMMA = ModelConfig(architecture="gemma3", vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                    layer_types=("sliding", "full", "sliding"), sliding_window=8, qk_norm=True,
                    query_pre_attn_scalar=16, rope_local_theta=10000.0, hidden_act="gelu_tanh",
                    tie_word_embeddings=True)
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


def _model(cfg: ModelConfig, device: str) -> CausalLM:
    torch.manual_seed(0)
    cls = Gemma3ForCausalLM if cfg.architecture == "gemma3" else LlamaForCausalLM
    m = cls(cfg, max_positions=256)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m.to(device).eval()


def _engine(model: CausalLM, graphs: bool) -> LLMEngine:
    backend = Backend(models.WordLevel({"w0": 0, "w1": 1}, unk_token="w1"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = Tokenizer(backend, bos_token_id=None, eos_token_id=0, add_bos=False, chat_template=None)
    engine = LLMEngine(model, tok, CacheConfig(block_size=4, num_kv_blocks=96),
                       SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=256))
    old = engine.runner
    assert isinstance(old, PagedModelRunner)
    # the same runner with graphs on or off (on the CPU they default to off)
    engine.runner = PagedModelRunner(model, old.num_blocks, old.block_size, groups=old.groups, graphs=graphs)
    return engine


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg", [LLAMA, GEMMA], ids=["llama", "gemma3-sliding"])
def test_graph_decode_gives_the_eager_engines_greedy_tokens(cfg: ModelConfig, device: str) -> None:
    """Five requests of different lengths (batch bucket 8, then fewer as they finish; tables
    crossing width buckets 16 -> 32 blocks): token for token the eager engine's."""
    model = _model(cfg, device)
    rng = random.Random(1)
    prompts = [[rng.randrange(2, cfg.vocab_size) for _ in range(n)] for n in (3, 17, 30, 9, 50)]
    lengths = {f"r{i}": 40 + 6 * i for i in range(len(prompts))}
    eager, graphed = _engine(model, False), _engine(model, True)
    for i, p in enumerate(prompts):  # different max_tokens: the batch shrinks as requests end
        for e in (eager, graphed):
            e.add_request(f"r{i}", p, SamplingParams(max_tokens=lengths[f"r{i}"], temperature=0.0, ignore_eos=True))
    results = []
    for e in (eager, graphed):
        out: dict[str, list[int]] = {}
        while e.has_unfinished_requests():
            for o in e.step():
                out[o.request_id] = o.outputs[0].token_ids
        results.append(out)
    assert results[0] == results[1]
    graphs = graphed.runner.graphs
    assert graphs is not None and graphs.disabled is None
    assert graphs.replays >= 40, "the decode steps went through the static path"
    assert {w for _, w in graphs._graphs} >= {16, 32}, "tables crossed width buckets"
    assert {b for b, _ in graphs._graphs} >= {8, 4, 2, 1}, "the batch shrank through buckets"
    if device == "cuda":
        assert all(g.graph is not None for g in graphs._graphs.values()), "every bucket was captured"


@pytest.mark.parametrize("device", DEVICES)
def test_static_decode_logits_match_the_ordinary_step_and_padding_touches_no_owned_block(device: str) -> None:
    model = _model(LLAMA, device)
    bs, num_blocks = 4, 40
    plain = PagedModelRunner(model, num_blocks, bs, graphs=False)
    static = PagedModelRunner(model, num_blocks, bs, graphs=True)
    assert static.kv_caches[0][0].shape[0] == num_blocks + 1, "one block for the padding rows"
    ids = list(range(num_blocks))
    random.Random(0).shuffle(ids)
    seqs = {"a": [5, 9, 13], "b": list(range(2, 23)), "c": [7]}  # 3 sequences: a batch bucket of 4
    tables = {k: [ids.pop() for _ in range(8)] for k in seqs}
    for r in (plain, static):
        r.execute([Step(k, s, 0, tables[k]) for k, s in seqs.items()])
    for step in range(6):
        steps = [Step(k, [(3 * step + len(k)) % 100 + 2], len(s), tables[k]) for k, s in seqs.items()]
        before = [c.clone() for c in static.kv_caches[0]]
        a, b = plain.execute(steps), static.execute(steps)
        assert b.sample_ids == a.sample_ids == list(seqs) and b.rows == a.rows
        torch.testing.assert_close(b.logits, a.logits, rtol=1e-4, atol=1e-3)
        torch.testing.assert_close(b.hidden, a.hidden, rtol=1e-4, atol=1e-4)
        written = {(tables[k][len(s) // bs], len(s) % bs) for k, s in seqs.items()}
        for cache, old in zip(static.kv_caches[0], before):
            changed = (cache != old).flatten(1).any(1).nonzero().flatten().tolist()
            assert set(changed) <= {blk for blk, _ in written} | {num_blocks}, "only the step's slots and the spare"
        for k, s in seqs.items():
            s.append(steps[list(seqs).index(k)].token_ids[0])
    assert static.graphs is not None and static.graphs.replays == 6 and set(static.graphs._graphs) == {(4, 8)}


def test_steps_the_graphs_cannot_serve_run_eagerly() -> None:
    model = _model(LLAMA, "cpu")
    runner = PagedModelRunner(model, 16, 4, graphs=True)
    graphs = runner.graphs
    assert graphs is not None
    assert graphs.key([Step("a", [1, 2], 0, [0])]) is None  # a chunk of two tokens
    assert graphs.key([Step("a", [1], 3, [0], sample=False)]) is None  # a token that samples nothing
    assert graphs.key([Step("a", [1], 256, list(range(65)))]) is None  # past the model's positions
    assert graphs.key([Step("a", [1], 0, [0])] * 3) == (4, MIN_WIDTH)
    out = runner.execute([Step("a", [1, 2, 3], 0, [1]), Step("b", [4], 0, [2])])  # a prompt: the ordinary step
    assert out.sample_ids == ["a", "b"] and graphs.replays == 0
    out = runner.execute([Step("a", [5], 3, [1]), Step("b", [6], 1, [2])], frozenset({"a"}))  # every row: eager
    assert graphs.replays == 0
    runner.execute([Step("a", [5], 3, [1]), Step("b", [6], 1, [2])])
    assert graphs.replays == 1


def test_graphs_default_to_cuda_and_stay_off_when_eager() -> None:
    model = _model(LLAMA, "cpu")
    assert PagedModelRunner(model, 8, 4).graphs is None  # the CPU has the decode plan
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16] and bucket(1, MIN_WIDTH) == MIN_WIDTH
    if torch.cuda.is_available():
        gpu = _model(LLAMA, "cuda")
        assert PagedModelRunner(gpu, 8, 4).graphs is not None
        assert PagedModelRunner(gpu, 8, 4, eager=True).graphs is None  # LLM(enforce_eager=True)


def test_changed_modules_are_captured_again() -> None:
    """Graphs hold pointers into the weights: after anything that may change the modules
    (`modules_changed`: .to(), load_state_dict, unpack_weights) the buckets are built again."""
    model = _model(LLAMA, "cpu")
    runner = PagedModelRunner(model, 16, 4, graphs=True)
    graphs = runner.graphs
    assert graphs is not None
    runner.execute([Step("a", [1, 2, 3], 0, [1])])
    first = runner.execute([Step("a", [4], 3, [1])])
    assert set(graphs._graphs) == {(1, MIN_WIDTH)}
    held = graphs._graphs[(1, MIN_WIDTH)]
    model.modules_changed()
    again = runner.execute([Step("a", [5], 4, [1, 2])])
    assert graphs._graphs[(1, MIN_WIDTH)] is not held, "captured again"
    assert again.logits.shape == first.logits.shape and graphs.replays == 2
