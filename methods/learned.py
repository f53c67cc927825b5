"""Learned credit estimators (DESIGN.md section 7): PPO's critic, SPA-RL's progress
estimator, AgentPRM's PRM, each trainer class next to its formula, on the hook of
methods/baselines.py (`Method`).

`Estimator`: a copy of the policy's transformer body with a scalar head, as Search-R1's PPO critic
is a copy of the policy model with a value head (verl critic: AutoModelForTokenClassification,
num_labels = 1). It scores every position of a batch (B, L) and trains with its own AdamW on a loss
the method defines, on the step's batch, before the policy update of that step. Gradients are
averaged over ranks before each optimizer step, so every rank holds the same estimator; its weights
and AdamW state are saved beside every checkpoint (estimator.pt). # DEVIATION L1: the head starts
at zero (verl: random), so the first step's values are 0 (PRM: Q = 0.5); all three estimators
learn at estimator_lr_scale x lr (Search-R1's critic/actor ratio, 1e-5 / 1e-6; the papers' PE and
PRM are trained offline).

Besides aux_tokens (generated), each method logs aux_fwd_tokens / aux_bwd_tokens (tokens through
an extra forward / backward pass) and time_credit (seconds, mean over ranks). Deviations L1-L3,
L5-L7 (DESIGN.md section 13).
"""
import copy
import math
import os
import time

import numpy as np
import torch

from methods import baselines
from generation import logprobs
from infra import adamw
import rollout
import sampler
import twice
from credit import as_array, group_index, grpo_advantages


# --------------------------------------------------------------------------------------------------
# The estimator: a scalar head on a copy of the policy's body


class Scorer(torch.nn.Module):
    """Transformer body + linear head: (B, L) token ids -> (B, L) scalars, position k scoring the
    prefix [0, k]."""

    def __init__(self, body, hidden: int):
        super().__init__()
        self.body = body
        self.head = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids, attention_mask):
        # (B, L, H)
        h = self.body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(h.float()).squeeze(-1)  # (B, L)


class Estimator:
    """A Scorer initialised from the policy's body, its AdamW, and counters of the tokens it ran
    on."""

    def __init__(self, policy, lr: float, weight_decay: float, device):
        body = copy.deepcopy(policy.base_model).float()
        body.requires_grad_(True)
        self.net = Scorer(body, policy.config.hidden_size).to(device)
        self.opt = adamw.AdamW(self.net.parameters(), lr=lr, weight_decay=weight_decay)
        self.fwd_tokens = 0  # tokens through a forward pass (scoring and training)
        self.bwd_tokens = 0  # tokens through a backward pass

    @torch.no_grad()
    def scores(self, input_ids, attention_mask, micro: int) -> torch.Tensor:
        """(B, L) scores, micro-batched, no gradient."""
        self.net.eval()
        out = [self.net(input_ids[r], attention_mask[r])
               for r in logprobs.micro_batches(len(input_ids), micro)]
        self.fwd_tokens += int(attention_mask.sum())
        return torch.cat(out)

    def fit(self, accel, input_ids, attention_mask, loss_sum, norm: float, micro: int,
            grad_clip=1.0) -> float:
        """One optimizer step on loss_sum(scores (b, L), rows) / norm summed over micro-batches of
        rows (the caller's normalisation, e.g. the batch's token or row count); returns the loss,
        averaged over ranks."""
        self.net.train()
        self.opt.zero_grad(set_to_none=True)
        total = 0.0
        with torch.enable_grad():
            for rows in logprobs.micro_batches(len(input_ids), micro):
                loss = loss_sum(self.net(input_ids[rows], attention_mask[rows]), rows) / norm
                if not torch.isfinite(loss):
                    raise FloatingPointError(
                        f"estimator loss = {loss.item()} (lower estimator_lr_scale)")
                loss.backward()
                total += loss.item()
        if accel.num_processes > 1:  # every rank keeps the same estimator
            for p in self.net.parameters():
                if p.grad is not None:
                    p.grad = accel.reduce(p.grad, "mean")
            total = float(accel.reduce(torch.tensor(total, device=accel.device), "mean"))
        torch.nn.utils.clip_grad_norm_(self.net.parameters(), grad_clip)
        self.opt.step()
        n = int(attention_mask.sum())
        self.fwd_tokens, self.bwd_tokens = self.fwd_tokens + n, self.bwd_tokens + n
        return total

    def state_dict(self) -> dict:
        return {"net": self.net.state_dict(), "opt": self.opt.state_dict()}

    def load_state_dict(self, state: dict):
        self.net.load_state_dict(state["net"])
        self.opt.load_state_dict(state["opt"])


