"""The built-in tiny world (DESIGN.md section 9).

A laptop-sized stand-in for Search-R1's NQ/HotpotQA + wiki-18 + Qwen2.5, in exactly the formats of the real
pipeline, so that `train_twice.py` runs through the same code paths on a CPU in minutes.
- corpus.jsonl (`id`, `contents` = '"Title"\\ntext', the wiki-18 shape) about invented countries, cities (in a
  country), companies (based in a city) and people (born in a city, working for a company). People come in
  look-alike pairs (Zorvak / Zorvik) with different attributes: searching the look-alike really retrieves its
  own document, which misleads.
- train.jsonl / test.jsonl (`id`, `question`, `golden_answers`, `data_source`, `metadata`): 1-hop questions
  (birthplace, employer, a city's country, a company's city) and 2-hop questions (country of birth, city of the
  employer). Test subjects (people by look-alike pair, cities, companies) never appear in train questions.
- index/: built by `retriever.build_index(corpus, "minilm")`, the E5 code path with a bundled MiniLM; every
  entity name, searched alone (the scripted agent's query), retrieves its own document at rank 1 (names that
  fail are resampled and the check is repeated; the result is in world.json).
- policy/: a word-level tokenizer (one token per entity name, ChatML-like chat template) and a tiny Qwen2 model
  warm-started by behaviour cloning on scripted episodes in the protocol of DESIGN.md section 3, tokenised as
  the rollout does (prompt, each turn alone, each observation alone; loss mask 0 on prompt and observations).
  The scripts are imperfect with the probabilities of `DEMO_PROBS`, so that turn-level choices are stochastic
  and consequential; in two identifiable situations the majority choice is wrong (2-hop: answer the bridge
  entity; "confusable" people: search the look-alike), so greedy decoding fails there and RL can fix it.
- world.json (written last): the entity table and every statistic of DESIGN.md section 9.

Deviations (README "Deviations"):
W1. Tokenizer: word-level instead of Qwen2.5's BPE, so that a ~1M-parameter model can copy names; the chat
   template is ChatML without Qwen's default system message (fewer prompt tokens).
W2. The behaviour-cloning forward pass computes the shared prompt prefix (chat header + instruction) once per
   batch and expands its KV cache; this is exact (tested against the plain forward pass) and ~2x faster.

Launch:
  python tinyworld.py --out data/tinyworld --seed 0              # full world, a few minutes on 2 CPU cores
  python tinyworld.py --out /tmp/tw --seed 0 --scale test --force  # small world for the test suite
"""
import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np

from eval import write_jsonl
from rollout import (INSTRUCTION, INVALID_ACTION_MSG, exact_match, information_block, render_prompt, reward,
                     user_message)


# Scripted-demonstration probabilities (saved in world.json). Each row is one decision of the script.
DEMO_PROBS = {
    # turn 1: search the subject / search its look-alike (misleads) / answer a guess without searching
    "first": {"search_right": 0.70, "search_lookalike": 0.15, "guess": 0.15},
    # turn 1 for "confusable" people: the look-alike is the majority search (greedy fails; RL can fix it)
    "first_confusable": {"search_right": 0.30, "search_lookalike": 0.55, "guess": 0.15},
    # after the look-alike's document came back: notice it and search the right name / trust Doc 1
    "after_lookalike": {"notice": 0.35, "trust": 0.65},
    # 2-hop, after the subject's document: search the bridge entity / answer the bridge (majority: wrong)
    "hop": {"search_bridge": 0.40, "answer_bridge": 0.60},
    # after the document that holds the answer: answer from Doc 1 / misread another doc (luck after a good
    # choice) / search again
    "read": {"doc1": 0.75, "other_doc": 0.15, "search_again": 0.10},
}
CONFUSABLE_FRAC = 0.3  # share of look-alike pairs that are "confusable"
NAME_STD = 0.3         # std of a name's identity embedding (other tokens: the init's 0.1): sharp copies at T = 1
MAX_SEARCHES = 4       # DESIGN 3 max_turns: the script answers after this many searches
TOPK = 3               # DESIGN 3 top-k

