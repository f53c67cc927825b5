"""TWICE: GRPO with twin-world credit for multi-turn search agents (one file: config, loop, loss, checkpoints).

Paper: "Same Luck, Different Choice: Twin-World Credit Assignment for Agentic Reinforcement Learning"
(arXiv 2610.31544). Reference design: DESIGN.md sections 5-6. One step:

  1. G factual episodes per prompt, every token sampled by keyed Gumbel-max (rollout.py):
     key = mix(seed, step, prompt_uid, line), noise u = U(key, turn, pos, token).
  2. Trajectory advantage (GRPO):     A_traj_i = (U_i - mean_group) / (std_group + eps)
  3. Budget rule:                     q_t = clip(lambda * sqrt(p_t / c_t), q_min, 1),  sum_t q_t c_t = budget
     p_t = predicted P(U != U') (online logistic regression), c_t = tokens of y_t and of everything after it,
     budget = twin_budget * factual tokens; decision t is branched iff a keyed uniform < q_t.
  4. Twins: y' ~ pi(.|s_t) with alternative keys, then the factual keys for every later (turn, pos):
     same luck, different choice. D_t = U - U' is unbiased for Q(s_t, y_t) - V(s_t), Var = (1 - rho) x that of an
     independent counterfactual. Self-twins (y' == y_t) and same-evidence searches cost no rollout (D_t = 0).
  5. Horvitz-Thompson:                A_hat_t = 1[branched] * mean_j D_t^j / q_t
  6. Token advantage on the sampled tokens of turn t:  A = A_traj_i + omega * A_hat_t / sigma_hat
  7. PPO-clip on token ratios (clip 0.2), token-mean over loss-masked tokens, k3 KL to the frozen reference.
omega = 0 is GRPO (no twins are launched); coupling = False is the independent-counterfactual baseline.

How this differs from textbook GRPO (as run by Search-R1/verl):
  - turn-level twin credit is added to the broadcast trajectory advantage (steps 3-6);
  - every token is sampled with keyed Gumbel noise, which is exact sampling from softmax(logits / T);
  - observation tokens (<information> blocks, invalid-action messages) carry loss mask 0 (as Search-R1).

Deviations (each tagged `# DEVIATION:` in the code):
  1. The budget's lambda is solved per rank (each rank's share of the batch), not over the global batch.

Launch:
  make demo                                                    # CPU, built-in tiny world, minutes
  python train_twice.py configs/demo.cfg --omega=0             # the same run as GRPO
  python train_twice.py configs/qwen2.5-3b.cfg --steps=5       # one GPU, real model
  accelerate launch --config_file configs/accelerate_ddp.yaml train_twice.py configs/qwen2.5-3b.cfg   # 8 GPUs
  ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 train_twice.py configs/demo.cfg  # 2 CPU ranks
"""
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

import credit
import eval as qa_eval
import rollout

BRANCH_TAG = 0x6272616E  # "bran": keyed uniforms of the branch draws, independent of every sampling key


