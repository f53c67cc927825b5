"""Tables and plots of finished runs and audits (DESIGN.md section 2): it reads files
(metrics.jsonl, config.json, eval.py result files), never another module's internals.

Usage:
  python -m lab.report run runs/demo/twice                    # learning_curve.png, the summary table
  python -m lab.report compare runs/demo-compare/omega*-seed*  # a row per method, compare.png
  python -m lab.report methods runs/compare-methods/*-seed*    # every method at equal tokens, a PNG
  python -m lab.report paired [--base grpo] runs/compare-methods/*-seed*  # AUC, final EM vs base
  python -m lab.report paper GRPO=runs/x-grpo/eval TWICE=runs/x-twice/eval --paper 3b --out r.md
  python -m lab.report coupling runs/coupling-group runs/coupling-text  # audits' coupling, paired

EM is a fraction in [0, 1] in every table but `paper`'s, which is in percent, as the paper's own
figures are. `compare` and `paired` refuse runs set to different lengths (steps or token_budget).
"""
import argparse
import json
import math
import os
import sys

import numpy as np

from infra import console


def tokens_str(n: float) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}k" if n >= 1e4 else f"{n:.0f}"


def mean_sd(xs, spec=".3f") -> str:
    return f"{np.mean(xs):{spec}} +- {np.std(xs):{spec}}" if len(xs) > 1 else f"{xs[0]:{spec}}"


def read_rows(out_dir: str) -> list:
    with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def eval_curves(runs: list, evals: list) -> np.ndarray:
    """(seeds, evals) greedy eval EM of each run's metrics rows at each eval step."""
    return np.array([[
        next(r["eval_em"] for r in rows if r["step"] == s and "eval_em" in r) for s in evals
    ] for rows in runs])


# compare's row names (method_of's, the two of the paper in capitals)
LABELS = {"grpo": "GRPO", "twice": "TWICE", "twice-uncoupled": "TWICE uncoupled"}


def compare_runs(run_dirs) -> str:
    """Markdown comparison of finished runs grouped by method (method_of: config.json's method, and
    omega = 0 with method twice is GRPO; coupling off is "TWICE uncoupled"), mean +- sd over the
    seeds of each group: greedy eval EM at every eval step, mean sampled training reward, and
    generated tokens (factual + twin) relative to GRPO's. Runs of unequal length (steps or
    token_budget) or evaluated at other steps are refused. `python -m lab.report compare DIR...`."""
    groups, lengths, measured = {}, {}, {}
    for d in run_dirs:
        cfg, rows = json.load(open(os.path.join(d, "config.json"))), read_rows(d)
        groups.setdefault(LABELS.get(method_of(cfg), method_of(cfg)), []).append(rows)
        lengths.setdefault(run_length(cfg), []).append(d)
        measured[d] = [r["step"] for r in rows if "eval_em" in r]
    if len(lengths) > 1:
        raise SystemExit("lab/report.py compare: the runs differ in length (" + "; ".join(
            f"{n}: {', '.join(ds)}" for n, ds in lengths.items()) + "): compare runs of the same "
            "steps or token_budget")
    evals = sorted({s for steps in measured.values() for s in steps})
    for d, steps in measured.items():
        if steps != evals:
            raise SystemExit(
                f"lab/report.py compare: {d} was evaluated at steps {steps}, the runs together at "
                f"{evals}: compare runs with the same eval_every (runs evaluated by tokens: "
                "python -m lab.report methods)")
    head = ["method", "seeds"] + [f"EM@{s}" for s in evals] + [
        "train reward", "tokens / GRPO", "twins / step", "self-twins", "shortcuts"
    ]
    out = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    tokens = {}
    for name, runs in groups.items():
        tokens[name] = np.mean([
            sum(r.get("factual_tokens", 0) + r.get("aux_tokens", r.get("twin_tokens", 0))
                for r in rows) for rows in runs
        ])
    for name in sorted(groups, key=lambda n: (n != "GRPO", n == "TWICE", n)):
        runs = groups[name]
        steps = [[r for r in rows if "final" not in r] for rows in runs]
        em = [mean_sd(col) for col in eval_curves(runs, evals).T]
        twins = sum(r.get("twins", 0) for rows in steps for r in rows)
        cells = [
            name,
            str(len(runs)), *em,
            mean_sd([np.mean([r["reward"] for r in rows])
                     for rows in steps]), f"{tokens[name] / tokens['GRPO']:.2f}x"
            if "GRPO" in tokens else "-", f"{twins / max(1, sum(len(x) for x in steps)):.1f}",
            f"{sum(r.get('self_twins', 0) for rows in steps for r in rows) / max(twins, 1):.1%}",
            f"{sum(r.get('shortcuts', 0) for rows in steps for r in rows) / max(twins, 1):.1%}"
        ]
        out.append("| " + " | ".join(cells) + " |")
    plot_compare(groups, evals,
                 os.path.join(os.path.dirname(os.path.abspath(run_dirs[0])), "compare.png"))
    return "\n".join(out)


