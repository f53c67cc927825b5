"""Tests for generation/engine.py: a row's tokens do not depend on its batch, its padding or its chunk, and the model's own
generation config cannot alter the keyed draw (plain and cached paths); test_speed.py compares the two paths."""
import math

import numpy as np
from test_rollout import FakeRetriever, byte_tok, one_thread, questions, word_model, word_tok  # noqa: F401
from transformers import GenerationConfig

from generation import engine
import rollout
from protocol import Protocol

SMALL = Protocol(max_turns=2, max_new_tokens=12, gen_batch_size=64)


def test_same_tokens_alone_in_a_batch_and_with_long_padding(word_tok, word_model):
    target = questions(1)
    run = lambda qs, proto=SMALL: rollout.run_episodes(  # noqa: E731
        word_model, word_tok, FakeRetriever(), rollout.start_episodes(word_tok, qs, 5, 2), proto)
    alone = run(target)[0]
    batch = run(questions(32))[0]  # the same uid and key inside a batch of 32
    padded = run(target + [{"id": "long", "question": "x " * 120 + "y", "golden_answers": ["x"]}])[0]
    chunks = run(questions(32), Protocol(max_turns=2, max_new_tokens=12, gen_batch_size=5))[0]
    assert len(alone.turns) >= 2 and alone.n_generated > 10
    for other in (batch, padded, chunks):
        assert other.ids == alone.ids and [t.key for t in other.turns] == [t.key for t in alone.turns]
        assert np.allclose([x for t in other.turns for x in t.logprobs], [x for t in alone.turns for x in t.logprobs],
                           atol=1e-4)


def test_model_generation_config_cannot_alter_the_draw(word_tok, word_model, monkeypatch):
    eps = lambda: rollout.start_episodes(word_tok, questions(8), 1, 0)  # noqa: E731
    proto = Protocol(max_new_tokens=24, max_turns=0, engine="generate")  # the cached engine never reads the config
    clean = [g.ids for g in engine.generate_turn(word_model, word_tok, eps(), proto)]
    saved = word_model.generation_config
    word_model.generation_config = GenerationConfig(repetition_penalty=5.0, no_repeat_ngram_size=1, top_k=3,
                                                    temperature=0.1, suppress_tokens=list(range(4, 40)))
    try:
        assert [g.ids for g in engine.generate_turn(word_model, word_tok, eps(), proto)] == clean
        cached = Protocol(max_new_tokens=24, max_turns=0)
        assert [g.ids for g in engine.generate_turn(word_model, word_tok, eps(), cached)] == clean
        monkeypatch.setattr(engine, "_plain_generation_config", lambda model: __import__("contextlib").nullcontext())
        assert [g.ids for g in engine.generate_turn(word_model, word_tok, eps(), proto)] != clean  # the test bites
    finally:
        word_model.generation_config = saved


# --- row features (DESIGN.md section 11): given first tokens, a fork token's own key and ban, text-line keys ---
CACHED, PLAIN = Protocol(max_turns=2, max_new_tokens=12), Protocol(max_turns=2, max_new_tokens=12, engine="generate")


def redraw_ok(model, ep, turn_ids, noise, ban=None, temperature=1.0) -> bool:
    """The definition (DESIGN.md section 4): token p of the turn is argmax_v l_v / T + g(key_p, pos_p)_v on the logits
    of one plain forward over the context and the turn's earlier tokens, token `ban[p]` excluded where given."""
    import torch
    import sampler
    ctx = ep.prompt_ids + ep.ids
    with torch.no_grad():
        logits = word_free_forward(model, ctx + turn_ids)[len(ctx) - 1:len(ctx) - 1 + len(turn_ids)]
    for p, tok in enumerate(turn_ids):
        row = logits[p:p + 1].clone()
        if ban and p in ban:
            row[0, ban[p]] = -float("inf")
        key, pos = noise(p)
        if int(sampler.keyed_gumbel_argmax(row, [key], pos, temperature)[0]) != tok:
            return False
    return True


def word_free_forward(model, ids):
    import torch
    return model(input_ids=torch.tensor([ids])).logits[0].float()


def factual(word_tok, word_model, n=12, proto=CACHED):
    return rollout.run_episodes(word_model, word_tok, FakeRetriever(), rollout.start_episodes(word_tok, questions(n),
                                                                                             3, 1), proto)