@dataclass
class Config:
    # --- io ---
    world: str = "data/tinyworld"   # built-in tiny world (tinyworld.py); fills model/train_data/eval_data/index
    model: str = ""                 # initial policy and reference: HF hub id or folder ("" -> {world}/policy)
    train_data: str = ""            # QA .jsonl/.parquet (id, question, golden_answers, data_source)
    eval_data: str = ""             # comma-separated QA files for periodic greedy evaluation
    index: str = ""                 # retriever index folder (retriever.py build); "" -> {world}/index
    retriever_url: str = ""         # Search-R1-style HTTP retriever (POST /retrieve); replaces `index` when set
    out_dir: str = "runs/twice"     # metrics.jsonl, checkpoints, learning_curve.png
    resume: str = ""                # checkpoint folder to continue from; the run continues exactly
    # --- rollout (DESIGN 3) ---
    prompts_per_step: int = 512     # prompts per step over all ranks (Search-R1 train_batch_size)
    group_size: int = 5             # G, lines per prompt
    max_turns: int = 4              # searches per episode, then one final turn
    topk: int = 3                   # documents per search
    max_new_tokens: int = 500       # tokens per turn
    max_obs_tokens: int = 500       # tokens per observation
    max_context: int = 4096         # prompt + response tokens
    temperature: float = 1.0        # T of the keyed Gumbel sampler (and of the log-probs in the loss)
    top_p: float = 1.0              # nucleus applied before the noise; 1 = off
    top_k: int = 0                  # top-k applied before the noise; 0 = off
    gen_batch_size: int = 64        # rows per generate call
    fused_sampler: bool = False     # torch.compile the keyed sampler (GPU)
    # --- credit (DESIGN 5) ---
    omega: float = 1.0              # omega, weight of the twin credit; 0 = GRPO (no twins are launched)
    twin_budget: float = 0.7        # expected twin tokens / factual tokens (sum_t q_t c_t)
    q_min: float = 0.05             # q_min, floor of the branch probability
    twins_per_decision: int = 1     # K twins per branched decision
    coupling: bool = True           # twins replay the factual keys; False = independent counterfactual baseline
    budget_rule: str = "sqrt"       # "sqrt" (q ~ sqrt(p / c)) or "uniform" (same q for every decision)
    same_evidence_shortcut: bool = True  # D = 0 without rollout when both searches retrieve the same doc ids
    scale_decay: float = 0.9        # EMA decay of sigma_hat (RMS of the nonzero A_hat)
    adv_eps: float = 1e-6           # eps of the GRPO std normalisation
    # --- optim (DESIGN 6) ---
    steps: int = 200                # optimisation steps (one batch of prompts each)
    lr: float = 1e-6                # AdamW learning rate (Search-R1: 1e-6)
    warmup_steps: int = 0           # linear warm-up steps, then constant
    weight_decay: float = 0.01      # AdamW weight decay
    clip: float = 0.2               # PPO ratio clip epsilon
    kl_coef: float = 0.001          # k3 KL to the frozen reference (Search-R1: low_var_kl 0.001)
    entropy_coef: float = 0.0       # entropy bonus coefficient
    ppo_epochs: int = 1             # passes over each batch
    mini_batches: int = 1           # optimizer steps per pass (Search-R1: 512 prompts / ppo_mini_batch 256 = 2)
    micro_batch_size: int = 8       # sequences per forward/backward; gradients accumulate over a mini-batch
    grad_clip: float = 1.0          # max global grad norm
    bf16: bool = False              # bf16 autocast (GPU)
    gradient_checkpointing: bool = False  # trade compute for memory (real models)
    # --- run ---
    seed: int = 0                   # run seed: prompt order, every sampling key, branch draws
    eval_every: int = 50            # steps between greedy evaluations (0 = only at the end)
    eval_size: int = 0              # questions per periodic evaluation (0 = all); the final one uses all
    save_every: int = 0             # steps between checkpoints (0 = only at the end)
    log_tensorboard: bool = True    # also write TensorBoard events when tensorboard is installed


# ---------------------------------------------------------------------------------------------------------------
# Config: --key=value and preset files of `key = value` lines, coerced to the field's type

def _coerce(name: str, value: str, kind):
    kind = {"int": int, "float": float, "bool": bool, "str": str}.get(kind, kind)
    value = value.strip()
    if kind is bool:
        if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
            raise ValueError(f"{name}: expected a boolean (true/false), got {value!r}")
        return value.lower() in ("1", "true", "yes")
    if kind is str:
        return value[1:-1] if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'" else value
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{name}: expected {kind.__name__}, got {value!r}") from None


def _set(cfg: Config, key: str, value: str, where: str):
    fields = {f.name: f.type for f in dataclasses.fields(Config)}
    if key not in fields:
        raise ValueError(f"{where}: unknown config key {key!r}; valid keys: {', '.join(fields)}")
    setattr(cfg, key, _coerce(f"{where}: {key}", value, fields[key]))


