"""methods/learned.py (ppo, spa_rl, agentprm) and the token-level baselines (igpo, craft): hand-computed targets and
advantages, the estimators' losses falling on a fixed batch, two training steps and exact resume per method."""
import json
import math
import os

import numpy as np
import pytest
import torch

from methods import baselines
import credit
from methods import learned
from generation import logprobs
import methods
import protocol
import rollout
import sampler
import train_twice as tt
from test_train import read_metrics, tiny_cfg

LEARNED = ("ppo", "igpo", "spa_rl", "agentprm", "craft")


# --- formulas, hand-computed -----------------------------------------------------------------------------------

def test_gae_skips_observation_tokens_and_telescopes_at_gamma_lambda_1():
    r = np.array([[0, 0, 0, 1.0]])
    v = np.array([[0.2, 0.5, 9.0, 0.4]])  # position 2 is an observation token: its value must not be used
    m = np.array([[1, 1, 0, 1]])
    adv, ret = learned.gae(r, v, m, 1.0, 1.0)
    assert np.allclose(adv, [[0.8, 0.5, 0, 0.6]]) and np.allclose(ret, [[1, 1, 0, 1]])  # A = R - V, returns = R
    adv, ret = learned.gae(r, v, m, 0.5, 0.5)
    # k=3: 1 - 0.4 = 0.6; k=1: 0.5*0.4 - 0.5 + 0.25*0.6 = -0.15; k=0: 0.5*0.5 - 0.2 + 0.25*(-0.15) = 0.0125
    assert np.allclose(adv, [[0.0125, -0.15, 0, 0.6]]) and np.allclose(ret, [[0.2125, 0.35, 0, 1.0]])


def test_masked_whiten_and_group_turn_normalise():
    x, m = np.array([[1.0, 5.0, 3.0], [7.0, 0.0, 0.0]]), np.array([[1, 0, 1], [1, 0, 0]])
    out = learned.masked_whiten(x, m)
    vals = np.array([1.0, 3.0, 7.0])  # mean 11/3, unbiased var 28/3
    assert np.allclose(out[m > 0], (vals - 11 / 3) / math.sqrt(28 / 3 + 1e-8)) and (out[m == 0] == 0).all()
    a = learned.group_turn_normalise([[1.0, 3.0], [2.0], [5.0, 5.0]], [0, 0, 1])
    # group 0 turns {1, 3, 2}: mean 2, std 1; group 1 {5, 5}: std 0 -> 0
    assert np.allclose(a[0], [-1, 1], atol=1e-5) and np.allclose(a[1], [0]) and np.allclose(a[2], [0, 0])


def test_craft_token_weights_keep_the_turn_total():
    assert np.allclose(baselines.craft_token_weights([0.0, 1.0, -3.0]), [0, 0.75, 2.25])
    assert np.allclose(baselines.craft_token_weights([0.0, 0.0]), [1, 1])


# --- methods on hand-built episodes ------------------------------------------------------------------------------

def episode(line, ids, turns, reward, prompt=(5, 5)):
    """An Episode with given response ids and turns (start, end, obs_end, action), a finished outcome."""
    ep = rollout.Episode(uid=1, line=line, key=sampler.episode_key(0, 0, 1, line), question="Who?",
                         golden_answers=["Forvamouth"], prompt_ids=list(prompt))
    ep.ids, ep.mask = list(ids), [1] * len(ids)
    for start, end, obs_end, action in turns:
        ep.mask[end:obs_end] = [0] * (obs_end - end)
        ep.turns.append(rollout.Turn(start, end, end, obs_end, "", action, "", (), [-1.0] * (end - start), [], 0,
                                     "stop"))
    ep.reward, ep.done = reward, True
    return ep


class Stub:
    """The parts of train_twice.Run a method reads (accel, tok, policy, retriever), without a model."""
    def __init__(self, tok=None):
        import accelerate
        self.accel, self.tok, self.policy, self.retriever = accelerate.Accelerator(cpu=True), tok, \
            torch.nn.Linear(1, 1), None


