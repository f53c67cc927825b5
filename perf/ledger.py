"""The memory ledger: peak GPU bytes of one training step per rank, per phase and category, at the
presets' real shapes and batch sizes (DESIGN.md section 10), derived from the code rather than
written down.

  python -m perf.ledger                                   # both presets: per-phase peaks and the fit against 80 GiB
  python -m perf.ledger configs/qwen2.5-3b.cfg --json F   # one preset, the whole ledger as JSON
  python -m perf.ledger --write                           # both presets: memory.json and README's memory table
  python -m perf.ledger --readme                          # rewrite README's memory table from memory.json as it is
  python -m perf.ledger configs/qwen2.5-3b.cfg --set lora_rank=16     # a config field changed (LoRA: under DDP)
  python -m perf.bench memory ...                         # the same command

Where every figure comes from:
  1. A probe run: the real `train_twice.train_step` (rollout, twins, log-prob passes, one mini-batch
     of the update with its optimizer step: each peaks alike, memprobe.one_mini_batch; update_counts
     states the rest) at the preset's per-rank batch (prompts_per_step / 8 prompts x group_size
     lines, its gen_batch_size, micro-batches, twin budget and chunks), on a model of the preset's
     layers (at most 12) and tiny widths in the preset's dtypes, driven by a scripted agent whose
     turns have the stated Search-R1-like lengths (memprobe.SCRIPTS), the engine sized as on CUDA
     (its slot cache at max_context + 1 positions, its live-KV budget in the preset's positions:
     kv_budget_gib / the preset's bytes a position). memtrack.Tracker counts every live storage by
     owner (the function that allocated it: the slot cache, the prefill's batch, a KV entry, the
     model's forward, the optimizer ...) and kind (keys/values, hidden states, other); the shapes of
     its forwards are kept.
  2. Scaling: keys and values scale to the preset by its KV bytes per token over the probe's (layers
     x kv heads x head dim x dtype), hidden states by hidden size x dtype; tensors of no model width
     (masks, token ids, log-probs) are counted as they are. The peak of each phase is taken on the
     scaled total. The slot cache so scaled is kvcache.cache_bytes at the preset (recorded as
     slot_cache_gib; a test checks it).
  3. Activations: the preset-size model (QWEN, the Qwen2.5 configs, no download) under
     FakeTensorMode, no memory behind it: each prefill bucket, the decode step (the engine's
     kvcache.Decoder step: forward, keyed draw with CUDA's top-p bisection, stop decision), reads
     off stored hidden states, the largest log-prob micro-batch and update micro-batch (forward and
     backward, gradient checkpointing), through the same functions; a prefill's or decode step's is
     held in the probe while that forward runs, so each phase peaks where the full-size run would.
  4. Parameters and optimizer: counted on the fake model; AdamW's step on the rank's fp32 partition
     run under FakeTensorMode; the ZeRO-2 layout of DeepSpeed 0.19.8 (zero2_static) from
     configs/deepspeed_zero2.json; with lora_rank > 0 (`--set lora_rank=16`), LoRA's layout under
     DDP from lora.memory_bytes (lora_static).
  5. Outside torch's allocator, estimates GPUs must confirm (perf/gpucheck.py, perf/nodecheck.py
     measure them): the CUDA context and NCCL, the retriever's index shard, allocator slack.

What it does not know: how long real turns are (SCRIPTS states the assumption; `--script long` is
the stress case).
"""
import argparse
import functools
import json
import os

import numpy as np
import torch

from generation import engine
from generation import kvcache
from generation import logprobs
from infra import config, lora
from perf import memprobe
from perf import memtrack
import sampler
import train_twice as tt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
GIB = 2 ** 30
PHASES = ("rollout", "twins", "logprobs", "update", "optimizer_step")
CATEGORIES = ("weights", "gradients", "optimizer", "reference", "kv_entries", "decode_batch",
              "activations", "retriever", "context", "slack")
QWEN = {  # config.json of Qwen/Qwen2.5-3B and -7B (the fields that set sizes)
    "3b": dict(vocab_size=151_936, hidden_size=2048, intermediate_size=11_008, num_hidden_layers=36,
               num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=32_768,
               rope_theta=1e6, rms_norm_eps=1e-6),
    "7b": dict(vocab_size=152_064, hidden_size=3584, intermediate_size=18_944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False,
               max_position_embeddings=131_072,
               rope_theta=1e6, rms_norm_eps=1e-6),
}


# --------------------------------------------------------------------------------------------------------------
# Full-size passes on fake tensors (no memory behind them): activations, parameters, the optimizer's
# step

