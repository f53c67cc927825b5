"""The live-KV budget: the KV cache entries that episodes hold (engine.KVEntry), counted in
positions and kept under a limit by choosing which episodes take the next turn and which kept
caches are dropped (DESIGN.md section 10).

Between turns each episode holds the KV cache of its context (engine.KVEntry: 40 KiB a position
at Qwen2.5-3B in bf16, 56 KiB at 7B); TWICE keeps the finished ones for its twins. With a rank's
320 episodes near max_context that is 320 x 4,096 positions = 50 GiB, more than an 80 GB GPU has
beside the model (`python -m perf.ledger --script long`). Protocol.kv_budget_gib sets a limit L
(positions = GiB / engine.position_bytes; 0 = none). Before each turn, schedule():

  1. counts what lives outside the call: entries none of its episodes holds (a factual cache
     while its twins run), whatever holds them;
  2. chooses the episodes that take the turn, in priority order (holding a cache, then started,
     then fresh; the furthest along first, so caches finish and go), each costing
     need = min(context + max_new_tokens, max_context) positions, the entry its turn ends with,
     while outside + sum(need) <= L; at least one episode, so a step always progresses;
  3. keeps the other caches of the call's episodes (waiting ones first, then finished ones) while
     they fit beside that, and drops the rest: the episode prefills its context again when it next
     runs or is branched from (recompute preemption, as vLLM's scheduler does).

So the entries held at every turn boundary are at most L (tested). Within a turn two transients
come on top, for moments: an episode's old entry lives until its prefill bucket (<=
gen_batch_size rows) has made the new one, and a stopping row's prefill entry until its final one
is copied out. The memory ledger measures the real peak with both.

rollout.run_twins adds what only it knows: it forms chunks of at most L / 2 positions of twins and
drops the factual caches that later chunks would branch from (the latest first) until the chunk
fits beside them.

No token changes: every draw is keyed, so which episodes share a turn and whether a context was
cached or prefilled again changes nothing but the float rounding of its logits (DEVIATION P1).
"""
from generation import engine

GIB = 2 ** 30


def limit(model, proto):
    """Positions of KV entries allowed at once for this model, or None: no budget, or a path that
    keeps no caches (engine = generate)."""
    if not proto.kv_budget_gib or not engine._cached_engine(model, proto):
        return None
    return max(1, int(proto.kv_budget_gib * GIB) // engine.position_bytes(model))


def live_positions() -> int:
    """Positions of every KV entry alive."""
    return sum(e.positions for e in list(engine.LIVE))


def held(ep):
    """The episode's KV entry, or None."""
    return getattr(ep, "_kv", None)


def need(ep, proto, context=None) -> int:
    """Positions of the entry the episode's next turn ends with, at most; context: the tokens
    before that turn (default: the episode's whole context; a twin of turn t: those before t)."""
    if context is None:
        context = len(ep.prompt_ids) + len(ep.ids)
    return min(context + proto.max_new_tokens, proto.max_context)


def schedule(episodes, proto, cap: int) -> list:
    """The episodes (not done) that take the next turn under `cap` positions; the caches of the
    others that do not fit beside them are dropped (module docstring)."""
    mine = {id(e): e for e in map(held, episodes) if e is not None}
    outside = live_positions() - sum(e.positions for e in mine.values())
    live = [ep for ep in episodes if not ep.done]
    order = sorted(range(len(live)),
                   key=lambda i: (held(live[i]) is None, -len(live[i].turns), i))
    chosen, used = [], outside
    for i in order:
        n = need(live[i], proto)
        if not chosen or used + n <= cap:
            chosen.append(live[i])
            used += n
    picked = {id(ep) for ep in chosen}
    waiting = [live[i] for i in order if id(live[i]) not in picked]
    kept = set()  # entries of the chosen die as their turn replaces them; others stay unless dropped
    for ep in waiting + [ep for ep in episodes if ep.done]:
        entry = held(ep)
        if entry is None or id(entry) in kept:
            continue
        if used + entry.positions <= cap:
            kept.add(id(entry))
            used += entry.positions
        else:
            ep._kv = None
    return chosen


def trim(episodes, cap: int):
    """Drop the caches of `episodes`, the last first, until every live entry fits in `cap`
    positions (or none of theirs is left). A shared entry lives while anyone holds it."""
    for ep in reversed(episodes):
        if live_positions() <= cap:
            return
        ep._kv = None
