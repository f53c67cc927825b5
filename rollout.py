"""Episodes and their branches: the Search-R1 episode loop, twins, Monte Carlo continuations, the
budget rule's decision table and the training batch (DESIGN.md sections 3 and 5).

An Episode is a prompt and a response of sampled turns (loss mask 1) and observations (loss mask 0,
cut to max_obs_tokens). Its noise is fully described by its key, key_overrides and fresh_seed: turn
t of a factual episode uses sampler.turn_key(key, t). run_episodes steps all episodes together: one
batched generation per turn (engine.generate_turn), then each turn's action (protocol.parse_action):
the searches of all episodes go to the retriever in one call and append their information block, an
answer ends the episode, anything else appends the invalid-action message; after max_turns searches
one final turn executes nothing. finish() scores the agent's own text with protocol.reward, the
evaluation's function.

Twins (DESIGN.md section 5): branch(ep, t) is the state s_t; run_twins draws y' with alt_key(key, t,
j) and continues on the factual keys (same luck, different choice), so D_t = U - U' with E[D_t |
s_t, y_t] = Q(s_t, y_t) - V(s_t). A self-twin (y' equals y_t token for token) and, with the
shortcut, a search retrieving the same ids take D_t = 0 without a rollout. continue_from runs Monte
Carlo rollouts from turn boundaries under fresh keys (the audit's oracle, the baselines' extra
rollouts). decision_table gives the budget rule its per-decision features and costs c_t; collate
makes the right-padded training batch.

It never touches an optimiser, computes no advantage (credit.py's) and samples no token itself
(generation/engine.py's). Driven by train_twice.py, methods/__init__.py, lab/audit.py and eval.py.

Deviations (DESIGN.md section 13; each tagged `# DEVIATION R<n>:` below; R1 is protocol.py's):
  R2. Queries longer than `max_query_chars` are truncated before retrieval (Search-R1 sends
      them whole).
  R3. An episode whose context reaches `max_context` tokens ends there, scored on its response so
      far; observations are cut to fit (Search-R1 left-truncates the rolling context instead,
      which would change what later tokens condition on between a factual episode and its twin).
  R4. An EOS token stays in the response as sampled (loss mask 1); Search-R1's decode/re-encode
      drops it.
  R5. The reward and the recorded answer come from the agent's own sampled text, never observations.
"""
from dataclasses import dataclass, field

import numpy as np
import torch

import credit
from generation import kvbudget
from generation.engine import generate_turn
from protocol import (INVALID_ACTION_MSG, extract_answer, information_block, parse_action,
                      render_prompt, reward)
from generation.rows import TurnStart
from sampler import (INDEPENDENT_TAG, UNCOUPLED_TAG, alt_key, episode_key, fresh_key, mix,
                     stable_id, turn_key)


# --- records ---
@dataclass
class Turn:
    """One generation turn: ids[start:end] sampled (mask 1), ids[obs_start:obs_end] its
    observation (mask 0)."""
    start: int
    end: int
    obs_start: int
    obs_end: int
    text: str               # decoded sampled text
    action: str | None      # "search" | "answer" | None (invalid)
    content: str            # stripped query / answer
    doc_ids: tuple          # retrieved document ids in rank order (empty unless a search ran)
    logprobs: list          # per sampled token, under the sampling distribution
    entropy: list           # per sampled token, of softmax(masked logits / T)
    key: int                # the turn key its noise was drawn with
    stop: str               # "stop" | "eos" | "length"


@dataclass
class Episode:
    """One episode (or a branch of one). Its noise keys are fully described by key,
    key_overrides and fresh_*."""
    uid: int                # stable_id(question id)
    line: int               # index inside the GRPO group
    key: int                # episode_key(run_seed, step, uid, line)
    question: str
    golden_answers: list
    prompt_ids: list
    ids: list = field(default_factory=list)    # response after the prompt: sampled + observation
    mask: list = field(default_factory=list)   # 1 sampled / 0 observation
    turns: list = field(default_factory=list)
    answer: str | None = None
    reward: float = 0.0
    done: bool = False
    n_generated: int = 0    # tokens sampled by this record (a branch counts from its branch point)
    key_overrides: dict = field(default_factory=dict)  # turn -> key (a twin's alternative turn)
    fresh_seed: int | None = None  # uncoupled: turns >= fresh_from use turn_key(fresh_seed, turn)
    fresh_from: int = 0
    branch_turn: int | None = None  # the turn this record branched at (None: factual)
    fork: TurnStart | None = None  # how turn fork.turn starts: given tokens, fork key and ban

    def start_for(self, turn: int):
        """The TurnStart (generation/rows.py) of `turn`, or None (the turn starts at position 0
        on its turn key)."""
        return self.fork if self.fork is not None and self.fork.turn == turn else None

    def key_for(self, turn: int) -> int:
        if turn in self.key_overrides:
            return self.key_overrides[turn]
        if self.fresh_seed is not None and turn >= self.fresh_from:
            return turn_key(self.fresh_seed, turn)
        return turn_key(self.key, turn)


