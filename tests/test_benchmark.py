"""lab/benchmark.py: run labels, the order of the sets and the frozen choice of knobs, the tables from committed outputs
alone, and one real run through train_twice.py whose outputs land where the tables read them."""
import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

from lab import benchmark as bm
from lab import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = ["--prompts_per_step=2", "--group_size=2", "--max_new_tokens=24", "--max_obs_tokens=200", "--max_turns=2",
        "--max_context=768", "--micro_batch_size=4", "--eval_size=4", "--gen_batch_size=16", "--token_budget=200",
        "--eval_tokens=100"]


def fake(results, label, seed, ems, tokens_per_step=10000, budget=120000):
    """A finished run whose greedy EM is ems[k] before update k and ems[-1] at the end."""
    d = bm.run_dir(label, seed, str(results))
    os.makedirs(d, exist_ok=True)
    json.dump({"seed": seed, "token_budget": budget, "method": label.split("-")[0]}, open(f"{d}/config.json", "w"))
    rows = [{"step": k, "eval_em": em, "tokens": tokens_per_step * (k + 1)} for k, em in enumerate(ems[:-1])]
    rows.append({"step": len(ems) - 1, "tokens": tokens_per_step * (len(ems) - 1), "eval_em": ems[-1], "final": True})
    open(f"{d}/metrics.jsonl", "w").write("".join(json.dumps(r) + "\n" for r in rows))


def test_labels_read_as_train_flags():
    assert bm.flags("grpo") == ["--method=grpo"]
    assert bm.flags("grpo-g8") == ["--method=grpo", "--group_size=8"]
    as_run = ["--twin_scale=d", "--twin_cap=0"]  # the committed runs' estimator, whatever the defaults now
    assert bm.flags(bm.twice("token", 0.25, 1.0)) == ["--method=twice", "--twin_unit=token", "--twin_budget=0.25",
                                                      "--omega=1.0"] + as_run
    assert bm.flags("independent-b0.7-w2") == ["--method=independent", "--twin_budget=0.7", "--omega=2.0"] + as_run
    assert bm.flags("vineppo-k3-360k") == ["--token_budget=360000", "--eval_tokens=90000", "--method=vineppo",
                                           "--vine_k=3"]
    assert bm.flags("tree_grpo") == ["--method=tree_grpo"]
    assert bm.flags("twice-turn-b0.7-w1-cap2") == ["--method=twice", "--twin_unit=turn", "--twin_budget=0.7",
                                                   "--omega=1.0", "--twin_scale=rms", "--twin_cap=2.0"]
    assert bm.flags("twice-turn-b0.25-w0-cap2-data-late1") == [
        "--method=twice", "--twin_unit=turn", "--twin_budget=0.25", "--omega=0.0", "--twin_scale=rms", "--twin_cap=2.0",
        "--twin_data=true", "--twin_from_turn=1"]
    for bad in ("twice-turn-b0.2", "twice-word-b0.2-w1", "vineppo-kx", "sac", "grpo-8", "twice-turn-b0.7-w1-x2",
                "twice-turn-b0.7-w1-latex"):
        with pytest.raises(ValueError, match=f"cannot read the run label '{bad}'"):
            bm.flags(bad)


def test_sets_wait_for_their_inputs_and_the_choice_is_frozen(tmp_path):
    r = str(tmp_path)
    with pytest.raises(SystemExit, match="runs are not done yet"):
        bm.plan("sweep-omega", r)
    # turn: budget 0.25 best; token: budget 0.5; vineppo K = 3 (the EM reached after a few steps sets the AUC)
    score = {bm.twice("turn", 0.25, 1.0): 0.6, bm.twice("token", 0.5, 1.0): 0.55, "vineppo-k3": 0.4}
    for s in bm.DEV_SEEDS:
        for lab in bm.sweep_labels():
            fake(r, lab, s, [0.3, score.get(lab, 0.35) + 0.01 * s, score.get(lab, 0.35)])
    assert [lab for lab, s in bm.plan("sweep-omega", r) if s == 0] == [
        *[bm.twice("turn", 0.25, w) for w in bm.OMEGAS], *[bm.twice("token", 0.5, w) for w in bm.OMEGAS]]
    with pytest.raises(SystemExit, match="runs are not done yet"):
        bm.plan("dev", r)
    for lab, s in bm.plan("sweep-omega", r):
        em = 0.7 if lab == bm.twice("token", 0.5, 2.0) else 0.2
        fake(r, lab, s, [0.3, em, em])
    ch = bm.chosen(r)
    assert (ch["twice-turn"], ch["twice-token"], ch["independent"], ch["vineppo"]) == (
        "twice-turn-b0.25-w1", "twice-token-b0.5-w2", "independent-b0.25-w1", "vineppo-k3")
    with pytest.raises(SystemExit, match="runs are not done yet"):
        bm.plan("heldout", r)  # the dev set first
    for lab, s in bm.plan("dev", r):
        if not bm.finished(bm.run_dir(lab, s, r)):
            fake(r, lab, s, [0.3, 0.5 if lab == "arpo" else 0.4, 0.45])
    assert len(bm.plan("heldout", r)) == 15 * 6 and bm.plan("heldout", r)[0] == ("grpo", 10)
    # a sweep run that changes afterwards does not move the frozen choice
    fake(r, bm.twice("turn", 0.7, 1.0), 0, [0.3, 0.99, 0.99])
    assert bm.chosen(r)["twice-turn"] == "twice-turn-b0.25-w1"
    assert {lab for lab, _ in bm.plan("long", r)} == {"grpo-360k", "twice-token-b0.5-w2-360k", "arpo-360k"}
    text = bm.build_report(r)
    assert text == open(os.path.join(r, "tables.md")).read()
    assert "| twice-turn-b0.25-w1 | 3 |" in text and "| arpo | 3 |" in text and "twice-token-b0.5-w2" in text
    assert os.path.isfile(os.path.join(r, "sweep_seeds0-1-2.png"))
    assert "0 of 45 runs done" in text  # the long set: none yet


