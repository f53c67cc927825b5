"""The world builder (DESIGN.md section 9): builds the tiny or the chains world into a folder, with
its CLI.

A laptop-sized stand-in for Search-R1's NQ/HotpotQA + wiki-18 + Qwen2.5, in exactly the formats of
the real
pipeline, so that `train_twice.py` runs through the same code paths on a CPU in minutes. `PRESETS` maps a preset to
its world, worlds/tiny.py (the demo's) or worlds/chains.py (1- to 4-hop chains, long turns); the
folder is written atomically (a temporary folder, world.json last, then a rename):
- corpus.jsonl (`id`, `contents` = '"Title"\\ntext', the wiki-18 shape): one document per entity.
- train.jsonl / test.jsonl (`id`, `question`, `golden_answers`, `data_source`, `metadata`); test
  subjects never appear in train questions.
- index/: built by `retriever.build_index(corpus, "minilm")`, the E5 code path with a bundled
  MiniLM; every entity name, searched alone (the scripted agent's query), retrieves its own document
  at rank 1 (names that fail are resampled and the check is repeated; the result is in world.json).
- policy/: a word-level tokenizer (one token per entity name, ChatML-like chat template) and a tiny
  Qwen2 model warm-started by behaviour cloning on the world's scripted episodes, tokenised as the
  rollout does (prompt, each turn alone, each observation alone; loss mask 0 on prompt and
  observations).
- world.json (written last): the entity table and the world's statistics of DESIGN.md section 9. The
builder knows no world: entities, questions, scripts, BC token weights and statistics are the
preset's (PRESETS); the pieces both worlds share are worlds/base.py's.

Deviations (DESIGN.md section 13):
W1. Tokenizer: word-level instead of Qwen2.5's BPE, so that a ~1M-parameter model can copy names;
   the chat template is ChatML without Qwen's default system message (fewer prompt tokens).
W2. The behaviour-cloning forward pass computes the shared prompt prefix (chat header + instruction)
   once per batch and expands its KV cache; this is exact (tested against the plain forward pass)
   and ~2x faster.
W3. Name embeddings are fixed random "identities" (as a pretrained model would have them), redrawn
   every other BC step, so that the policy learns to copy names from the context and can read the
   held-out test entities.

Launch:
  python -m worlds.build --out data/tinyworld --seed 0                 # full world, a few minutes on 2 CPU cores
  python -m worlds.build --out /tmp/tw --seed 0 --scale test --force   # small world for the test suite
  python -m worlds.build --out data/chains --preset chains --seed 0    # the chains world, ~10 min on one thread
  python -m worlds.build --calibration data/chains                     # a built chains world's stop calibration
  python -m worlds.build --calibration data/chains --policy RUN/step_N/policy   # ... of a trained checkpoint
  python -m worlds.build --verify data/chains                          # compare a built world with worlds.lock

Every build runs on pinned numerics (infra/numerics.py, imported first) and is compared with its
worlds.lock entry (worlds/lock.py): a build that differs is a different world, and the CLI exits
with status 1 unless ALLOW_UNPINNED=1.
"""
from infra import numerics  # noqa: F401  first: pins the CPU math libraries before numpy and torch load

import argparse
import hashlib
import json
import os
import shutil
import tempfile
import time

import numpy as np

from infra import adamw
from worlds import chains as world_chains
from worlds import lock as world_lock
from worlds import tiny as world_tiny
from eval import write_jsonl
from protocol import INSTRUCTION, INVALID_ACTION_MSG, information_block, user_message
from worlds.base import (KINDS, TAGS, TOPK, doc_title, docs_text, encode_episode, entity_names,
                         kind_of, lookalike_name, make_name, make_rng)


