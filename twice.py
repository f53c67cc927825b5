"""TWICE, the method (DESIGN.md section 5): steps 1-6 of a training step, turned into token
advantages.

Paper: "Same Luck, Different Choice: Twin-World Credit Assignment for Agentic Reinforcement
Learning" (arXiv 2610.31544). train_twice.train_step calls the method through one hook
(`Method.rollout`, then `Method.advantages`); step 7, the PPO update, is train_twice.py's.

  1. G factual episodes per prompt, every token a keyed Gumbel-max draw (sampler.py):
     key = mix(seed, step, prompt_uid, line), noise u = U(key, turn, pos, token).   `Method.rollout`
  2. Trajectory advantage (GRPO):  A_traj_i = (U_i - mean_group) / (std_group + eps).
                                                                      `Method.trajectory_advantages`
  3. Budget rule:  q_t = clip(lambda sqrt(p_t / c_t), q_min, 1), lambda such that
     sum_t q_t c_t = twin_budget x factual tokens. p_t is the predicted P(U != U') (online logistic
     regression), c_t the tokens of y_t and of everything after it. Decision t branches iff a keyed
     uniform < q_t.                                                                         `branch`
  4. Twins: y' ~ pi(.|s_t) with alternative keys, then the factual keys for every later (turn, pos):
     same luck, different choice. D_t = U - U' is unbiased for Q(s_t, y_t) - V(s_t), with (1 - rho)
     times the variance of an independent counterfactual. Self-twins (y' == y_t) and same-evidence
     searches cost no rollout (D_t = 0).                                                `roll_twins`
  5. Horvitz-Thompson:  A_hat_t = 1[branched] mean_j D_t^j / q_t.                   credit.ht_credit
  6. Token advantage on the sampled tokens of turn t:  A = A_traj_i + omega A_hat_t / sigma_hat,
     sigma_hat a scale of D itself (twin_scale = d), so omega means the same at every budget.
                                                                              credit.turn_advantages
  Knobs of the credit frontier (lab/frontier.py): traj_term = false drops A_traj (the twin term
  alone); budget_rule = all branches every decision (q_t = 1: A_hat_t = mean_j D_t^j).

`twin_credit` is steps 2-6 for the paper's unit, a whole turn. `token_twin_credit` is the token unit
(twin_unit = token, forks.py): the twin forks one token k ~ r_t of the turn (y_t[:k] kept, y_k
banned, the factual keys after it), p_t and c_t are the fork law's, and token k alone gets
omega (1 - pi_k) mean_j D^j / (q_t r_t(k) sigma_hat), unbiased for Q(s_k, y_k) - V(s_k) over
sigma_hat.

`Method` is GRPO: steps 1-2, broadcast over the turns. Every baseline of methods/ extends it and
replaces the advantages (DESIGN.md section 7). `Twice` adds steps 3-6;
`methods.baselines.Independent` is Twice with twins under fresh keys (the textbook counterfactual).

It knows no optimiser and no loss: episodes in, (B, L) advantages and counters out.
Deviations (DESIGN.md section 13): T1, C6 and F1, tagged below.
"""
import dataclasses

import numpy as np
import torch

import credit
import forks
import rollout
import sampler