def test_a_continuation_from_token_k_regenerates_the_factual_turn_in_both_paths(word_tok, word_model):
    """TurnStart(t, y_t[:k]) with no key and no ban: the row starts at position k on the turn key, so it draws
    y_t[k:] again, token for token, with the same stop; only the drawn tokens count as generated."""
    eps = factual(word_tok, word_model)
    rows = [(ep, t, k) for ep in eps for t, turn in enumerate(ep.turns) for k in (1, (turn.end - turn.start) // 2)
            if 0 < k < turn.end - turn.start]
    assert len(rows) > 10
    for proto in (CACHED, PLAIN):
        branches = [rollout.branch(ep, t, fork=rollout.turn_start(ep, t, k)) for ep, t, k in rows]
        gens = engine.generate_turn(word_model, word_tok, branches, proto)
        for (ep, t, k), g in zip(rows, gens):
            turn = ep.turns[t]
            assert g.ids == ep.ids[turn.start:turn.end] and g.stop == turn.stop and g.given == k
            assert g.logprobs[:k] == turn.logprobs[:k]
            assert np.allclose(g.logprobs, turn.logprobs, atol=1e-4)


def test_a_token_fork_draws_its_own_key_bans_y_k_and_then_replays_the_turn_key(word_tok, word_model):
    """Fork at k: the first k tokens given, token k drawn with the alternative key and never y_k, later tokens on
    the turn key at their positions: the cached and generate paths give the same tokens, and both equal the
    definition redrawn from plain forwards."""
    import sampler
    eps = factual(word_tok, word_model)
    rows = [(ep, t, k) for ep in eps for t, turn in enumerate(ep.turns) for k in (0, 2) if k < turn.end - turn.start]
    out = {}
    for name, proto in (("cached", CACHED), ("plain", PLAIN)):
        twins = [rollout.branch(ep, t, fork=rollout.turn_start(ep, t, k, sampler.alt_key(ep.key, t, 7),
                                                               ep.ids[ep.turns[t].start + k])) for ep, t, k in rows]
        out[name] = engine.generate_turn(word_model, word_tok, twins, proto)
    assert [g.ids for g in out["cached"]] == [g.ids for g in out["plain"]]
    changed_later = 0
    for (ep, t, k), g in zip(rows, out["cached"]):
        y = ep.ids[ep.turns[t].start:ep.turns[t].end]
        assert g.ids[:k] == y[:k] and g.ids[k] != y[k] and g.given == k
        alt, key = sampler.alt_key(ep.key, t, 7), ep.key_for(t)
        assert redraw_ok(word_model, rollout.branch(ep, t), g.ids, lambda p: (alt, p) if p == k else (key, p),
                         ban={k: y[k]})
        assert not redraw_ok(word_model, rollout.branch(ep, t), g.ids, lambda p: (key, p), ban={k: y[k]})
        changed_later += g.ids[k + 1:] != y[k + 1:len(g.ids)]
        assert math.isclose(g.logprobs[k], float(torch_logprob(word_model, ep, t, g.ids, k, y[k])), abs_tol=1e-4)
    assert changed_later  # the fork moved some turn's later tokens


def torch_logprob(model, ep, t, ids, k, banned):
    """log of ids[k]'s probability under the law a fork token is drawn from (and records): pi(. | context, ids[:k])
    restricted to v != banned."""
    import torch
    ctx = ep.prompt_ids + ep.ids[:ep.turns[t].start]
    with torch.no_grad():
        logits = word_free_forward(model, ctx + ids[:k + 1])[len(ctx) + k - 1]
        logits[banned] = -float("inf")
        return torch.log_softmax(logits, -1)[ids[k]]


def test_a_ban_on_the_only_token_with_mass_is_lifted():
    import torch
    import sampler
    proc = sampler.KeyedGumbelProcessor(None, 0, 1.0, top_k=1)  # top-k 1: the law is one token
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, 3.0, 1.0]])
    token, logprob, _ = proc._draw(logits.clone(), torch.tensor([5, 6]), 0, torch.tensor([1, -1]))
    assert token.tolist() == [1, 1] and torch.allclose(logprob, torch.zeros(2))
    proc = sampler.KeyedGumbelProcessor(None, 0, 1.0)
    token, logprob, entropy = proc._draw(logits.clone(), torch.tensor([5, 5]), 0, torch.tensor([1, -1]))
    rest = torch.log_softmax(torch.tensor([0.0, 1.0]), -1)  # the law restricted to tokens 0 and 2
    assert token[0] != 1 and math.isclose(float(logprob[0]), float(rest[token[0] // 2]), abs_tol=1e-6)
    assert math.isclose(float(entropy[0]), float(-(rest.exp() * rest).sum()), abs_tol=1e-6)


def test_text_line_keys_follow_the_definition_in_both_paths(byte_tok):
    """line_keys = "text": a draw's key is line_key(turn key, newline tokens before it in the turn) at its position
    since the last of them; both paths agree; turns without a newline are drawn as under the group reading."""
    import sampler
    from test_rollout import tiny_model
    model = tiny_model(len(byte_tok), seed=3)
    run = lambda proto: rollout.run_episodes(model, byte_tok, FakeRetriever(), rollout.start_episodes(  # noqa: E731
        byte_tok, questions(16), 9, 0), proto)
    text = {e: run(Protocol(max_turns=1, max_new_tokens=40, line_keys="text", engine=e)) for e in ("cached",
                                                                                                  "generate")}
    group = run(Protocol(max_turns=1, max_new_tokens=40))
    assert [e.ids for e in text["cached"]] == [e.ids for e in text["generate"]]
    nl = {i for i in range(len(byte_tok)) if "\n" in byte_tok.decode([i])}
    mid = 0
    for ep, g in zip(text["cached"], group):
        for t, turn in enumerate(ep.turns):
            ids = ep.ids[turn.start:turn.end]
            lines = [sum(x in nl for x in ids[:p]) for p in range(len(ids))]
            since = [p - max([q + 1 for q in range(p) if ids[q] in nl], default=0) for p in range(len(ids))]
            key = ep.key_for(t)
            assert redraw_ok(model, rollout.branch(ep, t), ids, lambda p: (sampler.line_key(key, lines[p]), since[p]))
            mid += lines[-1] > 0
        if not any(x in nl for turn in ep.turns[:1] for x in ep.ids[turn.start:turn.end]):
            first = ep.turns[0]
            assert ep.ids[first.start:first.end] == g.ids[g.turns[0].start:g.turns[0].end]
    assert mid, "no turn went past a newline: the test would not bite"
