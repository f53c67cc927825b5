"""The smoke stage of `make reproduce-*`: the real preset for a few steps, held against the memory ledger.

Before the long runs the pipeline trains the preset on every GPU of the node for 2 steps with the
retriever server up, saves, resumes for 1 more step, and then runs this check on the run folder:

  python -m perf.smoke RUN [--size 3b] [--ledger results/memory.json] [--margin 0.1]

It reads the run's metrics.jsonl, whose rows carry per phase and per rank the peak of torch's
allocator and the device's used memory (infra/phases.py), and the ledger's prediction for the preset
(results/memory.json: allocated bytes and the total with the retriever server, the CUDA context and
NCCL), and writes RUN/smoke.md: a table of measured against predicted per phase. It fails (exit
status 1, naming each phase) when a phase is over the ledger by more than the margin, when the run
has no GPU memory figures, when it did not continue after the resume, or when the run's memory
settings are not those the ledger was computed for. Under the ledger is not a failure: the table says
by how much.
"""
import argparse
import json
import os
import sys

from infra import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the trainer's phases (infra/phases.py marks) -> the ledger's (perf/ledger.PHASES) they cover
PHASES = {"rollout": ("rollout",), "twins": ("twins",), "logprobs": ("logprobs",),
          "update": ("update", "optimizer_step")}
STEPS = 3  # 2, a save, a resume, 1 more


def measured(rows: list) -> dict:
    """{phase: (peak allocated GiB, used GiB), the largest over steps and ranks} of metrics rows."""
    out = {}
    for phase in PHASES:
        alloc = [x for r in rows for x in r.get(f"mem_{phase}_gib", [])]
        used = [x for r in rows for x in r.get(f"used_{phase}_gib", [])]
        if alloc:
            out[phase] = (max(alloc), max(used))
    return out


def predicted(led: dict) -> dict:
    """{phase: (allocated GiB, total GiB)} of a ledger, each trainer phase the largest of its
    ledger phases."""
    return {phase: (max(led["phases"][q]["allocated_gib"] for q in covers),
                    max(led["phases"][q]["total_gib"] for q in covers))
            for phase, covers in PHASES.items()}


def mismatched(config: dict, led: dict) -> list:
    """The memory settings in which the run differs from the ledger's config (its prompts per
    step are the ledger's per rank times its world)."""
    want = dict(led["config"], prompts_per_step=led["config"]["prompts_per_step"] * led["world"])
    return [f"{k} = {config.get(k)!r} in the run, {v!r} in the ledger" for k, v in want.items()
            if k in config and config[k] != v and k != "method"]


def check(run: str, led: dict, margin: float) -> tuple:
    """(markdown report, problems) of the run folder against the ledger."""
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.exists(path):
        return "", [f"{path}: no such file (the smoke run did not start)"]
    rows = [r for _, r in checkpoint.read_metrics(path) if not r.get("final")]
    problems = []
    steps = sorted({r["step"] for r in rows})
    if steps != list(range(STEPS)):
        problems.append(f"{path}: steps {steps}, not 0..{STEPS - 1} (2 steps, a resume, 1 more)")
    config_path = os.path.join(run, "config.json")
    if os.path.exists(config_path):
        problems += mismatched(json.load(open(config_path)), led)
    got, want = measured(rows), predicted(led)
    if not got:
        problems.append(f"{path}: no per-phase GPU memory (mem_<phase>_gib): was this a GPU run?")
    lines = ["| phase | allocated GiB (max over ranks) | ledger | ratio | used GiB | ledger | ratio |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for phase, (alloc, used) in got.items():
        pa, pu = want[phase]
        lines.append(f"| {phase} | {alloc:.2f} | {pa:.2f} | {alloc / pa:.2f} | {used:.2f} | {pu:.2f} | "
                     f"{used / pu:.2f} |")
        for what, m, p in (("allocated", alloc, pa), ("used", used, pu)):
            if m > (1 + margin) * p:
                problems.append(f"{phase}: {what} {m:.2f} GiB, over the ledger's {p:.2f} GiB by more "
                                f"than {margin:.0%}")
    report = "\n".join(lines) + "\n"
    return report, problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.smoke", description=__doc__.split("\n")[0],
                                     epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="the smoke run's folder")
    parser.add_argument("--size", default="3b", choices=("3b", "7b"), help="the preset")
    parser.add_argument("--ledger", default=os.path.join(ROOT, "results", "memory.json"))
    parser.add_argument("--margin", type=float, default=0.1, help="allowed excess over the ledger")
    args = parser.parse_args(argv)
    led = json.load(open(args.ledger))[args.size]
    report, problems = check(args.run, led, args.margin)
    if report:
        with open(os.path.join(args.run, "smoke.md"), "w") as f:
            f.write(report + "".join(f"\n- {p}" for p in problems) + "\n")
        print(report, end="")
    for p in problems:
        print(f"smoke: {p}", file=sys.stderr)
    if problems:
        print(f"smoke: the {args.size} preset does not run as the ledger says: fix it before the long "
              "runs (DESIGN.md section 10)", file=sys.stderr)
        return 1
    print(f"smoke: every phase within {args.margin:.0%} of the ledger, and the run resumed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
