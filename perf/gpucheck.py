"""The first-GPU check: memory per phase against the memory ledger's prediction, decode tokens/s and
one update's time,
for Qwen2.5-3B shapes on one GPU, written to one JSON (DESIGN.md section 10).

  make gpu-check                      # one GPU, <= 8 minutes: python -m perf.gpucheck --out runs/gpu_check.json
  make gpu-check ARGS=--tiny          # the same code at a tiny size on the CPU, <= 2 minutes (a test runs it)

What runs: `--steps` train_steps (the last is measured: AdamW's state exists, as in every later
step) of the ledger's scripted agent (memprobe.SCRIPTS: Search-R1-like turn lengths, so turns stop
where they would and not at 500 tokens) with a random model of Qwen2.5-3B's shapes (hidden 2048, 16
heads, 2 KV heads, intermediate 11,008, vocabulary 151,936) cut to --layers layers, --prompts
prompts x 5 lines at the 3B preset's other settings, in one process without DeepSpeed: fp32 weights,
the bf16 sampling copy, bf16 autocast for the log-prob passes and the update.

It cannot run out of memory by construction: the ledger predicts this configuration before anything
is put on the GPU (ledger.build, strategy "plain", one rank, no retriever), and the layers and
prompts are halved until the prediction is under --fraction of the GPU's free memory; should an
out-of-memory error happen anyway, it is the JSON's result.

Measured per phase: torch.cuda.max_memory_allocated from the phase's start (on the CPU:
memtrack.Tracker's live storages), against the ledger's allocated bytes; the allocator's reserved
bytes and the device's used memory (torch.cuda.mem_get_info) for the slack and the context the
ledger estimates; generated tokens per second over rollout and twins; the log-prob passes' seconds
and the update's (forward and backward, optimizer step); the slot caches and KV entries alive after the
step (none may be). Then, on a GPU, the engine's own figure at the 3B preset's full shape and batch
(bench_engine.engine_gpu: tokens/s with and without CUDA graphs), if its model, slot cache and
decode step fit --fraction of the free memory (--no-engine: skipped).
"""
import argparse
import contextlib
import json
import math
import os
import sys
import time

import torch

from generation import engine
from generation import kvcache
from infra import cuda
from perf import ledger
from perf import memprobe
from perf import memtrack
import train_twice as tt

GIB = 2 ** 30
TINY = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    # kv (b, 1, n, 64): every storage 256-byte rows
    tie_word_embeddings=True,
    max_position_embeddings=8192)
TINY_FLAGS = [
    "--prompts_per_step=3", "--group_size=3", "--gen_batch_size=4", "--micro_batch_size=3",
    "--mini_batches=1", "--bf16=false", "--gradient_checkpointing=false", "--twin_chunk=4",
    "--max_new_tokens=120", "--max_obs_tokens=200", "--max_context=1536"
]


class CudaPhases:
    """memprobe.phases' recorder on a GPU: per phase, the allocator's peak from the phase's start (a
    nested phase's peak counts for the outer one too), its reserved bytes and the device's used
    bytes at that peak's end."""

    def __init__(self):
        self.current, self.peaks, self._outer = None, {}, []

    @contextlib.contextmanager
    def phase(self, name):
        torch.cuda.synchronize()
        if self.current is not None:
            self._outer.append((self.current, torch.cuda.max_memory_allocated()))
        saved, self.current = self.current, name
        torch.cuda.reset_peak_memory_stats()
        try:
            yield
        finally:
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            peak = max(torch.cuda.max_memory_allocated(), self.peaks.get(name, {}).get("total", 0))
            self.peaks[name] = {
                "total": peak, "reserved": torch.cuda.max_memory_reserved(), "used": total - free
            }
            self.current = saved
            if saved is not None:
                outer, before = self._outer.pop()
                self.peaks.setdefault(outer, {"total": 0})
                self.peaks[outer]["total"] = max(self.peaks[outer]["total"], before, peak)


def check_config(layers: int, prompts: int, tiny: bool):
    """(config, model dims) of the check: the 3B preset at one rank's share, cut to `prompts`
    prompts and `layers` layers (tiny: TINY_FLAGS and TINY, the script's vocabulary)."""
    preset = os.path.join(ledger.ROOT, ledger.PRESETS["3b"])
    if tiny:
        return memprobe.step_config(
            preset, TINY_FLAGS), {**TINY, "vocab_size": len(memprobe.script_tokenizer())}
    cfg = memprobe.step_config(preset, [f"--prompts_per_step={prompts}"])
    return cfg, {**ledger.QWEN["3b"], "num_hidden_layers": layers}


