"""Memory-bounded token log-probs of a causal LM: the policy loss's log pi and entropy without
(B, L, V) tensors.

Why a file of its own: the trainer's update, the old-policy and reference passes and the benchmarks
all need the same computation, and it is a concept of its own (how to get log softmax(W h / T)
without materialising it).

    log pi(x_{k+1} | x_<=k) = (W h_k)[x_{k+1}] / T - logsumexp_v (W h_k)_v / T,
    H_k = lse_k - sum_v p_v (W h_k)_v / T

The transformer body runs once (its logits kept for one position only: logits_to_keep=1); the LM
head then runs on at most `chunk_elements / V` selected positions at a time, so the extra float32
memory is a few (chunk, V) blocks (~64 MB each by default) instead of (B, L, V) logits,
log-softmax, exp and product (~20 GB each at 8 x 4096 x 151,936). With gradients each chunk is
checkpointed: its (chunk, V) block is recomputed in the backward pass rather than kept. Only the
positions asked for (the loss mask in the update) go through the head.

`token_logprobs_rows` is the plain teacher-forced pass over short token rows that some baselines
take (IGPO, CRAFT).
"""
import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

# positions x vocabulary per LM-head chunk: 64 MB per float32 (chunk, V) block
CHUNK_ELEMENTS = 1 << 24


def _unwrap(model):
    """The module under DDP / DeepSpeed wrappers (their forward is still what runs the body)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def final_hidden(model, input_ids, attention_mask):
    """(B, L, H) hidden states after the final norm, from the wrapper's forward (logits of the last
    position only). A transformers model's final norm output is read by a hook: asking for
    output_hidden_states would keep every layer's states (2.4 GB at 8 x 2000 tokens of Qwen2.5-3B)
    through a pass without gradients. No KV cache is built (use_cache=False: a cache of the whole
    micro-batch would be made and thrown away)."""
    inner = _unwrap(model)
    norm = (getattr(inner.base_model, "norm", None)
            if type(inner).forward.__module__.startswith("transformers.") else None)
    if norm is None:  # a model whose forward is its own: its reported last hidden state
        return model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                     logits_to_keep=1, use_cache=False).hidden_states[-1]
    seen = []
    hook = norm.register_forward_hook(lambda mod, args, out: seen.append(out))
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=1, use_cache=False)
    finally:
        hook.remove()
    return seen[-1]


def _chunk_stats(head, h, targets, temperature, with_entropy):
    """(n,) log-probs (and entropies) of targets under softmax(head(h) / T); h (n, H)."""
    # (n, V); h is float32 out of an accelerate-wrapped forward
    logits = head(h.to(head.weight.dtype)).float()
    if temperature != 1:
        logits = logits / temperature
    lse = torch.logsumexp(logits, -1)  # (n,)
    lp = logits.gather(1, targets[:, None]).squeeze(1) - lse
    if not with_entropy:
        return lp, lp.new_zeros(())
    return lp, lse - (torch.softmax(logits, -1) * logits).sum(-1)


def token_logprobs(model, input_ids, attention_mask, temperature, with_entropy=False,
                   positions=None, chunk_elements=CHUNK_ELEMENTS):
    """log pi(x_{k+1} | x_<=k) at every position k, (B, L-1), and the entropy (or None); 0 where
    not computed.

    positions: (B, L-1) bool, the positions to compute (default: every k whose token and next
    token are real).
    """
    # (B, L-1, H): what the LM head reads
    hidden = final_hidden(model, input_ids, attention_mask)[:, :-1]
    if positions is None:
        positions = attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()
    sel = positions.bool().flatten().nonzero().squeeze(1)  # (N,) flat indices into (B, L-1)
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, sel)  # (N, H)
    targets = input_ids[:, 1:].reshape(-1).index_select(0, sel)
    # DEVIATION P4: the head runs outside the wrapper's forward (its weight gets both uses'
    # gradients in one backward): right for DDP and ZeRO-2, not for ZeRO-3 / FSDP, which shard the
    # head's weight.
    head = _unwrap(model).get_output_embeddings()
    step = max(1, chunk_elements // head.weight.shape[0])
    lps, ents = [], []
    for s in range(0, len(sel), step):
        args = (head, h[s:s + step], targets[s:s + step], temperature, with_entropy)
        # keep only h per chunk; the (chunk, V) block is recomputed in backward
        if torch.is_grad_enabled():
            lp, ent = checkpoint(_chunk_stats, *args, use_reentrant=False)
        else:
            lp, ent = _chunk_stats(*args)
        lps.append(lp)
        ents.append(ent)
    shape = positions.shape
    lp = _scatter(lps, sel, shape, hidden)
    return lp, (_scatter(ents, sel, shape, hidden) if with_entropy else None)


def _scatter(parts, sel, shape, like):
    flat = torch.zeros(shape[0] * shape[1], dtype=torch.float32, device=like.device)
    if parts:
        # out of place: autograd flows into the chunks
        flat = flat.index_put((sel,), torch.cat(parts))
    return flat.view(shape)


def length_sorted_splits(lengths, rows, n_splits: int) -> list:
    """rows split into n_splits micro-batches of similar lengths (stable sort by length): little
    padding per split. The loss is a token sum, so which rows share a micro-batch changes only
    float rounding."""
    rows = np.asarray(rows)
    rows = rows[np.argsort(np.asarray(lengths)[rows], kind="stable")]
    return [r for r in np.array_split(rows, n_splits) if len(r)]


def trimmed(batch: dict, rows, keys=("input_ids", "attention_mask", "loss_mask")) -> tuple:
    """The rows of a right-padded batch cut to their longest row: (dict of (b, w) tensors, w)."""
    width = int(batch["attention_mask"][rows].sum(1).max())
    return {k: batch[k][rows, :width] for k in keys if k in batch}, width


def check_context(batch: dict, max_context: int | None):
    """Refuse a batch with a row longer than max_context: no pass may allocate past what the rollout
    is bounded by (one 15k-token prompt made a (chunk, V) pass ask for 9 GB). None: unchecked."""
    if max_context is None:
        return
    lengths = batch["attention_mask"].sum(1)
    if len(lengths) and int(lengths.max()) > max_context:
        b = int(lengths.argmax())
        raise ValueError(
            f"batch_logprobs: row {b} has {int(lengths[b])} tokens, past max_context={max_context} "
            f"({int((lengths > max_context).sum())} such row(s)); over-long prompts are refused "
            "when the QA file is loaded (eval.refuse_long_prompts)")


@torch.no_grad()
def batch_logprobs(model, batch, temperature, micro_batch_size, with_entropy=False,
                   max_context=None):
    """(log-probs, entropy or None) at the loss-masked positions of a batch (0 elsewhere:
    DEVIATION P2), no grads (old policy, reference); micro-batches of similar lengths, each cut to
    its longest row. With max_context, a row longer than it is refused before any forward
    (check_context)."""
    check_context(batch, max_context)
    n = batch["input_ids"].shape[0]
    lp = torch.zeros(n, batch["input_ids"].shape[1] - 1, device=batch["input_ids"].device)
    ent = torch.zeros_like(lp) if with_entropy else None
    lengths = batch["attention_mask"].sum(1).cpu().numpy()
    for rows in length_sorted_splits(lengths, np.arange(n), -(-n // micro_batch_size)):
        mb, w = trimmed(batch, rows)
        lp[rows, :w - 1], e = token_logprobs(model, mb["input_ids"], mb["attention_mask"],
                                             temperature, with_entropy,
                                             mb["loss_mask"][:, 1:].bool())
        if with_entropy:
            ent[rows, :w - 1] = e
    return lp, ent


def micro_batches(n: int, size: int) -> list:
    """Row indices 0..n-1 in consecutive chunks of `size` (tensors, for indexing batches)."""
    return [torch.arange(i, min(i + size, n)) for i in range(0, n, size)]


def pad_rows(rows: list, pad_id: int, device) -> tuple:
    """Right-padded (B, L) input_ids and attention_mask of token lists."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    att = torch.zeros((len(rows), width), dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, :len(row)] = torch.tensor(row, dtype=torch.long)
        att[b, :len(row)] = 1
    return ids.to(device), att.to(device)