class Method:
    """GRPO (Shao et al. 2024, as run by Search-R1): the group-normalised outcome on every turn.

    The hook of train_twice.train_step. `rollout` gives the step's episodes; `advantages` gives
    (B, L) token advantages on collate's rows and the step's counters (stats["aux_tokens"] counts
    every token generated beyond the factual episodes). `state_dict` / `load_state_dict` go into
    every checkpoint's run.json, and `save(dir)` / `load(dir, run)` put tensors beside it, so
    --resume continues exactly.
    """
    name = "grpo"
    # Twice only: twins under fresh keys (rollout.run_twins(independent=True))
    independent_twins = False
    autocast = True  # advantages run under the accelerator's autocast (the estimators' passes)

    def __init__(self, cfg):
        self.cfg = cfg

    def rollout(self, run, step, prompts, proto) -> list:
        """Step 1: G factual lines per prompt."""
        # GPU memory: an episode nothing branches from (GRPO's) drops its KV cache when it ends;
        # keep_caches=False drops all (twins and continuations then prefill their context again)
        release = (getattr(self.cfg, "method", "") == "grpo"
                   or not getattr(self.cfg, "keep_caches", True))
        return rollout.factual_episodes(self.policy(run), run.tok, run.retriever, prompts, proto,
                                        self.cfg.seed, step, self.cfg.group_size, release=release)

    def trajectory_advantages(self, episodes) -> np.ndarray:
        """Step 2: A_traj_i = (U_i - mean_group) / (std_group + eps), groups of group_size lines."""
        rewards = np.array([ep.reward for ep in episodes])
        groups = np.arange(len(episodes)) // self.cfg.group_size
        return credit.grpo_advantages(rewards, groups, self.cfg.adv_eps)

    def turn_advantages(self, run, step, episodes, proto) -> tuple:
        """One advantage per turn: GRPO's A_traj on every turn of its episode."""
        a_traj = self.trajectory_advantages(episodes)
        return [np.full(len(ep.turns), a) for ep, a in zip(episodes, a_traj)], {"aux_tokens": 0}

    def advantages(self, run, step, episodes, batch, proto) -> tuple:
        """turn_advantages on the sampled tokens of each turn, 0 on every other token."""
        turn_adv, stats = self.turn_advantages(run, step, episodes, proto)
        width = batch["input_ids"].shape[1]
        return credit.spread_over_tokens(turn_adv, rollout.turn_spans(episodes), width), stats

    def step_stats(self, accel, stats: dict, factual_tokens: int) -> dict:
        """The step's counters summed over ranks (every value a number; aux_tokens among them)."""
        keys = sorted(stats)
        counts = torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64,
                              device=accel.device)
        total = accel.reduce(counts, "sum").tolist() if keys else []
        return {k: int(v) if float(v).is_integer() else v for k, v in zip(keys, total)}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict):
        """GRPO carries nothing across steps (a method with learned state overrides both)."""

    def policy(self, run):
        """The model episodes and branches are sampled from: the step's sampling copy while
        train_step has one (infra/weights.py's sampling_copy), else the policy."""
        sampling = getattr(run, "sampler", None)
        return sampling if sampling is not None else run.accel.unwrap_model(run.policy)


class Twice(Method):
    """TWICE: GRPO's steps 1-2, plus twin credit (steps 3-6) on the turns."""
    name = "twice"
    autocast = False  # twins are sampled from the sampling copy, outside any autocast

    def advantages(self, run, step, episodes, batch, proto, draw: int = 0) -> tuple:
        unit = token_twin_credit if self.cfg.twin_unit == "token" else twin_credit
        return unit(self.cfg, run, step, episodes, batch, proto, draw)

    def step_stats(self, accel, stats: dict, factual_tokens: int) -> dict:
        """The twin counters over ranks; the predictor's scores (the same on every rank)."""
        out = twin_stats(accel, stats["twins"], stats["n_decisions"], factual_tokens)
        out.update({k: stats[k] for k in ("predictor_auc", "predictor_brier", "q_mean")})
        out.update(term_stats(accel, stats["terms"]))
        return {**out, "aux_tokens": out["twin_tokens"]}


# ---------------------------------------------------------------------------------------------
# Steps 2-6, the turn unit (the paper's)