# --- the episode loop (DESIGN.md section 3) ---
def _encode(tokenizer, text: str, chat: bool) -> list:
    # a chat template already holds any BOS
    return tokenizer(text, add_special_tokens=not chat)["input_ids"]


def prompt_lengths(tokenizer, questions, chunk: int = 1024) -> list:
    """Tokens of each question's prompt, encoded as start_episodes encodes it (the ids are not
    kept): the load-time check that every prompt leaves a turn's room under max_context
    (eval.refuse_long_prompts). Batched: ~160 us a Search-R1-sized prompt with Qwen2.5's tokenizer
    on one thread (one by one ~285 us): ~27 s for 169,615 rows."""
    chat = bool(getattr(tokenizer, "chat_template", None))
    out = []
    for c in range(0, len(questions), chunk):
        texts = [render_prompt(tokenizer, q["question"]) for q in questions[c:c + chunk]]
        out += [len(ids) for ids in tokenizer(texts, add_special_tokens=not chat)["input_ids"]]
    return out


def start_episodes(tokenizer, questions, run_seed: int, step: int, group_size: int = 1) -> list:
    """G = group_size lines per question (dicts with id, question, golden_answers), keyed by
    (seed, step, uid, line)."""
    chat = bool(getattr(tokenizer, "chat_template", None))
    episodes = []
    for i, q in enumerate(questions):
        missing = [k for k in ("id", "question", "golden_answers") if k not in q]
        if missing:
            raise ValueError(f"question {i}: missing field(s) {missing}")
        uid, gold = stable_id(str(q["id"])), q["golden_answers"]
        # the same row twice in one step (epoch wrap): distinct keys for each occurrence
        if q.get("occurrence"):
            uid = mix(uid, q["occurrence"])
        prompt = _encode(tokenizer, render_prompt(tokenizer, q["question"]), chat)
        for line in range(group_size):
            episodes.append(
                Episode(uid=uid, line=line, key=episode_key(run_seed, step, uid, line),
                        question=q["question"],
                        golden_answers=[gold] if isinstance(gold, str) else list(gold),
                        prompt_ids=list(prompt)))
    return episodes


def step_prompts(rows: list, prompts_per_step: int, seed: int, step: int, rank: int = 0,
                 world: int = 1) -> list:
    """This rank's share of the step's prompts: epoch-wise permutations seeded by
    mix(seed, epoch), so any step's batch is known without replaying the run (exact resume). A row
    drawn twice in one step (epoch wrap on small data) carries its occurrence number, so its two
    groups get different keys."""
    n, k0 = len(rows), step * prompts_per_step
    perms, batch, seen = {}, [], {}
    for k in range(k0, k0 + prompts_per_step):
        epoch, i = divmod(k, n)
        if epoch not in perms:
            perms[epoch] = np.random.default_rng(mix(seed, epoch)).permutation(n)
        row = rows[perms[epoch][i]]
        seen[id(row)] = seen.get(id(row), -1) + 1
        batch.append(dict(row, occurrence=seen[id(row)]) if seen[id(row)] else row)
    return batch[rank::world]


def _format_docs(docs) -> str:
    # lazy: the retriever module brings its encoder / FAISS dependencies
    from retriever import format_docs
    return format_docs(docs)


