"""Tests for retriever.py and retrieval/search.py (its `Retriever`) on a 50-row corpus of invented entities, encoded
with the packaged MiniLM (CPU, offline).
The HTTP server and RemoteRetriever against it: tests/test_server.py, on the same fixtures."""
import json
import math
import os
import random
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import faiss
import numpy as np
import pytest
import torch

import retriever as R
from protocol import information_block
from retrieval import dense as D
from retrieval import index as I
from retrieval import search

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST = ("Amber Bronze Cedar Dusky Ember Frost Granite Hazel Ivory Jade Kestrel Linen Maple Nimbus Onyx Pearl Quartz "
         "Russet Saffron Tawny Umber Velvet Willow Xenon Yarrow Zephyr Azure Birch Cobalt Dune Elder Fennel Garnet "
         "Heather Indigo Juniper Kelp Lilac Marble Nectar Opal Pine Quill Rowan Slate Thistle Upland Violet Walnut "
         "Yew").split()
SECOND = ("Harbor Falcon Meadow Citadel Lantern Orchard Glacier Canyon Bastion Tannery Beacon Chapel Ferry Quarry "
          "Grove Abbey Foundry Kiln Vineyard Spire Garrison Lagoon Mill Bridge Marsh Tavern Cove Terrace Rampart "
          "Atelier Granary Pavilion Forge Hollow Dockyard Lighthouse Aqueduct Causeway Monastery Observatory Plaza "
          "Reservoir Sawmill Shipyard Stable Theatre Tower Village Windmill Workshop").split()
KINDS = ["river", "city", "mountain", "painter", "king", "ship", "festival", "language"]


def make_rows(n=50):
    rows = []
    for i, name in enumerate(f"{a} {b}" for a, b in zip(FIRST[:n], SECOND)):
        text = f"{name} is a {KINDS[i % len(KINDS)]} known since {1500 + 7 * i}."
        if i % 5 == 0:
            text += f"\nIt has a second line about {name}."
        rows.append({"id": i if i % 2 else f"doc{i}", "contents": f'"{name}"\n{text}', "name": name})
    return rows


NAME0 = make_rows(1)[0]["name"]  # row 0: id "doc0", a river known since 1500, two lines of text


def write_corpus(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps({"id": row["id"], "contents": row["contents"]}) + "\n")
    return str(path)


def queries_of_mixed_lengths(rows, n=64):
    rng = random.Random(1)
    filler = "please tell me everything that is known about the history and the people of".split()
    queries = []
    for i in range(n):
        name = rows[i % len(rows)]["name"]
        words = filler[:rng.randrange(len(filler))]
        queries.append(" ".join(words + [name]) if i % 3 else name)
    queries[5] = "founded " * 400 + rows[5]["name"]  # longer than max_length: truncated
    return list(dict.fromkeys(queries))


