"""Tests for lab/audit.py: every estimator against Q(s_t, y_t) and V(s_t) computed EXACTLY by enumeration.

The policy is a tiny random Qwen2 whose logits are masked by a small grammar (turn start -> <search> / <answer> /
EOS, then a, b or c, then a closing tag or EOS), so a turn has at most 19 token sequences and a 2-turn episode
(max_turns 1, max_new_tokens 3) at most 19 x 19 continuations. Their probabilities come from the model's softmax;
the episode mechanics (observations, stop rule, reward) are rollout.execute_turn's own, so the enumeration follows
exactly the protocol the sampled estimators run through. Sampled estimates are then checked against the exact
values with a bound computed from their own empirical variance (|mean - exact| < 4 SE): every key is fixed, so
the checks are deterministic.
"""
import dataclasses
import json
import math
import os

import numpy as np
import pytest
import torch
from scipy import stats
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from lab import audit
from lab import audit_scores
from lab import audit_methods
from methods import baselines
from generation import engine
import methods
import protocol
from lab import report
import rollout

WORDS = ["[UNK]", "<|im_end|>", "<search>", "</search>", "<answer>", "</answer>", "a", "b", "c"]
DOCS = {"A": '"A"\nthe answer is a', "B": '"B"\nthe answer is b', "C": '"C"\nnothing'}
QUESTION = {"id": "q0", "question": "a or b", "golden_answers": ["a"]}
PROTO = protocol.Protocol(max_turns=1, topk=2, max_new_tokens=3, max_obs_tokens=64, gen_batch_size=8192)
R = 1500  # repeats of each sampled estimator: SE about 0.015 on credit in [-1, 1]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: a second thread only adds synchronisation on a shared 2-core machine
    yield
    torch.set_num_threads(threads)


class GrammarQwen(Qwen2ForCausalLM):
    """A random tiny Qwen2 plus a bias indexed by the previous token (-inf outside a small grammar)."""

    def forward(self, input_ids=None, **kwargs):
        out = super().forward(input_ids=input_ids, **kwargs)
        out.logits = out.logits + self.grammar[input_ids[:, -out.logits.shape[1]:]]  # (B, L, V)
        return out


class FakeRetriever:
    """Deterministic: a query holding the word `a` retrieves (A, C); any other query (B, C)."""

    def search(self, queries, topk=2):
        return [[{"id": d, "contents": DOCS[d]} for d in (("A", "C") if "a" in q.split() else ("B", "C"))][:topk]
                for q in queries]


