"""Tests for the memory ledger (perf/ledger.py, perf/memprobe.py, perf/memtrack.py, perf/gpucheck.py) and the memory fixes it led to
(DESIGN.md section 10): the tracker counts storages exactly; a small probe measures a wider model exactly; the ledger
predicts a measured run within 10% per phase (the first-GPU check at its tiny size); the README's table is
memory.json's and both presets fit 80 GiB with 10% headroom, the engine's slot cache inside; KV caches and the slot
cache are freed when the twins are done, sampled in the rollout dtype, never held twice (a larger slot cache, the
prefill's stacked rows); the twins' chunks change no twin; LoRA's layout is lora.memory_bytes."""
import gc
import json
import math
import os
import subprocess
import sys
import weakref

import pytest
import torch
from transformers import Qwen2Config
from test_rollout import FakeRetriever, one_thread, questions, tiny_model, word_model, word_tok  # noqa: F401

from generation import engine
from perf import gpucheck
from generation import kvcache
from perf import ledger
from infra import lora, weights
from perf import memprobe
from perf import memtrack
import rollout
import train_twice as tt
from protocol import Protocol

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- memtrack: what is counted ---
def test_tracker_counts_storages_once_with_the_allocators_rounding():
    tracker = memtrack.Tracker(lambda t: "a" if t.dtype == torch.float32 else "b")
    with tracker:
        x = torch.zeros(100)            # 400 bytes -> one 512-byte block
        view = x[10:20].view(2, 5)      # a view: no new storage
        y = torch.zeros(200, dtype=torch.float64)  # 1600 -> 2048
        assert (tracker.total, tracker.bytes["a"], tracker.bytes["b"], tracker.raw["b"]) == (2560, 512, 2048, 1600)
        assert tracker.count["a"] == 1
        del x
        assert tracker.total == 2560    # the view keeps the storage alive
        del view
        assert tracker.total == 2048
        y.untyped_storage().resize_(4000)  # not an op: the tracker patches resize_
        assert tracker.raw["b"] == 4000 and tracker.bytes["b"] == 4096
        del y
        assert tracker.total == 0
    exact = memtrack.Tracker(block=1)
    with exact:
        z = torch.ones(3, 7)
        assert exact.total == 84
        del z


def test_tracker_phases_scale_tags_and_holds():
    tracker = memtrack.Tracker(lambda t: "kv" if t.dim() == 2 else "other", scale={"kv": 10.0}, block=1)
    with tracker:
        with tracker.phase("p"):
            a = torch.zeros(4, 4)         # kv: 64 exact bytes, counted 640
            b = torch.zeros(8)            # other: 32
            with tracker.hold("virtual", 1000):
                pass                       # 640 + 32 + 1000 at the peak
            del b
        assert tracker.peaks["p"]["total"] == 1672 and tracker.peaks["p"]["bytes"]["virtual"] == 1000
        tracker.tag([a], "other")          # re-tagged: counted as it is now
        assert tracker.total == 64
        with tracker.phase("q"):           # a phase without allocations peaks at what was live
            pass
        assert tracker.peaks["q"]["total"] == 64


# --- memprobe: a small model measures a wide one ---
def test_a_probe_measures_a_wider_model_exactly():
    """The same scripted step with a narrow and a wide model of the same layers: KV entries, batch caches and step
    tensors of the wide one at each phase's peak equal the narrow one's scaled by memprobe.probe_scale."""
    cfg = memprobe.step_config(os.path.join(ROOT, "configs/qwen2.5-3b.cfg"), gpucheck.TINY_FLAGS + ["--max_turns=2"])
    wide = dict(gpucheck.TINY)
    narrow = memprobe.probe_dims(wide)
    script = memprobe.SCRIPTS["search-r1"]
    keep = {f"{o}/{k}": float(o in ("kv_entries", "decode_batch", "other")) for o in
            ("kv_entries", "decode_batch", "other", "activations", "weights", "reference", "gradients", "optimizer")
            for k in ("kv", "hidden", "other")}
    measured = memprobe.run_steps(cfg, wide, torch.float32, script, scale=keep, attention="probe")
    scale = {k: v * keep[k] for k, v in memprobe.probe_scale(narrow, torch.float32, wide, torch.float32).items()}
    probed = memprobe.run_steps(cfg, narrow, torch.float32, script, scale=scale, attention="probe")
    assert measured["metrics"]["factual_tokens"] == probed["metrics"]["factual_tokens"] > 500
    assert measured["metrics"]["twins"] == probed["metrics"]["twins"] > 0
    for phase in ("rollout", "twins"):
        a, b = measured["peaks"][phase]["bytes"], probed["peaks"][phase]["bytes"]
        for owner in ("kv_entries", "decode_batch"):
            got = sum(v for k, v in a.items() if k.startswith(owner))
            assert got > 0 and abs(got - sum(v for k, v in b.items() if k.startswith(owner))) < 1e-6 * got, phase