def _response_positions(episodes) -> list:
    """Per episode, the position (in collate's rows) of each turn's last sampled token: where the
    state-action (s_t, a_t) has been read, so a scorer's output there is a function of
    (s_t, a_t)."""
    return [[len(ep.prompt_ids) + t.end - 1 for t in ep.turns] for ep in episodes]


class _Learned(twice.Method):
    """A Method with one Estimator (above), built from the policy at first use, saved in every
    checkpoint as estimator.pt (weights and AdamW state: --resume restores it exactly)."""
    estimator_file = "estimator.pt"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.est = None

    def estimator(self, run) -> Estimator:
        if self.est is None:
            lr = self.cfg.lr * self.cfg.estimator_lr_scale
            self.est = Estimator(run.accel.unwrap_model(run.policy), lr, self.cfg.weight_decay,
                                 run.accel.device)
        return self.est

    def save(self, folder: str):
        if self.est is not None:
            torch.save(self.est.state_dict(), os.path.join(folder, self.estimator_file))

    def load(self, folder: str, run):
        path = os.path.join(folder, self.estimator_file)
        if os.path.exists(path):
            self.estimator(run).load_state_dict(torch.load(path, map_location=run.accel.device))

    def train_estimator(self, run, step, ids, att, loss_sum, norm) -> float:
        """ppo_epochs passes of mini_batches optimizer steps over the step's rows (the actor's
        schedule, as verl's critic). loss_sum(scores, rows) sums the loss of the given batch rows;
        norm(rows) is its normaliser."""
        cfg, losses = self.cfg, []
        for epoch in range(cfg.ppo_epochs):
            seed = sampler.mix(cfg.seed, step, epoch, sampler.ESTIMATOR_TAG)
            order = np.random.default_rng(seed).permutation(len(ids))
            for mb in np.array_split(order, cfg.mini_batches):
                mb = torch.as_tensor(mb)
                losses.append(self.est.fit(run.accel, ids[mb], att[mb],
                                           lambda s, rows, mb=mb: loss_sum(s, mb[rows]),
                                           norm(mb), cfg.micro_batch_size))
        return float(np.mean(losses))

    def cost(self, t0: float, accel, aux_tokens=0) -> dict:
        """This step's extra cost (counters reset): summed over ranks by reduce_stats, so time is
        divided here."""
        fwd, bwd = self.est.fwd_tokens, self.est.bwd_tokens
        self.est.fwd_tokens = self.est.bwd_tokens = 0
        return {"aux_tokens": aux_tokens, "aux_fwd_tokens": fwd, "aux_bwd_tokens": bwd,
                "time_credit": (time.time() - t0) / accel.num_processes}


# --------------------------------------------------------------------------------------------------
# PPO: a learned critic and GAE


def gae(rewards, values, mask, gamma=1.0, lam=1.0) -> tuple:
    """GAE (Schulman et al. 2016, Eq. 16): A_k = sum_l (gamma lam)^l delta_{k+l},
    delta_k = r_k + gamma V_{k+1} - V_k, returns = A + V. Rows (B, L); positions with mask 0
    (observation tokens) are skipped, not stepped through: the next sampled token's value
    bootstraps the last one before an observation, and the value after the last sampled token is
    0. gamma = lam = 1 gives A_k = R - V_k (the sum telescopes). Returns (advantages, returns), 0
    off-mask."""
    r, v, m = as_array(rewards), as_array(values), as_array(mask) > 0
    adv, ret = np.zeros(r.shape), np.zeros(r.shape)
    for b in range(len(r)):
        idx = np.flatnonzero(m[b])
        acc, next_v = 0.0, 0.0
        for k in idx[::-1]:
            acc = r[b, k] + gamma * next_v - v[b, k] + gamma * lam * acc
            adv[b, k], ret[b, k], next_v = acc, acc + v[b, k], v[b, k]
    return adv, ret


