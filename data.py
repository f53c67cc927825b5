"""Data for TWICE: the built-in tiny world (DESIGN.md section 9); the real datasets (section 10) go here too.

Tiny world (`tinyworld`): a laptop-sized stand-in for Search-R1's NQ/HotpotQA + wiki-18 + Qwen2.5, in exactly
the formats of the real pipeline, so that `train_twice.py` runs through the same code paths on a CPU in minutes.
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

Deviations:
1. Tokenizer: word-level instead of Qwen2.5's BPE, so that a ~1M-parameter model can copy names; the chat
   template is ChatML without Qwen's default system message (fewer prompt tokens).
2. The behaviour-cloning forward pass computes the shared prompt prefix (chat header + instruction) once per
   batch and expands its KV cache; this is exact (tested against the plain forward pass) and ~2x faster.

Real datasets (`searchr1`, DESIGN.md section 10; `make reproduce-3b` runs it): Search-R1's NQ + HotpotQA training
set, the seven FlashRAG test sets, wiki-18 and its prebuilt E5 flat index from the Hugging Face hub, resumable and
checksummed, converted to the QA schema above; see the section's docstring. DEVIATION: training-time evaluation uses
val.jsonl (100 questions per test set); final policies are scored on every question by eval.py.

Launch:
  python data.py searchr1 --out data/searchr1                         # ~80 GB download (corpus + index)
  python data.py tinyworld --out data/tinyworld --seed 0              # full world, a few minutes on 2 CPU cores
  python data.py tinyworld --out /tmp/tw --seed 0 --scale test --force  # small world for the test suite
"""
import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np

from eval import exact_match, reward
from rollout import INSTRUCTION, INVALID_ACTION_MSG, information_block, parse_action, render_prompt, user_message

# ------------------------------------------------------------------------------------------------------------------
# Tiny world
# ------------------------------------------------------------------------------------------------------------------

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


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


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
    is one token; tags are added non-special tokens (decode as text), ChatML specials as in Qwen2.5 (DEVIATION 1)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
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

    `prefix` (P,) is shared by every row: its KV is computed once and expanded (exact, DEVIATION 2); ids, mask and
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


# ------------------------------------------------------------------------------------------------------------------
# Real datasets (DESIGN.md section 10): `python data.py searchr1 ...`
# ------------------------------------------------------------------------------------------------------------------
# >>> searchr1 section (begin)
# `python data.py searchr1 --out data/searchr1` writes, resumably (a rerun skips every finished file):
#   train.jsonl            Search-R1's merged NQ + HotpotQA training split, in our QA schema
#   test/{name}.jsonl      the seven test sets (FlashRAG's test split, else dev, as Search-R1's test merge)
#   val.jsonl              VAL_PER_SOURCE questions of each test set: the periodic evaluation during training
#   wiki-18.jsonl          the corpus; e5_Flat.index the prebuilt E5 flat index (joined from its parts);
#   index/                 retriever.py's folder for it (describe_prebuilt), or one encoded here (--index build)
#   manifest.json          sources (repo, commit, checksum), outputs and row counts; written last = "done"
#   raw/                   the downloads; the big ones (corpus .gz, index parts) are deleted once converted
# Sources, checked against Search-R1 (github PeterGriffinJin/Search-R1: scripts/download.py, README "cat part_*",
# scripts/nq_hotpotqa/README.md, scripts/data_process/qa_search_{train,test}_merge.py) and FlashRAG's dataset card.
SR1_TRAIN = ("PeterJinGo/nq_hotpotqa_train", "train.parquet")  # hub dataset repo, file
FLASHRAG = "RUC-NLPIR/FlashRAG_datasets"  # {dataset}/{split}.jsonl rows: id, question, golden_answers, metadata
SR1_TESTS = {"nq": "test", "triviaqa": "test", "popqa": "test", "hotpotqa": "dev", "2wikimultihopqa": "dev",
             "musique": "dev", "bamboogle": "test"}
SR1_CORPUS = ("PeterJinGo/wiki-18-corpus", "wiki-18.jsonl.gz")  # DPR's 2018 Wikipedia, 100-word passages
SR1_INDEX = ("PeterJinGo/wiki-18-e5-index", ("part_aa", "part_ab"))  # e5_Flat.index = cat part_aa part_ab
SR1_ROWS = {"train": 169_615, "nq": 3_610, "triviaqa": 11_313, "popqa": 14_267, "hotpotqa": 7_405,  # FlashRAG card
            "2wikimultihopqa": 12_576, "musique": 2_417, "bamboogle": 125, "corpus": 21_015_324}  # DPR psgs_w100
