"""A newcomer's first hour: report rows by method and pairs of equal length, one step numbering,
tables of what was measured, one EM unit, one-line errors before anything loads, a failed start
that blocks nothing, Ctrl-C and SIGTERM that say how to resume, range errors for the chosen method
only, and no noise read as a fault."""
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

import eval as qa_eval
import train_twice as tt
from infra import checkpoint, console
from lab import report
from test_train import TINY, read_metrics, tiny_cfg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fake_run(folder, name, cfg: dict, rows: list) -> str:
    d = folder / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(d)


def steps_rows(n: int, em0: float, em: float, evaluated_at_0: bool = True) -> list:
    """n steps of 100 tokens each, the eval at step 0 (or not) and the final one."""
    rows = [{"step": s, "reward": 0.5, "tokens": 100 * (s + 1), "factual_tokens": 100}
            for s in range(n)]
    if evaluated_at_0:
        rows[0]["eval_em"] = em0
    return rows + [{"step": n, "tokens": 100 * n, "eval_em": em, "final": True}]


# --- 1. lab/report.py: rows by method, pairs of equal length ---

def test_compare_labels_runs_by_method_not_by_omega(tmp_path):
    """--method=grpo leaves omega at 1 in config.json: it is GRPO, not a second TWICE seed;
    omega = 0 with method twice is GRPO too (train_twice.Config.resolve's rule)."""
    dirs = [fake_run(tmp_path, "g0", {"method": "grpo", "omega": 1.0, "coupling": True, "seed": 0,
                                      "steps": 2}, steps_rows(2, 0.5, 0.6)),
            fake_run(tmp_path, "g1", {"method": "twice", "omega": 0.0, "coupling": True, "seed": 1,
                                      "steps": 2}, steps_rows(2, 0.5, 0.8)),
            fake_run(tmp_path, "t0", {"method": "twice", "omega": 1.0, "coupling": True, "seed": 0,
                                      "steps": 2}, steps_rows(2, 0.5, 0.9))]
    table = report.compare_runs(dirs).splitlines()
    assert table[2].startswith("| GRPO | 2 | 0.500 +- 0.000 | 0.700 +- 0.100 |")
    assert table[3].startswith("| TWICE | 1 | 0.500 | 0.900 |") and len(table) == 4
    assert report.method_of({"method": "grpo", "omega": 1.0}) == "grpo"
    assert report.method_of({"method": "twice", "omega": 0}) == "grpo"
    longer = fake_run(tmp_path, "t1", {"method": "twice", "omega": 1.0, "coupling": True,
                                       "seed": 1, "steps": 5}, steps_rows(5, 0.5, 0.9))
    with pytest.raises(SystemExit, match=r"differ in length \(2 steps: .*; 5 steps: .*t1\)"):
        report.compare_runs(dirs + [longer])


def test_paired_refuses_a_pair_of_unequal_length_and_flags_an_auc_without_a_start(tmp_path):
    """A 5-step GRPO run paired with a 3-step TWICE run was a silent, meaningless difference; a run
    not evaluated before its first step gave a bare nan AUC: now n/a, and a line says why."""
    grpo = fake_run(tmp_path, "g0", {"method": "grpo", "seed": 0, "steps": 5, "token_budget": 0},
                    steps_rows(5, 0.2, 0.6))
    short = fake_run(tmp_path, "t0", {"method": "twice", "seed": 0, "steps": 3, "token_budget": 0},
                     steps_rows(3, 0.2, 0.6))
    with pytest.raises(SystemExit, match="unequal length in a pair .twice seed 0 ran 3 steps, "
                                         "grpo seed 0 5 steps"):
        report.paired([grpo, short])
    late = fake_run(tmp_path, "t1", {"method": "twice", "seed": 0, "steps": 5, "token_budget": 0},
                    steps_rows(5, 0.2, 0.6, evaluated_at_0=False))
    table = report.paired([grpo, late]).splitlines()
    assert table[2] == "| grpo | 1 | 0.200 | 0.600 | - | - |"
    assert table[3] == "| twice | 1 | n/a | 0.600 | n/a | +0.000 |" and "nan" not in "".join(table)
    assert table[5].startswith("AUC n/a: twice seed 0 not evaluated before the first step")
    same = fake_run(tmp_path, "t2", {"method": "twice", "seed": 0, "steps": 5, "token_budget": 0},
                    steps_rows(5, 0.2, 0.8))
    assert "| twice | 1 | 0.200 | 0.800 | +0.000 | +0.200 |" in report.paired([grpo, same])


# --- 2, 9. one step numbering everywhere; a short config line; no tied-weights warning ---

