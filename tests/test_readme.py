"""Every command in the README's code blocks works as written: each one that fits a CPU runs here on the
test-scale tiny world (paths swapped for the test's own, sizes made small with overrides appended), and
every other one is listed below with the reason it does not run here. A README command that is neither
fails the test, so a new line in the README gets its check."""
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--prompts_per_step=2", "--group_size=2", "--max_new_tokens=16", "--max_turns=1", "--max_context=512",
         "--micro_batch_size=4", "--gen_batch_size=8", "--eval_size=2", "--eval_every=0", "--log_tensorboard=false"]
NOT_HERE = {  # a README command (regular expression) -> why this suite does not run it
    r"^make (demo|test)$": "the front page's two commands; train_twice.py configs/demo.cfg runs below",
    r"^ACCELERATE_USE_CPU=true accelerate launch": "two CPU ranks: tests/test_train.py launches them",
    r"^accelerate launch --config_file configs/accelerate_(zero2|ddp)": "GPUs (DeepSpeed, Qwen2.5)",
    r"--encoder e5 ": "E5 comes from the hub; the same code builds MiniLM below",
    r"^python -m retrieval.server serve": "a server that runs until stopped: tests/test_server.py starts it",
    r"^make benchmark SET=": "hours of training runs; tests/test_benchmark.py checks the sets",
    r"^make benchmark-report$": "rewrites results/chains: tests/test_benchmark.py rebuilds it elsewhere",
    r"^make compare-methods": "13 methods' training runs",
    r"^make suite SUITE=": "hours of training runs; tests/test_suite.py checks the sets and their passes",
    r"^make suite-report$": "rewrites results/suite: tests/test_suite.py rebuilds a summary elsewhere",
    r"^python train_twice.py configs/demo.cfg --method=oracle": "minutes of rollouts a step: tests/test_oracle.py "
                                                                "trains the arm two steps and resumes it",
    r"^python -m lab.headroom run ": "hours of training runs: tests/test_headroom.py checks the plans and the table",
    r"^python -m lab.gradaudit run ": "tens of minutes: tests/test_gradaudit.py runs its parts on the tiny world",
    r"^python -m lab.frontier run": "hours of training runs (and its report rewrites results/frontier): "
                                    "tests/test_frontier.py checks the stages, the choices and the table",
    r"^python -m worlds.data convert ": "needs a Search-R1 parquet: tests/test_data.py converts one it writes",
    r"^python -m perf.ledger configs/": "minutes per preset; tests/test_ledger.py runs the ledger small",
    r"^python -m worlds.build --out data/(tinyworld|chains)": "a full build; tests/test_world*.py build both "
                                                              "presets at test scale through the same CLI",
    r"^make (reproduce-3b|reproduce-7b|retriever-up|train-2nodes)( |$)(?!DRY_RUN)": "GPUs, downloads, a "
                                                                             "cluster",
}


def readme_commands() -> list:
    """The commands of the README's bash blocks: continuation lines joined, comments dropped."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                out.append(re.sub(r"\s+", " ", line))
    return out


class Context:
    """The test's own world, runs and output folders, and how a README command maps onto them."""

    def __init__(self, world, tmp):
        self.world, self.tmp = world, str(tmp)
        self.run, self.lora = os.path.join(self.tmp, "runs/demo/twice"), os.path.join(self.tmp, "runs/demo/lora")

    def swap(self, cmd: str) -> list:
        words = shlex.split(cmd)
        if words[0] == "python":
            words[0] = sys.executable
        out = []
        for w in words:
            w = w.replace("data/tinyworld/index_bm25", os.path.join(self.tmp, "index_bm25"))
            w = w.replace("data/tinyworld", self.world).replace("runs/demo/twice", self.run)
            w = w.replace("runs/demo/lora", self.lora).replace("runs/audit", os.path.join(self.tmp, "audit"))
            w = re.sub(r"data/(chains|luck-mid|luck-high|delay-high)", lambda m: os.path.join(self.tmp, m[1]), w)
            if "step_000030" in w:
                w = w.replace("step_000030", f"step_{self.last:06d}")
            out.append(w)
        return out

    @property
    def last(self) -> int:
        return max(int(d[5:]) for d in os.listdir(self.run) if d.startswith("step_"))


def run(words, ok=True, **kw):
    proc = subprocess.run(words, cwd=ROOT, capture_output=True, text=True, timeout=600, **kw)
    if ok:
        assert proc.returncode == 0, f"{' '.join(words)}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def train(ctx, cmd, *extra):
    return run(ctx.swap(cmd) + SMALL + [f"--world={ctx.world}", *extra])


def handled(cmd: str) -> bool:
    return any(re.search(pattern, cmd) for pattern in NOT_HERE) or any(
        re.search(pattern, cmd) for _, pattern, _ in RUNS)


def test_every_readme_command_is_run_or_says_why_not():
    commands = readme_commands()
    assert len(commands) > 30
    missing = [cmd for cmd in commands if not handled(cmd)]
    assert not missing, "README commands neither run by tests/test_readme.py nor listed in NOT_HERE:\n" + \
        "\n".join(missing)