SCALES = {  # entity counts; policy size and BC optimisation; warm-start evaluation sizes
    "full": dict(countries=12, cities=48, companies=48, pairs=90, test_pairs=12, test_places=8, templates=3,
                 hidden=64, layers=2, init=0.1, bc_steps=700, bc_batch=32, lr=3e-3, eval_questions=200, eval_group=5,
                 eval_max_new=100),
    "test": dict(countries=3, cities=6, companies=6, pairs=6, test_pairs=2, test_places=2, templates=1,
                 hidden=32, layers=2, init=0.1, bc_steps=12, bc_batch=8, lr=3e-3, eval_questions=4, eval_group=2,
                 eval_max_new=16),
}
# Policy notes (measured on the full world, 2 CPU cores): copying names from the context appears as a phase change
# after ~250 BC steps with 2 layers x 64 wide and initializer_range 0.1; 3 layers x 128 at 0.02 had not learned
# it after 300 steps (name-token loss 4.4 vs 0.13), and lr 1e-2 was worse than 3e-3.

# Question types: (hops, subject kind, relation chain, templates). Answers are never in the question.
QTYPES = {
    "birthplace": (1, "person", ("born",), ("Where was {} born?", "What is the birthplace of {}?",
                                             "In which city was {} born?")),
    "employer": (1, "person", ("works",), ("Which company does {} work for?", "Who employs {}?",
                                           "What is the employer of {}?")),
    "birth_country": (2, "person", ("born", "in"), ("In which country was {} born?", "What country was {} born in?",
                                                    "Which country is the birthplace of {} in?")),
    "employer_city": (2, "person", ("works", "based"), ("In which city is the employer of {} based?",
                                                        "Where is the company {} works for based?",
                                                        "Which city is the employer of {} in?")),
    "city_country": (1, "city", ("in",), ("Which country is {} in?", "In which country is the city {}?")),
    "company_city": (1, "company", ("based",), ("Where is {} based?", "In which city is the company {} based?")),
}
NEED = {"born": "I need the birthplace of {}.", "works": "I need the employer of {}.",
        "in": "I need the country of {}.", "based": "I need the city of {}."}
FACT = {"born": "{} was born in {}.", "works": "{} works for {}.", "in": "{} is a city in {}.",
        "based": "{} is a company based in {}."}
SUFFIX = {"country": ("land", "ia", "stan", "ova"), "city": ("ton", "by", "ford", "wick", "mouth"),
          "company": ("co", "corp", "tech", "dyne"), "person": ("",)}
ONSETS = "b br d dr f g gr h k kl l m n p pr r s sk st t tr v z".split()
MIDS = "l ld lm n nd r rk rm rv s sh st th v x z".split()
VOWELS = "aeiou"
TAGS = ("<think>", "</think>", "<search>", "</search>", "<answer>", "</answer>", "<information>", "</information>")
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def make_rng(seed, *tags):
    """Independent numpy stream per (seed, tags) by SeedSequence integer mixing (never Python's hash())."""
    return np.random.default_rng([seed, *tags])


def make_name(rng, kind, taken):
    """A new invented, capitalised, single-word name (letters only, so it is one pre-token)."""
    while True:
        stem = rng.choice(ONSETS) + rng.choice(list(VOWELS)) + rng.choice(MIDS) + rng.choice(list(VOWELS))
        name = (stem + rng.choice(list("knrsltx")) if kind == "person" else stem + rng.choice(SUFFIX[kind])).title()
        if name.lower() not in taken:
            taken.add(name.lower())
            return name


def lookalike_name(rng, name, taken):
    """Same name with the last vowel changed (Zorvak -> Zorvik); None when every variant is taken."""
    i = max(k for k, ch in enumerate(name) if ch in VOWELS)
    for v in rng.permutation(list(VOWELS)):
        cand = name[:i] + v + name[i + 1:]
        if cand.lower() not in taken:
            taken.add(cand.lower())
            return cand
    return None


