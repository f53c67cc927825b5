"""Learned credit estimators (PPO's critic, SPA-RL's progress estimator, AgentPRM's PRM) and the extra policy passes
of IGPO and CRAFT: small torch models and their training steps. Used by methods.py; no rollout, no policy update.

`Estimator`: a copy of the policy's transformer body with a scalar head, as Search-R1's PPO critic is a copy of the
policy model with a value head (verl critic: AutoModelForTokenClassification, num_labels = 1). It scores every
position of a batch (B, L) and trains with its own AdamW on a loss the method defines, on the step's batch.
# DEVIATION L1: the head starts at zero (verl: random), so the first step's values are 0 (PRM: Q = 0.5); all three
estimators learn at estimator_lr_scale x lr (Search-R1's critic/actor ratio, 1e-5 / 1e-6; the papers' PE and PRM
are trained offline).
Gradients are averaged over ranks before each optimizer step, so every rank holds the same estimator.

`token_logprobs_rows`: log p(row[k+1] | row[:k+1]) of plain token rows, teacher-forced, micro-batched: the answer
log-probs of IGPO and the teacher log-probs of CRAFT.
"""
import copy

import numpy as np
import torch


class Scorer(torch.nn.Module):
    """Transformer body + linear head: (B, L) token ids -> (B, L) scalars, position k scoring the prefix [0, k]."""

    def __init__(self, body, hidden: int):
        super().__init__()
        self.body = body
        self.head = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids, attention_mask):
        h = self.body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, L, H)
        return self.head(h.float()).squeeze(-1)  # (B, L)


class Estimator:
    """A Scorer initialised from the policy's body, its AdamW, and counters of the tokens it ran on."""

    def __init__(self, policy, lr: float, weight_decay: float, device):
        body = copy.deepcopy(policy.base_model).float()
        body.requires_grad_(True)
        self.net = Scorer(body, policy.config.hidden_size).to(device)
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=lr, weight_decay=weight_decay)
        self.fwd_tokens = 0  # tokens through a forward pass (scoring and training)
        self.bwd_tokens = 0  # tokens through a backward pass

    @torch.no_grad()
    def scores(self, input_ids, attention_mask, micro: int) -> torch.Tensor:
        """(B, L) scores, micro-batched, no gradient."""
        self.net.eval()
        out = [self.net(input_ids[r], attention_mask[r]) for r in _chunks(len(input_ids), micro)]
        self.fwd_tokens += int(attention_mask.sum())
        return torch.cat(out)

    def fit(self, accel, input_ids, attention_mask, loss_sum, norm: float, micro: int, grad_clip=1.0) -> float:
        """One optimizer step on loss_sum(scores (b, L), rows) / norm summed over micro-batches of rows (the
        caller's normalisation, e.g. the batch's token or row count); returns the loss, averaged over ranks."""
        self.net.train()
        self.opt.zero_grad(set_to_none=True)
        total = 0.0
        with torch.enable_grad():
            for rows in _chunks(len(input_ids), micro):
                loss = loss_sum(self.net(input_ids[rows], attention_mask[rows]), rows) / norm
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"estimator loss = {loss.item()} (lower estimator_lr_scale)")
                loss.backward()
                total += loss.item()
        if accel.num_processes > 1:  # every rank keeps the same estimator
            for p in self.net.parameters():
                if p.grad is not None:
                    p.grad = accel.reduce(p.grad, "mean")
            total = float(accel.reduce(torch.tensor(total, device=accel.device), "mean"))
        torch.nn.utils.clip_grad_norm_(self.net.parameters(), grad_clip)
        self.opt.step()
        n = int(attention_mask.sum())
        self.fwd_tokens, self.bwd_tokens = self.fwd_tokens + n, self.bwd_tokens + n
        return total

    def state_dict(self) -> dict:
        return {"net": self.net.state_dict(), "opt": self.opt.state_dict()}

    def load_state_dict(self, state: dict):
        self.net.load_state_dict(state["net"])
        self.opt.load_state_dict(state["opt"])


def _chunks(n: int, size: int) -> list:
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
def token_logprobs_rows(model, rows: list, pad_id: int, micro: int, temperature: float = 1.0) -> list:
    """Per row (len n), the n - 1 log-probs log softmax(logits / T)[row[k + 1]] at positions k = 0..n-2."""
    ids, att = pad_rows(rows, pad_id, next(model.parameters()).device)
    out = []
    for r in _chunks(len(rows), micro):
        logits = model(input_ids=ids[r], attention_mask=att[r]).logits[:, :-1].float() / temperature
        lp = torch.log_softmax(logits, -1).gather(-1, ids[r][:, 1:, None]).squeeze(-1)  # (b, L-1)
        out += [lp[j, :len(rows[int(b)]) - 1].cpu().numpy().astype(np.float64) for j, b in enumerate(r)]
    return out
