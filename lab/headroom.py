"""Headroom: what exact credit buys per update on each committed world, and the share of it each method takes
(RESULTS.md "Headroom"; DESIGN.md section 7, "The oracle arm").

    python -m lab.headroom run WORLD [--seeds dev|all] [--jobs 2]   # the world's missing runs
    python -m lab.headroom report [--seeds dev|all]                 # results/headroom/tables.md
    python -m lab.headroom plan WORLD [--seeds dev|all]             # the runs, done or to do

The arms, per world, at the chains benchmark's settings (configs/chains.cfg + configs/compare-methods.cfg, the
world's committed folder worlds/WORLD-0; lab/benchmark.py runs them): GRPO, GRPO-matched (G raised to the twin-data
arm's tokens per update, the credit suite's rule), the oracle alone (A* in place of A_traj) and the oracle added to
A_traj (methods/oracle.py, M = 16 rollouts per side), TWICE credit only and TWICE with twins as rows (the suite's
arms). The oracle's rollouts are not charged (its runs make GRPO's updates), so every comparison is per update: EM
after the same number of updates, paired by seed (benchmark.em_after_same_updates).

    headroom = oracle - GRPO-matched                (the issue's bar: the per-update bar of the twin arms)
    credit headroom = oracle - GRPO                 (the same five rows a prompt, only the credit differs)
    share of a method = (method - GRPO-matched) / headroom, where the headroom is above twice its SE

Runs that exist are reused, never rerun: chains' GRPO, GRPO-matched and twin arms are the chains `samples` set's
(results/chains-samples), the suite worlds' are the credit suite's (results/suite/WORLD). What no set ran (the
oracle arms everywhere, the tiny world's arms, held-out seeds a world lacks) lands in results/headroom/WORLD/runs.
"""
import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from lab import benchmark, suite

ROOT = benchmark.ROOT
RESULTS = os.path.join(ROOT, "results", "headroom")
WORLDS = ("tiny", "chains", "luck-mid", "luck-high", "delay-high")
M = 16  # the oracle's rollouts per side: mean SE of A* 0.06-0.08 (RESULTS.md "Headroom")
GRPO, CREDIT, DATA = suite.GRPO, suite.CREDIT, suite.DATA
ORACLE, ORACLE_TRAJ = f"oracle-m{M}", f"oracle-m{M}-traj"


def results_dir(world: str) -> str:
    return os.path.join(RESULTS, world)


def sources(world: str) -> list:
    """Where a world's runs may be, in the order looked in: the set that ran its baselines first, then headroom's."""
    first = {"chains": [suite.CHAINS_SAMPLES], "tiny": []}.get(world, [suite.results_dir(world)])
    return first + [results_dir(world)]


def matched(world: str, need: bool = False) -> str:
    """GRPO-matched's label on a world ('' until the runs that fix it are done): chains' from its samples set, a
    suite world's from the suite, the tiny world's by the suite's rule from the runs here (written once)."""
    if world == "chains":  # chosen by the samples set (written once, never here)
        path = os.path.join(suite.CHAINS_SAMPLES, "chosen.json")
        return json.load(open(path))["grpo_matched"] if os.path.isfile(path) else ""
    if world == "tiny":
        return suite.chosen(results_dir(world), need=need).get("grpo_matched", "")
    return suite.chosen(suite.results_dir(world), need=need).get("grpo_matched", "")


def labels(world: str) -> list:
    return [GRPO, *filter(None, [matched(world)]), ORACLE, ORACLE_TRAJ, CREDIT, DATA]


def find(world: str, label: str, seed: int) -> str:
    """The folder of a finished run of the label and seed ('' if none)."""
    for results in sources(world):
        if benchmark.finished(benchmark.run_dir(label, seed, results)):
            return results
    return ""


def plan(world: str, seeds: tuple) -> list:
    """[(label, seed)] this module runs, seed-major: what no other set ran. On the tiny world GRPO and the twin-data
    arm come first (they fix GRPO-matched), then the rest."""
    first = [(lab, s) for s in benchmark.DEV_SEEDS for lab in (GRPO, DATA)] if world == "tiny" else []
    rest = [(lab, s) for s in seeds for lab in labels(world) if (lab, s) not in first]
    return [(lab, s) for lab, s in first + rest if not find(world, lab, s) or find(world, lab, s) == results_dir(world)]


