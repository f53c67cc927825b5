"""The vLLM engine's checks and figures (generation/vllm_engine.py; DESIGN.md section 11, "The vLLM
engine"): every kind of keyed draw through vLLM against the cached engine on the same weights, and
decode tokens per second of both.

  python -m perf.bench_vllm --world worlds/tiny-0 --json F     the CPU checks and the speed ratio
  python -m perf.bench_vllm --gpu --json F                      the first-GPU check's figures (vllm_figure)
  python -m perf.bench_vllm --gpu --runner v2 --json F          the same on vLLM's Model Runner V2

It runs in a process of its own (tests/test_vllm.py starts it): vLLM sets the process's torch
threads and CPU binding. The tiny worlds' policies have head_dim 16, which vLLM's CPU attention
refuses, so the check widens the heads (`widened`: the same weights, fewer and wider heads, head_dim
32): a different network, but a trained-looking one, for exactness only.

Checks (each a count of rows whose tokens match, or a largest log-prob difference):
  factual   episodes (all turns, searches and observations) sampled by both engines
  order     one row alone, in a batch, and in the batch reversed (vLLM only)
  twins     coupled twins at every turn (rollout.run_twins: alt key, then the factual keys)
  forks     token forks mid-turn (given prefix, own key, the factual token banned)
  replays   continuations from mid-turn token k on the factual keys: the factual turn again
  lines     text-line keys (line_keys = "text")
  sync      after a change of every weight (the tied embedding too): ready(policy) against the
            cached engine on the new weights and against a fresh vLLM engine built from them
"""
import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def widened(world: str, out: str, head_dim: int = 32) -> str:
    """A copy of world's policy folder with heads of head_dim (same weights): vLLM's CPU attention
    needs head_dim >= 32."""
    from transformers import AutoModelForCausalLM
    src = os.path.join(world, "policy")
    model = AutoModelForCausalLM.from_pretrained(src)
    cfg = model.config
    heads = cfg.hidden_size // head_dim
    assert heads >= 1 and cfg.hidden_size % head_dim == 0, f"{src}: hidden {cfg.hidden_size}"
    kv = max(1, heads * cfg.num_key_value_heads // cfg.num_attention_heads)
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = heads, kv, head_dim
    wide = type(model)(cfg)
    wide.load_state_dict(model.state_dict())
    wide.save_pretrained(out)
    for name in os.listdir(src):
        if name.startswith(("tokenizer", "chat_template", "special_tokens", "generation_config")):
            shutil.copy(os.path.join(src, name), os.path.join(out, name))
    return out


def _ids(eps):
    return [ep.ids for ep in eps]


def _same(a, b) -> int:
    return sum(x == y for x, y in zip(a, b))


def _lp_gap(a, b) -> float:
    return max((abs(p - q) for x, y in zip(a, b) if x.ids == y.ids
                for tx, ty in zip(x.turns, y.turns) for p, q in zip(tx.logprobs, ty.logprobs)),
               default=0.0)


def checks(world: str, questions: int = 16, group: int = 4, max_new: int = 40,
           speed_kw: dict | None = None) -> dict:
    import torch
    import retriever
    import rollout
    from eval import load_policy, load_qa
    from generation.vllm_engine import VLLMEngine
    from protocol import Protocol
    work = tempfile.mkdtemp(prefix="bench-vllm-")
    path = widened(world, os.path.join(work, "policy"))
    model, tok = load_policy(path)
    retr = retriever.Retriever(os.path.join(world, "index"))
    rows = load_qa(os.path.join(world, "train.jsonl"))[:questions]
    proto = Protocol(max_turns=2, max_new_tokens=max_new, max_context=1024, gen_batch_size=64)
    t0 = time.perf_counter()
    engine = VLLMEngine(path, model, proto.max_context, kv_gib=0.25, max_num_seqs=64)
    out = {"start_s": time.perf_counter() - t0, "head_dim": 32}

    def episodes(m, qs=rows, proto=proto, g=group):
        return rollout.run_episodes(m, tok, retr, rollout.start_episodes(tok, qs, 3, 1, g), proto)

    with torch.no_grad():
        ref, got = episodes(model), episodes(engine)
        out["factual"] = dict(rows=len(ref), same=_same(_ids(ref), _ids(got)),
                              lp_gap=_lp_gap(ref, got), tokens=sum(e.n_generated for e in ref),
                              stops=sorted({t.stop for e in ref for t in e.turns}))
        alone = episodes(engine, rows[:1], g=1)[0]
        many = episodes(engine, rows, g=1)
        back = episodes(engine, rows[::-1], g=1)[::-1]
        out["order"] = dict(rows=len(many), alone=alone.ids == many[0].ids,
                            reversed=_same(_ids(many), _ids(back)))
        for name, fork in (("twins", False), ("forks", True)):
            results = []
            for m, eps in ((model, ref), (engine, got)):
                reqs = [(ep, t, 0) for ep in eps for t in range(len(ep.turns))
                        if ep.turns[t].end - ep.turns[t].start >= 2]
                # a fork at the middle token of the turn (its own key, the factual token banned)
                ks = [(ep.turns[t].end - ep.turns[t].start) // 2 for ep, t, _ in reqs]
                res = rollout.run_twins(m, tok, retr, reqs, proto, forks=ks if fork else None,
                                        same_evidence_shortcut=False)
                results.append([r.twin.ids for r in res if r.kind == "rollout"])
            out[name] = dict(rows=len(results[0]), same=_same(*results),
                             same_count=len(results[0]) == len(results[1]))
        requests = [(ep, 0, max(0, (ep.turns[0].end - ep.turns[0].start) // 2 - 1), ep.key)
                    for ep in got]
        replay = rollout.continue_after_token(engine, tok, retr, requests, proto)
        out["replays"] = dict(rows=len(replay), same=_same(_ids(replay), _ids(got)))
        lines = Protocol(**{**proto.__dict__, "line_keys": "text"})
        by_line = _ids(episodes(model, proto=lines))
        out["lines"] = dict(rows=len(ref), same=_same(by_line, _ids(episodes(engine, proto=lines))),
                            differ_from_group=len(ref) - _same(by_line, _ids(ref)))
        out["speed"] = speed(model, engine, tok, rows, proto, **(speed_kw or {}))
        # every weight moves (the tied embedding, so the LM head, too)
        gen = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.add_(0.05 * p.std() * torch.randn(p.shape, generator=gen))
        t0 = time.perf_counter()
        engine.ready(model)
        out["sync_s"] = time.perf_counter() - t0
        new_ref, synced = episodes(model), episodes(engine)
        del engine
        gc.collect()
        fresh_path = os.path.join(work, "moved")
        model.save_pretrained(fresh_path)
        for name in os.listdir(path):
            if not os.path.exists(os.path.join(fresh_path, name)):
                shutil.copy(os.path.join(path, name), fresh_path)
        fresh = episodes(VLLMEngine(fresh_path, model, proto.max_context, kv_gib=0.25))
        out["sync"] = dict(rows=len(new_ref), changed=len(ref) - _same(_ids(ref), _ids(new_ref)),
                           same_as_cached=_same(_ids(new_ref), _ids(synced)),
                           same_as_fresh=_same(_ids(fresh), _ids(synced)))
    shutil.rmtree(work, ignore_errors=True)
    return out


def speed(model, engine, tok, rows, proto, group: int = 8, reps: int = 2) -> dict:
    """Generated tokens per second of a rollout of len(rows) x group episodes, cached engine and
    vLLM, alternating, the best of reps each (retrieval included in both)."""
    import rollout
    best = {"cached": 0.0, "vllm": 0.0}
    retr = _NoSearch()
    for _ in range(reps):
        for name, m in (("cached", model), ("vllm", engine)):
            eps = rollout.start_episodes(tok, rows, 7, 0, group)
            t0 = time.perf_counter()
            rollout.run_episodes(m, tok, retr, eps, proto)
            best[name] = max(best[name], sum(e.n_generated for e in eps)
                             / (time.perf_counter() - t0))
    return {**best, "ratio": best["vllm"] / best["cached"], "episodes": len(rows) * group}


def vllm_figure(shape: str = "3b", rows: int = 320, slots: int = 64, length: int = 80,
                max_context: int = 4096, top_p: float = 0.95, kv_gib: float = 18,
                device: str = "cuda", runner: str = "v1") -> dict:
    """engine=vllm's GPU figures, for the first-GPU check: a random Qwen2.5-`shape`-shaped model in
    bf16 (near-uniform logits: turns run to `length` tokens; bench_engine's EOS-biased head has a
    bias vLLM's Qwen2 does not load), one decoded turn of `rows` episodes (one rank's share of the
    3B preset) through vLLM (max_num_seqs = slots, a KV pool of kv_gib) and through the cached
    engine (gen_batch_size = slots), each after a warm-up turn: tok_s of both,
    the share of rows whose tokens agree (bf16 kernels differ: near-ties may flip), start-up and
    weight-sync seconds, and the device memory in use (mem_get_info) per phase: before vLLM,
    awake, after the turn, asleep (sleep mode), awake again; runner: vLLM's model runner asked
    for (the figure records the one that ran). device="cpu" with shape="tiny" runs the same code
    (tested; V1 only: vLLM's V2 runner needs Triton, which has no CPU backend)."""
    import torch
    from transformers import Qwen2Config
    from generation import engine as cached
    from generation.vllm_engine import VLLMEngine
    from transformers import Qwen2ForCausalLM
    from perf.bench_engine import SHAPES, qwen_tokenizer
    from protocol import Protocol
    from rollout import start_episodes
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    used = (lambda: (lambda f, t: (t - f) / 2 ** 30)(*torch.cuda.mem_get_info())) if cuda else \
        (lambda: 0.0)
    tok = qwen_tokenizer()
    config = Qwen2Config(vocab_size=151_936, max_position_embeddings=32768, rms_norm_eps=1e-6,
                         rope_theta=1e6, initializer_range=0.002, **SHAPES[shape])
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval().to(
        device=device, dtype=torch.bfloat16 if cuda else torch.float32)
    work = tempfile.mkdtemp(prefix="vllm-figure-")
    model.save_pretrained(work)
    out = {"shape": shape, "rows": rows, "slots": slots, "kv_gib": kv_gib,
           "memory_gib": {"before": used()}}
    t0 = time.perf_counter()
    eng = VLLMEngine(work, model, max_context, kv_gib, slots, runner=runner)
    out["start_s"], out["memory_gib"]["awake"] = time.perf_counter() - t0, used()
    out["runner"] = eng.runner
    proto = Protocol(max_new_tokens=length, max_context=max_context, gen_batch_size=slots,
                     top_p=top_p)
    questions = [{"id": f"g{i}", "question": f"question {i}", "golden_answers": ["x"]}
                 for i in range(rows)]
    ids = {}
    with torch.no_grad():
        for name, m in (("vllm", eng), ("cached", model)):
            for step in (1, 0):  # a warm-up turn, then the timed one
                sync()
                t0 = time.perf_counter()
                gens = cached.generate_turn(m, tok, start_episodes(tok, questions, 0, step), proto)
                sync()
                took = time.perf_counter() - t0
            n = sum(len(g.ids) for g in gens)
            out[name] = {"tok_s": n / took, "tokens": n, "s": took}
            ids[name] = [g.ids for g in gens]
            if name == "vllm":
                out["memory_gib"]["after_turn"] = used()
        cached.free_cache(model)
        out["same_rows"] = sum(a == b for a, b in zip(ids["vllm"], ids["cached"])) / rows
        out["ratio"] = out["vllm"]["tok_s"] / out["cached"]["tok_s"]
        t0 = time.perf_counter()
        eng.ready(model)
        sync()
        out["sync_s"] = time.perf_counter() - t0
    eng.sleep()
    out["memory_gib"]["asleep"] = used()
    eng.wake()
    out["memory_gib"]["awake_again"] = used()
    shutil.rmtree(work, ignore_errors=True)
    print(f"vllm {shape} ({eng.runner}): {out['vllm']['tok_s']:.0f} tok/s, cached "
          f"{out['cached']['tok_s']:.0f} (x{out['ratio']:.2f}), same rows {out['same_rows']:.3f}, "
          f"sync {out['sync_s']:.2f}s, memory {out['memory_gib']}", flush=True)
    return out


class _NoSearch:
    """A retriever that returns the same empty-ish document at once: the timing is the engine's."""

    def search(self, queries, topk=3):
        return [[{"id": "0", "contents": "\"Nothing\"\nnothing here.", "score": 0.0}] * topk
                for _ in queries]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", default=os.path.join(ROOT, "worlds", "tiny-0"))
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--json", default="", help="write the figures here too")
    ap.add_argument("--gpu", action="store_true", help="vllm_figure at the 3B preset's shape")
    ap.add_argument("--tiny", action="store_true", help="vllm_figure at a tiny shape on the CPU")
    ap.add_argument("--max_new", type=int, default=40, help="tokens per turn of the checks' episodes")
    ap.add_argument("--speed_group", type=int, default=8, help="episodes per question of the speed figure")
    ap.add_argument("--speed_reps", type=int, default=2, help="the speed figure is the best of this many")
    ap.add_argument("--and_tiny", action="store_true",
                    help="the checks, then vllm_figure at the tiny shape, in one process (tests/test_vllm.py)")
    ap.add_argument("--runner", default="v1", choices=("v1", "v2"),
                    help="vLLM's model runner for vllm_figure (v2 needs a GPU)")
    args = ap.parse_args(argv)

    def tiny():
        return vllm_figure("tiny", rows=12, slots=4, length=24, max_context=512, kv_gib=0.25, device="cpu",
                           runner=args.runner)
    if args.gpu or args.tiny:
        out = vllm_figure(runner=args.runner) if args.gpu else tiny()
    else:
        out = checks(args.world, args.questions, max_new=args.max_new,
                     speed_kw=dict(group=args.speed_group, reps=args.speed_reps))
        if args.and_tiny:
            out["tiny_figure"] = tiny()
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
