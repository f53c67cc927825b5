"""infra/lora.py and train_twice.py with lora_rank > 0: the fields are checked, an update changes only the adapters, the
reference is the frozen base, --resume continues exactly, the merged export loads without peft and computes the
adapted policy, replay re-samples a LoRA run's steps, 2 CPU ranks with gradient checkpointing stay in sync, and the
memory figures count what a built model holds."""
import json
import os
import re
import subprocess

import pytest
import torch
from safetensors import safe_open

import eval as qa_eval
from generation import logprobs
from infra import lora
from lab import replay
import train_twice as tt
from test_train import ROOT, assert_ranks_in_sync, cpu_launch, read_metrics, tiny_cfg

# every reward of the test-scale world is 0: the entropy bonus gives the adapters a gradient (B moves off 0)
LORA = ["--lora_rank=4", "--lora_alpha=8", "--entropy_coef=0.1", "--lr=1e-2"]


def body(rows):
    """Metrics rows without the final row and the wall times."""
    return [{k: v for k, v in r.items() if not k.startswith("time")} for r in rows if not r.get("final")]


@pytest.fixture(scope="module")
def lora_run(tiny_world, tmp_path_factory):
    """A 3-step LoRA run with a checkpoint after every step, kept (step_000001..3)."""
    out = str(tmp_path_factory.mktemp("lora") / "run")
    tt.main(tiny_cfg(tiny_world, out, *LORA, "--steps=3", "--eval_every=0", "--save_every=1", "--keep_checkpoints=0"))
    return out


@pytest.mark.parametrize("override,message", [
    ("--lora_rank=-1", "lora_rank=-1 (must be >= 0"), ("--lora_alpha=0", "lora_alpha=0.0 (must be > 0)"),
    ("--lora_dropout=0.05", "lora_dropout=0.05 (must be 0: with dropout the update's policy differs"),
    ("--lora_targets=q_proj,,v_proj", "lora_targets='q_proj,,v_proj' (must be comma-separated module names"),
    ("--lora_targets=q-proj", "lora_targets='q-proj'")])
def test_lora_fields_are_range_checked(override, message):
    with pytest.raises(ValueError, match="invalid config value.*" + re.escape(message)):
        tt.parse_config([override])


def test_lora_with_a_learned_estimator_and_unknown_targets_are_refused(tiny_world):
    assert tt.Config().lora_targets == lora.TARGETS and tt.Config().lora_rank == 0  # default: full fine-tuning
    with pytest.raises(ValueError, match="lora_rank=4 .must be 0 with method ppo: its estimator"):
        tt.parse_config(["--lora_rank=4", "--method=ppo"])
    cfg = tiny_cfg(tiny_world, "unused", "--lora_rank=4", "--lora_targets=q_proj,qkv_proj")
    model, _ = qa_eval.load_policy(cfg.model)
    with pytest.raises(ValueError, match=r"lora_targets: qkv_proj name\(s\) no linear module of .*: down_proj"):
        lora.attach(model, cfg)


