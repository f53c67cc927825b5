"""Replay one training episode of a run, token for token, and print it readably (`python rollout.py
replay`); or write the whole step as one page (lab/twinview.py).

    python rollout.py replay --run runs/twice --step 12 --uid 8034712 --line 3   # the episode
    python rollout.py replay --run runs/twice --step 12 --uid 8034712 --line 3 --twins  # its twins
    python rollout.py replay --run runs/twice --step 12 --uid 8034712 --line 3 --twin 1  # at turn 1
    python rollout.py replay --run runs/twice --step 12 --html step12.html   # the step's page

Which policy: step N (as the console, metrics.jsonl and episodes.jsonl count it; the one numbering
is infra/checkpoint.py's docstring) was rolled out by the policy after N updates, which
checkpoint.save(cfg, run, N) writes as step_N after step N-1's update; step 0's is the initial
model (cfg.model). Every later step changed the weights, so no other checkpoint holds that policy:
a step without its checkpoint is refused, naming the steps that have one. The run's config (the checkpoint's run.json) gives the world, the retriever and the protocol;
the noise is counter-based (sampler.py: keys from seed, step, uid, line), so the episode comes back
exactly as sampled.

Exactness: the rank's whole batch of step N is regenerated (rollout.step_prompts with the run's rank
count: the logged `world`, else --world), as training generated it, because batched logits can
differ in the last bit with the batch around a row; twins go through the method's own twin credit
(twice.py) with the predictor state of step_N, so the branch draws, the alternatives y' and D are
training's. The cost is one rank's rollout of that step. With episodes.jsonl holding the episode,
the replayed tokens are checked against it (exit status 1 when they differ).

--html FILE: every rank's batch of step N, each replayed as above with the step's sigma_hat too, so
each token's advantage is the one training gave it; lab/twinview.py writes the page (grpo, twice,
independent and oracle runs: the methods whose credit is the factual loop's plus twins or A*).
Nothing in the run folder is written.
"""
import os
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import torch

import credit
import eval as qa_eval
import forks
import methods
import protocol
import rollout
import train_twice as tt
import twice
from infra import checkpoint, config, lora, weights
from lab import twinview
from methods import oracle
from sampler import stable_id


@dataclass
class Replay:
    """Replay an episode of a training run (lab/replay.py's docstring)."""
    run: str = ""                   # the run folder (its step_N checkpoints, episodes.jsonl)
    step: int = -1                  # the step whose episode to replay (as the console and
    #                                 metrics.jsonl count: step N samples from checkpoint step_N)
    uid: str = ""                   # the episode's uid (episodes.jsonl), or the QA row's id
    line: int = 0                   # the line inside its group (0 .. group_size - 1)
    twin: int = -1                  # also the twins branched at this turn (-1: none)
    twins: bool = False             # also every twin of the episode
    world: int = 0                  # processes the run had (0: the logged episode's `world`, else
    #                                 1)
    html: str = ""                  # write the step's page here (every prompt, line and twin, each
    #                                 token coloured by its advantage) instead of one episode

    def checks(self):
        return [("run", os.path.isdir(self.run), "a run folder"), ("step", self.step >= 0, ">= 0"),
                ("uid", bool(self.uid or self.html), "given (or --html)"),
                ("line", self.line >= 0, ">= 0"), ("world", self.world >= 0, ">= 0")]


def policy_of(run_dir: str, step: int) -> tuple:
    """(policy folder, run.json state or None) of the policy that rolled out step `step`."""
    ckpt = os.path.join(run_dir, f"step_{step:06d}")
    if os.path.isdir(ckpt):
        return os.path.join(ckpt, "policy"), checkpoint.read_state(ckpt)
    have = [n for n, _ in checkpoint.checkpoint_steps(run_dir)]
    if step == 0 and have:  # the initial policy: the run's cfg.model, loaded as setup() loads it
        state = checkpoint.read_state(os.path.join(run_dir, f"step_{have[0]:06d}"))
        return state["config"]["model"], {**state, "predictor": None, "token_predictor": None,
                                          "sigma_hat": None}
    raise ValueError(
        f"{run_dir}: step {step} has no checkpoint step_{step:06d} (its policy is the one after "
        f"{step} updates; every other checkpoint holds another): checkpoints exist for steps "
        f"{', '.join(map(str, have)) or '(none)'}; keep_checkpoints=0 and save_every=1 keep every "
        "step")


def logged(run_dir: str, step: int, uid: int, line: int):
    path = os.path.join(run_dir, "episodes.jsonl")
    rows = checkpoint.read_metrics(path) if os.path.exists(path) else []
    return next((row
                 for _, row in rows if (row["step"], row["uid"], row["line"]) == (step, uid, line)),
                None)


