"""The gradient audit (RESULTS.md "Headroom", "The gradient audit"; DESIGN.md section 8): where credit quality becomes
learning. At a fixed policy, each method's policy gradient on the same factual batches, against a reference gradient,
and its variance split into credit noise and episode sampling.

    python -m lab.gradaudit run WORLD [--policy DIR] [--tag warm]   # results/gradaudit/WORLD-TAG/gradaudit.json
    python -m lab.gradaudit run luck-high --labels frontier --tag frontier-warm   # the credit frontier's rungs
    python -m lab.gradaudit checkpoint WORLD                        # the mid-training policy: GRPO, half its updates
    python -m lab.gradaudit report                                  # results/gradaudit/summary.md from every json

Protocol, at the chains benchmark's settings (configs/chains.cfg + configs/compare-methods.cfg, each method at its
benchmark label's knobs: lab/benchmark.flags):
  1. B factual batches b of the training batch size (8 prompts x 5 lines), the batches of steps 0..B-1 of seed 0
     (rollout.step_prompts, the trainer's keys); GRPO-matched's batch has its own 9 (or 8) lines, the first five the
     same episodes.
  2. Per method and batch, R independent draws r of the credit's own randomness on the same episodes (TWICE: the
     branch draws and y', `draw` of twice.twin_credit; the oracle: M more rollouts per side, methods/oracle.py;
     GRPO: none, R = 1). Each draw's gradient g_br is the policy-gradient term of the trainer's loss at ratio 1, a
     token mean over the batch's loss-masked tokens (twins as rows: their weights), over every trained weight
     (generation/logprobs.policy_gradients). The KL term is left out: it is the same for every method.
  3. Reference: the gradient of the raw oracle credit A* (no scale, no clip), averaged over the draws and over every
     batch but b (leave one batch out: a batch B - 1 times larger, independent of batch b). Its own reliability: the
     cosine between the references of two disjoint halves of the batches.
  4. Per method: cos(g_br, reference) (mean over draws, then mean +- SE over batches); the same for the draws' mean
     (credit noise averaged R-fold); and the variance of one batch gradient, trace of the covariance, split
     (nested ANOVA, `variance_split`) into credit noise E_b Var_r(g | b) and episode sampling Var_b E_r(g | b).
Each method's generated tokens beyond the factual batch (twins, continuations, the oracle's rollouts) are counted
per decision, so the cosine can be read against what a method spends (`--labels frontier`: the rungs of
lab/frontier.py). Every policy, predictor and running scale starts fresh for each draw (the trainer's first step), so
draws are exchangeable. What it does not know: the update's later steps (Adam's scaling, the clip), only the direction of
one batch's gradient.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch

from lab import benchmark, frontier, headroom, suite
import credit
import eval as qa_eval
import forks
import methods
import protocol
import rollout
import train_twice as tt
from generation import engine, logprobs
from methods import oracle

ROOT = benchmark.ROOT
RESULTS = os.path.join(ROOT, "results", "gradaudit")
INDEPENDENT = suite.INDEPENDENT


def labels(world: str) -> list:
    """GRPO, GRPO-matched, TWICE credit only, the independent counterfactual, twins as rows, the oracle arm."""
    return [lab for lab in (headroom.GRPO, headroom.matched(world), headroom.CREDIT, INDEPENDENT, headroom.DATA,
                            headroom.ORACLE) if lab]  # GRPO-matched once chosen


# the credit frontier's rungs (lab/frontier.py): GRPO, TWICE's ladder, its independent counterparts, the oracle
FRONTIER = (headroom.GRPO, *frontier.LADDER.values(), *frontier.INDEPENDENT, "oracle-m4", headroom.ORACLE)


def config_of(world: str, label: str, policy: str) -> tt.Config:
    return tt.parse_config([*[os.path.join(ROOT, c) for c in benchmark.CONFIGS],
                            f"--world={suite.world_dir(world)}", *benchmark.flags(label), f"--model={policy}",
                            "--eval_data=", "--log_tensorboard=false"])


def fresh_run(cfg, policy, tok, retriever, rows) -> SimpleNamespace:
    """What a method's rollout and advantages read of train_twice.Run, one process, every estimator fresh."""
    accel = SimpleNamespace(unwrap_model=lambda m: m, num_processes=1, process_index=0)
    return SimpleNamespace(accel=accel, policy=policy, tok=tok, retriever=retriever, rows=rows, sampler=None,
                           method=methods.make(cfg), predictor=credit.DiscordancePredictor(),
                           token_predictor=credit.DiscordancePredictor(features=forks.TOKEN_FEATURES),
                           sigma_hat=credit.RunningScale(cfg.scale_decay, cfg.twin_scale))