CORPUS_GZ_RATIO = 3.5  # disk estimate of wiki-18.jsonl from its .gz size (English text gzips ~3x; rounded up)
VAL_PER_SOURCE = 100   # questions per test set in val.jsonl
RETRY_WAIT = 5.0       # seconds before the first automatic resume of a broken download (then 2x, 3x, ...)
GiB = 1 << 30


def hub_info(repo_id: str, filenames: list, revision: str = "main", endpoint=None) -> tuple:
    """(commit, {filename: {"size", "sha256" (LFS files, else None), "git_sha1"}}) of files of a hub dataset repo.
    The commit pins the downloads, so that files and checksums come from the same revision."""
    from huggingface_hub import HfApi
    api = HfApi(endpoint=endpoint)
    commit = api.dataset_info(repo_id, revision=revision).sha or revision
    found = {e.path: e for e in api.get_paths_info(repo_id, list(filenames), repo_type="dataset", revision=commit)}
    missing = [f for f in filenames if not hasattr(found.get(f), "blob_id")]
    if missing:
        raise FileNotFoundError(f"hub dataset {repo_id}@{revision} has no file(s) {missing}")
    return commit, {f: {"size": found[f].lfs.size if found[f].lfs else found[f].size,
                        "sha256": found[f].lfs.sha256 if found[f].lfs else None,
                        "git_sha1": None if found[f].lfs else found[f].blob_id} for f in filenames}


def hub_fetch(repo_id: str, filename: str, dest: str, revision: str = "main", endpoint=None):
    """Download a file of a hub dataset repo to `dest`; a partial `dest` is continued with an HTTP Range request."""
    import requests
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers
    from tqdm import tqdm
    url = hf_hub_url(repo_id, filename, repo_type="dataset", revision=revision, endpoint=endpoint)
    have = os.path.getsize(dest) if os.path.exists(dest) else 0
    headers = build_hf_headers()
    if have:
        headers["Range"] = f"bytes={have}-"
    with requests.get(url, headers=headers, stream=True, timeout=60) as r:
        if r.status_code == 416:  # nothing after `have`: the partial file is already whole
            return
        r.raise_for_status()
        if have and r.status_code != 206:  # the server ignored the range and sends everything: start over
            have = 0
        total = have + int(r.headers.get("Content-Length", 0))
        with open(dest, "ab" if have else "wb") as f, tqdm(total=total, initial=have, unit="B", unit_scale=True,
                                                           desc=f"{repo_id}/{filename}") as bar:
            for chunk in r.iter_content(1 << 20):
                f.write(chunk)
                bar.update(len(chunk))


def file_digest(path: str, kind: str) -> str:
    """Streamed "sha256" of a file, or its "git_sha1" (git blob id: sha1 of b"blob {size}\\0" + bytes)."""
    import hashlib
    from tqdm import tqdm
    size = os.path.getsize(path)
    h = hashlib.sha256() if kind == "sha256" else hashlib.sha1(b"blob %d\0" % size)
    with open(path, "rb") as f, tqdm(total=size, unit="B", unit_scale=True, desc=f"check {os.path.basename(path)}",
                                     disable=size < GiB) as bar:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
            bar.update(len(block))
    return h.hexdigest()


