"""Decision-token forks (DESIGN.md section 5, `twin_unit = "token"`): which token of a turn a
twin forks at, what that token is credited, and the audit's token-fork rows.

A realistic turn is mostly filler: a chains turn is ~62 tokens, of which the decision is one or two
(the stop word Next / So, the name searched). Re-sampling the turn whole (the paper's unit) never
reproduces y_t and mostly rewords the same decision. A token fork keeps y_t[:k], draws token k from
pi(. | s_k) restricted to v != y_k with the alternative key and continues on the factual keys
(rollout.run_twins(forks=...)), so
    E[D | s_k, y_k] = Q(s_k, y_k) - E_{v != y_k} Q(s_k, v),
    (1 - pi_k) D  is unbiased for  Q(s_k, y_k) - V(s_k).
Which token: the fork law of a decision over its n_t tokens, with a floor so that every token can
be drawn,
    w_k = p_k (1 - pi_k),   r_t(k) = floor / n_t + (1 - floor) w_k / sum_k w_k
(uniform where every w_k = 0), p_k the predicted P(D != 0 | fork at k) (credit.DiscordancePredictor
on TOKEN_FEATURES, learnt online from the forks' 1[D != 0]). The budget rule sees a turn as a
whole-turn twin would: p_t = sum_k r_t(k) p_k, c_t = sum_k r_t(k) (n_t - k + the factual tokens
after turn t). A branched turn draws k ~ r_t with a keyed uniform (sampler.FORK_TAG) and credits
token k alone (Horvitz-Thompson over both draws):
    A_hat_{t,k} = 1[branched] (1 - pi_k) mean_j D^j / (q_t r_t(k)),
    E[A_hat_{t,k} | s_k, y_k] = Q(s_k, y_k) - V(s_k).
Within a turn Q(s_k, y_k) = V(s_{k+1}), so sum_k (Q(s_k, y_k) - V(s_k)) = Q(s_t, y_t) - V(s_t): a
fork's turn-level estimate is (1 - pi_k) D / r_t(k). Its expectation is A*(s_t, y_t) when the
factual luck after token k is re-drawn (the audit's rows); given the factual turn's tokens after k,
it is not in general (the twin's later tokens of turn t replay keys that produced y_{>k}), which
the per-token policy gradient does not need (tests/test_forks.py).

It knows no model: episodes, token texts (a tokenizer's decode, cached) and arrays in; the rollouts
are rollout.py's.

Deviations (DESIGN.md section 13; tagged `# DEVIATION F<n>:` here and in twice.py):
  F1. twin_unit = token forks one token of the turn; the paper's twin re-samples the whole turn
      (twin_unit = turn, the default). Its token predictor learns from the fork tokens the law
      drew (no 1 / r importance weights), so its p_k is fitted where forks happen; r keeps a floor
      so every token is still drawn now and then.
  F2. The audit's token rows re-draw the factual luck after the fork token (not after the turn, as
      for whole-turn twins): only then is the mean of (1 - pi_k) D / r_t(k) the oracle's
      A*(s_t, y_t).
"""
import math
import re
import weakref
from typing import NamedTuple

import numpy as np

import credit
import rollout
import sampler

TOKEN_FEATURES = ("entropy", "surprisal", "position", "sentence_start", "is_tag", "in_think",
                  "in_search", "in_answer", "turn", "outcome", "group_success", "surprise",
                  "turns_remaining")
TAG = re.compile(r"</?(think|search|answer)>")
_TEXTS = weakref.WeakKeyDictionary()  # tokenizer -> {token id: decoded text}


def token_texts(tokenizer, ids) -> list:
    """The decoded text of each token alone (cached per tokenizer)."""
    try:
        table = _TEXTS.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable
        table = {}
    for i in set(ids) - table.keys():
        table[i] = tokenizer.decode([i], skip_special_tokens=False)
    return [table[i] for i in ids]