def test_console_metrics_and_checkpoints_count_steps_alike(tiny_world, tmp_path, capfd, caplog):
    out = str(tmp_path / "run")
    tt.main(tiny_cfg(tiny_world, out, "--steps=3", "--eval_every=2", "--save_every=1",
                     "--keep_checkpoints=0", "--log_tensorboard=false"))
    printed = capfd.readouterr()
    lines = printed.out.splitlines()
    rows = read_metrics(out)
    console = [line for line in lines if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in console] == [f"step {r['step']}/3" for r in rows[:-1]]
    # eval_every=2: evaluated at steps 0 and 2, on the console as in metrics.jsonl
    assert [line.split(" | ")[0] for line in console if "eval_em" in line] == ["step 0/3",
                                                                                "step 2/3"]
    assert [r["step"] for r in rows if "eval_em" in r and not r.get("final")] == [0, 2]
    assert next(line for line in lines if line.startswith("final")).startswith("final | step 3/3 |")
    for n in (1, 2, 3):  # step_N: the weights after N updates, which row N evaluated, sampled from
        assert checkpoint.read_state(os.path.join(out, f"step_{n:06d}"))["step"] == n
    assert "| eval (greedy EM) | step 0 | final |" in lines and "nan" not in printed.out
    config = [line for line in lines if line.startswith("config:")]
    assert len(config) == 1 and len(config[0].replace(out, "").replace(tiny_world, "")) < 200
    assert config[0].startswith("config: method twice (omega 1, twin_budget 0.7) | world ")
    assert f"{out}/config.json" in config[0] and "max_new_tokens" not in config[0]
    assert "Removed shared tensor" not in printed.out + printed.err
    assert not [r for r in caplog.records if "Removed shared tensor" in r.getMessage()]


# --- 3. the before/after table shows only what was measured ---

