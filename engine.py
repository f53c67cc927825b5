"""The generation engine: the next turn of many rows at once, every token a keyed draw (DESIGN.md section 11).

generate_turn(model, tokenizer, episodes, proto) samples one turn per episode. From an episode it reads only its
context (prompt_ids + ids), the key of its next turn (key_for(len(turns)), sampler.py), how that turn starts
(start_for(len(turns)): a TurnStart or None) and, for the cached engine, its KV cache (`_kv`); it returns a
Generation per row: the token ids exactly as sampled (no decode/re-encode), their log-probs and entropies, and why
the turn stopped: right after the first `</search>` or `</answer>` in its decoded text (protocol.STOP_STRINGS), at
EOS, or at its token budget. The noise keys are (turn key, position in the turn), so neither padding, batch
composition nor caching changes a token.

Row features (DESIGN.md section 11), the same in both paths: a TurnStart gives a row its turn's first tokens (it
starts at position k), a key of its own for the first token it draws and a token that draw may not take (a token
fork: rollout.run_twins with twin_unit = token); `proto.line_keys = "text"` keys every draw by the text line it
is in, restarting positions after each token that holds a newline (sampler.line_key).

Two paths, the same tokens (tested):
  cached (Protocol.engine = "cached", any transformers model): each episode keeps the KV cache of its context
    (a KVEntry); a turn feeds only what the cache lacks (the previous turn's last token and the observation),
    identical contexts in a call (a group's prompt) are prefilled once, a branch starts from its parent's cache,
    identical sequences share one decode row, and rows leave the decode batch as they finish while waiting rows
    take their slots (continuous batching): every context token goes through the model once per episode.
  generate (engine = "generate", or any object with only `generate`): left-padded `model.generate` calls with
    sampler.KeyedGumbelProcessor, each re-prefilling its whole context.
COUNTS adds up what each path spends (model positions, padding, row-steps) for bench.py.

It knows no reward, no retriever and no twins: it sees rows of token ids with keys and caches. What a turn means
(its action, its observation, a branch) is rollout.py's.

Deviations of the cached engine (DESIGN.md section 11; tagged `# DEVIATION P<n>:` below; P2 and P4 are logprobs.py's):
  P1. Logits from cached keys/values (or stored hidden states) equal re-prefilled ones up to float rounding, so a
      draw at an exact near-tie could differ from the generate path (none did in tests or benchmarks).
  P3. Each episode's cache lives as long as its Episode object (twins need it after the rollout); no host offload.
  P5. Slots refill within one turn's call only; turns stay a barrier (retrieval is batched per turn).
  P6. The keyed draw (the processor's own, same noise and law) runs in this engine's decode loop, not inside
      `model.generate` as DESIGN.md section 4 says.
"""
import contextlib
import types
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from protocol import STOP_STRINGS
from sampler import KeyedGumbelProcessor, _signed, line_key

# bench.py's cost measures, summed over both paths since the last reset: body positions (padding included), of
# which padding; sampling row-steps; sampled tokens; LM-head-only positions (rows repeating a cache's own tokens)
COUNTS = {"positions": 0, "padding": 0, "row_steps": 0, "tokens": 0, "head_only": 0}

_GT_TOKENS = weakref.WeakKeyDictionary()  # tokenizer -> {token id: its decoded text contains ">"}
_NL_TOKENS = weakref.WeakKeyDictionary()  # tokenizer -> {token id: its decoded text contains a newline}


@dataclass
class Generation:
    """A sampled turn before its action is executed."""
    ids: list
    logprobs: list
    entropy: list
    stop: str
    key: int
    given: int = 0          # its first `given` ids were given by a TurnStart, not sampled here


@dataclass
class TurnStart:
    """How a row starts turn `turn`: its first len(ids) tokens are given (with the log-probs and entropies they were
    sampled with), so it starts drawing at position len(ids); that first draw uses `key` (None: the turn key) and
    never takes token `ban` (None: any token); every later draw uses the turn key. A token fork at k is
    TurnStart(t, y[:k], ..., alt key, y[k]); a continuation after token k is TurnStart(t, y[:k + 1], ...)."""
    turn: int
    ids: list
    logprobs: list
    entropy: list
    key: int | None = None
    ban: int | None = None