@torch.no_grad()
def token_logprobs_rows(model, rows: list, pad_id: int, micro: int,
                        temperature: float = 1.0) -> list:
    """Per row (len n), the n - 1 log-probs log softmax(logits / T)[row[k + 1]] at positions
    k = 0..n-2, teacher-forced through the full LM head (rows are short: IGPO's gold-answer
    log-probs, CRAFT's teacher log-probs)."""
    ids, att = pad_rows(rows, pad_id, next(model.parameters()).device)
    out = []
    for r in micro_batches(len(rows), micro):
        logits = model(input_ids=ids[r], attention_mask=att[r]).logits[:, :-1].float() / temperature
        lp = torch.log_softmax(logits, -1).gather(-1, ids[r][:, 1:, None]).squeeze(-1)  # (b, L-1)
        out += [lp[j, :len(rows[int(b)]) - 1].cpu().numpy().astype(np.float64)
                for j, b in enumerate(r)]
    return out


def policy_gradients(model, batch, advantages, temperature, micro_batch_size) -> list:
    """Per (B, L-1) advantage tensor a of `advantages`, the flat gradient of the policy-gradient
    loss -sum_k a_k w_k log pi(x_k) over the batch (w the loss mask's weights): the PPO surrogate's
    gradient at ratio 1, a token sum (divide by sum w for the token mean). One forward per
    micro-batch serves every advantage; .grad is not touched. float32 vectors over the trained
    weights, in model.parameters() order."""
    params = [p for p in model.parameters() if p.requires_grad]
    sums = [[torch.zeros_like(p, dtype=torch.float32) for p in params] for _ in advantages]
    weight = batch["loss_mask"][:, 1:].float()
    n = batch["input_ids"].shape[0]
    lengths = batch["attention_mask"].sum(1).cpu().numpy()
    for rows in length_sorted_splits(lengths, np.arange(n), -(-n // micro_batch_size)):
        mb, w = trimmed(batch, rows)
        lp, _ = token_logprobs(model, mb["input_ids"], mb["attention_mask"], temperature, False,
                               mb["loss_mask"][:, 1:].bool())
        for acc, adv in zip(sums, advantages):
            loss = -(adv[rows, :w - 1] * weight[rows, :w - 1] * lp).sum()
            for a, g in zip(acc, torch.autograd.grad(loss, params, retain_graph=True,
                                                     allow_unused=True)):
                if g is not None:
                    a += g.float()
    return [torch.cat([g.reshape(-1) for g in acc]) for acc in sums]


def gradient_share(model, batch, part, whole, temperature, micro_batch_size) -> float:
    """||g(part)|| / ||g(whole)|| (policy_gradients): how much of the update an advantage part
    carries (the twin term in A = A_traj + twin term). (B, L-1) advantages; two more backward
    passes over the batch and two gradient buffers of the trained weights (a diagnostic: the
    presets of real models turn it off)."""
    g_part, g_whole = policy_gradients(model, batch, (part, whole), temperature, micro_batch_size)
    norm = float(torch.linalg.vector_norm(g_whole))
    return float(torch.linalg.vector_norm(g_part)) / norm if norm > 0 else 0.0