def make_world(seed, scale="full"):
    """Entity table: countries, cities, companies and look-alike pairs of people, with their relations and splits."""
    s, rng, taken = SCALES[scale], make_rng(seed, 0), set(w.lower() for w in INSTRUCTION.split())
    countries = [make_name(rng, "country", taken) for _ in range(s["countries"])]
    cities = {make_name(rng, "city", taken): countries[i % len(countries)] for i in range(s["cities"])}
    city_list = list(cities)
    companies = {make_name(rng, "company", taken): str(rng.choice(city_list)) for _ in range(s["companies"])}
    people, pairs = {}, []
    while len(pairs) < s["pairs"]:
        a = make_name(rng, "person", taken)
        b = lookalike_name(rng, a, taken)
        if b is None:
            continue
        pa = _person_attrs(rng, city_list, companies, cities, None)
        people[a], people[b] = pa, _person_attrs(rng, city_list, companies, cities, pa)
        pairs.append((a, b))
    n_conf = round(CONFUSABLE_FRAC * len(pairs))
    for k in rng.permutation(len(pairs))[:n_conf]:
        for p in pairs[k]:
            people[p]["confusable"] = True
    for a, b in pairs:
        people[a]["lookalike"], people[b]["lookalike"] = b, a
    test = set(p for pair in pairs[len(pairs) - s["test_pairs"]:] for p in pair)
    test |= set(city_list[-s["test_places"]:]) | set(list(companies)[-s["test_places"]:])
    return {"seed": seed, "scale": scale, "countries": countries, "cities": cities, "companies": companies,
            "people": people, "test_subjects": sorted(test)}


def _person_attrs(rng, city_list, companies, cities, other):
    """Birthplace and employer, the employer based elsewhere (else the 2-hop answer would sit in the person's own
    document); a look-alike differs in all four answers (birthplace, employer, their country and city)."""
    while True:
        born, works = str(rng.choice(city_list)), str(rng.choice(list(companies)))
        if companies[works] != born and (other is None or (
                born != other["born"] and works != other["works"] and cities[born] != cities[other["born"]]
                and companies[works] != companies[other["works"]])):
            return {"born": born, "works": works, "confusable": False}


def relation(world, name, rel):
    """Value of `rel` for an entity (None when the entity does not have it)."""
    if rel in ("born", "works"):
        return world["people"].get(name, {}).get(rel)
    return {"in": world["cities"], "based": world["companies"]}[rel].get(name)


def corpus_rows(world):
    """One document per entity, '"Title"\\ntext' as in wiki-18; its sentences are the FACT templates."""
    docs = [(c, f"{c} is a country.") for c in world["countries"]]
    docs += [(c, FACT["in"].format(c, n)) for c, n in world["cities"].items()]
    docs += [(k, FACT["based"].format(k, c)) for k, c in world["companies"].items()]
    docs += [(p, FACT["born"].format(p, a["born"]) + " " + FACT["works"].format(p, a["works"]))
             for p, a in world["people"].items()]
    return [{"id": str(i), "contents": f'"{title}"\n{text}'} for i, (title, text) in enumerate(docs)]


def question_rows(world, split):
    """QA rows of a split; `metadata` (type, subject, bridge, hops) is for the script and the audit."""
    test, rows = set(world["test_subjects"]), []
    subjects = {"person": world["people"], "city": world["cities"], "company": world["companies"]}
    for qtype, (hops, kind, chain, templates) in QTYPES.items():
        for subj in subjects[kind]:
            if (subj in test) != (split == "test"):
                continue
            bridge = relation(world, subj, chain[0])
            gold = bridge if hops == 1 else relation(world, bridge, chain[1])
            for t in templates[:SCALES[world["scale"]]["templates"]]:
                rows.append({"id": f"{split}_{len(rows)}", "question": t.format(subj), "golden_answers": [gold],
                             "data_source": f"tiny_{hops}hop", "metadata": {"type": qtype, "subject": subj,
                                                                             "bridge": bridge if hops == 2 else None}})
    return rows


def entity_names(world):
    return world["countries"] + list(world["cities"]) + list(world["companies"]) + list(world["people"])


def rename(obj, mapping):
    """The world with names replaced everywhere (keys and values) by `mapping`; names are whole strings."""
    if isinstance(obj, dict):
        return {mapping.get(k, k): rename(v, mapping) for k, v in obj.items()}
    if isinstance(obj, list):
        return [rename(v, mapping) for v in obj]
    return mapping.get(obj, obj) if isinstance(obj, str) else obj


