"""The credit audit's method rows (DESIGN.md section 8): every method of section 7 through its own
turn_advantages.

For each decision's turn t and repeat r, the method's trainer code (methods/baselines.py,
methods/learned.py) scores the groups [F_r, the G-1 fresh lines of the prompt in repeat r], with the
knobs of the trainer preset (--train_config, the world's by default), one call per (turn t, repeat
r) holding each prompt once, as a training batch does; the estimate is F_r's advantage at turn t.
What a method samples from F_r (AgentPRM's continuations) is keyed by
fresh_key(key, METHOD_TAG, t, r). SPA-RL's and AgentPRM's estimators first train --learned_steps trainer steps on
train questions not audited. lab/audit.py holds the protocol, the other estimators and the metrics;
this file only runs the methods' own code on the audit's episodes.

Deviations (DESIGN.md section 13; tagged `# DEVIATION A<n>:` below):
  A7. SPA-RL's and AgentPRM's estimators are trained first by --learned_steps trainer steps of the
     method (its rollout and turn_advantages) on the warm-start policy's episodes of train questions
     not audited (in training they follow a changing policy); every audit call restarts from that
     state and takes the trainer's online step on its batch.
  A8. A method row's batch is the groups of the decisions at one turn index in one repeat (the
     trainer's: a step's prompts), so batch-level pooling (GiGPO anchors, AgentPRM targets) never
     mixes repeats or decisions of a prompt.
  A9. A method row's aux tokens per decision are its call's aux_tokens over the call's decisions
     (every turn of every episode), the trainer's cost per decision; VinePPO's rows count the
     decision's own boundary rollouts.

Tests: `python -m pytest -q tests/test_audit.py -k method`.
"""
import copy
import dataclasses
import json
import os
import time
import types

import numpy as np
import torch

import methods
import rollout
import sampler
import train_twice
from worlds.chains import SUITE

METHOD_ROWS = {
    "gigpo": "GiGPO", "hgpo": "HGPO", "igpo": "IGPO", "spa_rl": "SPA-RL", "agentprm": "AgentPRM"
}


def method_names(text: str) -> list:
    return [m.strip() for m in str(text).split(",") if m.strip()]


def world_preset(world: str) -> str:
    """The trainer preset a built-in world is trained with (configs/chains.cfg for chains and the credit suite's
    worlds, configs/demo.cfg; world.json's preset), '' when the folder holds no world.json (then train_twice.Config's
    defaults)."""
    path = os.path.join(world, "world.json")
    if not os.path.isfile(path):
        return ""
    with open(path, encoding="utf-8") as f:
        preset = json.load(f).get("stats", {}).get("preset", "tiny")
    return os.path.relpath(
        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                     "chains.cfg" if preset == "chains" or preset in SUITE else "demo.cfg"))


class OneProcess:
    """What a method (methods/baselines.py, methods/learned.py) reads of accelerate.Accelerator, for
    one process: device, num_processes, unwrap_model."""
    num_processes = 1

    def __init__(self, device):
        self.device = device

    @staticmethod
    def unwrap_model(model):
        return model


def method_run(model, tok, retr):
    """The members of train_twice.Run that a Method's rollout / turn_advantages / estimator read."""
    return types.SimpleNamespace(accel=OneProcess(next(model.parameters()).device), policy=model,
                                 tok=tok, retriever=retr)


def method_config(cfg) -> "train_twice.Config":
    """The trainer's Config from cfg.train_config (its knobs: omega, step_gamma, gamma, lr,
    estimator_lr_scale, micro_batch_size, prompts_per_step, ...) with the audit's G and seed; the
    protocol is the audit's `proto`."""
    base = train_twice.parse_config([cfg.train_config] if cfg.train_config else [])
    return dataclasses.replace(base, group_size=cfg.group_size, seed=cfg.seed)


def rekeyed(f, t: int, r: int):
    """F_r under a key of its own, fresh_key(key, METHOD_TAG, t, r): its turns are sampled already,
    so this keys only what a method samples from it (AgentPRM's continuations): independent over
    repeats, disjoint from the oracle."""
    g = dataclasses.replace(f, key=sampler.fresh_key(f.key, sampler.METHOD_TAG, t, r))
    g._kv = getattr(f, "_kv", None)  # the cached engine may continue from F_r's cache
    return g


