"""TWICE: GRPO with twin-world credit for multi-turn search agents (config, loop, loss).

Paper: "Same Luck, Different Choice: Twin-World Credit Assignment for Agentic Reinforcement
Learning" (arXiv 2610.31544); design: DESIGN.md sections 5-6. `train_step` is one step:
  1.-6. The method (twice.py): G keyed factual episodes per prompt, the trajectory advantage A_traj
        (GRPO), the budget rule, the twins (same luck, different choice), Horvitz-Thompson credit,
        the token advantage A = A_traj + omega A_hat / sigma_hat.
  7.    PPO-clip on token ratios (clip 0.2), token mean over loss-masked tokens, k3 KL to the frozen
        reference (`ppo_loss`, `ppo_update`).
omega = 0 is GRPO (no twins). --method=NAME trains a baseline of the registry (methods/) through the
same loop: its rollout and its advantages replace steps 1-6. How this differs from textbook GRPO (as
Search-R1/verl run it): twin credit is added to the broadcast trajectory advantage; every token is
sampled with keyed Gumbel noise, exactly from softmax(logits / T); observation tokens carry loss
mask 0 (as Search-R1). Deviations: DESIGN.md section 13, the one list (T2 here).

The lab and the instruments use these names as an interface (tests/test_layout.py checks that they
use no other): `Config`, `parse_config`, `main`, `Run`, `setup`, `train_step`, `ppo_loss`,
`ppo_update`, `mini_batches`, `token_logprobs`.

Launch:
  python train_twice.py configs/demo.cfg   # CPU, the tiny world (make demo); --help: every option
  python train_twice.py configs/qwen2.5-3b.cfg --steps=5   # one GPU, real model
  python train_twice.py configs/demo.cfg --lora_rank=8 --lora_alpha=16 --lr=2e-3   # LoRA adapters
  accelerate launch --config_file configs/accelerate_zero2.yaml train_twice.py \
      configs/qwen2.5-3b.cfg                               # 8 GPUs (DeepSpeed ZeRO-2)
  ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 \
      train_twice.py configs/demo.cfg                      # 2 CPU ranks
"""
from infra import numerics  # noqa: F401  first: pins the CPU math libraries before numpy, torch

import contextlib
import datetime
import math
import os
from dataclasses import dataclass

import numpy as np
import torch

import credit
import eval as qa_eval
import forks
import methods
import protocol
import rollout
import sampler
import twice
from generation import engine, logprobs, vllm_engine
from infra import adamw, checkpoint, config, console, cuda, lora, phases, watchdog, weights


