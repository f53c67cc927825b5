"""worlds/data.py on the user's own files: `convert` (a Search-R1 / verl parquet, a FlashRAG jsonl)
into the QA jsonl that eval.load_qa reads, and `world` (a corpus and questions into a folder that
train_twice.py takes). Bad rows name file:line or `file: row N`, and nothing half-written is left.
The hub download (`searchr1`) is tests/test_reproduce.py's."""
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import eval as qa_eval
import protocol
import retriever
from worlds import data

# (data_source, question as asked, gold answers); each source numbers its rows from 0
QUESTIONS = [("nq", "who founded Brisk Corp", ["Amira Voss"]),
             ("nq", "where is Lake Orun?", ["Dalvia", "dalvia"]),
             ("hotpotqa", "what is the river of the capital of Kelora", ["Ossel"])]
# (subject, relation, answer): one corpus document per subject
FACTS = [("Kelora", "capital", "Vantis"), ("Brisk Corp", "founder", "Amira Voss"),
         ("Lake Orun", "country", "Dalvia"), ("Tamsin Rell", "birthplace", "Quorra"),
         ("Vantis", "river", "Ossel"), ("Quorra", "mayor", "Ivo Brand")]


def _searchr1_row(source, question, gold, index):
    """A row as Search-R1's scripts/data_process/nq_search.py writes it (verl's schema): the
    question only inside the prompt, after the instruction, "?" appended; no `question`,
    `golden_answers` or `id` column."""
    return {"data_source": source,
            "prompt": [{"role": "user", "content": protocol.user_message(question)}],
            "ability": "fact-reasoning",
            "reward_model": {"style": "rule", "ground_truth": {"target": gold}},
            "extra_info": {"split": "train", "index": index}}


