"""The credit suite's benchmark (DESIGN.md section 9, "The credit suite"; RESULTS.md "Credit suite"): the methods of
the chains benchmark on each world of the suite, at equal generated tokens, and the gain over GRPO against the
coupling the audit measured on each world.

    python -m lab.suite run WORLD [--seeds dev|all] [--jobs 2]   # WORLD: luck-mid, luck-high, delay-high or chains;
                                                                 # the runs' outputs in results/suite/WORLD/runs/
    python -m lab.suite report                                   # each world's tables, results/suite/summary.md, figure
    python -m lab.suite plan WORLD [--seeds dev|all]             # the runs, done or to do

Runs are lab/benchmark.py's (labels, run_one: configs/chains.cfg + configs/compare-methods.cfg, 120k generated
tokens per run) on the committed world worlds/WORLD-0. No knob is chosen here: every method runs at the knobs the
chains benchmark chose on its development seeds (LABELS), except GRPO-matched, whose group size follows the rule of
the chains `samples` set: G = round(5 x the twin-data arm's tokens per update / GRPO's), measured on this world's
seeds 0-2 and written to results/suite/WORLD/chosen.json before its first run (never rewritten). `--seeds dev` runs
seeds 0-2; `all` adds the held-out seeds 10-15.

The chains world is the suite's low-luck end: its runs are the chains `samples` set's (results/chains-samples, the
same labels on worlds/chains-0) and `results/suite/chains/runs/` for the labels that set did not run.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from lab import benchmark, report
from worlds.chains import SUITE

ROOT = benchmark.ROOT
RESULTS = os.path.join(ROOT, "results", "suite")
FIGURE = os.path.join(ROOT, "figures", "suite_gain_vs_rho.png")
# the audit each world's coupling is read from (python -m lab.audit ..., RESULTS.md "Credit suite")
AUDITS = {w: os.path.join(RESULTS, w, "audit") for w in ("chains", *SUITE)}
CHAINS_SAMPLES = os.path.join(ROOT, "results", "chains-samples")
GRPO, CREDIT = "grpo", "twice-turn-b0.7-w1-cap2"  # TWICE credit only: the bounded set's knobs
DATA = "twice-turn-b0.7-w1-cap2-data-late1"  # twins as rows: the arm the chains samples-sweep chose
ALONE = DATA.replace("-w1-", "-w0-")  # the same rows without the pair credit
INDEPENDENT = "independent-b0.7-w1-cap2"  # TWICE credit only with fresh keys after the decision
OTHERS = ("tree_grpo", "arpo", "vineppo-k1", "gigpo")  # VinePPO's K: the chains sweep's choice


# the labels of the suite that the chains samples set did not run (run here on worlds/chains-0)
CHAINS_EXTRA = (INDEPENDENT, "vineppo-k1", "gigpo")


def world_dir(world: str) -> str:
    return os.path.join(ROOT, "worlds", f"{world}-0")


def results_dir(world: str) -> str:
    return os.path.join(RESULTS, world)


def seeds_of(which: str) -> tuple:
    if which not in ("dev", "all"):
        raise SystemExit(f"lab/suite.py: --seeds must be dev or all, not {which!r}")
    return benchmark.DEV_SEEDS + (benchmark.HELDOUT_SEEDS if which == "all" else ())


def chosen(results: str, need: bool = True) -> dict:
    """GRPO-matched of a world (results/chosen.json, written once from GRPO's and the twin-data arm's runs on seeds
    0-2); {} when those runs are not all done and not `need`."""
    path = os.path.join(results, "chosen.json")
    if os.path.isfile(path):
        return json.load(open(path))
    runs = benchmark.collect((GRPO, DATA), benchmark.DEV_SEEDS, results, need_all=need)
    if len(runs[GRPO]) < 3 or len(runs[DATA]) < 3:
        return {}
    ratio = benchmark.per_update(runs[DATA]) / benchmark.per_update(runs[GRPO])
    out = {"grpo_matched": f"grpo-g{round(5 * ratio)}", "tokens_per_update_ratio": round(ratio, 3),
           "rule": f"G = round(5 x {DATA}'s tokens per update / GRPO's) over seeds 0-2",
           "chosen_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    benchmark.write_json(path, out)
    return out


def labels(ch: dict) -> list:
    """Every method of the suite: GRPO, GRPO-matched, TWICE credit only and its independent counterfactual, TWICE
    with twins as rows and the same rows at omega 0, Tree-GRPO, ARPO, VinePPO, GiGPO."""
    return [GRPO, *([ch["grpo_matched"]] if ch else []), CREDIT, INDEPENDENT, DATA, ALONE, *OTHERS]


def plan(results: str, seeds: tuple) -> list:
    """[(label, seed)], seed-major; GRPO and the twin-data arm on seeds 0-2 first: GRPO-matched's G needs them. On
    chains, the labels the samples set did not run."""
    if results == results_dir("chains"):
        return [(lab, s) for s in seeds for lab in CHAINS_EXTRA]
    ch = chosen(results, need=False)
    first = [(lab, s) for s in benchmark.DEV_SEEDS for lab in (GRPO, DATA)]
    return first + [(lab, s) for s in seeds for lab in labels(ch) if (lab, s) not in first]


def run(world: str, seeds: tuple, jobs: int, scratch: str) -> int:
    """The world's missing runs, in passes: GRPO-matched joins once the runs that fix its G are done."""
    results, folder = results_dir(world), world_dir(world)
    if subprocess.run([sys.executable, "-m", "worlds.build", "--verify", folder], cwd=ROOT).returncode:
        return 1
    while True:
        todo = [(lab, s) for lab, s in plan(results, seeds)
                if not benchmark.finished(benchmark.run_dir(lab, s, results))]
        if world != "chains" and not chosen(results, need=False):  # first the runs that fix GRPO-matched
            todo = [(lab, s) for lab, s in todo if lab in (GRPO, DATA) and s in benchmark.DEV_SEEDS] or todo
        if not todo:
            return 0
        print(f"lab/suite.py: {world}: {len(todo)} runs to do, {jobs} at a time", flush=True)
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            for line in pool.map(lambda r: benchmark.run_one(*r, folder, os.path.join(scratch, world), results),
                                 todo):
                print(line, flush=True)
        if any(not benchmark.finished(benchmark.run_dir(lab, s, results)) for lab, s in todo):
            print(f"lab/suite.py: {world}: some runs failed (see their logs under {scratch}/{world})")
            return 1


