"""TWICE: GRPO with twin-world credit for multi-turn search agents (config, loop, loss).

Paper: "Same Luck, Different Choice: Twin-World Credit Assignment for Agentic Reinforcement
Learning" (arXiv 2610.31544); reference design: DESIGN.md sections 5-6. One step, as the sections
# 1. to # 7. of `train_step` (steps 2-6 in `twin_credit`):

  1. G factual episodes per prompt, every token a keyed Gumbel-max draw (sampler.py):
     key = mix(seed, step, prompt_uid, line), noise u = U(key, turn, pos, token).
  2. Trajectory advantage (GRPO):  A_traj_i = (U_i - mean_group) / (std_group + eps)
  3. Budget rule:  q_t = clip(lambda sqrt(p_t / c_t), q_min, 1), lambda such that sum_t q_t c_t =
     twin_budget x factual tokens; p_t = predicted P(U != U') (online logistic regression), c_t =
     tokens of y_t and of everything after it; decision t branches iff a keyed uniform < q_t.
  4. Twins: y' ~ pi(.|s_t) with alternative keys, then the factual keys for every later (turn,
     pos): same luck, different choice. D_t = U - U' is unbiased for Q(s_t, y_t) - V(s_t), with
     (1 - rho) x the variance of an independent counterfactual. Self-twins (y' == y_t) and
     same-evidence searches cost no rollout (D_t = 0).
  5. Horvitz-Thompson:  A_hat_t = 1[branched] mean_j D_t^j / q_t
  6. Token advantage on the sampled tokens of turn t:  A = A_traj_i + omega A_hat_t / sigma_hat,
     sigma_hat a scale of D itself (twin_scale = d), so omega means the same at every budget.
  twin_unit = token (forks.py): the twin forks one token k ~ r_t of the turn (y_t[:k] kept, y_k banned,
  the factual keys after it), p_t and c_t are the fork law's, and token k alone gets
  omega (1 - pi_k) mean_j D^j / (q_t r_t(k) sigma_hat), unbiased for Q(s_k, y_k) - V(s_k) over sigma_hat.
  7. PPO-clip on token ratios (clip 0.2), token mean over loss-masked tokens, k3 KL to the
     frozen reference.
omega = 0 is GRPO (no twins); --method=NAME trains a baseline (methods/__init__.py registry) through the same loop: its
rollout and its advantages replace steps 1-6.

How this differs from textbook GRPO (as Search-R1/verl run it): turn-level twin credit is added to
the broadcast trajectory advantage (steps 3-6); every token is sampled with keyed Gumbel noise,
exact sampling from softmax(logits / T); observation tokens carry loss mask 0 (as Search-R1).
Deviations: the README's one list (T1 here).

Launch:
  make demo                                            # CPU, built-in tiny world, minutes
  python train_twice.py --help                         # every option, its default and meaning
  python train_twice.py configs/qwen2.5-3b.cfg --steps=5                   # one GPU, real model
  python train_twice.py configs/demo.cfg --lora_rank=8 --lora_alpha=16 --lr=2e-3   # LoRA adapters (infra/lora.py)
  accelerate launch --config_file configs/accelerate_zero2.yaml train_twice.py \
      configs/qwen2.5-3b.cfg                                               # 8 GPUs (DeepSpeed ZeRO-2)
  ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 \
      train_twice.py configs/demo.cfg                                      # 2 CPU ranks
"""
from infra import numerics  # noqa: F401  first: pins the CPU math libraries before numpy and torch load (infra/numerics.py)

import contextlib
import copy
import datetime
import math
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from methods import baselines
from infra import checkpoint
from infra import config
import credit
from generation import engine
import eval as qa_eval
import forks
from generation import logprobs
from infra import lora
import methods
import protocol
from lab import report
import rollout
import sampler


