"""infra/checkpoint.py: one run per folder at a time, a complete checkpoint at every instant, a resume only into its own
run's folder, --overwrite only of this project's run folders, and errors that name the broken checkpoint file."""
import json
import os
import shutil
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from infra import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cfg_of(out, resume="", overwrite=False):
    return SimpleNamespace(out_dir=str(out), resume=str(resume) if resume else "", overwrite=overwrite)


def fake_checkpoint(folder, step: int, rid: str) -> str:
    """A step_N/ with what prepare_out_dir and load read of it (run.json, trainer/)."""
    path = os.path.join(folder, f"step_{step:06d}")
    os.makedirs(os.path.join(path, "trainer"))
    with open(os.path.join(path, "run.json"), "w") as f:
        json.dump({"config": {}, "step": step, "predictor": {}, "sigma_hat": {}, "method": {}, "tokens": 0,
                   "run_id": rid}, f)
    return path


def new_run(out) -> str:
    """A folder as a run leaves it after its first checkpoint: run.id, metrics.jsonl, step_000001."""
    checkpoint.prepare_out_dir(cfg_of(out))
    open(os.path.join(out, "metrics.jsonl"), "w").write('{"step": 0}\n')
    fake_checkpoint(out, 1, checkpoint.run_id(str(out)))
    return checkpoint.run_id(str(out))


