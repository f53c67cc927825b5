"""The chains world (DESIGN.md section 9; `worlds/build.py --preset chains`): where decisions come
early and their outcome late. Same generator, formats and code paths as the tiny world
(worlds/tiny.py).

- Entities: one chain of relations, worker -works-> company -founded-> founder -born-> city -in->
  country. Cities, founders, companies and workers come in look-alike pairs whose chains differ at
  every link; every document names a second entity of its kind (the misread fact).
- Questions: an H-hop question (H = 1..4, 40% 4-hop) asks for the H-th link from a worker and needs
  exactly H searches (max_turns = 4 is just enough for 4 hops).
- Scripts: each scripted turn thinks in a <think> block of 1-3 information-free sentences plus what
  was read and what is needed (~55 tokens). The scripts make a different plausible mistake at each
  hop (CHAIN_PROBS): search the look-alike, misread the other entity's fact, answer a bridge early,
  stop one hop short (the majority at the last bridge, so greedy decoding fails there).
- The credit suite (SUITE): the same world with the scripts' probabilities moved along two knobs,
  luck (the misread rate of the last read, after the decision RL must fix) and delay (that decision
  at the first bridge instead of the last); its worlds are warm-started from the chains policy.
- Stats (world.json): the measured warm-start figures and the share of decisions with positive
  oracle advantage (Monte Carlo through rollout.continue_from) in failed episodes;
  `stop_calibration` (`worlds/build.py --calibration`) reads a built world's stop decisions.

This file knows the chains world's entities, questions, scripts and statistics; the index, the
tokenizer, behaviour cloning and the folder it is built into are worlds/build.py's.

Deviations (DESIGN.md section 13):
W10. The paper's turns think in free text of hundreds of tokens; ours draw 1-3 of 12 fixed,
   information-free sentences (+ what was read and what is needed), so turns are long and of varying
   length but their reasoning is not real: only the action and the names copied into the think block
   carry a decision.
W11. The share of good decisions in failed episodes is estimated from a few Monte Carlo
   continuations (6 per side) per decision on a sample of 16 sampled test episodes, not the audit's
   64 (build-time budget).
W12. The warm-start statistics are measured on the test split only (the split the trainer
     evaluates).
"""
import json
import os
import time

import numpy as np

from protocol import INSTRUCTION, information_block
from worlds.base import (CONFUSABLE_FRAC, KINDS, MAX_SEARCHES, TAGS, TOPK, count_questions,
                         decision_freqs, doc_title, docs_text, encode_episode, entity_names,
                         lookalike_name, make_name, make_rng, relation, scripted_em)


CHAIN_RELS = ("works", "founded", "born", "in")
# Scripted-demonstration probabilities of the chains world (saved in world.json). Each row is one
# decision.
CHAIN_PROBS = {
    # every search: the entity the chain needs / its look-alike (whose document points down a wrong
    # chain)
    "search": {"right": 0.85, "lookalike": 0.15},
    # the first search for a "confusable" worker: the look-alike is the majority (greedy fails; RL
    # can fix it)
    "search_confusable": {"right": 0.35, "lookalike": 0.65},
    # the look-alike's document came back: notice it and search the right name (one search spent) /
    # trust it
    "after_lookalike": {"notice": 0.30, "trust": 0.70},
    # reading the searched entity's document: its own fact / the fact about the other entity it
    # names (misread)
    "read": {"right": 0.88, "misread": 0.12},
    # a bridge entity was read and two or more hops remain: search it / answer it (answer a bridge
    # early)
    "bridge": {"continue": 0.88, "answer_early": 0.12},
    # the last bridge was read (one hop remains): search it / answer it (stop one hop short; the
    # majority, so greedy decoding fails every question of 2 or more hops until RL fixes it). 0.65,
    # not 0.55: at 0.55 the cloned policy's stop probability came out on either side of 1/2 by
    # position, and greedy passed some 3-4 hop questions
    "last_bridge": {"continue": 0.35, "stop_short": 0.65},
}
# The credit suite (DESIGN.md section 9, "The credit suite"): chains with two knobs. `luck`: the scripts' misread rate
# at the last read of a chain (the answer's document), after the decision RL must fix and whatever it was: the share
# of the outcome the warm start's own sampling decides after it (chains: 0.12, the rate of every read). `delay`: where
# the warm start's systematic error sits, at the last bridge as in chains (one turn before the answer) or at the first
# bridge (answer the company early, the majority on every question of 2 or more hops: 1-3 turns before the answer,
# 2.25 on the test questions of 2+ hops), the last bridge then continued as the other bridges are. Same entities,
# documents, questions and words as chains, so the same tokenizer, and the policy is warm-started from the chains
# world's (SUITE_SCALES).
SUITE = {
    "luck-mid": {"luck": 0.30, "delay": "last"},
    "luck-high": {"luck": 0.50, "delay": "last"},
    "delay-high": {"luck": 0.50, "delay": "first"},
}


