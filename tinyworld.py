"""The built-in worlds (DESIGN.md section 9): the tiny world (the demo's) and the chains world (issue 11).

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

The chains world (`--preset chains`; same generator, formats and code paths) is where decisions come early and
their outcome late: worker -works-> company -founded-> founder -born-> city -in-> country; an H-hop question
(H = 1..4, 40% 4-hop) asks for the H-th link from a worker and needs exactly H searches. Cities, founders, companies
and workers come in look-alike pairs whose chains differ at every link; every document names a second entity of its
kind (the misread fact). Each scripted turn thinks in a <think> block of 1-3 information-free sentences plus what
was read and what is needed (~55 tokens). The scripts make a different plausible mistake at each hop (CHAIN_PROBS):
search the look-alike, misread the other entity's fact, answer a bridge early, stop one hop short (the majority at
the last bridge, so greedy decoding fails there). world.json's stats hold the measured warm-start figures and the
share of decisions with positive oracle advantage (Monte Carlo through rollout.continue_from) in failed episodes.

Deviations (README "Deviations"):
W1. Tokenizer: word-level instead of Qwen2.5's BPE, so that a ~1M-parameter model can copy names; the chat
   template is ChatML without Qwen's default system message (fewer prompt tokens).
W2. The behaviour-cloning forward pass computes the shared prompt prefix (chat header + instruction) once per
   batch and expands its KV cache; this is exact (tested against the plain forward pass) and ~2x faster.
W10. Chains: the paper's turns think in free text of hundreds of tokens; ours draw 1-3 of 12 fixed, information-free
   sentences (+ what was read and what is needed), so turns are long and of varying length but their reasoning is
   not real: only the action and the names copied into the think block carry a decision.
W11. Chains: the share of good decisions in failed episodes is estimated from a few Monte Carlo continuations
   (6 per side) per decision on a sample of 16 sampled test episodes, not the audit's 64 (build-time budget).
W12. Chains: the warm-start statistics are measured on the test split only (the split the trainer evaluates).

Launch:
  python tinyworld.py --out data/tinyworld --seed 0              # full world, a few minutes on 2 CPU cores
  python tinyworld.py --out /tmp/tw --seed 0 --scale test --force  # small world for the test suite
  python tinyworld.py --out data/chains --preset chains --seed 0   # the chains world, ~10 min on one thread
"""
import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np