@dataclass
class Config:
    """Every knob of a run (DESIGN.md sections 3-7), paper defaults."""
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
    keep_caches: bool = True        # episodes keep KV caches for their twins; False: dropped at episode end (memory)
    fused_sampler: bool = True      # torch.compile the keyed draw (on CUDA; the CPU stays eager)
    sync_every: int = 16            # decode steps between read-backs of sampled tokens to the host (cached engine)
    cuda_graphs: bool = False       # replay the decode step as CUDA graphs, one per shape (cached engine, CUDA)
    # --- credit (DESIGN 5, 7) ---
    method: str = "twice"           # twice, or a baseline of methods/__init__.py's registry (grpo, vineppo, ...)
    omega: float = 1.0              # omega, weight of the twin credit; 0 = GRPO (method=grpo)
    twin_budget: float = 0.7        # expected twin tokens / factual tokens (sum_t q_t c_t)
    q_min: float = 0.05             # q_min, floor of the branch probability
    twins_per_decision: int = 1     # K twins per branched decision
    coupling: bool = True           # twins replay the factual keys (False: partly coupled ablation)
    budget_rule: str = "sqrt"       # "sqrt" (q ~ sqrt(p / c)) or "uniform" (one q for all)
    same_evidence_shortcut: bool = True  # D = 0, no rollout, when both searches get the same ids
    twin_chunk: int = 0             # twins rolled out together, chunk after chunk (GPU memory, DESIGN 10); 0 = all
    twin_unit: str = "turn"         # "turn": a twin re-samples y_t whole (the paper); "token": it forks at one token
    #                                 k ~ r_t of the turn and credits that token (forks.py, DESIGN 5)
    fork_floor: float = 0.1         # token unit: share of the fork law r_t spread evenly over the turn's tokens
    twin_scale: str = "d"           # sigma_hat: "d" (RMS of D per decision, Horvitz-Thompson: the same at every
    #                                 budget) or "rms" (RMS of the nonzero A_hat = D / q: the first form, ~1/q)
    scale_decay: float = 0.9        # EMA decay of sigma_hat
    line_keys: str = "group"        # "line" of the key tuple: "group" (the sample's line in its group) or "text" (the
    #                                 text line inside the turn: keys restart after every newline), DESIGN 5
    adv_eps: float = 1e-6           # eps of the GRPO std normalisation
    # --- baselines (DESIGN 7; methods/baselines.py, methods/learned.py): read only by the method they name ---
    vine_k: int = 9                 # vineppo: K Monte Carlo continuations per turn boundary (Kazemnejad et al.: 9)
    step_gamma: float = 0.95        # gigpo, hgpo: gamma of the step return R_t = gamma^(T-1-t) U (GiGPO: 0.95)
    hgpo_k: int = 2                 # hgpo: longest history context K of the step groups (levels k = 0..K)
    hgpo_alpha: float = 1.0         # hgpo: level weight w_k ~ (k + 1)^alpha
    arpo_initial: float = 0.5       # arpo: full samples N / rollout budget M = group_size (ARPO: 8 of 16)
    arpo_beam: int = 2              # arpo: partial samples Z branched per triggered step (ARPO: 2)
    arpo_beta: float = 0.2          # arpo: entropy weight beta of P_t = alpha + beta Normalize(H_t - H_initial)
    arpo_tau: float = 0.5           # arpo: branch iff P_t > tau, alpha ~ U(0, 1) (ARPO's code: 0.5)
    tree_m: int = 2                 # tree_grpo: trees M per prompt; expansions fill the group to group_size leaves
    tree_l: int = 1                 # tree_grpo: expansion rounds L
    gamma: float = 1.0              # discount: ppo's GAE, igpo/spa_rl returns, agentprm MC targets (papers: 1)
    gae_lambda: float = 1.0         # lambda of ppo's GAE (Search-R1: 1)
    estimator_lr_scale: float = 10.0  # lr of critic / progress estimator / PRM over lr (Search-R1: 1e-5 / 1e-6)
    spa_beta: float = 0.1           # SPA-RL weight of the grounding reward g_t (progress weight alpha = 1)
    prm_rollouts: int = 1           # AgentPRM Monte Carlo continuations per non-final decision
    craft_beta: float = 1.0         # CRAFT inverse temperature of the sibling weights exp(beta g)
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
    mini_batches: int = 1           # optimizer steps per pass (Search-R1: 512 / 256 = 2)
    micro_batch_size: int = 8       # sequences per forward/backward (gradients accumulate)
    grad_clip: float = 1.0          # max global grad norm
    max_weight_growth: float = 100.0  # diverged when the weight norm passes this x its start
    bf16: bool = False              # bf16 autocast (GPU)
    gradient_checkpointing: bool = False  # trade compute for memory (real models)
    ref_offload: bool = False       # the reference stays in host memory but for its log-prob pass (GPU memory)
    collective_timeout_h: float = 6.0  # hours a collective may wait for a rank before the run fails (torch: 10 min)
    # --- lora (DESIGN 6, infra/lora.py): train adapters W' = W + (alpha / r) B A instead of every weight ---
    lora_rank: int = 0              # r, rank of the adapters (infra/lora.py); 0 = off: full fine-tuning
    lora_alpha: float = 32.0        # alpha: the adapters' update is scaled by alpha / r (dimensionless)
    lora_dropout: float = 0.0       # dropout probability on the adapters' input; only 0 (lora.checks says why)
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # modules given adapters (Qwen2's)
    # --- run ---
    seed: int = 0                   # run seed: prompt order, every sampling key, branch draws
    eval_every: int = 50            # steps between greedy evaluations (0 = only at the end)
    eval_tokens: int = 0            # also evaluate at the first step and whenever generated tokens pass a multiple
    eval_size: int = 0              # questions per periodic evaluation (0 = all; the final: all)
    save_every: int = 0             # steps between checkpoints (0 = only at the end)
    log_episodes: int = 2           # episodes per step logged as text and tokens (episodes.jsonl; lab/replay.py)
    keep_checkpoints: int = 2       # newest checkpoints kept besides the last one; older are deleted (0 = keep all)
    log_tensorboard: bool = True    # every metric as TensorBoard scalars too (out_dir/tb)
    log_wandb: bool = False         # Weights & Biases too (WANDB_MODE=offline: no network)
    wandb_project: str = "twice"    # W&B project name

    def resolve(self):
        """Blank paths come from the world folder."""
        self.model = self.model or os.path.join(self.world, "policy")
        self.train_data = self.train_data or os.path.join(self.world, "train.jsonl")
        self.eval_data = self.eval_data or os.path.join(self.world, "test.jsonl")
        self.index = self.index or ("" if self.retriever_url else os.path.join(self.world, "index"))
        if self.method == "twice" and self.omega == 0:  # --omega=0 has always meant GRPO
            self.method = "grpo"

    def checks(self):
        """(field, ok, rule): every value that would otherwise fail, or mislead, inside a step."""
        at_least = {"prompts_per_step": 1, "group_size": 2, "max_turns": 0, "topk": 1, "max_new_tokens": 1,
                    "max_obs_tokens": 0, "max_context": 2, "top_k": 0, "gen_batch_size": 1, "twin_budget": 0,
                    "twin_chunk": 0,
                    "twins_per_decision": 1, "steps": 0, "token_budget": 0, "lr": 0, "warmup_steps": 0,
                    "kl_coef": 0, "ppo_epochs": 1, "mini_batches": 1, "micro_batch_size": 1, "eval_every": 0,
                    "eval_tokens": 0, "eval_size": 0, "save_every": 0,
                    "keep_checkpoints": 0, "log_episodes": 0, "sync_every": 1}
        above = {"adv_eps": 0, "clip": 0, "grad_clip": 0, "max_weight_growth": 1, "collective_timeout_h": 0}
        unit = ("top_p", "q_min")  # fractions and probabilities in (0, 1]
        return ([(k, getattr(self, k) >= v, f">= {v}") for k, v in at_least.items()] +
                [(k, getattr(self, k) > v, f"> {v}") for k, v in above.items()] +
                [(k, 0 < getattr(self, k) <= 1, "in (0, 1]") for k in unit] +
                [("method", self.method in methods.NAMES, f"one of {', '.join(methods.NAMES)}"),
                 ("budget_rule", self.budget_rule in ("sqrt", "uniform"), "'sqrt' or 'uniform'"),
                 ("twin_unit", self.twin_unit in ("turn", "token"), "'turn' or 'token'"),
                 ("fork_floor", 0 < self.fork_floor <= 1, "in (0, 1]"),
                 ("twin_scale", self.twin_scale in ("d", "rms"), "'d' or 'rms'"),
                 ("line_keys", self.line_keys in ("group", "text"), "'group' or 'text'"),
                 ("scale_decay", 0 <= self.scale_decay < 1, "in [0, 1)"),
                 ("omega", math.isfinite(self.omega), "finite"), ("weight_decay", self.weight_decay >= 0, ">= 0"),
                 # below 1e-3, softmax(logits / T) is one-hot in float32: log-probs and entropies lose meaning
                 ("temperature", self.temperature >= 1e-3, ">= 0.001 (greedy evaluation is eval.py's)")]
                + self.baseline_checks() + lora.checks(self, methods.LEARNED))

    def baseline_checks(self) -> list:
        at_least = {"vine_k": 1, "hgpo_k": 0, "arpo_beam": 1, "tree_m": 1, "tree_l": 1, "estimator_lr_scale": 0,
                    "spa_beta": 0, "prm_rollouts": 0, "craft_beta": 0}
        return ([(k, getattr(self, k) >= v, f">= {v}") for k, v in at_least.items()] +
                [(k, 0 < getattr(self, k) <= 1, "in (0, 1]") for k in ("step_gamma", "arpo_initial", "gamma")] +
                [("gae_lambda", 0 <= self.gae_lambda <= 1, "in [0, 1]"),
                 ("tree_m", self.tree_m <= self.group_size, "<= group_size")])


