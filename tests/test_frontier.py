"""The credit frontier's knobs and lab/frontier.py: at q = 1 with K twins the Horvitz-Thompson credit is the mean of
the K differences; the twin term alone (traj_term = false) leaves 0 where no twin differs; the independent
counterfactual branches the same decisions with fresh keys after y'; the oracle at M = 1; the labels of the ladder;
the choices written once; the frontier's report rebuilt by hand from a small fake set of runs."""
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
from test_train import tiny_cfg

import credit
import eval as qa_eval
import methods
import rollout
import train_twice as tt
import twice
from lab import benchmark as bm
from lab import frontier
from methods import oracle


def make_run(cfg):
    policy, tok = qa_eval.load_policy(cfg.model)
    return SimpleNamespace(accel=SimpleNamespace(num_processes=1, unwrap_model=lambda m: m), policy=policy, tok=tok,
                           retriever=qa_eval.load_retriever(cfg.index, ""), method=methods.make(cfg),
                           predictor=credit.DiscordancePredictor(),
                           sigma_hat=credit.RunningScale(cfg.scale_decay, cfg.twin_scale))


def episodes(cfg, run, n=4):
    proto = tt.protocol.protocol_from(cfg)
    eps = rollout.run_episodes(run.policy, run.tok, run.retriever, rollout.start_episodes(
        run.tok, qa_eval.load_qa(cfg.train_data)[:n], cfg.seed, 0, cfg.group_size), proto)
    return eps, rollout.collate(eps, run.tok.pad_token_id), proto


def spy(monkeypatch, diffs=None):
    """rollout.run_twins as it is, recording its twins; with diffs (a generator), each twin's D drawn from it."""
    seen, real = [], rollout.run_twins

    def recording(*args, **kw):
        out = real(*args, **kw)
        for x in out:
            if diffs is not None:
                x.diff = float(next(diffs))
        seen.extend(out)
        return out
    monkeypatch.setattr(rollout, "run_twins", recording)
    return seen


def test_q1_with_k_twins_credits_the_mean_difference_and_the_term_alone_is_zero_where_none_differs(
        tiny_world, monkeypatch):
    K = 3
    cfg = tiny_cfg(tiny_world, "unused", "--budget_rule=all", f"--twins_per_decision={K}", "--traj_term=false",
                   "--twin_cap=0", "--twin_scale=rms")
    run = make_run(cfg)
    eps, batch, proto = episodes(cfg, run)
    rng = np.random.default_rng(0)
    # a third of the decisions with every D = 0, the rest -1, 0 or +1 at random
    seen = spy(monkeypatch, iter([0.0] * (3 * K) + list(rng.choice([-1.0, 0.0, 1.0], size=10_000))))
    adv, stats = twice.twin_credit(cfg, run, 0, eps, batch, proto)
    decisions = twice.decision_table(cfg, eps)
    assert stats["q_mean"] == 1.0 and len(stats["twins"]) == K * len(decisions.index)
    diffs = {}
    for tw in seen:  # the twins come decision-major, K each, in the decision table's order
        diffs.setdefault((tw.twin.uid, tw.twin.line, tw.turn), []).append(tw.diff)
    a_hat = [np.mean(diffs[eps[i].uid, eps[i].line, t]) for i, t in decisions.index]  # HT at q = 1: the mean
    nonzero = np.array([a for a in a_hat if a != 0])
    sigma = np.sqrt(np.mean(nonzero ** 2))  # rms scale: this batch's, the first
    assert run.sigma_hat.value == pytest.approx(sigma)
    zero = 0
    for (i, t), a in zip(decisions.index, a_hat):
        ep, turn = eps[i], eps[i].turns[t]
        row = adv[i, len(ep.prompt_ids) + turn.start:len(ep.prompt_ids) + turn.end]
        np.testing.assert_allclose(row, a / sigma, rtol=1e-12)  # no A_traj under it
        zero += a == 0
        if a == 0:
            assert np.all(row == 0.0)
    assert zero >= 3 and len(nonzero) > 3  # both cases were met
    # with A_traj (the default) the same twins add to GRPO's broadcast
    cfg2 = tiny_cfg(tiny_world, "unused", "--budget_rule=all", f"--twins_per_decision={K}", "--twin_cap=0",
                    "--twin_scale=rms")
    run2 = make_run(cfg2)
    a_traj = run2.method.trajectory_advantages(eps)
    monkeypatch.undo()
    spy(monkeypatch, iter([0.0] * (3 * K) + list(np.random.default_rng(0).choice([-1.0, 0.0, 1.0], size=10_000))))
    adv2, _ = twice.twin_credit(cfg2, run2, 0, eps, batch, proto)
    for (i, t), a in zip(decisions.index, a_hat):
        ep, turn = eps[i], eps[i].turns[t]
        np.testing.assert_allclose(adv2[i, len(ep.prompt_ids) + turn.start:len(ep.prompt_ids) + turn.end],
                                   a_traj[i] + a / sigma, rtol=1e-12)


