"""Credit audit (DESIGN.md section 8): each credit estimator against the oracle turn advantage A* =
Q - V.

Paper (arXiv 2610.31544): wrong-sign 21.7% (independent branching) -> 6.9% (TWICE), correlation with
A* 0.46 -> 0.72, 68% fewer auxiliary tokens than VinePPO, total tokens 1.70x GRPO.

Protocol (all rollouts through rollout.py's batched functions, many decisions x repeats per call):
  1. Decisions: the questions of --data in a keyed order (permutation seeded by mix(seed,
     ORDER_TAG)), one factual episode each (T = 1, key episode_key(seed, 0, uid, 0)); every turn is
     a decision; whole episodes in that order until at least N are held (n >= N); none is skipped.
  2. Oracle: A*(s_t, y_t) = Q - V, Q = mean of M rollouts from just after y_t (continue_from,
     include_turn, seeds
     fresh_key(key, MC_Q_TAG, t, k)), V = mean of M rollouts from s_t (turn t re-sampled, MC_V_TAG),
     SE = sqrt(s2_Q / M + s2_V / M). Q = U exactly when turn t ended the episode.
  3. Repeats r < R, each ONE estimate as training computes it, with the factual luck after t
     re-drawn:
     F_r = continue_from(episode, t, include_turn, s_r = fresh_key(key, REROLL_TAG, t, r)), outcome U_r.
       TWICE        D_r = U_r - U'_r, U'_r = run_twins(F_r, t, j=r): y' ~ alt_key(key, t, r), then F_r's keys;
                    with and without the same-evidence shortcut (D = 0 when y' retrieves y_t's doc
                    ids)
       budgeted     q = solve_budget(p, c, twin_budget x factual tokens), sqrt rule, branch iff keyed u < q,
                    A_hat = 1[branched] D_r / q (Horvitz-Thompson); p_t from a DiscordancePredictor fitted on the
                    other half of the episodes (2-fold cross-fit), c_t = tokens of y_t and of F_r
                    after it
       independent  the same y', then fresh keys for every later turn, every twin rolled out (a
       self-twin too);
                    "as trainer": run_twins(coupling=False)'s rule, self-twin and shortcut scored D
                    = 0
       GRPO         (U_r - mean) / (std + eps) over U_r and G-1 fresh lines of the prompt, for every turn alike
       VinePPO(K)   A_t = V_K(s_{t+1}) - V_K(s_t), V_K = mean of K rollouts from the boundary, V(s_T) = U
       methods      GiGPO, HGPO, IGPO, SPA-RL, AgentPRM (--method_rows): the method's own turn_advantages on groups
                    [F_r, the same G-1 fresh lines] (lab/audit_methods.py)
       token forks  --token_forks (forks.py): per repeat a fork token k ~ r_t of turn t, the factual
       luck re-drawn
                    after token k (F'_r), a twin forked at k on F'_r's keys; estimate (1 - pi_k) D /
                    r_t(k), whose mean is A* (sum over k of Q(s_k, y_k) - V(s_k)); a pass with the
                    prior fork law, a second with a token predictor cross-fitted on the first, and
                    that one budgeted as above
  4. Per estimator: wrong-sign rate (estimate and A* strictly opposite) over decisions with |A*| >
     threshold; Pearson correlation with A* of single estimates (pooled over repeats) and of the
     repeat mean; mean variance over repeats; auxiliary tokens per decision (sampled beyond the
     factual episode; GRPO, GiGPO, HGPO, IGPO, SPA-RL 0; AgentPRM its continuations, A9;
     forward/backward passes are not generated tokens). Twins: rho = pooled within-decision
     correlation of U_r and U'_r, Var(D_coupled) / Var(D_independent) predicted and measured, and
     the token agreement after the decision (equal tokens at equal positions of the later turns,
     --line_keys).

Deviations (DESIGN.md section 13; tagged `# DEVIATION A<n>:` below):
  A1. VinePPO's K in --vine_k are nested: the first K of max(K) rollouts per boundary and repeat
     (each an exact K-rollout estimate, repeats independent; the K of one repeat are correlated with
     each other).
  A2. Shortcut rows reuse twins rolled out without it: D = 0 and only y' counted where it fires;
      equal to
     run_twins(same_evidence_shortcut=True) twin for twin (tested).
  A3. Budget: "factual tokens" are the audited factual episodes' (the same in every repeat).
  A4. An estimate of exactly 0 is not a wrong sign (its rate is the `zero` column).
  A5. --data defaults to the world's train split: the decisions training credits (the test split
     asks about unseen entities: its warm-start sampled EM was 0.07 in our build, so nearly every A*
     there is 0).
  A6. The independent counterfactual rolls a self-twin out (the textbook baseline);
     run_twins(coupling=False) scores it D = 0 like a coupled one: that rule is the separate row
     "independent as trainer".
  A7-A9: the method rows' (lab/audit_methods.py); the token-fork rows' is forks.py's F2.

Launch (CPU; --threads 1 because a second thread made these tiny models ~10x slower on a shared
2-core machine):
  python -m lab.audit --world data/tinyworld --out runs/audit          # `make audit`: N 150, M 64, R 8, K 1,2,4,8
  python -m lab.audit --world data/chains --out runs/audit-chains      # `make audit WORLD=data/chains`
  python -m lab.audit --world data/tinyworld --decisions 24 --oracle_rollouts 16 --repeats 4 --out runs/audit-small
  python -m lab.audit --model runs/twice/step_000200/policy --data data/tinyworld/train.jsonl \\
      --index data/tinyworld/index --decisions 40 --oracle_rollouts 16 --repeats 4   # a checkpoint, a few minutes
  python -m lab.audit --rescore runs/audit    # recompute the metrics of an earlier audit from its audit.json
Tests: `python -m pytest -q tests/test_audit.py`.
"""
from infra import numerics  # noqa: F401  first: pins the CPU math libraries before numpy and torch load (infra/numerics.py)

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from lab import audit_methods
from lab.audit_scores import corr_differences, coupling_stats, oracle_summary, score, targets
from methods import baselines
from methods import oracle as oracle_arm
from infra import config
import credit
import eval as qa_eval
import forks
import protocol
from lab import report
import rollout
import sampler
import train_twice

