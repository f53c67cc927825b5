"""The credit methods TWICE is compared with, as trainers of the same loop (DESIGN.md section 7).

`train_twice.py --method=NAME` selects one. TWICE itself (and its ablations) is told inline in train_twice.train_step,
steps 3-5; every other method is a `Method` here, and plugs into the same step at three points:

  1. episodes = method.rollout(run, step, prompts, proto)          the step's episodes (default: G factual lines per
                                                                    prompt; tree methods branch here)
  2.-5. adv, stats = method.turn_advantages(run, step, episodes, proto)
                                                                    per episode, one advantage per turn (the token
                                                                    advantage of every sampled token of that turn);
                                                                    stats["aux_tokens"] counts every token generated
                                                                    beyond the factual episodes
  state: method.state_dict() / load_state_dict() go into every checkpoint's run.json (learned estimators, counters),
  so --resume continues exactly.
  optional: adv, stats = method.token_advantages(run, step, episodes, batch, adv)  (B, L) token advantages in place
  of the spread per-turn ones (ppo's GAE, craft); method.save(dir) / load(dir, run): tensors beside run.json (learned
  estimators' weights and optimizer state).

Every extra rollout goes through rollout.py (branch, continue_from, run_twins) with keys derived like twin keys
(sampler.fresh_key(episode key, TAG, ...)), so every method is exactly reproducible and resumable.
"""
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

import credit
import estimators
import protocol
import rollout
import sampler

TWIN_COUNTERS = ("decisions", "twins", "self_twins", "shortcuts", "twin_rollouts", "discordant", "twin_tokens")


@dataclass
class Knobs:
    """The baselines' own knobs (DESIGN.md section 7), paper defaults; train_twice.Config inherits them."""
    vine_k: int = 9                 # vineppo: K Monte Carlo continuations per turn boundary (Kazemnejad et al.: 9)
    step_gamma: float = 0.95        # gigpo, hgpo: gamma of the step return R_t = gamma^(T-1-t) U (GiGPO: 0.95)
    hgpo_k: int = 2                 # hgpo: longest history context K of the step groups (levels k = 0..K)
    hgpo_alpha: float = 1.0         # hgpo: level weight w_k ~ (k + 1)^alpha
    arpo_initial: float = 0.5       # arpo: full samples N / rollout budget M = group_size (ARPO: 8 of 16)
    arpo_beam: int = 2              # arpo: partial samples Z branched per triggered step (ARPO: 2)
    arpo_beta: float = 0.2          # arpo: entropy weight beta of P_t = alpha + beta Normalize(H_t - H_initial)
    arpo_tau: float = 0.5           # arpo: branch iff P_t > tau, alpha ~ U(0, 1) (ARPO's code: 0.5)
    tree_m: int = 2                 # tree_grpo: trees M per prompt; expansions fill the group to group_size leaves
    tree_l: int = 1                 # tree_grpo: expansion rounds L
    gamma: float = 1.0              # discount: ppo's GAE, igpo/spa_rl returns, agentprm MC targets (papers: 1)
    gae_lambda: float = 1.0         # lambda of ppo's GAE (Search-R1: 1)
    estimator_lr_scale: float = 10.0  # lr of critic / progress estimator / PRM over lr (Search-R1: 1e-5 / 1e-6)
    spa_beta: float = 0.1           # SPA-RL weight of the grounding reward g_t (progress weight alpha = 1)
    prm_rollouts: int = 1           # AgentPRM Monte Carlo continuations per non-final decision
    craft_beta: float = 1.0         # CRAFT inverse temperature of the sibling weights exp(beta g)

    def knob_checks(self) -> list:
        """(field, ok, rule) of every knob above (config.check reports them with the trainer's)."""
        at_least = {"vine_k": 1, "hgpo_k": 0, "arpo_beam": 1, "tree_m": 1, "tree_l": 1, "estimator_lr_scale": 0,
                    "spa_beta": 0, "prm_rollouts": 0, "craft_beta": 0}
        return ([(k, getattr(self, k) >= v, f">= {v}") for k, v in at_least.items()] +
                [(k, 0 < getattr(self, k) <= 1, "in (0, 1]") for k in ("step_gamma", "arpo_initial", "gamma")] +
                [("gae_lambda", 0 <= self.gae_lambda <= 1, "in [0, 1]"),
                 ("tree_m", self.tree_m <= getattr(self, "group_size", self.tree_m), "<= group_size")])