# --- the commands that run, in the order of their dependencies (a run first, then what reads it) ---
def demo_run(ctx, cmd):
    train(ctx, cmd, f"--out_dir={ctx.run}", "--steps=2", "--save_every=1", "--log_episodes=2", "--overwrite")
    rows = [json.loads(line) for line in open(os.path.join(ctx.run, "metrics.jsonl"))]
    assert rows[-1]["final"] and os.path.isfile(os.path.join(ctx.run, "learning_curve.png"))


def grpo_run(ctx, cmd):
    out = os.path.join(ctx.tmp, "runs/compare-methods/grpo-seed0")
    train(ctx, cmd, f"--out_dir={out}", "--steps=2", "--overwrite")
    twice = os.path.join(ctx.tmp, "runs/compare-methods/twice-seed0")
    os.makedirs(os.path.dirname(twice), exist_ok=True)
    if not os.path.exists(twice):
        os.symlink(ctx.run, twice)
    assert json.load(open(os.path.join(out, "config.json")))["method"] == "grpo"


def resume(ctx, cmd):
    words = ctx.swap(cmd)
    words = [w if not w.startswith("--steps=") else f"--steps={ctx.last + 1}" for w in words]
    out = os.path.join(ctx.tmp, "runs/resumed")
    run(words + SMALL + [f"--world={ctx.world}", f"--out_dir={out}"])
    steps = [json.loads(line)["step"] for line in open(os.path.join(out, "metrics.jsonl"))]
    assert steps[-1] == ctx.last + 1


def replay(ctx, cmd):
    """The README's step (a step with its checkpoint in make demo's run) -> the last such step here."""
    step = ctx.last - 1  # step_N for N < last: the policy step N's episodes were sampled from
    uid = next(row["uid"] for row in map(json.loads, open(os.path.join(ctx.run, "episodes.jsonl")))
               if row["step"] == step)
    words = [{"U": str(uid), "20": str(step)}.get(w, w) for w in ctx.swap(cmd)]
    proc = run(words)
    assert "tokens identical to episodes.jsonl" in proc.stdout, proc.stdout[-1000:]


def replay_page(ctx, cmd):
    """The README's step as one page: a self-contained HTML file of the step's lines and twins."""
    step, page = ctx.last - 1, os.path.join(ctx.tmp, "step.html")
    words = [{"20": str(step), "step20.html": page}.get(w, w) for w in ctx.swap(cmd)]
    assert f"wrote {page}" in run(words).stdout
    text = open(page, encoding="utf-8").read()
    assert text.startswith("<!doctype html>") and f"step {step}" in text and 'class="line"' in text


def bm25_index(ctx, cmd):
    run(ctx.swap(cmd))
    assert json.load(open(os.path.join(ctx.tmp, "index_bm25", "meta.json")))["encoder"] == "bm25"


def plain(ctx, cmd):
    run(ctx.swap(cmd))


def plain_small(*extra):
    return lambda ctx, cmd: run(ctx.swap(cmd) + list(extra))


def lora_run(ctx, cmd):
    train(ctx, cmd, "--steps=1", "--overwrite")
    assert os.path.isdir(os.path.join(ctx.lora, "step_000001", "policy_merged"))


def make(cmd: str, *extra) -> list:
    """A README make line on this suite's virtual environment, never reinstalling it."""
    venv = os.path.dirname(os.path.dirname(sys.executable))
    return shlex.split(cmd) + [f"VENV={venv}", "-o", f"{venv}/.installed", *extra]


def world_copy(ctx, cmd):
    words = ctx.swap(cmd)
    out = next((w[len("WORLD="):] for w in words if w.startswith("WORLD=")), os.path.join(ctx.tmp, "tiny-world"))
    words += [] if "WORLD=" in cmd else [f"WORLD={out}"]
    text = run(make(" ".join(shlex.quote(w) for w in words))).stdout
    # the target compares the copy with worlds.lock itself (worlds/build.py --verify, its recipe's last line)
    assert os.path.isfile(os.path.join(out, "world.json")) and "every file matches worlds.lock" in text


def own_world(ctx, cmd):
    """The tiny world's corpus and training questions as the user's own data."""
    cmd = cmd.replace("docs.jsonl", f"{ctx.world}/corpus.jsonl").replace("qa.jsonl", f"{ctx.world}/train.jsonl")
    run(ctx.swap(cmd.replace("data/mine", os.path.join(ctx.tmp, "mine"))))
    assert json.load(open(os.path.join(ctx.tmp, "mine", "index", "meta.json")))["encoder"] == "bm25"


def own_world_run(ctx, cmd):
    out = os.path.join(ctx.tmp, "runs/mine")
    cmd = cmd.replace("data/mine", os.path.join(ctx.tmp, "mine")).replace("runs/mine", out)
    run(ctx.swap(cmd) + SMALL + ["--steps=1"])
    assert json.loads(open(os.path.join(out, "metrics.jsonl")).readlines()[-1])["final"]


