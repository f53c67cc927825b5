"""A training run's files: checkpoints, the metrics log, experiment trackers, and the out_dir guard.

Everything here makes a run resumable and never lost, and none of it is the method (train_twice.py):
checkpoints are written atomically (temp dir, then rename) with the config, step, predictor and
sigma_hat state and provenance; a resume refuses a changed config or a checkpoint past --steps;
metrics.jsonl survives a torn last line; a new run never mixes its files with another run's; every
scalar also goes to TensorBoard and, when asked, W&B. What the console says at a run's start and
end, and on Ctrl-C, is infra/console.py's.

A run folder (DESIGN.md section 12) is held by one run at a time: rank 0 holds an exclusive flock on
out_dir/.lock for the life of the run (the kernel releases it when the process dies, so a lock left
by kill -9 is free again), and out_dir/run.id names the run whose lineage the folder holds: every
checkpoint's run.json carries it, and a resume into a folder of another run is refused. A start
that ends before its first metrics row (a bad path, Ctrl-C while loading) leaves neither file
behind, so the corrected command is not refused (run_folder).

Steps count updates, one convention everywhere. "Step N" is the step that starts from the weights
after N updates: metrics.jsonl's row {"step": N} holds the greedy eval_em of those weights (measured
before the step's update), the reward of the episodes sampled from them, and the loss of the update
that makes the weights after N + 1. The console prints that row as `step N/steps` (so eval_every=5
shows at steps 0, 5, 10, ...); the final row and line carry the number of updates done. The
checkpoint step_N holds the weights after N updates: the ones row N evaluated and sampled from, and
`python rollout.py replay --step N` replays with (step 0: the initial model, cfg.model).
"""
import contextlib
import copy
import dataclasses
import fcntl
import json
import logging
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid

import numpy as np
import torch

from infra import lora
from infra import numerics


def _provenance() -> dict:
    import transformers
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        commit = ""
    return {
        "git_commit": commit, "torch": torch.__version__, "transformers": transformers.__version__,
        "python": sys.version.split()[0], "numerics": numerics.describe()
    }


def save(cfg, run, step: int, last: bool = False) -> str:
    """out_dir/step_NNNNNN: policy/ (HF folder, deployable), trainer/ (accelerate state: weights,
    optimizer, RNG), run.json (config, step, predictor and sigma_hat, provenance); the run's last
    one also policy_bf16/ (export_bf16). With LoRA, policy/ is the adapter (PEFT folder), trainer/
    the adapters' weights and AdamW state only, and the last one also holds policy_merged/ (the
    merged policy, float32, plain HF folder; policy_bf16/ is that in bf16). Written to a temp dir,
    then renamed: atomic. Only then are old checkpoints pruned (prune_checkpoints)."""
    accel = run.accel
    final = os.path.join(cfg.out_dir, f"step_{step:06d}")
    tmp = final + ".tmp"
    if accel.is_main_process and os.path.exists(tmp):
        shutil.rmtree(tmp)
    accel.wait_for_everyone()
    try:
        with _quiet_tied_weights():
            accel.save_state(os.path.join(tmp, "trainer"))
            if accel.is_main_process:
                _write_checkpoint(cfg, run, step, last, tmp)
        # every rank's own files (its RNG state) are in before rank 0 renames the folder: a slower
        # rank on another machine wrote into a renamed step_N.tmp once ("Parent directory ... does
        # not exist", the two-machine test)
        accel.wait_for_everyone()
    except BaseException:  # Ctrl-C or an error mid-write: no half-written folder is left behind
        if accel.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if accel.is_main_process:
        swap_in(tmp, final)
        # after the swap: the new one is complete
        prune_checkpoints(cfg.out_dir, cfg.keep_checkpoints, step, last)
    accel.wait_for_everyone()
    return final


class _TiedWeightsNote(logging.Filter):
    """accelerate warns "Removed shared tensor {'lm_head.weight'} while saving ... check by
    verifying" at every save of a policy that ties its LM head to its embeddings (the tiny world's,
    Qwen2.5-3B's). The live model keeps the tie, so loading the embeddings restores both, and the
    exact-resume tests (tests/test_train.py) get the same numbers back. Not a fault: dropped."""

    def filter(self, record) -> bool:
        return "Removed shared tensor" not in record.getMessage()


