"""The stop rule of a turn (DESIGN.md section 3): a turn ends right after the first `</search>` or
`</answer>` in its decoded text (protocol.STOP_STRINGS), at EOS, or at its token budget; the rule
exactly as the host checks it (TurnStopper for model.generate, StopRule.reason for the cached
engine), and as tables the device looks up.

Both stop strings end with ">", so a stop can only complete on a token whose text contains ">" (true
for byte-level BPE, sentencepiece byte fallback, word-level): only then is a row's turn decoded, in
full, so tags split across tokens are found exactly where the decoded text first contains them. On
the device (generation/engine.py's decode step, no host sync) a string-matching automaton over the
tokens' own texts marks the token that completes a stop string, so a row freezes there; the host
still applies the exact rule to every token it reads back.

It knows no model and no episode: token ids and a tokenizer in, stop reasons and tables out.
"""
import weakref

import numpy as np
import torch
from transformers import StoppingCriteria

from protocol import STOP_STRINGS

_GT_TOKENS = weakref.WeakKeyDictionary()  # tokenizer -> {token id: its decoded text contains ">"}


class TurnStopper(StoppingCriteria):
    """Ends a row right after the first `</search>` / `</answer>` in the decoded text of its turn,
    at EOS, or at its own token budget; keeps TurnStopper.length / .reason per row and tells the
    processor which rows still run.

    Both stop strings end with ">", so a stop can only complete on a token whose text contains ">"
    (true for byte-level BPE, sentencepiece byte fallback, word-level): only then is the row's turn
    decoded, in full, so tags split across tokens are found exactly where the decoded text first
    contains them.
    """

    def __init__(self, tokenizer, start_len: int, budgets, eos_ids, processor=None, heads=None):
        (self.tokenizer, self.start_len,
         self.budgets, self.processor) = tokenizer, start_len, list(budgets), processor
        # given turn tokens before start_len
        self.heads = list(heads) if heads is not None else [0] * len(budgets)
        # generate pads finished rows when a criterion has this attribute
        self.eos_token_id = list(eos_ids)
        self.length, self.reason = [None] * len(budgets), [None] * len(budgets)
        self.live = list(range(len(budgets)))
        self.done = None
        try:
            self.gt = _GT_TOKENS.setdefault(tokenizer, {})
        except TypeError:  # tokenizer not weak-referenceable
            self.gt = {}

    def _has_gt(self, tok: int) -> bool:
        # ids past the tokenizer (padded embedding rows, e.g. Qwen2.5) have no text
        if tok not in self.gt:
            self.gt[tok] = (tok < len(self.tokenizer)
                            and ">" in self.tokenizer.decode([tok], skip_special_tokens=False))
        return self.gt[tok]

    def _stops(self, row_ids, b: int = 0) -> bool:
        text = self.tokenizer.decode(row_ids[self.start_len - self.heads[b]:].tolist(),
                                     skip_special_tokens=False)
        return any(s in text for s in STOP_STRINGS)

    def __call__(self, input_ids, scores, **kwargs):
        n = input_ids.shape[1] - self.start_len  # tokens generated so far
        last = input_ids[:, -1].tolist()
        ended = []
        for b in self.live:
            if self._has_gt(last[b]) and self._stops(input_ids[b], b):
                self.reason[b] = "stop"
            elif last[b] in self.eos_token_id:
                self.reason[b] = "eos"
            elif n + self.heads[b] >= self.budgets[b]:
                self.reason[b] = "length"
            else:
                continue
            self.length[b] = n
            ended.append(b)
        if self.done is None:
            self.done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if ended:
            self.done[ended] = True
            self.live = [b for b in self.live if self.reason[b] is None]
            if self.processor is not None:
                self.processor.rows = torch.tensor(self.live, dtype=torch.long,
                                                   device=input_ids.device)
        return self.done.clone()


# --- on the device: a string-matching automaton over the tokens' own texts ---
_TEXTS = weakref.WeakKeyDictionary()  # tokenizer -> {vocab: [text of each id]}