def bits(results):
    """Each query's (ids, scores as raw float64 bits)."""
    return [([d["id"] for d in docs], np.array([d["score"] for d in docs], np.float64).view(np.uint64).tolist())
            for docs in results]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """On 2 shared cores, 2 intra-op threads contend: measured 750 ms vs 30 ms per query encoded alone."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("retriever")
    rows = make_rows()
    corpus = write_corpus(root / "corpus.jsonl", rows)
    index_dir = str(root / "index")
    meta = R.build_index(corpus, "minilm", index_dir, batch_size=2, device="cpu")  # 2 chunks of 32 rows
    return SimpleNamespace(root=root, rows=rows, corpus=corpus, index_dir=index_dir, meta=meta)


@pytest.fixture(scope="module")
def dense(world):
    retriever = R.Retriever(world.index_dir, device="cpu")
    yield retriever
    retriever.close()


@pytest.fixture(scope="module")
def fresh(world):
    """No cache: every search really encodes and searches."""
    retriever = R.Retriever(world.index_dir, device="cpu", cache_size=0)
    yield retriever
    retriever.close()


# --- formatting, encoder ---

def test_format_docs_is_search_r1_passages2string():
    docs = [{"id": "1", "contents": '"Alpha Beta"\nline one\nline two'}, {"id": "2", "contents": '"Solo"'},
            {"id": "3", "contents": '"T"\n\nafter a blank line'}]
    expected = ('Doc 1(Title: "Alpha Beta") line one\nline two\n'
                'Doc 2(Title: "Solo") \n'
                'Doc 3(Title: "T") \nafter a blank line\n')
    assert R.format_docs(docs) == expected
    assert R.format_docs([]) == ""
    assert information_block(R.format_docs(docs[:2])) == (
        '\n\n<information>Doc 1(Title: "Alpha Beta") line one\nline two\nDoc 2(Title: "Solo")</information>\n\n')


def test_encoder_names_and_prefixes():
    assert os.path.exists(os.path.join(I.resolve_encoder("minilm"), "config.json"))
    assert I.resolve_encoder("e5") == "intfloat/e5-base-v2"
    assert I.resolve_encoder("/models/mine") == "/models/mine"
    assert I.encoder_prefixes("e5") == I.encoder_prefixes("/models/e5-large-v2") == ("query: ", "passage: ")
    assert I.encoder_prefixes("minilm") == I.encoder_prefixes("/tmp/abe5x/bert") == ("", "")


def test_encoder_matches_sentence_transformers(dense):
    from sentence_transformers import SentenceTransformer
    texts = [NAME0, "who is a river known since 1500", '"Dusky Citadel"\nDusky Citadel is a language.\nMore.']
    reference = SentenceTransformer(I.resolve_encoder("minilm"), device="cpu").encode(texts, normalize_embeddings=True)
    for kind in ("query", "passage"):
        vecs = dense.encoder.encode(texts, kind)
        assert vecs.dtype == np.float32 and vecs.shape == (3, 384)
        np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-6)
        np.testing.assert_allclose(vecs, reference, atol=2e-6)
    with pytest.raises(ValueError, match="kind"):
        dense.encoder.encode(texts, "document")


# --- search ---

def test_title_query_ranks_its_document_first(world, fresh):
    results = fresh.search([row["name"] for row in world.rows], topk=3)
    assert [docs[0]["id"] for docs in results] == [str(row["id"]) for row in world.rows]
    assert all(docs[0]["contents"] == row["contents"] for docs, row in zip(results, world.rows))


def test_search_equals_brute_force_ranking(world, fresh):
    vectors = faiss.read_index(os.path.join(world.index_dir, "index.faiss")).reconstruct_n(0, 50).astype(np.float64)
    query = "a painter known since 1521"
    scores = vectors @ fresh.encoder.encode([query], "query")[0].astype(np.float64)
    order = np.lexsort((np.arange(50), -scores))
    docs = fresh.search([query], topk=500)[0]  # more than the corpus: every row, once
    assert [d["id"] for d in docs] == [str(world.rows[i]["id"]) for i in order]
    np.testing.assert_allclose([d["score"] for d in docs], scores[order], rtol=0, atol=1e-12)


def test_results_do_not_depend_on_the_batch(world, fresh):
    queries = queries_of_mixed_lengths(world.rows)
    assert len(queries) == 64 and len({len(fresh.encoder.tokenizer(q)["input_ids"]) for q in queries}) > 10
    alone = bits([fresh.search([q])[0] for q in queries])
    assert bits(fresh.search(queries)) == alone  # one batch of 64
    assert bits([docs for i in range(0, 64, 7) for docs in fresh.search(queries[i:i + 7])]) == alone  # batches of 7


def test_packed_query_embeddings_are_their_own(world, fresh):
    """Determinism (1a): a query's vector is bit-identical alone, in any pack and at any offset, and equals the padded
    forward of BertModel up to float rounding; a query longer than PACK_TOKENS gets a pack of its own."""
    enc = fresh.encoder
    queries = queries_of_mixed_lengths(world.rows) + ["", "founded " * 150]  # 2 and 152 tokens; one truncated at 256
    lengths = [len(ids) for ids in enc.tokenizer(queries, max_length=I.MAX_LENGTH, truncation=True)["input_ids"]]
    assert enc.packed and min(lengths) == 2 and max(lengths) == I.MAX_LENGTH > D.PACK_TOKENS
    together = enc.encode(queries, "query")
    order = np.random.default_rng(0).permutation(len(queries))
    assert (enc.encode([queries[i] for i in order], "query") == together[order]).all()
    assert all((enc.encode([q], "query")[0] == v).all() for q, v in zip(queries, together))
    padded = enc.tokenizer(queries, max_length=I.MAX_LENGTH, truncation=True, padding=True, return_tensors="pt")
    np.testing.assert_allclose(together, enc._pool(padded), rtol=0, atol=2e-6)


def test_pack_queries_fills_packs_longest_first():
    assert D.pack_queries([5, 130, 3, 128, 60, 70, 2], 128) == [[1], [3], [5, 0, 2, 6], [4]]
    lengths = np.random.default_rng(1).integers(1, 40, 500).tolist()
    packs = D.pack_queries(lengths, 128)
    assert sorted(i for pack in packs for i in pack) == list(range(500))
    assert all(sum(lengths[i] for i in pack) <= 128 for pack in packs)
    assert len(packs) <= sum(lengths) // 128 + 2  # first-fit decreasing wastes at most a pack here


def test_exact_top_equals_fsum_of_every_row():
    """Determinism (2): only rows that float64 sums cannot rule out are summed exactly; the answer is the plain one."""
    rng = np.random.default_rng(2)
    for trial in range(200):
        vectors = rng.standard_normal((20, 64)).astype(np.float32)
        vectors[3] = vectors[7]  # an exact tie: the lower row first
        vectors[11] = np.nextafter(vectors[5], np.float32(np.inf))  # a tie up to float32 rounding
        query = rng.standard_normal(64).astype(np.float32).astype(np.float64)
        query = vectors[5].astype(np.float64) if trial % 2 else query  # ties at the top half of the time
        rows = rng.permutation(20)
        products = vectors[rows].astype(np.float64) * query
        plain = np.array([math.fsum(p) for p in products.tolist()])
        for topk in (1, 3, 20, 30):
            best = np.lexsort((rows, -plain))[:topk]
            got_rows, got_scores = D.exact_top(rows, products, topk)
            assert got_rows.tolist() == rows[best].tolist() and got_scores.tobytes() == plain[best].tobytes()


def test_cache_hits_misses_and_eviction(world):
    retriever = R.Retriever(world.index_dir, device="cpu", cache_size=2)
    first = retriever.search([NAME0, "a river", NAME0])  # duplicates in a batch are encoded once
    assert (retriever.cache_hits, retriever.cache_misses) == (0, 2) and first[0] == first[2]
    first[0][0]["id"] = "mutated by the caller"
    again = retriever.search([NAME0])
    assert (retriever.cache_hits, retriever.cache_misses) == (1, 2) and again[0][0]["id"] == "doc0"
    retriever.search([NAME0], topk=2)  # another topk is another key; evicts "a river" (least recent)
    assert (retriever.cache_hits, retriever.cache_misses) == (1, 3)
    retriever.search(["a river"])
    assert (retriever.cache_hits, retriever.cache_misses) == (1, 4)
    retriever.close()


@pytest.mark.parametrize("queries,topk,match", [("a river", 3, "queries"), ([None], 3, r"queries'\[0\]"),
                                                 (["ok", "\ud800"], 3, r"queries'\[1\].*Unicode"), (["ok"], 0, "topk"),
                                                 (["ok"], True, "topk"), (["ok"], 2.0, "topk")])
def test_search_rejects_bad_arguments(fresh, queries, topk, match):
    with pytest.raises(ValueError, match=match):
        fresh.search(queries, topk)


# --- index folder and corpus checks ---

def test_index_folder_records_everything(world):
    meta = json.load(open(os.path.join(world.index_dir, "meta.json")))
    assert meta == world.meta
    assert (meta["n_rows"], meta["dim"], meta["pooling"], meta["normalize"], meta["max_length"]) == (50, 384, "mean",
                                                                                                     True, 256)
    assert meta["encoder"] == "minilm" and meta["corpus"] == world.corpus and meta["index_file"] == "index.faiss"
    assert meta["corpus_fingerprint"]["size"] == os.path.getsize(world.corpus)
    offsets = np.load(os.path.join(world.index_dir, "offsets.npy"))
    assert offsets.dtype == np.int64 and len(offsets) == 50
    with open(world.corpus, "rb") as f:
        for offset, row in zip(offsets, world.rows):
            f.seek(offset)
            assert json.loads(f.readline())["id"] == row["id"]
    assert sorted(os.listdir(os.path.dirname(world.index_dir))) == ["corpus.jsonl", "index"]  # no temp folder left


def _edit_row(corpus, path):
    text = open(corpus).read()
    open(path, "w").write(text.replace("known since 1570", "known since 1571"))  # same size, one byte differs


def _add_row(corpus, path):
    shutil.copy(corpus, path)
    with open(path, "a") as f:
        f.write(json.dumps({"id": "extra", "contents": '"Extra"\nOne more row.'}) + "\n")


@pytest.mark.parametrize("breakage,error,match", [
    ("edit one row", ValueError, r"sha256_head .* recorded.*Rebuild"),
    ("add a row", ValueError, r"size \d+ != \d+ recorded"),
    ("delete offsets.npy", FileNotFoundError, r"incomplete, missing .*offsets\.npy"),
    ("delete the corpus", FileNotFoundError, r"corpus .* not found \(pass corpus="),
    ("index has 49 rows", ValueError, r"holds 49 vectors of dim 384 but .* say 50 rows"),
    ("index has dim 8", ValueError, r"holds 50 vectors of dim 8 but .* say 50 rows of dim 384"),
    ("offsets disagree with meta", ValueError, r"offsets\.npy has 49 rows but .*meta\.json says 50"),
    ("offsets shifted by a byte", ValueError, r"row 0 at byte 1 does not start a line; the corpus changed"),
])
def test_stale_index_is_refused(world, tmp_path, breakage, error, match):
    index_dir, corpus = str(tmp_path / "index"), str(tmp_path / "corpus.jsonl")
    shutil.copytree(world.index_dir, index_dir)
    shutil.copy(world.corpus, corpus)
    if breakage == "edit one row":
        _edit_row(world.corpus, corpus)
    elif breakage == "add a row":
        _add_row(world.corpus, corpus)
    elif breakage == "delete offsets.npy":
        os.remove(os.path.join(index_dir, "offsets.npy"))
    elif breakage == "delete the corpus":
        os.remove(corpus)
    elif breakage.startswith("offsets"):
        offsets = np.load(os.path.join(index_dir, "offsets.npy"))
        np.save(os.path.join(index_dir, "offsets.npy"), offsets[:49] if "meta" in breakage else offsets + 1)
    else:
        rows, dim = (49, 384) if breakage == "index has 49 rows" else (50, 8)
        index = faiss.IndexFlatIP(dim)
        index.add(np.eye(rows, dim, dtype=np.float32))
        faiss.write_index(index, os.path.join(index_dir, "index.faiss"))
    with pytest.raises(error, match=match):
        R.Retriever(index_dir, device="cpu", corpus=corpus)


def test_moved_corpus_is_accepted_when_identical(world, fresh, tmp_path):
    moved = shutil.copy(world.corpus, tmp_path / "moved.jsonl")
    retriever = R.Retriever(world.index_dir, device="cpu", cache_size=0, corpus=str(moved))
    assert bits(retriever.search(["a king", NAME0])) == bits(fresh.search(["a king", NAME0]))
    retriever.close()


@pytest.mark.parametrize("line", ["not json", "[1, 2]", '{"id": 1}', '{"id": [1], "contents": "x"}',
                                  '{"id": true, "contents": "x"}', '{"id": 1, "contents": 5}'])
def test_bad_corpus_row_names_file_and_line(tmp_path, line):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": 0, "contents": "\\"A\\"\\na"}\n\n' + line + "\n")  # line 2 is blank, line 3 is bad
    with pytest.raises(ValueError, match=f"{path}:3: "):
        list(I.iter_corpus(str(path)))


def test_build_reports_bad_row_and_refuses_foreign_folder(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": 0, "contents": "\\"A\\"\\na"}\n{"id": 1, "contents": null}\n')
    with pytest.raises(ValueError, match=f"{path}:2: field 'contents'"):
        R.build_index(str(path), "minilm", str(tmp_path / "index"), device="cpu")
    assert not os.path.exists(tmp_path / "index")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="refusing"):
        R.build_index(str(path), "minilm", str(tmp_path / "notes"), device="cpu")


def test_describe_prebuilt_round_trip(world, fresh, tmp_path):
    vectors = faiss.read_index(os.path.join(world.index_dir, "index.faiss")).reconstruct_n(0, 50)
    index_file = str(tmp_path / "e5_Flat.index")  # a bare flat index, as Search-R1 ships it
    index = faiss.IndexFlatIP(384)
    index.add(vectors)
    faiss.write_index(index, index_file)
    out = str(tmp_path / "described")
    meta = I.describe_prebuilt(index_file, world.corpus, out_dir=out)  # the E5 default: prefixes recorded
    assert (meta["encoder"], meta["query_prefix"], meta["passage_prefix"]) == (I.E5, "query: ", "passage: ")
    meta = I.describe_prebuilt(index_file, world.corpus, "minilm", out_dir=out)  # replaces the folder
    assert meta["index_file"] == index_file and meta["n_rows"] == 50 and meta["query_prefix"] == ""
    assert sorted(os.listdir(out)) == ["meta.json", "offsets.npy"]
    retriever = R.Retriever(out, device="cpu", cache_size=0)
    queries = [NAME0, "a ship known since 1600", "who is a king"]
    assert bits(retriever.search(queries, topk=5)) == bits(fresh.search(queries, topk=5))
    retriever.close()
    small = faiss.IndexFlatIP(384)
    small.add(vectors[:49])
    faiss.write_index(small, index_file)
    with pytest.raises(ValueError, match="holds 49 vectors but .* has 50 rows"):
        I.describe_prebuilt(index_file, world.corpus, "minilm", out_dir=str(tmp_path / "other"))


# --- client (the server's side: tests/test_server.py) ---

def test_remote_retriever_retries_server_errors():
    answers = [(503, {"error": "loading"}), (200, {"result": [[{"document": {"id": 7, "contents": '"T"\nx'},
                                                                  "score": 0.5}]]})]

    class Flaky(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            status, payload = answers.pop(0)
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = R.RemoteRetriever(f"http://127.0.0.1:{server.server_port}", retries=2, backoff=0.01)
    assert client.search(["q"]) == [[{"id": "7", "contents": '"T"\nx', "score": 0.5}]]
    assert answers == []
    server.shutdown()
    server.server_close()


# --- command line ---

def test_cli_build_and_search(world, tmp_path, capsys):
    out = str(tmp_path / "index")
    R.main(["build", "--corpus", world.corpus, "--encoder", "minilm", "--out", out, "--batch_size", "8",
            "--device", "cpu"])
    assert "50 rows, dim 384" in capsys.readouterr().out
    found = subprocess.run([sys.executable, os.path.join(ROOT, "retriever.py"), "search", "--index", out, "--topk", "2",
                            "--device", "cpu", NAME0], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})  # see one_thread
    assert found.returncode == 0, found.stderr
    lines = found.stdout.splitlines()
    assert lines[:2] == [f"# query: {NAME0}", f'Doc 1(Title: "{NAME0}") {NAME0} is a river known since 1500.']
    assert lines[4].startswith("# ids: doc0 ") and lines[5].startswith("# scores: 0.")


@pytest.mark.gpu
def test_gpu_matches_cpu_and_is_batch_independent(world, fresh):
    gpu = R.Retriever(world.index_dir, device="cuda", cache_size=0)
    queries = queries_of_mixed_lengths(world.rows)
    alone = bits([gpu.search([q])[0] for q in queries])
    assert bits(gpu.search(queries)) == alone
    for got, want in zip(gpu.search(queries), fresh.search(queries)):
        assert [d["id"] for d in got] == [d["id"] for d in want]
        np.testing.assert_allclose([d["score"] for d in got], [d["score"] for d in want], atol=1e-4)
    gpu.close()


# --- query tokens, cache bytes, damaged or copied index folders, read-only index files ---

def test_query_features_are_the_tokenizer_call(fresh):
    """The server tokenizes with a backend copy set up once; the ids are those of the tokenizer's own call."""
    queries = ["", " ", NAME0, "founded " * 400 + "x", "Ämber 日本語 \U0001F600", "[CLS] [SEP] x",
               "who\tis\nthe king?"]
    enc = fresh.encoder
    want = enc.tokenizer([enc.query_prefix + q for q in queries], max_length=enc.max_length, truncation=True)
    assert [list(ids) for ids, _ in enc.query_features(queries)] == want["input_ids"]
    assert np.array_equal(enc.encode_tokens(enc.query_features(queries)), enc.encode(queries, "query"))