def doc_title(doc):
    return doc["contents"].split("\n")[0].strip('"')


def fix_retrieval(world, work_dir, seed, max_rounds=6):
    """Build the index; resample every name whose own search misses its document at rank 1; repeat.

    Returns (world, {name: top-k docs}, report). A person who fails takes a new look-alike pair of names, since the
    pair's similarity is usually the cause. Deterministic: the new names come from make_rng(seed, 1, round).
    """
    import retriever
    report = {"rounds": 0, "resampled": []}
    for rnd in range(max_rounds):
        write_jsonl(os.path.join(work_dir, "corpus.jsonl"), corpus_rows(world))
        index_dir = os.path.join(work_dir, "index")
        shutil.rmtree(index_dir, ignore_errors=True)
        retriever.build_index(os.path.join(work_dir, "corpus.jsonl"), "minilm", index_dir)
        names = entity_names(world)
        retr = retriever.DenseRetriever(index_dir)
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
        for n in failed:
            if n in world["people"]:
                if n in mapping:
                    continue
                a = make_name(rng, "person", taken)
                while (b := lookalike_name(rng, a, taken)) is None:
                    a = make_name(rng, "person", taken)
                mapping[n], mapping[world["people"][n]["lookalike"]] = a, b
            else:
                kind = "country" if n in world["countries"] else "city" if n in world["cities"] else "company"
                mapping[n] = make_name(rng, kind, taken)
        report["resampled"] += sorted(mapping)
        world = rename(world, mapping)
    raise RuntimeError(f"tiny world: {len(failed)} names still miss rank 1 after {max_rounds} rounds: {failed[:10]}")


