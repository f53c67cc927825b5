"""The credit frontier on luck-high (RESULTS.md "The credit frontier"): at equal updates, the EM each credit estimator
gains per update over GRPO against the tokens it generates per update, beside the same tokens spent on more rows.

    python -m lab.frontier run [--seeds dev|heldout] [--jobs 2] [--only LABEL,...]   # the missing runs
    python -m lab.frontier plan [--seeds dev|heldout]                                # the runs, done or to do
    python -m lab.frontier report       # results/frontier/tables.md, figures/frontier.png, figures/frontier_curves.png

Every run is lab/benchmark.py's `run_one` on worlds/luck-high-0 (configs/chains.cfg + configs/compare-methods.cfg and
the label's flags, benchmark.flags), then FLAGS: N = 20 updates whatever they cost in tokens (past GRPO's take-off at
13-17 updates), greedy EM on the 120 test questions before updates 0, 2, ..., 18 and after the 20th. Tokens per
update are measured from each run's metrics.jsonl, never estimated: factual tokens, auxiliary tokens (twins,
continuations) and the oracle's rollouts (which the oracle's own runs do not charge: methods/oracle.py).

The arms, dev seeds 0-2, in the order they run (`stages`; (g) after the Monte Carlo arms, G = 128 last):
  rows         GRPO at G = 5, 9, 16, 32, 64 lines per prompt: the tokens spent on more samples (and G = 128 last,
               which takes the rows line past the cost of K = 16 coupled twins)
  coupled      TWICE's ladder, each rung one change from the one before: (a) the paper's budget 0.7, K = 1, A_traj
               plus the twin term; (b) the twin term in place of A_traj (traj_term = false, as the oracle alone uses
               A*); (c) every decision branched (q = 1, budget_rule = all); (d) and K = 4 twins; (e) K = 16
  variants     (f) the best coupled rung without the same-evidence shortcut; (g) it with its twins as rows too
  independent  (c)-(e) with fresh keys for y' and after it (--method=independent: self-twins rolled out, no shortcut)
  mc           the oracle's Monte Carlo A* at M = 1, 4, 16 rollouts per side; VinePPO at K = 2 and its preset's 9
The best coupled rung of (a)-(e) (the highest mean EM after N updates over the dev seeds) goes to
results/frontier/chosen.json once (a)-(e) are done, before (f) and (g) run. Once every dev run is done, the held-out
arms (seeds 10-15) go there too, from the dev seeds alone: the cheapest coupled configuration that takes half of the
oracle M = 16's gain (else the best), its independent counterpart, the rows arm of its cost (G = round(5 x its tokens
per update / GRPO's), the credit suite's GRPO-matched rule), GRPO and the oracle M = 16. Neither is ever rewritten.

The report is a function of results/frontier/runs alone: per arm its tokens per update (factual, auxiliary, over
GRPO's), EM after N updates and the mean EM over updates 0..N, each paired by seed against GRPO (the same rows), its
share of the oracle M = 16's gain, and its gain against the rows line at its own cost: per seed, the rows arms' gains
interpolated linearly in log tokens per update (nothing outside the rows' range of cost). A run is used only if it
made N updates on this schedule.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from lab import benchmark, suite

ROOT = benchmark.ROOT
WORLD = "luck-high"
RESULTS = os.path.join(ROOT, "results", "frontier")
FIGURE = os.path.join(ROOT, "figures", "frontier.png")
CURVES = os.path.join(ROOT, "figures", "frontier_curves.png")
N = 20  # updates every arm makes
EVERY = 2  # updates between greedy evaluations
FLAGS = [f"--steps={N}", "--token_budget=0", f"--eval_every={EVERY}", "--eval_tokens=0", "--log_grad_share=false"]
GRPO, ORACLE = "grpo", "oracle-m16"
ROWS = ("grpo", "grpo-g9", "grpo-g16", "grpo-g32", "grpo-g64", "grpo-g128")
LADDER = {"a": "twice-turn-b0.7-w1-cap2", "b": "twice-turn-b0.7-w1-cap2-solo", "c": "twice-turn-q1-w1-cap2-solo",
          "d": "twice-turn-q1-w1-cap2-solo-k4", "e": "twice-turn-q1-w1-cap2-solo-k16"}
MC = ("oracle-m1", "oracle-m4", ORACLE, "vineppo-k2", "vineppo-k9")
FAMILIES = ("rows", "coupled", "independent", "oracle", "vineppo")


def counterpart(label: str) -> str:
    """The independent counterfactual of a coupled label at the same decisions and K (never a shortcut to drop)."""
    return label.replace("twice-turn-", "independent-").replace("-noshort", "")


INDEPENDENT = tuple(counterpart(LADDER[r]) for r in "cde")


def family(label: str) -> str:
    if label.startswith("grpo"):
        return "rows"
    return {"twice": "coupled", "independent": "independent", "oracle": "oracle",
            "vineppo": "vineppo"}[label.split("-")[0]]


def rung(label: str, ch: dict) -> str:
    """A label's short name on the figure: the ladder's letter, G, M or K."""
    letters = {**{v: k for k, v in LADDER.items()}, **{counterpart(v): k for k, v in LADDER.items()}}
    best = ch.get("best_coupled", "")
    letters.update({f"{best}-noshort": "f", f"{best}-data": "g"} if best else {})
    if label in letters:
        return letters[label]
    if label.startswith("grpo"):
        return f"G={label[6:] if label != GRPO else 5}"
    return f"{'M' if label.startswith('oracle') else 'K'}={label.split('-')[1][1:]}"


# --- the plan ---

def done(label: str, seed: int) -> bool:
    return benchmark.finished(benchmark.run_dir(label, seed, RESULTS))


def chosen() -> dict:
    path = os.path.join(RESULTS, "chosen.json")
    return json.load(open(path)) if os.path.isfile(path) else {}


def choose() -> dict:
    """chosen.json, with each choice written the first time the dev runs it needs are all done (never rewritten)."""
    ch = chosen()
    new = dict(ch)
    dev = benchmark.DEV_SEEDS
    if "best_coupled" not in ch and all(done(lab, s) for lab in LADDER.values() for s in dev):
        runs = load(list(LADDER.values()), dev)
        new["best_coupled"] = max(LADDER.values(), key=lambda lab: np.mean([final_em(r) for r in runs[lab]]))
    if "heldout" not in new and "best_coupled" in new and all(done(lab, s) for lab in dev_labels(new) for s in dev):
        new.update(heldout_choice(new))
    if new != ch:
        new["rule"] = ("best_coupled: the highest mean EM after N updates over seeds 0-2 among (a)-(e); heldout: the "
                       "cheapest coupled configuration whose mean gain over GRPO after N updates is at least half the "
                       "oracle M = 16's (else the highest), its independent counterpart, GRPO at G = round(5 x its "
                       "tokens per update / GRPO's), GRPO and the oracle M = 16")
        new.setdefault("chosen_at", {})
        for key in set(new) - set(ch) - {"rule", "chosen_at"}:
            new["chosen_at"][key] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        benchmark.write_json(os.path.join(RESULTS, "chosen.json"), new)
    return new


def variants(ch: dict) -> list:
    best = ch.get("best_coupled")
    return [f"{best}-noshort", f"{best}-data"] if best else []


def dev_labels(ch: dict) -> list:
    return [*ROWS, *LADDER.values(), *variants(ch), *INDEPENDENT, *MC]


def heldout_choice(ch: dict) -> dict:
    """The held-out arms, from the dev runs alone (the module docstring)."""
    dev = benchmark.DEV_SEEDS
    coupled = [*LADDER.values(), *variants(ch)]
    runs = load([GRPO, ORACLE, *coupled], dev)
    gains = {lab: np.mean(paired(runs, lab, GRPO)) for lab in coupled}
    cost = {lab: cost_ratio(runs[lab], runs[GRPO]) for lab in coupled}
    half = 0.5 * np.mean(paired(runs, ORACLE, GRPO))
    taking = [lab for lab in coupled if gains[lab] >= half]
    pick = min(taking, key=cost.get) if taking else max(coupled, key=gains.get)
    rows = f"grpo-g{round(5 * cost[pick])}"
    return {"heldout_coupled": pick, "heldout_takes_half": bool(taking),
            "heldout": list(dict.fromkeys([GRPO, pick, counterpart(pick), rows, ORACLE]))}


def stages(seeds: str) -> list:
    """[[(label, seed)]], one list per stage, seed-major within it; a stage whose choice is not made yet is empty."""
    if seeds == "heldout":
        ch = choose()
        return [[(lab, s) for s in benchmark.HELDOUT_SEEDS for lab in ch.get("heldout", [])]]
    ch, dev = choose(), benchmark.DEV_SEEDS
    # (g), twins as rows, costs ~5x (f) in training: after the Monte Carlo arms, which the shares need
    groups = [[*ROWS[:-1], *LADDER.values()], variants(ch)[:1], list(INDEPENDENT), list(MC), variants(ch)[1:],
              [ROWS[-1]]]
    return [[(lab, s) for s in dev for lab in group] for group in groups]


def run(seeds: str, jobs: int, scratch: str, only: tuple = ()) -> int:
    """The missing runs, stage after stage (a choice is made as soon as the runs it needs are done)."""
    folder = suite.world_dir(WORLD)
    if subprocess.run([sys.executable, "-m", "worlds.build", "--verify", folder], cwd=ROOT).returncode:
        return 1
    for k in range(len(stages(seeds))):
        todo = [(lab, s) for lab, s in stages(seeds)[k]
                if not done(lab, s) and (not only or lab in only)]
        if not todo:
            continue
        print(f"lab/frontier.py: stage {k + 1}: {len(todo)} runs, {jobs} at a time", flush=True)
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            for line in pool.map(lambda r: benchmark.run_one(*r, folder, scratch, RESULTS, FLAGS), todo):
                print(line, flush=True)
        if any(not done(lab, s) for lab, s in todo):
            print(f"lab/frontier.py: some runs failed (see their logs under {scratch})")
            return 1
    choose()
    return 0


# --- the runs' figures ---

def load(labels, seeds) -> dict:
    """{label: [(config, rows)]} of the finished runs among the seeds; ValueError for a run of another schedule."""
    out = {}
    for lab in labels:
        runs = benchmark.collect([lab], seeds, RESULTS, need_all=False)[lab]
        for cfg, rows in runs:
            evals = [u for u, _ in benchmark.updates_curve(rows)]
            if updates(rows) != N or evals != list(range(0, N, EVERY)) + [N]:
                raise ValueError(f"{benchmark.run_dir(lab, cfg['seed'], RESULTS)}: {updates(rows)} updates, EM "
                                 f"after {evals}; the frontier needs {N}, EM every {EVERY} and at the end")
        if runs:
            out[lab] = runs
    return out


def updates(rows: list) -> int:
    return max(r["step"] for r in rows)


def final_em(run) -> float:
    return benchmark.updates_curve(run[1])[-1][1]


def tokens(run) -> dict:
    """Generated tokens per update of one run: factual, auxiliary (twins, continuations, the oracle's rollouts)."""
    steps = [r for r in run[1] if not r.get("final") and "factual_tokens" in r]
    factual = sum(r["factual_tokens"] for r in steps)
    aux = sum(r.get("aux_tokens", 0) + r.get("oracle_tokens", 0) for r in steps)
    return {"factual": factual / len(steps), "aux": aux / len(steps), "total": (factual + aux) / len(steps)}


def by_seed(runs: list) -> dict:
    return {cfg["seed"]: (cfg, rows) for cfg, rows in runs}


def cost_ratio(runs: list, base: list) -> float:
    """Mean over shared seeds of tokens per update / the base's."""
    b = by_seed(base)
    return float(np.mean([tokens(r)["total"] / tokens(b[r[0]["seed"]])["total"] for r in runs if r[0]["seed"] in b]))


def paired(runs: dict, lab: str, base: str, path: bool = False) -> list:
    """EM after N updates (path: the mean EM over updates 0..N) minus the base's, per shared seed."""
    b = by_seed(runs.get(base, []))
    diff = benchmark.mean_em_over_same_updates if path else lambda x, y: benchmark.em_after_same_updates(x, y)[0]
    return [diff(rows, b[cfg["seed"]][1]) for cfg, rows in runs.get(lab, []) if cfg["seed"] in b]


def over_rows_line(runs: dict, lab: str, path: bool = False) -> list:
    """Per seed: the label's gain over GRPO minus the rows line's at the label's tokens per update (the rows arms'
    gains over GRPO, linear in log cost between the two rows arms around it); seeds outside the rows' range of cost
    are left out."""
    out = []
    for cfg, rows in runs.get(lab, []):
        s = cfg["seed"]
        line = []
        for r in ROWS:
            mine = by_seed(runs.get(r, [])).get(s)
            if mine and s in by_seed(runs.get(GRPO, [])):
                line.append((np.log(cost_ratio([mine], runs[GRPO])), gain_on(runs, r, s, path)))
        if len(line) < 2:
            continue
        x = np.log(cost_ratio([(cfg, rows)], runs[GRPO]))
        xs, ys = zip(*sorted(line))
        if xs[0] <= x <= xs[-1]:
            out.append(gain_on(runs, lab, s, path) - float(np.interp(x, xs, ys)))
    return out


def gain_on(runs: dict, lab: str, seed: int, path: bool = False) -> float:
    mine, base = by_seed(runs[lab])[seed][1], by_seed(runs[GRPO])[seed][1]
    return benchmark.mean_em_over_same_updates(mine, base) if path else benchmark.em_after_same_updates(mine, base)[0]


def mean_se(x: list) -> tuple:
    return (float(np.mean(x)), suite.se(x)) if x else (float("nan"), float("nan"))


def fmt(m: tuple) -> str:
    return "-" if np.isnan(m[0]) else f"{m[0]:+.3f} +- {m[1]:.3f}" if not np.isnan(m[1]) else f"{m[0]:+.3f}"


def wall_minutes(lab: str, seeds: tuple) -> float:
    paths = [os.path.join(benchmark.run_dir(lab, s, RESULTS), "meta.json") for s in seeds]
    walls = [json.load(open(p))["wall_s"] for p in paths if os.path.isfile(p)]
    return float(np.mean(walls)) / 60 if walls else float("nan")


# --- the report ---

def points(runs: dict, ch: dict) -> dict:
    """{label: figures of the arm}: cost, tokens, the gains (after N, mean over updates) over GRPO, the share of the
    oracle's gain, the gain over the rows line, each (mean, SE) over seeds."""
    if GRPO not in runs:
        return {}
    oracle = np.mean(paired(runs, ORACLE, GRPO)) if ORACLE in runs else float("nan")
    out = {}
    for lab, seeds in runs.items():
        t = [tokens(r) for r in seeds]
        after = mean_se(paired(runs, lab, GRPO))
        out[lab] = {"family": family(lab), "rung": rung(lab, ch), "seeds": len(seeds),
                    "cost": cost_ratio(seeds, runs[GRPO]), "factual": np.mean([x["factual"] for x in t]),
                    "aux": np.mean([x["aux"] for x in t]), "em": mean_se([final_em(r) for r in seeds]),
                    "after": after, "mean": mean_se(paired(runs, lab, GRPO, path=True)),
                    "share": after[0] / oracle if oracle > 0 else float("nan"),
                    "over_rows": mean_se(over_rows_line(runs, lab)),
                    "over_counterpart": mean_se(paired(runs, lab, counterpart(lab)) if family(lab) == "coupled"
                                                else []),
                    "complete": len(seeds) >= len(runs[GRPO]),  # run on every seed GRPO has
                    "over_rows_mean": mean_se(over_rows_line(runs, lab, path=True))}
    return out


def arm_table(runs: dict, ch: dict, seeds: tuple) -> list:
    pts = points(runs, ch)
    lines = ["| family | rung | label | seeds | tokens per update (factual + aux) | / GRPO's | EM after N | "
             "- GRPO's | mean EM over updates - GRPO's | share of the oracle's gain | - rows line at its cost | "
             "(mean over updates) | wall min |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    order = sorted(pts, key=lambda lab: (FAMILIES.index(pts[lab]["family"]), pts[lab]["rung"] if
                                         len(pts[lab]["rung"]) == 1 else "", pts[lab]["cost"]))
    for lab in order:
        p = pts[lab]
        share = "-" if lab == GRPO or np.isnan(p["share"]) else f"{p['share']:.2f}"
        lines.append(f"| {p['family']} | {p['rung']} | {lab} | {p['seeds']} | {p['factual']:.0f} + {p['aux']:.0f} | "
                     f"{p['cost']:.2f} | {p['em'][0]:.3f} | {'-' if lab == GRPO else fmt(p['after'])} | "
                     f"{'-' if lab == GRPO else fmt(p['mean'])} | "
                     f"{share} | "
                     f"{'-' if family(lab) == 'rows' else fmt(p['over_rows'])} | "
                     f"{'-' if family(lab) == 'rows' else fmt(p['over_rows_mean'])} | "
                     f"{wall_minutes(lab, seeds):.1f} |")
    return lines