def parse_config(argv) -> Config:  # preset files, then --key=value overrides (infra/config.py)
    return config.parse(Config, argv, "train_twice.py")


@dataclass
class Run:
    """The objects a run holds, built once by main() and passed to every step."""
    accel: object                   # accelerate.Accelerator
    policy: object                  # the trained model (wrapped by accelerate); with LoRA: the base + peft's layers
    ref: object                     # frozen reference for the KL term (None with LoRA: lora.reference)
    tok: object                     # tokenizer
    retriever: object               # DenseRetriever or RemoteRetriever
    opt: object                     # AdamW
    method: baselines.Method        # cfg.method's rollout and advantages (TWICE's: twin_credit)
    predictor: credit.DiscordancePredictor  # p_t of the budget rule
    token_predictor: credit.DiscordancePredictor  # p_k of the fork law (twin_unit = token)
    sigma_hat: credit.RunningScale  # sigma_hat of the token advantage
    rows: list                      # training questions
    n_micro: int                    # micro-batches per mini-batch (gradient accumulation)
    weight_norm0: float = 0.0       # the initial weight norm (divergence check)
    tokens: int = 0                 # generated tokens so far, factual + aux (token_budget)
    episode_log: list = None        # this step's logged episodes (checkpoint.episode_rows), rank 0's
    adapter: object = None          # peft.PeftModel around the policy when lora_rank > 0 (lora.attach), else None
    sampler: object = None          # during a step's rollout: the model episodes are sampled from (sampling_copy)


def gather_list(accel, items: list) -> list:
    """Concatenation of every rank's list, in rank order (identical on all ranks)."""
    if accel.num_processes == 1:
        return list(items)
    from accelerate.utils import gather_object
    return list(gather_object(list(items)))


# --------------------------------------------------------------------------------------------------
# Policy loss (DESIGN 6)

