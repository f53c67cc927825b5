"""The generation engine: the next turn of many rows at once, every token a keyed draw
(DESIGN.md section 11).

generate_turn(model, tokenizer, episodes, proto) samples one turn per episode. From an episode it
reads only its context (prompt_ids + ids), the key of its next turn (key_for(len(turns)),
sampler.py) and, for the cached engine, its KV cache (`_kv`); it returns a Generation per row: the
token ids exactly as sampled (no decode/re-encode), their log-probs and entropies, and why the turn
stopped (generation/stops.py: right after the first `</search>` or `</answer>` in its decoded text,
at EOS, or at its token budget). The noise keys are (turn key, position in the turn), so neither
padding, batch composition, caching nor read-back timing changes a token.

Row features (DESIGN.md section 11), the same in both paths: a TurnStart
(ep.start_for(len(ep.turns))) gives a row its turn's first tokens, so it starts at position k, a key
of its own for the first token it draws and a token that draw may not take (a token fork:
rollout.run_twins with twin_unit = token); `proto.line_keys = "text"` keys every draw by the text
line it is in, restarting positions after each token whose text holds a newline (sampler.line_key).

Two paths, the same tokens (tested):
  cached (Protocol.engine = "cached", transformers decoders with full sdpa/eager attention): each
    episode keeps the KV cache of its context (a KVEntry); a turn feeds only what the cache lacks
    (the previous turn's last token and the observation), identical contexts in a call are
    prefilled once, a branch starts from its parent's cache. The decode runs in slots of one
    preallocated cache written in place (generation/kvcache.py: no concatenation, no whole-cache
    copy, a fixed-shape step CUDA graphs can replay); rows join free slots, leave at their stop,
    rows with one context share their first step, and a twin's repeated tokens are read off stored
    hidden states. Stops are decided on the device (generation/stops.py's automaton) and the
    sampled tokens read back every `sync_every` steps.
  generate (engine = "generate", or any other object with `generate`): left-padded
    `model.generate` calls with sampler.KeyedGumbelProcessor, each re-prefilling its whole context.
A meter (perf/bench_engine.py's `counting`) can be attached to METER to add up what each path
spends (model positions, padding, row-steps, decode steps, read-backs, bytes copied); none is
attached in a run.

It knows no reward, no retriever and no twins: it sees rows of token ids with keys and caches. What
a turn means (its action, its observation, a branch) is rollout.py's.

Deviations of the cached engine (DESIGN.md section 11; tagged `# DEVIATION P<n>:` where they act;
P2 and P4 are generation/logprobs.py's, P7 sampler.py's, P8 generation/kvcache.py's):
  P1. Logits from cached keys/values (or stored hidden states) equal re-prefilled ones up to float
      rounding, so a draw at an exact near-tie could differ from the generate path (none did in
      tests or benchmarks).
  P3. Each episode's cache lives as long as its Episode object holds it (twins need it after the
      rollout); the trainer drops it once nothing will branch from it (rollout.release_caches) or
      when it does not fit the live-KV budget (generation/kvbudget.py); no host offload.
  P5. Slots refill within one turn's call only; turns stay a barrier (retrieval is batched
      per turn).
  P6. The keyed draw (the processor's own, same noise and law) runs in this engine's decode loop,
      not inside `model.generate` as DESIGN.md section 4 says.
"""
import collections
import contextlib
import functools
import types
import weakref
from dataclasses import dataclass

import numpy as np
import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from generation import kvcache
from generation.rows import advance, keyer, make_rows, noise, noise_ahead
from sampler import KeyedGumbelProcessor, _signed, keyed_draw
from generation.stops import TurnStopper, stop_rule

# The benches' cost measures, summed over both paths while a meter is attached: body positions
# (padding included), of which padding; sampling row-steps; sampled tokens; LM-head-only positions
# (rows repeating a cache's own tokens); decode steps, slot-steps, live slot-steps, read-backs,
# bytes copied, live cache bytes.
METERED = ("positions", "padding", "row_steps", "tokens", "head_only", "steps", "slot_steps",
           "live_steps", "syncs", "copied", "cache_bytes")
# a dict over METERED while perf/bench_engine.counting attaches one; None: nothing is counted
METER = None


def _count(**spent):
    if METER is not None:
        for key, n in spent.items():
            METER[key] += n