def plot_compare(groups: dict, evals: list, path: str):
    """compare.png next to the runs: greedy eval EM against the step, mean +- sd over seeds, one
    line per method."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, runs in sorted(groups.items()):
        em = eval_curves(runs, evals)  # (seeds, evals)
        ax.plot(evals, em.mean(0), marker="o", label=f"{name} ({len(runs)} seeds)")
        ax.fill_between(evals, em.mean(0) - em.std(0), em.mean(0) + em.std(0), alpha=0.2)
    ax.set(xlabel="step", ylabel="greedy EM (test)", title="GRPO vs TWICE, same seeds")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


# --- the paper-scale results table (`make reproduce-3b`): `python -m lab.report paper METHOD=PATH
# ...` ---

# Search-R1's column order and names
TEST_SETS = {
    "nq": "NQ", "triviaqa": "TriviaQA", "popqa": "PopQA", "hotpotqa": "HotpotQA",
    "2wikimultihopqa": "2wiki", "musique": "Musique", "bamboogle": "Bamboogle"
}
# arXiv 2610.31544: average EM in percent (the paper's unit; report_table converts ours to it) over
# the seven sets; its per-set figures are not available to us
PAPER_AVG_EM = {"3b": {"GRPO": 37.4, "TWICE": 42.7}, "7b": {"GRPO": 42.0, "TWICE": 46.5}}


def _result_files(path: str) -> list:
    if os.path.isdir(path):
        return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".json"))
    return [path]


def report_table(results_jsons: dict, paper: dict = None) -> str:
    """Markdown table in the paper's layout: one row per method, EM (%) per test set and the
    unweighted average over the sets (Search-R1's "Avg."), then TWICE - GRPO style differences of
    the first two methods and the paper's averages. results_jsons: {method: [eval.py --out files, or
    folders of them]}; paper: {method: average EM (%)}. The one table in percent, because the
    paper's figures are: eval.py's files hold EM as a fraction in [0, 1] (as every other table of
    the project), multiplied by 100 here, at display."""
    per = {}
    for method, paths in results_jsons.items():
        per[method] = {}
        for path in (f for p in paths for f in _result_files(p)):
            with open(path, encoding="utf-8") as f:
                result = json.load(f)
            if "per_source" not in result:
                raise ValueError(f"{path}: not an `eval.py --out` file (no field 'per_source')")
            for source, v in result["per_source"].items():
                if source in per[method]:
                    raise ValueError(f"{path}: {source} is scored twice for {method}")
                per[method][source] = (v["n"], 100 * v["em"])
        if not per[method]:
            raise ValueError(f"{method}: no results in {paths}")
    seen = {s for scores in per.values() for s in scores}
    cols = [s for s in TEST_SETS if s in seen] + sorted(seen - set(TEST_SETS))
    lines = ["| method | " + " | ".join(TEST_SETS.get(s, s) for s in cols) + " | Avg. |",
             "|---|" + "---:|" * (len(cols) + 1)]
    avgs = {}
    for method, scores in per.items():
        avgs[method] = sum(em for _, em in scores.values()) / len(scores)
        partial = "" if len(scores) == len(cols) else f" ({len(scores)}/{len(cols)} sets)"
        cells = [f"{scores[s][1]:.1f}" if s in scores else "-" for s in cols]
        lines.append(f"| {method} | " + " | ".join(cells) + f" | **{avgs[method]:.1f}**{partial} |")
    if len(per) >= 2:
        (a, sa), (b, sb) = list(per.items())[:2]
        cells = [f"{sb[s][1] - sa[s][1]:+.1f}" if s in sa and s in sb else "-" for s in cols]
        lines.append(f"| {b} - {a} | " + " | ".join(cells) + f" | {avgs[b] - avgs[a]:+.1f} |")
    for method, avg in (paper or {}).items():
        lines.append(f"| {method} (paper) | " + " | ".join("-" for _ in cols) + f" | {avg:.1f} |")
    counts = {s: n for scores in per.values() for s, (n, _) in scores.items()}
    lines.append("| questions | " + " | ".join(str(counts[s]) for s in cols) + " | |")
    return "\n".join(lines)


def paper_main(argv=None):
    ap = argparse.ArgumentParser(
        description="GRPO vs TWICE table from eval.py --out files (the paper's layout).")
    ap.add_argument("results", nargs="+",
                    help="METHOD=PATH[,PATH...]: result files or folders of them")
    ap.add_argument("--paper", choices=sorted(PAPER_AVG_EM) + ["none"], default="none",
                    help="add the paper's rows")
    ap.add_argument("--out", default="", help="write the markdown here as well")
    args = ap.parse_args(argv)
    runs = {}
    for item in args.results:
        method, sep, paths = item.partition("=")
        if not sep or not paths:
            ap.error(f"expected METHOD=PATH, got {item!r}")
        runs[method] = paths.split(",")
    paper = PAPER_AVG_EM.get(args.paper, {})
    model = f" (Qwen2.5-{args.paper.upper()})" if paper else ""
    text = (
        f"# Exact match (%) on the seven test sets{model}\n\n{report_table(runs, paper)}\n\n"
        "Greedy decoding, one sample per question, exact match after SQuAD normalisation; Avg. is "
        "the unweighted mean over the test sets. EM in percent, as the paper reports it: eval.py's "
        "files hold fractions in [0, 1], multiplied by 100 here. Paper rows: arXiv 2610.31544, "
        "average only (its per-set figures are not available here).\n")
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    return text


# --- every method at equal generated tokens (`make compare-methods`) ---

def method_of(cfg: dict) -> str:
    """A run's row name: its method (config.json's `method`; omega = 0 with method twice, or no
    method field, is GRPO, as train_twice.Config.resolve rules); VinePPO with its K (a knob swept on
    seeds 0-2), uncoupled TWICE apart."""
    method = cfg.get("method", "twice")
    if method == "twice" and cfg.get("omega") == 0:
        return "grpo"
    if method == "vineppo" and "vine_k" in cfg:
        return f"vineppo K={cfg['vine_k']}"
    return "twice-uncoupled" if method == "twice" and not cfg.get("coupling", True) else method


def run_length(cfg: dict) -> str:
    """What a run was set to spend (config.json): its token_budget, else its steps."""
    return (f"token_budget {cfg['token_budget']}" if cfg.get("token_budget") else
            f"{cfg.get('steps')} steps")


def em_vs_tokens(rows: list) -> list:
    """[(generated tokens when measured, greedy EM)] of a run: a step's eval runs before that step's
    tokens."""
    points, before = [], 0
    for r in rows:
        if "eval_em" in r:
            points.append((r["tokens"] if r.get("final") else before, r["eval_em"]))
        before = r.get("tokens", before)
    return points


def em_at(points: list, tokens: float) -> float:
    """EM of the last evaluation at or before `tokens` (a step function)."""
    return max((p for p in points if p[0] <= tokens), default=(0, float("nan")))[1]


def auc(points: list, budget: float) -> float:
    """Mean EM over [0, budget] generated tokens of the step function em_at (area / budget)."""
    xs = sorted({0.0, budget, *[t for t, _ in points if t < budget]})
    return sum(em_at(points, a) * (b - a) for a, b in zip(xs, xs[1:])) / budget


def load_run(d: str) -> tuple:
    """(config, metrics rows) of a benchmark run folder; a clear error if it is not one, a warning
    if unfinished."""
    if not os.path.isfile(os.path.join(d, "config.json")) or not os.path.isfile(
            os.path.join(d, "metrics.jsonl")):
        raise SystemExit(
            f"lab/report.py: {d} is not a run folder (no config.json or metrics.jsonl): was the run "
            "started? make compare-methods runs the missing ones")
    cfg, rows = json.load(open(os.path.join(d, "config.json"))), read_rows(d)
    if not any(r.get("final") for r in rows):
        print(
            f"lab/report.py: warning: {d} has not finished (no final evaluation); its last evaluation is used as its "
            "final EM", file=sys.stderr)
    return cfg, rows


def load_runs(run_dirs) -> dict:
    """{method: [(config, rows)]} of benchmark run folders (load_run), grouped by method_of."""
    runs = {}
    for d in run_dirs:
        cfg, rows = load_run(d)
        runs.setdefault(method_of(cfg), []).append((cfg, rows))
    return runs


def shared_budget(runs: dict) -> float:
    """The token budget of a set of runs {method: [(cfg, rows)]}: the largest token_budget (or
    tokens reached)."""
    return max(cfg["token_budget"] or max(r.get("tokens", 0) for r in rows) for m in runs.values()
               for cfg, rows in m)


def paired(run_dirs, base: str = "grpo", runs: dict = None) -> str:
    """Markdown: per method, AUC and final EM as mean +- standard error over its seeds (sd with ddof
    1 / sqrt(n)), and their differences from the `base` method's run of the same seed (paired: same
    prompts, same warm start). `runs` ({name: [(config, rows)]}) replaces the folders' grouping by
    method (lab/benchmark.py names its runs)."""
    runs = load_runs(run_dirs) if runs is None else runs
    if base not in runs:
        raise SystemExit(f"lab/report.py paired: no {base} run among the folders: the differences "
                         "are taken from it")
    refuse_unpaired(runs, base)
    budget = shared_budget(runs)
    stats = {
        m: {
            cfg["seed"]: (auc(c, budget), c[-1][1]) for cfg, rows in seeds
            for c in [em_vs_tokens(rows)]
        } for m, seeds in runs.items()
    }

    def se(x, sign=""):  # n/a: an AUC without an evaluation before the first step (below)
        if not np.isfinite(x).all():
            return "n/a"
        return f"{np.mean(x):{sign}.3f} +- {np.std(x, ddof=1) / np.sqrt(len(x)):.3f}" \
            if len(x) > 1 else f"{x[0]:{sign}.3f}"

    out = [
        f"| method | seeds | AUC | final EM | AUC - {base}'s (paired) | final EM - {base}'s "
        "(paired) |", "|---|---:|---:|---:|---:|---:|"
    ]
    for m in sorted(stats, key=lambda m: -np.nan_to_num(np.mean([a for a, _ in stats[m].values()]),
                                                         nan=-np.inf)):
        both = [s for s in stats[m] if s in stats[base]]
        diff = [[stats[m][s][k] - stats[base][s][k] for s in both] for k in (0, 1)]
        out.append(f"| {m} | {len(stats[m])} | {se([a for a, _ in stats[m].values()])} | "
                   f"{se([f for _, f in stats[m].values()])} | " +
                   (" | ".join(se(x, "+") for x in diff) if m != base and both else "- | -") + " |")
    late = [f"{m} seed {s}" for m in stats for s, (a, _) in stats[m].items() if not np.isfinite(a)]
    if late:
        out += ["", f"AUC n/a: {', '.join(late)} not evaluated before the first step, so the area "
                "under EM-vs-tokens has no start (eval_every > 0 or eval_tokens > 0 evaluates there)"]
    return "\n".join(out)


def refuse_unpaired(runs: dict, base: str):
    """SystemExit naming every pair of runs ({name: [(config, rows)]}) that paired() cannot
    compare: a run and its seed's base run set to different lengths (steps or token_budget)."""
    length = {(m, cfg.get("seed")): run_length(cfg) for m, seeds in runs.items() for cfg, _ in seeds}
    bad = [f"{m} seed {s} ran {n}, {base} seed {s} {length[base, s]}"
           for (m, s), n in length.items() if (base, s) in length and n != length[base, s]]
    if bad:
        raise SystemExit(f"lab/report.py paired: runs of unequal length in a pair ({'; '.join(bad)})"
                         ": a paired difference needs runs of the same steps or token_budget")