# preset -> its world: scales ({scale: row}), entity table, documents, questions, the tokenizer's
# texts for the scripts' sentences (given a name), the script, look-alikes, BC token weights (None:
# every token weighs 1), stats
PRESETS = {
    "tiny": dict(scales=world_tiny.SCALES, make_world=world_tiny.make_world,
                 corpus_rows=world_tiny.corpus_rows, question_rows=world_tiny.question_rows,
                 texts=world_tiny.tiny_texts, scripted_episode=world_tiny.scripted_episode,
                 lookalikes=world_tiny.lookalikes, token_weight=lambda tok, table, sc: None,
                 stats=world_tiny.tiny_stats),
    "chains": dict(
        scales=world_chains.CHAIN_SCALES, make_world=world_chains.make_chains_world,
        corpus_rows=world_chains.chains_corpus_rows,
        question_rows=world_chains.chains_question_rows, texts=world_chains.chains_texts,
        scripted_episode=world_chains.chains_episode, lookalikes=world_chains.lookalikes,
        token_weight=lambda tok, table, sc: world_chains.chains_token_weight(
            tok, table, sc["name_weight"]), stats=world_chains.chains_stats),
}
# the credit suite (worlds/chains.py SUITE): chains with other script probabilities, warm-started from chains
PRESETS.update({name: dict(PRESETS["chains"], scales=world_chains.SUITE_SCALES,
                           make_world=world_chains.make_suite_world(name)) for name in world_chains.SUITE})
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
# std of a name's identity embedding (other tokens: the init's 0.1): sharp copies at T = 1
NAME_STD = 0.3
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
KIND_NAME = {"countries": "country", "cities": "city", "companies": "company", "people": "person"}


def rename(obj, mapping):
    """The world with names replaced everywhere (keys and values) by `mapping`; names are whole
    strings."""
    if isinstance(obj, dict):
        return {mapping.get(k, k): rename(v, mapping) for k, v in obj.items()}
    if isinstance(obj, list):
        return [rename(v, mapping) for v in obj]
    return mapping.get(obj, obj) if isinstance(obj, str) else obj


def fix_retrieval(world, preset, work_dir, seed, max_rounds=6):
    """Build the index of `world` (its `preset`, a PRESETS row); resample every name whose own
    search misses its document at rank 1; repeat.

    Returns (world, retriever, {name: top-k docs}, report). A name with a look-alike that fails
    takes a new look-alike pair of names, since the pair's similarity is usually the cause.
    Deterministic: the new names come from make_rng(seed, 1, round).
    """
    import retriever
    report = {"rounds": 0, "resampled": []}
    for rnd in range(max_rounds):
        write_jsonl(os.path.join(work_dir, "corpus.jsonl"), preset["corpus_rows"](world))
        index_dir = os.path.join(work_dir, "index")
        shutil.rmtree(index_dir, ignore_errors=True)
        retriever.build_index(os.path.join(work_dir, "corpus.jsonl"), "minilm", index_dir)
        names = entity_names(world)
        retr = retriever.Retriever(index_dir)
        results = retr.search(names, topk=TOPK)
        failed = [n for n, docs in zip(names, results) if doc_title(docs[0]) != n]
        report["rounds"] = rnd + 1
        if failed:
            retr.close()
        report.setdefault("first_round_rank1", 1 - len(failed) / len(names))
        if not failed:
            report.update(checked=len(names), rank1=1.0)
            return world, retr, dict(zip(names, results)), report
        rng, taken, mapping = make_rng(seed, 1, rnd), set(n.lower() for n in names), {}
        partner = preset["lookalikes"](world)
        for n in failed:
            kind = KIND_NAME[kind_of(world, n)]
            if partner.get(n, n) != n:
                if n in mapping:
                    continue
                a = make_name(rng, kind, taken)
                while (b := lookalike_name(rng, a, taken)) is None:
                    a = make_name(rng, kind, taken)
                mapping[n], mapping[partner[n]] = a, b
            else:
                mapping[n] = make_name(rng, kind, taken)
        report["resampled"] += sorted(mapping)
        world = rename(world, mapping)
    raise RuntimeError(
        f"world: {len(failed)} names still miss rank 1 after {max_rounds} rounds: {failed[:10]}")


