"""Tests for generation/kvcache.py and the cached engine's decode over it (DESIGN.md section 11): the slot cache's size is
cache_bytes; the fixed-shape step (what CUDA graphs capture, run eagerly here), every read-back interval and device
stop tables that flag every token or none all sample exactly the generate path's tokens; the cache is allocated once
and never copied whole; read-backs stay at one per sync_every steps."""
import pytest
import torch
from test_rollout import FakeRetriever, one_thread, questions, tiny_model, word_model, word_tok  # noqa: F401
from transformers import Qwen2Config

from perf import bench_engine
from generation import engine
from generation import kvcache
import rollout
import sampler
from generation import stops
from protocol import Protocol


def test_cache_bytes_is_the_slot_cache_size():
    tiny = Qwen2Config(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1)
    for config, hidden in ((tiny, True), (tiny, False), (Qwen2Config(**bench_engine.SHAPES["3b"]), True)):
        cache = kvcache.SlotCache(config, 8, 33, torch.bfloat16, "meta", hidden)
        assert cache.nbytes() == kvcache.cache_bytes(8, 33, config, torch.bfloat16, hidden)
        assert cache.position_bytes() * 8 * 33 == cache.nbytes()
    # the docstring's figure: Qwen2.5-3B, 128 slots of 4097 positions, bf16 (36 layers x 2 kv heads x 128 x 2 x 2 B)
    three_b = Qwen2Config(**bench_engine.SHAPES["3b"])
    assert round(kvcache.cache_bytes(128, 4097, three_b, torch.bfloat16, False) / 1e9, 1) == 19.3
    assert round(kvcache.cache_bytes(128, 4097, three_b, torch.bfloat16, True) / 1e9, 1) == 21.5


def episodes_and_twins(model, tok, proto, n=6, group=2):
    eps = rollout.run_episodes(model, tok, FakeRetriever(), rollout.start_episodes(tok, questions(n), 7, 1, group),
                               proto)
    twins = rollout.run_twins(model, tok, FakeRetriever(), [(ep, t, 0) for ep in eps for t in range(len(ep.turns))],
                              proto)
    return [(ep.ids, [(t.key, t.stop) for t in ep.turns]) for ep in eps + [r.twin for r in twins]]


@pytest.mark.parametrize("settings", [dict(cuda_graphs=True), dict(sync_every=1), dict(sync_every=3, gen_batch_size=5)])
def test_every_decode_setting_samples_the_generate_paths_tokens(word_tok, word_model, settings):  # noqa: F811
    """cuda_graphs=True on the CPU runs the fixed-shape step eagerly (rows padded to a power of two, width to a
    multiple of 256): the step a GPU captures, minus the capture."""
    base = dict(max_turns=2, max_new_tokens=10)
    plain = episodes_and_twins(word_model, word_tok, Protocol(engine="generate", **base))
    assert plain == episodes_and_twins(word_model, word_tok, Protocol(**base, **settings))


@pytest.mark.parametrize("flag", [True, False])
def test_device_stop_tables_decide_only_when_rows_freeze(word_tok, monkeypatch, flag):  # noqa: F811
    """Tables that flag every token (every row freezes each step, the host thaws it) or none (the host alone finds
    the stops): the same tokens as the generate path, so the host's exact rule decides every stop."""
    model = tiny_model(len(word_tok), seed=5)
    base = dict(max_turns=2, max_new_tokens=10, sync_every=4)
    plain = episodes_and_twins(model, word_tok, Protocol(engine="generate", **base))
    rule = stops.StopRule(word_tok, engine._special_ids(model, word_tok)[0], len(word_tok), "cpu")
    nxt, hit, eos = rule.tables
    rule.tables = (nxt, torch.full_like(hit, flag), eos if flag else torch.zeros_like(eos))
    monkeypatch.setattr(engine, "stop_rule", lambda *args: rule)
    assert episodes_and_twins(model, word_tok, Protocol(**base)) == plain


def test_the_cache_is_allocated_once_and_read_back_every_sync_every_steps(word_tok):  # noqa: F811
    """40 rows through 8 slots (rows wait and refill), no EOS and no stop string reachable: every row runs its budget
    of 30 tokens. The slot cache is the same storage across calls; nothing copies more than one row at a time; the
    host reads back once per sync_every steps (plus once when every row has stopped)."""
    model = tiny_model(len(word_tok), seed=6)
    head = torch.nn.Linear(model.config.hidden_size, len(word_tok))
    head.weight.data.copy_(model.lm_head.weight.data)
    ending = [i for i in range(len(word_tok)) if i == word_tok.eos_token_id or "</" in word_tok.decode([i])]
    head.bias.data.zero_()[ending] = -1e4  # EOS and every word holding a closing tag: never drawn
    model.lm_head = head
    proto = Protocol(max_new_tokens=30, gen_batch_size=8, sync_every=16)
    eps = lambda step: rollout.start_episodes(word_tok, questions(40), 3, step)  # noqa: E731
    engine.generate_turn(model, word_tok, eps(0), proto)
    storage = engine._DECODERS[model]["cache"].k.data_ptr()
    with bench_engine.counting() as counts:
        gens = engine.generate_turn(model, word_tok, eps(1), proto)
    assert [len(g.ids) for g in gens] == [30] * 40 and all(g.stop == "length" for g in gens)
    assert engine._DECODERS[model]["cache"].k.data_ptr() == storage
    # 5 waves of 8 rows x 30 steps (a wave's rows share every step): 2 read-backs a wave, after 16 and after 30 steps
    assert counts["steps"] == 150 and counts["syncs"] == 10 and counts["live_steps"] == 40 * 30
    row = (len(eps(1)[0].prompt_ids) + 30) * engine._DECODERS[model]["cache"].position_bytes()
    assert counts["copied"] <= 40 * 2 * row  # each row copied in once and out once, at most


def test_kv_stored_in_the_autocast_dtype_changes_nothing():
    """kv_dtype: under autocast, attention reads keys/values in the autocast dtype, so keys computed in float32 (after
    the rotary embedding) and stored in bfloat16 give the same attention output, bit for bit."""
    torch.manual_seed(0)
    q, k, v = torch.randn(4, 2, 1, 16), torch.randn(4, 2, 9, 16), torch.randn(4, 2, 9, 16).bfloat16()
    mask = kvcache.attention_mask(torch.tensor([3, 8, 0, 5]), 9, "sdpa", torch.bfloat16)
    attend = torch.nn.functional.scaled_dot_product_attention
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(attend(q, k, v, attn_mask=mask), attend(q, k.bfloat16(), v, attn_mask=mask))
        assert engine.kv_dtype(tiny_model(50)) == torch.bfloat16
    assert engine.kv_dtype(tiny_model(50)) == torch.float32
    assert sampler.keyed_draw  # the draw the step runs (a captured graph included)


def test_engine_gpu_runs_at_a_tiny_size():
    """bench_engine.engine_gpu, the first-GPU check's figure, on the CPU at a tiny size: both variants (cuda_graphs
    off and on: exact and fixed step shapes here) decode the same tokens."""
    out = bench_engine.engine_gpu(shape="tiny", rows=6, slots=4, median=4, cap=6, max_context=512, device="cpu")
    for name in ("no_graphs", "graphs"):
        assert out[name]["tokens"] > 6 and out[name]["tok_s"] > 0 and 0 < out[name]["slot_occupancy"] <= 1
    assert out["same_tokens"]