def test_independent_twins_branch_the_same_decisions_with_fresh_keys_after_the_decision(tiny_world, monkeypatch):
    twins, seen = {}, spy(monkeypatch)
    for method in ("twice", "independent"):
        cfg = tiny_cfg(tiny_world, "unused", f"--method={method}", "--budget_rule=all", "--twins_per_decision=2",
                       "--traj_term=false")
        run = make_run(cfg)
        eps, batch, proto = episodes(cfg, run, n=3)
        seen.clear()
        twice.twin_credit(cfg, run, 0, eps, batch, proto)
        twins[method] = list(seen)
    factual = {(ep.uid, ep.line): ep for ep in eps}
    coupled, fresh = twins["twice"], twins["independent"]
    # the same decisions and twin indices j, every decision branched
    assert [(t.twin.uid, t.twin.line, t.turn, t.j) for t in coupled] == \
        [(t.twin.uid, t.twin.line, t.turn, t.j) for t in fresh]
    assert len(coupled) == 2 * sum(len(ep.turns) for ep in eps)
    assert {t.kind for t in fresh} == {"rollout"}  # self-twins rolled out, no shortcut
    for c, f in zip(coupled, fresh):
        ep, t = factual[c.twin.uid, c.twin.line], c.turn
        later = range(t + 1, t + 4)  # the keys of the turns after the decision (those a twin may play)
        assert all(c.twin.key_for(u) == ep.key_for(u) for u in later)  # same luck
        assert all(f.twin.key_for(u) != ep.key_for(u) for u in (t, *later))  # fresh luck
        assert c.twin.key_for(t) != ep.key_for(t) and f.twin.key_for(t) != c.twin.key_for(t)


def test_the_oracle_at_one_rollout_per_side():
    # two decisions: Q and V from one rollout each (outcome, tokens)
    x = [(1, 5), (0, 7), (0, 3), (0, 4)]
    est = oracle.estimates(x, 2, 1)
    np.testing.assert_array_equal(est["a"], [1.0, 0.0])
    assert np.all(np.isnan(est["se"])) and list(est["tokens"]) == [12.0, 7.0]
    assert tt.parse_config(["--method=oracle", "--oracle_rollouts=1"]).oracle_rollouts == 1
    with pytest.raises(ValueError, match="oracle_rollouts"):
        tt.parse_config(["--method=oracle", "--oracle_rollouts=0"])


def test_the_ladder_reads_as_flags_and_the_knobs_are_checked():
    assert bm.flags("twice-turn-q1-w1-cap2-solo-k16") == [
        "--method=twice", "--twin_unit=turn", "--budget_rule=all", "--omega=1.0", "--twin_scale=rms",
        "--twin_cap=2.0", "--traj_term=false", "--twins_per_decision=16"]
    assert bm.flags("independent-q1-w1-cap2-solo-k4") == [
        "--method=independent", "--budget_rule=all", "--omega=1.0", "--twin_scale=rms", "--twin_cap=2.0",
        "--traj_term=false", "--twins_per_decision=4"]
    assert bm.flags("twice-turn-q1-w1-cap2-solo-noshort")[-1] == "--same_evidence_shortcut=false"
    assert frontier.counterpart("twice-turn-q1-w1-cap2-solo-k4-noshort") == "independent-q1-w1-cap2-solo-k4"
    for lab in frontier.dev_labels({"best_coupled": frontier.LADDER["e"]}):
        tt.parse_config(["configs/chains.cfg", *bm.flags(lab), *frontier.FLAGS])  # every arm is a valid run
    for bad in ("twice-turn-q2-w1", "twice-turn-b0.7-w1-kx", "independent-q1-w1-solo-y"):
        with pytest.raises(ValueError, match="cannot read"):
            bm.flags(bad)
    with pytest.raises(ValueError, match="traj_term"):
        tt.parse_config(["--method=grpo", "--traj_term=false"])
    q = credit.solve_budget([0.1, 0.0, 0.9], [5, 7, 9], 1.0, rule="all")
    assert list(q.q) == [1.0, 1.0, 1.0] and q.spent == 21.0


# --- the report, from a small fake set of runs ---