def _token_flags(cache, tokenizer, char: str):
    """{token id: whether its decoded text holds `char`}, filled lazily, one per tokenizer."""
    try:
        table = cache.setdefault(tokenizer, {})
    except TypeError:  # tokenizer not weak-referenceable
        table = {}

    def has(tok: int) -> bool:
        if tok not in table:  # ids past the tokenizer (padded embedding rows, e.g. Qwen2.5) have no text
            table[tok] = tok < len(tokenizer) and char in tokenizer.decode([tok], skip_special_tokens=False)
        return table[tok]
    return has


class TurnStopper(StoppingCriteria):
    """Ends a row right after the first `</search>` / `</answer>` in the decoded text of its turn, at EOS, or at its
    own token budget; keeps TurnStopper.length / .reason per row and tells the processor which rows still run.

    Both stop strings end with ">", so a stop can only complete on a token whose text contains ">" (true for
    byte-level BPE, sentencepiece byte fallback, word-level): only then is the row's turn decoded, in full, so tags
    split across tokens are found exactly where the decoded text first contains them.
    """

    def __init__(self, tokenizer, start_len: int, budgets, eos_ids, processor=None, heads=None):
        self.tokenizer, self.start_len, self.budgets, self.processor = tokenizer, start_len, list(budgets), processor
        self.heads = list(heads) if heads is not None else [0] * len(budgets)  # given turn tokens before start_len
        self.eos_token_id = list(eos_ids)  # generate pads finished rows when a criterion has this attribute
        self.length, self.reason = [None] * len(budgets), [None] * len(budgets)
        self.live = list(range(len(budgets)))
        self.done = None
        self._has_gt = _token_flags(_GT_TOKENS, tokenizer, ">")

    def _stops(self, row_ids, b: int = 0) -> bool:
        text = self.tokenizer.decode(row_ids[self.start_len - self.heads[b]:].tolist(), skip_special_tokens=False)
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
                self.processor.rows = torch.tensor(self.live, dtype=torch.long, device=input_ids.device)
        return self.done.clone()


# --- the plain path: model.generate with the keyed processor, one call per chunk of rows ---
def _special_ids(model, tokenizer):
    """(eos ids, pad id): EOS from the tokenizer and the model's generation config (Qwen2.5 chat: <|im_end|>)."""
    eos = set()
    for src in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        eos.update([src] if isinstance(src, int) else (src or []))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos, default=0)
    return sorted(eos), pad


@contextlib.contextmanager
def _plain_generation_config(model):
    """generate() fills every unset field from model.generation_config (Qwen2.5-Instruct sets repetition_penalty,
    top_k, ...), and such processors would silently change the keyed draw: swap in a blank config meanwhile."""
    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


def _generate_chunk(model, tokenizer, rows, proto) -> list:
    """One left-padded generate call -> a Generation per row, its ids exactly as sampled."""
    eos, pad = _special_ids(model, tokenizer)
    n, width = len(rows), max(len(r.ctx) for r in rows)
    input_ids = torch.full((n, width), pad, dtype=torch.long)  # (B, L)
    attention = torch.zeros((n, width), dtype=torch.long)
    for b, r in enumerate(rows):
        input_ids[b, width - len(r.ctx):] = torch.tensor(r.ctx, dtype=torch.long)
        attention[b, width - len(r.ctx):] = 1
    device = model.device
    proc = KeyedGumbelProcessor(torch.tensor([_signed(r.key) for r in rows], device=device), width, proto.temperature,
                                proto.top_k, proto.top_p, proto.fused_sampler)
    if any(r.start is not None for r in rows) or proto.line_keys == "text":
        proc.keyer = _keyer(rows, tokenizer, proto, device)
    stopper = TurnStopper(tokenizer, width, [r.budget for r in rows], eos, proc, [len(r.head) for r in rows])
    config = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max(r.budget - len(r.head) for r in rows),
                              eos_token_id=eos or None, pad_token_id=pad, use_cache=True)
    with _plain_generation_config(model), torch.no_grad():
        out = model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                             generation_config=config, logits_processor=LogitsProcessorList([proc]),
                             stopping_criteria=StoppingCriteriaList([stopper]))
    new = out[:, width:].cpu()  # (B, n_steps)
    COUNTS["positions"] += n * (width + max(new.shape[1] - 1, 0))  # prefill, then one column per decode step
    COUNTS["row_steps"] += n * new.shape[1]
    COUNTS["tokens"] += sum(stopper.length)
    logprobs, entropy = proc.records()
    gens = []
    for b, r in enumerate(rows):
        k = stopper.length[b]
        assert k is not None and k <= new.shape[1], f"row {b}: generation ended without a stop reason"
        gens.append(_generation(r, new[b, :k].tolist(), logprobs[b, :k].tolist(), entropy[b, :k].tolist(),
                                stopper.reason[b]))
    return gens


