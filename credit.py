"""TWICE's credit (DESIGN.md section 5): twin outcome differences to token advantages. Pure
array math.

TWICE ("Same Luck, Different Choice", arXiv 2610.31544). Decision t of episode i, outcome U_i:
  A_traj_i = (U_i - mean_g U) / (std_g U + eps)      GRPO; std unbiased (ddof=1) as verl's torch.std
  D_t      = U - U'                                  twin difference; E[D_t | s_t, y_t] = Q - V
  q_t      = clip(lam * sqrt(p_t / c_t), q_min, 1)   budget rule; lam: sum_t q_t c_t = budget
  A_hat_t  = 1[u_t < q_t] * mean_j D_t^j / q_t       Horvitz-Thompson, unbiased for Q - V
  A_i,tok  = A_traj_i + omega * A_hat_t / sigma_hat  on the sampled tokens of turn t, 0 elsewhere
p_t = P(U != U') comes from `DiscordancePredictor` (online logistic regression on 1[D != 0],
scored by AUC and Brier score on each batch before it learns from it), c_t is the predicted twin
cost in tokens, sigma_hat is `RunningScale`: twin_scale "d" (default): sqrt of an EMA of the
Horvitz-Thompson mean of D^2 per decision, whose expectation does not depend on the branch
probabilities q, so omega means the same at every budget; "rms" (the first form): an EMA of the
RMS of the nonzero A_hat, which grows like 1/q and makes the expected twin term shrink with the
budget. Token forks' fork law and credit are forks.py's.

This file knows no episodes, models or ranks: the twins come from rollout.run_twins, the loop that
joins them is twice.twin_credit. The baselines' formulas live with their trainers
(methods/baselines.py, methods/learned.py), which reuse grpo_advantages, group_index and as_array
from here.

Inputs are numpy arrays, lists or torch tensors (copied to float64 numpy); outputs are numpy. Group
and state keys are any hashables (ints, strings, tuples); grouping uses equality only, never
Python's hash() order.

Deviations (DESIGN.md section 13; tagged `# DEVIATION C<n>:` below):
C1. Groups of size 1 get advantage 0 (verl uses mean 0, std 1 there, i.e. the raw score).
C2. solve_budget: decisions with p_t = 0 stay at q_min until every p_t > 0 decision is at q = 1;
    only then does the rest of the budget go to them, evenly. DESIGN.md does not say; this keeps
    sum q c = budget on the whole range.
(C3-C5 are the baselines' formulas: methods/baselines.py.)
C6. sigma_hat (twin_scale = d): sqrt of an EMA of the Horvitz-Thompson mean of D^2 per decision,
    taken from the batches before the one it scales; a batch without data leaves it. The paper
    says "a running scale"; its first form here (twin_scale = rms) made the expected twin term
    proportional to q.

No entry point: train_twice.py and lab/audit.py import these functions.
Tests: `python -m pytest -q tests/test_credit.py`.
"""
import math
from typing import NamedTuple

import numpy as np

FEATURES = ("turn", "is_search", "is_answer", "entropy", "group_success", "outcome",
            "turns_remaining", "surprise")