def measure(cfg, dims, steps: int, tiny: bool) -> dict:
    """The check's own run: per-phase peaks (CUDA allocator, or the Tracker on the CPU) and the last
    step's metrics."""
    script = memprobe.SCRIPTS["search-r1"]
    tok = memprobe.script_tokenizer()
    weights = torch.float32  # one process without DeepSpeed: fp32 master weights
    run = memprobe.make_run(cfg, dims, weights, tok,
                            memprobe.script_rows(tok, script, cfg.prompts_per_step),
                            memprobe.ScriptedRetriever(tok, script), "bf16" if cfg.bf16 else "no",
                            device="cpu" if tiny else "cuda")
    stack, shapes = [], {}
    if tiny:
        recorder = memtrack.Tracker(memprobe.classifier(dims, stack))
        model = run.accel.unwrap_model(run.policy)
        recorder.tag([
            *model.parameters(), *model.buffers(), *run.ref.parameters(), *run.ref.buffers()
        ], "weights/other")
    else:
        recorder = CudaPhases()
    metrics, before = {}, held()
    tag = memprobe.tagger(recorder, dims) if tiny else None
    with recorder if tiny else contextlib.nullcontext(), memprobe.owners(stack, run.accel, tag), \
            memprobe.scripted(tok, script), memprobe.as_on_gpu() if tiny else contextlib.nullcontext():
        for step in range(steps):
            recorder.peaks = {}
            if tiny:
                recorder.tag(
                    [s for st in run.opt.state.values()
                     for s in st.values() if torch.is_tensor(s)], "optimizer/other")
            with memprobe.phases(recorder, run, shapes):
                metrics = tt.train_step(cfg, run, step)
    after = held()
    return {
        "peaks": recorder.peaks, "metrics": metrics,
        "held_after_step": {k: after[k] - before[k] for k in after}
    }


def held() -> dict:
    """Live engine caches (slot caches, KV entries) in this process: none may outlive a step
    (train_step frees them once the twins are done)."""
    import gc
    gc.collect()
    objects = gc.get_objects()
    return {"slot_caches": sum(type(o) is kvcache.SlotCache for o in objects),
            "kv_entries": sum(type(o) is engine.KVEntry for o in objects)}


def engine_figure(cfg, fraction: float) -> dict:
    """bench_engine.engine_gpu at the 3B preset's shape and one rank's batch (prompts x 5 rows over
    gen_batch_size slots), when its bf16 model, slot cache and widest decode step fit `fraction` of
    the free memory (else why not)."""
    from perf import bench_engine
    dims = ledger.QWEN["3b"]
    need = 2 * ledger.n_params(dims) + ledger.slot_cache_bytes(cfg, dims, torch.bfloat16) + \
        ledger.decode_activations(dims, torch.bfloat16, cfg, cfg.gen_batch_size, cfg.max_context)
    free = torch.cuda.mem_get_info()[0]
    if need > fraction * free:
        return {
            "skipped": f"needs {need / GIB:.1f} GiB, more than {fraction} of the free {free / GIB:.1f} GiB"
        }
    return bench_engine.engine_gpu("3b", rows=cfg.prompts_per_step * cfg.group_size,
                                   slots=cfg.gen_batch_size, max_context=cfg.max_context,
                                   top_p=cfg.top_p)


