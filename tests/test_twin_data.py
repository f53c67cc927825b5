"""Tests for twins as training rows (twin_data), late branching (twin_from_turn) and the twin term's share of the
gradient (DESIGN.md section 5): a twin's row trains only its own turns, with weight 1/q_t; its advantage is the one it
would have at q = 1 (no baseline or scale depends on which twins were drawn), so over the keyed branch draws the
weighted rows sum to every decision's twin; the trainer runs with them and logs twin_rows and twin_grad_share."""
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_train import read_metrics, tiny_cfg

import credit
import eval as qa_eval
import methods
import rollout
import sampler
import train_twice as tt
import twice
from generation import logprobs


def test_the_line_out_baseline_leaves_the_own_line_out_and_agreeing_groups_stay_finite():
    fact, rows = credit.line_out_advantages([0, 0, 0, 0, 0, 1, 0, 1, 0, 0], 5, [(1, 1.0), (6, 1.0), (6, 0.0)])
    s = np.std([1, 0, 1, 0, 0], ddof=1)
    np.testing.assert_allclose(fact[5:], (np.array([1, 0, 1, 0, 0]) - np.array([1, 2, 1, 2, 2]) / 4) / s, atol=1e-5)
    assert np.all(fact[:5] == 0)  # the lines of an agreeing group: U equals every other line's
    # a twin of line 6 is scored against lines 5, 7, 8, 9 only; a twin in the all-fail group takes the batch's scale
    np.testing.assert_allclose(rows, [1 / s, (1 - 0.5) / s, -0.5 / s], atol=1e-5)
    # a row's advantage does not depend on the other rows (the q = 1 value whatever was drawn)
    _, alone = credit.line_out_advantages([0, 0, 0, 0, 0, 1, 0, 1, 0, 0], 5, [(6, 0.0)])
    assert alone[0] == rows[2]
    _, lone = credit.line_out_advantages([1] * 5, 5, [(2, 0.0)])
    assert lone[0] == pytest.approx(-1.0, abs=1e-5)  # no group with a spread: scale 1
    with pytest.raises(ValueError, match="group_size >= 2"):
        credit.line_out_advantages([1.0], 1)


def make_run(cfg):
    policy, tok = qa_eval.load_policy(cfg.model)
    return SimpleNamespace(accel=SimpleNamespace(num_processes=1, unwrap_model=lambda m: m), policy=policy, tok=tok,
                           retriever=qa_eval.load_retriever(cfg.index, ""), method=methods.make(cfg),
                           predictor=credit.DiscordancePredictor(), sigma_hat=credit.RunningScale(mode="rms"))


@pytest.fixture(scope="module")
def every_twin(tiny_world):
    """Factual episodes of 6 prompts and the twin of every decision (q = 1), under the test-scale tiny policy; it
    answers next to nothing right, so the outcomes are drawn at random (rows and advantages see only outcomes)."""
    cfg = tiny_cfg(tiny_world, "unused", "--twin_data=true")
    run = make_run(cfg)
    proto = tt.protocol.protocol_from(cfg)
    eps = rollout.run_episodes(run.policy, run.tok, run.retriever, rollout.start_episodes(
        run.tok, qa_eval.load_qa(cfg.train_data)[:6], cfg.seed, 0, cfg.group_size), proto)
    decisions = twice.decision_table(cfg, eps)
    pairs, twins, _ = twice.roll_twins(cfg, run, eps, decisions, np.ones(len(decisions.index), bool), proto)
    rng = np.random.default_rng(3)
    for ep in eps:
        ep.reward = float(rng.random() < 0.4)
    for (n, _), tw in zip(pairs, twins):
        if tw.kind == "rollout":
            tw.twin.reward = tw.outcome = float(rng.random() < 0.4)
            tw.diff = eps[decisions.index[n][0]].reward - tw.outcome
    return cfg, run, eps, decisions, pairs, twins


def test_a_twin_row_trains_its_own_turns_only(every_twin):
    cfg, run, eps, decisions, pairs, twins = every_twin
    q = np.full(len(decisions.index), 0.5)
    assert {tw.kind for tw in twins} <= {"self", "rollout"}  # no same-evidence shortcut with twin_data
    # a self-twin (y' = y_t: the same keys give the factual tokens) of the last decision
    n, _ = pairs[-1]
    i, t = decisions.index[n]
    twins = twins[:-1] + [rollout.TwinResult(len(pairs) - 1, t, 0, "self", eps[i].reward, 0.0, 0, twins[-1].twin)]
    rows, row_adv, weights, _, _ = twice.data_rows(cfg, eps, decisions, pairs, twins, q, 1.0)
    assert weights == [2.0] * len(rows)
    for (n, _), tw, row, adv in zip(pairs, twins, rows, row_adv):
        i, t = decisions.index[n]
        start = row.turns[t].start
        assert sum(row.mask[:start]) == 0 and row.mask[start:] == (eps[i].mask if tw.kind == "self" else
                                                                   tw.twin.mask)[start:]
        assert row.ids[:start] == eps[i].ids[:start]  # the shared prefix is the factual line's
        if tw.kind == "self":
            assert row.ids == eps[i].ids and row.reward == eps[i].reward and adv[t] == adv[-1]
        else:  # the mirrored pair credit on turn t: omega clip(-D / sigma, +-cap)
            assert adv[t] - adv[-1 if t < len(adv) - 1 else t] == pytest.approx(
                float(np.clip(-tw.diff, -cfg.twin_cap, cfg.twin_cap))) or t == len(adv) - 1
    batch = twice.joined_batch(cfg, run, eps + rows, weights, "cpu")
    mask = batch["loss_mask"]
    assert mask.dtype == torch.float32 and torch.equal(mask[:len(eps)], mask[:len(eps)].round())
    assert set(mask[len(eps):].unique().tolist()) == {0.0, 2.0}  # the rows' weight 1 / q on their own tokens