def test_breakeven_by_hand():
    # GRPO: 10k tokens per update, EM 0.2 -> 0.4 over 4 updates; the other: 20k per update, 0.2 -> 0.45 over 2
    grpo = [{"step": k, "eval_em": 0.2 + 0.05 * k, "tokens": 10000 * (k + 1)} for k in range(4)]
    grpo.append({"step": 4, "eval_em": 0.4, "tokens": 40000, "final": True})
    other = [{"step": 0, "eval_em": 0.2, "tokens": 20000}, {"step": 2, "eval_em": 0.45, "tokens": 40000,
                                                       "final": True}]
    runs = {"grpo": [({"seed": 0}, grpo)], "other": [({"seed": 0}, other)]}
    table = bm.breakeven(runs)
    # c = 20000 / 10000 = 2; r = 0.25 / (GRPO's 0.1 after 2 updates) = 2.5: more than pays for itself
    assert "| other | 1 | 2.0 | 2.00 | 2.50 | +0.50 |" in table and "| grpo | 1 | 4.0 | 1.00 | 1.00 | +0.00 |" in table


def test_one_real_run_lands_in_the_results(tiny_world, tmp_path):
    line = bm.run_one(bm.twice("token", 0.5, 1.0), 3, tiny_world, str(tmp_path / "scratch"), str(tmp_path), TINY)
    assert line.startswith("done twice-token-b0.5-w1 seed 3"), line
    d = bm.run_dir("twice-token-b0.5-w1", 3, str(tmp_path))
    assert sorted(os.listdir(d)) == ["config.json", "meta.json", "metrics.jsonl"]
    cfg, rows = report.load_run(d)
    meta = json.load(open(os.path.join(d, "meta.json")))
    assert (cfg["twin_unit"], cfg["twin_budget"], cfg["seed"], meta["seed"]) == ("token", 0.5, 3, 3)
    assert rows[-1]["final"] and rows[-1]["tokens"] >= 200 and meta["world"]["world.json"] != "missing"
    assert "--twin_unit=token" in meta["argv"] and meta["wall_s"] > 0
    bad = bm.run_one("grpo", 0, str(tmp_path / "no-world"), str(tmp_path / "scratch"), str(tmp_path), TINY)
    assert bad.startswith("FAILED grpo seed 0") and not os.path.exists(bm.run_dir("grpo", 0, str(tmp_path)))


def test_the_committed_tables_are_rebuilt_from_the_committed_runs(tmp_path):
    """results/chains/tables.md is what `python -m lab.benchmark report` makes of results/chains/runs and chosen.json
    (a run added without rebuilding the tables, or a table edited by hand, fails here)."""
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results", "chains")
    assert len(os.listdir(os.path.join(src, "runs"))) >= 100, "the benchmark's run outputs are not committed"
    shutil.copytree(src, tmp_path / "chains", ignore=shutil.ignore_patterns("*.png"))
    (tmp_path / "chains" / "heldout_seeds10.png").write_bytes(b"a figure of fewer seeds")  # replaced, not kept
    rebuilt = bm.build_report(str(tmp_path / "chains"))
    assert rebuilt == open(os.path.join(src, "tables.md")).read()
    assert sorted(p.name for p in (tmp_path / "chains").glob("*.png")) == sorted(
        p for p in os.listdir(src) if p.endswith(".png"))