def sized(layers: int, prompts: int, fraction: float, steps: int, tiny: bool):
    """The largest configuration from (layers, prompts) down, halving both, whose predicted peak is
    under fraction of the free GPU memory: (cfg, dims, prediction)."""
    free = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() and not tiny else None
    while True:
        cfg, dims = check_config(layers, prompts, tiny)
        # the fewest prompts whose lines split into the preset's mini-batches (10: 2 prompts)
        least = cfg.mini_batches // math.gcd(cfg.group_size, cfg.mini_batches)
        pred = ledger.build(cfg, dims, "plain", world=1, retriever=False, steps=steps)
        allocated = max(ph["allocated_gib"] for ph in pred["phases"].values()) * GIB
        if free is None or allocated <= fraction * free or (layers == 1 and prompts <= least):
            return cfg, dims, pred
        layers, prompts = max(1, layers // 2), max(least, prompts // 2 // least * least)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="perf/gpucheck.py", description=__doc__.split("\n")[0],
                                     epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/gpu_check.json", help="the JSON written")
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny model on the CPU (what the test suite runs)")
    parser.add_argument("--layers", type=int, default=8,
                        help="layers of the 3B-shaped model (the preset has 36)")
    parser.add_argument("--prompts", type=int, default=32,
                        help="prompts of the step, x 5 lines (the preset: 64)")
    parser.add_argument("--steps", type=int, default=2, help="train steps; the last is measured")
    parser.add_argument("--fraction", type=float, default=0.5,
                        help="predicted peak / free GPU memory, at most")
    parser.add_argument(
        "--engine", default=True, action=argparse.BooleanOptionalAction,
        help="also the engine's figure at the 3B preset's shape and batch (bench_engine.engine_gpu)"
    )
    args = parser.parse_args(argv)
    if not args.tiny and cuda.diagnose():
        parser.error(f"{cuda.diagnose()}; --tiny runs the CPU version")
    if not (args.layers >= 1 and args.prompts >= 1 and args.steps >= 1 and 0 < args.fraction <= 1):
        parser.error("--layers, --prompts, --steps >= 1 and --fraction in (0, 1]")
    t0 = time.time()
    cfg, dims, pred = sized(args.layers, args.prompts, args.fraction, args.steps, args.tiny)
    out = {
        "device": torch.cuda.get_device_name() if not args.tiny else "cpu", "tiny": args.tiny,
        "layers": dims["num_hidden_layers"], "prompts": cfg.prompts_per_step,
        "episodes": pred["episodes"], "predict_s": time.time() - t0, "phases": {}
    }
    try:
        t1 = time.time()
        got = measure(cfg, dims, args.steps, args.tiny)
        out["run_s"] = time.time() - t1
    except torch.cuda.OutOfMemoryError as e:  # the prediction was wrong: that is the finding
        out["error"] = f"out of GPU memory: {e}"
        got = None
    if got is not None:
        m = got["metrics"]
        out["tokens_per_s"] = (m["factual_tokens"] + m.get("twin_tokens", 0)) / (m["time_rollout"] +
                                                                                 m["time_twins"])
        out["logprobs_s"], out["update_s"] = m["time_logprobs"], m["time_update"]
        out["step"] = {k: m.get(k) for k in ("factual_tokens", "twin_tokens", "twins", "turns")}
        out["held_after_step"] = got["held_after_step"]
        for phase in ledger.PHASES:
            measured, predicted = got["peaks"].get(phase, {}), pred["phases"][phase]
            row = {
                "measured_gib": measured.get("total", 0) / GIB,
                "predicted_gib": predicted["allocated_gib"], "predicted": predicted["gib"]
            }
            row["ratio"] = row["measured_gib"] / row["predicted_gib"] if row[
                "predicted_gib"] else None
            # what the ledger estimates: slack and memory outside the allocator
            if "reserved" in measured:
                row["slack_gib"] = (measured["reserved"] - measured["total"]) / GIB
                row["outside_allocator_gib"] = (measured["used"] - measured["reserved"]) / GIB
            out["phases"][phase] = row
        ratios = [r["ratio"] for r in out["phases"].values() if r["ratio"]]
        out["worst_ratio"] = max(ratios, key=lambda r: abs(r - 1)) if ratios else None
    # the engine at the preset's own shape and batch
    if got is not None and not args.tiny and args.engine:
        del got
        torch.cuda.empty_cache()
        preset = memprobe.step_config(os.path.join(ledger.ROOT, ledger.PRESETS["3b"]))
        out["engine"] = engine_figure(preset, args.fraction)
    out["time_s"] = time.time() - t0
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
    for phase, row in out["phases"].items():
        print(
            f"{phase:15s} measured {row['measured_gib']:8.3f} GiB  predicted {row['predicted_gib']:8.3f} GiB  "
            f"ratio {row['ratio']:.3f}" if row["ratio"] else f"{phase}: nothing predicted",
            flush=True)
    print(
        f"tokens/s {out.get('tokens_per_s', float('nan')):.0f} | update {out.get('update_s', float('nan')):.1f}s | "
        f"{out['time_s']:.0f}s in all | {args.out}" +
        (f" | {out['error']}" if "error" in out else ""))
    return out


if __name__ == "__main__":
    sys.exit(0 if "error" not in main() else 1)