class Method:
    """GRPO (Shao et al. 2024, as run by Search-R1): the group-normalised outcome on every turn; no extra rollouts."""
    name = "grpo"

    def __init__(self, cfg):
        self.cfg = cfg

    def rollout(self, run, step, prompts, proto) -> list:
        policy = run.accel.unwrap_model(run.policy)
        episodes = rollout.start_episodes(run.tok, prompts, self.cfg.seed, step, self.cfg.group_size)
        return rollout.run_episodes(policy, run.tok, run.retriever, episodes, proto)

    def trajectory_advantages(self, episodes) -> np.ndarray:
        """A_traj_i = (U_i - mean_group) / (std_group + eps), groups of group_size consecutive episodes."""
        rewards = np.array([ep.reward for ep in episodes])
        return credit.grpo_advantages(rewards, np.arange(len(episodes)) // self.cfg.group_size, self.cfg.adv_eps)

    def turn_advantages(self, run, step, episodes, proto) -> tuple:
        a_traj = self.trajectory_advantages(episodes)
        return [np.full(len(ep.turns), a) for ep, a in zip(episodes, a_traj)], {"aux_tokens": 0}

    independent_twins = False  # TWIN_METHODS only: run_twins in the textbook independent mode

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict):
        """GRPO carries nothing across steps (a method with learned state overrides both)."""

    def policy(self, run):
        return run.accel.unwrap_model(run.policy)


class Independent(Method):
    """The textbook independent counterfactual (e.g. the independent branching the TWICE paper compares with, its
    "21.7% wrong-sign" row): TWICE's loop (budget rule, Horvitz-Thompson, predictor, omega, sigma_hat: steps 3-6),
    with D_t = U - U' from a twin whose alternative y' and everything after it use fresh keys
    (rollout.run_twins(independent=True)): a self-twin is rolled out like any other, no same-evidence shortcut.
    # DEVIATION B1: the budget rule, the discordance predictor, Horvitz-Thompson and sigma_hat stay TWICE's (only the
    counterfactual changes), so the comparison isolates the coupling; the predictor learns independent discordance."""
    name = "independent"
    independent_twins = True


class VinePPO(Method):
    """VinePPO (Kazemnejad et al. 2024, "VinePPO: Unlocking RL Potential for LLM Reasoning through Refined Credit
    Assignment": its MC value estimate and advantage, gamma = 1, reward only at the end):
    V_hat(s_t) = (1/K) sum_k U(rollout k from s_t), K = vine_k Monte Carlo continuations with fresh keys from every
    turn boundary of every episode, and A_t = V_hat(s_{t+1}) - V_hat(s_t) with V(s_T) = U
    (credit.vineppo_advantages). The K continuations from
    s_t use turn_key(fresh_key(episode key, VINE_TAG, t, k), turn): reproducible, independent of the episode.
    # DEVIATION B2: every episode gets its own K continuations from each of its boundaries, s_0 included, though a
    prompt's G lines share s_0 (as VinePPO estimates per trajectory); K = 9 is VinePPO's default.
    # DEVIATION B3: no advantage whitening and no GRPO term: A_t is the method's whole advantage (VinePPO trains
    PPO on these advantages; a turn is the step, as in its multi-step reading of a response)."""
    name = "vineppo"

    def turn_advantages(self, run, step, episodes, proto) -> tuple:
        K = self.cfg.vine_k
        requests = [(ep, t, False, sampler.fresh_key(ep.key, sampler.VINE_TAG, t, k))
                    for ep in episodes for t in range(len(ep.turns)) for k in range(K)]
        conts = rollout.continue_from(self.policy(run), run.tok, run.retriever, requests, proto)
        outcomes, adv = iter(c.reward for c in conts), []
        for ep in episodes:
            values = [np.mean([next(outcomes) for _ in range(K)]) for _ in ep.turns]  # V_hat(s_0..s_{T-1})
            adv.append(credit.vineppo_advantages(values, ep.reward))
        return adv, {"aux_tokens": sum(c.n_generated for c in conts), "continuations": len(conts)}


class GiGPO(Method):
    """GiGPO (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent Training", verl-agent):
    A = A^E(tau_i) + omega * A^S(a_t) (its combined advantage; credit.gigpo_combine), A^E the episode
    group advantage (GRPO's), A^S the return-to-go R_t = gamma^(T-1-t) U normalised by std within the step's anchor
    group: every step of the prompt's G episodes taken from an identical state (credit.gigpo_step_advantages).
    # DEVIATION B4: the state of a search episode is the evidence it has been shown, rollout.evidence_states:
    (prompt, the observation of every earlier turn: retrieved ids in rank order, or "invalid"); the agent's own
    text is not part of it (GiGPO's anchors are environment states). omega is the shared `omega` field."""
    name = "gigpo"

    def turn_advantages(self, run, step, episodes, proto) -> tuple:
        keys = [s for ep in episodes for s in rollout.evidence_states(ep)]
        returns = np.concatenate([credit.step_returns(ep.reward, len(ep.turns), self.cfg.step_gamma)
                                  for ep in episodes])
        a_step = credit.gigpo_step_advantages(keys, returns, "std", self.cfg.adv_eps)
        return _combine(self.trajectory_advantages(episodes), a_step, episodes, self.cfg.omega), {
            "aux_tokens": 0, "anchor_groups": len(set(keys))}


