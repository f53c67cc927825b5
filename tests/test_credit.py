"""Tests for credit.py: hand-computed values, exact enumeration, a statistical bound from the known variance."""
import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import credit

S3 = math.sqrt(1 / 3)  # the ddof=1 std of {1, 0, 0, 1} and of {1, 0, 0}


# ---------------------------------------------------------------------------------------------------------------
# GRPO trajectory advantage

def test_grpo_hand_two_groups_singleton_and_constant():
    rewards = [1, 1, 0, 0, 0, 0, 1, 0.1, 0.1, 0.1, 1]
    groups = ["a", "b", "a", "b", "a", "b", "a", "c", "c", "c", "d"]
    a = credit.grpo_advantages(rewards, groups)
    ga = np.array([0.5, -0.5, -0.5, 0.5]) / (S3 + 1e-6)            # a: {1, 0, 0, 1}, mean 1/2
    gb = np.array([2 / 3, -1 / 3, -1 / 3]) / (S3 + 1e-6)            # b: {1, 0, 0}, mean 1/3
    np.testing.assert_allclose(a[[0, 2, 4, 6]], ga, rtol=1e-12)
    np.testing.assert_allclose(a[[1, 3, 5]], gb, rtol=1e-12)
    assert np.all(a[7:10] == 0.0)  # constant group: exactly zero although mean(0.1, 0.1, 0.1) != 0.1 in floats
    assert a[10] == 0.0            # singleton


def test_grpo_no_std_and_torch_input():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    g = torch.tensor([0, 0, 0, 1, 1])
    np.testing.assert_allclose(credit.grpo_advantages(r, g, normalize_std=False), [2 / 3, -1 / 3, -1 / 3, 0, 0])
    assert credit.grpo_advantages([], []).shape == (0,)
    with pytest.raises(ValueError):
        credit.grpo_advantages([1.0, 0.0], [0])


# ---------------------------------------------------------------------------------------------------------------
# Budget rule

def test_solve_budget_hand():
    p, c = [0.25, 1.0, 1.0], [1.0, 1.0, 1.0]  # sqrt(p / c) = [0.5, 1, 1]
    b = credit.solve_budget(p, c, 2.0, q_min=0.1)  # interior: 2.5 lam = 2
    np.testing.assert_allclose(b.q, [0.4, 0.8, 0.8], rtol=1e-12)
    assert b.lam == pytest.approx(0.8) and b.spent == pytest.approx(2.0) and not b.over
    b = credit.solve_budget(p, c, 2.8, q_min=0.1)  # two saturated at 1: 0.5 lam = 0.8
    np.testing.assert_allclose(b.q, [0.8, 1.0, 1.0], rtol=1e-12)
    assert b.lam == pytest.approx(1.6)
    b = credit.solve_budget(p, c, 0.3, q_min=0.1)  # q_min floor binds for the low one: 0.1 + 2 lam = 0.3 -> lam 0.1
    np.testing.assert_allclose(b.q, [0.1, 0.1, 0.1], rtol=1e-12)


def test_solve_budget_edges():
    p, c = np.array([0.3, 0.0, 0.9]), np.array([10.0, 5.0, 20.0])
    b = credit.solve_budget(p, c, 35.0)
    assert np.all(b.q == 1.0) and b.spent == 35.0 and not b.over
    b = credit.solve_budget(p, c, 1.0, q_min=0.05)  # floor 0.05 * 35 = 1.75 > 1
    assert np.all(b.q == 0.05) and b.over and b.spent == pytest.approx(1.75)
    b = credit.solve_budget(p, c, 10.0, q_min=0.05)
    assert b.q[1] == 0.05 and not b.over  # p = 0 stays at the floor while the budget is needed elsewhere
    b = credit.solve_budget([0.0, 1.0], [1.0, 1.0], 1.5, q_min=0.1)  # p > 0 saturated, leftover to the p = 0 one
    np.testing.assert_allclose(b.q, [0.5, 1.0])
    b = credit.solve_budget([], [], 3.0)
    assert b.q.shape == (0,) and not b.over
    for bad in ([1.0, 0.0], [1.0, -2.0], [1.0, np.nan]):
        with pytest.raises(ValueError):
            credit.solve_budget([0.5, 0.5], bad, 1.0)
    with pytest.raises(ValueError):
        credit.solve_budget([1.5], [1.0], 1.0)
    with pytest.raises(ValueError):
        credit.solve_budget([0.5], [1.0], 1.0, rule="cube")