from eval import write_jsonl
from protocol import (INSTRUCTION, INVALID_ACTION_MSG, exact_match, information_block, render_prompt, reward,
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
    return {"in": world["cities"], "based": world["companies"], "founded": world["companies"]}[rel].get(name)


def corpus_rows(world):
    """One document per entity, '"Title"\\ntext' as in wiki-18; its sentences are the FACT templates."""
    if world.get("preset") == "chains":
        return chains_corpus_rows(world)
    docs = [(c, f"{c} is a country.") for c in world["countries"]]
    docs += [(c, FACT["in"].format(c, n)) for c, n in world["cities"].items()]
    docs += [(k, FACT["based"].format(k, c)) for k, c in world["companies"].items()]
    docs += [(p, FACT["born"].format(p, a["born"]) + " " + FACT["works"].format(p, a["works"]))
             for p, a in world["people"].items()]
    return [{"id": str(i), "contents": f'"{title}"\n{text}'} for i, (title, text) in enumerate(docs)]


def question_rows(world, split):
    """QA rows of a split; `metadata` (type, subject, bridge, hops) is for the script and the audit."""
    if world.get("preset") == "chains":
        return chains_question_rows(world, split)
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


KIND_NAME = {"countries": "country", "cities": "city", "companies": "company", "people": "person"}


def lookalikes(world):
    """{name: its look-alike} (people only in the tiny world; every kind but countries in chains)."""
    if "lookalike" in world:
        return world["lookalike"]
    return {n: p["lookalike"] for n, p in world["people"].items()}


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
        rng, taken, mapping, partner = make_rng(seed, 1, rnd), set(n.lower() for n in names), {}, lookalikes(world)
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
    if world.get("preset") == "chains":
        texts += chains_texts(p)
    else:
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
    if world.get("preset") == "chains":
        return chains_episode(q, world, top, rng, perfect)
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


def make_policy(tok, sc):
    """A tiny Qwen2 of the scale `sc` (a SCALES row); tied embeddings: copying a name is an identity map."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    h = sc["hidden"]
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=h, intermediate_size=3 * h,
                      num_hidden_layers=sc["layers"], num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=4096, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, bos_token_id=None, initializer_range=sc["init"])
    return Qwen2ForCausalLM(cfg)


def name_table(tok, world):
    """Token rows of every entity name: (spaced rows, bare rows, kind index, row of its look-alike's spaced form)."""
    import torch
    names, kinds = entity_names(world), ("countries", "cities", "companies", "people")
    row = {n: tok.convert_tokens_to_ids(n) for n in names}
    spaced = {n: tok.convert_tokens_to_ids("\u0120" + n) for n in names}  # U+0120 "Ġ": ByteLevel's space
    look = lookalikes(world)
    return (torch.tensor([spaced[n] for n in names]), torch.tensor([row[n] for n in names]),
            torch.tensor([kinds.index(kind_of(world, n)) for n in names]),
            torch.tensor([names.index(look.get(n, n)) for n in names]))


def draw_names(table, h, gen, std=NAME_STD):
    """Embeddings (spaced (N, H), bare (N, H)) of all names, as a pretrained LM would have them (DEVIATION W3):
    a random identity in the first H - 8 dims and a type code in the last 8 (is a name, its kind, bare = the title
    form after a quote).
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


def bc_loss(model, prefix, ids, mask, attn, emb=None, token_weight=None):
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
    if token_weight is None:
        return torch.nn.functional.cross_entropy(logits.float(), ids[:, 1:][m])
    w = token_weight[ids[:, 1:][m]]  # (N,) weight of each target token
    return (torch.nn.functional.cross_entropy(logits.float(), ids[:, 1:][m], reduction="none") * w).sum() / w.sum()


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


def train_bc(model, encoded, table, s, seed, token_weight=None):
    """Behaviour cloning with AdamW (warmup + cosine), deterministic from the seed; returns the loss curve.

    Name embeddings are set from draw_names and frozen; every other step they are redrawn for that step only, so the
    policy must learn to copy names from the context rather than to memorise them: this is what makes it read the
    held-out test people, whose tokens it never sees in training (without it: name-token loss 0.13 on train
    episodes, 3.4 on test ones). The steps with the saved embeddings still let it memorise confusable people.
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
        loss = bc_loss(model, prefix, *pad_batch(encoded, batch, P, model.config.pad_token_id), w, token_weight)
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
    from protocol import Protocol
    from rollout import run_episodes, start_episodes
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


# ---------------------------------------------------------------------------------------------------------------
# The chains preset (DESIGN.md section 9, issue 11): where decisions come early and their outcome comes late.
# One chain of relations, worker -works-> company -founded-> founder -born-> city -in-> country; an H-hop question
# asks for the H-th link from a worker, so it needs exactly H searches (max_turns = 4 is just enough for 4 hops).

CHAIN_RELS = ("works", "founded", "born", "in")
# Scripted-demonstration probabilities of the chains world (saved in world.json). Each row is one decision.
CHAIN_PROBS = {
    # every search: the entity the chain needs / its look-alike (whose document points down a wrong chain)
    "search": {"right": 0.85, "lookalike": 0.15},
    # the first search for a "confusable" worker: the look-alike is the majority (greedy fails; RL can fix it)
    "search_confusable": {"right": 0.35, "lookalike": 0.65},
    # the look-alike's document came back: notice it and search the right name (one search spent) / trust it
    "after_lookalike": {"notice": 0.30, "trust": 0.70},
    # reading the searched entity's document: its own fact / the fact about the other entity it names (misread)
    "read": {"right": 0.88, "misread": 0.12},
    # a bridge entity was read and two or more hops remain: search it / answer it (answer a bridge early)
    "bridge": {"continue": 0.88, "answer_early": 0.12},
    # the last bridge was read (one hop remains): search it / answer it (stop one hop short; the majority, so
    # greedy decoding fails every question of 2 or more hops until RL fixes it). 0.65, not 0.55: at 0.55 the cloned
    # policy's stop probability came out on either side of 1/2 by position, and greedy passed some 3-4 hop questions
    "last_bridge": {"continue": 0.35, "stop_short": 0.65},
}
CHAIN_QTYPES = {  # type: (hops, goal, templates); 4-hop gets two templates, so 40% of the questions need 4 searches
    "employer": (1, "a company that a person works for", ("Which company does {} work for?",)),
    "founder": (2, "a founder of a company", ("Who founded the company that {} works for?",)),
    "founder_birthplace": (3, "a city where a founder was born", (
        "Where was the founder of the company that {} works for born?",)),
    "founder_country": (4, "a country of a city", (
        "In which country was the founder of the company that {} works for born?",
        "What is the home country of the founder of the employer of {}?")),
}
# Every think block opens by restating the goal, its kind and the kind one link before it ("a city where a founder
# was born"): whether the fact just read is the last bridge is then whether its kind word (CHAIN_FACT) occurs in the
# goal sentence a few tokens back. With the goal's kind alone ("a city"), BC had to learn a table of (goal, fact)
# pairs and did not: the 3-hop last-bridge decision came out "continue" (warm-start greedy EM 0.71 on 3 hops).
CHAIN_GOAL = "The question asks for {}."
# A think block ends with the decision: "Next I need ..." (search) or "So the answer is ..." (answer); "Next" and
# "So" occur nowhere else, so BC can weight the decision tokens (chains_token_weight).
CHAIN_NEED = {"works": "Next I need the company that {} works for.", "founded": "Next I need the founder of {}.",
              "born": "Next I need the city where {} was born.", "in": "Next I need the country of {}."}
# What a think block says it read: the value's kind is named, the word of the goal sentence (CHAIN_GOAL), so the
# stop decision compares two equal words (with the documents' wording the BC policy searched on after the answer).
CHAIN_FACT = {"works": "{} works for the company {}.", "founded": "{} has the founder {}.",
              "born": "{} was born in the city {}.", "in": "{} is in the country {}."}
CHAIN_DOC = {  # an entity's document names a second entity of its kind: reading the right fact is a decision
    "works": "{} works for {}. {} knows {}, who works for {}.",
    "founded": "{} was founded by {}. {} competes with {}, which was founded by {}.",
    "born": "{} was born in {}. {} met {}, who was born in {}.",
    "in": "{} is a city in {}. {} is near {}, a city in {}.",
}
CHAIN_NOTICE, CHAIN_ANSWER = "The document is about {}, not {}.", "So the answer is {}."
# DEVIATION W10: think-block sentences without information; each turn's <think> carries 1 to 3 of them, so turns
# are ~55 tokens of varying length and a twin's cost is comparable to a continuation's.
FILLERS = (
    "The question asks for one fact at the end of a chain of facts.",
    "I should follow the chain one link at a time and not skip a step.",
    "Names in this collection often look alike, so I must read them carefully.",
    "Each search returns three documents, and the first one is about the name I searched.",
    "A document can also mention other people, companies or places.",
    "I will only trust a fact that is stated about the right entity.",
    "It is better to check the next link than to guess the answer.",
    "Let me think about what I know so far and what is still missing.",
    "The answer must be a single name taken from a document.",
    "I have a limited number of searches, so every search should count.",
    "Let me reason step by step before I decide what to do next.",
    "The information I have now may not be enough to answer yet.",
)
CHAIN_SCALES = {  # entity counts (pairs of look-alikes); policy and BC; warm-start evaluation and oracle sample
    "full": dict(countries=10, city_pairs=20, founder_pairs=20, company_pairs=20, worker_pairs=60, test_pairs=12,
                 hidden=64, layers=2, init=0.1, bc_steps=1400, bc_batch=16, lr=3e-3, name_weight=10,
                 eval_questions=120, eval_group=5, eval_max_new=128, oracle_episodes=16, oracle_rollouts=6),
    "test": dict(countries=3, city_pairs=3, founder_pairs=3, company_pairs=3, worker_pairs=4, test_pairs=1,
                 hidden=32, layers=2, init=0.1, bc_steps=6, bc_batch=4, lr=3e-3, name_weight=5, eval_questions=3,
                 eval_group=2, eval_max_new=24, oracle_episodes=2, oracle_rollouts=2),
}
PRESET_SCALES = {"tiny": SCALES, "chains": CHAIN_SCALES}


def _pairs(rng, kind, n, taken):
    """n look-alike pairs of new names of `kind`: [(a, b)]."""
    out = []
    while len(out) < n:
        a = make_name(rng, kind, taken)
        b = lookalike_name(rng, a, taken)
        if b is not None:
            out.append((a, b))
    return out


def _pick_pair_values(rng, options, chain):
    """Two values from `options` whose chains (value and every later link) differ link by link: a look-alike's
    document then points down a chain that never rejoins the right one."""
    while True:
        u, v = (str(x) for x in rng.choice(options, 2, replace=False))
        if all(a != b for a, b in zip(chain(u), chain(v))):
            return u, v


def chain_of(world, name, rels):
    """[value of rels[0] for name, value of rels[1] for that, ...] (None past a missing link)."""
    out = []
    for rel in rels:
        name = relation(world, name, rel) if name is not None else None
        out.append(name)
    return out


def make_chains_world(seed, scale="full"):
    """Entity table of the chains world: look-alike pairs of cities, founders, companies and workers."""
    s, rng, taken = CHAIN_SCALES[scale], make_rng(seed, 0, 1), set(w.lower() for w in INSTRUCTION.split())
    world = {"preset": "chains", "seed": seed, "scale": scale, "countries": [], "cities": {}, "companies": {},
             "people": {}, "lookalike": {}, "neighbour": {}}
    world["countries"] = [make_name(rng, "country", taken) for _ in range(s["countries"])]
    for i, pair in enumerate(_pairs(rng, "city", s["city_pairs"], taken)):
        for j, c in enumerate(pair):  # a pair lies in two different countries
            world["cities"][c] = world["countries"][(2 * i + j) % len(world["countries"])]
    founders = _pairs(rng, "person", s["founder_pairs"], taken)
    for a, b in founders:
        x, y = _pick_pair_values(rng, list(world["cities"]), lambda v: chain_of(world, v, ("in",)) + [v])
        world["people"][a], world["people"][b] = {"born": x}, {"born": y}
    companies = _pairs(rng, "company", s["company_pairs"], taken)
    for a, b in companies:
        f, g = _pick_pair_values(rng, [f for pair in founders for f in pair],
                                 lambda v: chain_of(world, v, ("born", "in")) + [v])
        world["companies"][a], world["companies"][b] = f, g
    workers = _pairs(rng, "person", s["worker_pairs"], taken)
    conf = set(rng.permutation(len(workers))[:round(CONFUSABLE_FRAC * len(workers))].tolist())
    for k, (a, b) in enumerate(workers):
        c, d = _pick_pair_values(rng, list(world["companies"]), lambda v: chain_of(world, v, CHAIN_RELS[1:]) + [v])
        world["people"][a], world["people"][b] = ({"works": c, "confusable": k in conf},
                                                  {"works": d, "confusable": k in conf})
    for a, b in (*_pairs_of(world["cities"]), *founders, *companies, *workers):
        world["lookalike"][a], world["lookalike"][b] = b, a
    _set_neighbours(world, rng)
    world["test_subjects"] = sorted(p for pair in workers[len(workers) - s["test_pairs"]:] for p in pair)
    return world


def _pairs_of(d):
    keys = list(d)
    return list(zip(keys[::2], keys[1::2]))


def _set_neighbours(world, rng):
    """Each non-country entity's document names a second entity of its role (not its look-alike) whose fact
    differs: the misread fact."""
    for rel in CHAIN_RELS:
        group = [n for n in entity_names(world) if relation(world, n, rel) is not None]
        for n in group:
            ok = [m for m in group if m != n and m != world["lookalike"][n]
                  and relation(world, m, rel) != relation(world, n, rel)]
            world["neighbour"][n] = str(rng.choice(ok))


def chain_rel(world, name):
    """The one relation an entity's document states (None for a country)."""
    return next((r for r in CHAIN_RELS if relation(world, name, r) is not None), None)


def chains_corpus_rows(world):
    docs = [(c, f"{c} is a country.") for c in world["countries"]]
    for n in list(world["cities"]) + list(world["companies"]) + list(world["people"]):
        rel, m = chain_rel(world, n), world["neighbour"][n]
        docs.append((n, CHAIN_DOC[rel].format(n, relation(world, n, rel), n, m, relation(world, m, rel))))
    return [{"id": str(i), "contents": f'"{title}"\n{text}'} for i, (title, text) in enumerate(docs)]


def chains_question_rows(world, split):
    test, rows = set(world["test_subjects"]), []
    workers = [p for p, a in world["people"].items() if "works" in a]
    for qtype, (hops, goal, templates) in CHAIN_QTYPES.items():
        for subj in workers:
            if (subj in test) != (split == "test"):
                continue
            chain = chain_of(world, subj, CHAIN_RELS[:hops])
            for t in templates:
                rows.append({"id": f"{split}_{len(rows)}", "question": t.format(subj), "golden_answers": [chain[-1]],
                             "data_source": f"chains_{hops}hop", "metadata": {"type": qtype, "subject": subj,
                                                                               "hops": hops, "chain": chain,
                                                                               "goal": goal}})
    return rows


def chains_texts(name):
    """Every think sentence once, so that each of its words becomes one token."""
    sentences = [*FILLERS, *(t.format(name, name) for t in (*CHAIN_NEED.values(), *CHAIN_FACT.values())),
                 CHAIN_NOTICE.format(name, name), CHAIN_ANSWER.format(name),
                 *(CHAIN_GOAL.format(goal) for _, goal, _ in CHAIN_QTYPES.values())]
    return [" ".join(sentences + sentences)]  # each sentence once after a space, as inside a think block


def think_text(rng, head, tail):
    """<think> body: 1 to 3 fillers, the sentences of `head` (goal, what was read), then `tail` (the decision): the
    decision sits a few tokens after the goal and the fact it compares (far from them, BC did not learn it)."""
    fill = rng.choice(len(FILLERS), int(rng.integers(1, 4)), replace=False)
    return " ".join([*(FILLERS[i] for i in fill), *head, tail])


def chains_token_weight(tok, table, weight):
    """(V,) BC weight of each target token: `weight` for the names and the decision and kind words, 1 elsewhere.
    Fillers make ~60% of the target tokens and dilute the few tokens that carry a decision; unweighted (first build,
    3 layers, 400 steps), the policy did not learn to copy names: test greedy EM 0.00, sampled 0.007."""
    import torch
    w = torch.ones(len(tok))
    words = ["Next", "So", "company", "founder", "city", "country"]
    w[torch.cat(table[:2])] = float(weight)
    w[torch.tensor([tok.convert_tokens_to_ids("\u0120" + x) for x in words])] = float(weight)
    # the action tags too: unweighted, 11.6% of sampled warm-start turns were invalid actions (e.g. </answer> closing
    # a search)
    w[torch.tensor(tok.convert_tokens_to_ids(list(TAGS)))] = float(weight)
    return w


def chains_episode(q, world, top, rng, perfect=False):
    """One scripted chains episode: ([(turn_text, observation or None)], [(decision, choice)]); the same contract
    as scripted_episode. Choices follow CHAIN_PROBS (perfect: always the first); fillers are drawn either way."""
    hops, look, turns, log = q["metadata"]["hops"], world["lookalike"], [], []
    state = {"searches": 0}

    def choose(row, allowed=None):
        probs = {k: p for k, p in CHAIN_PROBS[row].items() if allowed is None or k in allowed}
        keys, p = list(probs), np.array(list(probs.values()))
        pick = keys[0] if perfect else keys[rng.choice(len(keys), p=p / p.sum())]
        log.append((row, pick))
        return pick

    def act(head, tail, action, content):
        obs = None
        if action == "search":
            state["searches"] += 1
            obs = information_block(docs_text(top[content]))
        body = think_text(rng, [CHAIN_GOAL.format(q["metadata"]["goal"]), *head], tail)
        turns.append((f"<think> {body} </think>\n<{action}> {content} </{action}>", obs))

    target, head = q["metadata"]["subject"], []
    row = "search_confusable" if world["people"][target]["confusable"] else "search"
    for hop, rel in enumerate(CHAIN_RELS[:hops]):
        name = target if choose(row) == "right" else look[target]
        act(head, CHAIN_NEED[rel].format(name), "search", name)
        entity = doc_title(top[name][0])
        if entity != target and choose("after_lookalike", None if state["searches"] < MAX_SEARCHES
                                        else ("trust",)) == "notice":
            act([CHAIN_NOTICE.format(entity, target)], CHAIN_NEED[rel].format(target), "search", target)
            entity = target
        source = entity if choose("read") == "right" else world["neighbour"][entity]
        value = relation(world, source, rel)
        head, row = [CHAIN_FACT[rel].format(entity, value)], "search"
        last = hop == hops - 1
        if not last and state["searches"] < MAX_SEARCHES:
            last = choose("last_bridge" if hop == hops - 2 else "bridge") != "continue"
        if last:
            act(head, CHAIN_ANSWER.format(value), "answer", value)
            return turns, log
        target = value
    raise AssertionError("unreachable: the last hop answers")


def chains_warm_start(model, tok, retr, questions, group, seed, max_new):
    """Warm-start policy through rollout.run_episodes (the training path): greedy (T = 0, one line) and sampled
    (T = 1, `group` lines) EM overall and per hop count, mixed groups, turns and generated tokens per turn."""
    from protocol import Protocol
    from rollout import run_episodes, start_episodes
    def proto(temp):
        return Protocol(temperature=temp, max_new_tokens=max_new, gen_batch_size=128)
    greedy = run_episodes(model, tok, retr, start_episodes(tok, questions, seed, 0, 1), proto(0.0))
    sampled = run_episodes(model, tok, retr, start_episodes(tok, questions, seed, 1, group), proto(1.0))
    g = np.array([e.reward for e in greedy])
    s = np.array([e.reward for e in sampled]).reshape(len(questions), group)
    hops = np.array([q["metadata"]["hops"] for q in questions])
    turns = [t for e in sampled for t in e.turns]
    out = {"questions": len(questions), "group": group, "greedy_em": float(g.mean()), "sampled_em": float(s.mean()),
           "mixed_groups": float(((s.min(1) == 0) & (s.max(1) == 1)).mean()),
           "turns_mean": len(turns) / len(sampled),
           "tokens_per_turn_mean": float(np.mean([t.end - t.start for t in turns])),
           "tokens_per_turn_sd": float(np.std([t.end - t.start for t in turns])),
           "turns_cut_at_max_new": float(np.mean([t.stop == "length" for t in turns])),
           "actions": {a: float(np.mean([t.action == a for t in turns])) for a in ("search", "answer", None)}}
    out["per_hop"] = {f"{h}hop": {"questions": int((hops == h).sum()), "greedy_em": float(g[hops == h].mean()),
                                  "sampled_em": float(s[hops == h].mean())} for h in sorted(set(hops.tolist()))}
    return out, sampled


def oracle_share(model, tok, retr, episodes, rollouts, max_new):
    """Oracle A*(s_t, y_t) = Q - V of every decision of `episodes` from `rollouts` Monte Carlo continuations per side
    (rollout.continue_from, the audit's keys: fresh_key(key, MC_Q_TAG / MC_V_TAG, t, k)); the share of decisions
    with A* > 0 that sit in failed episodes: good decisions that GRPO's outcome-only credit punishes."""
    import protocol
    import rollout
    import sampler
    proto = protocol.Protocol(temperature=1.0, max_new_tokens=max_new, gen_batch_size=128)
    dec = [(ep, t) for ep in episodes for t in range(len(ep.turns))]
    reqs = [(ep, t, inc, sampler.fresh_key(ep.key, tag, t, k)) for ep, t in dec
            for inc, tag in ((True, sampler.MC_Q_TAG), (False, sampler.MC_V_TAG)) for k in range(rollouts)]
    u = np.array([e.reward for e in rollout.continue_from(model, tok, retr, reqs, proto)]).reshape(len(dec), 2, -1)
    a = u[:, 0].mean(1) - u[:, 1].mean(1)
    failed = np.array([ep.reward == 0 for ep, _ in dec])
    pos, big = a > 0, a >= 0.5
    return {"episodes": len(episodes), "decisions": len(dec), "rollouts_per_side": rollouts,
            "positive": int(pos.sum()), "positive_in_failed": int((pos & failed).sum()),
            "share_positive_in_failed": float((pos & failed).sum() / max(1, pos.sum())),
            "share_a_ge_0.5_in_failed": float((big & failed).sum() / max(1, big.sum())),
            "negative": int((a < 0).sum()), "mean_abs_a": float(np.abs(a).mean())}


def chains_stats(model, tok, retr, world, split, top, demos, seed, sc, times):
    """world.json's stats of the chains world (issue 11): all measured here, on the test split for the policy."""
    # DEVIATION W12: warm-start figures on the test split only; DEVIATION W11: oracle_episodes x oracle_rollouts
    t = time.time()
    rng = make_rng(seed, 5)
    test = split["test"]
    questions = [test[k] for k in sorted(rng.permutation(len(test))[:sc["eval_questions"]])]
    warm, sampled = chains_warm_start(model, tok, retr, questions, sc["eval_group"], seed, sc["eval_max_new"])
    times["eval_s"], t = time.time() - t, time.time()
    pick = sorted(make_rng(seed, 6).permutation(len(questions))[:sc["oracle_episodes"]])
    warm["oracle"] = oracle_share(model, tok, retr, [sampled[k * sc["eval_group"]] for k in pick],
                                  sc["oracle_rollouts"], sc["eval_max_new"])
    times["oracle_s"] = time.time() - t
    hops = {s: {h: sum(q["metadata"]["hops"] == h for q in rows) for h in (1, 2, 3, 4)} for s, rows in split.items()}
    return {"preset": "chains", "seed": seed, "scale": world["scale"], "corpus_docs": len(corpus_rows(world)),
            "entities": {k: len(world[k]) for k in ("countries", "cities", "companies", "people")},
            "confusable_workers": sum(bool(p.get("confusable")) for p in world["people"].values()),
            "questions": {s: _count(rows) for s, rows in split.items()}, "questions_per_hop": hops,
            "share_4hop": {s: hops[s][4] / len(rows) for s, rows in split.items()}, "demo_probs": CHAIN_PROBS,
            "scripted_em": {s: {"perfect": scripted_em(world, rows, top, seed, True),
                                "imperfect": scripted_em(world, rows, top, seed, False)} for s, rows in split.items()},
            "demo_decisions": _decision_freqs(log for _, _, log in demos), "warm_start": {"test": warm}}


def build_tinyworld(out, seed=0, scale="full", force=False, threads=1, preset="tiny"):
    """Build a world (`preset` tiny or chains) into `out` atomically (temp dir, world.json last, rename); returns
    the stats."""
    import torch
    if preset not in PRESET_SCALES:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESET_SCALES)}")
    if scale not in PRESET_SCALES[preset]:
        raise ValueError(f"unknown scale {scale!r}; choose one of {sorted(PRESET_SCALES[preset])}")
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
        stats = _build(tmp, seed, scale, out, preset)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(threads_before)
    return stats