def masked_whiten(x, mask, eps=1e-8) -> np.ndarray:
    """(x - mean) / sqrt(var + eps) over the masked entries, 0 elsewhere (verl's masked_whiten of
    PPO advantages; variance unbiased as there)."""
    x, m = as_array(x), as_array(mask) > 0
    vals = x[m]
    if vals.size < 2:
        return np.zeros(x.shape)
    out = np.zeros(x.shape)
    out[m] = (vals - vals.mean()) / math.sqrt(vals.var(ddof=1) + eps)
    return out


class PPO(_Learned):
    """PPO with a learned critic (Schulman et al. 2017), as Search-R1 runs it (verl,
    algorithm.adv_estimator=gae): a critic initialised from the policy scores V at every token; GAE
    (Schulman et al. 2016, Eq. 16) with gamma = lambda = 1 over the sampled tokens (observation
    tokens masked and skipped), reward = the outcome on the last sampled token; advantages whitened
    over the batch (verl masked_whiten); the critic regresses the GAE returns, 0.5 (V - R)^2
    token-mean (verl dp_critic), on the same batch, values taken before its update. # DEVIATION L2:
    no value clipping (verl cliprange_value 0.5) and no KL-in-reward: the KL stays a loss term
    (kl_coef, as for every method), so methods differ only in the advantage."""
    name = "ppo"

    def advantages(self, run, step, episodes, batch, proto) -> tuple:
        return self.token_advantages(run, step, episodes, batch, np.zeros(batch["input_ids"].shape))

    def token_advantages(self, run, step, episodes, batch, adv) -> tuple:
        t0, cfg, est = time.time(), self.cfg, self.estimator(run)
        ids, att = batch["input_ids"], batch["attention_mask"]
        mask = batch["loss_mask"][:, 1:].cpu().numpy()  # (B, L-1): position k predicts token k + 1
        # V(s) before token k + 1
        values = est.scores(ids, att, cfg.micro_batch_size)[:, :-1].cpu().numpy()
        rewards = np.zeros(mask.shape)
        for b, ep in enumerate(episodes):
            sampled = np.flatnonzero(mask[b])
            if len(sampled):
                rewards[b, sampled[-1]] = ep.reward
        a, ret = gae(rewards, values, mask, cfg.gamma, cfg.gae_lambda)
        a = masked_whiten(a, mask)  # DEVIATION L3: over this rank's tokens (verl: the whole batch)
        ret_t = torch.tensor(ret, dtype=torch.float32, device=ids.device)
        m = torch.tensor(mask, dtype=torch.float32, device=ids.device)
        loss = self.train_estimator(
            run, step, ids, att,
            lambda s, rows: (0.5 * (s[:, :-1] - ret_t[rows])**2 * m[rows]).sum(),
            lambda rows: float(m[rows].sum().clamp(min=1)))
        out = np.zeros(adv.shape)
        # back to token layout: token k + 1's advantage sits at k + 1 (train_step shifts it)
        out[:, 1:] = a
        return out, {**self.cost(t0, run.accel), "critic_loss": loss,
                     "value_mean": float((values * mask).sum() / max(mask.sum(), 1))}


# --------------------------------------------------------------------------------------------------
# SPA-RL: a progress estimator whose contributions sum to the outcome


def group_turn_normalise(values_per_episode, group_ids, eps=1e-6) -> list:
    """z-score of per-turn values over all turns of each group's episodes (IGPO's group-wise
    normalisation of turn rewards, used for SPA-RL returns and AgentPRM Q values). Per-episode
    arrays in, per-episode arrays out."""
    vals = [as_array(v).reshape(-1) for v in values_per_episode]
    n = np.array([len(v) for v in vals], dtype=np.int64)
    if n.sum() == 0:
        return [np.zeros(0) for _ in vals]
    flat = grpo_advantages(np.concatenate(vals), np.repeat(group_index(group_ids), n), eps)
    return np.split(flat, np.cumsum(n)[:-1])