def token_logprobs(model, input_ids, attention_mask, temperature, with_entropy=False, positions=None):
    """log pi(x_{k+1} | x_<=k) of softmax(logits / T) at every position k, (B, L-1); optionally
    its entropy. Chunked through the LM head (generation/logprobs.py): no (B, L, V) tensor."""
    return logprobs.token_logprobs(model, input_ids, attention_mask, temperature, with_entropy, positions)


def ppo_loss(cfg, lp, old_lp, ref_lp, adv, mask, ent=None):
    """Per-token PPO-clip surrogate + k3 KL to the reference - entropy bonus; clipped tokens."""
    ratio = torch.exp(lp - old_lp)
    pg = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - cfg.clip, 1 + cfg.clip) * adv)
    d = ref_lp - lp
    kl = torch.exp(d) - d - 1  # k3 estimator of KL(pi || ref): unbiased, >= 0 (Schulman 2020)
    loss = pg + cfg.kl_coef * kl - (cfg.entropy_coef * ent if ent is not None else 0.0)
    return loss * mask, kl * mask, ((ratio - 1).abs() > cfg.clip).float() * mask


def diverged(step: int, what: str, value) -> FloatingPointError:  # raised before any save
    return FloatingPointError(f"diverged at step {step}: {what} = {value} (lower lr, or resume)")


def ppo_update(cfg, run, batch, adv, old_lp, ref_lp, step) -> dict:
    """ppo_epochs passes of mini_batches optimizer steps; token-mean over the mini-batch's loss-masked tokens of
    every rank; gradients accumulated over n_micro micro-batches (the same count on every rank)."""
    accel, model, opt = run.accel, run.policy, run.opt
    mask = batch["loss_mask"][:, 1:].float()  # (B, L-1): position k predicts token k+1
    sums = torch.zeros(4, device=accel.device)  # loss, kl, clipped, tokens
    lengths = batch["attention_mask"].sum(1).cpu().numpy()
    grad_norms = []
    for epoch in range(cfg.ppo_epochs):
        order = np.random.default_rng(sampler.mix(cfg.seed, step, epoch)).permutation(len(mask))
        for mb in np.array_split(order, cfg.mini_batches):
            n_tok = accel.reduce(mask[mb].sum(), "sum").clamp(min=1)  # the mini-batch's, all ranks
            for micro in logprobs.length_sorted_splits(lengths, mb, run.n_micro):  # little padding
                with accel.accumulate(model):
                    mbt, w = logprobs.trimmed(batch, micro)
                    lp, ent = token_logprobs(model, mbt["input_ids"], mbt["attention_mask"], cfg.temperature,
                                             cfg.entropy_coef > 0, mbt["loss_mask"][:, 1:].bool())
                    loss, kl, clipped = ppo_loss(cfg, lp, old_lp[micro, :w - 1], ref_lp[micro, :w - 1],
                                                 adv[micro, :w - 1], mask[micro, :w - 1], ent)
                    total = loss.sum() / n_tok
                    # every rank learns of a non-finite loss on any rank, so all stop here together (no rank is
                    # left waiting in the next collective)
                    bad = int(accel.reduce(torch.tensor(float(not torch.isfinite(total)), device=accel.device),
                                           "sum"))
                    if bad:
                        raise diverged(step, "loss", f"{total.item()} on rank {accel.process_index}; non-finite on "
                                                     f"{bad} of {accel.num_processes} rank(s)")
                    # accelerate divides by n_micro, DDP averages ranks: undo both (a global token mean)
                    accel.backward(total * accel.num_processes * run.n_micro)
                    if accel.sync_gradients:
                        grad_norms.append(float(accel.clip_grad_norm_(model.parameters(), cfg.grad_clip)))
                        if not math.isfinite(grad_norms[-1]):
                            raise diverged(step, "grad norm", grad_norms[-1])
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                sums += torch.stack([loss.sum(), kl.sum(), clipped.sum(), mask[micro].sum()]).detach()
    loss, kl, clipped, tokens = accel.reduce(sums, "sum").tolist()
    return {"loss": loss / max(tokens, 1),
            "kl": kl / max(tokens, 1),
            "clip_frac": clipped / max(tokens, 1),
            "grad_norm": float(np.mean(grad_norms)) if grad_norms else 0.0}


def weight_norm(accel, model) -> float:
    """Norm of the trained weights (LoRA: the adapters'), float32 norms per tensor: no float64 copy of the weights."""
    norms = [torch.linalg.vector_norm(p.detach(), dtype=torch.float32) for p in accel.unwrap_model(model).parameters()
             if p.requires_grad]
    return float(torch.linalg.vector_norm(torch.stack(norms)))


# --------------------------------------------------------------------------------------------------
# Where the weights are (DESIGN.md section 10: memory)

def sampling_copy(model, dtype=None):
    """The model to sample episodes from: `model` itself when its weights are already in dtype (DeepSpeed's bf16
    module, or any run without bf16), else a copy with the weights cast to dtype (fp32 master weights under bf16
    autocast), tied weights still tied and the class's own forward (not accelerate's autocast wrapper). Sampling
    from it instead of under autocast keeps the KV caches in bf16 (RoPE under autocast gives fp32 keys over an fp32
    residual stream) and holds no autocast copy of the weights while the caches grow; freed when the step drops it."""
    params = list(model.parameters())
    frozen = [p for p in params if not p.requires_grad]
    if dtype is None or all(p.dtype == dtype for p in params) or frozen and all(p.dtype == dtype for p in frozen):
        return model  # LoRA: a base already in dtype, its float32 adapters cast by peft's layers (no copy)
    memo = {id(p): torch.nn.Parameter(p.detach().to(dtype), requires_grad=False) for p in params}
    clone = copy.deepcopy(model, memo)
    clone.__dict__.pop("forward", None)  # accelerate's autocast wrapper, bound to the original
    clone.__dict__.pop("_original_forward", None)
    return clone.eval()


