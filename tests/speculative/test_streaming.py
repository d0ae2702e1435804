"""Speculative Streaming: stream rows see what they should, training teaches them the model's own
continuations, and decoding with them is lossless (greedy identical, sampling distributed as the
model's)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from brisk.config import CacheConfig, SpecConfig
from brisk.core.outputs import ScheduledRequest
from brisk.model.llama import LlamaForCausalLM
from brisk.engine.speculative import build_speculator
from brisk.request import SamplingParams
from brisk.runtime.decode_plan import plan_supported
from brisk.runtime.paged_runner import PagedModelRunner
from brisk.speculative.base import DraftRequest
from brisk.speculative.streaming import (
    StreamAdapter,
    StreamingProposer,
    StreamSegment,
    load_streams,
    run_streams,
    save_streams,
)
from brisk.speculative.train_streams import StreamTraining, stream_features, train_streams
from tests.speculative.conftest import CFG, VOCAB, run, tiny_engine, tiny_model
from tests.speculative.test_tiny_engine_spec import _exact_marginals, second_and_third_tokens
from tests.speculative.test_verify import _chi2_pvalue_ok

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _random_adapter(seed: int = 0) -> StreamAdapter:
    torch.manual_seed(seed)
    adapter = StreamAdapter(CFG, num_streams=3, num_layers=1, rank=4)
    with torch.no_grad():
        for p in adapter.parameters():
            p.normal_(0, 0.3)
    return adapter.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def trained() -> tuple[object, StreamAdapter, dict[str, object], list[tuple[list[int], int]]]:
    """A tiny model, streams trained on its own greedy continuations, the report, the sequences."""
    model = tiny_model(7)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, VOCAB, (4,), generator=g).tolist() for _ in range(160)]
    outs = run(tiny_engine(model, blocks=256, seqs=32), prompts, GREEDY)
    sequences = [(p + outs[f"r{i}"], len(p)) for i, p in enumerate(prompts)]
    cfg = StreamTraining(num_streams=3, num_layers=1, rank=4, epochs=8, lr=2e-2, batch_size=8)
    first = CFG.num_hidden_layers - cfg.num_layers
    adapter, report = train_streams(model, stream_features(model, sequences[16:], first),
                                    stream_features(model, sequences[:16], first), cfg)
    return model, adapter, report, sequences


def test_stream_rows_see_only_the_past_and_earlier_streams() -> None:
    model = tiny_model(3)
    adapter = _random_adapter()
    ids = torch.randint(1, VOCAB, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    changed = ids[:10] + [(t % (VOCAB - 1)) + 1 for t in ids[10:]]  # every token after position 9 differs
    f, g = stream_features(model, [(ids, 2), (changed, 2)], first_layer=1)
    anchors = torch.tensor([3, 8])
    nxt = torch.tensor(ids)[anchors + 1]  # x[t+1]: the token each anchor's row produced
    out = [run_streams(model, adapter, x.start[anchors], [StreamSegment(anchors, nxt, lambda layer, x=x: x.kv[layer])])
           for x in (f, g)]
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=1e-6)  # nothing after t + 1 = 9 is read
    # stream j does not read streams after it: a 1-stream adapter gives stream 1's rows exactly
    one = StreamAdapter(CFG, 1, 1, 4)
    one.load_state_dict({**adapter.state_dict(), "streams": adapter.streams[:1]})
    first = run_streams(model, one, f.start[anchors], [StreamSegment(anchors, nxt, lambda layer: f.kv[layer])])
    torch.testing.assert_close(first, out[0].view(2, 3, -1)[:, 0], rtol=1e-5, atol=1e-5)
    # and a main key past the anchor would change them: the mask is what hides it
    assert not torch.allclose(out[0].view(2, 3, -1)[0], out[0].view(2, 3, -1)[1])


@pytest.mark.parametrize("eager", [False, True])
def test_the_stream_pass_over_the_paged_cache_equals_training_s(eager: bool) -> None:
    """The proposer's stream rows (a step of their own over the target's paged cache, writing their
    keys and values into the draft slots: through the C++ decode plan with the adapters in its
    Linears, or eagerly through the modules with their hooks) equal the training pass's (main KV
    captured from a whole-sequence forward) at the same position, a request alone or in a batch."""
    model = tiny_model(4)
    adapter = _random_adapter(1)
    runner = PagedModelRunner(model, num_blocks=8, block_size=4, eager=eager)
    proposer = StreamingProposer(model, adapter, runner)
    gen = torch.Generator().manual_seed(2)
    requests, wants = [], []
    for i, n in enumerate((12, 9)):
        ids = torch.randint(1, VOCAB, (n,), generator=gen).tolist()
        table = [list(range(4 * i, 4 * i + 4))]  # room for the prompt, t_last and 3 draft slots
        p = n - 1  # t_last: its KV not yet in the cache
        runner.execute([ScheduledRequest(f"r{i}", ids[:p], 0, table, sample=True)])
        f = stream_features(model, [(ids, 4)], first_layer=1)[0]
        t = p - 1  # the row that produced t_last
        proposer.observe(f"r{i}", f.start[t], t)
        requests.append(DraftRequest(f"r{i}", ids, 3, table, SamplingParams(temperature=0.0), None))
        wants.append(run_streams(model, adapter, f.start[[t]],
                                 [StreamSegment(torch.tensor([t]), torch.tensor([ids[p]]), lambda layer, f=f: f.kv[layer])]))
    for i, r in enumerate(requests):
        torch.testing.assert_close(proposer.stream_hidden([r], [3]), wants[i], rtol=1e-5, atol=1e-5)
    # both at once, the second asking for fewer streams (stream j reads only the streams before it)
    both = proposer.stream_hidden(requests, [3, 2])
    torch.testing.assert_close(both, torch.cat([wants[0], wants[1][:2]]), rtol=1e-5, atol=1e-5)
    assert (proposer.plans.current is not None) == (not eager and plan_supported())


def test_the_runner_keeps_the_residual_stream_and_the_same_logits() -> None:
    model = tiny_model(5)
    prompt = torch.randint(1, VOCAB, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    outs = []
    for capture in (None, 1):
        engine = tiny_engine(model)
        engine.runner.capture_layer = capture
        engine.add_request("r0", prompt, SamplingParams(max_tokens=8, temperature=0.0))
        sched = engine.scheduler.schedule()
        outs.append(engine.runner.execute(sched.scheduled))
    torch.testing.assert_close(outs[1].logits, outs[0].logits, rtol=0, atol=0)
    assert outs[0].captured is None
    f = stream_features(model, [(prompt, 1)], first_layer=1)[0]
    torch.testing.assert_close(outs[1].captured, f.start[-1:], rtol=1e-5, atol=1e-5)


def test_training_teaches_the_streams_the_model_s_continuations(trained) -> None:  # type: ignore[no-untyped-def]
    _, adapter, report, _ = trained
    before, after = report["before"], report["after"]
    # a random model's continuations are hard to guess ahead: stream 1 learns most (0.10 -> 0.23 when
    # written), the later streams guess further ahead and gain less
    assert after[0] > before[0] + 0.08 and sum(after) > sum(before) + 0.05, (before, after)
    assert report["extra_params"] == adapter.num_params() < 0.2 * sum(p.numel() for p in tiny_model(0).parameters())


def test_training_continues_from_a_streams_file_and_keeps_kv_in_bfloat16(trained) -> None:  # type: ignore[no-untyped-def]
    model, adapter, report, sequences = trained
    first = CFG.num_hidden_layers - 1
    feats = stream_features(model, sequences[:20], first, torch.bfloat16)
    assert feats[0].kv[first][0].dtype == torch.bfloat16 and feats[0].start.dtype == torch.float32
    cfg = StreamTraining(num_streams=3, num_layers=1, rank=4, epochs=1, lr=2e-3, batch_size=8)
    _, more = train_streams(model, feats[4:], feats[:4], cfg, init=adapter)
    _, fresh = train_streams(model, feats[4:], feats[:4], cfg)
    assert sum(more["before"]) > sum(fresh["before"]) + 0.1  # it starts where the file left off
    with pytest.raises(ValueError, match="give the same or start afresh"):
        train_streams(model, feats[4:], feats[:4], StreamTraining(num_streams=2, num_layers=1, rank=4, epochs=1),
                      init=adapter)


def test_streaming_decoding_is_greedy_identical_and_accepts_drafts(trained, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model, adapter, _, sequences = trained
    prompts = [ids[:n] for ids, n in sequences[16:40]] + [[5, 9, 2, 11, 3, 3, 7]]  # prompts it trained on
    expected = run(tiny_engine(model, budget=12), prompts, GREEDY)
    rates = []
    layer_types = [type(m) for m in model.modules()]
    for name, streams, quant in (("trained", adapter, None), ("untrained", StreamAdapter(CFG, 3, 1, 4), None),
                                 ("trained, int8 pass", adapter, "int8"), ("trained, int4 pass", adapter, "int4")):
        path = tmp_path / f"{name}.safetensors"
        save_streams(path, streams, "tiny", CFG)
        engine = tiny_engine(model, budget=12)  # prompts arrive in chunks beside speculating decodes
        cfg = SpecConfig(method="streaming", heads=str(path), num_speculative_tokens=3, quantization=quant)
        engine.spec = build_speculator(cfg, engine.runner, CacheConfig(block_size=4, num_kv_blocks=64), 64, None,
                                       True, 0)
        assert run(engine, prompts, GREEDY) == expected, name
        if quant:  # the drafts really came from the quantized copies
            from brisk.quant.grouped import GroupLinear
            from brisk.quant.int8 import Int8Linear
            from brisk.speculative.streaming import PassModel

            proposer = engine.spec.proposer
            assert isinstance(proposer.plans.model, PassModel) and isinstance(proposer.vocab.head, Int8Linear)
            kind = Int8Linear if quant == "int8" else GroupLinear
            assert isinstance(proposer.plans.model.layers[-1].mlp.down_proj, kind)
        assert engine.spec.stats.num_draft_tokens > 100
        assert engine.scheduler.kv.num_free_blocks == engine.num_blocks
        rates.append(engine.spec.stats.acceptance_rate)
    # what training taught reaches decoding: the stream rows there read the state training read
    assert rates[0] > rates[1] + 0.05, rates
    # int8 copies of the stream layers draft nearly as well (the target verifies in its own weights,
    # which the copies left as they were)
    assert rates[2] > rates[1] + 0.05 and abs(rates[2] - rates[0]) < 0.1, rates
    assert rates[3] > rates[1] + 0.05 and abs(rates[3] - rates[0]) < 0.15, rates  # 4-bit groups of 32
    assert [type(m) for m in model.modules()] == layer_types


def test_the_int8_stream_pass_runs_quantized_copies_of_the_top_layers() -> None:
    from brisk.quant.int8 import Int8Linear
    from brisk.speculative.streaming import PassModel, int8_draft_vocab

    model = tiny_model(5)
    passes = PassModel(model, first=1)
    assert all(isinstance(m, Int8Linear) for m in passes.layers[1].modules() if hasattr(m, "out_features"))
    assert passes.layers[0] is model.layers[0] and passes.layers[1] is not model.layers[1]
    assert not any(isinstance(m, Int8Linear) for m in model.modules())
    h = torch.randn(3, CFG.hidden_size)
    vocab = int8_draft_vocab(model, None)
    assert vocab.logits(h).argmax(-1).tolist() == model.compute_logits(h).argmax(-1).tolist()
    # an int4 target (with AWQ-style input scales) is copied as its effective weight
    from brisk import quant

    quant.apply(model, quant.QuantConfig("int4", group_size=32))
    mlp = model.layers[1].mlp
    mlp.down_proj.set_input_scale(torch.rand(mlp.down_proj.in_features) + 0.5)
    copied = PassModel(model, first=1).layers[1].mlp
    for name in ("gate_up_proj", "down_proj"):
        x = torch.randn(2, getattr(mlp, name).in_features)
        want, got = getattr(mlp, name)(x), getattr(copied, name)(x)
        assert isinstance(getattr(copied, name), Int8Linear)
        assert float((got - want).norm() / want.norm()) < 0.02, name


def test_stream_pass_quantization_is_checked() -> None:
    assert SpecConfig(method="streaming", heads="s.safetensors", quantization="int8").quantization == "int8"
    assert SpecConfig(method="streaming", heads="s.safetensors", quantization="int4").quantization == "int4"
    with pytest.raises(ValueError, match='stream pass.s weights: "int8" or "int4"'):
        SpecConfig(method="streaming", heads="s.safetensors", quantization="w8a8")
    with pytest.raises(ValueError, match="method 'ngram' has none"):
        SpecConfig(method="ngram", quantization="int8")


def test_streams_with_lookup_first_stay_greedy_identical(trained, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Prompts that repeat themselves: lookups draft where the tail occurred before, the streams
    elsewhere; the output is plain decoding's."""
    model, adapter, _, sequences = trained
    prompts = [ids[:n] * 2 for ids, n in sequences[16:28]]
    expected = run(tiny_engine(model, budget=16), prompts, GREEDY)
    path = tmp_path / "s.safetensors"
    save_streams(path, adapter, "tiny", CFG)
    engine = tiny_engine(model, budget=16)
    cfg = SpecConfig(method="streaming", heads=str(path), num_speculative_tokens="auto", lookup_first=True)
    engine.spec = build_speculator(cfg, engine.runner, CacheConfig(block_size=4, num_kv_blocks=64), 64, None, True, 0)
    asked: list[int] = []
    inner = engine.spec.proposer.inner  # type: ignore[union-attr]
    propose = inner.propose
    inner.propose = lambda requests: asked.append(len(requests)) or propose(requests)  # type: ignore[method-assign]
    assert run(engine, prompts, GREEDY) == expected
    classes = engine.spec.length._overall  # type: ignore[union-attr]
    assert sum(asked) > 0 and any(c in classes for c in (1, 2, 3, 4)), (asked, classes)
    assert engine.scheduler.kv.num_free_blocks == engine.num_blocks