def test_the_summary_table_shows_only_what_was_measured(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "factual_tokens": 10, "aux_tokens": 0}, {"step": 1, "factual_tokens": 10,
                                                                  "aux_tokens": 0},
            {"step": 2, "final": True, "eval_em": 0.75, "eval_em/a": 1.0, "eval_em/b": 0.5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = console.run_summary(str(tmp_path))
    assert table.splitlines()[:5] == ["| eval (greedy EM) | final |", "|---|---:|", "| a | 1.000 |",
                                      "| b | 0.500 |", "| average | 0.750 |"]
    rows[1].update({"eval_em": 0.5, "eval_em/a": 0.5})  # first evaluated at step 1, on source a
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = console.run_summary(str(tmp_path)).splitlines()
    assert table[:5] == ["| eval (greedy EM) | step 1 | final |", "|---|---:|---:|",
                         "| a | 0.500 | 1.000 |", "| b | - | 0.500 |",
                         "| average | 0.500 | 0.750 |"]
    assert "nan" not in "\n".join(table)


# --- 4. one EM unit: a fraction, three decimals; the paper's table alone in percent ---

def test_eval_prints_em_as_a_fraction_and_the_papers_table_says_it_converts(tmp_path):
    table = qa_eval.em_table({"nq": (10, 0.99), "hotpotqa": (4, 0.5)}).splitlines()
    assert table[2:] == ["| nq | 10 | 0.990 |", "| hotpotqa | 4 | 0.500 |",
                         "| **average** | 14 | **0.745** |"]
    result = tmp_path / "grpo.json"
    result.write_text(json.dumps({"per_source": {"nq": {"n": 10, "em": 0.99}}}))
    text = report.paper_main([f"GRPO={result}", "--paper", "3b"])
    assert "| GRPO | 99.0 | **99.0** |" in text and "fractions in [0, 1], multiplied by 100" in text


# --- 5, 6. bad paths: one line, before anything loads, and nothing left to block the fix ---

def test_bad_paths_are_one_line_before_anything_loads(tiny_world, tmp_path):
    out, world = tmp_path / "run", tmp_path / "no-world"
    t = time.time()
    proc = subprocess.run([sys.executable, "train_twice.py", f"--world={world}",
                           f"--out_dir={out}"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith(f"train_twice.py: error: world {world}: no such folder")
    for field, name in (("train_data", "train.jsonl"), ("eval_data", "test.jsonl"),
                        ("index", "index"), ("model", "policy")):
        assert f"{field} {world / name}: no such" in lines[0]
    assert os.listdir(out) == [] and time.time() - t < 60  # no folder state left, no model loaded
    proc = subprocess.run([sys.executable, "eval.py", f"--model={tmp_path / 'policy'}",
                           f"--data={tiny_world}/test.jsonl", f"--index={tiny_world}"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert (f"index {tiny_world}: not an index folder, no meta.json or offsets.npy" in proc.stderr
            and f"model {tmp_path / 'policy'}: no such folder" in proc.stderr)


def test_a_start_that_fails_before_its_first_step_blocks_nothing(tiny_world, tmp_path,
                                                                  monkeypatch):
    """A bad index path (checked before the model loads) and a diverged first step (after
    config.json and the run.id are written): the corrected command then runs, not refused as a
    folder that holds a run."""
    out = str(tmp_path / "run")

    def no_model(*a, **k):
        raise AssertionError("a model was loaded before the paths were checked")
    with monkeypatch.context() as m:
        m.setattr(qa_eval, "load_policy", no_model)
        with pytest.raises(ValueError, match=f"index {tmp_path}/nope: no such folder"):
            tt.main(tiny_cfg(tiny_world, out, f"--index={tmp_path}/nope", "--steps=1"))
    assert os.listdir(out) == []
    with pytest.raises(FloatingPointError, match="diverged at step 0"):
        tt.main(tiny_cfg(tiny_world, out, "--steps=1", "--eval_every=0", "--lr=1e9"))
    assert os.listdir(out) == []
    tt.main(tiny_cfg(tiny_world, out, "--steps=1", "--eval_every=0", "--log_tensorboard=false"))
    assert [r["step"] for r in read_metrics(out)] == [0, 1]


def test_model_names_and_encoder_names_fail_at_once(tmp_path, monkeypatch):
    """Neither a known name, a folder nor org/name: refused before any hub call (the hub's retries
    took 55 s), even with HF_HUB_OFFLINE unset; an org/name id offline must be in the cache."""
    from retrieval import dense
    from retrieval import index as I
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    t = time.time()
    with pytest.raises(ValueError, match="encoder 'e6' is not known: give minilm, e5, bm25"):
        I.resolve_encoder("e6")
    with pytest.raises(ValueError, match="encoder 'e6' is not known"):
        dense.Encoder("e6", device="cpu")
    with pytest.raises(ValueError, match="model e6: no such folder .nor a hub id"):
        qa_eval.check_inputs(SimpleNamespace(model="e6"))
    assert time.time() - t < 5
    assert I.resolve_encoder("org/name") == "org/name" and I.resolve_encoder("/x/y") == "/x/y"
    qa_eval.check_inputs(SimpleNamespace(model="Qwen/Qwen2.5-3B"))  # a hub id: the hub decides
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="not in the Hugging Face cache"):
        qa_eval.check_inputs(SimpleNamespace(model="nobody-here/no-such-model"))
    (tmp_path / "step_000003" / "policy").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"without config.json: a checkpoint\? its policy/"):
        qa_eval.check_inputs(SimpleNamespace(model=str(tmp_path / "step_000003")))


# --- 7. Ctrl-C and SIGTERM: one line that says how to resume; nothing saved is lost ---

@pytest.mark.parametrize("sig,save_every,at", [(signal.SIGINT, 1, "step 2/"),
                                               (signal.SIGTERM, 0, "step 1/")])
def test_an_interrupted_run_says_how_to_resume_in_one_line(tiny_world, tmp_path, sig, save_every,
                                                           at):
    out, err = str(tmp_path / "run"), tmp_path / "stderr"
    argv = [f"--world={tiny_world}", f"--out_dir={out}", *TINY, "--steps=50", "--eval_every=0",
            f"--save_every={save_every}", "--log_tensorboard=false"]
    with open(err, "w") as stderr:
        # the Ctrl-C case starts with SIGINT ignored, as a shell's background job (and, once, a test worker) passes it
        # on through exec: train_twice handles it all the same (infra/console.run_cli)
        ignored = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sig == signal.SIGINT else None
        proc = subprocess.Popen([sys.executable, "train_twice.py", *argv], stdout=subprocess.PIPE,
                                stderr=stderr, text=True, cwd=ROOT, preexec_fn=ignored)
        try:
            for line in proc.stdout:
                if line.startswith(at):
                    break
            proc.send_signal(sig)
            proc.communicate(timeout=120)
        finally:
            proc.kill()
    text = err.read_text()
    assert proc.returncode == (130 if sig == signal.SIGINT else 143), text[-2000:]
    assert "Traceback" not in text
    last = text.strip().splitlines()[-1]
    steps = [r["step"] for r in read_metrics(out)]  # every line whole, one row per step
    assert steps == list(range(len(steps))) and len(steps) >= int(at[5])
    assert not [f for f in os.listdir(out) if f.endswith((".tmp", ".old"))]
    if save_every:
        prefix = "train_twice.py: interrupted; resume with: python train_twice.py "
        assert last.startswith(prefix), last
        cfg = tt.parse_config(shlex.split(last[len(prefix):]))
        newest = checkpoint.checkpoint_steps(out)[-1][1]
        assert cfg.resume == newest and checkpoint.read_state(newest)["step"] >= 2
        assert (cfg.out_dir, cfg.steps, cfg.save_every) == (out, 50, 1)
    else:
        assert last.startswith("train_twice.py: interrupted before the first checkpoint "
                               "(save_every=0), so there is nothing to resume from; start again "
                               "with: python train_twice.py ") and last.endswith(" --overwrite")


# --- 8. range errors only for the knobs the chosen method reads ---

def test_range_errors_only_for_the_chosen_methods_knobs():
    with pytest.raises(ValueError) as err:
        tt.parse_config(["--group_size=1"])
    assert "group_size=1 (must be >= 2)" in str(err.value) and "tree_m" not in str(err.value)
    assert tt.parse_config(["--vine_k=0", "--tree_m=9"]).vine_k == 0  # twice reads neither
    with pytest.raises(ValueError, match=r"vine_k=0 \(must be >= 1\)"):
        tt.parse_config(["--method=vineppo", "--vine_k=0"])
    with pytest.raises(ValueError, match=r"tree_m=3 \(must be <= group_size\)"):
        tt.parse_config(["--method=tree_grpo", "--group_size=2", "--tree_m=3"])