@dataclass
class Generation:
    """A sampled turn before its action is executed."""
    ids: list
    logprobs: list
    entropy: list
    stop: str
    key: int
    given: int = 0          # its first `given` ids were given by a TurnStart, not sampled here


# --- the plain path: model.generate with the keyed processor, one call per chunk of rows ---
def _special_ids(model, tokenizer):
    """(eos ids, pad id): EOS from the tokenizer and the model's generation config (Qwen2.5 chat:
    <|im_end|>)."""
    eos = set()
    for src in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        eos.update([src] if isinstance(src, int) else (src or []))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos, default=0)
    return sorted(eos), pad


@contextlib.contextmanager
def _plain_generation_config(model):
    """generate() fills every unset field from model.generation_config (Qwen2.5-Instruct sets
    repetition_penalty, top_k, ...), and such processors would silently change the keyed draw:
    swap in a blank config meanwhile."""
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
    proc = KeyedGumbelProcessor(torch.tensor([_signed(r.key) for r in rows], device=device), width,
                                proto.temperature, proto.top_k, proto.top_p, _fused(proto, device))
    if any(r.start is not None or r.newline is not None for r in rows):
        proc.keyer = keyer(rows, device)
    stopper = TurnStopper(tokenizer, width, [r.budget for r in rows], eos, proc,
                          [r.given for r in rows])
    config = GenerationConfig(do_sample=False, num_beams=1,
                              max_new_tokens=max(r.budget - r.given for r in rows),
                              eos_token_id=eos or None, pad_token_id=pad, use_cache=True)
    with _plain_generation_config(model), torch.no_grad():
        out = model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                             generation_config=config, logits_processor=LogitsProcessorList([proc]),
                             stopping_criteria=StoppingCriteriaList([stopper]))
    new = out[:, width:].cpu()  # (B, n_steps)
    # prefill, then one column per decode step
    _count(positions=n * (width + max(new.shape[1] - 1, 0)), row_steps=n * new.shape[1],
           tokens=sum(stopper.length))
    logprobs, entropy = proc.records()
    gens = []
    for b, r in enumerate(rows):
        k = stopper.length[b]
        assert k is not None and k <= new.shape[1], \
            f"row {b}: generation ended without a stop reason"
        gens.append(Generation(r.ids[:r.given] + new[b, :k].tolist(),
                               r.logprobs[:r.given] + logprobs[b, :k].tolist(),
                               r.entropy[:r.given] + entropy[b, :k].tolist(),
                               stopper.reason[b], r.key, r.given))
    return gens


def generate_turn(model, tokenizer, episodes, proto) -> list:
    """Sample the next turn of every episode (none may be done): a vLLM engine's own draws
    (generation/vllm_engine.py), the cached engine for a transformers model (below), else
    (engine = "generate", or an object with only `generate`) left-padded generate calls in chunks
    of gen_batch_size, each re-prefilling its whole context."""
    if hasattr(model, "generate_turn"):
        return model.generate_turn(tokenizer, episodes, proto)
    rows = make_rows(episodes, tokenizer, proto)
    if _cached_engine(model, proto):
        return _generate_cached(model, tokenizer, episodes, rows, proto)
    order = sorted(range(len(episodes)), key=lambda i: len(rows[i].ctx))
    gens = [None] * len(episodes)
    for c in range(0, len(order), proto.gen_batch_size):
        chunk = order[c:c + proto.gen_batch_size]  # similar lengths together: less padding
        for i, g in zip(chunk, _generate_chunk(model, tokenizer, [rows[i] for i in chunk], proto)):
            gens[i] = g
    return gens


# --- the cached engine: every context token goes through the model once per episode ---
LIVE = weakref.WeakSet()  # every KVEntry alive, whoever holds it (generation/kvbudget.py counts them)


@dataclass(eq=False)
class KVEntry:
    """The KV cache of one token sequence: keys and values (layers, kv heads, len(ids), head dim)
    and the final hidden state (the LM head's input) at each position, (len(ids), hidden): a row
    that samples this sequence's own tokens again (a self-twin, a twin's shared first tokens) reads
    its logits off it without running the model."""
    ids: list
    k: torch.Tensor
    v: torch.Tensor
    hidden: object

    def __post_init__(self):
        LIVE.add(self)

    @property
    def positions(self) -> int:
        return self.k.shape[2]

    @functools.cached_property
    def kv(self):
        """Per layer (keys, values), each (1, H, len(ids), D): views, made once."""
        return [(self.k[i][None], self.v[i][None]) for i in range(self.k.shape[0])]


