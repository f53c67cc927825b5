"""Tests for retrieval/bm25.py and BM25 index folders of retriever.py: the analyzer, Lucene's BM25 computed by hand, ranking
against a plain implementation, batch invariance, identical builds, ties, named folder errors, read-only storage and
the CLI. The HTTP server over a BM25 folder: tests/test_server.py; a training run with one: tests/test_train.py."""
import builtins
import json
import math
import os
import random
import shutil
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from retrieval import bm25
import retriever as R
from test_retriever import NAME0, ROOT, bits, make_rows, queries_of_mixed_lengths, write_corpus

# Lucene's EnglishAnalyzer.ENGLISH_STOP_WORDS_SET, which Anserini's default analyzer removes
LUCENE_STOPWORDS = ("a an and are as at be but by for if in into is it no not of on or such that the their then there "
                    "these they this to was will with").split()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """test_retriever.py's 50 invented entities, as a BM25 folder."""
    root = tmp_path_factory.mktemp("bm25")
    rows = make_rows()
    corpus = write_corpus(root / "corpus.jsonl", rows)
    index_dir = str(root / "index")
    meta = R.build_index(corpus, "bm25", index_dir)
    return SimpleNamespace(root=root, rows=rows, corpus=corpus, index_dir=index_dir, meta=meta)


@pytest.fixture(scope="module")
def fresh(world):
    retriever = R.Retriever(world.index_dir, cache_size=0)
    yield retriever
    retriever.close()


def folder_of(tmp_path, texts, name="index"):
    corpus = write_corpus(tmp_path / f"{name}.jsonl", [{"id": f"r{i}", "contents": t} for i, t in enumerate(texts)])
    R.build_index(corpus, "bm25", str(tmp_path / name))
    return R.Retriever(str(tmp_path / name), cache_size=0)


# --- analyzer and score ---

def test_analyzer_is_anserini_english_lowercase_stopwords_possessive_porter():
    assert sorted(bm25.STOPWORDS) == sorted(LUCENE_STOPWORDS)
    assert bm25.analyze("The Kings of Zorvak's rivers ARE running!") == ["king", "zorvak", "river", "run"]
    assert bm25.analyze("U.S.A. in 1,000 years: 3.14 e-mail") == ["u.s.a", "1,000", "year", "3.14", "e", "mail"]
    assert bm25.analyze("us is as") == ["us"]  # "is", "as" are stopwords; "us" is too short for the stemmer
    assert bm25.analyze("generalizations ponies caresses") == ["gener", "poni", "caress"]  # Porter's own examples
    # Lucene's PorterStemmer (Porter's reference code) where Snowball's published algorithm stops at -logi / -bli
    words = "technology analogies biology logy possibly humbly probably"
    assert bm25._stemmer().stemWords(words.split()) == ["technologi", "analogi", "biologi", "logi", "possibli",
                                                        "humbli", "probabl"]
    assert bm25.analyze(words) == ["technolog", "analog", "biologi", "logi", "possibl", "humbl", "probabl"]
    assert bm25.analyze("") == bm25.analyze("the of and") == []


def test_score_is_lucene_bm25_computed_by_hand(tmp_path):
    texts = ["The river Amber flows past the old mill.", "Amber and amber: the Amber river.", "A mill by the sea.",
             "Kings of the north."]
    terms = [["river", "amber", "flow", "past", "old", "mill"], ["amber", "amber", "amber", "river"],
             ["mill", "sea"], ["king", "north"]]
    assert [bm25.analyze(t) for t in texts] == terms
    n, avgdl, k1, b = 4, (6 + 4 + 2 + 2) / 4, 0.9, 0.4
    idf = math.log(1 + (n - 2 + 0.5) / (2 + 0.5))  # "amber" and "river" are each in 2 of the 4 rows

    def part(tf, dl):
        return idf * tf / (tf + k1 * (1 - b + b * dl / avgdl))
    retriever = folder_of(tmp_path, texts)
    docs = retriever.search(["amber rivers"], 3)[0]
    assert [d["id"] for d in docs] == ["r1", "r0", "r2"]  # r2, r3 score 0: the lower row fills the third place
    want = [part(3, 4) + part(1, 4), part(1, 6) + part(1, 6), 0.0]
    assert [d["score"] for d in docs] == pytest.approx(want, rel=1e-6)
    twice = retriever.search(["amber amber"], 1)[0][0]  # a repeated term counts twice (Anserini boosts by count)
    assert twice["id"] == "r1" and twice["score"] == pytest.approx(2 * part(3, 4), rel=1e-6)
    retriever.close()