@dataclass
class Config(methods.BaselineConfig):
    """Every knob of a run (DESIGN.md sections 3-7), paper defaults; the baselines' own knobs are
    methods.BaselineConfig's (read only by the method they name)."""
    # --- io ---
    world: str = "data/tinyworld"   # world folder (worlds/build.py): fills the blank paths below
    model: str = ""                 # initial policy and reference: hub id or folder
    train_data: str = ""            # QA .jsonl/.parquet (id, question, golden_answers, data_source)
    eval_data: str = ""             # comma-separated QA files for periodic greedy evaluation
    index: str = ""                 # retriever index folder (retriever.py build)
    retriever_url: str = ""         # Search-R1 HTTP retriever (POST /retrieve); replaces `index`
    out_dir: str = "runs/twice"     # metrics.jsonl, checkpoints, learning_curve.png
    resume: str = ""                # checkpoint folder to continue from; the run continues exactly
    overwrite: bool = False         # replace the run already in out_dir (its files are removed)
    # --- rollout (DESIGN 3) ---
    prompts_per_step: int = 512     # prompts per step over all ranks (Search-R1 train_batch_size)
    group_size: int = 5             # G, lines per prompt
    max_turns: int = 4              # searches per episode, then one final turn
    topk: int = 3                   # documents per search
    max_new_tokens: int = 500       # tokens per turn
    max_obs_tokens: int = 500       # tokens per observation
    max_context: int = 4096         # prompt + response tokens
    temperature: float = 1.0        # T of the keyed sampler and of the log-probs in the loss
    top_p: float = 1.0              # nucleus applied before the noise; 1 = off
    top_k: int = 0                  # top-k applied before the noise; 0 = off
    gen_batch_size: int = 64        # rows per generate call
    keep_caches: bool = True        # episodes keep KV caches for twins; False: freed at their end
    kv_budget_gib: float = 0.0      # KV caches held at once per rank (0 = no cap; generation/kvbudget)
    fused_sampler: bool = True      # torch.compile the keyed draw (on CUDA; the CPU stays eager)
    sync_every: int = 16            # decode steps between read-backs of sampled tokens to the host
    cuda_graphs: bool = False       # replay the decode step as CUDA graphs, one per shape (CUDA)
    engine: str = "cached"          # "cached" (the project's), "generate", or "vllm" (in-process vLLM,
    #                                 the same keyed draws: generation/vllm_engine.py)
    vllm_kv_gib: float = 1.0        # engine=vllm: its KV pool per rank (GiB; perf/ledger.py sizes it)
    vllm_max_seqs: int = 64         # engine=vllm: rows decoded at once
    vllm_batch_invariant: bool = False  # engine=vllm: VLLM_BATCH_INVARIANT=1 (beta, GPUs)
    vllm_runner: str = "v1"         # engine=vllm: vLLM's model runner, "v1" or "v2" (DESIGN 13, V3)
    # --- credit (DESIGN 5, 7) ---
    method: str = "twice"           # twice, or a baseline of the registry (grpo, vineppo, ...)
    omega: float = 1.0              # omega, weight of the twin credit; 0 = GRPO (method=grpo)
    twin_budget: float = 0.7        # expected twin tokens / factual tokens (sum_t q_t c_t)
    q_min: float = 0.05             # q_min, floor of the branch probability
    twins_per_decision: int = 1     # K twins per branched decision
    coupling: bool = True           # twins replay the factual keys (False: partly coupled ablation)
    budget_rule: str = "sqrt"       # "sqrt" (q ~ sqrt(p / c)), "uniform" (one q) or "all" (q_t = 1)
    same_evidence_shortcut: bool = True  # D = 0, no rollout, when both searches get the same ids
    twin_chunk: int = 0             # twins rolled out together, chunk after chunk; 0 = all (memory)
    twin_unit: str = "turn"         # "turn": a twin re-samples y_t (the paper); "token": forks.py's
    fork_floor: float = 0.1         # token unit: share of the fork law r_t spread over the turn
    twin_scale: str = "rms"         # sigma_hat: "rms" (of the nonzero A_hat as applied) or "d" (of D)
    twin_cap: float = 2.0           # |A_hat / sigma_hat| <= twin_cap: A_traj's scale (0 = no cap)
    control_variate: bool = False   # turn unit: A_hat = g + 1[branched] (D - g) / q, g = (2U - 1) p
    twin_data: bool = False         # twins join their group as training rows, weighted 1/q (turn)
    traj_term: bool = True          # A = A_traj + twin term; false: the twin term alone (as oracle A*)
    twin_from_turn: int = 0         # branch decisions at turns >= this only (a twin costs a suffix)
    scale_decay: float = 0.9        # EMA decay of sigma_hat
    line_keys: str = "group"        # key "line": "group" (line in its group), "text" (text line of turn)
    adv_eps: float = 1e-6           # eps of the GRPO std normalisation
    # --- optim (DESIGN 6) ---
    steps: int = 200                # optimisation steps, one batch of prompts each (at most)
    token_budget: int = 0           # stop at this many generated tokens, factual + aux (0: off)
    lr: float = 1e-6                # AdamW learning rate (Search-R1: 1e-6)
    warmup_steps: int = 0           # linear warm-up steps, then constant
    weight_decay: float = 0.01      # AdamW weight decay
    clip: float = 0.2               # PPO ratio clip epsilon
    kl_coef: float = 0.001          # k3 KL to the frozen reference (Search-R1: low_var_kl 0.001)
    entropy_coef: float = 0.0       # entropy bonus coefficient
    ppo_epochs: int = 1             # passes over each batch
    mini_batches: int = 1           # optimizer steps per pass (Search-R1's code: 10; DESIGN.md 10)
    micro_batch_size: int = 8       # sequences per forward/backward (gradients accumulate)
    grad_clip: float = 1.0          # max global grad norm
    max_weight_growth: float = 100.0  # diverged when the weight norm passes this x its start
    bf16: bool = False              # bf16 autocast (GPU)
    require_cuda: bool = False      # stop at once if no CUDA device (bf16 and DeepSpeed do too)
    gradient_checkpointing: bool = False  # trade compute for memory (real models)
    ref_offload: bool = False       # the reference waits in host memory but for its log-prob pass
    collective_timeout_h: float = 6.0  # hours a collective waits for a rank (torch: 10 min)
    rank_timeout_s: float = 45.0    # a rank failed, killed or silent this long stops all (0 = off)
    # --- lora (DESIGN 6, infra/lora.py): adapters W' = W + (alpha / r) B A, not every weight ---
    lora_rank: int = 0              # r, rank of the adapters; 0 = off: full fine-tuning
    lora_alpha: float = 32.0        # alpha: the adapters' update is scaled by alpha / r
    lora_dropout: float = 0.0       # dropout on the adapters' input; only 0 (lora.checks says why)
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # adapted (Qwen2)
    # --- run ---
    seed: int = 0                   # run seed: prompt order, every sampling key, branch draws
    eval_every: int = 50            # steps between greedy evaluations (0 = only at the end)
    eval_tokens: int = 0            # also evaluate at the start and at every multiple of tokens
    eval_size: int = 0              # questions per periodic evaluation (0 = all; the final: all)
    save_every: int = 0             # steps between checkpoints (0 = only at the end)
    log_grad_share: bool = True     # log the twin term's share of the policy-gradient norm (CPU)
    log_episodes: int = 2           # episodes per step logged as text and tokens (episodes.jsonl)
    keep_checkpoints: int = 2       # newest checkpoints kept besides the last (0 = keep all)
    log_tensorboard: bool = True    # every metric as TensorBoard scalars too (out_dir/tb)
    log_wandb: bool = False         # Weights & Biases too (WANDB_MODE=offline: no network)
    wandb_project: str = "twice"    # W&B project name

    def resolve(self):
        """Blank paths come from the world folder."""
        self.model = self.model or os.path.join(self.world, "policy")
        self.train_data = self.train_data or os.path.join(self.world, "train.jsonl")
        self.eval_data = self.eval_data or os.path.join(self.world, "test.jsonl")
        self.index = self.index or ("" if self.retriever_url else os.path.join(self.world, "index"))
        if self.method == "twice" and self.omega == 0 and not self.twin_data:  # GRPO, as always
            self.method = "grpo"

    def checks(self):
        """(field, ok, rule): every value that would otherwise fail, or mislead, inside a step."""
        at_least = {"prompts_per_step": 1, "group_size": 2, "max_turns": 0, "topk": 1,
                    "max_new_tokens": 1, "max_obs_tokens": 0, "max_context": 2, "top_k": 0,
                    "gen_batch_size": 1, "twin_chunk": 0, "twins_per_decision": 1,
                    "steps": 0, "token_budget": 0, "lr": 0, "warmup_steps": 0, "kl_coef": 0,
                    "ppo_epochs": 1, "mini_batches": 1, "micro_batch_size": 1, "eval_every": 0,
                    "eval_tokens": 0, "eval_size": 0, "save_every": 0, "keep_checkpoints": 0,
                    "log_episodes": 0, "sync_every": 1, "rank_timeout_s": 0,
                    "kv_budget_gib": 0, "twin_cap": 0, "twin_from_turn": 0, "vllm_max_seqs": 1}
        above = {"adv_eps": 0, "clip": 0, "grad_clip": 0, "max_weight_growth": 1,
                 "collective_timeout_h": 0, "vllm_kv_gib": 0}
        unit = ("top_p", "q_min", "fork_floor")  # fractions and probabilities in (0, 1]
        choices = {"budget_rule": ("sqrt", "uniform", "all"), "twin_unit": ("turn", "token"),
                   "twin_scale": ("d", "rms"), "line_keys": ("group", "text"),
                   "engine": ("cached", "generate", "vllm"), "vllm_runner": ("v1", "v2")}
        return ([(k, getattr(self, k) >= v, f">= {v}") for k, v in at_least.items()] +
                [(k, getattr(self, k) > v, f"> {v}") for k, v in above.items()] +
                [(k, 0 < getattr(self, k) <= 1, "in (0, 1]") for k in unit] +
                [(k, getattr(self, k) in v, " or ".join(map(repr, v))) for k, v in choices.items()] +
                [("method", self.method in methods.NAMES, f"one of {', '.join(methods.NAMES)}"),
                 ("twin_budget", self.twin_budget >= self.q_min, ">= q_min (below, every q_t is q_min)"),
                 ("control_variate", self.twin_unit == "turn" or not self.control_variate, "turn unit only"),
                 ("twin_data", not self.twin_data or self.method in ("twice", "independent")
                  and self.twin_unit == "turn" and self.coupling, "twice's turn unit, coupled"),
                 ("traj_term", self.traj_term or self.method in methods.TWIN_METHODS, "false: twin methods"),
                 ("scale_decay", 0 <= self.scale_decay < 1, "in [0, 1)"),
                 ("omega", math.isfinite(self.omega), "finite"),
                 ("weight_decay", self.weight_decay >= 0, ">= 0"),
                 # below 1e-3, softmax(logits / T) is one-hot in float32: log-probs lose meaning
                 ("temperature", self.temperature >= 1e-3, ">= 0.001 (greedy evaluation: eval.py)")]
                + self.baseline_checks() + lora.checks(self, methods.LEARNED))