def test_the_bounded_set_runs_on_its_own_results_and_verifies_the_world_first(tmp_path, monkeypatch):
    """plan: every BOUNDED label on the dev seeds; run: the world check (`python -m worlds.build --verify`) runs before
    any run, and a failing check stops the set; report bounded: that section alone."""
    want = [(lab, s) for s in bm.DEV_SEEDS + bm.HELDOUT_SEEDS for lab in bm.BOUNDED]
    assert bm.plan("bounded", str(tmp_path)) == want
    calls = []
    monkeypatch.setattr(bm.subprocess, "run", lambda argv, **kw: calls.append(argv) or SimpleNamespace(returncode=3))
    assert bm.run_set("bounded", 1, "w", str(tmp_path / "s"), str(tmp_path)) == 1
    assert calls == [[sys.executable, "-m", "worlds.build", "--verify", "w"]]
    with pytest.raises(SystemExit, match="a world of its own"):
        bm.run_set("bounded", 1, "w", str(tmp_path / "s"))  # never into the committed benchmark's folder
    monkeypatch.undo()
    proc = subprocess.run([sys.executable, "-m", "worlds.build", "--help"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0 and "--verify" in proc.stdout
    text = bm.build_report(str(tmp_path), "bounded")
    assert text.count("\n## ") == 2 and "Bounded twin term" in text and "No finished runs yet" in text


def test_the_bounded_sets_tables_are_rebuilt_from_its_runs(tmp_path):
    """results/chains-bounded/tables.md is `python -m lab.benchmark report bounded` of its committed runs."""
    src = os.path.join(ROOT, "results", "chains-bounded")
    assert len(os.listdir(os.path.join(src, "runs"))) == len(bm.plan("bounded", src))
    shutil.copytree(src, tmp_path / "b", ignore=shutil.ignore_patterns("*.png"))
    assert bm.build_report(str(tmp_path / "b"), "bounded") == open(os.path.join(src, "tables.md")).read()


def test_the_samples_sets_tables_are_rebuilt_from_its_runs(tmp_path):
    """results/chains-samples/tables.md is `python -m lab.benchmark report samples` of its committed runs and choice."""
    src = os.path.join(ROOT, "results", "chains-samples")
    done = set(bm.plan("samples-sweep", src)) | set(bm.plan("samples", src))
    assert len(os.listdir(os.path.join(src, "runs"))) == len(done) == 69
    shutil.copytree(src, tmp_path / "s", ignore=shutil.ignore_patterns("*.png"))
    assert bm.build_report(str(tmp_path / "s"), "samples") == open(os.path.join(src, "tables.md")).read()


def test_the_samples_set_freezes_its_arm_and_grpo_matched_on_the_dev_seeds(tmp_path, monkeypatch):
    """samples-sweep on the dev seeds; samples waits for it, then chooses the twin-data arm by dev AUC and GRPO-matched
    by that arm's tokens per update (written once); its plan runs GRPO, GRPO-matched, the arm and the arm at omega 0
    on every seed before the rest; the report gives the per-update table against GRPO-matched and the census."""
    r = str(tmp_path)
    assert bm.plan("samples-sweep", r) == [(lab, s) for s in bm.DEV_SEEDS for lab in bm.SAMPLES_SWEEP]
    with pytest.raises(SystemExit, match="runs are not done yet"):
        bm.plan("samples", r)
    best = "twice-turn-b0.7-w1-cap2-data-late1"
    for s in bm.DEV_SEEDS:
        for lab in bm.SAMPLES_SWEEP:  # GRPO 10k tokens per update; the twin-data arms 16k
            fake(r, lab, s, [0.2, 0.5 if lab == best else 0.3, 0.6], 10000 if lab == "grpo" else 16000)
    ch = bm.samples_chosen(r)
    assert (ch["twice_data"], ch["grpo_matched"]) == (best, "grpo-g8") and ch["tokens_per_update_ratio"] == 1.6
    plan = bm.plan("samples", r)
    first = ["grpo", "grpo-g8", best, best.replace("-w1-", "-w0-")]
    assert [lab for lab, _ in plan[:4 * 9]] == first * 9 and [s for _, s in plan[:4]] == [0] * 4
    assert {lab for lab, _ in plan[4 * 9:]} == {"tree_grpo", "arpo", "twice-turn-b0.7-w1-cap2"} and len(plan) == 63
    fake(r, "twice-turn-b0.25-w1-cap2-data", 0, [0.2, 0.9, 0.9])
    assert bm.samples_chosen(r) == ch  # frozen
    with pytest.raises(SystemExit, match="a world of its own"):
        bm.run_set("samples", 1, "w", str(tmp_path / "s"))
    for lab, s in plan:
        if not bm.finished(bm.run_dir(lab, s, r)):
            fake(r, lab, s, [0.2, 0.4, 0.5], 16000 if "data" in lab or lab == "grpo-g8" else 10000)
    text = bm.build_report(r, "samples")
    assert "Per update against GRPO-matched (grpo-g8" in text and text.count("\n## ") == 3
    assert f"The pair credit: {best} against the same rows without it ({first[3]})" in text
    # the arm at 16k per update reached 0.6 after 2 updates; GRPO-matched's 0.5 after 2: +0.1 on seeds 0-2
    assert f"| {best} | 3 | 2.0 | 1.00 | +0.100 +- 0.000 |" in text
    def curve(n, em):  # EM 0.2 before any update, em after n updates, 8 tokens in all
        return [({"seed": 0}, [{"step": 0, "eval_em": 0.2, "tokens": 1}, {"step": n, "eval_em": em, "tokens": 8}])]
    runs = {"base": curve(4, 0.6), "long": curve(8, 0.4)}
    assert "| long | 1 | 4.0 | 0.50 | -0.300 +- nan |" in bm.at_updates(runs, "base")  # 0.3 against 0.6 after 4