# the trainer's defaults: the audit measures credit as training computes it
TRAIN = train_twice.Config()


@dataclass
class Config:
    """Credit audit of a policy against Monte Carlo oracle advantages (DESIGN.md section 8)."""
    world: str = "data/tinyworld"   # world folder; fills blank model / data / index
    model: str = ""                 # policy: HF folder or hub id ('' -> {world}/policy)
    data: str = ""                  # QA .jsonl/.parquet of the audited questions ('' ->
    #                                 {world}/train.jsonl, A5)
    index: str = ""                 # retriever index folder ('' -> {world}/index unless
    #                                 retriever_url)
    retriever_url: str = ""         # Search-R1-style HTTP retriever; replaces index
    out: str = "runs/audit"         # audit.json, audit.md, audit_scatter.png go here
    seed: int = 0                   # seed of every key and of the question order
    decisions: int = 150            # N, decisions audited (whole episodes: n >= N)
    oracle_rollouts: int = 64       # M, rollouts per side of the oracle A* = Q - V
    repeats: int = 8                # R, independent repeats of every estimator
    vine_k: str = "1,2,4,8"         # VinePPO rollouts per turn boundary, comma-separated
    threshold: float = 0.2          # wrong-sign rate counts decisions with |A*| above this
    method_rows: str = "gigpo,hgpo,igpo,spa_rl,agentprm"  # methods' own rows too, comma-separated
    #                                                       ('' none)
    train_config: str = ""          # trainer preset of the method rows' knobs ('' -> the world's,
    #                                 world_preset)
    learned_steps: int = 30         # spa_rl, agentprm: trainer steps training the estimator first
    #                                 (A7; demo: 30)
    group_size: int = TRAIN.group_size  # G, GRPO group: the factual line + G-1 fresh lines
    token_forks: bool = False       # also the token-fork rows (forks.py): prior law, learnt law,
    #                                 budgeted
    fork_floor: float = TRAIN.fork_floor  # token forks: share of the fork law spread evenly over a
    #                                       turn's tokens
    line_keys: str = TRAIN.line_keys  # protocol: "group" or "text" reading of "line" in the keys
    #                                   (DESIGN 5)
    twin_budget: float = TRAIN.twin_budget  # budgeted TWICE: expected twin tokens / factual tokens
    q_min: float = TRAIN.q_min      # budgeted TWICE: floor of the branch probability
    max_turns: int = TRAIN.max_turns  # protocol: searches per episode, then one final turn
    topk: int = TRAIN.topk          # protocol: documents per search
    max_new_tokens: int = TRAIN.max_new_tokens  # protocol: tokens per turn
    max_obs_tokens: int = TRAIN.max_obs_tokens  # protocol: tokens per observation
    max_context: int = TRAIN.max_context  # protocol: prompt + response tokens
    temperature: float = TRAIN.temperature  # protocol: sampling temperature T
    gen_batch_size: int = 256       # rows per generate call
    chunk: int = 2048               # requests per batched rollout call (one progress-bar step)
    threads: int = 1                # torch CPU threads (0: torch's default)
    progress: bool = True           # progress bars
    rescore: str = ""               # an earlier --out folder: recompute its metrics from
    #                                 audit.json, no rollouts

    def resolve(self):
        self.model = self.model or os.path.join(self.world, "policy")
        # DEVIATION A5: what training credits
        self.data = self.data or os.path.join(self.world, "train.jsonl")
        self.index = self.index or ("" if self.retriever_url else os.path.join(self.world, "index"))
        self.train_config = self.train_config or audit_methods.world_preset(self.world)

    def checks(self):
        return [("oracle_rollouts", self.oracle_rollouts >= 2, ">= 2"),
                ("repeats", self.repeats >= 2, ">= 2"), ("group_size", self.group_size
                                                         >= 2, ">= 2"),
                ("decisions", self.decisions >= 1, ">= 1"),
                ("vine_k", _valid_ks(self.vine_k), "comma-separated integers >= 1"),
                ("threshold", self.threshold >= 0, ">= 0"),
                ("twin_budget", self.twin_budget >= 0, ">= 0"),
                ("q_min", 0 < self.q_min <= 1, "in (0, 1]"),
                ("max_new_tokens", self.max_new_tokens >= 1, ">= 1"),
                ("temperature", self.temperature > 0, "> 0"),
                ("gen_batch_size", self.gen_batch_size >= 1, ">= 1"),
                ("chunk", self.chunk >= 1, ">= 1"), ("threads", self.threads >= 0, ">= 0"),
                ("method_rows", set(audit_methods.method_names(self.method_rows))
                 <= set(audit_methods.METHOD_ROWS),
                 f"comma-separated names among {', '.join(audit_methods.METHOD_ROWS)}"),
                ("train_config", not self.train_config or
                 os.path.isfile(self.train_config), "a preset file or ''"),
                ("learned_steps", self.learned_steps >= 0, ">= 0"),
                ("fork_floor", 0 < self.fork_floor <= 1, "in (0, 1]"),
                ("line_keys", self.line_keys in ("group", "text"), "'group' or 'text'")]