def parse_config(argv) -> Config:  # preset files, then --key=value overrides (infra/config.py)
    return config.parse(Config, argv, "train_twice.py")


@dataclass
class Run:
    """The objects a run holds, built once by main() and passed to every step."""
    accel: object                   # accelerate.Accelerator
    policy: object                  # the trained model (accelerate's); LoRA: base + peft's layers
    ref: object                     # frozen reference of the KL term (LoRA: None, lora.reference)
    tok: object                     # tokenizer
    retriever: object               # retriever.Retriever or retriever.RemoteRetriever
    opt: object                     # AdamW
    method: twice.Method            # cfg.method's rollout and advantages (TWICE's: twice.Twice)
    predictor: credit.DiscordancePredictor  # p_t of the budget rule
    token_predictor: credit.DiscordancePredictor  # p_k of the fork law (twin_unit = token)
    sigma_hat: credit.RunningScale  # sigma_hat of the token advantage
    rows: list                      # training questions
    n_micro: int                    # micro-batches per mini-batch (gradient accumulation)
    weight_norm0: float = 0.0       # the initial weight norm (divergence check)
    tokens: int = 0                 # generated tokens so far, factual + aux (token_budget)
    episode_log: list = None        # this step's logged episodes (rank 0's)
    adapter: object = None          # peft.PeftModel around the policy when lora_rank > 0
    sampler: object = None          # during a step's rollout: the model episodes are sampled from
    vllm: object = None             # engine=vllm: this rank's vllm_engine.VLLMEngine