def spa_rl_rewards(contributions, grounding, alpha, beta) -> np.ndarray:
    """SPA-RL (Wang et al. 2025) fused step reward r_t = alpha * c_t + beta * g_t: progress
    contribution c_t from the learned estimator, grounding g_t = 1 if the action could be
    executed."""
    return alpha * as_array(contributions) + beta * as_array(grounding)


def spa_rl_loss(pred_contribs_per_episode, outcomes):
    """SPA-RL progress-estimator loss: mean over episodes of (sum_t c_hat_t - R)^2. Duck-typed:
    torch tensors in, differentiable torch scalar out; lists or numpy in, a float out."""
    terms = [((c if hasattr(c, "sum") else np.asarray(c, dtype=np.float64)).sum() - r) ** 2
             for c, r in zip(pred_contribs_per_episode, outcomes)]
    return sum(terms) / len(terms)


class SPARL(_Learned):
    """SPA-RL (Wang et al. 2025, "Stepwise Progress Attribution"): a progress estimator
    c_hat(s_t, a_t) (a head on a copy of the policy, read at turn t's last token) is trained so
    that an episode's contributions sum to its outcome, L_PE = mean_i (sum_t c_hat_t - R_i)^2
    (Eq. 3; spa_rl_loss); the fused step reward r_t = alpha c_t + beta g_t (Eq. 5; g_t = 1 when
    turn t's action was a valid search or answer; alpha = 1, as only beta / alpha matters after
    the normalisation below) replaces the sparse outcome, and its discounted returns-to-go drive
    the update. The estimator is trained first, then scores the batch (the paper's order:
    estimator, then RL). # DEVIATION L5: the estimator trains online on each step's batch (paper:
    on exploration rollouts, beforehand). # DEVIATION L6: returns-to-go are z-normalised over the
    group's turns (GRPO's baseline) instead of PPO's critic.
    """
    name = "spa_rl"

    def turn_advantages(self, run, step, episodes, proto) -> tuple:
        t0, cfg, est = time.time(), self.cfg, self.estimator(run)
        batch = rollout.collate(episodes, run.tok.pad_token_id)
        ids, att = (batch["input_ids"].to(run.accel.device),
                    batch["attention_mask"].to(run.accel.device))
        pos, R = _response_positions(episodes), torch.tensor([ep.reward for ep in episodes])
        loss = self.train_estimator(
            run, step, ids, att,
            lambda s, rows: spa_rl_loss([s[j, pos[int(i)]] for j, i in enumerate(rows)],
                                        R[rows].to(s.device)) * len(rows),
            lambda rows: float(len(rows)))
        s = est.scores(ids, att, cfg.micro_batch_size).cpu().numpy()
        contrib = [s[b, pos[b]] for b in range(len(episodes))]
        ground = [[float(t.action in ("search", "answer")) for t in ep.turns] for ep in episodes]
        returns = [baselines.discounted_returns(spa_rl_rewards(c, g, 1.0, cfg.spa_beta), cfg.gamma)
                   for c, g in zip(contrib, ground)]
        adv = group_turn_normalise(returns, baselines._group_ids(cfg, episodes), cfg.adv_eps)
        return adv, {**self.cost(t0, run.accel), "estimator_loss": loss,
                     "progress_sum": float(np.mean([c.sum() for c in contrib]))}


# --------------------------------------------------------------------------------------------------
# AgentPRM: a process reward model on Monte Carlo targets


def agentprm_targets(sa_keys, returns) -> np.ndarray:
    """AgentPRM (Choudhury 2025, "Process Reward Models for LLM Agents") MC target:
    Q_hat(s, a) = mean discounted return-to-go over every visit of the same (state, action) key;
    returned per step."""
    g, R = group_index(sa_keys), as_array(returns).reshape(-1)
    return (np.bincount(g, R) / np.bincount(g))[g]