def test_a_prompt_longer_than_a_step_streams_in_chunks(tmp_path: Path) -> None:
    """Steps of prompt chunks alone sample nothing: no row to observe, and decoding goes on."""
    model = tiny_model(6)
    path = tmp_path / "s.safetensors"
    save_streams(path, _random_adapter(3), "tiny", CFG)
    prompt = torch.randint(1, VOCAB, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    expected = run(tiny_engine(model, budget=8), [prompt], GREEDY)
    engine = tiny_engine(model, budget=8)
    cfg = SpecConfig(method="streaming", heads=str(path), num_speculative_tokens=3)
    engine.spec = build_speculator(cfg, engine.runner, CacheConfig(block_size=4, num_kv_blocks=64), 64, None, True, 0)
    assert run(engine, [prompt], GREEDY) == expected
    assert engine.spec.stats.num_draft_tokens > 0


def test_sampled_tokens_follow_the_model_s_distribution(trained, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model, adapter, _, _ = trained
    path = tmp_path / "streams.safetensors"
    save_streams(path, adapter, "tiny", CFG)
    prompt = [3, 5, 7]
    engine = tiny_engine(model, blocks=512, budget=256, seqs=64)
    cfg = SpecConfig(method="streaming", heads=str(path), num_speculative_tokens=2)
    engine.spec = build_speculator(cfg, engine.runner, CacheConfig(block_size=4, num_kv_blocks=512), 512, None,
                                   True, 0)
    n = 2000
    counts = second_and_third_tokens(engine, prompt, SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True), n)
    assert engine.spec.stats.num_draft_tokens > n  # drafts from the streams really were verified
    assert engine.scheduler.kv.num_free_blocks == engine.num_blocks
    exact = _exact_marginals(model, prompt)
    assert _chi2_pvalue_ok(counts[0], exact[0], n)
    assert _chi2_pvalue_ok(counts[1], exact[1], n)


def test_streams_file_round_trips_and_refuses_other_files(tmp_path: Path) -> None:
    model = tiny_model(0)
    adapter = _random_adapter(2)
    path = tmp_path / "s.safetensors"
    save_streams(path, adapter, "tiny", CFG, vocab=torch.tensor([3, 1, 2]))
    loaded, meta, vocab = load_streams(path, model)
    assert meta["kind"] == "streaming" and loaded.first_layer == 1 and loaded.num_streams == 3
    assert vocab is not None and sorted(vocab.token_ids.tolist()) == [1, 2, 3]
    for a, b in zip(adapter.parameters(), loaded.parameters()):
        assert torch.equal(a, b)
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(ValueError, match="not found"):
        load_streams(tmp_path / "missing.safetensors", model)
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    with pytest.raises(ValueError, match="not a heads file"):
        load_streams(tmp_path / "junk.safetensors", model)
    from brisk.speculative.heads import ResidualHeads, save_heads
    save_heads(tmp_path / "medusa.safetensors", ResidualHeads(CFG.hidden_size, 2), "medusa", "tiny")
    with pytest.raises(ValueError, match="holds medusa heads, not streaming heads"):
        load_streams(tmp_path / "medusa.safetensors", model)
    from safetensors.torch import load_file, save_file
    old = load_file(str(path))
    save_file(old, str(tmp_path / "old.safetensors"), metadata={"kind": "streaming", "hidden_size": "32",
                                                                "num_layers": "2", "rank": "4"})
    with pytest.raises(ValueError, match="lacks num_streams, first_layer, token_rank .*brisk train-heads"):
        load_streams(tmp_path / "old.safetensors", model)
    import dataclasses

    wider = LlamaForCausalLM(dataclasses.replace(CFG, hidden_size=2 * CFG.hidden_size), max_positions=64)
    with pytest.raises(ValueError, match=f"trained for a model of hidden size {CFG.hidden_size} .* this one has "
                                         f"{2 * CFG.hidden_size}.*brisk train-heads --kind streaming"):
        load_streams(path, wider)
    with pytest.raises(ValueError, match="needs \"heads\""):
        SpecConfig(method="streaming")
    with pytest.raises(ValueError, match="1..1 top layers"):
        StreamAdapter(CFG, 2, 2)