def test_cache_is_bounded_in_bytes(world):
    probe = R.Retriever(world.index_dir, device="cpu", cache_size=0)
    one = search._bytes(("a king", 3), probe.search(["a king"])[0])
    probe.close()
    retriever = R.Retriever(world.index_dir, device="cpu", cache_bytes=int(2.5 * one))
    retriever.search(["a king"])
    retriever.search(["a ship"])
    retriever.search(["a king"])  # most recent now; "a ship" goes first
    retriever.search(["a city"])
    assert list(retriever._cache) == [("a king", 3), ("a city", 3)] and retriever.cache_used <= 2.5 * one
    retriever.search(["founded " * 10_000])  # one answer over the whole budget: not cached, nothing evicted
    assert list(retriever._cache) == [("a king", 3), ("a city", 3)]
    assert retriever.cache_used == sum(size for _, size in retriever._cache.values())
    retriever.close()


def _damage(index_dir, what):
    meta_path, offsets_path = os.path.join(index_dir, "meta.json"), os.path.join(index_dir, "offsets.npy")
    meta, offsets = json.load(open(meta_path)), np.load(offsets_path)
    if what == "meta not json":
        open(meta_path, "w").write('{"encoder": "minilm", ')
    elif what == "meta a list":
        json.dump([meta], open(meta_path, "w"))
    elif what == "meta without n_rows":
        json.dump({k: v for k, v in meta.items() if k != "n_rows"}, open(meta_path, "w"))
    elif what == "n_rows a string":
        json.dump({**meta, "n_rows": "50"}, open(meta_path, "w"))
    elif what == "fingerprint without size":
        json.dump({**meta, "corpus_fingerprint": {"rows": 50}}, open(meta_path, "w"))
    elif what == "offsets float":
        np.save(offsets_path, offsets.astype(np.float64))
    elif what == "offsets 2-d":
        np.save(offsets_path, offsets.reshape(5, 10))
    elif what == "offsets pickled":
        np.save(offsets_path, np.array([int(x) for x in offsets], dtype=object), allow_pickle=True)
    elif what == "offsets garbage":
        open(offsets_path, "wb").write(b"not an npy file at all")
    elif what == "offsets decreasing":
        np.save(offsets_path, offsets[::-1].copy())
    return meta_path, offsets_path