def twin_credit(cfg, run, step: int, episodes, batch, proto, draw: int = 0) -> tuple:
    """Steps 2-6: (B, L) token advantages A = A_traj + omega A_hat / sigma_hat, and the counters
    (with twin_data the twins' rows join the batch: stats["batch"], data_rows). draw > 0 redraws
    the credit's own randomness (branch draws, y') for the same episodes: the gradient audit's
    replicates (lab/gradaudit.py); training uses draw 0."""
    # 2. Trajectory advantage A_traj (GRPO's group-normalised outcome; traj_term = false: none).
    a_traj = trajectory_term(cfg, run, episodes)
    decisions = decision_table(cfg, episodes)
    # 3. Budget rule: q_t from the predicted discordance p_t and the cost c_t; keyed branch draws.
    p = run.predictor.predict(decisions.features)
    budget, branched, _ = branch(cfg, step, episodes, decisions, p, decisions.cost, draw)
    # 4. Twins of the branched decisions: y' at turn t, then the factual keys (same luck).
    pairs, twins, diffs = roll_twins(cfg, run, episodes, decisions, branched, proto, draw=draw)
    # 5. Horvitz-Thompson credit A_hat = 1[branched] mean_j D^j / q_t (with control_variate:
    #    g_t + 1[branched] (D - g_t) / q_t, g_t = (2U - 1) p_t); the predictor learns from every
    #    twin of the batch (scored first: AUC, Brier).
    g = (credit.control_baseline([episodes[i].reward for i, _ in decisions.index], p)
         if cfg.control_variate else None)
    a_flat = credit.ht_credit(diffs, branched, budget.q, g)
    fit = learn(run, run.predictor, decisions.features, [n for n, _ in pairs], twins)
    sigma = scale_step(cfg, run, diffs, branched, budget.q, a_flat)
    # 6. Token advantage A = A_traj + omega clip(A_hat / sigma_hat, +-twin_cap) on the sampled
    #    tokens of turn t; with twin_data the twins are rows too (A_traj: leave one line out).
    a_hat = [np.zeros(len(ep.turns)) for ep in episodes]
    for (i, t), a in zip(decisions.index, a_flat):
        a_hat[i][t] = a
    rows, row_adv, row_traj = [], [], []
    if getattr(cfg, "twin_data", False):
        rows, row_adv, weights, a_traj, row_traj = data_rows(cfg, episodes, decisions, pairs,
                                                             twins, budget.q, sigma)
        batch = joined_batch(cfg, run, episodes + rows, weights, batch["input_ids"].device)
    turn_adv = credit.turn_advantages(a_traj, a_hat, cfg.omega, sigma, cfg.twin_cap) + row_adv
    spans, width = rollout.turn_spans(episodes + rows), batch["input_ids"].shape[1]
    adv = credit.spread_over_tokens(turn_adv, spans, width)
    traj = credit.spread_over_tokens([np.full(len(ep.turns), a) for ep, a in
                                      zip(episodes + rows, list(a_traj) + row_traj)], spans, width)
    out = counters(twins, decisions, budget, fit,
                   terms(cfg, a_traj, a_flat / sigma, adv, traj, budget, episodes, twins, len(rows)))
    if rows:
        out["batch"] = batch
    shown = per_decision(decisions, budget, branched, a_flat, sigma)
    return adv, {**out, "twin_adv": adv - traj, "credit": shown}


def token_twin_credit(cfg, run, step: int, episodes, batch, proto, draw: int = 0) -> tuple:
    """Steps 2-6 with twin_unit = token (forks.py): each branched turn forks at one token k ~ r_t,
    and that token alone carries the twin term; the turn's other tokens carry A_traj (draw: as
    twin_credit's)."""
    a_traj = trajectory_term(cfg, run, episodes)
    decisions = decision_table(cfg, episodes)
    # DEVIATION F1: a fork at one token k ~ r_t of the turn, not the whole turn re-sampled
    table = forks.token_table(episodes, decisions, run.tok)
    law = forks.fork_law(table, run.token_predictor.predict(table.features), cfg.fork_floor)
    budget, branched, keys = branch(cfg, step, episodes, decisions, law.p, law.cost, draw)
    row = table.offsets[:-1].copy()  # each branched decision's fork token, as a row of the table
    for n in np.flatnonzero(branched):
        lo, hi = table.offsets[n], table.offsets[n + 1]
        row[n] = lo + forks.draw_fork(law.r[lo:hi], forks.fork_uniform(*keys[n]))
    pairs, twins, diffs = roll_twins(cfg, run, episodes, decisions, branched, proto,
                                     forks_at=row - table.offsets[:-1], draw=draw)
    a_flat = forks.fork_credit(diffs, branched, budget.q, law.r[row], table.pi[row])
    # DEVIATION F1: the token predictor learns from the fork tokens the law drew
    # (no importance weights)
    fit = learn(run, run.token_predictor, table.features, [row[n] for n, _ in pairs], twins)
    sigma = scale_step(cfg, run, diffs, branched, budget.q, a_flat)
    turn_adv = credit.turn_advantages(a_traj, [np.zeros(len(ep.turns)) for ep in episodes],
                                      cfg.omega, sigma)
    adv = credit.spread_over_tokens(turn_adv, rollout.turn_spans(episodes),
                                    batch["input_ids"].shape[1])
    traj, scaled = adv.copy(), a_flat / sigma
    term = cfg.omega * credit.capped(scaled, cfg.twin_cap)  # DEVIATION C7: the bound
    for n in np.flatnonzero(branched):
        i, t = decisions.index[n]
        k = row[n] - table.offsets[n]
        adv[i, len(episodes[i].prompt_ids) + episodes[i].turns[t].start + k] += term[n]
    return adv, {**counters(twins, decisions, budget, fit,
                            terms(cfg, a_traj, scaled, adv, traj, budget, episodes, twins)),
                 "twin_adv": adv - traj,
                 "credit": per_decision(decisions, budget, branched, a_flat, sigma)}