def draws_of(label: str, R: int) -> int:
    """GRPO's credit is a function of the batch: one draw."""
    return R if label.startswith(("twice", "independent", "oracle")) else 1


def aux_tokens(stats: dict) -> int:
    """The tokens a method's credit generated beyond the factual batch (twins, continuations, oracle rollouts)."""
    if "twins" in stats:
        return sum(tw.tokens for tw in stats["twins"])
    return stats.get("aux_tokens", 0) + stats.get("oracle_tokens", 0)


def batch_gradients(cfg, run, step: int, episodes, draws: int) -> tuple:
    """([g_r] over the draws, and for the oracle [the raw-A* gradient of each draw]), float64 vectors (token
    means), and the credit's generated tokens of each draw."""
    proto = protocol.protocol_from(cfg)
    base = rollout.collate(episodes, run.tok.pad_token_id, cfg.max_context)
    grads, raw, spent = [], [], []
    for r in range(draws):
        fresh = fresh_run(cfg, run.policy, run.tok, run.retriever, run.rows)
        with torch.no_grad():
            if cfg.method == "oracle":  # A* once: the arm's advantages and, unscaled, the reference's
                a_star, est = oracle.oracle_credit(run.policy, run.tok, run.retriever, episodes,
                                                   cfg.oracle_rollouts, proto, r)
                adv, stats = fresh.method.from_credit(fresh, episodes, base, a_star, est)
            else:
                kw = {"draw": r} if cfg.method in ("twice", "independent") else {}
                adv, stats = fresh.method.advantages(fresh, step, episodes, base, proto, **kw)
        batch = stats.get("batch", base)
        spent.append(aux_tokens(stats))
        advs = [adv]
        if cfg.method == "oracle":
            advs.append(credit.spread_over_tokens(a_star, rollout.turn_spans(episodes), adv.shape[1]))
        tokens = float(batch["loss_mask"][:, 1:].float().sum())
        gs = logprobs.policy_gradients(run.policy, batch, [torch.tensor(a[:, 1:], dtype=torch.float32)
                                                           for a in advs], cfg.temperature, cfg.micro_batch_size)
        grads.append(gs[0].double().numpy() / tokens)
        raw += [gs[1].double().numpy() / tokens] if len(gs) > 1 else []
        engine.free_cache(run.policy)
    return grads, raw, spent


# --- the statistics ---

def variance_split(g) -> dict:
    """Nested ANOVA of gradients g (B batches, R draws, d): credit noise W = E_b Var_r(g | b) (0 when R = 1),
    episode sampling S = Var_b E_r(g | b) = (the batch means' variance) - W / R, each the trace of a covariance
    (summed over the d coordinates), total = W + S, the variance of one draw on one batch. Also the sums of squares,
    for which SS_total = SS_batches + SS_draws exactly."""
    g = np.asarray(g, dtype=np.float64)
    B, R = g.shape[:2]
    means = g.mean(1)  # (B, d)
    grand = means.mean(0)
    ss_draws = float(((g - means[:, None]) ** 2).sum())
    ss_batches = float(R * ((means - grand) ** 2).sum())
    within = ss_draws / (B * (R - 1)) if R > 1 else 0.0
    sampling = ss_batches / (R * (B - 1)) - within / R
    return {"credit_noise": within, "sampling": sampling, "total": within + sampling,
            "ss_total": float(((g - grand) ** 2).sum()), "ss_batches": ss_batches, "ss_draws": ss_draws,
            "signal": float((grand ** 2).sum()) - (within + sampling) / (B * R)}


def cosine(a, b) -> float:
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    return float(a @ b / (na * nb)) if na > 0 and nb > 0 else 0.0


def cosines(g, refs) -> dict:
    """Mean +- SE over batches of cos(g_br, ref_b) (averaged over draws) and of cos(mean_r g_br, ref_b)."""
    g = np.asarray(g)
    one = [np.mean([cosine(x, ref) for x in draws]) for draws, ref in zip(g, refs)]
    avg = [cosine(draws.mean(0), ref) for draws, ref in zip(g, refs)]
    return {"cos": float(np.mean(one)), "cos_se": suite.se(one), "cos_mean_of_draws": float(np.mean(avg)),
            "cos_mean_of_draws_se": suite.se(avg)}