def plain_scores(texts, query):
    """BM25 of every row, from the formula alone (float64): the plain implementation to compare with."""
    docs = [bm25.analyze(t) for t in texts]
    n, avgdl = len(docs), sum(map(len, docs)) / len(docs)
    scores = []
    for doc in docs:
        s = 0.0
        for term in bm25.analyze(query):
            df, tf = sum(term in d for d in docs), doc.count(term)
            if tf:
                s += math.log(1 + (n - df + 0.5) / (df + 0.5)) * tf / (tf + 0.9 * (0.6 + 0.4 * len(doc) / avgdl))
        scores.append(s)
    return scores


def test_ranking_equals_the_plain_formula(world, fresh):
    texts = [row["contents"] for row in world.rows]
    assert fresh.search([NAME0], 1)[0][0]["id"] == "doc0"
    for query in [NAME0, "a king known since 1514", "river city 1507", "second line about Cedar", "Jade Bastion ship"]:
        plain = plain_scores(texts, query)
        order = sorted(range(len(texts)), key=lambda i: (-round(plain[i], 5), i))[:8]
        docs = fresh.search([query], 8)[0]
        assert [d["id"] for d in docs] == [str(world.rows[i]["id"]) for i in order], query
        assert [d["score"] for d in docs] == pytest.approx([plain[i] for i in order], rel=1e-6, abs=1e-9)


# --- the dense path's guarantees ---

def test_results_do_not_depend_on_the_batch(world, fresh):
    queries = queries_of_mixed_lengths(world.rows) + ["", "the of", "unknown words only"]
    alone = [bits(fresh.search([q]))[0] for q in queries]
    assert bits(fresh.search(queries)) == alone
    shuffled = random.Random(0).sample(queries, len(queries))
    assert bits(fresh.search(shuffled)) == [alone[queries.index(q)] for q in shuffled]
    features = fresh.encoder.query_features(queries)  # the server's path: analyzed in the request's thread
    served = fresh.search_batch([(q, 3) for q in queries], features)
    assert bits(served) == alone


def test_ties_go_to_the_lower_row(tmp_path):
    retriever = folder_of(tmp_path, ["alpha beta", "gamma", "alpha beta", "alpha beta", "delta", "alpha beta"])
    assert [d["id"] for d in retriever.search(["alpha"], 3)[0]] == ["r0", "r2", "r3"]
    assert [d["id"] for d in retriever.search(["gamma alpha"], 3)[0]] == ["r1", "r0", "r2"]
    assert [d["id"] for d in retriever.search([""], 2)[0]] == ["r0", "r1"]  # DEVIATION S19: zero scores fill
    retriever.close()
    rng = np.random.default_rng(0)
    for _ in range(200):  # top_rows against a plain sort, on scores with many ties
        scores = rng.integers(0, 4, rng.integers(1, 30)).astype(np.float32)
        k = int(rng.integers(1, 35))
        rows, top = bm25.top_rows(scores, k)
        plain = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:k]
        assert rows.tolist() == plain and top.tolist() == scores[plain].tolist()


@pytest.mark.parametrize("queries,topk,match", [("a river", 3, "queries"), ([None], 3, r"queries'\[0\]"),
                                                (["a"], 0, "topk"), (["a"], True, "topk"), (["a"], "3", "topk"),
                                                (["\ud800"], 3, "not valid Unicode")])
def test_search_rejects_bad_arguments_as_the_dense_path(fresh, queries, topk, match):
    with pytest.raises(ValueError, match=match):
        fresh.search(queries, topk)


