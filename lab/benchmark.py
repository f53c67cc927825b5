"""The benchmark on the chains world, built up over several sittings and rebuilt from committed run
outputs.

    python -m lab.benchmark run SET [--jobs 2] [--world data/chains]   # the set's missing runs; each one's outputs are
                                                                   # copied into
                                                                   results/chains/runs/ when it ends
    python -m lab.benchmark report                                     # every table (results/chains/tables.md) and PNG
    python -m lab.benchmark plan SET                                   # the runs of a set, done or to do

A run is a label and a seed: `train_twice.py configs/chains.cfg configs/compare-methods.cfg` plus
the label's flags (LABELS below; "grpo-g8" is GRPO with 8 lines per prompt, "twice-token-b0.25-w1"
TWICE with token forks, twin_budget 0.25 and omega 1, a "-360k" suffix triples the token budget).
Every run stops at the same generated tokens (factual + auxiliary).
results/chains/runs/<label>-seed<s>/ keeps its config.json, metrics.jsonl and meta.json (command,
commit, world digests, machine, wall time), a few kB: the tables are a function of that folder
alone.

The sets, in the order they may run (each refuses to start before what it depends on is complete):
    sweep        dev seeds 0-2: GRPO; TWICE, both units, twin_budget x {0.1, 0.25, 0.5, 0.7} at omega 1; VinePPO
                 K in {1, 3, 9}
    sweep-omega  dev seeds 0-2: TWICE, both units, omega {0.25, 0.5, 2} at the unit's best budget of
    `sweep`
    dev          dev seeds 0-2: every method of the benchmark, at the knobs chosen from the sweeps
    heldout      seeds 10-15 at 120k tokens: the same list, run once (chosen.json is frozen before any of them)
    long         seeds 10-12 at 360k tokens: GRPO, the best TWICE variant and the best other method (by dev AUC)
    bounded      seeds 0-2 and 10-15 on a world of its own (--world, --results): GRPO, GRPO with 8 lines, TWICE at
                 the paper's knobs with the estimator above and with the bounded twin term ("-cap2"); no choice made
    samples-sweep  dev seeds 0-2 on a world of its own: GRPO and TWICE with twins as training rows ("-data") at
                 budgets 0.7 and 0.25, and at 0.7 branching from turn 1 on only ("-late1")
    samples      seeds 0-2, then 10-15: GRPO, GRPO-matched (G raised to the chosen twin-data arm's tokens per
                 update), Tree-GRPO, ARPO, TWICE bounded (credit only), the chosen twin-data arm and it at omega 0
Knobs are chosen by one rule, the highest mean area under EM-vs-tokens over the development seeds,
and written to results/chains/chosen.json before the first run that needs them; an existing
chosen.json is never rewritten.
"""
import argparse
import datetime
import glob
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from lab import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
RESULTS = os.path.join(ROOT, "results", "chains")
CONFIGS = ["configs/chains.cfg", "configs/compare-methods.cfg"]
DEV_SEEDS, HELDOUT_SEEDS, LONG_SEEDS = (0, 1, 2), (10, 11, 12, 13, 14, 15), (10, 11, 12)
BUDGETS, OMEGAS, VINE_KS = (0.1, 0.25, 0.5, 0.7), (0.25, 0.5, 2.0), (1, 3, 9)
OTHERS = ("gigpo", "hgpo", "arpo", "tree_grpo", "ppo", "igpo", "spa_rl", "agentprm", "craft")
LONG = 3  # the long set's token budget: 3 x compare-methods.cfg's (360k)
# the bounded twin term against the estimator the benchmark ran and GRPO at 5 and 8 lines, at the paper's knobs
# (turn unit, budget 0.7, omega 1: defaults, not chosen), on a world of its own (`--results`)
BOUNDED = ("grpo", "grpo-g8", "twice-turn-b0.7-w1", "twice-turn-b0.7-w1-cap2")
# twins as training rows, on a world of its own: the dev choice between budgets and late branching (rms scale, cap 2)
SAMPLES_SWEEP = ("grpo", "twice-turn-b0.7-w1-cap2-data", "twice-turn-b0.25-w1-cap2-data",
                 "twice-turn-b0.7-w1-cap2-data-late1")


