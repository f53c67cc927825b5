"""infra/cuda.py: a GPU run on a machine where torch sees no CUDA device stops in seconds with one line that says
why (a CPU build of torch, no driver, a driver older than the torch build's CUDA needs) and what to do."""
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from infra import cuda

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("torch_cuda,driver,expected", [
    (None, "", "torch is a CPU build, without CUDA (NVIDIA driver: none found)"),
    ("13.0", "", "no NVIDIA driver found"),
    ("13.0", "535.104.05", "NVIDIA driver 535.104.05 is too old: torch's CUDA 13.0 needs an NVIDIA driver >= 580"),
    ("12.8", "535.104.05", "torch (CUDA 12.8 needs an NVIDIA driver >= 525) sees no CUDA device with driver 535"),
])
def test_each_cause_is_named(torch_cuda, driver, expected, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert cuda.problem(torch_cuda, driver, available=False).startswith(expected)
    assert cuda.problem(torch_cuda, driver, available=True) == ""


def test_the_driver_floor_is_nvidias_minor_version_table():
    assert cuda.DRIVER_FLOOR == {11: 450, 12: 525, 13: 580}
    assert "update the NVIDIA driver" in cuda.problem("13.0", "570.86.15", False)
    assert "too old" not in cuda.problem("13.0", "580.65.06", False)


def test_only_gpu_runs_are_checked(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    monkeypatch.setattr(cuda, "diagnose", lambda: "no NVIDIA driver found")
    cuda.require(SimpleNamespace(bf16=False, require_cuda=False))  # a CPU run: nothing to check
    for cfg, why in ((SimpleNamespace(bf16=True), "bf16 = true"),
                     (SimpleNamespace(bf16=False, require_cuda=True), "require_cuda = true")):
        with pytest.raises(ValueError, match=rf"this run needs a CUDA GPU \({why}\): no NVIDIA driver found"):
            cuda.require(cfg)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ValueError, match=r"\(DeepSpeed"):
        cuda.require(SimpleNamespace(bf16=False))
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")  # asked for a CPU run on purpose
    cuda.require(SimpleNamespace(bf16=True))


@pytest.mark.skipif(cuda.diagnose() == "", reason="this machine has a usable CUDA device")
def test_the_paper_preset_on_a_machine_without_cuda_stops_in_seconds(tmp_path):
    """`python train_twice.py configs/qwen2.5-3b.cfg` where no GPU can be used: one line naming CUDA and the driver,
    exit status 1, within a minute, nothing left in the run folder."""
    t = time.time()
    env = {k: v for k, v in os.environ.items() if k not in ("ACCELERATE_USE_CPU", "ACCELERATE_USE_DEEPSPEED")}
    tiny = os.path.join(ROOT, "worlds", "tiny-0")
    proc = subprocess.run([sys.executable, "train_twice.py", "configs/qwen2.5-3b.cfg", f"--model={tiny}/policy",
                           f"--train_data={tiny}/train.jsonl", f"--eval_data={tiny}/test.jsonl", "--retriever_url=",
                           f"--index={tiny}/index", f"--out_dir={tmp_path / 'run'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("train_twice.py: error: this run needs a CUDA GPU (bf16 = true): ")
    assert "CUDA" in lines[0].split("): ", 1)[1] and "driver" in lines[0]
    assert time.time() - t < 60 and os.listdir(tmp_path / "run") == []
    proc = subprocess.run([sys.executable, "-m", "infra.cuda"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "no GPU run can start" in proc.stdout