def _cached_engine(model, proto) -> bool:
    from transformers import PreTrainedModel
    return proto.engine != "generate" and isinstance(model, PreTrainedModel) and _slots_fit(model)


def _slots_fit(model) -> bool:
    """The slot cache drives attention through a prepared mask per layer type: full attention
    only, sdpa or eager (Qwen2.5, Llama-shaped models); anything else takes the generate path (same
    tokens, slower)."""
    config = model.config
    layers = set(getattr(config, "layer_types", None) or ["full_attention"])
    return (layers == {"full_attention"}
            and getattr(config, "_attn_implementation", "sdpa") in ("sdpa", "eager"))


def _usable(ep, ctx):
    """(entry, n): ep's cached entry and how many leading tokens of ctx it covers (at most
    len(ctx) - 1: the last context token is fed in the first decode step, which gives the first
    logits)."""
    entry = getattr(ep, "_kv", None)
    if entry is None:
        return None, 0
    n = min(len(entry.ids), len(ctx) - 1)
    if entry.ids[:n] != ctx[:n]:
        same = np.asarray(entry.ids[:n]) == np.asarray(ctx[:n])
        n = int(same.argmin())
    return entry, n


def _forward(model, ids, mask, pos, cache):
    """The model's own forward (a subclass may change its logits) over (b, S) new tokens on top of
    `cache` (updated in place) -> (logits of the last position (b, V) float32, final hidden states
    (b, S, hidden) or None when the model cannot be read that way). Padding: mask 0 (left of the
    cache, right of the new tokens); a dict mask is the slot cache's, already per layer type."""
    seen = []
    norm = getattr(model.base_model, "norm", None) if _can_track(model) else None
    hook = (norm.register_forward_hook(lambda mod, args, out: seen.append(out))
            if norm is not None else None)
    try:
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
    finally:
        if hook is not None:
            hook.remove()
    return out.logits[:, -1].float(), (seen[-1] if seen else None)


def _can_track(model) -> bool:
    """Logits = LM head(final norm output) holds for a transformers causal LM whose forward is the
    library's own; only then may a row read logits off stored hidden states."""
    forward = type(model).forward
    return forward.__module__.startswith("transformers.") and hasattr(model.base_model, "norm")


def _logits(model, hidden):
    """(n, V) float32 logits of (n, hidden) final hidden states: the model's own LM head, as its
    forward applies it."""
    return model.get_output_embeddings()(hidden).float()


def _stack_rows(rows, width):
    """Per-layer (keys, values) (b, H, width, D) of KVEntry slices (entry, n), left-padded with
    zeros. Each layer's pair is its own allocation, so the prefill's cache frees it as soon as that
    layer's update has concatenated the new positions (one stacked tensor of every layer would be
    held until the last layer: twice the cache at once)."""
    first = next(entry for entry, n in rows if n)  # width > 0: some row has a cache
    layers = []
    for i in range(first.k.shape[0]):
        ks = first.k.new_zeros((len(rows), first.k.shape[1], width, first.k.shape[3]))
        # its own dtype
        vs = first.v.new_zeros((len(rows), first.v.shape[1], width, first.v.shape[3]))
        for b, (entry, n) in enumerate(rows):
            if n:
                ks[b, :, width - n:] = entry.k[i, :, :n]
                vs[b, :, width - n:] = entry.v[i, :, :n]
        layers.append((ks, vs))
    return layers


def _stack_hidden(rows, width):
    """(b, width, hidden) of KVEntry hidden states (entry, n), left-padded with zeros."""
    h0 = next(entry for entry, n in rows if n).hidden
    out = h0.new_zeros((len(rows), width, h0.shape[-1]))
    for b, (entry, n) in enumerate(rows):
        if n:
            out[b, width - n:] = entry.hidden[:n]
    return out


def _prefill(model, episodes, contexts, proto, pad):
    """Give every episode a KVEntry of its context but the last token: the missing suffix only,
    rows with the same context computed once, in buckets of similar suffix length (little
    padding)."""
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
        if bucket and (job is None or len(bucket) == proto.gen_batch_size or
                       suffix > 1.25 * bucket[0][2] + 8):
            _prefill_bucket(model, bucket, pad)
            # the replaced entries die now, not when the whole turn is prefilled
            for _, eps, _ in bucket:
                eps[:] = [(ep, None, n) for ep, _, n in eps]
            bucket = []
        if job is not None:
            bucket.append((job[0], job[1], suffix))