def make_policy(seed=0):
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_tokens([AddedToken(t, normalized=False) for t in (protocol.INSTRUCTION, protocol.INVALID_ACTION_MSG)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|im_end|>",
                                  unk_token="[UNK]", clean_up_tokenization_spaces=False)
    assert len(tok(protocol.user_message(QUESTION["question"]))["input_ids"]) == 5  # instruction as one token
    ids = {w: tok.convert_tokens_to_ids(w) for w in WORDS}
    V = len(tok)
    g = torch.full((V, V), -math.inf)
    g[:, [ids["<search>"], ids["<answer>"], ids["<|im_end|>"]]] = torch.tensor([2.0, 2.0, -1.0])  # turn start
    for w in ("<search>", "<answer>"):
        g[ids[w], [ids["a"], ids["b"], ids["c"]]] = torch.tensor([1.5, 0.0, 0.0])
        g[ids[w], [ids["<search>"], ids["<answer>"], ids["<|im_end|>"]]] = -math.inf
    for w in ("a", "b", "c"):
        g[ids[w]] = -math.inf
        g[ids[w], [ids["</search>"], ids["</answer>"], ids["<|im_end|>"]]] = torch.tensor([1.0, 1.0, -1.0])
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, initializer_range=0.4,
                         eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|im_end|>"])
    model = GrammarQwen(config).eval()
    model.register_buffer("grammar", g)
    model.generation_config = GenerationConfig(eos_token_id=ids["<|im_end|>"])
    return model, tok


# --- exact enumeration through the protocol's own functions ---
def next_probs(model, contexts) -> np.ndarray:
    """(B, V) float64 next-token law after each context (right-padded forward pass, last real position)."""
    width = max(map(len, contexts))
    ids = torch.zeros((len(contexts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, ctx in enumerate(contexts):
        ids[b, :len(ctx)], mask[b, :len(ctx)] = torch.tensor(ctx), 1
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    last = logits[torch.arange(len(contexts)), mask.sum(1) - 1].double()
    return torch.softmax(last, -1).numpy()


def turn_laws(model, tok, states) -> list:
    """Every possible next turn of each unfinished state: [(token ids, probability)] (TurnStopper's stop rule)."""
    frontier, laws = [(s, [], 1.0) for s in range(len(states))], [[] for _ in states]
    while frontier:
        probs = next_probs(model, [states[s].prompt_ids + states[s].ids + ids for s, ids, _ in frontier])
        grown = []
        for (s, ids, p), row in zip(frontier, probs):
            for v in np.flatnonzero(row):
                seq = ids + [int(v)]
                text = tok.decode(seq, skip_special_tokens=False)
                stop = v == tok.eos_token_id or len(seq) >= PROTO.max_new_tokens or \
                    any(x in text for x in protocol.STOP_STRINGS)
                (laws[s].append((seq, p * row[v])) if stop else grown.append((s, seq, p * row[v])))
        frontier = grown
    assert all(abs(sum(p for _, p in law) - 1) < 1e-9 for law in laws)
    return laws


def clone(ep):
    return dataclasses.replace(ep, ids=list(ep.ids), mask=list(ep.mask), turns=list(ep.turns),
                               key_overrides=dict(ep.key_overrides))


def exact_values(model, tok, retr, states) -> np.ndarray:
    """V(s) of each unfinished state: sum_y pi(y | s) (U if y ends the episode else V(s after y))."""
    children, owner, prob, gens = [], [], [], []
    for s, law in enumerate(turn_laws(model, tok, states)):
        for ids, p in law:
            children.append(clone(states[s]))
            owner.append(s)
            prob.append(p)
            gens.append(engine.Generation(ids, [0.0] * len(ids), [0.0] * len(ids), "enum", 0))
    rollout.execute_turn(tok, retr, children, gens, PROTO)
    live = [c for c in children if not c.done]
    later = iter(exact_values(model, tok, retr, live) if live else [])
    value = np.zeros(len(states))
    for child, s, p in zip(children, owner, prob):
        value[s] += p * (child.reward if child.done else next(later))
    return value


def exact_q_v(model, tok, retr, ep, t):
    """(Q(s_t, y_t), V(s_t)) of the factual episode's decision t."""
    after = rollout.branch(ep, t, include_turn=True)
    q = after.reward if after.done else exact_values(model, tok, retr, [after])[0]
    return q, exact_values(model, tok, retr, [rollout.branch(ep, t)])[0]


@pytest.fixture(scope="module")
def world():
    """Policy, retriever, a factual episode (turn 0 searches `b`, so downstream luck matters) and exact Q, V."""
    model, tok = make_policy()
    retr = FakeRetriever()
    eps = rollout.run_episodes(model, tok, retr, rollout.start_episodes(tok, [QUESTION], 1, 0, 64), PROTO)
    ep = next(e for e in eps if len(e.turns) == 2 and e.turns[0].action == "search" and e.turns[0].content == "b")
    exact = [exact_q_v(model, tok, retr, ep, t) for t in range(2)]
    return model, tok, retr, ep, exact


def cfg(**kw):
    return audit.Config(**{"repeats": R, "chunk": 10 ** 6, "progress": False, **kw})


def assert_unbiased(samples, exact, what):
    mean, se = float(np.mean(samples)), float(np.std(samples, ddof=1) / math.sqrt(len(samples)))
    print(f"{what}: mean {mean:+.4f} exact {exact:+.4f} SE {se:.4f}")
    ok = abs(mean - exact) < 4 * se if se > 0 else abs(mean - exact) < 1e-12  # a constant must equal it exactly
    assert ok, f"{what}: mean {mean:.4f} vs exact {exact:.4f} (SE {se:.4f})"


# --- (a) the sampler's law ---
def test_keyed_sampler_law_equals_softmax(world):
    model, tok, retr, ep, _ = world
    n = 10_000
    eps = rollout.start_episodes(tok, [QUESTION], 7, 0, n)
    gens = engine.generate_turn(model, tok, eps, PROTO)
    probs = next_probs(model, [eps[0].prompt_ids])[0]
    counts = np.bincount([g.ids[0] for g in gens], minlength=len(probs))
    kept = probs > 0
    assert counts[~kept].sum() == 0 and kept.sum() == 3
    assert stats.chisquare(counts[kept], probs[kept] * n).pvalue > 1e-3  # first token
    law = {tuple(ids): p for ids, p in turn_laws(model, tok, [eps[0]])[0]}
    seen = [tuple(g.ids) for g in gens]
    assert set(seen) <= set(law)
    expected = np.array([law[k] * n for k in law])
    observed = np.array([seen.count(k) for k in law])
    big = expected >= 5  # chi-square over whole turns, the rare ones pooled
    obs, exp = np.append(observed[big], observed[~big].sum()), np.append(expected[big], expected[~big].sum())
    assert stats.chisquare(obs, exp).pvalue > 1e-3


# --- (b) twin credit, VinePPO and the oracle are unbiased for Q - V ---
def test_oracle_matches_exact_values(world):
    model, tok, retr, ep, exact = world
    orc = audit.oracle(model, tok, retr, [ep], [(0, 0), (0, 1)], cfg(oracle_rollouts=1000), PROTO)
    for t, (q, v) in enumerate(exact):
        assert abs(orc["a"][t] - (q - v)) < 4 * orc["se"][t], (t, orc["a"][t], q - v, orc["se"][t])
    assert orc["q"][1] == q and 0 < exact[0][0] < 1 and 0 < exact[0][1] < 1


@pytest.fixture(scope="module")
def repeats(world):
    """R repeats of the factual re-roll and of its coupled and independent twins, decisions t = 0 and t = 1."""
    model, tok, retr, ep, _ = world
    decisions = [(0, 0), (0, 1)]
    facts = audit.reroll(model, tok, retr, [ep], decisions, cfg(), PROTO)
    u = np.array([f.reward for f in facts]).reshape(2, R)
    return facts, u, {c: audit.twins(model, tok, retr, facts, decisions, cfg(), PROTO, c) for c in (True, False)}


@pytest.mark.parametrize("coupling", [True, False])
def test_twin_credit_is_unbiased(world, repeats, coupling):
    exact = world[4]
    _, u, tw = repeats
    for t, (q, v) in enumerate(exact):
        assert_unbiased(u[t], q, f"U_r t={t}")  # the re-rolled factual outcome has mean Q
        assert_unbiased(tw[coupling]["u"][t], v, f"U'_r t={t} coupling={coupling}")  # the twin's has mean V
        assert_unbiased(u[t] - tw[coupling]["u"][t], q - v, f"D_r t={t} coupling={coupling}")
    assert tw[coupling]["self"].any() and not tw[coupling]["self"].all()


def test_vineppo_is_unbiased(world):
    model, tok, retr, ep, exact = world
    decisions = [(0, 0), (0, 1)]
    x = audit.vine_values(model, tok, retr, [ep], decisions, cfg(repeats=600), PROTO, 2)
    for k in (1, 2):
        est, tokens = audit.vine_estimates(x, [ep], decisions, k)
        for t, (q, v) in enumerate(exact):
            assert_unbiased(est[t], q - v, f"VinePPO K={k} t={t}")
        assert np.array_equal(tokens, x[:, :, :k, 1].sum(2))


# --- (c) Horvitz-Thompson under the sqrt budget rule ---
def test_horvitz_thompson_sqrt_budget_is_unbiased(world, repeats):
    exact = world[4]
    _, u, tw = repeats
    d = u - tw[True]["u"]
    p, c = np.array([[0.5], [0.2]]).repeat(R, 1), np.array([[12.0], [4.0]]).repeat(R, 1)
    est, q, branched = audit.horvitz_thompson(d, p, c, budget=6.0, q_min=0.05, seed=3)
    lam = 6.0 / (math.sqrt(0.5 / 12) * 12 + math.sqrt(0.2 / 4) * 4)  # sum q c = budget, no clipping
    assert np.allclose(q[:, 0], lam * np.sqrt([0.5 / 12, 0.2 / 4])) and np.allclose(q, q[:, :1])
    assert abs(branched.mean(1) - q[:, 0]).max() < 0.05  # keyed branch draws hit q
    for t, (qv, v) in enumerate(exact):
        assert_unbiased(est[t], qv - v, f"HT t={t}")
    assert np.all(est[~branched] == 0) and np.allclose(est[branched], (d / q)[branched])


# --- (d) coupling reduces the variance where downstream luck matters ---
def test_coupled_variance_below_independent(world, repeats):
    q, v = world[4][0]
    _, u, tw = repeats
    d = {c: u[0] - tw[c]["u"][0] for c in (True, False)}  # decision t = 0: a search, luck in turn 1 matters
    var_exact = q * (1 - q) + v * (1 - v)  # independent U_r ~ Bern(Q), U'_r ~ Bern(V)
    var_i, var_c = d[False].var(ddof=1), d[True].var(ddof=1)
    se_var = math.sqrt(np.var((d[False] - d[False].mean()) ** 2) / R)
    print(f"Var independent {var_i:.4f} (exact {var_exact:.4f}, SE {se_var:.4f}), coupled {var_c:.4f}")
    assert abs(var_i - var_exact) < 4 * se_var
    assert var_c < var_exact - 8 * se_var  # strictly and clearly lower
    cs = audit.coupling_stats(u[:1], tw[True]["u"][:1], tw[False]["u"][:1])
    assert cs["rho"] > 0.2 and abs(cs["measured_ratio"] - var_c / var_i) < 1e-12


@pytest.mark.parametrize("coupling", [True, False])
def test_derived_rows_equal_run_twins_with_shortcut(world, repeats, coupling):
    """TWICE's shortcut row, and the trainer's uncoupled rule (self-twin and shortcut scored 0), derived from twins
    rolled out in full, equal rollout.run_twins(same_evidence_shortcut=True) twin for twin."""
    model, tok, retr = world[:3]
    facts, u, tw = repeats
    n = 300
    d, tokens = audit.with_shortcut(u[:1, :n], {k: v[:1, :n] for k, v in tw[coupling].items()}, zero_self=True)
    plain = rollout.run_twins(model, tok, retr, [(f, 0, r) for r, f in enumerate(facts[:n])], PROTO, coupling, True)
    assert tw[coupling]["same_evidence"][0, :n].any(), "no twin searched c (b's documents): the test would not bite"
    assert [x.diff for x in plain] == d[0].tolist() and [x.tokens for x in plain] == tokens[0].tolist()
    assert [x.kind == "same_evidence" for x in plain] == tw[coupling]["same_evidence"][0, :n].tolist()
    assert [x.kind == "self" for x in plain] == tw[coupling]["self"][0, :n].tolist()


# --- metrics and baselines against hand-computed values ---
def test_score_grpo_and_vine_by_hand():
    a = np.array([0.5, -0.4, 0.1])
    est = np.array([[1.0, 0.0], [1.0, -1.0], [0.0, 1.0]])
    m = audit.score(est, np.array([[2, 4], [0, 0], [6, 0]]), a, thr=0.2, factual_tokens=6.0)
    assert m["wrong_sign"] == 0.25 and m["zero"] == 0.25 and m["wrong_sign_mean"] == 0.0
    assert math.isclose(m["var"], (0.5 + 2.0 + 0.5) / 3) and m["aux_tokens"] == 2.0
    assert math.isclose(m["total_vs_grpo"], 1 + 12 / 2 / 6)
    assert math.isclose(m["corr"], np.corrcoef(est.ravel(), a.repeat(2))[0, 1])
    lines = np.zeros((1, 2, 2, 2))
    lines[0, 0, :, 0] = [1.0, 0.0]  # repeat 0: fresh lines 1, 0; repeat 1: 0, 0
    g = audit.grpo_estimates(np.array([[1.0, 1.0]]), lines, [(0, 0)], eps=0.0)
    assert np.allclose(g, [[(1 - 2 / 3) / math.sqrt(1 / 3), (1 - 1 / 3) / math.sqrt(1 / 3)]])
    ep = rollout.Episode(uid=0, line=0, key=0, question="q", golden_answers=["a"], prompt_ids=[1],
                         turns=[None, None], reward=1.0)
    x = np.zeros((2, 1, 2, 2))
    x[0, 0, :, 0], x[1, 0, :, 0], x[:, 0, :, 1] = [1.0, 0.0], [1.0, 1.0], 3
    v1, t1 = audit.vine_estimates(x, [ep], [(0, 0), (0, 1)], 1)
    v2, t2 = audit.vine_estimates(x, [ep], [(0, 0), (0, 1)], 2)
    assert v1.ravel().tolist() == [0.0, 0.0] and v2.ravel().tolist() == [0.5, 0.0] and t2.ravel().tolist() == [6, 6]
    metrics = {"VinePPO K=1": {"corr": 0.5, "aux_tokens": 20.0, "wrong_sign": 0.0},
               "VinePPO K=2": {"corr": 0.7, "aux_tokens": 40.0, "wrong_sign": 0.0}}
    vines = list(metrics)
    assert report.vine_tokens_at(metrics, vines, 0.6) == (30.0, "interpolated")
    assert report.vine_tokens_at(metrics, vines, 0.4) == (20.0, "VinePPO K=1 already")
    assert report.vine_tokens_at(metrics, vines, 0.9) == (40.0, None)
    metrics.update({"TWICE": {"corr": 0.6, "wrong_sign": 0.0, "aux_tokens": 7.0},
                    "independent": {"corr": 0.5, "wrong_sign": 0.1}})
    assert audit.targets(metrics, vines) == {"twice_wrong_sign_le_5pct": True, "twice_corr_ge_0.8": False,
                                             "better_than_independent": True, "better_than_VinePPO K=1": True,
                                             "aux_75pct_below_vineppo_at_equal_corr": True}  # 1 - 7 / 30


# --- the CLI on the test-scale tiny world ---
def test_cli_smoke(tiny_world, tmp_path):
    out = tmp_path / "audit"
    res = audit.main(audit.parse_args([
        "--world", tiny_world, "--out", str(out), "--decisions", "4", "--oracle_rollouts", "3", "--repeats", "2",
        "--vine_k", "1,2", "--max_new_tokens", "6", "--max_turns", "1", "--progress", "false", "--learned_steps", "2"]))
    assert {p.name for p in out.iterdir()} >= {"audit.json", "audit.md", "audit_scatter.png"}
    saved = json.loads((out / "audit.json").read_text())
    md = (out / "audit.md").read_text()
    assert "| estimator | wrong-sign | wrong-sign (mean of R) | zero | corr | corr (mean of R) |" in md
    names = ["TWICE", "TWICE no shortcut", "TWICE budgeted", "independent", "independent as trainer", "GRPO",
             "VinePPO K=1", "VinePPO K=2", "GiGPO", "HGPO", "IGPO", "SPA-RL", "AgentPRM"]
    assert list(saved["metrics"]) == names and all(f"| {n} |" in md for n in names)
    assert all(saved["metrics"][n]["aux_tokens"] == 0 for n in ("GiGPO", "HGPO", "IGPO", "SPA-RL"))
    assert {n: r["steps"] for n, r in saved["learned"].items()} == {"SPA-RL": 2, "AgentPRM": 2}
    assert saved["config"]["train_config"].endswith("configs/demo.cfg") and saved["method_config"]["group_size"] == 5
    assert len(saved["decisions"]) == res["oracle"]["decisions"] >= 4
    for d in saved["decisions"]:
        assert -1 <= d["a"] <= 1 and 0 <= d["se"] <= 1 and all(len(v) == 2 for v in d["estimates"].values())
        assert all(math.isfinite(x) for v in d["estimates"].values() for x in v)
    for name, m in saved["metrics"].items():
        assert m["aux_tokens"] >= 0 and m["total_vs_grpo"] >= 1 and m["var"] >= 0
        assert all(m[k] is None or 0 <= m[k] <= 1 for k in ("wrong_sign", "wrong_sign_mean", "zero"))
        assert all(m[k] is None or -1 <= m[k] <= 1 for k in ("corr", "corr_mean"))
    assert saved["metrics"]["GRPO"]["aux_tokens"] == 0 and saved["metrics"]["VinePPO K=2"]["aux_tokens"] > 0
    assert os.path.getsize(out / "audit_scatter.png") > 1000
    # --rescore recomputes the same metrics from audit.json alone (no model, no rollouts) and keeps the tokens
    rescored = audit.main(audit.parse_args(["--rescore", str(out), "--world", "/nonexistent"]))
    for name, m in saved["metrics"].items():
        for k, v in m.items():
            assert rescored["metrics"][name][k] == pytest.approx(math.nan if v is None else v, nan_ok=True), (name, k)
    assert rescored["corr_differences"].keys() == saved["corr_differences"].keys() >= {"TWICE - independent"}
    assert "paired bootstrap" in (out / "audit.md").read_text()
    with pytest.raises(SystemExit, match="audit.json not found"):
        audit.rescore(str(tmp_path / "nothing"))


def test_bootstrap_se_matches_the_binomial_and_pairs_cancel():
    """The bootstrap SE of a wrong-sign rate over N independent decisions (R = 1) is the binomial sqrt(p(1-p)/N);
    the paired SE of corr(X) - corr(X) is 0 and of corr(X) - corr(noisier X) is below either corr's own SE."""
    rng = np.random.default_rng(1)
    a = rng.choice([-1.0, 1.0], 400)
    est = np.where(np.arange(400) < 100, -a, a)[:, None]  # p = 0.25 wrong
    se = audit_scores.bootstrap_se(est, a, thr=0.5, draws=2000)
    assert se["wrong_sign_se"] == pytest.approx(math.sqrt(0.25 * 0.75 / 400), rel=0.1)
    x = (a + rng.normal(0, 1, 400))[:, None]
    y = x + rng.normal(0, 0.5, (400, 1))
    d = audit.corr_differences({"TWICE": x, "independent": x, "GRPO": y}, a)
    assert d["TWICE - independent"] == (0.0, 0.0)
    diff, se_d = d["TWICE - GRPO"]
    assert diff > 0 and 0 < se_d < min(audit_scores.bootstrap_se(e, a, 0.5)["corr_se"] for e in (x, y))


def test_shortcut_bias_is_per_decision_not_a_signed_mean():
    """Two decisions whose shortcut biases are +0.5 and -0.5: the signed mean is 0 (the old figure), the
    per-decision mean |b| is 0.5; tokens saved are what the rolled-out twins cost where it fired."""
    d_without = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    d_with = d_without + np.array([[0.5, 0.5], [-0.5, -0.5], [0.0, 0.0]])
    fired = np.array([[True, True], [True, True], [False, False]])
    tok_without, tok_with = np.full((3, 2), 10.0), np.where(fired, 2.0, 10.0)
    sc = audit.shortcut_bias(d_with, d_without, tok_with, tok_without, fired)
    assert sc["signed_mean_bias"] == 0.0 and sc["mean_abs_bias"] == 0.5 and sc["decisions_fired"] == 2
    assert sc["noise_floor"] == 0.0 and sc["mean_abs_bias_se"] == 0.0
    assert sc["tokens_saved_per_decision"] == pytest.approx(8 * 4 / 6)
    assert sc["tokens_saved_share"] == pytest.approx(32 / 60)


# --- the methods/__init__.py rows: the method's own turn_advantages, F_r's decision turn, learned estimators trained ---
@pytest.fixture(scope="module")
def method_setup():
    """Two prompts with a 2-turn factual episode each (decisions t = 0, 1: a search, then a successful answer),
    R = 2 re-rolls, G - 1 = 2 fresh lines."""
    model, tok = make_policy()
    retr = FakeRetriever()
    other = {"id": "q1", "question": "b or a", "golden_answers": ["a"]}
    lines = [rollout.run_episodes(model, tok, retr, rollout.start_episodes(tok, [q], 2, 0, 64), PROTO)
             for q in (QUESTION, other)]
    episodes = [next(e for e in eps if len(e.turns) == 2 and e.turns[0].action == "search" and e.reward == 1)
                for eps in lines]
    c = cfg(repeats=2, group_size=3)
    decisions = [(0, 0), (0, 1), (1, 0), (1, 1)]
    facts = audit.reroll(model, tok, retr, episodes, decisions, c, PROTO)
    line_eps = audit.group_lines(model, tok, retr, [QUESTION, other], c, PROTO)
    return (audit_methods.method_run(model, tok, retr), audit_methods.method_config(c), facts, line_eps, decisions,
            audit_methods.method_calls(facts, line_eps, decisions, 2), [QUESTION, other])


def test_method_row_is_the_methods_advantage_at_the_decision_turn(method_setup):
    """GiGPO's row equals baselines.GiGPO().turn_advantages on the hand-built group [F_r, the prompt's lines of
    repeat r] at F_r's decision turn t (and not at the other turn), though the audit batches both prompts in one
    call."""
    run, mcfg, facts, line_eps, decisions, calls, _ = method_setup
    assert [len(eps) for _, _, eps in calls] == [6] * 4  # (t, r) calls, each with both prompts' groups of 3
    est, aux = audit_methods.method_estimates(baselines.GiGPO(mcfg), run, calls, (4, 2), PROTO, 0)
    assert np.all(aux == 0)
    bites = 0
    for n, (i, t) in enumerate(decisions):
        for r in range(2):
            f = facts[n * 2 + r]
            group = [audit_methods.rekeyed(f, t, r), *line_eps[i][r]]
            adv, _ = baselines.GiGPO(mcfg).turn_advantages(run, 0, group, PROTO)
            assert est[n, r] == pytest.approx(adv[0][t], abs=1e-12), (n, r)
            bites += len(adv[0]) == 2 and abs(adv[0][t] - adv[0][1 - t]) > 1e-6
            assert group[0].ids == f.ids and group[0].key != f.key  # the same episode, its own continuation key
    assert bites, "GiGPO's advantage is the same at both turns everywhere: the test would not catch a wrong turn"


@pytest.mark.parametrize("name", ["spa_rl", "agentprm"])
def test_learned_rows_train_their_estimator(method_setup, name):
    """pretrain moves the estimator off its zero head through the method's own turn_advantages; every scoring call
    then restarts from that state, so the estimates do not depend on the calls before them."""
    run, mcfg, *_, calls, rows = method_setup
    method = methods.METHODS[name](dataclasses.replace(mcfg, lr=1e-3, prompts_per_step=8, micro_batch_size=32))
    rec = audit_methods.pretrain(method, run, rows, 3, PROTO)
    assert len(rec["losses"]) == 3 and all(math.isfinite(x) for x in rec["losses"]) and rec["rollout_tokens"] > 0
    assert (rec["aux_tokens"] > 0) == (name == "agentprm")  # AgentPRM's Monte Carlo continuations
    assert method.est.net.head.weight.abs().sum() > 0  # the head starts at zero (DEVIATION L1)
    head = method.est.net.head.weight.detach().clone()
    est, aux = audit_methods.method_estimates(method, run, calls, (4, 2), PROTO, 3)
    again, _ = audit_methods.method_estimates(method, run, calls[::-1], (4, 2), PROTO, 3)
    assert np.all(np.isfinite(est)) and np.array_equal(est, again)
    assert (aux.sum() > 0) == (name == "agentprm") and torch.equal(method.est.net.head.weight, head)


def test_cli_token_forks_and_text_line_keys(tiny_world, tmp_path):
    """--token_forks adds the token-fork rows beside the turn twins (with bootstrap SEs and the paired difference
    against TWICE), the predictors' AUC and Brier, and the token agreement after the decision; --line_keys=text
    reads the keys by text line (the turn-twin rows still run)."""
    out = tmp_path / "forks"
    res = audit.main(audit.parse_args([
        "--world", tiny_world, "--out", str(out), "--decisions", "4", "--oracle_rollouts", "3", "--repeats", "2",
        "--vine_k", "1", "--max_new_tokens", "6", "--max_turns", "1", "--progress", "false", "--method_rows=",
        "--token_forks", "true", "--line_keys", "text"]))
    rows = ("TWICE token (prior law)", "TWICE token", "TWICE token budgeted")
    assert all(n in res["metrics"] for n in rows + ("TWICE", "TWICE budgeted"))
    for n in rows:
        m = res["metrics"][n]
        assert m["aux_tokens"] >= 0 and m["var"] >= 0 and "corr_se" in m and "wrong_sign_se" in m
    assert m["aux_tokens"] <= res["metrics"]["TWICE token"]["aux_tokens"]  # budgeted spends at most the full row
    assert {"TWICE token - TWICE", "TWICE token budgeted - TWICE budgeted"} <= set(res["corr_differences"])
    assert set(res["predictors"]) == {"turn", "token"} and set(res["predictors"]["token"]) >= {"auc", "brier"}
    assert 0 <= res["coupling"]["token_agreement_coupled"] <= 1 and res["config"]["line_keys"] == "text"
    md = (out / "audit.md").read_text()
    assert "| TWICE token |" in md and "Token forks (forks.py)" in md and "Token agreement after the decision" in md
    for d in json.loads((out / "audit.json").read_text())["decisions"]:
        assert all(math.isfinite(x) for n in rows for x in d["estimates"][n])
        agree = d["token_agreement"]  # per decision: (agree, compared) of coupled, independent, fork passes 1, 2
        assert len(agree) == 8 and all(0 <= a <= c for a, c in zip(agree[::2], agree[1::2]))


def test_compare_coupling_by_hand(tmp_path):
    """lab/report.py coupling: pooled token agreement and the variance ratio per audit with bootstrap SEs, and the paired
    difference over the decisions two audits share (matched by question and turn)."""
    def audit_json(name, rows, line_keys):
        d = tmp_path / name
        d.mkdir()
        decisions = [{"question": q, "turn": t, "token_agreement": agree,
                      "estimates": {"TWICE no shortcut": dc, "independent": di}} for q, t, agree, dc, di in rows]
        (d / "audit.json").write_text(json.dumps({"config": {"line_keys": line_keys}, "decisions": decisions}))
        return str(d)
    a = audit_json("a", [("q1", 0, [3, 4, 1, 4], [1, 0], [1, -1]), ("q2", 1, [1, 6, 0, 6], [0, 0], [1, 0])], "group")
    b = audit_json("b", [("q2", 1, [5, 6, 0, 6], [0, 0], [1, 0]), ("q3", 0, [0, 2, 0, 2], [1, 1], [0, 1])], "text")
    rows = report.compare_coupling([a, b], draws=200).splitlines()
    assert rows[0] == "| audit | line keys | decisions | coupled | independent | var ratio |"
    # a: coupled (3 + 1) / (4 + 6) = 0.4; independent 1 / 10; var ratio mean(0.5, 0) / mean(2, 0.5) = 0.2
    assert rows[2].startswith(f"| {a} | group | 2 | 0.400 +- ")
    assert "| 0.100 +- " in rows[2] and "| 0.200 +- " in rows[2]
    # paired on q2 alone: coupled 5/6 - 1/6; a single shared decision resamples to itself (SE 0)
    assert rows[4] == f"| {b} - {a} (paired) | | 1 | +0.667 +- 0.000 | +0.000 +- 0.000 | +0.000 +- 0.000 |"
