"""eval.load_qa through `datasets` and its load-time checks (DESIGN.md section 12): good files load exactly as the
hand-written loader loaded them; a degenerate gold answer, a non-UTF-8 byte and a lone surrogate escape are
refused when the file is loaded, with file:line and how to fix it."""
import json
import os
import time

import pandas as pd
import pytest

from worlds import data
import eval as qa_eval
import protocol

# A good QA file with what real ones hold: int and str ids, a gold answer as a bare string, non-ASCII text, an
# emoji (json.dumps writes it as a surrogate pair escape), extra fields (FlashRAG metadata), blank lines between rows.
GOOD = [{"id": 0, "question": "what is the capital of Kelora", "golden_answers": ["Vantis", "vantis"],
         "data_source": "nq", "metadata": {"hops": 1}},
        {"id": "train_1", "question": "who founded Brisk Corp?", "golden_answers": "Amira Voss",
         "data_source": "hotpotqa", "metadata": {"hops": 2}},
        {"id": 2, "question": "où est Quorra \U0001F600 ?", "golden_answers": ["Dalvia", "the Dalvia river"],
         "data_source": "popqa", "metadata": {"hops": 1}}]


def old_load_qa(path: str) -> list:
    """The hand-written loader that `datasets` replaced (eval.py at 6780e89), kept as the reference."""
    def check(row, where):
        missing = [k for k in qa_eval.QA_FIELDS if k not in row]
        assert not missing, f"{where}: missing {missing}"
        gold = row["golden_answers"]
        gold = gold.tolist() if hasattr(gold, "tolist") else gold
        gold = [gold] if isinstance(gold, str) else gold
        return {"id": str(row["id"]), "question": row["question"], "golden_answers": gold,
                "data_source": str(row["data_source"])}
    if path.endswith(".parquet"):
        return [check(r, f"{path}: row {i}") for i, r in enumerate(pd.read_parquet(path).to_dict("records"))]
    with open(path, encoding="utf-8") as f:
        return [check(json.loads(line), f"{path}:{n}") for n, line in enumerate(f, 1) if line.strip()]


def _jsonl(path, lines) -> str:
    """Write lines (dicts as JSON, str as they are) and return the path."""
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return str(path)


def _row(question="what is the river of Vantis", gold=("Ossel",), rid=7):
    return {"id": rid, "question": question, "golden_answers": list(gold), "data_source": "nq"}


def test_a_good_jsonl_file_loads_as_the_hand_written_loader_loaded_it(tmp_path):
    path = _jsonl(tmp_path / "good.jsonl", [GOOD[0], "", GOOD[1], "   ", GOOD[2]])
    assert "\\ud83d\\ude00" in open(path).read()  # the emoji as a surrogate pair escape
    rows = qa_eval.load_qa(path)
    assert rows == old_load_qa(path)  # same rows, same order, same fields, same types
    assert [list(r) for r in rows] == [list(qa_eval.QA_FIELDS)] * 3
    assert rows[1]["golden_answers"] == ["Amira Voss"] and rows[2]["question"] == "où est Quorra \U0001F600 ?"
    assert [r["id"] for r in rows] == ["0", "train_1", "2"]


def test_a_good_parquet_file_loads_as_the_hand_written_loader_loaded_it(tmp_path):
    path = str(tmp_path / "good.parquet")
    pd.DataFrame([{**r, "id": str(r["id"]), "golden_answers": [r["golden_answers"]] if isinstance(
        r["golden_answers"], str) else r["golden_answers"]} for r in GOOD]).to_parquet(path)
    rows = qa_eval.load_qa(path)
    assert rows == old_load_qa(path) and [r["id"] for r in rows] == ["0", "train_1", "2"]
    assert all(type(r["golden_answers"]) is list for r in rows)


@pytest.mark.parametrize("gold", [[""], ["The"], ["Ossel", "a"], [" . "]])
def test_a_gold_answer_that_normalises_to_nothing_is_refused_with_file_line(tmp_path, gold):
    """An empty <answer></answer> would score 1.0 against it."""
    assert protocol.reward("<answer></answer>", gold) == 1.0  # why it must not reach training
    path = _jsonl(tmp_path / "qa.jsonl", [_row(), "", _row(gold=gold, rid=8)])
    with pytest.raises(ValueError, match=rf"qa.jsonl:3: golden answer\(s\) .* normalise to an empty string.*"
                                         r"remove them from 'golden_answers'"):
        qa_eval.load_qa(path)


def test_a_degenerate_gold_answer_in_parquet_names_the_row(tmp_path):
    path = str(tmp_path / "qa.parquet")
    pd.DataFrame([_row(rid="a"), _row(gold=["An"], rid="b")]).to_parquet(path)
    with pytest.raises(ValueError, match=r"qa.parquet: row 1: golden answer\(s\) \['An'\] normalise"):
        qa_eval.load_qa(path)


def test_a_non_utf8_byte_is_refused_with_file_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    _jsonl(path, [_row(), _row(rid=8)])
    with open(path, "ab") as f:
        f.write(json.dumps(_row(rid=9)).replace("river", "rivi\xe8re").encode("latin-1") + b"\n")
    with pytest.raises(ValueError, match=r"latin1.jsonl:3: not UTF-8 \(byte 0xe8 .*re-encode the file as UTF-8"):
        qa_eval.load_qa(str(path))