def build_tokenizer(world, questions, preset):
    """Qwen2Tokenizer (what AutoTokenizer loads for a qwen2 folder) whose BPE is trained until every
    word of the world is one token (its documents, `questions` and its `preset`'s script sentences);
    tags are added non-special tokens (decode as text), ChatML specials as in Qwen2.5
    (DEVIATION W1)."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer
    texts = [
        INSTRUCTION, INVALID_ACTION_MSG, "user\nassistant\nQuestion: \n\n", "0 1 2 3 4 5 6 7 8 9"
    ]
    texts += [user_message(q["question"]) for q in questions]
    texts += [information_block(docs_text([r, r, r])) for r in preset["corpus_rows"](world)]
    texts += preset["texts"](next(iter(world["people"])))
    # both the spaced and the bare (title) form of every name
    texts += [f"{n} {n}" for n in entity_names(world)]
    bpe = Tokenizer(models.BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix=""))
    # the pipeline of Qwen2Tokenizer.__init__, so training and loading agree
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    ])
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    # merge until no pair is left: every pre-token of the world becomes one token; other text falls
    # back to bytes
    bpe.train_from_iterator(
        texts,
        trainers.BpeTrainer(vocab_size=1 << 20, min_frequency=0, show_progress=False,
                            special_tokens=special,
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = json.loads(bpe.to_str())["model"]
    tok = Qwen2Tokenizer(vocab=model["vocab"], merges=[tuple(m)
                                                       for m in model["merges"]], unk_token=None,
                         bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                         chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False)
    tok.add_tokens([AddedToken(t, special=True, normalized=False)
                    for t in special], special_tokens=True)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    return tok


def make_policy(tok, sc):
    """A tiny Qwen2 of the scale `sc` (a row of a preset's scales); tied embeddings: copying a name
    is an identity map."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    h = sc["hidden"]
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=h, intermediate_size=3 * h,
                      num_hidden_layers=sc["layers"], num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=4096, tie_word_embeddings=True,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                      bos_token_id=None, initializer_range=sc["init"])
    return Qwen2ForCausalLM(cfg)


def name_table(tok, world, look):
    """Token rows of every entity name: (spaced rows, bare rows, kind index, row of its look-alike's
    spaced form); `look` is {name: its look-alike}."""
    import torch
    names = entity_names(world)
    row = {n: tok.convert_tokens_to_ids(n) for n in names}
    # U+0120 "Ġ": ByteLevel's space
    spaced = {n: tok.convert_tokens_to_ids("\u0120" + n) for n in names}
    return (torch.tensor([spaced[n] for n in names]), torch.tensor([row[n] for n in names]),
            torch.tensor([KINDS.index(kind_of(world, n)) for n in names]),
            torch.tensor([names.index(look.get(n, n)) for n in names]))


