"""lab/twinview.py (`python rollout.py replay --run DIR --step N --html FILE`): the page of a tiny-world step holds
every factual token's text and every twin's D and q as the replay computes them (parsed with html.parser), marks the
token where each twin parts from its line at the position the text replay reports, refers to nothing outside the
file; bad inputs get one line each and the run folder is left as it was."""
import json
import os
import re
import shutil
from html.parser import HTMLParser

import numpy as np
import pytest
from test_train import tiny_cfg

import eval as qa_eval
import train_twice as tt
from infra import checkpoint
from lab import replay, twinview

VOID = {"meta", "input", "br", "img", "link"}


class Page(HTMLParser):
    """The page's factual tokens per line, its twins (attributes, marked tokens) and every attribute value."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack, self.lines, self.twins, self.attrs = [], {}, [], []
        self.line = self.twin = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.attrs += [(tag, k, v) for k, v in attrs]
        if tag in VOID:
            return
        self.stack.append((tag, a))
        if tag == "div" and "line" in a.get("class", "").split():
            self.line = (int(a["data-uid"]), int(a["data-line"]))
            self.lines[self.line] = []
        if tag == "details" and a.get("class") == "twin":
            self.twin = {**a, "owner": self.line, "marked": []}
            self.twins.append(self.twin)
        if tag == "t":
            if self.twin is not None:
                if a.get("class") == "d":
                    self.twin["marked"].append(int(a["data-p"]))
            elif self.line is not None:
                self.lines[self.line].append("")

    def handle_endtag(self, tag):
        while self.stack:
            top, a = self.stack.pop()
            if top == "details" and a.get("class") == "twin":
                self.twin = None
            if top == "div" and "line" in a.get("class", "").split():
                self.line = None
            if top == tag:
                break

    def handle_data(self, data):
        if self.stack and self.stack[-1][0] == "t" and self.twin is None and self.line is not None:
            self.lines[self.line][-1] += data


@pytest.fixture(scope="module")
def run(tiny_world, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("view") / "run")
    tt.main(tiny_cfg(tiny_world, out, "--steps=2", "--eval_every=0", "--save_every=1", "--keep_checkpoints=0",
                     "--log_episodes=2", "--log_tensorboard=false", "--twins_per_decision=2"))
    return out


def snapshot(folder):
    return {os.path.relpath(os.path.join(d, f), folder): (os.path.getsize(os.path.join(d, f)),
                                                         os.path.getmtime(os.path.join(d, f)))
            for d, _, files in os.walk(folder) for f in files}


def test_the_page_holds_every_token_and_twin_as_the_replay_computes_them(run, tmp_path, capsys):
    before = snapshot(run)
    path = str(tmp_path / "step1.html")
    assert replay.main(["--run", run, "--step", "1", "--html", path]) == 0
    assert f"wrote {path}" in capsys.readouterr().out
    text = open(path, encoding="utf-8").read()
    page = Page()
    page.feed(text)
    # the replay itself: the step's batch, twins and credit as training computed them
    state = checkpoint.read_state(os.path.join(run, "step_000001"))
    cfg = tt.Config(**{k: v for k, v in state["config"].items() if k in tt.Config.__dataclass_fields__})
    policy, tok = qa_eval.load_policy(os.path.join(run, "step_000001", "policy"))
    b = replay.rank_batch(cfg, policy, tok, qa_eval.load_retriever(cfg.index, ""), qa_eval.load_qa(cfg.train_data),
                          1, 0, 1, state, True)
    assert len(page.lines) == len(b.episodes) == cfg.prompts_per_step * cfg.group_size
    for ep in b.episodes:
        want = [tok.decode([ep.ids[p]]) for t in ep.turns for p in range(t.start, t.end)]
        assert page.lines[ep.uid, ep.line] == want  # every sampled token, in order, as its own text
    twins, table = b.stats["twins"], b.stats["credit"]
    q = {(b.episodes[i].uid, b.episodes[i].line, t): q for (i, t), q in zip(table["index"], table["q"])}
    assert len(page.twins) == len(twins) > 0 and any(tw.kind == "rollout" for tw in twins)
    factual = {(ep.uid, ep.line): ep for ep in b.episodes}
    for tw in twins:
        key = (tw.twin.uid, tw.twin.line)
        shown = next(x for x in page.twins if x["owner"] == key and int(x["data-turn"]) == tw.turn
                     and int(x["data-j"]) == tw.j)
        assert float(shown["data-d"]) == tw.diff and float(shown["data-q"]) == q[key + (tw.turn,)]
        assert shown["data-kind"] == tw.kind
        part = twinview.divergence(factual[key], tw)
        assert shown["data-div"] == ("" if part is None else str(part))
        ep = factual[key]
        # marked in the factual column and in the twin's, wherever each has a sampled token there
        want = [p for rec in (ep, tw.twin) for u in rec.turns[tw.turn:] if part is not None
                for p in range(u.start, u.end) if p == part]
        assert shown["marked"] == want
    parted = next(tw for tw in twins if tw.kind == "rollout" and twinview.divergence(factual[tw.twin.uid,
                                                                                            tw.twin.line], tw))
    # the text replay prints the same position for it
    shown = replay.show(factual[parted.twin.uid, parted.twin.line], [parted])
    assert f"parts at token {twinview.divergence(factual[parted.twin.uid, parted.twin.line], parted)}" in shown
    # self-contained: no attribute points anywhere, no CSS url(), no @import
    assert not [x for x in page.attrs if x[1] in ("src", "href", "action") or "://" in (x[2] or "")]
    assert "url(" not in text and "@import" not in text and "http" not in text
    # every sampled token's colour is its advantage's: the hover values are the advantages of the tokens
    titles = {float(m.split('"')[0]) for m in text.split('title="A = ')[1:]}
    adv = {round(float(b.adv[i, len(ep.prompt_ids) + p]), 4) for i, ep in enumerate(b.episodes)
           for t in ep.turns for p in range(t.start, t.end)}
    assert {round(x, 4) for x in titles} == adv
    assert snapshot(run) == before  # nothing in the run folder was written


def test_bad_inputs_get_one_line_each_and_change_nothing(run, tmp_path, capsys):
    before = snapshot(run)
    page = str(tmp_path / "p.html")
    cases = [(["--step", "7"], "step 7 has no checkpoint step_000007"),
             (["--step", "1", "--html", str(tmp_path / "no" / "p.html")], "does not exist; create it"),
             (["--step", "1", "--html", str(tmp_path)], "a folder; give a file name")]
    for extra, message in cases:
        assert replay.main(["--run", run, "--html", page, *extra] if "--html" not in extra
                           else ["--run", run, *extra]) == 2
        out = capsys.readouterr().out.strip().splitlines()
        assert len(out) == 1 and out[0].startswith("rollout.py replay: error:") and message in out[0], out
    assert snapshot(run) == before and not os.path.exists(page)
    # past the run: step 2 has a checkpoint (the last) but rolled out nothing
    assert replay.main(["--run", run, "--step", "2", "--html", page]) == 2
    assert "step 2 was not trained in this run" in capsys.readouterr().out
    # a run of another method, and a step whose checkpoint is gone, in a copy of the run
    copy = str(tmp_path / "copy")
    shutil.copytree(run, copy)
    state_file = os.path.join(copy, "step_000001", "run.json")
    state = json.load(open(state_file))
    json.dump({**state, "config": {**state["config"], "method": "vineppo"}}, open(state_file, "w"))
    assert replay.main(["--run", copy, "--step", "1", "--html", page]) == 2
    line = capsys.readouterr().out.strip()
    assert "is a vineppo run: the page shows grpo, twice, independent, oracle runs" in line and "\n" not in line
    shutil.rmtree(os.path.join(copy, "step_000001"))
    assert replay.main(["--run", copy, "--step", "1", "--html", page]) == 2
    assert "step 1 has no checkpoint step_000001" in capsys.readouterr().out
    assert not os.path.exists(page) and snapshot(run) == before


def test_colours_and_folds():
    assert twinview.colour(0.0, 1.0) == "z" and twinview.colour(-1.0, 1.0) == f"n{twinview.BINS}"
    assert twinview.colour(0.01, 1.0) == "p1" and twinview.colour(5.0, 1.0) == f"p{twinview.BINS}"
    assert twinview.colour(float("nan"), 1.0) == "z" and twinview.colour(-0.5, 1.0) == f"n{twinview.BINS // 2 + 1}"


def test_an_oracle_page_shows_a_star_and_its_se_per_turn(tiny_world, tmp_path):
    """The oracle's step 0, replayed from the initial model: every decision's A* and SE, in order, whose means are
    the ones training logged."""
    out, path = str(tmp_path / "oracle"), str(tmp_path / "oracle.html")
    tt.main(tiny_cfg(tiny_world, out, "--method=oracle", "--oracle_rollouts=2", "--steps=1", "--eval_every=0",
                     "--log_tensorboard=false"))
    assert replay.main(["--run", out, "--step", "0", "--html", path]) == 0
    text = open(path, encoding="utf-8").read()
    shown = np.array([(float(a), float(s)) for a, s in re.findall(r"A\* ([-+][0-9.]+) ± ([0-9.]+)", text)])
    logged = json.loads(open(os.path.join(out, "metrics.jsonl")).readline())
    assert len(shown) == round(logged["turns"] * 4 * 3)  # every decision of 4 prompts x 3 lines
    assert np.abs(shown[:, 0]).mean() == pytest.approx(logged["oracle_abs"], abs=6e-4)
    assert shown[:, 1].mean() == pytest.approx(logged["oracle_se"], abs=6e-4)
    assert "twin j=" not in text and "(not in A)" in text  # no twins; the oracle alone: A_traj is not in A