# --------------------------------------------------------------------------------------------------
# 7. Policy loss (DESIGN 6)

def token_logprobs(model, input_ids, attention_mask, temperature, with_entropy=False, positions=None):
    """log pi(x_{k+1} | x_<=k) of softmax(logits / T) at every position k, (B, L-1); optionally its
    entropy. Chunked through the LM head (generation/logprobs.py): no (B, L, V) tensor."""
    return logprobs.token_logprobs(model, input_ids, attention_mask, temperature, with_entropy,
                                   positions)


def ppo_loss(cfg, lp, old_lp, ref_lp, adv, mask, ent=None):
    """Per-token PPO-clip surrogate + k3 KL to the reference - entropy bonus; clipped tokens."""
    ratio = torch.exp(lp - old_lp)
    pg = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - cfg.clip, 1 + cfg.clip) * adv)
    kl = torch.exp(ref_lp - lp) - (ref_lp - lp) - 1  # k3 KL(pi || ref): unbiased, >= 0 (Schulman 2020)
    loss = pg + cfg.kl_coef * kl - (cfg.entropy_coef * ent if ent is not None else 0.0)
    return loss * mask, kl * mask, ((ratio - 1).abs() > cfg.clip).float() * mask


def diverged(step: int, what: str, value) -> FloatingPointError:  # raised before any save
    return FloatingPointError(f"diverged at step {step}: {what} = {value} (lower lr, or resume)")


