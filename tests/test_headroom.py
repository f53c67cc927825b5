"""lab/headroom.py: the oracle labels read as flags, each world's plan reuses the runs other sets made and runs only
what they lack (the tiny world's GRPO-matched fixed from its own dev runs first), and the headroom table by hand."""
import json
import os

import numpy as np
import pytest

from lab import benchmark as bm
from lab import headroom, suite
from tests.test_benchmark import fake


def test_oracle_labels_read_as_flags():
    assert bm.flags("oracle-m16") == ["--method=oracle", "--oracle_rollouts=16", "--oracle_traj=false", "--twin_cap=2"]
    assert bm.flags("oracle-m32-traj") == ["--method=oracle", "--oracle_rollouts=32", "--oracle_traj=true",
                                           "--twin_cap=2"]
    for bad in ("oracle", "oracle-16", "oracle-m16-x", "oracle-mx", "oracle-m16-traj-traj"):
        with pytest.raises(ValueError, match="cannot read"):
            bm.flags(bad)
    for lab in (headroom.ORACLE, headroom.ORACLE_TRAJ, headroom.CREDIT, headroom.DATA):
        bm.flags(lab)


@pytest.fixture
def folders(tmp_path, monkeypatch):
    """Empty results folders for the headroom, the suite and chains' samples set."""
    for name, attr in ((headroom, "RESULTS"), (suite, "RESULTS"), (suite, "CHAINS_SAMPLES")):
        monkeypatch.setattr(name, attr, str(tmp_path / f"{name.__name__}-{attr}"))
    return tmp_path


def test_plans_run_only_what_no_other_set_ran(folders):
    # the tiny world: GRPO and the twin-data arm first, GRPO-matched once their dev runs fix it
    plan = headroom.plan("tiny", bm.DEV_SEEDS)
    assert plan[:6] == [(lab, s) for s in bm.DEV_SEEDS for lab in (headroom.GRPO, headroom.DATA)]
    assert not any(lab.startswith("grpo-g") for lab, _ in plan) and len(plan) == 5 * 3
    for s in bm.DEV_SEEDS:  # 10k and 17k tokens per update: G = round(5 x 1.7) = 8 (9 rounds 8.5 to even)
        fake(headroom.results_dir("tiny"), headroom.GRPO, s, [0.2, 0.3, 0.4], 10000)
        fake(headroom.results_dir("tiny"), headroom.DATA, s, [0.2, 0.3, 0.4], 17000)
    assert headroom.matched("tiny", need=False) == "grpo-g8"
    todo = [(lab, s) for lab, s in headroom.plan("tiny", bm.DEV_SEEDS) if not headroom.find("tiny", lab, s)]
    assert sorted({lab for lab, _ in todo}) == sorted(["grpo-g8", headroom.ORACLE, headroom.ORACLE_TRAJ,
                                                       headroom.CREDIT])
    # a suite world: its baselines are the suite's, found there; only the oracle arms (and what a seed lacks) run here
    os.makedirs(suite.results_dir("luck-high"))
    json.dump({"grpo_matched": "grpo-g9"}, open(os.path.join(suite.results_dir("luck-high"), "chosen.json"), "w"))
    for lab in (headroom.GRPO, "grpo-g9", headroom.CREDIT, headroom.DATA):
        for s in bm.DEV_SEEDS:
            fake(suite.results_dir("luck-high"), lab, s, [0.2, 0.3, 0.4])
    assert headroom.plan("luck-high", bm.DEV_SEEDS) == [(lab, s) for s in bm.DEV_SEEDS
                                                        for lab in (headroom.ORACLE, headroom.ORACLE_TRAJ)]
    held = headroom.plan("luck-high", (10,))
    assert sorted(lab for lab, _ in held) == sorted(headroom.labels("luck-high"))  # no held-out run anywhere yet


def fake_oracle(results, label, seed, ems, factual=10000, oracle=500000, se=0.07, a=0.1):
    fake(results, label, seed, ems, factual)
    path = os.path.join(bm.run_dir(label, seed, results), "metrics.jsonl")
    rows = [json.loads(line) for line in open(path)]
    for r in rows[:-1]:
        r.update(factual_tokens=factual, oracle_tokens=oracle, oracle_se=se, oracle_abs=a,
                 oracle_token_ratio=oracle / factual)
    open(path, "w").write("".join(json.dumps(r) + "\n" for r in rows))