def suite_probs(luck, delay):
    """CHAIN_PROBS with the last read's misread rate `luck` and the systematic stop at the `delay` bridge."""
    probs = {**CHAIN_PROBS, "read_last": {"right": round(1 - luck, 6), "misread": luck}}
    if delay == "first":
        probs["first_bridge"] = {"continue": 0.35, "answer_early": 0.65}
        probs["last_bridge"] = {"continue": 0.88, "stop_short": 0.12}
    elif delay != "last":
        raise ValueError(f"delay must be 'last' or 'first', not {delay!r}")
    return probs


CHAIN_QTYPES = {  # type: (hops, goal, templates); 4-hop gets two templates, so 40% of the questions need 4 searches
    "employer": (1, "a company that a person works for", ("Which company does {} work for?",)),
    "founder": (2, "a founder of a company", ("Who founded the company that {} works for?",)),
    "founder_birthplace": (3, "a city where a founder was born", (
        "Where was the founder of the company that {} works for born?",)),
    "founder_country": (4, "a country of a city", (
        "In which country was the founder of the company that {} works for born?",
        "What is the home country of the founder of the employer of {}?")),
}
# Every think block opens by restating the goal, its kind and the kind one link before it ("a city
# where a founder was born"): whether the fact just read is the last bridge is then whether its kind
# word (CHAIN_FACT) occurs in the goal sentence a few tokens back. With the goal's kind alone ("a
# city"), BC had to learn a table of (goal, fact) pairs and did not: the 3-hop last-bridge decision
# came out "continue" (warm-start greedy EM 0.71 on 3 hops).
CHAIN_GOAL = "The question asks for {}."
# A think block ends with the decision: "Next I need ..." (search) or "So the answer is ..."
# (answer); "Next" and "So" occur nowhere else, so BC can weight the decision tokens
# (chains_token_weight).
CHAIN_NEED = {
    "works": "Next I need the company that {} works for.",
    "founded": "Next I need the founder of {}.", "born": "Next I need the city where {} was born.",
    "in": "Next I need the country of {}."
}
# What a think block says it read: the value's kind is named, the word of the goal sentence
# (CHAIN_GOAL), so the stop decision compares two equal words (with the documents' wording the BC
# policy searched on after the answer).
CHAIN_FACT = {"works": "{} works for the company {}.", "founded": "{} has the founder {}.",
              "born": "{} was born in the city {}.", "in": "{} is in the country {}."}