def regenerate(cfg, policy, tok, retriever, rows, step: int, uid: int, world: int, state):
    """The rank's factual batch of `step` holding uid, and (TWIN_METHODS) twin_credit's twins of it.
    """
    ranks = [
        r for r in range(world) if uid in {
            ep.uid for ep in rollout.start_episodes(
                tok, rollout.step_prompts(rows, cfg.prompts_per_step, cfg.seed, step, r, world),
                cfg.seed, step, 1)
        }
    ]
    if not ranks:
        raise ValueError(
            f"uid {uid} is not among step {step}'s prompts (seed {cfg.seed}, {world} rank(s))")
    out = rank_batch(cfg, policy, tok, retriever, rows, step, ranks[0], world, state,
                     cfg.method in methods.TWIN_METHODS)
    return out.episodes, out.stats.get("twins", [])


def rank_batch(cfg, policy, tok, retriever, rows, step: int, rank: int, world: int, state,
               credit_too: bool) -> SimpleNamespace:
    """Rank `rank`'s factual batch of `step` as train_step sampled it and, with credit_too, the
    method's advantages of it (twins, the oracle's A*) from the step's predictor and sigma_hat:
    episodes, batch, adv (None without credit), stats, and the oracle's estimates."""
    prompts = rollout.step_prompts(rows, cfg.prompts_per_step, cfg.seed, step, rank, world)
    proto = protocol.protocol_from(cfg)
    # the weights train_step samples from
    sampler = weights.sampling_copy(policy, torch.bfloat16 if cfg.bf16 else None)
    out = SimpleNamespace(adv=None, stats={}, estimates=None)
    with torch.no_grad():
        out.episodes = rollout.run_episodes(
            sampler, tok, retriever,
            rollout.start_episodes(tok, prompts, cfg.seed, step, cfg.group_size), proto)
        out.batch = rollout.collate(out.episodes, tok.pad_token_id, cfg.max_context)
        if credit_too:
            run = step_run(cfg, policy, sampler, tok, retriever, state)
            if cfg.method == "oracle":  # A* kept per decision: the page shows it and its SE
                a_star, out.estimates = oracle.oracle_credit(sampler, tok, retriever, out.episodes,
                                                             cfg.oracle_rollouts, proto)
                out.adv, out.stats = run.method.from_credit(run, out.episodes, out.batch, a_star,
                                                            out.estimates)
            else:
                out.adv, out.stats = run.method.advantages(run, step, out.episodes, out.batch, proto)
    return out


def step_run(cfg, policy, sampler, tok, retriever, state) -> SimpleNamespace:
    """What the method reads of train_twice.Run at step N: the branch draws' predictors and
    sigma_hat as step_N's checkpoint saved them (fresh at step 0)."""
    run = SimpleNamespace(
        accel=SimpleNamespace(num_processes=1, unwrap_model=lambda m: m), policy=policy,
        sampler=sampler, tok=tok, retriever=retriever, method=methods.make(cfg),
        predictor=credit.DiscordancePredictor(),
        token_predictor=credit.DiscordancePredictor(features=forks.TOKEN_FEATURES),
        sigma_hat=credit.RunningScale(cfg.scale_decay, cfg.twin_scale))
    for name in ("predictor", "token_predictor", "sigma_hat"):
        if state.get(name):
            getattr(run, name).load_state_dict(state[name])
    return run


def show(ep, twins) -> str:
    """The episode as text: each turn's action and text, retrieved ids, reward; then each twin, its
    y' and D."""
    out = [
        f"uid {ep.uid} line {ep.line} | reward {ep.reward} | answer {ep.answer!r} | {len(ep.ids)} response tokens",
        f"question: {ep.question}"
    ]
    for t, turn in enumerate(ep.turns):
        out.append(
            f"--- turn {t}: {turn.action or 'invalid'} {turn.content!r} ({turn.end - turn.start} tokens, "
            f"stop {turn.stop})")
        out.append(turn.text)
        if turn.doc_ids:
            out.append(f"    retrieved: {', '.join(turn.doc_ids)}")
    for tw in twins:
        alt = tw.twin.turns[tw.turn]
        at = ep.turns[tw.turn].start + (tw.k or 0)
        fork = "" if tw.k is None else f" token {tw.k} (id {ep.ids[at]} -> {tw.twin.ids[at]})"
        part = twinview.divergence(ep, tw)
        out.append(
            f"=== twin at turn {tw.turn}{fork} (j={tw.j}): {tw.kind} | y' = {alt.action or 'invalid'} "
            f"{alt.content!r} | U' {tw.outcome} | D = U - U' = {tw.diff} | "
            f"{'never parts' if part is None else f'parts at token {part}'}")
        out.append(alt.text)
        out += [f"    retrieved: {', '.join(alt.doc_ids)}"] if alt.doc_ids else []
        out += [
            f"    then: {u.action or 'invalid'} {u.content!r}" for u in tw.twin.turns[tw.turn + 1:]
        ]
    return "\n".join(out)