def build_tokenizer(world, questions):
    """Qwen2Tokenizer (what AutoTokenizer loads for a qwen2 folder) whose BPE is trained until every word of the world
    is one token; tags are added non-special tokens (decode as text), ChatML specials as in Qwen2.5 (DEVIATION W1)."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer
    texts = [INSTRUCTION, INVALID_ACTION_MSG, "user\nassistant\nQuestion: \n\n", "0 1 2 3 4 5 6 7 8 9"]
    texts += [user_message(q["question"]) for q in questions]
    texts += [information_block(docs_text([r, r, r])) for r in corpus_rows(world)]
    p = next(iter(world["people"]))
    thoughts = (*NEED.values(), "Wrong person.", "Let me search again.", "I guess {}.")
    texts += [turn_text(t, p, "search", p) for t in thoughts]
    texts += [f"{n} {n}" for n in entity_names(world)]  # both the spaced and the bare (title) form of every name
    bpe = Tokenizer(models.BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix=""))
    bpe.normalizer = normalizers.NFC()  # the pipeline of Qwen2Tokenizer.__init__, so training and loading agree
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    # merge until no pair is left: every pre-token of the world becomes one token; other text falls back to bytes
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=1 << 20, min_frequency=0, show_progress=False,
                                                        special_tokens=special,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = json.loads(bpe.to_str())["model"]
    tok = Qwen2Tokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]], unk_token=None,
                         bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                         chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False)
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in special], special_tokens=True)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    return tok


def turn_text(think, arg, action, content):
    """One agent turn, ending right at its closing tag (the rollout stops there)."""
    return f"<think> {think.format(arg, content)} </think>\n<{action}> {content} </{action}>"


def docs_text(docs):
    import retriever
    return retriever.format_docs(docs)


def kind_of(world, name):
    return next(k for k in ("countries", "cities", "companies", "people") if name in world[k])


def scripted_episode(q, world, top, rng, perfect=False):
    """One scripted episode for question row `q`: ([(turn_text, observation or None)], [(decision, choice)]).

    `top[name]` are the retriever's top-k docs for the query `name`. `perfect` always takes the first (right)
    choice of each DEMO_PROBS row; otherwise choices are drawn from `rng` with the stated probabilities.
    """
    meta, turns, log = q["metadata"], [], []
    hops, _, chain, _ = QTYPES[meta["type"]]
    person = world["people"].get(meta["subject"])
    hop, target, searched, searches = 0, meta["subject"], None, 0

    def choose(row, allowed=None, label=None):
        probs = {k: p for k, p in DEMO_PROBS[row].items() if allowed is None or k in allowed}
        keys, p = list(probs), np.array(list(probs.values()))
        pick = keys[0] if perfect else keys[rng.choice(len(keys), p=p / p.sum())]
        log.append((label or row, pick))
        return pick

    def search(think, name):
        nonlocal searched, searches
        searched, searches = name, searches + 1
        turns.append((turn_text(think, name, "search", name), information_block(docs_text(top[name]))))

    def answer(think, arg, value):
        turns.append((turn_text(think, arg, "answer", value), None))

    row = "first_confusable" if person and person["confusable"] else "first"
    pick = choose(row, *((None,) if person else (("search_right", "guess"), "first_place")))
    if pick == "guess":
        gold = q["golden_answers"][0]
        answer("I guess {1}.", None, str(rng.choice(list(world[kind_of(world, gold)]))))
        return turns, log
    search(NEED[chain[0]], target if pick == "search_right" else person["lookalike"])
    while True:
        docs, can_search = top[searched], searches < MAX_SEARCHES
        entity = doc_title(docs[0])
        if entity != target and choose("after_lookalike", None if can_search else ("trust",)) == "notice":
            search("Wrong person. " + NEED[chain[hop]], target)
            continue
        value = relation(world, entity, chain[hop])
        if hop == 0 and hops == 2:
            if choose("hop", None if can_search else ("answer_bridge",)) == "answer_bridge":
                return answer(FACT[chain[0]], entity, value) or (turns, log)
            hop, target = 1, value
            search(FACT[chain[0]].format(entity, value) + " " + NEED[chain[1]], value)
            continue
        others = [(doc_title(d), relation(world, doc_title(d), chain[hop])) for d in docs[1:]]
        others = [(e, v) for e, v in others if v is not None and v != value]
        pick = choose("read", [k for k, ok in (("doc1", True), ("other_doc", others), ("search_again", can_search))
                               if ok])
        if pick == "search_again":
            search("Let me search again.", searched)
            continue
        entity, value = (entity, value) if pick == "doc1" else others[0]
        return answer(FACT[chain[hop]], entity, value) or (turns, log)


def episode_response(turns):
    """Everything after the prompt, as the rollout would see it (for the reward)."""
    return "".join(t + (o or "") for t, o in turns)


def encode_episode(tok, question, turns, cache):
    """(ids, loss mask) exactly as the rollout tokenises: prompt, each turn alone, each observation alone (<= 500)."""
    def enc(text):
        if text not in cache:
            cache[text] = tok(text, add_special_tokens=False)["input_ids"]
        return cache[text]
    ids = list(enc(render_prompt(tok, question)))
    mask = [0] * len(ids)
    for text, obs in turns:
        ids += enc(text)
        mask += [1] * len(enc(text))
        if obs is not None:
            ids += enc(obs)[:500]
            mask += [0] * len(enc(obs)[:500])
    return ids, mask


def make_policy(tok, scale):
    """A tiny Qwen2; tied embeddings, so that copying a name from the context is an identity map."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    h = SCALES[scale]["hidden"]
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=h, intermediate_size=3 * h,
                      num_hidden_layers=SCALES[scale]["layers"], num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=4096, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, bos_token_id=None, initializer_range=SCALES[scale]["init"])
    return Qwen2ForCausalLM(cfg)


def name_table(tok, world):
    """Token rows of every entity name: (spaced rows, bare rows, kind index, row of its look-alike's spaced form)."""
    import torch
    names, kinds = entity_names(world), ("countries", "cities", "companies", "people")
    row = {n: tok.convert_tokens_to_ids(n) for n in names}
    spaced = {n: tok.convert_tokens_to_ids("\u0120" + n) for n in names}  # U+0120 "Ġ": ByteLevel's space
    look = {n: world["people"][n]["lookalike"] for n in world["people"]}
    return (torch.tensor([spaced[n] for n in names]), torch.tensor([row[n] for n in names]),
            torch.tensor([kinds.index(kind_of(world, n)) for n in names]),
            torch.tensor([names.index(look.get(n, n)) for n in names]))