def test_a_second_run_into_a_held_folder_is_refused_naming_the_holder_and_a_dead_holder_frees_it(tmp_path):
    out = str(tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", f"import sys, time; sys.path.insert(0, {ROOT!r}); "
                               f"from infra import checkpoint; checkpoint.lock_out_dir({out!r}); print('held', flush=True); "
                               "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match=rf"in use by a running run \(pid {holder.pid} on "):
            checkpoint.lock_out_dir(out)
    finally:
        holder.kill()  # as kill -9: the kernel releases the flock
        holder.wait()
    fd = checkpoint.lock_out_dir(out)  # the lock file is still there, stale, and free
    assert f"pid {os.getpid()} " in open(os.path.join(out, ".lock")).read()
    os.close(fd)


def test_two_runs_started_together_one_is_refused(tmp_path):
    out = str(tmp_path / "run")
    with checkpoint.run_folder(cfg_of(out)):
        with pytest.raises(ValueError, match="in use by a running run"):
            with checkpoint.run_folder(cfg_of(out)):
                pass
        assert checkpoint.run_id(out)  # the first one's folder is intact
    with checkpoint.run_folder(cfg_of(out, overwrite=True)):  # released at the end of the first
        pass


def test_a_resume_from_another_runs_checkpoint_is_refused(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    new_run(a)
    rid_b = new_run(b)
    with pytest.raises(ValueError, match=rf"{b} already holds the run {rid_b}, not the lineage of"):
        checkpoint.prepare_out_dir(cfg_of(b, resume=os.path.join(a, "step_000001")))
    assert os.path.exists(os.path.join(b, "step_000001")) and checkpoint.run_id(b) == rid_b
    checkpoint.prepare_out_dir(cfg_of(b, resume=os.path.join(b, "step_000001")))  # its own lineage: continues
    assert os.path.exists(os.path.join(b, "step_000001"))
    empty = str(tmp_path / "c")  # an empty folder may continue any lineage, and takes its run id
    checkpoint.prepare_out_dir(cfg_of(empty, resume=os.path.join(a, "step_000001")))
    assert checkpoint.run_id(empty) == checkpoint.run_id(a)
    checkpoint.prepare_out_dir(cfg_of(b, resume=os.path.join(a, "step_000001"), overwrite=True))
    assert not os.path.exists(os.path.join(b, "step_000001")) and checkpoint.run_id(b) == checkpoint.run_id(a)


def test_a_crash_while_re_saving_a_step_leaves_a_complete_checkpoint(tmp_path, monkeypatch):
    out = str(tmp_path / "run")
    old = fake_checkpoint(out, 3, "x")
    new = old + ".tmp"
    os.makedirs(new)
    open(os.path.join(new, "run.json"), "w").write("{}")
    real = os.replace

    def crash(src, dst):
        if src == new:
            raise KeyboardInterrupt("killed between the two renames")
        real(src, dst)
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.swap_in(new, old)
    monkeypatch.setattr(os, "replace", real)
    assert os.path.exists(os.path.join(old + ".old", "trainer"))  # the complete old checkpoint, aside
    checkpoint.recover_checkpoints(out)
    assert checkpoint.read_state(old)["step"] == 3 and not os.path.exists(old + ".old")
    checkpoint.swap_in(new, old)  # an uninterrupted re-save replaces it
    assert json.load(open(os.path.join(old, "run.json"))) == {} and sorted(os.listdir(out)) == ["step_000003"]


def test_overwrite_refuses_a_folder_this_project_did_not_write(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    with pytest.raises(ValueError, match="not a run folder of this project"):
        checkpoint.prepare_out_dir(cfg_of(model, overwrite=True))
    assert (model / "config.json").read_text() == '{"model_type": "qwen2"}'
    with pytest.raises(ValueError, match="not a run folder of this project"):
        with checkpoint.run_folder(cfg_of(model, overwrite=True)):
            pass
    assert sorted(os.listdir(model)) == ["config.json"]  # not even a lock file left behind


@pytest.mark.parametrize("damage,message", [("missing", "run.json: missing"), ("torn", "not readable JSON"),
                                            ("fields", "missing field"), ("trainer", "no trainer/ folder")])
def test_a_broken_checkpoint_names_its_file(tmp_path, damage, message):
    ckpt = fake_checkpoint(str(tmp_path), 1, "x")
    path = os.path.join(ckpt, "run.json")
    if damage == "missing":
        os.remove(path)
    elif damage == "torn":
        open(path, "w").write('{"config": {}, "st')
    elif damage == "fields":
        open(path, "w").write('{"config": {}}')
    else:
        os.rmdir(os.path.join(ckpt, "trainer"))
    with pytest.raises(ValueError, match=message) as err:
        checkpoint.load(SimpleNamespace(resume=ckpt, steps=5), None)
    assert ckpt in str(err.value)


def test_eval_out_is_checked_before_anything_loads(tmp_path):
    """A file where --out needs a folder: refused at once, before the (missing) QA file, model and index load."""
    ro = tmp_path / "file"
    ro.write_text("")
    t = time.time()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "eval.py"), "--model=/nonexistent", "--data=/nonexistent",
                           "--index=/nonexistent", f"--out={ro}/results.json"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 1 and f"--out {ro}/results.json: cannot write there" in proc.stderr, proc.stderr[-800:]
    assert "Traceback" not in proc.stderr and time.time() - t < 60


def test_pruning_deletes_only_this_runs_older_checkpoints(tmp_path, monkeypatch):
    """keep = K leaves the K newest of this run's checkpoints at steps <= the saved one (K + 1 for a run's last);
    another run's checkpoint, a folder without run.json, a temp folder, a look-alike name and a checkpoint past the
    saved step are never touched; a crash mid-delete leaves step_N.del, which the next start finishes deleting."""
    out = str(tmp_path / "run")
    rid = new_run(out)  # step_000001
    os.remove(os.path.join(out, "step_000001", "run.json"))  # not readable as a checkpoint: not ours to delete
    for step in (2, 3, 4, 5, 8):
        fake_checkpoint(out, step, rid)
    fake_checkpoint(out, 0, "another-run")
    for name in ("step_000006.tmp", "step_000002_backup"):
        os.makedirs(os.path.join(out, name))
    step = lambda n: os.path.join(out, f"step_{n:06d}")  # noqa: E731
    assert checkpoint.prune_checkpoints(out, 0, 5) == []  # keep 0: every checkpoint
    assert checkpoint.prune_checkpoints(out, 2, 5, last=True) == [step(2)]  # the last one and 2 before it
    assert checkpoint.prune_checkpoints(out, 2, 5) == [step(3)]
    real = shutil.rmtree

    def crash(path, *a, **k):
        raise KeyboardInterrupt("killed while deleting")
    monkeypatch.setattr(shutil, "rmtree", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.prune_checkpoints(out, 1, 5)
    monkeypatch.setattr(shutil, "rmtree", real)
    assert os.path.isdir(step(4) + ".del") and not os.path.exists(step(4))
    checkpoint.recover_checkpoints(out)
    assert sorted(os.listdir(out)) == ["metrics.jsonl", "run.id", "step_000000", "step_000001", "step_000002_backup",
                                       "step_000005", "step_000006.tmp", "step_000008"]


def tensor_bytes(ckpt: str) -> int:
    return sum(os.path.getsize(os.path.join(ckpt, f)) for f in ("policy/model.safetensors",
                                                                "trainer/model.safetensors", "trainer/optimizer.bin"))


def test_retention_through_a_crash_before_pruning_and_a_resume_and_the_bf16_export(tiny_world, tmp_path,
                                                                                    monkeypatch):
    """A crash between a save and its pruning loses nothing; the resume from the newest checkpoint prunes to the
    newest keep_checkpoints plus the last; the last holds policy_bf16/, which from_pretrained loads as the trained
    weights in bf16; a checkpoint weighs 16 bytes per parameter (the disk table's rule, RESULTS.md) plus headers."""
    import transformers
    import train_twice as tt
    from test_train import tiny_cfg
    out = str(tmp_path / "run")
    real = checkpoint.prune_checkpoints

    def crash_at_2(out_dir, keep, step, last=False):
        if step == 2:
            raise KeyboardInterrupt("killed between the save and the prune")
        return real(out_dir, keep, step, last)
    monkeypatch.setattr(checkpoint, "prune_checkpoints", crash_at_2)
    args = ["--steps=4", "--eval_every=0", "--save_every=1", "--keep_checkpoints=2"]
    with pytest.raises(KeyboardInterrupt):
        tt.main(tiny_cfg(tiny_world, out, *args))
    steps = lambda: sorted(f for f in os.listdir(out) if f.startswith("step_"))  # noqa: E731
    assert steps() == ["step_000001", "step_000002"]  # nothing lost, step 2 complete
    assert checkpoint.read_state(os.path.join(out, "step_000002"))["step"] == 2
    monkeypatch.setattr(checkpoint, "prune_checkpoints", real)
    tt.main(tiny_cfg(tiny_world, out, *args, f"--resume={out}/step_000002"))
    assert steps() == ["step_000002", "step_000003", "step_000004"]  # 2 kept, plus the last
    last = os.path.join(out, "step_000004")
    assert [s for s in steps() if os.path.exists(os.path.join(out, s, "policy_bf16"))] == ["step_000004"]

    fp32 = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(last, "policy"))
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(last, "policy_bf16"))
    assert bf16.dtype == torch.bfloat16 and os.path.exists(os.path.join(last, "policy_bf16", "model.safetensors"))
    want = {k: v.to(torch.bfloat16) for k, v in fp32.state_dict().items()}
    assert all(torch.equal(v, want[k]) for k, v in bf16.state_dict().items()) and len(want) == len(bf16.state_dict())
    # fp32 policy 4N + trainer: fp32 weights 4N + AdamW exp_avg, exp_avg_sq 8N; headers under 1.5 KB a tensor
    n, n_tensors = sum(p.numel() for p in fp32.parameters()), len(list(fp32.parameters()))
    assert 16 * n <= tensor_bytes(last) <= 16 * n + 1536 * n_tensors
    assert 2 * n <= os.path.getsize(os.path.join(last, "policy_bf16", "model.safetensors")) <= 2 * n + 512 * n_tensors


def test_log_wandb_without_wandb_fails_at_start_naming_the_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    cfg = SimpleNamespace(log_tensorboard=False, log_wandb=True, out_dir=str(tmp_path),
                          wandb_project="twice")
    with pytest.raises(ValueError, match=r"wandb is not installed: pip install wandb"):
        checkpoint.open_trackers(cfg)
