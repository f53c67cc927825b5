"""methods/__init__.py, the registry: every name builds its trainer, and every trainer answers the one hook train_step calls."""
from methods import baselines
import methods
import train_twice as tt


def test_every_method_builds_and_answers_the_hook():
    assert set(methods.TWIN_METHODS) <= set(methods.NAMES) and len(methods.NAMES) == 14  # 13 and the oracle
    for name in methods.NAMES:
        method = methods.make(tt.Config(method=name))
        assert isinstance(method, baselines.Method), name
        assert callable(method.rollout) and callable(method.advantages), name
        assert method.state_dict() == {}, name  # nothing learned before the first step
    assert methods.make(tt.Config(method="independent")).independent_twins
    assert not methods.make(tt.Config(method="twice")).independent_twins


def test_omega_zero_is_grpo():
    cfg = tt.parse_config(["--omega=0"])
    assert cfg.method == "grpo" and type(methods.make(cfg)) is baselines.Method
