"""The fast paths equal the plain ones (DESIGN.md section 11). Chunked log-probs equal the full (B, L, V)
computation and stay within a memory bound; the cached engine (KV reuse across turns and into twins, shared prefills,
continuous batching) samples exactly the episodes of the plain generate path; perf/bench.py gpu runs at a tiny size."""
import numpy as np
import pytest
import torch
from test_rollout import FakeRetriever, one_thread, questions, tiny_model, word_model, word_tok  # noqa: F401

from perf import bench
from generation import engine
from perf import bench_engine
import eval as qa_eval
from generation import logprobs
import rollout
import sampler
import train_twice as tt
from protocol import Protocol


def full_logprobs(model, ids, mask, temperature):
    """The previous commit's token_logprobs: full-vocabulary float32 logits and log-softmax."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float() / temperature
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, ids[:, 1:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_equal_the_full_computation(temperature):
    model = tiny_model(3001, seed=2)
    ids = torch.randint(0, 3001, (3, 41), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0  # right padding
    valid = (mask[:, 1:] * mask[:, :-1]).bool()
    ref_lp, ref_ent = full_logprobs(model, ids, mask, temperature)
    for chunk in (3001 * 7, 1 << 24):  # 7 positions per chunk (many chunks, a ragged last one), and one chunk
        lp, ent = logprobs.token_logprobs(model, ids, mask, temperature, True, chunk_elements=chunk)
        assert (lp - ref_lp)[valid].abs().max() < 1e-5 and (ent - ref_ent)[valid].abs().max() < 1e-5
        assert lp[~valid].eq(0).all() and ent[~valid].eq(0).all()
    lp, ent = tt.token_logprobs(model, ids, mask, temperature)  # the trainer's entry point: no entropy asked
    assert ent is None and (lp - ref_lp)[valid].abs().max() < 1e-5
    some = valid & (torch.rand(valid.shape, generator=torch.Generator().manual_seed(1)) < 0.5)
    lp, _ = tt.token_logprobs(model, ids, mask, temperature, positions=some)
    assert torch.equal(lp != 0, some) and (lp - ref_lp)[some].abs().max() < 1e-5


def test_chunked_logprobs_gradients_equal_the_full_computation():
    model = tiny_model(500, seed=3).train()
    ids = torch.randint(0, 500, (2, 30), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    weight = torch.randn(2, 29, generator=torch.Generator().manual_seed(5))
    grads = []
    for f in (lambda: full_logprobs(model, ids, mask, 0.9),
              lambda: logprobs.token_logprobs(model, ids, mask, 0.9, True, chunk_elements=500 * 4)):
        model.zero_grad()
        lp, ent = f()
        ((lp + 0.1 * ent) * weight).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):  # float32 sums in another order: equal to a few ulps of the gradient's scale
        assert (a - b).abs().max() <= 1e-5 * max(1.0, a.abs().max().item())


def test_chunked_logprobs_memory_is_bounded():
    """B=2, L=1024, V=50,000: a float32 logits tensor is 0.41 GB; the chunked path must stay far below it."""
    chunked = bench.logprob_memory("chunked", vocab=50_000)
    full = bench.logprob_memory("full", vocab=50_000)
    assert abs(chunked["lp_sum"] - full["lp_sum"]) < 1e-5 * 2 * 1023 * 10
    assert chunked["extra_gb"] < 0.25 and chunked["extra_gb"] < full["extra_gb"] / 3, (chunked, full)


def run_both(word_tok, word_model, proto_kw, n=8, group=3):  # noqa: F811
    out = {}
    for kind in ("generate", "cached"):
        proto = Protocol(engine=kind, **proto_kw)
        with bench_engine.counting() as counts:
            eps = rollout.run_episodes(word_model, word_tok, FakeRetriever(),
                                       rollout.start_episodes(word_tok, questions(n), 4, 2, group), proto)
            requests = [(ep, t, j) for ep in eps for t in range(len(ep.turns)) for j in range(2)]
            twins = rollout.run_twins(word_model, word_tok, FakeRetriever(), requests, proto)
            free = rollout.run_twins(word_model, word_tok, FakeRetriever(), requests[::3], proto, coupling=False)
            ep = max(eps, key=lambda e: len(e.turns))
            mc = rollout.continue_from(word_model, word_tok, FakeRetriever(),
                                       [(ep, 1, inc, sampler.fresh_key(ep.key, 9, k)) for inc in (0, 1)
                                        for k in range(2)], proto)
        out[kind] = (eps + [r.twin for r in twins + free] + mc, [r.kind for r in twins + free], dict(counts))
    return out


@pytest.mark.parametrize("batch", [64, 5])
def test_cached_engine_samples_the_plain_paths_episodes(word_tok, word_model, batch):  # noqa: F811
    """Bit-identical token ids, keys, stops, rewards and twin kinds; log-probs and entropies to float rounding (the
    two paths add the same numbers in different orders). batch=5 makes rows wait and refill freed slots."""
    out = run_both(word_tok, word_model, dict(max_turns=2, max_new_tokens=12, gen_batch_size=batch))
    (plain, kinds, cost), (cached, kinds2, cost2) = out["generate"], out["cached"]
    assert kinds == kinds2 and len(plain) == len(cached)
    for a, b in zip(plain, cached):
        assert a.ids == b.ids and a.mask == b.mask and a.reward == b.reward
        assert [(t.key, t.stop, t.start, t.end, t.doc_ids) for t in a.turns] == \
               [(t.key, t.stop, t.start, t.end, t.doc_ids) for t in b.turns]
        for t, u in zip(a.turns, b.turns):
            assert np.allclose(t.logprobs, u.logprobs, atol=1e-4) and np.allclose(t.entropy, u.entropy, atol=1e-4)
    assert cost["tokens"] == cost2["tokens"]
    assert cost2["row_steps"] == cost2["tokens"]  # no finished row is ever decoded
    assert cost["row_steps"] > cost["tokens"]  # ... while generate decodes them (the test bites)
    assert cost2["positions"] < cost["positions"] / 3  # each context token once, not once per turn


def test_cached_engine_prefills_a_shared_prompt_once(word_tok, word_model):  # noqa: F811
    proto = Protocol(max_turns=0, max_new_tokens=1)
    eps = rollout.start_episodes(word_tok, questions(1), 0, 0, group_size=5)
    with bench_engine.counting() as counts:
        engine.generate_turn(word_model, word_tok, eps, proto)
    # the prompt once, and its last token once for all five rows (identical sequences share a physical row)
    assert counts["positions"] == len(eps[0].prompt_ids) and counts["row_steps"] == 5
    assert len({id(ep._kv.kv[0][0]) for ep in eps}) == 5  # each row's own cache after its turn


def test_twins_read_repeated_tokens_off_the_parent_cache(word_tok, word_model):  # noqa: F811
    """A twin whose alternative turn repeats the factual tokens (self-twin) runs no body position for them."""
    proto = Protocol(max_turns=1, max_new_tokens=6, temperature=0.05)  # near-greedy: alternatives repeat
    eps = rollout.run_episodes(word_model, word_tok, FakeRetriever(),
                               rollout.start_episodes(word_tok, questions(4), 0, 0), proto)
    with bench_engine.counting() as counts:
        results = rollout.run_twins(word_model, word_tok, FakeRetriever(), [(ep, 0, 0) for ep in eps], proto)
    selfs = [r for r in results if r.kind == "self"]
    assert selfs and counts["head_only"] >= sum(r.tokens for r in selfs)


def test_bench_gpu_runs_at_a_tiny_size(tiny_world, capsys):
    loader = qa_eval.load_policy
    (result,) = bench.main(["gpu", "--tiny", "--steps=1", f"--world={tiny_world}"])
    assert qa_eval.load_policy is loader  # the random-model loader must not leak into later tests
    (m,) = result["steps"]
    assert m["factual_tokens"] > 0 and m["time_update"] > 0 and np.isfinite(m["loss"])
    parts = ("time_rollout", "time_twins", "time_logprobs", "time_update")  # infra/phases.py, in order
    assert all(m[k] > 0 for k in parts) and abs(sum(m[k] for k in parts) - m["time"]) < 1e-6
    assert not [k for k in m if k.startswith(("mem_", "used_"))]  # GPU memory figures: none on a CPU
    assert "tok/s" in capsys.readouterr().out


def test_cached_engine_keeps_a_subclass_forward(word_tok):  # noqa: F811
    """A model whose forward changes its logits (here a fixed bias): the cached engine samples through that forward
    (no reading logits off hidden states) and matches the generate path."""
    from transformers import Qwen2ForCausalLM

    class Biased(Qwen2ForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits + self.bias
            return out

    base = tiny_model(len(word_tok), seed=4)
    model = Biased(base.config).eval()
    model.load_state_dict(base.state_dict())
    bias = torch.zeros(len(word_tok))
    bias[word_tok.convert_tokens_to_ids("paris")] = 4.0
    model.register_buffer("bias", bias)
    assert not engine._can_track(model) and engine._can_track(base)
    out = run_both(word_tok, model, dict(max_turns=1, max_new_tokens=8, gen_batch_size=7), n=4, group=2)
    assert [ep.ids for ep in out["generate"][0]] == [ep.ids for ep in out["cached"][0]]
    assert out["cached"][2]["head_only"] == 0
