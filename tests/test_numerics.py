"""Tests for infra/numerics.py: a fresh process is pinned whatever its environment asked for; a process that loaded torch
first is refused (or, with ALLOW_UNPINNED=1, warned); the checks read what the libraries really run with."""
import json
import os
import subprocess
import sys

from infra import numerics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {k: v for k, v in os.environ.items() if k != "ALLOW_UNPINNED"}


def run(args, **extra):
    return subprocess.run([sys.executable, *args], cwd=ROOT, env={**ENV, **extra}, capture_output=True, text=True,
                          timeout=120)


def report_of(proc) -> dict:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout[:proc.stdout.rindex("}") + 1])


def test_a_fresh_process_is_pinned_whatever_its_environment_asked_for():
    hostile = dict(OMP_NUM_THREADS="2", MKL_CBWR="AVX512", ATEN_CPU_CAPABILITY="avx512", FAISS_SIMD_LEVEL="NONE")
    proc = run(["-m", "perf.probe"], **hostile)
    report = report_of(proc)
    assert report["in_force"] == {"cpu_capability": "AVX2", "threads": 1, "mkl_branch": "COMPATIBLE",
                                  "faiss_simd": "AVX2"}
    assert report["pins"] == numerics.PINS and proc.stdout.rstrip().endswith("pinned: no problem")
    for note in ("OMP_NUM_THREADS=2", "MKL_CBWR=AVX512", "ATEN_CPU_CAPABILITY=avx512", "FAISS_SIMD_LEVEL=NONE"):
        assert f"numerics: {note} replaced by the pinned value" in proc.stderr
    assert report_of(run(["-m", "perf.probe"]))["probe"] == report["probe"]  # the same bits either way


def test_torch_loaded_first_is_refused_or_with_allow_unpinned_warned():
    code = "import torch; from infra import numerics; print(numerics.require('this check'))"
    refused = run(["-c", code])
    assert refused.returncode == 1 and refused.stdout == ""
    assert "this check is not on pinned numerics" in refused.stderr
    assert "numpy, torch loaded before infra/numerics.py" in refused.stderr and "Set ALLOW_UNPINNED=1" in refused.stderr
    warned = run(["-c", code], ALLOW_UNPINNED="1")
    assert warned.returncode == 0 and warned.stdout.strip() == "False" and "ALLOW_UNPINNED=1: going on" in warned.stderr


def test_the_checks_read_the_libraries_not_the_environment():
    """MKL_CBWR=AVX2 set after MKL has run changes nothing: the branch in force is still reported as it is."""
    code = ("from infra import numerics; import torch, os; torch.ones(8, 8) @ torch.ones(8, 8); os.environ['MKL_CBWR'] = 'AVX2'; "
            "print(numerics.mkl_branch()); print(numerics.problems())")
    proc = run(["-c", code])
    assert proc.returncode == 0, proc.stderr
    branch, problems = proc.stdout.splitlines()
    assert branch == "COMPATIBLE" and "MKL_CBWR='AVX2' in the environment, pinned 'COMPATIBLE'" in problems


def test_this_test_process_is_not_pinned():
    """conftest.py loads torch before any project module, so in-process tests run on the machine's own numerics."""
    assert numerics.LOADED_BEFORE and any("loaded before infra/numerics.py" in p for p in numerics.problems())
    assert numerics.pin() == [] and numerics.describe()["pinned"] is False