def compare_methods(run_dirs, checkpoints: int = 4, png: str = "", runs: dict = None) -> str:
    """Markdown: one row per method (mean +- sd over seeds): greedy EM at `checkpoints` equally
    spaced token counts up to the shared budget, area under EM-vs-tokens, final EM and the tokens it
    was measured at (mean), tokens to reach GRPO's final EM, steps, wall time; and a PNG of EM
    against generated tokens (mean, sd band). `png` may hold "{seeds}", filled with the runs' seeds
    ("0-1-2"). `runs` as in paired."""
    runs = load_runs(run_dirs) if runs is None else runs
    budget = shared_budget(runs)
    marks = [budget * (k + 1) / checkpoints for k in range(checkpoints)]
    grpo_final = np.mean([em_vs_tokens(rows)[-1][1]
                          for _, rows in runs.get("grpo", [])]) if "grpo" in runs else None
    # the final evaluation runs after the step that crossed the budget, so it lies past the last
    # mark: its own column
    head = [
        "method", "seeds", *[f"EM@{tokens_str(m)}" for m in marks], "AUC", "final EM",
        "final tokens", "tokens to GRPO's final", "steps", "wall min"
    ]
    out = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for name in sorted(runs, key=lambda n: (n != "grpo", n != "twice", n)):
        curves = [em_vs_tokens(rows) for _, rows in runs[name]]
        reach = [
            next((t for t, em in c if grpo_final is not None and em >= grpo_final), np.nan)
            for c in curves
        ]
        cells = [name, str(len(curves))]
        cells += [mean_sd([em_at(c, m) for c in curves])
                  for m in marks] + [mean_sd([auc(c, budget) for c in curves])]
        cells += [
            mean_sd([c[-1][1] for c in curves]),
            tokens_str(np.mean([c[-1][0] for c in curves]))
        ]
        reached = np.isfinite(reach)
        cells.append("-" if grpo_final is None else "never" if not reached.any() else
                     f"{tokens_str(np.nanmean(reach))} ({reached.sum()}/{len(reach)} reach)")
        cells.append(mean_sd([max(r["step"] for r in rows) for _, rows in runs[name]], ".0f"))
        cells.append(
            mean_sd([sum(r.get("time", 0) for r in rows) / 60 for _, rows in runs[name]], ".1f"))
        out.append("| " + " | ".join(cells) + " |")
    if png:
        seeds = sorted({cfg["seed"] for m in runs.values() for cfg, _ in m})
        plot_em_vs_tokens(runs, budget, png.replace("{seeds}", "-".join(map(str, seeds))))
    return "\n".join(out)


