"""The baselines TWICE is compared with (DESIGN.md section 7), each trainer class next to
its formula.

`train_twice.py --method=NAME` selects one through the registry (methods/__init__.py). Each extends
GRPO, `twice.Method`, and replaces what it must of the one hook: the step's rollout (tree methods
branch there) and its advantages. A turn-level method implements turn_advantages (one advantage per
turn, spread over the turn's sampled tokens by Method.advantages); a token-level one (CRAFT here,
PPO in methods/learned.py) overrides advantages. TWICE itself is twice.py's.

Every extra rollout goes through rollout.py (branch, continue_from, run_twins) with keys derived
like twin keys (fresh_key(episode key, TAG, ...)), so every method is exactly reproducible and
resumable. The formulas are pure array math (numpy in, numpy out), the paper's equation in each
docstring; group and state keys are any hashables.

Deviations (DESIGN.md section 13): B1-B9 (the trainers), C3-C5 (the formulas), L4, L8, L9,
tagged below.
"""
import math
import time

import numpy as np

import protocol
import rollout
import sampler
import twice
from credit import as_array, group_index, grpo_advantages
from generation import logprobs
from twice import Method  # GRPO: the base every method extends (TWICE's steps 1-2)


# --------------------------------------------------------------------------------------------------
# The independent counterfactual: TWICE's loop, twins under fresh keys


class Independent(twice.Twice):
    """The textbook independent counterfactual (e.g. the independent branching the TWICE paper
    compares with, its "21.7% wrong-sign" row): TWICE's loop (budget rule, Horvitz-Thompson,
    predictor, omega, sigma_hat: steps 3-6), with D_t = U - U' from a twin whose alternative y' and
    everything after it use fresh keys (rollout.run_twins(independent=True)): a self-twin is rolled
    out like any other, no same-evidence shortcut. # DEVIATION B1: the budget rule, the discordance
    predictor, Horvitz-Thompson and sigma_hat stay TWICE's (only the counterfactual changes), so the
    comparison isolates the coupling; the predictor learns independent discordance."""
    name = "independent"
    independent_twins = True


# --------------------------------------------------------------------------------------------------
# VinePPO: Monte Carlo values at every turn boundary


def mc_value(outcomes) -> np.ndarray:
    """Monte Carlo value: mean of K rollout outcomes along the last axis."""
    return as_array(outcomes).mean(axis=-1)


def vineppo_advantages(values, outcome) -> np.ndarray:
    """VinePPO (Kazemnejad et al. 2024), one episode: A_t = V(s_{t+1}) - V(s_t), t = 1..T, with
    V(s_t) the MC estimate at the boundary before turn t (mc_value of K rollouts from there) and
    V(s_{T+1}) = the outcome (reward only at the end, gamma = 1). The advantages telescope to
    outcome - V(s_1)."""
    return np.diff(np.append(as_array(values).reshape(-1), float(outcome)))


class VinePPO(Method):
    """VinePPO (Kazemnejad et al. 2024, "VinePPO: Unlocking RL Potential for LLM Reasoning through
    Refined Credit Assignment": its MC value estimate and advantage, gamma = 1, reward only at the
    end): V_hat(s_t) = (1/K) sum_k U(rollout k from s_t), K = vine_k Monte Carlo continuations with
    fresh keys from every turn boundary of every episode, and A_t = V_hat(s_{t+1}) - V_hat(s_t)
    with V(s_T) = U (vineppo_advantages). The K continuations from s_t use
    turn_key(fresh_key(episode key, VINE_TAG, t, k), turn): reproducible, independent of the
    episode. # DEVIATION B2: every episode gets its own K continuations from each of its
    boundaries, s_0 included, though a prompt's G lines share s_0 (as VinePPO estimates per
    trajectory); K = 9 is VinePPO's default. # DEVIATION B3: no advantage whitening and no GRPO
    term: A_t is the method's whole advantage (VinePPO trains PPO on these advantages; a turn is
    the step, as in its multi-step reading of a response)."""
    name = "vineppo"

    def turn_advantages(self, run, step, episodes, proto) -> tuple:
        K = self.cfg.vine_k
        requests = [(ep, t, False, sampler.fresh_key(ep.key, sampler.VINE_TAG, t, k))
                    for ep in episodes for t in range(len(ep.turns)) for k in range(K)]
        conts = rollout.continue_from(self.policy(run), run.tok, run.retriever, requests, proto)
        outcomes, adv = iter(c.reward for c in conts), []
        for ep in episodes:
            # V_hat(s_0..s_{T-1})
            values = [np.mean([next(outcomes) for _ in range(K)]) for _ in ep.turns]
            adv.append(vineppo_advantages(values, ep.reward))
        return adv, {"aux_tokens": sum(c.n_generated for c in conts), "continuations": len(conts)}