def _shared_head(model, todo, pad, least=16):
    """Fresh contexts (no cache yet: different questions behind one instruction) share their
    longest common prefix: computed once, it becomes their starting cache."""
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
    """One forward: row b = [left pad][its cached n_b][its suffix][right pad]; positions 0.. over
    the real tokens."""
    dev = model.device
    # (entry, n) of the first episode of each context
    heads = [(eps[0][1], eps[0][2]) for _, eps, _ in bucket]
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
    # hidden (b, span, H) or None
    _, hidden = _forward(model, ids.to(dev), mask.to(dev), pos.to(dev), cache)
    _count(positions=ids.numel(), padding=len(bucket) * span - sum(s for _, _, s in bucket))
    if width and hidden is not None:
        hidden = torch.cat([_stack_hidden(heads, width), hidden], 1)
    for b, ((ctx, eps, s), (_, n)) in enumerate(zip(bucket, heads)):
        start, end = width - n, width + s
        entry = KVEntry(list(ctx),
                        torch.stack([layer.keys[b, :, start:end] for layer in cache.layers]),
                        torch.stack([layer.values[b, :, start:end] for layer in cache.layers]),
                        None if hidden is None else hidden[b, start:end].clone())
        for ep, _, _ in eps:
            ep._kv = entry  # shared, never written: a later turn makes a new entry


# --- the decode loop: rows in slots of a preallocated cache, read back every few steps ---
def _start(episodes, r):
    """A waiting row: tracking its cache's own tokens when the cache already covers its whole
    context (a branch from a longer episode), else (row, dedup key, entry, n cached, next token)
    for a slot."""
    entry, m = episodes[r.i]._kv, len(r.ctx)
    if entry.hidden is not None and len(entry.ids) >= m and entry.ids[m - 1] == r.ctx[-1]:
        r.track = (entry, m)  # _prefill checked the first m - 1 tokens
        return None
    return (r, tuple(r.ctx), entry, m - 1, r.ctx[-1])


def _sample(proto, device) -> dict:
    """keyed_draw's settings."""
    return dict(temperature=proto.temperature, top_k=proto.top_k, top_p=proto.top_p,
                fused=_fused(proto, device))


def _fused(proto, device) -> bool:
    """The compiled draw where it pays: on CUDA. On the CPU it is 2-4x faster per draw after an
    8-10 s compile (RESULTS.md), which the short CPU runs (tests, the CLIs) do not recover, so the
    CPU keeps the eager reference."""
    return proto.fused_sampler and device.type == "cuda"


def _finish(episodes, gens, r, stop, entry):
    episodes[r.i]._kv = entry
    gens[r.i] = Generation(r.ids, r.logprobs, r.entropy, stop, r.key, r.given)


