"""Tests for generation/stops.py: the automaton the device looks up marks the token where the decoded turn first holds a stop
string, however the tokenizer splits the tags (byte-level BPE across tokens, word-level as single tokens, Qwen2.5's
BPE), and its tables on a hand-worked example."""
import random

import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st
from test_rollout import PIECES, byte_tok, encode, one_thread, word_tok  # noqa: F401

from perf import bench_engine
from generation import stops
from protocol import STOP_STRINGS


def exact_first_stop(tok, ids):
    """TurnStopper's rule by brute force: the first k whose decoded ids[:k + 1] hold a stop string."""
    return next((k for k in range(len(ids)) if any(s in tok.decode(ids[:k + 1]) for s in STOP_STRINGS)), None)


def automaton_first_hit(rule, ids):
    q = 0
    for k, tok in enumerate(ids):
        if rule.hit[q, tok]:
            return k
        q = rule.next_state[q, tok]
    return None


def test_tables_on_a_hand_worked_example():
    texts = ["</sea", "rch>", "x", "", "</answer>", ">", "</search", "<", "<</a"]
    nxt, hit, states = stops.stop_automaton(texts)
    q = {s: i for i, s in enumerate(states)}
    assert len(states) == 15 and states[:3] == ["", "<", "</"]  # "</" then 6 more characters of each tag
    assert nxt[q[""], 0] == q["</sea"] and hit[q["</sea"], 1] and nxt[q["</sea"], 1] == q[""]
    assert nxt[q["</sea"], 2] == q[""] and not hit[q["</sea"], 2]  # any other character restarts
    assert nxt[q["</sea"], 3] == q["</sea"]  # a token without text keeps the state
    assert hit[q[""], 4] and hit[q["</answer"], 5] and hit[q["</search"], 5] and not hit[q["</"], 5]
    assert nxt[q[""], 6] == q["</search"] and nxt[q["</search"], 7] == q["<"] and nxt[q["</"], 8] == q["</a"]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(PIECES | st.text(max_size=6), max_size=16))
def test_the_automaton_marks_the_first_stop_byte_level(byte_tok, parts):
    ids = encode(byte_tok, "".join(parts))
    rule = stops.StopRule(byte_tok, [], len(byte_tok), "cpu")
    assert automaton_first_hit(rule, ids) == exact_first_stop(byte_tok, ids)


def test_the_automaton_marks_the_first_stop_word_level_and_qwen(word_tok):
    """Random id sequences over the word-level vocabulary (tags are tokens; decode joins words with spaces), and
    random tag-laden texts through Qwen2.5's tokenizer (its 151,665 texts in the tables)."""
    rng = random.Random(0)
    rule = stops.StopRule(word_tok, [], len(word_tok), "cpu")
    tags = word_tok.convert_tokens_to_ids(["</search>", "</answer>", "<search>"])
    for _ in range(300):
        ids = [rng.choice(tags) if rng.random() < 0.1 else rng.randrange(len(word_tok)) for _ in range(20)]
        assert automaton_first_hit(rule, ids) == exact_first_stop(word_tok, ids)
    qwen = bench_engine.qwen_tokenizer()
    rule = stops.StopRule(qwen, [], 151_936, "cpu")
    assert not rule.gt[len(qwen):].any() and (rule.next_state[:, len(qwen):] == np.arange(15)[:, None]).all()
    words = ["</search>", "</answer>", "</sea", "rch>", "</", "answer>", "<", ">", " ", "\n", "query", "日本", "/a"]
    for _ in range(300):
        text = "".join(rng.choice(words) for _ in range(rng.randrange(1, 12)))
        ids = qwen(text, add_special_tokens=False)["input_ids"]
        assert automaton_first_hit(rule, ids) == exact_first_stop(qwen, ids), text