def as_array(x, dtype=np.float64) -> np.ndarray:
    """float64 numpy copy of a list, array or torch tensor (detached, moved to CPU)."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.array(x, dtype=dtype)


def group_index(keys):
    """Dense group ids 0..G-1 in order of first appearance; equal keys share an id."""
    # numpy / torch: elementwise Python scalars (tensor elements hash by identity)
    if hasattr(keys, "tolist"):
        keys = keys.tolist()
    ids, out = {}, np.empty(len(keys), dtype=np.int64)
    for n, k in enumerate(keys):
        out[n] = ids.setdefault(tuple(k) if isinstance(k, list) else k, len(ids))
    return out


def _sigmoid(z):
    return 0.5 * (1.0 + np.tanh(0.5 * z))  # no overflow warning for large |z|


# --------------------------------------------------------------------------------------------------
# TWICE (DESIGN 5)

def grpo_advantages(rewards, group_ids, eps=1e-6, normalize_std=True) -> np.ndarray:
    """GRPO group-normalised advantage (x - mean_g) / (std_g + eps) for each entry, grouped by
    equal `group_ids`.

    std_g is the unbiased (ddof=1) sample std, as verl / Search-R1 (`torch.std`).
    normalize_std=False gives x - mean_g. A constant group (all rewards equal) gets exactly 0; a
    group of size 1 gets 0.
    """
    x = as_array(rewards).reshape(-1)
    g = group_index(group_ids)
    if len(g) != len(x):
        raise ValueError(f"{len(x)} rewards but {len(g)} group ids")
    if x.size == 0:
        return x
    n = np.bincount(g).astype(np.float64)
    dev = x - (np.bincount(g, x) / n)[g]
    std = np.sqrt(np.bincount(g, dev * dev) / np.maximum(n - 1, 1))
    out = dev / (std[g] + eps) if normalize_std else dev
    lo, hi = np.full(len(n), np.inf), np.full(len(n), -np.inf)
    np.minimum.at(lo, g, x)
    np.maximum.at(hi, g, x)
    # DEVIATION C1: singletons -> 0; constant groups exactly 0 (mean may round off by an ulp)
    out[(hi == lo)[g]] = 0.0
    return out


class Budget(NamedTuple):
    q: np.ndarray  # (n,) branch probabilities, each in [q_min, 1]
    lam: float     # the multiplier: inf once every p > 0 decision is at q = 1, 0 at the q_min floor
    spent: float   # sum_t q_t c_t: expected twin tokens
    over: bool     # budget < q_min * sum(c): the q_min floor forces spending past the budget


def solve_budget(p, c, budget, q_min=0.05, rule="sqrt") -> Budget:
    """Branch probabilities q_t = clip(lam * sqrt(p_t / c_t), q_min, 1) with
    sum_t q_t c_t = budget (DESIGN 5).

    rule="uniform": q_t = clip(lam, q_min, 1), the same total; rule="all": q_t = 1 at every
    decision, whatever the budget (spent = sum c). Returns Budget(q, lam, spent, over).
    Edges: budget >= sum c -> all ones; budget <= q_min sum c -> all q_min (`over` says whether
    that exceeds the budget); p_t = 0 -> q_min (see deviation 2); empty input -> empty q.
    c_t <= 0 or p_t outside [0, 1] raise. lam is found by geometric bisection on the continuous,
    non-decreasing spend f(lam) = sum_t c_t q_t(lam), to float precision (relative error of the
    spend ~1e-15).
    """
    p, c = as_array(p).reshape(-1), as_array(c).reshape(-1)
    if p.shape != c.shape:
        raise ValueError(f"p has {p.size} entries, c has {c.size}")
    if not np.all(c > 0) or not np.all(np.isfinite(c)):
        raise ValueError("twin costs c_t must be finite and > 0")
    if not np.all((p >= 0) & (p <= 1)):
        raise ValueError("discordance p_t must lie in [0, 1]")
    if not (0 < q_min <= 1) or not budget >= 0 or rule not in ("sqrt", "uniform", "all"):
        raise ValueError(f"need 0 < q_min <= 1, budget >= 0, rule in (sqrt, uniform, all); "
                         f"got {q_min}, {budget}, {rule}")
    total = float(c.sum())
    if rule == "all":  # every decision branched: A_hat_t is the mean of its K differences
        return Budget(np.ones_like(p), math.inf, total, False)
    w = np.sqrt(p / c) if rule == "sqrt" else np.ones_like(p)
    pos = w > 0
    full = c[pos].sum() + q_min * c[~pos].sum()  # spend once every p > 0 decision is at q = 1
    if budget >= total:
        q, lam = np.ones_like(p), math.inf
    elif budget <= q_min * total:
        q, lam = np.full_like(p, q_min), 0.0
    elif budget >= full:  # DEVIATION C2: leftover spread evenly over the p = 0 decisions
        q, lam = np.where(pos, 1.0, q_min + (budget - full) / c[~pos].sum()), math.inf
    else:
        # f(lo) = q_min * total < budget <= full = f(hi)
        lo, hi = q_min / w[pos].max(), 1.0 / w[pos].min()
        for _ in range(200):  # geometric bisection: p_t / c_t may span hundreds of decades
            mid = math.sqrt(lo) * math.sqrt(hi)
            if not lo < mid < hi:
                break
            lo, hi = (mid, hi) if (c * np.clip(mid * w, q_min, 1.0)).sum() < budget else (lo, mid)
        q, lam = np.clip(hi * w, q_min, 1.0), hi
    return Budget(q, float(lam), float((q * c).sum()), bool(budget < q_min * total))


def branch_mask(q, u) -> np.ndarray:
    """Decision t gets a twin iff u_t < q_t; u_t are keyed uniforms in [0, 1) drawn by the
    caller (reproducible)."""
    q, u = as_array(q), as_array(u)
    if q.shape != u.shape:
        raise ValueError(f"q {q.shape} and u {u.shape} differ in shape")
    return u < q


def ht_credit(diffs, branched, q, baseline=None) -> np.ndarray:
    """Horvitz-Thompson turn credit A_hat_t = 1[branched_t] * mean_j(D_t^j) / q_t (DESIGN 5).
    Unbiased: E[A_hat_t] = q_t * mean D / q_t, Var = mean(D)^2 (1/q_t - 1) for fixed twins.
    With a baseline g_t fixed before the branch draw (a control variate, control_baseline):
    A_hat_t = g_t + 1[branched_t] (mean_j D_t^j - g_t) / q_t, unbiased for any g, with variance
    (mean D - g)^2 (1/q_t - 1): smaller wherever g predicts D.

    diffs: a 2D array (n, K) (rows of unbranched decisions are ignored, may be NaN) or a list of
    per-decision lists of K_t twin differences (empty for unbranched decisions). A branched
    decision needs at least one twin.
    """
    branched = np.asarray(branched, dtype=bool).reshape(-1)
    q = as_array(q).reshape(-1)
    if len(q) != len(branched) or len(diffs) != len(q):
        raise ValueError(f"lengths differ: diffs {len(diffs)}, branched {len(branched)}, "
                         f"q {len(q)}")
    if not np.all((q[branched] > 0) & (q[branched] <= 1)):
        raise ValueError("q_t must lie in (0, 1] for branched decisions")
    a = np.zeros(len(q))
    if isinstance(diffs, np.ndarray) or hasattr(diffs, "detach"):  # fast path, (n, K)
        mean = as_array(diffs).reshape(len(q), -1)[branched].mean(axis=1)
    else:
        rows = [as_array(diffs[n]).reshape(-1) for n in np.flatnonzero(branched)]
        if any(r.size == 0 for r in rows):
            raise ValueError("a branched decision has no twin difference")
        mean = np.array([r.mean() for r in rows])
    if not np.all(np.isfinite(mean)):
        raise ValueError("non-finite twin difference on a branched decision")
    if baseline is None:
        a[branched] = mean / q[branched]
        return a
    g = as_array(baseline).reshape(-1)
    if g.shape != q.shape:
        raise ValueError(f"baseline has {g.size} entries, q {q.size}")
    a = g.astype(float).copy()
    a[branched] += (mean - g[branched]) / q[branched]
    return a


def line_out_advantages(rewards, group_size: int, rows=(), eps=1e-6) -> tuple:
    """Trajectory advantages with a leave-one-line-out baseline (twin_data, DESIGN.md section 5):
    factual line i of a group and every extra row of line i (its twins) get (U - b_i) / (s_g + eps),
    b_i the mean outcome of the group's other factual lines (no baseline shares a row's luck: other
    lines have other keys) and s_g the std (ddof 1) of the group's factual outcomes; a group whose
    lines all agree takes the mean s_g of the batch's other groups (1 if none), so a twin that
    disagrees with all five lines keeps a finite advantage. Neither depends on which twins were
    drawn: each row's advantage is the one it would have at q = 1. rows: (line index i, U) pairs.
    Returns (factual (N,), rows (len(rows),))."""
    if group_size < 2:
        raise ValueError(f"a leave-one-line-out baseline needs group_size >= 2, got {group_size}")
    u = as_array(rewards).reshape(-1, group_size)  # (groups, G)
    base = ((u.sum(1, keepdims=True) - u) / (group_size - 1)).reshape(-1)
    std = u.std(1, ddof=1)
    spread = std > 0
    std[~spread] = std[spread].mean() if spread.any() else 1.0
    line = np.array([i for i, _ in rows], dtype=int)
    extra = as_array([r for _, r in rows]).reshape(-1)
    fact = (u.reshape(-1) - base) / (std.repeat(group_size) + eps)
    return fact, (extra - base[line]) / (std[line // group_size] + eps)


def control_baseline(outcome, p) -> np.ndarray:
    """g_t = (2 U - 1) p_t: the predicted D = U - U' of a decision whose factual outcome is U in
    {0, 1} and whose twin disagrees with probability p_t (the predictor's, before this batch)."""
    return (2 * as_array(outcome).reshape(-1) - 1) * as_array(p).reshape(-1)


def capped(x, cap: float) -> np.ndarray:
    """x clipped to [-cap, cap]; cap 0: x as it is. The twin term's bound (DESIGN 5)."""
    x = as_array(x).astype(float)
    return np.clip(x, -cap, cap) if cap > 0 else x


def turn_advantages(a_traj, a_hat, omega, sigma, cap: float = 0.0) -> list:
    """Per-turn advantage A_{i,t} = A_traj_i + omega * clip(A_hat_{i,t} / sigma, +-cap)
    (DESIGN 5, token advantage; cap 0: no clip)."""
    if not sigma > 0:
        raise ValueError(f"sigma must be > 0, got {sigma}")
    # DEVIATION C7: the twin term is clipped to omega * cap (the paper states no bound)
    return [a + omega * capped(as_array(h).reshape(-1) / sigma, cap)
            for a, h in zip(as_array(a_traj).reshape(-1), a_hat)]


def token_advantages(a_traj, a_hat, turn_spans, seq_len, omega, sigma) -> np.ndarray:
    """(N, seq_len) token advantages: turn_advantages on the sampled tokens of each turn, 0 on
    every other token. a_hat[i] = A_hat per turn (0 for an unbranched turn, which then carries
    exactly A_traj_i)."""
    a_traj = as_array(a_traj).reshape(-1)
    if not len(a_traj) == len(a_hat) == len(turn_spans):
        raise ValueError(f"episodes: a_traj {len(a_traj)}, a_hat {len(a_hat)}, "
                         f"spans {len(turn_spans)}")
    return spread_over_tokens(turn_advantages(a_traj, a_hat, omega, sigma), turn_spans, seq_len)


def spread_over_tokens(turn_adv, turn_spans, seq_len) -> np.ndarray:
    """(N, seq_len): turn_adv[i][t] on the tokens turn_spans[i][t] = (start, end) of episode i
    (end exclusive, increasing, non-overlapping, in the episode's token coordinates); prompt and
    observation tokens stay 0."""
    if len(turn_adv) != len(turn_spans):
        raise ValueError(f"episodes: {len(turn_adv)} advantage rows, {len(turn_spans)} span rows")
    out = np.zeros((len(turn_adv), seq_len))  # (N, L)
    for i, (adv, spans) in enumerate(zip(turn_adv, turn_spans)):
        if len(adv) != len(spans):
            raise ValueError(f"episode {i}: {len(adv)} turn credits but {len(spans)} turn spans")
        prev = 0
        for t, (start, end) in enumerate(spans):
            if not prev <= start <= end <= seq_len:
                raise ValueError(f"episode {i} turn {t}: span ({start}, {end}) overlaps or "
                                 f"leaves [0, {seq_len})")
            out[i, start:end] = adv[t]
            prev = end
    return out


def featurize(turn, action, entropy, group_success, outcome, turns_remaining) -> np.ndarray:
    """(n, len(FEATURES)) features of n decisions; each argument is a scalar or a length-n array
    (broadcast), so a dict of columns works as `featurize(**cols)`.

    turn             0-based index t of the turn
    is_search        1 if `action == "search"`  } from `action`, the turn's parsed action; an
    is_answer        1 if `action == "answer"`  } invalid turn (neither tag, action None) has both 0
    entropy          mean per-token entropy of y_t under the sampling policy (nats)
    group_success    success rate of the prompt's G lines (mean U over the group, this line
                     included)
    outcome          the factual outcome U in {0, 1}
    turns_remaining  turns the factual episode played after t (T_i - 1 - t); 0 on the last turn
    surprise         |outcome - group_success|: a linear model cannot form this outcome x group
                     interaction itself, and it carries the main signal (a success in a failing
                     group is where a twin most often differs)
    """
    action = np.asarray(action, dtype=object)  # strings or None; a single string is one decision
    cols = [as_array(turn), action == "search", action == "answer", as_array(entropy),
            as_array(group_success), as_array(outcome), as_array(turns_remaining),
            np.abs(as_array(outcome) - as_array(group_success))]
    cols = np.broadcast_arrays(*[np.atleast_1d(np.asarray(col, dtype=np.float64)) for col in cols])
    return np.stack(cols, axis=-1).reshape(-1, len(FEATURES))


def auc(p, y) -> float:
    """Area under the ROC curve of scores p for 0/1 labels y (Mann-Whitney U / (n1 n0), ties
    counted half); nan when a class is missing."""
    p, y = as_array(p).reshape(-1), as_array(y).reshape(-1)
    n1 = float(y.sum())
    n0 = len(y) - n1
    if n1 == 0 or n0 == 0:
        return math.nan
    order = np.argsort(p, kind="mergesort")
    _, first, count = np.unique(p[order], return_index=True, return_counts=True)
    ranks = np.empty(len(p))
    ranks[order] = np.repeat(first + (count + 1) / 2, count)  # 1-based, ties share their mean rank
    return float((ranks[y == 1].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def brier(p, y) -> float:
    """Mean squared error of probabilities p against 0/1 labels y (nan for no labels)."""
    p, y = as_array(p).reshape(-1), as_array(y).reshape(-1)
    return float(np.mean((p - y) ** 2)) if len(y) else math.nan


class DiscordancePredictor:
    """p_t = P(U != U') from per-decision features: online L2 logistic regression (DESIGN 5,
    discordance predictor).

    Fitted on a replay buffer of the most recent `buffer_size` labelled decisions (label 1[D != 0]
    of branched decisions), features standardised on the buffer, by damped Newton (IRLS) from zero:
    deterministic. Until the buffer holds `min_fit` labels of both classes, predict() returns the
    prior: the mean of every label seen so far, 0.5 before any. Predictions are clipped to
    [p_min, 1 - p_min] so q_t never collapses. `features` names the columns (credit.FEATURES for
    decisions, forks.TOKEN_FEATURES for fork tokens). Each update scores the batch before learning
    from it: `auc` and `brier` (accuracy said nothing: it equals the majority class's rate).
    """
    FEATURES = FEATURES
    featurize = staticmethod(featurize)

    def __init__(self, min_fit=64, buffer_size=4096, l2=1.0, p_min=0.02, newton_iters=30,
                 features=FEATURES):
        if not (l2 > 0 and 0 < p_min < 0.5 and min_fit >= 1 and buffer_size >= min_fit):
            raise ValueError("need l2 > 0, 0 < p_min < 0.5, 1 <= min_fit <= buffer_size")
        self.min_fit, self.buffer_size, self.newton_iters = min_fit, buffer_size, newton_iters
        # L2 strength on standardised weights; clip of every prediction
        self.l2, self.p_min = l2, p_min
        self.features = tuple(features)
        d = len(self.features)
        self.X, self.y = np.zeros((0, d)), np.zeros(0)  # replay buffer, oldest first
        # w: (d + 1,), intercept last; None = prior
        self.mu, self.sd, self.w = np.zeros(d), np.ones(d), None
        self.n_seen = self.n_pos = 0
        self.auc = self.brier = math.nan  # of the last update batch, predicted before fitting on it

    @property
    def prior(self) -> float:
        return self.n_pos / self.n_seen if self.n_seen else 0.5

    def _check(self, X):
        X, d = as_array(X), len(self.features)
        if X.ndim != 2 or X.shape[1] != d or not np.all(np.isfinite(X)):
            raise ValueError(f"X must be finite with shape (n, {d}), columns {self.features}; "
                             f"got {X.shape}")
        return X

    def _design(self, X):
        return np.hstack([(X - self.mu) / self.sd, np.ones((len(X), 1))])  # (n, d + 1)

    def predict(self, X) -> np.ndarray:
        X = self._check(X)
        p = np.full(len(X), self.prior) if self.w is None else _sigmoid(self._design(X) @ self.w)
        return np.clip(p, self.p_min, 1.0 - self.p_min)

    def update(self, X, y) -> tuple:
        """Score the batch (AUC, Brier score of its predictions before it is learnt), append it to
        the buffer, refit; returns (auc, brier), nan where undefined (no labels; AUC: one class
        only)."""
        X, y = self._check(X), as_array(y).reshape(-1)
        if len(y) != len(X) or not np.all((y == 0) | (y == 1)):
            raise ValueError(f"need one 0/1 label per row: {len(X)} rows, "
                             f"labels {np.unique(y)[:5]}")
        if len(y) == 0:
            self.auc = self.brier = math.nan
            return self.auc, self.brier
        p = self.predict(X)
        self.auc, self.brier = auc(p, y), brier(p, y)
        self.n_seen, self.n_pos = self.n_seen + len(y), self.n_pos + int(y.sum())
        self.X = np.concatenate([self.X, X])[-self.buffer_size:]
        self.y = np.concatenate([self.y, y])[-self.buffer_size:]
        self._fit()
        return self.auc, self.brier

    def _fit(self):
        y, n_pos = self.y, self.y.sum()
        if len(y) < self.min_fit or n_pos in (0, len(y)):
            self.w = None
            return
        self.mu, sd = self.X.mean(axis=0), self.X.std(axis=0)
        # constant columns stand still (their weight is held at 0 by the L2)
        self.sd = np.where(sd > 0, sd, 1.0)
        Z = self._design(self.X)
        reg = np.full(Z.shape[1], self.l2)
        reg[-1] = 0.0  # the intercept is not shrunk
        w = np.zeros(Z.shape[1])
        w[-1] = math.log(n_pos / (len(y) - n_pos))

        def loss(w):  # penalised negative log-likelihood, overflow-free
            z = Z @ w
            return np.sum(np.logaddexp(0.0, z) - y * z) + 0.5 * np.sum(reg * w * w)
        cur = loss(w)
        for _ in range(self.newton_iters):
            p = _sigmoid(Z @ w)
            hess = (Z * (p * (1 - p))[:, None]).T @ Z + np.diag(reg)
            step = np.linalg.solve(hess, Z.T @ (p - y) + reg * w)
            # damping: a full Newton step can overshoot on nearly separable data
            for t in 0.5 ** np.arange(20):
                new = loss(w - t * step)
                if new <= cur:
                    break
            if new > cur:  # no descent left at float precision
                break
            w, done, cur = w - t * step, cur - new <= 1e-12 * (1.0 + abs(cur)), new
            if done:
                break
        self.w = w

    def state_dict(self) -> dict:
        """JSON-serialisable state (Python floats round-trip exactly): reload gives bit-identical
        predictions."""
        s = {k: getattr(self, k)
             for k in ("min_fit", "buffer_size", "l2", "p_min", "newton_iters", "n_seen", "n_pos")}
        s.update(X=self.X.tolist(), y=self.y.tolist(), mu=self.mu.tolist(), sd=self.sd.tolist(),
                 w=None if self.w is None else self.w.tolist(), features=list(self.features),
                 auc=None if math.isnan(self.auc) else self.auc,
                 brier=None if math.isnan(self.brier) else self.brier)
        return s

    def load_state_dict(self, s: dict):
        if tuple(s.get("features", FEATURES)) != self.features:
            raise ValueError(f"predictor state has features {s.get('features', FEATURES)}, "
                             f"this one {self.features}")
        for k in ("min_fit", "buffer_size", "newton_iters", "n_seen", "n_pos"):
            setattr(self, k, int(s[k]))
        self.l2, self.p_min = float(s["l2"]), float(s["p_min"])
        self.X = np.array(s["X"], dtype=np.float64).reshape(-1, len(self.features))
        self.y, self.mu, self.sd = (np.array(s[k], dtype=np.float64) for k in ("y", "mu", "sd"))
        self.w = None if s["w"] is None else np.array(s["w"], dtype=np.float64)
        self.auc, self.brier = (math.nan if s.get(k) is None else float(s[k])
                                for k in ("auc", "brier"))


def ht_mean_square(diffs, branched, q) -> float:
    """(1 / n) sum_t 1[branched_t] mean_j (D_t^j)^2 / q_t over n decisions: the Horvitz-Thompson
    estimate of the mean of D^2 per decision, whose expectation over the branch draws,
    (1 / n) sum_t E[D_t^2], does not involve q. diffs as ht_credit's."""
    mean_sq = ht_credit([np.square(as_array(d)) for d in diffs]
                        if not isinstance(diffs, np.ndarray) else np.square(diffs), branched, q)
    return float(mean_sq.mean()) if len(mean_sq) else 0.0


class RunningScale:
    """sigma_hat (DESIGN 5), value 1.0 before any data.

    mode "d" (twin_scale = d): sqrt of an EMA of ht_mean_square of each batch, a scale of D itself
    whose expectation does not depend on q; the trainer scales a batch by the value from the
    batches before it (update after use), so over that batch's branch draws
    E[A_hat / sigma] = (Q - V) / sigma exactly, at every budget. mode "rms" (the first form): EMA
    of the RMS of the nonzero A_hat = D / q of each batch, updated before use; it grows like 1/q,
    so the expected twin term shrinks with the budget. Either way the first batch with data sets
    the value and a batch without any (no twin, or every D = 0) leaves it.
    """

    def __init__(self, decay=0.9, mode="rms"):
        if mode not in ("rms", "d"):
            raise ValueError(f"RunningScale mode must be 'rms' or 'd', got {mode!r}")
        self.decay, self.mode, self._value = decay, mode, None  # _value: EMA of the RMS or of D^2

    @property
    def value(self) -> float:
        if self._value is None:
            return 1.0
        return math.sqrt(self._value) if self.mode == "d" else self._value

    def _ema(self, x: float):
        self._value = x if self._value is None else self.decay * self._value + (1 - self.decay) * x

    def update(self, a_hat) -> float:
        """mode "rms": one batch's A_hat (the nonzero ones count)."""
        a = as_array(a_hat).reshape(-1)
        a = a[a != 0]
        if a.size:
            self._ema(float(np.sqrt(np.mean(a * a))))
        return self.value

    def update_d(self, mean_square: float) -> float:
        """mode "d": one batch's ht_mean_square (0: no data)."""
        if mean_square > 0:
            self._ema(float(mean_square))
        return self.value

    def state_dict(self) -> dict:
        return {"decay": self.decay, "mode": self.mode, "value": self._value}

    def load_state_dict(self, s: dict):
        self.decay, self.mode = float(s["decay"]), s.get("mode", "rms")
        self._value = None if s["value"] is None else float(s["value"])
