"""methods/oracle.py, the ceiling arm: its credit is the audit's A* key for key on the tiny world, its token advantages
are TWICE's step 6 with A_hat = A*, its rollouts are logged but not charged to the token budget, and it trains and
resumes exactly."""
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lab import audit
from methods import oracle
import credit
import eval as qa_eval
import protocol
import rollout
import train_twice as tt
from test_baselines import resumed_rows

TINY = ["--prompts_per_step=2", "--group_size=3", "--max_new_tokens=24", "--max_obs_tokens=200", "--max_turns=2",
        "--max_context=768", "--lr=1e-4", "--micro_batch_size=6", "--gen_batch_size=32", "--eval_data=",
        "--log_tensorboard=false", "--method=oracle", "--oracle_rollouts=4"]


COMMITTED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "worlds", "tiny-0")


@pytest.fixture(scope="module")
def setting():
    """The committed tiny world (its warm start succeeds half the time: credit to find), two prompts x 3 lines."""
    torch.set_num_threads(1)
    cfg = tt.parse_config([f"--world={COMMITTED}", *TINY])
    policy, tok = qa_eval.load_policy(cfg.model, "cpu", torch.float32)
    policy.eval()
    accel = SimpleNamespace(unwrap_model=lambda m: m, num_processes=1)
    run = SimpleNamespace(accel=accel, policy=policy, tok=tok, retriever=qa_eval.load_retriever(cfg.index),
                          sigma_hat=credit.RunningScale(cfg.scale_decay, cfg.twin_scale))
    rows = qa_eval.load_qa(cfg.train_data)[:cfg.prompts_per_step]
    proto = protocol.protocol_from(cfg)
    with torch.no_grad():
        episodes = rollout.factual_episodes(policy, tok, run.retriever, rows, proto, cfg.seed, 0, cfg.group_size)
    return cfg, run, episodes, proto


def advantages(cfg, run, episodes, proto):
    run.sigma_hat = credit.RunningScale(cfg.scale_decay, cfg.twin_scale)
    batch = rollout.collate(episodes, run.tok.pad_token_id, cfg.max_context)
    with torch.no_grad():
        return oracle.Oracle(cfg).advantages(run, 0, episodes, batch, proto)


def test_credit_is_the_audits_a_star_key_for_key(setting):
    cfg, run, episodes, proto = setting
    decisions = [(i, t) for i, ep in enumerate(episodes) for t in range(len(ep.turns))]
    acfg = audit.Config(oracle_rollouts=cfg.oracle_rollouts, chunk=7, progress=False)  # other batches, same keys
    with torch.no_grad():
        want = audit.oracle(run.policy, run.tok, run.retriever, episodes, decisions, acfg, proto)
        per_turn, got = oracle.oracle_credit(run.policy, run.tok, run.retriever, episodes, cfg.oracle_rollouts, proto)
    for key in ("a", "se", "q", "v", "tokens"):
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    assert [len(a) for a in per_turn] == [len(ep.turns) for ep in episodes]
    np.testing.assert_array_equal(np.concatenate(per_turn), want["a"])
    assert np.any(want["a"] != 0), "a tiny-world batch with no credit anywhere tests nothing"
    for (i, t), q in zip(decisions, want["q"]):  # Q = U exactly where the turn ended the episode
        if t == len(episodes[i].turns) - 1:
            assert q == episodes[i].reward


@pytest.mark.parametrize("traj", [False, True])
def test_token_advantage_is_twice_step_6_with_the_exact_credit(setting, traj):
    cfg, run, episodes, proto = setting
    cfg = tt.parse_config([f"--world={cfg.world}", *TINY, f"--oracle_traj={traj}", "--omega=0.5", "--twin_cap=1.5"])
    adv, stats = advantages(cfg, run, episodes, proto)
    per_turn, est = oracle.oracle_credit(run.policy, run.tok, run.retriever, episodes, cfg.oracle_rollouts, proto)
    nonzero = est["a"][est["a"] != 0]
    sigma = float(np.sqrt(np.mean(nonzero ** 2)))
    a_traj = credit.grpo_advantages([ep.reward for ep in episodes], np.arange(len(episodes)) // cfg.group_size)
    for i, ep in enumerate(episodes):
        for t, turn in enumerate(ep.turns):
            term = np.clip(per_turn[i][t] / sigma, -1.5, 1.5)
            want = a_traj[i] + 0.5 * term if traj else term
            start = len(ep.prompt_ids) + turn.start
            np.testing.assert_allclose(adv[i, start:len(ep.prompt_ids) + turn.end], want)
    assert stats["aux_tokens"] == 0 and stats["oracle_tokens"] == int(est["tokens"].sum()) > 0
    assert stats["oracle_continuations"] == 2 * cfg.oracle_rollouts * len(est["a"])
    assert ("twin_adv" in stats) == traj
    if traj:  # the oracle term alone: what the gradient share is logged of
        np.testing.assert_allclose(stats["twin_adv"], adv - credit.spread_over_tokens(
            [np.full(len(ep.turns), a) for ep, a in zip(episodes, a_traj)], rollout.turn_spans(episodes),
            adv.shape[1]))


def test_two_steps_resume_exactly_and_charge_only_factual_tokens(tmp_path):
    rows = resumed_rows([f"--world={COMMITTED}", *TINY, "--eval_every=0", "--oracle_traj=true"], tmp_path)
    assert rows[1]["tokens"] == rows[0]["factual_tokens"] + rows[1]["factual_tokens"]  # not charged
    for r in rows:
        assert r["aux_tokens"] == 0 and r["oracle_tokens"] > 0 and r["oracle_se"] > 0
        assert r["oracle_token_ratio"] == pytest.approx(r["oracle_tokens"] / r["factual_tokens"])


def test_knobs_are_checked():
    with pytest.raises(ValueError, match="oracle_rollouts"):
        tt.parse_config(["--method=oracle", "--oracle_rollouts=0"])
    with pytest.raises(ValueError, match="twin_scale"):
        tt.parse_config(["--method=oracle", "--twin_scale=d"])
    tt.parse_config(["--method=grpo", "--oracle_rollouts=0"])  # read by the oracle alone