@pytest.mark.parametrize("field", ["question", "golden_answers"])
def test_a_lone_surrogate_escape_is_refused_with_file_line(tmp_path, field):
    """json.loads accepts "\\ud800"; the tokenizer's UTF-8 encoding does not, at the step that samples the row."""
    bad = json.dumps(_row(rid=8)).replace("Vantis" if field == "question" else "Ossel", "Van\\ud800tis")
    path = _jsonl(tmp_path / "qa.jsonl", [_row(), "", bad])
    assert "\ud800" in json.dumps(json.loads(bad)[field]).encode().decode("unicode_escape")  # a real lone surrogate
    with pytest.raises(ValueError, match=rf"qa.jsonl:3: field '{field}' has a lone surrogate \\ud800 at character"):
        qa_eval.load_qa(path)


def test_other_bad_rows_still_name_file_and_line(tmp_path):
    cases = {"malformed JSON": '{"id": 1, "question": ', "missing field\\(s\\) \\['question'\\]":
             {"id": 1, "golden_answers": ["x"], "data_source": "nq"}, "expected a JSON object": "[1, 2]",
             "field 'golden_answers' must be a non-empty list": _row(gold=[])}
    for k, (message, bad) in enumerate(cases.items()):
        path = _jsonl(tmp_path / f"bad{k}.jsonl", [_row(), "", "", bad, _row(rid=9)])
        with pytest.raises(ValueError, match=rf"bad{k}.jsonl:4: {message}"):
            qa_eval.load_qa(path)
    with pytest.raises(ValueError, match="empty.jsonl: no QA rows"):
        qa_eval.load_qa(_jsonl(tmp_path / "empty.jsonl", ["", ""]))


def test_loading_is_fast_and_leaves_no_cache(tmp_path):
    import datasets.config
    cache = str(datasets.config.HF_DATASETS_CACHE)
    before = sorted(os.listdir(cache)) if os.path.exists(cache) else None
    path = _jsonl(tmp_path / "qa.jsonl", [_row(rid=i) for i in range(200)])
    qa_eval.load_qa(path)  # first call pays the imports
    t = time.perf_counter()
    for _ in range(5):
        assert len(qa_eval.load_qa(path)) == 200
    assert (time.perf_counter() - t) / 5 < 1.0  # ~40 ms per small file measured on 2 CPU cores (LOG.md, 2026-11-30)
    assert (sorted(os.listdir(cache)) if os.path.exists(cache) else None) == before


def test_conversion_removes_degenerate_gold_answers_and_counts_dropped_rows(tmp_path, capsys):
    """DEVIATION D10: worlds/data.py keeps what load_qa accepts; the row check counts the dropped rows."""
    rows = [_row(gold=["Ossel", "The"], rid="a"), _row(gold=["A"], rid="b"), _row(rid="c")]
    dest = str(tmp_path / "test" / "nq.jsonl")
    assert data._write_qa(rows, dest, "src.jsonl") == 2
    assert [(r["id"], r["golden_answers"]) for r in qa_eval.load_qa(dest)] == [("a", ["Ossel"]), ("c", ["Ossel"])]
    assert data._dropped(dest) == ["b"] and "dropped the 1 left without an answer: ['b']" in capsys.readouterr().out


def test_a_duplicate_id_is_refused_naming_both_lines(tmp_path):
    """Sampling keys derive from the id: two questions with one id would get identical noise. Any repeat is refused,
    an identical row too, and 7 and "7" are one id (ids are compared as strings, as stable_id reads them)."""
    other = _row(question="who founded Brisk Corp", rid="7")
    path = _jsonl(tmp_path / "qa.jsonl", [_row(rid=6), "", _row(rid=7), _row(rid=8), "", other])
    with pytest.raises(ValueError, match=r"qa.jsonl:6: duplicate id '7', first at .*qa.jsonl:3; ids key each"):
        qa_eval.load_qa(path)
    same = _jsonl(tmp_path / "same.jsonl", [_row(rid=1), _row(rid=1)])
    with pytest.raises(ValueError, match=r"same.jsonl:2: duplicate id '1', first at .*same.jsonl:1"):
        qa_eval.load_qa(same)
    pq = str(tmp_path / "qa.parquet")
    pd.DataFrame([_row(rid="a"), _row(rid="b"), _row(rid="a")]).to_parquet(pq)
    with pytest.raises(ValueError, match=r"qa.parquet: row 2: duplicate id 'a', first at .*qa.parquet: row 0"):
        qa_eval.load_qa(pq)
    # line by line (`datasets` fails on the mixed types of an extra field): the same lines are named
    mixed = _jsonl(tmp_path / "mixed.jsonl", [dict(_row(rid=1), extra=1), dict(_row(rid=1), extra="x")])
    with pytest.raises(ValueError, match=r"mixed.jsonl:2: duplicate id '1', first at .*mixed.jsonl:1"):
        qa_eval.load_qa(mixed)


def test_the_built_in_worlds_and_searchr1_conversion_have_unique_ids(tiny_world, tmp_path):
    """Every QA file of the tiny world loads (ids unique); worlds/data.py gives Search-R1's rows `{data_source}_{id}`, so NQ's
    and HotpotQA's colliding FlashRAG numbering (train_0, ...) stays apart, and val.jsonl merges sources safely."""
    import glob
    files = sorted(glob.glob(os.path.join(tiny_world, "*.jsonl")))
    qa_files = [f for f in files if not f.endswith("corpus.jsonl")]
    assert qa_files and all(qa_eval.load_qa(f) for f in qa_files)
    src = str(tmp_path / "train.parquet")
    pd.DataFrame([{"id": "train_0", "question": "q one", "golden_answers": ["Ossel"], "data_source": "nq"},
                  {"id": "train_0", "question": "q two", "golden_answers": ["Vantis"], "data_source": "hotpotqa"}]
                 ).to_parquet(src)
    dest = str(tmp_path / "train.jsonl")
    assert data.convert_qa(src, dest) == 2
    assert [r["id"] for r in qa_eval.load_qa(dest)] == ["nq_train_0", "hotpotqa_train_0"]