def rows_table(runs: dict, path: bool = False) -> list:
    """EM after N updates (path: the mean EM over updates 0..N) of every credit arm minus each rows arm's, paired
    by seed."""
    rows = [r for r in ROWS if r in runs]
    lines = ["| label | " + " | ".join(f"- {r}" for r in rows) + " |", "|---|" + "---:|" * len(rows)]
    for lab in runs:
        if family(lab) != "rows":
            lines.append(f"| {lab} | " + " | ".join(fmt(mean_se(paired(runs, lab, r, path))) for r in rows) + " |")
    return lines


TWIN_KEYS = ("decisions", "twins", "self_twins", "shortcuts", "twin_rollouts", "discordant")


def twin_table(runs: dict) -> list:
    """The twin arms' step logs: per step, decisions, twins and their kinds, discordant twins; the twin term's share
    of the advantage mass."""
    lines = ["| label | " + " | ".join(f"{k} / step" for k in TWIN_KEYS) + " | discordant / twins | "
             "shortcuts / twins | advantage share |", "|---|" + "---:|" * (len(TWIN_KEYS) + 3)]
    for lab, seeds in runs.items():
        steps = [r for _, rows in seeds for r in rows if "discordant" in r]
        if not steps:
            continue
        total = {k: sum(r[k] for r in steps) for k in TWIN_KEYS}
        lines.append(f"| {lab} | " + " | ".join(f"{total[k] / len(steps):.1f}" for k in TWIN_KEYS) +
                     f" | {total['discordant'] / max(total['twins'], 1):.3f} | "
                     f"{total['shortcuts'] / max(total['twins'], 1):.3f} | "
                     f"{np.mean([r['twin_adv_share'] for r in steps]):.3f} |")
    return lines