def method_calls(facts, line_eps, decisions, R) -> list:
    """[(t, [(n, r)], episodes)]: one call per (turn t, repeat r), the groups [F_r, its prompt's G-1
    fresh lines of repeat r] of every decision at turn t, so a call holds each prompt once, as a
    training batch does (GiGPO's anchors and AgentPRM's Monte Carlo targets pool over the call's
    episodes)."""
    # DEVIATION A8: a call batches the decisions at one turn index (a trainer batch:
    # prompts_per_step prompts)
    calls = []
    for t in sorted({t for _, t in decisions}):
        for r in range(R):
            rows = [n for n, (_, u) in enumerate(decisions) if u == t]
            eps = [
                e for n in rows
                for e in [rekeyed(facts[n * R + r], t, r), *line_eps[decisions[n][0]][r]]
            ]
            calls.append((t, [(n, r) for n in rows], eps))
    return calls


def method_estimates(method, run, calls, shape, proto, step) -> tuple:
    """(N, R) the method's turn advantage of F_r at its decision turn t (turn_advantages on each
    call, groups of group_size consecutive episodes, F_r first) and (N, R) auxiliary tokens: its
    call's aux_tokens per decision (every turn of the call's episodes), as a training batch spends
    them (A9). A learned estimator restarts every call from its state on entry (and is left in it),
    then trains its one online step on the call's batch before scoring it."""
    est, aux, G = np.full(shape, np.nan), np.zeros(shape), method.cfg.group_size
    start = copy.deepcopy(method.est.state_dict()) if getattr(method, "est",
                                                              None) is not None else None
    for t, rows, eps in calls:
        if start is not None:
            # AdamW's state too: every call from the same point
            method.est.load_state_dict(copy.deepcopy(start))
        with torch.no_grad():
            adv, stats = method.turn_advantages(run, step, eps, proto)
        for k, (n, r) in enumerate(rows):
            # DEVIATION A9: per decision, the call's aux tokens over its decisions (VinePPO: the
            # decision's own)
            est[n, r], aux[n,
                           r] = adv[k * G][t], stats["aux_tokens"] / sum(len(e.turns) for e in eps)
    if start is not None:
        method.est.load_state_dict(start)  # left as found
    return est, aux


def pretrain(method, run, rows, steps: int, proto) -> dict:
    """A learned estimator's training before the audit: `steps` trainer steps of the method, each
    its own rollout of prompts_per_step questions of `rows` and its turn_advantages, which trains
    the estimator on that batch (the trainer's path and hyperparameters); the estimator loss of each
    step is on a batch it has not trained on yet."""
    # DEVIATION A7: the estimator trains on the warm-start policy's episodes of questions not
    # audited, the policy fixed
    method.estimator(run)
    losses, tokens, aux = [], 0, 0
    for step in range(steps):
        prompts = rollout.step_prompts(rows, method.cfg.prompts_per_step, method.cfg.seed, step)
        with torch.no_grad():
            eps = method.rollout(run, step, prompts, proto)
            _, stats = method.turn_advantages(run, step, eps, proto)
        losses.append(stats["estimator_loss"])
        tokens, aux = tokens + sum(e.n_generated for e in eps), aux + stats["aux_tokens"]
    return {"steps": steps, "prompts_per_step": method.cfg.prompts_per_step, "questions": len(rows),
            "losses": losses, "rollout_tokens": tokens, "aux_tokens": aux}


def method_rows(model, tok, retr, rows, raw, cfg, proto) -> dict:
    """{"rows": {name: ((N, R) estimates, (N, R) aux tokens)}, "learned": {name: pretrain's record}}
    of every --method_rows method; learned estimators first train on the questions of `rows` not
    audited."""
    mcfg, run, R = method_config(cfg), method_run(model, tok, retr), cfg.repeats
    audited = {row["id"] for row in raw["chosen"]}
    others = [row for row in rows if row["id"] not in audited]
    calls = method_calls(raw["facts"], raw["line_eps"], raw["decisions"], R)
    out = {"rows": {}, "learned": {}}
    for name in method_names(cfg.method_rows):
        t0, method = time.time(), methods.METHODS[name](mcfg)
        if hasattr(method, "estimator"):
            if not others:
                raise ValueError(
                    f"{cfg.data}: every question is audited; {name} needs others to train on")
            out["learned"][METHOD_ROWS[name]] = pretrain(method, run, others, cfg.learned_steps,
                                                         proto)
        out["rows"][METHOD_ROWS[name]] = method_estimates(
            method, run, calls, (len(raw["decisions"]), R), proto, cfg.learned_steps)
        raw["times"][f"{name}_s"] = time.time() - t0
    return out
