"""infra/phases.py (a step's phases: seconds, and GPU memory per rank) and perf/smoke.py (the smoke stage of
`make reproduce-*` against the memory ledger)."""
import json
import os
from types import SimpleNamespace

import pytest
import torch

from infra import phases
from perf import smoke

GIB = 1 << 30


class OneRank:
    device, num_processes = torch.device("cpu"), 1

    def gather(self, t):
        return t


def test_phases_time_each_phase_and_on_a_cpu_measure_no_memory(monkeypatch):
    clock = iter([10.0, 12.0, 15.0, 16.5, 20.0])
    monkeypatch.setattr(phases.time, "time", lambda: next(clock))
    times = phases.Phases()
    for name in ("rollout", "twins", "logprobs", "update"):
        times.mark(name)
    assert times.metrics(OneRank()) == {"time_rollout": 2.0, "time_twins": 3.0, "time_logprobs": 1.5,
                                        "time_update": 3.5, "time": 10.0}


def test_on_a_gpu_each_phase_has_its_own_peak_and_the_used_bytes_at_its_end(monkeypatch):
    """The allocator's peak is reset at each mark, so a phase's figure is its own, not the step's so far."""
    state = {"peak": 0, "used": 0}
    cuda = SimpleNamespace(is_available=lambda: True, max_memory_allocated=lambda: state["peak"],
                           reset_peak_memory_stats=lambda: state.update(peak=0),
                           mem_get_info=lambda: (80 * GIB - state["used"], 80 * GIB))
    monkeypatch.setattr(phases.torch, "cuda", cuda)
    times = phases.Phases()
    for name, peak, used in (("rollout", 60, 65), ("twins", 50, 66), ("update", 30, 40)):
        state.update(peak=peak * GIB, used=used * GIB)
        times.mark(name)
        assert state["peak"] == 0
    got = times.metrics(OneRank())
    assert (got["mem_rollout_gib"], got["mem_twins_gib"], got["mem_update_gib"]) == ([60.0], [50.0], [30.0])
    assert (got["used_rollout_gib"], got["used_twins_gib"], got["used_update_gib"]) == ([65.0], [66.0], [40.0])


def ledger(alloc=(50.0, 45.0, 20.0, 30.0, 25.0), total=(60.0, 55.0, 30.0, 40.0, 35.0)):
    names = ("rollout", "twins", "logprobs", "update", "optimizer_step")
    return {"world": 8, "config": {"prompts_per_step": 64, "gen_batch_size": 64, "method": "twice"},
            "phases": {n: {"allocated_gib": a, "total_gib": t} for n, a, t in zip(names, alloc, total)}}


def run_folder(tmp_path, steps=(0, 1, 2), rollout=(48.0, 51.0), gpu=True, config=None):
    run = tmp_path / "smoke"
    run.mkdir()
    rows = []
    for step in steps:
        row = {"step": step, "reward": 0.1}
        if gpu:
            for phase, (alloc, used) in {"rollout": rollout, "twins": (40.0, 50.0), "logprobs": (18.0, 28.0),
                                         "update": (29.0, 39.0)}.items():
                row[f"mem_{phase}_gib"], row[f"used_{phase}_gib"] = [alloc, alloc - 1], [used, used - 1]
        rows.append(row)
    rows.append({"step": len(steps), "final": True, "eval_em": 0.1})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "config.json").write_text(json.dumps(config or {"prompts_per_step": 512, "gen_batch_size": 64}))
    return str(run)


def test_a_run_within_the_ledger_passes_and_writes_its_table(tmp_path, capsys):
    run = run_folder(tmp_path)
    path = tmp_path / "memory.json"
    path.write_text(json.dumps({"3b": ledger()}))
    assert smoke.main([run, "--size", "3b", "--ledger", str(path)]) == 0
    table = open(os.path.join(run, "smoke.md")).read()
    # update: the larger of the ledger's update and optimizer step; the largest rank and step
    assert "| rollout | 48.00 | 50.00 | 0.96 | 51.00 | 60.00 | 0.85 |" in table
    assert "| update | 29.00 | 30.00 | 0.97 | 39.00 | 40.00 | 0.97 |" in table
    assert "within 10% of the ledger" in capsys.readouterr().out


@pytest.mark.parametrize("case,want", [
    ("over", "rollout: allocated 56.00 GiB, over the ledger's 50.00 GiB by more than 10%"),
    ("no resume", "steps [0, 1], not 0..2"),
    ("cpu", "no per-phase GPU memory"),
    ("other preset", "gen_batch_size = 32 in the run, 64 in the ledger"),
])
def test_what_stops_the_pipeline_is_named(tmp_path, capsys, case, want):
    run = run_folder(tmp_path, steps=(0, 1) if case == "no resume" else (0, 1, 2),
                     rollout=(56.0, 58.0) if case == "over" else (48.0, 51.0), gpu=case != "cpu",
                     config={"prompts_per_step": 512, "gen_batch_size": 32} if case == "other preset" else None)
    path = tmp_path / "memory.json"
    path.write_text(json.dumps({"3b": ledger()}))
    assert smoke.main([run, "--ledger", str(path)]) == 1
    err = capsys.readouterr().err
    assert want in err and "does not run as the ledger says" in err
    _, problems = smoke.check(run, ledger(), 0.1)
    assert len(problems) == 1  # that one, and nothing else


def test_the_committed_ledger_covers_every_phase_the_trainer_marks():
    saved = json.load(open(os.path.join(smoke.ROOT, "results", "memory.json")))
    for size in ("3b", "7b"):
        want = smoke.predicted(saved[size])
        assert set(want) == {"rollout", "twins", "logprobs", "update"}
        assert all(0 < alloc < total < saved[size]["gpu_gib"] for alloc, total in want.values())