def mini_batches(cfg, step: int, epoch: int, rows: int) -> list:
    """One pass's rows in a seeded order, cut into mini_batches: an optimizer step each."""
    order = np.random.default_rng(sampler.mix(cfg.seed, step, epoch)).permutation(rows)
    return np.array_split(order, cfg.mini_batches)


def ppo_update(cfg, run, batch, adv, old_lp, ref_lp, step) -> dict:
    """ppo_epochs passes of mini_batches optimizer steps; a token mean over each mini-batch's
    loss-masked tokens on every rank; gradients accumulate over n_micro micro-batches."""
    accel, model, opt = run.accel, run.policy, run.opt
    mask = batch["loss_mask"][:, 1:].float()  # (B, L-1): position k predicts token k+1
    sums = torch.zeros(4, device=accel.device)  # loss, kl, clipped, tokens
    lengths, grad_norms = batch["attention_mask"].sum(1).cpu().numpy(), []
    for epoch in range(cfg.ppo_epochs):
        for mb in mini_batches(cfg, step, epoch, len(mask)):
            n_tok = accel.reduce(mask[mb].sum(), "sum").clamp(min=1)  # the mini-batch's, all ranks
            for micro in logprobs.length_sorted_splits(lengths, mb, run.n_micro):  # little padding
                with accel.accumulate(model):
                    mbt, w = logprobs.trimmed(batch, micro)
                    lp, ent = token_logprobs(model, mbt["input_ids"], mbt["attention_mask"],
                                             cfg.temperature, cfg.entropy_coef > 0,
                                             mbt["loss_mask"][:, 1:].bool())
                    cut = (micro, slice(0, w - 1))
                    loss, kl, clipped = ppo_loss(cfg, lp, old_lp[cut], ref_lp[cut], adv[cut],
                                                 mask[cut], ent)
                    total = loss.sum() / n_tok
                    check_finite(accel, total, step)
                    # accelerate divides by n_micro, DDP averages ranks: undo both (a global mean)
                    accel.backward(total * accel.num_processes * run.n_micro)
                    if accel.sync_gradients:
                        norm = accel.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                        grad_norms.append(float(norm))
                        if not math.isfinite(grad_norms[-1]):
                            raise diverged(step, "grad norm", grad_norms[-1])
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                sums += torch.stack([x.sum() for x in (loss, kl, clipped, mask[micro])]).detach()
                del mbt, lp, ent, loss, kl, clipped, total  # each mini-batch peaks alike (ledger)
    loss, kl, clipped, tokens = accel.reduce(sums, "sum").tolist()
    n = max(tokens, 1)
    return {"loss": loss / n, "kl": kl / n, "clip_frac": clipped / n,
            "grad_norm": float(np.mean(grad_norms)) if grad_norms else 0.0}


def check_finite(accel, total, step: int):
    """Every rank learns of a non-finite loss on any rank, so all stop here together (no rank is
    left waiting in the next collective)."""
    bad = int(accel.reduce(torch.tensor(float(not total.isfinite()), device=accel.device), "sum"))
    if bad:
        raise diverged(step, "loss", f"{total.item()} on rank {accel.process_index}; non-finite on "
                                     f"{bad} of {accel.num_processes} rank(s)")


# --------------------------------------------------------------------------------------------------
# One step: the method, in the order of the docstring