@contextlib.contextmanager
def on_device(model, device):
    """model's parameters and buffers on `device` inside the block, back on their own device after it (the reference
    kept in host memory, ref_offload): the host copies are kept, so nothing is copied back."""
    params = [p for p in [*model.parameters(), *model.buffers()] if p.device != torch.device(device)]
    held = [p.data for p in params]
    for p in params:
        p.data = p.data.to(device, non_blocking=True)
    try:
        yield model
    finally:
        for p, data in zip(params, held):
            p.data = data


# --------------------------------------------------------------------------------------------------
# One step: the method, in the order of the docstring

def train_step(cfg: Config, run: Run, step: int) -> dict:
    accel, times = run.accel, {"start": time.time()}
    policy = accel.unwrap_model(run.policy)
    policy.eval()
    proto = protocol.protocol_from(cfg)
    with torch.no_grad():
        # Episodes are sampled from weights in the rollout dtype (bf16 at scale), outside any autocast: no fp32 KV,
        # no cached casts of the weights while caches grow (memory: DESIGN.md section 10).
        run.sampler, episodes = sampling_copy(policy, torch.bfloat16 if cfg.bf16 else None), []
        try:
            # 1. Factual episodes: G lines per prompt, every token a keyed Gumbel-max draw (a baseline's own rollout).
            prompts = rollout.step_prompts(run.rows, cfg.prompts_per_step, cfg.seed, step, accel.process_index,
                                           accel.num_processes)
            episodes = run.method.rollout(run, step, prompts, proto)
            batch = {k: v.to(accel.device) for k, v in rollout.collate(episodes, run.tok.pad_token_id,
                                                                        cfg.max_context).items()}
            times["rollout"] = time.time()

            # 2.-6. Token advantages: TWICE's twin credit, or the baseline's own (baselines.Method.advantages).
            if cfg.method in methods.TWIN_METHODS:
                adv, stats = twin_credit(cfg, run, step, episodes, batch, proto)
            else:
                with accel.autocast():
                    adv, stats = run.method.advantages(run, step, episodes, batch, proto)
        finally:
            # no pass below reads a KV cache: the episodes' entries and the engine's slot cache go now (the engine
            # keeps its slot cache per model between calls; a sampling copy dies with it)
            engine.free_cache(run.sampler)
            run.sampler = None
            rollout.release_caches(episodes)
        times["twins"] = time.time()
        run.episode_log = checkpoint.episode_rows(step, episodes, stats.get("twins", []), cfg.log_episodes,
                                                  accel.num_processes) if accel.is_main_process else []
        # log-prob k predicts token k + 1 (token_logprobs): token k's advantage moves to k - 1
        adv = torch.tensor(adv[:, 1:], dtype=torch.float32, device=accel.device)
        with accel.autocast():
            old_lp, ent = logprobs.batch_logprobs(policy, batch, cfg.temperature, cfg.micro_batch_size, True,
                                                  cfg.max_context)
            # LoRA: the policy with its adapters disabled; ref_offload: on the GPU for this pass only
            with lora.reference(run) as ref, on_device(ref, accel.device):
                ref_lp, _ = logprobs.batch_logprobs(ref, batch, cfg.temperature, cfg.micro_batch_size,
                                                    max_context=cfg.max_context)

    # 7. PPO-clip update with the k3 KL to the reference.
    run.policy.train()
    lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else cfg.lr
    for group in run.opt.param_groups:
        group["lr"] = lr
    update = ppo_update(cfg, run, batch, adv, old_lp, ref_lp, step)
    norm = weight_norm(accel, run.policy)
    if not math.isfinite(norm) or norm > cfg.max_weight_growth * run.weight_norm0:
        raise diverged(step, "weight norm", f"{norm:.4g} (initial {run.weight_norm0:.4g})")
    now = time.time()
    metrics = {"step": step, **batch_totals(accel, episodes, batch, ent), "lr": lr, "sigma": run.sigma_hat.value,
               "weight_norm": norm, **update}
    if "twins" in stats:
        metrics.update(twin_stats(accel, stats["twins"], stats["n_decisions"], metrics["factual_tokens"]))
        metrics.update({k: stats[k] for k in ("predictor_auc", "predictor_brier", "q_mean")},
                       aux_tokens=metrics["twin_tokens"])
    else:
        metrics.update(reduce_stats(accel, stats))
    metrics.update({"time_rollout": times["rollout"] - times["start"],
                    "time_twins": times["twins"] - times["rollout"],
                    "time_update": now - times["twins"],
                    "time": now - times["start"]})
    return metrics