def _track(model, episodes, rows, proto, rule, gens) -> list:
    """Rows whose tokens repeat their cache's own (a twin's shared first tokens, a self-twin) read
    their logits off the stored hidden states through the LM head, several positions per read-back
    (1, 2, 4, ... as a row keeps repeating): drawn ahead, kept up to the first token that differs
    or stops. Returns the rows that diverged, as slot requests
    (row, dedup key, entry, n cached, next token)."""
    diverged, active, ahead = [], rows, 1
    vocab = model.get_output_embeddings().weight.shape[0]
    while active:
        # (N, V) float32 logits stay <= 256 MB
        ahead = max(1, min(ahead, (1 << 26) // (vocab * len(active))))
        spans = [min(ahead, len(r.track[0].ids) - r.track[1] + 1, r.budget - len(r.ids))
                 for r in active]
        states = torch.cat([r.track[0].hidden[r.track[1] - 1:r.track[1] - 1 + k]
                            for r, k in zip(active, spans)])
        # draw j of a row, had it drawn its cache's next j tokens
        drawn_at = [x for r, k in zip(active, spans)
                    for x in noise_ahead(r, r.track[0].ids[r.track[1]:r.track[1] + k - 1])]
        keys = torch.tensor([_signed(key) for key, _, _ in drawn_at], device=model.device)
        steps, bans = (torch.tensor(x, device=model.device) for x in list(zip(*drawn_at))[1:])
        drawn = keyed_draw(_logits(model, states), keys, steps, **_sample(proto, model.device),
                           ban=bans if any(ban >= 0 for _, _, ban in drawn_at) else None)
        # the one sync
        token, logprob, entropy = torch.stack([x.double() for x in drawn]).cpu().numpy()
        _count(syncs=1, head_only=len(keys))
        at, still, used = 0, [], 0
        for r, k in zip(active, spans):
            for j in range(k):
                tok = int(token[at + j])
                r.ids.append(tok)
                r.logprobs.append(float(logprob[at + j]))
                r.entropy.append(float(entropy[at + j]))
                advance(r, tok)
                used += 1
                entry, m = r.track
                stop = rule.reason(r, tok)
                if stop is not None:  # its tokens are its cache's own: that entry covers them
                    _finish(episodes, gens, r, stop, entry)
                    break
                if m < len(entry.ids) and entry.ids[m] == tok:
                    r.track = (entry, m + 1)
                    continue
                r.track = None  # a token of its own: from here on it needs the model
                # key: the sequence
                diverged.append((r, tuple(entry.ids[:m]) + (tok,), entry, m, tok))
                break
            else:
                still.append(r)
            at += k
        _count(row_steps=used, tokens=used)
        active, ahead = still, 2 * ahead
    return diverged


_DECODERS = weakref.WeakKeyDictionary()  # model -> {"cache": SlotCache, settings: Decoder}


def kv_dtype(model):
    """The dtype the model's attention reads keys and values in: the autocast dtype when autocast
    is on (attention casts to it, so storing them in it changes nothing), else the model's own."""
    dev = model.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else model.dtype


def _decoder(model, proto, rule, slots: int, length: int):
    """The model's slot cache (kept between calls and reused while large enough) and a Decoder for
    these settings (kept too: its captured CUDA graphs stay valid as long as the cache and the
    settings do)."""
    held = _DECODERS.setdefault(model, {})
    dtype, hidden = kv_dtype(model), _can_track(model)
    cache = held.get("cache")
    if (cache is None or cache.slots < slots or cache.length < length
            or (cache.kv_dtype, cache.hid is not None) != (dtype, hidden)):
        # the old cache goes before the new one is allocated: no doubling (nor may a local hold it)
        held.clear()
        cache = None
        held["cache"] = cache = kvcache.SlotCache(model.config, slots, length, dtype,
                                                  model.device, hidden)
    sample = _sample(proto, model.device)
    key = (slots, rule, proto.sync_every, proto.cuda_graphs, proto.line_keys,
           tuple(sorted(sample.items())))
    if key not in held:
        def forward(ids, mask, pos, cache):  # the slot cache's mask is per layer type, prepared
            return _forward(model, ids, {"full_attention": mask}, pos, cache)

        held[key] = kvcache.Decoder(cache, slots, forward, rule.tables, sample, proto.sync_every,
                                    proto.cuda_graphs, model.config._attn_implementation,
                                    rule.newline if proto.line_keys == "text" else None)
    return held[key]


def _cache_length(model, proto, queue) -> int:
    """Positions per slot: max_context + 1 on CUDA (one allocation, stable for CUDA graphs: a
    stopped row writes its unused next position); on the CPU what this call's rows can reach, in
    steps of 1024 (kept while large enough)."""
    if model.device.type == "cuda":
        return proto.max_context + 1
    reach = max(n + r.budget - len(r.ids) for r, _, _, n, _ in queue) + 1
    return min(proto.max_context + 1, -(-reach // 1024) * 1024)


def position_bytes(model) -> int:
    """Bytes of one position of a KVEntry of this model (keys and values of every layer, and the
    hidden state when rows may read logits off it)."""
    return kvcache.cache_bytes(1, 1, model.config, kv_dtype(model), _can_track(model))


def free_cache(model):
    """Drop the model's slot cache and decoders (and their CUDA graphs); the next call
    allocates again."""
    _DECODERS.pop(model, None)


class _Slots:
    """The host's half of the decode loop: which row holds which slot and what it has drawn, read
    back from the Decoder's records every few steps. Rows join free slots (lowest first; rows with
    one context share their first step, then fork by copying it), leave the slot the read-back
    after they stop (their positions copied out as the episode's KVEntry) and, once nobody waits,
    the top rows move down into the holes, so the step runs on a prefix."""

    def __init__(self, dec, rule, episodes, gens, fixed: bool):
        (self.dec, self.cache, self.rule,
         self.episodes, self.gens) = dec, dec.cache, rule, episodes, gens
        # per slot: its row, its positions at the read-back
        self.rows, self.pos = [None] * dec.slots, [0] * dec.slots
        self.free, self.forks, self.since = list(range(dec.slots)), [], 0
        # stopped rows that trigger an early read-back while rows wait
        self.eager_at = max(1, dec.slots // 8)
        self.fixed = fixed  # few step shapes (CUDA graphs; on the CPU the same shapes, run eagerly)

    def run(self, queue):
        while queue or any(r is not None for r in self.rows):
            if queue and self.free and self.since == 0:
                self.admit(queue)
            self.step()
            occupied = sum(r is not None for r in self.rows)
            stopped = self.dec.stopped_so_far()
            if (self.since == self.dec.ring or stopped >= occupied
                    or (queue and stopped >= self.eager_at)):
                self.read_back()
                if not queue:
                    self.compact()

    def admit(self, queue):
        """Free slots for waiting rows (row, dedup key, entry, n cached, next token)."""
        take = [queue.popleft() for _ in range(min(len(queue), len(self.free)))]
        groups = {}
        for item in take:
            groups.setdefault(item[1], []).append(item)
        # leaders first
        order = [g[0] for g in groups.values()] + [item for g in groups.values() for item in g[1:]]
        self.free.sort()
        slots, self.free = self.free[:len(take)], self.free[len(take):]
        lead = {}
        for (r, key, entry, n, tok), s in zip(order, slots):
            assert n + r.budget - len(r.ids) < self.cache.length, "a row longer than max_context"
            r.slot, self.rows[s], self.pos[s] = s, r, n
            if key in lead:  # shares its leader's first step: its own cache is a copy made after it
                self.forks.append((s, lead[key], n + 1))
            else:
                lead[key] = s
                _count(copied=self.cache.copy(s, entry, n) if n else 0)
        # each row's next draw: key, position, ban (section 11)
        nxt = [noise(item[0]) for item in order]
        self.dec.set(slots, tok=[item[4] for item in order], pos=[item[3] for item in order],
                     key=[_signed(key) for key, _, _ in nxt], npos=[pos for _, pos, _ in nxt],
                     ban=[ban for _, _, ban in nxt], line=[item[0].line for item in order],
                     turn=[_signed(item[0].key) for item in order],
                     step=[len(item[0].ids) for item in order],
                     budget=[item[0].budget for item in order], live=[True] * len(order),
                     sstate=[self.rule.state(item[0].ids) for item in order],
                     src=[lead[item[1]] for item in order])

    def step(self):
        occupied = [s for s, r in enumerate(self.rows) if r is not None]
        forking = {m for m, _, _ in self.forks}
        n_rows = occupied[-1] + 1
        n_fwd = max(s for s in occupied if s not in forking) + 1
        width = min(self.cache.length, max(self.pos[s] for s in occupied) + self.since + 1)
        if self.fixed:  # few shapes: rows to a power of two, width to a multiple of 256
            n_rows = n_fwd = min(self.dec.slots, 1 << (n_rows - 1).bit_length())
            width = min(self.cache.length, -(-width // 256) * 256)
        self.dec.run(n_fwd, n_rows, width)
        self.since += 1
        if METER is not None:
            live = sum(self.pos[s] for s in occupied) + self.since * len(occupied)
            _count(positions=n_fwd, steps=1, slot_steps=self.dec.slots,
                   cache_bytes=live * self.cache.position_bytes())
        if self.forks:
            for m, lead, n in self.forks:
                _count(copied=self.cache.copy(m, lead, n))
            self.dec.set([m for m, _, _ in self.forks], src=[m for m, _, _ in self.forks])
            self.forks = []

    def read_back(self):
        """Every row's tokens since the last read-back, TurnStopper's rule on each (exact: the
        device only decides when a row freezes), finished rows out, rows the device froze without
        a stop thawed."""
        rec = self.dec.read(self.since,
                            max(s for s, r in enumerate(self.rows) if r is not None) + 1).numpy()
        _count(syncs=1, live_steps=int(rec[:, 3].sum()) if METER is not None else 0)
        self.since = 0
        freed, thaw, read = [], [], 0
        for s, r in enumerate(self.rows):
            if r is None:
                continue
            drawn, stop = np.nonzero(rec[:, 3, s])[0], None
            for t in drawn:
                tok = int(rec[t, 0, s])
                r.ids.append(tok)
                r.logprobs.append(float(rec[t, 1, s]))
                r.entropy.append(float(rec[t, 2, s]))
                advance(r, tok)
                self.pos[s] += 1
                read += 1
                stop = self.rule.reason(r, tok)
                if stop is not None:
                    break
            if stop is not None:
                _finish(self.episodes, self.gens, r, stop, self.entry(s, r))
                self.rows[s] = None
                freed.append(s)
            # frozen on an automaton hit the exact rule rejects
            elif len(drawn) and rec[drawn[-1], 4, s]:
                thaw.append(s)
        _count(row_steps=read, tokens=read)
        if freed:
            self.free += freed
            self.dec.set(freed, live=[False] * len(freed), src=freed)
        if thaw:
            self.dec.set(thaw, live=[True] * len(thaw))

    def entry(self, s: int, r):
        """A stopped row's KVEntry: its context and every sampled token but the last, copied out
        of its slot. DEVIATION P3: the entry lives as long as the episode holds it (twins need it
        after the rollout; the trainer drops it once nothing will branch from it); at 3B 36 KiB per
        token in bf16 (+ 4 KiB of hidden state), no host offload (memory.json)."""
        # ctx holds the given tokens already
        n, cache = len(r.ctx) + len(r.ids) - r.given - 1, self.cache
        _count(copied=n * cache.position_bytes())
        return KVEntry(r.ctx + r.ids[r.given:-1], cache.k[:, s, :, :n].clone(),
                       cache.v[:, s, :, :n].clone(),
                       None if cache.hid is None else cache.hid[s, :n].clone())

    def compact(self):
        """Move the top rows down into the holes (their own positions only), so the step runs on
        a shorter prefix."""
        moves = []
        self.free.sort()
        while self.free:
            top = max((s for s, r in enumerate(self.rows) if r is not None), default=-1)
            if self.free[0] > top:
                break
            hole = self.free.pop(0)
            _count(copied=self.cache.copy(hole, top, self.pos[top]))
            self.rows[hole], self.pos[hole], self.rows[top] = self.rows[top], self.pos[top], None
            self.rows[hole].slot = hole
            self.free.append(top)
            self.free.sort()
            moves.append((hole, top))
        if moves:
            self.dec.move([h for h, _ in moves], [t for _, t in moves])


def _decode(model, tokenizer, episodes, rows, proto, eos) -> list:
    """Continuous batching: at most gen_batch_size rows decode together, each in its own slot of
    a preallocated cache; a row leaves its slot at the first read-back after it stops (its cache
    kept as its episode's KVEntry) and a waiting row takes the slot. Rows with one context share
    their first step; a row whose tokens repeat its cache's own (a twin's first tokens) runs no
    model position until it diverges (_track). DEVIATION P5: slots refill within one turn's call
    only; turns stay a barrier (retrieval is batched per turn)."""
    # DEVIATION P6: the keyed draw (the processor's own: same noise, same law) runs in this loop
    # rather than inside model.generate (DESIGN.md 4), which can neither drop and refill rows nor
    # start from kept caches. DEVIATION P1: the logits come from cached keys/values, not a full
    # re-prefill: equal up to float rounding, so a draw at an exact near-tie (|gap| ~ 1e-6) could
    # differ from the generate path; none did in tests/bench.
    rule = stop_rule(tokenizer, eos, model.get_output_embeddings().weight.shape[0], model.device)
    gens, queue, tracking = [None] * len(episodes), collections.deque(), []
    for r in rows:
        item = _start(episodes, r)
        if item is None:
            tracking.append(r)
        else:
            queue.append(item)
    if tracking:
        queue.extend(_track(model, episodes, tracking, proto, rule, gens))
    if queue:
        dec = _decoder(model, proto, rule, proto.gen_batch_size, _cache_length(model, proto, queue))
        _Slots(dec, rule, episodes, gens, proto.cuda_graphs).run(queue)
    return gens


def _generate_cached(model, tokenizer, episodes, rows, proto) -> list:
    """generate_turn with the cached engine (same tokens as _generate_chunk: keyed noise, same
    stop rule)."""
    eos, pad = _special_ids(model, tokenizer)
    # similar cache widths decode together
    order = sorted(range(len(episodes)), key=lambda i: len(rows[i].ctx))
    with torch.no_grad():
        _prefill(model, episodes, [r.ctx for r in rows], proto, pad)
        return _decode(model, tokenizer, episodes, [rows[i] for i in order], proto, eos)