def test_the_headroom_table_by_hand(folders):
    r = suite.results_dir("luck-mid")
    os.makedirs(r)
    json.dump({"grpo_matched": "grpo-g9"}, open(os.path.join(r, "chosen.json"), "w"))
    # EM before updates 0, 1, 2 and at the end (3 updates); GRPO-matched makes 2 updates in the same tokens
    grpo, bar = [0.20, 0.30, 0.40, 0.50], {0: [0.2, 0.4, 0.5], 1: [0.2, 0.4, 0.6], 2: [0.2, 0.4, 0.7]}
    oracle = {0: [0.2, 0.5, 0.7, 0.8], 1: [0.2, 0.5, 0.8, 0.8], 2: [0.2, 0.5, 0.9, 0.8]}
    credit = {0: [0.2, 0.4, 0.55, 0.6], 1: [0.2, 0.4, 0.65, 0.6], 2: [0.2, 0.4, 0.75, 0.6]}
    for s in bm.DEV_SEEDS:
        fake(r, headroom.GRPO, s, grpo)
        fake(r, "grpo-g9", s, bar[s], 15000)
        fake(r, headroom.CREDIT, s, credit[s], 13000)
        fake_oracle(headroom.results_dir("luck-mid"), headroom.ORACLE, s, oracle[s])
    for s in bm.DEV_SEEDS:
        for lab in (headroom.ORACLE, "grpo-g9"):  # meta.json's wall time, as run_one writes it
            json.dump({"wall_s": 60.0 * (s + 1)}, open(os.path.join(bm.run_dir(
                lab, s, headroom.find("luck-mid", lab, s)), "meta.json"), "w"))
    lines, points = headroom.world_table("luck-mid", bm.DEV_SEEDS)
    text = "\n".join(lines)
    # after 2 updates (GRPO-matched's last): oracle 0.7 / 0.8 / 0.9 against 0.5 / 0.6 / 0.7: headroom +0.2, SE 0
    assert points["headroom"] == pytest.approx((0.2, 0.0))
    # TWICE credit only after 2 updates: 0.55 / 0.65 / 0.75 against the same: +0.05, share 0.25
    assert points["twice-turn-b0.7-w1-cap2"] == pytest.approx((0.05, 0.0))
    row = next(line for line in text.splitlines() if line.startswith("| twice-turn-b0.7-w1-cap2 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3] == "+0.050 +- 0.000" and cells[5] == "0.25" and cells[7] == "1.30"
    # the mean over updates 0-2: GRPO-matched 0.2, 0.4, 0.5 + s/10; TWICE 0.2, 0.4, 0.55 + s/10: trapezoid 0.05/4
    assert cells[6] == f"+{0.05 / 4:.3f} +- 0.000"
    # against GRPO after 3 updates: TWICE credit only 0.60 - 0.50
    assert cells[4] == "+0.100 +- 0.000"
    orow = [c.strip() for c in next(line for line in text.splitlines()
                                    if line.startswith(f"| {headroom.ORACLE} |")).strip("|").split("|")]
    assert orow[5] == "1.00" and orow[7] == f"{(10000 + 500000) / 10000:.2f}" and orow[8] == "2.0"
    assert "mean SE 0.070" in text and "credit headroom (oracle - GRPO, the same rows) +0.300" in text
    # the report writes the tables and the figure from the runs alone
    out = headroom.build_report("dev")
    assert os.path.isfile(os.path.join(headroom.RESULTS, "tables.md")) and "### luck-mid" in out
    assert "Not all of GRPO, GRPO-matched and the oracle" in out  # the other worlds have no runs here


def test_no_share_without_a_headroom_above_its_se(folders):
    r = suite.results_dir("luck-mid")
    os.makedirs(r)
    json.dump({"grpo_matched": "grpo-g9"}, open(os.path.join(r, "chosen.json"), "w"))
    for s, d in zip(bm.DEV_SEEDS, (0.1, -0.1, 0.05)):
        fake(r, headroom.GRPO, s, [0.2, 0.3, 0.4])
        fake(r, "grpo-g9", s, [0.2, 0.3, 0.4])
        fake_oracle(headroom.results_dir("luck-mid"), headroom.ORACLE, s, [0.2, 0.3, 0.4 + d])
    lines, points = headroom.world_table("luck-mid", bm.DEV_SEEDS)
    assert np.isclose(points["headroom"][0], 0.05 / 3) and "no share is computed" in "\n".join(lines)