def token_columns(texts) -> np.ndarray:
    """(n, 5) per token of a turn: sentence_start (the first token, or after one whose text ends a
    sentence, a line or a tag), is_tag (its text overlaps a think/search/answer tag), and inside
    which tag it starts (one-hot think, search, answer; all 0 outside any). Tags are found in the
    concatenated token texts, so a tag split over several tokens counts."""
    ends = np.cumsum([len(x) for x in texts])
    starts = ends - np.array([len(x) for x in texts], dtype=np.int64)
    text = "".join(texts)
    out = np.zeros((len(texts), 5))
    # state: 0 outside, 1 think, 2 search, 3 answer; marks: (tag end offset, state after)
    state, marks = 0, []
    for m in TAG.finditer(text):
        state = (0 if m.group(0).startswith("</")
                 else ("think", "search", "answer").index(m.group(1)) + 1)
        marks.append((m.start(), m.end(), state))
    for k, (a, b) in enumerate(zip(starts, ends)):
        prev = texts[k - 1].rstrip(" ") if k else ""
        out[k, 0] = k == 0 or prev.endswith((".", "!", "?", ">", "\n"))
        out[k, 1] = any(s < b and a < e for s, e, _ in marks)
        inside = [st for _, e, st in marks if e <= a]
        if inside and inside[-1]:
            out[k, 1 + inside[-1]] = 1.0
    return out


class TokenTable(NamedTuple):
    """The tokens of every decision of a batch (decision n's are rows offsets[n]:offsets[n + 1])."""
    offsets: np.ndarray   # (n + 1,)
    features: np.ndarray  # (N, len(TOKEN_FEATURES))
    pi: np.ndarray        # (N,) pi(y_k | s_k) under the sampling law (the recorded log-probs)
    cost: np.ndarray      # (N,) twin tokens predicted for a fork at k: n_t - k + later factual ones


def token_table(episodes, decisions, tokenizer) -> TokenTable:
    """Features, pi and twin cost of every token of every decision;
    decisions = rollout.decision_table(...) of the same episodes (its decision-level columns are
    repeated on each token)."""
    col = {name: j for j, name in enumerate(credit.FEATURES)}
    feats, pi, cost, offsets = [], [], [], [0]
    for n, (i, t) in enumerate(decisions.index):
        ep, turn = episodes[i], episodes[i].turns[t]
        ids = ep.ids[turn.start:turn.end]
        m = len(ids)
        later = sum(u.end - u.start for u in ep.turns[t + 1:])
        d = decisions.features[n]
        lp = np.array(turn.logprobs, dtype=np.float64)
        f = np.zeros((m, len(TOKEN_FEATURES)))
        f[:, 0], f[:, 1], f[:, 2] = turn.entropy, -np.expm1(lp), np.arange(m) / max(m, 1)
        f[:, 3:8] = token_columns(token_texts(tokenizer, ids))
        f[:, 8:] = [d[col[c]] for c in ("turn", "outcome", "group_success", "surprise",
                                        "turns_remaining")]
        feats.append(f)
        pi.append(np.exp(lp))
        cost.append(m - np.arange(m) + later)
        offsets.append(offsets[-1] + m)
    empty = np.zeros((0, len(TOKEN_FEATURES)))
    return TokenTable(np.array(offsets),
                      np.concatenate(feats) if feats else empty,
                      np.concatenate(pi) if pi else np.zeros(0),
                      np.concatenate(cost).astype(np.float64) if cost else np.zeros(0))


class ForkLaw(NamedTuple):
    r: np.ndarray           # (N,) r_t(k) of each token, summing to 1 over each decision's tokens
    p: np.ndarray           # (n,) p_t = sum_k r_t(k) p_k, the turn's discordance (budget rule)
    cost: np.ndarray        # (n,) c_t = sum_k r_t(k) cost_k, its expected twin tokens (budget rule)


def fork_law(table: TokenTable, p_tok, floor: float) -> ForkLaw:
    """r_t(k) = floor / n_t + (1 - floor) w_k / sum w, w_k = p_k (1 - pi_k); uniform over a turn
    whose w are all 0."""
    if not 0 < floor <= 1:
        raise ValueError(f"fork_floor must lie in (0, 1], got {floor}")
    p_tok = credit.as_array(p_tok).reshape(-1)
    w = p_tok * (1 - table.pi)
    n = len(table.offsets) - 1
    seg = np.repeat(np.arange(n), np.diff(table.offsets))
    size = np.diff(table.offsets).astype(np.float64)
    total = np.bincount(seg, w, minlength=n)
    share = np.where(total[seg] > 0, w / np.where(total[seg] > 0, total[seg], 1.0), 1.0 / size[seg])
    r = floor / size[seg] + (1 - floor) * share
    return ForkLaw(r, np.bincount(seg, r * p_tok, minlength=n),
                   np.bincount(seg, r * table.cost, minlength=n))