def test_craft_adds_the_sibling_importance_credit(monkeypatch, tiny_world):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(os.path.join(tiny_world, "policy"))
    eps = [episode(j, [7, 8], [(0, 2, 2, "answer")], r) for j, r in enumerate([1.0, 0.0, 0.0])]
    gaps = {0: [0.5, 0.0], 1: [-1.0, -1.0], 2: [0.0, 0.0]}  # teacher - student per token (student lp = -1)

    def teacher(model, rows, pad, micro, temperature=1.0):  # token k of the response sits at offset + k - 1
        return [np.array([0.0] * (len(r) - 3) + [-1 + gaps[b][0], -1 + gaps[b][1]]) for b, r in enumerate(rows)]
    monkeypatch.setattr(baselines.logprobs, "token_logprobs_rows", teacher)
    run = Stub(tok)
    cfg = tt.Config(group_size=3, craft_beta=1.0)
    batch = rollout.collate(eps, 0)
    adv0 = credit.spread_over_tokens([[a] for a in credit.grpo_advantages([1.0, 0, 0], [0, 0, 0])],
                                     [[(2, 4)]] * 3, batch["input_ids"].shape[1])
    out, stats = baselines.CRAFT(cfg).token_advantages(run, 0, eps, batch, adv0)
    A = [2 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)]  # GRPO: mean 1/3, std sqrt(1/3)
    w = [math.exp(0.5), math.exp(-2.0), 1.0]  # exp(beta * turn gap sum)
    C = [(w[1] * A[1] + w[2] * A[2]) / (w[1] + w[2]) - (A[1] + A[2]) / 2,
         (w[0] * A[0] + w[2] * A[2]) / (w[0] + w[2]) - (A[0] + A[2]) / 2,
         (w[0] * A[0] + w[1] * A[1]) / (w[0] + w[1]) - (A[0] + A[1]) / 2]
    assert np.allclose(out[0, 2:4], [A[0] + 2 * C[0], A[0]], atol=1e-5)  # all the turn's credit on token 0
    assert np.allclose(out[1, 2:4], A[1] + C[1], atol=1e-5) and np.allclose(out[2, 2:4], A[2] + C[2], atol=1e-5)
    assert (out[:, :2] == 0).all() and stats["aux_tokens"] == 0 and stats["aux_fwd_tokens"] > 0


def test_agentprm_targets_average_mc_continuations_and_shared_prefixes(monkeypatch):
    # two lines with the same first turn (tokens 7, 8): one (s, a) key, visited twice factually
    eps = [episode(0, [7, 8, 0, 9], [(0, 2, 3, "search"), (3, 4, 4, "answer")], 1.0),
           episode(1, [7, 8, 0, 6], [(0, 2, 3, "search"), (3, 4, 4, "answer")], 0.0)]
    mc = {eps[0].key: 0.0, eps[1].key: 1.0}

    def fake_continue(model, tok, retriever, requests, proto):
        out = []
        for ep, t, inc, seed in requests:
            assert inc and seed == sampler.fresh_key(ep.key, sampler.MC_Q_TAG, t, 0)
            br = rollout.branch(ep, t, include_turn=True, fresh_seed=seed)
            br.turns.append(ep.turns[-1])
            br.reward, br.n_generated = mc[ep.key], 3
            out.append(br)
        return out
    monkeypatch.setattr(learned.rollout, "continue_from", fake_continue)
    run = Stub()
    q, aux = learned.AgentPRM(tt.Config(group_size=2, prm_rollouts=1)).mc_targets(run, eps, None)
    # key (7, 8): returns 1 (line 0), 0 (line 1), 0 (line 0's MC), 1 (line 1's MC) -> 0.5; final turns: own outcome
    assert np.allclose(q, [0.5, 1.0, 0.5, 0.0]) and aux == 6
    assert math.isclose(learned.soft_bce([0.5], [0.5]), math.log(2))


# --- on the tiny world: estimators learn, methods train two steps and resume exactly ------------------------------

@pytest.fixture(scope="module")
def tiny_run(tiny_world, tmp_path_factory):
    """A Run of the tiny world and one step's factual episodes (12), shared by the estimator tests."""
    torch.set_num_threads(1)
    cfg = tiny_cfg(tiny_world, str(tmp_path_factory.mktemp("est")), "--lr=2e-4")  # estimators: 2e-3
    cfg.resolve()
    run = tt.setup(cfg)
    proto = protocol.protocol_from(cfg)
    with torch.no_grad():
        prompts = rollout.step_prompts(run.rows, cfg.prompts_per_step, cfg.seed, 0)
        episodes = baselines.Method(cfg).rollout(run, 0, prompts, proto)
    for i, ep in enumerate(episodes):  # a fixed batch with both outcomes in every group, whatever the policy did
        ep.reward = float(i % 2)
    return cfg, run, episodes, proto


@pytest.mark.parametrize("name,key", [("ppo", "critic_loss"), ("spa_rl", "estimator_loss"),
                                      ("agentprm", "estimator_loss")])
