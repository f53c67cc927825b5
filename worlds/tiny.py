"""The tiny world (DESIGN.md section 9; `worlds/build.py --preset tiny`, the demo's): short 1- and
2-hop episodes.

- Corpus: one document per entity (`"Title"\\ntext`, the wiki-18 shape) about invented countries,
  cities (in a country), companies (based in a city) and people (born in a city, working for a
  company). People come in look-alike pairs (Zorvak / Zorvik) with different attributes: searching
  the look-alike really retrieves its own document, which misleads.
- Questions: 1-hop (birthplace, employer, a city's country, a company's city) and 2-hop (country of
  birth, city of the employer). Test subjects (people by look-alike pair, cities, companies) never
  appear in train questions.
- Scripts: scripted episodes in the protocol of DESIGN.md section 3, imperfect with the
  probabilities of `DEMO_PROBS`, so that turn-level choices are stochastic and consequential; in two
  identifiable situations the majority choice is wrong (2-hop: answer the bridge entity;
  "confusable" people: search the look-alike), so greedy decoding fails there and RL can fix it.
- Stats (world.json): every statistic of DESIGN.md section 9, the warm start measured on both
  splits.

This file knows the tiny world's entities, questions and scripts; the index, the tokenizer,
behaviour cloning and the folder it is built into are worlds/build.py's.
"""
import time

import numpy as np

from protocol import INSTRUCTION, exact_match, information_block
from worlds.base import (CONFUSABLE_FRAC, KINDS, MAX_SEARCHES, count_questions, decision_freqs,
                         doc_title, docs_text, kind_of, lookalike_name, make_name, make_rng,
                         relation, scripted_em)


# Scripted-demonstration probabilities (saved in world.json). Each row is one decision of the
# script.
DEMO_PROBS = {
    # turn 1: search the subject / search its look-alike (misleads) / answer a guess without
    # searching
    "first": {"search_right": 0.70, "search_lookalike": 0.15, "guess": 0.15},
    # turn 1 for "confusable" people: the look-alike is the majority search (greedy fails; RL can
    # fix it)
    "first_confusable": {"search_right": 0.30, "search_lookalike": 0.55, "guess": 0.15},
    # after the look-alike's document came back: notice it and search the right name / trust Doc 1
    "after_lookalike": {"notice": 0.35, "trust": 0.65},
    # 2-hop, after the subject's document: search the bridge entity / answer the bridge (majority:
    # wrong)
    "hop": {"search_bridge": 0.40, "answer_bridge": 0.60},
    # after the document that holds the answer: answer from Doc 1 / misread another doc (luck after
    # a good choice) / search again
    "read": {"doc1": 0.75, "other_doc": 0.15, "search_again": 0.10},
}

SCALES = {  # entity counts; policy size and BC optimisation; warm-start evaluation sizes
    "full": dict(countries=12, cities=48, companies=48, pairs=90, test_pairs=12, test_places=8, templates=3,
                 hidden=64, layers=2, init=0.1, bc_steps=700, bc_batch=32, lr=3e-3, eval_questions=200, eval_group=5,
                 eval_max_new=100),
    "test": dict(countries=3, cities=6, companies=6, pairs=6, test_pairs=2, test_places=2, templates=1,
                 hidden=32, layers=2, init=0.1, bc_steps=12, bc_batch=8, lr=3e-3, eval_questions=4, eval_group=2,
                 eval_max_new=16),
}
# Policy notes (measured on the full world, 2 CPU cores): copying names from the context appears as
# a phase change after ~250 BC steps with 2 layers x 64 wide and initializer_range 0.1; 3 layers x
# 128 at 0.02 had not learned it after 300 steps (name-token loss 4.4 vs 0.13), and lr 1e-2 was
# worse than 3e-3.

# Question types: (hops, subject kind, relation chain, templates). Answers are never in the
# question.
QTYPES = {
    "birthplace": (1, "person", ("born", ), ("Where was {} born?", "What is the birthplace of {}?",
                                             "In which city was {} born?")),
    "employer": (1, "person", ("works", ), ("Which company does {} work for?", "Who employs {}?",
                                            "What is the employer of {}?")),
    "birth_country": (2, "person", ("born", "in"),
                      ("In which country was {} born?", "What country was {} born in?",
                       "Which country is the birthplace of {} in?")),
    "employer_city": (2, "person", ("works", "based"),
                      ("In which city is the employer of {} based?",
                       "Where is the company {} works for based?",
                       "Which city is the employer of {} in?")),
    "city_country": (1, "city", ("in", ), ("Which country is {} in?",
                                           "In which country is the city {}?")),
    "company_city": (1, "company", ("based", ), ("Where is {} based?",
                                                 "In which city is the company {} based?")),
}
NEED = {"born": "I need the birthplace of {}.", "works": "I need the employer of {}.",
        "in": "I need the country of {}.", "based": "I need the city of {}."}