def generate_turn(model, tokenizer, episodes, proto) -> list:
    """Sample the next turn of every episode (none may be done): the cached engine for a transformers model (below),
    else (proto.engine = "generate", or any object with only `generate`) left-padded generate calls in chunks of
    gen_batch_size, each re-prefilling its whole context."""
    rows = _rows(episodes, tokenizer, proto)
    if _cached_engine(model, proto):
        return _generate_cached(model, tokenizer, episodes, rows, proto)
    order = sorted(range(len(episodes)), key=lambda i: len(rows[i].ctx))
    gens = [None] * len(episodes)
    for c in range(0, len(order), proto.gen_batch_size):
        chunk = order[c:c + proto.gen_batch_size]  # similar lengths together: less padding
        for i, g in zip(chunk, _generate_chunk(model, tokenizer, [rows[i] for i in chunk], proto)):
            gens[i] = g
    return gens


# --- row features (DESIGN.md section 11): given first tokens, a fork token's own key and ban, text-line keys ---
@dataclass
class _Row:
    """A row of one turn call: its episode's context (the TurnStart's given tokens included), turn key, budget (for
    the whole turn), how it starts and what it sampled so far; the cached engine's decode-batch bookkeeping."""
    i: int
    ctx: list
    key: int
    budget: int
    start: TurnStart | None = None
    head: list = field(default_factory=list)  # the given tokens (start.ids)
    ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    entropy: list = field(default_factory=list)
    newline: object = None  # text-line keys: token id -> its text holds a newline; None: the group reading
    line: int = 0           # the text line of the next draw, and its position in that line (newline is not None)
    line_pos: int = 0
    p: int = 0              # its physical row in the decode batch (_Batch)
    track: tuple | None = None  # (KVEntry, m): its sequence is the entry's first m tokens (no physical row)
    q: int = 0              # its row among the tracking logits


def _rows(episodes, tokenizer, proto) -> list:
    """A _Row per episode, in order: context, turn key, budget, TurnStart, text-line state after the given tokens."""
    newline = _token_flags(_NL_TOKENS, tokenizer, "\n") if proto.line_keys == "text" else None
    rows = []
    for i, ep in enumerate(episodes):
        start = ep.start_for(len(ep.turns))
        head = list(start.ids) if start is not None else []
        ctx = ep.prompt_ids + ep.ids
        r = _Row(i, ctx + head, ep.key_for(len(ep.turns)), min(proto.max_new_tokens, proto.max_context - len(ctx)),
                 start, head, newline=newline)
        assert r.budget > len(head), "an episode without room for a token should have ended"
        for tok in head:
            _advance_line(r, tok)
        rows.append(r)
    return rows


def _advance_line(r, tok: int):
    if r.newline is not None:
        r.line, r.line_pos = (r.line + 1, 0) if r.newline(tok) else (r.line, r.line_pos + 1)


def _noise(r) -> tuple:
    """(key, position, banned token or -1) of r's next draw: (turn key, position in the turn); with text-line keys
    (line_key(turn key, line), position in the line); a TurnStart's first draw with its own key and ban."""
    first = r.start is not None and not r.ids
    if first and r.start.key is not None:
        key, pos = r.start.key, len(r.head)
    elif r.newline is not None:
        key, pos = line_key(r.key, r.line), r.line_pos
    else:
        key, pos = r.key, len(r.head) + len(r.ids)
    return key, pos, r.start.ban if first and r.start.ban is not None else -1


def _noise_tensors(rows, device):
    """(keys, positions, bans or None) of the rows' next draws, (B,) int64 tensors."""
    keys, pos, ban = zip(*(_noise(r) for r in rows))
    bans = torch.tensor(ban, device=device) if max(ban) >= 0 else None
    return torch.tensor([_signed(k) for k in keys], device=device), torch.tensor(pos, device=device), bans


def _keyer(rows, tokenizer, proto, device):
    """The generate path's KeyedGumbelProcessor.keyer: each row's state advanced by the token it drew last (padding,
    after a row finished, only moves rows that draw nothing more)."""
    def keyer(input_ids, n):
        if n > 0:
            for r, tok in zip(rows, input_ids[:, -1].tolist()):
                r.ids.append(tok)
                _advance_line(r, tok)
        return _noise_tensors(rows, device)
    return keyer