class HGPO(Method):
    """HGPO (hierarchical history-context step groups; credit.hgpo_advantages): steps grouped at every context
    length k = 0..hgpo_k by their last k + 1 states (credit.hgpo_context_keys), A_k the group-normalised return
    R_t = gamma^(T-1-t) U within the level-k group, A^H = sum_k w_k A_k, w_k ~ (k + 1)^hgpo_alpha.
    # DEVIATION B5: the state of step t is (prompt, the observation just before it: retrieved ids, "invalid", or the
    prompt for t = 0); A = A^E + omega * A^H as GiGPO's combination; hgpo_k = 2 is our choice."""
    name = "hgpo"

    def turn_advantages(self, run, step, episodes, proto) -> tuple:
        levels = [[] for _ in range(self.cfg.hgpo_k + 1)]
        for ep in episodes:
            states = [(ep.uid, ()) if t == 0 else (ep.uid, rollout.observation_of(ep.turns[t - 1]))
                      for t in range(len(ep.turns))]
            for level, keys in zip(levels, credit.hgpo_context_keys(states, self.cfg.hgpo_k)):
                level.extend(keys)
        returns = np.concatenate([credit.step_returns(ep.reward, len(ep.turns), self.cfg.step_gamma)
                                  for ep in episodes])
        a_h = credit.hgpo_advantages(levels, returns, self.cfg.hgpo_alpha, self.cfg.adv_eps)
        return _combine(self.trajectory_advantages(episodes), a_h, episodes, self.cfg.omega), {"aux_tokens": 0}


def _combine(a_episode, a_step_flat, episodes, omega) -> list:
    """Per-episode arrays A^E_i + omega * A^S_{i,t} from a flat, episode-major step array."""
    splits = np.split(np.asarray(a_step_flat), np.cumsum([len(ep.turns) for ep in episodes])[:-1])
    return [credit.gigpo_combine(a, s, omega) for a, s in zip(a_episode, splits)]


class TreeMethod(Method):
    """Methods whose G training episodes per prompt are the leaves of a rollout tree (ARPO, Tree-GRPO).

    A branch is rollout.branch(leaf, t) continued with fresh keys from turn t on (rollout.continue_from), so a
    tree is a pure function of the episode keys. Each token is generated once: a branch's n_generated counts from
    its branch turn, so factual_tokens counts every tree token exactly once and aux_tokens is 0.
    # DEVIATION B6: the leaves are the step's training episodes, so branch tokens are factual_tokens, not aux.
    Shared-prefix tokens sit in several leaf rows: rollout.mask_shared_prefix gives them loss mask 0 in every row
    but the leaf that sampled them, and that row's turn carries the mean advantage of the leaves through it
    (credit.shared_prefix_advantages): each token enters the token-mean loss once, with its branches' mean.
    rollout() leaves this step's tree (segment paths, tree ids) on self for turn_advantages() of the same step;
    nothing crosses steps, so state_dict() stays empty."""

    def _finish(self, trees) -> list:
        """trees: per prompt, a list of (episode, parent leaf index or None, branch turn, tree id)."""
        self.paths, self.tree_ids, self.prompt_ids, episodes = [], [], [], []
        for p, tree in enumerate(trees):
            paths = []
            for i, (ep, parent, t, m) in enumerate(tree):
                own = [(p, i, u) for u in range(t, len(ep.turns))]
                paths.append(own if parent is None else paths[parent][:t] + own)
                rollout.mask_shared_prefix(ep)
                self.tree_ids.append((p, m))
                self.prompt_ids.append(p)
                episodes.append(ep)
            self.paths += paths
        self.branches = sum(parent is not None for tree in trees for _, parent, _, _ in tree)
        return episodes

    def turn_advantages(self, run, step, episodes, proto) -> tuple:
        a_leaf, adv = self.leaf_advantages(episodes), []
        for p in sorted(set(self.prompt_ids)):
            rows = [n for n, q in enumerate(self.prompt_ids) if q == p]
            adv += credit.shared_prefix_advantages(a_leaf[rows], [self.paths[n] for n in rows])
        return adv, {"aux_tokens": 0, "branches": self.branches}