@contextlib.contextmanager
def _quiet_tied_weights():
    """_TiedWeightsNote on accelerate's saving logger, for one save only."""
    logger, note = logging.getLogger("accelerate.utils.other"), _TiedWeightsNote()
    logger.addFilter(note)
    try:
        yield
    finally:
        logger.removeFilter(note)


def _write_checkpoint(cfg, run, step: int, last: bool, tmp: str):
    """Rank 0's part of save: everything but trainer/ into the temp folder tmp."""
    policy = run.accel.unwrap_model(run.policy)
    (policy if run.adapter is None else run.adapter).save_pretrained(os.path.join(tmp, "policy"))
    run.tok.save_pretrained(os.path.join(tmp, "policy"))
    state = {
        "config": dataclasses.asdict(cfg), "step": step, "predictor": run.predictor.state_dict(),
        "token_predictor": run.token_predictor.state_dict(), "method": run.method.state_dict(),
        "tokens": run.tokens, "sigma_hat": run.sigma_hat.state_dict(),
        "run_id": run_id(cfg.out_dir), **_provenance()
    }
    with open(os.path.join(tmp, "run.json"), "w") as f:
        json.dump(state, f)
    # learned estimators: weights and optimizer state (methods/learned.py)
    if hasattr(run.method, "save"):
        run.method.save(tmp)
    if last:
        # W + (alpha / r) B A as a plain model, loadable without peft
        if run.adapter is not None:
            policy = lora.merged_model(policy)
            policy.save_pretrained(os.path.join(tmp, "policy_merged"))
            run.tok.save_pretrained(os.path.join(tmp, "policy_merged"))
        export_bf16(policy, run.tok, os.path.join(tmp, "policy_bf16"))


def swap_in(tmp: str, final: str):
    """Rename the complete folder tmp to final. An existing final is renamed aside first and deleted
    last, so a complete checkpoint exists at every instant (recover_checkpoints puts an aside one
    back after a crash)."""
    if os.path.exists(final):
        os.replace(final, final + ".old")
    os.replace(tmp, final)
    if os.path.exists(final + ".old"):
        shutil.rmtree(final + ".old")


def recover_checkpoints(out_dir: str):
    """After a crash inside swap_in: step_N.old whose step_N is missing is the complete checkpoint,
    put back. After a crash inside prune_checkpoints: step_N.del (renamed there, a pruned
    checkpoint) finishes being deleted."""
    for name in sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []:
        if name.endswith(".del") and CHECKPOINT.fullmatch(name[:-4]):
            shutil.rmtree(os.path.join(out_dir, name))
        if name.startswith("step_") and name.endswith(".old"):
            old, final = os.path.join(out_dir, name), os.path.join(out_dir, name[:-4])
            if os.path.exists(final):
                shutil.rmtree(old)
            else:
                os.replace(old, final)
                print(f"{final}: restored from {name} (a save was interrupted)", flush=True)


# a checkpoint folder's name (save); step_N.tmp/.old/.del are not
CHECKPOINT = re.compile(r"step_(\d{6})")


def checkpoint_steps(out_dir: str) -> list:
    """Sorted (step, path) of out_dir's checkpoint folders (names matching CHECKPOINT)."""
    found = ((CHECKPOINT.fullmatch(name), os.path.join(out_dir, name))
             for name in os.listdir(out_dir))
    return sorted((int(m.group(1)), path) for m, path in found if m and os.path.isdir(path))


def prune_checkpoints(out_dir: str, keep: int, step: int, last: bool = False) -> list:
    """Delete this run's checkpoints older than its `keep` newest at steps <= step (the last one of
    a run is kept on top: keep + 1 remain). Called only once step's checkpoint is complete and
    swapped in, so the newest checkpoint, the one a resume needs, is never deleted; a checkpoint
    past step (written before a resume from an earlier one) is left for its re-save to replace.
    Deletes only folders named step_NNNNNN whose run.json carries this folder's run id; each is
    renamed to step_N.del first (one atomic rename), so a crash mid-delete leaves no partial folder
    under a checkpoint's name (recover_checkpoints finishes it). keep = 0 keeps every checkpoint.
    Returns the deleted."""
    rid = run_id(out_dir)
    if keep <= 0 or not rid:
        return []
    ours = []
    for n, path in checkpoint_steps(out_dir):
        try:
            if n <= step and read_state(path).get("run_id") == rid:
                ours.append(path)
        except ValueError:  # no readable run.json: not a checkpoint of this run, not ours to delete
            continue
    doomed = ours[:-(keep + 1 if last else keep)]
    for path in doomed:
        os.replace(path, path + ".del")
        shutil.rmtree(path + ".del")
    return doomed