def _generation(r, ids, logprobs, entropy, stop) -> Generation:
    """The whole turn: the given tokens (with their records) and the drawn ones."""
    start = r.start
    if start is None:
        return Generation(ids, logprobs, entropy, stop, r.key)
    return Generation(list(start.ids) + ids, list(start.logprobs) + logprobs, list(start.entropy) + entropy, stop,
                      r.key, len(start.ids))


# --- the cached engine: every context token goes through the model once per episode ---
@dataclass
class KVEntry:
    """The KV cache of one token sequence: per layer (keys, values), each (1, H, len(ids), D), and the final hidden
    state (the LM head's input) at each position, (len(ids), hidden): a row that samples this sequence's own tokens
    again (a self-twin, a twin's shared first tokens) reads its logits off it without running the model."""
    ids: list
    kv: list
    hidden: object


def _cached_engine(model, proto) -> bool:
    from transformers import PreTrainedModel
    return proto.engine == "cached" and isinstance(model, PreTrainedModel)


def _usable(ep, ctx):
    """(entry, n): ep's cached entry and how many leading tokens of ctx it covers (at most len(ctx) - 1: the last
    context token is fed in the first decode step, which gives the first logits)."""
    entry = getattr(ep, "_kv", None)
    if entry is None:
        return None, 0
    n = min(len(entry.ids), len(ctx) - 1)
    if entry.ids[:n] != ctx[:n]:
        same = np.asarray(entry.ids[:n]) == np.asarray(ctx[:n])
        n = int(same.argmin())
    return entry, n


def _forward(model, ids, mask, pos, cache):
    """The model's own forward (a subclass may change its logits) over (b, S) new tokens on top of `cache` (updated
    in place) -> (logits of the last position (b, V) float32, final hidden states (b, S, hidden) or None when the
    model cannot be read that way). Padding: mask 0 (left of the cache, right of the new tokens)."""
    seen = []
    norm = getattr(model.base_model, "norm", None) if _can_track(model) else None
    hook = norm.register_forward_hook(lambda mod, args, out: seen.append(out)) if norm is not None else None
    try:
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                    logits_to_keep=1)
    finally:
        if hook is not None:
            hook.remove()
    COUNTS["positions"] += ids.numel()
    return out.logits[:, -1].float(), (seen[-1] if seen else None)


def _can_track(model) -> bool:
    """Logits = LM head(final norm output) holds for a transformers causal LM whose forward is the library's own;
    only then may a row read logits off stored hidden states."""
    forward = type(model).forward
    return forward.__module__.startswith("transformers.") and hasattr(model.base_model, "norm")


def _logits(model, hidden):
    """(n, V) float32 logits of (n, hidden) final hidden states: the model's own LM head, as its forward applies it."""
    return model.get_output_embeddings()(hidden).float()


def _stack_rows(rows, width):
    """Per-layer (keys, values) (b, H, width, D) of KVEntry slices (entry, n), left-padded with zeros."""
    first = next(entry for entry, n in rows if n).kv  # width > 0: some row has a cache
    layers = []
    for i in range(len(first)):
        k0 = first[i][0]
        ks = k0.new_zeros((len(rows), k0.shape[1], width, k0.shape[3]))
        vs = torch.zeros_like(ks)
        for b, (entry, n) in enumerate(rows):
            if n:
                ks[b, :, width - n:] = entry.kv[i][0][0, :, :n]
                vs[b, :, width - n:] = entry.kv[i][1][0, :, :n]
        layers.append((ks, vs))
    return layers


def _row_entry(cache, hidden, b, start, end, ids):
    return KVEntry(ids, [(layer.keys[b:b + 1, :, start:end].clone(), layer.values[b:b + 1, :, start:end].clone())
                         for layer in cache.layers], None if hidden is None else hidden[b, start:end].clone())


def _stack_hidden(rows, width):
    """(b, width, hidden) of KVEntry hidden states (entry, n), left-padded with zeros."""
    h0 = next(entry for entry, n in rows if n).hidden
    out = h0.new_zeros((len(rows), width, h0.shape[-1]))
    for b, (entry, n) in enumerate(rows):
        if n:
            out[b, width - n:] = entry.hidden[:n]
    return out