# (group, README command pattern, what runs it), in this order within a group. A group's commands read what the
# group's earlier ones wrote; the groups share nothing, so each is a test of its own and the groups run side by side.
RUNS = [
    ("demo", r"^python train_twice.py configs/demo.cfg --overwrite$", demo_run),
    ("demo", r"^python train_twice.py configs/demo.cfg --method=grpo --out_dir=runs/demo/grpo$", grpo_run),
    ("demo", r"^python train_twice.py configs/demo.cfg --resume=", resume),
    ("demo", r"^python eval.py --model runs/demo/twice/", plain_small("--limit=3")),
    ("demo", r"^python rollout.py replay (?!.*--html)", replay),
    ("demo", r"^python rollout.py replay .*--html", replay_page),
    ("demo", r"^python -m lab.report paired runs/compare-methods", lambda ctx, cmd: run(
        [sys.executable, "-m", "lab.report", "paired", *sorted(
            os.path.join(ctx.tmp, "runs/compare-methods", d)
            for d in os.listdir(os.path.join(ctx.tmp, "runs/compare-methods")))])),
    ("demo", r"^python -m lab.report compare DIR\.\.\.$", lambda ctx, cmd: run(
        [sys.executable, "-m", "lab.report", "compare", ctx.run,
         os.path.join(ctx.tmp, "runs/compare-methods/grpo-seed0")])),
    ("tools", r"^python train_twice.py --help$", plain),
    ("tools", r"^python -m perf.bench_server --index data/tinyworld/index", plain_small(
        "--clients", "2", "--requests", "2", "--queries", "2", "--big", "20")),
    ("tools", r"^python -m lab.audit --world ", plain_small("--decisions=2", "--oracle_rollouts=2", "--repeats=2",
                                                            "--vine_k=1", "--max_new_tokens=6", "--max_turns=1",
                                                            "--method_rows=", "--progress=false")),
    ("tools", r"^make reproduce-3b DRY_RUN=1$", lambda ctx, cmd: run(make(cmd))),
    ("bm25", r"^python retriever.py build --corpus data/tinyworld/corpus.jsonl --encoder bm25", bm25_index),
    ("bm25", r"^python retriever.py search --index data/tinyworld/index_bm25 ", plain),
    ("bm25", r"^python train_twice.py configs/demo.cfg --index=data/tinyworld/index_bm25", lambda ctx, cmd: train(
        ctx, cmd, f"--out_dir={os.path.join(ctx.tmp, 'runs/bm25')}", "--steps=1")),
    ("lora", r"^python train_twice.py configs/demo.cfg --lora_rank=8 ", lora_run),
    ("lora", r"^python -m infra.lora memory ", plain),
    ("lora", r"^python eval.py --model runs/demo/lora/", lambda ctx, cmd: run(
        ctx.swap(cmd.replace("step_000030", "step_000001")) + ["--limit=3"])),
    ("worlds", r"^make world$", world_copy),
    ("worlds", r"^make world WORLD=data/chains PRESET=chains$", world_copy),
    ("worlds", r"^make world WORLD=data/luck-high PRESET=luck-high$", world_copy),
    ("worlds", r"^python -m worlds.build --verify DIR$", lambda ctx, cmd: run(
        [sys.executable, "-m", "worlds.build", "--verify", os.path.join(ctx.tmp, "tiny-world")])),
    ("own_data", r"^python -m worlds.data world ", own_world),
    ("own_data", r"^python train_twice.py --world=data/mine ", own_world_run),
]
GROUPS = list(dict.fromkeys(group for group, _, _ in RUNS))


@pytest.mark.parametrize("group", GROUPS)
def test_the_readme_commands_run_on_the_tiny_world(tiny_world, tmp_path, group):
    """The group's commands in README order, on paths of the test's own."""
    ctx, runs = Context(tiny_world, tmp_path), [(pattern, how) for g, pattern, how in RUNS if g == group]
    done = set()
    for cmd in readme_commands():
        for pattern, how in runs:
            if re.search(pattern, cmd) and not any(re.search(p, cmd) for p in NOT_HERE):
                how(ctx, cmd)
                done.add(pattern)
    assert done == {pattern for pattern, _ in runs}, {pattern for pattern, _ in runs} - done


def test_the_readme_examples_fit_make_demos_own_output():
    """After `make demo`: the replayed step has its checkpoint in the demo's run (configs/demo.cfg's save_every and
    keep_checkpoints), and every example query names an entity of the committed tiny world."""
    import train_twice as tt
    cfg = tt.parse_config(["configs/demo.cfg"])
    step = int(re.search(r"^python rollout.py replay .*--step (\d+) ", "\n".join(readme_commands()), re.M)[1])
    kept = [n for n in range(cfg.save_every, cfg.steps, cfg.save_every)][-cfg.keep_checkpoints:]
    assert 0 < step < cfg.steps and step in kept, (step, kept)
    titles = {json.loads(line)["contents"].split("\n")[0].strip('"')
              for line in open(os.path.join(ROOT, "worlds", "tiny-0", "corpus.jsonl"))}
    queries = [shlex.split(cmd)[-1] for cmd in readme_commands() if cmd.startswith("python retriever.py search")]
    assert queries and all(any(name in titles for name in re.findall(r"[A-Z][a-z]+", q)[1:]) for q in queries), \
        queries
