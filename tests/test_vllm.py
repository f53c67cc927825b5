"""engine=vllm (generation/vllm_engine.py): vLLM's tokens are the keyed draws. perf/bench_vllm.py runs every kind of
draw through vLLM and through the cached engine on the same weights, in a process of its own (vLLM binds the process's
threads); these tests read its figures. A 2-step training run with engine=vllm samples the same tokens as one with the
cached engine. The processor's core (catch_up, draw, finish) is tested here without vLLM; KeyedProcessorV2 (Model Runner
V2, vLLM's GPU default) on FakeV2, a V2 runner made of vLLM's own V2 loader and state; the engine's start with vLLM
stubbed at its config and LLM, and once for real (V2 refused on a CPU, in seconds)."""
import importlib
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import types

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY0 = os.path.join(ROOT, "worlds", "tiny-0")


@pytest.fixture(scope="module")
def figures(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("bench") / "vllm.json")
    proc = subprocess.run([sys.executable, "-m", "perf.bench_vllm", "--world", TINY0, "--and_tiny", "--max_new", "24",
                           "--speed_group", "2", "--speed_reps", "1", "--json", out], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
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
    assert s["episodes"] == 32  # 16 questions x --speed_group 2 (the figure of RESULTS.md: x 8, the best of 2)


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
            catch_up(q, o[q.held:])
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
    assert q.held == 2 and q.forced == 2
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


def test_the_gpu_figure_runs_at_a_tiny_size_on_the_cpu(figures):
    """make gpu-check's engine=vllm figure (perf/bench_vllm.py --gpu) is the same code as --tiny (run here by the
    figures' process, --and_tiny): vLLM and the cached engine decode one turn of every row, agree on every row in
    float32, and the figures a GPU fills are there."""
    fig = figures["tiny_figure"]
    assert fig["vllm"]["tokens"] == fig["cached"]["tokens"] == 12 * 24 and fig["same_rows"] == 1.0
    assert fig["vllm"]["tok_s"] > 0 and fig["sync_s"] >= 0 and fig["start_s"] > 0
    assert set(fig["memory_gib"]) == {"before", "awake", "after_turn", "asleep", "awake_again"}


# --- Model Runner V2 (vLLM's GPU default), faked on the CPU from vLLM's own runner state ---
class FakeV2:
    """vllm.LLM on Model Runner V2 as vLLM 0.32's source runs a custom logits processor, with vLLM's
    own pieces where they run on a CPU: the processors built by its loader
    (build_custom_logits_processors: the V2 interface's class check and constructor), slots and token
    buffers from its RequestState (v1/worker/gpu/states.py; its staged writes applied as
    buffer_utils' kernel does), a LogitsContext per step (sample/sampler.py), greedy argmax at
    temperature 0 (sample/gumbel.py), each sampled token appended as post_update does
    (input_batch.py). Logits: the transformers model on the whole sequence. The batch is reordered
    every step; at most max_num_seqs run, so slots are reused; every third request first runs a
    chunked prefill (a logits row whose sample is dropped); one request is preempted and comes back
    at a new slot with its outputs as prefill; another user's request shares the batches."""

    def __init__(self, model, kw):
        import numpy as np
        from vllm.v1.worker.gpu.sample.logits_processor import build_custom_logits_processors
        from vllm.v1.worker.gpu.states import RequestState
        self.model, self.max_seqs, self.rng = model, kw["max_num_seqs"], np.random.default_rng(0)
        self.state = RequestState(kw["max_num_seqs"], kw["max_model_len"], 8192, 0, model.config.vocab_size,
                                  torch.device("cpu"))
        self.procs = build_custom_logits_processors(None, self.state, False, kw["logits_processors"])
        self.llm_engine = types.SimpleNamespace(vllm_config=types.SimpleNamespace(use_v2_model_runner=True))
        self.seen = {"chunked": 0, "preempted": 0, "slots": set(), "admitted": 0, "other": 0, "other_untouched": 0}

    def _admit(self, r):
        self.state.add_request(r["id"], len(r["prompt"]), r["prompt"] + r["out"], 0, r["params"].max_tokens)
        for t in (self.state.all_token_ids, self.state.total_len):  # _apply_write_kernel, in Python
            rows, at = t.gpu.view(t.num_rows, -1), 0
            for i, start, end in zip(t._staged_write_indices, t._staged_write_starts, t._staged_write_cu_lens):
                rows[i, start:start + end - at] = torch.tensor(t._staged_write_contents[at:end], dtype=t.dtype)
                at = end
            t.clear_staged_writes()
        slot = self.state.req_id_to_index[r["id"]]
        for p in self.procs:
            p.add_request(slot, r["params"])
        self.seen["slots"].add(slot)
        self.seen["admitted"] += 1
        r["chunk"] = (len(r["prompt"]) + len(r["out"])) // 2 if self.seen["admitted"] % 3 == 0 else 0

    def _step(self, batch):
        from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext
        import numpy as np
        seqs = [(r["prompt"] + r["out"])[:r["chunk"] or None] for r in batch]
        with torch.no_grad():
            raw = torch.stack([self.model(torch.tensor([s])).logits[0, -1].float() for s in seqs])
        slots = np.array([self.state.req_id_to_index[r["id"]] for r in batch], dtype=np.int32)
        idx = torch.tensor(slots, dtype=torch.long)
        ctx = LogitsContext(expanded_idx_mapping=idx, idx_mapping=idx, idx_mapping_np=slots,
                            expanded_local_pos=torch.zeros(len(batch), dtype=torch.int32),
                            input_ids=torch.tensor([s[-1] for s in seqs]),
                            pos=torch.tensor([len(s) - 1 for s in seqs]),
                            seq_lens_upper_bound_np=np.array([len(s) for s in seqs]))
        logits = raw.clone()
        for p in self.procs:
            logits = p.apply(logits, ctx)
        for i, r in enumerate(batch):
            if r["id"] == "other":
                self.seen["other"] += 1
                self.seen["other_untouched"] += int(torch.equal(logits[i], raw[i]))
        return logits.argmax(-1).tolist()

    def generate(self, prompts, params, use_tqdm=False):
        from collections import deque
        from vllm import SamplingParams
        reqs = [dict(id=f"r{i}", prompt=list(p["prompt_token_ids"]), params=q, out=[], done=None)
                for i, (p, q) in enumerate(zip(prompts, params))]
        other = dict(id="other", prompt=reqs[0]["prompt"][:5], params=SamplingParams(temperature=0.0, max_tokens=6),
                     out=[], done=None)
        waiting, running, preempt = deque([other] + reqs), [], True
        while waiting or running:
            while waiting and len(running) < self.max_seqs:
                running.append(waiting.popleft())
                self._admit(running[-1])
            batch = [running[i] for i in self.rng.permutation(len(running))]
            for r, tok in zip(batch, self._step(batch)):
                if r["chunk"]:  # a chunked prefill: its sample is dropped, nothing is written
                    r["chunk"], self.seen["chunked"] = 0, self.seen["chunked"] + 1
                    continue
                slot = self.state.req_id_to_index[r["id"]]  # post_update
                self.state.all_token_ids.gpu[slot, self.state.total_len.gpu[slot]] = tok
                self.state.total_len.gpu[slot] += 1
                r["out"].append(tok)
                stop = tok in (r["params"].stop_token_ids or [])
                r["done"] = "stop" if stop else "length" if len(r["out"]) >= r["params"].max_tokens else None
            for r in [r for r in running if r["done"]]:
                running.remove(r)
                self.state.remove_request(r["id"])
            victim = [r for r in running if r["id"] != "other" and len(r["out"]) >= 3 and not r["chunk"]][:1]
            if victim and preempt:  # its slot freed, back first in line with its outputs as prefill
                running.remove(victim[0])
                self.state.remove_request(victim[0]["id"])
                waiting.appendleft(victim[0])
                preempt, self.seen["preempted"] = False, self.seen["preempted"] + 1
        return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=r["out"], finish_reason=r["done"])])
                for r in reqs]


