"""methods.py baselines (issue 12): each advantage against a hand computation or exact enumeration on a small
setting, the trees' structure and keys on the tiny world, and two training steps + exact resume for every method."""
import itertools
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import credit
import eval as qa_eval
import methods
import protocol
import rollout
import sampler
import train_twice as tt

TINY = ["--prompts_per_step=2", "--group_size=3", "--max_new_tokens=24", "--max_obs_tokens=200", "--max_turns=2",
        "--max_context=768", "--lr=1e-4", "--micro_batch_size=6", "--gen_batch_size=32", "--eval_data=",
        "--log_tensorboard=false", "--vine_k=2"]
BASELINES = ("independent", "vineppo", "gigpo", "hgpo", "arpo", "tree_grpo")


def cfg_of(*extra, world="data/tinyworld"):
    return tt.parse_config([f"--world={world}", *TINY, *extra])


def fake_turn(action="search", doc_ids=(), obs=True, start=0, n=3):
    return rollout.Turn(start, start + n, start + n, start + n + (5 if obs else 0), "", action, "", tuple(doc_ids),
                        [0.0] * n, [1.0] * n, 0, "stop")


def fake_episode(uid, line, observations, reward):
    """An episode whose turn t showed observations[t] (a tuple of ids, "invalid", or None for a final answer)."""
    turns = [fake_turn("answer" if o is None else "search" if o != "invalid" else None,
                       o if isinstance(o, tuple) else (), o is not None, start=8 * t)
             for t, o in enumerate(observations)]
    return rollout.Episode(uid=uid, line=line, key=sampler.mix(uid, line), question="q", golden_answers=["a"],
                           prompt_ids=[1], turns=turns, reward=float(reward), done=True)


# --- pure advantages on hand-built episodes ---
def test_gigpo_anchor_groups_and_advantage_by_hand():
    """Lines 0 and 1 retrieve the same ids at turn 0, so their turn-1 steps share an anchor state; line 2 does not."""
    cfg = cfg_of("--group_size=3", "--step_gamma=0.5", "--omega=2")
    eps = [fake_episode(7, 0, [("d1", "d2"), None], 1), fake_episode(7, 1, [("d1", "d2"), None], 0),
           fake_episode(7, 2, [("d3",), ("d1", "d2"), None], 1)]
    states = [rollout.evidence_states(ep) for ep in eps]
    assert states[0] == states[1] == [(7, ()), (7, (("d1", "d2"),))]
    assert states[2][1] == (7, (("d3",),)) and states[2][2] == (7, (("d3",), ("d1", "d2")))
    adv, stats = methods.GiGPO(cfg).turn_advantages(None, 0, eps, None)
    assert stats == {"aux_tokens": 0, "anchor_groups": 4}
    a_ep = credit.grpo_advantages([1, 0, 1], [0, 0, 0])  # (1/3, -2/3, 1/3) / std
    # turn 0 (one anchor of 3): returns 0.5 U, 0.5 U, 0.25 U = (0.5, 0, 0.25): mean 0.25, std 0.25
    # turn 1 of lines 0/1 (anchor of 2): returns (1, 0) -> +-0.5 / std(1, 0); line 2's later turns: singletons
    s2 = np.std([1.0, 0.0], ddof=1)
    expect = [[a_ep[0] + 2 * 0.25 / 0.25, a_ep[0] + 2 * 0.5 / s2],
              [a_ep[1] - 2 * 0.25 / 0.25, a_ep[1] - 2 * 0.5 / s2], [a_ep[2] + 0.0, a_ep[2], a_ep[2]]]
    for got, want in zip(adv, expect):
        np.testing.assert_allclose(got, want, rtol=1e-5)


def test_hgpo_levels_by_hand():
    """K = 1: level 0 groups by the last observation, level 1 by the last two states; weights (k + 1)^alpha."""
    cfg = cfg_of("--group_size=2", "--hgpo_k=1", "--hgpo_alpha=1", "--step_gamma=1", "--omega=1")
    # line 0: search A then answer; line 1: search B, search A, answer. Turn-1 of line 0 and turn-2 of line 1 both
    # follow observation A (level 0 shares them); their level-1 contexts differ ((start, A) vs (B, A)).
    eps = [fake_episode(3, 0, [("A",), None], 1), fake_episode(3, 1, [("B",), ("A",), None], 0)]
    adv, _ = methods.HGPO(cfg).turn_advantages(None, 0, eps, None)
    a_ep = credit.grpo_advantages([1, 0], [0, 0])
    d = 0.5 / np.std([1.0, 0.0], ddof=1)  # the normalised deviation of a pair with returns (1, 0)
    # turn 0 of both: level 0 and level 1 both the shared prompt state: A = +-d at both levels -> +-d
    # line 0 turn 1 / line 1 turn 2: level 0 shared (+-d, weight 1), level 1 singletons (left out) -> +-d
    # line 1 turn 1 (after B): singleton at every level -> 0
    np.testing.assert_allclose(adv[0], [a_ep[0] + d, a_ep[0] + d], rtol=1e-5)
    np.testing.assert_allclose(adv[1], [a_ep[1] - d, a_ep[1], a_ep[1] - d], rtol=1e-5)