def test_solve_budget_uniform():
    b = credit.solve_budget([0.9, 0.1, 0.0, 0.5], [3.0, 7.0, 1.0, 9.0], 8.0, rule="uniform")
    assert np.all(b.q == b.q[0]) and b.q[0] == pytest.approx(8.0 / 20.0, rel=1e-12)
    bt = credit.solve_budget(torch.tensor([0.9, 0.1, 0.0, 0.5]), torch.tensor([3.0, 7.0, 1.0, 9.0]), 8.0)
    np.testing.assert_allclose((bt.q * [3.0, 7.0, 1.0, 9.0]).sum(), 8.0, rtol=1e-12)  # torch in, numpy out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 1.0), st.floats(1.0, 500.0)), min_size=1, max_size=40),
       st.floats(0.0, 1.0), st.sampled_from(["sqrt", "uniform"]))
def test_solve_budget_spends_exactly(pc, frac, rule):
    p, c = np.array(pc).T
    q_min = 0.05
    total = c.sum()
    budget = q_min * total + frac * (1 - q_min) * total  # anywhere in the feasible range
    b = credit.solve_budget(p, c, budget, q_min=q_min, rule=rule)
    assert np.all((b.q >= q_min) & (b.q <= 1.0))
    assert (b.q * c).sum() == pytest.approx(budget, rel=1e-6)
    assert not b.over


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(0.01, 1.0), st.floats(1.0, 100.0)), min_size=2, max_size=20),
       st.floats(0.1, 0.9), st.floats(1.05, 3.0), st.integers(0, 19))
def test_solve_budget_monotone(pc, frac, factor, k):
    p, c = np.array(pc).T
    k %= len(p)
    budget = frac * c.sum()
    q = credit.solve_budget(p, c, budget).q
    p_up, c_up = p.copy(), c.copy()
    p_up[k] = min(1.0, p[k] * factor)
    c_up[k] = c[k] * factor
    assert credit.solve_budget(p_up, c, budget).q[k] >= q[k] - 1e-9       # more discordant -> more twins
    assert credit.solve_budget(p, c_up, budget).q[k] <= q[k] + 1e-9       # more expensive -> fewer twins
    order = np.lexsort((-p, c))  # within one solve: at equal cost, higher p never gets a lower q
    same_c = c[order][1:] == c[order][:-1]
    assert np.all(q[order][1:][same_c] <= q[order][:-1][same_c] + 1e-12)


# ---------------------------------------------------------------------------------------------------------------
# Branching and Horvitz-Thompson

def test_branch_mask():
    q = np.array([0.0, 0.3, 0.3, 1.0])
    np.testing.assert_array_equal(credit.branch_mask(q, [0.0, 0.29, 0.3, 0.999]), [False, True, False, True])
    with pytest.raises(ValueError):
        credit.branch_mask(q, [0.5])


def test_ht_credit_unbiased():
    """Mean of A_hat over R independent branch draws vs the true D. Var(A_hat_t) = D_t^2 (1/q_t - 1) for a fixed
    twin difference, so the mean's std is |D_t| sqrt((1/q_t - 1) / R); we allow 4.5 of them (two-sided
    probability ~7e-6 per decision under the normal approximation, and the seed is fixed)."""
    D = np.array([1.0, -1.0, 0.5, 2.0, -0.3])
    q = np.array([0.05, 0.2, 0.5, 0.9, 1.0])
    R = 200_000
    rng = np.random.default_rng(0)
    branched = credit.branch_mask(np.tile(q, R), rng.random(R * len(q)))
    a = credit.ht_credit(np.tile(D, R)[:, None], branched, np.tile(q, R)).reshape(R, len(q))
    sd = np.abs(D) * np.sqrt((1 / q - 1) / R)
    assert np.all(np.abs(a.mean(axis=0) - D) <= 4.5 * sd + 1e-9)  # + summation round-off
    assert np.all(a[:, -1] == D[-1])  # q = 1: always branched, no HT noise