def findings(pts: dict) -> list:
    """(i) the cheapest arm of each family taking half the oracle's gain; (ii) coupled against independent at the
    same rung; (iii) the credit arms above the rows line at their cost."""
    out = ["(i) Cheapest arm of each family with at least half the oracle M = 16's gain after N updates:"]
    for fam in FAMILIES if ORACLE in pts else ():
        # an arm counts once it has run on every seed GRPO has (a share from fewer seeds is not paired alike)
        arms = [lab for lab, p in pts.items() if p["family"] == fam and lab not in (ORACLE, GRPO) and p["complete"]]
        if not arms:
            out.append(f"- {fam}: " + ("no arm besides M = 16 run yet" if fam == family(ORACLE) else "not run yet"))
            continue
        half = [lab for lab in arms if p_share(pts[lab]) >= 0.5]
        pick = min(half, key=lambda lab: pts[lab]["cost"]) if half else None
        out.append(f"- {fam}: " + (f"{pick} ({pts[pick]['rung']}) at {pts[pick]['cost']:.2f}x GRPO's tokens per "
                                   f"update, share {pts[pick]['share']:.2f}" if pick else
                                   "none (" + ", ".join(f"{pts[lab]['rung']} {p_share(pts[lab]):.2f}"
                                                       for lab in arms) + ")"))
    if ORACLE not in pts:
        out.append(f"- not yet: {ORACLE} has not run on these seeds")
    out.append("(ii) Coupled minus independent twins at the same decisions and K (EM after N updates, paired by seed; "
               "each one's gain over GRPO; tokens per update / GRPO's, coupled / independent):")
    for lab, p in pts.items():
        other = counterpart(lab)
        if p["family"] == "coupled" and other in pts and other != lab:
            q = pts[other]
            out.append(f"- ({p['rung']}) {fmt(p['over_counterpart'])} ({fmt(p['after'])} against "
                       f"{fmt(q['after'])}); cost {p['cost']:.2f} / {q['cost']:.2f}")
    out.append("(iii) Credit arms against the rows line at their own cost (EM after N updates, paired by seed):")
    above = [lab for lab, p in pts.items() if p["family"] != "rows" and p["over_rows"][0] - 2 * p["over_rows"][1] > 0]
    inside = [lab for lab, p in pts.items() if p["family"] != "rows" and not np.isnan(p["over_rows"][0])]
    out.append(f"- {len(inside)} credit arms lie inside the rows' range of cost; above the line by more than twice the "
               f"SE: {', '.join(above) or 'none'}")
    out.append("- the cost at which the rows line (mean gains) reaches each credit arm's mean gain: a credit arm pays "
               "over more rows only if it costs less than that")
    for lab, p in sorted(pts.items(), key=lambda kv: kv[1]["cost"]):
        if p["family"] != "rows" and p["after"][0] > 0:
            x, (top_cost, top_gain) = break_even(pts, p["after"][0])
            where = f"{x:.2f}x" if not np.isnan(x) else \
                f"beyond the rows' largest gain ({top_gain:+.3f} at {top_cost:.2f}x)"
            out.append(f"  - {lab} ({p['rung']}): {p['after'][0]:+.3f} at {p['cost']:.2f}x; the rows line: {where}")
    return out