# --- the report ---

def coupling(world: str) -> dict:
    """The audit's coupling figures of a world: rho (outcome correlation of factual and twin), the measured
    Var(coupled D) / Var(independent D) and 1 minus it (the variance coupling removes), wrong-sign and correlation
    with A* of TWICE, independent and GRPO."""
    path = os.path.join(AUDITS[world], "audit.json")
    if not os.path.isfile(path):
        return {}
    res = json.load(open(path))
    c, m = res["coupling"], res["metrics"]
    out = {"rho": c["rho"], "var_ratio": c["measured_ratio"], "removed": 1 - c["measured_ratio"],
           "decisions": res["oracle"]["decisions"], "above": res["oracle"]["above_threshold"]}
    for name in ("TWICE", "independent", "GRPO"):
        out[name] = (m[name]["wrong_sign"], m[name]["corr"], m[name]["corr_se"])
    return out


def world_runs(world: str, seeds: tuple) -> dict:
    """{label: [(config, rows)]} of a world's finished runs (chains: the samples set's, then the suite's own)."""
    ch = chosen(results_dir(world), need=False) if world != "chains" else {"grpo_matched": "grpo-g9"}
    out = {}
    for lab in labels(ch):
        for results in ([CHAINS_SAMPLES] if world == "chains" else []) + [results_dir(world)]:
            runs = benchmark.collect([lab], seeds, results, need_all=False)[lab]
            if runs:
                out[lab] = runs
                break
    return out


def se(x: list) -> float:
    return float(np.std(x, ddof=1) / np.sqrt(len(x))) if len(x) > 1 else float("nan")