def draw_names(table, h, gen, std=NAME_STD):
    """Embeddings (spaced (N, H), bare (N, H)) of all names, as a pretrained LM would have them
    (DEVIATION W3): a random identity in the first H - 8 dims and a type code in the last 8 (is a
    name, its kind, bare = the title form after a quote). A look-alike's identity is its partner's
    with the second half negated: spelling similarity as one fixed map, so "search the look-alike"
    can be learned once and holds for unseen names too."""
    import torch
    _, _, kinds, partner = table
    n, d = len(partner), h - 8
    ident = torch.randn(n, d, generator=gen) * std  # (N, d)
    mirror = partner < torch.arange(n)  # the second of each pair mirrors the first
    flip = torch.cat([torch.ones(d // 2), -torch.ones(d - d // 2)])
    ident = torch.where(mirror[:, None], ident[partner] * flip, ident)
    code = torch.zeros(n, 8)
    code[:, 0] = 1.0
    code[torch.arange(n), 1 + kinds] = 1.0
    bare = code.clone()
    bare[:, 5] = 1.0
    return torch.cat([ident, code], 1), torch.cat([ident, bare], 1)


def common_prefix(seqs):
    n = min(len(s) for s in seqs)
    return next((i for i in range(n) if any(s[i] != seqs[0][i] for s in seqs)), n)


def bc_loss(model, prefix, ids, mask, attn, emb=None, token_weight=None):
    """Mean NLL of the loss-masked tokens, with the tied embedding matrix `emb` (V, H) (default: the
    model's).

    `prefix` (P,) is shared by every row: its KV is computed once and expanded (exact,
    DEVIATION W2); ids, mask and attn (B, T) are the right-padded rest of each episode.
    """
    import torch
    from transformers import DynamicCache
    emb = model.get_input_embeddings().weight if emb is None else emb
    B, T = ids.shape
    P = prefix.numel()
    cache = DynamicCache(config=model.config)
    model.model(inputs_embeds=emb[prefix][None], past_key_values=cache, use_cache=True)
    cache.batch_repeat_interleave(B)
    full_attn = torch.cat([torch.ones(B, P, dtype=attn.dtype), attn], 1)
    pos = torch.arange(P, P + T)[None].expand(B, T)
    hidden = model.model(inputs_embeds=emb[ids], attention_mask=full_attn, position_ids=pos,
                         past_key_values=cache)[0]  # (B, T, H)
    m = mask[:, 1:].bool()  # the first rest token is part of the question: never a target
    logits = hidden[:, :-1][m] @ emb.T  # (N, V): only the loss-masked positions need the vocabulary
    if token_weight is None:
        return torch.nn.functional.cross_entropy(logits.float(), ids[:, 1:][m])
    w = token_weight[ids[:, 1:][m]]  # (N,) weight of each target token
    return (torch.nn.functional.cross_entropy(logits.float(), ids[:, 1:][m], reduction="none") *
            w).sum() / w.sum()


def make_batches(encoded, batch, rng):
    """Fixed-order batches of similar lengths (less padding); order drawn from `rng`."""
    order = rng.permutation(len(encoded))
    span = 16 * batch
    chunks = [
        sorted(order[i:i + span], key=lambda k: len(encoded[k][0]))
        for i in range(0, len(order), span)
    ]
    batches = [c[i:i + batch] for c in chunks for i in range(0, len(c), batch)]
    return [batches[i] for i in rng.permutation(len(batches))]


def pad_batch(encoded, rows, P, pad_id):
    import torch
    T = max(len(encoded[k][0]) for k in rows) - P
    ids = torch.full((len(rows), T), pad_id)
    mask, attn = torch.zeros(len(rows), T, dtype=torch.long), torch.zeros(
        len(rows), T, dtype=torch.long)
    for r, k in enumerate(rows):
        seq, m = encoded[k][0][P:], encoded[k][1][P:]
        ids[r, :len(seq)], mask[r, :len(seq)], attn[r, :len(seq)] = torch.tensor(seq), torch.tensor(
            m), 1
    return ids, mask, attn


def train_bc(model, encoded, table, s, seed, token_weight=None):
    """Behaviour cloning with AdamW (warmup + cosine), deterministic from the seed; returns the loss
    curve.

    Name embeddings are set from draw_names and frozen; every other step they are redrawn for that
    step only, so the policy must learn to copy names from the context rather than to memorise them:
    this is what makes it read the held-out test people, whose tokens it never sees in training
    (without it: name-token loss 0.13 on train episodes, 3.4 on test ones). The steps with the saved
    embeddings still let it memorise confusable people.
    """
    import math
    import torch
    from tqdm import tqdm
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    emb = model.get_input_embeddings().weight
    rows, h = torch.cat(table[:2]), emb.shape[1]
    with torch.no_grad():
        emb[rows] = torch.cat(draw_names(table, h, gen))
    # frozen: a name's vector is its identity
    emb.register_hook(lambda g: g.index_fill(0, rows, 0.0))
    P = common_prefix([e[0] for e in encoded])
    assert not any(any(e[1][:P]) for e in encoded), "the shared prefix must be prompt only (mask 0)"
    prefix = torch.tensor(encoded[0][0][:P])
    batches = make_batches(encoded, s["bc_batch"], make_rng(seed, 2))
    steps = min(s["bc_steps"], len(batches))
    # AdamW with the CPU-independent square root (infra/adamw.py): the same world on every CPU
    opt = adamw.AdamW(model.parameters(), lr=s["lr"], betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1, (i + 1) / warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, i / steps)))))
    losses, bar = [], tqdm(batches[:steps], desc="behaviour cloning", leave=False)
    model.train()
    for i, batch in enumerate(bar):
        w = emb.index_put((rows,), torch.cat(draw_names(table, h, gen))) if i % 2 else emb
        loss = bc_loss(model, prefix, *pad_batch(encoded, batch, P, model.config.pad_token_id), w,
                       token_weight)
        assert torch.isfinite(loss), f"BC loss is not finite at step {i}"
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(), sched.step(), opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return losses


def make_demos(episode, world, questions, top, n, seed):
    """n scripted (imperfect) episodes of the script `episode` over the train questions, in a fixed
    shuffled order, cycling."""
    rng, demos = make_rng(seed, 3), []
    while len(demos) < n:
        for k in rng.permutation(len(questions))[: n - len(demos)]:
            demos.append((questions[k], *episode(questions[k], world, top, rng)))
    return demos