# an entity's document names a second entity of its kind: reading the right fact is a decision
CHAIN_DOC = {
    "works": "{} works for {}. {} knows {}, who works for {}.",
    "founded": "{} was founded by {}. {} competes with {}, which was founded by {}.",
    "born": "{} was born in {}. {} met {}, who was born in {}.",
    "in": "{} is a city in {}. {} is near {}, a city in {}.",
}
CHAIN_NOTICE, CHAIN_ANSWER = "The document is about {}, not {}.", "So the answer is {}."
# DEVIATION W10: think-block sentences without information; each turn's <think> carries 1 to 3 of
# them, so turns are ~55 tokens of varying length and a twin's cost is comparable to a
# continuation's.
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
# entity counts (pairs of look-alikes); policy and BC; warm-start evaluation and oracle sample
CHAIN_SCALES = {
    "full": dict(countries=10, city_pairs=20, founder_pairs=20, company_pairs=20, worker_pairs=60,
                 test_pairs=12, hidden=64, layers=2, init=0.1, bc_steps=1600, bc_batch=16, lr=3e-3,
                 name_weight=10, eval_questions=120, eval_group=5, eval_max_new=128,
                 oracle_episodes=16, oracle_rollouts=6),
    "test": dict(countries=3, city_pairs=3, founder_pairs=3, company_pairs=3, worker_pairs=4,
                 test_pairs=1, hidden=32, layers=2, init=0.1, bc_steps=6, bc_batch=4, lr=3e-3,
                 name_weight=5, eval_questions=3, eval_group=2, eval_max_new=24, oracle_episodes=2,
                 oracle_rollouts=2),
}
# A suite world's policy starts from the chains world's of its seed (`from_chains`; worlds/build.py --init): BC then
# moves the decisions its scripts change, 800 steps at chains' learning rate (the chains recipe from scratch is 1,600
# steps, ~30 min on one pinned thread). 400 steps at 1e-3 barely moved the last read (teacher-forced P(misread) 0.11
# at 1 hop for a script's 0.50), and 1,600 from scratch did no better (0.06); this recipe reached 0.19, plus 0.18 on
# other names (RESULTS.md "Credit suite"). At test scale it starts from scratch unless --init names a chains world.
SUITE_SCALES = {"full": {**CHAIN_SCALES["full"], "bc_steps": 800, "lr": 3e-3, "from_chains": True},
                "test": {**CHAIN_SCALES["test"], "from_chains": False}}


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
    """Two values from `options` whose chains (value and every later link) differ link by link: a
    look-alike's document then points down a chain that never rejoins the right one."""
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
    """Entity table of the chains world: look-alike pairs of cities, founders, companies and
    workers."""
    s, rng, taken = CHAIN_SCALES[scale], make_rng(seed, 0, 1), set(w.lower()
                                                                   for w in INSTRUCTION.split())
    world = {
        "preset": "chains", "seed": seed, "scale": scale, "countries": [], "cities": {},
        "companies": {}, "people": {}, "lookalike": {}, "neighbour": {}
    }
    world["countries"] = [make_name(rng, "country", taken) for _ in range(s["countries"])]
    for i, pair in enumerate(_pairs(rng, "city", s["city_pairs"], taken)):
        for j, c in enumerate(pair):  # a pair lies in two different countries
            world["cities"][c] = world["countries"][(2 * i + j) % len(world["countries"])]
    founders = _pairs(rng, "person", s["founder_pairs"], taken)
    for a, b in founders:
        x, y = _pick_pair_values(rng, list(world["cities"]), lambda v: chain_of(world, v,
                                                                                ("in", )) + [v])
        world["people"][a], world["people"][b] = {"born": x}, {"born": y}
    companies = _pairs(rng, "company", s["company_pairs"], taken)
    for a, b in companies:
        f, g = _pick_pair_values(rng, [f for pair in founders for f in pair],
                                 lambda v: chain_of(world, v, ("born", "in")) + [v])
        world["companies"][a], world["companies"][b] = f, g
    workers = _pairs(rng, "person", s["worker_pairs"], taken)
    conf = set(rng.permutation(len(workers))[:round(CONFUSABLE_FRAC * len(workers))].tolist())
    for k, (a, b) in enumerate(workers):
        c, d = _pick_pair_values(rng, list(world["companies"]),
                                 lambda v: chain_of(world, v, CHAIN_RELS[1:]) + [v])
        world["people"][a], world["people"][b] = ({"works": c, "confusable": k in conf},
                                                  {"works": d, "confusable": k in conf})
    for a, b in (*_pairs_of(world["cities"]), *founders, *companies, *workers):
        world["lookalike"][a], world["lookalike"][b] = b, a
    _set_neighbours(world, rng)
    world["test_subjects"] = sorted(p for pair in workers[len(workers) - s["test_pairs"]:]
                                    for p in pair)
    return world