def export_bf16(model, tok, path: str):
    """The policy in bf16 as an HF folder (safetensors, tokenizer): 2 bytes per parameter, an eighth
    of a checkpoint (DESIGN.md section 12), for evaluation and serving. The weights are cast on the
    CPU: no second GPU copy."""
    cast, state = {}, {}  # tied tensors (embedding and LM head) stay one tensor, stored once
    for k, v in model.state_dict().items():
        if v.data_ptr() not in cast:
            cast[v.data_ptr()] = v.detach().to("cpu", torch.bfloat16)
        state[k] = cast[v.data_ptr()]
    model.save_pretrained(path, state_dict=state, safe_serialization=True)
    config = copy.deepcopy(model.config)  # save_pretrained wrote the live model's dtype (float32)
    config.dtype = torch.bfloat16
    config.save_pretrained(path)
    tok.save_pretrained(path)


RESUME_FREE = {
    "resume",
    "kv_budget_gib",  # memory only: a run that ran out resumes under a smaller one
    "steps",
    "token_budget",
    "eval_every",
    "eval_tokens",
    "eval_size",
    "save_every",
    "out_dir",
    "overwrite",
    "keep_checkpoints",
    "log_episodes",
    "log_tensorboard",
    "log_wandb",
    "wandb_project",
    # ref_offload: where the reference waits, no number changes
    "collective_timeout_h",
    "rank_timeout_s",
    "ref_offload"
}


def load(cfg, run) -> int:
    """Restore weights, optimizer, RNG, predictor and sigma_hat from cfg.resume; returns the step to
    continue from. Refuses a checkpoint written with a config that differs in anything that changes
    results, or past cfg.steps."""
    state = read_state(cfg.resume)
    if not os.path.isdir(os.path.join(cfg.resume, "trainer")):
        raise ValueError(
            f"{cfg.resume}: no trainer/ folder (weights, optimizer, RNG): not a complete checkpoint"
        )
    diff = {k: (v, getattr(cfg, k)) for k, v in state["config"].items()
            if k not in RESUME_FREE and hasattr(cfg, k) and getattr(cfg, k) != v}
    if diff:
        raise ValueError(f"{cfg.resume}: config differs from the checkpoint's (saved, now): {diff}")
    if cfg.steps < state["step"]:
        raise ValueError(
            f"{cfg.resume}: the checkpoint is at step {state['step']}, past --steps={cfg.steps}; "
            f"set --steps >= {state['step']}")
    # trainer/ holds the adapters only: loaded non-strictly, so checked first
    if run.adapter is not None:
        lora.check_trainer(os.path.join(cfg.resume, "trainer"), run.policy)
    run.accel.load_state(os.path.join(cfg.resume, "trainer"), strict=run.adapter is None)
    run.predictor.load_state_dict(state["predictor"])
    # checkpoints from before token forks have none (nothing learnt yet)
    if "token_predictor" in state:
        run.token_predictor.load_state_dict(state["token_predictor"])
    run.sigma_hat.load_state_dict(state["sigma_hat"])
    run.method.load_state_dict(state["method"])
    run.tokens = int(state["tokens"])
    if hasattr(run.method, "load"):
        run.method.load(cfg.resume, run)
    return int(state["step"])


def read_state(ckpt: str) -> dict:
    """A checkpoint's run.json; a missing or unreadable one is an error naming the file."""
    path = os.path.join(ckpt, "run.json")
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path}: missing: {ckpt} is not a checkpoint of this project (step_N/ "
                         "with run.json)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(
            f"{path}: not readable JSON ({e}): a truncated or corrupt checkpoint") from None
    missing = [
        k for k in ("config", "step", "predictor", "sigma_hat", "method", "tokens")
        if k not in state
    ]
    if missing:
        raise ValueError(
            f"{path}: missing field(s) {', '.join(missing)}: a truncated or corrupt checkpoint")
    return state


