"""Tests for worlds/build.py and worlds/tiny.py: one test-scale tiny world is built once (CLI path) and checked file by file."""
import json
import os
import re

import pytest
import torch

from worlds import build as world
from worlds import base as world_base
from worlds import tiny as world_tiny
from eval import load_qa
from protocol import INVALID_ACTION_MSG, information_block, render_prompt, reward
from worlds.build import bc_loss, common_prefix, pad_batch

SEED = 3


@pytest.fixture(scope="module")
def world_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tw") / "world"
    world.main(["--out", str(out), "--seed", str(SEED), "--scale", "test"])
    return str(out)


@pytest.fixture(scope="module")
def built(world_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import retriever
    with open(os.path.join(world_dir, "world.json")) as f:
        blob = json.load(f)
    tok = AutoTokenizer.from_pretrained(os.path.join(world_dir, "policy"))
    model = AutoModelForCausalLM.from_pretrained(os.path.join(world_dir, "policy"))
    retr = retriever.Retriever(os.path.join(world_dir, "index"))
    names = world_base.entity_names(blob["world"])
    top = dict(zip(names, retr.search(names, topk=world_base.TOPK)))
    return {"world": blob["world"], "stats": blob["stats"], "tok": tok, "model": model, "retr": retr, "top": top}


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_files_and_schemas(world_dir, built):
    assert sorted(os.listdir(world_dir)) == ["corpus.jsonl", "index", "policy", "test.jsonl", "train.jsonl",
                                             "world.json"]
    corpus = read_jsonl(os.path.join(world_dir, "corpus.jsonl"))
    assert [r["id"] for r in corpus] == [str(i) for i in range(len(corpus))]
    for r in corpus:  # wiki-18: '"Title"\ntext'
        title, text = r["contents"].split("\n")
        assert title.startswith('"') and title.endswith('"') and text.startswith(title.strip('"') + " ")
    assert len(corpus) == len(world_base.entity_names(built["world"])) == built["stats"]["corpus_docs"]
    for split in ("train", "test"):
        rows = load_qa(os.path.join(world_dir, f"{split}.jsonl"))
        assert rows and {r["data_source"] for r in rows} == {"tiny_1hop", "tiny_2hop"}
        assert len(rows) == built["stats"]["questions"][split]["total"]


def test_names_are_single_tokens_and_round_trip(built):
    tok, world = built["tok"], built["world"]
    for name in world_base.entity_names(world):
        assert len(tok(" " + name, add_special_tokens=False)["input_ids"]) == 1, name
        assert len(tok(name, add_special_tokens=False)["input_ids"]) == 1, name  # the title form, after a quote
    q = world_tiny.question_rows(world, "train")[0]
    texts = [render_prompt(tok, q["question"]), INVALID_ACTION_MSG]
    texts += [information_block(world_base.docs_text(docs)) for docs in built["top"].values()]
    turns, _ = world_tiny.scripted_episode(q, world, built["top"], world_base.make_rng(0, 9))
    texts += [t for t, _ in turns]
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text


def test_chat_template_and_tags(built):
    tok = built["tok"]
    prompt = render_prompt(tok, "Where was X born")
    assert prompt.startswith("<|im_start|>user\nAnswer the given question.")
    assert prompt.endswith("Question: Where was X born?\n<|im_end|>\n<|im_start|>assistant\n")
    for tag in world_base.TAGS:  # added tokens that decode as text, as in Qwen2.5
        ids = tok(tag, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and tok.decode(ids, skip_special_tokens=True) == tag
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"


def test_lookalike_is_retrieved_and_misleads(built):
    world, top = built["world"], built["top"]
    for name, person in world["people"].items():
        look = person["lookalike"]
        assert world["people"][look]["lookalike"] == name
        assert world_base.doc_title(top[look][0]) == look  # searching the look-alike really returns its own document
        other = world["people"][look]
        assert other["born"] != person["born"] and other["works"] != person["works"]
        assert world["cities"][other["born"]] != world["cities"][person["born"]]
    assert built["stats"]["retrieval_check"]["rank1"] == 1.0


def test_answers_need_the_stated_hops(world_dir, built):
    world = built["world"]
    docs = {world_base.doc_title(r): set(re.findall(r"\w+", r["contents"]))
            for r in read_jsonl(os.path.join(world_dir, "corpus.jsonl"))}
    for split in ("train", "test"):
        for q in read_jsonl(os.path.join(world_dir, f"{split}.jsonl")):
            gold, meta = q["golden_answers"][0], q["metadata"]
            assert gold not in re.findall(r"\w+", q["question"])
            assert gold in {**world["cities"], **world["companies"], **dict.fromkeys(world["countries"])}
            if q["data_source"] == "tiny_1hop":
                assert gold in docs[meta["subject"]]
            else:  # the subject's document names the bridge, only the bridge's names the answer
                assert gold not in docs[meta["subject"]] and meta["bridge"] in docs[meta["subject"]]
                assert gold in docs[meta["bridge"]]


def test_train_test_subjects_disjoint(world_dir):
    subjects = {s: {q["metadata"]["subject"] for q in read_jsonl(os.path.join(world_dir, f"{s}.jsonl"))}
                for s in ("train", "test")}
    assert subjects["train"] and subjects["test"] and not subjects["train"] & subjects["test"]


def test_world_is_deterministic_in_the_seed():
    def dump(seed):
        world = world_tiny.make_world(seed, "test")
        return json.dumps([world_tiny.corpus_rows(world), world_tiny.question_rows(world, "train"),
                           world_tiny.question_rows(world, "test")])
    assert dump(SEED) == dump(SEED)
    assert dump(SEED) != dump(SEED + 1)


def test_rebuild_is_bit_for_bit_identical(world_dir, tmp_path):
    """The same seed rebuilds the same world: data files, index vectors and behaviour-cloned weights, byte for byte."""
    again = str(tmp_path / "again")
    world.build_world(again, seed=SEED, scale="test")
    assert world.differing_files(world_dir, again) == []


def test_perfect_script_scores_one_and_imperfect_less(built, world_dir):
    world, top = built["world"], built["top"]
    rows = read_jsonl(os.path.join(world_dir, "train.jsonl")) + read_jsonl(os.path.join(world_dir, "test.jsonl"))
    assert world_base.scripted_em(world_tiny.scripted_episode, world, rows, top, 0, perfect=True) == 1.0
    assert world_base.scripted_em(world_tiny.scripted_episode, world, rows * 5, top, 0, perfect=False) < 0.9
    assert built["stats"]["scripted_em"]["test"]["perfect"] == 1.0


def test_policy_loads_and_bc_loss_decreased(built):
    model, stats = built["model"], built["stats"]
    assert model.config.model_type == "qwen2" and model.config.vocab_size == len(built["tok"])
    assert stats["bc"]["loss_last10"] < stats["bc"]["loss_first10"]
    assert set(stats["warm_start"]) == {"train", "test"} and 0 <= stats["warm_start"]["test"]["sampled_em"] <= 1


def test_demo_mask_is_zero_on_prompt_and_observations(built):
    tok, world, top = built["tok"], built["world"], built["top"]
    q = next(q for q in world_tiny.question_rows(world, "train") if q["data_source"] == "tiny_2hop")
    turns, _ = world_tiny.scripted_episode(q, world, top, world_base.make_rng(0, 0), perfect=True)
    ids, mask = world_base.encode_episode(tok, q["question"], turns, {})
    assert len(turns) == 3 and turns[-1][1] is None
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "".join(t for t, _ in turns)
    assert tok.decode([i for i, m in zip(ids, mask) if not m]) == render_prompt(tok, q["question"]) + "".join(
        o for _, o in turns if o)
    assert reward(world_base.episode_response(turns), q["golden_answers"]) == 1.0
    assert turns[0][0].endswith("</search>") and turns[-1][0].endswith("</answer>")


def test_fast_bc_loss_equals_plain_forward(built):
    tok, world, top, model = built["tok"], built["world"], built["top"], built["model"]
    rows = world_tiny.question_rows(world, "train")[:3]
    script = world_tiny.scripted_episode
    enc = [world_base.encode_episode(tok, q["question"], script(q, world, top, world_base.make_rng(0, 1))[0], {})
           for q in rows]
    P = common_prefix([e[0] for e in enc])
    with torch.no_grad():
        batch = pad_batch(enc, [0, 1, 2], P, tok.pad_token_id)
        fast = bc_loss(model, torch.tensor(enc[0][0][:P]), *batch)
        nll, n = 0.0, 0
        for ids, mask in enc:
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1], -1)
            for j in range(1, len(ids)):
                if mask[j]:
                    nll, n = nll - logp[j - 1, ids[j]].item(), n + 1
    assert fast.item() == pytest.approx(nll / n, rel=1e-4)


def test_unknown_preset_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="preset"):
        world.build_world(str(tmp_path / "w"), scale="test", preset="nope")


def test_out_must_be_empty_without_force(tmp_path):
    (tmp_path / "stale.txt").write_text("x")
    with pytest.raises(FileExistsError, match="--force"):
        world.build_world(str(tmp_path), scale="test")
    assert os.listdir(tmp_path) == ["stale.txt"]


def test_no_temporary_folder_left(world_dir):
    parent = os.path.dirname(world_dir)
    assert [p for p in os.listdir(parent) if p.startswith(".tinyworld-")] == []
