"""The credit methods of `train_twice.py --method=NAME`: one registry (DESIGN.md section 7).

Every method gives train_step its rollout and its advantages through one hook, `twice.Method`
(GRPO). TWICE is twice.Twice; its textbook ablation, the independent counterfactual, and the
rollout-based baselines are baselines.py's; the learned estimators (PPO's critic, SPA-RL, AgentPRM)
are learned.py's; oracle.py is the ceiling (exact credit by Monte Carlo), no method to run.
"""
from dataclasses import dataclass

import twice
from methods import baselines
from methods import learned
from methods import oracle

TWIN_METHODS = ("twice", "independent")  # credited by twice.twin_credit (steps 2-6)
METHODS = {"grpo": twice.Method, "twice": twice.Twice, "independent": baselines.Independent,
           "vineppo": baselines.VinePPO, "gigpo": baselines.GiGPO, "hgpo": baselines.HGPO,
           "arpo": baselines.ARPO, "tree_grpo": baselines.TreeGRPO, "ppo": learned.PPO,
           "igpo": baselines.IGPO, "spa_rl": learned.SPARL, "agentprm": learned.AgentPRM,
           "craft": baselines.CRAFT, "oracle": oracle.Oracle}
NAMES = tuple(METHODS)
# the learned estimators copy the policy's body
LEARNED = tuple(name for name, cls in METHODS.items() if issubclass(cls, learned._Learned))


@dataclass
class BaselineConfig:
    """The baselines' knobs (DESIGN.md section 7): each is read only by the method it names.
    train_twice's Config extends this class, so every knob is a field of one Config and a flag of
    train_twice.py."""
    vine_k: int = 9                 # vineppo: K MC continuations per turn boundary (its paper: 9)
    step_gamma: float = 0.95        # gigpo, hgpo: gamma of the step return gamma^(T-1-t) U (0.95)
    hgpo_k: int = 2                 # hgpo: longest history context K of the step groups
    hgpo_alpha: float = 1.0         # hgpo: level weight w_k ~ (k + 1)^alpha
    arpo_initial: float = 0.5       # arpo: full samples N / rollout budget M (ARPO: 8 of 16)
    arpo_beam: int = 2              # arpo: partial samples Z per triggered step (ARPO: 2)
    arpo_beta: float = 0.2          # arpo: entropy weight beta of P_t = alpha + beta Normalize(dH)
    arpo_tau: float = 0.5           # arpo: branch iff P_t > tau, alpha ~ U(0, 1) (ARPO's code: 0.5)
    tree_m: int = 2                 # tree_grpo: trees M per prompt (expansions fill the group)
    tree_l: int = 1                 # tree_grpo: expansion rounds L
    gamma: float = 1.0              # discount: ppo's GAE, igpo/spa_rl returns, agentprm (papers: 1)
    gae_lambda: float = 1.0         # lambda of ppo's GAE (Search-R1: 1)
    estimator_lr_scale: float = 10.0  # lr of critic, progress estimator, PRM / lr (Search-R1: 10)
    spa_beta: float = 0.1           # spa_rl: weight of the grounding reward g_t (progress: 1)
    prm_rollouts: int = 1           # agentprm: MC continuations per non-final decision
    craft_beta: float = 1.0         # craft: inverse temperature of the sibling weights exp(beta g)
    oracle_rollouts: int = 32       # oracle: M MC rollouts per side of A* = Q - V (SE <= sqrt(0.5 / M))
    oracle_traj: bool = False       # oracle: A_traj + omega A* / sigma_hat (TWICE, A_hat = A*), not A* alone

    def baseline_checks(self) -> list:
        """(field, ok, rule) of the knobs the chosen method reads, and only those: a knob no method
        of the run reads cannot fail or mislead it (`--group_size=1` is one error, not also
        Tree-GRPO's tree_m <= group_size)."""
        read_by = {"vine_k": ("vineppo",), "step_gamma": ("gigpo", "hgpo"), "hgpo_k": ("hgpo",),
                   "arpo_initial": ("arpo",), "arpo_beam": ("arpo",), "tree_m": ("tree_grpo",),
                   "tree_l": ("tree_grpo",), "gamma": ("ppo", "igpo", "spa_rl", "agentprm"),
                   "gae_lambda": ("ppo",), "estimator_lr_scale": ("ppo", "spa_rl", "agentprm"),
                   "spa_beta": ("spa_rl",), "prm_rollouts": ("agentprm",), "craft_beta": ("craft",),
                   "oracle_rollouts": ("oracle",), "twin_scale": ("oracle",)}
        at_least = {"vine_k": 1, "hgpo_k": 0, "arpo_beam": 1, "tree_m": 1, "tree_l": 1,
                    "estimator_lr_scale": 0, "spa_beta": 0, "prm_rollouts": 0, "craft_beta": 0,
                    "oracle_rollouts": 1}
        checks = ([(k, getattr(self, k) >= v, f">= {v}") for k, v in at_least.items()] +
                  [(k, 0 < getattr(self, k) <= 1, "in (0, 1]")
                   for k in ("step_gamma", "arpo_initial", "gamma")] +
                  [("gae_lambda", 0 <= self.gae_lambda <= 1, "in [0, 1]"),
                   ("tree_m", self.tree_m <= self.group_size, "<= group_size"),
                   ("twin_scale", self.twin_scale == "rms", "'rms': the oracle scales A* by its RMS")])
        return [c for c in checks if self.method in read_by[c[0]]]


def make(cfg) -> twice.Method:
    return METHODS[cfg.method](cfg)