RUN_FILES = ("metrics.jsonl", "metrics.jsonl.orphaned", "episodes.jsonl", "episodes.jsonl.orphaned",
             "config.json", "learning_curve.png", "tb", "wandb", "run.id")
LOCK_FILE, RUN_ID_FILE = ".lock", "run.id"


def lock_out_dir(out_dir: str) -> int:
    """An exclusive flock on out_dir/.lock (its file descriptor), or a ValueError naming the run
    that holds it."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = open(path, encoding="utf-8", errors="replace").read().strip() or "another process"
        os.close(fd)
        raise ValueError(
            f"{out_dir} is in use by a running run ({holder}): wait for it to end, or choose "
            "another --out_dir") from None
    os.ftruncate(fd, 0)
    os.write(
        fd,
        f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}".
        encode())
    return fd


def run_id(out_dir: str) -> str:
    path = os.path.join(out_dir, RUN_ID_FILE)
    return open(path, encoding="utf-8").read().strip() if os.path.exists(path) else ""


def is_run_folder(out_dir: str) -> bool:
    """Written by this project: its run.id, a metrics.jsonl, or a checkpoint with run.json."""
    return any(os.path.exists(os.path.join(out_dir, f))
               for f in (RUN_ID_FILE, "metrics.jsonl")) or any(
                   os.path.exists(os.path.join(out_dir, f, "run.json"))
                   for f in os.listdir(out_dir) if f.startswith("step_"))


def prepare_out_dir(cfg):
    """A new run never mixes with another run's files: refuse a folder that holds one, unless
    --overwrite (which removes that run's files) or --resume from a checkpoint of that folder's run
    (which continues it). --overwrite never touches a folder this project did not write (a model
    folder's config.json, say)."""
    recover_checkpoints(cfg.out_dir)
    found = sorted(f for f in os.listdir(cfg.out_dir) if f.startswith("step_") or f in RUN_FILES) \
        if os.path.isdir(cfg.out_dir) else []
    state = read_state(cfg.resume) if cfg.resume else None
    own = state is not None and found and _same_run(cfg, state)
    if found and not own:
        if not cfg.overwrite:
            what = (
                f"the run {run_id(cfg.out_dir) or '(no run.id)'}, not the lineage of {cfg.resume}"
                if state else f"a run ({', '.join(found[:4])}...)")
            raise ValueError(
                f"{cfg.out_dir} already holds {what}: choose another --out_dir, continue it with "
                "--resume=DIR/step_N, or pass --overwrite to replace it")
        if not is_run_folder(cfg.out_dir):
            raise ValueError(
                f"{cfg.out_dir} holds {', '.join(found[:4])} but is not a run folder of this "
                "project (no run.id, metrics.jsonl or step_*/run.json): --overwrite refuses to "
                "delete them")
        for f in found:
            path = os.path.join(cfg.out_dir, f)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    os.makedirs(cfg.out_dir, exist_ok=True)
    # a new run, or a lineage continued in a new folder: its id names the folder
    if not run_id(cfg.out_dir):
        with open(os.path.join(cfg.out_dir, RUN_ID_FILE), "w", encoding="utf-8") as f:
            f.write((state or {}).get("run_id") or uuid.uuid4().hex[:16])


def _same_run(cfg, state: dict) -> bool:
    """The checkpoint continues the run out_dir holds: same run id, or (checkpoints from before run
    ids) it lies inside out_dir."""
    if run_id(cfg.out_dir) and state.get("run_id"):
        return run_id(cfg.out_dir) == state["run_id"]
    return os.path.realpath(cfg.resume).startswith(os.path.realpath(cfg.out_dir) + os.sep)


@contextlib.contextmanager
def run_folder(cfg, main_process: bool = True):
    """Hold out_dir for the life of the run (rank 0) and prepare it; released on exit, error or not.
    A start that leaves no run behind (it ended before its first metrics row: a bad path, Ctrl-C
    while loading) takes back what it wrote (run.id, config.json, tb/, the lock), so the corrected
    command starts as the first would have, not refused as a folder that holds a run."""
    fd = lock_out_dir(cfg.out_dir) if main_process else None
    fresh, prepared = not run_id(cfg.out_dir), False  # fresh: this start writes the run.id
    try:
        if main_process:
            prepare_out_dir(cfg)  # before any model loads: a refused folder costs nothing
            prepared = True
        yield
    finally:
        if fd is not None:
            # prepared and fresh: every run file in the folder is this start's (prepare_out_dir)
            if prepared and fresh and not holds_a_run(cfg.out_dir):
                for name in RUN_FILES:
                    path = os.path.join(cfg.out_dir, name)
                    if os.path.isdir(path):
                        shutil.rmtree(path)
                    elif os.path.exists(path):
                        os.remove(path)
            # refused, or taken back: leave no lock behind either
            if not run_id(cfg.out_dir):
                os.remove(os.path.join(cfg.out_dir, LOCK_FILE))
            os.close(fd)  # the flock goes with it


def holds_a_run(out_dir: str) -> bool:
    """A run has begun in out_dir: it logged a metrics row or saved a checkpoint."""
    return os.path.isdir(out_dir) and (os.path.exists(os.path.join(out_dir, "metrics.jsonl"))
                                       or bool(checkpoint_steps(out_dir)))


def last_checkpoint(out_dir: str) -> str:
    """The newest complete checkpoint of the run out_dir holds (its run.id), or ''."""
    rid = run_id(out_dir)
    for _, path in reversed(checkpoint_steps(out_dir) if os.path.isdir(out_dir) else []):
        try:
            if read_state(path).get("run_id") == rid:
                return path
        except ValueError:  # no readable run.json: not a checkpoint to resume from
            continue
    return ""


def read_metrics(path: str) -> list:
    """(line, row) of metrics.jsonl; a torn last line (a crash mid-write) is dropped with a warning,
    any other bad line names the file and line."""
    lines = open(path, encoding="utf-8").read().splitlines()
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append((line + "\n", json.loads(line)))
        except json.JSONDecodeError as e:
            if n < len(lines):
                raise ValueError(f"{path}:{n}: malformed JSON ({e.msg})") from None
            print(
                f"warning: {path}:{n}: dropped a torn last line (interrupted write): {line[:60]!r}",
                flush=True)
    return rows


def truncate_metrics(path: str, start: int):
    """On resume, rows of steps >= start (logged after the checkpoint) move to
    metrics.jsonl.orphaned: the file then holds exactly one row per step, and nothing is lost."""
    if not os.path.exists(path):
        return
    rows = read_metrics(path)
    keep = [line for line, row in rows if row["step"] < start]
    with open(path + ".orphaned", "a") as f:
        f.writelines(line for line, row in rows if row["step"] >= start)
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)


def open_trackers(cfg) -> list:
    """TensorBoard (out_dir/tb) and, when asked, W&B: each gets every scalar of metrics.jsonl."""
    trackers = []
    if cfg.log_tensorboard:
        from torch.utils.tensorboard import SummaryWriter
        trackers.append(SummaryWriter(os.path.join(cfg.out_dir, "tb")))
    if cfg.log_wandb:
        try:
            import wandb
        except ImportError:  # an optional package: requirements-dev.txt, not requirements.txt
            raise ValueError("log_wandb is on but wandb is not installed: pip install wandb "
                             "(or pip install -r requirements-dev.txt)") from None
        trackers.append(
            wandb.init(project=cfg.wandb_project, dir=cfg.out_dir, config=dataclasses.asdict(cfg),
                       name=os.path.basename(os.path.abspath(cfg.out_dir))))
    return trackers


def log_metrics(cfg, metrics: dict, trackers=()):
    """One human line, one json row in metrics.jsonl, and the scalars to every tracker."""
    clean = {
        k: (None if isinstance(v, float) and not math.isfinite(v) else v)
        for k, v in metrics.items()
    }
    with open(os.path.join(cfg.out_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(clean) + "\n")
    parts = [f"step {metrics['step']}/{cfg.steps}"]  # the row's step (the module docstring)
    for key, fmt in (("reward", ".3f"), ("eval_em", ".3f"), ("kl", ".4f"), ("clip_frac", ".3f"),
                     ("twins", "d"), ("discordance", ".2f"), ("twin_token_ratio", ".2f"),
                     ("time", ".1f")):
        if clean.get(key) is not None:
            parts.append(f"{key} {clean[key]:{fmt}}")
    print(" | ".join(parts), flush=True)
    scalars = {
        k: v for k, v in clean.items() if isinstance(v, (int, float)) and k not in ("step", "final")
    }
    for tracker in trackers:
        if hasattr(tracker, "add_scalar"):  # TensorBoard
            for k, v in scalars.items():
                tracker.add_scalar(k, v, metrics["step"])
            tracker.flush()
        else:  # W&B
            tracker.log(scalars, step=metrics["step"])


def start_log(cfg, start: int) -> list:
    """metrics.jsonl and episodes.jsonl cut back to the resumed step, config.json written (the
    console gets its summary: infra/console.py); returns the trackers."""
    for name in ("metrics.jsonl", "episodes.jsonl"):
        truncate_metrics(os.path.join(cfg.out_dir, name), start)
    with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=1)
    return open_trackers(cfg)


def episode_rows(step: int, episodes, twins, n: int, world: int) -> list:
    """n of this rank's episodes, evenly spaced over its batch (different prompts and lines), as
    lab/replay.py prints and checks them: turns, actions, retrieved ids, reward, the response's
    token ids, and each twin of theirs (rollout.TwinResult: turn, fork token k or None, kind, D, the
    twin's tokens from its branch turn)."""
    spaced = np.linspace(0, len(episodes) - 1, n).round().astype(int) if episodes and n else []
    picked = [episodes[i] for i in sorted(set(spaced))]
    rows = []
    for ep in picked:
        mine = twins_of(ep, twins)
        rows.append({
            "step": step, "uid": ep.uid, "line": ep.line, "world": world, "question": ep.question,
            "reward": ep.reward, "answer": ep.answer, "ids": ep.ids, "turns": [{
                "text": t.text, "action": t.action, "doc_ids": list(t.doc_ids)
            } for t in ep.turns], "twins": [{
                "turn": tw.turn, "k": tw.k, "j": tw.j, "kind": tw.kind, "diff": tw.diff,
                "outcome": tw.outcome, "ids": twin_tokens(ep, tw)
            } for tw in mine]
        })
    return rows


def twins_of(ep, twins) -> list:
    """The twins (rollout.TwinResult) branched from episode ep."""
    return [tw for tw in twins if (tw.twin.uid, tw.twin.line) == (ep.uid, ep.line)]


def twin_tokens(ep, tw) -> list:
    """A twin's response tokens from the start of the turn it changed on (a token fork's given
    tokens included)."""
    return tw.twin.ids[ep.turns[tw.turn].start:]


def log_episodes(cfg, rows: list, trackers=()):
    """Rows of episode_rows to out_dir/episodes.jsonl, as text to TensorBoard and as a table to W&B.
    """
    with open(os.path.join(cfg.out_dir, "episodes.jsonl"), "a") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    for tracker in trackers if rows else ():
        texts = [(row["uid"], row["line"], row["reward"], "".join(t["text"] for t in row["turns"]))
                 for row in rows]
        if hasattr(tracker, "add_text"):  # TensorBoard
            tracker.add_text(
                "episodes",
                "\n\n".join(f"**uid {u} line {l}, reward {r}**\n\n    " + x.replace("\n", "\n    ")
                            for u, l, r, x in texts), rows[0]["step"])
        else:  # W&B
            import wandb
            tracker.log(
                {
                    "episodes": wandb.Table(columns=["uid", "line", "reward", "text"],
                                            data=[list(t) for t in texts])
                }, step=rows[0]["step"])


def end_log(cfg, final: dict, trackers):
    """The final row (final evaluation) and closed trackers."""
    with open(os.path.join(cfg.out_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({**final, "final": True}) + "\n")
    for tracker in trackers:
        tracker.close() if hasattr(tracker, "close") else tracker.finish()