# --------------------------------------------------------------------------------------------------
# GiGPO and HGPO: step groups of identical states


def step_returns(outcome, n_turns, gamma=1.0) -> np.ndarray:
    """Return-to-go R_t = gamma^(T-1-t) U of an episode of T turns rewarded only at its end
    (GiGPO, HGPO)."""
    return float(outcome) * gamma ** np.arange(n_turns - 1, -1, -1, dtype=np.float64)


def gigpo_step_advantages(anchor_keys, returns, normalize="std", eps=1e-6) -> np.ndarray:
    """GiGPO step advantage (Feng et al. 2025, micro advantage A^S): steps grouped by identical
    anchor state key, A^S = (R_t - mean_group) / F_norm, F_norm = std (normalize="std") or 1
    ("none"); R_t the discounted return-to-go. Singleton groups -> 0. Keys should include the
    prompt so only one prompt's rollouts meet."""
    if normalize not in ("std", "none"):
        raise ValueError(f"normalize must be 'std' or 'none', got {normalize!r}")
    return grpo_advantages(returns, anchor_keys, eps, normalize_std=normalize == "std")


def gigpo_combine(a_episode, a_step, omega) -> np.ndarray:
    """GiGPO: A = A^E(tau_i) + omega * A^S(a_t) (episode advantage broadcast to each of its
    steps)."""
    return as_array(a_episode) + omega * as_array(a_step)


def hgpo_context_keys(states, max_k) -> list:
    """HGPO context operator for one episode: level k key of step t = (s_{t-k}, ..., s_t), shorter
    near the start. Returns max_k + 1 lists (levels 0..K) of per-step tuples; prefix the states
    with the prompt uid."""
    states = list(states)
    return [[tuple(states[max(0, t - k):t + 1]) for t in range(len(states))]
            for k in range(max_k + 1)]


def hgpo_advantages(context_keys_per_level, returns, alpha=1.0, eps=1e-6) -> np.ndarray:
    """HGPO (hierarchical history-context groups): A = sum_k w_k A_k, A_k the group-normalised
    return within the level-k context group, w_k = (k+1)^alpha / sum_k' (k'+1)^alpha.

    A level where the step's group is a singleton says nothing about the action: it contributes 0
    and its weight leaves the normalisation (# DEVIATION C3). A step with no shared level gets 0.
    """
    R = as_array(returns).reshape(-1)
    num, den = np.zeros_like(R), np.zeros_like(R)
    for k, keys in enumerate(context_keys_per_level):
        g = group_index(keys)
        w = (k + 1.0) ** alpha * (np.bincount(g)[g] > 1)  # (n,) weight, 0 on singletons
        num += w * grpo_advantages(R, g, eps)
        den += w
    return np.divide(num, den, out=np.zeros_like(R), where=den > 0)


def _combine(a_episode, a_step_flat, episodes, omega) -> list:
    """Per-episode arrays A^E_i + omega * A^S_{i,t} from a flat, episode-major step array."""
    splits = np.split(np.asarray(a_step_flat), np.cumsum([len(ep.turns) for ep in episodes])[:-1])
    return [gigpo_combine(a, s, omega) for a, s in zip(a_episode, splits)]