class ARPO(TreeMethod):
    """ARPO (Dong et al. 2025, "Agentic Reinforced Policy Optimization": entropy-based adaptive rollout and
    advantage attribution), rollout budget M = group_size trajectories per prompt, as GRPO's: N = round(arpo_initial
    * M) full samples; after each tool observation
    (turn t following an executed search) the entropy of the next turn gives P_t = alpha + beta * Normalize(H_t -
    H_initial) (credit.arpo_branch, alpha a keyed U(0, 1) as the official code draws it); P_t > tau branches
    arpo_beam partial samples from s_t, until the M - N remaining slots are spent; unspent slots are full samples.
    Leaf advantage: the group-normalised reward over the M leaves; shared-prefix tokens get the mean of their
    branches (its advantage attribution; credit.shared_prefix_advantages).
    # DEVIATION B7: H_t is the mean entropy of the whole turn after the observation (ARPO: the first k tokens);
    branching happens once, from the N initial samples, candidates in (sample, turn) order (ARPO branches during
    generation, partial samples included); the initial and the filling samples are GRPO's lines 0..M-1 (same keys)."""
    name = "arpo"

    def triggered(self, ep, vocab: int) -> list:
        """Turns t right after a tool observation whose entropy triggers a branch from s_t."""
        cand = [t for t in range(1, len(ep.turns)) if ep.turns[t - 1].doc_ids and ep.turns[t].entropy]
        if not cand or not ep.turns[0].entropy:
            return []
        h = [float(np.mean(ep.turns[t].entropy)) for t in cand]
        alpha = [sampler.branch_uniform(ep.key, sampler.ARPO_TAG, t) for t in cand]
        fire = credit.arpo_branch(h, float(np.mean(ep.turns[0].entropy)), np.array(alpha), self.cfg.arpo_beta,
                                  self.cfg.arpo_tau, vocab)
        return [t for t, f in zip(cand, fire) if f]

    def rollout(self, run, step, prompts, proto) -> list:
        G, policy = self.cfg.group_size, self.policy(run)
        n0 = min(G, max(1, math.floor(self.cfg.arpo_initial * G + 0.5)))  # half up: G = 5 -> 3 full samples
        lines = rollout.start_episodes(run.tok, prompts, self.cfg.seed, step, G)  # (prompt, line) order
        groups = [lines[p * G:(p + 1) * G] for p in range(len(prompts))]
        rollout.run_episodes(policy, run.tok, run.retriever, [ep for g in groups for ep in g[:n0]], proto)
        trees, pending = [], []
        for g in groups:
            tree = [(ep, None, 0, 0) for ep in g[:n0]]
            for i, ep in enumerate(g[:n0]):
                for t in self.triggered(ep, policy.config.vocab_size):
                    for z in range(min(self.cfg.arpo_beam, G - len(tree))):
                        seed = sampler.fresh_key(ep.key, sampler.ARPO_TAG, t, z)
                        tree.append((rollout.branch(ep, t, fresh_seed=seed), i, t, 0))
            tree += [(ep, None, 0, 0) for ep in g[len(tree):]]  # unspent budget: GRPO's remaining lines
            pending += [ep for ep, *_ in tree[n0:]]
            trees.append(tree)
        rollout.run_episodes(policy, run.tok, run.retriever, pending, proto)
        return self._finish(trees)

    def leaf_advantages(self, episodes) -> np.ndarray:
        return self.trajectory_advantages(episodes)  # the M leaves of a prompt are its group