def _add_turn(ep, gen, tokenizer) -> Turn:
    """Append a sampled turn (mask 1) and parse its first action."""
    text = tokenizer.decode(gen.ids, skip_special_tokens=False)
    action, content = parse_action(text)
    start = len(ep.ids)
    turn = Turn(start, start + len(gen.ids), start + len(gen.ids), start + len(gen.ids), text,
                action, content, (), gen.logprobs, gen.entropy, gen.key, gen.stop)
    # DEVIATION R4: an EOS ending the turn stays, as sampled (Search-R1's re-encode drops it)
    ep.ids += gen.ids
    ep.mask += [1] * len(gen.ids)
    # a fork's given first tokens were sampled by its factual episode
    ep.n_generated += len(gen.ids) - gen.given
    ep.turns.append(turn)
    return turn


def _add_observation(ep, turn, tokenizer, text: str, proto):
    """Observation tokens (mask 0), tokenised alone and cut to max_obs_tokens (Search-R1's
    max_obs_length)."""
    room = proto.max_context - len(ep.prompt_ids) - len(ep.ids)
    ids = tokenizer(text,
                    add_special_tokens=False)["input_ids"][:max(0, min(proto.max_obs_tokens, room))]
    turn.obs_start, turn.obs_end = len(ep.ids), len(ep.ids) + len(ids)
    ep.ids += ids
    ep.mask += [0] * len(ids)


def agent_text(ep) -> str:
    """What the agent itself wrote: its sampled turns, without any observation or
    invalid-action message."""
    return "".join(turn.text for turn in ep.turns)


def finish(ep, tokenizer):
    """End the episode: answer and reward from the agent's own text (the training reward is the
    evaluation's).

    DEVIATION R5: Search-R1 scores prompt + response, so an `<answer>` inside a retrieved document
    or the invalid-action message ("... between <answer> and </answer> ...") counts as the agent's
    answer; here only sampled tokens do (tested: neither can earn a reward or be recorded as the
    answer)."""
    text = agent_text(ep)
    ep.answer, ep.reward, ep.done = extract_answer(text), reward(text, ep.golden_answers), True


def execute_turn(tokenizer, retriever, episodes, gens, proto):
    """Append each sampled turn and execute its action; searches of all episodes go to the
    retriever at once."""
    searches = []
    for ep, gen in zip(episodes, gens):
        turn = _add_turn(ep, gen, tokenizer)
        # the final turn executes nothing
        if turn.action == "answer" or len(ep.turns) > proto.max_turns:
            finish(ep, tokenizer)
        elif turn.action == "search":
            searches.append((ep, turn))
        else:
            _add_observation(ep, turn, tokenizer, INVALID_ACTION_MSG, proto)
    if searches:
        # DEVIATION R2: an over-long query is cut to max_query_chars before retrieval.
        docs = retriever.search([turn.content[:proto.max_query_chars] for _, turn in searches],
                                topk=proto.topk)
        for (ep, turn), hits in zip(searches, docs):
            turn.doc_ids = tuple(str(d["id"]) for d in hits)
            _add_observation(ep, turn, tokenizer, information_block(_format_docs(hits)), proto)
    for ep in episodes:
        if not ep.done and len(ep.prompt_ids) + len(ep.ids) >= proto.max_context:
            # DEVIATION R3: the context is full: the episode ends, no left truncation
            finish(ep, tokenizer)


def step_turn(model, tokenizer, retriever, episodes, proto):
    """One turn for every episode not done: batched keyed generation, then the actions."""
    live = [ep for ep in episodes if not ep.done]
    for ep in live:
        # e.g. a prompt longer than max_context
        if proto.max_context - len(ep.prompt_ids) - len(ep.ids) <= 0:
            finish(ep, tokenizer)
    live = [ep for ep in live if not ep.done]
    if live:
        execute_turn(tokenizer, retriever, live, generate_turn(model, tokenizer, live, proto),
                     proto)
    return episodes


def factual_episodes(model, tokenizer, retriever, questions, proto, run_seed: int, step: int,
                     group_size: int, release=False) -> list:
    """TWICE's step 1 and GRPO's rollout: group_size factual lines per question, run to the end."""
    episodes = start_episodes(tokenizer, questions, run_seed, step, group_size)
    return run_episodes(model, tokenizer, retriever, episodes, proto, release=release)


