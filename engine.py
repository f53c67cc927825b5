"""The generation engine: the next turn of many rows at once, every token a keyed draw (DESIGN.md section 11).

generate_turn(model, tokenizer, episodes, proto) samples one turn per episode. From an episode it reads only its
context (prompt_ids + ids), the key of its next turn (key_for(len(turns)), sampler.py) and, for the cached engine,
its KV cache (`_kv`); it returns a Generation per row: the token ids exactly as sampled (no decode/re-encode), their
log-probs and entropies, and why the turn stopped: right after the first `</search>` or `</answer>` in its decoded
text (protocol.STOP_STRINGS), at EOS, or at its token budget. The noise keys are (turn key, position in the turn),
so neither padding, batch composition nor caching changes a token.

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
  P3. Each episode's cache lives as long as its Episode object holds it (twins need it after the rollout); the
      trainer drops it once nothing will branch from it (rollout.release_caches); no host offload.
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
from sampler import KeyedGumbelProcessor, _signed

# bench.py's cost measures, summed over both paths since the last reset: body positions (padding included), of
# which padding; sampling row-steps; sampled tokens; LM-head-only positions (rows repeating a cache's own tokens)
COUNTS = {"positions": 0, "padding": 0, "row_steps": 0, "tokens": 0, "head_only": 0}

_GT_TOKENS = weakref.WeakKeyDictionary()  # tokenizer -> {token id: its decoded text contains ">"}


@dataclass
class Generation:
    """A sampled turn before its action is executed."""
    ids: list
    logprobs: list
    entropy: list
    stop: str
    key: int


class TurnStopper(StoppingCriteria):
    """Ends a row right after the first `</search>` / `</answer>` in the decoded text of its turn, at EOS, or at its
    own token budget; keeps TurnStopper.length / .reason per row and tells the processor which rows still run.

    Both stop strings end with ">", so a stop can only complete on a token whose text contains ">" (true for
    byte-level BPE, sentencepiece byte fallback, word-level): only then is the row's turn decoded, in full, so tags
    split across tokens are found exactly where the decoded text first contains them.
    """

    def __init__(self, tokenizer, start_len: int, budgets, eos_ids, processor=None):
        self.tokenizer, self.start_len, self.budgets, self.processor = tokenizer, start_len, list(budgets), processor
        self.eos_token_id = list(eos_ids)  # generate pads finished rows when a criterion has this attribute
        self.length, self.reason = [None] * len(budgets), [None] * len(budgets)
        self.live = list(range(len(budgets)))
        self.done = None
        try:
            self.gt = _GT_TOKENS.setdefault(tokenizer, {})
        except TypeError:  # tokenizer not weak-referenceable
            self.gt = {}

    def _has_gt(self, tok: int) -> bool:
        if tok not in self.gt:  # ids past the tokenizer (padded embedding rows, e.g. Qwen2.5) have no text
            self.gt[tok] = tok < len(self.tokenizer) and ">" in self.tokenizer.decode([tok], skip_special_tokens=False)
        return self.gt[tok]

    def _stops(self, row_ids) -> bool:
        text = self.tokenizer.decode(row_ids[self.start_len:].tolist(), skip_special_tokens=False)
        return any(s in text for s in STOP_STRINGS)

    def __call__(self, input_ids, scores, **kwargs):
        n = input_ids.shape[1] - self.start_len  # tokens generated so far
        last = input_ids[:, -1].tolist()
        ended = []
        for b in self.live:
            if self._has_gt(last[b]) and self._stops(input_ids[b]):
                self.reason[b] = "stop"
            elif last[b] in self.eos_token_id:
                self.reason[b] = "eos"
            elif n >= self.budgets[b]:
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


def _generate_chunk(model, tokenizer, contexts, keys, budgets, proto) -> list:
    """One left-padded generate call -> a Generation per row, its ids exactly as sampled."""
    eos, pad = _special_ids(model, tokenizer)
    n, width = len(contexts), max(map(len, contexts))
    input_ids = torch.full((n, width), pad, dtype=torch.long)  # (B, L)
    attention = torch.zeros((n, width), dtype=torch.long)
    for b, ctx in enumerate(contexts):
        input_ids[b, width - len(ctx):] = torch.tensor(ctx, dtype=torch.long)
        attention[b, width - len(ctx):] = 1
    device = model.device
    proc = KeyedGumbelProcessor(torch.tensor([_signed(k) for k in keys], device=device), width, proto.temperature,
                                proto.top_k, proto.top_p, proto.fused_sampler)
    stopper = TurnStopper(tokenizer, width, budgets, eos, proc)
    config = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max(budgets), eos_token_id=eos or None,
                              pad_token_id=pad, use_cache=True)
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
    for b in range(n):
        k = stopper.length[b]
        assert k is not None and k <= new.shape[1], f"row {b}: generation ended without a stop reason"
        gens.append(Generation(new[b, :k].tolist(), logprobs[b, :k].tolist(), entropy[b, :k].tolist(),
                               stopper.reason[b], keys[b]))
    return gens


def generate_turn(model, tokenizer, episodes, proto) -> list:
    """Sample the next turn of every episode (none may be done): the cached engine for a transformers model (below),
    else (proto.engine = "generate", or any object with only `generate`) left-padded generate calls in chunks of
    gen_batch_size, each re-prefilling its whole context."""
    if _cached_engine(model, proto):
        return _generate_cached(model, tokenizer, episodes, proto)
    order = sorted(range(len(episodes)), key=lambda i: len(episodes[i].prompt_ids) + len(episodes[i].ids))
    gens = [None] * len(episodes)
    for c in range(0, len(order), proto.gen_batch_size):
        chunk = order[c:c + proto.gen_batch_size]  # similar lengths together: less padding
        eps = [episodes[i] for i in chunk]
        contexts = [ep.prompt_ids + ep.ids for ep in eps]
        budgets = [min(proto.max_new_tokens, proto.max_context - len(ctx)) for ctx in contexts]
        assert min(budgets) > 0, "an episode without room for a token should have ended"
        keys = [ep.key_for(len(ep.turns)) for ep in eps]
        for i, g in zip(chunk, _generate_chunk(model, tokenizer, contexts, keys, budgets, proto)):
            gens[i] = g
    return gens


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
        (k0, v0) = first[i]
        ks = k0.new_zeros((len(rows), k0.shape[1], width, k0.shape[3]))
        vs = v0.new_zeros((len(rows), v0.shape[1], width, v0.shape[3]))  # its own dtype (keys may differ)
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
            for _, eps, _ in bucket:  # the replaced entries die now, not when the whole turn is prefilled
                eps[:] = [(ep, None, n) for ep, _, n in eps]
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


@dataclass
class _Row:
    """A row of the decode batch: its episode's context, key, budget and what it sampled so far."""
    i: int
    ctx: list
    key: int
    budget: int
    ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    entropy: list = field(default_factory=list)
    p: int = 0              # its physical row in the decode batch (_Batch)
    track: tuple | None = None  # (KVEntry, m): its sequence is the entry's first m tokens (no physical row)
    q: int = 0              # its row among the tracking logits


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
    if stopper._has_gt(tok) and any(s in stopper.tokenizer.decode(row.ids, skip_special_tokens=False)
                                    for s in STOP_STRINGS):
        return "stop"
    if tok in stopper.eos_token_id:
        return "eos"
    return "length" if len(row.ids) >= row.budget else None


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
        keys = torch.tensor([_signed(r.key) for r in live], device=dev)
        steps = torch.tensor([len(r.ids) for r in live], device=dev)
        # DEVIATION P1: the logits come from cached keys/values, not a full re-prefill: equal up to float rounding,
        # so a draw at an exact near-tie (|gap| ~ 1e-6) could differ from the generate path; none did in tests/bench.
        token, logprob, entropy = proc._draw(logits.index_select(0, src), keys, steps)
        keep, diverged = [], []
        for r, tok, lp, ent in zip(live, token.tolist(), logprob.tolist(), entropy.tolist()):
            r.ids.append(tok)
            r.logprobs.append(lp)
            r.entropy.append(ent)
            stop = _row_stop(stopper, r, tok)
            if stop is not None:
                _finish_row(episodes, batch, r)
                gens[r.i] = Generation(r.ids, r.logprobs, r.entropy, stop, r.key)
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
    # DEVIATION P3: the entry lives as long as the episode holds it (twins need it after the rollout; the trainer
    # drops it once nothing will branch from it); at 3B 36 KiB per token in bf16 (+ 4 KiB of hidden state), no host
    # offload (memory.json).
    episodes[r.i]._kv = _row_entry(batch.cache, batch.hid, r.p, width - n, width, r.ctx + r.ids[:-1])


def _generate_cached(model, tokenizer, episodes, proto) -> list:
    """generate_turn with the cached engine (same tokens as _generate_chunk: keyed noise, same stop rule)."""
    eos, pad = _special_ids(model, tokenizer)
    contexts = [ep.prompt_ids + ep.ids for ep in episodes]
    order = sorted(range(len(episodes)), key=lambda i: len(contexts[i]))  # similar cache widths decode together
    rows = [_Row(i, contexts[i], episodes[i].key_for(len(episodes[i].turns)),
                 min(proto.max_new_tokens, proto.max_context - len(contexts[i]))) for i in order]
    assert min(r.budget for r in rows) > 0, "an episode without room for a token should have ended"
    with torch.no_grad():
        _prefill(model, episodes, contexts, proto, pad)
        return _decode(model, tokenizer, episodes, rows, proto, eos)