# ---------------------------------------------------------------------------------------------
# The pieces both units share

def trajectory_term(cfg, run, episodes) -> np.ndarray:
    """Step 2: A_traj of each line, or 0 with traj_term = false: the twin term alone carries the
    credit, as the oracle alone carries A* (methods/oracle.py), so a turn without a discordant twin
    gets no gradient."""
    a_traj = run.method.trajectory_advantages(episodes)
    return a_traj if cfg.traj_term else np.zeros_like(a_traj)


def decision_table(cfg, episodes) -> "rollout.Decisions":
    """Every decision of the batch with its features, cost c_t and key; the group's success rate
    is a feature of the discordance predictor."""
    rewards = np.array([ep.reward for ep in episodes])
    group_success = rewards.reshape(-1, cfg.group_size).mean(1).repeat(cfg.group_size)
    # late branching (twin_from_turn): only the later decisions get twins, a twin is a suffix
    return rollout.decision_table(episodes, group_success, getattr(cfg, "twin_from_turn", 0))


def branch(cfg, step: int, episodes, decisions, p, cost, draw: int = 0) -> tuple:
    """Step 3: (budget, branched mask, branch keys). q_t = clip(lambda sqrt(p_t / c_t), q_min, 1),
    lambda solved so that sum q_t c_t = twin_budget x factual tokens; decision t branches iff its
    keyed uniform < q_t (draw > 0: the key gains the draw, an independent uniform)."""
    factual_tokens = sum(ep.n_generated for ep in episodes)
    # DEVIATION T1: lambda is solved over this rank's decisions (its share of the budget)
    budget = credit.solve_budget(p, cost, cfg.twin_budget * factual_tokens, cfg.q_min,
                                 cfg.budget_rule)
    keys = [(cfg.seed, step, episodes[i].uid, episodes[i].line, t) + ((draw,) if draw else ())
            for i, t in decisions.index]
    draws = np.array([sampler.branch_uniform(*key) for key in keys])
    return budget, credit.branch_mask(budget.q, draws), keys


def roll_twins(cfg, run, episodes, decisions, branched, proto, forks_at=None,
               draw: int = 0) -> tuple:
    """Step 4: twins_per_decision twins of each branched decision, y' at turn t (or at its fork
    token), then the factual keys. Returns (pairs (decision, j), twins, D per decision). draw > 0
    takes the twins j of a later draw (alt_key(key, t, j + draw x twins_per_decision))."""
    K = cfg.twins_per_decision
    pairs = [(n, j) for n in np.flatnonzero(branched) for j in range(K)]
    requests = [(episodes[decisions.index[n][0]], decisions.index[n][1], j + draw * K)
                for n, j in pairs]
    ks = None if forks_at is None else [int(forks_at[n]) for n, _ in pairs]
    # memory: the other caches die before any twin runs
    branching = {id(ep) for ep, _, _ in requests}
    rollout.release_caches([ep for ep in episodes if id(ep) not in branching])
    # twin_data: no shortcut (a same-evidence twin would be a row without its continuation)
    shortcut = cfg.same_evidence_shortcut and not getattr(cfg, "twin_data", False)
    twins = rollout.run_twins(run.method.policy(run), run.tok, run.retriever, requests, proto,
                              cfg.coupling, shortcut,
                              run.method.independent_twins, ks, cfg.twin_chunk, release=True)
    diffs = [[] for _ in decisions.index]
    for (n, _), twin in zip(pairs, twins):
        diffs[n].append(twin.diff)
    return pairs, twins, diffs


