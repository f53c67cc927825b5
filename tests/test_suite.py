"""lab/suite.py: the credit suite's runs (the fixed labels, GRPO-matched fixed from the dev runs and frozen, the passes
of a world's set), the gains over GRPO by hand, and the summary and figure from audits and runs alone."""
import json
import os
import sys
from types import SimpleNamespace

import pytest

from lab import audit_methods
from lab import benchmark as bm
from lab import suite
from tests.test_benchmark import fake

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_labels_are_the_chains_benchmarks_knobs_and_read_as_flags():
    ch = {"grpo_matched": "grpo-g9"}
    labs = suite.labels(ch)
    assert labs == ["grpo", "grpo-g9", "twice-turn-b0.7-w1-cap2", "independent-b0.7-w1-cap2",
                    "twice-turn-b0.7-w1-cap2-data-late1", "twice-turn-b0.7-w0-cap2-data-late1", "tree_grpo", "arpo",
                    "vineppo-k1", "gigpo"]
    for lab in labs:
        bm.flags(lab)  # every label is one the benchmark can run
    # the independent counterfactual at TWICE's knobs and bounded term: only the coupling differs
    twice, indep = bm.flags(suite.CREDIT), bm.flags(suite.INDEPENDENT)
    assert indep == ["--method=independent"] + [f for f in twice if f.startswith(("--twin_b", "--omega", "--twin_s",
                                                                                     "--twin_c"))]
    assert suite.seeds_of("all") == (0, 1, 2, 10, 11, 12, 13, 14, 15)
    with pytest.raises(SystemExit, match="dev or all"):
        suite.seeds_of("heldout")


def test_a_suite_world_is_trained_with_the_chains_preset(tmp_path):
    for preset, cfg in (("luck-high", "chains.cfg"), ("chains", "chains.cfg"), ("tiny", "demo.cfg")):
        (tmp_path / "world.json").write_text(json.dumps({"stats": {"preset": preset}}))
        assert audit_methods.world_preset(str(tmp_path)).endswith(os.path.join("configs", cfg))


def test_grpo_matched_waits_for_its_dev_runs_then_is_frozen(tmp_path):
    r = str(tmp_path)
    plan = suite.plan(r, suite.seeds_of("dev"))
    assert plan[:6] == [(lab, s) for s in (0, 1, 2) for lab in (suite.GRPO, suite.DATA)]
    assert not any(lab.startswith("grpo-g") for lab, _ in plan) and len(plan) == 9 * 3
    for s in bm.DEV_SEEDS:  # GRPO 10k tokens per update, the twin-data arm 16k: G = round(5 x 1.6) = 8
        fake(r, suite.GRPO, s, [0.2, 0.3, 0.4], 10000)
        fake(r, suite.DATA, s, [0.2, 0.3, 0.4], 16000)
    ch = suite.chosen(r)
    assert ch["grpo_matched"] == "grpo-g8" and ch["tokens_per_update_ratio"] == 1.6
    fake(r, suite.DATA, 0, [0.2, 0.3, 0.4], 30000)
    assert suite.chosen(r) == ch  # written once
    plan = suite.plan(r, suite.seeds_of("all"))
    assert len(plan) == 10 * 9 and ("grpo-g8", 15) in plan
    # chains: only the labels its samples set did not run
    assert suite.plan(suite.results_dir("chains"), (0,)) == [(lab, 0) for lab in suite.CHAINS_EXTRA]


def test_a_worlds_set_runs_in_two_passes_after_the_world_check(tmp_path, monkeypatch):
    """run: the world check first (a failing one stops it); GRPO and the twin-data arm on the dev seeds, then the rest
    with GRPO-matched."""
    monkeypatch.setattr(suite, "RESULTS", str(tmp_path))
    calls = []
    monkeypatch.setattr(bm.subprocess, "run", lambda argv, **kw: calls.append(argv) or SimpleNamespace(returncode=1))
    assert suite.run("luck-high", bm.DEV_SEEDS, 1, str(tmp_path / "s")) == 1
    assert calls == [[sys.executable, "-m", "worlds.build", "--verify", suite.world_dir("luck-high")]]
    monkeypatch.setattr(bm.subprocess, "run", lambda argv, **kw: SimpleNamespace(returncode=0))
    done = []

    def run_one(label, seed, world, scratch, results):
        assert world == suite.world_dir("luck-high") and scratch == os.path.join(str(tmp_path / "s"), "luck-high")
        done.append((label, seed))
        fake(results, label, seed, [0.2, 0.4, 0.5], 16000 if "data" in label else 10000)
        return f"done {label} seed {seed}"
    monkeypatch.setattr(bm, "run_one", run_one)
    assert suite.run("luck-high", bm.DEV_SEEDS, 2, str(tmp_path / "s")) == 0
    assert set(done[:6]) == {(lab, s) for s in bm.DEV_SEEDS for lab in (suite.GRPO, suite.DATA)}
    assert len(done) == 30 and ("grpo-g8", 2) in done[6:]
    assert suite.run("luck-high", bm.DEV_SEEDS, 2, str(tmp_path / "s")) == 0 and len(done) == 30  # nothing left