def parse_config(argv) -> Config:
    """Config from preset files (positional, `key = value` lines, # comments) then `--key=value` overrides."""
    cfg = Config()
    for arg in argv:
        if arg.startswith("--"):
            key, sep, value = arg[2:].partition("=")
            if not sep:
                raise ValueError(f"{arg}: overrides are written --key=value")
            _set(cfg, key, value, "command line")
            continue
        with open(arg, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                line = line.split("#", 1)[0].strip()
                if line:
                    key, sep, value = line.partition("=")
                    if not sep:
                        raise ValueError(f"{arg}:{lineno}: expected `key = value`, got {line!r}")
                    _set(cfg, key.strip(), value, f"{arg}:{lineno}")
    return resolve(cfg)


def resolve(cfg: Config) -> Config:
    """Fill blank paths from the tiny world and check the values that would otherwise fail deep inside a step."""
    cfg.model = cfg.model or os.path.join(cfg.world, "policy")
    cfg.train_data = cfg.train_data or os.path.join(cfg.world, "train.jsonl")
    cfg.eval_data = cfg.eval_data or os.path.join(cfg.world, "test.jsonl")
    cfg.index = cfg.index or ("" if cfg.retriever_url else os.path.join(cfg.world, "index"))
    checks = {"budget_rule": cfg.budget_rule in ("sqrt", "uniform"), "group_size": cfg.group_size >= 2,
              "prompts_per_step": cfg.prompts_per_step >= 1, "twin_budget": cfg.twin_budget >= 0,
              "q_min": 0 < cfg.q_min <= 1, "twins_per_decision": cfg.twins_per_decision >= 1,
              "temperature": cfg.temperature > 0, "mini_batches": cfg.mini_batches >= 1}
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        raise ValueError(f"invalid config value(s): {', '.join(f'{k}={getattr(cfg, k)!r}' for k in bad)}")
    return cfg


def protocol(cfg: Config, greedy=False) -> rollout.Protocol:
    return rollout.Protocol(max_turns=cfg.max_turns, topk=cfg.topk, max_new_tokens=cfg.max_new_tokens,
                            max_obs_tokens=cfg.max_obs_tokens, max_context=cfg.max_context,
                            temperature=0.0 if greedy else cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                            gen_batch_size=cfg.gen_batch_size, fused_sampler=cfg.fused_sampler)


# ---------------------------------------------------------------------------------------------------------------
# Prompts, twin credit (DESIGN 5)

def prompts_for_step(rows: list, cfg: Config, step: int, rank: int, world: int) -> list:
    """This rank's share of the step's prompts: epoch-wise permutations seeded by mix(seed, epoch), so any step's
    batch is known without replaying the run (exact resume)."""
    n, k0 = len(rows), step * cfg.prompts_per_step
    perms = {}
    batch = []
    for k in range(k0, k0 + cfg.prompts_per_step):
        epoch, i = divmod(k, n)
        if epoch not in perms:
            perms[epoch] = np.random.default_rng(rollout.mix(cfg.seed, epoch)).permutation(n)
        batch.append(rows[perms[epoch][i]])
    return batch[rank::world]


def decision_table(episodes: list, group_success: np.ndarray):
    """Every (episode, turn) decision: index pairs, predictor features (n, F) and twin costs c_t (n,) in tokens
    (y_t and every factual token sampled after it: what a twin from s_t is predicted to generate)."""
    idx, cols, cost = [], {k: [] for k in ("turn", "action", "entropy", "group_success", "outcome",
                                           "turns_remaining")}, []
    for i, ep in enumerate(episodes):
        for t, turn in enumerate(ep.turns):
            idx.append((i, t))
            for k, v in (("turn", t), ("action", turn.action), ("group_success", group_success[i]),
                         ("entropy", float(np.mean(turn.entropy)) if turn.entropy else 0.0),
                         ("outcome", ep.reward), ("turns_remaining", len(ep.turns) - 1 - t)):
                cols[k].append(v)
            cost.append(max(1, sum(u.end - u.start for u in ep.turns[t:])))
    return idx, credit.featurize(**cols), np.asarray(cost, dtype=np.float64)


def gather_list(accel, items: list) -> list:
    """Concatenation of every rank's list, in rank order (identical on all ranks)."""
    if accel.num_processes == 1:
        return list(items)
    from accelerate.utils import gather_object
    return list(gather_object(list(items)))


def twin_step(cfg, accel, step, episodes, policy, tok, retriever, predictor, scale):
    """Budget rule -> branch draws -> twins -> Horvitz-Thompson credit. Returns (per-episode turn credit, stats)."""
    G = cfg.group_size
    rewards = np.array([ep.reward for ep in episodes])
    group_success = rewards.reshape(-1, G).mean(1).repeat(G)
    idx, X, cost = decision_table(episodes, group_success)
    factual_tokens = sum(ep.n_generated for ep in episodes)
    # DEVIATION: lambda is solved over this rank's decisions (the budget is this rank's share of the batch's).
    budget = credit.solve_budget(predictor.predict(X), cost, cfg.twin_budget * factual_tokens, cfg.q_min,
                                 cfg.budget_rule)
    u = np.array([rollout.mix(cfg.seed, step, episodes[i].uid, episodes[i].line, t, BRANCH_TAG) / 2.0 ** 64
                  for i, t in idx])
    branched = credit.branch_mask(budget.q, u)
    pairs = [(n, j) for n in np.flatnonzero(branched) for j in range(cfg.twins_per_decision)]  # (decision, twin j)
    requests = [(episodes[idx[n][0]], idx[n][1], j) for n, j in pairs]
    results = rollout.run_twins(accel.unwrap_model(policy), tok, retriever, requests, protocol(cfg),
                                cfg.coupling, cfg.same_evidence_shortcut)
    diffs = [[] for _ in idx]
    for (n, _), res in zip(pairs, results):
        diffs[n].append(res.diff)
    a_hat = credit.ht_credit(diffs, branched, budget.q)
    labels = [(X[n].tolist(), float(res.diff != 0)) for (n, _), res in zip(pairs, results)]
    everyone = gather_list(accel, labels)  # every rank fits the same predictor on the whole batch's twins
    acc = predictor.update(np.array([x for x, _ in everyone]).reshape(-1, X.shape[1]), [y for _, y in everyone])
    scale.update(gather_list(accel, a_hat[branched].tolist()))
    turn_credit = [np.zeros(len(ep.turns)) for ep in episodes]
    for (i, t), a in zip(idx, a_hat):
        turn_credit[i][t] = a
    kinds = [res.kind for res in results]
    stats = {"decisions": len(idx), "twins": len(results), "self_twins": kinds.count("self"),
             "shortcuts": kinds.count("same_evidence"), "twin_rollouts": kinds.count("rollout"),
             "discordant": sum(res.diff != 0 for res in results), "twin_tokens": sum(r.tokens for r in results),
             "q_mean": float(budget.q.mean()) if len(idx) else 0.0, "budget_over": int(budget.over),
             "predictor_acc": acc}
    return turn_credit, stats


# ---------------------------------------------------------------------------------------------------------------
# Policy loss (DESIGN 6)

def token_logprobs(model, input_ids, attention_mask, temperature, with_entropy=False):
    """log pi(x_{k+1} | x_<=k) of softmax(logits / T) at every position k, (B, L-1); optionally its entropy."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float() / temperature
    logp = torch.log_softmax(logits, -1)  # (B, L-1, V)
    lp = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1) if with_entropy else None
    return lp, ent


@torch.no_grad()
def batch_logprobs(model, batch, cfg):
    """(log-probs, entropy) of a whole batch, micro-batched, without gradients (old policy and reference)."""
    lps, ents = [], []
    for s in range(0, batch["input_ids"].shape[0], cfg.micro_batch_size):
        lp, ent = token_logprobs(model, batch["input_ids"][s:s + cfg.micro_batch_size],
                                 batch["attention_mask"][s:s + cfg.micro_batch_size], cfg.temperature, True)
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps), torch.cat(ents)


def ppo_loss(cfg, lp, old_lp, ref_lp, adv, mask, ent=None):
    """Per-token PPO-clip surrogate + k3 KL to the reference - entropy bonus, and the clipped-token indicator."""
    ratio = torch.exp(lp - old_lp)
    pg = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - cfg.clip, 1 + cfg.clip) * adv)
    d = ref_lp - lp
    kl = torch.exp(d) - d - 1  # k3 estimator of KL(pi || ref): unbiased, >= 0 (Schulman 2020)
    loss = pg + cfg.kl_coef * kl - (cfg.entropy_coef * ent if ent is not None else 0.0)
    return loss * mask, kl * mask, ((ratio - 1).abs() > cfg.clip).float() * mask


def ppo_update(cfg, accel, model, opt, batch, adv, old_lp, ref_lp, n_micro, step) -> dict:
    """ppo_epochs passes of mini_batches optimizer steps; token-mean over the mini-batch's loss-masked tokens of
    every rank; gradients accumulated over n_micro micro-batches (the same count on every rank)."""
    mask = batch["loss_mask"][:, 1:].float()  # (B, L-1): position k predicts token k+1
    sums = torch.zeros(4, device=accel.device)  # loss, kl, clipped, tokens
    grad_norms = []
    for epoch in range(cfg.ppo_epochs):
        order = np.random.default_rng(rollout.mix(cfg.seed, step, epoch)).permutation(len(mask))
        for mb in np.array_split(order, cfg.mini_batches):
            n_tok = accel.reduce(mask[mb].sum(), "sum").clamp(min=1)  # global token count of the mini-batch
            for micro in np.array_split(mb, n_micro):
                with accel.accumulate(model):
                    lp, ent = token_logprobs(model, batch["input_ids"][micro], batch["attention_mask"][micro],
                                             cfg.temperature, cfg.entropy_coef > 0)
                    loss, kl, clipped = ppo_loss(cfg, lp, old_lp[micro], ref_lp[micro], adv[micro], mask[micro], ent)
                    total = loss.sum() / n_tok
                    if not torch.isfinite(total):
                        raise FloatingPointError(f"step {step}: non-finite loss {total.item()}")
                    # accelerate divides by n_micro and DDP averages ranks: undo both for a global token mean
                    accel.backward(total * accel.num_processes * n_micro)
                    if accel.sync_gradients:
                        grad_norms.append(float(accel.clip_grad_norm_(model.parameters(), cfg.grad_clip)))
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                sums += torch.stack([loss.sum(), kl.sum(), clipped.sum(), mask[micro].sum()]).detach()
    loss, kl, clipped, tokens = accel.reduce(sums, "sum").tolist()
    return {"loss": loss / max(tokens, 1), "kl": kl / max(tokens, 1), "clip_frac": clipped / max(tokens, 1),
            "grad_norm": float(np.mean(grad_norms)) if grad_norms else 0.0}


# ---------------------------------------------------------------------------------------------------------------
# One step

def train_step(cfg, accel, policy, ref, tok, retriever, opt, predictor, scale, rows, step, n_micro) -> dict:
    times = {"time_start": time.time()}
    unwrapped = accel.unwrap_model(policy)
    unwrapped.eval()
    prompts = prompts_for_step(rows, cfg, step, accel.process_index, accel.num_processes)
    with torch.no_grad(), accel.autocast():
        episodes = rollout.start_episodes(tok, prompts, cfg.seed, step, cfg.group_size)
        rollout.run_episodes(unwrapped, tok, retriever, episodes, protocol(cfg))
        if not episodes:
            raise RuntimeError(f"step {step}: empty batch on rank {accel.process_index}")
        times["time_rollout"] = time.time()
        rewards = np.array([ep.reward for ep in episodes])
        a_traj = credit.grpo_advantages(rewards, np.arange(len(episodes)) // cfg.group_size, cfg.adv_eps)
        turn_credit, stats = [np.zeros(len(ep.turns)) for ep in episodes], {}
        if cfg.omega != 0:
            turn_credit, stats = twin_step(cfg, accel, step, episodes, policy, tok, retriever, predictor, scale)
        times["time_twins"] = time.time()
        batch = {k: v.to(accel.device) for k, v in rollout.collate(episodes, tok.pad_token_id).items()}
        width = batch["input_ids"].shape[1]
        spans = [[(len(ep.prompt_ids) + t.start, len(ep.prompt_ids) + t.end) for t in ep.turns] for ep in episodes]
        adv = credit.token_advantages(a_traj, turn_credit, spans, width, cfg.omega, scale.value)
        adv = torch.tensor(adv[:, 1:], dtype=torch.float32, device=accel.device)  # aligned with token_logprobs
        old_lp, ent = batch_logprobs(unwrapped, batch, cfg)
        ref_lp, _ = batch_logprobs(ref, batch, cfg)
    policy.train()
    lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else cfg.lr
    for group in opt.param_groups:
        group["lr"] = lr
    update = ppo_update(cfg, accel, policy, opt, batch, adv, old_lp, ref_lp, n_micro, step)
    mask = batch["loss_mask"][:, 1:].float()
    local = torch.tensor([rewards.sum(), len(rewards), float((ent * mask).sum()), float(mask.sum()),
                          sum(len(ep.turns) for ep in episodes), sum(ep.n_generated for ep in episodes)],
                         dtype=torch.float64, device=accel.device)
    r_sum, n_ep, ent_sum, n_tok, n_turns, n_gen = accel.reduce(local, "sum").tolist()
    metrics = {"step": step, "reward": r_sum / n_ep, "entropy": ent_sum / max(n_tok, 1), "turns": n_turns / n_ep,
               "factual_tokens": int(n_gen), "lr": lr, "sigma": scale.value, **update}
    metrics.update(reduce_stats(accel, stats, metrics["factual_tokens"]))
    now = time.time()
    metrics.update({"time_rollout": times["time_rollout"] - times["time_start"],
                    "time_twins": times["time_twins"] - times["time_rollout"],
                    "time_update": now - times["time_twins"], "time": now - times["time_start"]})
    return metrics


def reduce_stats(accel, stats: dict, factual_tokens: int) -> dict:
    """Sum the twin counters over ranks and derive the rates that are logged (factual_tokens: already summed)."""
    if not stats:
        return {}
    keys = ["decisions", "twins", "self_twins", "shortcuts", "twin_rollouts", "discordant", "twin_tokens"]
    total = dict(zip(keys, accel.reduce(torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64,
                                                     device=accel.device), "sum").tolist()))
    out = {k: int(v) for k, v in total.items()}
    out.update({"discordance": total["discordant"] / max(total["twins"], 1),
                "twin_token_ratio": total["twin_tokens"] / max(factual_tokens, 1),
                "predictor_acc": stats["predictor_acc"], "q_mean": stats["q_mean"]})
    return out


# ---------------------------------------------------------------------------------------------------------------
# Evaluation, checkpoints, logs

def run_eval(cfg, accel, policy, tok, retriever, rows) -> dict:
    """Greedy EM on the eval rows (sharded over ranks): {"eval_em": average over sources, "eval_em/<source>": ..}."""
    mine = list(range(accel.process_index, len(rows), accel.num_processes))
    unwrapped = accel.unwrap_model(policy)
    unwrapped.eval()
    with torch.no_grad(), accel.autocast():
        eps = qa_eval.evaluate(unwrapped, tok, retriever, [rows[i] for i in mine], protocol(cfg, greedy=True),
                               progress=accel.is_main_process)
    scored = sorted(gather_list(accel, [(i, ep.reward) for i, ep in zip(mine, eps)]))
    per_source = qa_eval.summarize(rows, [r for _, r in scored])
    out = {f"eval_em/{k}": em for k, (_, em) in per_source.items()}
    out["eval_em"] = float(np.mean(list(out.values())))
    return out


def _provenance() -> dict:
    import transformers
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        commit = ""
    return {"git_commit": commit, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": sys.version.split()[0]}


def save_checkpoint(cfg, accel, policy, tok, predictor, scale, step: int) -> str:
    """out_dir/step_NNNNNN: policy/ (HF folder, deployable), trainer/ (accelerate state: weights, optimizer, RNG),
    run.json (config, step, predictor and scale, provenance). Written to a temp dir, then renamed: atomic."""
    final = os.path.join(cfg.out_dir, f"step_{step:06d}")
    tmp = final + ".tmp"
    if accel.is_main_process and os.path.exists(tmp):
        shutil.rmtree(tmp)
    accel.wait_for_everyone()
    accel.save_state(os.path.join(tmp, "trainer"))
    if accel.is_main_process:
        accel.unwrap_model(policy).save_pretrained(os.path.join(tmp, "policy"))
        tok.save_pretrained(os.path.join(tmp, "policy"))
        run = {"config": dataclasses.asdict(cfg), "step": step, "predictor": predictor.state_dict(),
               "scale": scale.state_dict(), **_provenance()}
        with open(os.path.join(tmp, "run.json"), "w") as f:
            json.dump(run, f)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
    accel.wait_for_everyone()
    return final


RESUME_FREE = {"resume", "steps", "eval_every", "eval_size", "save_every", "out_dir", "log_tensorboard"}


def load_checkpoint(cfg, accel, predictor, scale) -> int:
    """Restore weights, optimizer, RNG, predictor and scale from cfg.resume; returns the step to continue from.
    Refuses a checkpoint written with a config that differs in anything that changes results."""
    with open(os.path.join(cfg.resume, "run.json")) as f:
        run = json.load(f)
    diff = {k: (v, getattr(cfg, k)) for k, v in run["config"].items()
            if k not in RESUME_FREE and hasattr(cfg, k) and getattr(cfg, k) != v}
    if diff:
        raise ValueError(f"{cfg.resume}: config differs from the checkpoint's (saved, now): {diff}")
    accel.load_state(os.path.join(cfg.resume, "trainer"))
    predictor.load_state_dict(run["predictor"])
    scale.load_state_dict(run["scale"])
    return int(run["step"])


def log_metrics(cfg, metrics: dict, writer=None):
    """One human line and one json row in metrics.jsonl (and TensorBoard scalars when available)."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
    with open(os.path.join(cfg.out_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(clean) + "\n")
    parts = [f"step {metrics['step'] + 1}/{cfg.steps}"]
    for key, fmt in (("reward", ".3f"), ("eval_em", ".3f"), ("kl", ".4f"), ("clip_frac", ".3f"), ("twins", "d"),
                     ("discordance", ".2f"), ("twin_token_ratio", ".2f"), ("time", ".1f")):
        if clean.get(key) is not None:
            parts.append(f"{key} {clean[key]:{fmt}}")
    print(" | ".join(parts), flush=True)
    if writer is not None:
        for k, v in clean.items():
            if isinstance(v, (int, float)) and k != "step":
                writer.add_scalar(k, v, metrics["step"])


def plot_curve(out_dir: str):
    """learning_curve.png: greedy eval EM and sampled training reward against the step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("reward", "train reward (sampled)"), ("eval_em", "eval EM (greedy)")):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o" if key == "eval_em" else None, label=label)
    ax.set(xlabel="step", ylabel="exact match", title=os.path.basename(os.path.abspath(out_dir)))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(os.path.join(out_dir, "learning_curve.png"), dpi=120, bbox_inches="tight")
    plt.close(fig)


def run_summary(out_dir: str) -> str:
    """Markdown: greedy EM per source before training (the step-0 eval) and after (the final one), and the run's
    twin statistics summed over steps. Printed at the end of every run and by `make demo`."""
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    first = next((r for r in rows if "eval_em" in r and not r.get("final")), {})
    last = next((r for r in reversed(rows) if r.get("final")), {})
    keys = sorted(k for k in last if k.startswith("eval_em/")) + ["eval_em"]
    lines = ["| eval (greedy EM) | step 0 | final |", "|---|---:|---:|"]
    lines += [f"| {k.split('/')[-1] if '/' in k else 'average'} | {first.get(k, float('nan')):.3f} | "
              f"{last.get(k, float('nan')):.3f} |" for k in keys]
    steps = [r for r in rows if "final" not in r]
    tot = {k: sum(r.get(k, 0) for r in steps) for k in ("decisions", "twins", "self_twins", "shortcuts",
                                                         "twin_rollouts", "twin_tokens", "factual_tokens")}
    twins = max(tot["twins"], 1)
    lines += ["", f"{len(steps)} steps: {tot['decisions']} decisions, {tot['twins']} twins drawn "
              f"(self-twins {tot['self_twins'] / twins:.1%}, same-evidence shortcuts {tot['shortcuts'] / twins:.1%}, "
              f"{tot['twin_rollouts']} rolled out); generated tokens: factual {tot['factual_tokens']}, twins "
              f"{tot['twin_tokens']}, total / factual {1 + tot['twin_tokens'] / max(tot['factual_tokens'], 1):.2f}x"]
    return "\n".join(lines)


def eval_curves(runs: list, evals: list) -> np.ndarray:
    """(seeds, evals) greedy eval EM of each run's metrics rows at each eval step."""
    return np.array([[next(r["eval_em"] for r in rows if r["step"] == s and "eval_em" in r) for s in evals]
                     for rows in runs])


def compare_runs(run_dirs) -> str:
    """Markdown comparison of finished runs grouped by method (GRPO: omega = 0; TWICE; independent: coupling off),
    mean +- sd over the seeds of each group: greedy eval EM at every eval step, mean sampled training reward, and
    generated tokens (factual + twin) relative to GRPO's. `python train_twice.py compare DIR...`."""
    groups = {}
    for d in run_dirs:
        cfg = json.load(open(os.path.join(d, "config.json")))
        name = "GRPO" if cfg["omega"] == 0 else "TWICE" if cfg["coupling"] else "independent"
        groups.setdefault(name, []).append([json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))])
    def ms(xs):
        return f"{np.mean(xs):.3f} +- {np.std(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"
    evals = sorted({r["step"] for runs in groups.values() for rows in runs for r in rows if "eval_em" in r})
    head = ["method", "seeds"] + [f"EM@{s}" for s in evals] + ["train reward", "tokens / GRPO", "twins / step",
                                                                "self-twins", "shortcuts"]
    out = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    tokens = {}
    for name, runs in groups.items():
        tokens[name] = np.mean([sum(r.get("factual_tokens", 0) + r.get("twin_tokens", 0) for r in rows)
                                for rows in runs])
    for name in sorted(groups, key=["GRPO", "independent", "TWICE"].index):
        runs = groups[name]
        steps = [[r for r in rows if "final" not in r] for rows in runs]
        em = [ms(col) for col in eval_curves(runs, evals).T]
        twins = sum(r.get("twins", 0) for rows in steps for r in rows)
        cells = [name, str(len(runs)), *em, ms([np.mean([r["reward"] for r in rows]) for rows in steps]),
                 f"{tokens[name] / tokens['GRPO']:.2f}x" if "GRPO" in tokens else "-",
                 f"{twins / max(1, sum(len(x) for x in steps)):.1f}",
                 f"{sum(r.get('self_twins', 0) for rows in steps for r in rows) / max(twins, 1):.1%}",
                 f"{sum(r.get('shortcuts', 0) for rows in steps for r in rows) / max(twins, 1):.1%}"]
        out.append("| " + " | ".join(cells) + " |")
    plot_compare(groups, evals, os.path.join(os.path.dirname(os.path.abspath(run_dirs[0])), "compare.png"))
    return "\n".join(out)