def data_rows(cfg, episodes, decisions, pairs, twins, q, sigma) -> tuple:
    """twin_data: every twin a training row of its prompt's group (DESIGN.md section 5). Its tokens
    before turn t are its factual line's and get loss weight 0 (trained in that row); from turn t
    on they get 1/q_t: Horvitz-Thompson, so over the branch draws the rows sum to the rows of every
    decision's twin (q = 1), though q_t was chosen from the factual outcome. A self-twin's row is
    its factual line from turn t on (the same keys give the same tokens); same-evidence twins are
    rolled out (roll_twins). A line and its twins get A_traj = U minus the mean outcome of the
    group's other lines (credit.line_out_advantages; 0 with traj_term = false); a twin's turn t adds
    the mirrored pair credit -omega clip(D / sigma_hat, +-twin_cap), D = U - U'. Returns (rows,
    their turn advantages, weights, the factual lines' A_traj, the rows' A_traj)."""
    rows, owners = [], []
    for (n, _), tw in zip(pairs, twins):
        i, t = decisions.index[n]
        if tw.kind == "self":
            row = dataclasses.replace(episodes[i], mask=list(episodes[i].mask), branch_turn=t)
        elif tw.kind == "rollout":
            row = tw.twin
        else:
            raise ValueError(f"twin_data: a {tw.kind!r} twin has no continuation to train on")
        rollout.mask_shared_prefix(row)
        rows.append(row)
        owners.append((n, i, t, tw.diff))
    a_traj, a_rows = credit.line_out_advantages([ep.reward for ep in episodes], cfg.group_size,
                                                [(i, r.reward) for (_, i, _, _), r
                                                 in zip(owners, rows)], cfg.adv_eps)
    if not cfg.traj_term:  # the pair credit alone, on the factual lines and on the rows
        a_traj, a_rows = np.zeros_like(a_traj), np.zeros_like(a_rows)
    row_adv = []
    for (n, i, t, d), row, a in zip(owners, rows, a_rows):
        adv = np.full(len(row.turns), a)
        adv[t] += cfg.omega * credit.capped(-d / sigma, cfg.twin_cap)
        row_adv.append(adv)
    weights = [1.0 / q[n] for n, _, _, _ in owners]
    return rows, row_adv, weights, a_traj, list(a_rows)


def joined_batch(cfg, run, rows, weights, device) -> dict:
    """collate's batch of the factual lines and the twins' rows after them; the twins' loss mask
    holds their weights (the loss is a weighted token mean: train_twice.ppo_update)."""
    batch = rollout.collate(rows, run.tok.pad_token_id, cfg.max_context)
    mask = batch["loss_mask"].to(torch.float32)
    mask[len(rows) - len(weights):] *= torch.tensor(weights, dtype=torch.float32)[:, None]
    return {**{k: v.to(device) for k, v in batch.items()}, "loss_mask": mask.to(device)}


def learn(run, predictor, features, rows, twins) -> tuple:
    """The discordance predictor learns 1[D != 0] of every twin of the batch, over every rank
    (the same model on each); returns (AUC, Brier) of its predictions before the update."""
    labels = gather_list(run.accel, [(features[r].tolist(), float(twin.diff != 0))
                                     for r, twin in zip(rows, twins)])
    x = np.array([x for x, _ in labels]).reshape(-1, features.shape[1])
    return predictor.update(x, [y for _, y in labels])


def scale_step(cfg, run, diffs, branched, q, a_flat) -> float:
    """sigma_hat of this batch. twin_scale = d: the value from the batches before (so over this
    batch's branch draws E[A_hat / sigma_hat] = (Q - V) / sigma_hat at any q), then updated with
    the batch's Horvitz-Thompson mean of D^2 per decision over every rank. rms: updated first with
    the RMS of the batch's nonzero A_hat (the first form)."""
    if cfg.twin_scale == "rms":  # the credit as applied: fork weights, control variate included
        return run.sigma_hat.update(gather_list(run.accel, a_flat[a_flat != 0].tolist()))
    # DEVIATION C6: the paper's "running scale" read as a scale of D per decision,
    # from the batches before this one
    sigma = run.sigma_hat.value
    mean_square = credit.ht_mean_square(diffs, branched, q) * len(q)
    total, n = np.sum(gather_list(run.accel, [(mean_square, len(q))]), axis=0)
    run.sigma_hat.update_d(total / n if n else 0.0)
    return sigma


def per_decision(decisions, budget, branched, a_flat, sigma) -> dict:
    """Each decision's (episode, turn), q_t, branch and Horvitz-Thompson credit A_hat_t, and the
    batch's sigma_hat: what lab/twinview.py shows beside the twins (no counter reads it)."""
    return {"index": list(decisions.index), "q": budget.q, "branched": branched, "a_hat": a_flat,
            "sigma": sigma}


def counters(twins, decisions, budget, fit, term_sums) -> dict:
    auc, brier = fit
    q_mean = float(budget.q.mean()) if len(decisions.index) else 0.0
    return {"twins": twins, "n_decisions": len(decisions.index), "predictor_auc": auc,
            "predictor_brier": brier, "q_mean": q_mean, "terms": term_sums}


