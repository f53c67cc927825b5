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

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict):
        pass


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


TWIN_METHODS = ("twice",)  # told inline in train_twice.train_step (steps 3-5); their rollout and A_traj: Method's
METHODS = {"grpo": Method, **{name: Method for name in TWIN_METHODS}}
NAMES = tuple(METHODS)


def make(cfg) -> Method:
    return METHODS[cfg.method](cfg)