def test_weighted_rows_over_the_branch_draws_sum_to_every_decisions_twin(every_twin):
    """Keyed branch draws at q_t in [0.1, 1]: each drawn row has the advantages it has at q = 1, and the weighted sum
    of the rows' (advantage x loss weight) over 1,500 draws is within 4 standard errors of the q = 1 sum."""
    cfg, run, eps, decisions, pairs, twins = every_twin
    n_dec = len(decisions.index)
    q = np.random.default_rng(0).uniform(0.1, 1.0, n_dec)

    def rows_sum(keep, qq):
        chosen = [k for k, (n, _) in enumerate(pairs) if keep[n]]
        rows, adv, w, a_traj, _ = twice.data_rows(cfg, eps, decisions, [pairs[k] for k in chosen],
                                                  [twins[k] for k in chosen], qq, 1.0)
        per = np.zeros(len(pairs))
        for k, row, a, wk in zip(chosen, rows, adv, w):
            spans = rollout.turn_spans([row])[0]
            per[k] = wk * sum(a[t] * sum(row.mask[s - len(row.prompt_ids):e - len(row.prompt_ids)])
                              for t, (s, e) in enumerate(spans))
        return per, a_traj

    full, a_full = rows_sum(np.ones(n_dec, bool), np.ones(n_dec))
    assert np.abs(full).sum() > 0
    draws = []
    for s in range(1500):
        keep = np.array([sampler.branch_uniform(0, s, i, 0, 0) for i in range(n_dec)]) < q
        per, a_traj = rows_sum(keep, q)
        np.testing.assert_array_equal(a_traj, a_full)  # the factual lines' A_traj: the same at every draw
        draws.append(per)
    draws = np.array(draws)
    se = draws.std(0) / np.sqrt(len(draws)) + 1e-12
    assert np.all(np.abs(draws.mean(0) - full) <= 4 * se + 1e-9)
    assert abs(draws.sum(1).mean() - full.sum()) <= 4 * draws.sum(1).std() / np.sqrt(len(draws))


def test_late_branching_twins_only_late_decisions_and_costs_a_suffix(every_twin):
    cfg, run, eps, decisions, pairs, twins = every_twin
    late = tiny_cfg(os.path.dirname(cfg.index), "unused", "--twin_data=true", "--twin_from_turn=1")
    table = twice.decision_table(late, eps)
    assert [x for x in decisions.index if x[1] >= 1] == table.index and len(table.index) < len(decisions.index)
    keep = [n for n, x in enumerate(decisions.index) if x[1] >= 1]
    np.testing.assert_array_equal(table.cost, decisions.cost[keep])
    assert table.cost.mean() < decisions.cost.mean()  # a twin from a later turn regenerates less


def test_gradient_share_is_linear_in_the_part(every_twin):
    cfg, run, eps, *_ = every_twin
    batch = rollout.collate(eps, run.tok.pad_token_id)
    whole = torch.randn(batch["input_ids"].shape[0], batch["input_ids"].shape[1] - 1)
    share = [logprobs.gradient_share(run.policy, batch, part, whole, 1.0, 8)
             for part in (whole, 2 * whole, 0 * whole)]
    assert share[0] == pytest.approx(1.0, rel=1e-4) and share[1] == pytest.approx(2.0, rel=1e-4) and share[2] == 0
    assert all(p.grad is None for p in run.policy.parameters())  # a diagnostic: no .grad touched


def test_the_trainer_trains_on_twin_rows_and_logs_them(tiny_world, tmp_path):
    out = str(tmp_path / "data")
    tt.main(tiny_cfg(tiny_world, out, "--steps=2", "--twin_data=true", "--omega=0"))
    rows = [r for r in read_metrics(out) if "twin_rows" in r]
    assert len(rows) == 2 and all(r["twin_rows"] > 0 for r in rows)
    # omega = 0 with twin_data: pure data (no pair credit), not GRPO
    assert all(r["twin_term_max"] == 0 and r["twin_grad_share"] == 0 for r in rows)
    out2 = str(tmp_path / "credit")  # the committed tiny world's policy answers some: discordant twins
    committed = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "worlds", "tiny-0")
    tt.main(tiny_cfg(committed, out2, "--steps=1", "--twin_data=true"))
    r = [r for r in read_metrics(out2) if "twin_rows" in r][0]
    assert r["twin_rows"] > 0 and 0 < r["twin_grad_share"] < 1 and 0 < r["twin_term_max"] <= 2.0
    out3 = str(tmp_path / "quiet")  # the diagnostic changes no trained number
    tt.main(tiny_cfg(committed, out3, "--steps=1", "--twin_data=true", "--log_grad_share=false"))
    quiet = read_metrics(out3)
    assert "twin_grad_share" not in quiet[0] and all(
        quiet[k].get(f) == read_metrics(out2)[k].get(f) for k in (0, 1) for f in ("loss", "weight_norm", "eval_em"))
    census = [r[k] for k in twice.CENSUS]  # every discordant twin in one cell; an agreeing group's are all one sign
    assert sum(census) == r["discordant"] > 0
    with pytest.raises(ValueError, match="twin_data=True .must be twice's turn unit, coupled"):
        tt.parse_config(["--twin_data=true", "--twin_unit=token"])
    assert tt.parse_config(["--twin_data=true", "--omega=0"]).method == "twice"
    assert tt.parse_config(["--omega=0"]).method == "grpo"