def make_suite_world(name):
    """make_world of the credit-suite preset `name`: the chains world of the seed, its preset, knobs and script
    probabilities (world.json's `world`)."""
    def make(seed, scale="full"):
        world = make_chains_world(seed, scale)
        world.update(preset=name, suite=SUITE[name], probs=suite_probs(**SUITE[name]))
        return world
    return make


def lookalikes(world):
    """{name: its look-alike}: every kind but countries."""
    return world["lookalike"]


def _pairs_of(d):
    keys = list(d)
    return list(zip(keys[::2], keys[1::2]))


def _set_neighbours(world, rng):
    """Each non-country entity's document names a second entity of its role (not its look-alike)
    whose fact differs: the misread fact."""
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
    """One document per entity, '"Title"\\ntext' as in wiki-18: its fact and a second entity's
    (CHAIN_DOC)."""
    docs = [(c, f"{c} is a country.") for c in world["countries"]]
    for n in list(world["cities"]) + list(world["companies"]) + list(world["people"]):
        rel, m = chain_rel(world, n), world["neighbour"][n]
        docs.append((n, CHAIN_DOC[rel].format(n, relation(world, n, rel), n, m,
                                              relation(world, m, rel))))
    return [{"id": str(i), "contents": f'"{title}"\n{text}'}
            for i, (title, text) in enumerate(docs)]


def chains_question_rows(world, split):
    """QA rows of a split; `metadata` (type, subject, hops, chain, goal) is for the script and the
    audit."""
    test, rows = set(world["test_subjects"]), []
    workers = [p for p, a in world["people"].items() if "works" in a]
    for qtype, (hops, goal, templates) in CHAIN_QTYPES.items():
        for subj in workers:
            if (subj in test) != (split == "test"):
                continue
            chain = chain_of(world, subj, CHAIN_RELS[:hops])
            for t in templates:
                rows.append({
                    "id": f"{split}_{len(rows)}", "question": t.format(subj),
                    "golden_answers": [chain[-1]], "data_source": f"chains_{hops}hop", "metadata": {
                        "type": qtype, "subject": subj, "hops": hops, "chain": chain, "goal": goal
                    }
                })
    return rows


def chains_texts(name):
    """Every think sentence once, so that each of its words becomes one token."""
    sentences = [
        *FILLERS, *(t.format(name, name) for t in (*CHAIN_NEED.values(), *CHAIN_FACT.values())),
        CHAIN_NOTICE.format(name, name),
        CHAIN_ANSWER.format(name), *(CHAIN_GOAL.format(goal)
                                     for _, goal, _ in CHAIN_QTYPES.values())
    ]
    # each sentence once after a space, as inside a think block
    return [" ".join(sentences + sentences)]


def think_text(rng, head, tail):
    """<think> body: 1 to 3 fillers, the sentences of `head` (goal, what was read), then `tail` (the
    decision): the decision sits a few tokens after the goal and the fact it compares (far from
    them, BC did not learn it)."""
    fill = rng.choice(len(FILLERS), int(rng.integers(1, 4)), replace=False)
    return " ".join([*(FILLERS[i] for i in fill), *head, tail])


