"""LoRA: train low-rank adapters (peft) instead of every weight, so a run fits on fewer GPUs
(DESIGN.md section 6).

    W' = W + (alpha / r) B A,   A: (r, in), B: (out, r), B = 0 at the start (peft's init: the run starts at W)

on the linear modules named by lora_targets (default: Qwen2's attention and MLP projections). With
lora_rank > 0, train_twice.py changes in these places only:
  - the policy is the base model, frozen, with peft's LoRA layers injected (`attach`); it stays a
    transformers model, so the cached generation engine and the chunked log-probs run on it
    unchanged. Only the adapters get gradients and AdamW state (float32). The base is held in bf16
    when bf16 is on (`base_dtype`): weights that never change need no float32 master copy.
  - the reference of the KL term is that model with its adapters disabled (`reference`: peft's
    disable_adapter), not a second copy: the same base weights, in the same dtype as full
    fine-tuning's bf16 reference.
  - checkpoints: policy/ is the adapter (a PEFT folder: adapter_config.json,
    adapter_model.safetensors); trainer/ holds the adapter tensors and their AdamW state only
    (`adapter_only`, `check_trainer`); the run's last checkpoint also holds policy_merged/, W' in
    float32 as a plain HF folder (`merged_model`: loads without peft, feeds eval.py), and
    policy_bf16/, the same merged policy in bf16.
  - `python rollout.py replay` loads the base as setup() does and the step's adapter on it (`load`).
What it does not know: the loop, the loss and accelerate's wrapping (train_twice.py), the checkpoint
layout (infra/checkpoint.py). The learned estimators (ppo, spa_rl, agentprm) copy the policy's body
into a fully trained critic, so LoRA is refused with them. Dropout on the adapters is refused: the
update runs in train mode and the rollout and old log-probs in eval mode, so with dropout the
update's policy is not the rollout's and the PPO ratio is not 1 on the first mini-batch.

Memory per GPU of weights, gradients, AdamW state and reference, with and without LoRA, for the
Qwen2.5-3B and -7B configs written below (no download): `memory_bytes`, and

  python -m infra.lora memory --rank 16            # both models, one rank; --shard 8: ZeRO-2's sharded gradients, AdamW
  python train_twice.py configs/demo.cfg --lora_rank=8 --lora_alpha=16 --lr=2e-3 --out_dir=runs/demo/lora  # CPU
"""
import argparse
import contextlib
import copy
import os
import re

import torch


# Qwen2's attention and MLP projections
TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def targets_of(cfg) -> list:
    return [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]


def checks(cfg, learned_methods=()) -> list:
    """(field, ok, rule) of the LoRA fields, for train_twice.Config.checks."""
    names = [t.strip() for t in cfg.lora_targets.split(",")]
    return [
        ("lora_rank", cfg.lora_rank >= 0, ">= 0 (0: full fine-tuning)"),
        ("lora_rank", cfg.lora_rank == 0 or cfg.method not in learned_methods,
         f"0 with method {cfg.method}: its estimator is a fully trained copy of the policy's body (methods/learned.py)"
         ),
        ("lora_alpha", cfg.lora_alpha > 0, "> 0"),
        # dropout is on in the update (train mode), off in the rollout and the old log-probs
        # (eval mode)
        ("lora_dropout", cfg.lora_dropout == 0,
         "0: with dropout the update's policy differs from the "
         "rollout's, so the PPO ratio is not 1 before any update"),
        ("lora_targets", all(re.fullmatch(r"[A-Za-z_][\w.]*", t)
                             for t in names), "comma-separated module names, e.g. " + TARGETS)
    ]


def base_dtype(cfg):
    """The dtype the policy's weights load in: float32 master weights for full fine-tuning; with
    LoRA the frozen base in bf16 when bf16 is on (it is never updated), else float32."""
    return torch.bfloat16 if cfg.lora_rank and cfg.bf16 else torch.float32


def attach(model, cfg, adapter: str = ""):
    """Inject LoRA layers into `model` in place and freeze its base weights; returns the
    peft.PeftModel around it. A fresh adapter (B = 0, A drawn from torch's generator) unless
    `adapter` names a saved adapter folder."""
    import peft
    linear = {
        n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
    }
    missing = [t for t in targets_of(cfg) if t not in linear]
    if missing:
        raise ValueError(
            f"lora_targets: {', '.join(missing)} name(s) no linear module of {cfg.model} (its linear "
            f"modules: {', '.join(sorted(linear))})")
    if adapter:
        return peft.PeftModel.from_pretrained(model, adapter)
    config = peft.LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
                             lora_dropout=cfg.lora_dropout, target_modules=targets_of(cfg),
                             bias="none")
    # adapters in float32 whatever the base's dtype (autocast_adapter_dtype)
    return peft.get_peft_model(model, config)