def load_lora(cfg, adapter: str, device):
    """(policy, tokenizer) as a LoRA run's setup() builds them: the base from cfg.model in
    base_dtype, then the adapter saved at `adapter` (a step_N/policy folder), or a fresh one (B = 0:
    the initial policy) when ''."""
    policy, tok = qa_eval.load_policy(cfg.model, device, lora.base_dtype(cfg))
    torch.manual_seed(cfg.seed)
    return lora.attach(policy, cfg, adapter).get_base_model().eval(), tok


def replay(opts: Replay) -> int:
    """Print the episode (and the twins asked for); 1 when episodes.jsonl logged it with other
    tokens. With --html, write the step's page instead."""
    if opts.html:
        twinview.check_writable(opts.html)  # before the replay's minutes, not after
    path, state = policy_of(opts.run, opts.step)
    known = {f for f in tt.Config.__dataclass_fields__}
    cfg = tt.Config(**{k: v for k, v in state["config"].items() if k in known})
    if type(methods.make(cfg)).rollout is not twice.Method.rollout:  # ARPO's and Tree-GRPO's trees
        raise ValueError(
            f"method {cfg.method} samples its own trees (methods/baselines.py): replay regenerates the factual "
            "episode loop of grpo, twice and the methods that share it")
    if opts.html and cfg.method not in twinview.METHODS:
        raise ValueError(
            f"{opts.run} is a {cfg.method} run: the page shows {', '.join(twinview.METHODS)} runs (their credit "
            f"is GRPO's, the twins' or the oracle's A*); --uid U --line L prints one of its episodes")
    trained = [
        r["step"] for _, r in checkpoint.read_metrics(os.path.join(opts.run, "metrics.jsonl"))
        if not r.get("final")
    ] if os.path.exists(os.path.join(opts.run, "metrics.jsonl")) else []
    if opts.step not in trained:
        raise ValueError(
            f"{opts.run}: step {opts.step} was not trained in this run (metrics.jsonl has steps "
            f"{min(trained, default='-')}..{max(trained, default='-')})")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # the base as setup() loads it, with step_N's adapter (step 0: a fresh one, B = 0)
    if cfg.lora_rank:
        policy, tok = load_lora(cfg, path if opts.step else "", device)
    else:
        # setup's / saved
        policy, tok = qa_eval.load_policy(path, device, torch.float32 if opts.step == 0 else None)
    retriever = qa_eval.load_retriever(cfg.index, cfg.retriever_url)
    rows = qa_eval.load_qa(cfg.train_data)
    if opts.html:
        world = opts.world or step_world(opts.run, opts.step)
        batches = [rank_batch(cfg, policy, tok, retriever, rows, opts.step, r, world, state, True)
                   for r in range(world)]
        size = twinview.write(opts.html, twinview.page(cfg, opts.run, opts.step, path, batches, tok))
        print(f"wrote {opts.html} ({size / 1e3:.0f} kB): step {opts.step} of {opts.run}, "
              f"{sum(len(b.episodes) for b in batches)} episodes, "
              f"{sum(len(b.stats.get('twins', [])) for b in batches)} twins")
        return 0
    uid = int(opts.uid) if opts.uid.lstrip("-").isdigit() else stable_id(opts.uid)
    row = logged(opts.run, opts.step, uid, opts.line)
    world = opts.world or (row or {}).get("world", 1)
    episodes, twins = regenerate(cfg, policy, tok, retriever, rows, opts.step, uid, world, state)
    ep = next((e for e in episodes if (e.uid, e.line) == (uid, opts.line)), None)
    if ep is None:
        raise ValueError(f"uid {uid} has no line {opts.line} (group_size {cfg.group_size})")
    mine = [tw for tw in checkpoint.twins_of(ep, twins) if opts.twins or tw.turn == opts.twin]
    print(f"step {opts.step} of {opts.run}, policy {path}, method {cfg.method}")
    print(show(ep, mine))
    if row is None:
        print("(not in episodes.jsonl: nothing to check against)")
        return 0
    same = row["ids"] == ep.ids and all(
        any(t["ids"] == checkpoint.twin_tokens(ep, tw) for t in row["twins"]) for tw in mine)
    print("tokens identical to episodes.jsonl" if same else "tokens DIFFER from episodes.jsonl")
    return 0 if same else 1


def step_world(run_dir: str, step: int) -> int:
    """The processes that ran the step, as episodes.jsonl logged them (1 without a row of it)."""
    path = os.path.join(run_dir, "episodes.jsonl")
    rows = checkpoint.read_metrics(path) if os.path.exists(path) else []
    return next((row.get("world", 1) for _, row in rows if row["step"] == step), 1)


def main(argv) -> int:
    opts = config.cli(Replay, argv, prog="rollout.py replay", presets=False)
    try:
        return replay(opts)
    except (ValueError, OSError) as e:
        print(f"rollout.py replay: error: {e}", flush=True)
        return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
