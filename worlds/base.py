"""What both built-in worlds (DESIGN.md section 9) are made of: invented names and their
look-alikes, the entity table's relations and documents, and scripted episodes as the rollout sees
them (text, tokens, exact match).

The tiny world (worlds/tiny.py) and the chains world (worlds/chains.py) write their entity tables,
documents and scripts with these pieces; worlds/build.py builds either from them. This file knows no
world: no question type, no script probability, no preset, and nothing of the index, the tokenizer
or behaviour cloning (worlds/build.py's).
"""
import numpy as np

from protocol import render_prompt, reward


CONFUSABLE_FRAC = 0.3  # share of look-alike pairs that are "confusable"
MAX_SEARCHES = 4       # DESIGN 3 max_turns: the script answers after this many searches
TOPK = 3               # DESIGN 3 top-k
SUFFIX = {"country": ("land", "ia", "stan", "ova"), "city": ("ton", "by", "ford", "wick", "mouth"),
          "company": ("co", "corp", "tech", "dyne"), "person": ("",)}
ONSETS = "b br d dr f g gr h k kl l m n p pr r s sk st t tr v z".split()
MIDS = "l ld lm n nd r rk rm rv s sh st th v x z".split()
VOWELS = "aeiou"
TAGS = ("<think>", "</think>", "<search>", "</search>", "<answer>", "</answer>", "<information>",
        "</information>")
# the entity table's kinds, in the corpus's order
KINDS = ("countries", "cities", "companies", "people")


def make_rng(seed, *tags):
    """Independent numpy stream per (seed, tags) by SeedSequence integer mixing (never Python's
    hash())."""
    return np.random.default_rng([seed, *tags])


def make_name(rng, kind, taken):
    """A new invented, capitalised, single-word name (letters only, so it is one pre-token)."""
    while True:
        stem = rng.choice(ONSETS) + rng.choice(list(VOWELS)) + rng.choice(MIDS) + rng.choice(
            list(VOWELS))
        name = (stem + rng.choice(list("knrsltx")) if kind == "person" else stem +
                rng.choice(SUFFIX[kind])).title()
        if name.lower() not in taken:
            taken.add(name.lower())
            return name


def lookalike_name(rng, name, taken):
    """Same name with the last vowel changed (Zorvak -> Zorvik); None when every variant is taken.
    """
    i = max(k for k, ch in enumerate(name) if ch in VOWELS)
    for v in rng.permutation(list(VOWELS)):
        cand = name[:i] + v + name[i + 1:]
        if cand.lower() not in taken:
            taken.add(cand.lower())
            return cand
    return None


def relation(world, name, rel):
    """Value of `rel` for an entity (None when the entity does not have it)."""
    if rel in ("born", "works"):
        return world["people"].get(name, {}).get(rel)
    return {"in": world["cities"], "based": world["companies"],
            "founded": world["companies"]}[rel].get(name)


def entity_names(world):
    return world["countries"] + list(world["cities"]) + list(world["companies"]) + list(
        world["people"])


def kind_of(world, name):
    return next(k for k in KINDS if name in world[k])


def doc_title(doc):
    return doc["contents"].split("\n")[0].strip('"')


def docs_text(docs):
    import retriever
    return retriever.format_docs(docs)


def episode_response(turns):
    """Everything after the prompt, as the rollout would see it (for the reward)."""
    return "".join(t + (o or "") for t, o in turns)


def encode_episode(tok, question, turns, cache):
    """(ids, loss mask) exactly as the rollout tokenises: prompt, each turn alone, each observation
    alone (<= 500)."""
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


def scripted_em(episode, world, questions, top, seed, perfect):
    """Exact match of a world's script `episode` (its scripted_episode) on `questions`."""
    rng = make_rng(seed, 4)
    return float(
        np.mean([
            reward(episode_response(episode(q, world, top, rng, perfect)[0]), q["golden_answers"])
            for q in questions
        ]))


def count_questions(rows):
    """{data_source/type: count}, sorted, and the total."""
    out = {}
    for r in rows:
        key = f'{r["data_source"]}/{r["metadata"]["type"]}'
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()), total=len(rows))


def decision_freqs(logs):
    """{decision: {choice: frequency}} over episodes' [(decision, choice)] logs."""
    counts = {}
    for log in logs:
        for row, pick in log:
            counts.setdefault(row, {}).setdefault(pick, 0)
            counts[row][pick] += 1
    return {
        row: {k: round(v / sum(c.values()), 3) for k, v in sorted(c.items())}
        for row, c in counts.items()
    }