def chains_token_weight(tok, table, weight):
    """(V,) BC weight of each target token: `weight` for the names and the decision and kind words,
    1 elsewhere. Fillers make ~60% of the target tokens and dilute the few tokens that carry a
    decision; unweighted (first build, 3 layers, 400 steps), the policy did not learn to copy names:
    test greedy EM 0.00, sampled 0.007."""
    import torch
    w = torch.ones(len(tok))
    words = ["Next", "So", "company", "founder", "city", "country"]
    w[torch.cat(table[:2])] = float(weight)
    w[torch.tensor([tok.convert_tokens_to_ids("\u0120" + x) for x in words])] = float(weight)
    # the action tags too: unweighted, 11.6% of sampled warm-start turns were invalid actions (e.g.
    # </answer> closing a search)
    w[torch.tensor(tok.convert_tokens_to_ids(list(TAGS)))] = float(weight)
    return w


def chains_episode(q, world, top, rng, perfect=False):
    """One scripted chains episode: ([(turn_text, observation or None)], [(decision, choice)]); the
    same contract as world_tiny.scripted_episode. Choices follow the world's probabilities (CHAIN_PROBS,
    or a suite world's; perfect: always the first); fillers are drawn either way."""
    hops, look, turns, log = q["metadata"]["hops"], world["lookalike"], [], []
    table = world.get("probs", CHAIN_PROBS)
    state = {"searches": 0}

    def choose(row, allowed=None):
        probs = {k: p for k, p in table[row].items() if allowed is None or k in allowed}
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
            act([CHAIN_NOTICE.format(entity, target)], CHAIN_NEED[rel].format(target), "search",
                target)
            entity = target
        read = "read_last" if hop == hops - 1 and "read_last" in table else "read"
        source = entity if choose(read) == "right" else world["neighbour"][entity]
        value = relation(world, source, rel)
        head, row = [CHAIN_FACT[rel].format(entity, value)], "search"
        last = hop == hops - 1
        if not last and state["searches"] < MAX_SEARCHES:
            last = choose(bridge_row(table, hop, hops)) != "continue"
        if last:
            act(head, CHAIN_ANSWER.format(value), "answer", value)
            return turns, log
        target = value
    raise AssertionError("unreachable: the last hop answers")


def bridge_row(table, hop, hops):
    """The script's row of the bridge read at `hop` of a `hops`-hop chain (two or more hops left or the last)."""
    if hop == 0 and "first_bridge" in table:
        return "first_bridge"
    return "last_bridge" if hop == hops - 2 else "bridge"


def chains_warm_start(model, tok, retr, questions, group, seed, max_new):
    """Warm-start policy through rollout.run_episodes (the training path): greedy (T = 0, one line)
    and sampled (T = 1, `group` lines) EM overall and per hop count, mixed groups, turns and
    generated tokens per turn."""
    from protocol import Protocol
    from rollout import run_episodes, start_episodes
    def proto(temp):
        return Protocol(temperature=temp, max_new_tokens=max_new, gen_batch_size=128)
    greedy = run_episodes(model, tok, retr, start_episodes(tok, questions, seed, 0, 1), proto(0.0))
    sampled = run_episodes(model, tok, retr, start_episodes(tok, questions, seed, 1, group),
                           proto(1.0))
    g = np.array([e.reward for e in greedy])
    s = np.array([e.reward for e in sampled]).reshape(len(questions), group)
    hops = np.array([q["metadata"]["hops"] for q in questions])
    turns = [t for e in sampled for t in e.turns]
    out = {
        "questions": len(questions), "group": group, "greedy_em": float(g.mean()),
        "sampled_em": float(s.mean()), "mixed_groups": float(
            ((s.min(1) == 0) & (s.max(1) == 1)).mean()),
        "turns_mean": len(turns) / len(sampled), "tokens_per_turn_mean": float(
            np.mean([t.end - t.start for t in turns])), "tokens_per_turn_sd": float(
                np.std([t.end - t.start for t in turns])), "turns_cut_at_max_new": float(
                    np.mean([t.stop == "length" for t in turns])), "actions": {
                        a: float(np.mean([t.action == a for t in turns]))
                        for a in ("search", "answer", None)
                    }
    }
    out["per_hop"] = {
        f"{h}hop": {
            "questions": int((hops == h).sum()), "greedy_em": float(g[hops == h].mean()),
            "sampled_em": float(s[hops == h].mean())
        } for h in sorted(set(hops.tolist()))
    }
    return out, sampled


