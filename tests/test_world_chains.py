"""Tests for worlds/chains.py (worlds/build.py --preset chains): one test-scale chains world is built once through the
CLI and checked for determinism, solvability by the perfect script, and chains reachable by searching entity names."""
import json
import os
import re

import pytest

from worlds import build as world
from worlds import base as world_base
from worlds import chains as world_chains
from eval import read_jsonl
from protocol import reward

SEED = 5


@pytest.fixture(scope="module")
def world_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("chains") / "world"
    world.main(["--out", str(out), "--seed", str(SEED), "--preset", "chains", "--scale", "test"])
    return str(out)


@pytest.fixture(scope="module")
def built(world_dir):
    import retriever
    with open(os.path.join(world_dir, "world.json")) as f:
        blob = json.load(f)
    retr = retriever.Retriever(os.path.join(world_dir, "index"))
    names = world_base.entity_names(blob["world"])
    top = dict(zip(names, retr.search(names, topk=world_base.TOPK)))
    rows = {s: [r for _, r in read_jsonl(os.path.join(world_dir, f"{s}.jsonl"))] for s in ("train", "test")}
    return {"world": blob["world"], "stats": blob["stats"], "top": top, "rows": rows}


def test_files_and_question_mix(world_dir, built):
    assert sorted(os.listdir(world_dir)) == ["corpus.jsonl", "index", "policy", "test.jsonl", "train.jsonl",
                                             "world.json"]
    for split, rows in built["rows"].items():
        assert {r["data_source"] for r in rows} == {f"chains_{h}hop" for h in (1, 2, 3, 4)}
        assert built["stats"]["questions_per_hop"][split]["4"] == sum(r["metadata"]["hops"] == 4 for r in rows)
    # the full-scale world (no build needed for its questions): at least 30% of the questions need 4 searches
    full = world_chains.make_chains_world(0, "full")
    for split in ("train", "test"):
        rows = world_chains.chains_question_rows(full, split)
        assert sum(r["metadata"]["hops"] == 4 for r in rows) / len(rows) >= 0.3


def test_test_subjects_never_in_train_questions(built):
    test_subjects = set(built["world"]["test_subjects"])
    assert test_subjects == {r["metadata"]["subject"] for r in built["rows"]["test"]}
    for r in built["rows"]["train"]:
        assert not test_subjects & set(re.findall(r"\w+", r["question"]))


def test_every_chain_is_reachable_by_searching_entity_names(built):
    """Searching each link's name retrieves its own document at rank 1, which states the next link; the last link
    is the gold answer, and no answer or bridge is named in the question."""
    top = built["top"]
    for r in built["rows"]["train"] + built["rows"]["test"]:
        name, chain = r["metadata"]["subject"], r["metadata"]["chain"]
        assert len(chain) == r["metadata"]["hops"] and chain[-1] == r["golden_answers"][0]
        for rel, value in zip(world_chains.CHAIN_RELS, chain):
            doc = top[name][0]
            assert world_base.doc_title(doc) == name
            first = world_chains.CHAIN_DOC[rel].split(". ")[0].format(name, value)
            assert doc["contents"].split("\n")[1].startswith(first + ". ")
            assert value not in re.findall(r"\w+", r["question"])
            name = value
    assert built["stats"]["retrieval_check"]["rank1"] == 1.0


def test_lookalikes_and_neighbours_point_down_wrong_chains(built):
    world, top = built["world"], built["top"]
    look = world["lookalike"]
    for a, b in look.items():
        assert look[b] == a and a != b and world_base.doc_title(top[b][0]) == b  # the distractor really is retrieved
        rels = world_chains.CHAIN_RELS[world_chains.CHAIN_RELS.index(world_chains.chain_rel(world, a)):]
        assert all(x != y for x, y in zip(world_chains.chain_of(world, a, rels), world_chains.chain_of(world, b, rels)))
    for n, m in world["neighbour"].items():  # every document names a second entity with a different fact
        rel = world_chains.chain_rel(world, n)
        assert m != n and world_base.relation(world, m, rel) != world_base.relation(world, n, rel)
        assert f" {m}," in top[n][0]["contents"]


def test_perfect_script_solves_every_question_with_one_search_per_hop(built):
    world, top = built["world"], built["top"]
    rows = built["rows"]["train"] + built["rows"]["test"]
    assert world_base.scripted_em(world_chains.chains_episode, world, rows, top, 0, perfect=True) == 1.0
    assert built["stats"]["scripted_em"]["test"]["perfect"] == 1.0
    rng = world_base.make_rng(0, 7)
    for r in rows:
        turns, _ = world_chains.chains_episode(r, world, top, rng, perfect=True)
        assert len(turns) == r["metadata"]["hops"] + 1 <= world_base.MAX_SEARCHES + 1
        assert all(t.endswith("</search>") for t, _ in turns[:-1]) and turns[-1][0].endswith("</answer>")
        assert reward(world_base.episode_response(turns), r["golden_answers"]) == 1.0