def gains(runs: dict, against: str = GRPO) -> dict:
    """{label: (per-token gain, its SE, per-update gain, its SE, seeds)}: AUC - the base's (`against`, GRPO) and EM -
    its EM after the same number of updates (benchmark.em_after_same_updates), paired by seed; SE over seeds."""
    base = {cfg["seed"]: rows for cfg, rows in runs.get(against, [])}
    if not base:
        return {}
    budget = report.shared_budget(runs)
    out = {}
    for lab, seeds in runs.items():
        pairs = [(rows, base[cfg["seed"]]) for cfg, rows in seeds if lab != against and cfg["seed"] in base]
        if pairs:
            tok = [report.auc(report.em_vs_tokens(r), budget) - report.auc(report.em_vs_tokens(b), budget)
                   for r, b in pairs]
            upd = [benchmark.em_after_same_updates(r, b)[0] for r, b in pairs]
            out[lab] = (float(np.mean(tok)), se(tok), float(np.mean(upd)), se(upd), len(tok))
    return out


def method(label: str) -> str:
    """A label as the summary and figure name it: GRPO-matched whatever its G (9 on one world, 8 on another)."""
    return "GRPO-matched" if label.startswith("grpo-g") else label


def gain_cells(g) -> list:
    """The two cells (per token with its seeds, per update) of a gains() value; "-" for none."""
    return [f"{g[0]:+.3f} +- {g[1]:.3f} ({g[4]})", f"{g[2]:+.3f} +- {g[3]:.3f}"] if g else ["-", "-"]


def gain_tables(runs: dict, seeds: tuple) -> tuple:
    """Markdown lines of the gains over GRPO of every method on every world (runs: {world: world_runs}), then of
    what coupling and the pair credit add, on `seeds`; and the gains, {world: {method: gains() value}}."""
    worlds = list(runs)
    head = ["| {} | " + " | ".join(f"{w}: per token | {w}: per update" for w in worlds) + " |",
            "|---|" + "---:|" * (2 * len(worlds))]
    lines = [f"Gain over GRPO, seeds {', '.join(map(str, seeds))} (paired, mean +- SE; per token: AUC - GRPO's "
             "at 120k tokens; per update: EM - GRPO's after the same updates):", "", head[0].format("method"),
             head[1]]
    g = {w: {method(k): v for k, v in gains(runs[w]).items()} for w in worlds}
    for lab in labels({"grpo_matched": "GRPO-matched"})[1:]:
        cells = [c for w in worlds for c in gain_cells(g[w].get(lab))]
        lines.append(f"| {lab} | " + " | ".join(cells) + " |")
    lines += ["", "What coupling and the pair credit add (paired by seed, the same cells): coupling = TWICE credit "
              "only against the independent counterfactual at the same knobs; pair credit = twins as rows against "
              "the same rows at omega 0:", "", head[0].format("comparison"), head[1]]
    for name, lab, base in (("coupling", CREDIT, INDEPENDENT), ("pair credit", DATA, ALONE)):
        cells = []
        for w in worlds:
            cells += gain_cells(gains({k: runs[w][k] for k in (lab, base) if k in runs[w]}, base).get(lab))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines, g


def summary(seeds_name: str = "dev") -> tuple:
    """Markdown of the coupling and the gains of every world on the development seeds (and, with `all`, on the
    held-out seeds apart), and {world: (removed variance, development-seed gains)} for the figure."""
    seeds_of(seeds_name)  # dev or all, else a clear error
    worlds = ["chains", *SUITE]
    lines = ["| world | luck | delay | decisions (above 0.2) | rho | Var(coupled D) / Var(independent D) | "
             "TWICE wrong-sign / corr | independent | GRPO |", "|---|---:|---|---:|---:|---:|---|---|---|"]
    dev_lines, dev_gains = gain_tables({w: world_runs(w, benchmark.DEV_SEEDS) for w in worlds}, benchmark.DEV_SEEDS)
    points = {}
    for w in worlds:
        knobs = SUITE.get(w, {"luck": 0.12, "delay": "last"})
        c = coupling(w)
        if not c:
            lines.append(f"| {w} | {knobs['luck']} | {knobs['delay']} | (no audit yet) | | | | | |")
            continue
        cells = [f"{100 * c[n][0]:.1f}% / {c[n][1]:.3f} +- {c[n][2]:.3f}" for n in ("TWICE", "independent", "GRPO")]
        lines.append(f"| {w} | {knobs['luck']} | {knobs['delay']} | {c['decisions']} ({c['above']}) | "
                     f"{c['rho']:.3f} | {c['var_ratio']:.3f} | " + " | ".join(cells) + " |")
        points[w] = (c["removed"], dev_gains[w])
    lines += ["", *dev_lines]
    if seeds_name == "all":  # the held-out seeds apart: nothing was chosen on them
        lines += ["", *gain_tables({w: world_runs(w, benchmark.HELDOUT_SEEDS) for w in worlds},
                                   benchmark.HELDOUT_SEEDS)[0]]
    return "\n".join(lines), points