def draw_fork(r, u: float) -> int:
    """k ~ r (one decision's fork law) by inversion of the keyed uniform u in [0, 1)."""
    return int(min(np.searchsorted(np.cumsum(r), u, side="right"), len(r) - 1))


def fork_uniform(*key: int) -> float:
    """Keyed uniform of a fork draw, e.g. key = (run seed, step, uid, line, turn): independent of
    every other draw."""
    return sampler.mix(*key, sampler.FORK_TAG) / 2.0 ** 64


def fork_credit(diffs, branched, q, r_k, pi_k) -> np.ndarray:
    """(n,) A_hat = 1[branched] (1 - pi_k) mean_j D^j / (q_t r_t(k)) of each decision's fork
    token k (0 unbranched; r_k, pi_k of an unbranched decision are not read)."""
    a = credit.ht_credit(diffs, branched, q)  # mean_j D / q
    b = np.asarray(branched, dtype=bool).reshape(-1)
    a[b] *= (1 - credit.as_array(pi_k).reshape(-1)[b]) / credit.as_array(r_k).reshape(-1)[b]
    return a


# --- the audit's token-fork rows (lab/audit.py --token_forks) ---
def audit_decisions(raw) -> "rollout.Decisions":
    """rollout.Decisions of the audited decisions, in audit order: the audited episode's turn and
    outcome, group success over it and every repeat's fresh lines."""
    episodes = raw["episodes"]
    success = [(ep.reward + raw["lines"][i][..., 0].sum()) / (1 + raw["lines"][i][..., 0].size)
               for i, ep in enumerate(episodes)]
    table = rollout.decision_table(episodes, success)
    where = {pair: n for n, pair in enumerate(table.index)}
    rows = [where[d] for d in raw["decisions"]]
    return rollout.Decisions([table.index[n] for n in rows], table.features[rows], table.cost[rows])


def fork_rows(model, tok, retr, raw, cfg, proto, law: ForkLaw, table: TokenTable, tag: int,
              batched) -> dict:
    """One token-fork twin per (decision, repeat r): k ~ r_t (keyed uniform (seed, tag, n, r)), the
    factual luck re-drawn after token k (rollout.continue_after_token,
    seed fresh_key(key, FORK_TAG, tag, t, r)), the twin forked at k with alt_key(key, t, r) on that
    re-rolled episode's keys
    (run_twins without the same-evidence shortcut; `same` says where it would fire, as audit.twins
    does for whole-turn twins). (N, R) arrays: k, r_t(k), pi_k, the re-rolled U, D, twin tokens,
    tokens of the forked turn from k, same, and the later-token agreement counts."""
    decisions, episodes, R = raw["decisions"], raw["episodes"], cfg.repeats
    # DEVIATION F2: the luck after token k is re-drawn, so the estimate's mean is A*
    # (given y_t whole it is not)
    ks = np.zeros((len(decisions), R), dtype=np.int64)
    for n in range(len(decisions)):
        lo, hi = table.offsets[n], table.offsets[n + 1]
        ks[n] = [draw_fork(law.r[lo:hi], fork_uniform(cfg.seed, tag, n, r)) for r in range(R)]
    reqs = [(episodes[i], t, int(ks[n, r]),
             sampler.fresh_key(episodes[i].key, sampler.FORK_TAG, tag, t, r), r)
            for n, (i, t) in enumerate(decisions) for r in range(R)]

    def run(chunk):
        facts = rollout.continue_after_token(model, tok, retr, [q[:4] for q in chunk], proto)
        twins = rollout.run_twins(model, tok, retr,
                                  [(f, t, r) for f, (_, t, _, _, r) in zip(facts, chunk)], proto,
                                  same_evidence_shortcut=False,
                                  forks=[k for _, _, k, _, _ in chunk])
        return [(f.reward, x.diff, x.tokens, x.twin.turns[t].end - x.twin.turns[t].start - k,
                 rollout._same_evidence(f.turns[t], x.twin.turns[t]),
                 *later_agreement(f, x.twin, t, k))
                for f, x, (_, t, k, _, _) in zip(facts, twins, chunk)]

    x = np.array(batched(run, reqs, cfg, f"token forks {tag}"),
                 dtype=np.float64).reshape(len(decisions), R, 7)
    flat = table.offsets[:-1, None] + ks
    return {"k": ks, "r": law.r[flat], "pi": table.pi[flat], "u": x[..., 0], "d": x[..., 1],
            "tokens": x[..., 2], "alt_tokens": x[..., 3], "same_evidence": x[..., 4] > 0,
            "agree": x[..., 5], "compared": x[..., 6]}


