"""methods/baselines.py: each formula and advantage against a hand computation or exact enumeration on a small setting,
the trees' structure and keys on the tiny world, and two training steps + exact resume for every method."""
import itertools
import json
import math
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from methods import baselines
import credit
import eval as qa_eval
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
    adv, stats = baselines.GiGPO(cfg).turn_advantages(None, 0, eps, None)
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
    adv, _ = baselines.HGPO(cfg).turn_advantages(None, 0, eps, None)
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
        adv, stats = baselines.VinePPO(cfg).turn_advantages(run, 0, [ep], None)
        v = np.array(outcomes).reshape(3, 2).mean(1)
        np.testing.assert_allclose(adv[0], [v[1] - v[0], v[2] - v[1], 1 - v[2]])  # by hand
        assert stats["aux_tokens"] == 60
        prob = np.prod([p[n // 2] if o else 1 - p[n // 2] for n, o in enumerate(outcomes)])
        mean += prob * adv[0]
    np.testing.assert_allclose(mean, [0.3, 0.3, 0.1], atol=1e-12)


def test_tree_grpo_and_shared_prefix_advantages_by_hand():
    a = baselines.tree_grpo_advantages([1, 0, 1, 1], [0, 0, 1, 1], [0, 0, 0, 0])
    intra = [0.5 / np.std([1.0, 0.0], ddof=1), -0.5 / np.std([1.0, 0.0], ddof=1), 0.0, 0.0]
    inter = (np.array([1, 0, 1, 1]) - 0.75) / np.std([1, 0, 1, 1], ddof=1)
    np.testing.assert_allclose(a, np.array(intra) + inter, rtol=1e-5)
    # leaf 1 branched from leaf 0 at turn 1: turn 0 is shared, so both rows carry the mean there
    out = baselines.shared_prefix_advantages([2.0, -1.0], [[(0, 0), (0, 1)], [(0, 0), (1, 1)]])
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
    method = baselines.ARPO(cfg)
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
    method = baselines.TreeGRPO(cfg)
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
def resumed_rows(common: list, tmp_path) -> list:
    """Two steps straight, and one step then a resume for the second: the metrics rows of both (times left out),
    asserted equal; returns them."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    tt.main(tt.parse_config([*common, f"--out_dir={a}", "--steps=2"]))
    tt.main(tt.parse_config([*common, f"--out_dir={b}", "--steps=1"]))
    tt.main(tt.parse_config([*common, f"--out_dir={b}", "--steps=2", f"--resume={b}/step_000001"]))
    rows = {}
    for out in (a, b):
        lines = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        rows[out] = [{k: v for k, v in r.items() if not k.startswith("time")} for r in lines if not r.get("final")]
    assert rows[a] == rows[b] and len(rows[a]) == 2
    return rows[a]


@pytest.mark.parametrize("method", BASELINES)
def test_two_steps_and_exact_resume(tiny_world, tmp_path, method):
    rows = resumed_rows([f"--world={tiny_world}", *TINY, f"--method={method}", "--eval_every=0"], tmp_path)
    for r in rows:
        assert r["factual_tokens"] > 0 and "aux_tokens" in r
        assert (r["aux_tokens"] > 0) == (method in ("independent", "vineppo"))


# --- the formulas, by hand ---
S3 = math.sqrt(1 / 3)  # the ddof=1 std of {1, 0, 0, 1} and of {1, 0, 0}


def test_returns_mc_vineppo():
    np.testing.assert_allclose(baselines.discounted_returns([0, 0, 1], 0.9), [0.81, 0.9, 1.0])
    np.testing.assert_allclose(baselines.mc_value([[1, 0, 1, 1], [0, 0, 0, 1]]), [0.75, 0.25])
    a = baselines.vineppo_advantages([0.5, 0.25, 0.75], 1.0)
    np.testing.assert_allclose(a, [-0.25, 0.5, 0.25])
    assert a.sum() == pytest.approx(1.0 - 0.5)


def test_gigpo():
    keys = [("p0", "results-page")] * 3 + [("p0", "home")]  # the seed's WebShop example + a singleton
    R = [1.0, 0.73, 0.0, 0.9]
    mean = 1.73 / 3
    np.testing.assert_allclose(baselines.gigpo_step_advantages(keys, R, "none"), [1 - mean, 0.73 - mean, -mean, 0])
    std = math.sqrt(((1 - mean) ** 2 + (0.73 - mean) ** 2 + mean ** 2) / 2)
    np.testing.assert_allclose(baselines.gigpo_step_advantages(keys, R), [(1 - mean) / (std + 1e-6),
                               (0.73 - mean) / (std + 1e-6), -mean / (std + 1e-6), 0.0])
    np.testing.assert_allclose(baselines.gigpo_combine([0.5, -0.5], [1.0, 2.0], 0.5), [1.0, 0.5])
    with pytest.raises(ValueError):
        baselines.gigpo_step_advantages(keys, R, "mad")


def test_hgpo():
    assert baselines.hgpo_context_keys(["a", "b", "c"], 1) == [[("a",), ("b",), ("c",)],
                                                           [("a",), ("a", "b"), ("b", "c")]]
    lv0 = ["s"] * 4
    lv1 = [("a", "s"), ("a", "s"), ("b", "s"), ("c", "s")]  # steps 2, 3 have no peer at level 1
    a = baselines.hgpo_advantages([lv0, lv1], [1.0, 0.0, 1.0, 0.0], alpha=1.0)
    a0 = 0.5 / (S3 + 1e-6)                      # level 0: {1, 0, 1, 0}
    a1 = 0.5 / (math.sqrt(0.5) + 1e-6)          # level 1: {1, 0}
    np.testing.assert_allclose(a, [(a0 + 2 * a1) / 3, -(a0 + 2 * a1) / 3, a0, -a0], rtol=1e-12)
    np.testing.assert_array_equal(baselines.hgpo_advantages([["x", "y"]], [1.0, 0.0]), [0.0, 0.0])


def test_igpo():
    lps = [[-4.0, -1.5], [-2.0, -3.2, -3.0]]  # IG: [2.5] and [-1.2, 0.2]
    np.testing.assert_allclose(baselines.igpo_turn_rewards(lps[1], 0.0), [-1.2, 0.2, 0.0])
    adv = baselines.igpo_advantages(lps, [1.0, 0.0], ["g", "g"], gamma=0.5)
    ig_sd = math.sqrt((2.0 ** 2 + 1.7 ** 2 + 0.3 ** 2) / 2)  # pooled IG {2.5, -1.2, 0.2}, mean 0.5
    o = 0.5 / (math.sqrt(0.5) + 1e-6)                         # outcomes {1, 0}
    ig = np.array([2.0, -1.7, -0.3]) / (ig_sd + 1e-6)
    np.testing.assert_allclose(adv[0], [ig[0] + 0.5 * o, o], rtol=1e-12)
    np.testing.assert_allclose(adv[1], [ig[1] + 0.5 * ig[2] + 0.25 * -o, ig[2] + 0.5 * -o, -o], rtol=1e-12)
    single = baselines.igpo_advantages([[-1.0]], [1.0], [0])  # one turn, singleton group
    np.testing.assert_array_equal(single[0], [0.0])


def test_arpo():
    paths = [["root", "x"], ["root", "y", "y1"], ["root", "y", "y2"]]
    adv = baselines.arpo_advantages([1.0, 0.0, 1.0], paths)
    hi, lo = (1 / 3) / (S3 + 1e-6), -(2 / 3) / (S3 + 1e-6)
    np.testing.assert_allclose(adv[0], [0.0, hi], atol=1e-12)                  # root shared by all: mean is 0
    np.testing.assert_allclose(adv[1], [0.0, (lo + hi) / 2, lo], atol=1e-12)   # y shared by trajectories 1, 2
    np.testing.assert_allclose(adv[2], [0.0, (lo + hi) / 2, hi], atol=1e-12)
    H0, V = 1.0, 100
    branch = baselines.arpo_branch([1.0, 1.0 + 0.3 * math.log(V)], H0, alpha=0.4, beta=0.5, tau=0.5, vocab_size=V)
    np.testing.assert_array_equal(branch, [False, True])  # P = 0.4 and 0.55


def test_craft():
    A = np.array([1.0, -1.0, 0.5])
    gaps = np.array([[0.0, np.nan], [math.log(3), 2.0], [0.0, -1.0]])  # rollout 0 has no turn 1
    c = baselines.craft_token_importance(gaps, A)
    # i=0: siblings 1, 2 weighted 3:1 -> (-3 + 0.5)/4 - (-0.25); i=1: 1:1 -> 0; i=2: siblings 0, 1 at 1:3 -> -0.5 - 0
    np.testing.assert_allclose(c[:, 0], [-0.375, 0.0, -0.5], atol=1e-12)
    np.testing.assert_array_equal(c[:, 1], [0.0, 0.0, 0.0])  # a single sibling: tilting cannot move its mean
    np.testing.assert_allclose(baselines.craft_token_importance(gaps, A, beta=0.0), 0.0, atol=1e-15)
    with pytest.raises(ValueError):
        baselines.craft_token_importance(gaps[:2], A)