def _valid_ks(text: str) -> bool:
    try:
        return bool(vine_ks_of(text)) and min(vine_ks_of(text)) >= 1
    except ValueError:
        return False


def parse_args(argv=None) -> Config:
    """Config from `--key=value` / `--key value` options (infra/config.py)."""
    return config.parse(Config, [] if argv is None else argv, "lab.audit", presets=False)


def vine_ks_of(text: str) -> list:
    return sorted({int(k) for k in str(text).split(",") if k.strip()})


def vine_ks(cfg) -> list:
    return vine_ks_of(cfg.vine_k)


def batched(fn, items, cfg, desc) -> list:
    """fn over chunks of cfg.chunk items (one batched rollout call each), concatenated, with a
    progress bar."""
    out = []
    for c in tqdm(range(0, len(items), cfg.chunk), desc=desc, unit="call",
                  disable=not cfg.progress):
        out += fn(items[c:c + cfg.chunk])
    return out


def outcomes(model, tok, retr, requests, cfg, proto, desc) -> np.ndarray:
    """(n, 2) outcome and generated tokens of continue_from(requests)."""
    run = lambda q: [(e.reward, e.n_generated) for e in rollout.continue_from(model, tok, retr, q, proto)]  # noqa
    return np.array(batched(run, requests, cfg, desc), dtype=np.float64).reshape(-1, 2)


