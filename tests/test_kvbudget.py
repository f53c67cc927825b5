"""Tests for generation/kvbudget.py, the live-KV budget (DESIGN.md section 10): under a budget the factual episodes
and their twins are the same tokens as without one, the KV entries held at every turn boundary stay under it (and
without it they would not), a budget smaller than one episode still finishes, and the presets fit the ledger's
long-turn script under 90% of 80 GiB."""
import gc
import json
import os

import pytest
from test_rollout import FakeRetriever, one_thread, questions, word_model, word_tok  # noqa: F401

from generation import engine
from generation import kvbudget
from protocol import Protocol
import rollout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = dict(max_turns=3, max_new_tokens=12, gen_batch_size=4)


def gib(model, positions):
    """The kv_budget_gib that allows `positions` positions of this model's entries."""
    return (positions + 0.5) * engine.position_bytes(model) / kvbudget.GIB


def clean():
    """No KV entry of an earlier test is counted: live_positions() counts every entry in the process. One an earlier
    test left in a reference cycle lives until the collector runs; one still referenced fails here by name (as
    tests/test_vllm.py's V2 fixture's did, its frame kept alive by vLLM's first import)."""
    gc.collect()
    assert kvbudget.live_positions() == 0, "an earlier test holds KV entries alive"


def traced(model, tok, proto, monkeypatch, n=8, group=2, chunk=0):
    """Factual episodes, then twins of every turn (chunks, caches released): their tokens and outcomes, the live
    positions after every turn of any call, the episodes of each turn call, and the most positions alive when an
    entry was made (within a turn)."""
    clean()
    at_turn, calls, made = [], [], []
    step, post = rollout.step_turn, engine.KVEntry.__post_init__

    def record(entry):
        post(entry)
        made.append(kvbudget.live_positions())

    def counted(model, tok, retriever, episodes, proto):
        calls.append(len([ep for ep in episodes if not ep.done]))
        out = step(model, tok, retriever, episodes, proto)
        at_turn.append(kvbudget.live_positions())
        return out
    monkeypatch.setattr(rollout, "step_turn", counted)
    monkeypatch.setattr(engine.KVEntry, "__post_init__", record)
    eps = rollout.run_episodes(model, tok, FakeRetriever(), rollout.start_episodes(tok, questions(n), 5, 1, group),
                               proto)
    requests = [(ep, t, 0) for ep in eps for t in range(len(ep.turns))]
    twins = rollout.run_twins(model, tok, FakeRetriever(), requests, proto, chunk=chunk, release=True)
    tokens = [(ep.ids, ep.reward) for ep in eps] + [(r.kind, r.twin.ids, r.diff) for r in twins]
    monkeypatch.undo()
    return tokens, at_turn, calls, max(made)


def test_a_budget_changes_no_token_and_holds_every_turn_under_it(word_tok, word_model, monkeypatch):  # noqa: F811
    free, free_turns, free_calls, _ = traced(word_model, word_tok, Protocol(**BASE), monkeypatch)
    most = max(free_turns)
    cap = most // 3  # a third of what the free run held: several episodes must wait or re-prefill
    one = max(len(ep_ids) for ep_ids, _ in free[:16]) + 60  # prompt + response + a turn: more than one episode needs
    assert cap > one, (cap, one)
    proto = Protocol(**BASE, kv_budget_gib=gib(word_model, cap))
    assert kvbudget.limit(word_model, proto) == cap
    held, turns, calls, peak = traced(word_model, word_tok, proto, monkeypatch)
    assert held == free
    assert max(turns) <= cap < most, (max(turns), cap, most)
    # within a turn: the transients the docstring names, at most a prefill bucket of entries
    assert peak <= cap + BASE["gen_batch_size"] * max(BASE["max_new_tokens"] + len(ids) for ids, _ in free[:16])
    assert len(calls) > len(free_calls) and max(calls) < max(free_calls)  # the budget made episodes wait


def test_a_budget_below_one_episode_still_finishes_one_at_a_time(word_tok, word_model, monkeypatch):  # noqa: F811
    free = traced(word_model, word_tok, Protocol(**BASE), monkeypatch, n=3)[0]
    proto = Protocol(**BASE, kv_budget_gib=1e-12)
    assert kvbudget.limit(word_model, proto) == 1
    held, _, calls, _ = traced(word_model, word_tok, proto, monkeypatch, n=3)
    assert held == free and max(calls) == 1


def test_twin_chunks_under_a_budget_are_the_same_twins(word_tok, word_model, monkeypatch):  # noqa: F811
    free, free_turns, _, _ = traced(word_model, word_tok, Protocol(**BASE), monkeypatch, chunk=5)
    cap = max(free_turns) // 2
    proto = Protocol(**BASE, kv_budget_gib=gib(word_model, cap))
    held, turns, _, _ = traced(word_model, word_tok, proto, monkeypatch, chunk=5)
    assert held == free and max(turns) <= cap, (max(turns), cap)


def test_the_generate_path_and_no_budget_have_no_limit(word_tok, word_model):  # noqa: F811
    assert kvbudget.limit(word_model, Protocol(**BASE)) is None
    assert kvbudget.limit(word_model, Protocol(**BASE, engine="generate", kv_budget_gib=1.0)) is None


def test_schedule_keeps_the_furthest_along_and_drops_what_does_not_fit(word_tok, word_model):  # noqa: F811
    """Direct: three started episodes holding caches and two fresh ones, a cap that fits two turns."""
    clean()
    proto = Protocol(**BASE)
    eps = rollout.start_episodes(word_tok, questions(5), 5, 1, 1)
    rollout.run_episodes(word_model, word_tok, FakeRetriever(), eps[:3], Protocol(**{**BASE, "max_turns": 0}))
    for ep in eps[:3]:  # finished after one turn; pretend they are running, caches held
        ep.done = False
    assert all(kvbudget.held(ep) is not None for ep in eps[:3])
    needs = [kvbudget.need(ep, proto) for ep in eps]
    cap = needs[0] + needs[1] + kvbudget.held(eps[2]).positions  # two turns and one waiting cache
    chosen = kvbudget.schedule(eps, proto, cap)
    assert chosen == eps[:2]  # started ones first, in order; nobody fresh fits beside them
    assert kvbudget.held(eps[2]) is not None  # kept: it fits beside the turn
    chosen = kvbudget.schedule(eps, proto, needs[0] + needs[1])
    assert chosen == eps[:2] and kvbudget.held(eps[2]) is None  # dropped: it re-prefills when it runs


@pytest.mark.parametrize("size", ["3b", "7b"])
def test_the_presets_fit_the_long_script_under_90_percent(size):
    """results/memory_long.json is `python -m perf.ledger --script long --json results/memory_long.json` of the
    presets as they are (their memory fields), and both peak under 90% of 80 GiB."""
    from perf import ledger
    from perf import memprobe
    saved = json.load(open(os.path.join(ROOT, "results", "memory_long.json")))[size]
    cfg = memprobe.step_config(os.path.join(ROOT, ledger.PRESETS[size]))
    assert saved["config"] == json.loads(json.dumps(ledger.config_of(cfg)))
    assert saved["config"]["kv_budget_gib"] > 0 and saved["script"]["name"] == "long"
    assert saved["peak_gib"] <= 0.9 * saved["gpu_gib"], saved["peak_gib"]