class TreeGRPO(TreeMethod):
    """Tree-GRPO (Ji et al. 2025, "Tree Search for LLM Agent Reinforcement Learning", arXiv 2509.21240): per prompt
    M = tree_m trees, each initialised by one full chain (GRPO's lines 0..M-1), then L = tree_l rounds expand nodes
    (states s_t between agent steps, a turn = thought + action + observation) with fresh continuations, until the
    prompt has G = group_size leaves: the same number of trajectories as GRPO, fewer tokens (shared prefixes).
    Expansion e (0..G-M-1) grows tree e mod M in round floor(e L / (G - M)) from a node drawn uniformly (keyed)
    among the tree's distinct non-terminal states. Leaf advantage A = A_intra-tree + A_inter-tree
    (credit.tree_grpo_advantages); shared prefixes get their leaves' mean (its step-level preference reading).
    # DEVIATION B8: the paper expands N nodes per tree per round (M (1 + L N) leaves); here the G - M expansions
    are spread over trees and rounds so a prompt has exactly G leaves at any G.
    # DEVIATION B9: nodes are drawn uniformly among the tree's distinct non-terminal states, the root (the prompt)
    included; expanding node s_t keeps the turns before t and re-samples turn t onwards with fresh keys."""
    name = "tree_grpo"

    def _expand(self, tree, e, m):
        """Expansion e of tree m: (new branch, parent leaf, turn, m), the node drawn by a keyed uniform."""
        nodes, seen = [], set()
        for i, (ep, parent, t0, tm) in enumerate(tree):
            for t in range(len(ep.turns)):
                node = (tm, tuple(self._path(tree, i)[:t]))
                if tm == m and node not in seen:
                    seen.add(node)
                    nodes.append((i, t))
        root = tree[m][0]
        i, t = nodes[int(sampler.branch_uniform(root.key, sampler.TREE_TAG, e) * len(nodes))]
        seed = sampler.fresh_key(root.key, sampler.TREE_TAG, e)
        return rollout.branch(tree[i][0], t, fresh_seed=seed), i, t, m

    @staticmethod
    def _path(tree, i) -> list:
        ep, parent, t, _ = tree[i]
        own = [(i, u) for u in range(t, len(ep.turns))]
        return own if parent is None else TreeGRPO._path(tree, parent)[:t] + own

    def rollout(self, run, step, prompts, proto) -> list:
        G, M, L, policy = self.cfg.group_size, self.cfg.tree_m, self.cfg.tree_l, self.policy(run)
        lines = rollout.start_episodes(run.tok, prompts, self.cfg.seed, step, G)
        trees = [[(ep, None, 0, m) for m, ep in enumerate(lines[p * G:p * G + M])] for p in range(len(prompts))]
        rollout.run_episodes(policy, run.tok, run.retriever, [ep for tree in trees for ep, *_ in tree], proto)
        for r in range(L):
            grown = [[self._expand(tree, e, e % M) for e in range(G - M) if e * L // (G - M) == r] for tree in trees]
            rollout.run_episodes(policy, run.tok, run.retriever, [b[0] for new in grown for b in new], proto)
            for tree, new in zip(trees, grown):
                tree += new
        return self._finish(trees)

    def leaf_advantages(self, episodes) -> np.ndarray:
        return credit.tree_grpo_advantages([ep.reward for ep in episodes], self.tree_ids, self.prompt_ids,
                                           self.cfg.adv_eps)


def twin_stats(accel, twins, n_decisions: int, factual_tokens: int) -> dict:
    """The twin counters of TWIN_COUNTERS summed over ranks, and the logged rates (factual_tokens: summed)."""
    kinds = [twin.kind for twin in twins]
    counts = [n_decisions, len(twins), kinds.count("self"), kinds.count("same_evidence"), kinds.count("rollout"),
             sum(twin.diff != 0 for twin in twins), sum(twin.tokens for twin in twins)]
    total = accel.reduce(torch.tensor(counts, dtype=torch.float64, device=accel.device), "sum").tolist()
    out = {k: int(v) for k, v in zip(TWIN_COUNTERS, total)}
    out["discordance"] = out["discordant"] / max(out["twins"], 1)
    out["twin_token_ratio"] = out["twin_tokens"] / max(factual_tokens, 1)
    return out


def reduce_stats(accel, stats: dict) -> dict:
    """A method's per-rank counters summed over ranks (every value a number; aux_tokens among them)."""
    keys = sorted(stats)
    counts = torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64, device=accel.device)
    total = accel.reduce(counts, "sum").tolist() if keys else []
    return {k: int(v) if float(v).is_integer() else v for k, v in zip(keys, total)}


TWIN_METHODS = ("twice", "independent")  # told inline in train_twice.train_step (steps 3-5); rollout, A_traj: Method's
METHODS = {"grpo": Method, "twice": Method, "independent": Independent, "vineppo": VinePPO, "gigpo": GiGPO,
           "hgpo": HGPO, "arpo": ARPO, "tree_grpo": TreeGRPO}
NAMES = tuple(METHODS)


def make(cfg) -> Method:
    return METHODS[cfg.method](cfg)


# ---------------------------------------------------------------------------------------------------------------
# Learned estimators and token-level credit (issue 13): ppo, igpo, spa_rl, agentprm, craft. README-methods-learned.md
# lists each method's config keys, cost per step and deviations (L1, L2, ...). Learned estimators train on the
# step's own batch inside turn_advantages / token_advantages, i.e. before the policy update of that step. Besides
# aux_tokens (generated), each logs aux_fwd_tokens / aux_bwd_tokens (tokens through an extra forward / backward
# pass: estimators, teacher-forced policy passes) and time_credit (seconds, mean over ranks).

def _response_positions(episodes) -> list:
    """Per episode, the position (in collate's rows) of each turn's last sampled token: where the state-action
    (s_t, a_t) has been read, so a scorer's output there is a function of (s_t, a_t)."""
    return [[len(ep.prompt_ids) + t.end - 1 for t in ep.turns] for ep in episodes]


def _group_ids(cfg, episodes) -> np.ndarray:
    return np.arange(len(episodes)) // cfg.group_size


class _Learned(Method):
    """A Method with one Estimator (estimators.py), built from the policy at first use, saved in every checkpoint
    as estimator.pt (weights and AdamW state: --resume restores it exactly)."""
    estimator_file = "estimator.pt"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.est = None

    def estimator(self, run) -> estimators.Estimator:
        if self.est is None:
            lr = self.cfg.lr * self.cfg.estimator_lr_scale
            self.est = estimators.Estimator(run.accel.unwrap_model(run.policy), lr, self.cfg.weight_decay,
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
        """ppo_epochs passes of mini_batches optimizer steps over the step's rows (the actor's schedule, as verl's
        critic). loss_sum(scores, rows) sums the loss of the given batch rows; norm(rows) is its normaliser."""
        cfg, losses = self.cfg, []
        for epoch in range(cfg.ppo_epochs):
            seed = sampler.mix(cfg.seed, step, epoch, sampler.ESTIMATOR_TAG)
            order = np.random.default_rng(seed).permutation(len(ids))
            for mb in np.array_split(order, cfg.mini_batches):
                mb = torch.as_tensor(mb)
                losses.append(self.est.fit(run.accel, ids[mb], att[mb], lambda s, rows, mb=mb: loss_sum(s, mb[rows]),
                                           norm(mb), cfg.micro_batch_size))
        return float(np.mean(losses))

    def cost(self, t0: float, accel, aux_tokens=0) -> dict:
        """This step's extra cost (counters reset): summed over ranks by reduce_stats, so time is divided here."""
        fwd, bwd = self.est.fwd_tokens, self.est.bwd_tokens
        self.est.fwd_tokens = self.est.bwd_tokens = 0
        return {"aux_tokens": aux_tokens, "aux_fwd_tokens": fwd, "aux_bwd_tokens": bwd,
                "time_credit": (time.time() - t0) / accel.num_processes}


class PPO(_Learned):
    """PPO with a learned critic (Schulman et al. 2017), as Search-R1 runs it (verl, algorithm.adv_estimator=gae):
    a critic initialised from the policy scores V at every token; GAE (Schulman et al. 2016, Eq. 16) with
    gamma = lambda = 1 over the sampled tokens (observation tokens masked and skipped), reward = the outcome on the
    last sampled token; advantages whitened over the batch (verl masked_whiten); the critic regresses the GAE
    returns, 0.5 (V - R)^2 token-mean (verl dp_critic), on the same batch, values taken before its update.
    # DEVIATION L2: no value clipping (verl cliprange_value 0.5) and no KL-in-reward: the KL stays a loss term
    (kl_coef, as for every method), so methods differ only in the advantage."""
    name = "ppo"

    def turn_advantages(self, run, step, episodes, proto) -> tuple:
        return [np.zeros(len(ep.turns)) for ep in episodes], {}  # token_advantages replaces them

    def token_advantages(self, run, step, episodes, batch, adv) -> tuple:
        t0, cfg, est = time.time(), self.cfg, self.estimator(run)
        ids, att = batch["input_ids"], batch["attention_mask"]
        mask = batch["loss_mask"][:, 1:].cpu().numpy()  # (B, L-1): position k predicts token k + 1
        values = est.scores(ids, att, cfg.micro_batch_size)[:, :-1].cpu().numpy()  # V(s) before token k + 1
        rewards = np.zeros(mask.shape)
        for b, ep in enumerate(episodes):
            sampled = np.flatnonzero(mask[b])
            if len(sampled):
                rewards[b, sampled[-1]] = ep.reward
        a, ret = credit.gae(rewards, values, mask, cfg.gamma, cfg.gae_lambda)
        a = credit.masked_whiten(a, mask)  # DEVIATION L3: over this rank's tokens (verl: the whole batch)
        ret_t = torch.tensor(ret, dtype=torch.float32, device=ids.device)
        m = torch.tensor(mask, dtype=torch.float32, device=ids.device)
        loss = self.train_estimator(run, step, ids, att,
                                    lambda s, rows: (0.5 * (s[:, :-1] - ret_t[rows]) ** 2 * m[rows]).sum(),
                                    lambda rows: float(m[rows].sum().clamp(min=1)))
        out = np.zeros(adv.shape)
        out[:, 1:] = a  # back to token layout: token k + 1's advantage sits at k + 1 (train_step shifts it)
        return out, {**self.cost(t0, run.accel), "critic_loss": loss,
                     "value_mean": float((values * mask).sum() / max(mask.sum(), 1))}


class IGPO(Method):
    """IGPO (Wang et al. 2025, "Information Gain-based Policy Optimization"): turn t's reward is the information
    gain r_t = log pi(a | q, o_<=t) - log pi(a | q, o_<t) (Eq. 5), log pi(a | .) the mean per-token log-prob of the
    gold answer a, teacher-forced by the current policy (Eq. 4); the last turn's reward is the outcome; both are
    z-normalised per group separately and summed with discount gamma (Eqs. 6-7; credit.igpo_advantages).
    # DEVIATION L4: the answer is teacher-forced after the response's own "<answer>" tag, and only the first gold
    answer is scored (the paper does not say how several gold answers combine)."""
    name = "igpo"

    def answer_ids(self, tok, gold: str) -> tuple:
        pre, full = tok("<answer>", add_special_tokens=False)["input_ids"], \
            tok(f"<answer> {gold}", add_special_tokens=False)["input_ids"]
        if full[:len(pre)] != pre or len(full) == len(pre):
            return pre, tok(f" {gold}", add_special_tokens=False)["input_ids"]
        return pre, full[len(pre):]

    def turn_advantages(self, run, step, episodes, proto) -> tuple:
        t0, cfg = time.time(), self.cfg
        rows, n_ans = [], []
        for ep in episodes:
            pre, ans = self.answer_ids(run.tok, str(ep.golden_answers[0]))
            for t in range(len(ep.turns)):  # o_<=t-1: every turn before t with its observation; t = 0: q alone
                rows.append(ep.prompt_ids + ep.ids[:ep.turns[t - 1].obs_end if t else 0] + pre + ans)
                n_ans.append(len(ans))
        lps = estimators.token_logprobs_rows(run.accel.unwrap_model(run.policy), rows, run.tok.pad_token_id,
                                             cfg.micro_batch_size) if rows else []
        flat = np.array([lp[-n:].mean() for lp, n in zip(lps, n_ans)])
        per_ep = np.split(flat, np.cumsum([len(ep.turns) for ep in episodes])[:-1])
        adv = credit.igpo_advantages(per_ep, [ep.reward for ep in episodes], _group_ids(cfg, episodes), cfg.gamma,
                                     cfg.adv_eps)
        return adv, {"aux_tokens": 0, "aux_fwd_tokens": sum(map(len, rows)), "aux_bwd_tokens": 0,
                     "time_credit": (time.time() - t0) / run.accel.num_processes,
                     "info_gain": float(np.mean([np.diff(lp).mean() for lp in per_ep if len(lp) > 1] or [0.0]))}


class SPARL(_Learned):
    """SPA-RL (Wang et al. 2025, "Stepwise Progress Attribution"): a progress estimator c_hat(s_t, a_t) (a head on a
    copy of the policy, read at turn t's last token) is trained so that an episode's contributions sum to its
    outcome, L_PE = mean_i (sum_t c_hat_t - R_i)^2 (Eq. 3; credit.spa_rl_loss); the fused step reward
    r_t = alpha c_t + beta g_t (Eq. 5; g_t = 1 when turn t's action was a valid search or answer; alpha = 1, as
    only beta / alpha matters after the normalisation below) replaces the
    sparse outcome, and its discounted returns-to-go drive the update. The estimator is trained first, then scores
    the batch (the paper's order: estimator, then RL).
    # DEVIATION L5: the estimator trains online on each step's batch (paper: on exploration rollouts, beforehand).
    # DEVIATION L6: returns-to-go are z-normalised over the group's turns (GRPO's baseline) instead of PPO's critic.
    """
    name = "spa_rl"

    def turn_advantages(self, run, step, episodes, proto) -> tuple:
        t0, cfg, est = time.time(), self.cfg, self.estimator(run)
        batch = rollout.collate(episodes, run.tok.pad_token_id)
        ids, att = batch["input_ids"].to(run.accel.device), batch["attention_mask"].to(run.accel.device)
        pos, R = _response_positions(episodes), torch.tensor([ep.reward for ep in episodes])
        loss = self.train_estimator(
            run, step, ids, att, lambda s, rows: credit.spa_rl_loss(
                [s[j, pos[int(i)]] for j, i in enumerate(rows)], R[rows].to(s.device)) * len(rows),
            lambda rows: float(len(rows)))
        s = est.scores(ids, att, cfg.micro_batch_size).cpu().numpy()
        contrib = [s[b, pos[b]] for b in range(len(episodes))]
        ground = [[float(t.action in ("search", "answer")) for t in ep.turns] for ep in episodes]
        returns = [credit.discounted_returns(credit.spa_rl_rewards(c, g, 1.0, cfg.spa_beta), cfg.gamma)
                   for c, g in zip(contrib, ground)]
        adv = credit.group_turn_normalise(returns, _group_ids(cfg, episodes), cfg.adv_eps)
        return adv, {**self.cost(t0, run.accel), "estimator_loss": loss,
                     "progress_sum": float(np.mean([c.sum() for c in contrib]))}


class AgentPRM(_Learned):
    """AgentPRM (Choudhury 2025, "Process Reward Models for LLM Agents"): a PRM Q_phi(s_t, a_t) = sigmoid(head) on a
    copy of the policy, read at turn t's last token, trained by soft binary cross-entropy (Eq. 4; credit.soft_bce)
    on Monte Carlo targets Q_hat(s, a) = the mean return over every visit of the same (s, a) (Eq. 3;
    credit.agentprm_targets): the factual episodes plus prm_rollouts continuations after each non-final turn
    (rollout.continue_from, keys fresh_key(ep.key, MC_Q_TAG, t, k); their tokens are aux_tokens). The policy then
    maximises Q_phi (Eq. 5): turn t's advantage is Q_phi(s_t, a_t) z-normalised over the group's turns.
    # DEVIATION L7: PRM and policy train online, step by step, on the same stream (paper: alternating stages), and
    the KL anchor is the frozen reference (paper: the previous policy)."""
    name = "agentprm"

    def mc_targets(self, run, episodes, proto) -> tuple:
        """Q_hat per factual decision (episode-major) and the continuations' generated tokens."""
        cfg, keys, returns = self.cfg, [], []
        for ep in episodes:
            for t, turn in enumerate(ep.turns):
                keys.append(np.asarray(ep.prompt_ids + ep.ids[:turn.end], dtype=np.int64).tobytes())
                returns.append(cfg.gamma ** (len(ep.turns) - 1 - t) * ep.reward)
        requests = [(ep, t, True, sampler.fresh_key(ep.key, sampler.MC_Q_TAG, t, k)) for ep in episodes
                    for t in range(len(ep.turns) - 1) for k in range(cfg.prm_rollouts)]
        branches = rollout.continue_from(run.accel.unwrap_model(run.policy), run.tok, run.retriever, requests,
                                         proto) if requests else []
        for (ep, t, _, _), br in zip(requests, branches):
            keys.append(np.asarray(ep.prompt_ids + ep.ids[:ep.turns[t].end], dtype=np.int64).tobytes())
            returns.append(cfg.gamma ** (len(br.turns) - 1 - t) * br.reward)
        n = sum(len(ep.turns) for ep in episodes)
        return credit.agentprm_targets(keys, returns)[:n], sum(br.n_generated for br in branches)

    def turn_advantages(self, run, step, episodes, proto) -> tuple:
        t0, cfg, est = time.time(), self.cfg, self.estimator(run)
        targets, aux = self.mc_targets(run, episodes, proto)
        batch = rollout.collate(episodes, run.tok.pad_token_id)
        ids, att = batch["input_ids"].to(run.accel.device), batch["attention_mask"].to(run.accel.device)
        pos = _response_positions(episodes)
        q_hat = np.split(targets, np.cumsum([len(p) for p in pos])[:-1])
        q_hat = [torch.tensor(q, dtype=torch.float32, device=ids.device) for q in q_hat]
        bce = torch.nn.functional.binary_cross_entropy_with_logits
        loss = self.train_estimator(
            run, step, ids, att, lambda s, rows: sum(bce(s[j, pos[int(i)]], q_hat[int(i)], reduction="sum")
                                                     for j, i in enumerate(rows)),
            lambda rows: float(max(sum(len(pos[int(i)]) for i in rows), 1)))
        s = est.scores(ids, att, cfg.micro_batch_size).cpu().numpy()
        q = [1.0 / (1.0 + np.exp(-s[b, pos[b]])) for b in range(len(episodes))]
        adv = credit.group_turn_normalise(q, _group_ids(cfg, episodes), cfg.adv_eps)
        return adv, {**self.cost(t0, run.accel, aux), "estimator_loss": loss, "q_mean": float(np.mean(targets))}


class CRAFT(Method):
    """CRAFT pillar 1 (seed 004, "Counterfactual Credit Assignment from Free Sibling Rollouts") on top of GRPO:
    A_{i,k} = A_traj_i + C_{i,t} w_{i,k} on the sampled tokens k of turn t. C_{i,t} (credit.craft_token_importance)
    is the self-normalised importance estimate, over the G - 1 siblings, of the change in group advantage if turn t
    were tilted toward the teacher, with weights exp(craft_beta g_{j,t}), g = sum of (log pi_teacher - log pi) over
    the turn's tokens; w_{i,k} = |g_{i,k}| / mean |g_{i,.}| puts it on the tokens where teacher and student differ
    (credit.craft_token_weights). Pillars 2-3 (distillation controller, polarised KL) act on a self-distillation
    loss this trainer does not have, so they are not implemented.
    # DEVIATION L8: the teacher is the same policy with the gold answer appended to the question (the seed's
    "privileged context" for search QA); student log-probs are the rollout's sampling log-probs (turn.logprobs)."""
    name = "craft"

    def token_advantages(self, run, step, episodes, batch, adv) -> tuple:
        t0, cfg, tok = time.time(), self.cfg, run.tok
        chat = bool(getattr(tok, "chat_template", None))
        rows, offsets = [], []
        for ep in episodes:
            hint = f"{ep.question}\nReference answer: {ep.golden_answers[0]}"
            prompt = tok(protocol.render_prompt(tok, hint), add_special_tokens=not chat)["input_ids"]
            rows.append(prompt + ep.ids)
            offsets.append(len(prompt))
        teacher = estimators.token_logprobs_rows(run.accel.unwrap_model(run.policy), rows, tok.pad_token_id,
                                                 cfg.micro_batch_size, cfg.temperature)
        # token k of the response is predicted at position offset + k - 1
        gaps = [[teacher[b][offsets[b] + t.start - 1:offsets[b] + t.end - 1] - np.asarray(t.logprobs)
                 for t in ep.turns] for b, ep in enumerate(episodes)]
        a_traj, G, out = self.trajectory_advantages(episodes), cfg.group_size, np.array(adv, dtype=np.float64)
        for g0 in range(0, len(episodes), G):
            table = np.full((G, max(len(ep.turns) for ep in episodes[g0:g0 + G])), np.nan)
            for j in range(G):
                table[j, :len(gaps[g0 + j])] = [g.sum() for g in gaps[g0 + j]]
            C = credit.craft_token_importance(table, a_traj[g0:g0 + G], cfg.craft_beta)
            for j in range(G):
                ep = episodes[g0 + j]
                for t, turn in enumerate(ep.turns):
                    span = slice(len(ep.prompt_ids) + turn.start, len(ep.prompt_ids) + turn.end)
                    out[g0 + j, span] += C[j, t] * credit.craft_token_weights(gaps[g0 + j][t])
        sampled = batch["loss_mask"].cpu().numpy() == 1
        return out, {"aux_tokens": 0, "aux_fwd_tokens": sum(map(len, rows)), "aux_bwd_tokens": 0,
                     "time_credit": (time.time() - t0) / run.accel.num_processes,
                     "craft_credit_rms": float(np.sqrt(np.mean((out - adv)[sampled] ** 2))) if sampled.any() else 0.0}


METHODS.update(ppo=PPO, igpo=IGPO, spa_rl=SPARL, agentprm=AgentPRM, craft=CRAFT)
NAMES = tuple(METHODS)
