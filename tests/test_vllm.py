"""engine=vllm (generation/vllm_engine.py): vLLM's tokens are the keyed draws. perf/bench_vllm.py runs every kind of
draw through vLLM and through the cached engine on the same weights, in a process of its own (vLLM binds the process's
threads); these tests read its figures. A 2-step training run with engine=vllm samples the same tokens as one with the
cached engine. The processor's core (catch_up, draw, finish) is tested here without vLLM."""
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.xdist_group("vllm")  # one worker runs the file: its module fixtures are built once

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY0 = os.path.join(ROOT, "worlds", "tiny-0")


@pytest.fixture(scope="module")
def figures(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("bench") / "vllm.json")
    proc = subprocess.run([sys.executable, "-m", "perf.bench_vllm", "--world", TINY0, "--json", out], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.load(open(out))


def test_factual_episodes_are_the_cached_engines(figures):
    f = figures["factual"]
    assert f["rows"] == 64 and f["same"] == f["rows"] and f["tokens"] > 1000
    assert f["lp_gap"] < 1e-4  # the draw's own log-probs, recorded by the processor
    assert "stop" in f["stops"]  # turns ended by a stop string (the forced EOS dropped)


def test_batch_order_changes_no_token(figures):
    assert figures["order"]["alone"] and figures["order"]["reversed"] == figures["order"]["rows"]


@pytest.mark.parametrize("kind", ["twins", "forks", "replays", "lines"])
def test_twins_forks_replays_and_text_line_keys_are_the_cached_engines(figures, kind):
    f = figures[kind]
    assert f["rows"] >= 40 and f["same"] == f["rows"], f
    if kind in ("twins", "forks"):
        assert f["same_count"]
    if kind == "lines":  # the text-line reading is a different noise: the check bites
        assert f["differ_from_group"] > 0


def test_weight_sync_matches_the_cached_engine_and_a_fresh_engine(figures):
    f = figures["sync"]
    assert f["changed"] > 0  # the new weights sample other episodes
    assert f["same_as_cached"] == f["rows"] and f["same_as_fresh"] == f["rows"]


def test_speed_is_measured(figures):
    s = figures["speed"]
    assert s["cached"] > 0 and s["vllm"] > 0 and math.isclose(s["ratio"], s["vllm"] / s["cached"])


def test_training_on_two_ranks_with_vllm_samples_the_cached_engines_tokens(tiny_world, tmp_path):
    """accelerate launch --multi_gpu --num_processes 2 on CPU (gloo) of train_twice.py --engine=vllm, 2 steps, on the
    session's test-scale world with its policy's heads widened to head_dim 32, one vLLM engine per rank: the same
    logged episodes and twins (token ids), rewards, token counts and twins as --engine=cached; the ranks stay in sync,
    and the engines shut down cleanly (no traceback). The weights move between the steps, so the second step's tokens
    come from the synced weights."""
    from perf.bench_vllm import widened
    world = str(tmp_path / "world")
    shutil.copytree(tiny_world, world, ignore=shutil.ignore_patterns("policy"))
    widened(tiny_world, os.path.join(world, "policy"))
    runs = {}
    for eng in ("cached", "vllm"):
        out = str(tmp_path / eng)
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               os.path.join(ROOT, "train_twice.py"), f"--world={world}", f"--out_dir={out}",
               "--prompts_per_step=4", "--group_size=3", "--max_new_tokens=24", "--max_obs_tokens=200",
               "--max_turns=2", "--max_context=768", "--lr=1e-3", "--micro_batch_size=6", "--eval_size=6",
               "--steps=2", "--eval_every=0", "--log_episodes=12", f"--engine={eng}", "--vllm_kv_gib=0.1"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                              env=dict(os.environ, ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1"))
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
        runs[eng] = ([json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))],
                     [json.loads(line) for line in open(os.path.join(out, "episodes.jsonl"))])
    (m_c, e_c), (m_v, e_v) = runs["cached"], runs["vllm"]
    steps_c, steps_v = [r for r in m_c if not r.get("final")], [r for r in m_v if not r.get("final")]
    assert len(steps_c) == len(steps_v) == 2 and all(r["weights_spread"] == 0.0 for r in steps_v)
    for a, b in zip(steps_c, steps_v):
        for key in ("reward", "factual_tokens", "aux_tokens", "twins"):
            assert a[key] == b[key], key
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-4, abs_tol=1e-6)
    assert len(e_c) == len(e_v) >= 12
    assert [e["ids"] for e in e_c] == [e["ids"] for e in e_v]
    assert [[tw["ids"] for tw in e["twins"]] for e in e_c] == [[tw["ids"] for tw in e["twins"]] for e in e_v]