def build_world(out, seed=0, scale="full", force=False, threads=1, preset="tiny", init=None):
    """Build a world (`preset` tiny, chains or a suite world) into `out` atomically (temp dir, world.json last,
    rename); returns the stats. `init`: the chains world whose policy a suite world's BC starts from (default, at
    a scale whose row says `from_chains`: the committed worlds/chains-<seed>)."""
    import torch
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    if scale not in PRESETS[preset]["scales"]:
        raise ValueError(
            f"unknown scale {scale!r}; choose one of {sorted(PRESETS[preset]['scales'])}")
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise FileExistsError(f"{out} exists and is not empty; pass --force to overwrite it")
    # One thread: with two, some CPU kernel reduces in a varying order and the BC weights differ
    # from run to run (max |diff| 0.017 between two builds); with one, the build is bit for bit
    # repeatable (tested).
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tinyworld-", dir=parent)
    try:
        stats = _build(tmp, seed, scale, out, preset, init)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(threads_before)
    return stats


def init_policy(model, tok, folder):
    """Load the policy of the built world `folder` into `model` (a suite world's BC starts there); the two
    tokenizers must be one (the same words: the suite's texts are chains'). Returns its weights' sha256."""
    from safetensors.torch import load_file
    path = os.path.join(folder, "policy", "model.safetensors")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"worlds/build.py: no policy to start from at {path} (build or copy the chains "
                                "world of this seed first: make world WORLD=DIR PRESET=chains)")
    from transformers import AutoTokenizer
    if AutoTokenizer.from_pretrained(os.path.join(folder, "policy")).get_vocab() != tok.get_vocab():
        raise ValueError(f"worlds/build.py: {folder}/policy has another vocabulary than this world's: not the "
                         "chains world of the same seed and scale")
    missing, unexpected = model.load_state_dict(load_file(path), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # the tied head is the embedding
        raise ValueError(f"worlds/build.py: {path} does not fit this world's policy: missing {missing}, "
                         f"unexpected {unexpected}")
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _build(tmp, seed, scale, out, name, init=None):
    """The world of the preset `name` into `tmp`: corpus and index, questions, tokenizer, BC policy,
    stats."""
    import torch
    preset = PRESETS[name]
    sc, t0, times = preset["scales"][scale], time.time(), {}
    world, retr, top, check = fix_retrieval(preset["make_world"](seed, scale), preset, tmp, seed)
    split = {s: preset["question_rows"](world, s) for s in ("train", "test")}
    for s, rows in split.items():
        write_jsonl(os.path.join(tmp, f"{s}.jsonl"), rows)
    times["corpus_index_s"], t = time.time() - t0, time.time()
    tok = build_tokenizer(world, split["train"] + split["test"], preset)
    demos = make_demos(preset["scripted_episode"], world, split["train"], top,
                       sc["bc_steps"] * sc["bc_batch"], seed)
    cache = {}
    encoded = [encode_episode(tok, q["question"], turns, cache) for q, turns, _ in demos]
    times["tokenizer_demos_s"], t = time.time() - t, time.time()
    torch.manual_seed(seed)
    model = make_policy(tok, sc)
    if init is None and sc.get("from_chains"):
        init = os.path.join(ROOT, "worlds", f"chains-{seed}")
    start = init_policy(model, tok, init) if init else None
    table = name_table(tok, world, preset["lookalikes"](world))
    losses = train_bc(model, encoded, table, sc, seed, preset["token_weight"](tok, table, sc))
    model.save_pretrained(os.path.join(tmp, "policy"))
    tok.save_pretrained(os.path.join(tmp, "policy"))
    times["bc_s"], t = time.time() - t, time.time()
    stats = {
        "preset": name,
        **preset["stats"](model, tok, retr, world, split, top, demos, seed, sc, times)
    }
    stats["bc"] = {
        "steps": len(losses), "batch": sc["bc_batch"], "episodes": len(encoded), "lr": sc["lr"],
        "params": sum(p.numel() for p in model.parameters()),
        **({"init_sha256": start} if start else {}),
        "vocab": len(tok), "loss_first10": float(np.mean(losses[:10])), "loss_last10": float(
            np.mean(losses[-10:])), "losses": [round(x, 4) for x in losses]
    }
    stats["retrieval_check"], stats["numerics"], stats["times"] = check, numerics.describe(), times
    return _finish(tmp, out, world, stats, t0)


def _finish(tmp, out, world, stats, t0):
    # The index records its corpus by absolute path: point it at the final folder (the fingerprint
    # is unchanged).
    meta_path = os.path.join(tmp, "index", "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    meta["corpus"] = os.path.join(os.path.abspath(out), "corpus.jsonl")
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=2)
    stats["times"]["total_s"] = time.time() - t0
    # last: its presence means the world is complete
    with open(os.path.join(tmp, "world.json"), "w") as f:
        json.dump({"stats": stats, "world": world}, f, indent=1, default=float)
    return stats


WORLD_FILES = ("corpus.jsonl", "train.jsonl", "test.jsonl", "index/index.faiss",
               "policy/model.safetensors", "policy/tokenizer.json")


def differing_files(a: str, b: str) -> list:
    """The WORLD_FILES whose bytes differ between two built worlds (a rebuild on one thread: none).
    """
    def read(root, rel):
        with open(os.path.join(root, rel), "rb") as f:
            return f.read()
    return [rel for rel in WORLD_FILES if read(a, rel) != read(b, rel)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="output folder (must not exist or be empty, unless --force)")
    parser.add_argument(
        "--calibration", metavar="WORLD", help="print a built chains world's stop calibration "
        "(world_chains.stop_calibration) and exit")
    parser.add_argument("--policy", metavar="DIR", help="with --calibration: calibrate this policy folder (a trained "
                        "checkpoint's step_N/policy) on the world instead of its warm start")
    parser.add_argument(
        "--verify", metavar="WORLD",
        help="compare a built world with its worlds.lock entry and exit "
        "(status 1 on a difference unless ALLOW_UNPINNED=1)")
    parser.add_argument(
        "--lock", metavar="WORLD", help="write a built world's digests into worlds.lock (a world "
        "built on pinned numerics) and exit")
    parser.add_argument("--seed", type=int, default=0, help="world, demonstrations and BC seed")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                        help="tiny (the demo's world), chains (1- to 4-hop chains, long turns) or a world of the "
                        "credit suite (worlds/chains.py SUITE: " + ", ".join(world_chains.SUITE) + ")")
    parser.add_argument("--init", metavar="WORLD", help="a suite world: the chains world whose policy BC starts "
                        "from (default at full scale: worlds/chains-<seed>)")
    parser.add_argument("--scale", choices=sorted({
        s for p in PRESETS.values() for s in p["scales"]
    }), default="full", help="full world, or a small one for tests")
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    args = parser.parse_args(argv)
    if args.policy and not args.calibration:
        parser.error("--policy goes with --calibration WORLD")
    if args.calibration:
        cal = world_chains.stop_calibration(args.calibration, seed=args.seed, policy=args.policy or "")
        print(json.dumps(cal, indent=1))
        return
    if args.verify:
        return verify(args.verify)
    if args.lock:
        return lock(args.lock)
    if not args.out:
        parser.error("--out is required (or --calibration, --verify or --lock WORLD)")
    numerics.require("this world build")
    stats = build_world(args.out, args.seed, args.scale, args.force, 1, args.preset, args.init)
    stats["bc"].pop("losses")
    print(json.dumps(stats, indent=1, default=float))
    verify(args.out)


def verify(folder):
    """Print how a built world compares with worlds.lock; SystemExit(1) on a difference unless
    ALLOW_UNPINNED=1."""
    try:
        ok, message = world_lock.verdict(folder)
    # no world there, or a bad lock line (named by read_lock)
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(
            f"worlds/build.py: cannot check {folder} against worlds.lock: {e}") from None
    print(message, flush=True)
    if not ok and not numerics.allowed():
        raise SystemExit(
            f"worlds/build.py: {folder} is not the committed world: an older build? `rm -r {folder}` and "
            f"`make world` copy the committed one (or set {numerics.ALLOW}=1 to use it anyway)")


def lock(folder):
    with open(os.path.join(folder, "world.json"), encoding="utf-8") as f:
        if not json.load(f)["stats"].get("numerics", {}).get("pinned"):
            raise SystemExit(
                f"worlds/build.py: {folder} was not built on pinned numerics: its digests would not hold on "
                "another machine, so they are not locked")
    print(f"worlds.lock: wrote {' '.join(map(str, world_lock.write_entry(folder)))}")


if __name__ == "__main__":
    main()