def test_topk_past_the_corpus_empty_and_over_long_queries(world, fresh):
    assert len(fresh.search(["a river"], 80)[0]) == 50  # every row, as the dense path (S2)
    assert [len(docs) for docs in fresh.search(["", "the of"], 3)] == [3, 3]
    name = world.rows[7]["name"]
    filler = "zyxwv " * 255  # a term of no row: it counts towards the 256 read (S20) and adds nothing
    assert bits(fresh.search([filler + "zyxwv " + name])) == bits(fresh.search([""]))
    assert fresh.search([filler + name])[0][0]["id"] == str(world.rows[7]["id"])  # its first word is read


# --- the folder: identical builds, named errors, read-only storage, CLI ---

def test_two_builds_write_identical_files(world, tmp_path, capsys):
    """Another process, another hash seed, the CLI: the same bytes in every file (meta.json included)."""
    out = str(world.root / "again")
    env = {**os.environ, "PYTHONHASHSEED": "12345", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "retriever.py"), "build", "--corpus", world.corpus,
                           "--encoder", "bm25", "--out", out], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"built {out}: 50 rows, terms {world.meta['dim']}" in proc.stdout

    def files(folder):
        return {os.path.relpath(os.path.join(d, f), folder): open(os.path.join(d, f), "rb").read()
                for d, _, names in os.walk(folder) for f in names}
    first, second = files(world.index_dir), files(out)
    assert sorted(first) == sorted(["meta.json", "offsets.npy"] + [f"bm25/{f}" for f in bm25.FILES])
    assert first == second
    R.main(["search", "--index", out, "--topk", "2", NAME0])
    printed = capsys.readouterr().out
    assert f"# query: {NAME0}" in printed and "# ids: doc0 " in printed and "Doc 1(Title: " in printed
    for flags in (["--query_prefix", "q: "], ["--fp16"], ["--device", "cpu"]):  # nothing a BM25 build would read
        with pytest.raises(SystemExit):
            R.main(["build", "--corpus", world.corpus, "--encoder", "bm25", "--out", out, *flags])
        assert "--encoder bm25 goes with `build` only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        R.main(["describe-prebuilt", "--index_file", out, "--corpus", world.corpus, "--encoder", "bm25", "--out", out])


def _damage(index_dir, what):
    meta_path, folder = os.path.join(index_dir, "meta.json"), os.path.join(index_dir, "bm25")
    meta = json.load(open(meta_path))
    params_path = os.path.join(folder, "params.index.json")
    params = json.load(open(params_path))
    if what == "no params":
        os.remove(params_path)
    elif what == "no index folder":
        shutil.rmtree(folder)
    elif what == "k1 differs":
        json.dump({**params, "k1": 1.2}, open(params_path, "w"))
    elif what == "rows differ":
        json.dump({**params, "num_docs": 49}, open(params_path, "w"))
    elif what == "params not json":
        open(params_path, "w").write("{")
    elif what == "vocab short":
        vocab = json.load(open(os.path.join(folder, "vocab.index.json")))
        json.dump(dict(list(vocab.items())[:-1]), open(os.path.join(folder, "vocab.index.json"), "w"))
    elif what == "indptr short":
        path = os.path.join(folder, "indptr.csc.index.npy")
        np.save(path, np.load(path)[:-1])
    elif what == "data pickled":
        np.save(os.path.join(folder, "data.csc.index.npy"), np.array([1.0, "x"], dtype=object), allow_pickle=True)
    elif what == "indices float":
        path = os.path.join(folder, "indices.csc.index.npy")
        np.save(path, np.load(path).astype(np.float32))
    elif what == "no bm25 field":
        json.dump({k: v for k, v in meta.items() if k != "bm25"}, open(meta_path, "w"))
    elif what == "other analyzer":
        json.dump({**meta, "bm25": {**meta["bm25"], "analyzer": "whitespace"}}, open(meta_path, "w"))
    return {"meta": meta_path, "params": params_path, "folder": folder,
            "vocab": os.path.join(folder, "vocab.index.json"), "indptr": os.path.join(folder, "indptr.csc.index.npy"),
            "data": os.path.join(folder, "data.csc.index.npy"),
            "indices": os.path.join(folder, "indices.csc.index.npy")}