# --- the processor's core, without vLLM ---
class _Rule:
    """A stop rule over integer tokens: token 9 completes a stop string, 2 is EOS."""
    def reason(self, row, tok):
        return "stop" if tok == 9 else "eos" if tok == 2 else ("length" if len(row.ids) >= row.budget else None)


def _request(key=11, budget=8, given=(), ban=None):
    from generation.rows import Row, TurnStart
    from generation.vllm_engine import Request
    start = TurnStart(0, list(given), [0.0] * len(given), [0.0] * len(given), key=None if ban is None else 77,
                      ban=ban) if given or ban is not None else None
    row = Row(0, [1, 2, 3] + list(given), key, budget, start, given=len(given), ids=list(given),
              logprobs=[0.0] * len(given), entropy=[0.0] * len(given))
    return Request(row, (1.0, 0, 1.0, False), _Rule(), 2)


def test_draw_is_keyed_draw_and_a_stop_string_forces_eos_next():
    import sampler
    from generation.vllm_engine import catch_up, draw, finish
    torch.manual_seed(0)
    logits = torch.randn(2, 16)
    reqs = [_request(11), _request(12, given=[5, 6], ban=4)]
    out = [[], []]
    for step in range(3):
        for q, o in zip(reqs, out):
            catch_up(q, o)
        l = logits.clone()
        draw(l, [(0, reqs[0]), (1, reqs[1])])
        for b, (q, o) in enumerate(zip(reqs, out)):
            key, pos, ban = (11, step, -1) if b == 0 else ((77, 2, 4) if step == 0 else (12, 2 + step, -1))
            row = logits[b:b + 1].clone()
            if ban >= 0:
                row[0, ban] = -math.inf
            want = int(sampler.keyed_gumbel_argmax(row, [key], pos, 1.0)[0])
            assert torch.isfinite(l[b]).sum() == 1 and int(l[b].argmax()) == want
            o.append(want)
    # a stop string completes on token 9: the next draw is the forced EOS, which finish() drops
    q, o = _request(13), [4, 9]
    catch_up(q, o)
    q.drawn = {0: 4, 1: 9}
    l = torch.zeros(1, 16)
    draw(l, [(0, q)])
    assert int(l[0].argmax()) == 2 and torch.isfinite(l[0]).sum() == 1
    q.row.logprobs, q.row.entropy = [-1.0, -2.0], [0.5, 0.5]
    ids, lps, _, stop = finish(q, o + [2], "stop")
    assert ids == [4, 9] and lps == [-1.0, -2.0] and stop == "stop"


def test_finish_refuses_a_token_that_is_not_the_keyed_draw():
    from generation.vllm_engine import finish
    q = _request(14)
    q.drawn = {0: 4, 1: 5}
    q.row.logprobs, q.row.entropy = [0.0, 0.0], [0.0, 0.0]
    with pytest.raises(AssertionError, match="keyed draw was 5"):
        finish(q, [4, 6], "length")
    q2 = _request(15, budget=2)
    q2.drawn = {0: 4, 1: 5}
    q2.row.logprobs, q2.row.entropy = [0.0, 0.0], [0.0, 0.0]
    assert finish(q2, [4, 5], "length")[3] == "length"


def test_the_gpu_figure_runs_at_a_tiny_size_on_the_cpu(tmp_path):
    """make gpu-check's engine=vllm figure (perf/bench_vllm.py --gpu) is the same code as --tiny: vLLM and the cached
    engine decode one turn of every row, agree on every row in float32, and the figures a GPU fills are there."""
    out = str(tmp_path / "fig.json")
    proc = subprocess.run([sys.executable, "-m", "perf.bench_vllm", "--tiny", "--json", out], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    fig = json.load(open(out))
    assert fig["vllm"]["tokens"] == fig["cached"]["tokens"] == 12 * 24 and fig["same_rows"] == 1.0
    assert fig["vllm"]["tok_s"] > 0 and fig["sync_s"] >= 0 and fig["start_s"] > 0
    assert set(fig["memory_gib"]) == {"before", "awake", "after_turn", "asleep", "awake_again"}