def fetch_verified(fetch, src: dict, retries: int = 3):
    """src["repo"]/src["file"]@src["commit"] -> src["path"] through src["path"].partial (resumed if present), checked
    against the hub's size and checksum (src) before the rename: a file under its final name is whole and verified.
    A broken transfer is resumed up to `retries` times (after RETRY_WAIT x attempt seconds) before giving up."""
    partial, where, meta = src["path"] + ".partial", f"{src['repo']}/{src['file']}", src
    os.makedirs(os.path.dirname(partial), exist_ok=True)
    for attempt in range(retries + 1):
        try:
            fetch(src["repo"], src["file"], partial, src["commit"])
            size = os.path.getsize(partial) if os.path.exists(partial) else 0
            if size < meta["size"]:  # the stream ended early without an error: resume like a broken one
                raise IOError(f"the transfer stopped at byte {size} of {meta['size']}")
            break
        except Exception as e:
            if attempt == retries:
                raise IOError(f"{where}: download interrupted ({type(e).__name__}: {e}); {partial} is kept, rerun "
                              "to resume") from e
            print(f"{where}: {type(e).__name__}: {e}; resuming (retry {attempt + 1}/{retries})", flush=True)
            time.sleep(RETRY_WAIT * (attempt + 1))
    if size > meta["size"]:
        os.remove(partial)
        raise IOError(f"{where}: downloaded {size} bytes to {partial}, the hub says {meta['size']}; the download "
                      "was deleted, rerun to fetch it again")
    kind = "sha256" if meta.get("sha256") else "git_sha1"
    got = file_digest(partial, kind)
    if got != meta[kind]:
        os.remove(partial)
        raise ValueError(f"{where}: {kind} checksum mismatch in {partial} (got {got}, the hub says {meta[kind]}); "
                         "the corrupt download was deleted, rerun to fetch it again")
    os.replace(partial, src["path"])


def _as_list(gold) -> list:
    gold = gold.tolist() if hasattr(gold, "tolist") else gold  # parquet list columns arrive as numpy arrays
    return [gold] if isinstance(gold, str) else list(gold)


def _write_qa(rows: list, dest: str, src: str) -> int:
    """Write QA rows atomically, once ids are unique and eval.load_qa (what training reads) accepts the file."""
    import eval as qa_eval
    seen = set()
    for i, r in enumerate(rows):
        if r["id"] in seen:
            raise ValueError(f"{src}: row {i}: duplicate id {r['id']!r}")
        seen.add(r["id"])
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    write_jsonl(dest + ".partial", rows)
    try:
        qa_eval.load_qa(dest + ".partial")
    except ValueError as e:
        raise ValueError(f"{src}: converted rows are not valid QA rows: {e}") from None
    os.replace(dest + ".partial", dest)
    return len(rows)


def convert_train(src: str, dest: str) -> int:
    """Search-R1's merged train.parquet -> QA jsonl. FlashRAG numbers each dataset's rows from train_0, so NQ and
    HotpotQA ids collide and the id gets its data source as prefix (the rollout keys prompts by id)."""
    import pandas as pd
    df = pd.read_parquet(src)
    missing = [c for c in ("question", "data_source") if c not in df.columns]
    if missing or not {"golden_answers", "reward_model"} & set(df.columns):
        raise ValueError(f"{src}: missing column(s) {missing or ['golden_answers']}; columns: {list(df.columns)}")
    rows = []
    for i, r in enumerate(df.to_dict("records")):
        gold = r.get("golden_answers")
        gold = r["reward_model"]["ground_truth"]["target"] if gold is None else gold
        rid = r.get("id") if r.get("id") is not None else r["extra_info"]["index"]
        rows.append({"id": f"{r['data_source']}_{rid}", "question": r["question"], "golden_answers": _as_list(gold),
                     "data_source": str(r["data_source"])})
    return _write_qa(rows, dest, src)


def convert_flashrag(src: str, name: str, dest: str) -> int:
    """A FlashRAG {split}.jsonl (id, question, golden_answers, metadata) -> QA jsonl with data_source = name."""
    from eval import read_jsonl
    rows = []
    for lineno, r in read_jsonl(src):
        missing = [k for k in ("id", "question", "golden_answers") if k not in r]
        if missing:
            raise ValueError(f"{src}:{lineno}: missing field(s) {missing}")
        rows.append({"id": f"{name}_{r['id']}", "question": r["question"],
                     "golden_answers": _as_list(r["golden_answers"]), "data_source": name})
    return _write_qa(rows, dest, src)


def write_val(test_files: dict, dest: str, per_source: int, seed: int = 0) -> int:
    """A fixed random sample of `per_source` questions of each test set (in file order), for periodic evaluation.
    # DEVIATION: Search-R1 validates on all 51,713 test questions every test_freq steps; with HF generate that would
    cost hours per evaluation, so training curves use this sample and only the final policy is scored on everything."""
    import eval as qa_eval
    rows = []
    for k, (name, path) in enumerate(sorted(test_files.items())):
        qa = qa_eval.load_qa(path)
        keep = np.sort(np.random.default_rng([seed, k]).permutation(len(qa))[:per_source])
        rows += [qa[i] for i in keep]
    return _write_qa(rows, dest, "val sample of " + ", ".join(sorted(test_files)))