class GiGPO(Method):
    """GiGPO (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent Training",
    verl-agent): A = A^E(tau_i) + omega * A^S(a_t) (its combined advantage; gigpo_combine), A^E the
    episode group advantage (GRPO's), A^S the return-to-go R_t = gamma^(T-1-t) U normalised by std
    within the step's anchor group: every step of the prompt's G episodes taken from an identical
    state (gigpo_step_advantages). # DEVIATION B4: the state of a search episode is the evidence it
    has been shown, rollout.evidence_states: (prompt, the observation of every earlier turn:
    retrieved ids in rank order, or "invalid"); the agent's own text is not part of it (GiGPO's
    anchors are environment states). omega is the shared `omega` field."""
    name = "gigpo"

    def turn_advantages(self, run, step, episodes, proto) -> tuple:
        keys = [s for ep in episodes for s in rollout.evidence_states(ep)]
        returns = np.concatenate([step_returns(ep.reward, len(ep.turns), self.cfg.step_gamma)
                                  for ep in episodes])
        a_step = gigpo_step_advantages(keys, returns, "std", self.cfg.adv_eps)
        return (_combine(self.trajectory_advantages(episodes), a_step, episodes, self.cfg.omega),
                {"aux_tokens": 0, "anchor_groups": len(set(keys))})


class HGPO(Method):
    """HGPO (hierarchical history-context step groups; hgpo_advantages): steps grouped at every
    context length k = 0..hgpo_k by their last k + 1 states (hgpo_context_keys), A_k the
    group-normalised return R_t = gamma^(T-1-t) U within the level-k group, A^H = sum_k w_k A_k,
    w_k ~ (k + 1)^hgpo_alpha. # DEVIATION B5: the state of step t is (prompt, the observation just
    before it: retrieved ids, "invalid", or the prompt for t = 0); A = A^E + omega * A^H as GiGPO's
    combination; hgpo_k = 2 is our choice."""
    name = "hgpo"

    def turn_advantages(self, run, step, episodes, proto) -> tuple:
        levels = [[] for _ in range(self.cfg.hgpo_k + 1)]
        for ep in episodes:
            states = [(ep.uid, ()) if t == 0 else (ep.uid, rollout.observation_of(ep.turns[t - 1]))
                      for t in range(len(ep.turns))]
            for level, keys in zip(levels, hgpo_context_keys(states, self.cfg.hgpo_k)):
                level.extend(keys)
        returns = np.concatenate([step_returns(ep.reward, len(ep.turns), self.cfg.step_gamma)
                                  for ep in episodes])
        a_h = hgpo_advantages(levels, returns, self.cfg.hgpo_alpha, self.cfg.adv_eps)
        return (_combine(self.trajectory_advantages(episodes), a_h, episodes, self.cfg.omega),
                {"aux_tokens": 0})


# --------------------------------------------------------------------------------------------------
# ARPO and Tree-GRPO: rollout trees, shared prefixes credited with their leaves' mean


def shared_prefix_advantages(leaf_advantages, paths) -> list:
    """Tree credit (ARPO's advantage attribution; Tree-GRPO's implicit step preference): a segment
    shared by several leaves gets the mean advantage of the leaves through it, an individual one
    its leaf's. paths[i] = segment ids of leaf i (e.g. one per turn), root first. Returns per-leaf
    arrays aligned with paths."""
    total, count = {}, {}
    for a_i, path in zip(as_array(leaf_advantages).reshape(-1), paths):
        for seg in path:
            total[seg], count[seg] = total.get(seg, 0.0) + a_i, count.get(seg, 0) + 1
    return [np.array([total[seg] / count[seg] for seg in path]) for path in paths]