def oracle_share(model, tok, retr, episodes, rollouts, max_new):
    """Oracle A*(s_t, y_t) = Q - V of every decision of `episodes` from `rollouts` Monte Carlo
    continuations per side (rollout.continue_from, the audit's keys: fresh_key(key, MC_Q_TAG /
    MC_V_TAG, t, k)); the share of decisions with A* > 0 that sit in failed episodes: good decisions
    that GRPO's outcome-only credit punishes."""
    import protocol
    import rollout
    import sampler
    proto = protocol.Protocol(temperature=1.0, max_new_tokens=max_new, gen_batch_size=128)
    dec = [(ep, t) for ep in episodes for t in range(len(ep.turns))]
    reqs = [(ep, t, inc, sampler.fresh_key(ep.key, tag, t, k)) for ep, t in dec
            for inc, tag in ((True, sampler.MC_Q_TAG), (False, sampler.MC_V_TAG))
            for k in range(rollouts)]
    u = np.array([e.reward for e in rollout.continue_from(model, tok, retr, reqs, proto)]).reshape(
        len(dec), 2, -1)
    a = u[:, 0].mean(1) - u[:, 1].mean(1)
    failed = np.array([ep.reward == 0 for ep, _ in dec])
    pos, big = a > 0, a >= 0.5
    return {"episodes": len(episodes), "decisions": len(dec), "rollouts_per_side": rollouts,
            "positive": int(pos.sum()), "positive_in_failed": int((pos & failed).sum()),
            "share_positive_in_failed": float((pos & failed).sum() / max(1, pos.sum())),
            "share_a_ge_0.5_in_failed": float((big & failed).sum() / max(1, big.sum())),
            "negative": int((a < 0).sum()), "mean_abs_a": float(np.abs(a).mean())}


def chains_stats(model, tok, retr, world, split, top, demos, seed, sc, times):
    """world.json's stats of the chains world: all measured here, on the test split for the policy.
    """
    # DEVIATION W12: warm-start figures on the test split only; DEVIATION W11: oracle_episodes x
    # oracle_rollouts
    t = time.time()
    rng = make_rng(seed, 5)
    test = split["test"]
    questions = [test[k] for k in sorted(rng.permutation(len(test))[:sc["eval_questions"]])]
    warm, sampled = chains_warm_start(model, tok, retr, questions, sc["eval_group"], seed,
                                      sc["eval_max_new"])
    times["eval_s"], t = time.time() - t, time.time()
    pick = sorted(make_rng(seed, 6).permutation(len(questions))[:sc["oracle_episodes"]])
    warm["oracle"] = oracle_share(model, tok, retr, [sampled[k * sc["eval_group"]] for k in pick],
                                  sc["oracle_rollouts"], sc["eval_max_new"])
    times["oracle_s"] = time.time() - t
    hops = {
        s: {h: sum(q["metadata"]["hops"] == h for q in rows) for h in (1, 2, 3, 4)}
        for s, rows in split.items()
    }
    return {
        "preset": world["preset"], "seed": seed, "scale": world["scale"], "corpus_docs": len(
            chains_corpus_rows(world)),
        "entities": {k: len(world[k]) for k in KINDS}, "confusable_workers": sum(
            bool(p.get("confusable")) for p in world["people"].values()), "questions": {
                s: count_questions(rows) for s, rows in split.items()
            }, "questions_per_hop": hops, "share_4hop": {
                s: hops[s][4] / len(rows) for s, rows in split.items()
            }, "demo_probs": world.get("probs", CHAIN_PROBS), "scripted_em": {
                s: {
                    "perfect": scripted_em(chains_episode, world, rows, top, seed, True),
                    "imperfect": scripted_em(chains_episode, world, rows, top, seed, False)
                } for s, rows in split.items()
            }, "demo_decisions": decision_freqs(log for _, _, log in demos), "warm_start": {
                "test": warm
            }, **({"suite": world["suite"]} if "suite" in world else {})
    }