def test_one_mini_batch_peaks_as_the_whole_update(monkeypatch):
    """The ledger's probe runs one mini-batch of the update (memprobe.one_mini_batch): on a step of 3 mini-batches of
    2 micro-batches each, its tracked peaks at the ledger's scale equal a probe of every mini-batch byte for byte, in
    every phase and category, and the micro-batches it skipped are recorded with the shapes they have when run."""
    cfg = memprobe.step_config(os.path.join(ROOT, "configs/qwen2.5-3b.cfg"), gpucheck.TINY_FLAGS + [
        "--prompts_per_step=4", "--mini_batches=3", "--micro_batch_size=2", "--omega=0", "--max_turns=1"])
    dims = memprobe.probe_dims(gpucheck.TINY)
    scale = memprobe.probe_scale(dims, torch.float32, gpucheck.TINY, torch.float32)
    passes, loss = [], tt.ppo_loss
    monkeypatch.setattr(tt, "ppo_loss", lambda *a, **k: passes.append(1) or loss(*a, **k))
    runs = []
    for every in (True, False):
        passes.clear()
        runs.append(memprobe.run_steps(cfg, dims, torch.float32, memprobe.SCRIPTS["search-r1"], scale=scale,
                                       attention="probe", every_mini_batch=every))
        runs[-1]["passes"] = len(passes)
    every, one = runs
    assert (every["passes"], one["passes"]) == (6, 2) and ledger.update_counts(cfg)["passes"] == 6
    assert every["peaks"].keys() == one["peaks"].keys() == set(ledger.PHASES)
    for phase in ledger.PHASES:  # categories the ledger counts 0 (taken from elsewhere) left out
        a, b = ({k: v for k, v in run["peaks"][phase]["bytes"].items() if v} for run in (every, one))
        assert every["peaks"][phase]["total"] == one["peaks"][phase]["total"] > 0 and a == b, phase
    assert every["peaks"]["update"]["total"] > every["peaks"]["logprobs"]["total"]  # the update's own tensors
    update = every["shapes"]["update", "scored"]
    assert sorted(update) == sorted(one["shapes"]["update", "scored"]) and len(update) == 6
    widest = max(range(6), key=lambda i: update[i][0] * update[i][1])
    assert widest >= 2, update  # the probed mini-batch is not the first: the one holding the widest micro-batch


def test_scripted_turns_have_the_scripts_lengths():
    tok, script = memprobe.script_tokenizer(), memprobe.SCRIPTS["search-r1"]
    rows = memprobe.script_rows(tok, script, 3)
    prompt = memprobe._ids(tok, rollout.render_prompt(tok, rows[0]["question"]))
    assert len(prompt) == script.prompt
    docs = memprobe.ScriptedRetriever(tok, script).search(["a", "b"], topk=3)
    assert docs[0][0]["id"] != docs[1][0]["id"]  # another query, other documents (no same-evidence shortcut)


