"""Tests for engine.py: a row's tokens do not depend on its batch, its padding or its chunk, and the model's own
generation config cannot alter the keyed draw (plain and cached paths); test_speed.py compares the two paths."""
import numpy as np
from test_rollout import FakeRetriever, one_thread, questions, word_model, word_tok  # noqa: F401
from transformers import GenerationConfig

import engine
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