def _prefill(model, episodes, contexts, proto, pad):
    """Give every episode a KVEntry of its context but the last token: the missing suffix only, rows with the same
    context computed once, in buckets of similar suffix length (little padding)."""
    todo = {}
    for ep, ctx in zip(episodes, contexts):
        entry, n = _usable(ep, ctx)
        if n < len(ctx) - 1:
            todo.setdefault(tuple(ctx[:-1]), []).append((ep, entry, n))
        else:
            ep._kv = entry
    _shared_head(model, todo, pad)
    jobs = sorted(todo.items(), key=lambda kv: len(kv[0]) - kv[1][0][2])  # by suffix length
    bucket = []
    for job in jobs + [None]:
        suffix = None if job is None else len(job[0]) - job[1][0][2]
        if bucket and (job is None or len(bucket) == proto.gen_batch_size or suffix > 1.25 * bucket[0][2] + 8):
            _prefill_bucket(model, bucket, pad)
            bucket = []
        if job is not None:
            bucket.append((job[0], job[1], suffix))


def _shared_head(model, todo, pad, least=16):
    """Fresh contexts (no cache yet: different questions behind one instruction) share their longest common prefix:
    computed once, it becomes their starting cache."""
    fresh = [ctx for ctx, eps in todo.items() if eps[0][1] is None]
    if len(fresh) < 2:
        return
    lcp = min(len(c) for c in fresh)
    first = fresh[0]
    for ctx in fresh[1:]:
        lcp = next((k for k in range(lcp) if ctx[k] != first[k]), lcp)
    lcp = min(lcp, min(len(c) for c in fresh) - 1)  # every context keeps a suffix of its own
    if lcp < least:
        return
    holder = types.SimpleNamespace(_kv=None)
    _prefill_bucket(model, [(first[:lcp], [(holder, None, 0)], lcp)], pad)
    for ctx in fresh:
        todo[ctx] = [(ep, holder._kv, lcp) for ep, _, _ in todo[ctx]]


def _prefill_bucket(model, bucket, pad):
    """One forward: row b = [left pad][its cached n_b][its suffix][right pad]; positions 0.. over the real tokens."""
    dev = model.device
    heads = [(eps[0][1], eps[0][2]) for _, eps, _ in bucket]  # (entry, n) of the first episode of each context
    width, span = max(n for _, n in heads), max(s for _, _, s in bucket)
    ids = torch.full((len(bucket), span), pad, dtype=torch.long)
    mask = torch.zeros((len(bucket), width + span), dtype=torch.long)
    pos = torch.zeros((len(bucket), span), dtype=torch.long)
    for b, ((ctx, _, s), (_, n)) in enumerate(zip(bucket, heads)):
        ids[b, :s] = torch.tensor(ctx[n:], dtype=torch.long)
        mask[b, width - n:width + s] = 1
        pos[b, :s] = torch.arange(n, n + s)
    from transformers import DynamicCache
    cache = DynamicCache(ddp_cache_data=_stack_rows(heads, width)) if width else DynamicCache()
    _, hidden = _forward(model, ids.to(dev), mask.to(dev), pos.to(dev), cache)  # hidden (b, span, H) or None
    COUNTS["padding"] += len(bucket) * span - sum(s for _, _, s in bucket)
    if width and hidden is not None:
        hidden = torch.cat([_stack_hidden(heads, width), hidden], 1)
    for b, ((ctx, eps, s), (_, n)) in enumerate(zip(bucket, heads)):
        entry = _row_entry(cache, hidden, b, width - n, width + s, list(ctx))
        for ep, _, _ in eps:
            ep._kv = entry  # shared, never written: a later turn makes a new entry


def _pad_left(t, width, dim):
    extra = width - t.shape[dim]
    if extra == 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t.new_zeros(shape), t], dim)


def _admit(model, batch, parts):
    """Join new physical rows, parts = (KVEntry, n) caching n tokens, to the batch: both padded on the left."""
    width = max(n for _, n in parts)
    mask = torch.zeros((len(parts), width), dtype=torch.long, device=model.device)
    for b, (_, n) in enumerate(parts):
        mask[b, width - n:] = 1
    layers = _stack_rows(parts, width)
    hidden = _stack_hidden(parts, width) if _can_track(model) else None
    if batch.cache is not None:
        width = max(width, batch.mask.shape[1])
        layers = [tuple(torch.cat([_pad_left(old, width, 2), _pad_left(add, width, 2)]) for old, add in
                        zip((layer.keys, layer.values), kv)) for layer, kv in zip(batch.cache.layers, layers)]
        mask = torch.cat([_pad_left(batch.mask, width, 1), _pad_left(mask, width, 1)])
        if hidden is not None:
            hidden = torch.cat([_pad_left(batch.hid, width, 1), _pad_left(hidden, width, 1)])
    from transformers import DynamicCache
    batch.cache, batch.mask, batch.hid = DynamicCache(ddp_cache_data=layers), mask, hidden