@contextlib.contextmanager
def reference(run):
    """The frozen reference of the KL term: run.ref, or (LoRA) the policy with its adapters disabled
    (peft's disable_adapter context: the base weights the policy holds, no second copy)."""
    if run.adapter is None:
        yield run.ref
        return
    with run.adapter.disable_adapter():
        yield run.accel.unwrap_model(run.policy)


def trainable(model) -> set:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def adapter_only(models, weights, output_dir):
    """accelerate save_state pre-hook: trainer/model.safetensors holds the adapter tensors only, not the frozen base
    (which cfg.model holds). The optimizer state saved beside it covers the adapters only already
    (setup)."""
    for i, model in enumerate(models):
        keep = trainable(model)
        weights[i] = {k: v for k, v in weights[i].items() if k in keep}


def check_trainer(trainer_dir: str, model):
    """A LoRA resume loads trainer/ non-strictly (the base is not in it): its tensors must be
    exactly the adapter's."""
    from safetensors import safe_open
    path = os.path.join(trainer_dir, "model.safetensors")
    if not os.path.exists(path):
        raise ValueError(f"{path}: missing: not a checkpoint of a LoRA run")
    with safe_open(path, "pt") as f:
        keys = set(f.keys())
    want = trainable(model)
    if keys != want:
        raise ValueError(
            f"{path}: holds {len(keys)} tensors, not the {len(want)} adapter tensors of this lora_rank "
            f"and lora_targets (e.g. extra {sorted(keys - want)[:2]}, missing {sorted(want - keys)[:2]})"
        )


def merged_state_dict(model) -> dict:
    """The plain model's state dict of W' = W + (alpha / r) B A for every adapted module, on the CPU
    in float32 (tied tensors stay one tensor)."""
    from peft.tuners.lora import LoraLayer
    layers = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    out, cast = {}, {}
    for key, value in model.state_dict().items():
        if ".lora_" in key:
            continue
        if value.data_ptr() not in cast:
            # never the live tensor
            cast[value.data_ptr()] = value.detach().to("cpu", torch.float32, copy=True)
        out[key.replace(".base_layer.", ".")] = cast[value.data_ptr()]
    for name, layer in layers.items():
        delta = layer.get_delta_weight(layer.active_adapters[0]).to("cpu", torch.float32)
        out[name + ".weight"] = out[name + ".weight"] + delta
    return out


def merged_model(model):
    """The adapted policy as a plain transformers model (no peft layers) on the CPU in float32: W'
    merged in."""
    from transformers import AutoModelForCausalLM
    config = copy.deepcopy(model.config)
    config.dtype = torch.float32
    # no random initialisation: every tensor comes from the merged state dict
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(merged_state_dict(model), strict=True, assign=True)
    live = dict(model.named_buffers())
    # non-persistent buffers (rotary inv_freq): not in a state dict
    for name, buffer in list(plain.named_buffers()):
        if not buffer.is_meta:
            continue
        owner, _, attr = name.rpartition(".")
        plain.get_submodule(owner).register_buffer(attr, live[name].to("cpu", copy=True),
                                                   persistent=False)
    plain.generation_config = copy.deepcopy(model.generation_config)
    return plain.eval()


# --------------------------------------------------------------------------------------------------------------
# Memory per GPU, for the per-GPU memory ledger to call (weights, gradients, optimizer, reference)

# config.json of Qwen/Qwen2.5-3B and Qwen/Qwen2.5-7B on the hub: the fields that size the weights
QWEN2_5 = {
    "Qwen2.5-3B": dict(vocab_size=151_936, hidden_size=2048, intermediate_size=11_008,
                       num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                       tie_word_embeddings=True),
    "Qwen2.5-7B": dict(vocab_size=152_064, hidden_size=3584, intermediate_size=18_944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       tie_word_embeddings=False),
}