def fake(label, seed, ems, factual=1000, aux=0, oracle_tokens=0, n=frontier.N, every=frontier.EVERY):
    """A finished frontier run: EM ems[k] before update every * k, ems[-1] after the n-th; tokens per step."""
    d = bm.run_dir(label, seed, frontier.RESULTS)
    os.makedirs(d, exist_ok=True)
    json.dump({"seed": seed}, open(f"{d}/config.json", "w"))
    rows = []
    for k in range(n):
        row = {"step": k, "factual_tokens": factual, "aux_tokens": aux, "tokens": (factual + aux) * (k + 1)}
        row.update({"oracle_tokens": oracle_tokens} if oracle_tokens else {})
        row.update({"eval_em": ems[k // every]} if k % every == 0 else {})
        rows.append(row)
    rows.append({"step": n, "final": True, "tokens": (factual + aux) * n, "eval_em": ems[-1]})
    open(f"{d}/metrics.jsonl", "w").write("".join(json.dumps(r) + "\n" for r in rows))
    json.dump({"wall_s": 120.0}, open(f"{d}/meta.json", "w"))


def flat(start, end):
    """EM at start before every evaluation but the last, end after the last update."""
    return [start] * (frontier.N // frontier.EVERY) + [end]


@pytest.fixture
def results(tmp_path, monkeypatch):
    for attr, name in (("RESULTS", "frontier"), ("FIGURE", "frontier.png"), ("CURVES", "curves.png")):
        monkeypatch.setattr(frontier, attr, str(tmp_path / name))
    return tmp_path


def test_the_frontier_table_by_hand(results):
    seeds = bm.DEV_SEEDS
    for s in seeds:
        fake("grpo", s, flat(0.2, 0.4))
        fake("grpo-g16", s, flat(0.2, 0.5 + 0.01 * s), factual=3000)  # 3x the tokens: +0.1 (+0.01 s)
        fake("grpo-g64", s, flat(0.2, 0.6), factual=9000)  # 9x: +0.2
        fake(frontier.ORACLE, s, flat(0.2, 0.8), oracle_tokens=50000)  # the oracle's rollouts count: 51x, +0.4
        # q = 1, K = 4: 1000 twin tokens on 1000 factual (2x), +0.3 after N; EM 0.3 from update 2 on
        fake(frontier.LADDER["d"], s, [0.2] + [0.3] * (frontier.N // frontier.EVERY - 1) + [0.7], aux=1000)
        fake(frontier.counterpart(frontier.LADDER["d"]), s, flat(0.2, 0.4 + 0.01 * s), aux=3000)  # 4x
    runs = frontier.load(frontier.dev_labels({}), seeds)
    pts = frontier.points(runs, {})
    d = pts[frontier.LADDER["d"]]
    assert d["cost"] == pytest.approx(2.0) and d["after"] == pytest.approx((0.3, 0.0))
    assert d["share"] == pytest.approx(0.75) and d["factual"] == 1000 and d["aux"] == 1000
    # mean over updates 0..20 of EM - GRPO's: +0.1 from update 2 to 18 (trapezoids), then rising to +0.3 at 20
    want = (0.1 / 2 * 2 + 0.1 * 16 + (0.1 + 0.3) / 2 * 2) / frontier.N
    assert d["mean"][0] == pytest.approx(want)
    # the rows line at 2x (log-interpolated between G = 5 at 1x, +0, and G = 16 at 3x, +0.1 + 0.01 s)
    line = [(0.1 + 0.01 * s) * np.log(2) / np.log(3) for s in seeds]
    assert d["over_rows"][0] == pytest.approx(np.mean([0.3 - v for v in line]))
    ind = pts[frontier.counterpart(frontier.LADDER["d"])]
    # at 4x: between G = 16 (3x) and G = 64 (9x); the seed's G = 16 gain 0.1 + 0.01 s
    x = np.log(4 / 3) / np.log(3)
    assert ind["over_rows"][0] == pytest.approx(np.mean([
        0.01 * s - ((0.1 + 0.01 * s) * (1 - x) + 0.2 * x) for s in seeds]))
    assert np.isnan(pts[frontier.ORACLE]["over_rows"][0])  # 51x: past the rows' range of cost
    assert pts[frontier.ORACLE]["cost"] == pytest.approx(51.0)
    text = frontier.build_report()
    row = next(r for r in text.splitlines() if f"| {frontier.LADDER['d']} |" in r)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:2] == ["coupled", "d"] and cells[4] == "1000 + 1000" and cells[5] == "2.00"
    assert cells[7] == "+0.300 +- 0.000" and cells[9] == "0.75" and cells[12] == "2.0"
    assert "- coupled: twice-turn-q1-w1-cap2-solo-k4 (d) at 2.00x GRPO's tokens per update, share 0.75" in text  # (i)
    # G = 16: 0.11 / 0.4; G = 64's 0.6 - 0.4 is a hair under 0.2 in floating point, so under half
    assert "- rows: none (G=16 0.27, G=64 0.50)" in text
    assert "- oracle: no arm besides M = 16 run yet" in text and "- vineppo: not run yet" in text
    assert "- (d) +0.290 +- 0.006 (+0.300 +- 0.000 against +0.010 +- 0.006)" in text  # (ii), paired by seed
    # (iii): the rows line reaches +0.01 at 3 ** (0.01 / 0.11) = 1.1050x; (d)'s +0.3 never (G = 64: +0.2 at 9x)
    assert f"  - {frontier.counterpart(frontier.LADDER['d'])} (d): +0.010 at 4.00x; the rows line: 1.11x" in text
    assert f"  - {frontier.LADDER['d']} (d): +0.300 at 2.00x; the rows line: beyond the rows' largest gain (+0.200 " \
           "at 9.00x)" in text
    assert os.path.isfile(frontier.FIGURE) and os.path.isfile(frontier.CURVES)


def test_runs_of_another_schedule_are_refused_and_choices_are_written_once(results):
    fake("grpo", 0, [0.2] * 6, n=10)  # a 120k-token run: 10 updates
    with pytest.raises(ValueError, match="10 updates.*needs 20"):
        frontier.load(["grpo"], (0,))
    assert frontier.choose() == {}  # nothing to choose from
    for s in bm.DEV_SEEDS:
        fake("grpo", s, flat(0.2, 0.4))
        for k, lab in enumerate(frontier.LADDER.values()):
            fake(lab, s, flat(0.2, 0.7 if k == 4 else 0.4 + 0.05 * k), aux=500 * (k + 1))  # (e) the best
    ch = frontier.choose()
    assert ch["best_coupled"] == frontier.LADDER["e"] and "heldout" not in ch
    stages = [[lab for lab, _ in stage] for stage in frontier.stages("dev")]
    assert stages[1][0] == frontier.LADDER["e"] + "-noshort" and stages[4][0] == frontier.LADDER["e"] + "-data"
    assert stages[5] == ["grpo-g128"] * 3 and stages[3][:5] == list(frontier.MC)
    for s in bm.DEV_SEEDS:  # every other dev arm; the oracle gains +0.4, so half is +0.2: (e), +0.3, the only taker
        for lab in frontier.dev_labels(ch):
            if not frontier.done(lab, s):
                fake(lab, s, flat(0.2, 0.8 if lab == frontier.ORACLE else 0.4), aux=1000)
    ch = frontier.choose()
    assert ch["heldout_coupled"] == frontier.LADDER["e"] and ch["heldout_takes_half"]
    # (e) spends 2500 twin tokens on 1000 factual: the rows arm of its cost is G = round(5 x 3.5) = 18 (17.5 to even)
    assert ch["heldout"] == ["grpo", frontier.LADDER["e"], frontier.counterpart(frontier.LADDER["e"]), "grpo-g18",
                             frontier.ORACLE]
    fake(frontier.LADDER["e"], 0, flat(0.2, 0.1), aux=2500)  # a later run changes no choice
    assert frontier.choose() == ch
    assert [lab for lab, _ in frontier.stages("heldout")[0]][:5] == ch["heldout"]


def test_the_gradient_audit_beside_training(results, monkeypatch):
    monkeypatch.setattr(frontier, "GRADAUDIT", str(results / "gradaudit"))
    assert list(frontier.ranks([3.0, 1.0, 3.0, 2.0])) == [3.5, 1.0, 3.5, 2.0]
    assert frontier.spearman([1, 2, 3, 4], [10, 20, 25, 40]) == pytest.approx(1.0)
    assert frontier.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    for s in bm.DEV_SEEDS:
        fake("grpo", s, flat(0.2, 0.4))
        for k, lab in enumerate(frontier.LADDER.values()):
            fake(lab, s, flat(0.2, 0.4 + 0.05 * k), aux=500 * (k + 1))
    audit = {lab: {"cos": 0.1 * k if k != 2 else 0.05, "cos_se": 0.01, "aux_tokens_per_decision": 2.0 * k}
             for k, lab in enumerate(["grpo", *frontier.LADDER.values()])}
    os.makedirs(results / "gradaudit" / "luck-high-frontier-warm")
    json.dump({"methods": audit}, open(results / "gradaudit" / "luck-high-frontier-warm" / "gradaudit.json", "w"))
    pts = frontier.points(frontier.load(frontier.dev_labels({}), bm.DEV_SEEDS), {})
    text = "\n".join(frontier.audit_table(pts))
    # training: grpo and a tie (+0), then b < c < d < e (ranks 1.5 1.5 3 4 5 6); the cosines order grpo < b < a < c <
    # d < e (ranks 1 3 2 4 5 6): Pearson of the ranks 15.5 / sqrt(17.5 x 17)
    rho = 15.5 / np.sqrt(17.5 * 17)
    assert f"cos (warm) against training: {rho:+.2f} (EM after N)" in text and f"{rho:+.2f}" == "+0.90"
    assert "| twice-turn-q1-w1-cap2-solo-k16 | 0.500 +- 0.010 | 10.0 | +0.200 +- 0.000 |" in text