def later_agreement(fact, twin, t: int, k=None) -> tuple:
    """(tokens equal at the same position, positions compared) over what follows the decision:
    turn t after token k (token forks) and every later turn both episodes have, each turn compared
    up to the longer of the two."""
    same = total = 0
    for u in range(t if k is not None else t + 1, min(len(fact.turns), len(twin.turns))):
        a = fact.ids[fact.turns[u].start:fact.turns[u].end]
        b = twin.ids[twin.turns[u].start:twin.turns[u].end]
        lo = k + 1 if u == t else 0
        same += sum(x == y for x, y in zip(a[lo:], b[lo:]))
        total += max(len(a), len(b)) - lo
    return same, total


def crossfit_tokens(table: TokenTable, first: dict, folds, floor: float) -> tuple:
    """p_k of every audited token from a token predictor fitted on the other folds' first-pass
    forks (their features and 1[D != 0]), its fork law, and that predictor's (AUC, Brier) on the
    first pass's own forks of each fold."""
    p = np.full(len(table.pi), math.nan)
    seg = np.repeat(np.arange(len(table.offsets) - 1), np.diff(table.offsets))
    flat = table.offsets[:-1, None] + first["k"]
    scores = []
    for f in np.unique(folds):
        pred = credit.DiscordancePredictor(buffer_size=max(4096, flat.size),
                                           features=TOKEN_FEATURES)
        train = folds != f
        pred.update(table.features[flat[train].ravel()],
                    (first["d"][train] != 0).ravel().astype(float))
        p[folds[seg] == f] = pred.predict(table.features[folds[seg] == f])
        scores.append((flat[~train].ravel(), (first["d"][~train] != 0).ravel()))
    idx = np.concatenate([i for i, _ in scores])
    y = np.concatenate([y for _, y in scores]).astype(float)
    return p, fork_law(table, p, floor), (credit.auc(p[idx], y), credit.brier(p[idx], y))


def audit_rows(model, tok, retr, raw, cfg, proto, batched) -> dict:
    """The audit's token forks, two passes over every (decision, repeat): the first with the prior
    fork law (every p_k = 1/2, so r_t ~ (1 - pi_k) with the floor), the second with p_k from a
    token predictor cross-fitted on the first pass's forks of the other half of the episodes (as
    the budgeted turn row's discordance is). Its AUC and Brier score are measured on the second
    pass's forks, which it never saw."""
    table = token_table(raw["episodes"], audit_decisions(raw), tok)
    prior = fork_law(table, np.full(len(table.pi), 0.5), cfg.fork_floor)
    first = fork_rows(model, tok, retr, raw, cfg, proto, prior, table, 1, batched)
    p, law, held_out = crossfit_tokens(table, first, np.array([i % 2 for i, _ in raw["decisions"]]),
                                       cfg.fork_floor)
    second = fork_rows(model, tok, retr, raw, cfg, proto, law, table, 2, batched)
    flat, y = table.offsets[:-1, None] + second["k"], (second["d"] != 0).astype(float)
    return {"table": table, "law": law, "first": first, "second": second, "p": p,
            "predictor": {"auc": credit.auc(p[flat], y), "brier": credit.brier(p[flat], y),
                          "auc_first_pass": held_out[0], "brier_first_pass": held_out[1]},
            "token_agreement": [float(x["agree"].sum() / max(x["compared"].sum(), 1))
                                for x in (first, second)]}


def fork_estimates(rows) -> tuple:
    """((N, R) turn-level estimates (1 - pi_k) D / r_t(k), (N, R) twin tokens) of a fork pass,
    with the trainer's same-evidence shortcut (D = 0 and only the forked turn's tokens from k where
    it fires; audit DEVIATION A2)."""
    d = np.where(rows["same_evidence"], 0.0, rows["d"])
    return ((1 - rows["pi"]) * d / rows["r"],
            np.where(rows["same_evidence"], rows["alt_tokens"], rows["tokens"]))