def plot_em_vs_tokens(runs: dict, budget: float, path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    grid = np.linspace(0, budget, 200)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = plt.get_cmap("tab20").colors  # 13 methods: no colour twice (the default cycle has 10)
    for i, name in enumerate(sorted(runs, key=lambda n: (n != "grpo", n != "twice", n))):
        # (seeds, grid)
        em = np.array([[em_at(em_vs_tokens(rows), x) for x in grid] for _, rows in runs[name]])
        # the comparison the project exists for: bold, with its sd band
        main = name in ("grpo", "twice")
        ax.plot(grid, em.mean(0), color=colors[2 * i % 20 + i // 10], lw=2.4 if main else 1.2,
                ls="-" if main or i % 2 else "--", label=f"{name} ({len(runs[name])} seeds)")
        ax.fill_between(grid,
                        em.mean(0) - em.std(0),
                        em.mean(0) + em.std(0), color=colors[2 * i % 20 + i // 10],
                        alpha=0.15 if main else 0.05)
    ax.set(xlabel="generated tokens (factual + auxiliary)", ylabel="greedy EM (test)",
           title="every method at equal generated tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------------
# The credit audit's report (lab/audit.py writes audit.json; these turn it into audit.md and
# audit_scatter.png)

def vine_tokens_at(metrics, vines, corr):
    """VinePPO's aux tokens per decision at correlation `corr`, interpolated linearly in K between
    the measured K (tokens are linear in K); (tokens, how): how "interpolated", "<smallest K>
    already", or None past the largest K (then the largest K's tokens, a lower bound)."""
    pts = [(metrics[v]["corr"], metrics[v]["aux_tokens"]) for v in vines]
    if not math.isfinite(corr):
        return math.nan, "n/a"
    if corr <= pts[0][0]:
        return pts[0][1], f"{vines[0]} already"
    for (c0, t0), (c1, t1) in zip(pts, pts[1:]):
        if c0 < corr <= c1:
            return t0 + (t1 - t0) * (corr - c0) / (c1 - c0), "interpolated"
    return pts[-1][1], None


def fmt(x, spec=".3f") -> str:
    """A number for the audit's tables: spec "%" is a percentage; NaN / None is n/a."""
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{100 * x:.1f}%" if spec == "%" else f"{x:{spec}}"


def audit_table(metrics: dict) -> list:
    """Markdown rows; wrong-sign and corr carry their bootstrap SE over decisions
    (audit_scores.bootstrap_se) where it exists."""
    cols = (("wrong_sign", "%"), ("wrong_sign_mean", "%"), ("zero", "%"), ("corr", ".3f"),
            ("corr_mean", ".3f"), ("var", ".3f"), ("aux_tokens", ".1f"))
    cell = lambda r, k, s: fmt(r[k], s) + (f" +- {fmt(r[k + '_se'], s)}" if r.get(k + "_se") is not None  # noqa: E731
                                           and math.isfinite(r[k + "_se"]) else "")
    return [
        "| estimator | wrong-sign | wrong-sign (mean of R) | zero | corr | corr (mean of R) | var over repeats | "
        "aux tokens / decision | total tokens / GRPO |", "|---|" + "---:|" * 8
    ] + [
        f"| {name} | " + " | ".join(cell(r, k, s)
                                    for k, s in cols) + f" | {fmt(r['total_vs_grpo'], '.2f')}x |"
        for name, r in metrics.items()
    ]


def ceiling(var_a, var) -> float:
    """The highest Pearson correlation with A* that an unbiased estimate with within-decision
    variance `var` can have (oracle noise ignored): sqrt(Var(A*) / (Var(A*) + var))."""
    total = var_a + var
    return math.sqrt(var_a / total) if total > 0 and math.isfinite(total) else math.nan


def audit_report(res: dict) -> str:
    """audit.md: the estimator table, the paper's figures next to ours, coupling, shortcut, oracle,
    targets."""
    m, cfg, o, cp, sc = res["metrics"], res["config"], res["oracle"], res["coupling"], res[
        "shortcut"]
    tw, ind, bud, vines = m["TWICE"], m["independent"], m["TWICE budgeted"], res["vines"]
    tokens, how = vine_tokens_at(m, vines, tw["corr"])
    at = f"VinePPO at TWICE's corr ({how}: {tokens:.1f} tokens)" if how else f"{vines[-1]} (below TWICE's corr)"
    return "\n".join([
        f"# Credit audit: {cfg['model']} on {cfg['data']}", "",
        f"{o['decisions']} decisions ({res['episodes']} episodes), M = {cfg['oracle_rollouts']} oracle rollouts per "
        f"side, R = {cfg['repeats']} repeats; wrong-sign over the {o['above_threshold']} decisions with |A*| > "
        f"{cfg['threshold']}; {res['times']['total_s']:.0f} s.", "", *audit_table(m), "",
        "| paper figure | paper | this audit |", "|---|---|---|",
        f"| wrong-sign, independent -> TWICE | 21.7% -> 6.9% | {fmt(ind['wrong_sign'], '%')} -> "
        f"{fmt(tw['wrong_sign'], '%')} |",
        f"| corr with A*, independent -> TWICE | 0.46 -> 0.72 | {fmt(ind['corr'])} -> {fmt(tw['corr'])} |",
        f"| aux tokens vs VinePPO | 68% fewer | {fmt(1 - tw['aux_tokens'] / tokens, '%')} fewer than {at}; "
        + ", ".join(f"{fmt(1 - tw['aux_tokens'] / m[v]['aux_tokens'], '%')} fewer than {v}"
                    for v in vines) + " |",
        f"| total tokens vs GRPO | 1.70x | {fmt(bud['total_vs_grpo'], '.2f')}x budgeted, "
        f"{fmt(tw['total_vs_grpo'], '.2f')}x with a twin at every decision |", "",
        f"- GRPO: {res['grpo_group_tokens']:.1f} tokens per prompt for G = {cfg['group_size']} lines, the factual "
        "batch itself (0 auxiliary tokens); its estimates are in normalised units.",
        f"- Coupling: rho = {fmt(cp['rho'])}; Var(coupled D) / Var(independent D) predicted 1 - rho = "
        f"{fmt(cp['predicted_ratio'])} (DESIGN, equal spreads), {fmt(cp['predicted_ratio_unequal'])} with the measured "
        f"spreads of U ({fmt(cp['sd_u'])}) and U' ({fmt(cp['sd_u_twin'])}); measured {fmt(cp['measured_ratio'])}. "
        f"Twin outcome equals the factual outcome: {fmt(cp['agree_coupled'], '%')} coupled, "
        f"{fmt(cp['agree_independent'], '%')} independent. Token agreement after the decision (equal tokens at equal "
        f"positions of the later turns; keys read with line = {cfg.get('line_keys', 'group')}): "
        f"{fmt(cp.get('token_agreement_coupled'), '%')} coupled, {fmt(cp.get('token_agreement_independent'), '%')} "
        "independent.", *audit_fork_notes(res),
        f"- Same-evidence shortcut: fires on {fmt(sc['fire_rate'], '%')} of twins ({sc['decisions_fired']} "
        f"decisions); per-decision bias mean |b| {sc['mean_abs_bias']:.4f} +- {sc['mean_abs_bias_se']:.4f} (SE over "
        f"decisions; noise floor {sc['noise_floor']:.4f}, signed mean {sc['signed_mean_bias']:+.4f}); saves "
        f"{sc['tokens_saved_per_decision']:.1f} twin tokens per decision ({fmt(sc['tokens_saved_share'], '%')}).",
        f"- Oracle: mean SE of A* {o['mean_se']:.3f}; expected share of thresholded decisions whose A* has the wrong "
        f"sign itself {fmt(o['sign_noise_floor'], '%')}; reliability 1 - mean SE^2 / Var(A*) {fmt(o['reliability'])}.",
        "- Correlation ceiling of one unbiased estimate with variance v: sqrt(Var(A*) / (Var(A*) + v)), Var(A*) = "
        f"{o['var_a']:.3f}: " + ", ".join(f"{n} {fmt(ceiling(o['var_a'], m[n]['var']))}"
                                          for n in ("TWICE", "independent", "VinePPO K=1")
                                          if n in m) + ".",
        f"- Budgeted TWICE: sqrt rule, twin_budget {cfg['twin_budget']}, mean q {res['budget_q_mean']:.2f}, "
        "discordance cross-fitted on the other half of the episodes.", *audit_method_notes(res),
        "- Correlation differences, paired bootstrap over decisions (SE): " + "; ".join(
            f"{k} {fmt(d, '+.3f')} +- {fmt(se)}"
            for k, (d, se) in res.get("corr_differences", {}).items()) + ".", "",
        "Targets: " + ", ".join(f"{k} {'MET' if v else 'NOT met'}"
                                for k, v in res["targets"].items()), ""
    ])


def audit_fork_notes(res) -> list:
    """The report's lines on the discordance predictors and the token forks."""
    pr = res.get("predictors", {})
    lines = [
        "- Discordance predictors, scored on twins they never saw: " +
        "; ".join(f"{unit} AUC {fmt(x['auc'])}, Brier {fmt(x['brier'])}"
                  for unit, x in pr.items()) + "."
    ] if pr else []
    if "TWICE token" in res["metrics"]:
        lines.append(
            f"- Token forks (forks.py): fork floor {res['config']['fork_floor']}; the factual luck re-drawn "
            "after the fork token in every repeat; the first pass draws k from the prior law (r ~ 1 - pi, "
            "floored), the second from a token predictor cross-fitted on the first pass (other half of the "
            "episodes); 'budgeted' applies the sqrt rule to the second pass's fork laws. Token agreement "
            "after the fork token (rest of its turn and the later turns): " +
            ", ".join(fmt(x, "%")
                      for x in res.get("fork_token_agreement") or []) + " (first, second pass).")
    return lines


def audit_method_notes(res) -> list:
    """The report's lines on the method rows: their preset and the learned estimators' pre-training.
    """
    if not res["method_config"]:
        return []
    mc, cfg = res["method_config"], res["config"]
    lines = [(
        f"- Method rows: their own turn_advantages on the groups [F_r, G-1 fresh lines] of each decision's "
        f"turn and repeat, knobs of {cfg['train_config'] or 'train_twice.Config'} (omega {mc['omega']}, "
        f"step_gamma {mc['step_gamma']}, gamma {mc['gamma']}, estimator lr "
        f"{mc['lr'] * mc['estimator_lr_scale']:g}); GiGPO and HGPO include the episode term A^E; aux tokens: "
        "each call's aux_tokens per decision.")]
    for name, rec in res["learned"].items():
        loss = rec["losses"]
        lines.append(
            f"- {name}: estimator trained {rec['steps']} trainer steps first ({rec['prompts_per_step']} "
            f"prompts each, of {rec['questions']} questions not audited), estimator loss " +
            (f"{loss[0]:.4f} (step 0) -> {min(loss):.4f} (min) -> {loss[-1]:.4f} (last)"
             if loss else "n/a") +
            f"; that training generated {rec['rollout_tokens']} episode + {rec['aux_tokens']} aux tokens "
            "(not in the table).")
    return lines


# audit.json token_agreement columns
COUPLING = (("coupled", 0), ("independent", 2), ("fork, learnt law", 6))


def coupling_samples(folder: str) -> dict:
    """{(question, turn): (token_agreement counts, coupled D, independent D)} of an audit folder's
    audit.json."""
    with open(os.path.join(folder, "audit.json"), encoding="utf-8") as f:
        res = json.load(f)
    if any("token_agreement" not in d for d in res["decisions"]):
        raise SystemExit(
            f"{folder}/audit.json has no per-decision token_agreement (an audit from before it): rerun it"
        )
    return res, {(d["question"], d["turn"]): (np.array(d["token_agreement"], dtype=float),
                                              np.array(d["estimates"]["TWICE no shortcut"],
                                                       dtype=float),
                                              np.array(d["estimates"]["independent"], dtype=float))
                 for d in res["decisions"]}


def coupling_figures(rows: list) -> dict:
    """Token agreement after the decision (pooled counts) and Var(coupled D) / Var(independent D)
    (means of the per-decision variances over repeats) of a list of coupling_samples values."""
    out = {
        name: sum(r[0][c] for r in rows) / max(sum(r[0][c + 1] for r in rows), 1)
        for name, c in COUPLING if all(len(r[0]) > c + 1 for r in rows)
    }
    out["var ratio"] = np.mean([r[1].var(ddof=1)
                                for r in rows]) / np.mean([r[2].var(ddof=1) for r in rows])
    return out


def compare_coupling(folders: list, draws: int = 2000, seed: int = 0) -> str:
    """The coupling figures of audits (e.g. --line_keys group and text) with bootstrap SEs over
    decisions, and each audit minus the first on the decisions they share (matched by question and
    turn, resampled together)."""
    runs = [coupling_samples(f) for f in folders]
    idx_of = lambda n: np.random.default_rng(seed).integers(0, n, (draws, n))  # noqa: E731
    lines = [
        "| audit | line keys | decisions | " +
        " | ".join(coupling_figures(list(runs[0][1].values()))) + " |"
    ]
    lines.append("|---" * (len(lines[0].split("|")) - 2) + "|")
    for folder, (res, rows) in zip(folders, runs):
        vals, idx = list(rows.values()), idx_of(len(rows))
        fig, boot = coupling_figures(vals), [coupling_figures([vals[i] for i in b]) for b in idx]
        lines.append(f"| {folder} | {res['config'].get('line_keys', 'group')} | {len(vals)} | " +
                     " | ".join(f"{v:.3f} +- {np.std([b[k] for b in boot], ddof=1):.3f}"
                                for k, v in fig.items()) + " |")
    for folder, (_, rows) in zip(folders[1:], runs[1:]):
        shared = [k for k in runs[0][1] if k in rows]
        a, b, idx = [runs[0][1][k] for k in shared], [rows[k] for k in shared], idx_of(len(shared))
        diff = lambda i: {k: v - coupling_figures([a[j] for j in i])[k]  # noqa: E731
                          for k, v in coupling_figures([b[j] for j in i]).items()}
        boot = [diff(i) for i in idx]
        lines.append(f"| {folder} - {folders[0]} (paired) | | {len(shared)} | " +
                     " | ".join(f"{v:+.3f} +- {np.std([x[k] for x in boot], ddof=1):.3f}"
                                for k, v in diff(range(len(shared))).items()) + " |")
    return "\n".join(lines)


def audit_scatter(path: str, a, ests: dict, metrics: dict):
    """Estimate against oracle A*, one panel per estimator: single repeats (jittered) and repeat
    means."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = math.ceil(len(ests) / 4)
    fig, axes = plt.subplots(rows, 4, figsize=(16, 3.6 * rows), squeeze=False)
    jitter = np.random.default_rng(0)
    for ax, (name, est) in zip(axes.flat, ests.items()):
        R = est.shape[1]
        ax.scatter(np.repeat(a, R),
                   est.ravel() + jitter.normal(0, 0.02, est.size), s=3, alpha=0.2,
                   label="one repeat")
        ax.scatter(a, est.mean(1), s=7, c="C3", label=f"mean of {R}")
        ax.axline((0, 0), slope=1, color="k", lw=0.6)
        ax.set(title=f"{name}: corr {fmt(metrics[name]['corr'], '.2f')}", xlabel="oracle A*",
               ylabel="estimate")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    for ax in axes.flat[len(ests):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    commands = {
        "run": lambda a: print(console.finish_run(a[0])),
        "compare": lambda a: print(compare_runs(a)), "methods": lambda a: print(
            compare_methods(
                a, png=os.path.join(os.path.dirname(os.path.abspath(a[0])),
                                    "compare_methods_seeds{seeds}.png"))), "paper": paper_main,
        "paired": lambda a: print(paired(a[2:], base=a[1]) if a[0] == "--base" else paired(a)),
        "coupling": lambda a: print(compare_coupling(a))
    }
    if not argv or argv[0] not in commands or (argv[0] != "paper" and
                                               len(argv) < 2) or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv[:1] in (["-h"], ["--help"]) else 2)
    commands[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