def test_gains_by_hand():
    """Per token: AUC - GRPO's at the shared budget; per update: EM - GRPO's after the updates both made."""
    def run(seed, ems, per):  # EM ems[k] measured before update k (per tokens each), ems[-1] at the end
        rows = [{"step": k, "eval_em": em, "tokens": per * (k + 1)} for k, em in enumerate(ems[:-1])]
        return ({"seed": seed, "token_budget": 100},
                rows + [{"step": len(ems) - 1, "eval_em": ems[-1], "tokens": per * (len(ems) - 1), "final": True}])
    grpo = [run(0, [0.2, 0.4, 0.6], 50), run(1, [0.2, 0.4, 0.6], 50)]  # 50 tokens per update
    other = [run(0, [0.2, 0.5], 100), run(1, [0.2, 0.7], 100)]  # 100 tokens per update
    g = suite.gains({"grpo": grpo, "m": other})
    # AUC: GRPO 0.2 x 0.5 + 0.4 x 0.5 = 0.3 (its last evaluation lands at the budget); m 0.2 over [0, 100] = 0.2
    assert g["m"][0] == pytest.approx(-0.1) and g["m"][1] == pytest.approx(0.0)
    # after 1 update: m 0.5 / 0.7 against GRPO's 0.4: +0.1, +0.3
    assert g["m"][2] == pytest.approx(0.2) and g["m"][3] == pytest.approx(0.1) and g["m"][4] == 2
    assert "grpo" not in g and suite.gains({"m": other}) == {}


def test_the_summary_and_figure_from_audits_and_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(suite, "RESULTS", str(tmp_path))
    monkeypatch.setattr(suite, "FIGURE", str(tmp_path / "fig.png"))
    audits = {}
    for k, w in enumerate(["chains", "luck-high"]):
        d = tmp_path / "audit" / w
        d.mkdir(parents=True)
        m = {n: {"wrong_sign": 0.05 * k, "corr": 0.5 + 0.1 * k, "corr_se": 0.05} for n in ("TWICE", "independent",
                                                                                            "GRPO")}
        (d / "audit.json").write_text(json.dumps({
            "coupling": {"rho": 0.3 + 0.3 * k, "measured_ratio": 0.8 - 0.4 * k}, "metrics": m,
            "oracle": {"decisions": 100, "above_threshold": 20}}))
        audits[w] = str(d)
    monkeypatch.setattr(suite, "AUDITS", {**suite.AUDITS, **audits, "luck-mid": str(tmp_path / "none")})
    r = suite.results_dir("luck-high")
    for s in bm.DEV_SEEDS:
        fake(r, suite.GRPO, s, [0.2, 0.3, 0.4], 10000)
        fake(r, suite.DATA, s, [0.2, 0.4, 0.6], 16000)
    text = suite.build_report("dev")
    assert "| luck-high | 0.5 | last | 100 (20) | 0.600 | 0.400 | 5.0% / 0.600 +- 0.050 |" in text
    assert "| luck-mid | 0.3 | last | (no audit yet) |" in text
    row = next(line for line in text.splitlines() if line.startswith(f"| {suite.DATA} |"))
    # luck-high (the 3rd world): AUC 0.52 against 0.375 over 120k tokens; EM 0.6 against 0.4 after 2 updates
    assert row.split(" | ")[5:7] == ["+0.145 +- 0.000 (3)", "+0.200 +- 0.000"]
    assert os.path.isfile(tmp_path / "fig.png") and os.path.isfile(tmp_path / "summary.md")
    assert os.path.isfile(os.path.join(r, "tables.md"))
    assert "seeds 10, 11" not in text
    # held-out seeds: reported apart from the development seeds, never pooled with them (EM 0.2 flat: AUC 0.2)
    for s in bm.HELDOUT_SEEDS[:2]:
        fake(r, suite.GRPO, s, [0.2, 0.3, 0.4], 10000)
        fake(r, suite.DATA, s, [0.2, 0.2, 0.2], 16000)
    text = suite.build_report("all")
    dev, held = text.split("Gain over GRPO, seeds 10, 11, 12, 13, 14, 15")
    row = next(line for line in dev.splitlines() if line.startswith(f"| {suite.DATA} |"))
    assert row.split(" | ")[5:7] == ["+0.145 +- 0.000 (3)", "+0.200 +- 0.000"]
    row = next(line for line in held.splitlines() if line.startswith(f"| {suite.DATA} |"))
    assert row.split(" | ")[5:7] == ["-0.175 +- 0.000 (2)", "-0.200 +- 0.000"]


def test_the_committed_summary_and_tables_are_rebuilt_from_the_committed_runs_and_audits(tmp_path, monkeypatch):
    """results/suite/summary.md and every world's tables.md are `python -m lab.suite report` of the committed runs,
    choices and audits alone."""
    import shutil
    src = os.path.join(ROOT, "results", "suite")
    shutil.copytree(src, tmp_path / "suite", ignore=shutil.ignore_patterns("*.png"))
    monkeypatch.setattr(suite, "RESULTS", str(tmp_path / "suite"))
    monkeypatch.setattr(suite, "AUDITS", {w: str(tmp_path / "suite" / w / "audit") for w in suite.AUDITS})
    monkeypatch.setattr(suite, "FIGURE", str(tmp_path / "fig.png"))
    summary = open(os.path.join(src, "summary.md")).read()
    seeds = "all" if "--seeds all" in summary else "dev"
    assert suite.build_report(seeds) == summary
    for w in os.listdir(src):
        if os.path.isfile(os.path.join(src, w, "tables.md")):
            assert open(tmp_path / "suite" / w / "tables.md").read() == open(os.path.join(src, w, "tables.md")).read()