def test_an_update_changes_only_the_adapters_and_the_reference_is_the_frozen_base(tiny_world, tmp_path,
                                                                                   monkeypatch):
    """Two steps: every adapter tensor moves and no base tensor does; the reference log-probs of step 1 (the KL
    term's, taken inside train_step) equal a separately loaded frozen base model's, bit for bit, while the policy's
    differ; the AdamW state is the adapters' only (lora.memory_bytes' 8 bytes an adapter parameter)."""
    cfg = tiny_cfg(tiny_world, str(tmp_path / "unused"), *LORA)
    run = tt.setup(cfg)
    policy = run.accel.unwrap_model(run.policy)
    assert run.ref is None and run.adapter is not None  # no second copy of the model
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    seen, real = [], tt.ppo_update

    def spy(cfg, run, batch, adv, old_lp, ref_lp, step):
        seen.append((batch, old_lp, ref_lp))
        return real(cfg, run, batch, adv, old_lp, ref_lp, step)
    monkeypatch.setattr(tt, "ppo_update", spy)
    metrics = [tt.train_step(cfg, run, step) for step in (0, 1)]
    after = policy.state_dict()
    adapters = {k for k in before if ".lora_" in k}
    assert adapters and {k for k in before if not torch.equal(before[k], after[k])} == adapters  # B moved off 0

    base, _ = qa_eval.load_policy(cfg.model, "cpu", torch.float32)
    batch, old_lp, ref_lp = seen[1]
    frozen, _ = logprobs.batch_logprobs(base, batch, cfg.temperature, cfg.micro_batch_size)
    mask = batch["loss_mask"][:, 1:].bool()
    assert mask.any() and torch.equal(ref_lp, frozen)
    assert (old_lp - ref_lp)[mask].abs().max() > 1e-3 and metrics[1]["kl"] > 0  # the policy has moved off it

    state = [t for s in run.opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    c = {k: getattr(policy.config, k) for k in lora.QWEN2_5["Qwen2.5-3B"]}
    n_adapter = lora.n_adapter_params(c, cfg.lora_rank)
    assert sum(t.numel() * t.element_size() for t in state) == lora.memory_bytes(c, 4)["lora"]["optimizer"] \
        == 8 * n_adapter == 8 * sum(p.numel() for p in policy.parameters() if p.requires_grad)


@pytest.fixture
def fresh_accelerate_state():
    """accelerate's state is one per process, and earlier tests made it without bf16: cleared before the test (its
    Accelerator starts anew with bf16) and after it (the next starts anew without)."""
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def test_a_bf16_lora_run_holds_a_bf16_base_and_its_reference_is_full_fine_tunings(tiny_world, tmp_path, monkeypatch,
                                                                                   fresh_accelerate_state):
    """bf16 on (CPU autocast): the frozen base is bf16, the adapters float32, the weights' bytes are memory_bytes';
    the reference log-probs of step 1 equal those of the bf16 reference model full fine-tuning loads. A bf16 run on a
    CPU is asked for by name (ACCELERATE_USE_CPU), as infra/cuda.py wants: bf16 alone reads as a GPU run."""
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    cfg = tiny_cfg(tiny_world, str(tmp_path / "unused"), *LORA, "--bf16")
    run = tt.setup(cfg)
    policy = run.accel.unwrap_model(run.policy)
    assert {p.dtype for p in policy.parameters() if p.requires_grad} == {torch.float32}
    assert {p.dtype for p in policy.parameters() if not p.requires_grad} == {torch.bfloat16}
    c = {k: getattr(policy.config, k) for k in lora.QWEN2_5["Qwen2.5-3B"]}
    assert sum(p.numel() * p.element_size() for p in policy.parameters()) == \
        lora.memory_bytes(c, 4, bf16=True)["lora"]["weights"]
    seen, real = [], tt.ppo_update
    monkeypatch.setattr(tt, "ppo_update", lambda cfg, run, batch, adv, old_lp, ref_lp, step: (
        seen.append((batch, old_lp, ref_lp)), real(cfg, run, batch, adv, old_lp, ref_lp, step))[1])
    metrics = [tt.train_step(cfg, run, step) for step in (0, 1)]
    batch, old_lp, ref_lp = seen[1]
    full_ref, _ = qa_eval.load_policy(cfg.model, "cpu", torch.bfloat16)  # as setup() loads it without LoRA
    with torch.no_grad(), run.accel.autocast():
        want, _ = logprobs.batch_logprobs(full_ref, batch, cfg.temperature, cfg.micro_batch_size)
    assert torch.equal(ref_lp, want) and not torch.equal(old_lp, ref_lp) and metrics[1]["kl"] > 0


def test_gradient_checkpointing_gives_the_same_lora_update(tiny_world, tmp_path):
    """The checkpointed blocks recompute their forward in the backward pass; the adapters' gradients still flow
    through the frozen layers: two steps with and without it give the same metrics and adapters."""
    got = []
    for gc in ("false", "true"):
        cfg = tiny_cfg(tiny_world, str(tmp_path / "unused"), *LORA, f"--gradient_checkpointing={gc}")
        run = tt.setup(cfg)
        rows = body([tt.train_step(cfg, run, step) for step in (0, 1)])
        policy = run.accel.unwrap_model(run.policy)
        got.append((rows, {k: v.clone() for k, v in policy.state_dict().items() if ".lora_" in k}))
    assert policy.is_gradient_checkpointing and got[0][0] == got[1][0] and got[0][0][1]["kl"] > 0
    assert got[0][1].keys() == got[1][1].keys() and all(torch.equal(v, got[1][1][k]) for k, v in got[0][1].items())


def test_resume_of_a_lora_run_reproduces_the_uninterrupted_run(lora_run, tiny_world, tmp_path):
    """1 step, resume from its checkpoint, 2 more == 3 steps in one go (metrics rows, times aside). A checkpoint holds
    the adapter: policy/ a PEFT folder, trainer/ the adapter tensors and their AdamW state only."""
    b = str(tmp_path / "b")
    args = [*LORA, "--eval_every=0"]
    tt.main(tiny_cfg(tiny_world, b, *args, "--steps=1"))
    tt.main(tiny_cfg(tiny_world, b, *args, "--steps=3", f"--resume={b}/step_000001"))
    assert body(read_metrics(b)) == body(read_metrics(lora_run)) and len(body(read_metrics(b))) == 3

    ckpt = os.path.join(lora_run, "step_000002")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(os.path.join(ckpt, "policy")))
    assert "model.safetensors" not in os.listdir(os.path.join(ckpt, "policy"))
    with safe_open(os.path.join(ckpt, "trainer", "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    n_layers = 2  # the tiny policy's; A and B of each of the 7 targets in each layer
    assert len(keys) == 2 * 7 * n_layers and all(".lora_A." in k or ".lora_B." in k for k in keys)
    opt = torch.load(os.path.join(ckpt, "trainer", "optimizer.bin"), weights_only=False)
    assert len(opt["state"]) == len(keys)
    fake = tmp_path / "fake" / "trainer"  # a trainer/ holding other tensors (a full fine-tuning's) is refused
    fake.mkdir(parents=True)
    from safetensors.torch import save_file
    save_file({"model.embed_tokens.weight": torch.zeros(2)}, str(fake / "model.safetensors"))
    run = tt.setup(tiny_cfg(tiny_world, str(tmp_path / "unused"), *LORA))
    with pytest.raises(ValueError, match=r"model.safetensors: holds 1 tensors, not the 28 adapter tensors"):
        lora.check_trainer(str(fake), run.policy)


def test_the_merged_export_loads_without_peft_and_computes_the_adapted_policy(lora_run, tiny_world, tmp_path):
    """policy_merged/ (last checkpoint) is a plain HF folder: from_pretrained loads it with no LoRA layer, and its
    log-probs equal the adapted model's (base + step_3's adapter, as replay loads it) to float32 rounding;
    policy_bf16/ is that cast to bf16; eval.py evaluates it."""
    from transformers import AutoModelForCausalLM
    last = os.path.join(lora_run, "step_000003")
    assert not os.path.exists(os.path.join(lora_run, "step_000002", "policy_merged"))  # the last checkpoint only
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(last, "policy_merged")).eval()
    assert not any("lora" in n for n, _ in merged.named_modules()) and merged.dtype == torch.float32
    assert not os.path.exists(os.path.join(last, "policy_merged", "adapter_config.json"))
    cfg = tt.Config(**json.load(open(os.path.join(last, "run.json")))["config"])
    adapted, tok = replay.load_lora(cfg, os.path.join(last, "policy"), "cpu")
    base, _ = qa_eval.load_policy(cfg.model, "cpu", torch.float32)
    ids, att = logprobs.pad_rows([[5, 9, 17, 33, 2, 48, 101, 7], [4, 250, 3, 3, 60]], tok.pad_token_id, "cpu")
    with torch.no_grad():
        lp = {name: logprobs.token_logprobs(m, ids, att, 1.0)[0] for name, m in
              (("merged", merged), ("adapted", adapted), ("base", base))}
    assert torch.allclose(lp["merged"], lp["adapted"], atol=1e-5, rtol=0)
    in_memory = lora.merged_model(adapted)  # what checkpoint.save wrote: runnable too (rotary buffers restored)
    with torch.no_grad():
        assert torch.equal(logprobs.token_logprobs(in_memory, ids, att, 1.0)[0], lp["merged"])
    # eval.py on the adapter folder itself: transformers loads the base its adapter_config.json names, then the adapter
    plain, _ = qa_eval.load_policy(os.path.join(last, "policy"))
    with torch.no_grad():
        assert torch.equal(logprobs.token_logprobs(plain, ids, att, 1.0)[0], lp["adapted"])
    assert (lp["adapted"] - lp["base"]).abs().max() > 1e-2  # the adapter is not a no-op: the check could fail
    bf16 = AutoModelForCausalLM.from_pretrained(os.path.join(last, "policy_bf16"))
    want = {k: v.to(torch.bfloat16) for k, v in merged.state_dict().items()}
    assert bf16.dtype == torch.bfloat16 and all(torch.equal(v, want[k]) for k, v in bf16.state_dict().items())
    out = str(tmp_path / "eval.json")
    per_source = qa_eval.main(qa_eval.Config(model=os.path.join(last, "policy_merged"), out=out, limit=3,
                                             data=os.path.join(tiny_world, "test.jsonl"),
                                             index=os.path.join(tiny_world, "index"), max_new_tokens=24,
                                             max_context=768, max_turns=2))
    assert sum(n for n, _ in per_source.values()) == 3 and len(json.load(open(out))["records"]) == 3


def test_replay_re_samples_a_lora_runs_steps_token_for_token(lora_run, capsys):
    """Step 0 from the base with a fresh adapter (B = 0), steps 1 and 2 from step_N's adapter on the base."""
    rows = [json.loads(line) for line in open(os.path.join(lora_run, "episodes.jsonl"))]
    for step in (0, 1, 2):
        r = next(r for r in rows if r["step"] == step)
        assert replay.replay(replay.Replay(run=lora_run, step=step, uid=str(r["uid"]), line=r["line"],
                                           twins=True)) == 0
        assert "tokens identical to episodes.jsonl" in capsys.readouterr().out


def test_two_cpu_ranks_with_lora_and_gradient_checkpointing_stay_in_sync(tiny_world, tmp_path):
    """accelerate launch --multi_gpu --num_processes 2 on CPU (gloo) with LoRA and gradient checkpointing: both ranks
    hold the same weights (base and adapters) after every step, and the adapters did move (KL > 0 at step 1)."""
    out = str(tmp_path / "ddp")
    cmd, env = cpu_launch(os.path.join(ROOT, "train_twice.py"), out, tiny_world, "--multi_gpu", "--num_processes",
                          "2", "--num_machines", "1",
                          flags=("--steps=2", "--eval_every=0", *LORA, "--gradient_checkpointing"))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_ranks_in_sync(out)
    assert body(read_metrics(out))[1]["kl"] > 0
    assert os.path.exists(os.path.join(out, "step_000002", "policy_merged", "model.safetensors"))


def test_memory_counts_equal_built_models(tiny_world):
    """n_params and n_adapter_params against models built from the configs: the tiny policy, and Qwen2.5-3B / -7B on
    the meta device (no weights allocated, no download); the per-GPU bytes by the rules of memory_bytes."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = tt.Config(model=os.path.join(tiny_world, "policy"), lora_rank=4)
    tiny, _ = qa_eval.load_policy(cfg.model)
    shapes = [(lora.QWEN2_5[name], name) for name in lora.QWEN2_5]
    shapes.append(({k: getattr(tiny.config, k) for k in lora.QWEN2_5["Qwen2.5-3B"]}, "tiny"))
    for c, name in shapes:
        if name == "tiny":
            model = tiny
        else:
            with torch.device("meta"):
                model = Qwen2ForCausalLM(Qwen2Config(**c))
        assert sum(p.numel() for p in model.parameters()) == lora.n_params(c), name
        lora.attach(model, cfg)
        assert sum(p.numel() for p in model.parameters() if p.requires_grad) == lora.n_adapter_params(c, 4), name
    n, a = lora.n_params(lora.QWEN2_5["Qwen2.5-3B"]), lora.n_adapter_params(lora.QWEN2_5["Qwen2.5-3B"], 16)
    assert (n, a) == (3_085_938_688, 36 * 16 * (2 * 4096 + 2 * 2304 + 3 * 13_056))  # q, o; k, v; gate, up, down
    m = lora.memory_bytes("Qwen2.5-3B", 16)
    assert m["full"] == {"weights": 4 * n, "gradients": 4 * n, "optimizer": 8 * n, "reference": 2 * n,
                         "total": 18 * n}
    assert m["lora"] == {"weights": 2 * n + 4 * a, "gradients": 4 * a, "optimizer": 8 * a, "reference": 0,
                         "total": 2 * n + 16 * a}
    assert lora.memory_bytes("Qwen2.5-7B", 16, shard=8)["full"]["optimizer"] == 8 * lora.n_params(
        lora.QWEN2_5["Qwen2.5-7B"]) // 8
    with pytest.raises(ValueError, match="targets: qkv are not linear modules"):
        lora.n_adapter_params(lora.QWEN2_5["Qwen2.5-3B"], 16, "q_proj,qkv")
