"""The ceiling: training on exact turn credit, A*(s_t, y_t) = Q(s_t, y_t) - V(s_t), estimated by
Monte Carlo (DESIGN.md section 7, "The oracle arm"; RESULTS.md "Headroom").

Not a method one would run: it answers what credit assignment could buy at all on a world. For
every turn t of every factual episode,

    Q = (1/M) sum_k U(rollout k from just after y_t),  keys fresh_key(key, MC_Q_TAG, t, k)
    V = (1/M) sum_k U(rollout k from s_t, y_t re-drawn),  keys fresh_key(key, MC_V_TAG, t, k)
    A* = Q - V,  SE = sqrt(s2_Q / M + s2_V / M)

the credit audit's estimator, key for key (lab/audit.py calls `requests` and `estimates` too), with
Q = U exactly where turn t ended the episode. M = oracle_rollouts; with binary outcomes the SE is at
most sqrt(0.5 / M): 0.125 at the default M = 32, where the audits measured a mean SE of 0.06 beside
an sd of A* of 0.2 (RESULTS.md "Headroom" states it per world).

The turn's advantage is A* scaled as TWICE scales its twin term (twice.py step 6), so that the
oracle differs from TWICE in the credit alone:
    oracle_traj = False   A = clip(A* / sigma_hat, +-twin_cap)            exact credit in place of A_traj
    oracle_traj = True    A = A_traj + omega clip(A* / sigma_hat, +-twin_cap)   TWICE with A_hat = A*
sigma_hat is the running RMS of the batch's nonzero A* (credit.RunningScale, twin_scale = rms).

Its rollouts are a ceiling's, not a method's cost: they go to the step's `oracle_tokens`, not to
`aux_tokens`, so token_budget counts the factual tokens alone and an oracle run makes the updates a
GRPO run makes (compare it per update; its real cost is logged beside it).
"""
import numpy as np

import credit
import rollout
import sampler
from twice import Method, gather_list


def requests(episodes, decisions, M: int, first: int = 0) -> list:
    """continue_from's requests of A*: per decision (episode index, turn), M from just after y_t
    (Q), then M from s_t (V), decision-major; rollouts k = first, ..., first + M - 1."""
    return [(episodes[i], t, inc, sampler.fresh_key(episodes[i].key, tag, t, k))
            for i, t in decisions for inc, tag in ((True, sampler.MC_Q_TAG), (False, sampler.MC_V_TAG))
            for k in range(first, first + M)]


def estimates(x, n: int, M: int) -> dict:
    """A* = Q - V, its SE (nan at M = 1), Q, V and the rollouts' tokens, each (n,), from the
    (n * 2 * M, 2) outcome and token counts of `requests`' rollouts."""
    x = np.asarray(x, dtype=np.float64).reshape(n, 2, M, 2)
    q, v = x[:, 0, :, 0], x[:, 1, :, 0]
    # one rollout per side (M = 1) has no spread to estimate: its SE is nan, not 0
    se = np.sqrt(q.var(1, ddof=1) / M + v.var(1, ddof=1) / M) if M > 1 else np.full(n, np.nan)
    return {"a": q.mean(1) - v.mean(1), "se": se,
            "q": q.mean(1), "v": v.mean(1), "tokens": x[..., 1].sum((1, 2))}


def oracle_credit(model, tok, retr, episodes, M: int, proto, draw: int = 0) -> tuple:
    """(A* per turn of each episode, estimates() of every decision, episode-major). draw > 0 takes
    the next M rollouts per side (an independent estimate: the gradient audit's replicates)."""
    decisions = [(i, t) for i, ep in enumerate(episodes) for t in range(len(ep.turns))]
    conts = rollout.continue_from(model, tok, retr, requests(episodes, decisions, M, draw * M), proto)
    est = estimates([(c.reward, c.n_generated) for c in conts], len(decisions), M)
    per_turn = np.split(est["a"], np.cumsum([len(ep.turns) for ep in episodes])[:-1])
    return per_turn, est


class Oracle(Method):
    """Exact turn credit from M Monte Carlo rollouts per side (the module docstring)."""
    name = "oracle"
    autocast = False  # rollouts from the sampling copy, outside any autocast

    def advantages(self, run, step, episodes, batch, proto, draw: int = 0) -> tuple:
        a_star, est = oracle_credit(self.policy(run), run.tok, run.retriever, episodes,
                                    self.cfg.oracle_rollouts, proto, draw)
        return self.from_credit(run, episodes, batch, a_star, est)

    def from_credit(self, run, episodes, batch, a_star, est) -> tuple:
        """(B, L) token advantages and the counters from oracle_credit's A* (per turn) and estimates."""
        cfg = self.cfg
        sigma = run.sigma_hat.update(gather_list(run.accel, est["a"][est["a"] != 0].tolist()))
        a_traj = self.trajectory_advantages(episodes)
        base, weight = (a_traj, cfg.omega) if cfg.oracle_traj else (np.zeros(len(episodes)), 1.0)
        turn_adv = credit.turn_advantages(base, a_star, weight, sigma, cfg.twin_cap)
        spans, width = rollout.turn_spans(episodes), batch["input_ids"].shape[1]
        adv = credit.spread_over_tokens(turn_adv, spans, width)
        traj = credit.spread_over_tokens([np.full(len(ep.turns), a) for ep, a in zip(episodes, base)],
                                         spans, width)
        stats = {"aux_tokens": 0, "oracle_tokens": int(est["tokens"].sum()),
                 "oracle_decisions": len(est["a"]), "oracle_abs_sum": float(np.abs(est["a"]).sum()),
                 "oracle_se_sum": float(est["se"].sum()),
                 "oracle_continuations": 2 * cfg.oracle_rollouts * len(est["a"])}
        return adv, {**stats, "twin_adv": adv - traj} if cfg.oracle_traj else stats

    def step_stats(self, accel, stats: dict, factual_tokens: int) -> dict:
        """The counters over ranks; oracle_abs and oracle_se: the mean |A*| and SE per decision."""
        out = super().step_stats(accel, stats, factual_tokens)
        n = max(out.pop("oracle_decisions"), 1)
        out["oracle_abs"] = out.pop("oracle_abs_sum") / n
        out["oracle_se"] = out.pop("oracle_se_sum") / n
        out["oracle_token_ratio"] = out["oracle_tokens"] / max(factual_tokens, 1)
        return out