def num(x: float) -> str:
    return f"{x:g}"


def twice(unit: str, budget: float, omega: float, method: str = "twice") -> str:
    return f"{method}-{unit}-b{num(budget)}-w{num(omega)}" if method == "twice" else \
        f"{method}-b{num(budget)}-w{num(omega)}"


def flags(label: str) -> list:
    """train_twice.py flags of a run label; ValueError names a label it cannot read."""
    out, name = [], label
    unreadable = f"lab/benchmark.py: cannot read the run label {label!r} (see LABELS in the module docstring)"
    if name.endswith("-360k"):
        out, name = [f"--token_budget={120000 * LONG}",
                     f"--eval_tokens={30000 * LONG}"], name[:-len("-360k")]
    parts = name.split("-")
    try:
        if parts[0] == "grpo" and len(parts) <= 2:
            return out + ["--method=grpo"
                          ] + ([f"--group_size={int(parts[1][1:])}"] if len(parts) == 2 else [])
        # the estimator the committed runs used (the defaults before 2026-12-05: scale of D, no cap)
        as_run = ["--twin_scale=d", "--twin_cap=0"]
        if parts[0] == "twice" and len(parts) >= 4 and parts[1] in ("turn", "token"):
            as_run, extra = modifiers(parts[4:], as_run, unreadable)
            return out + ["--method=twice", f"--twin_unit={parts[1]}", *budget(parts[2]),
                          f"--omega={float(parts[3][1:])}"] + as_run + extra
        if parts[0] == "independent" and len(parts) >= 3:
            as_run, extra = modifiers(parts[3:], as_run, unreadable)
            return out + ["--method=independent", *budget(parts[1]),
                          f"--omega={float(parts[2][1:])}"] + as_run + extra
        if parts[0] == "oracle" and len(parts) in (2, 3):  # "oracle-mM[-traj]": the ceiling (methods/oracle.py)
            if len(parts) == 3 and parts[2] != "traj" or not parts[1].startswith("m"):
                raise ValueError(unreadable)
            return out + ["--method=oracle", f"--oracle_rollouts={int(parts[1][1:])}",
                          f"--oracle_traj={str(len(parts) == 3).lower()}", "--twin_cap=2"]
        if parts[0] == "vineppo" and len(parts) == 2:
            return out + ["--method=vineppo", f"--vine_k={int(parts[1][1:])}"]
        if len(parts) == 1 and name in OTHERS:
            return out + [f"--method={name}"]
    except ValueError as e:  # a number that does not parse
        raise ValueError(unreadable) from e
    raise ValueError(unreadable)


def budget(part: str) -> list:
    """A twin label's budget: "bX" twin_budget X (the budget rule's q_t), "q1" every decision
    branched (budget_rule = all)."""
    if part == "q1":
        return ["--budget_rule=all"]
    if not part.startswith("b"):
        raise ValueError(part)
    return [f"--twin_budget={float(part[1:])}"]


def modifiers(parts: list, as_run: list, unreadable: str) -> tuple:
    """(scale flags, other flags) of a twin label's modifiers, each "-"-separated part one flag:
    "capC" the bounded term (rms scale, cap C; DESIGN.md section 5), "data" twins as rows, "lateK"
    decisions at turns >= K, "solo" the twin term without A_traj, "kK" K twins per decision,
    "noshort" no same-evidence shortcut."""
    extra = []
    for part in parts:
        if part.startswith("cap"):
            as_run = ["--twin_scale=rms", f"--twin_cap={float(part[3:])}"]
        elif part == "data":
            extra.append("--twin_data=true")
        elif part.startswith("late"):
            extra.append(f"--twin_from_turn={int(part[4:])}")
        elif part == "solo":
            extra.append("--traj_term=false")
        elif part.startswith("k") and part[1:].isdigit():
            extra.append(f"--twins_per_decision={int(part[1:])}")
        elif part == "noshort":
            extra.append("--same_evidence_shortcut=false")
        else:
            raise ValueError(unreadable)
    return as_run, extra