def break_even(pts: dict, gain: float) -> tuple:
    """The first cost (x GRPO's tokens per update) at which the rows line of mean gains after N updates, linear in log
    cost from GRPO's (1x, 0), reaches `gain` (nan if it never does); and the (cost, gain) of the rows arm of the
    largest gain."""
    line = sorted((p["cost"], 0.0 if lab == GRPO else p["after"][0]) for lab, p in pts.items()
                  if p["family"] == "rows")
    top = max(line, key=lambda xy: xy[1])
    for (x0, y0), (x1, y1) in zip(line, line[1:]):
        if y0 < gain <= y1:
            return float(np.exp(np.log(x0) + (gain - y0) / (y1 - y0) * (np.log(x1) - np.log(x0)))), top
    return float("nan"), top


def p_share(p: dict) -> float:
    return p["share"] if not np.isnan(p["share"]) else -np.inf


def plot(pts: dict, path: str):
    """Gain over GRPO per update (after N; mean over updates) against tokens per update / GRPO's: a line along each
    knob that buys credit with tokens (G, K at q = 1, M, VinePPO's K), the other coupled rungs as points, the oracle
    M = 16's gain drawn across."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, ScalarFormatter
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), sharey=True)
    colours = {"rows": "black", "coupled": "tab:blue", "independent": "tab:orange", "oracle": "tab:green",
               "vineppo": "tab:purple"}
    lined = set(ROWS) | {LADDER[r] for r in "cde"} | set(INDEPENDENT) | set(MC)
    for ax, key, title in ((axes[0], "after", f"EM after {N} updates"), (axes[1], "mean", f"mean EM over updates 0-{N}")):
        for fam in FAMILIES:
            for on_line in (True, False):
                arms = sorted((p["cost"], p[key][0], p[key][1], p["rung"]) for lab, p in pts.items()
                              if p["family"] == fam and (lab in lined) == on_line and not np.isnan(p[key][0]))
                if not arms:
                    continue
                x, y, e, names = zip(*arms)
                ax.errorbar(x, y, yerr=[0.0 if np.isnan(v) else v for v in e], marker="o" if on_line else "s",
                            ms=4, capsize=2, lw=1.2, ls="-" if on_line else "none", color=colours[fam], alpha=0.9,
                            label=fam if on_line or fam != "coupled" else "coupled, other rungs")
                for xi, yi, n in zip(x, y, names):
                    ax.annotate(n, (xi, yi), fontsize=6.5, xytext=(3, 3), textcoords="offset points",
                                color=colours[fam])
        if ORACLE in pts:
            ax.axhline(pts[ORACLE][key][0], color="tab:green", ls="--", lw=0.8)
            ax.axhline(pts[ORACLE][key][0] / 2, color="tab:green", ls=":", lw=0.8)
        ax.axhline(0, color="grey", lw=0.6)
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(FixedLocator([1, 2, 5, 10, 20, 50, 100]))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(plt.NullFormatter())
        ax.set_xlabel("generated tokens per update / GRPO's (log)")
        ax.set_title(title, fontsize=10)
    axes[0].set_ylabel("EM gain over GRPO (same seed), mean +- SE")
    axes[1].legend(fontsize=7.5, loc="best")
    fig.suptitle(f"The credit frontier on {WORLD} (dashed: the oracle M = 16's gain; dotted: half of it)", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_curves(runs: dict, labels: list, names: dict, path: str):
    """Greedy EM against updates, mean over seeds with a +- SE band, one line per arm."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.4))
    for lab in labels:
        if lab not in runs:
            continue
        curves = np.array([[em for _, em in benchmark.updates_curve(rows)] for _, rows in runs[lab]])
        x = [u for u, _ in benchmark.updates_curve(runs[lab][0][1])]
        m = curves.mean(0)
        se = curves.std(0, ddof=1) / np.sqrt(len(curves)) if len(curves) > 1 else np.zeros_like(m)
        line, = ax.plot(x, m, marker="o", ms=3, lw=1.4, label=f"{names.get(lab, lab)} ({len(curves)} seeds)")
        ax.fill_between(x, m - se, m + se, color=line.get_color(), alpha=0.18, lw=0)
    ax.set_xlabel("updates")
    ax.set_xticks(range(0, N + 1, EVERY))
    ax.set_ylabel("greedy EM, 120 test questions")
    ax.set_title(f"{WORLD}: learning per update, mean +- SE over seeds", fontsize=10)
    ax.legend(fontsize=7.5, loc="upper left")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def curve_arms(pts: dict, ch: dict) -> tuple:
    """The arms the curves figure shows: GRPO, the most rows, TWICE's default, the best coupled and independent
    rungs, the oracle M = 16; and their names."""
    def best(fam):
        arms = [lab for lab, p in pts.items() if p["family"] == fam and not np.isnan(p["after"][0])]
        return max(arms, key=lambda lab: pts[lab]["after"][0]) if arms else ""
    rows = max((lab for lab, p in pts.items() if p["family"] == "rows"), key=lambda lab: pts[lab]["cost"], default="")
    labels = list(dict.fromkeys(filter(None, [GRPO, rows, LADDER["a"], best("coupled"), best("independent"), ORACLE])))
    names = {GRPO: "GRPO (G = 5)", LADDER["a"]: "TWICE default (a)", ORACLE: "oracle M = 16"}
    for lab in labels:
        rows = lab in pts and pts[lab]["family"] == "rows"
        names.setdefault(lab, f"GRPO, {pts[lab]['rung'].replace('=', ' = ')}" if rows else
                         f"{pts[lab]['family']} ({pts[lab]['rung']})" if lab in pts else lab)
    return labels, names