@pytest.mark.parametrize("what,names,match", [
    ("meta not json", "meta", "not valid JSON"), ("meta a list", "meta", "expected a JSON object, got list"),
    ("meta without n_rows", "meta", "'n_rows' missing"), ("n_rows a string", "meta", "'n_rows' is \"50\", expected"),
    ("fingerprint without size", "meta", "'corpus_fingerprint.size' missing"),
    ("offsets float", "offsets", "1-d integer array of byte offsets, got a float64"),
    ("offsets 2-d", "offsets", r"shape \(5, 10\)"), ("offsets pickled", "offsets", "not a readable .npy"),
    ("offsets garbage", "offsets", "not a readable .npy"), ("offsets decreasing", "offsets", "must .* increase")])
def test_damaged_index_files_are_named(world, tmp_path, what, names, match):
    index_dir = str(tmp_path / "index")
    shutil.copytree(world.index_dir, index_dir)
    meta_path, offsets_path = _damage(index_dir, what)
    with pytest.raises(ValueError, match=match) as error:
        R.Retriever(index_dir, device="cpu", corpus=world.corpus)
    assert (meta_path if names == "meta" else offsets_path) in str(error.value)


def test_a_copied_world_reads_its_own_corpus(world, fresh, tmp_path):
    """meta.json records the corpus by absolute path and relative to the index folder; the relative one wins wherever
    it exists, so a copy reads its own corpus (an edited copy is refused) while the original still exists."""
    copy = tmp_path / "copy"
    shutil.copytree(world.root, copy, ignore=shutil.ignore_patterns("described*"))
    retriever = R.Retriever(str(copy / "index"), device="cpu", cache_size=0)
    assert retriever.corpus == str(copy / "corpus.jsonl")
    assert bits(retriever.search([NAME0, "a king"])) == bits(fresh.search([NAME0, "a king"]))
    retriever.close()
    _edit_row(world.corpus, copy / "corpus.jsonl")
    with pytest.raises(ValueError, match=f"corpus {copy / 'corpus.jsonl'} does not match"):
        R.Retriever(str(copy / "index"), device="cpu")
    meta = json.load(open(copy / "index" / "meta.json"))
    assert meta["corpus"] == world.corpus and meta["corpus_relative"] == "../corpus.jsonl"  # what builds record
    json.dump({**meta, "corpus": "../corpus.jsonl"}, open(copy / "index" / "meta.json", "w"))
    with pytest.raises(ValueError, match=f"corpus {copy / 'corpus.jsonl'} does not match"):  # stored relative
        R.Retriever(str(copy / "index"), device="cpu")
    meta.pop("corpus_relative")  # a meta.json from before corpus_relative: the absolute path, as it always was
    json.dump(meta, open(copy / "index" / "meta.json", "w"))
    retriever = R.Retriever(str(copy / "index"), device="cpu", cache_size=0)
    assert retriever.corpus == world.corpus
    retriever.close()


