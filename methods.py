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

Every extra rollout goes through rollout.py (branch, continue_from, run_twins) with keys derived like twin keys
(rollout.fresh_key(episode key, TAG, ...)), so every method is exactly reproducible and resumable.
"""
import math

import numpy as np
import torch

import credit
import rollout

TWIN_COUNTERS = ("decisions", "twins", "self_twins", "shortcuts", "twin_rollouts", "discordant", "twin_tokens")


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
        pass

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
        requests = [(ep, t, False, rollout.fresh_key(ep.key, rollout.VINE_TAG, t, k))
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
        alpha = [rollout.branch_uniform(ep.key, rollout.ARPO_TAG, t) for t in cand]
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
                        seed = rollout.fresh_key(ep.key, rollout.ARPO_TAG, t, z)
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
        i, t = nodes[int(rollout.branch_uniform(root.key, rollout.TREE_TAG, e) * len(nodes))]
        seed = rollout.fresh_key(root.key, rollout.TREE_TAG, e)
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
    local = [n_decisions, len(twins), kinds.count("self"), kinds.count("same_evidence"), kinds.count("rollout"),
             sum(twin.diff != 0 for twin in twins), sum(twin.tokens for twin in twins)]
    total = accel.reduce(torch.tensor(local, dtype=torch.float64, device=accel.device), "sum").tolist()
    out = {k: int(v) for k, v in zip(TWIN_COUNTERS, total)}
    out["discordance"] = out["discordant"] / max(out["twins"], 1)
    out["twin_token_ratio"] = out["twin_tokens"] / max(factual_tokens, 1)
    return out


def reduce_stats(accel, stats: dict) -> dict:
    """A method's per-rank counters summed over ranks (every value a number; aux_tokens among them)."""
    keys = sorted(stats)
    local = torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64, device=accel.device)
    total = accel.reduce(local, "sum").tolist() if keys else []
    return {k: int(v) if float(v).is_integer() else v for k, v in zip(keys, total)}


TWIN_METHODS = ("twice", "independent")  # told inline in train_twice.train_step (steps 3-5); rollout, A_traj: Method's
METHODS = {"grpo": Method, "twice": Method, "independent": Independent, "vineppo": VinePPO, "gigpo": GiGPO,
           "hgpo": HGPO, "arpo": ARPO, "tree_grpo": TreeGRPO}
NAMES = tuple(METHODS)


def make(cfg) -> Method:
    return METHODS[cfg.method](cfg)