def test_imperfect_script_makes_each_mistake_and_fails_more(built):
    world, top = built["world"], built["top"]
    rows = (built["rows"]["train"] + built["rows"]["test"]) * 20
    assert world_base.scripted_em(world_chains.chains_episode, world, rows, top, 0, perfect=False) < 0.6
    rng, picks = world_base.make_rng(0, 8), set()
    for r in rows:
        picks |= set(world_chains.chains_episode(r, world, top, rng)[1])
    for mistake in (("search", "lookalike"), ("read", "misread"), ("bridge", "answer_early"),
                    ("last_bridge", "stop_short"), ("after_lookalike", "trust"), ("after_lookalike", "notice")):
        assert mistake in picks


def test_think_blocks_vary_and_names_are_single_tokens(built, world_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(os.path.join(world_dir, "policy"))
    world, top = built["world"], built["top"]
    for name in world_base.entity_names(world):
        assert len(tok(" " + name, add_special_tokens=False)["input_ids"]) == 1, name
    lengths = []
    rng = world_base.make_rng(0, 9)
    for r in built["rows"]["train"]:
        for text, _ in world_chains.chains_episode(r, world, top, rng)[0]:
            ids = tok(text, add_special_tokens=False)["input_ids"]
            assert tok.decode(ids) == text
            lengths.append(len(ids))
    assert sum(lengths) / len(lengths) >= 40 and max(lengths) - min(lengths) >= 20


def test_stats_fields(built):
    warm = built["stats"]["warm_start"]["test"]
    for key in ("greedy_em", "sampled_em", "mixed_groups", "turns_mean", "tokens_per_turn_mean", "per_hop", "oracle"):
        assert key in warm
    assert 0 <= warm["oracle"]["share_positive_in_failed"] <= 1 and warm["oracle"]["decisions"] > 0


def test_world_is_deterministic_in_the_seed():
    def dump(seed):
        world = world_chains.make_chains_world(seed, "test")
        return json.dumps([world_chains.chains_corpus_rows(world), world_chains.chains_question_rows(world, "train"),
                           world_chains.chains_question_rows(world, "test")])
    assert dump(SEED) == dump(SEED)
    assert dump(SEED) != dump(SEED + 1)


def test_rebuild_is_bit_for_bit_identical(world_dir, tmp_path):
    again = str(tmp_path / "again")
    world.build_world(again, seed=SEED, scale="test", preset="chains")
    assert world.differing_files(world_dir, again) == []
    with open(os.path.join(world_dir, "world.json")) as f, open(os.path.join(again, "world.json")) as g:
        a, b = json.load(f), json.load(g)
    assert a["world"] == b["world"] and a["stats"]["warm_start"] == b["stats"]["warm_start"]


def test_stop_calibration_covers_every_decision_position(world_dir, built, capsys):
    """`worlds/build.py --calibration`: one row per (hops, decision kind, position) of the scripted perfect episodes
    and one per hop count for the last read, counting every question once, with probabilities in [0, 1] and the
    script's own probability beside them."""
    world.main(["--calibration", world_dir, "--seed", str(SEED)])
    out = capsys.readouterr().out
    cal = json.loads(out[out.find("{"):])
    test = built["rows"]["test"]
    hop_counts = {q["metadata"]["hops"] for q in test}
    expect = {f"{h}hop/{'answer' if k == h else 'last_bridge' if k == h - 1 else 'bridge'}@{k}"
              for h in hop_counts for k in range(1, h + 1)}
    assert set(cal) == expect | {f"{h}hop/read_last" for h in hop_counts}
    probs = world_chains.CHAIN_PROBS
    script = {"answer": 1.0, "last_bridge": probs["last_bridge"]["stop_short"],
              "bridge": probs["bridge"]["answer_early"], "read_last": probs["read"]["right"]}
    for key, row in cal.items():
        hops = int(key[0])
        assert row["n"] == sum(q["metadata"]["hops"] == hops for q in test)
        if key.endswith("read_last"):
            assert 0.0 <= row["p_misread"] and row["p_right"] + row["p_misread"] <= 1.0 + 1e-3
        else:
            assert 0.0 <= row["p_stop"] <= 1.0
        assert row["script"] == script[key.split("/")[1].split("@")[0]]


def test_calibration_of_a_trained_policy(world_dir, tmp_path, capsys):
    """`--calibration WORLD --policy DIR` reads DIR's policy on WORLD's episodes: the world's own policy gives the warm
    start's calibration, changed weights give other probabilities; --policy alone is refused."""
    import shutil
    from safetensors.torch import load_file, save_file
    warm = world_chains.stop_calibration(world_dir, seed=SEED)
    same = shutil.copytree(os.path.join(world_dir, "policy"), tmp_path / "same")
    assert world_chains.stop_calibration(world_dir, seed=SEED, policy=str(same)) == warm
    other = shutil.copytree(same, tmp_path / "other")
    weights = load_file(str(other / "model.safetensors"))
    weights = {k: v * 0.5 if v.dim() == 2 else v for k, v in weights.items()}  # a different policy, same shapes
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    world.main(["--calibration", world_dir, "--policy", str(other), "--seed", str(SEED)])
    out = capsys.readouterr().out
    changed = json.loads(out[out.find("{"):])
    assert set(changed) == set(warm) and changed != warm
    with pytest.raises(SystemExit):
        world.main(["--policy", str(other)])


def suite_world(built, name):
    return {**built["world"], "preset": name, "suite": world_chains.SUITE[name],
            "probs": world_chains.suite_probs(**world_chains.SUITE[name])}


def test_the_suite_scripts_move_only_their_knobs(built):
    """luck: the last read misreads at the world's rate, earlier reads at chains'; delay: the first bridge stops
    early at 0.65 and the last bridge continues as the others; the entities, documents and questions are chains'."""
    rows = built["rows"]["train"]
    for name, knobs in world_chains.SUITE.items():
        w = suite_world(built, name)
        assert world_chains.chains_question_rows(w, "train") == rows
        assert world_chains.chains_corpus_rows(w) == world_chains.chains_corpus_rows(built["world"])
        rng, picks = world_base.make_rng(1, 2), {}
        for _ in range(40):
            for r in rows:
                for row, pick in world_chains.chains_episode(r, w, built["top"], rng)[1]:
                    picks.setdefault(row, []).append(pick)
        misread = picks["read_last"].count("misread") / len(picks["read_last"])
        assert abs(misread - knobs["luck"]) < 0.05, (name, misread)
        assert abs(picks["read"].count("misread") / len(picks["read"]) - 0.12) < 0.05
        if knobs["delay"] == "first":
            first = picks["first_bridge"]
            assert abs(first.count("answer_early") / len(first) - 0.65) < 0.05
            assert picks["last_bridge"].count("stop_short") / len(picks["last_bridge"]) < 0.2
        else:
            assert "first_bridge" not in picks
    with pytest.raises(ValueError, match="delay must be"):
        world_chains.suite_probs(0.3, "middle")


def test_a_suite_world_starts_from_the_chains_policy(world_dir, built, tmp_path):
    """--init: BC starts from the chains world's policy (its sha256 in world.json), and moves it; a policy of another
    vocabulary, or none, is refused by name."""
    import hashlib
    from transformers import AutoTokenizer
    out = tmp_path / "luck"
    world.main(["--out", str(out), "--seed", str(SEED), "--preset", "luck-high", "--scale", "test", "--init",
                world_dir])
    stats = json.load(open(out / "world.json"))["stats"]
    start = open(os.path.join(world_dir, "policy", "model.safetensors"), "rb").read()
    assert stats["bc"]["init_sha256"] == hashlib.sha256(start).hexdigest()
    assert stats["preset"] == "luck-high" and stats["suite"] == {"luck": 0.5, "delay": "last"}
    assert stats["demo_probs"]["read_last"] == {"right": 0.5, "misread": 0.5}
    # from the trained chains policy, the first losses are below those of chains' own BC from scratch
    assert stats["bc"]["loss_first10"] < built["stats"]["bc"]["loss_first10"]
    assert open(out / "policy" / "model.safetensors", "rb").read() != start
    model = world.make_policy(AutoTokenizer.from_pretrained(os.path.join(world_dir, "policy")),
                              world_chains.SUITE_SCALES["test"])
    tok = AutoTokenizer.from_pretrained(os.path.join(world_dir, "policy"))
    tok.add_tokens(["Zzyzxword"])
    with pytest.raises(ValueError, match="another vocabulary"):
        world.init_policy(model, tok, world_dir)
    with pytest.raises(FileNotFoundError, match="no policy to start from"):
        world.init_policy(model, tok, str(tmp_path))


def test_calibration_refuses_a_tiny_world(tmp_path):
    d = tmp_path / "w"
    d.mkdir()
    (d / "world.json").write_text(json.dumps({"world": {"preset": "tiny"}, "stats": {}}))
    with pytest.raises(ValueError, match="not a chains world"):
        world_chains.stop_calibration(str(d))