def train_step(cfg: Config, run: Run, step: int) -> dict:
    accel, times = run.accel, phases.Phases()  # each phase's seconds and, on a GPU, its memory
    policy = accel.unwrap_model(run.policy)
    policy.eval()
    proto = protocol.protocol_from(cfg)
    with torch.no_grad():
        # Episodes are sampled from weights in the rollout dtype (bf16 at scale), outside any
        # autocast: no fp32 KV, no cached casts of the weights while caches grow (DESIGN.md 10).
        run.sampler = (run.vllm.ready(policy) if run.vllm else  # the current weights copied in
                       weights.sampling_copy(policy, torch.bfloat16 if cfg.bf16 else None))
        episodes = []
        try:
            # 1. Factual episodes: G keyed lines per prompt (a baseline's own rollout).
            prompts = rollout.step_prompts(run.rows, cfg.prompts_per_step, cfg.seed, step,
                                           accel.process_index, accel.num_processes)
            episodes = run.method.rollout(run, step, prompts, proto)
            batch = rollout.collate(episodes, run.tok.pad_token_id, cfg.max_context)
            batch = {k: v.to(accel.device) for k, v in batch.items()}
            times.mark("rollout")

            # 2.-6. Token advantages: TWICE's twin credit (twice.py), or the baseline's own.
            with accel.autocast() if run.method.autocast else contextlib.nullcontext():
                adv, stats = run.method.advantages(run, step, episodes, batch, proto)
            batch = stats.pop("batch", batch)  # twin_data: the twins' rows follow the episodes'
        finally:
            # No pass below reads a KV cache: the episodes' entries and the engine's slot cache go
            # now (the engine keeps its slot cache per model; a sampling copy dies with it).
            engine.free_cache(run.sampler)
            run.sampler = None
            if run.vllm:  # CUDA: its weights and KV pool leave the GPU for the update
                run.vllm.sleep()
            rollout.release_caches(episodes)
        times.mark("twins")
        run.episode_log = checkpoint.episode_rows(step, episodes, stats.get("twins", []),
                                                  cfg.log_episodes, accel.num_processes) \
            if accel.is_main_process else []
        # log-prob k predicts token k + 1 (token_logprobs): token k's advantage moves to k - 1
        adv = torch.tensor(adv[:, 1:], dtype=torch.float32, device=accel.device)
        with accel.autocast():
            old_lp, ent = logprobs.batch_logprobs(policy, batch, cfg.temperature,
                                                  cfg.micro_batch_size, True, cfg.max_context)
            # LoRA: the policy with its adapters disabled; ref_offload: on the GPU for this pass
            with lora.reference(run) as ref, weights.on_device(ref, accel.device):
                ref_lp, _ = logprobs.batch_logprobs(ref, batch, cfg.temperature,
                                                    cfg.micro_batch_size, False, cfg.max_context)
    times.mark("logprobs")
    twin, share = stats.pop("twin_adv", None), {}
    if cfg.log_grad_share and twin is not None:  # the twin term's share of the update's size
        with accel.autocast():
            share = logprobs.gradient_share(policy, batch, adv.new_tensor(twin[:, 1:]), adv,
                                            cfg.temperature, cfg.micro_batch_size)
        share = {"twin_grad_share": float(accel.reduce(adv.new_tensor(share), "mean"))}

    # 7. PPO-clip update with the k3 KL to the reference.
    run.policy.train()
    lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else cfg.lr
    for group in run.opt.param_groups:
        group["lr"] = lr
    update = ppo_update(cfg, run, batch, adv, old_lp, ref_lp, step)
    norm = weights.weight_norm(accel, run.policy)
    if not math.isfinite(norm) or norm > cfg.max_weight_growth * run.weight_norm0:
        raise diverged(step, "weight norm", f"{norm:.4g} (initial {run.weight_norm0:.4g})")
    times.mark("update")
    metrics = {"step": step, **batch_totals(accel, episodes, batch, ent), "lr": lr,
               "sigma": run.sigma_hat.value, "weight_norm": norm, **update, **share}
    metrics.update(run.method.step_stats(accel, stats, metrics["factual_tokens"]))
    metrics.update(times.metrics(accel))
    return metrics