def test_estimator_loss_falls_on_a_fixed_batch(tiny_run, name, key):
    cfg, run, episodes, proto = tiny_run
    cfg = tt.Config(**{**cfg.__dict__, "method": name, "prm_rollouts": 0})
    method = methods.make(cfg)
    batch = rollout.collate(episodes, run.tok.pad_token_id)
    losses = []
    for step in range(8):
        with torch.no_grad():
            if name == "ppo":
                adv, stats = method.token_advantages(run, step, episodes, batch, np.zeros(batch["input_ids"].shape))
                assert np.isfinite(adv).all() and (adv[:, 1:][batch["loss_mask"][:, 1:].numpy() == 0] == 0).all()
            else:
                adv, stats = method.turn_advantages(run, step, episodes, proto)
                assert [len(a) for a in adv] == [len(ep.turns) for ep in episodes]
        losses.append(stats[key])
        assert stats["aux_bwd_tokens"] > 0 and stats["aux_fwd_tokens"] > stats["aux_bwd_tokens"]
    assert losses[-1] < 0.85 * losses[0] and np.mean(losses[-3:]) < np.mean(losses[:3]), losses


def test_igpo_answer_logprobs_are_the_teacher_forced_gold_answer(tiny_run):
    cfg, run, episodes, proto = tiny_run
    pre, ans = baselines.IGPO(cfg).answer_ids(run.tok, "Forvamouth")
    assert run.tok.decode(pre + ans).replace(" ", "") == "<answer>Forvamouth"
    ep = episodes[0]
    row = ep.prompt_ids + pre + ans
    with torch.no_grad():
        logits = run.policy(input_ids=torch.tensor([row])).logits[0].log_softmax(-1)
    manual = np.mean([float(logits[len(row) - len(ans) - 1 + j, a]) for j, a in enumerate(ans)])
    lp = logprobs.token_logprobs_rows(run.policy, [row, row[:3]], 0, 4)
    assert len(lp[1]) == 2 and math.isclose(lp[0][-len(ans):].mean(), manual, rel_tol=1e-5)


@pytest.mark.parametrize("name", LEARNED)
def test_two_steps_and_exact_resume(tiny_world, tmp_path, name):
    """2 steps in one go == 1 step, resume from its checkpoint (estimator included), 1 more: identical metrics."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    extra = [f"--method={name}", "--eval_every=0", "--lr=1e-3"]
    tt.main(tiny_cfg(tiny_world, a, "--steps=2", *extra))
    tt.main(tiny_cfg(tiny_world, b, "--steps=1", *extra))
    assert os.path.exists(os.path.join(b, "step_000001", "estimator.pt")) == (name in ("ppo", "spa_rl", "agentprm"))
    tt.main(tiny_cfg(tiny_world, b, "--steps=2", f"--resume={b}/step_000001", *extra))
    ra, rb = read_metrics(a), read_metrics(b)
    drop = lambda r: {k: v for k, v in r.items() if not k.startswith("time")}  # noqa: E731
    assert [drop(r) for r in ra] == [drop(r) for r in rb]
    row = ra[1]
    assert row["factual_tokens"] > 0 and "aux_tokens" in row and "time_credit" in row
    assert (row["aux_tokens"] > 0) == (name == "agentprm")
    if name in ("ppo", "spa_rl", "agentprm"):  # the estimator moved, and the resumed one is the saved one
        sa = torch.load(os.path.join(a, "step_000002", "estimator.pt"))["net"]
        sb = torch.load(os.path.join(b, "step_000002", "estimator.pt"))["net"]
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
        assert json.load(open(os.path.join(b, "config.json")))["method"] == name


# --- the formulas, by hand ---
def test_spa_rl():
    np.testing.assert_allclose(learned.spa_rl_rewards([0.2, 0.4], [1, 0], alpha=0.5, beta=2.0), [2.1, 0.2])
    assert learned.spa_rl_loss([[0.2, 0.3], [0.5]], [1.0, 0.0]) == pytest.approx(0.25)
    c = [torch.tensor([0.2, 0.3], requires_grad=True), torch.tensor([0.5], requires_grad=True)]
    loss = learned.spa_rl_loss(c, torch.tensor([1.0, 0.0]))
    loss.backward()  # d/dc = 2 (sum c - R) / n
    assert c[0].grad.tolist() == pytest.approx([-0.5, -0.5]) and c[1].grad.tolist() == pytest.approx([0.5])


def test_agentprm():
    q = learned.agentprm_targets([("s", "a"), ("s", "a"), ("s", "b"), ("t", "a")], [1.0, 0.0, 0.81, 0.5])
    np.testing.assert_allclose(q, [0.5, 0.5, 0.81, 0.5])
    assert learned.soft_bce([0.5], [0.5]) == pytest.approx(math.log(2))
    assert learned.soft_bce([0.8, 0.2], [1.0, 0.0]) == pytest.approx(-math.log(0.8))