FACT = {"born": "{} was born in {}.", "works": "{} works for {}.", "in": "{} is a city in {}.",
        "based": "{} is a company based in {}."}


def make_world(seed, scale="full"):
    """Entity table: countries, cities, companies and look-alike pairs of people, with their
    relations and splits."""
    s, rng, taken = SCALES[scale], make_rng(seed, 0), set(w.lower() for w in INSTRUCTION.split())
    countries = [make_name(rng, "country", taken) for _ in range(s["countries"])]
    cities = {
        make_name(rng, "city", taken): countries[i % len(countries)] for i in range(s["cities"])
    }
    city_list = list(cities)
    companies = {
        make_name(rng, "company", taken): str(rng.choice(city_list)) for _ in range(s["companies"])
    }
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
    return {
        "seed": seed, "scale": scale, "countries": countries, "cities": cities,
        "companies": companies, "people": people, "test_subjects": sorted(test)
    }


def _person_attrs(rng, city_list, companies, cities, other):
    """Birthplace and employer, the employer based elsewhere (else the 2-hop answer would sit in the
    person's own document); a look-alike differs in all four answers (birthplace, employer, their
    country and city)."""
    while True:
        born, works = str(rng.choice(city_list)), str(rng.choice(list(companies)))
        if companies[works] != born and (other is None or
                                         (born != other["born"] and works != other["works"] and
                                          cities[born] != cities[other["born"]] and
                                          companies[works] != companies[other["works"]])):
            return {"born": born, "works": works, "confusable": False}


def lookalikes(world):
    """{name: its look-alike}: people only."""
    return {n: p["lookalike"] for n, p in world["people"].items()}


def corpus_rows(world):
    """One document per entity, '"Title"\\ntext' as in wiki-18; its sentences are the FACT
    templates."""
    docs = [(c, f"{c} is a country.") for c in world["countries"]]
    docs += [(c, FACT["in"].format(c, n)) for c, n in world["cities"].items()]
    docs += [(k, FACT["based"].format(k, c)) for k, c in world["companies"].items()]
    docs += [(p, FACT["born"].format(p, a["born"]) + " " + FACT["works"].format(p, a["works"]))
             for p, a in world["people"].items()]
    return [{"id": str(i), "contents": f'"{title}"\n{text}'}
            for i, (title, text) in enumerate(docs)]


def question_rows(world, split):
    """QA rows of a split; `metadata` (type, subject, bridge, hops) is for the script and the audit.
    """
    test, rows = set(world["test_subjects"]), []
    subjects = {"person": world["people"], "city": world["cities"], "company": world["companies"]}
    for qtype, (hops, kind, chain, templates) in QTYPES.items():
        for subj in subjects[kind]:
            if (subj in test) != (split == "test"):
                continue
            bridge = relation(world, subj, chain[0])
            gold = bridge if hops == 1 else relation(world, bridge, chain[1])
            for t in templates[:SCALES[world["scale"]]["templates"]]:
                rows.append({
                    "id": f"{split}_{len(rows)}", "question": t.format(subj),
                    "golden_answers": [gold], "data_source": f"tiny_{hops}hop", "metadata": {
                        "type": qtype, "subject": subj, "bridge": bridge if hops == 2 else None
                    }
                })
    return rows


def turn_text(think, arg, action, content):
    """One agent turn, ending right at its closing tag (the rollout stops there)."""
    return f"<think> {think.format(arg, content)} </think>\n<{action}> {content} </{action}>"


def tiny_texts(name):
    """The tokenizer's texts for the scripts' thoughts: each in a turn about `name`."""
    thoughts = (*NEED.values(), "Wrong person.", "Let me search again.", "I guess {}.")
    return [turn_text(t, name, "search", name) for t in thoughts]


