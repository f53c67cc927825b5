"""lab/gradaudit.py: the variance split adds up and recovers known components on a synthetic case, the cosines and the
leave-one-out reference by hand, and on the committed tiny world a draw redraws the credit of the same batch (draw 0
is training's credit; GRPO has one draw; the oracle arm's gradient is the raw A*'s over sigma_hat)."""
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lab import gradaudit
from methods import oracle
import credit
import eval as qa_eval
import protocol
import rollout
import train_twice as tt
from generation import logprobs

COMMITTED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "worlds", "tiny-0")
TINY = ["--prompts_per_step=2", "--group_size=3", "--max_new_tokens=24", "--max_obs_tokens=200", "--max_turns=2",
        "--max_context=768", "--micro_batch_size=6", "--gen_batch_size=32", "--eval_data=",
        "--log_tensorboard=false", "--oracle_rollouts=4"]


def test_variance_split_adds_up_and_recovers_known_components():
    rng = np.random.default_rng(0)
    B, R, d, su, se = 400, 4, 50, 0.5, 1.0
    mu = rng.normal(size=d)
    g = mu + su * rng.normal(size=(B, 1, d)) + se * rng.normal(size=(B, R, d))  # batch effect + credit noise
    v = gradaudit.variance_split(g)
    assert v["ss_total"] == pytest.approx(v["ss_batches"] + v["ss_draws"], rel=1e-12)  # the identity, exactly
    assert v["credit_noise"] == pytest.approx(d * se ** 2, rel=0.05)
    assert v["sampling"] == pytest.approx(d * su ** 2, rel=0.15)
    assert v["total"] == pytest.approx(d * (se ** 2 + su ** 2), rel=0.05)
    assert v["signal"] == pytest.approx(float(mu @ mu), rel=0.1)
    one = gradaudit.variance_split(g[:, :1])  # one draw: no credit noise can be told apart
    assert one["credit_noise"] == 0 and one["sampling"] == pytest.approx(d * (se ** 2 + su ** 2), rel=0.1)


def test_cosines_and_leave_one_out_reference_by_hand():
    raw = np.array([[[1.0, 0.0]], [[0.0, 1.0]], [[1.0, 1.0]]])  # (B=3, R=1, d=2)
    refs, half = gradaudit.references(raw)
    np.testing.assert_allclose(refs, [[0.5, 1.0], [1.0, 0.5], [0.5, 0.5]])
    assert half == pytest.approx(0.0)  # batch 0 against batch 1 (the third is left out of two halves of one)
    g = np.array([[[1.0, 2.0], [2.0, 1.0]], [[2.0, 1.0], [2.0, 1.0]], [[1.0, 1.0], [1.0, 1.0]]])
    assert gradaudit.cosine(np.array([1.0, 2.0]), refs[0]) == pytest.approx(1.0)
    assert gradaudit.cosine(np.array([2.0, 1.0]), refs[0]) == pytest.approx(0.8)
    c = gradaudit.cosines(g, refs)  # batch 0: (1.0 + 0.8) / 2; batches 1 and 2 lie along their references
    assert c["cos"] == pytest.approx(np.mean([0.9, 1.0, 1.0]))
    assert c["cos_mean_of_draws"] == pytest.approx(np.mean([gradaudit.cosine(np.array([1.5, 1.5]), refs[0]), 1, 1]))
    assert c["cos_se"] == pytest.approx(np.std([0.9, 1.0, 1.0], ddof=1) / np.sqrt(3))


def test_reference_cos_follows_spearman_brown():
    """Batches g* + noise of variance r |g*|^2 each: a mean of k has cos^2 = 1 / (1 + r / k) with g*."""
    rng = np.random.default_rng(1)
    d, B, r = 4000, 6, 3.0
    star = rng.normal(size=d)
    noise = np.sqrt(r * (star @ star) / d)
    got = []
    for _ in range(20):
        batches = star + noise * rng.normal(size=(B, d))
        half = gradaudit.cosine(batches[:3].mean(0), batches[3:].mean(0))  # two means of 3: rho = 1 / (1 + r / 3)
        got.append(gradaudit.reference_cos(half, B))
    assert np.mean(got) == pytest.approx(1 / np.sqrt(1 + r / (B - 1)), abs=0.02)
    assert np.isnan(gradaudit.reference_cos(0.0, B))


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    cfg = tt.parse_config([f"--world={COMMITTED}", *TINY])
    policy, tok = qa_eval.load_policy(cfg.model, "cpu", torch.float32)
    policy.eval()
    rows = qa_eval.load_qa(cfg.train_data)
    retriever = qa_eval.load_retriever(cfg.index)
    run = gradaudit.fresh_run(cfg, policy, tok, retriever, rows)
    with torch.no_grad():
        episodes = run.method.rollout(run, 0, rows[:2], protocol.protocol_from(cfg))
    return run, episodes


