"""Tests for the bounded twin term and the control variate (DESIGN.md section 5): the twin term of any token is at most
omega x twin_cap whatever D and q are (and without the cap it is not), the logged twin_term_max says so; the control
variate's credit is unbiased for every baseline and has less variance where the baseline predicts D; a budget below
q_min is refused."""
from types import SimpleNamespace

import numpy as np
import pytest
from test_train import tiny_cfg

import credit
import eval as qa_eval
import methods
import rollout
import sampler
import train_twice as tt
import twice


def test_the_cap_bounds_every_term_and_zero_is_no_cap():
    rng = np.random.default_rng(0)
    a_hat = [rng.choice([-1, 0, 1], 4) / rng.choice([0.05, 0.3, 1.0], 4) for _ in range(50)]  # D / q: up to 20
    a_traj = rng.normal(size=50)
    for cap, omega in ((2.0, 1.0), (1.0, 0.5)):
        adv = credit.turn_advantages(a_traj, a_hat, omega, 0.5, cap)
        assert max(np.abs(row - a).max() for row, a in zip(adv, a_traj)) == pytest.approx(omega * cap)
    free = credit.turn_advantages(a_traj, a_hat, 1.0, 0.5)
    assert max(np.abs(row - a).max() for row, a in zip(free, a_traj)) == pytest.approx(40.0)
    assert np.array_equal(credit.capped([3.0, -0.5], 0.0), [3.0, -0.5])


def test_the_control_variate_is_unbiased_for_any_baseline_and_smaller_where_it_predicts():
    rng = np.random.default_rng(1)
    n = 400
    d = rng.choice([-1.0, 0.0, 1.0], n, p=[0.2, 0.6, 0.2])
    q = rng.uniform(0.05, 1.0, n)
    for g in (np.zeros(n), rng.uniform(-1, 1, n), 0.8 * d):
        on = credit.ht_credit(d[:, None], np.ones(n, bool), q, g)
        off = credit.ht_credit(d[:, None], np.zeros(n, bool), q, g)
        np.testing.assert_allclose(q * on + (1 - q) * off, d, atol=1e-12)  # E over the branch draw, exactly
        var = q * (on - d) ** 2 + (1 - q) * (off - d) ** 2
        np.testing.assert_allclose(var, (d - g) ** 2 * (1 / q - 1), atol=1e-9)
    # keyed branch draws (as the trainer draws them): the mean over 2,000 draws is within 4 standard errors of D
    draws = np.array([[sampler.branch_uniform(0, s, i, 0, 0) for i in range(n)] for s in range(2000)])
    g = 0.8 * d
    est = np.array([credit.ht_credit(d[:, None], u < q, q, g) for u in draws])
    se = est.std(0) / np.sqrt(len(draws)) + 1e-12
    assert np.all(np.abs(est.mean(0) - d) <= 4 * se + 1e-9)
    plain = np.array([credit.ht_credit(d[:, None], u < q, q) for u in draws])
    assert est.var(0).sum() < 0.1 * plain.var(0).sum()  # g = 0.8 D: (0.2)^2 of the plain variance
    assert np.array_equal(credit.control_baseline([1, 0, 1], [0.5, 0.25, 0.0]), [0.5, -0.25, 0.0])


def test_config_refuses_a_budget_below_q_min_and_a_token_unit_control_variate():
    with pytest.raises(ValueError, match="twin_budget=0.01 .must be >= q_min"):
        tt.parse_config(["--twin_budget=0.01"])
    with pytest.raises(ValueError, match="control_variate=True .must be turn unit only"):
        tt.parse_config(["--control_variate=true", "--twin_unit=token"])
    with pytest.raises(ValueError, match="twin_cap=-1.0"):
        tt.parse_config(["--twin_cap=-1"])


@pytest.mark.parametrize("unit", ["turn", "token"])
def test_at_the_q_min_floor_the_logged_term_stays_under_omega_cap(tiny_world, monkeypatch, unit):
    """Every twin's D forced to +-1 at the floor budget (q_t = q_min: A_hat = +-20): the applied twin term of every
    token is at most omega x twin_cap and twin_term_max says so; with twin_cap = 0 it is far above."""
    got = {}
    for cap in (2.0, 0.0):
        cfg = tiny_cfg(tiny_world, "unused", f"--twin_unit={unit}", "--twin_budget=0.05", "--omega=0.5",
                       f"--twin_cap={cap}", "--twin_scale=d")
        policy, tok = qa_eval.load_policy(cfg.model)
        run = SimpleNamespace(accel=SimpleNamespace(num_processes=1, unwrap_model=lambda m: m), policy=policy,
                              tok=tok, retriever=qa_eval.load_retriever(cfg.index, ""), method=methods.make(cfg),
                              predictor=credit.DiscordancePredictor(),
                              token_predictor=credit.DiscordancePredictor(features=__import__("forks").TOKEN_FEATURES),
                              sigma_hat=credit.RunningScale(mode="d"))
        run.sigma_hat.update_d(0.25)  # sigma_hat 0.5: |A_hat / sigma| = 40 at q_min
        proto = tt.protocol.protocol_from(cfg)
        eps = rollout.run_episodes(policy, tok, run.retriever, rollout.start_episodes(
            tok, qa_eval.load_qa(cfg.train_data)[:4], cfg.seed, 0, cfg.group_size), proto)
        real = rollout.run_twins

        def forced(*args, **kw):
            out = real(*args, **kw)
            for x in out:
                x.diff = 1.0 if x.turn % 2 == 0 else -1.0
            return out
        monkeypatch.setattr(rollout, "run_twins", forced)
        batch = rollout.collate(eps, tok.pad_token_id)
        credit_fn = twice.token_twin_credit if unit == "token" else twice.twin_credit
        adv, stats = credit_fn(cfg, run, 0, eps, batch, proto)
        monkeypatch.undo()
        a_traj = run.method.trajectory_advantages(eps)
        traj = credit.spread_over_tokens([np.full(len(ep.turns), a) for ep, a in zip(eps, a_traj)],
                                         rollout.turn_spans(eps), adv.shape[1])
        logged = twice.term_stats(run.accel, stats["terms"])
        got[cap] = (np.abs(adv - traj).max(), logged)
        assert logged["twin_budget_effective"] >= cfg.twin_budget  # the floor: at least what was asked
        assert logged["a_traj_max"] == pytest.approx(np.abs(a_traj).max())
    (capped, log_c), (free, log_f) = got[2.0], got[0.0]
    assert capped == pytest.approx(0.5 * 2.0) and log_c["twin_term_max"] == pytest.approx(0.5 * 2.0)
    assert log_c["twin_capped"] > 0 and 0 < log_c["twin_adv_share"] <= log_f["twin_adv_share"] <= 1
    assert free > 10 and log_f["twin_term_max"] == pytest.approx(free) and log_f["twin_capped"] == 0