def run_episodes(model, tokenizer, retriever, episodes, proto, release=False):
    """Step all episodes until every one is done (at most max_turns + 1 turns each); with release,
    an episode's KV cache is dropped as soon as it is done (nothing will branch from it). Under a
    live-KV budget (proto.kv_budget_gib) each turn is taken by the episodes that fit
    (generation/kvbudget.py: the others wait, the same tokens)."""
    cap = kvbudget.limit(model, proto)
    while any(not ep.done for ep in episodes):
        turn = episodes if cap is None else kvbudget.schedule(episodes, proto, cap)
        step_turn(model, tokenizer, retriever, turn, proto)
        if release:
            release_caches([ep for ep in episodes if ep.done])
    return episodes


def release_caches(episodes):
    """Drop each episode's KV cache (engine.KVEntry: what its next turn or a branch would start
    from); memory (DESIGN.md section 10). Nothing else changes: a branch taken afterwards prefills
    its context again."""
    for ep in episodes:
        ep._kv = None


# --- twins and Monte Carlo continuations (DESIGN.md section 5) ---
def branch(ep, turn: int, include_turn=False, key_overrides=None, fresh_seed=None,
           fork=None) -> Episode:
    """A new episode in state s_t (the factual prefix before `turn`), or after it with include_turn.

    Keys: the parent's for the kept turns; key_overrides on top; with fresh_seed, every turn from
    the branch point on (turn, or turn + 1 with include_turn) not overridden uses
    turn_key(fresh_seed, t). fork: how its next turn starts (rows.TurnStart: given first tokens, a
    fork token's key and ban).
    """
    if not 0 <= turn < len(ep.turns):
        raise ValueError(f"branch: turn {turn} outside the episode's {len(ep.turns)} turns")
    cut = ep.turns[turn].obs_end if include_turn else ep.turns[turn].start
    start = turn + int(include_turn)
    overrides = {t: k for t, k in ep.key_overrides.items() if t < start}
    overrides.update(key_overrides or {})
    new = Episode(uid=ep.uid, line=ep.line, key=ep.key, question=ep.question,
                  golden_answers=ep.golden_answers, prompt_ids=ep.prompt_ids, ids=ep.ids[:cut],
                  mask=ep.mask[:cut], turns=list(ep.turns[:start]), key_overrides=overrides,
                  fresh_seed=ep.fresh_seed if fresh_seed is None else fresh_seed,
                  fresh_from=ep.fresh_from if fresh_seed is None else start,
                  branch_turn=turn, fork=fork)
    # the cached engine starts the branch from its parent's cache
    new._kv = getattr(ep, "_kv", None)
    # the turn ended the episode: nothing left to sample
    if include_turn and start == len(ep.turns) and ep.done:
        new.answer, new.reward, new.done = ep.answer, ep.reward, True
    return new


@dataclass
class Decisions:
    """Every (episode, turn) decision of a batch, the budget rule's inputs (DESIGN.md section 5)."""
    index: list             # (episode i, turn t) pairs, episode-major
    features: object        # (n, F) discordance-predictor features (credit.featurize)
    cost: object            # (n,) c_t: tokens of y_t and of every factual token sampled after it


def decision_table(episodes, group_success, from_turn: int = 0) -> Decisions:
    """c_t counts what a twin from s_t is predicted to generate: y_t and the factual turns after
    it. from_turn: only the decisions at turns >= it (late branching)."""
    index, cost = [], []
    cols = {k: [] for k in ("turn", "action", "entropy", "group_success", "outcome",
                            "turns_remaining")}
    for i, ep in enumerate(episodes):
        for t, turn in enumerate(ep.turns[from_turn:], from_turn):
            index.append((i, t))
            cols["turn"].append(t)
            cols["action"].append(turn.action)
            cols["entropy"].append(float(np.mean(turn.entropy)) if turn.entropy else 0.0)
            cols["group_success"].append(group_success[i])
            cols["outcome"].append(ep.reward)
            cols["turns_remaining"].append(len(ep.turns) - 1 - t)
            cost.append(max(1, sum(u.end - u.start for u in ep.turns[t:])))
    return Decisions(index, credit.featurize(**cols), np.asarray(cost, dtype=np.float64))


@dataclass
class TwinResult:
    request: int        # index into run_twins' requests
    turn: int           # t
    j: int              # alternative index
    kind: str           # "self" | "same_evidence" | "rollout"
    outcome: float      # U' (the factual U when not rolled out)
    diff: float         # D_t = U - U'
    tokens: int         # tokens generated: the alternative turn (from the fork) + the continuation
    twin: Episode
    k: int | None = None  # token fork: the forked token's position in turn t; None: whole turn