def test_ht_credit_list_matches_array():
    diffs = [[1.0, 0.0], [], [-1.0, -1.0], [0.5, 1.0]]
    branched = np.array([True, False, True, True])
    q = np.array([0.5, 0.1, 0.25, 1.0])
    a = credit.ht_credit(diffs, branched, q)
    np.testing.assert_allclose(a, [1.0, 0.0, -4.0, 0.75])
    arr = np.array([[1.0, 0.0], [np.nan, np.nan], [-1.0, -1.0], [0.5, 1.0]])
    np.testing.assert_array_equal(credit.ht_credit(arr, branched, q), a)
    np.testing.assert_array_equal(credit.ht_credit(torch.tensor(arr), torch.tensor(branched), q), a)
    with pytest.raises(ValueError):
        credit.ht_credit([[], []], [True, False], [0.5, 0.5])


# ---------------------------------------------------------------------------------------------------------------
# Token advantages

def test_token_advantages():
    a_traj, credit_t = [1.0, -1.0], [[0.5, 0.0], [-1.0]]
    spans = [[(2, 4), (6, 9)], [(0, 3)]]
    tok = credit.token_advantages(a_traj, credit_t, spans, 10, omega=2.0, sigma=0.5)
    want = np.zeros((2, 10))
    want[0, 2:4] = 1.0 + 2.0 * 0.5 / 0.5
    want[0, 6:9] = 1.0    # unbranched turn: exactly the trajectory advantage
    want[1, 0:3] = -1.0 + 2.0 * -1.0 / 0.5
    np.testing.assert_array_equal(tok, want)
    grpo = credit.token_advantages(a_traj, credit_t, spans, 10, omega=0.0, sigma=0.5)
    np.testing.assert_array_equal(grpo, np.where(want != 0, np.array(a_traj)[:, None], 0.0))  # omega = 0: GRPO
    for bad in ([[(2, 4), (3, 9)], [(0, 3)]], [[(2, 4), (6, 11)], [(0, 3)]], [[(2, 4)], [(0, 3)]]):
        with pytest.raises(ValueError):
            credit.token_advantages(a_traj, credit_t, bad, 10, omega=1.0, sigma=1.0)


# ---------------------------------------------------------------------------------------------------------------
# Discordance predictor and running scale

def _synthetic(rng, n):
    cols = dict(turn=rng.integers(0, 4, n), action=rng.choice(["search", "answer", None], n),
                entropy=rng.gamma(2.0, 0.5, n), group_success=rng.random(n), outcome=rng.integers(0, 2, n),
                turns_remaining=rng.integers(0, 4, n))
    X = credit.featurize(**cols)
    logit = -1.0 + 3.0 * (cols["entropy"] - 1.0) - 1.5 * cols["turns_remaining"] + 1.0 * X[:, 1]
    p = 1 / (1 + np.exp(-logit))
    return X, (rng.random(n) < p).astype(float), p


def test_featurize_columns():
    X = credit.featurize(turn=[0, 2], action=["search", None], entropy=0.7, group_success=[0.2, 0.4], outcome=1,
                         turns_remaining=[1, 0])
    np.testing.assert_allclose(X, [[0, 1, 0, 0.7, 0.2, 1, 1, 0.8], [2, 0, 0, 0.7, 0.4, 1, 0, 0.6]])
    assert credit.featurize(1, "answer", 0.1, 0.5, 0, 0).tolist() == [[1, 0, 1, 0.1, 0.5, 0, 0, 0.5]]
    assert len(credit.FEATURES) == X.shape[1]