# --- the committed outputs ---

def run_dir(label: str, seed: int, results: str = RESULTS) -> str:
    return os.path.join(results, "runs", f"{label}-seed{seed}")


def finished(folder: str) -> bool:
    path = os.path.join(folder, "metrics.jsonl")
    return os.path.isfile(path) and any(
        json.loads(line).get("final") for line in open(path) if line.strip())


def collect(labels, seeds, results: str = RESULTS, need_all: bool = True) -> dict:
    """{label: [(config, rows)]} of the finished committed runs; SystemExit naming what is missing
    if need_all."""
    done = {(lab, s): finished(run_dir(lab, s, results)) for lab in labels for s in seeds}
    missing = [f"{lab} seed {s}" for (lab, s), ok in done.items() if not ok]
    if missing and need_all:
        raise SystemExit(
            f"lab/benchmark.py: {len(missing)} runs are not done yet ({', '.join(missing[:6])}"
            f"{', ...' if len(missing) > 6 else ''}): run their set first")
    return {
        lab: [report.load_run(run_dir(lab, s, results)) for s in seeds if done[lab, s]]
        for lab in labels
    }


def mean_auc(runs: list, budget: float) -> float:
    return float(np.mean([report.auc(report.em_vs_tokens(rows), budget) for _, rows in runs]))


# --- the sets and the choices between them ---

def sweep_labels() -> list:
    return ["grpo", *[twice(u, b, 1.0) for u in ("turn", "token") for b in BUDGETS],
            *[f"vineppo-k{k}" for k in VINE_KS]]


def best(runs: dict, labels: list) -> str:
    budget = report.shared_budget({lab: runs[lab] for lab in labels})
    return max(labels, key=lambda lab: mean_auc(runs[lab], budget))


def best_budgets(runs: dict) -> dict:
    """{unit: the twin_budget of its best omega-1 run in the sweep}."""
    return {
        u: float(best(runs, [twice(u, b, 1.0) for b in BUDGETS]).split("-")[2][1:])
        for u in ("turn", "token")
    }