def twin_credit(cfg: Config, run: Run, step: int, episodes, batch, proto) -> tuple:
    """Steps 2-6 of TWICE: (B, L) token advantages A = A_traj + omega A_hat / sigma_hat and the twins' counters.
    twin_unit = token: one fork token per branched turn carries the twin term (forks.py)."""
    accel, policy, G = run.accel, run.method.policy(run), cfg.group_size
    rewards = np.array([ep.reward for ep in episodes])
    factual_tokens = sum(ep.n_generated for ep in episodes)
    token = cfg.twin_unit == "token"
    # 2. Trajectory advantage A_traj (GRPO's group-normalised outcome).
    a_traj = run.method.trajectory_advantages(episodes)

    # 3. Budget rule: q_t from predicted discordance p_t and cost c_t (token unit: the fork law's, over each turn's
    #    tokens); keyed branch draws, and (token unit) the fork token k ~ r_t of each branched turn.
    #    DEVIATION T1: lambda is solved over this rank's decisions (its share of the budget).
    group_success = rewards.reshape(-1, G).mean(1).repeat(G)
    decisions = rollout.decision_table(episodes, group_success)
    if token:  # DEVIATION F1: a fork at one token k ~ r_t of the turn, not the whole turn re-sampled
        table = forks.token_table(episodes, decisions, run.tok)
        law = forks.fork_law(table, run.token_predictor.predict(table.features), cfg.fork_floor)
        p, cost, pred, X = law.p, law.cost, run.token_predictor, table.features
    else:
        p, cost, pred, X = run.predictor.predict(decisions.features), decisions.cost, run.predictor, decisions.features
    budget = credit.solve_budget(p, cost, cfg.twin_budget * factual_tokens, cfg.q_min, cfg.budget_rule)
    keys = [(cfg.seed, step, episodes[i].uid, episodes[i].line, t) for i, t in decisions.index]
    branched = credit.branch_mask(budget.q, np.array([sampler.branch_uniform(*key) for key in keys]))
    row = np.arange(len(keys))  # the predictor's row of each decision: itself, or its fork token's
    if token:
        for n in np.flatnonzero(branched):
            lo, hi = table.offsets[n], table.offsets[n + 1]
            row[n] = lo + forks.draw_fork(law.r[lo:hi], forks.fork_uniform(*keys[n]))

    # 4. Twins of the branched decisions: y' at turn t (or at its fork token), then the factual keys (same luck).
    pairs = [(n, j) for n in np.flatnonzero(branched) for j in range(cfg.twins_per_decision)]
    requests = [(episodes[decisions.index[n][0]], decisions.index[n][1], j) for n, j in pairs]
    ks = [int(row[n] - table.offsets[n]) for n, _ in pairs] if token else None
    branching = {id(ep) for ep, _, _ in requests}  # memory: the other caches die before any twin runs
    rollout.release_caches([ep for ep in episodes if id(ep) not in branching])
    twins = rollout.run_twins(policy, run.tok, run.retriever, requests, proto, cfg.coupling,
                              cfg.same_evidence_shortcut, run.method.independent_twins, ks, cfg.twin_chunk,
                              release=True)

    # 5. Horvitz-Thompson credit A_hat = 1[branched] mean_j D^j / q_t (token unit: x (1 - pi_k) / r_t(k)); the
    #    predictor learns from the whole batch's twins (same model on every rank), scored first (AUC, Brier).
    diffs = [[] for _ in decisions.index]
    for (n, _), twin in zip(pairs, twins):
        diffs[n].append(twin.diff)
    a_flat = (forks.fork_credit(diffs, branched, budget.q, law.r[row], table.pi[row]) if token else
              credit.ht_credit(diffs, branched, budget.q))
    # DEVIATION F1: the token predictor learns from the fork tokens the law drew (no importance weights)
    labels = gather_list(accel, [(X[row[n]].tolist(), float(twin.diff != 0)) for (n, _), twin in zip(pairs, twins)])
    auc, brier = pred.update(np.array([x for x, _ in labels]).reshape(-1, X.shape[1]), [y for _, y in labels])
    sigma = scale_step(cfg, run, accel, diffs, branched, budget.q, a_flat)

    # 6. Token advantage A = A_traj + omega A_hat / sigma_hat on the sampled tokens of turn t (token unit: on the
    #    fork token k alone; the turn's other tokens carry A_traj).
    a_hat = [np.zeros(len(ep.turns)) for ep in episodes]
    if not token:
        for (i, t), a in zip(decisions.index, a_flat):
            a_hat[i][t] = a
    turn_adv = credit.turn_advantages(a_traj, a_hat, cfg.omega, sigma)
    adv = credit.spread_over_tokens(turn_adv, rollout.turn_spans(episodes), batch["input_ids"].shape[1])
    if token:
        for n in np.flatnonzero(branched):
            i, t = decisions.index[n]
            adv[i, len(episodes[i].prompt_ids) + episodes[i].turns[t].start + row[n] - table.offsets[n]] += \
                cfg.omega * a_flat[n] / sigma
    return adv, {"twins": twins, "n_decisions": len(decisions.index), "predictor_auc": auc, "predictor_brier": brier,
                 "q_mean": float(budget.q.mean()) if len(decisions.index) else 0.0}