def config(*flags):
    return tt.parse_config([f"--world={COMMITTED}", *TINY, *flags])


def test_twice_draw_zero_is_trainings_credit_and_a_draw_redraws_it(tiny):
    run, episodes = tiny
    cfg = config("--method=twice", "--twin_budget=1", "--q_min=1", "--twin_cap=2")  # every decision branches
    grads, raw, spent = gradaudit.batch_gradients(cfg, run, 0, episodes, 2)
    assert len(grads) == 2 and raw == []
    fresh = gradaudit.fresh_run(cfg, run.policy, run.tok, run.retriever, run.rows)
    batch = rollout.collate(episodes, run.tok.pad_token_id, cfg.max_context)
    with torch.no_grad():
        adv, stats = fresh.method.advantages(fresh, 0, episodes, batch, protocol.protocol_from(cfg))
    assert spent[0] == sum(tw.tokens for tw in stats["twins"]) > 0  # the twins' generated tokens, draw 0's
    want = logprobs.policy_gradients(run.policy, batch, [torch.tensor(adv[:, 1:], dtype=torch.float32)],
                                     cfg.temperature, cfg.micro_batch_size)[0].double().numpy()
    np.testing.assert_allclose(grads[0], want / float(batch["loss_mask"][:, 1:].sum()), rtol=1e-6, atol=1e-12)
    assert not np.allclose(grads[0], grads[1]), "a second draw of y' changed no twin: nothing was redrawn"
    assert gradaudit.draws_of("grpo", 2) == 1 and gradaudit.draws_of("twice-turn-b0.7-w1-cap2", 2) == 2


def test_oracle_draws_and_the_reference_gradient(tiny):
    run, episodes = tiny
    cfg = config("--method=oracle", "--twin_cap=0")  # no clip: the arm's advantage is A* / sigma_hat exactly
    grads, raw, spent = gradaudit.batch_gradients(cfg, run, 0, episodes, 2)
    assert len(grads) == len(raw) == 2
    for g, r in zip(grads, raw):
        assert gradaudit.cosine(g, r) == pytest.approx(1.0, abs=1e-6)
    proto = protocol.protocol_from(cfg)
    first, _ = oracle.oracle_credit(run.policy, run.tok, run.retriever, episodes, 4, proto, 0)
    second, _ = oracle.oracle_credit(run.policy, run.tok, run.retriever, episodes, 4, proto, 1)
    eight, est = oracle.oracle_credit(run.policy, run.tok, run.retriever, episodes, 8, proto, 0)
    # draw 1 is rollouts 4..7: the first eight rollouts' mean is the two draws' mean, decision by decision
    np.testing.assert_allclose(np.concatenate(eight), (np.concatenate(first) + np.concatenate(second)) / 2,
                               atol=1e-12)
    assert not np.allclose(np.concatenate(first), np.concatenate(second))
    _, est1 = oracle.oracle_credit(run.policy, run.tok, run.retriever, episodes, 4, proto, 1)
    assert spent == [oracle.oracle_credit(run.policy, run.tok, run.retriever, episodes, 4, proto, 0)[1]["tokens"].sum(),
                     est1["tokens"].sum()]  # every rollout of A*, per draw


def test_the_frontier_rungs_are_audited_against_the_oracle_reference():
    # every rung reads as a run of luck-high's settings; the reference arm must be among them
    for label in gradaudit.FRONTIER:
        cfg = gradaudit.config_of("luck-high", label, "unused")
        assert cfg.method == label.split("-")[0] and cfg.steps > 0
    assert gradaudit.FRONTIER[-1] == "oracle-m16" and "twice-turn-q1-w1-cap2-solo-k16" in gradaudit.FRONTIER
    with pytest.raises(ValueError, match="the reference is oracle-m16's raw A"):
        gradaudit.run_audit("luck-high", "unused", "x", 3, 2, "unused", ["grpo", "oracle-m4"])
    assert gradaudit.aux_tokens({"twins": [SimpleNamespace(tokens=3), SimpleNamespace(tokens=4)]}) == 7
    assert gradaudit.aux_tokens({"aux_tokens": 0, "oracle_tokens": 90}) == 90