def _row_stop(stopper, row, tok: int):
    """TurnStopper's rule for one row after it sampled tok: a stop string, EOS, or its budget (that order)."""
    if stopper._has_gt(tok) and any(s in stopper.tokenizer.decode(row.head + row.ids, skip_special_tokens=False)
                                    for s in STOP_STRINGS):
        return "stop"
    if tok in stopper.eos_token_id:
        return "eos"
    return "length" if len(row.head) + len(row.ids) >= row.budget else None


class _Batch:
    """The physical decode batch: one cache row per distinct sequence. Logical rows (episodes) with the same context
    and the same tokens so far share a physical row (a group's identical lines, twins of identical states) and fork
    when their keyed draws differ, so each distinct position goes through the model once. hid (P, W, hidden): the
    final hidden state at every cached position (what a finished row's KVEntry keeps)."""

    def __init__(self):
        self.cache = self.mask = self.hid = None
        self.tok, self.pos, self.seen = [], [], {}  # per physical row: next token, its position; dedup keys

    def add(self, model, rows):
        """Physical rows for rows = [(row, dedup key, KVEntry, n cached, next token)], one per distinct key."""
        parts = []
        for r, key, entry, n, tok in rows:
            if key not in self.seen:
                self.seen[key] = len(self.tok)
                self.tok.append(tok)
                self.pos.append(n)
                parts.append((entry, n))
            r.p, r.track = self.seen[key], None
        if parts:
            _admit(model, self, parts)

    def logits(self, model):
        """(P, V) float32 logits of every physical row's next position (one body position each)."""
        if not self.tok:
            return None
        dev = model.device
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.tok), 1))], 1)
        logits, hidden = _forward(model, torch.tensor(self.tok, device=dev)[:, None], self.mask,
                                  torch.tensor(self.pos, device=dev)[:, None], self.cache)  # hidden (P, 1, H)
        if hidden is not None:
            self.hid = torch.cat([self.hid, hidden], 1)
        return logits

    def regroup(self, live):
        """Physical rows for the physical rows still decoding: one per (parent row, sampled token)."""
        rows, src, tok, pos = {}, [], [], []
        for r in live:
            key = (r.p, r.ids[-1])
            if key not in rows:
                rows[key] = len(src)
                src.append(r.p)
                tok.append(r.ids[-1])
                pos.append(self.pos[r.p] + 1)
            r.p = rows[key]
        if not src:  # nothing left: the next admission starts a new cache
            self.cache = self.mask = self.hid = None
        elif src != list(range(len(self.tok))):
            idx = torch.tensor(src, dtype=torch.long, device=self.mask.device)
            self.cache.batch_select_indices(idx)
            self.mask, self.hid = self.mask[idx], None if self.hid is None else self.hid[idx]
        self.tok, self.pos, self.seen = tok, pos, {}


def _start(episodes, r):
    """A waiting row: tracking its cache's own tokens when the cache already covers its whole context (a branch
    from a longer episode), else (dedup key, entry, n, token) of a physical row feeding its last context token."""
    entry, m = episodes[r.i]._kv, len(r.ctx)
    if entry.hidden is not None and len(entry.ids) >= m and entry.ids[m - 1] == r.ctx[-1]:
        r.track = (entry, m)  # _prefill checked the first m - 1 tokens
        return None
    return (r, tuple(r.ctx), entry, m - 1, r.ctx[-1])


def _track_logits(model, rows):
    """(Q, V) logits of tracking rows, one per distinct (entry, length): the LM head on stored hidden states."""
    index, states = {}, []
    for r in rows:
        entry, m = r.track
        if (id(entry), m) not in index:
            index[id(entry), m] = len(states)
            states.append(entry.hidden[m - 1])
        r.q = index[id(entry), m]
    COUNTS["head_only"] += len(states)
    return _logits(model, torch.stack(states)) if states else None