def stop_calibration(world_dir: str, split: str = "test", seed: int = 0, policy: str = "") -> dict:
    """How well a chains (or suite) world's warm start learned its scripts, teacher-forced on scripted perfect
    episodes: P(So) / (P(So) + P(Next)) at each decision word, by position (hops, kind), against the scripts'
    probability of stopping there; and at the last read (`{hops}hop/read_last`), P(the right value) and P(the
    misread one) against the scripts' probability of reading right (1 - P(right) is the luck the world realises).
    `policy`: another policy folder on the same world (a trained checkpoint's `policy`), to see what training left
    of the warm start's stops and luck."""
    import torch
    import retriever
    from eval import load_policy
    with open(os.path.join(world_dir, "world.json")) as f:
        world = json.load(f)["world"]
    if world.get("preset") != "chains" and world.get("preset") not in SUITE:
        raise ValueError(
            f"{world_dir}/world.json: not a chains world (preset {world.get('preset')!r})")
    table = world.get("probs", CHAIN_PROBS)
    model, tok = load_policy(policy or os.path.join(world_dir, "policy"))
    retr = retriever.Retriever(os.path.join(world_dir, "index"))
    top = dict(zip(entity_names(world), retr.search(entity_names(world), topk=TOPK)))
    so, nxt = tok.convert_tokens_to_ids("\u0120So"), tok.convert_tokens_to_ids("\u0120Next")
    stop = {"first_bridge": "answer_early", "bridge": "answer_early", "last_bridge": "stop_short"}
    rng, out, script = make_rng(seed, 7), {}, {}
    for q in chains_question_rows(world, split):
        turns, _ = chains_episode(q, world, top, rng, perfect=True)
        ids, mask = encode_episode(tok, q["question"], turns, {})
        with torch.no_grad():
            p = torch.softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        hops, at = q["metadata"]["hops"], [
            i for i in range(1, len(ids)) if mask[i] and ids[i] in (so, nxt)
        ]
        for k, i in enumerate(at[1:], 1):  # the first think block always searches
            row = "answer" if k == hops else bridge_row(table, k - 1, hops)
            key = f"{hops}hop/{row}@{k}"
            script[key] = 1.0 if row == "answer" else table[row][stop[row]]
            out.setdefault(key, []).append(float(p[i - 1, so] / (p[i - 1, so] + p[i - 1, nxt])))
        chain, rel = q["metadata"]["chain"], CHAIN_RELS[hops - 1]
        right = tok.convert_tokens_to_ids("\u0120" + chain[-1])
        entity = chain[-2] if hops > 1 else q["metadata"]["subject"]  # the last document read
        wrong = tok.convert_tokens_to_ids("\u0120" + relation(world, world["neighbour"][entity], rel))
        i = next(i for i in range(1, len(ids)) if mask[i] and ids[i] == right)  # the last think's fact
        key = f"{hops}hop/read_last"
        script[key] = table.get("read_last", table["read"])["right"]
        out.setdefault(key, []).append((float(p[i - 1, right]), float(p[i - 1, wrong])))
    cal = {}
    for key, v in sorted(out.items()):
        if "@" in key:
            cal[key] = {"p_stop": round(float(np.mean(v)), 3), "script": script[key], "n": len(v)}
        else:  # the last read: the right fact, the misread one; the rest of the mass goes to other names
            m = np.mean(v, axis=0)
            cal[key] = {"p_right": round(float(m[0]), 3), "p_misread": round(float(m[1]), 3),
                        "script": script[key], "n": len(v)}
    return cal