def test_vineppo_is_the_mean_of_K_keyed_continuations_and_unbiased(monkeypatch):
    """A_t = V(s_{t+1}) - V(s_t) from K continuations keyed fresh_key(key, VINE_TAG, t, k); and, enumerating every
    outcome of K = 2 Bernoulli continuations per boundary, E[A_t] = p_{t+1} - p_t exactly (V(s_T) = U)."""
    cfg = cfg_of("--vine_k=2")
    ep = fake_episode(5, 0, [("x",), ("y",), None], 1)
    p = [0.3, 0.6, 0.9]  # true V(s_0), V(s_1), V(s_2)
    seeds = [sampler.fresh_key(ep.key, sampler.VINE_TAG, t, k) for t in range(3) for k in range(2)]
    run = SimpleNamespace(accel=SimpleNamespace(unwrap_model=lambda m: m), policy=None, tok=None, retriever=None)
    mean = np.zeros(3)
    for outcomes in itertools.product([0, 1], repeat=6):
        def fake(model, tok, retr, requests, proto, outcomes=outcomes):
            assert [(r[1], r[2], r[3]) for r in requests] == [(t, False, s) for t, s in zip([0, 0, 1, 1, 2, 2], seeds)]
            return [SimpleNamespace(reward=float(o), n_generated=10) for o in outcomes]
        monkeypatch.setattr(rollout, "continue_from", fake)
        adv, stats = methods.VinePPO(cfg).turn_advantages(run, 0, [ep], None)
        v = np.array(outcomes).reshape(3, 2).mean(1)
        np.testing.assert_allclose(adv[0], [v[1] - v[0], v[2] - v[1], 1 - v[2]])  # by hand
        assert stats["aux_tokens"] == 60
        prob = np.prod([p[n // 2] if o else 1 - p[n // 2] for n, o in enumerate(outcomes)])
        mean += prob * adv[0]
    np.testing.assert_allclose(mean, [0.3, 0.3, 0.1], atol=1e-12)


def test_tree_grpo_and_shared_prefix_advantages_by_hand():
    a = credit.tree_grpo_advantages([1, 0, 1, 1], [0, 0, 1, 1], [0, 0, 0, 0])
    intra = [0.5 / np.std([1.0, 0.0], ddof=1), -0.5 / np.std([1.0, 0.0], ddof=1), 0.0, 0.0]
    inter = (np.array([1, 0, 1, 1]) - 0.75) / np.std([1, 0, 1, 1], ddof=1)
    np.testing.assert_allclose(a, np.array(intra) + inter, rtol=1e-5)
    # leaf 1 branched from leaf 0 at turn 1: turn 0 is shared, so both rows carry the mean there
    out = credit.shared_prefix_advantages([2.0, -1.0], [[(0, 0), (0, 1)], [(0, 0), (1, 1)]])
    np.testing.assert_allclose(out[0], [0.5, 2.0])
    np.testing.assert_allclose(out[1], [0.5, -1.0])


# --- rollouts on the tiny world ---
@pytest.fixture(scope="module")
def world_run(tiny_world):
    torch.set_num_threads(1)
    policy, tok = qa_eval.load_policy(os.path.join(tiny_world, "policy"), "cpu", torch.float32)
    policy.eval()
    run = SimpleNamespace(accel=SimpleNamespace(unwrap_model=lambda m: m), policy=policy, tok=tok,
                          retriever=qa_eval.load_retriever(os.path.join(tiny_world, "index")))
    rows = qa_eval.load_qa(os.path.join(tiny_world, "train.jsonl"))[:3]
    return tiny_world, run, rows


def check_tree(method, episodes, G, n_prompts):
    """G leaves per prompt; every turn's segment is sampled by exactly one row (mask 1 there, 0 in the others);
    factual tokens = the tree's distinct sampled tokens; shared turns carry the mean of their leaves."""
    assert len(episodes) == G * n_prompts and len(method.paths) == len(episodes)
    owner = {}
    for n, (ep, path) in enumerate(zip(episodes, method.paths)):
        assert len(path) == len(ep.turns)
        for turn, seg in zip(ep.turns, path):
            sampled = ep.mask[turn.start:turn.end]
            if seg[1] == n % G:  # this leaf sampled the segment
                assert all(sampled) and seg not in owner
                owner[seg] = n
            else:
                assert not any(sampled)
    assert sum(ep.n_generated for ep in episodes) == sum(sum(ep.mask) for ep in episodes)
    assert len(owner) == len({seg for path in method.paths for seg in path})
    a_leaf = method.leaf_advantages(episodes)
    adv, stats = method.turn_advantages(None, 0, episodes, None)
    assert stats["aux_tokens"] == 0
    for seg, n in owner.items():
        leaves = [m for m, path in enumerate(method.paths) if seg in path]
        assert adv[n][method.paths[n].index(seg)] == pytest.approx(np.mean(a_leaf[leaves]))


def test_arpo_tree_budget_keys_and_prefix_credit(world_run):
    world, run, rows = world_run
    cfg = cfg_of("--group_size=5", "--arpo_tau=-1", "--arpo_beam=2", world=world)  # tau < alpha: every candidate fires
    method = methods.ARPO(cfg)
    episodes = method.rollout(run, 0, rows, protocol.protocol_from(cfg))
    check_tree(method, episodes, 5, len(rows))
    for p in range(len(rows)):
        tree = episodes[5 * p:5 * p + 5]
        assert [ep.line for ep in tree[:3]] == [0, 1, 2] and all(ep.branch_turn is None for ep in tree[:3])
        for ep in tree[3:]:
            if ep.branch_turn is not None:  # fresh keys from the branch turn on, derived from the parent's key
                t = ep.branch_turn
                assert ep.turns[t - 1].doc_ids, "ARPO branches right after a tool observation"
                assert ep.key_for(t) in {sampler.turn_key(sampler.fresh_key(ep.key, sampler.ARPO_TAG, t, z), t)
                                         for z in range(2)}
    assert method.rollout(run, 0, rows, protocol.protocol_from(cfg))[7].ids == episodes[7].ids  # reproducible


def test_tree_grpo_tree_budget_and_advantage(world_run):
    world, run, rows = world_run
    cfg = cfg_of("--group_size=5", "--tree_m=2", "--tree_l=2", world=world)
    method = methods.TreeGRPO(cfg)
    episodes = method.rollout(run, 0, rows, protocol.protocol_from(cfg))
    check_tree(method, episodes, 5, len(rows))
    assert method.branches == 3 * len(rows)
    assert [ep.line for ep in episodes[:2]] == [0, 1]  # roots are GRPO's lines 0 and 1 (same keys)
    trees = [m for _, m in method.tree_ids[:5]]
    assert trees[:2] == [0, 1] and trees[2:] == [0, 1, 0]  # expansion e grows tree e mod M
    r = np.array([ep.reward for ep in episodes[:5]])
    want = credit.grpo_advantages(r, trees) + credit.grpo_advantages(r, np.zeros(5))
    np.testing.assert_allclose(method.leaf_advantages(episodes)[:5], want)


def test_independent_twins_are_textbook(world_run):
    """method=independent: every twin rolled out with fresh keys for y' and after; coupling=False keeps D = 0 for
    self-twins (the old, partly coupled ablation)."""
    world, run, rows = world_run
    cfg = cfg_of(world=world)
    proto = protocol.protocol_from(cfg)
    eps = rollout.start_episodes(run.tok, rows, 0, 0, 3)
    rollout.run_episodes(run.policy, run.tok, run.retriever, eps, proto)
    requests = [(ep, t, 0) for ep in eps for t in range(len(ep.turns))]
    ind = rollout.run_twins(run.policy, run.tok, run.retriever, requests, proto, independent=True)
    old = rollout.run_twins(run.policy, run.tok, run.retriever, requests, proto, coupling=False)
    assert all(tw.kind == "rollout" for tw in ind)
    assert all(tw.diff == 0 and tw.outcome == ep.reward
               for (ep, _, _), tw in zip(requests, old) if tw.kind != "rollout")
    for (ep, t, j), tw in zip(requests, ind):
        seed = sampler.fresh_key(ep.key, sampler.INDEPENDENT_TAG, t, j)
        assert [tw.twin.key_for(u) for u in range(t, len(tw.twin.turns))] == \
               [sampler.turn_key(seed, u) for u in range(t, len(tw.twin.turns))]
        assert tw.tokens == tw.twin.n_generated > 0 and tw.diff == ep.reward - tw.twin.reward


# --- two training steps and exact resume, every method ---
@pytest.mark.parametrize("method", BASELINES)
def test_two_steps_and_exact_resume(tiny_world, tmp_path, method):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    common = [f"--world={tiny_world}", *TINY, f"--method={method}", "--eval_every=0"]
    tt.main(tt.parse_config([*common, f"--out_dir={a}", "--steps=2"]))
    tt.main(tt.parse_config([*common, f"--out_dir={b}", "--steps=1"]))
    tt.main(tt.parse_config([*common, f"--out_dir={b}", "--steps=2", f"--resume={b}/step_000001"]))
    rows = {}
    for out in (a, b):
        lines = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        rows[out] = [{k: v for k, v in r.items() if not k.startswith("time")} for r in lines if not r.get("final")]
    assert rows[a] == rows[b] and len(rows[a]) == 2
    for r in rows[a]:
        assert r["factual_tokens"] > 0 and "aux_tokens" in r
        assert (r["aux_tokens"] > 0) == (method in ("independent", "vineppo"))