def _v2_modules():
    """vllm, its V2 buffer utilities and EngineArgs, first imported on a thread of their own: importing
    vllm.engine.arg_utils leaves one of vLLM's module-level frames alive (vllm/multimodal/media/audio.py's), and with
    it every frame below it, the importer's included, with its locals (the fixture's episodes and their KV caches,
    which tests/test_kvbudget.py then counted in the same worker). A thread's first frame has no caller."""
    names = ("vllm", "vllm.v1.worker.gpu.buffer_utils", "vllm.engine.arg_utils")
    thread = threading.Thread(target=lambda: [importlib.import_module(name) for name in names])
    thread.start()
    thread.join()
    import vllm  # imported already: these lines make no module frame
    import vllm.v1.worker.gpu.buffer_utils as buffers
    from vllm.engine.arg_utils import EngineArgs
    return vllm, buffers, EngineArgs


@pytest.fixture(scope="module")
def v2(tmp_path_factory):
    """VLLMEngine told by vLLM (create_engine_config) that it runs Model Runner V2, over FakeV2, against the cached
    engine on the committed tiny world's policy with widened heads (as perf/bench_vllm.py: its turns hold newlines and
    end in all three ways): factual episodes, coupled twins, token forks, mid-turn replays and text-line keys, each as
    (rows, rows with the same tokens); and what the fake went through. One torch thread: a few seconds."""
    vllm, buffers, EngineArgs = _v2_modules()
    import retriever
    import rollout
    from eval import load_policy, load_qa
    from generation.vllm_engine import VLLMEngine
    from perf.bench_vllm import widened
    from protocol import Protocol
    path = widened(TINY0, str(tmp_path_factory.mktemp("v2") / "policy"))
    model, tok = load_policy(path)
    retr = retriever.Retriever(os.path.join(TINY0, "index"))
    qs = load_qa(os.path.join(TINY0, "train.jsonl"))[:6]
    proto = Protocol(max_turns=2, max_new_tokens=24, max_context=1024, gen_batch_size=64)
    same = lambda a, b: (len(a), sum(x.ids == y.ids for x, y in zip(a, b)))  # noqa: E731
    out, threads = {}, torch.get_num_threads()
    torch.set_num_threads(1)  # a forward per row per step: on a busy 2-core machine, threads only wait
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        for var in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_V2_MODEL_RUNNER"):
            mp.setenv(var, "unset")  # put back as they were afterwards
        mp.setattr(EngineArgs, "create_engine_config", lambda self, *a, **k: types.SimpleNamespace(
            use_v2_model_runner=True))
        mp.setattr(vllm, "LLM", lambda **kw: FakeV2(model, kw))
        mp.setattr(buffers, "is_uva_available", lambda: False)  # no pinned memory on a CPU: vLLM's own fallback
        engine = VLLMEngine(path, model, proto.max_context, kv_gib=0.25, max_num_seqs=4)

        def episodes(m, proto=proto):
            return rollout.run_episodes(m, tok, retr, rollout.start_episodes(tok, qs, 3, 1, 2), proto)
        ref, got = episodes(model), episodes(engine)
        out["factual"], out["stops"] = same(ref, got), {t.stop for e in ref for t in e.turns}
        for name, fork in (("twins", False), ("forks", True)):
            twins = []
            for m, eps in ((model, ref), (engine, got)):
                reqs = [(e, t, 0) for e in eps for t in range(len(e.turns)) if e.turns[t].end - e.turns[t].start >= 2]
                ks = [(e.turns[t].end - e.turns[t].start) // 2 for e, t, _ in reqs]
                twins.append([r.twin for r in rollout.run_twins(m, tok, retr, reqs, proto, forks=ks if fork else None,
                                                                same_evidence_shortcut=False) if r.kind == "rollout"])
            out[name] = same(*twins)
        replays = [(e, 0, max(0, (e.turns[0].end - e.turns[0].start) // 2 - 1), e.key) for e in got]
        out["replays"] = same(got, rollout.continue_after_token(engine, tok, retr, replays, proto))
        lines = Protocol(**{**proto.__dict__, "line_keys": "text"})
        out["lines"] = same(episodes(model, lines), episodes(engine, lines))
        out["lines_differ"] = out["lines"][0] - same(ref, episodes(model, lines))[1]
    torch.set_num_threads(threads)
    out["runner"], out["processor"], out["seen"] = engine.runner, type(engine.llm.procs[-1]).__name__, engine.llm.seen
    return out


def test_v2_processor_samples_the_cached_engines_tokens_on_vllms_v2_runner_state(v2):
    """KeyedProcessorV2 (generation/vllm_engine.py), built by vLLM's V2 loader and fed vLLM's own V2 slot buffers and
    LogitsContext, draws every kind of keyed draw exactly: the same tokens as the cached engine, through slot reuse,
    reordered batches, chunked prefills, preemptions and a request of another user it leaves untouched."""
    assert v2["runner"] == "v2" and v2["processor"] == "KeyedProcessorV2"
    for kind in ("factual", "twins", "forks", "replays", "lines"):
        rows, same = v2[kind]
        assert rows >= 8 and same == rows, (kind, v2[kind])
    assert v2["stops"] == {"stop", "eos", "length"}  # a stop string's forced EOS, EOS and the budget, through V2
    assert v2["lines_differ"] > 0  # the text-line keys are another noise: the check bites
    seen = v2["seen"]
    assert seen["chunked"] > 0 and seen["preempted"] > 0 and seen["admitted"] > len(seen["slots"])
    assert seen["other"] > 0 and seen["other_untouched"] == seen["other"]


# --- the engine's start: the processor of the runner vLLM picks, or a stop in seconds ---
def _stub_vllm(monkeypatch, picked, live=None):
    """vLLM stubbed at the two calls of vllm_engine.start: the config its arguments make (the runner vLLM picks) and
    LLM (what it is handed; the runner it then runs: `live`, by default the one picked)."""
    import vllm
    from vllm.engine.arg_utils import EngineArgs
    monkeypatch.setattr(EngineArgs, "create_engine_config", lambda self, *a, **k: types.SimpleNamespace(
        use_v2_model_runner=picked == "v2"))
    made = []

    def llm(**kw):
        shut = []
        config = types.SimpleNamespace(use_v2_model_runner=(live or picked) == "v2")
        made.append(types.SimpleNamespace(kw=kw, shut=shut, llm_engine=types.SimpleNamespace(
            vllm_config=config, engine_core=types.SimpleNamespace(shutdown=lambda: shut.append(1)))))
        return made[-1]
    monkeypatch.setattr(vllm, "LLM", llm)
    return made


@pytest.mark.parametrize("asked,picked", [("v1", "v1"), ("v2", "v2"), ("v1", "v2"), ("v2", "v1")])
def test_the_engine_hands_vllm_the_processor_of_the_runner_vllm_picks(monkeypatch, capsys, asked, picked):
    """Whatever vLLM picks for the engine's arguments, the processor it is handed is that runner's: the one its loader
    for that runner accepts (the other runner's loader refuses it, at start-up: what the V1-only engine met on V2)."""
    from vllm.v1.sample.logits_processor import _load_logitsprocs_by_fqcns as load_v1
    from vllm.v1.worker.gpu.sample.logits_processor.loader import _load_v2_logitsprocs_by_fqcns as load_v2
    from generation.vllm_engine import start
    made = _stub_vllm(monkeypatch, picked)
    llm, runner = start({"model": os.path.join(TINY0, "policy")}, asked)
    cls, = llm.kw["logits_processors"]
    assert runner == picked and llm is made[0] and llm.kw["model"] == os.path.join(TINY0, "policy")
    assert cls.__name__ == {"v1": "KeyedProcessor", "v2": "KeyedProcessorV2"}[picked]
    right, wrong = (load_v1, load_v2) if picked == "v1" else (load_v2, load_v1)
    assert right([cls]) == [cls]
    with pytest.raises(ValueError, match="is not a subclass of"):
        wrong([cls])
    assert ("vLLM picked Model Runner" in capsys.readouterr().out) == (asked != picked)


def test_a_refused_start_stops_in_seconds_naming_the_runner_and_the_fallback(monkeypatch):
    """Model Runner V2 asked on a CPU: vLLM itself refuses it (no Triton CPU backend) while building its config, before
    any weight loads, and the engine stops with the runner and --engine=cached in its message. A runner at start other
    than the one the arguments resolved to (stubbed) stops it too, the engine shut down."""
    import time
    from eval import load_policy
    from generation.vllm_engine import VLLMEngine, start
    for var in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_V2_MODEL_RUNNER"):
        monkeypatch.setenv(var, "unset")  # put back as they were afterwards
    path = os.path.join(TINY0, "policy")
    model, _ = load_policy(path)
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError) as err:
        VLLMEngine(path, model, 512, kv_gib=0.25, max_num_seqs=4, runner="v2")
    took = time.perf_counter() - t0
    msg = str(err.value)
    assert "Model Runner V2 (vllm_runner=v2 asked)" in msg and "Triton" in msg and "--engine=cached" in msg, msg
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1" and took < 120, took  # seconds of config, no weights
    made = _stub_vllm(monkeypatch, "v1", live="v2")
    with pytest.raises(RuntimeError, match=r"Model Runner V2 \(vllm_runner=v1 asked\).*resolved to Model Runner V1"):
        start({"model": path}, "v1")
    assert made[0].shut == [1]


def test_the_start_memory_share_passes_vllms_own_check():
    """vLLM 0.32 refuses a start while less than gpu_memory_utilization x total is free, whatever the pool's bytes
    (v1/worker/utils.py request_memory): colocated with the trainer, 0.92 cannot be; startup_share can."""
    from vllm.v1.worker.utils import request_memory
    from generation.vllm_engine import startup_share
    snap = types.SimpleNamespace(total_memory=80 * 2 ** 30, free_memory=60 * 2 ** 30, device_="cuda:0")
    with pytest.raises(ValueError, match="less than desired GPU memory utilization"):
        request_memory(snap, types.SimpleNamespace(gpu_memory_utilization=0.92))
    share = startup_share(snap.free_memory, snap.total_memory)
    assert 0 < share < 0.75 and request_memory(snap, types.SimpleNamespace(gpu_memory_utilization=share)) < 60 * 2 ** 30


def test_a_policy_off_the_first_gpu_stops_the_engine():
    """vLLM 0.32's in-process engine starts on cuda:0 whatever the rank (vllm/config/device.py, uniproc_executor.py):
    a policy on cuda:1 stops the start, naming --engine=cached; cuda:0 goes on."""
    from generation.vllm_engine import first_gpu_only
    first_gpu_only(torch.device("cuda", 0))
    with pytest.raises(RuntimeError, match="would start on cuda:0.*--engine=cached"):
        first_gpu_only(torch.device("cuda", 1))