def batch_totals(accel, episodes, batch, ent) -> dict:
    """Reward, entropy, turns and factual tokens of the step, over every rank."""
    mask = batch["loss_mask"][:, 1:].float()
    sums = [sum(ep.reward for ep in episodes), len(episodes), float((ent * mask).sum()),
            float(mask.sum()), sum(len(ep.turns) for ep in episodes),
            sum(ep.n_generated for ep in episodes)]
    sums = torch.tensor(sums, dtype=torch.float64, device=accel.device)
    reward, n_episodes, entropy, n_tokens, turns, generated = accel.reduce(sums, "sum").tolist()
    return {"reward": reward / n_episodes,
            "entropy": entropy / max(n_tokens, 1),
            "turns": turns / n_episodes,
            "factual_tokens": int(generated)}


# --------------------------------------------------------------------------------------------------
# Set-up, evaluation and the run

def run_eval(cfg, run, rows) -> dict:
    """Greedy EM on the eval rows, over ranks: {"eval_em": the mean over sources, per source}."""
    policy = run.accel.unwrap_model(run.policy)
    policy.eval()
    try:
        with torch.no_grad(), run.accel.autocast():
            return qa_eval.evaluate_on_ranks(run.accel, policy, run.tok, run.retriever, rows,
                                             protocol.protocol_from(cfg, greedy=True),
                                             twice.gather_list)
    finally:
        engine.free_cache(policy)  # the engine's slot cache is not held through the steps after it