def run(world: str, seeds: tuple, jobs: int, scratch: str) -> int:
    """The missing runs, in passes (GRPO-matched joins once the runs that fix its G are done)."""
    folder, results = suite.world_dir(world), results_dir(world)
    if subprocess.run([sys.executable, "-m", "worlds.build", "--verify", folder], cwd=ROOT).returncode:
        return 1
    while True:
        todo = [(lab, s) for lab, s in plan(world, seeds) if not find(world, lab, s)]
        if world == "tiny" and not matched(world):
            todo = [(lab, s) for lab, s in todo if lab in (GRPO, DATA) and s in benchmark.DEV_SEEDS] or todo
        if not todo:
            return 0
        print(f"lab/headroom.py: {world}: {len(todo)} runs to do, {jobs} at a time", flush=True)
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            for line in pool.map(lambda r: benchmark.run_one(*r, folder, os.path.join(scratch, world), results),
                                 todo):
                print(line, flush=True)
        if world == "tiny":
            matched(world, need=False)  # written once the runs that fix it are done
        if any(not find(world, lab, s) for lab, s in todo):
            print(f"lab/headroom.py: {world}: some runs failed (see their logs under {scratch}/{world})")
            return 1


# --- the report ---

def world_runs(world: str, seeds: tuple) -> dict:
    """{label: [(config, rows)]} of the world's finished runs on the seeds, each from where it ran."""
    out = {}
    for lab in labels(world):
        runs = []
        for s in seeds:
            where = find(world, lab, s)
            if where:
                runs += benchmark.collect([lab], (s,), where)[lab]
        if runs:
            out[lab] = runs
    return out


def paired(runs: dict, lab: str, base: str, path: bool = False) -> list:
    """EM after the same updates minus the base's (path: the mean over those updates), per shared seed."""
    base_rows = {cfg["seed"]: rows for cfg, rows in runs.get(base, [])}
    diff = benchmark.mean_em_over_same_updates if path else lambda a, b: benchmark.em_after_same_updates(a, b)[0]
    return [diff(rows, base_rows[cfg["seed"]]) for cfg, rows in runs.get(lab, []) if cfg["seed"] in base_rows]


def mean_se(x: list) -> tuple:
    return (float(np.mean(x)), suite.se(x)) if x else (float("nan"), float("nan"))


def oracle_figures(runs: list) -> dict:
    """The oracle's step logs: mean |A*|, mean SE, its rollout tokens per factual token, and total tokens."""
    steps = [r for _, rows in runs for r in rows if "oracle_se" in r]
    total = [sum(r["factual_tokens"] + r["oracle_tokens"] for r in rows if "oracle_tokens" in r) for _, rows in runs]
    return {"abs": float(np.mean([r["oracle_abs"] for r in steps])), "se": float(np.mean([r["oracle_se"] for r in steps])),
            "ratio": float(np.mean([r["oracle_token_ratio"] for r in steps])), "total": float(np.mean(total))}


def wall_minutes(world: str, label: str, seeds: tuple) -> float:
    """Mean wall minutes of the label's runs on the seeds (their meta.json), nan without any."""
    paths = [os.path.join(benchmark.run_dir(label, s, find(world, label, s)), "meta.json") for s in seeds
             if find(world, label, s)]
    walls = [json.load(open(p))["wall_s"] for p in paths if os.path.isfile(p)]
    return float(np.mean(walls)) / 60 if walls else float("nan")