def fake_mode(selected=()):
    """(FakeTensorMode, a mode answering aten.nonzero with `selected` rows: the number of scored
    positions is data, which fake tensors do not have)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Nonzero(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts = list(selected)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.nonzero.default:
                return torch.empty((self.counts.pop(0), args[0].dim()), dtype=torch.long)
            return func(*args, **(kwargs or {}))
    return FakeTensorMode(allow_non_fake_inputs=True), Nonzero()


def fake_model(dims, dtype, checkpointing=False):
    """The preset-size Qwen2 on fake tensors (built inside an active FakeTensorMode)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    model = Qwen2ForCausalLM._from_config(Qwen2Config(**dims), dtype=dtype)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


FORWARD = engine._forward  # the engine's own, whatever a probe run has wrapped around it meanwhile


def _start(tracker):
    """The measured pass begins: what was set up for it (the model, its inputs, a cache) no longer
    counts."""
    tracker.tag_all("other/other")
    return tracker.phase("pass")


def _measure(dims, fn, selected=()) -> dict:
    """Peak of the activations while fn(tracker) runs on fake tensors: {"peak": bytes, ...}. What no
    function of memprobe.OWNED claims counts as activations here; any mode already running (a
    probe's tracker, when a probe asks
    for a pass) is set aside meanwhile."""
    from torch.utils._python_dispatch import _disable_current_modes
    fake, nonzero = fake_mode(selected)
    stack = ["activations"]
    scale = {
        f"{o}/{k}": float(o == "activations")
        for o in ("activations", "decode_batch", "kv_entries", "other", "weights", "reference",
                  "gradients", "optimizer") for k in ("kv", "hidden", "other")
    }
    tracker = memtrack.Tracker(memprobe.classifier(dims, stack), scale=scale)
    # sampler's table of Weyl sequences is filled on first use: a fake pass fills a fresh one (a
    # fake tensor left in the real table would be what every later real draw over that vocabulary
    # reads)
    with _disable_current_modes(), memprobe.patched(sampler, "_WEYL", {}), fake, nonzero, tracker, \
            memprobe.owners(stack):
        out = fn(tracker) or {}
    return {"peak": tracker.peaks.get("pass", {"total": 0})["total"], **out}


def _cuda_floor(l, top_p: float):
    """sampler._nucleus_floor as on CUDA (the bisection: fixed shapes, no host sync), which fake
    tensors can run."""
    e = torch.exp(l - l.amax(-1, keepdim=True))
    return sampler._bisect_floor(l, e, e.sum(-1, keepdim=True) * top_p)


def decode_activations(dims, dtype, cfg, rows, width) -> int:
    """One decode step of `rows` rows attending over `width` cached positions: the engine's
    fixed-shape step (kvcache.Decoder._step: the forward through the slot cache, the keyed draw, the
    stop decision), top-p read as CUDA reads it. The slot cache itself is the decode batch's, not
    counted here."""
    def fn(tracker):
        model = fake_model(dims, dtype).eval()
        cache = kvcache.SlotCache(model.config, rows, width + 1, dtype, "cpu", hidden=True)
        vocab = dims["vocab_size"]
        tables = (torch.zeros(vocab, dtype=torch.long), torch.zeros(vocab, dtype=torch.bool),
                  torch.zeros(vocab, dtype=torch.bool))  # one stop-automaton state: no row stops
        sample = dict(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, fused=False)
        dec = kvcache.Decoder(
            cache, rows,
            lambda ids, mask, pos, c: FORWARD(model, ids, {"full_attention": mask}, pos, c), tables,
            sample, cfg.sync_every, False, "sdpa")
        dec.pos.fill_(width)
        dec.live.fill_(True)
        dec.budget.fill_(cfg.max_context)
        with torch.no_grad(), memprobe.patched(sampler, "_nucleus_floor",
                                               _cuda_floor), _start(tracker):
            dec._step(rows, rows, width + 1)
    return _measure(dims, fn)["peak"]


def head_activations(dims, dtype, cfg, rows) -> int:
    """`rows` draws read off stored final hidden states (engine._track: a twin's first tokens, a
    self-twin): the LM head over (rows, hidden) and the keyed draw over the vocabulary."""
    def fn(tracker):
        model = fake_model(dims, dtype).eval()
        states = torch.zeros((rows, dims["hidden_size"]), dtype=dtype)
        keys, steps = torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.long)
        with torch.no_grad(), memprobe.patched(sampler, "_nucleus_floor",
                                               _cuda_floor), _start(tracker):
            sampler.keyed_draw(engine._logits(model, states), keys, steps, cfg.temperature,
                               cfg.top_k, cfg.top_p)
    return _measure(dims, fn)["peak"]