def plot_compare(groups: dict, evals: list, path: str):
    """compare.png next to the runs: greedy eval EM against the step, mean +- sd over seeds, one line per method."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, runs in sorted(groups.items()):
        em = eval_curves(runs, evals)  # (seeds, evals)
        ax.plot(evals, em.mean(0), marker="o", label=f"{name} ({len(runs)} seeds)")
        ax.fill_between(evals, em.mean(0) - em.std(0), em.mean(0) + em.std(0), alpha=0.2)
    ax.set(xlabel="step", ylabel="greedy EM (test)", title="GRPO vs TWICE, same seeds")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _truncate_metrics(path: str, start: int):
    """On resume, rows of steps >= start (logged after the checkpoint) move to metrics.jsonl.orphaned: the file then
    holds exactly one row per step, and nothing is lost."""
    if not os.path.exists(path):
        return
    rows = [line for line in open(path) if line.strip()]
    keep = [r for r in rows if json.loads(r)["step"] < start]
    if len(keep) < len(rows):
        with open(path + ".orphaned", "a") as f:
            f.writelines(r for r in rows if r not in keep)
        with open(path + ".tmp", "w") as f:
            f.writelines(keep)
        os.replace(path + ".tmp", path)


def weights_checksum(accel, model) -> float:
    """Max over ranks minus min of a float64 weight checksum: 0 when every rank holds the same weights."""
    s = sum(p.detach().double().sum() for p in accel.unwrap_model(model).parameters())
    all_s = accel.gather(s.reshape(1).to(accel.device))
    return float(all_s.max() - all_s.min())


def main(cfg: Config):
    from accelerate import Accelerator
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.prompts_per_step % world:
        raise ValueError(f"prompts_per_step={cfg.prompts_per_step} must divide over {world} processes")
    local = cfg.prompts_per_step // world * cfg.group_size
    if local % cfg.mini_batches:
        raise ValueError(f"{local} episodes per rank do not split into mini_batches={cfg.mini_batches}")
    n_micro = math.ceil(local // cfg.mini_batches / cfg.micro_batch_size)
    accel = Accelerator(mixed_precision="bf16" if cfg.bf16 else "no", gradient_accumulation_steps=n_micro,
                        cpu=not torch.cuda.is_available())
    torch.manual_seed(cfg.seed)
    policy, tok = qa_eval.load_policy(cfg.model, accel.device, torch.float32)  # fp32 master weights
    ref, _ = qa_eval.load_policy(cfg.model, accel.device, torch.bfloat16 if cfg.bf16 else torch.float32)
    ref.requires_grad_(False)
    if cfg.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    policy, opt = accel.prepare(policy, opt)
    retriever = qa_eval.load_retriever(cfg.index, cfg.retriever_url)
    rows = qa_eval.load_qa(cfg.train_data)
    eval_rows = [r for path in cfg.eval_data.split(",") if path for r in qa_eval.load_qa(path)]
    predictor, scale = credit.DiscordancePredictor(), credit.RunningScale(cfg.scale_decay)
    start = load_checkpoint(cfg, accel, predictor, scale) if cfg.resume else 0
    writer = None
    if accel.is_main_process:
        os.makedirs(cfg.out_dir, exist_ok=True)
        _truncate_metrics(os.path.join(cfg.out_dir, "metrics.jsonl"), start)
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=1)
        print("config:", json.dumps(dataclasses.asdict(cfg)), flush=True)
        if cfg.log_tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                writer = SummaryWriter(os.path.join(cfg.out_dir, "tb"))
            except ImportError:
                writer = None
    eval_subset = eval_rows[:cfg.eval_size] if cfg.eval_size else eval_rows
    for step in range(start, cfg.steps):
        metrics = {}
        if eval_rows and cfg.eval_every and step % cfg.eval_every == 0:
            metrics.update(run_eval(cfg, accel, policy, tok, retriever, eval_subset))
        metrics.update(train_step(cfg, accel, policy, ref, tok, retriever, opt, predictor, scale, rows, step, n_micro))
        if accel.num_processes > 1:
            metrics["weights_spread"] = weights_checksum(accel, policy)
        if accel.is_main_process:
            log_metrics(cfg, metrics, writer)
        if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < cfg.steps:
            save_checkpoint(cfg, accel, policy, tok, predictor, scale, step + 1)
    final = {"step": cfg.steps}
    if eval_rows:
        final.update(run_eval(cfg, accel, policy, tok, retriever, eval_rows))
    path = save_checkpoint(cfg, accel, policy, tok, predictor, scale, cfg.steps)
    if accel.is_main_process:
        with open(os.path.join(cfg.out_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({**final, "final": True}) + "\n")
        plot_curve(cfg.out_dir)
        print(f"final | eval_em {final.get('eval_em', float('nan')):.3f} | checkpoint {path}", flush=True)
        print(run_summary(cfg.out_dir), flush=True)
    accel.end_training()
    return final


if __name__ == "__main__":
    if sys.argv[1:2] == ["compare"]:
        print(compare_runs(sys.argv[2:]))
    else:
        main(parse_config(sys.argv[1:]))