def linear_shapes(c: dict) -> dict:
    """{module name: (in features, out features, bias)} of one Qwen2 decoder layer's linear modules.
    """
    h, i = c["hidden_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * (h // c["num_attention_heads"])
    return {
        "q_proj": (h, h, True), "k_proj": (h, kv, True), "v_proj": (h, kv, True), "o_proj": (h, h,
                                                                                             False),
        "gate_proj": (h, i, False), "up_proj": (h, i, False), "down_proj": (i, h, False)
    }


def n_params(c: dict) -> int:
    """Parameters of a Qwen2ForCausalLM: per layer its linears and two RMSNorms; embedding, final
    norm, LM head."""
    h = c["hidden_size"]
    layer = sum(a * b + (b if bias else 0) for a, b, bias in linear_shapes(c).values()) + 2 * h
    head = 0 if c["tie_word_embeddings"] else c["vocab_size"] * h
    return c["num_hidden_layers"] * layer + c["vocab_size"] * h + h + head


def n_adapter_params(c: dict, rank: int, targets=TARGETS) -> int:
    """LoRA parameters: r (in + out) per adapted linear module per layer."""
    shapes = linear_shapes(c)
    names = [t.strip() for t in targets.split(",")] if isinstance(targets, str) else list(targets)
    unknown = [t for t in names if t not in shapes]
    if unknown:
        raise ValueError(
            f"targets: {', '.join(unknown)} are not linear modules of Qwen2 ({', '.join(shapes)})")
    return c["num_hidden_layers"] * sum(rank * (shapes[t][0] + shapes[t][1]) for t in names)


def memory_bytes(c, rank: int, targets=TARGETS, bf16: bool = True, shard: int = 1) -> dict:
    """Per-GPU bytes of weights, gradients, optimizer state (AdamW: two float32 moments) and
    reference, as setup() holds them, for full fine-tuning ("full") and LoRA of rank `rank`
    ("lora"), each with its "total". c: a config dict (a QWEN2_5 value) or a QWEN2_5 key. shard:
    ranks that gradients and optimizer state are split over (ZeRO-2: the world size; DDP: 1). Not
    here: DDP's gradient buckets, activations, KV cache (the ledger's).
      full: float32 weights 4N, gradients 4N, AdamW 8N, reference 2N (bf16) or 4N lora: base 2N
      (bf16) or 4N, adapters 4n, their gradients 4n and AdamW 8n, reference 0 (the base itself)"""
    c = QWEN2_5[c] if isinstance(c, str) else c
    n, a = n_params(c), n_adapter_params(c, rank, targets)
    low = 2 if bf16 else 4
    full = {
        "weights": 4 * n, "gradients": 4 * n // shard, "optimizer": 8 * n // shard,
        "reference": low * n
    }
    lora = {
        "weights": low * n + 4 * a, "gradients": 4 * a // shard, "optimizer": 8 * a // shard,
        "reference": 0
    }
    for d in (full, lora):
        d["total"] = sum(d.values())
    return {"full": full, "lora": lora, "params": n, "adapter_params": a}


def memory_table(rank: int, targets=TARGETS, bf16: bool = True, shard: int = 1) -> str:
    """memory_bytes of both QWEN2_5 models as a markdown table, GB = 1e9 bytes."""
    rows = [
        "| model (parameters; adapter parameters) | what | full fine-tuning GB | LoRA GB |",
        "|---|---|---|---|"
    ]
    for name in QWEN2_5:
        m = memory_bytes(name, rank, targets, bf16, shard)
        for k in ("weights", "gradients", "optimizer", "reference", "total"):
            first = f"{name} ({m['params']:,}; {m['adapter_params']:,})" if k == "weights" else ""
            rows.append(f"| {first} | {k} | {m['full'][k] / 1e9:.2f} | {m['lora'][k] / 1e9:.2f} |")
    return "\n".join(rows)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="infra/lora.py", description="LoRA's memory per GPU (infra/lora.py's docstring).")
    sub = parser.add_subparsers(dest="command", required=True)
    mem = sub.add_parser("memory",
                         help="per-GPU bytes of weights, gradients, AdamW, reference: full vs LoRA")
    mem.add_argument("--rank", type=int, default=16, help="LoRA rank r")
    mem.add_argument("--targets", default=TARGETS, help="comma-separated adapted modules")
    mem.add_argument("--shard", type=int, default=1,
                     help="ranks that gradients and AdamW state are split over")
    mem.add_argument("--fp32", action="store_true",
                     help="no bf16: the reference and a LoRA base in float32")
    args = parser.parse_args(argv)
    if args.rank < 1 or args.shard < 1:
        parser.error("--rank and --shard must be >= 1")
    try:
        table = memory_table(args.rank, args.targets, not args.fp32, args.shard)
    except ValueError as e:
        parser.error(str(e))
    print(
        f"per-GPU bytes, LoRA rank {args.rank} on {args.targets}, {'float32' if args.fp32 else 'bf16'}, "
        f"gradients and AdamW over {args.shard} rank(s); GB = 1e9 bytes")
    print(table)


if __name__ == "__main__":
    main()