def draw_names(table, h, gen, std=NAME_STD):
    """Embeddings (spaced (N, H), bare (N, H)) of all names, as a pretrained LM would have them: a random identity in
    the first H - 8 dims and a type code in the last 8 (is a name, its kind, bare = the title form after a quote).
    A look-alike's identity is its partner's with the second half negated: spelling similarity as one fixed map, so
    "search the look-alike" can be learned once and holds for unseen names too."""
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


def bc_loss(model, prefix, ids, mask, attn, emb=None):
    """Mean NLL of the loss-masked tokens, with the tied embedding matrix `emb` (V, H) (default: the model's).

    `prefix` (P,) is shared by every row: its KV is computed once and expanded (exact, DEVIATION W2); ids, mask and
    attn (B, T) are the right-padded rest of each episode.
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
    return torch.nn.functional.cross_entropy(logits.float(), ids[:, 1:][m])


def make_batches(encoded, batch, rng):
    """Fixed-order batches of similar lengths (less padding); order drawn from `rng`."""
    order = rng.permutation(len(encoded))
    span = 16 * batch
    chunks = [sorted(order[i:i + span], key=lambda k: len(encoded[k][0])) for i in range(0, len(order), span)]
    batches = [c[i:i + batch] for c in chunks for i in range(0, len(c), batch)]
    return [batches[i] for i in rng.permutation(len(batches))]


def pad_batch(encoded, rows, P, pad_id):
    import torch
    T = max(len(encoded[k][0]) for k in rows) - P
    ids = torch.full((len(rows), T), pad_id)
    mask, attn = torch.zeros(len(rows), T, dtype=torch.long), torch.zeros(len(rows), T, dtype=torch.long)
    for r, k in enumerate(rows):
        seq, m = encoded[k][0][P:], encoded[k][1][P:]
        ids[r, :len(seq)], mask[r, :len(seq)], attn[r, :len(seq)] = torch.tensor(seq), torch.tensor(m), 1
    return ids, mask, attn


def train_bc(model, encoded, table, scale, seed):
    """Behaviour cloning with AdamW (warmup + cosine), deterministic from the seed; returns the loss curve.

    Name embeddings are set from draw_names and frozen; every other step they are redrawn for that step only, so the
    policy must learn to copy names from the context rather than to memorise them: this is what makes it read the
    held-out test people, whose tokens it never sees in training (without it: name-token loss 0.13 on train
    episodes, 3.4 on test ones). The steps with the saved embeddings still let it memorise confusable people.
    """
    import math
    import torch
    from tqdm import tqdm
    s, gen = SCALES[scale], torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    emb = model.get_input_embeddings().weight
    rows, h = torch.cat(table[:2]), emb.shape[1]
    with torch.no_grad():
        emb[rows] = torch.cat(draw_names(table, h, gen))
    emb.register_hook(lambda g: g.index_fill(0, rows, 0.0))  # frozen: a name's vector is its identity
    P = common_prefix([e[0] for e in encoded])
    assert not any(any(e[1][:P]) for e in encoded), "the shared prefix must be prompt only (mask 0)"
    prefix = torch.tensor(encoded[0][0][:P])
    batches = make_batches(encoded, s["bc_batch"], make_rng(seed, 2))
    steps = min(s["bc_steps"], len(batches))
    opt = torch.optim.AdamW(model.parameters(), lr=s["lr"], betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1, (i + 1) / warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, i / steps)))))
    losses, bar = [], tqdm(batches[:steps], desc="behaviour cloning", leave=False)
    model.train()
    for i, batch in enumerate(bar):
        w = emb.index_put((rows,), torch.cat(draw_names(table, h, gen))) if i % 2 else emb
        loss = bc_loss(model, prefix, *pad_batch(encoded, batch, P, model.config.pad_token_id), w)
        assert torch.isfinite(loss), f"BC loss is not finite at step {i}"
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(), sched.step(), opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return losses


def first_decisions(q, world, turns):
    """Classify the policy's decisions like the script's: [(DEMO_PROBS row, choice)] from [(action, content)]."""
    meta, gold = q["metadata"], q["golden_answers"]
    subj, person = meta["subject"], world["people"].get(meta["subject"])
    row = ("first_confusable" if person["confusable"] else "first") if person else "first_place"
    (a, c), nxt = turns[0], turns[1] if len(turns) > 1 else (None, "")
    pick = ("guess" if a == "answer" else "search_right" if c == subj else
            "search_lookalike" if person and a == "search" and c == person["lookalike"] else "other")
    out = [(row, pick)]
    if pick == "search_lookalike":
        out.append(("after_lookalike", "notice" if nxt == ("search", subj) else "trust" if nxt[0] else "other"))
    elif pick == "search_right" and meta["bridge"]:
        out.append(("hop", "search_bridge" if nxt == ("search", meta["bridge"]) else
                    "answer_bridge" if nxt == ("answer", meta["bridge"]) else "other"))
    elif pick == "search_right":
        out.append(("read", "doc1" if nxt[0] == "answer" and exact_match(nxt[1], gold) else "other_doc" if nxt[0] ==
                    "answer" else "search_again" if nxt == ("search", subj) else "other"))
    return out


def evaluate_policy(model, tok, retr, questions, world, group, seed, max_new):
    """Warm-start EM through rollout.run_episodes (the training code path): greedy (T = 0, one line per question, as
    the evaluation) and sampled (T = 1, `group` lines, as GRPO), and the sampled policy's decision frequencies."""
    from rollout import Protocol, run_episodes, start_episodes
    # scripted turns are < 40 tokens: a turn still open after `max_new` has failed; the cap bounds a weak policy's time
    greedy = run_episodes(model, tok, retr, start_episodes(tok, questions, seed, 0, 1),
                          Protocol(temperature=0.0, max_new_tokens=max_new))
    sampled = run_episodes(model, tok, retr, start_episodes(tok, questions, seed, 1, group),
                           Protocol(temperature=1.0, max_new_tokens=max_new))
    g = np.array([e.reward for e in greedy])
    s = np.array([e.reward for e in sampled]).reshape(len(questions), group)
    two = np.array([q["data_source"] == "tiny_2hop" for q in questions])
    logs = [first_decisions(q, world, [(t.action, t.content) for t in e.turns])
            for q, e in zip([q for q in questions for _ in range(group)], sampled)]
    def mean(x):
        return float(x.mean()) if x.size else None
    return {"questions": len(questions), "group": group, "greedy_em": mean(g), "greedy_em_1hop": mean(g[~two]),
            "greedy_em_2hop": mean(g[two]), "sampled_em": mean(s), "sampled_em_1hop": mean(s[~two]),
            "sampled_em_2hop": mean(s[two]), "mixed_groups": mean((s.min(1) == 0) & (s.max(1) == 1)),
            "turns_mean": np.mean([len(e.turns) for e in sampled]), "decisions": _decision_freqs(logs)}