def scripted_episode(q, world, top, rng, perfect=False):
    """One scripted episode for question row `q`: ([(turn_text, observation or None)], [(decision,
    choice)]).

    `top[name]` are the retriever's top-k docs for the query `name`. `perfect` always takes the
    first (right) choice of each DEMO_PROBS row; otherwise choices are drawn from `rng` with the
    stated probabilities.
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
        turns.append((turn_text(think, name, "search",
                                name), information_block(docs_text(top[name]))))

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
        if entity != target and choose("after_lookalike", None if can_search else
                                       ("trust", )) == "notice":
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
        pick = choose("read", [
            k
            for k, ok in (("doc1", True), ("other_doc", others), ("search_again", can_search)) if ok
        ])
        if pick == "search_again":
            search("Let me search again.", searched)
            continue
        entity, value = (entity, value) if pick == "doc1" else others[0]
        return answer(FACT[chain[hop]], entity, value) or (turns, log)


def first_decisions(q, world, turns):
    """Classify the policy's decisions like the script's: [(DEMO_PROBS row, choice)] from [(action,
    content)]."""
    meta, gold = q["metadata"], q["golden_answers"]
    subj, person = meta["subject"], world["people"].get(meta["subject"])
    row = ("first_confusable" if person["confusable"] else "first") if person else "first_place"
    (a, c), nxt = turns[0], turns[1] if len(turns) > 1 else (None, "")
    pick = ("guess" if a == "answer" else "search_right" if c == subj else "search_lookalike"
            if person and a == "search" and c == person["lookalike"] else "other")
    out = [(row, pick)]
    if pick == "search_lookalike":
        out.append(("after_lookalike",
                    "notice" if nxt == ("search", subj) else "trust" if nxt[0] else "other"))
    elif pick == "search_right" and meta["bridge"]:
        out.append(("hop", "search_bridge" if nxt == ("search", meta["bridge"]) else
                    "answer_bridge" if nxt == ("answer", meta["bridge"]) else "other"))
    elif pick == "search_right":
        out.append(
            ("read", "doc1" if nxt[0] == "answer" and exact_match(nxt[1], gold) else
             "other_doc" if nxt[0] == "answer" else "search_again" if nxt == ("search",
                                                                              subj) else "other"))
    return out


def evaluate_policy(model, tok, retr, questions, world, group, seed, max_new):
    """Warm-start EM through rollout.run_episodes (the training code path): greedy (T = 0, one line
    per question, as the evaluation) and sampled (T = 1, `group` lines, as GRPO), and the sampled
    policy's decision frequencies."""
    from protocol import Protocol
    from rollout import run_episodes, start_episodes
    # scripted turns are < 40 tokens: a turn still open after `max_new` has failed; the cap bounds a
    # weak policy's time
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

    return {
        "questions": len(questions), "group": group, "greedy_em": mean(g), "greedy_em_1hop": mean(
            g[~two]), "greedy_em_2hop": mean(g[two]), "sampled_em": mean(s),
        "sampled_em_1hop": mean(s[~two]), "sampled_em_2hop": mean(s[two]),
        "mixed_groups": mean((s.min(1) == 0) & (s.max(1) == 1)), "turns_mean": np.mean([
            len(e.turns) for e in sampled
        ]), "decisions": decision_freqs(logs)
    }


def tiny_stats(model, tok, retr, world, split, top, demos, seed, sc, times):
    """world.json's stats of the tiny world: the entity and question counts, the scripts, and the
    warm start on both splits (`eval_questions` questions each)."""
    t, scale = time.time(), world["scale"]
    rng = make_rng(seed, 5)
    warm = {
        s: evaluate_policy(model, tok, retr, [
            rows[k] for k in sorted(rng.permutation(len(rows))[:sc["eval_questions"]])
        ], world, sc["eval_group"], seed, sc["eval_max_new"]) for s, rows in split.items()
    }
    times["eval_s"] = time.time() - t
    stats = {
        "seed": seed, "scale": scale, "corpus_docs": len(corpus_rows(world)), "entities": {
            k: len(world[k]) for k in KINDS
        },
        "confusable_people": sum(p["confusable"] for p in world["people"].values()), "questions": {
            s: count_questions(rows) for s, rows in split.items()
        }, "demo_probs": DEMO_PROBS, "scripted_em": {
            s: {
                "perfect": scripted_em(scripted_episode, world, rows, top, seed, True),
                "imperfect": scripted_em(scripted_episode, world, rows, top, seed, False)
            } for s, rows in split.items()
        }, "demo_decisions": decision_freqs(log for _, _, log in demos), "warm_start": warm
    }
    return stats