def _build(tmp, seed, scale, out, preset="tiny"):
    import torch
    sc, t0, times = PRESET_SCALES[preset][scale], time.time(), {}
    world = make_world(seed, scale) if preset == "tiny" else make_chains_world(seed, scale)
    world, retr, top, check = fix_retrieval(world, tmp, seed)
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
    model = make_policy(tok, sc)
    table = name_table(tok, world)
    weight = chains_token_weight(tok, table, sc["name_weight"]) if preset == "chains" else None
    losses = train_bc(model, encoded, table, sc, seed, weight)
    model.save_pretrained(os.path.join(tmp, "policy"))
    tok.save_pretrained(os.path.join(tmp, "policy"))
    times["bc_s"], t = time.time() - t, time.time()
    if preset == "chains":
        stats = chains_stats(model, tok, retr, world, split, top, demos, seed, sc, times)
    else:
        stats = _tiny_stats(model, tok, retr, world, split, top, demos, seed, sc, times)
    stats["bc"] = {"steps": len(losses), "batch": sc["bc_batch"], "episodes": len(encoded), "lr": sc["lr"],
                   "params": sum(p.numel() for p in model.parameters()), "vocab": len(tok),
                   "loss_first10": float(np.mean(losses[:10])), "loss_last10": float(np.mean(losses[-10:])),
                   "losses": [round(x, 4) for x in losses]}
    stats["retrieval_check"], stats["times"] = check, times
    return _finish(tmp, out, world, stats, t0)