def setup(cfg: Config, watch: bool = False) -> Run:
    """Accelerator, policy (fp32 master weights; bf16 under DeepSpeed, which keeps its own fp32
    master partition), frozen reference, optimizer, retriever, data."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, InitProcessGroupKwargs
    qa_eval.check_inputs(cfg)  # data, index and model paths, before anything loads
    cuda.require(cfg)  # a GPU run without a usable GPU: why (the driver?), in seconds
    n_micro = config.micro_batches(cfg)
    timeout = InitProcessGroupKwargs(timeout=datetime.timedelta(hours=cfg.collective_timeout_h))
    accel = Accelerator(mixed_precision="bf16" if cfg.bf16 else "no", kwargs_handlers=[timeout],
                        gradient_accumulation_steps=n_micro, cpu=not torch.cuda.is_available())
    watchdog.start(cfg.rank_timeout_s if watch else 0)  # watch (a run): one rank fails, all stop
    if accel.device.type == "cpu":  # the same figures on every x86-64 CPU (DESIGN.md section 9)
        numerics.require("this CPU training run")
    if cfg.lora_rank and accel.distributed_type == "DEEPSPEED":  # its save_state saves every weight
        raise ValueError("lora_rank > 0 runs under DDP (configs/accelerate_ddp.yaml), not "
                         "DeepSpeed: the adapters' gradients and AdamW state fit whole on each "
                         "GPU (python -m infra.lora memory)")
    torch.manual_seed(cfg.seed)
    deepspeed = accel.distributed_type == DistributedType.DEEPSPEED
    if deepspeed:  # no dataloader tells DeepSpeed its micro-batch: the preset's, not the JSON's
        ds = accel.state.deepspeed_plugin.deepspeed_config
        ds["train_micro_batch_size_per_gpu"] = cfg.micro_batch_size
    # fp32 master weights; DeepSpeed: its bf16 module (it keeps the fp32 partition); LoRA: bf16 base
    dtype = (torch.bfloat16 if cfg.bf16 else torch.float32) if deepspeed else lora.base_dtype(cfg)
    policy, tok = qa_eval.load_policy(cfg.model, accel.device, dtype)
    if cfg.gradient_checkpointing:  # also makes the embeddings' output require grad (LoRA's flow)
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    adapter, ref = None, None
    # DEVIATION T2: lora_rank > 0 trains LoRA adapters on a frozen base (bf16 with bf16 on), not
    # every weight; the reference is that base with the adapters off (lora.reference)
    if cfg.lora_rank:
        adapter = lora.attach(policy, cfg)
        accel.register_save_state_pre_hook(lora.adapter_only)  # trainer/: the adapters alone
    else:
        ref = qa_eval.reference_model(cfg, accel.device)
    opt = adamw.AdamW([p for p in policy.parameters() if p.requires_grad], lr=cfg.lr,
                      weight_decay=cfg.weight_decay)  # CPU: the same bits on every CPU
    policy, opt = accel.prepare(policy, opt)
    rows = qa_eval.load_qa(cfg.train_data)
    qa_eval.refuse_long_prompts(rows, tok, cfg.max_context, cfg.max_new_tokens, cfg.train_data)
    rollouts = vllm_engine.VLLMEngine(
        cfg.model, accel.unwrap_model(policy), cfg.max_context, cfg.vllm_kv_gib, cfg.vllm_max_seqs,
        cfg.vllm_batch_invariant, torch.bfloat16 if cfg.bf16 else None, cfg.vllm_runner) \
        if cfg.engine == "vllm" else None
    return Run(accel, policy, ref, tok, qa_eval.load_retriever(cfg.index, cfg.retriever_url), opt,
               methods.make(cfg), credit.DiscordancePredictor(),
               credit.DiscordancePredictor(features=forks.TOKEN_FEATURES),
               credit.RunningScale(cfg.scale_decay, cfg.twin_scale), rows, n_micro,
               weights.weight_norm(accel, policy), adapter=adapter, vllm=rollouts)


def main(cfg: Config):
    """One run, holding its out_dir from start to end (checkpoint.run_folder)."""
    # Set before the first CUDA allocation: blocks of every size share growable segments, so the
    # caches that grow and shrink every step leave no fragments (DESIGN.md section 10).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with checkpoint.run_folder(cfg, int(os.environ.get("RANK", "0")) == 0), watchdog.reporting():
        return train(cfg)


def train(cfg: Config):
    run = setup(cfg, watch=True)
    accel = run.accel
    eval_rows = [r for path in cfg.eval_data.split(",") if path for r in qa_eval.load_qa(path)]
    start = checkpoint.load(cfg, run) if cfg.resume else 0
    trackers = checkpoint.start_log(cfg, start) if accel.is_main_process else []
    if accel.is_main_process:  # the fields a user sets; every field is in out_dir/config.json
        print(console.config_line(cfg, start), flush=True)
    eval_subset = eval_rows[:cfg.eval_size] if cfg.eval_size else eval_rows
    done, mark = start, -1  # mark: multiples of eval_tokens evaluated so far (-1: none yet)
    for step in range(start, cfg.steps):  # step N starts from N updates (checkpoint.py)
        if cfg.token_budget and run.tokens >= cfg.token_budget:
            break
        metrics = {}
        due = cfg.eval_tokens and run.tokens // cfg.eval_tokens > mark  # methods differ in tokens
        if eval_rows and (cfg.eval_every and step % cfg.eval_every == 0 or due):
            metrics.update(run_eval(cfg, run, eval_subset))
            mark = run.tokens // cfg.eval_tokens if cfg.eval_tokens else mark
        metrics.update(train_step(cfg, run, step))
        run.tokens += metrics["factual_tokens"] + metrics["aux_tokens"]
        metrics["tokens"], done = run.tokens, step + 1  # this row's eval_em: before its tokens
        if accel.num_processes > 1:
            metrics["weights_spread"] = weights.weights_spread(accel, run.policy)
        if accel.is_main_process:
            checkpoint.log_metrics(cfg, metrics, trackers)
            checkpoint.log_episodes(cfg, run.episode_log, trackers)
        if cfg.save_every and done % cfg.save_every == 0 and done < cfg.steps:
            checkpoint.save(cfg, run, done)
    final = {"step": done, "tokens": run.tokens}
    if eval_rows:
        final.update(run_eval(cfg, run, eval_rows))
    path = checkpoint.save(cfg, run, done, last=True)
    if accel.is_main_process:
        checkpoint.end_log(cfg, final, trackers)
        console.finish(cfg, final, path)  # the final line, learning_curve.png, the summary table
    if run.vllm:
        run.vllm.close()
    accel.end_training()
    return final


if __name__ == "__main__":  # an error or Ctrl-C ends in one line (Ctrl-C: how to resume)
    console.run_cli(main, config.cli(Config, prog="train_twice.py"), "train_twice.py")