GRADAUDIT = os.path.join(ROOT, "results", "gradaudit")  # lab/gradaudit.py's `--labels frontier --tag frontier-TAG`


def ranks(x) -> np.ndarray:
    """Ranks 1..n, ties sharing their mean rank."""
    x = np.asarray(x, dtype=float)
    order = np.argsort(x, kind="mergesort")
    r = np.empty(len(x))
    r[order] = np.arange(1, len(x) + 1)
    for v in np.unique(x):
        r[x == v] = r[x == v].mean()
    return r


def spearman(x, y) -> float:
    return float(np.corrcoef(ranks(x), ranks(y))[0, 1]) if len(x) > 2 else float("nan")


def audit_table(pts: dict) -> list:
    """The gradient audit of the rungs (fixed policies) beside their training (arms run on every seed GRPO has):
    cosine with the oracle's reference, tokens per decision, gains; and how well each policy's cosines order the
    rungs as training does."""
    audits = {}
    for tag in ("warm", "mid"):
        path = os.path.join(GRADAUDIT, f"{WORLD}-frontier-{tag}", "gradaudit.json")
        if os.path.isfile(path):
            audits[tag] = json.load(open(path))["methods"]
    if not audits:
        return []
    tags = list(audits)
    labels = [lab for lab in audits[tags[0]] if lab in pts and pts[lab]["complete"]]
    lines = ["| label | " + " | ".join(f"cos ({t})" for t in tags) + " | aux tokens / decision | EM after N - GRPO's "
             "| mean EM - GRPO's |", "|---|" + "---:|" * (len(tags) + 3)]
    for lab in labels:
        m = audits[tags[0]][lab]
        lines.append(f"| {lab} | " + " | ".join(f"{audits[t][lab]['cos']:.3f} +- {audits[t][lab]['cos_se']:.3f}"
                                                 for t in tags if lab in audits[t]) +
                     f" | {m.get('aux_tokens_per_decision', float('nan')):.1f} | {fmt(pts[lab]['after'])} | "
                     f"{fmt(pts[lab]['mean'])} |")
    lines.append("")
    for t in tags:
        common = [lab for lab in labels if lab in audits[t]]
        cos = [audits[t][lab]["cos"] for lab in common]
        lines.append(f"Spearman rank correlation over the {len(common)} audited arms, cos ({t}) against training: "
                     f"{spearman(cos, [pts[lab]['after'][0] for lab in common]):+.2f} (EM after N), "
                     f"{spearman(cos, [pts[lab]['mean'][0] for lab in common]):+.2f} (mean EM over updates).")
    return lines