def _tiny_stats(model, tok, retr, world, split, top, demos, seed, sc, times):
    t, scale = time.time(), world["scale"]
    rng = make_rng(seed, 5)
    warm = {s: evaluate_policy(model, tok, retr, [rows[k] for k in sorted(rng.permutation(len(rows))[
        :sc["eval_questions"]])], world, sc["eval_group"], seed, sc["eval_max_new"]) for s, rows in split.items()}
    times["eval_s"] = time.time() - t
    stats = {"seed": seed, "scale": scale, "corpus_docs": len(corpus_rows(world)),
             "entities": {k: len(world[k]) for k in ("countries", "cities", "companies", "people")},
             "confusable_people": sum(p["confusable"] for p in world["people"].values()),
             "questions": {s: _count(rows) for s, rows in split.items()}, "demo_probs": DEMO_PROBS,
             "scripted_em": {s: {"perfect": scripted_em(world, rows, top, seed, True),
                                                           "imperfect": scripted_em(world, rows, top, seed, False)}
                                                       for s, rows in split.items()},
             "demo_decisions": _decision_freqs(log for _, _, log in demos), "warm_start": warm}
    return stats


def _finish(tmp, out, world, stats, t0):
    # The index records its corpus by absolute path: point it at the final folder (the fingerprint is unchanged).
    meta_path = os.path.join(tmp, "index", "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    meta["corpus"] = os.path.join(os.path.abspath(out), "corpus.jsonl")
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=2)
    stats["times"]["total_s"] = time.time() - t0
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