def gunzip_corpus(src: str, dest: str):
    """Decompress the corpus to dest through dest.partial (progress in compressed bytes)."""
    import gzip
    from tqdm import tqdm
    with open(src, "rb") as raw, gzip.GzipFile(fileobj=raw) as fin, open(dest + ".partial", "wb") as fout, \
            tqdm(total=os.path.getsize(src), unit="B", unit_scale=True, desc=f"gunzip {src}") as bar:
        for block in iter(lambda: fin.read(1 << 24), b""):
            fout.write(block)
            bar.update(raw.tell() - bar.n)
    os.replace(dest + ".partial", dest)


def join_parts(parts: list, sizes: dict, dest: str, delete: bool = True):
    """`cat parts > dest`, resumable, peak disk = the index + one part. Each part is deleted once appended (delete),
    so after an interruption dest.partial holds exactly the parts that are gone: it is cut back to their total size
    (`sizes`, from the hub) and the remaining parts are appended again."""
    from tqdm import tqdm
    partial = dest + ".partial"
    gone = [p for p in parts if not os.path.exists(p)]
    if gone and (not os.path.exists(partial) or gone != parts[:len(gone)]):
        raise FileNotFoundError(f"cannot join {dest}: part(s) {gone} are missing and were not appended to {partial}; "
                                f"delete {partial} (if any) and rerun to download them again")
    offset = sum(sizes[p] for p in gone)
    if gone and os.path.getsize(partial) < offset:
        raise IOError(f"{partial} is shorter than the parts already appended to it; delete it and rerun")
    with open(partial, "ab") as f, tqdm(total=sum(sizes.values()), initial=offset, unit="B", unit_scale=True,
                                        desc=f"join {dest}") as bar:
        f.truncate(offset)
        for p in parts[len(gone):]:
            with open(p, "rb") as src:
                for block in iter(lambda: src.read(1 << 24), b""):
                    f.write(block)
                    bar.update(len(block))
            f.flush()
            os.fsync(f.fileno())
            if delete:
                os.remove(p)
    check_flat_index(partial)
    os.replace(partial, dest)


def check_flat_index(path: str):
    """The joined file must be a FAISS IndexFlatIP whose header's ntotal x dim float32 vectors fill the file."""
    import retriever
    try:
        index = retriever.read_flat_index(path, mmap=True)
    except RuntimeError as e:
        raise ValueError(f"{path}: not a readable FAISS index ({str(e).splitlines()[0]}); a part is missing or "
                         "corrupt: delete it and rerun") from None
    need, size = index.ntotal * index.d * 4, os.path.getsize(path)
    if not need <= size <= need + 4096:  # + the header
        raise ValueError(f"{path}: {size} bytes, but its header says {index.ntotal} vectors of dim {index.d} "
                         f"({need} bytes of vectors): a part is missing or corrupt; delete it and rerun")


def check_disk(out: str, need: dict, disk_free=None):
    """Fail before downloading when the folder's disk cannot take `need` ({what: bytes}) plus a 1 GiB margin."""
    free = (disk_free or (lambda p: shutil.disk_usage(p).free))(out)
    total = sum(need.values()) + GiB
    if free < total:
        parts = ", ".join(f"{k} {v / GiB:.1f}" for k, v in need.items() if v)
        raise OSError(f"not enough free disk space in {os.path.abspath(out)}: about {total / GiB:.1f} GiB needed "
                      f"({parts}, +1 GiB margin), {free / GiB:.1f} GiB free. Free some space or choose another --out")


def searchr1_sources(out: str, index: str) -> list:
    """Every file to download: {name, repo, file, path (under out/raw)}; the index parts only for a prebuilt index."""
    src = [("train", *SR1_TRAIN)] + [(n, FLASHRAG, f"{n}/{split}.jsonl") for n, split in SR1_TESTS.items()]
    src += [("corpus", *SR1_CORPUS)]
    src += [("index", SR1_INDEX[0], part) for part in SR1_INDEX[1]] if index == "prebuilt" else []
    return [{"name": n, "repo": r, "file": f, "path": os.path.join(out, "raw", r.replace("/", "__"), f)}
            for n, r, f in src]