def reference_cos(split_half: float, batches: int) -> float:
    """The cosine of the leave-one-out reference (B - 1 batches) with the expected gradient, from the split-half
    cosine rho of two references of B // 2 batches each, if each batch adds independent noise of one size: a
    reference of k batches has cos^2 = 1 / (1 + r / k) with r = (B // 2) (1 / rho - 1) (Spearman-Brown). A batch
    gradient's cosine with the expected gradient is then about its cosine with the reference over this."""
    if split_half <= 0:
        return float("nan")
    r = (batches // 2) * (1 / split_half - 1)
    return float(1 / np.sqrt(1 + r / (batches - 1)))


def references(raw) -> tuple:
    """(leave-one-batch-out reference per batch, the split-half cosine of the reference), raw (B, R, d)."""
    per_batch = np.asarray(raw).mean(1)
    total = per_batch.sum(0)
    refs = [(total - per_batch[b]) / (len(per_batch) - 1) for b in range(len(per_batch))]
    half = len(per_batch) // 2
    return refs, cosine(per_batch[:half].mean(0), per_batch[half:2 * half].mean(0))


# --- the run ---

def run_audit(world: str, policy_dir: str, tag: str, batches: int, draws: int, out: str, arms=()) -> dict:
    """The audit of the arms (default: `labels(world)`); the reference is the raw A* of the oracle M = 16 arm."""
    torch.set_num_threads(1)
    arms = list(arms) or labels(world)
    if headroom.ORACLE not in arms:
        raise ValueError(f"the reference is {headroom.ORACLE}'s raw A*: add it to the labels")
    cfg0 = config_of(world, headroom.GRPO, policy_dir)
    policy, tok = qa_eval.load_policy(policy_dir, "cpu", torch.float32)
    policy.eval()
    retriever = qa_eval.load_retriever(cfg0.index)
    rows = qa_eval.load_qa(cfg0.train_data)
    grads, raw, times, spent, decisions, start = {}, [], {}, {}, {}, time.time()
    for b in range(batches):
        factual = {}  # lines per prompt -> the batch's episodes (every method with G lines shares them)
        for label in arms:
            t0, cfg = time.time(), config_of(world, label, policy_dir)
            run = fresh_run(cfg, policy, tok, retriever, rows)
            if cfg.group_size not in factual:
                prompts = rollout.step_prompts(rows, cfg.prompts_per_step, cfg.seed, b)
                with torch.no_grad():
                    factual[cfg.group_size] = run.method.rollout(run, b, prompts, protocol.protocol_from(cfg))
            g, r, n = batch_gradients(cfg, run, b, factual[cfg.group_size], draws_of(label, draws))
            grads.setdefault(label, []).append(g)
            raw += [r] if label == headroom.ORACLE else []
            spent[label] = spent.get(label, 0) + sum(n) / len(n)
            decisions[label] = decisions.get(label, 0) + sum(len(ep.turns) for ep in factual[cfg.group_size])
            times[label] = times.get(label, 0.0) + time.time() - t0
        print(f"gradaudit {world} {tag}: batch {b + 1}/{batches} in {time.time() - start:.0f} s", flush=True)
    refs, split_half = references(raw)
    result = {"world": world, "tag": tag, "policy": described(os.path.abspath(policy_dir)), "batches": batches,
              "draws": draws, "oracle_rollouts": headroom.M, "reference_split_half_cos": split_half,
              "reference_cos": reference_cos(split_half, batches),
              "params": int(len(refs[0])), "methods": {}}
    for label, g in grads.items():
        result["methods"][label] = {**cosines(g, refs), **variance_split(g), "seconds": round(times[label], 1),
                                    "aux_tokens_per_decision": spent[label] / decisions[label]}
    result["wall_s"] = round(time.time() - start, 1)
    os.makedirs(out, exist_ok=True)
    benchmark.write_json(os.path.join(out, "gradaudit.json"), result)
    return result


def mid_steps(world: str) -> int:
    """Half the updates of the world's GRPO run on seed 0 at the benchmark's budget (chains: 8 of 17)."""
    where = headroom.find(world, headroom.GRPO, 0)
    if not where:
        raise SystemExit(f"lab/gradaudit.py: {world} has no finished GRPO run on seed 0 yet "
                         f"(python -m lab.headroom run {world}): the checkpoint is half its updates")
    _, rows = benchmark.collect([headroom.GRPO], (0,), where)[headroom.GRPO][0]
    return max(r["step"] for r in rows) // 2


def described(policy: str) -> str:
    """A policy folder as the report names it: the repository's own by path, a `checkpoint` by how it was made."""
    steps = re.search(r"-grpo(\d+)/step_\d+/policy$", policy.replace(os.sep, "/"))
    if steps and os.path.relpath(policy, ROOT).startswith(".."):
        return f"GRPO seed 0 after {int(steps[1])} updates, `lab.gradaudit checkpoint`"
    return os.path.relpath(policy, ROOT)


def checkpoint(world: str, scratch: str) -> str:
    """GRPO on the world from its warm start for half its run's updates, seed 0 (benchmark settings, one thread): the
    mid-training policy; returns its folder."""
    steps = mid_steps(world)
    out = os.path.join(scratch, f"{world}-grpo{steps}")
    argv = [sys.executable, "train_twice.py", *benchmark.CONFIGS, f"--world={suite.world_dir(world)}",
            "--method=grpo", f"--steps={steps}", "--token_budget=0", "--eval_tokens=0", "--eval_every=0",
            "--eval_data=", "--log_tensorboard=false", f"--out_dir={out}", "--overwrite"]
    subprocess.run(argv, cwd=ROOT, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return os.path.join(out, f"step_{steps:06d}", "policy")


# --- the report ---

def summary(results: str = RESULTS) -> str:
    """Markdown: per world and policy, every method's cosine with the reference and its variance split."""
    lines = ["# Gradient audit (generated by `python -m lab.gradaudit report`; do not edit)", "",
             "cos: one batch's gradient against the reference (leave one batch out, raw oracle A*), mean +- SE over "
             "batches; cos (R draws): the same for the mean of R credit draws; cos / ref: cos over the reference's "
             "own estimated cosine with the expected gradient (from its split half, `reference_cos`), about the "
             "batch gradient's cosine with the expected oracle gradient; credit noise and sampling: shares of the "
             "variance of one batch's gradient (trace of the covariance); SNR: |E g|^2 / that variance.", ""]
    found = sorted(d for d in os.listdir(results) if os.path.isfile(os.path.join(results, d, "gradaudit.json"))) \
        if os.path.isdir(results) else []
    for name in found:
        res = json.load(open(os.path.join(results, name, "gradaudit.json")))
        ref = reference_cos(res["reference_split_half_cos"], res["batches"])
        policy = described(os.path.join(ROOT, res["policy"]))
        lines += [f"## {res['world']}, {res['tag']} ({policy}): {res['batches']} batches x {res['draws']} "
                  f"draws, reference split-half cos {res['reference_split_half_cos']:.3f} (reference cos {ref:.2f})",
                  "", "| method | cos | cos (R draws) | cos / ref | credit noise | sampling | SNR | aux tokens / decision "
                  "| s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for label, m in res["methods"].items():
            total = m["total"] if m["total"] > 0 else float("nan")
            aux = f"{m['aux_tokens_per_decision']:.1f}" if "aux_tokens_per_decision" in m else "-"  # since 2026-12-07
            lines.append(f"| {suite.method(label)} | {m['cos']:.3f} +- {m['cos_se']:.3f} | "
                         f"{m['cos_mean_of_draws']:.3f} +- {m['cos_mean_of_draws_se']:.3f} | {m['cos'] / ref:.2f} | "
                         f"{m['credit_noise'] / total:.2f} | {m['sampling'] / total:.2f} | "
                         f"{m['signal'] / total:.3f} | {aux} | {m['seconds']:.0f} |")
        lines.append("")
    return benchmark.write_text(os.path.join(results, "summary.md"), "\n".join(lines))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="lab/gradaudit.py", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["run", "checkpoint", "report"])
    parser.add_argument("world", nargs="?", help=", ".join(headroom.WORLDS))
    parser.add_argument("--policy", default="", help="policy folder ('' = the world's warm start)")
    parser.add_argument("--tag", default="warm", help="names the output folder results/gradaudit/WORLD-TAG")
    parser.add_argument("--batches", type=int, default=6, help="B factual batches (steps 0..B-1)")
    parser.add_argument("--draws", type=int, default=2, help="R credit draws per batch")
    parser.add_argument("--scratch", default="runs/gradaudit", help="where checkpoint trains")
    parser.add_argument("--results", default=RESULTS, help="where the json goes (WORLD-TAG/) and the summary")
    parser.add_argument("--labels", default="", help="comma-separated run labels to audit (with oracle-m16, the "
                                                     "reference), or 'frontier': the credit frontier's rungs")
    a = parser.parse_args(argv)
    if a.command == "report":
        print(summary(a.results))
        return 0
    if a.world not in headroom.WORLDS:
        parser.error(f"{a.command} needs a world: {', '.join(headroom.WORLDS)}")
    if a.command == "checkpoint":
        print(checkpoint(a.world, a.scratch))
        return 0
    if a.batches < 3 or a.draws < 2:
        parser.error("--batches >= 3 (a leave-one-out reference and a split half) and --draws >= 2 (credit noise)")
    policy = a.policy or os.path.join(suite.world_dir(a.world), "policy")
    arms = FRONTIER if a.labels == "frontier" else tuple(filter(None, a.labels.split(",")))
    res = run_audit(a.world, policy, a.tag, a.batches, a.draws, os.path.join(a.results, f"{a.world}-{a.tag}"), arms)
    print(json.dumps({k: {m: round(v["cos"], 3) for m, v in res["methods"].items()} if k == "methods" else v
                      for k, v in res.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