def test_auc_and_brier_by_hand():
    """AUC = share of (positive, negative) pairs ordered right, ties half; Brier = mean squared error."""
    assert credit.auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == 0.75  # 0.35 < 0.4 is the one pair out of order
    assert credit.auc([0.5, 0.5, 0.5], [0, 1, 1]) == 0.5 and credit.auc([0.2, 0.9, 0.2], [1, 1, 0]) == 0.75
    assert math.isnan(credit.auc([0.3, 0.7], [1, 1])) and math.isnan(credit.brier([], []))
    assert credit.brier([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx((0.01 + 0.16 + 0.4225 + 0.04) / 4)
    rng = np.random.default_rng(0)  # against the O(n^2) pair count, with many ties
    p, y = rng.integers(0, 5, 300) / 4, rng.integers(0, 2, 300)
    pos, neg = p[y == 1], p[y == 0]
    pairs = (pos[:, None] > neg[None, :]).mean() + 0.5 * (pos[:, None] == neg[None, :]).mean()
    assert credit.auc(p, y) == pytest.approx(pairs, abs=1e-12)


def test_predictor_prior_then_learns():
    rng = np.random.default_rng(1)
    pred = credit.DiscordancePredictor(min_fit=64)
    X, y, p_true = _synthetic(rng, 40)
    assert np.all(pred.predict(X) == 0.5)
    auc, brier = pred.update(X, y)  # scored before fitting: the 0.5 prior ranks nothing, Brier 1/4
    assert (auc, brier) == (0.5, 0.25) and pred.w is None  # 40 < min_fit: still the prior
    assert np.all(pred.predict(X) == np.clip(y.mean(), 0.02, 0.98))
    for _ in range(15):
        pred.update(*_synthetic(rng, 256)[:2])
    X, y, p_true = _synthetic(rng, 2000)
    auc, brier = pred.update(X, y)
    assert auc >= credit.auc(p_true, y) - 0.02 and brier <= credit.brier(p_true, y) + 0.01, (auc, brier)
    assert (pred.auc, pred.brier) == (auc, brier)
    w = pred.w[:len(credit.FEATURES)]
    assert w[3] > 0 and w[6] < 0 and w[1] > 0  # entropy, turns_remaining, is_search signs as generated
    assert len(pred.y) == 4096 and pred.n_seen == 40 + 15 * 256 + 2000  # bounded buffer, all labels counted
    with pytest.raises(ValueError, match="columns"):
        pred.update(np.zeros((2, 3)), [0, 1])
    other = credit.DiscordancePredictor(features=("a", "b", "c"))  # any named columns
    other.update(np.zeros((2, 3)), [0, 1])
    with pytest.raises(ValueError, match="features"):
        pred.load_state_dict(other.state_dict())


def test_predictor_fit_matches_plain_optimiser():
    """The damped-Newton fit is the minimiser of the L2-penalised log-loss: L-BFGS on the same objective agrees."""
    from scipy.optimize import minimize
    rng = np.random.default_rng(4)
    pred = credit.DiscordancePredictor(min_fit=32, l2=1.0)
    pred.update(*_synthetic(rng, 600)[:2])
    Z, y = pred._design(pred.X), pred.y
    reg = np.r_[np.ones(Z.shape[1] - 1), 0.0]

    def f(w):
        z = Z @ w
        grad = Z.T @ (1 / (1 + np.exp(-z)) - y) + reg * w
        return np.sum(np.logaddexp(0, z) - y * z) + 0.5 * np.sum(reg * w * w), grad
    ref = minimize(f, np.zeros(Z.shape[1]), jac=True, method="L-BFGS-B", options=dict(gtol=1e-10, maxiter=5000)).x
    assert np.abs(f(pred.w)[1]).max() < 1e-8  # stationary point of the convex objective = its minimiser
    assert f(pred.w)[0] <= f(ref)[0] + 1e-9
    np.testing.assert_allclose(pred.w, ref, atol=1e-3)


def test_predictor_separable_and_clipped():
    rng = np.random.default_rng(2)
    pred = credit.DiscordancePredictor(min_fit=32, p_min=0.02)
    for _ in range(4):
        X = credit.featurize(0, "search", rng.random(200) * 2, 0.5, 1, 1)
        pred.update(X, (X[:, 3] > 1.0).astype(float))
    X = credit.featurize(0, "search", rng.random(500) * 2, 0.5, 1, 1)
    assert pred.update(X, (X[:, 3] > 1.0).astype(float))[0] >= 0.99
    p = pred.predict(X)
    assert p.min() == 0.02 and p.max() == 0.98 and np.all(np.isfinite(pred.w))


def test_predictor_state_dict_bit_exact():
    rng = np.random.default_rng(3)
    pred = credit.DiscordancePredictor(min_fit=32, buffer_size=300)
    for _ in range(3):
        pred.update(*_synthetic(rng, 128)[:2])
    clone = credit.DiscordancePredictor()
    clone.load_state_dict(json.loads(json.dumps(pred.state_dict())))
    X, y, _ = _synthetic(rng, 500)
    assert pred.predict(X).tobytes() == clone.predict(X).tobytes()
    assert pred.update(X, y) == clone.update(X, y)  # the resumed run keeps fitting identically
    assert pred.predict(X).tobytes() == clone.predict(X).tobytes()
    assert (pred.auc, pred.brier) == (clone.auc, clone.brier)


def test_running_scale():
    s = credit.RunningScale(decay=0.9)
    assert s.value == 1.0
    assert s.update([0.0, 0.0]) == 1.0          # all-zero batch ignored
    s.update([3.0, 0.0, -4.0])                  # first batch sets it: rms of {3, -4}
    assert s.value == pytest.approx(math.sqrt(12.5))
    s.update(np.zeros(5))
    s.update(torch.tensor([1.0, 0.0]))
    assert s.value == pytest.approx(0.9 * math.sqrt(12.5) + 0.1 * 1.0)
    t = credit.RunningScale()
    t.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert t.value == s.value and t.decay == 0.9
    d = credit.RunningScale(decay=0.5, mode="d")  # a scale of D: sqrt of an EMA of mean squares
    assert d.update_d(0.0) == 1.0 and d.update_d(4.0) == 2.0 and d.update_d(0.0) == 2.0
    assert d.update_d(16.0) == pytest.approx(math.sqrt(10.0))
    e = credit.RunningScale()
    e.load_state_dict(json.loads(json.dumps(d.state_dict())))
    assert (e.mode, e.value) == ("d", d.value)


def _exact_twin_term(d, q, mode, omega=1.0, sigma_before=None):
    """E over every branch pattern (2^n, each with its probability prod q or 1 - q) of the twin term
    omega A_hat_t / sigma_hat of each decision, sigma_hat as the trainer's scale_step computes it (the first batch of
    a run, or after a scale `sigma_before` of earlier batches): exact, no sampling."""
    import itertools
    n, out = len(d), np.zeros(len(d))
    for pattern in itertools.product([False, True], repeat=n):
        b = np.array(pattern)
        prob = np.prod(np.where(b, q, 1 - q))
        a_hat = credit.ht_credit(d[:, None], b, q)
        scale = credit.RunningScale(mode=mode)
        if sigma_before is not None:
            scale.load_state_dict({"decay": 0.9, "mode": mode, "value": sigma_before ** (2 if mode == "d" else 1)})
        if mode == "rms":
            sigma = scale.update(a_hat[b])  # updated with the batch, then used (the first form)
        else:
            sigma = scale.value  # the batches before; then updated with ht_mean_square
            scale.update_d(credit.ht_mean_square(d[:, None], b, q))
        if sigma > 0:
            out += prob * omega * a_hat / sigma
    return out


def test_twin_term_does_not_change_with_the_budget():
    """Hand-built batch: 4 decisions with fixed twin differences D (deterministic twins) and a uniform branch
    probability q (the budget). With twin_scale = d the exact expected twin term E[omega A_hat / sigma_hat] is
    omega D / sigma at every q; with the first form (rms) it is q times that: it shrinks with the budget."""
    d = np.array([1.0, -1.0, 1.0, 0.0])
    for sigma_before in (None, 0.5):
        terms = {q: _exact_twin_term(d, np.full(4, q), "d", sigma_before=sigma_before) for q in (0.1, 0.3, 0.7, 1.0)}
        for q, term in terms.items():
            np.testing.assert_allclose(term, d / (sigma_before or 1.0), rtol=1e-12, atol=1e-15)
    rms = {q: _exact_twin_term(d, np.full(4, q), "rms") for q in (0.1, 0.3, 0.7, 1.0)}
    for q, term in rms.items():
        np.testing.assert_allclose(term, q * d, rtol=1e-12, atol=1e-15)  # (D / q) / (RMS of branched D / q) = D
    # the scale itself: E[ht_mean_square] = mean D^2 per decision at every q (exact over the patterns)
    import itertools
    for q in (0.1, 0.5):
        e = sum(np.prod(np.where(b, q, 1 - q)) * credit.ht_mean_square(d[:, None], np.array(b), np.full(4, q))
                for b in itertools.product([False, True], repeat=4))
        assert e == pytest.approx(np.mean(d ** 2), rel=1e-12)