def _decode(model, tokenizer, episodes, rows, proto, eos) -> list:
    """Continuous batching: at most gen_batch_size rows decode together; a row leaves the batch the step it stops
    (its cache kept as its episode's KVEntry) and a waiting row takes the slot. Rows with identical sequences share
    one physical row (_Batch); a row whose tokens repeat its cache's own (a twin's first tokens) runs no model
    position until it diverges.
    DEVIATION P5: slots refill within one turn's call only; turns stay a barrier (retrieval is batched per turn)."""
    # DEVIATION P6: the keyed draw (the processor's own _draw: same noise, same law) runs in this loop rather than
    # inside model.generate (DESIGN.md 4), which can neither drop and refill rows nor start from kept caches.
    proc = KeyedGumbelProcessor(None, 0, proto.temperature, proto.top_k, proto.top_p, proto.fused_sampler)
    stopper = TurnStopper(tokenizer, 0, [r.budget for r in rows], eos)
    queue, live, batch, gens = list(rows), [], _Batch(), [None] * len(episodes)
    dev = model.device
    while queue or live:
        if queue and len(live) < proto.gen_batch_size:
            new, queue = queue[:proto.gen_batch_size - len(live)], queue[proto.gen_batch_size - len(live):]
            batch.add(model, [p for p in (_start(episodes, r) for r in new) if p is not None])
            live += new
        phys = batch.logits(model)  # (P, V) or None
        tracking = [r for r in live if r.track is not None]
        track = _track_logits(model, tracking)
        n_phys = 0 if phys is None else phys.shape[0]
        logits = torch.cat([x for x in (phys, track) if x is not None])
        src = torch.tensor([r.p if r.track is None else n_phys + r.q for r in live], device=dev)
        COUNTS["row_steps"] += len(live)
        COUNTS["tokens"] += len(live)
        keys, steps, bans = _noise_tensors(live, dev)
        # DEVIATION P1: the logits come from cached keys/values, not a full re-prefill: equal up to float rounding,
        # so a draw at an exact near-tie (|gap| ~ 1e-6) could differ from the generate path; none did in tests/bench.
        token, logprob, entropy = proc._draw(logits.index_select(0, src), keys, steps, bans)
        keep, diverged = [], []
        for r, tok, lp, ent in zip(live, token.tolist(), logprob.tolist(), entropy.tolist()):
            r.ids.append(tok)
            r.logprobs.append(lp)
            r.entropy.append(ent)
            _advance_line(r, tok)
            stop = _row_stop(stopper, r, tok)
            if stop is not None:
                _finish_row(episodes, batch, r)
                gens[r.i] = _generation(r, r.ids, r.logprobs, r.entropy, stop)
            elif r.track is None:
                keep.append(r)
            else:
                entry, m = r.track
                if m < len(entry.ids) and entry.ids[m] == tok:
                    r.track = (entry, m + 1)
                else:  # a token of its own: from here on it needs the model
                    diverged.append((r, tuple(entry.ids[:m]) + (tok,), entry, m, tok))  # key: the sequence
        batch.regroup(keep)
        batch.add(model, diverged)
        live = [r for r in live if gens[r.i] is None]
    return gens


def _finish_row(episodes, batch, r):
    """A stopped row's KVEntry: its context and every sampled token but the last."""
    if r.track is not None:  # its tokens are its cache's own: that entry covers them
        episodes[r.i]._kv = r.track[0]
        return
    n, width = len(r.ctx) + len(r.ids) - 1, batch.mask.shape[1]
    # DEVIATION P3: the entry lives as long as the episode object (twins need it after the rollout); at 3B it is
    # ~36 KB per token in bf16 (+ 4 KB of hidden state), no offload to the host.
    episodes[r.i]._kv = _row_entry(batch.cache, batch.hid, r.p, width - n, width, r.ctx + r.ids[:-1])


def _generate_cached(model, tokenizer, episodes, rows, proto) -> list:
    """generate_turn with the cached engine (same tokens as _generate_chunk: keyed noise, same stop rule)."""
    eos, pad = _special_ids(model, tokenizer)
    order = sorted(range(len(episodes)), key=lambda i: len(rows[i].ctx))  # similar cache widths decode together
    with torch.no_grad():
        _prefill(model, episodes, [r.ctx for r in rows], proto, pad)
        return _decode(model, tokenizer, episodes, [rows[i] for i in order], proto, eos)