def make_demos(world, questions, top, n, seed):
    """n scripted (imperfect) episodes over the train questions, in a fixed shuffled order, cycling."""
    rng, demos = make_rng(seed, 3), []
    while len(demos) < n:
        for k in rng.permutation(len(questions))[: n - len(demos)]:
            demos.append((questions[k], *scripted_episode(questions[k], world, top, rng)))
    return demos


def scripted_em(world, questions, top, seed, perfect):
    rng = make_rng(seed, 4)
    return float(np.mean([reward(episode_response(scripted_episode(q, world, top, rng, perfect)[0]),
                                 q["golden_answers"]) for q in questions]))


def build_tinyworld(out, seed=0, scale="full", force=False, threads=1):
    """Build the tiny world into `out` atomically (temp dir, world.json last, rename); returns the stats."""
    import torch
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; choose one of {sorted(SCALES)}")
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise FileExistsError(f"{out} exists and is not empty; pass --force to overwrite it")
    # One thread: with two, some CPU kernel reduces in a varying order and the BC weights differ from run to run
    # (max |diff| 0.017 between two builds); with one, the build is bit for bit repeatable (tested).
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tinyworld-", dir=parent)
    try:
        stats = _build(tmp, seed, scale, out)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(threads_before)
    return stats


def _build(tmp, seed, scale, out):
    import torch
    sc, t0, times = SCALES[scale], time.time(), {}
    world, retr, top, check = fix_retrieval(make_world(seed, scale), tmp, seed)
    split = {s: question_rows(world, s) for s in ("train", "test")}
    for s, rows in split.items():
        write_jsonl(os.path.join(tmp, f"{s}.jsonl"), rows)
    times["corpus_index_s"], t = time.time() - t0, time.time()
    tok = build_tokenizer(world, split["train"] + split["test"])
    demos = make_demos(world, split["train"], top, sc["bc_steps"] * sc["bc_batch"], seed)
    cache = {}
    encoded = [encode_episode(tok, q["question"], turns, cache) for q, turns, _ in demos]
    times["tokenizer_demos_s"], t = time.time() - t, time.time()
    torch.manual_seed(seed)
    model = make_policy(tok, scale)
    losses = train_bc(model, encoded, name_table(tok, world), scale, seed)
    model.save_pretrained(os.path.join(tmp, "policy"))
    tok.save_pretrained(os.path.join(tmp, "policy"))
    times["bc_s"], t = time.time() - t, time.time()
    rng = make_rng(seed, 5)
    warm = {s: evaluate_policy(model, tok, retr, [rows[k] for k in sorted(rng.permutation(len(rows))[
        :sc["eval_questions"]])], world, sc["eval_group"], seed, sc["eval_max_new"]) for s, rows in split.items()}
    times["eval_s"] = time.time() - t
    stats = {"seed": seed, "scale": scale, "corpus_docs": len(corpus_rows(world)),
             "entities": {k: len(world[k]) for k in ("countries", "cities", "companies", "people")},
             "confusable_people": sum(p["confusable"] for p in world["people"].values()),
             "questions": {s: _count(rows) for s, rows in split.items()}, "demo_probs": DEMO_PROBS,
             "retrieval_check": check, "scripted_em": {s: {"perfect": scripted_em(world, rows, top, seed, True),
                                                           "imperfect": scripted_em(world, rows, top, seed, False)}
                                                       for s, rows in split.items()},
             "demo_decisions": _decision_freqs(log for _, _, log in demos), "warm_start": warm,
             "bc": {"steps": len(losses), "batch": sc["bc_batch"], "episodes": len(encoded), "lr": sc["lr"],
                    "params": sum(p.numel() for p in model.parameters()), "vocab": len(tok),
                    "loss_first10": float(np.mean(losses[:10])), "loss_last10": float(np.mean(losses[-10:])),
                    "losses": [round(x, 4) for x in losses]}, "times": times}
    # The index records its corpus by absolute path: point it at the final folder (the fingerprint is unchanged).
    meta_path = os.path.join(tmp, "index", "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    meta["corpus"] = os.path.join(os.path.abspath(out), "corpus.jsonl")
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=2)
    times["total_s"] = time.time() - t0
    with open(os.path.join(tmp, "world.json"), "w") as f:  # last: its presence means the world is complete
        json.dump({"stats": stats, "world": world}, f, indent=1, default=float)
    return stats


def _count(rows):
    out = {}
    for r in rows:
        key = f'{r["data_source"]}/{r["metadata"]["type"]}'
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()), total=len(rows))


def _decision_freqs(logs):
    counts = {}
    for log in logs:
        for row, pick in log:
            counts.setdefault(row, {}).setdefault(pick, 0)
            counts[row][pick] += 1
    return {row: {k: round(v / sum(c.values()), 3) for k, v in sorted(c.items())} for row, c in counts.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output folder (must not exist or be empty, unless --force)")
    parser.add_argument("--seed", type=int, default=0, help="world, demonstrations and BC seed")
    parser.add_argument("--scale", choices=sorted(SCALES), default="full", help="full world, or a small one for tests")
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: bit-for-bit repeatable BC)")
    args = parser.parse_args(argv)
    stats = build_tinyworld(args.out, args.seed, args.scale, args.force, args.threads)
    stats["bc"].pop("losses")
    print(json.dumps(stats, indent=1, default=float))


if __name__ == "__main__":
    main()
