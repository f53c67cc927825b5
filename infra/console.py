"""What a run says on the console: the config line at its start, the final line, the summary
table and learning_curve.png at its end, and the one line a script ends on when it fails or is
stopped (Ctrl-C, SIGTERM: how to resume). A step's own line is written with its metrics row
(checkpoint.log_metrics), and every step number here counts as checkpoint.py's docstring says.

It writes no file but learning_curve.png: the run's files, and what a checkpoint is, are
checkpoint.py's.
"""
import os
import shlex
import signal
import sys

from infra import checkpoint


def config_line(cfg, start: int = 0) -> str:
    """The fields a user sets, in one line; every field is in out_dir/config.json."""
    data = (f"world {cfg.world}" if cfg.model == os.path.join(cfg.world, "policy") else
            f"model {cfg.model}")
    method = cfg.method
    if cfg.method in ("twice", "independent"):  # methods.TWIN_METHODS: they read both knobs
        method += f" (omega {cfg.omega:g}, twin_budget {cfg.twin_budget:g})"
    steps = f"{cfg.steps} steps" + (f" or {cfg.token_budget} tokens" if cfg.token_budget else "")
    parts = [f"config: method {method}", data,
             f"{steps} x {cfg.prompts_per_step} prompts x {cfg.group_size} lines", f"lr {cfg.lr:g}"]
    if cfg.lora_rank:
        parts[-1] += f", lora_rank {cfg.lora_rank}"
    if cfg.resume:
        parts.append(f"resumed from {cfg.resume} at step {start}")
    config_json = os.path.join(cfg.out_dir, "config.json")
    return " | ".join(parts + [f"out_dir {cfg.out_dir} (every field: {config_json})"])


def resume_line(cfg, argv: list, prog: str) -> str:
    """One line after an interrupted run: the command again (argv without --resume and
    --overwrite) with --resume at its newest complete checkpoint, or why there is none."""
    checkpoint.recover_checkpoints(cfg.out_dir)  # a swap cut short: its checkpoint put back
    args, skip = [], False
    for arg in argv:
        name = arg.split("=", 1)[0]
        if not skip and name not in ("--resume", "--overwrite"):
            args.append(shlex.quote(arg))
        skip = arg == "--resume"  # `--resume PATH`: its value is the next argument
    command = " ".join(["python", prog, *args])
    path = checkpoint.last_checkpoint(cfg.out_dir)
    if path:
        return f"interrupted; resume with: {command} --resume={shlex.quote(path)}"
    if checkpoint.holds_a_run(cfg.out_dir):
        return (f"interrupted before the first checkpoint (save_every={cfg.save_every}), so there "
                f"is nothing to resume from; start again with: {command} --overwrite")
    return f"interrupted before the first step; nothing was saved. Start again with: {command}"


def run_cli(main, cfg, prog: str):
    """A training script's __main__: main(cfg), with an error as one line (exit status 1) and
    Ctrl-C or SIGTERM as one line that says how to resume (exit status 130 or 143), not a
    traceback. What was saved stays: metrics.jsonl is written row by row, and a checkpoint being
    written is dropped whole (save), never left half-written."""
    def stop(signum, frame):
        raise KeyboardInterrupt(signum)
    signal.signal(signal.SIGTERM, stop)  # torchrun, Slurm and `kill` stop a run with SIGTERM
    # Ctrl-C and `kill -INT` too, whatever this process inherited: a parent that ignores SIGINT (a shell's background
    # job, a test worker) passes SIG_IGN on through exec, and Python then installs no KeyboardInterrupt for it
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})  # a blocked mask is inherited too
    try:
        return main(cfg)
    except (ValueError, FloatingPointError, FileNotFoundError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except KeyboardInterrupt as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{prog}: {resume_line(cfg, sys.argv[1:], prog)}", file=sys.stderr, flush=True)
        raise SystemExit(143 if e.args == (signal.SIGTERM,) else 130) from None


# --- the end of a run: its learning curve and summary table ---

def plot_curve(out_dir: str):
    """learning_curve.png: greedy eval EM and sampled training reward against the step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [row for _, row in checkpoint.read_metrics(os.path.join(out_dir, "metrics.jsonl"))]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("reward", "train reward (sampled)"), ("eval_em", "eval EM (greedy)")):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o" if key == "eval_em" else None, label=label)
    ax.set(xlabel="step", ylabel="exact match", title=os.path.basename(os.path.abspath(out_dir)))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(os.path.join(out_dir, "learning_curve.png"), dpi=120, bbox_inches="tight")
    plt.close(fig)


def run_summary(out_dir: str) -> str:
    """Markdown: greedy EM per source at the run's first evaluation (step 0 when it was evaluated
    there: before training) and at the final one, only what was measured (a source or a column
    without an evaluation shows "-" or is left out), and the run's twin statistics summed over
    steps. Printed at the end of every run and by `make demo`."""
    rows = [row for _, row in checkpoint.read_metrics(os.path.join(out_dir, "metrics.jsonl"))]
    first = next((r for r in rows if r.get("eval_em") is not None and not r.get("final")), None)
    last = next((r for r in reversed(rows) if r.get("final")), {})
    cols = [(f"step {first['step']}", first)] if first else []
    cols += [("final", last)] if last.get("eval_em") is not None else []
    keys = sorted({k for _, r in cols for k in r if k.startswith("eval_em/")}) + ["eval_em"]
    lines = []
    if cols:
        lines += ["| eval (greedy EM) | " + " | ".join(name for name, _ in cols) + " |",
                  "|---|" + "---:|" * len(cols)]
        lines += [f"| {k.split('/')[-1] if '/' in k else 'average'} | " + " | ".join(
            "-" if r.get(k) is None else f"{r[k]:.3f}" for _, r in cols) + " |" for k in keys]
        lines.append("")
    steps = [r for r in rows if "final" not in r]
    tot = {
        k: sum(r.get(k, 0) for r in steps)
        for k in ("decisions", "twins", "self_twins", "shortcuts", "twin_rollouts",
                  "factual_tokens", "aux_tokens")
    }
    ratio = 1 + tot["aux_tokens"] / max(tot["factual_tokens"], 1)
    tokens = (
        f"generated tokens: factual {tot['factual_tokens']}, auxiliary (twins, continuations) "
        f"{tot['aux_tokens']}, total / factual {ratio:.2f}x")
    if tot["twins"]:
        twins = tot["twins"]
        lines.append(
            f"{len(steps)} steps: {tot['decisions']} decisions, {twins} twins drawn (self-twins "
            f"{tot['self_twins'] / twins:.1%}, same-evidence shortcuts "
            f"{tot['shortcuts'] / twins:.1%}, {tot['twin_rollouts']} rolled out); {tokens}")
    else:
        lines.append(f"{len(steps)} steps; {tokens}")
    return "\n".join(lines)


def finish_run(out_dir: str) -> str:
    """What the end of every training run shows: learning_curve.png written, the summary table
    returned."""
    plot_curve(out_dir)
    return run_summary(out_dir)


def finish(cfg, final: dict, path: str):
    """The end of a run on the console: the final line (the updates done, as the final row of
    metrics.jsonl counts them; eval_em only if measured), learning_curve.png, the summary table."""
    em = f" | eval_em {final['eval_em']:.3f}" if "eval_em" in final else ""
    print(f"final | step {final['step']}/{cfg.steps}{em} | checkpoint {path}", flush=True)
    print(finish_run(cfg.out_dir), flush=True)
