"""Tests for perf/nodecheck.py, the node check (DESIGN.md section 10): on two CPU ranks (gloo, DeepSpeed's CPU
accelerator) every part runs and agrees with the ledger (the all-reduce's sum exact, ZeRO-2's steady bytes and step
equal to zero2_static, its backward under it, every query finds its own row); a figure off its budget fails the check
with a reason naming the rank; without torchrun it says how to launch it."""
import copy
import json
import os
import subprocess
import sys

import pytest

from perf import ledger
from perf import nodecheck

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("node") / "node_check.json")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "perf.nodecheck", "--tiny", "--out", out], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.load(open(out))


def test_two_cpu_ranks_run_every_part_and_match_the_ledger(two_ranks):
    result = two_ranks
    assert result["ok"] and result["why"] == [] and result["world"] == 2 and len(result["ranks"]) == 2
    for fig in result["ranks"]:
        assert fig["all_reduce"]["exact"] and len(fig["all_reduce"]["busbw_gbs"]) == 3
        assert all(v > 0 for v in fig["all_reduce"]["busbw_gbs"].values())
        z = fig["zero2"]
        for k in ("steady", "step"):  # zero2_static is exact here (to the allocator's 4-byte rounding)
            assert abs(z[k] - z["predicted"][k]) <= 1e-4 * z["predicted"][k], (k, z)
        assert 0 < z["update"] <= z["predicted"]["update"]
        assert z["params"] == sum(ledger.param_numels({**nodecheck.TINY}))
    server = result["ranks"][0]["retriever"]
    assert server["self_found"] and server["queries_per_s"] > 0
    assert "retriever" not in result["ranks"][1]  # rank 0 loads the index, as the one server process does


def test_a_figure_off_its_budget_fails_the_check_naming_the_rank(two_ranks):
    bad = copy.deepcopy(two_ranks)
    bad["ranks"][1]["outside_gib"]["nccl"] = sum(ledger.CONTEXT_GIB.values()) + 1
    bad["ranks"][0]["zero2"]["steady"] *= 1.5
    bad["ranks"][1]["all_reduce"]["exact"] = False
    bad["ranks"][0]["retriever"]["self_found"] = False
    bad["ranks"][1]["retriever_gib"] = 100.0
    why = nodecheck.verdict(bad, 0.1)
    assert not why["ok"] and len(why["why"]) == 5
    assert [w.split(":")[0] for w in why["why"]] == ["rank 0", "rank 1", "rank 1", "retriever", "rank 1"]


def test_without_torchrun_it_says_how_to_launch_it():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-m", "perf.nodecheck", "--tiny"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "torchrun --nproc_per_node" in proc.stderr