def chosen(results: str = RESULTS, need: str = "knobs") -> dict:
    """The knobs chosen on the development seeds (results/chains/chosen.json; computed and written
    the first time they are asked for, from complete sweeps only, and never rewritten). need="long"
    also asks for the best TWICE variant and the best other method of the dev set."""
    path = os.path.join(results, "chosen.json")
    out = json.load(open(path)) if os.path.isfile(path) else {}
    if "twice-turn" not in out:
        runs = collect(sweep_labels(), DEV_SEEDS, results)
        budgets = best_budgets(runs)
        runs.update(
            collect([twice(u, b, w) for u, b in budgets.items()
                     for w in OMEGAS], DEV_SEEDS, results))
        units = {
            u: best(runs, [twice(u, b, w) for w in (1.0, *OMEGAS)]) for u, b in budgets.items()
        }
        turn = units["turn"].split("-")
        out.update({
            "twice-turn": units["turn"],
            "twice-token": units["token"],
            # the turn unit's knobs, uncoupled
            "independent": f"independent-{turn[2]}-{turn[3]}",
            "vineppo": best(runs, [f"vineppo-k{k}" for k in VINE_KS]),
            "rule": "highest mean AUC (area under greedy EM vs generated tokens) over seeds 0-2",
            "chosen_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        })
        write_json(path, out)
    if need == "long" and "best_twice" not in out:
        labels = dev_labels(out)
        runs = collect(labels, DEV_SEEDS, results)
        out["best_twice"] = best(runs, [out["twice-turn"], out["twice-token"]])
        out["best_other"] = best(runs,
                                 [lab for lab in labels if not lab.startswith(("grpo", "twice"))])
        write_json(path, out)
    return out


def per_update(runs: list) -> float:
    """Mean generated tokens per update over a label's runs."""
    return float(np.mean([rows[-1]["tokens"] / max(r["step"] for r in rows) for _, rows in runs]))


def samples_chosen(results: str) -> dict:
    """The samples set's choices (results/.../chosen.json; written once, from the complete
    samples-sweep on the dev seeds): the twin-data arm with the highest mean dev AUC, and
    GRPO-matched, GRPO with G = round(5 x that arm's tokens per update / GRPO's)."""
    path = os.path.join(results, "chosen.json")
    if os.path.isfile(path):
        return json.load(open(path))
    runs = collect(SAMPLES_SWEEP, DEV_SEEDS, results)
    arm = best(runs, list(SAMPLES_SWEEP[1:]))
    ratio = per_update(runs[arm]) / per_update(runs["grpo"])
    out = {"twice_data": arm, "grpo_matched": f"grpo-g{round(5 * ratio)}",
           "tokens_per_update_ratio": round(ratio, 3),
           "rule": "twin-data arm: highest mean AUC over seeds 0-2; GRPO-matched: G = round(5 x its "
                   "tokens per update / GRPO's) over seeds 0-2",
           "chosen_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    write_json(path, out)
    return out


def samples_labels(ch: dict) -> list:
    """GRPO, GRPO-matched, the two sample-makers that beat GRPO on chains, TWICE credit only
    (bounded), TWICE with twins as rows and the same with omega = 0 (the rows alone)."""
    data = ch["twice_data"]
    return ["grpo", ch["grpo_matched"], "tree_grpo", "arpo", "twice-turn-b0.7-w1-cap2", data,
            data.replace("-w1-", "-w0-")]


def dev_labels(ch: dict) -> list:
    return [
        "grpo", "grpo-g8", ch["twice-turn"], ch["twice-token"], ch["independent"], ch["vineppo"],
        *OTHERS
    ]


def plan(name: str, results: str = RESULTS) -> list:
    """[(label, seed)] of a set, seed-major (a prefix of the runs covers every label on the first
    seeds)."""
    if name == "sweep":
        labels, seeds = sweep_labels(), DEV_SEEDS
    elif name == "sweep-omega":
        budgets = best_budgets(collect(sweep_labels(), DEV_SEEDS, results))
        labels, seeds = [twice(u, b, w) for u, b in budgets.items() for w in OMEGAS], DEV_SEEDS
    elif name == "dev":
        labels, seeds = dev_labels(chosen(results)), DEV_SEEDS
    elif name == "heldout":
        ch = chosen(results)
        collect(dev_labels(ch), DEV_SEEDS, results)  # frozen on the dev seeds first
        labels, seeds = dev_labels(ch), HELDOUT_SEEDS
    elif name == "bounded":
        labels, seeds = BOUNDED, DEV_SEEDS + HELDOUT_SEEDS
    elif name == "samples-sweep":
        labels, seeds = SAMPLES_SWEEP, DEV_SEEDS
    elif name == "samples":  # the four that answer the question first, every seed (dev first), then the rest
        labels, seeds = samples_labels(samples_chosen(results)), DEV_SEEDS + HELDOUT_SEEDS
        first = [labels[i] for i in (0, 1, 5, 6)]
        return [(lab, s) for group in (first, [lab for lab in labels if lab not in first])
                for s in seeds for lab in group]
    elif name == "long":
        ch = chosen(results, need="long")
        labels, seeds = [f"{lab}-360k"
                         for lab in ("grpo", ch["best_twice"], ch["best_other"])], LONG_SEEDS
    else:
        raise SystemExit(
            f"lab/benchmark.py: unknown set {name!r}; choose sweep, sweep-omega, dev, heldout, long, bounded, "
            "samples-sweep or samples"
        )
    return [(lab, s) for s in seeds for lab in labels]


# --- running ---

def write_text(path: str, text: str) -> str:
    """A generated table (its folder made first); returns the text."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return text


def write_json(path: str, obj):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(path + ".tmp", path)


def sha(path: str) -> str:
    return hashlib.sha256(open(path,
                               "rb").read()).hexdigest()[:16] if os.path.isfile(path) else "missing"


def commit() -> str:
    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short",
               "HEAD") + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def cpu() -> str:
    try:
        return next(
            line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
            if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def run_one(label: str, seed: int, world: str, scratch: str, results: str, extra=()) -> str:
    """One training run in scratch/, then its small outputs copied into results/; returns a line for
    the log. `extra` flags come last (the tests' small runs)."""
    out, dest = os.path.join(os.path.abspath(scratch), f"{label}-seed{seed}"), run_dir(
        label, seed, results)
    # held-out runs skip the gradient-share diagnostic: two more backward passes a step, no trained number changes
    quiet = ["--log_grad_share=false"] if seed in HELDOUT_SEEDS else []
    argv = [
        sys.executable, "train_twice.py", *CONFIGS, *(["--world=" + world] if world else []),
        *flags(label), f"--seed={seed}", f"--out_dir={out}", "--overwrite", *quiet, *extra
    ]
    os.makedirs(os.path.dirname(out), exist_ok=True)
    start, code = time.time(), commit()
    with open(out + ".log", "w") as log:
        rc = subprocess.run(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode
    wall = time.time() - start
    if rc != 0 or not finished(out):
        return f"FAILED {label} seed {seed} (exit {rc}): see {out}.log"
    os.makedirs(dest + ".tmp", exist_ok=True)
    for name in ("config.json", "metrics.jsonl"):
        shutil.copy(os.path.join(out, name), os.path.join(dest + ".tmp", name))
    wdir = world or "data/chains"
    shown = [a.replace(ROOT + os.sep, "") for a in ["python", *argv[1:]]]
    meta = {
        "label": label, "seed": seed, "argv": shown, "commit": code, "wall_s": round(wall, 1),
        "cpu": cpu(), "finished": datetime.datetime.now(
            datetime.timezone.utc).isoformat(timespec="seconds"), "world": {
                f: sha(os.path.join(ROOT, wdir, f))
                for f in ("world.json", "policy/model.safetensors")
            }
    }
    write_json(os.path.join(dest + ".tmp", "meta.json"), meta)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(dest + ".tmp", dest)
    return f"done {label} seed {seed} in {wall / 60:.1f} min"


def run_set(name: str, jobs: int, world: str, scratch: str, results: str = RESULTS) -> int:
    if name.startswith(("bounded", "samples")) and os.path.abspath(results) == os.path.abspath(RESULTS):
        raise SystemExit(f"lab/benchmark.py: the {name} set runs on a world of its own, beside the committed "
                         f"benchmark: --world worlds/chains-0 --results results/chains-{name.split('-')[0]}")
    todo = [(lab, s) for lab, s in plan(name, results) if not finished(run_dir(lab, s, results))]
    print(
        f"lab/benchmark.py: set {name}: {len(todo)} runs to do, {jobs} at a time, outputs in {scratch}",
        flush=True)
    if todo and subprocess.run(
        [sys.executable, "-m", "worlds.build", "--verify", world or "data/chains"],
            cwd=ROOT).returncode:
        return 1
    os.makedirs(scratch, exist_ok=True)
    start, failed = time.time(), 0
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for line in pool.map(lambda r: run_one(*r, world, scratch, results), todo):
            print(line, flush=True)
            failed += line.startswith("FAILED")
    print(
        f"lab/benchmark.py: set {name}: {len(todo) - failed} runs in {(time.time() - start) / 60:.1f} min, "
        f"{failed} failed", flush=True)
    return 1 if failed else 0


# --- the report ---

def updates_curve(rows: list) -> list:
    """[(updates done when measured, greedy EM)]: a step's evaluation runs before its update."""
    return [(r["step"], r["eval_em"]) for r in rows
            if "eval_em" in r and r.get("eval_em") is not None]


def breakeven(runs: dict, base: str = "grpo") -> str:
    """Markdown: per label, the token cost of an update against the base's (c) and the EM gained
    over its n updates against what the base gained over its first n updates (r, same seeds, the
    base's curve interpolated in updates). At equal generated tokens a label makes up for its cost
    when r >= c (progress roughly linear in updates)."""
    out = [
        "| run | seeds | updates | tokens per update (c: / GRPO's) | EM gain per update (r: / GRPO's at the same "
        "updates) | r - c |", "|---|---:|---:|---:|---:|---:|"
    ]
    base_runs = {cfg["seed"]: rows for cfg, rows in runs.get(base, [])}
    for lab, seeds in runs.items():
        cs, rs, ns = [], [], []
        for cfg, rows in seeds:
            if cfg["seed"] not in base_runs:
                continue
            b = base_runs[cfg["seed"]]
            n, bn = max(r["step"] for r in rows), max(r["step"] for r in b)
            cs.append((rows[-1]["tokens"] / n) / (b[-1]["tokens"] / bn))
            mine, theirs = updates_curve(rows), updates_curve(b)
            gain = mine[-1][1] - mine[0][1]
            their_gain = np.interp(n, *zip(*theirs)) - theirs[0][1]
            rs.append(gain / their_gain if their_gain > 0 else np.nan)
            ns.append(n)
        if cs:
            c, r = float(np.mean(cs)), float(np.nanmean(rs)) if np.isfinite(rs).any() else np.nan
            out.append(
                f"| {lab} | {len(cs)} | {np.mean(ns):.1f} | {c:.2f} | {r:.2f} | {r - c:+.2f} |")
    return "\n".join(out)


def em_after_same_updates(rows: list, base: list) -> tuple:
    """(EM - the base run's EM after the most updates both made, those updates): each curve interpolated in updates."""
    mine, theirs = updates_curve(rows), updates_curve(base)
    n = min(mine[-1][0], theirs[-1][0])
    return np.interp(n, *zip(*mine)) - np.interp(n, *zip(*theirs)), n


def mean_em_over_same_updates(rows: list, base: list) -> float:
    """Mean over [0, n] updates of EM - the base run's EM, n the most updates both made, each curve linear between
    its evaluations (exact: the trapezoid over every breakpoint). Unlike the EM after n updates it sees the path,
    so two runs that both saturate still differ by how soon they got there."""
    mine, theirs = updates_curve(rows), updates_curve(base)
    n = min(mine[-1][0], theirs[-1][0])
    xs = np.array(sorted({0, n, *[u for u, _ in mine + theirs if u < n]}), dtype=float)
    diff = np.interp(xs, *zip(*mine)) - np.interp(xs, *zip(*theirs))
    return float(np.sum((diff[1:] + diff[:-1]) / 2 * np.diff(xs)) / n) if n > 0 else float(diff[0])


def at_updates(runs: dict, base: str) -> str:
    """Markdown: per label, its EM against the base's after the same number of updates, the most
    both made (each curve interpolated in updates, same seed): a per-update comparison, fair when
    the base spends the label's tokens per update (GRPO-matched)."""
    out = ["| run | seeds | updates compared | tokens per update / base's | EM - base's at those updates (paired) |",
           "|---|---:|---:|---:|---:|"]
    base_runs = {cfg["seed"]: rows for cfg, rows in runs.get(base, [])}
    for lab, seeds in runs.items():
        diffs, ns, cs = [], [], []
        for cfg, rows in seeds:
            b = base_runs.get(cfg["seed"])
            if b:
                diff, n = em_after_same_updates(rows, b)
                diffs.append(diff)
                ns.append(n)
                cs.append(per_update([(cfg, rows)]) / per_update([(None, b)]))
        if diffs:
            se = np.std(diffs, ddof=1) / np.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
            out.append(f"| {lab} | {len(diffs)} | {np.mean(ns):.1f} | {np.mean(cs):.2f} | "
                       f"{np.mean(diffs):+.3f} +- {se:.3f} |")
    return "\n".join(out)


def census(runs: dict) -> str:
    """Markdown: per TWICE label, the step log's twin figures over its runs: twin rows and
    discordant twins per step, the discordant twins' census (D = +1 / -1 in a group whose factual
    lines all agree, constant, or not, mixed), the twin term's share of the gradient norm and of
    the advantage mass, and the largest twin term."""
    keys = ("census_pos_constant", "census_pos_mixed", "census_neg_constant", "census_neg_mixed")
    out = ["| run | seeds | twin rows / step | discordant / step | D=+1 constant | D=+1 mixed | D=-1 constant | "
           "D=-1 mixed | grad-norm share | advantage share | largest twin term |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for lab, seeds in runs.items():
        steps = [r for _, rows in seeds for r in rows if "discordant" in r]
        if not steps or keys[0] not in steps[0]:
            continue
        disc = sum(r["discordant"] for r in steps)
        cells = [f"{sum(r[k] for r in steps) / max(disc, 1):.2f}" for k in keys]
        share = [r["twin_grad_share"] for r in steps if "twin_grad_share" in r]
        out.append(f"| {lab} | {len(seeds)} | {np.mean([r.get('twin_rows', 0) for r in steps]):.1f} | "
                   f"{disc / len(steps):.1f} | {' | '.join(cells)} | "
                   f"{f'{np.mean(share):.3f}' if share else '-'} | "
                   f"{np.mean([r['twin_adv_share'] for r in steps]):.3f} | "
                   f"{max(r['twin_term_max'] for r in steps):.2f} |")
    return "\n".join(out)


def section(title: str, runs: dict, png: str, matched: str = "") -> list:
    runs = {lab: v for lab, v in runs.items() if v}
    if not runs:
        return [f"## {title}", "", "No finished runs yet.", ""]
    out = [f"## {title}", "", report.compare_methods([], runs=runs, png=png), ""]
    if "grpo" in runs:
        out += ["Paired with GRPO (mean +- SE over seeds):", "", report.paired([], runs=runs), "",
                "What an update costs and gains against GRPO's:", "", breakeven(runs), ""]
    if matched in runs:
        out += [f"Per update against GRPO-matched ({matched}: about the tokens per update of the twin-data arms):",
                "", at_updates(runs, matched), ""]
        data = [lab for lab in runs if lab.endswith(("-data", "-late1", "-late2")) and "-w0-" not in lab]
        for lab in data:  # what the pair credit adds to the same rows: the arm against itself at omega 0
            alone = lab.replace("-w1-", "-w0-")
            if alone in runs and lab != alone:
                pair = {alone: runs[alone], lab: runs[lab]}
                out += [f"The pair credit: {lab} against the same rows without it ({alone}), paired:", "",
                        report.paired([], base=alone, runs=pair), "", at_updates(pair, alone), ""]
    table = census(runs)
    if table.count("\n") > 1:  # runs whose step logs have the census (since 2026-12-05)
        out += ["The twin term and the discordant twins (step logs; census: shares of the discordant twins):", "",
                table, ""]
    return out


def build_report(results: str = RESULTS, only: str = "") -> str:
    """results/chains/tables.md and the PNGs from results/chains/runs alone (only = "bounded":
    that set's section alone, for its own results folder)."""
    if only == "samples":
        title, ch = "Twins as training samples, ", samples_chosen(results) if os.path.isfile(
            os.path.join(results, "chosen.json")) else {}
        sets = [("Twins as samples: the dev choice (budget, late branching), seeds 0-2", list(SAMPLES_SWEEP),
                 DEV_SEEDS, "samples-sweep")]
        if ch:
            sets += [(title + "seeds 0-2", samples_labels(ch), DEV_SEEDS, "samples-dev"),
                     (title + "seeds 10-15", samples_labels(ch), HELDOUT_SEEDS, "samples-heldout")]
        head = ["Chosen on the development seeds (chosen.json): " + ", ".join(
            f"{k} = {v}" for k, v in sorted(ch.items()) if k not in ("rule", "chosen_at")) +
            f"; rule: {ch.get('rule')}; written {ch.get('chosen_at')}.", ""] if ch else []
        return write_tables(results, head, sets, {}, "`python -m lab.benchmark report samples --results DIR` "
                            "from DIR/runs", ch.get("grpo_matched", ""))
    if only == "bounded":
        title = "Bounded twin term against the benchmark's estimator and GRPO, "
        return write_tables(results, [], [(title + "seeds 0-2", list(BOUNDED), DEV_SEEDS, "bounded-dev"),
                                          (title + "seeds 10-15", list(BOUNDED), HELDOUT_SEEDS,
                                           "bounded-heldout")], {},
                            "`python -m lab.benchmark report bounded --results DIR` from DIR/runs")
    path = os.path.join(results, "chosen.json")
    ch = json.load(open(path)) if os.path.isfile(path) else {}
    rename = {
        f"{lab}-360k": lab for lab in ("grpo", ch.get("best_twice"), ch.get("best_other")) if lab
    }
    sets = [("Sweep, development seeds 0-2", sweep_labels(), DEV_SEEDS, "sweep")]
    if os.path.isdir(os.path.join(results, "runs")):
        done = sorted(os.listdir(os.path.join(results, "runs")))
        omega = sorted({lab for lab in (d.rsplit("-seed", 1)[0] for d in done)
                        if lab.startswith("twice") and not lab.endswith(("-w1", "-360k"))
                        and "-cap" not in lab})
        sets[0] = (sets[0][0], sweep_labels() + omega, DEV_SEEDS, "sweep")
    if ch:
        sets += [("Every method, development seeds 0-2", dev_labels(ch), DEV_SEEDS, "dev"),
                 ("Every method, held-out seeds 10-15, 120k tokens", dev_labels(ch), HELDOUT_SEEDS,
                  "heldout"),
                 ("Three methods, held-out seeds 10-12, 360k tokens", list(rename), LONG_SEEDS,
                  "long")]
    head = ["Chosen on the development seeds (chosen.json): " + ", ".join(
        f"{k} = {v}" for k, v in sorted(ch.items()) if k not in ("rule", "chosen_at")) +
        f"; rule: {ch.get('rule')}; written {ch.get('chosen_at')}.", ""] if ch else []
    return write_tables(results, head, sets, rename)


def write_tables(results: str, head: list, sets: list, rename: dict,
                 made_by: str = "`python -m lab.benchmark report` from results/chains/runs", matched: str = "") -> str:
    lines = [f"# Benchmark tables (generated by {made_by}; do not edit)", ""] + head
    for title, labels, seeds, tag in sets:
        runs = collect(labels, seeds, results, need_all=False)
        runs = {rename.get(lab, lab): v for lab, v in runs.items()}
        walls = [
            json.load(open(os.path.join(run_dir(lab, s, results), "meta.json")))["wall_s"]
            for lab in labels for s in seeds
            if os.path.isfile(os.path.join(run_dir(lab, s, results), "meta.json"))
        ]
        # the seeds in its name may have grown
        for stale in glob.glob(os.path.join(results, f"{tag}_seeds*.png")):
            os.remove(stale)
        lines += section(title, runs, os.path.join(results, f"{tag}_seeds{{seeds}}.png"), matched)
        lines += [
            f"{len(walls)} of {len(labels) * len(seeds)} runs done; {sum(walls) / 3600:.2f} h of run time "
            "(one thread each, the sum over runs).", ""
        ]
    return write_text(os.path.join(results, "tables.md"), "\n".join(lines))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="lab/benchmark.py", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["run", "report", "plan"])
    parser.add_argument("set", nargs="?",
                        help="sweep, sweep-omega, dev, heldout, long, bounded, samples-sweep or samples (run, "
                             "plan; report: bounded or samples)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, one thread each")
    parser.add_argument("--world", default="",
                        help="the chains world folder (default: configs/chains.cfg's)")
    parser.add_argument("--scratch", default="runs/benchmark",
                        help="where runs write checkpoints and logs")
    parser.add_argument("--results", default=RESULTS, help="the committed outputs' folder")
    a = parser.parse_args(argv)
    if a.command == "report":
        print(build_report(a.results, a.set or ""))
        return 0
    if not a.set:
        parser.error(f"{a.command} needs a set: sweep, sweep-omega, dev, heldout or long")
    if a.command == "plan":
        for lab, s in plan(a.set, a.results):
            print(f"{'done' if finished(run_dir(lab, s, a.results)) else 'to do'}  {lab} seed {s}  "
                  f"{' '.join(flags(lab))}")
        return 0
    return run_set(a.set, a.jobs, a.world, a.scratch, a.results)


if __name__ == "__main__":
    raise SystemExit(main())
