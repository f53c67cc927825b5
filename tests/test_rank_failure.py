"""A failure on one of two CPU ranks stops both within a minute, at every phase of a run (DESIGN.md section 10).

Each case launches train_twice on 2 CPU processes (accelerate launch, gloo) through a driver that injects one
failure on rank 1 only, by patching the function of that phase: an exception (an OOM as torch raises it), a
SIGKILL, or a SIGSTOP (a rank alive but stuck: no launcher notices that, only infra/watchdog.py). The driver writes
the time of the injection; the test asserts the launcher has returned non-zero within 60 s of it and that the
output names the failure. Nothing of this is in train_twice: the patching is the driver's, and the watchdog costs a
few store round trips a second."""
import contextlib
import os
import signal
import subprocess
import time

import pytest

from test_train import ROOT, cpu_launch

DRIVER = r"""
import atexit, os, signal, sys, time
sys.path.insert(0, {root!r})
import torch
import eval as qa_eval
import train_twice as tt
import twice

PHASE, KIND = os.environ["FAIL_AT"].split(":")
MARK = os.environ["FAIL_MARK"]
with open(MARK + ".pids", "a") as f:  # for the test's clean-up: torchrun's workers outlive a killed launcher
    f.write(f"{{os.getpid()}}\n")


def fail():
    with open(MARK, "w") as f:
        f.write(repr(time.time()))
    print(f"rank 1 injects {{KIND}} in {{PHASE}}", file=sys.stderr, flush=True)
    if KIND == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if KIND == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if KIND == "oom-hang":  # as a process whose NCCL teardown waits for peers that never come
        atexit.register(time.sleep, 3600)
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected in " + PHASE + ")")


def on_rank_1(module, name, calls=1):
    real = getattr(module, name)
    seen = []
    def patched(*args, **kw):
        seen.append(1)
        if os.environ.get("RANK") == "1" and len(seen) == calls:
            fail()
        return real(*args, **kw)
    setattr(module, name, patched)


TARGETS = {{"setup": (qa_eval, "load_policy", 1), "rollout": (tt.rollout, "collate", 2),
           "twins": (twice.Twice, "advantages", 1), "update": (tt, "ppo_update", 1),
           "eval": (qa_eval, "evaluate_on_ranks", 2), "save": (tt.checkpoint, "save", 1)}}
on_rank_1(*TARGETS[PHASE])
tt.console.run_cli(tt.main, tt.config.cli(tt.Config, prog="train_twice.py"), "train_twice.py")
"""

# each phase once, the kinds spread over them (every pair would be 18 launches of ~20 s)
CASES = [("setup", "oom"), ("rollout", "kill"), ("twins", "oom"), ("update", "oom-hang"), ("eval", "stop"),
         ("save", "oom")]


@pytest.mark.parametrize("phase,kind", CASES)
def test_a_failure_on_one_rank_stops_both_within_a_minute(tiny_world, tmp_path, phase, kind):
    driver, mark, out = tmp_path / "driver.py", tmp_path / "injected", str(tmp_path / "run")
    driver.write_text(DRIVER.format(root=ROOT))
    cmd, env = cpu_launch(str(driver), out, tiny_world, "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                          flags=("--steps=3", "--eval_every=1", "--save_every=1", "--rank_timeout_s=10"))
    env.update(FAIL_AT=f"{phase}:{kind}", FAIL_MARK=str(mark))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=400)
    finally:  # a test that failed leaves no process behind (SIGSTOPped ones included)
        if proc.poll() is None:
            for pid in open(f"{mark}.pids").read().split() if os.path.exists(f"{mark}.pids") else []:
                with contextlib.suppress(ProcessLookupError):  # the workers first: they hold the pipes open
                    os.kill(int(pid), signal.SIGKILL)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    ended = time.time()
    assert mark.exists(), err[-3000:]
    took = ended - float(mark.read_text())
    print(f"{phase}:{kind}: both ranks stopped {took:.1f} s after the injection")
    assert proc.returncode != 0 and took < 60, (proc.returncode, took, err[-3000:])
    assert f"rank 1 injects {kind} in {phase}" in err
    if kind.startswith("oom"):
        assert "OutOfMemoryError" in err and f"(injected in {phase})" in err, err[-3000:]
    if kind in ("stop", "oom-hang"):  # only the watchdog stops rank 0 here
        why = "rank 1 has not been heard from for" if kind == "stop" else \
            "rank 1 failed: OutOfMemoryError: CUDA out of memory"
        assert f"rank 0: stopping: {why}" in err, err[-3000:]