def plot(points: dict, path: str = ""):
    """Per-token and per-update gain over GRPO against the variance coupling removed (1 - Var ratio), one line per
    method, the worlds ordered by it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    order = sorted((w for w in points if points[w][1]), key=lambda w: points[w][0])  # the worlds with runs
    names = sorted({lab for w in order for lab in points[w][1]})
    for ax, (k, title) in zip(axes, ((0, "per token: AUC - GRPO's"), (2, "per update: EM - GRPO's"))):
        for lab in names:
            xs = [(points[w][0], points[w][1][lab]) for w in order if lab in points[w][1]]
            if xs:
                ax.errorbar([x for x, _ in xs], [g[k] for _, g in xs], yerr=[g[k + 1] for _, g in xs],
                            marker="o", capsize=2, label=lab)
        for w in order:
            ax.annotate(w, (points[w][0], ax.get_ylim()[0]), fontsize=7, rotation=90, va="bottom")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xlabel("1 - Var(coupled D) / Var(independent D) (audit)")
        ax.set_title(title)
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path = path or FIGURE
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_report(seeds_name: str = "dev") -> str:
    for w in SUITE:
        results = results_dir(w)
        if not os.path.isdir(os.path.join(results, "runs")):
            continue
        ch = chosen(results, need=False)
        head = [f"World worlds/{w}-0 ({SUITE[w]}); GRPO-matched: " + (
            f"{ch['grpo_matched']} ({ch['rule']}, written {ch['chosen_at']})" if ch else "not chosen yet"), ""]
        benchmark.write_tables(results, head, [
            (f"Credit suite, {w}, seeds 0-2", labels(ch), benchmark.DEV_SEEDS, "dev"),
            (f"Credit suite, {w}, seeds 10-15", labels(ch), benchmark.HELDOUT_SEEDS, "heldout")],
            {}, "`python -m lab.suite report` from results/suite/<world>/runs", ch.get("grpo_matched", ""))
    text, points = summary(seeds_name)
    if any(p[1] for p in points.values()):
        plot(points)
    out = "\n".join([f"# Credit suite: coupling and gain over GRPO (generated by `python -m lab.suite report "
                     f"--seeds {seeds_name}`; do not edit)", "", text, ""])
    return benchmark.write_text(os.path.join(RESULTS, "summary.md"), out)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="lab/suite.py", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["run", "report", "plan"])
    parser.add_argument("world", nargs="?", help="chains (the labels its samples set lacks), " + ", ".join(SUITE) +
                        " (run, plan)")
    parser.add_argument("--seeds", default="dev", help="dev (0-2) or all (0-2 and 10-15)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, one thread each")
    parser.add_argument("--scratch", default="runs/suite", help="where runs write checkpoints and logs")
    a = parser.parse_args(argv)
    if a.command == "report":
        print(build_report(a.seeds))
        return 0
    if a.world not in ("chains", *SUITE):
        parser.error(f"{a.command} needs a world of the suite: chains, {', '.join(SUITE)}")
    if a.command == "plan":
        for lab, s in plan(results_dir(a.world), seeds_of(a.seeds)):
            done = benchmark.finished(benchmark.run_dir(lab, s, results_dir(a.world)))
            print(f"{'done' if done else 'to do'}  {lab} seed {s}  {' '.join(benchmark.flags(lab))}")
        return 0
    return run(a.world, seeds_of(a.seeds), a.jobs, a.scratch)


if __name__ == "__main__":
    raise SystemExit(main())