# --- the ledger against a measured run, and the first-GPU check's tiny size ---
def test_gpu_check_tiny_matches_the_ledger_within_10_percent(tmp_path):
    """The check's train step at its tiny size, 2 prompts of at most 2 turns (a process of its own: the check forks
    its parts): every phase measured within 2.2% of the prediction (2026-12-07; 1.4% at 4 turns, in 1.6x the time);
    at one step instead of two the rollout's is 14% under (the measured step is then the first)."""
    cpu = [f"--budget={name}=1500" for name in gpucheck.BUDGET_S] + ["--time_limit=3000"]  # an H100's are less
    run = subprocess.run([sys.executable, "-m", "perf.gpucheck", "--tiny", "--parts", "train_step", "--prompts", "2",
                          "--set", "max_turns=2", "--out", str(tmp_path / "check.json"), *cpu], cwd=ROOT,
                         capture_output=True, text=True, timeout=3600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    saved = json.load(open(tmp_path / "check.json"))["parts"]["train_step"]
    assert saved["phases"].keys() == set(ledger.PHASES) and "error" not in saved
    for phase, row in saved["phases"].items():
        assert row["measured_gib"] > 0 and 0.9 <= row["ratio"] <= 1.1, (phase, row)
    assert saved["tokens_per_s"] > 0 and saved["update_s"] > 0 and saved["step"]["twins"] > 0
    assert saved["held_after_step"] == {"slot_caches": 0, "kv_entries": 0}  # train_step freed the engine's caches


def test_the_decode_fit_holds_on_other_shapes():
    """At the 3B preset's widths and vocabulary (2 layers: a decode step's activations live one layer at a time)."""
    cfg = memprobe.step_config(os.path.join(ROOT, "configs/qwen2.5-3b.cfg"))
    dims = {**ledger.QWEN["3b"], "num_hidden_layers": 2}
    virtual = ledger.rollout_activations(dims, torch.bfloat16, cfg)
    for rows, width in ((48, 1500), (64, 3500), (5, 700)):
        fake = ledger.decode_activations(dims, torch.bfloat16, cfg, rows, width)
        assert fake > 0 and abs(virtual("decode", rows, 1, width) - fake) <= 0.05 * fake, (rows, width)


def test_zero2_layout_by_hand():
    ds = {"zero_optimization": {"overlap_comm": True, "reduce_bucket_size": 100}}
    adam = {"state": 8 * 250, "peak": 12 * 250}  # AdamW's two moments and its sqrt temporary, on 250 parameters
    got = ledger.zero2_static(1000, 300, 4, adam, ds)
    assert got["rollout"] == {"weights": 2000, "optimizer": 4 * 250 + 2000, "gradients": 0}
    assert got["update"]["gradients"] == 2 * 2 * (250 + 300) + 2 * 100 * 2 + 2 * 300  # sums, buckets, one in flight
    assert got["optimizer_step"]["gradients"] == max((2 + 2 + 4) * 250, 4 * 250 + 4 * 250)  # then AdamW's sqrt


# --- the README's table and the presets' fit ---
def test_readme_memory_table_is_memory_json_and_both_presets_fit():
    saved = json.load(open(os.path.join(ROOT, "results", "memory.json")))
    assert ledger.readme_table() == ledger.table(saved)
    for size, path in ledger.PRESETS.items():
        led = saved[size]
        assert led["headroom"] >= 0.10 and led["peak_gib"] <= 0.9 * led["gpu_gib"] == 72, (size, led["peak_gib"])
        cfg = memprobe.step_config(os.path.join(ROOT, path))
        assert led["config"] == ledger.config_of(cfg), f"{path} changed since memory.json: run python -m perf.ledger --write"
        assert set(led["phases"]) == set(ledger.PHASES)
        # the engine's slot cache (kvcache.cache_bytes at CUDA's size) is inside the decode batch while episodes and
        # twins are drawn, and gone (with every KV entry) from the log-prob passes on
        dims = ledger.QWEN[size]
        assert led["slot_cache_gib"] * ledger.GIB == kvcache.cache_bytes(
            cfg.gen_batch_size, cfg.max_context + 1, Qwen2Config(**dims), torch.bfloat16, hidden=True)
        for phase in ledger.PHASES:
            parts = led["phases"][phase]["gib"]
            sampling = phase in ("rollout", "twins")
            assert (parts["decode_batch"] >= led["slot_cache_gib"]) if sampling else (parts["decode_batch"] == 0)
            assert sampling or parts["kv_entries"] == 0


@pytest.mark.slow
def test_memory_json_is_what_the_code_produces(tmp_path):
    saved = json.load(open(os.path.join(ROOT, "results", "memory.json")))
    for size, path in ledger.PRESETS.items():
        now = ledger.preset_ledger(os.path.join(ROOT, path))
        for phase in ledger.PHASES:
            a, b = saved[size]["phases"][phase]["total_gib"], now["phases"][phase]["total_gib"]
            assert abs(a - b) <= 0.02 * a, (size, phase, a, b)


# --- the fixes: caches freed, sampled in the rollout dtype, twins in chunks ---
def test_twins_in_chunks_are_the_same_twins_and_release_every_cache(word_tok, word_model):  # noqa: F811
    proto = Protocol(max_turns=2, max_new_tokens=12, gen_batch_size=8)
    runs = []
    for chunk, release in ((0, False), (3, True)):
        eps = rollout.run_episodes(word_model, word_tok, FakeRetriever(), rollout.start_episodes(
            word_tok, questions(4), 3, 1, 2), proto)
        assert all(getattr(ep, "_kv", None) is not None for ep in eps)
        requests = [(ep, t, 0) for ep in eps for t in range(len(ep.turns))]
        twins = rollout.run_twins(word_model, word_tok, FakeRetriever(), requests, proto, chunk=chunk,
                                  release=release)
        runs.append([(r.request, r.kind, r.twin.ids, r.outcome) for r in twins])
        if release:
            assert all(getattr(x, "_kv", None) is None for x in eps + [r.twin for r in twins])
    assert runs[0] == runs[1] and len(runs[0]) >= 4


def test_sampling_copy_is_bf16_tied_and_the_policy_itself_when_it_already_is():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.forward = lambda *a, **k: None  # an instance attribute, as accelerate's autocast wrapper is
    copy = weights.sampling_copy(model, torch.bfloat16)
    assert copy is not model and all(p.dtype == torch.bfloat16 and not p.requires_grad for p in copy.parameters())
    assert copy.lm_head.weight is copy.model.embed_tokens.weight  # tied weights stay tied
    assert "forward" not in copy.__dict__ and all(p.dtype == torch.float32 for p in model.parameters())
    assert weights.sampling_copy(model, None) is model and weights.sampling_copy(copy, torch.bfloat16) is copy


def test_stacked_values_keep_their_own_dtype():
    keys, values = torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4, dtype=torch.bfloat16)  # (layers, H, n, D)
    entry = engine.KVEntry([1, 2, 3], keys, values, None)
    (ks, vs), = engine._stack_rows([(entry, 3), (entry, 2)], 5)
    assert ks.dtype == torch.float32 and vs.dtype == torch.bfloat16 and vs.shape == (2, 2, 5, 4)
    assert vs[1, :, :3].eq(0).all() and vs[1, :, 3:].eq(1).all()


