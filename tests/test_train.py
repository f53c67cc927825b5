"""train_twice.py: config parsing, one-step smoke run, exact resume, GRPO switch, 2-process CPU run, loud failures."""
import collections
import glob
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import credit
import rollout
from lab import report
import train_twice as tt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--prompts_per_step=4", "--group_size=3", "--max_new_tokens=24", "--max_obs_tokens=200", "--max_turns=2",
        "--max_context=768", "--lr=1e-4", "--micro_batch_size=6", "--eval_size=6", "--gen_batch_size=32"]


def tiny_cfg(world, out, *extra) -> tt.Config:
    return tt.parse_config([f"--world={world}", f"--out_dir={out}", *TINY, *extra])


def read_metrics(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def test_config_presets_overrides_and_errors(tmp_path):
    preset = tmp_path / "p.cfg"
    preset.write_text("# a preset\nomega = 0.5   # weight\nmodel = \"Qwen/Qwen2.5-3B\"\ncoupling = false\n")
    cfg = tt.parse_config([str(preset), "--steps=7", "--omega=2"])
    assert (cfg.omega, cfg.model, cfg.coupling, cfg.steps) == (2.0, "Qwen/Qwen2.5-3B", False, 7)
    assert cfg.index == os.path.join("data/tinyworld", "index")  # blanks filled from the world
    with pytest.raises(ValueError, match="unknown config key 'omgea'.*valid keys: world"):
        tt.parse_config(["--omgea=1"])
    with pytest.raises(ValueError, match="steps: expected int"):
        tt.parse_config(["--steps=ten"])
    with pytest.raises(ValueError, match="coupling: expected a boolean"):
        tt.parse_config(["--coupling=maybe"])
    bad = tmp_path / "bad.cfg"
    bad.write_text("steps 3\n")
    with pytest.raises(ValueError, match=r"bad.cfg:1: expected `key = value`"):
        tt.parse_config([str(bad)])
    with pytest.raises(ValueError, match="budget_rule='cubic'"):
        tt.parse_config(["--budget_rule=cubic"])


def test_prompts_for_step_is_a_pure_function_of_step():
    rows = [{"id": str(i)} for i in range(10)]
    cfg = tt.Config(prompts_per_step=4, seed=3)
    seen = [r["id"] for s in range(5) for r in rollout.step_prompts(rows, cfg.prompts_per_step, cfg.seed, s, 0, 1)]
    assert sorted(seen[:8] + seen[8:10]) == sorted(str(i) for i in range(10))  # epoch 0 covers every row once
    assert rollout.step_prompts(rows, 4, 3, 3) == rollout.step_prompts(rows, 4, 3, 3)
    shards = [rollout.step_prompts(rows, 4, 3, 2, r, 2) for r in range(2)]
    whole = rollout.step_prompts(rows, 4, 3, 2, 0, 1)
    assert sorted(x["id"] for s in shards for x in s) == sorted(x["id"] for x in whole)


def test_token_advantages_land_on_sampled_tokens():
    """The advantage row fed to the loss is aligned with the loss mask: A_traj + omega A_hat / sigma on turn t."""
    ep = rollout.Episode(uid=1, line=0, key=5, question="q", golden_answers=["a"], prompt_ids=[7, 7, 7])
    ep.ids, ep.mask = [1, 2, 3, 4, 5, 6], [1, 1, 0, 0, 1, 1]
    ep.turns = [rollout.Turn(0, 2, 2, 4, "", "search", "x", (), [], [], 0, "stop"),
                rollout.Turn(4, 6, 6, 6, "", "answer", "a", (), [], [], 0, "stop")]
    batch = rollout.collate([ep], pad_id=0)
    spans = [[(3 + t.start, 3 + t.end) for t in ep.turns]]
    adv = credit.token_advantages([0.5], [np.array([0.0, 2.0])], spans, batch["input_ids"].shape[1], 1.0, 4.0)
    assert np.array_equal(adv[0] != 0, batch["loss_mask"][0].numpy() == 1)
    assert adv[0].tolist() == [0, 0, 0, 0.5, 0.5, 0, 0, 1.0, 1.0]


def test_smoke_run_logs_checkpoints_and_plots(tiny_world, tmp_path):
    out = str(tmp_path / "run")
    final = tt.main(tiny_cfg(tiny_world, out, "--steps=2", "--eval_every=1"))
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[-1]["final"]
    for key in ("reward", "kl", "clip_frac", "entropy", "twins", "self_twins", "shortcuts", "discordance",
                "twin_token_ratio", "predictor_auc", "predictor_brier", "time", "eval_em"):
        assert key in rows[0], key
    assert rows[0]["twins"] > 0 and rows[0]["factual_tokens"] > 0
    ckpt = os.path.join(out, "step_000002")
    assert sorted(os.listdir(ckpt)) == ["policy", "policy_bf16", "run.json", "trainer"]
    run = json.load(open(os.path.join(ckpt, "run.json")))
    assert run["step"] == 2 and run["config"]["omega"] == 1.0 and "transformers" in run
    assert os.path.exists(os.path.join(out, "learning_curve.png"))
    assert 0.0 <= final["eval_em"] <= 1.0


def test_grpo_switch_launches_no_twins(tiny_world, tmp_path):
    out = str(tmp_path / "grpo")
    tt.main(tiny_cfg(tiny_world, out, "--steps=1", "--eval_every=0", "--omega=0"))
    row = read_metrics(out)[0]
    assert "twins" not in row and row["reward"] >= 0


def test_resume_reproduces_the_uninterrupted_run(tiny_world, tmp_path):
    """2N steps in one go == N steps, resume from the checkpoint, N more: identical metrics (times aside)."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    tt.main(tiny_cfg(tiny_world, a, "--steps=4", "--eval_every=0"))
    tt.main(tiny_cfg(tiny_world, b, "--steps=2", "--eval_every=0"))
    tt.main(tiny_cfg(tiny_world, b, "--steps=4", "--eval_every=0", f"--resume={b}/step_000002"))
    strip = [{k: v for k, v in r.items() if not k.startswith("time")} for r in read_metrics(a)]
    got = [{k: v for k, v in r.items() if not k.startswith("time")} for r in read_metrics(b)]
    body = lambda rows: [r for r in rows if not r.get("final")]  # noqa: E731
    assert body(got) == body(strip)
    assert len(body(got)) == 4


def test_resume_refuses_a_changed_config(tiny_world, tmp_path):
    out = str(tmp_path / "c")
    tt.main(tiny_cfg(tiny_world, out, "--steps=1", "--eval_every=0", "--omega=0"))
    with pytest.raises(ValueError, match="config differs.*omega"):
        tt.main(tiny_cfg(tiny_world, out, "--steps=2", "--eval_every=0", f"--resume={out}/step_000001"))


def test_nonfinite_loss_fails_loudly():
    cfg = tt.Config()
    lp = torch.tensor([[0.0, float("nan")]])
    loss, _, _ = tt.ppo_loss(cfg, lp, torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
    assert not torch.isfinite(loss.sum())  # ppo_update turns this into FloatingPointError (checked every micro-batch)


def test_a_run_on_a_bm25_index_gets_its_hits(tmp_path, monkeypatch):
    """train_twice --index DIR with a BM25 folder (retrieval/bm25.py): every search of the logged episodes (all of them)
    retrieved exactly what that folder returns for its query, which the world's dense index does not. The session's
    test-scale world has a policy of 12 BC steps that never writes a <search>; the same world with 150 (4 s more)
    searches in about one turn in five."""
    import protocol
    import retriever
    from worlds import build as world
    from worlds import tiny as world_tiny
    monkeypatch.setitem(world_tiny.SCALES, "test", dict(world_tiny.SCALES["test"], bc_steps=150))
    tiny, index, out = str(tmp_path / "world"), str(tmp_path / "bm25"), str(tmp_path / "run")
    world.build_world(tiny, seed=0, scale="test")
    retriever.build_index(os.path.join(tiny, "corpus.jsonl"), "bm25", index)
    tt.main(tiny_cfg(tiny, out, "--steps=2", "--eval_every=0", f"--index={index}", "--log_episodes=12"))
    turns = [t for line in open(os.path.join(out, "episodes.jsonl")) for t in json.loads(line)["turns"]]
    searches = [(protocol.parse_action(t["text"])[1][:protocol.Protocol().max_query_chars], t["doc_ids"])
                for t in turns if t["doc_ids"]]
    assert len(searches) >= 5
    bm25, dense = retriever.Retriever(index), retriever.Retriever(os.path.join(tiny, "index"))
    queries = [query for query, _ in searches]
    assert [ids for _, ids in searches] == [[d["id"] for d in docs] for docs in bm25.search(queries, 3)]
    assert [ids for _, ids in searches] != [[d["id"] for d in docs] for docs in dense.search(queries, 3)]


def cpu_launch(script, out, tiny_world, *launch, flags=("--steps=2", "--eval_every=0")) -> tuple:
    """(command, environment) of `accelerate launch LAUNCH... SCRIPT` of a tiny run on CPU processes (gloo)."""
    env = dict(os.environ, ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *launch, "--mixed_precision", "no", "--dynamo_backend",
           "no", script, f"--world={tiny_world}", f"--out_dir={out}", *TINY, *flags]
    return cmd, env


def assert_ranks_in_sync(out, steps=2):
    """Both ranks held the same weights after every step (weights_spread: max - min of a float64 checksum)."""
    rows = [r for r in read_metrics(out) if not r.get("final")]
    assert len(rows) == steps and all(r["weights_spread"] == 0.0 for r in rows), rows


@pytest.mark.parametrize("unit", ["turn"])  # token forks on two ranks: test_two_machines_stay_in_sync
def test_two_cpu_processes_stay_in_sync(tiny_world, tmp_path, unit):
    """accelerate launch --multi_gpu --num_processes 2 on CPU (gloo): it completes and both ranks hold the same
    weights after every step."""
    out = str(tmp_path / "ddp")
    cmd, env = cpu_launch(os.path.join(ROOT, "train_twice.py"), out, tiny_world, "--multi_gpu", "--num_processes",
                          "2", "--num_machines", "1", flags=("--steps=2", "--eval_every=0", f"--twin_unit={unit}"))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_ranks_in_sync(out)
    assert all(r["twins"] > 0 for r in read_metrics(out) if not r.get("final"))


def test_two_machines_stay_in_sync(tiny_world, tmp_path):
    """configs/accelerate_2nodes.yaml as `make train-2nodes` launches it, with two "machines" on this host: one
    launcher per machine rank, one CPU process each, meeting at 127.0.0.1:PORT; the run completes and both hold the
    same weights after every step, with token forks (the predictor learns from both ranks' forks). The port is free
    when picked but may be taken before rank 0 binds it: a start that fails for that reason alone is retried on
    another port."""
    import socket
    out = str(tmp_path / "2nodes")
    for attempt in range(3):
        with socket.socket() as s:  # a free port for the rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        for rank in (0, 1):
            cmd, env = cpu_launch(os.path.join(ROOT, "train_twice.py"), out, tiny_world, "--config_file",
                                  os.path.join(ROOT, "configs", "accelerate_2nodes.yaml"), "--num_machines", "2",
                                  "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
                                  "--main_process_port", str(port), "--num_processes", "2",
                                  flags=("--steps=2", "--eval_every=0", "--overwrite", "--twin_unit=token"))
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True))
        try:
            results = [p.communicate(timeout=900) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        taken = any(p.returncode and "address already in use" in err.lower() for p, (_, err) in zip(procs, results))
        if not taken:
            break
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    assert_ranks_in_sync(out)
    assert all(r["twins"] > 0 for r in read_metrics(out) if not r.get("final"))


DRIVER = """import os, sys
sys.path.insert(0, {root!r})
import train_twice as tt
real = tt.ppo_loss
def rank_one_nan(cfg, lp, *args, **kw):  # a non-finite loss on rank 1 only
    loss, kl, clipped = real(cfg, lp, *args, **kw)
    return (loss * float("nan") if os.environ.get("RANK") == "1" else loss), kl, clipped
tt.ppo_loss = rank_one_nan
import torch.distributed as dist
real_init = dist.init_process_group
def init(*args, **kw):  # what accelerate asks of the process group (collective_timeout_h)
    print(f"rank {{os.environ['RANK']}} collective timeout {{kw.get('timeout')}}", file=sys.stderr, flush=True)
    return real_init(*args, **kw)
dist.init_process_group = init
try:
    tt.main(tt.config.cli(tt.Config, prog="train_twice.py"))
except FloatingPointError as e:
    print(f"rank {{os.environ['RANK']}} stopped: {{e}}", file=sys.stderr, flush=True)
    raise SystemExit(3)
"""


def test_a_non_finite_loss_on_one_rank_stops_both_with_a_message(tiny_world, tmp_path):
    """Rank 1's loss is NaN, rank 0's is not: both ranks stop at the same micro-batch naming it, nothing hangs in a
    collective, and nothing is saved. A rank may stop by its own FloatingPointError or by its watchdog, which can read
    the other rank's report of the same error first; either line names the step and the loss. Collectives wait
    collective_timeout_h (6 h by default), not torch's 10 min."""
    out, driver = str(tmp_path / "ddp-nan"), tmp_path / "driver.py"
    driver.write_text(DRIVER.format(root=ROOT))
    cmd, env = cpu_launch(str(driver), out, tiny_world, "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                          flags=("--steps=2", "--eval_every=0", "--save_every=1"))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode != 0
    for rank in (0, 1):  # its own error, or the other rank's as its watchdog read it first: both name the step
        assert (f"rank {rank} stopped: diverged at step 0: loss = " in proc.stderr
                or f"rank {rank}: stopping: rank {1 - rank} failed: FloatingPointError: diverged at step 0: loss = "
                in proc.stderr), proc.stderr[-3000:]
    assert "non-finite on 1 of 2 rank(s)" in proc.stderr
    assert all(f"rank {rank} collective timeout 6:00:00" in proc.stderr for rank in (0, 1)), proc.stderr[-3000:]
    assert not [f for f in os.listdir(out) if f.startswith("step_")]


def test_compare_runs_table_and_plot(tmp_path):
    """Two fake seeds per method: the table's means, token ratio and twin rates, computed by hand."""
    def run(name, omega, ems, tokens, twins=0, self_twins=0):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"omega": omega, "coupling": True}))
        rows = [{"step": 0, "reward": 0.5, "eval_em": 0.5, "factual_tokens": tokens, "twin_tokens": tokens * omega,
                 "twins": twins, "self_twins": self_twins, "shortcuts": 0},
                {"step": 2, "eval_em": ems, "final": True}]
        (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        return str(d)
    dirs = [run("g0", 0, 0.6, 100), run("g1", 0, 0.8, 100),
            run("t0", 0.5, 0.9, 100, 4, 1), run("t1", 0.5, 0.7, 100, 4, 3)]
    table = report.compare_runs(dirs).splitlines()
    assert table[0].startswith("| method | seeds | EM@0 | EM@2 |")
    assert table[2] == "| GRPO | 2 | 0.500 +- 0.000 | 0.700 +- 0.100 | 0.500 +- 0.000 | 1.00x | 0.0 | 0.0% | 0.0% |"
    assert table[3] == "| TWICE | 2 | 0.500 +- 0.000 | 0.800 +- 0.100 | 0.500 +- 0.000 | 1.50x | 4.0 | 50.0% | 0.0% |"
    assert (tmp_path / "compare.png").stat().st_size > 1000


# --- config ranges, and runs that must never be lost or mixed (DESIGN.md section 12) ---

@pytest.mark.parametrize("override,field", [("--micro_batch_size=0", "micro_batch_size"), ("--steps=-1", "steps"),
                                            ("--top_p=0", "top_p"), ("--max_new_tokens=0", "max_new_tokens"),
                                            ("--group_size=1", "group_size"), ("--temperature=0", "temperature")])
def test_out_of_range_values_name_the_field(override, field):
    with pytest.raises(ValueError, match=f"invalid config value.*{field}="):
        tt.parse_config([override])


def test_a_duplicate_row_in_one_step_is_marked():
    rows = [{"id": str(i)} for i in range(3)]
    batch = rollout.step_prompts(rows, 5, 0, 0)  # 5 draws from 3 rows: wraps
    counts = collections.Counter(r["id"] for r in batch)
    assert sorted(r.get("occurrence", 0) for r in batch) == [0, 0, 0, 1, 1]
    assert all(len({r.get("occurrence", 0) for r in batch if r["id"] == k}) == n for k, n in counts.items())


def test_resume_below_the_checkpoint_step_and_a_foreign_out_dir_are_refused(tiny_world, tmp_path):
    out = str(tmp_path / "r")
    tt.main(tiny_cfg(tiny_world, out, "--steps=2", "--eval_every=0", "--save_every=1"))
    with pytest.raises(ValueError, match="checkpoint is at step 2, past --steps=1"):
        tt.main(tiny_cfg(tiny_world, out, "--steps=1", "--eval_every=0", f"--resume={out}/step_000002"))
    assert [r["step"] for r in read_metrics(out)] == [0, 1, 2]  # nothing written by the refused run
    with pytest.raises(ValueError, match=f"{out} already holds a run"):
        tt.main(tiny_cfg(tiny_world, out, "--steps=1", "--eval_every=0"))
    tt.main(tiny_cfg(tiny_world, out, "--steps=1", "--eval_every=0", "--overwrite"))
    assert sorted(f for f in os.listdir(out) if f.startswith("step_")) == ["step_000001"]  # no mix of two runs
    assert [r["step"] for r in read_metrics(out)] == [0, 1]


def test_divergence_stops_before_anything_is_saved(tiny_world, tmp_path):
    out = str(tmp_path / "div")
    with pytest.raises(FloatingPointError, match="diverged at step 0: weight norm"):
        tt.main(tiny_cfg(tiny_world, out, "--steps=2", "--eval_every=0", "--lr=1e9", "--save_every=1"))
    assert not [f for f in os.listdir(out) if f.startswith("step_")]
    assert not os.path.exists(os.path.join(out, "metrics.jsonl"))


def test_a_torn_last_metrics_line_is_dropped_on_resume(tiny_world, tmp_path, capsys):
    out = str(tmp_path / "torn")
    tt.main(tiny_cfg(tiny_world, out, "--steps=2", "--eval_every=0", "--save_every=1"))
    path = os.path.join(out, "metrics.jsonl")
    lines = open(path).read().splitlines()
    open(path, "w").write("\n".join(lines[:1]) + "\n" + lines[1][:17])  # crash in the middle of writing step 1
    tt.main(tiny_cfg(tiny_world, out, "--steps=2", "--eval_every=0", f"--resume={out}/step_000001"))
    assert "dropped a torn last line" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(out)] == [0, 1, 2]
    open(path, "w").write(lines[0] + "\n{oops\n" + lines[1] + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: malformed JSON"):
        tt.main(tiny_cfg(tiny_world, out, "--steps=2", "--eval_every=0", f"--resume={out}/step_000001"))


def test_tensorboard_events_hold_the_logged_scalars(tiny_world, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = str(tmp_path / "tb")
    tt.main(tiny_cfg(tiny_world, out, "--steps=2", "--eval_every=1"))
    events = EventAccumulator(os.path.join(out, "tb"))
    events.Reload()
    rows = [r for r in read_metrics(out) if not r.get("final")]
    for key in ("reward", "kl", "twins", "eval_em", "factual_tokens"):
        got = [(e.step, e.value) for e in events.Scalars(key)]
        assert got == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in rows], key
    texts = [(e.step, e.tensor_proto.string_val[0].decode()) for e in events.Tensors("episodes/text_summary")]
    logged = [json.loads(line) for line in open(os.path.join(out, "episodes.jsonl"))]
    assert [s for s, _ in texts] == [0, 1] and all(f"uid {r['uid']} line {r['line']}" in texts[r["step"]][1]
                                                   for r in logged)


def test_wandb_offline_logs_every_scalar(tiny_world, tmp_path, monkeypatch):
    """A real offline W&B run (no network); its log() calls are recorded on the way through."""
    import wandb
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logged, real_init = [], wandb.init

    def init(**kw):
        run = real_init(**kw)
        real_log = run.log
        monkeypatch.setattr(run, "log", lambda data, step: (logged.append((step, dict(data))), real_log(data, step)))
        return run
    monkeypatch.setattr(wandb, "init", init)
    out = str(tmp_path / "wb")
    tt.main(tiny_cfg(tiny_world, out, "--steps=2", "--eval_every=0", "--log_wandb", "--log_tensorboard=false"))
    rows = [r for r in read_metrics(out) if not r.get("final")]
    tables = [(s, data["episodes"]) for s, data in logged if "episodes" in data]  # the episode log (log_episodes)
    assert [s for s, t in tables] == [r["step"] for r in rows] and all(len(t.data) == 2 for _, t in tables)
    logged = [(s, data) for s, data in logged if "episodes" not in data]
    assert [s for s, _ in logged] == [r["step"] for r in rows]
    for (_, data), row in zip(logged, rows):
        assert data == {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
    assert glob.glob(os.path.join(out, "wandb", "offline-run-*", "run-*.wandb"))  # the run's local record


def test_token_budget_stops_the_run_and_counts_every_generated_token(tiny_world, tmp_path):
    out = str(tmp_path / "budget")
    final = tt.main(tiny_cfg(tiny_world, out, "--steps=5", "--eval_every=0", "--token_budget=1"))
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1] and final["step"] == 1  # the first step already spends the budget
    assert rows[0]["tokens"] == rows[0]["factual_tokens"] + rows[0]["aux_tokens"] == final["tokens"]
    assert rows[0]["aux_tokens"] == rows[0]["twin_tokens"] > 0
    assert json.load(open(os.path.join(out, "step_000001", "run.json")))["tokens"] == final["tokens"]


def test_eval_tokens_evaluates_at_the_start_and_at_every_multiple_of_generated_tokens(tiny_world, tmp_path):
    """Methods differ in tokens per step, so the benchmark evaluates by tokens: a step's eval runs when the tokens
    before it have passed a new multiple of eval_tokens (and at the first step)."""
    out = str(tmp_path / "evtok")
    tt.main(tiny_cfg(tiny_world, out, "--steps=4", "--eval_every=0", "--eval_size=4", "--omega=0"))
    rows = [r for r in read_metrics(out) if not r.get("final")]
    per_step = rows[0]["tokens"]  # about the same every step; eval every ~1.5 steps
    shutil.rmtree(out)
    tt.main(tiny_cfg(tiny_world, out, "--steps=4", "--eval_every=0", "--eval_size=4", "--omega=0",
                     f"--eval_tokens={int(per_step * 1.5)}"))
    rows = [r for r in read_metrics(out) if not r.get("final")]
    before = [0] + [r["tokens"] for r in rows[:-1]]
    k = int(per_step * 1.5)
    expect = [i == 0 or before[i] // k > max(before[j] // k for j in range(i) if "eval_em" in rows[j])
              for i in range(len(rows))]
    assert ["eval_em" in r for r in rows] == expect
    assert 2 <= sum(expect) < len(rows)  # the rule fired more than once and skipped a step


def test_compare_methods_at_equal_tokens(tmp_path, capsys):
    """Hand-computed: EM at token marks is the last evaluation at or before the mark; AUC is the mean of that step
    function over [0, budget]; 'tokens to GRPO's final EM' is where a method's curve first reaches it."""
    def run(name, method, ems):  # ems: EM at tokens 0, 100, 200 (final)
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"method": method, "token_budget": 200, "seed": int(name[1:])}))
        rows = [{"step": 0, "eval_em": ems[0], "tokens": 100, "factual_tokens": 100, "time": 30},
                {"step": 1, "eval_em": ems[1], "tokens": 200, "factual_tokens": 100, "time": 30},
                {"step": 2, "eval_em": ems[2], "tokens": 200, "final": True}]
        (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        return str(d)
    dirs = [run("g0", "grpo", (0.2, 0.4, 0.6)), run("g1", "grpo", (0.2, 0.2, 0.4)),
            run("t0", "twice", (0.2, 0.6, 0.8)), run("t1", "twice", (0.2, 0.4, 0.6))]
    table = report.compare_methods(dirs, checkpoints=2, png=str(tmp_path / "m{seeds}.png")).splitlines()
    assert table[0] == ("| method | seeds | EM@100 | EM@200 | AUC | final EM | final tokens | tokens to GRPO's final "
                        "| steps | wall min |")
    grpo, twice = table[2].split(" | "), table[3].split(" | ")
    assert grpo[:4] == ["| grpo", "2", "0.300 +- 0.100", "0.500 +- 0.100"]  # EM at 100 and at 200 tokens
    assert grpo[4] == "0.250 +- 0.050"  # AUC: (0.2 * 100 + 0.4 * 100) / 200 and (0.2 * 100 + 0.2 * 100) / 200
    assert twice[2:5] == ["0.500 +- 0.100", "0.700 +- 0.100", "0.350 +- 0.050"]
    assert twice[5:7] == ["0.700 +- 0.100", "200"] and grpo[5] == "0.500 +- 0.100"  # final EM, its tokens
    assert twice[7] == "150 (2/2 reach)"  # GRPO's final EM is 0.5: t0 reaches it at 100 tokens (0.6), t1 at 200
    assert grpo[7] == "200 (1/2 reach)" and twice[8:] == ["2 +- 0", "1.0 +- 0.0 |"]  # steps, minutes
    assert report.method_of({"method": "vineppo", "vine_k": 3}) == "vineppo K=3"  # a K sweep keeps its K apart
    assert (tmp_path / "m0-1.png").stat().st_size > 1000  # named after the seeds: dev and held-out PNGs coexist
    # paired: mean +- SE (ddof 1) over seeds, differences from the same seed's GRPO run (AUC 0.4 - 0.3, 0.3 - 0.2)
    assert report.paired(dirs).splitlines()[2:] == [
        "| twice | 2 | 0.350 +- 0.050 | 0.700 +- 0.100 | +0.100 +- 0.000 | +0.200 +- 0.000 |",
        "| grpo | 2 | 0.250 +- 0.050 | 0.500 +- 0.100 | - | - |"]
    assert "AUC - twice's" in report.paired(dirs, base="twice")
    with pytest.raises(SystemExit, match="g9 is not a run folder"):
        report.compare_methods(dirs + [str(tmp_path / "g9")])
    rows = (tmp_path / "t1" / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "t1" / "metrics.jsonl").write_text("\n".join(rows[:2]) + "\n")  # t1 stopped before its final eval
    capsys.readouterr()
    report.compare_methods(dirs)
    assert "t1 has not finished" in capsys.readouterr().err


def _with_long_question(tiny_world, path, words=5000) -> str:
    """The tiny world's train file with its third row's question made `words` words long."""
    import eval as qa_eval
    rows = qa_eval.load_qa(os.path.join(tiny_world, "train.jsonl"))
    rows[2] = dict(rows[2], question="what is the capital of " + "the city " * (words // 2))
    qa_eval.write_jsonl(path, rows)
    return path


def test_an_over_long_train_question_is_refused_with_file_line_before_any_rollout(tiny_world, tmp_path,
                                                                                  monkeypatch):
    """A 5,000-word question: its prompt went whole into every log-prob pass (with Qwen2.5 at 15k tokens, a 9.1 GB
    allocation; a 40,000-word one ran the process to 24 GB, killed). Now setup refuses the file, naming the line and
    the token count, before any episode is sampled; an eval question past the cap is refused by evaluate()."""
    import eval as qa_eval

    def no_rollout(*a, **k):
        raise AssertionError("an episode was sampled")
    monkeypatch.setattr(rollout, "start_episodes", no_rollout)
    path = _with_long_question(tiny_world, str(tmp_path / "long.jsonl"))
    out = str(tmp_path / "run")
    with pytest.raises(ValueError, match=r"long.jsonl:3: the prompt is \d{4,} tokens, past the 744 that leave one "
                                         r"turn \(max_new_tokens=24\) under max_context=768; 1 such row"):
        tt.main(tiny_cfg(tiny_world, out, f"--train_data={path}", "--steps=1", "--eval_every=0"))
    assert not os.path.exists(os.path.join(out, "metrics.jsonl"))
    model, tok = qa_eval.load_policy(os.path.join(tiny_world, "policy"))
    rows = qa_eval.load_qa(path)
    proto = tt.protocol.Protocol(max_new_tokens=24, max_context=768, temperature=0.0)
    with pytest.raises(ValueError, match=rf"question {rows[2]['id']!r} of tiny_\dhop: the prompt is \d{{4,}} tokens"):
        qa_eval.evaluate(model, tok, None, rows, proto, progress=False)


# --- twin units, scales and key readings (DESIGN.md section 5) ---
@pytest.mark.parametrize("extra", [["--twin_unit=token", "--twin_scale=d"],
                                   ["--twin_unit=token", "--method=independent", "--line_keys=text",
                                    "--twin_scale=rms"]])
def test_twin_options_two_steps_and_exact_resume(tiny_world, tmp_path, extra):
    """2 steps in one go == 1 step, resume, 1 more (the token predictor and the scale are in the checkpoint); token
    forks log their fork token k."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    tt.main(tiny_cfg(tiny_world, a, "--steps=2", "--eval_every=0", "--log_tensorboard=false", *extra))
    tt.main(tiny_cfg(tiny_world, b, "--steps=1", "--eval_every=0", "--log_tensorboard=false", *extra))
    tt.main(tiny_cfg(tiny_world, b, "--steps=2", "--eval_every=0", "--log_tensorboard=false",
                     f"--resume={b}/step_000001", *extra))
    strip = lambda out: [{k: v for k, v in r.items() if not k.startswith("time")}  # noqa: E731
                         for r in read_metrics(out) if not r.get("final")]
    assert strip(a) == strip(b) and len(strip(a)) == 2
    assert all(r["twins"] > 0 and r["self_twins"] == 0 for r in strip(a))  # a fork bans y_k: never a self-twin
    logged = [tw for line in open(os.path.join(a, "episodes.jsonl")) for tw in json.loads(line)["twins"]]
    assert logged and all(isinstance(tw["k"], int) and tw["k"] >= 0 for tw in logged)
    state = json.load(open(os.path.join(b, "step_000002", "run.json")))
    assert state["token_predictor"]["n_seen"] > 0 and state["sigma_hat"]["mode"] == extra[-1].split("=")[1]


def test_token_unit_credits_the_fork_token_alone(tiny_world, monkeypatch):
    """twin_credit with twin_unit = token: every twin's D forced to +1, so each branched turn's fork token k gets
    A_traj + omega (1 - pi_k) / (q_t r_t(k) sigma) and every other token of its turn exactly A_traj; the twin of
    turn t was forked at that k (y_t[:k] kept, token k changed)."""
    from types import SimpleNamespace
    import eval as qa_eval
    import forks
    import methods
    import twice
    cfg = tiny_cfg(tiny_world, "unused", "--twin_unit=token", "--twin_budget=0.5", "--omega=2", "--twin_scale=d",
                   "--twin_cap=0")
    policy, tok = qa_eval.load_policy(cfg.model)
    run = SimpleNamespace(accel=SimpleNamespace(num_processes=1, unwrap_model=lambda m: m), policy=policy, tok=tok,
                          retriever=qa_eval.load_retriever(cfg.index, ""), method=methods.make(cfg),
                          predictor=credit.DiscordancePredictor(),
                          token_predictor=credit.DiscordancePredictor(features=forks.TOKEN_FEATURES),
                          sigma_hat=credit.RunningScale(mode="d"))
    run.sigma_hat.update_d(0.25)  # sigma_hat 0.5 from "earlier batches"
    proto = tt.protocol.protocol_from(cfg)
    eps = rollout.run_episodes(policy, tok, run.retriever, rollout.start_episodes(
        tok, qa_eval.load_qa(cfg.train_data)[:4], cfg.seed, 0, cfg.group_size), proto)
    seen = {}
    real = rollout.run_twins

    def forced(*args, **kw):
        out = real(*args, **kw)
        for x in out:
            x.diff = 1.0
            seen[x.twin.uid, x.twin.line, x.turn] = x
        return out
    monkeypatch.setattr(rollout, "run_twins", forced)
    batch = rollout.collate(eps, tok.pad_token_id)
    adv, stats = twice.token_twin_credit(cfg, run, 0, eps, batch, proto)
    a_traj = run.method.trajectory_advantages(eps)
    decisions = rollout.decision_table(eps, np.array([e.reward for e in eps]).reshape(-1, 3).mean(1).repeat(3))
    table = forks.token_table(eps, decisions, tok)
    law = forks.fork_law(table, np.full(len(table.pi), 0.5), cfg.fork_floor)  # a fresh predictor: the prior
    q = credit.solve_budget(law.p, law.cost, cfg.twin_budget * sum(e.n_generated for e in eps), cfg.q_min).q
    assert seen and stats["predictor_brier"] == 0.25  # the prior 0.5 against labels all 1
    for n, (i, t) in enumerate(decisions.index):
        ep, turn = eps[i], eps[i].turns[t]
        row = adv[i, len(ep.prompt_ids) + turn.start:len(ep.prompt_ids) + turn.end] - a_traj[i]
        x = seen.get((ep.uid, ep.line, t))
        if x is None:
            assert np.all(row == 0)
            continue
        k = x.k
        y, y2 = ep.ids[turn.start:turn.end], x.twin.ids[turn.start:x.twin.turns[t].end]
        assert y2[:k] == y[:k] and y2[k] != y[k]
        want = 2.0 * (1 - table.pi[table.offsets[n] + k]) / (q[n] * law.r[table.offsets[n] + k]) / 0.5
        assert row[k] == pytest.approx(want, rel=1e-9) and np.all(np.delete(row, k) == 0)