def arpo_branch(entropy, entropy_init, alpha, beta, tau, vocab_size) -> np.ndarray:
    """ARPO (Dong et al. 2025) entropy-triggered branching:
    P_t = alpha + beta * Normalize(H_t - H_initial), branch iff P_t > tau. # DEVIATION C4:
    Normalize = / log|V| (ARPO's released code). The official code also draws alpha ~ U(0, 1) per
    candidate: pass an array of keyed uniforms for that."""
    dh = (as_array(entropy) - as_array(entropy_init)) / math.log(vocab_size)
    return as_array(alpha) + beta * dh > tau


def arpo_advantages(rewards, paths, eps=1e-6) -> list:
    """ARPO advantage attribution on one prompt's rollout tree. paths[i] = segment ids (hashables)
    of trajectory i, root first; shared-prefix segments appear in several paths.
    A_i = group-normalised reward over the G trajectories; a segment gets the mean A_i of the
    trajectories through it (its own A_i if it is individual). Returns per-trajectory arrays of
    segment advantages, aligned with paths."""
    return shared_prefix_advantages(
        grpo_advantages(rewards, np.zeros(len(paths), dtype=np.int64), eps), paths)


def tree_grpo_advantages(rewards, tree_ids, prompt_ids, eps=1e-6) -> np.ndarray:
    """Tree-GRPO (Ji et al. 2025, arXiv 2509.21240, tree-based group advantage) per leaf:
    A = A_intra + A_inter, the reward group-normalised within the leaf's tree plus group-normalised
    over every leaf of the prompt's trees (tree_ids: hashables unique over the batch, e.g.
    (prompt, tree))."""
    return grpo_advantages(rewards, tree_ids, eps) + grpo_advantages(rewards, prompt_ids, eps)


class TreeMethod(Method):
    """Methods whose G training episodes per prompt are the leaves of a rollout tree (ARPO,
    Tree-GRPO).

    A branch is rollout.branch(leaf, t) continued with fresh keys from turn t on
    (rollout.continue_from), so a tree is a pure function of the episode keys. Each token is
    generated once: a branch's n_generated counts from its branch turn, so factual_tokens counts
    every tree token exactly once and aux_tokens is 0. # DEVIATION B6: the leaves are the step's
    training episodes, so branch tokens are factual_tokens, not aux. Shared-prefix tokens sit in
    several leaf rows: rollout.mask_shared_prefix gives them loss mask 0 in every row but the leaf
    that sampled them, and that row's turn carries the mean advantage of the leaves through it
    (shared_prefix_advantages): each token enters the token-mean loss once, with its branches' mean.
    rollout() leaves this step's tree (segment paths, tree ids) on self for turn_advantages() of
    the same step; nothing crosses steps, so state_dict() stays empty."""

    def _finish(self, trees) -> list:
        """trees: per prompt, a list of (episode, parent leaf index or None, branch turn,
        tree id)."""
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
            adv += shared_prefix_advantages(a_leaf[rows], [self.paths[n] for n in rows])
        return adv, {"aux_tokens": 0, "branches": self.branches}