def world_table(world: str, seeds: tuple) -> tuple:
    """Markdown lines of one world's headroom table and {method: (gain over GRPO-matched, SE)} with the headroom."""
    runs, bar = world_runs(world, seeds), matched(world)
    lines = [f"### {world}, seeds {', '.join(map(str, seeds))}", ""]
    if GRPO not in runs or bar not in runs or ORACLE not in runs:
        return lines + ["Not all of GRPO, GRPO-matched and the oracle have run on these seeds yet.", ""], {}
    head = mean_se(paired(runs, ORACLE, bar))
    ok = head[0] > 2 * head[1]
    lines += ["| method | seeds | updates | EM after the same updates - GRPO-matched's | - GRPO's | share of the headroom "
              "| mean EM over those updates - GRPO-matched's | tokens per update / GRPO's | wall min |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    points = {}
    for lab in labels(world):
        if lab not in runs:
            continue
        vs_bar, vs_grpo = mean_se(paired(runs, lab, bar)), mean_se(paired(runs, lab, GRPO))
        updates = np.mean([max(r["step"] for r in rows) for _, rows in runs[lab]])
        cost = benchmark.per_update(runs[lab]) / benchmark.per_update(runs[GRPO])
        if lab.startswith("oracle"):
            cost = np.mean([oracle_figures([run])["total"] / max(r["step"] for r in run[1]) for run in runs[lab]]) \
                / benchmark.per_update(runs[GRPO])
        share = f"{vs_bar[0] / head[0]:.2f}" if ok and lab != bar else "-"
        path = mean_se(paired(runs, lab, bar, path=True))
        lines.append(f"| {suite.method(lab)} | {len(runs[lab])} | {updates:.1f} | "
                     f"{'-' if lab == bar else f'{vs_bar[0]:+.3f} +- {vs_bar[1]:.3f}'} | "
                     f"{'-' if lab == GRPO else f'{vs_grpo[0]:+.3f} +- {vs_grpo[1]:.3f}'} | {share} | "
                     f"{'-' if lab == bar else f'{path[0]:+.3f} +- {path[1]:.3f}'} | "
                     f"{cost:.2f} | {wall_minutes(world, lab, seeds):.1f} |")
        if lab != bar:
            points[suite.method(lab)] = vs_bar
    o = oracle_figures(runs[ORACLE])
    credit_head = mean_se(paired(runs, ORACLE, GRPO))
    lines += ["", f"Headroom (oracle - GRPO-matched) {head[0]:+.3f} +- {head[1]:.3f}"
              f"{'' if ok else ' (not above twice its SE: no share is computed)'}; credit headroom (oracle - GRPO, "
              f"the same rows) {credit_head[0]:+.3f} +- {credit_head[1]:.3f}. The oracle's A*: mean |A*| {o['abs']:.3f}, "
              f"mean SE {o['se']:.3f} (M = {M}); its rollouts {o['ratio']:.0f}x the factual tokens.", ""]
    return lines, {"headroom": head, **points}


def build_report(seeds_name: str = "dev") -> str:
    lines = [f"# Headroom: the oracle's per-update gain and each method's share (generated by `python -m lab.headroom "
             f"report --seeds {seeds_name}`; do not edit)", "",
             "EM after the same updates is taken at the fewer updates of a pair: against GRPO-matched that is ~10 on the "
             "luck worlds (its 120k tokens end there), before GRPO takes off there at 13-17. The credit frontier "
             "(`python -m lab.frontier report`, results/frontier/tables.md) compares every arm after 20 updates.", ""]
    for world in WORLDS:
        lines += world_table(world, benchmark.DEV_SEEDS)[0]
    if seeds_name == "all":  # the held-out seeds apart: nothing was chosen on them
        for world in WORLDS:
            if any(find(world, ORACLE, s) for s in benchmark.HELDOUT_SEEDS):
                lines += world_table(world, benchmark.HELDOUT_SEEDS)[0]
    return benchmark.write_text(os.path.join(RESULTS, "tables.md"), "\n".join(lines))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="lab/headroom.py", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["run", "report", "plan"])
    parser.add_argument("world", nargs="?", help=", ".join(WORLDS) + " (run, plan)")
    parser.add_argument("--seeds", default="dev", help="dev (0-2) or all (0-2 and 10-15)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, one thread each")
    parser.add_argument("--scratch", default="runs/headroom", help="where runs write checkpoints and logs")
    a = parser.parse_args(argv)
    if a.command == "report":
        print(build_report(a.seeds))
        return 0
    if a.world not in WORLDS:
        parser.error(f"{a.command} needs a world: {', '.join(WORLDS)}")
    seeds = suite.seeds_of(a.seeds)
    if a.command == "plan":
        for lab, s in plan(a.world, seeds):
            print(f"{'done' if find(a.world, lab, s) else 'to do'}  {lab} seed {s}  {' '.join(benchmark.flags(lab))}")
        return 0
    return run(a.world, seeds, a.jobs, a.scratch)


if __name__ == "__main__":
    raise SystemExit(main())