def scale_step(cfg: Config, run: Run, accel, diffs, branched, q, a_flat) -> float:
    """sigma_hat of this batch. twin_scale = d: the value from the batches before (so over this batch's branch draws
    E[A_hat / sigma_hat] = (Q - V) / sigma_hat at any q), then updated with the batch's Horvitz-Thompson mean of D^2
    per decision over every rank; rms: updated with the RMS of the batch's nonzero A_hat first (the first form)."""
    if cfg.twin_scale == "rms":
        return run.sigma_hat.update(gather_list(accel, a_flat[branched].tolist()))
    # DEVIATION C6: the paper's "running scale" read as a scale of D per decision, from the batches before this one
    sigma = run.sigma_hat.value
    total, n = np.sum(gather_list(accel, [(credit.ht_mean_square(diffs, branched, q) * len(q), len(q))]), axis=0)
    run.sigma_hat.update_d(total / n if n else 0.0)
    return sigma


TWIN_COUNTERS = ("decisions", "twins", "self_twins", "shortcuts", "twin_rollouts", "discordant", "twin_tokens")


def twin_stats(accel, twins, n_decisions: int, factual_tokens: int) -> dict:
    """The twin counters of TWIN_COUNTERS summed over ranks, and the logged rates (factual_tokens: summed)."""
    kinds = [twin.kind for twin in twins]
    counts = [n_decisions, len(twins), kinds.count("self"), kinds.count("same_evidence"), kinds.count("rollout"),
              sum(twin.diff != 0 for twin in twins), sum(twin.tokens for twin in twins)]
    total = accel.reduce(torch.tensor(counts, dtype=torch.float64, device=accel.device), "sum").tolist()
    out = {k: int(v) for k, v in zip(TWIN_COUNTERS, total)}
    out["discordance"] = out["discordant"] / max(out["twins"], 1)
    out["twin_token_ratio"] = out["twin_tokens"] / max(factual_tokens, 1)
    return out


def reduce_stats(accel, stats: dict) -> dict:
    """A method's per-rank counters summed over ranks (every value a number; aux_tokens among them)."""
    keys = sorted(stats)
    counts = torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64, device=accel.device)
    total = accel.reduce(counts, "sum").tolist() if keys else []
    return {k: int(v) if float(v).is_integer() else v for k, v in zip(keys, total)}


def batch_totals(accel, episodes, batch, ent) -> dict:
    """Reward, entropy, turns and factual tokens of the step, over every rank."""
    mask = batch["loss_mask"][:, 1:].float()
    sums = torch.tensor([sum(ep.reward for ep in episodes), len(episodes), float((ent * mask).sum()),
                         float(mask.sum()), sum(len(ep.turns) for ep in episodes),
                         sum(ep.n_generated for ep in episodes)], dtype=torch.float64, device=accel.device)
    reward, n_episodes, entropy, n_tokens, turns, generated = accel.reduce(sums, "sum").tolist()
    return {"reward": reward / n_episodes,
            "entropy": entropy / max(n_tokens, 1),
            "turns": turns / n_episodes,
            "factual_tokens": int(generated)}


# --------------------------------------------------------------------------------------------------
# Evaluation, checkpoints, logs

def run_eval(cfg, run, rows) -> dict:
    """Greedy EM on the eval rows, over ranks: {"eval_em": mean over sources, "eval_em/<source>": ..}."""
    policy = run.accel.unwrap_model(run.policy)
    policy.eval()
    try:
        with torch.no_grad(), run.accel.autocast():
            return qa_eval.evaluate_on_ranks(run.accel, policy, run.tok, run.retriever, rows,
                                             protocol.protocol_from(cfg, greedy=True), gather_list)
    finally:
        engine.free_cache(policy)  # the engine's slot cache is not held through the training steps after it


def weights_spread(accel, model) -> float:
    """Max minus min over ranks of a float64 weight checksum: 0 when all ranks hold the same weights."""
    s = sum(p.detach().double().sum() for p in accel.unwrap_model(model).parameters())
    all_s = accel.gather(s.reshape(1).to(accel.device))
    return float(all_s.max() - all_s.min())


def reference_model(cfg: Config, device):
    """The frozen reference in the rollout dtype: on the GPU, or with ref_offload in host memory (pinned, if the
    system lets every rank pin it: read asynchronously) until its log-prob pass moves it (on_device)."""
    ref, _ = qa_eval.load_policy(cfg.model, "cpu" if cfg.ref_offload else device,
                                 torch.bfloat16 if cfg.bf16 else torch.float32)
    ref.requires_grad_(False)
    if cfg.ref_offload and device.type == "cuda":
        try:
            for p in ref.parameters():
                p.data = p.data.pin_memory()
        except RuntimeError as e:
            print(f"ref_offload: the reference stays in pageable host memory ({e})", file=sys.stderr)
    return ref


