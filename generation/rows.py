"""A turn call's rows and the noise address of each of their draws (DESIGN.md section 11,
"Row features").

generation/engine.py decodes rows; this file says where each row's turn starts and which
(key, position) each of its draws uses, the same in the generate path and the cached one:
  - a TurnStart (Episode.start_for(len(turns))) gives a row its turn's first tokens, so it starts
    drawing at position k, with a key of its own for that first draw and a token the draw may not
    take (rollout.run_twins' token forks, rollout.continue_after_token's continuations);
  - turn key at the position in the turn (the group reading of "line"), or with
    `proto.line_keys = "text"` (line_key(turn key, line), position in the line), a token whose
    text holds a newline ending its line.
It knows no model and no cache: episodes, a tokenizer's token texts and keys in, rows and noise
addresses out.
"""
import weakref
from dataclasses import dataclass, field

import torch

from sampler import _signed, line_key


@dataclass
class TurnStart:
    """How a row starts turn `turn`: its first len(ids) tokens are given (with the log-probs and
    entropies they were sampled with), so it starts drawing at position len(ids); that first draw
    uses `key` (None: the turn's) and never takes token `ban` (None: any token); every later draw
    uses the turn key. A token fork at k is TurnStart(t, y[:k], ..., alt key, y[k]); a continuation
    after token k is TurnStart(t, y[:k + 1], ...)."""
    turn: int
    ids: list
    logprobs: list
    entropy: list
    key: int | None = None
    ban: int | None = None


@dataclass
class Row:
    """A row of one turn call: its episode's context (a TurnStart's given tokens included), turn
    key, budget (for the whole turn), how it starts, the turn's tokens so far (the given ones
    first) and its text-line state."""
    i: int
    ctx: list
    key: int
    budget: int
    start: TurnStart | None = None
    given: int = 0          # len(start.ids): the first `given` ids are the TurnStart's
    ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    entropy: list = field(default_factory=list)
    newline: object = None  # text-line keys: token id -> its text holds a newline;
    #                         None: the group reading
    line: int = 0           # the text line of the next draw (newline is not None)
    line_pos: int = 0       # the next draw's position in that line
    track: tuple | None = None  # (KVEntry, m): its sequence is the entry's first m
    #                             tokens (no slot yet)
    slot: int = -1


_NL_TOKENS = weakref.WeakKeyDictionary()  # tokenizer -> {token id: its text holds a newline}


def newline_of(tokenizer):
    """tok -> whether its decoded text holds a newline (filled lazily, one table per tokenizer)."""
    try:
        table = _NL_TOKENS.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable
        table = {}

    def has(tok: int) -> bool:
        # ids past the tokenizer (padded embedding rows, e.g. Qwen2.5) have no text
        if tok not in table:
            table[tok] = (tok < len(tokenizer)
                          and "\n" in tokenizer.decode([tok], skip_special_tokens=False))
        return table[tok]
    return has


def make_rows(episodes, tokenizer, proto) -> list:
    """A Row per episode, in order: context, turn key, budget, TurnStart and the state after its
    given tokens."""
    newline = newline_of(tokenizer) if proto.line_keys == "text" else None
    rows = []
    for i, ep in enumerate(episodes):
        start = ep.start_for(len(ep.turns))
        ctx = ep.prompt_ids + ep.ids
        r = Row(i, ctx, ep.key_for(len(ep.turns)),
                min(proto.max_new_tokens, proto.max_context - len(ctx)), start, newline=newline)
        if start is not None:
            r.ctx, r.given = ctx + list(start.ids), len(start.ids)
            r.ids, r.logprobs, r.entropy = (list(start.ids), list(start.logprobs),
                                            list(start.entropy))
            for tok in start.ids:
                advance(r, tok)
        assert r.budget > r.given, "an episode without room for a token should have ended"
        rows.append(r)
    return rows


def advance(r, tok: int):
    """The text-line state after token tok (a token holding a newline ends its line)."""
    if r.newline is not None:
        r.line, r.line_pos = (r.line + 1, 0) if r.newline(tok) else (r.line, r.line_pos + 1)


def noise(r) -> tuple:
    """(key, position, banned token or -1) of r's next draw: (turn key, position in the turn), or
    with text-line keys (line_key(turn key, line), position in the line); a TurnStart's first draw
    with its own key (at the same position) and its ban."""
    key, pos = ((line_key(r.key, r.line), r.line_pos) if r.newline is not None
                else (r.key, len(r.ids)))
    if r.start is not None and len(r.ids) == r.given:
        return ((key if r.start.key is None else r.start.key), pos,
                (-1 if r.start.ban is None else r.start.ban))
    return key, pos, -1


def noise_ahead(r, tokens) -> list:
    """noise() of r's next len(tokens) + 1 draws, had it drawn `tokens` first (a tracking row
    drawing ahead on its cache's own tokens); r is left as it was."""
    saved, out = (len(r.ids), r.line, r.line_pos), []
    for tok in list(tokens) + [None]:
        out.append(noise(r))
        if tok is not None:
            r.ids.append(tok)
            advance(r, tok)
    del r.ids[saved[0]:]
    r.line, r.line_pos = saved[1:]
    return out


def keyer(rows, device):
    """The generate path's KeyedGumbelProcessor.keyer: each row's state advanced by the token it
    drew last (padding, after a row finished, only moves rows that draw nothing more)."""
    def keyer(input_ids, n):
        if n > 0:
            for r, tok in zip(rows, input_ids[:, -1].tolist()):
                r.ids.append(tok)
                advance(r, tok)
        keys, pos, ban = zip(*(noise(r) for r in rows))
        return (torch.tensor([_signed(k) for k in keys], device=device),
                torch.tensor(pos, device=device),
                torch.tensor(ban, device=device) if max(ban) >= 0 else None)
    return keyer