def _same_evidence(factual: Turn, alt: Turn) -> bool:
    return (factual.action == alt.action == "search" and bool(alt.doc_ids)
            and alt.doc_ids == factual.doc_ids)


def turn_start(ep, t: int, n: int, key=None, ban=None) -> TurnStart:
    """rows.TurnStart of turn t with ep's first n tokens of it given (their sampled log-probs and
    entropies): a token fork at n (key, ban = y_t[n]) or, with neither, a continuation from
    position n."""
    turn = ep.turns[t]
    if not 0 <= n < turn.end - turn.start:
        raise ValueError(f"turn_start: token {n} outside turn {t}'s {turn.end - turn.start} tokens")
    return TurnStart(t, ep.ids[turn.start:turn.start + n], turn.logprobs[:n], turn.entropy[:n],
                     key, ban)


def run_twins(model, tokenizer, retriever, requests, proto, coupling=True,
              same_evidence_shortcut=True, independent=False, forks=None, chunk=0,
              release=False) -> list:
    """Twin of each (finished episode, turn t, j), all batched: y' ~ pi(. | s_t) with
    alt_key(key, t, j), then the factual keys for every later (turn, pos) (coupling) or fresh ones.
    Self-twins (y' == y_t token for token) and, with the shortcut, searches retrieving the same ids
    in the same order take D = 0 without a rollout.

    forks (twin_unit = token, DESIGN.md section 5): per request the token k of turn t to fork at.
    The twin keeps y_t[:k], draws its token k from pi(. | s_k) restricted to v != y_t[k] with
    alt_key(key, t, j) (at position k), then continues on the factual keys: turn t's from
    position k + 1 on, every later turn's. So E[D] = Q(s_k, y_k) - E_{v != y_k} Q(s_k, v): no
    self-twin and no rewording of the same decision.

    independent=True is the textbook independent counterfactual (method=independent): y' and every
    later turn use turn_key(fresh_key(key, INDEPENDENT_TAG, t, j), turn), every twin is rolled out
    (a self-twin too: its future noise is fresh, so it is not the factual episode) and the shortcut
    is off. coupling=False alone keeps the old ablation, which still scores self-twins and
    shortcuts as D = 0 (a coupled outcome).

    Memory (DESIGN.md section 10): chunk > 0 runs the requests in consecutive chunks of that many,
    each finished before the next begins, so only one chunk's twins hold KV caches at once (every
    draw is keyed: the same twins). release: a requested episode's cache is dropped once the twins
    of its last request are branched (they hold what they need), and each twin's once it is done.
    Under a live-KV budget a chunk holds at most half of it, and the caches later chunks branch
    from are dropped (the latest first) until it fits (generation/kvbudget.py).
    """
    out, c, cap = [], 0, kvbudget.limit(model, proto)
    last = {id(ep): i for i, (ep, _, _) in enumerate(requests)}
    while c < len(requests):
        part = _twin_chunk(requests, c, chunk, cap, proto)
        size = len(part)
        if cap is not None:  # the caches later chunks branch from make room for this one's twins
            now = {id(ep) for ep, _, _ in part}
            later = {id(ep): ep for ep, _, _ in requests[c + size:] if id(ep) not in now}
            kvbudget.trim(list(later.values()),
                          cap - sum(_twin_need(ep, t, proto) for ep, t, _ in part))
        ks = [None] * len(part) if forks is None else forks[c:c + size]
        twins = [_twin_branch(c + i, ep, t, j, k, coupling, independent)
                 for i, ((ep, t, j), k) in enumerate(zip(part, ks))]
        if release:
            release_caches([ep for ep, _, _ in part if last[id(ep)] < c + size])
        kinds = _run_twin_chunk(model, tokenizer, retriever, part, twins, proto,
                                same_evidence_shortcut, independent, release)
        out += [TwinResult(c + i, t, j, kind, tw.reward, ep.reward - tw.reward,
                           tw.n_generated, tw, k)
                for i, ((ep, t, j), kind, tw, k) in enumerate(zip(part, kinds, twins, ks))]
        c += size
    return out