WORLD_FILES = ("corpus.jsonl", "train.jsonl", "test.jsonl", "index/index.faiss", "policy/model.safetensors",
               "policy/tokenizer.json")


def differing_files(a: str, b: str) -> list:
    """The WORLD_FILES whose bytes differ between two built worlds (a rebuild on one thread: none)."""
    def read(root, rel):
        with open(os.path.join(root, rel), "rb") as f:
            return f.read()
    return [rel for rel in WORLD_FILES if read(a, rel) != read(b, rel)]


def stop_calibration(world_dir: str, split: str = "test", seed: int = 0) -> dict:
    """How well a chains world's warm start learned the stop decisions: P(So) / (P(So) + P(Next)) at each decision
    word of scripted perfect episodes (teacher-forced), by position (hops, kind), against the scripts' probability."""
    import torch
    import retriever
    from eval import load_policy
    with open(os.path.join(world_dir, "world.json")) as f:
        world = json.load(f)["world"]
    if world.get("preset") != "chains":
        raise ValueError(f"{world_dir}/world.json: not a chains world (preset {world.get('preset')!r})")
    model, tok = load_policy(os.path.join(world_dir, "policy"))
    retr = retriever.DenseRetriever(os.path.join(world_dir, "index"))
    top = dict(zip(entity_names(world), retr.search(entity_names(world), topk=TOPK)))
    so, nxt = tok.convert_tokens_to_ids("\u0120So"), tok.convert_tokens_to_ids("\u0120Next")
    script = {"bridge": CHAIN_PROBS["bridge"]["answer_early"], "last_bridge": CHAIN_PROBS["last_bridge"]["stop_short"],
              "answer": 1.0}
    rng, out = make_rng(seed, 7), {}
    for q in question_rows(world, split):
        turns, _ = scripted_episode(q, world, top, rng, perfect=True)
        ids, mask = encode_episode(tok, q["question"], turns, {})
        with torch.no_grad():
            p = torch.softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        hops, at = q["metadata"]["hops"], [i for i in range(1, len(ids)) if mask[i] and ids[i] in (so, nxt)]
        for k, i in enumerate(at[1:], 1):  # the first think block always searches
            kind = "answer" if k == hops else "last_bridge" if k == hops - 1 else "bridge"
            out.setdefault(f"{hops}hop/{kind}@{k}", []).append(float(p[i - 1, so] / (p[i - 1, so] + p[i - 1, nxt])))
    return {key: {"p_stop": round(float(np.mean(v)), 3), "script": script[key.split("/")[1].split("@")[0]],
                  "n": len(v)} for key, v in sorted(out.items())}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="output folder (must not exist or be empty, unless --force)")
    parser.add_argument("--calibration", metavar="WORLD", help="print a built chains world's stop calibration "
                        "(stop_calibration) and exit")
    parser.add_argument("--seed", type=int, default=0, help="world, demonstrations and BC seed")
    parser.add_argument("--preset", choices=sorted(PRESET_SCALES), default="tiny",
                        help="tiny (the demo's world) or chains (1- to 4-hop chains, long turns; issue 11)")
    parser.add_argument("--scale", choices=sorted(SCALES), default="full", help="full world, or a small one for tests")
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: bit-for-bit repeatable BC)")
    args = parser.parse_args(argv)
    if args.calibration:
        print(json.dumps(stop_calibration(args.calibration, seed=args.seed), indent=1))
        return
    if not args.out:
        parser.error("--out is required (or --calibration WORLD)")
    stats = build_tinyworld(args.out, args.seed, args.scale, args.force, args.threads, args.preset)
    stats["bc"].pop("losses")
    print(json.dumps(stats, indent=1, default=float))


if __name__ == "__main__":
    main()