def _vocab_texts(tokenizer, vocab: int) -> list:
    """The decoded text of every id below vocab ("" past the tokenizer: padded embedding rows
    have no text)."""
    try:
        cached = _TEXTS.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable
        cached = {}
    if vocab not in cached:
        n = min(vocab, len(tokenizer))
        cached[vocab] = ([tokenizer.decode([i], skip_special_tokens=False) for i in range(n)]
                         + [""] * (vocab - n))
    return cached[vocab]


def stop_automaton(texts, patterns=STOP_STRINGS):
    """(next_state (Q, V) int64, hit (Q, V) bool, states): state = the longest suffix of the
    turn's text so far (tokens' texts concatenated) that is a proper prefix of a pattern; hit: a
    pattern ends inside the token's text.

    A stop found in the decoded text is found here too for byte-level BPE, sentencepiece and
    word-level tokenizers (a pattern is ASCII without spaces, so decoding a sequence only adds
    spaces or replacement characters around it); the host checks every hit, and every '>' token,
    exactly (TurnStopper's rule), so this only decides how early a row freezes, never which tokens
    a row gets."""
    states = sorted({p[:i] for p in patterns for i in range(len(p))}, key=lambda s: (len(s), s))
    index, longest = {s: q for q, s in enumerate(states)}, max(map(len, patterns))
    # a pattern's end, starting inside a state
    tails = tuple(p[i:] for p in patterns for i in range(1, len(p)))
    pieces = {p[i:j] for p in patterns for i in range(len(p)) for j in range(i + 1, len(p) + 1)}
    firsts = {p[0] for p in patterns}

    def step(s):
        hit = any(p in s for p in patterns)
        return next((index[s[-n:]] for n in range(min(len(s), longest - 1), 0, -1)
                     if s[-n:] in index), 0), hit

    nxt = np.zeros((len(states), len(texts)), dtype=np.int64)
    hits = np.zeros((len(states), len(texts)), dtype=bool)
    for v, t in enumerate(texts):
        if not t:
            nxt[:, v] = np.arange(len(states))  # no text: the state carries over
        elif t in pieces or t.startswith(tails):  # the state before it matters
            for q, s in enumerate(states):
                nxt[q, v], hits[q, v] = step(s + t)
        elif firsts & set(t):
            nxt[:, v], hits[:, v] = step(t)
    return nxt, hits, states


class StopRule:
    """TurnStopper's rule for one row on the host, and its tables for the device (Decoder):
    the automaton, and EOS."""

    def __init__(self, tokenizer, eos, vocab: int, device):
        self.tokenizer, self.eos = tokenizer, set(eos)
        texts = _vocab_texts(tokenizer, vocab)
        self.gt = np.array([">" in t for t in texts])
        # text-line keys
        self.newline = torch.tensor(["\n" in t for t in texts], dtype=torch.bool, device=device)
        self.next_state, self.hit, _ = stop_automaton(texts)
        is_eos = torch.zeros(vocab, dtype=torch.bool)
        is_eos[[e for e in eos if e < vocab]] = True
        self.tables = (torch.from_numpy(self.next_state.ravel()).to(device),
                       torch.from_numpy(self.hit.ravel()).to(device), is_eos.to(device))

    def reason(self, row, tok: int):
        """A stop string in the decoded turn (only a '>' token can complete one), EOS, or the
        budget: that order."""
        if self.gt[tok] and any(s in self.tokenizer.decode(row.ids, skip_special_tokens=False)
                                for s in STOP_STRINGS):
            return "stop"
        if tok in self.eos:
            return "eos"
        return "length" if len(row.ids) >= row.budget else None

    def state(self, ids) -> int:
        q = 0
        for tok in ids:
            q = int(self.next_state[q, tok])
        return q


_RULES = weakref.WeakKeyDictionary()  # tokenizer -> {(vocab, eos, device): StopRule}


def stop_rule(tokenizer, eos, vocab: int, device) -> "StopRule":
    """The StopRule of (tokenizer, eos ids, model vocabulary, device), built once."""
    key = (vocab, tuple(eos), str(device))
    try:
        held = _RULES.setdefault(tokenizer, {})
    except TypeError:
        held = {}
    if key not in held:
        held[key] = StopRule(tokenizer, eos, vocab, device)
    return held[key]
