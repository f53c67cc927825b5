import os
import sys

import pytest
import torch  # before any project module: infra/numerics.py then leaves this process and its env unpinned

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the modules are imported from the repository root (folders as packages)
# child processes too: `python -m lab.audit` and the like, started from any working directory
os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# vLLM's own switch for its CPU CI (vllm/platforms/cpu.py): its CPU engines trace the model with dynamo's eager backend
# instead of compiling it with inductor. Each engine start of tests/test_vllm.py takes ~14 s instead of ~37 s on a cold
# compile cache (a fresh machine's), and decodes at the same speed; the tests compare tokens, not kernels.
os.environ.setdefault("VLLM_CPU_CI_ENV", "1")
# In-process tests run on this machine's own numerics and compare with in-process results; a script run in a
# subprocess pins itself (infra/numerics.py), and the tests of the pins themselves drop this variable. Set, not defaulted:
# the Makefile exports ALLOW_UNPINNED=0 for its world targets, and `make test` inherits it.
os.environ["ALLOW_UNPINNED"] = "1"
# Under pytest-xdist (make test: one worker per core) each worker and its child processes compute on one thread: the
# workers fill the cores, and the suite's tiny models gain nothing from a second thread but its synchronisation (two
# workers of two threads each on two cores spin-wait for each other's threads).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


# The files that take longest (a full run's --durations, 2026-12-06), longest first: under `--dist loadfile`
# (pytest.ini) each file is one unit of work, handed out in collection order, so they go out first and the
# short ones fill in.
LONGEST_FIRST = ["test_vllm", "test_ledger", "test_readme", "test_train", "test_rank_failure", "test_nodecheck",
                 "test_server", "test_lora", "test_speed", "test_first_hour", "test_layout", "test_gpucheck",
                 "test_numerics", "test_learned", "test_replay", "test_oracle", "test_world_lock", "test_retriever",
                 "test_benchmark", "test_baselines", "test_twin_data", "test_reproduce"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: a file's tests keep their order
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory):
    """The built-in tiny world at test scale (same files and formats as `make world`), built once per session."""
    from worlds import build as world
    out = tmp_path_factory.mktemp("tinyworld") / "world"
    world.build_world(str(out), seed=0, scale="test")
    return str(out)