def test_an_index_file_on_read_only_storage_gets_its_folder_in_the_cache(world, fresh, tmp_path, monkeypatch):
    """Search-R1's index-file mode wrote `<file>.twice` beside the file and crashed on read-only storage. Tests run
    as root, whom chmod does not stop: writes under the read-only folder fail as a read-only mount's would."""
    shelf = tmp_path / "shelf"
    shelf.mkdir()
    index_file = str(shelf / "e5_Flat.index")
    shutil.copy(os.path.join(world.index_dir, "index.faiss"), index_file)
    shelf.chmod(0o555)

    def guarded(call):
        def wrapper(path, *args, **kwargs):
            flags = args[0] if call is real["open"] and args else 0
            if str(os.fspath(path)).startswith(str(shelf)) and (call is not real["open"] or flags & (
                    os.O_WRONLY | os.O_RDWR | os.O_CREAT)):
                raise OSError(30, "Read-only file system", str(path))
            return call(path, *args, **kwargs)
        return wrapper
    real = {"open": os.open, "mkdir": os.mkdir, "rename": os.rename}
    for name, call in real.items():
        monkeypatch.setattr(os, name, guarded(call))
    monkeypatch.setenv("TWICE_CACHE", str(tmp_path / "cache"))
    try:
        out = I.search_r1_index_dir(index_file, world.corpus, "minilm", "minilm")
        assert out.startswith(str(tmp_path / "cache")) and sorted(os.listdir(shelf)) == ["e5_Flat.index"]
        assert I.search_r1_index_dir(index_file, world.corpus, "minilm", "minilm") == out  # reused
        retriever = R.Retriever(out, device="cpu", cache_size=0)
        assert bits(retriever.search([NAME0, "a king"])) == bits(fresh.search([NAME0, "a king"]))
        retriever.close()
        monkeypatch.setenv("TWICE_CACHE", str(shelf / "cache"))  # nowhere to write: say where it needs to
        with pytest.raises(OSError, match=r"needs an index folder .*e5_Flat\.index\.twice \(.*Read-only.*TWICE_CACHE"):
            I.search_r1_index_dir(index_file, world.corpus, "minilm", "minilm")
    finally:
        shelf.chmod(0o755)


def test_a_float16_index_answers_as_the_float32_index(world, fresh, monkeypatch):
    """DEVIATION S21: float16 candidates, certified or searched again with more, give the float32 index's answers to
    the bit; with no candidate margin and a bound 1000 times too wide every query is searched again, same answers."""
    half = R.Retriever(world.index_dir, device="cpu", cache_size=0, index_fp16=True)
    queries = queries_of_mixed_lengths(world.rows)
    assert half.index.error > 0 and bits(half.search(queries, topk=3)) == bits(fresh.search(queries, topk=3))

    class Counting:
        def __init__(self, index):
            self.index, self.calls = index, 0

        def search(self, vecs, k):
            self.calls += 1
            return self.index.search(vecs, k)
    monkeypatch.setattr(D, "CANDIDATE_MARGIN", 0)
    half.index.error, half.index.index = half.index.error * 1000, Counting(half.index.index)
    assert bits(half.search(queries, topk=3)) == bits(fresh.search(queries, topk=3))
    assert half.index.index.calls > len(queries)  # the batch's search, then searches again
    half.close()