class ARPO(TreeMethod):
    """ARPO (Dong et al. 2025, "Agentic Reinforced Policy Optimization": entropy-based adaptive
    rollout and advantage attribution), rollout budget M = group_size trajectories per prompt, as
    GRPO's: N = round(arpo_initial * M) full samples; after each tool observation (turn t following
    an executed search) the entropy of the next turn gives
    P_t = alpha + beta * Normalize(H_t - H_initial) (arpo_branch, alpha a keyed U(0, 1) as the
    official code draws it); P_t > tau branches arpo_beam partial samples from s_t, until the
    M - N remaining slots are spent; unspent slots are full samples. Leaf advantage: the
    group-normalised reward over the M leaves; shared-prefix tokens get the mean of their branches
    (its advantage attribution; shared_prefix_advantages). # DEVIATION B7: H_t is the mean entropy
    of the whole turn after the observation (ARPO: the first k tokens); branching happens once,
    from the N initial samples, candidates in (sample, turn) order (ARPO branches during
    generation, partial samples included); the initial and the filling samples are GRPO's lines
    0..M-1 (same keys)."""
    name = "arpo"

    def triggered(self, ep, vocab: int) -> list:
        """Turns t right after a tool observation whose entropy triggers a branch from s_t."""
        cand = [t for t in range(1, len(ep.turns))
                if ep.turns[t - 1].doc_ids and ep.turns[t].entropy]
        if not cand or not ep.turns[0].entropy:
            return []
        h = [float(np.mean(ep.turns[t].entropy)) for t in cand]
        alpha = [sampler.branch_uniform(ep.key, sampler.ARPO_TAG, t) for t in cand]
        fire = arpo_branch(h, float(np.mean(ep.turns[0].entropy)), np.array(alpha),
                           self.cfg.arpo_beta, self.cfg.arpo_tau, vocab)
        return [t for t, f in zip(cand, fire) if f]

    def rollout(self, run, step, prompts, proto) -> list:
        G, policy = self.cfg.group_size, self.policy(run)
        # half up: G = 5 -> 3 full samples
        n0 = min(G, max(1, math.floor(self.cfg.arpo_initial * G + 0.5)))
        # (prompt, line) order
        lines = rollout.start_episodes(run.tok, prompts, self.cfg.seed, step, G)
        groups = [lines[p * G:(p + 1) * G] for p in range(len(prompts))]
        rollout.run_episodes(policy, run.tok, run.retriever,
                             [ep for g in groups for ep in g[:n0]], proto)
        trees, pending = [], []
        for g in groups:
            tree = [(ep, None, 0, 0) for ep in g[:n0]]
            for i, ep in enumerate(g[:n0]):
                for t in self.triggered(ep, policy.config.vocab_size):
                    for z in range(min(self.cfg.arpo_beam, G - len(tree))):
                        seed = sampler.fresh_key(ep.key, sampler.ARPO_TAG, t, z)
                        tree.append((rollout.branch(ep, t, fresh_seed=seed), i, t, 0))
            # unspent budget: GRPO's remaining lines
            tree += [(ep, None, 0, 0) for ep in g[len(tree):]]
            pending += [ep for ep, *_ in tree[n0:]]
            trees.append(tree)
        rollout.run_episodes(policy, run.tok, run.retriever, pending, proto)
        return self._finish(trees)

    def leaf_advantages(self, episodes) -> np.ndarray:
        return self.trajectory_advantages(episodes)  # the M leaves of a prompt are its group


