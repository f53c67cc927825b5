"""The figures README.md quotes are those of committed results files, each rebuilt by a command: the demo's
(results/demo: `make demo`'s metrics.jsonl and config.json), the benchmark's (results/chains/tables.md: `make
benchmark-report` from the committed runs), the chains audit's (results/chains-audit: `lab.audit`, RESULTS.md), the
paper's (lab/report.PAPER_AVG_EM). A figure edited in one place and not the other fails here."""
import json
import os
import re

from infra import console
from lab import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "results", "demo")


def read(*path) -> str:
    return open(os.path.join(ROOT, *path), encoding="utf-8").read()


def glance() -> str:
    """README's "Results at a glance" and the paragraph under the two commands, lines joined."""
    text = read("README.md")
    top = text[:text.index("## Algorithm")]
    bullets = text[text.index("## Results at a glance"):text.index("## Usage")]
    return re.sub(r"\s+", " ", top + bullets)


def demo_rows() -> list:
    return [json.loads(line) for line in open(os.path.join(DEMO, "metrics.jsonl"))]


def test_the_demo_figures_are_the_committed_runs():
    rows = demo_rows()
    first, final = rows[0], rows[-1]
    cfg = json.load(open(os.path.join(DEMO, "config.json")))
    assert first["step"] == 0 and final.get("final") and final["step"] == cfg["steps"]
    em = f"{first['eval_em']:.3f} -> {final['eval_em']:.3f}"
    hop2 = f"{first['eval_em/tiny_2hop']:.3f} -> {final['eval_em/tiny_2hop']:.3f}"
    text = glance()
    assert f"before and after ({em})" in text
    assert f"greedy EM {em} in {cfg['steps']} steps (2-hop {hop2})" in text


def test_results_md_demo_section_is_the_committed_run():
    """The summary table and twin statistics as `make demo` prints them, and the EM at every evaluation."""
    section = read("RESULTS.md").split("\n## Demo\n")[1].split("\n## ")[0]
    assert console.run_summary(DEMO) in section
    curve = ", ".join(f"{r['step']}: {r['eval_em']:.3f}" for r in demo_rows()
                      if "eval_em" in r and not r.get("final"))
    assert f"EM over the run (step: EM): {curve}." in re.sub(r"\s+", " ", section)


def paired_cell(section: str, method: str) -> str:
    """results/chains/tables.md: a method's "AUC - grpo's (paired)" in a section's paired table."""
    tables = read("results", "chains", "tables.md")
    body = tables.split(f"\n## {section}\n")[1].split("\n## ")[0]
    paired = body[body.index("| AUC - grpo's (paired) |"):]
    row = next(line for line in paired.splitlines() if line.startswith(f"| {method} |"))
    return row.split(" | ")[4]


def test_the_benchmark_figures_are_the_committed_tables():
    held, long = "Every method, held-out seeds 10-15, 120k tokens", "Three methods, held-out seeds 10-12, 360k tokens"
    quoted = {"TWICE token": (held, "twice-token-b0.1-w0.25"), "Tree-GRPO": (held, "tree_grpo"),
              "ARPO": (held, "arpo"), "at 360k TWICE": (long, "twice-token-b0.1-w0.25")}
    text = glance()
    for name, (section, method) in quoted.items():
        found = re.search(rf"{name} ([+-]\d\.\d{{3}} \+- \d\.\d{{3}})", text)
        assert found and found[1] == paired_cell(section, method), (name, found and found[1])


def test_the_papers_averages_are_the_reports():
    text = re.sub(r"\s+", " ", read("README.md"))
    paper = report.PAPER_AVG_EM
    assert (f"The paper's average EM is {paper['3b']['TWICE']} (3B) and {paper['7b']['TWICE']} (7B) for TWICE, "
            f"GRPO {paper['3b']['TWICE'] - paper['3b']['GRPO']:.1f} and "
            f"{paper['7b']['TWICE'] - paper['7b']['GRPO']:.1f} points lower") in text


def test_the_chains_audit_figures_are_the_committed_audit():
    res = json.load(open(os.path.join(ROOT, "results", "chains-audit", "audit.json")))
    corr = {name: f"{m['corr']:.3f}" for name, m in res["metrics"].items()}
    diff, se = res["corr_differences"]["TWICE - independent"]
    assert (f"a coupled twin correlates with A* at {corr['TWICE']} (GRPO {corr['GRPO']}; independent "
            f"{corr['independent']}, {diff:+.3f} +- {se:.3f}), a token fork at {corr['TWICE token']}") in glance()


def test_the_credit_suite_figures_are_the_committed_audits_and_summary():
    """The share of variance coupling removes is 1 - the audits' measured ratio; the luck-high cells are summary.md's
    (python -m lab.suite report --seeds all), from its last tables: the held-out seeds'."""
    removed = {}
    for w in ("chains", "luck-mid", "luck-high", "delay-high"):
        res = json.load(open(os.path.join(ROOT, "results", "suite", w, "audit", "audit.json")))
        removed[w] = f"{1 - res['coupling']['measured_ratio']:.2f}"
    suite = sorted(removed[w] for w in ("luck-mid", "luck-high", "delay-high"))
    text = glance()
    assert f"coupling removes {suite[0]}-{suite[-1]} of the independent twin's variance (chains {removed['chains']})" \
        in text
    summary = read("results", "suite", "summary.md")
    assert "Gain over GRPO, seeds 10, 11, 12, 13, 14, 15" in summary
    coupling = [line for line in summary.splitlines() if line.startswith("| coupling |")][-1].split(" | ")
    credit = [line for line in summary.splitlines() if line.startswith("| twice-turn-b0.7-w1-cap2 |")][-1].split(" | ")
    # columns: chains, luck-mid, luck-high, delay-high, each per token then per update
    assert f"coupled twins gain {coupling[6]} EM per update" in text
    assert f"TWICE trails GRPO by {credit[5].split(' (')[0]} AUC" in text