def prefill_activations(dims, dtype, rows, span, width) -> int:
    """One prefill bucket: `rows` suffixes of `span` tokens over `width` cached ones (the cache is
    the batch's)."""
    from transformers import DynamicCache

    def fn(tracker):
        model = fake_model(dims, dtype).eval()
        head_dim = dims["hidden_size"] // dims["num_attention_heads"]
        kv = (rows, dims["num_key_value_heads"], width, head_dim)
        cache = DynamicCache(ddp_cache_data=[(torch.zeros(kv, dtype=dtype),
                                              torch.zeros(kv, dtype=dtype))
                                             for _ in range(dims["num_hidden_layers"])
                                             ]) if width else DynamicCache()
        ids, mask = torch.zeros((rows, span), dtype=torch.long), torch.ones((rows, width + span),
                                                                            dtype=torch.long)
        pos = torch.arange(width, width + span).expand(rows, span)
        with torch.no_grad(), _start(tracker):
            FORWARD(model, ids, mask, pos, cache)
    return _measure(dims, fn)["peak"]


def logprob_activations(dims, dtype, cfg, rows, width, scored, autocast=False) -> int:
    """One micro-batch of the old-policy / reference pass (no gradient): log-probs and entropies at
    `scored` positions. autocast: bf16 autocast over fp32 weights (its cached weight casts count).
    """
    def fn(tracker):
        model = fake_model(dims, dtype).eval()
        ids, mask = torch.zeros((rows, width), dtype=torch.long), torch.ones((rows, width),
                                                                             dtype=torch.long)
        cast = torch.autocast("cpu", torch.bfloat16, enabled=autocast)
        with torch.no_grad(), cast, _start(tracker):
            logprobs.token_logprobs(model, ids, mask, cfg.temperature, True, mask[:, 1:].bool())
    return _measure(dims, fn, [scored])["peak"]


def update_pass(dims, dtype, cfg, rows, width, scored, autocast=False) -> dict:
    """One micro-batch of the update: forward with the entropy if the loss has it, PPO loss,
    backward (gradient checkpointing as configured). {"activations": peak bytes, "gradients": the
    parameters' gradients}."""
    out = {}

    def fn(tracker):
        model = fake_model(dims, dtype, cfg.gradient_checkpointing).train()
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: tracker.tag([p.grad], "gradients/other"))
        ids, mask = torch.zeros((rows, width), dtype=torch.long), torch.ones((rows, width),
                                                                             dtype=torch.long)
        old = torch.zeros((rows, width - 1))
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast), _start(tracker):
            lp, ent = logprobs.token_logprobs(model, ids, mask, cfg.temperature, cfg.entropy_coef
                                              > 0, mask[:, 1:].bool())
            loss, _, _ = tt.ppo_loss(cfg, lp, old, old, old, old, ent)
            loss.sum().backward()
        out["gradients"] = tracker.bytes["gradients/other"]
    return {"activations": _measure(dims, fn, [scored])["peak"], **out}


def adamw_step(cfg, numels, dtype=torch.float32) -> dict:
    """AdamW's step (torch's, as train_twice builds it) on parameters of these sizes, each with a
    gradient: {"state": bytes kept after it, "peak": bytes above the parameters and gradients while
    it runs}."""
    fake, _ = fake_mode()
    tracker = memtrack.Tracker(scale={"optimizer/other": 1.0, "other/other": 0.0})
    stack = []
    tracker.classify = lambda t: f"{stack[-1] if stack else 'other'}/other"
    with fake, tracker, memprobe.owners(stack):
        params = [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n in numels]
        for p in params:
            p.grad = torch.zeros_like(p)
        opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        with tracker.phase("step"):
            opt.step()
        state = tracker.total
    return {"state": state, "peak": tracker.peaks["step"]["total"]}


# --------------------------------------------------------------------------------------------------------------
# Parameters, gradients and optimizer state by strategy; what lives outside torch's allocator

# wiki-18 passages x E5 dims: the flat index the retriever server shards over the GPUs
WIKI18 = (21_015_324, 768)
# the server's FAISS memory beside its shard: the scratch stack (dense.FAISS_TEMP, 0.5 GiB) and the
# brute-force search's distance tiles, which FAISS sizes to 1 GiB on a GPU over 8 GB whatever the
# stack holds ("we ignore available temporary memory": chooseTileSize in faiss/gpu/impl/Distance.cu)
# and allocates beside it when they do not fit; its CUDA context on each GPU and E5 on the first:
# estimates (perf/nodecheck.py measures)
SERVER_GIB = {"temp": 0.5 + 1.0, "context": 0.5, "encoder": 0.5}
# The training process's memory outside torch's allocator, budgeted high until a lent 8-GPU node
# measures it (perf/nodecheck.py): the CUDA context (~0.5 GiB with lazy module loading), cuBLAS
# workspaces, NCCL's ring and tree buffers for the one world communicator (~1.6 GB reported for
# one communicator with an all-reduce: github.com/NVIDIA/nccl/issues/864), and NVLink SHARP's
# buffers on an NVSwitch node (NCCL's own log on 8 x H200: nvlsTotalSize 2,415,919,104 B = 2.25
# GiB, github.com/vllm-project/vllm/issues/9699; NCCL_NVLS_ENABLE=0 saves it)
CONTEXT_GIB = {"cuda_context": 0.5, "cublas": 0.25, "nccl": 1.0, "nvls": 2.25}
# allocator: reserved but not allocated, with expandable segments: estimate
SLACK = 0.05
# engine=vllm (generation/vllm_engine.py), colocated on each rank: its copy of the weights and its KV
# pool (vllm_kv_gib) while it samples, both released by sleep mode during the update; its workspace
# (vllm_workspace: the largest profile forward over VLLM_BATCHED_TOKENS tokens, the keyed draw's
# buffers per row, and VLLM_GIB's budgets), estimates the first-GPU check measures (make gpu-check
# runs perf/bench_vllm.py --gpu): CUDA graphs' pool and vLLM's own context, and what stays on the
# GPU asleep (its graphs' memory is not tagged for sleep mode)
VLLM_CATEGORIES = ("vllm_weights", "vllm_pool", "vllm_workspace")
VLLM_BATCHED_TOKENS = 8192  # vLLM's max_num_batched_tokens default for offline LLM() use
VLLM_GIB = {"graphs": 1.0, "asleep": 1.0}