def soft_bce(q_pred, q_target, eps=1e-7) -> float:
    """AgentPRM loss: -mean(Q_hat log Q + (1 - Q_hat) log(1 - Q)), Q clipped to [eps, 1 - eps]."""
    p, t = np.clip(as_array(q_pred), eps, 1 - eps), as_array(q_target)
    return float(-np.mean(t * np.log(p) + (1 - t) * np.log1p(-p)))


class AgentPRM(_Learned):
    """AgentPRM (Choudhury 2025, "Process Reward Models for LLM Agents"): a PRM
    Q_phi(s_t, a_t) = sigmoid(head) on a copy of the policy, read at turn t's last token, trained
    by soft binary cross-entropy (Eq. 4; soft_bce) on Monte Carlo targets Q_hat(s, a) = the mean
    return over every visit of the same (s, a) (Eq. 3; agentprm_targets): the factual episodes plus
    prm_rollouts continuations after each non-final turn (rollout.continue_from, keys
    fresh_key(ep.key, MC_Q_TAG, t, k); their tokens are aux_tokens). The policy then maximises
    Q_phi (Eq. 5): turn t's advantage is Q_phi(s_t, a_t) z-normalised over the group's turns.
    # DEVIATION L7: PRM and policy train online, step by step, on the same stream (paper:
    alternating stages), and the KL anchor is the frozen reference (paper: the previous policy)."""
    name = "agentprm"

    def mc_targets(self, run, episodes, proto) -> tuple:
        """Q_hat per factual decision (episode-major) and the continuations' generated tokens."""
        cfg, keys, returns = self.cfg, [], []
        for ep in episodes:
            for t, turn in enumerate(ep.turns):
                keys.append(np.asarray(ep.prompt_ids + ep.ids[:turn.end], dtype=np.int64).tobytes())
                returns.append(cfg.gamma ** (len(ep.turns) - 1 - t) * ep.reward)
        requests = [(ep, t, True, sampler.fresh_key(ep.key, sampler.MC_Q_TAG, t, k))
                    for ep in episodes for t in range(len(ep.turns) - 1)
                    for k in range(cfg.prm_rollouts)]
        branches = (rollout.continue_from(self.policy(run), run.tok, run.retriever, requests, proto)
                    if requests else [])
        for (ep, t, _, _), br in zip(requests, branches):
            keys.append(
                np.asarray(ep.prompt_ids + ep.ids[:ep.turns[t].end], dtype=np.int64).tobytes())
            returns.append(cfg.gamma ** (len(br.turns) - 1 - t) * br.reward)
        n = sum(len(ep.turns) for ep in episodes)
        return agentprm_targets(keys, returns)[:n], sum(br.n_generated for br in branches)

    def turn_advantages(self, run, step, episodes, proto) -> tuple:
        t0, cfg, est = time.time(), self.cfg, self.estimator(run)
        targets, aux = self.mc_targets(run, episodes, proto)
        batch = rollout.collate(episodes, run.tok.pad_token_id)
        ids, att = (batch["input_ids"].to(run.accel.device),
                    batch["attention_mask"].to(run.accel.device))
        pos = _response_positions(episodes)
        q_hat = np.split(targets, np.cumsum([len(p) for p in pos])[:-1])
        q_hat = [torch.tensor(q, dtype=torch.float32, device=ids.device) for q in q_hat]
        bce = torch.nn.functional.binary_cross_entropy_with_logits
        loss = self.train_estimator(
            run, step, ids, att,
            lambda s, rows: sum(bce(s[j, pos[int(i)]], q_hat[int(i)], reduction="sum")
                                for j, i in enumerate(rows)),
            lambda rows: float(max(sum(len(pos[int(i)]) for i in rows), 1)))
        s = est.scores(ids, att, cfg.micro_batch_size).cpu().numpy()
        q = [1.0 / (1.0 + np.exp(-s[b, pos[b]])) for b in range(len(episodes))]
        adv = group_turn_normalise(q, baselines._group_ids(cfg, episodes), cfg.adv_eps)
        return adv, {**self.cost(t0, run.accel, aux), "estimator_loss": loss,
                     "q_mean": float(np.mean(targets))}