def count_lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(block.count(b"\n") for block in iter(lambda: f.read(1 << 24), b""))


def prepare_searchr1(out: str, index: str = "prebuilt", encoder: str = "e5", revision: str = "main", fetch=None,
                     info=None, expected_rows=SR1_ROWS, keep_downloads: bool = False, disk_free=None,
                     val_per_source: int = VAL_PER_SOURCE, retries: int = 3) -> dict:
    """Download, check and convert Search-R1's data into `out` (layout at the top of this section); resumable.

    index: "prebuilt" (Search-R1's E5 flat index, joined from its parts), "build" (encode the corpus here with
    `encoder`, retriever.build_index) or "none". fetch(repo, file, dest, revision) and info(repo, files, revision)
    -> (commit, {file: {size, sha256, git_sha1}}) default to the hub (hub_fetch, hub_info); tests pass stand-ins.
    expected_rows: {output: rows} to check (None: no check); retries: automatic resumes of a broken download.
    Returns the manifest."""
    import retriever
    if index not in ("prebuilt", "build", "none"):
        raise ValueError(f"index must be prebuilt, build or none, got {index!r}")
    fetch, info = fetch or hub_fetch, info or hub_info
    manifest_path = os.path.join(out, "manifest.json")
    if os.path.exists(manifest_path):
        print(f"{manifest_path} exists: nothing to do (delete it to check and redo the missing steps)")
        with open(manifest_path) as f:
            return json.load(f)
    os.makedirs(out, exist_ok=True)
    corpus, index_file, index_dir = (os.path.join(out, x) for x in ("wiki-18.jsonl", "e5_Flat.index", "index"))
    made = {"train": os.path.join(out, "train.jsonl"), "corpus": corpus, "index": index_file,
            **{n: os.path.join(out, "test", f"{n}.jsonl") for n in SR1_TESTS}}
    sources = searchr1_sources(out, index)
    commits, meta = {}, {}
    for repo in dict.fromkeys(s["repo"] for s in sources):
        commits[repo], files = info(repo, [s["file"] for s in sources if s["repo"] == repo], revision)
        meta.update({(repo, f): m for f, m in files.items()})
    for s in sources:
        s.update(commit=commits[s["repo"]], **meta[(s["repo"], s["file"])])

    # 1. downloads: skipped when the file, or what was made of it, exists (parts being joined count as made)
    joining = os.path.exists(index_file + ".partial")
    todo = [s for s in sources if not (os.path.exists(s["path"]) or os.path.exists(made[s["name"]])
                                       or (s["name"] == "index" and joining))]
    by = {s["name"]: s for s in sources if s["name"] != "index"}
    gz, parts = by["corpus"], [s for s in sources if s["name"] == "index"]
    have = [os.path.getsize(s["path"] + ".partial") if os.path.exists(s["path"] + ".partial") else 0 for s in todo]
    need = {"downloads": sum(s["size"] for s in todo) - sum(have),
            "wiki-18.jsonl": 0 if os.path.exists(corpus) else int(CORPUS_GZ_RATIO * gz["size"]),
            "index join": 0 if not parts or os.path.exists(index_file) else  # the part being appended + its copy
            (sum if keep_downloads else max)(p["size"] for p in parts)}
    check_disk(out, need, disk_free)
    for k, s in enumerate(todo, 1):
        print(f"[{k}/{len(todo)}] {s['repo']}/{s['file']} ({s['size'] / GiB:.2f} GiB)", flush=True)
        fetch_verified(fetch, s, retries)

    # 2. conversions, each written under a temporary name and renamed: an existing output is a finished one
    if not os.path.exists(made["train"]):
        convert_train(by["train"]["path"], made["train"])
    for name in SR1_TESTS:
        if not os.path.exists(made[name]):
            convert_flashrag(by[name]["path"], name, made[name])
    val = os.path.join(out, "val.jsonl")
    if not os.path.exists(val):
        write_val({n: made[n] for n in SR1_TESTS}, val, val_per_source)
    if not os.path.exists(corpus):
        gunzip_corpus(gz["path"], corpus)
        if not keep_downloads:
            os.remove(gz["path"])
    has_index = os.path.exists(os.path.join(index_dir, retriever.META_FILE))
    if index == "prebuilt" and not os.path.exists(index_file):
        join_parts([p["path"] for p in parts], {p["path"]: p["size"] for p in parts}, index_file, not keep_downloads)
    if index == "prebuilt" and not has_index:
        retriever.describe_prebuilt(index_file, corpus, encoder, out_dir=index_dir)
    if index == "build" and not has_index:  # float32 vectors in RAM and on disk; 768 = E5-base's width
        check_disk(out, {"index build (768-dim vectors)": count_lines(corpus) * 768 * 4}, disk_free)
        retriever.build_index(corpus, encoder, index_dir)

    # 3. row counts against Search-R1's, then the manifest (last: its existence means "done")
    rows = {name: count_lines(path) for name, path in made.items() if name != "index"}
    rows["val"] = count_lines(val)
    bad = {k: f"{rows.get(k)} != {v}" for k, v in (expected_rows or {}).items() if rows.get(k) != v}
    if bad:
        raise ValueError(f"row counts differ from Search-R1's data: {bad}; a changed hub revision? Pass "
                         "--skip_row_check to accept them")
    manifest = {"created": time.strftime("%Y-%m-%dT%H:%M:%S"), "revision": revision, "index": index,
                "encoder": encoder, "rows": rows,
                "sources": [{k: s[k] for k in ("name", "repo", "file", "commit", "size", "sha256", "git_sha1")}
                            for s in sources],
                "outputs": {"train": "train.jsonl", "test": {n: f"test/{n}.jsonl" for n in SR1_TESTS},
                            "val": "val.jsonl", "corpus": "wiki-18.jsonl",
                            "index_file": "e5_Flat.index" if index == "prebuilt" else None,
                            "index_dir": "index" if index != "none" else None}}
    with open(manifest_path + ".partial", "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(manifest_path + ".partial", manifest_path)
    return manifest
# <<< searchr1 section (end)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    # >>> searchr1 subparser (begin)
    sr = sub.add_parser("searchr1", help="download and convert Search-R1's QA sets, wiki-18 and its E5 index "
                                         "(DESIGN.md section 10); resumable")
    sr.add_argument("--out", default="data/searchr1", help="output folder (a rerun resumes it)")
    sr.add_argument("--index", choices=("prebuilt", "build", "none"), default="prebuilt",
                    help="prebuilt: Search-R1's E5 flat index (~65 GB download); build: encode wiki-18 here "
                         "(retriever.py build, one GPU, hours); none: corpus and QA only")
    sr.add_argument("--encoder", default="e5", help="encoder of the index (e5 = intfloat/e5-base-v2)")
    sr.add_argument("--revision", default="main", help="hub revision of every source repo (recorded as a commit)")
    sr.add_argument("--keep_downloads", action="store_true", help="keep wiki-18.jsonl.gz and the index parts")
    sr.add_argument("--skip_row_check", action="store_true", help="accept row counts that differ from Search-R1's")
    sr.add_argument("--val_per_source", type=int, default=VAL_PER_SOURCE, help="questions per test set in val.jsonl")
    # <<< searchr1 subparser (end)
    tw = sub.add_parser("tinyworld", help="build the built-in tiny world (DESIGN.md section 9)")
    tw.add_argument("--out", required=True, help="output folder (must not exist or be empty, unless --force)")
    tw.add_argument("--seed", type=int, default=0, help="world, demonstrations and BC seed")
    tw.add_argument("--scale", choices=sorted(SCALES), default="full", help="full world, or a small one for tests")
    tw.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    tw.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: bit-for-bit repeatable BC)")
    args = parser.parse_args(argv)
    if args.command == "tinyworld":
        stats = build_tinyworld(args.out, args.seed, args.scale, args.force, args.threads)
        stats["bc"].pop("losses")
        print(json.dumps(stats, indent=1, default=float))
    # >>> searchr1 dispatch (begin)
    if args.command == "searchr1":
        manifest = prepare_searchr1(args.out, args.index, args.encoder, args.revision,
                                    expected_rows=None if args.skip_row_check else SR1_ROWS,
                                    keep_downloads=args.keep_downloads, val_per_source=args.val_per_source)
        print(json.dumps({"out": args.out, "rows": manifest["rows"], "outputs": manifest["outputs"]}, indent=1))
    # <<< searchr1 dispatch (end)


if __name__ == "__main__":
    main()