def build_report() -> str:
    ch = chosen()
    dev = load(dev_labels(ch), benchmark.DEV_SEEDS)
    lines = [f"# The credit frontier on {WORLD} (generated by `python -m lab.frontier report`; do not edit)", "",
             f"Every arm makes {N} updates (greedy EM on the 120 test questions every {EVERY} and at the end); gains are "
             "EM differences paired by seed, mean +- SE over seeds; tokens are generated tokens per update, measured.",
             ""]
    if ch:
        lines += ["Chosen on the dev seeds (chosen.json): " + ", ".join(
            f"{k} = {v}" for k, v in sorted(ch.items()) if k not in ("rule", "chosen_at")) + f"; rule: {ch['rule']}.",
            ""]
    lines += ["## Dev seeds 0-2", ""]
    pts = points(dev, ch)
    if not pts:
        return write(lines + ["GRPO has not run on the dev seeds yet.", ""])
    lines += arm_table(dev, ch, benchmark.DEV_SEEDS) + [""] + findings(pts) + [""]
    lines += ["EM after N updates against each rows arm, paired by seed:", ""] + rows_table(dev) + [""]
    lines += ["Mean EM over updates 0..N against each rows arm, paired by seed:", ""] + rows_table(dev, True) + [""]
    lines += ["The twin arms' step logs (per step, summed over the runs' steps):", ""] + twin_table(dev) + [""]
    audit = audit_table(pts)
    if audit:
        lines += ["The gradient audit of the same arms (`python -m lab.gradaudit run luck-high --labels frontier --tag "
                  "frontier-TAG`: one batch's gradient against the oracle's reference at a fixed policy, mean +- SE "
                  "over batches) beside their training:", ""] + audit + [""]
    plot(pts, FIGURE)
    plot_curves(dev, *curve_arms(pts, ch), CURVES)
    held = load(ch.get("heldout", []), benchmark.HELDOUT_SEEDS)
    if held:
        lines += ["## Held-out seeds 10-15 (the arms chosen on the dev seeds)", ""]
        lines += arm_table(held, ch, benchmark.HELDOUT_SEEDS) + [""]
        lines += ["EM after N updates against each rows arm, paired by seed:", ""] + rows_table(held) + [""]
        lines += ["Mean EM over updates 0..N against each rows arm, paired by seed:", ""] + rows_table(held, True)
        lines += [""]
    return write(lines)


def write(lines: list) -> str:
    return benchmark.write_text(os.path.join(RESULTS, "tables.md"), "\n".join(lines))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="lab/frontier.py", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["run", "report", "plan"])
    parser.add_argument("--seeds", default="dev", choices=["dev", "heldout"], help="dev (0-2) or heldout (10-15)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, one thread each")
    parser.add_argument("--only", default="", help="comma-separated labels: run only these of the plan")
    parser.add_argument("--scratch", default="runs/frontier", help="where runs write checkpoints and logs")
    a = parser.parse_args(argv)
    if a.command == "report":
        print(build_report())
        return 0
    if a.command == "plan":
        for k, stage in enumerate(stages(a.seeds), 1):
            for lab, s in stage:
                print(f"stage {k}  {'done' if done(lab, s) else 'to do'}  {lab} seed {s}  "
                      f"{' '.join(benchmark.flags(lab) + FLAGS)}")
        return 0
    return run(a.seeds, a.jobs, a.scratch, tuple(filter(None, a.only.split(","))))


if __name__ == "__main__":
    raise SystemExit(main())