def vllm_parts(cfg, dims, dtype) -> dict:
    """{phase: {category: bytes}} of the colocated vLLM engine: awake in rollout and twins, asleep
    after."""
    h, inter, vocab = dims["hidden_size"], dims["intermediate_size"], dims["vocab_size"]
    forward = VLLM_BATCHED_TOKENS * (4 * h + 3 * inter) * memprobe._size(dtype)
    draws = cfg.vllm_max_seqs * vocab * 28  # logits, copy, uniforms' int64 pair, race: 28 B
    awake = {"vllm_weights": n_params(dims) * memprobe._size(dtype),
             "vllm_pool": cfg.vllm_kv_gib * GIB,
             "vllm_workspace": forward + draws + VLLM_GIB["graphs"] * GIB}
    asleep = {"vllm_weights": 0, "vllm_pool": 0, "vllm_workspace": VLLM_GIB["asleep"] * GIB}
    return {p: awake if p in ("rollout", "twins") else asleep for p in PHASES}


def vllm_kv_need(cfg, dims, dtype) -> float:
    """Bytes of a KV pool holding vllm_max_seqs rows at max_context (never preempts)."""
    per_token = (2 * dims["num_hidden_layers"] * dims["num_key_value_heads"]
                 * dims["hidden_size"] // dims["num_attention_heads"] * memprobe._size(dtype))
    return cfg.vllm_max_seqs * cfg.max_context * per_token


def zero2_static(params: int, largest: int, world: int, adam: dict, ds: dict) -> dict:
    """{phase: {category: bytes}} of DeepSpeed ZeRO-2 with bf16 (stage_1_and_2.py of DeepSpeed
    0.19.8), as measured on CPU ranks (perf/nodecheck.py --tiny: every coefficient below matched it, the
    update's as an upper bound): the module in bf16, replicated; the fp32 master partition and
    AdamW's two moments on 1/world of the parameters (adam: its step measured on the partition); in
    the update two bf16 copies of the rank's partition gradients with a parameter straddling its
    edge (the previous micro-batches' sum and the new one, added at the end of each backward), the
    reduction buckets (two of reduce_bucket_size elements when overlap_comm) and one parameter's
    gradient on its way into a bucket; in the step the partition's gradients in bf16, their flat
    copy and fp32 conversion, then the fp32 gradients beside AdamW's temporaries."""
    part = -(-params // world)
    zero = ds["zero_optimization"]
    buckets = (2 if zero.get("overlap_comm") else 1) * int(zero.get("reduce_bucket_size", 5e8)) * 2
    optimizer = 4 * part + adam["state"]
    out = {}
    for phase in PHASES:
        grads = {
            "update": 2 * 2 * (part + largest) + buckets + 2 * largest, "optimizer_step": max(
                2 * part + 2 * part + 4 * part, 4 * part + adam["peak"] - adam["state"])
        }.get(phase, 0)
        out[phase] = {"weights": 2 * params, "optimizer": optimizer, "gradients": grads}
    return out


def plain_static(params: int, adam: dict, grads: int, sampling: int) -> dict:
    """{phase: {category: bytes}} of one process (or DDP without its buckets) holding fp32 weights,
    the sampling copy while episodes are drawn (sampling: its bytes, 0 without bf16), fp32 gradients
    from the update to the end of the step (zero_grad(set_to_none)), AdamW's state and its step's
    temporaries."""
    out = {}
    for phase in PHASES:
        out[phase] = {"weights": 4 * params + (sampling if phase in ("rollout", "twins") else 0),
                      "optimizer": adam["peak"] if phase == "optimizer_step" else adam["state"],
                      "gradients": grads if phase in ("update", "optimizer_step") else 0}
    return out


def lora_static(cfg, dims, world: int) -> dict:
    """{phase: {category: bytes}} of a LoRA run (lora_rank > 0: DDP, which train_twice requires of
    LoRA): the frozen base and the float32 adapters, their gradients (and DDP's bucket copy of them
    on several ranks) and AdamW state from lora.memory_bytes; AdamW's step temporaries from its fake
    step; no reference (the base, adapters off)."""
    m = lora.memory_bytes(dims, cfg.lora_rank, cfg.lora_targets, cfg.bf16)
    held = m["lora"]
    adam = adamw_step(cfg, [m["adapter_params"]])
    grads = held["gradients"] * (2 if world > 1 else 1)
    return {
        phase: {
            "weights": held["weights"], "optimizer": held["optimizer"] +
            (adam["peak"] - adam["state"] if phase == "optimizer_step" else 0),
            "gradients": grads if phase in ("update", "optimizer_step") else 0
        } for phase in PHASES
    }


def retriever_bytes(world: int, fp16: bool = True) -> float:
    """One GPU's share of the retriever server beside training: its index shard, FAISS scratch, its
    CUDA context, and (GPU 0, the worst) the E5 encoder."""
    n, d = WIKI18
    return n * d * (2 if fp16 else 4) / world + sum(SERVER_GIB.values()) * GIB


# --------------------------------------------------------------------------------------------------------------
# The ledger: probe + scaling + fake passes + static, per phase

def _largest(shapes, phase, kind, key):
    """The shape of most key(shape); of those, the largest: in whatever order they were recorded."""
    rows = shapes.get((phase, kind), [])
    return max(rows, key=lambda s: (key(s), s)) if rows else None


# a prefill is measured at its new tokens and cache width rounded up to these
ROUND_NEW, ROUND_WIDTH = 32, 128


def rollout_activations(dims, dtype, cfg):
    """virtual(kind, rows, new, width) -> bytes for memprobe.phases: the full-size activations of one prefill forward
    (a fake pass per shape, new tokens and width rounded up: ~20 shapes a step), one decode step
    (forward, keyed draw, stop decision) as the larger of two a + b rows + c rows x width, each fitted
    exactly to fake steps of gen_batch_size / 4 and gen_batch_size rows over short (256, 512) and
    long (max_context / 2, max_context) caches (logits and the draw's buffers per row; masks,
    attention's repeated keys and values per row and position; the tests check the fit on other
    shapes), or one read off stored hidden states ("head": a + b rows,
    from two fake passes)."""
    lo, hi, w1, w2 = max(1, cfg.gen_batch_size // 4), cfg.gen_batch_size, 256, max(
        512, cfg.max_context // 2)
    # a first pass also allocates what the model builds once
    decode_activations(dims, dtype, cfg, lo, w1)
    fit = lambda points: np.linalg.solve(  # noqa: E731
        [[1, p, p * w] for p, w in points],
        [decode_activations(dims, dtype, cfg, p, w) for p, w in points])
    # two regimes, the larger one peaks: the draw's buffers per row (short caches) and attention's
    # per row and position (long caches; sdpa with a mask repeats GQA's keys and values per head)
    dec = (fit(((lo, w1), (lo, 2 * w1), (hi, w1))), fit(((lo, w2), (lo, 2 * w2), (hi, w2))))
    head = np.linalg.solve([[1, lo], [1, hi]],
                           [head_activations(dims, dtype, cfg, n) for n in (lo, hi)])

    @functools.lru_cache(maxsize=None)
    def prefill(rows, new, width):
        return prefill_activations(dims, dtype, rows, new, width)

    def virtual(kind, rows, new, width):
        if kind == "decode":
            return max(0.0, *(float(d @ [1, rows, rows * width]) for d in dec))
        # the engine reads at most 2^26 logits at once (rows tracked at once: twin_chunk at most)
        if kind == "head":
            rows = min(rows, max((1 << 26) // dims["vocab_size"], cfg.twin_chunk or rows))
            return max(0.0, float(head @ [1, rows]))
        return prefill(rows, -(-new // ROUND_NEW) * ROUND_NEW,
                       -(-width // ROUND_WIDTH) * ROUND_WIDTH)
    return virtual


def activations(dims, dtype, cfg, shapes, autocast=False) -> dict:
    """{phase: the largest activations at full size} of the passes that have no cache growing beside
    them: the largest log-prob micro-batch (logprobs; update: with the backward, whose parameter
    gradients come back as "gradients"); rollout and twins hold theirs during the probe
    (rollout_activations)."""
    out = {"optimizer_step": 0, "rollout": 0, "twins": 0}
    # autocast: the passes with gradients run on the fp32 weights
    master = torch.float32 if autocast else dtype
    b, w, n = _largest(shapes, "logprobs", "scored", lambda s: s[0] * s[1])
    out["logprobs"] = logprob_activations(dims, master, cfg, b, w, n, autocast)
    b, w, n = _largest(shapes, "update", "scored", lambda s: s[0] * s[1])
    update = update_pass(dims, master, cfg, b, w, n, autocast)
    out["update"], out["gradients"] = update["activations"], update["gradients"]
    return out


def param_numels(dims) -> list:
    """Sizes of the parameters of a Qwen2 of these dims (counted on the fake model)."""
    fake, _ = fake_mode()
    with fake:
        return [p.numel() for p in fake_model(dims, torch.bfloat16).parameters()]


def n_params(dims) -> int:
    return sum(param_numels(dims))


def slot_cache_bytes(cfg, dims, dtype, slots=None, length=None) -> int:
    """The engine's slot cache on a GPU: gen_batch_size slots of max_context + 1 positions
    (kvcache.cache_bytes), what the probe's decode batch holds from the first decode of the rollout
    until the twins are done; (1, 1): a KV entry's bytes per position (engine.position_bytes)."""
    from transformers import Qwen2Config
    return kvcache.cache_bytes(slots or cfg.gen_batch_size, length or cfg.max_context + 1,
                               Qwen2Config(**dims), dtype, hidden=True)


MEMORY_FIELDS = ("prompts_per_step", "group_size", "max_turns", "max_new_tokens", "max_obs_tokens",
                 "max_context", "gen_batch_size", "kv_budget_gib", "method", "twin_budget", "twins_per_decision",
                 "twin_chunk", "keep_caches", "mini_batches", "micro_batch_size", "entropy_coef",
                 "bf16", "gradient_checkpointing", "ref_offload", "lora_rank", "lora_targets")


def config_of(cfg) -> dict:
    """The config fields that change a rank's memory (the ledger records them; a preset that changes
    them needs a new ledger)."""
    return {k: getattr(cfg, k) for k in MEMORY_FIELDS}


def update_counts(cfg) -> dict:
    """The update of a rank's step: its mini-batches (the probe runs one a pass, whose peak is
    every one's: memprobe.one_mini_batch), their rows, micro-batches, and the optimizer steps and
    forward/backward passes that time scales with."""
    micro = config.micro_batches(cfg)
    return {"mini_batches": cfg.mini_batches, "probed": 1, "micro_batches": micro,
            "rows": cfg.prompts_per_step * cfg.group_size // cfg.mini_batches,
            "optimizer_steps": cfg.ppo_epochs * cfg.mini_batches,
            "passes": cfg.ppo_epochs * cfg.mini_batches * micro}


def build(cfg, dims, strategy="zero2", world=8, script="search-r1", retriever=True, threads=1,
          steps=1) -> dict:
    """The ledger of one rank of `world` training with cfg (its per-rank batch) on a `dims` model (a
    Qwen2 config's sizes, vocabulary included): {"gpu_gib", "peak_gib", "peak_phase", "headroom",
    "phases": {phase: {"total_gib", "allocated_gib", "gib": {category: GiB}}}, ...}. strategy
    "zero2": DeepSpeed ZeRO-2 in bf16 (the presets); "plain": one process (or DDP, less its
    buckets), fp32 weights, bf16 autocast and sampling copy when cfg.bf16 (perf/gpucheck.py); with
    lora_rank > 0, LoRA's layout under DDP (lora_static, lora.memory_bytes). The probe runs `steps`
    steps and the last is the ledger's."""
    half = torch.bfloat16 if cfg.bf16 else torch.float32  # the rollout's dtype, the reference's
    if cfg.lora_rank and strategy == "zero2":
        raise ValueError(
            "lora_rank > 0 runs under DDP (train_twice.setup refuses DeepSpeed): strategy 'ddp'")
    zero2 = strategy == "zero2"
    # the module's dtype: ZeRO-2's bf16 module; else fp32 master weights under autocast (LoRA: its base in bf16)
    module = half if zero2 or (cfg.lora_rank and cfg.bf16) else torch.float32
    mixed = "bf16" if cfg.bf16 and module == torch.float32 else "no"
    probe_dims = memprobe.probe_dims(dims)
    probe = memprobe.run_steps(cfg, probe_dims, module,
                               memprobe.SCRIPTS[script], scale=memprobe.probe_scale(
                                   probe_dims, half, dims, half), mixed=mixed, threads=threads,
                               attention="probe", steps=steps, virtual=rollout_activations(
                                   dims, half, cfg), position_bytes=slot_cache_bytes(cfg, dims, half, 1, 1))
    act = activations(dims, half, cfg, probe["shapes"], autocast=mixed == "bf16")
    numels = param_numels(dims)
    params = sum(numels)
    if cfg.lora_rank:
        static = lora_static(cfg, dims, world)
    elif zero2:
        ds = json.load(open(os.path.join(ROOT, "configs", "deepspeed_zero2.json")))
        static = zero2_static(params, max(numels), world, adamw_step(cfg, [-(-params // world)]),
                              ds)
    else:
        static = plain_static(params, adamw_step(cfg, numels), act["gradients"],
                              2 * params if cfg.bf16 else 0)
    vllm = vllm_parts(cfg, dims, half) if cfg.engine == "vllm" else None
    cats_all = CATEGORIES + (VLLM_CATEGORIES if vllm else ())
    phases = {}
    for phase in PHASES:
        got = probe["peaks"].get(phase, {"bytes": {}})["bytes"]
        part = lambda owner: sum(v for k, v in got.items() if k.startswith(owner + "/"))  # noqa: E731
        cats = dict(static[phase])
        # LoRA: the base is the reference
        on_gpu = not cfg.lora_rank and (not cfg.ref_offload or phase == "logprobs")
        cats["reference"] = params * memprobe._size(half) if on_gpu else 0
        cats["kv_entries"], cats["decode_batch"] = part("kv_entries"), part("decode_batch")
        # the probe's: held full-size ones
        cats["activations"] = part("other") + part("activations") + act[phase]
        if vllm:  # vLLM samples: none of the cached engine's caches, batches or forwards
            if phase in ("rollout", "twins"):
                cats["kv_entries"] = cats["decode_batch"] = cats["activations"] = 0
            cats.update(vllm[phase])
        allocated = sum(cats.values())
        cats["retriever"] = retriever_bytes(world) if retriever else 0
        cats["context"] = sum(CONTEXT_GIB.values()) * GIB
        cats["slack"] = SLACK * allocated
        phases[phase] = {"total_gib": sum(cats.values()) / GIB, "allocated_gib": allocated / GIB,
                         "gib": {c: cats[c] / GIB for c in cats_all}}
    peak = max(phases, key=lambda p: phases[p]["total_gib"])
    m = probe["metrics"]
    return {
        "gpu_gib": 80, "peak_gib": phases[peak]["total_gib"], "peak_phase": peak,
        "headroom": 1 - phases[peak]["total_gib"] / 80, "strategy": strategy, "world": world,
        "params": params, "script": memprobe.SCRIPTS[script].__dict__, "phases": phases,
        "config": config_of(cfg), "update": update_counts(cfg), "step": {
            k: m.get(k)
            for k in ("factual_tokens", "twin_tokens", "twins", "twin_rollouts", "turns")
        }, "episodes": cfg.prompts_per_step * cfg.group_size,
        "slot_cache_gib": slot_cache_bytes(cfg, dims, half) / GIB,
        **({"vllm_kv_need_gib": vllm_kv_need(cfg, dims, half) / GIB} if vllm else {}), "shapes": {
            f"{ph}:{kind}": max(v, key=lambda s: (s[0] * s[-1], s))
            for (ph, kind), v in probe["shapes"].items()
        }
    }


# --------------------------------------------------------------------------------------------------------------
# Presets, the README table, the command line

PRESETS = {"3b": "configs/qwen2.5-3b.cfg", "7b": "configs/qwen2.5-7b.cfg"}
TABLE_START = "<!-- memory ledger: `python -m perf.ledger --write` rewrites this table from memory.json -->"
TABLE_END = "<!-- end of memory ledger -->"


def preset_ledger(path: str, script="search-r1", threads=1, overrides=()) -> dict:
    """The ledger of a preset file at its real shapes: one of 8 ranks, ZeRO-2 (LoRA: DDP).
    overrides: `--key=value` config flags on top of the preset."""
    model = tt.parse_config([path, *overrides]).model
    size = "7b" if "7B" in model else "3b" if "3B" in model else None
    if size is None:
        raise ValueError(
            f"{path}: model = {model!r}, not Qwen2.5-3B or -7B (the shapes QWEN knows)")
    cfg = memprobe.step_config(path, list(overrides))
    return {
        "preset": os.path.relpath(os.path.abspath(path),
                                  ROOT), "model": model, "overrides": list(overrides),
        **build(cfg, QWEN[size], "plain" if cfg.lora_rank else "zero2", 8, script, threads=threads)
    }


def table(ledgers: dict) -> str:
    """README's table: per phase, the peak GiB of each preset (its largest categories), then the
    fit."""
    names = list(ledgers)
    head = "| phase | " + " | ".join(f"{n.upper()} peak GiB (largest parts)" for n in names) + " |"
    lines = [head, "|---|" + "---|" * len(names)]
    for phase in PHASES:
        cells = []
        for n in names:
            ph = ledgers[n]["phases"][phase]
            top = sorted(ph["gib"].items(), key=lambda kv:
                         (-round(kv[1], 6), (CATEGORIES + VLLM_CATEGORIES).index(kv[0])))[:3]
            parts = ", ".join(f"{c.replace('_', ' ')} {v:.1f}" for c, v in top)
            cells.append(f"{ph['total_gib']:.1f} ({parts})")
        lines.append(f"| {phase.replace('_', ' ')} | " + " | ".join(cells) + " |")
    lines.append("| **peak of 80 GiB** | " + " | ".join(
        f"**{ledgers[n]['peak_gib']:.1f}** ({ledgers[n]['peak_phase'].replace('_', ' ')}), headroom "
        f"{100 * ledgers[n]['headroom']:.0f}%" for n in names) + " |")
    return "\n".join(lines)


def write_readme(ledgers: dict, path=os.path.join(ROOT, "README.md")):
    text = open(path, encoding="utf-8").read()
    if TABLE_START not in text or TABLE_END not in text:
        raise ValueError(f"{path}: no memory table markers ({TABLE_START!r} ... {TABLE_END!r})")
    head, rest = text.split(TABLE_START, 1)
    tail = rest.split(TABLE_END, 1)[1]
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"{head}{TABLE_START}\n{table(ledgers)}\n{TABLE_END}{tail}")


def readme_table(path=os.path.join(ROOT, "README.md")) -> str:
    """The memory table as README.md has it."""
    text = open(path, encoding="utf-8").read()
    return text.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0].strip()


def show(name: str, led: dict) -> str:
    out = [f"{name}: {led.get('model', '')} {led['strategy']} x {led['world']} ranks, "
           f"{led['episodes']} episodes a rank, "
           f"{led['params'] / 1e9:.2f}B parameters; probe step: {led['step']}"]
    cats = [c for c in CATEGORIES + VLLM_CATEGORIES if c in led["phases"]["rollout"]["gib"]]
    out.append("  phase           total  " + " ".join(f"{c[:12]:>12s}" for c in cats))
    for phase in PHASES:
        ph = led["phases"][phase]
        out.append(f"  {phase:14s} {ph['total_gib']:6.1f}  " + " ".join(f"{ph['gib'][c]:12.2f}"
                                                                        for c in cats))
    out.append(
        f"  peak {led['peak_gib']:.1f} GiB ({led['peak_phase']}) of {led['gpu_gib']}: headroom "
        f"{100 * led['headroom']:.1f}% ({'fits' if led['headroom'] >= 0.10 else 'DOES NOT FIT'} with 10%)"
    )
    out.append("  update: {probed} of {mini_batches} mini-batches probed ({rows} rows, "
               "{micro_batches} micro-batches), its peak every one's; the step takes "
               "{optimizer_steps} optimizer steps, {passes} forward/backward passes"
               .format(**led["update"]))
    return "\n".join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="perf/ledger.py", description=__doc__.split("\n")[0],
                                     epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("presets", nargs="*", help="preset files (default: both Qwen2.5 presets)")
    parser.add_argument("--json", default="", help="write the ledger(s) here")
    parser.add_argument("--script", default="search-r1", choices=sorted(memprobe.SCRIPTS),
                        help="turn statistics")
    parser.add_argument("--write", action="store_true",
                        help="write memory.json and README's table (both presets)")
    parser.add_argument("--readme", action="store_true",
                        help="rewrite README's table from memory.json as it is")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="a config field on top of the preset(s), e.g. --set lora_rank=16 (repeatable)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads of the probe runs")
    parser.add_argument("--jobs", type=int, default=1, help="presets computed at once (processes)")
    args = parser.parse_args(argv)
    if args.readme:
        write_readme(json.load(open(os.path.join(ROOT, "results", "memory.json"))))
        return {}
    paths = args.presets or list(PRESETS.values())
    for p in paths:
        if not os.path.isfile(p):
            parser.error(f"{p}: no such preset file")
    if (args.write or args.readme) and args.set:
        parser.error("--write and --readme record the presets as they are: no --set")
    overrides = [f"--{kv}" for kv in args.set]
    jobs = [(p, args.script, args.threads, overrides) for p in paths]
    if args.jobs > 1:
        import multiprocessing
        with multiprocessing.get_context("spawn").Pool(min(args.jobs, len(jobs))) as pool:
            results = pool.starmap(preset_ledger, jobs)
    else:
        results = [preset_ledger(*job) for job in jobs]
    ledgers = {}
    for p, led in zip(paths, results):
        name = next((k for k, v in PRESETS.items() if os.path.abspath(v) == os.path.abspath(p)), p)
        ledgers[name] = led
        print(show(name, led), flush=True)
    out = ledgers[next(iter(ledgers))] if len(ledgers) == 1 else ledgers
    if args.write:
        args.json = args.json or os.path.join(ROOT, "results", "memory.json")
        write_readme(ledgers)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, sort_keys=True)
    return ledgers


if __name__ == "__main__":
    main()