@pytest.mark.parametrize("what,error,names,match", [
    ("no params", FileNotFoundError, "folder", r"missing \['params.index.json'\]"),
    ("no index folder", FileNotFoundError, "folder", "index file named in .*not found"),
    ("k1 differs", ValueError, "params", "does not match .*meta.json: k1 1.2 != 0.9"),
    ("rows differ", ValueError, "params", "num_docs 49 != 50"),
    ("params not json", ValueError, "params", "not valid JSON"),
    ("vocab short", ValueError, "vocab", "terms, not numbered"),
    ("indptr short", ValueError, "indptr", "does not fit"),
    ("data pickled", ValueError, "data", "not a readable .npy"),
    ("indices float", ValueError, "indices", "expected a 1-d integer array, got float32"),
    ("no bm25 field", ValueError, "meta", "field 'bm25' must be an object"),
    ("other analyzer", ValueError, "meta", "built with the analyzer 'whitespace'")])
def test_damaged_bm25_files_are_named(world, tmp_path, what, error, names, match):
    index_dir = str(tmp_path / "index")
    shutil.copytree(world.index_dir, index_dir)
    paths = _damage(index_dir, what)
    with pytest.raises(error, match=match) as raised:
        R.Retriever(index_dir, corpus=world.corpus)
    assert paths[names] in str(raised.value)


def test_a_stale_corpus_is_refused_and_a_copied_world_reads_its_own(world, fresh, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(world.root, copy, ignore=shutil.ignore_patterns("again"))
    retriever = R.Retriever(str(copy / "index"), cache_size=0)
    assert retriever.corpus == str(copy / "corpus.jsonl")
    assert bits(retriever.search([NAME0, "a king"])) == bits(fresh.search([NAME0, "a king"]))
    retriever.close()
    with open(copy / "corpus.jsonl", "a") as f:
        f.write(json.dumps({"id": "new", "contents": "a new row"}) + "\n")
    with pytest.raises(ValueError, match=f"corpus {copy / 'corpus.jsonl'} does not match"):
        R.Retriever(str(copy / "index"))


def test_a_folder_on_read_only_storage_loads_and_writes_nothing(world, fresh, tmp_path, monkeypatch):
    """Tests run as root, whom chmod does not stop: every way of writing under the folder fails as on a read-only
    mount, and the search still answers as from the original folder."""
    shelf = tmp_path / "shelf"
    shutil.copytree(world.root, shelf, ignore=shutil.ignore_patterns("again"))
    before = sorted((d, tuple(sorted(f))) for d, _, f in os.walk(shelf))

    def refuse(path):
        if str(os.fspath(path)).startswith(str(shelf)):
            raise OSError(30, "Read-only file system", str(path))
    real_open, real_os_open = builtins.open, os.open
    monkeypatch.setattr(builtins, "open", lambda path, mode="r", *a, **k: (
        refuse(path) if isinstance(path, (str, os.PathLike)) and set(mode) & set("wax+") else None,
        real_open(path, mode, *a, **k))[1])
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT
    monkeypatch.setattr(os, "open", lambda path, flags, *a, **k: (
        refuse(path) if flags & writes else None, real_os_open(path, flags, *a, **k))[1])
    for name in ("mkdir", "rename", "replace", "remove", "unlink"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda path, *a, _real=real, **k: (refuse(path), _real(path, *a, **k))[1])
    retriever = R.Retriever(str(shelf / "index"), cache_size=0)
    assert bits(retriever.search([NAME0, "a king", ""])) == bits(fresh.search([NAME0, "a king", ""]))
    retriever.close()
    monkeypatch.undo()
    assert sorted((d, tuple(sorted(f))) for d, _, f in os.walk(shelf)) == before


def test_bench_retrieval_times_both_and_bm25_finds_each_querys_row(tmp_path):
    """`perf/bench.py retrieval` at a tiny size: both retrievers timed, and BM25 puts the row each query was drawn from
    (its unique invented title and three of its words) first."""
    from perf import bench
    r = bench.bench_retrieval(rows=300, queries=20, batch=8, rounds=1, out=str(tmp_path))
    assert r["bm25_hit_rate"] == 1.0
    assert json.load(open(tmp_path / "dense" / "index" / "meta.json"))["n_rows"] == 300
    assert all(r[f"{name}_ms_alone"] > 0 and r[f"{name}_queries_per_s"] > 0 for name in ("bm25", "dense"))
