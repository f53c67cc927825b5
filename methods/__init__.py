"""The credit methods of `train_twice.py --method=NAME`: one registry (DESIGN.md section 7).

TWICE and its textbook ablation (the independent counterfactual) are told inline in train_twice.twin_credit, on
GRPO's rollout; every other method is a trainer of methods/baselines.py (rollout-based) or methods/learned.py (learned estimators),
and gives train_step its rollout and its advantages through one hook (baselines.Method).
"""
from methods import baselines
from methods import learned

TWIN_METHODS = ("twice", "independent")  # credited by train_twice.twin_credit (steps 2-6)
METHODS = {"grpo": baselines.Method, "twice": baselines.Method, "independent": baselines.Independent,
           "vineppo": baselines.VinePPO, "gigpo": baselines.GiGPO, "hgpo": baselines.HGPO, "arpo": baselines.ARPO,
           "tree_grpo": baselines.TreeGRPO, "ppo": learned.PPO, "igpo": baselines.IGPO, "spa_rl": learned.SPARL,
           "agentprm": learned.AgentPRM, "craft": baselines.CRAFT}
NAMES = tuple(METHODS)
LEARNED = tuple(name for name, cls in METHODS.items() if issubclass(cls, learned._Learned))  # copy the policy's body


def make(cfg) -> baselines.Method:
    return METHODS[cfg.method](cfg)