def terms(cfg, a_traj, scaled, adv, traj, budget, episodes, twins, rows: int = 0) -> tuple:
    """This rank's figures of the twin term's size (summed over ranks by term_stats): largest
    |A_traj|, largest |twin term| = omega |clip(A_hat / sigma_hat, +-twin_cap)|, decisions with a
    nonzero term and those the cap clipped, the term's and A_traj's absolute mass over the factual
    rows' sampled tokens (adv - traj and traj), the twin tokens spent (sum q_t c_t), the factual
    tokens, the twins' training rows (twin_data) and the census of discordant twins: D = +1 / -1
    in a group whose factual lines all agree (constant: A_traj = 0) or not (mixed)."""
    reward = np.array([ep.reward for ep in episodes]).reshape(-1, cfg.group_size)
    constant = np.ptp(reward, axis=1) == 0 if len(reward) else np.zeros(0, bool)
    line = {(ep.uid, ep.line): i // cfg.group_size for i, ep in enumerate(episodes)}
    sign = [(tw.diff > 0, bool(constant[line[tw.twin.uid, tw.twin.line]]))
            for tw in twins if tw.diff != 0]
    nonzero = scaled[scaled != 0]
    term = cfg.omega * credit.capped(nonzero, cfg.twin_cap)
    n = len(episodes)
    return (float(np.abs(a_traj).max(initial=0.0)), float(np.abs(term).max(initial=0.0)),
            len(nonzero), int((np.abs(nonzero) > cfg.twin_cap).sum()) if cfg.twin_cap > 0 else 0,
            float(np.abs(adv[:n] - traj[:n]).sum()), float(np.abs(traj[:n]).sum()), budget.spent,
            sum(ep.n_generated for ep in episodes), rows,
            *[sign.count(key) for key in CENSUS_KEYS])


CENSUS_KEYS = ((True, True), (True, False), (False, True), (False, False))
CENSUS = ("census_pos_constant", "census_pos_mixed", "census_neg_constant", "census_neg_mixed")


def term_stats(accel, sums) -> dict:
    """The logged twin-term figures over every rank: a_traj_max, twin_term_max (at most omega
    twin_cap, the bound), twin_capped (share of nonzero terms the cap clipped), twin_adv_share
    (the term's share of the absolute advantage mass on sampled tokens) and
    twin_budget_effective (sum q_t c_t / factual tokens: above twin_budget when the q_min floor
    binds), twin_rows (the twins trained on as rows: twin_data), the discordant twins' census."""
    rows = np.array(gather_list(accel, [sums]), dtype=float).reshape(-1, 9 + len(CENSUS))
    n, clipped, twin, traj, spent, factual, data, *census = rows[:, 2:].sum(0)
    return {"a_traj_max": rows[:, 0].max(), "twin_term_max": rows[:, 1].max(),
            "twin_capped": clipped / max(n, 1), "twin_adv_share": twin / max(twin + traj, 1e-12),
            "twin_budget_effective": spent / max(factual, 1), "twin_rows": int(data),
            **{k: int(v) for k, v in zip(CENSUS, census)}}


TWIN_COUNTERS = ("decisions", "twins", "self_twins", "shortcuts", "twin_rollouts", "discordant",
                 "twin_tokens")


def twin_stats(accel, twins, n_decisions: int, factual_tokens: int) -> dict:
    """The counters of TWIN_COUNTERS summed over ranks, and the logged rates
    (factual_tokens: already summed)."""
    kinds = [twin.kind for twin in twins]
    counts = [n_decisions, len(twins), kinds.count("self"), kinds.count("same_evidence"),
              kinds.count("rollout"), sum(twin.diff != 0 for twin in twins),
              sum(twin.tokens for twin in twins)]
    total = accel.reduce(torch.tensor(counts, dtype=torch.float64, device=accel.device),
                         "sum").tolist()
    out = {k: int(v) for k, v in zip(TWIN_COUNTERS, total)}
    out["discordance"] = out["discordant"] / max(out["twins"], 1)
    out["twin_token_ratio"] = out["twin_tokens"] / max(factual_tokens, 1)
    return out


def gather_list(accel, items: list) -> list:
    """Concatenation of every rank's list, in rank order (identical on all ranks)."""
    if accel.num_processes == 1:
        return list(items)
    from accelerate.utils import gather_object
    return list(gather_object(list(items)))