def test_on_device_leaves_a_model_already_there_as_it_is():  # the move itself needs a GPU (perf/gpucheck.py)
    model = tiny_model(20, seed=2)
    before = [p.data_ptr() for p in model.parameters()]
    with weights.on_device(model, "cpu") as same:
        assert same is model and [p.data_ptr() for p in model.parameters()] == before
    assert [p.data_ptr() for p in model.parameters()] == before


def test_the_slot_cache_dies_with_free_cache_and_so_does_a_sampling_copy(word_tok, word_model):  # noqa: F811
    """The engine keeps a model's slot cache between calls, and its decoder refers back to the model: without
    free_cache neither the cache nor a sampling copy would ever die (train_step calls it once the twins are done)."""
    proto = Protocol(max_turns=1, max_new_tokens=6, gen_batch_size=4)
    copy = weights.sampling_copy(word_model, torch.bfloat16)
    rollout.run_episodes(copy, word_tok, FakeRetriever(), rollout.start_episodes(word_tok, questions(3), 1, 0), proto)
    cache, model = weakref.ref(engine._DECODERS[copy]["cache"]), weakref.ref(copy)
    assert cache().kv_dtype == torch.bfloat16  # sampled from bf16 weights outside autocast: a bf16 cache
    del copy
    gc.collect()
    assert cache() is not None and model() is not None  # held by the engine
    engine.free_cache(model())
    gc.collect()
    assert cache() is None and model() is None


def test_a_larger_slot_cache_replaces_the_old_one_without_holding_both(word_tok, word_model):  # noqa: F811
    rule = engine.stop_rule(word_tok, engine._special_ids(word_model, word_tok)[0], len(word_tok), "cpu")
    proto = Protocol(gen_batch_size=4)
    engine.free_cache(word_model)
    engine._decoder(word_model, proto, rule, 4, 256)
    small = engine._DECODERS[word_model]["cache"].nbytes()
    tracker = memtrack.Tracker(block=1)
    with tracker, tracker.phase("grow"):
        engine._decoder(word_model, proto, rule, 8, 512)
    big = engine._DECODERS[word_model]["cache"].nbytes()
    assert big == 4 * small and tracker.peaks["grow"]["total"] - tracker.total < small  # the old one went first
    engine.free_cache(word_model)


def _one_allocation(rows, width):
    """The stacked rows as one allocation for every layer (what the engine did before)."""
    first = next(entry for entry, n in rows if n)
    ks = first.k.new_zeros((first.k.shape[0], len(rows), first.k.shape[1], width, first.k.shape[3]))
    vs = torch.zeros_like(ks)
    for b, (entry, n) in enumerate(rows):
        if n:
            ks[:, b, :, width - n:] = entry.k[:, :, :n]
            vs[:, b, :, width - n:] = entry.v[:, :, :n]
    return list(zip(ks, vs))