def _twin_chunk(requests, c: int, chunk: int, cap, proto) -> list:
    """The requests of the chunk starting at c: `chunk` of them (0: all), and under a live-KV
    limit no more than fit in half of it (at least one)."""
    part = requests[c:c + chunk] if chunk else requests[c:]
    if cap is None:
        return part
    used = 0
    for i, (ep, t, _) in enumerate(part):
        used += _twin_need(ep, t, proto)
        if i and used > cap // 2:
            return part[:i]
    return part


def _twin_need(ep, t: int, proto) -> int:
    """Positions of a twin of (ep, t)'s entry after its first turn, at most."""
    return kvbudget.need(ep, proto, len(ep.prompt_ids) + ep.turns[t].start)


def _twin_branch(i, ep, t, j, k, coupling, independent) -> Episode:
    """The j-th twin of (episode, turn t): its alternative turn's key and the keys after it; k: a
    token fork at token k of turn t (None: the whole turn is drawn again)."""
    if not ep.done:
        raise ValueError(f"request {i}: twins branch from finished episodes")
    if independent:
        return branch(
            ep, t, fresh_seed=fresh_key(ep.key, INDEPENDENT_TAG, t, j),
            fork=None if k is None else turn_start(ep, t, k, ban=ep.ids[ep.turns[t].start + k]))
    fresh = None if coupling else fresh_key(ep.key, UNCOUPLED_TAG, t, j)
    if k is None:
        return branch(ep, t, key_overrides={t: alt_key(ep.key, t, j)}, fresh_seed=fresh)
    start = turn_start(ep, t, k, alt_key(ep.key, t, j), ep.ids[ep.turns[t].start + k])
    return branch(ep, t, fresh_seed=fresh, fork=start)


def _run_twin_chunk(model, tokenizer, retriever, requests, twins, proto, same_evidence_shortcut,
                    independent, release) -> list:
    """y' for every twin at once, then the rolled-out twins to their end; returns each twin's
    kind."""
    gens = generate_turn(model, tokenizer, twins, proto) if twins else []
    kinds, live = [], []
    for (ep, t, _), twin, gen in zip(requests, twins, gens):
        fact = ep.turns[t]
        if gen.ids == ep.ids[fact.start:fact.end] and not independent:
            _add_turn(twin, gen, tokenizer)
            kinds.append("self")
        else:
            live.append((twin, gen))
            kinds.append("rollout")
    execute_turn(tokenizer, retriever, [tw for tw, _ in live], [g for _, g in live], proto)
    for i, (ep, t, _) in enumerate(requests):
        shortcut = same_evidence_shortcut and not independent
        if kinds[i] == "rollout" and shortcut and _same_evidence(ep.turns[t], twins[i].turns[t]):
            kinds[i] = "same_evidence"
        if kinds[i] != "rollout":
            twins[i].answer, twins[i].reward, twins[i].done = ep.answer, ep.reward, True
    rolled = [tw for tw, kind in zip(twins, kinds) if kind == "rollout"]
    if release:
        release_caches([tw for tw, kind in zip(twins, kinds) if kind != "rollout"])
    run_episodes(model, tokenizer, retriever, rolled, proto, release=release)
    return kinds


def continue_from(model, tokenizer, retriever, requests, proto) -> list:
    """Monte Carlo rollouts from turn boundaries: requests of (episode, turn, include_turn, seed),
    all batched.

    include_turn=True: from just after turn t (a sample of Q(s_t, y_t)); False: from s_t (V(s_t)).
    The noise of every sampled turn uses turn_key(seed, turn): e.g.
    seed = fresh_key(ep.key, MC_Q_TAG, t, k) for the k-th.
    """
    branches = [branch(ep, t, include_turn=inc, fresh_seed=seed) for ep, t, inc, seed in requests]
    return run_episodes(model, tokenizer, retriever, branches, proto)


def continue_after_token(model, tokenizer, retriever, requests, proto) -> list:
    """Rollouts from just after token k of turn t (a sample of Q(s_k, y_k)): requests of (episode,
    t, k, seed), all batched; turn t's later tokens and every later turn use turn_key(seed, turn)
    (after its last token: the turn boundary, as continue_from with include_turn)."""
    branches = []
    for ep, t, k, seed in requests:
        if k == ep.turns[t].end - ep.turns[t].start - 1:
            branches.append(branch(ep, t, include_turn=True, fresh_seed=seed))
        else:
            branches.append(branch(ep, t, fresh_seed=seed, fork=turn_start(ep, t, k + 1)))
    return run_episodes(model, tokenizer, retriever, branches, proto)