# --- rollouts: factual decisions, oracle, re-rolled factual episodes, twins, GRPO lines, VinePPO
# values ---
def collect(model, tok, retr, rows, cfg, proto):
    """(rows, episodes, decisions [(episode index, turn)]): whole episodes in keyed question order
    until >= N."""
    order = np.random.default_rng(sampler.mix(cfg.seed, sampler.ORDER_TAG)).permutation(len(rows))
    chosen, episodes, decisions = [], [], []
    step = max(1, cfg.decisions // 2)  # every episode has a turn: a few batches at most
    for c in range(0, len(rows), step):
        part = [rows[k] for k in order[c:c + step]]
        for row, ep in zip(part, rollout.run_episodes(model, tok, retr, rollout.start_episodes(
                tok, part, cfg.seed, 0), proto)):
            if len(decisions) >= cfg.decisions:
                return chosen, episodes, decisions
            assert ep.turns, f"question {row['id']}: an episode without a turn (prompt longer than max_context?)"
            decisions += [(len(episodes), t) for t in range(len(ep.turns))]
            chosen.append(row)
            episodes.append(ep)
    print(f"warning: {cfg.data} holds only {len(decisions)} decisions (asked for {cfg.decisions})")
    return chosen, episodes, decisions


def oracle(model, tok, retr, episodes, decisions, cfg, proto) -> dict:
    """A* = Q - V from M fresh rollouts per side, its SE, Q, V and the oracle's tokens, each (N,).
    """
    reqs = oracle_arm.requests(episodes, decisions, cfg.oracle_rollouts)  # the oracle arm's keys
    x = outcomes(model, tok, retr, reqs, cfg, proto, "oracle")
    return oracle_arm.estimates(x, len(decisions), cfg.oracle_rollouts)


def reroll(model, tok, retr, episodes, decisions, cfg, proto) -> list:
    """F_r of every (decision, repeat), decision-major: the factual prefix through y_t, fresh luck
    after it."""
    reqs = [(episodes[i], t, True, sampler.fresh_key(episodes[i].key, sampler.REROLL_TAG, t, r))
            for i, t in decisions for r in range(cfg.repeats)]
    return batched(lambda q: rollout.continue_from(model, tok, retr, q, proto), reqs, cfg,
                   "re-roll")


def twins(model, tok, retr, facts, decisions, cfg, proto, coupling) -> dict:
    """Twin j = r of each re-rolled F_r at its decision turn t: y' with alt_key(key, t, r), then
    F_r's keys (coupling: rollout.run_twins without the shortcut) or fresh keys fresh_key(key,
    UNCOUPLED_TAG, t, r) with every twin rolled out, a self-twin too: the textbook independent
    counterfactual (run_twins(coupling=False) scores a self-twin D = 0, which only coupling
    justifies). (N, R) arrays: outcome U', tokens, tokens of y', self-twin (y' == y_t), and whether
    the same-evidence shortcut would fire."""
    reqs = [(facts[n * cfg.repeats + r], t, r) for n, (_, t) in enumerate(decisions)
            for r in range(cfg.repeats)]

    def run(chunk):
        if coupling:
            res = [(x.twin, x.outcome, x.tokens) for x in rollout.run_twins(
                model, tok, retr, chunk, proto, True, same_evidence_shortcut=False)]
        else:  # DEVIATION A6: every twin rolled out, a self-twin too
            eps = [rollout.branch(f, t, key_overrides={t: sampler.alt_key(f.key, t, j)},
                                  fresh_seed=sampler.fresh_key(f.key, sampler.UNCOUPLED_TAG, t, j))
                   for f, t, j in chunk]
            res = [(e, e.reward, e.n_generated)
                   for e in rollout.run_episodes(model, tok, retr, eps, proto)]
        out = []
        for (f, t, _), (twin, outcome, tokens) in zip(chunk, res):
            alt, fact = twin.turns[t], f.turns[t]
            same = twin.ids[alt.start:alt.end] == f.ids[fact.start:fact.end]
            out.append((outcome, tokens, alt.end - alt.start, same, not same and
                        rollout._same_evidence(fact, alt), *forks.later_agreement(f, twin, t)))
        return out
    x = np.array(batched(run, reqs, cfg, "twins" if coupling else "independent"), dtype=np.float64)
    x = x.reshape(len(decisions), cfg.repeats, 7)
    return {"u": x[..., 0], "tokens": x[..., 1], "alt_tokens": x[..., 2], "self": x[..., 3] > 0,
            "same_evidence": x[..., 4] > 0, "agree": x[..., 5], "compared": x[..., 6]}


def group_lines(model, tok, retr, chosen, cfg, proto) -> list:
    """[episode][r]: the G-1 fresh lines (Episodes) of its prompt in repeat r, keys (mix(seed,
    GROUP_TAG), r, .)."""
    G, R = cfg.group_size, cfg.repeats
    eps = [
        e for r in range(R) for e in rollout.start_episodes(
            tok, chosen, sampler.mix(cfg.seed, sampler.GROUP_TAG), r, G - 1)
    ]
    eps = batched(lambda q: rollout.run_episodes(model, tok, retr, q, proto), eps, cfg,
                  "grpo lines")
    return [[
        eps[(r * len(chosen) + i) * (G - 1):(r * len(chosen) + i + 1) * (G - 1)] for r in range(R)
    ] for i in range(len(chosen))]


def line_outcomes(line_eps) -> np.ndarray:
    """(episodes, R, G-1, 2) outcome and tokens of group_lines' episodes."""
    return np.array([[[(e.reward, e.n_generated) for e in g] for g in per]
                     for per in line_eps], dtype=np.float64)


def vine_values(model, tok, retr, episodes, decisions, cfg, proto, kmax) -> np.ndarray:
    """(N, R, kmax, 2) outcome and tokens of VinePPO's rollouts from each boundary s_t, seeds
    (VINE_TAG, t, r, k)."""
    reqs = [(episodes[i], t, False, sampler.fresh_key(episodes[i].key, sampler.VINE_TAG, t, r, k))
            for i, t in decisions for r in range(cfg.repeats) for k in range(kmax)]
    return outcomes(model, tok, retr, reqs, cfg, proto, "vineppo").reshape(
        len(decisions), cfg.repeats, kmax, 2)


def rollouts(model, tok, retr, rows, cfg) -> dict:
    """Every rollout of the audit, each phase timed."""
    proto, t = protocol.protocol_from(cfg), time.time()
    chosen, episodes, decisions = collect(model, tok, retr, rows, cfg, proto)
    raw = {
        "chosen": chosen, "episodes": episodes, "decisions": decisions,
        "times": {"collect_s": time.time() - t}
    }
    steps = [
        ("oracle", lambda: oracle(model, tok, retr, episodes, decisions, cfg, proto)),
        ("facts", lambda: reroll(model, tok, retr, episodes, decisions, cfg, proto)),
        ("coupled", lambda: twins(model, tok, retr, raw["facts"], decisions, cfg, proto, True)),
        ("independent",
         lambda: twins(model, tok, retr, raw["facts"], decisions, cfg, proto, False)),
        ("line_eps", lambda: group_lines(model, tok, retr, chosen, cfg, proto)),
        ("vine",
         lambda: vine_values(model, tok, retr, episodes, decisions, cfg, proto, max(vine_ks(cfg)))),
        ("methods", lambda: audit_methods.method_rows(model, tok, retr, rows, raw, cfg, proto))
    ]
    for name, fn in steps:
        t = time.time()
        raw[name] = fn()
        raw["times"][f"{name}_s"] = time.time() - t
    raw["lines"] = line_outcomes(raw["line_eps"])  # GRPO's and the budget rule's group outcomes
    t = time.time()
    raw["forks"] = forks.audit_rows(model, tok, retr, raw, cfg, proto,
                                    batched) if cfg.token_forks else None
    raw["times"]["forks_s"] = time.time() - t
    return raw


# --- estimators from the rollouts ---
def with_shortcut(u, tw, zero_self=False):
    """(D, tokens) with the same-evidence shortcut (and, zero_self, a self-twin scored 0 as
    run_twins does even uncoupled): D = 0 and only y' generated where it fires."""
    # DEVIATION A2: derived from the twins rolled out without it; equal to
    # run_twins(same_evidence_shortcut=True).
    fire = tw["same_evidence"] | (tw["self"] if zero_self else False)
    return np.where(fire, 0.0, u - tw["u"]), np.where(fire, tw["alt_tokens"], tw["tokens"])


def grpo_estimates(u, lines, decisions, eps) -> np.ndarray:
    """(N, R) GRPO advantage of F_r: U_r normalised in its group [U_r, G-1 fresh lines of the
    prompt]."""
    # (N, R, G)
    groups = np.concatenate([u[..., None], lines[[i for i, _ in decisions], :, :, 0]], axis=2)
    ids = np.repeat(np.arange(u.size), groups.shape[2])
    return credit.grpo_advantages(groups.ravel(), ids, eps).reshape(groups.shape)[..., 0]


def vine_estimates(x, episodes, decisions, k):
    """(N, R) VinePPO advantages from the first k rollouts per boundary
    (baselines.vineppo_advantages per episode), and (N, R) their tokens: the k rollouts of the
    decision's own boundary s_t."""
    # DEVIATION A1: the K of --vine_k are nested subsets of the same kmax rollouts.
    v = baselines.mc_value(x[:, :, :k, 0])  # (N, R) V_K(s_t)
    est = np.empty_like(v)
    for i, ep in enumerate(episodes):
        rows = [n for n, (j, _) in enumerate(decisions) if j == i]
        assert [decisions[n][1]
                for n in rows] == list(range(len(ep.turns))), "decisions must be whole episodes"
        for r in range(v.shape[1]):
            est[rows, r] = baselines.vineppo_advantages(v[rows, r], ep.reward)
    return est, x[:, :, :k, 1].sum(2)


def crossfit_discordance(X, discordant, folds) -> np.ndarray:
    """(N, R) predicted P(D != 0), each decision's from a DiscordancePredictor fitted on the other
    folds only."""
    p = np.empty(discordant.shape)
    for f in np.unique(folds):
        pred = credit.DiscordancePredictor(buffer_size=max(4096, discordant.size))
        pred.update(X[folds != f].reshape(-1, X.shape[2]),
                    discordant[folds != f].ravel().astype(float))
        p[folds == f] = pred.predict(X[folds == f].reshape(-1, X.shape[2])).reshape(-1, p.shape[1])
    return p


def horvitz_thompson(d, p, c, budget, q_min, seed):
    """(N, R) A_hat = 1[u < q] D / q, q and the branch mask, with q = solve_budget(p[:, r], c[:, r],
    budget) per repeat and u = sampler.branch_uniform(seed, r, n) keyed uniforms (as the trainer's
    step 3, a batch a repeat)."""
    est, q, branched = np.zeros(d.shape), np.zeros(d.shape), np.zeros(d.shape, dtype=bool)
    for r in range(d.shape[1]):
        q[:, r] = credit.solve_budget(p[:, r], c[:, r], budget, q_min, "sqrt").q
        u = np.array([sampler.branch_uniform(seed, r, n) for n in range(d.shape[0])])
        branched[:, r] = credit.branch_mask(q[:, r], u)
        est[:, r] = credit.ht_credit(d[:, r:r + 1], branched[:, r], q[:, r])
    return est, q, branched


def budgeted(raw, u, d, tokens, cfg) -> dict:
    """Budgeted TWICE: the trainer's features and twin costs (rollout.decision_table on F_r at its
    turn t), cross-fitted discordance (2 folds by episode), the sqrt rule and Horvitz-Thompson,
    repeat by repeat."""
    decisions, facts, (N, R) = raw["decisions"], raw["facts"], u.shape
    # (N, R, G)
    group = np.concatenate([u[..., None], raw["lines"][[i for i, _ in decisions], :, :, 0]], axis=2)
    table = rollout.decision_table(facts, group.mean(2).ravel())
    X, c = table.features, table.cost
    where = {pair: m for m, pair in enumerate(table.index)}
    # F_r's decision turn
    rows = [where[n * R + r, t] for n, (_, t) in enumerate(decisions) for r in range(R)]
    p = crossfit_discordance(X[rows].reshape(N, R, -1), d != 0,
                             np.array([i % 2 for i, _ in decisions]))
    factual = sum(ep.n_generated for ep in raw["episodes"])
    # DEVIATION A3: the budget is twin_budget x the audited factual episodes' tokens, in every
    # repeat.
    est, q, branched = horvitz_thompson(d, p, c[rows].reshape(N, R), cfg.twin_budget * factual,
                                        cfg.q_min, cfg.seed)
    return {"est": est, "tokens": np.where(branched, tokens, 0.0), "p": p, "q": q}


def shortcut_bias(d_with, d_without, tok_with, tok_without, fired) -> dict:
    """What the same-evidence shortcut costs in bias and saves in tokens, per decision. The signed
    mean of (with - without) over decisions is ~0 by symmetry for any world (sum_y pi(y) b(y) = 0),
    so the figure is the per-decision bias b_n = mean_r (D_with - D_without), (N, R) arrays: mean
    |b_n| over the decisions where the shortcut fires, its SE over decisions, and the noise floor
    mean_n SE(b_n) (|b_n| of a bias-free decision is about 0.8 SE(b_n))."""
    R = d_with.shape[1]
    b = (d_with - d_without).mean(1)  # (N,)
    se_b = (d_with - d_without).std(1, ddof=1) / math.sqrt(R)
    where = fired.any(1)
    n = int(where.sum())
    abs_b = np.abs(b[where])
    return {"fire_rate": float(fired.mean()), "decisions_fired": n,
            "mean_abs_bias": float(abs_b.mean()) if n else 0.0,
            "mean_abs_bias_se": float(abs_b.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan,
            "noise_floor": float(math.sqrt(2 / math.pi) * se_b[where].mean()) if n else 0.0,
            "signed_mean_bias": float(b.mean()),
            "tokens_saved_per_decision": float((tok_without - tok_with).mean()),
            "tokens_saved_share": float((tok_without - tok_with).sum() / max(tok_without.sum(), 1))}


def estimates(raw: dict, cfg) -> tuple:
    """{name: ((N, R) estimates, (N, R) auxiliary tokens)} and side results (shortcut, budget)."""
    decisions, episodes, tc, ti = raw["decisions"], raw["episodes"], raw["coupled"], raw[
        "independent"]
    N, R = len(decisions), cfg.repeats
    u = np.array([f.reward for f in raw["facts"]]).reshape(N, R)
    d_sc, tok_sc = with_shortcut(u, tc)
    bud = budgeted(raw, u, d_sc, tok_sc, cfg)
    ests = {
        "TWICE": (d_sc, tok_sc), "TWICE no shortcut": (u - tc["u"], tc["tokens"]),
        "TWICE budgeted": (bud["est"], bud["tokens"]), "independent": (u - ti["u"], ti["tokens"]),
        "independent as trainer": with_shortcut(u, ti, zero_self=True), "GRPO": (grpo_estimates(
            u, raw["lines"], decisions, TRAIN.adv_eps), np.zeros((N, R)))
    }
    for k in vine_ks(cfg):
        ests[f"VinePPO K={k}"] = vine_estimates(raw["vine"], episodes, decisions, k)
    # token forks (forks.py): the prior law's pass, the learnt law's, and that one budgeted
    if raw["forks"]:
        fk, factual = raw["forks"], sum(ep.n_generated for ep in episodes)
        ests["TWICE token (prior law)"] = forks.fork_estimates(fk["first"])
        est, tokens = ests["TWICE token"] = forks.fork_estimates(fk["second"])
        p, c = (np.repeat(x[:, None], R, 1) for x in (fk["law"].p, fk["law"].cost))
        est, _, branched = horvitz_thompson(est, p, c, cfg.twin_budget * factual, cfg.q_min,
                                            cfg.seed)
        ests["TWICE token budgeted"] = (est, np.where(branched, tokens, 0.0))
    ests.update(raw["methods"]["rows"])
    shortcut = shortcut_bias(d_sc, u - tc["u"], tok_sc, tc["tokens"], tc["same_evidence"])
    return ests, {"u": u, "p": bud["p"], "q": bud["q"], "shortcut": shortcut,
                  "factual_tokens": sum(ep.n_generated for ep in episodes),
                  "grpo_group_tokens": float(np.mean([ep.n_generated for ep in episodes]) +
                                             raw["lines"][..., 1].sum(2).mean())}


# --- the audit ---
def run_audit(model, tok, retr, rows, cfg) -> tuple:
    """All rollouts, estimators and metrics -> (result dict for audit.json, {name: (N, R)
    estimates})."""
    t0 = time.time()
    raw = rollouts(model, tok, retr, rows, cfg)
    ests, side = estimates(raw, cfg)
    a, orc = raw["oracle"]["a"], raw["oracle"]
    metrics = {
        name: score(est, aux, a, cfg.threshold, side["factual_tokens"])
        for name, (est, aux) in ests.items()
    }
    vines = [f"VinePPO K={k}" for k in vine_ks(cfg)]
    res = {
        "config": dataclasses.asdict(cfg), "episodes": len(
            raw["episodes"]), "metrics": metrics, "vines": vines, "oracle": oracle_summary(
                orc, cfg.threshold), "shortcut": side["shortcut"], "coupling": coupling_stats(
                    side["u"], raw["coupled"]["u"], raw["independent"]["u"], raw["coupled"],
                    raw["independent"]), "predictors": {
                        "turn": {
                            "auc": credit.auc(side["p"], ests["TWICE"][0] != 0),
                            "brier": credit.brier(side["p"], ests["TWICE"][0] != 0)
                        }, **({"token": raw["forks"]["predictor"]} if raw["forks"] else {})
                    }, "fork_token_agreement": raw["forks"]["token_agreement"]
        if raw["forks"] else None, "targets": targets(metrics, vines),
        "budget_q_mean": float(side["q"].mean()), "corr_differences": corr_differences(
            {name: est
             for name, (est, _) in ests.items()}, a), "factual_tokens": side["factual_tokens"],
        "grpo_group_tokens": side["grpo_group_tokens"], "oracle_tokens": float(
            orc["tokens"].sum()), "times": raw["times"],
        "learned": raw["methods"]["learned"], "method_config": dataclasses.asdict(
            audit_methods.method_config(cfg)) if raw["methods"]["rows"] else {}
    }
    res["decisions"] = [{
        "question": raw["chosen"][i]["id"], "episode": i, "turn": t,
        "outcome": ep.reward, "action": ep.turns[t].action, **{
            k: float(orc[k][n]) for k in ("a", "se", "q", "v")
        }, "u_reroll": side["u"][n].tolist(), "p_discordance": side["p"][n].tolist(),
        "token_agreement": [
            float(raw[k][x][n].sum()) for k in ("coupled", "independent")
            for x in ("agree", "compared")
        ] + ([
            float(raw["forks"][k][x][n].sum()) for k in ("first", "second")
            for x in ("agree", "compared")
        ] if raw["forks"] else []), "q_branch": side["q"][n].tolist(), "estimates": {
            name: est[n].tolist() for name, (est, _) in ests.items()
        }
    } for n, (i, t) in enumerate(raw["decisions"]) for ep in [raw["episodes"][i]]]
    res["times"]["total_s"] = time.time() - t0
    return res, {name: est for name, (est, _) in ests.items()}


def _clean(x):
    """JSON-safe: NaN / inf -> null, numpy scalars -> Python."""
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    return x.item() if isinstance(x, np.generic) else x


def write(res: dict, out: str) -> str:
    """audit.json and audit.md into `out`, each replaced atomically; returns the markdown."""
    md = report.audit_report(res)
    os.makedirs(out, exist_ok=True)
    for name, text in (("audit.json", json.dumps(_clean(res), indent=1)), ("audit.md", md)):
        with open(os.path.join(out, name + ".tmp"), "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))
    return md


def rescore(folder: str) -> dict:
    """Recompute every estimator's metrics from an audit folder's audit.json (its per-decision
    estimates and A*; the aux-token figures are kept) and rewrite audit.json and audit.md: new
    metrics without new rollouts."""
    path = os.path.join(folder, "audit.json")
    if not os.path.isfile(path):
        raise SystemExit(
            f"lab/audit.py --rescore: {path} not found (the folder of an earlier lab/audit.py --out)"
        )
    res = json.load(
        open(path, encoding="utf-8"),
        object_hook=lambda d: {
            k: math.nan if v is None else v
            # _clean's inverse
            for k, v in d.items()
        })
    a, ests = np.array([d["a"] for d in res["decisions"]], dtype=float), {}
    for name, m in res["metrics"].items():
        est = np.array([[math.nan if x is None else x for x in d["estimates"][name]]
                        for d in res["decisions"]], dtype=float)
        aux = np.full(est.shape, m["aux_tokens"])
        m.update({
            k: v for k, v in score(est, aux, a, res["config"]["threshold"],
                                   res["factual_tokens"]).items()
            if k not in ("aux_tokens", "total_vs_grpo")
        })
        ests[name] = est
    res["corr_differences"] = corr_differences(ests, a)
    print(write(res, folder), flush=True)
    return res


def main(cfg: Config) -> dict:
    if cfg.rescore:
        return rescore(cfg.rescore)
    # tiny models on a shared 2-core CPU: a second thread made generation ~10x slower (measured)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    numerics.require("this audit")
    t0 = time.time()
    model, tok = qa_eval.load_policy(cfg.model)
    res, ests = run_audit(model, tok, qa_eval.load_retriever(cfg.index, cfg.retriever_url),
                          qa_eval.load_qa(cfg.data), cfg)
    res["times"]["wall_s"] = time.time() - t0
    md = write(res, cfg.out)
    report.audit_scatter(os.path.join(cfg.out, "audit_scatter.png"),
                         np.array([d["a"] for d in res["decisions"]]), ests, res["metrics"])
    print(md, flush=True)
    return res


if __name__ == "__main__":
    main(config.cli(Config, prog="lab.audit", presets=False))