def test_a_prefill_frees_each_layers_stacked_rows_after_that_layer(word_tok, monkeypatch):  # noqa: F811
    """Continuing rows are stacked per layer, so the prefill's cache frees each layer's stack once that layer has
    concatenated the new positions; one allocation for every layer was held until the last layer: the prefill's
    peak was higher by at least (layers - 1) / layers of the stack, the same tokens either way."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(3)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(word_tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                                         initializer_range=0.3)).eval()
    proto = Protocol(max_turns=2, max_new_tokens=8, gen_batch_size=8)
    peaks, entries = [], []
    for stack in (engine._stack_rows, _one_allocation):
        monkeypatch.setattr(engine, "_stack_rows", stack)
        eps = rollout.start_episodes(word_tok, questions(6), 2, 0)
        rollout.step_turn(model, word_tok, FakeRetriever(), eps, proto)  # every episode holds an entry now
        live = [ep for ep in eps if not ep.done]
        stacked = sum(ep._kv.k.numel() + ep._kv.v.numel() for ep in live) * 4  # float32 keys and values
        tracker = memtrack.Tracker(lambda t: "kv" if t.dim() >= 4 and t.shape[-1] == 16 else "other", block=1)
        with tracker, tracker.phase("prefill"):
            engine._prefill(model, live, [ep.prompt_ids + ep.ids for ep in live], proto, word_tok.pad_token_id)
        peaks.append(tracker.peaks["prefill"]["bytes"]["kv"])
        entries.append([(ep._kv.ids, ep._kv.k, ep._kv.v) for ep in live])
    assert len(entries[0]) >= 2 and stacked > 0
    assert all(a[0] == b[0] and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]) for a, b in zip(*entries))
    assert peaks[1] - peaks[0] >= stacked * 3 / 4, peaks


def test_lora_layout_is_lora_memory_bytes():
    cfg = memprobe.step_config(os.path.join(ROOT, "configs/qwen2.5-3b.cfg"), ["--lora_rank=16"])
    got = ledger.lora_static(cfg, ledger.QWEN["3b"], world=8)
    held = lora.memory_bytes("Qwen2.5-3B", 16)
    r, layers, h, i, kv = 16, 36, 2048, 11_008, 256
    adapter = layers * r * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + i) + (i + h))  # q, k, v, o, gate, up, down
    assert held["adapter_params"] == adapter
    assert got["rollout"] == {"weights": held["lora"]["weights"], "optimizer": 8 * adapter, "gradients": 0}
    assert got["update"]["gradients"] == 2 * 4 * adapter  # the gradients and DDP's bucket copy of them
    assert got["optimizer_step"]["optimizer"] > 8 * adapter  # AdamW's step temporaries on top of its moments
    with pytest.raises(ValueError, match="DDP"):
        ledger.build(cfg, ledger.QWEN["3b"], "zero2")


def test_vllm_colocated_fits_both_presets():
    """results/memory_vllm.json (`python -m perf.ledger --set engine=vllm --json ...`): at each preset the vLLM engine
    (its weights, the preset's KV pool, its workspace) replaces the cached engine's caches and batches while it samples,
    is asleep after (sleep mode), and the peak leaves >= 10% of 80 GiB; the pool holds every row at max_context."""
    saved = json.load(open(os.path.join(ROOT, "results", "memory_vllm.json")))
    for size, path in ledger.PRESETS.items():
        led, cfg = saved[size], memprobe.step_config(os.path.join(ROOT, path), ["--engine=vllm"])
        assert led["headroom"] >= 0.10 and led["config"] == ledger.config_of(cfg)
        parts = ledger.vllm_parts(cfg, ledger.QWEN[size], torch.bfloat16)
        for phase in ledger.PHASES:
            gib = led["phases"][phase]["gib"]
            for cat in ledger.VLLM_CATEGORIES:
                assert math.isclose(gib[cat], parts[phase][cat] / ledger.GIB, rel_tol=1e-9)
            if phase in ("rollout", "twins"):
                assert gib["kv_entries"] == gib["decode_batch"] == 0 and gib["vllm_pool"] == cfg.vllm_kv_gib
            else:
                assert gib["vllm_weights"] == gib["vllm_pool"] == 0
        assert led["vllm_kv_need_gib"] <= cfg.vllm_kv_gib