def setup(cfg: Config) -> Run:
    """Accelerator, policy (fp32 master weights; bf16 under DeepSpeed, which keeps its own fp32 master partition),
    frozen reference, optimizer, retriever, data."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, InitProcessGroupKwargs
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.prompts_per_step % world:
        raise ValueError(f"prompts_per_step={cfg.prompts_per_step} must divide over {world} processes")
    episodes_per_rank = cfg.prompts_per_step // world * cfg.group_size
    if episodes_per_rank % cfg.mini_batches:
        raise ValueError(f"{episodes_per_rank} episodes per rank do not split into mini_batches={cfg.mini_batches}")
    n_micro = math.ceil(episodes_per_rank // cfg.mini_batches / cfg.micro_batch_size)
    timeout = InitProcessGroupKwargs(timeout=datetime.timedelta(hours=cfg.collective_timeout_h))
    accel = Accelerator(mixed_precision="bf16" if cfg.bf16 else "no", gradient_accumulation_steps=n_micro,
                        cpu=not torch.cuda.is_available(), kwargs_handlers=[timeout])
    if accel.device.type == "cpu":  # the same figures on every x86-64 CPU (DESIGN.md section 9), or a clear refusal
        numerics.require("this CPU training run")
    if cfg.lora_rank and accel.distributed_type == "DEEPSPEED":  # its save_state writes the whole model
        raise ValueError("lora_rank > 0 runs under DDP (configs/accelerate_ddp.yaml), not DeepSpeed: the adapters' "
                         "gradients and AdamW state are small enough to hold whole on each GPU (python -m infra.lora memory)")
    torch.manual_seed(cfg.seed)
    half = torch.bfloat16 if cfg.bf16 else torch.float32
    deepspeed = accel.distributed_type == DistributedType.DEEPSPEED
    if deepspeed:  # no dataloader tells DeepSpeed its micro-batch: the preset's, whatever the shared JSON says
        accel.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = cfg.micro_batch_size
    # fp32 master weights; DeepSpeed: its bf16 module (it keeps the fp32 partition); LoRA: bf16 base if bf16
    policy, tok = qa_eval.load_policy(cfg.model, accel.device, half if deepspeed else lora.base_dtype(cfg))
    if cfg.gradient_checkpointing:  # also makes the embeddings' output require grad: LoRA's gradients flow back
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    adapter, ref = None, None
    # DEVIATION T2: lora_rank > 0 trains LoRA adapters on a frozen (bf16 with bf16 on) base, not every weight
    if cfg.lora_rank:  # the base frozen, peft's layers in it; the reference is the base itself (lora.reference)
        adapter = lora.attach(policy, cfg)
        accel.register_save_state_pre_hook(lora.adapter_only)  # trainer/ holds the adapters, not the base
    else:
        ref = reference_model(cfg, accel.device)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=cfg.lr,
                            weight_decay=cfg.weight_decay)
    policy, opt = accel.prepare(policy, opt)
    rows = qa_eval.load_qa(cfg.train_data)
    qa_eval.refuse_long_prompts(rows, tok, cfg.max_context, cfg.max_new_tokens, cfg.train_data)  # before any rollout
    return Run(accel, policy, ref, tok, qa_eval.load_retriever(cfg.index, cfg.retriever_url), opt,
               methods.make(cfg), credit.DiscordancePredictor(),
               credit.DiscordancePredictor(features=forks.TOKEN_FEATURES),
               credit.RunningScale(cfg.scale_decay, cfg.twin_scale), rows, n_micro, weight_norm(accel, policy),
               adapter=adapter)


def main(cfg: Config):
    """One run, holding its out_dir from start to end (checkpoint.run_folder: one run per folder at a time)."""
    # set before the first CUDA allocation: blocks of every size share growable segments, so the caches that
    # grow and shrink every step leave no fragments (DESIGN.md section 10); the Makefile's launch lines set it too
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with checkpoint.run_folder(cfg, int(os.environ.get("RANK", "0")) == 0):
        return train(cfg)


def train(cfg: Config):
    run = setup(cfg)
    accel = run.accel
    eval_rows = [r for path in cfg.eval_data.split(",") if path for r in qa_eval.load_qa(path)]
    start = checkpoint.load(cfg, run) if cfg.resume else 0
    trackers = checkpoint.start_log(cfg, start) if accel.is_main_process else []
    eval_subset = eval_rows[:cfg.eval_size] if cfg.eval_size else eval_rows
    done, mark = start, -1  # mark: multiples of eval_tokens evaluated so far (-1: none yet)
    for step in range(start, cfg.steps):
        if cfg.token_budget and run.tokens >= cfg.token_budget:
            break
        metrics = {}
        due = cfg.eval_tokens and run.tokens // cfg.eval_tokens > mark  # methods differ in tokens per step
        if eval_rows and (cfg.eval_every and step % cfg.eval_every == 0 or due):
            metrics.update(run_eval(cfg, run, eval_subset))
            mark = run.tokens // cfg.eval_tokens if cfg.eval_tokens else mark
        metrics.update(train_step(cfg, run, step))
        run.tokens += metrics["factual_tokens"] + metrics["aux_tokens"]
        metrics["tokens"], done = run.tokens, step + 1  # this row's eval_em: before its tokens
        if accel.num_processes > 1:
            metrics["weights_spread"] = weights_spread(accel, run.policy)
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
        print(f"final | eval_em {final.get('eval_em', float('nan')):.3f} | checkpoint {path}", flush=True)
        print(report.finish_run(cfg.out_dir), flush=True)  # learning_curve.png, before/after table
    accel.end_training()
    return final


if __name__ == "__main__":
    cfg = config.cli(Config, prog="train_twice.py")
    try:
        main(cfg)
    except (ValueError, FloatingPointError) as e:
        print(f"train_twice.py: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