class TreeGRPO(TreeMethod):
    """Tree-GRPO (Ji et al. 2025, "Tree Search for LLM Agent Reinforcement Learning",
    arXiv 2509.21240): per prompt M = tree_m trees, each initialised by one full chain (GRPO's
    lines 0..M-1), then L = tree_l rounds expand nodes (states s_t between agent steps, a turn =
    thought + action + observation) with fresh continuations, until the prompt has G = group_size
    leaves: the same number of trajectories as GRPO, fewer tokens (shared prefixes). Expansion e
    (0..G-M-1) grows tree e mod M in round floor(e L / (G - M)) from a node drawn uniformly (keyed)
    among the tree's distinct non-terminal states. Leaf advantage A = A_intra-tree + A_inter-tree
    (tree_grpo_advantages); shared prefixes get their leaves' mean (its step-level preference
    reading). # DEVIATION B8: the paper expands N nodes per tree per round (M (1 + L N) leaves);
    here the G - M expansions are spread over trees and rounds so a prompt has exactly G leaves at
    any G. # DEVIATION B9: nodes are drawn uniformly among the tree's distinct non-terminal states,
    the root (the prompt) included; expanding node s_t keeps the turns before t and re-samples turn
    t onwards with fresh keys."""
    name = "tree_grpo"

    def _expand(self, tree, e, m):
        """Expansion e of tree m: (new branch, parent leaf, turn, m), the node drawn by a
        keyed uniform."""
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
        trees = [[(ep, None, 0, m) for m, ep in enumerate(lines[p * G:p * G + M])]
                 for p in range(len(prompts))]
        rollout.run_episodes(policy, run.tok, run.retriever,
                             [ep for tree in trees for ep, *_ in tree], proto)
        for r in range(L):
            grown = [[self._expand(tree, e, e % M) for e in range(G - M) if e * L // (G - M) == r]
                     for tree in trees]
            rollout.run_episodes(policy, run.tok, run.retriever,
                                 [b[0] for new in grown for b in new], proto)
            for tree, new in zip(trees, grown):
                tree += new
        return self._finish(trees)

    def leaf_advantages(self, episodes) -> np.ndarray:
        return tree_grpo_advantages([ep.reward for ep in episodes], self.tree_ids,
                                    self.prompt_ids, self.cfg.adv_eps)


# --------------------------------------------------------------------------------------------------
# IGPO: information gain of each turn on the gold answer


def discounted_returns(rewards, gamma=1.0) -> np.ndarray:
    """Return-to-go R_t = sum_{k >= t} gamma^(k-t) r_k of one episode."""
    r, acc = as_array(rewards).reshape(-1), 0.0
    out = np.empty_like(r)
    for t in range(len(r) - 1, -1, -1):
        acc = r[t] + gamma * acc
        out[t] = acc
    return out


def igpo_turn_rewards(answer_logprobs, outcome) -> np.ndarray:
    """IGPO raw turn rewards of one episode with T turns: r_t = lp_t - lp_{t-1} for t = 1..T-1
    (information gain of turn t), r_T = outcome. answer_logprobs[t] = mean per-token log-prob of
    the gold answer, teacher-forced, given the question and the interaction up to turn t,
    t = 0..T-1 (t = 0: the question alone)."""
    return np.append(np.diff(as_array(answer_logprobs).reshape(-1)), float(outcome))


def igpo_advantages(answer_logprobs, outcomes, group_ids, gamma=1.0, eps=1e-6) -> list:
    """IGPO (Wang et al. 2025): z-normalise the IG rewards over all turns of the group's episodes
    and the outcome rewards over the group's episodes, separately;
    A_t = sum_{k >= t} gamma^(k-t) r~_k. Per-episode arrays (T_i,)."""
    gid = group_index(group_ids)
    raw = [igpo_turn_rewards(lp, o)
           for lp, o in zip(answer_logprobs, as_array(outcomes).reshape(-1))]
    n_ig = np.array([len(r) - 1 for r in raw], dtype=np.int64)
    ig = grpo_advantages(np.concatenate([r[:-1] for r in raw]), np.repeat(gid, n_ig), eps)
    out = grpo_advantages([r[-1] for r in raw], gid, eps)
    return [discounted_returns(np.append(g, o), gamma)
            for g, o in zip(np.split(ig, np.cumsum(n_ig)[:-1]), out)]


def _group_ids(cfg, episodes) -> np.ndarray:
    return np.arange(len(episodes)) // cfg.group_size


class IGPO(Method):
    """IGPO (Wang et al. 2025, "Information Gain-based Policy Optimization"): turn t's reward is the
    information gain r_t = log pi(a | q, o_<=t) - log pi(a | q, o_<t) (Eq. 5), log pi(a | .) the
    mean per-token log-prob of the gold answer a, teacher-forced by the current policy (Eq. 4); the
    last turn's reward is the outcome; both are z-normalised per group separately and summed with
    discount gamma (Eqs. 6-7; igpo_advantages). # DEVIATION L4: the answer is teacher-forced after
    the response's own "<answer>" tag, and only the first gold answer is scored (the paper does not
    say how several gold answers combine)."""
    name = "igpo"

    def answer_ids(self, tok, gold: str) -> tuple:
        pre, full = (tok("<answer>", add_special_tokens=False)["input_ids"],
                     tok(f"<answer> {gold}", add_special_tokens=False)["input_ids"])
        if full[:len(pre)] != pre or len(full) == len(pre):
            return pre, tok(f" {gold}", add_special_tokens=False)["input_ids"]
        return pre, full[len(pre):]

    def turn_advantages(self, run, step, episodes, proto) -> tuple:
        t0, cfg = time.time(), self.cfg
        rows, n_ans = [], []
        for ep in episodes:
            pre, ans = self.answer_ids(run.tok, str(ep.golden_answers[0]))
            # o_<=t-1: every turn before t with its observation; t = 0: q alone
            for t in range(len(ep.turns)):
                rows.append(ep.prompt_ids + ep.ids[:ep.turns[t - 1].obs_end if t else 0]
                            + pre + ans)
                n_ans.append(len(ans))
        lps = (logprobs.token_logprobs_rows(run.accel.unwrap_model(run.policy), rows,
                                            run.tok.pad_token_id, cfg.micro_batch_size)
               if rows else [])
        flat = np.array([lp[-n:].mean() for lp, n in zip(lps, n_ans)])
        per_ep = np.split(flat, np.cumsum([len(ep.turns) for ep in episodes])[:-1])
        adv = igpo_advantages(per_ep, [ep.reward for ep in episodes], _group_ids(cfg, episodes),
                              cfg.gamma, cfg.adv_eps)
        return adv, {"aux_tokens": 0, "aux_fwd_tokens": sum(map(len, rows)), "aux_bwd_tokens": 0,
                     "time_credit": (time.time() - t0) / run.accel.num_processes,
                     "info_gain": float(np.mean([np.diff(lp).mean() for lp in per_ep
                                                 if len(lp) > 1] or [0.0]))}


# --------------------------------------------------------------------------------------------------
# CRAFT: counterfactual credit from free sibling rollouts


def craft_token_importance(gaps, advantages, beta=1.0) -> np.ndarray:
    """CRAFT pillar 1, counterfactual token importance: signed credit C_{i,t} per rollout i and
    turn t.

    Our reading of the seed (# DEVIATION C5): to estimate how the group advantage would change if
    the policy at turn t were tilted toward the teacher (the same policy with privileged context),
    reweight the G-1 siblings j != i by the teacher/student likelihood ratio of their own turn-t
    decision,
        w_j = exp(beta * g_{j,t}),
        g_{j,t} = sum over the turn's tokens of (log pi_teacher - log pi_student),
        C_{i,t} = sum_j w_j A_j / sum_j w_j - mean_j A_j
    (self-normalised importance sampling, j over siblings that have a turn t). C > 0: following the
    teacher at turn t raises the advantage; C < 0: it would hurt. # DEVIATION C5: computed per turn
    and broadcast to the turn's tokens (e.g. with token_advantages), because sibling tokens cannot
    be aligned position by position. gaps: (G, T), NaN where a rollout has no turn t; advantages:
    (G,) GRPO advantages. Returns (G, T); 0 where rollout i has no turn t or no sibling has one.
    """
    g, A = as_array(gaps), as_array(advantages).reshape(-1)
    if g.ndim != 2 or len(g) != len(A):
        raise ValueError(f"gaps must be (G, T) with G = {len(A)}; got {g.shape}")
    has = ~np.isnan(g)
    out = np.zeros(g.shape)
    for i, t in zip(*np.nonzero(has)):
        m = has[:, t] & (np.arange(len(A)) != i)  # leave-one-out siblings with a turn t
        if m.any():
            logw = beta * g[m, t]
            w = np.exp(logw - logw.max())
            out[i, t] = w @ A[m] / w.sum() - A[m].mean()
    return out


def craft_token_weights(token_gaps) -> np.ndarray:
    """How CRAFT's per-turn credit C_{i,t} is spread over the turn's tokens:
    w_k = |g_k| / mean_k' |g_k'| (tokens where teacher and student agree carry no counterfactual
    signal); mean 1 over the turn, so the turn's total credit is unchanged; all ones when every gap
    is 0. # DEVIATION L9: our reading of "signed per-token credit"."""
    a = np.abs(as_array(token_gaps).reshape(-1))
    return a / a.mean() if a.size and a.mean() > 0 else np.ones(a.shape)


class CRAFT(Method):
    """CRAFT pillar 1 (seed 004, "Counterfactual Credit Assignment from Free Sibling Rollouts") on
    top of GRPO: A_{i,k} = A_traj_i + C_{i,t} w_{i,k} on the sampled tokens k of turn t. C_{i,t}
    (craft_token_importance) is the self-normalised importance estimate, over the G - 1 siblings,
    of the change in group advantage if turn t were tilted toward the teacher, with weights
    exp(craft_beta g_{j,t}), g = sum of (log pi_teacher - log pi) over the turn's tokens;
    w_{i,k} = |g_{i,k}| / mean |g_{i,.}| puts it on the tokens where teacher and student differ
    (craft_token_weights). Pillars 2-3 (distillation controller, polarised KL) act on a
    self-distillation loss this trainer does not have, so they are not implemented.
    # DEVIATION L8: the teacher is the same policy with the gold answer appended to the question
    (the seed's "privileged context" for search QA); student log-probs are the rollout's sampling
    log-probs (turn.logprobs)."""
    name = "craft"

    def advantages(self, run, step, episodes, batch, proto) -> tuple:
        # GRPO's A_traj on every sampled token
        adv, _ = super().advantages(run, step, episodes, batch, proto)
        return self.token_advantages(run, step, episodes, batch, adv)

    def token_advantages(self, run, step, episodes, batch, adv) -> tuple:
        t0, cfg, tok = time.time(), self.cfg, run.tok
        chat = bool(getattr(tok, "chat_template", None))
        rows, offsets = [], []
        for ep in episodes:
            hint = f"{ep.question}\nReference answer: {ep.golden_answers[0]}"
            prompt = tok(protocol.render_prompt(tok, hint),
                         add_special_tokens=not chat)["input_ids"]
            rows.append(prompt + ep.ids)
            offsets.append(len(prompt))
        teacher = logprobs.token_logprobs_rows(run.accel.unwrap_model(run.policy), rows,
                                               tok.pad_token_id, cfg.micro_batch_size,
                                               cfg.temperature)
        # token k of the response is predicted at position offset + k - 1
        gaps = [[teacher[b][offsets[b] + t.start - 1:offsets[b] + t.end - 1]
                 - np.asarray(t.logprobs) for t in ep.turns]
                for b, ep in enumerate(episodes)]
        a_traj, G, out = (self.trajectory_advantages(episodes), cfg.group_size,
                          np.array(adv, dtype=np.float64))
        for g0 in range(0, len(episodes), G):
            table = np.full((G, max(len(ep.turns) for ep in episodes[g0:g0 + G])), np.nan)
            for j in range(G):
                table[j, :len(gaps[g0 + j])] = [g.sum() for g in gaps[g0 + j]]
            C = craft_token_importance(table, a_traj[g0:g0 + G], cfg.craft_beta)
            for j in range(G):
                ep = episodes[g0 + j]
                for t, turn in enumerate(ep.turns):
                    span = slice(len(ep.prompt_ids) + turn.start, len(ep.prompt_ids) + turn.end)
                    out[g0 + j, span] += C[j, t] * craft_token_weights(gaps[g0 + j][t])
        sampled = batch["loss_mask"].cpu().numpy() == 1
        return out, {"aux_tokens": 0, "aux_fwd_tokens": sum(map(len, rows)), "aux_bwd_tokens": 0,
                     "time_credit": (time.time() - t0) / run.accel.num_processes,
                     "craft_credit_rms": (float(np.sqrt(np.mean((out - adv)[sampled]**2)))
                                          if sampled.any() else 0.0)}