def observation_of(turn: Turn):
    """What the environment showed after a turn: the retrieved ids of an executed search,
    "invalid" for Search-R1's invalid-action message, None when nothing was appended (an answer,
    or the final turn)."""
    if turn.doc_ids:
        return turn.doc_ids
    return "invalid" if turn.obs_end > turn.obs_start else None


def evidence_states(ep) -> list:
    """GiGPO/HGPO state of each turn t: (uid, observations of turns 0..t-1), the prompt's state
    for t = 0.

    The environment state of a search episode is the evidence it has been shown; the agent's own
    words (thoughts, query wording) are the policy's, not the environment's, as GiGPO's ALFWorld
    anchors are the environment's observations, not the agent's text. Two lines that retrieved the
    same ids in the same order share a state.
    """
    obs = [observation_of(turn) for turn in ep.turns]
    return [(ep.uid, tuple(obs[:t])) for t in range(len(ep.turns))]


def mask_shared_prefix(ep) -> int:
    """Loss mask 0 on a tree branch's tokens before its branch turn (they are its parent's,
    trained in the parent's row): each shared token enters the loss once. Returns how many sampled
    tokens were masked."""
    if ep.branch_turn is None:
        return 0
    cut = ep.turns[ep.branch_turn].start if ep.branch_turn < len(ep.turns) else len(ep.ids)
    masked = sum(ep.mask[:cut])
    ep.mask[:cut] = [0] * cut
    return masked


def collate(episodes, pad_id: int, max_context: int | None = None) -> dict:
    """Right-padded prompt + response: input_ids, attention_mask, loss_mask (1 on sampled tokens)
    (B, L) and response_start (B,) (the prompt length, where response position 0 sits).

    With max_context, a row longer than it is refused: every pass over the batch (old policy,
    reference, update) is then bounded by it; a prompt of 15k tokens once tried to allocate 9 GB in
    the log-prob pass."""
    rows = [ep.prompt_ids + ep.ids for ep in episodes]
    if max_context is not None:
        over = [(b, len(row)) for b, row in enumerate(rows) if len(row) > max_context]
        if over:
            b, n = over[0]
            raise ValueError(
                f"collate: {len(over)} row(s) longer than max_context={max_context} (row {b}, "
                f"question {episodes[b].question[:60]!r}...: {len(episodes[b].prompt_ids)} prompt "
                f"+ {len(episodes[b].ids)} response = {n} tokens); over-long prompts are refused "
                "when the QA file is loaded (eval.refuse_long_prompts)")
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (B, L)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, (ep, row) in enumerate(zip(episodes, rows)):
        assert len(ep.mask) == len(ep.ids), f"episode {b}: mask and ids differ in length"
        input_ids[b, :len(row)] = torch.tensor(row, dtype=torch.long)
        attention_mask[b, :len(row)] = 1
        loss_mask[b, len(ep.prompt_ids):len(row)] = torch.tensor(ep.mask, dtype=torch.long)
    response_start = torch.tensor([len(ep.prompt_ids) for ep in episodes], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask,
            "response_start": response_start}


def turn_spans(episodes) -> list:
    """Per episode, (start, end) of each turn's sampled tokens in collate's rows (the response
    follows the prompt)."""
    return [[(len(ep.prompt_ids) + t.start, len(ep.prompt_ids) + t.end) for t in ep.turns]
            for ep in episodes]


# python rollout.py replay ...: the same as python -m lab.replay ... (lab/replay.py)
if __name__ == "__main__":
    import runpy
    import sys
    if sys.argv[1:2] != ["replay"]:
        print("usage: python rollout.py replay --run DIR --step N --uid U --line L "
              "[--twin T | --twins]\n\n"
              "Re-sample one logged training episode from its checkpoint and print it "
              "(lab/replay.py; python rollout.py replay --help lists every option).")
        raise SystemExit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    sys.argv = ["rollout.py replay"] + sys.argv[2:]
    runpy.run_module("lab.replay", run_name="__main__", alter_sys=True)