def _parquet(path, rows) -> str:
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def _jsonl(path, lines) -> str:
    """Write lines (dicts as JSON, str as they are) and return the path."""
    os.makedirs(os.path.dirname(str(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return str(path)


def _searchr1_parquet(path) -> str:
    index = {"nq": 0, "hotpotqa": 0}
    rows = []
    for source, question, gold in QUESTIONS:
        rows.append(_searchr1_row(source, question, gold, index[source]))
        index[source] += 1
    return _parquet(path, rows)


def _corpus(path) -> str:
    return _jsonl(path, [{"id": str(i), "contents": f'"{s}"\nThe {r} of {s} is {a}.'}
                         for i, (s, r, a) in enumerate(FACTS)])


def _flashrag(path, start=0, n=len(FACTS)) -> str:
    """FACTS[start:start + n] as FlashRAG rows (no data_source), ids q<i>."""
    return _jsonl(path, [{"id": f"q{i}", "question": f"what is the {r} of {s}",
                          "golden_answers": [a]}
                         for i, (s, r, a) in list(enumerate(FACTS))[start:start + n]])


def test_a_searchr1_parquet_converts_and_round_trips_through_load_qa(tmp_path, capsys):
    src = _searchr1_parquet(tmp_path / "train.parquet")
    with pytest.raises(ValueError, match=r"row 0: missing field\(s\) \['id', 'question', "
                                         r"'golden_answers'\].*python -m worlds.data convert"):
        qa_eval.load_qa(src)  # eval.py refuses it, and names the converter
    out = str(tmp_path / "qa" / "train.jsonl")
    data.main(["convert", "--input", src, "--out", out])
    assert f"{out}: 3 QA rows" in capsys.readouterr().out
    assert qa_eval.load_qa(out) == [
        {"id": "nq_0", "question": "who founded Brisk Corp?", "golden_answers": ["Amira Voss"],
         "data_source": "nq"},
        {"id": "nq_1", "question": "where is Lake Orun?", "golden_answers": ["Dalvia", "dalvia"],
         "data_source": "nq"},
        {"id": "hotpotqa_0", "question": "what is the river of the capital of Kelora?",
         "golden_answers": ["Ossel"], "data_source": "hotpotqa"}]
    # the prompt a run renders from a converted row is the parquet's, byte for byte
    prompts = [t["prompt"][0]["content"] for t in pq.read_table(src).to_pylist()]
    assert [protocol.user_message(r["question"]) for r in qa_eval.load_qa(out)] == prompts
    assert os.listdir(tmp_path / "qa") == ["train.jsonl"]  # no partial file left


def test_question_from_prompt_reads_searchr1_and_other_templates():
    searchr1 = [{"role": "system", "content": "Be brief. Question: not this one"},
                {"role": "user", "content": protocol.user_message("Question: why")}]
    assert data.question_from_prompt(searchr1) == "Question: why?"  # all after the instruction
    few_shot = "Question: Who? Answer: <answer>A</answer>\nQuestion: where was Zorvak born\n"
    assert data.question_from_prompt(few_shot) == "where was Zorvak born"  # the last one
    with pytest.raises(ValueError, match="no user message"):
        data.question_from_prompt([{"role": "assistant", "content": "Question: x"}])
    with pytest.raises(ValueError, match=r"has no 'Question: \.\.\.'.*give the row a 'question'"):
        data.question_from_prompt([{"role": "user", "content": protocol.INSTRUCTION}])


def test_a_flashrag_jsonl_converts_with_its_dataset_as_data_source(tmp_path):
    """FlashRAG's {dataset}/{split}.jsonl: the folder names the data source and ids get it as prefix
    (DEVIATION D4); a bare-string gold answer, metadata and blank lines are fine; --data_source
    overrides the name, and a second conversion replaces the file."""
    src = _jsonl(tmp_path / "popqa" / "test.jsonl", [
        {"id": "test_0", "question": "who founded Brisk Corp", "golden_answers": ["Amira Voss"],
         "metadata": {"a": 1}},
        "", {"id": "test_1", "question": "où est Quorra ?", "golden_answers": "Dalvia",
             "metadata": {}}])
    out = str(tmp_path / "popqa.jsonl")
    assert data.convert_qa(src, out) == 2
    assert qa_eval.load_qa(out) == [
        {"id": "popqa_test_0", "question": "who founded Brisk Corp",
         "golden_answers": ["Amira Voss"], "data_source": "popqa"},
        {"id": "popqa_test_1", "question": "où est Quorra ?", "golden_answers": ["Dalvia"],
         "data_source": "popqa"}]
    data.main(["convert", "--input", src, "--out", out, "--data_source", "mine"])
    assert [(r["id"], r["data_source"]) for r in qa_eval.load_qa(out)] == [
        ("mine_test_0", "mine"), ("mine_test_1", "mine")]


def test_a_gold_answer_that_normalises_to_nothing_is_removed_not_refused(tmp_path):
    """DEVIATION D10, as for Search-R1's own files: the answer goes; a row left without one goes."""
    src = _parquet(tmp_path / "d.parquet", [_searchr1_row("nq", "q one", ["Ossel", "The"], 0),
                                            _searchr1_row("nq", "q two", ["a"], 1)])
    out = str(tmp_path / "d.jsonl")
    assert data.convert_qa(src, out) == 1
    assert [(r["id"], r["golden_answers"]) for r in qa_eval.load_qa(out)] == [("nq_0", ["Ossel"])]
    assert data._dropped(out) == ["nq_1"]


def test_a_verl_row_whose_ground_truth_is_the_answer_itself_converts(tmp_path):
    """Other verl sets store the answer as reward_model.ground_truth, with no target inside."""
    row = dict(_searchr1_row("sums", "what is 2 + 2", [], 0),
               reward_model={"style": "rule", "ground_truth": "4"})
    out = str(tmp_path / "sums.jsonl")
    assert data.convert_qa(_parquet(tmp_path / "sums.parquet", [row]), out) == 1
    assert qa_eval.load_qa(out) == [{"id": "sums_0", "question": "what is 2 + 2?",
                                     "golden_answers": ["4"], "data_source": "sums"}]


@pytest.mark.parametrize("kind, where, message", [
    ("parquet", "bad.parquet: row 1",
     r"the user message of field 'prompt' has no 'Question: \.\.\.'"),
    ("parquet-gold", "bad.parquet: row 2",
     r"no gold answers: the row needs 'golden_answers' or 'reward_model.ground_truth.target'"),
    ("jsonl", "bad.jsonl:4",
     r"field 'golden_answers' must be a non-empty list of strings, got \[\]"),
    ("jsonl-dup", "bad.jsonl:4", r"duplicate id 'bad_7', first at .*bad.jsonl:1"),
    ("jsonl-json", "bad.jsonl:4", r"malformed JSON")])
def test_a_bad_row_names_file_and_row_and_leaves_no_output(tmp_path, capsys, kind, where, message):
    if kind.startswith("parquet"):
        rows = [_searchr1_row("nq", q, [a], i) for i, (q, a) in enumerate(
            [("q one", "Ossel"), ("q two", "Vantis"), ("q three", "Quorra")])]
        if kind == "parquet":
            rows[1]["prompt"] = [{"role": "user", "content": "What is the river of Vantis?"}]
        else:
            rows[2]["reward_model"] = {"style": "rule", "ground_truth": None}
        src = _parquet(tmp_path / "bad.parquet", rows)
    else:
        good = {"id": 7, "question": "q", "golden_answers": ["Ossel"]}
        bad = {"jsonl": dict(good, id=8, golden_answers=[]), "jsonl-dup": good,
               "jsonl-json": '{"id": 8,'}[kind]
        src = _jsonl(tmp_path / "bad.jsonl", [good, "", dict(good, id=9), bad])
    out = tmp_path / "out" / "qa.jsonl"
    with pytest.raises(ValueError, match=f"{where}: {message}"):
        data.convert_qa(src, str(out))
    with pytest.raises(SystemExit):
        data.main(["convert", "--input", src, "--out", str(out)])
    assert f"convert: error: {src}" in capsys.readouterr().err  # one line, no traceback
    assert not os.path.exists(out.parent) or os.listdir(out.parent) == []


def test_a_file_that_fails_the_last_check_leaves_no_partial_file(tmp_path, monkeypatch):
    """The last check (eval.load_qa of the written file) fails: the partial file goes too."""
    src = _jsonl(tmp_path / "nq.jsonl", [{"id": 1, "question": "q", "golden_answers": ["Ossel"]}])

    def refuse(path):
        raise ValueError(f"{path}:1: refused")
    monkeypatch.setattr(qa_eval, "load_qa", refuse)
    with pytest.raises(ValueError, match="converted rows are not valid QA rows"):
        data.convert_qa(src, str(tmp_path / "out" / "nq.jsonl"))
    assert os.listdir(tmp_path / "out") == []


def test_world_builds_a_folder_whose_index_retriever_searches(tmp_path):
    corpus = _corpus(tmp_path / "in" / "docs.jsonl")
    qa = _flashrag(tmp_path / "in" / "facts.jsonl")
    out = tmp_path / "worlds" / "mine"
    data.main(["world", "--corpus", corpus, "--questions", qa, "--encoder", "bm25",
               "--out", str(out), "--test_fraction", "0.34"])
    assert sorted(os.listdir(out)) == ["corpus.jsonl", "index", "manifest.json", "test.jsonl",
                                       "train.jsonl"]
    assert os.listdir(out.parent) == ["mine"]  # no temporary folder left
    train, test = (qa_eval.load_qa(str(out / f"{s}.jsonl")) for s in ("train", "test"))
    assert (len(train), len(test)) == (4, 2)
    assert {r["data_source"] for r in train + test} == {"facts"}  # the file's name
    assert sorted(r["id"] for r in train + test) == [f"facts_q{i}" for i in range(6)]  # a split
    assert open(out / "corpus.jsonl", "rb").read() == open(corpus, "rb").read()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["rows"] == {"corpus": 6, "train": 4, "test": 2}
    assert manifest["encoder"] == "bm25" and manifest["test_fraction"] == 0.34
    meta = json.loads((out / "index" / "meta.json").read_text())
    assert meta["corpus"] == str(out / "corpus.jsonl")
    assert meta["corpus_relative"] == "../corpus.jsonl"
    moved = tmp_path / "moved"
    os.rename(out, moved)  # a world reads its own corpus wherever it goes
    r = retriever.Retriever(str(moved / "index"))
    try:
        docs = r.search(["the river of Vantis", "who is the founder of Brisk Corp"], topk=2)
    finally:
        r.close()
    assert [d[0]["id"] for d in docs] == ["4", "1"] and "Ossel" in docs[0][0]["contents"]


def test_world_takes_a_test_file_and_train_twice_reads_the_folder(tmp_path):
    import train_twice as tt
    corpus = _corpus(tmp_path / "docs.jsonl")
    train_src = _searchr1_parquet(tmp_path / "train.parquet")
    test_src = _flashrag(tmp_path / "nq" / "dev.jsonl", start=2, n=3)
    out = str(tmp_path / "w")
    os.makedirs(out)  # an empty folder is replaced
    manifest = data.build_world(corpus, [train_src, test_src], out, encoder="bm25")
    assert manifest["rows"] == {"corpus": 6, "train": 3, "test": 3}
    assert manifest["test_fraction"] is None
    test = qa_eval.load_qa(os.path.join(out, "test.jsonl"))
    assert [r["id"] for r in test] == ["nq_q2", "nq_q3", "nq_q4"]
    cfg = tt.parse_config([f"--world={out}", "--model=my/model"])
    assert (cfg.model, cfg.index) == ("my/model", os.path.join(out, "index"))
    assert all(os.path.exists(p) for p in (cfg.train_data, cfg.eval_data, cfg.index))


def test_world_refuses_bad_inputs_and_leaves_nothing(tmp_path, monkeypatch):
    corpus, qa = _corpus(tmp_path / "docs.jsonl"), _flashrag(tmp_path / "facts.jsonl")
    bad_corpus = _jsonl(tmp_path / "bad.jsonl", [{"id": "0", "contents": "x"}, "", {"id": "1"}])
    out = tmp_path / "out" / "w"
    with pytest.raises(ValueError, match=r"bad.jsonl:3: field 'contents' must be a string"):
        data.build_world(bad_corpus, [qa], str(out), encoder="bm25")
    bad_qa = _jsonl(tmp_path / "badqa.jsonl", [{"id": 1, "question": "", "golden_answers": ["x"]}])
    with pytest.raises(ValueError, match=r"badqa.jsonl:1: field 'question' must be a non-empty"):
        data.build_world(corpus, [qa, bad_qa], str(out), encoder="bm25")
    with pytest.raises(ValueError, match=r"cannot hold out 0.1 of 1 question"):
        data.build_world(corpus, [_flashrag(tmp_path / "one.jsonl", n=1)], str(out), encoder="bm25")

    def broken(corpus, encoder, index_dir):  # the build fails half way
        os.makedirs(index_dir)
        raise RuntimeError("out of memory")
    monkeypatch.setattr(retriever, "build_index", broken)
    with pytest.raises(RuntimeError, match="out of memory"):
        data.build_world(corpus, [qa], str(out), encoder="bm25")
    assert os.listdir(tmp_path / "out") == []  # the temporary folder went too
    os.makedirs(out)
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        data.build_world(corpus, [qa], str(out), encoder="bm25")
    assert os.listdir(out) == ["keep.txt"]
