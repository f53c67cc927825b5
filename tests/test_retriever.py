"""Tests for retriever.py on a 50-row corpus of invented entities, encoded with the packaged MiniLM (CPU, offline)."""
import concurrent.futures
import gc
import http.client
import json
import math
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import faiss
import numpy as np
import pytest
import requests
import torch

import retriever as R
from protocol import information_block

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
    retriever = R.DenseRetriever(world.index_dir, device="cpu")
    yield retriever
    retriever.close()


@pytest.fixture(scope="module")
def fresh(world):
    """No cache: every search really encodes and searches."""
    retriever = R.DenseRetriever(world.index_dir, device="cpu", cache_size=0)
    yield retriever
    retriever.close()


@pytest.fixture(scope="module")
def url(dense):
    server, url = R.start_server(dense)
    yield url
    server.shutdown()
    server.server_close()


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
    assert os.path.exists(os.path.join(R.resolve_encoder("minilm"), "config.json"))
    assert R.resolve_encoder("e5") == "intfloat/e5-base-v2"
    assert R.resolve_encoder("/models/mine") == "/models/mine"
    assert R.encoder_prefixes("e5") == R.encoder_prefixes("/models/e5-large-v2") == ("query: ", "passage: ")
    assert R.encoder_prefixes("minilm") == R.encoder_prefixes("/tmp/abe5x/bert") == ("", "")


def test_encoder_matches_sentence_transformers(dense):
    from sentence_transformers import SentenceTransformer
    texts = [NAME0, "who is a river known since 1500", '"Dusky Citadel"\nDusky Citadel is a language.\nMore.']
    reference = SentenceTransformer(R.resolve_encoder("minilm"), device="cpu").encode(texts, normalize_embeddings=True)
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
    lengths = [len(ids) for ids in enc.tokenizer(queries, max_length=R.MAX_LENGTH, truncation=True)["input_ids"]]
    assert enc.packed and min(lengths) == 2 and max(lengths) == R.MAX_LENGTH > R.PACK_TOKENS
    together = enc.encode(queries, "query")
    order = np.random.default_rng(0).permutation(len(queries))
    assert (enc.encode([queries[i] for i in order], "query") == together[order]).all()
    assert all((enc.encode([q], "query")[0] == v).all() for q, v in zip(queries, together))
    padded = enc.tokenizer(queries, max_length=R.MAX_LENGTH, truncation=True, padding=True, return_tensors="pt")
    np.testing.assert_allclose(together, enc._pool(padded), rtol=0, atol=2e-6)


def test_pack_queries_fills_packs_longest_first():
    assert R.pack_queries([5, 130, 3, 128, 60, 70, 2], 128) == [[1], [3], [5, 0, 2, 6], [4]]
    lengths = np.random.default_rng(1).integers(1, 40, 500).tolist()
    packs = R.pack_queries(lengths, 128)
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
            got_rows, got_scores = R.exact_top(rows, products, topk)
            assert got_rows.tolist() == rows[best].tolist() and got_scores.tobytes() == plain[best].tobytes()


def test_cache_hits_misses_and_eviction(world):
    retriever = R.DenseRetriever(world.index_dir, device="cpu", cache_size=2)
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
        R.DenseRetriever(index_dir, device="cpu", corpus=corpus)


def test_moved_corpus_is_accepted_when_identical(world, fresh, tmp_path):
    moved = shutil.copy(world.corpus, tmp_path / "moved.jsonl")
    retriever = R.DenseRetriever(world.index_dir, device="cpu", cache_size=0, corpus=str(moved))
    assert bits(retriever.search(["a king", NAME0])) == bits(fresh.search(["a king", NAME0]))
    retriever.close()


@pytest.mark.parametrize("line", ["not json", "[1, 2]", '{"id": 1}', '{"id": [1], "contents": "x"}',
                                  '{"id": true, "contents": "x"}', '{"id": 1, "contents": 5}'])
def test_bad_corpus_row_names_file_and_line(tmp_path, line):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": 0, "contents": "\\"A\\"\\na"}\n\n' + line + "\n")  # line 2 is blank, line 3 is bad
    with pytest.raises(ValueError, match=f"{path}:3: "):
        list(R.iter_corpus(str(path)))


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
    meta = R.describe_prebuilt(index_file, world.corpus, out_dir=out)  # the E5 default: prefixes recorded
    assert (meta["encoder"], meta["query_prefix"], meta["passage_prefix"]) == (R.E5, "query: ", "passage: ")
    meta = R.describe_prebuilt(index_file, world.corpus, "minilm", out_dir=out)  # replaces the folder
    assert meta["index_file"] == index_file and meta["n_rows"] == 50 and meta["query_prefix"] == ""
    assert sorted(os.listdir(out)) == ["meta.json", "offsets.npy"]
    retriever = R.DenseRetriever(out, device="cpu", cache_size=0)
    queries = [NAME0, "a ship known since 1600", "who is a king"]
    assert bits(retriever.search(queries, topk=5)) == bits(fresh.search(queries, topk=5))
    retriever.close()
    small = faiss.IndexFlatIP(384)
    small.add(vectors[:49])
    faiss.write_index(small, index_file)
    with pytest.raises(ValueError, match="holds 49 vectors but .* has 50 rows"):
        R.describe_prebuilt(index_file, world.corpus, "minilm", out_dir=str(tmp_path / "other"))


# --- HTTP server and client ---

def post_raw(url, body, headers=None, path="/retrieve"):
    host, port = url.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", path)
    for key, value in ({"Content-Length": str(len(body))} if headers is None else headers).items():
        conn.putheader(key, value)
    conn.endheaders()
    if body:
        conn.send(body)
    response = conn.getresponse()
    status, payload = response.status, json.loads(response.read())
    conn.close()
    return status, payload


def post_status(url, body, headers):
    host, port = url.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/retrieve")
    for key, value in headers.items():
        conn.putheader(key, value)
    conn.endheaders()
    status = conn.getresponse().status
    conn.close()
    return status


def test_server_health(url):
    assert requests.get(url.replace("/retrieve", "/health"), timeout=30).json() == {"status": "ok", "n_rows": 50}


def test_server_answers_concurrent_clients_like_in_process(world, fresh, url):
    pool = [row["name"] for row in world.rows[:16]] + [f"a {kind}" for kind in KINDS]
    expected = {(q, k): docs for k in (1, 3, 5) for q, docs in zip(pool, fresh.search(pool, k))}
    rng = random.Random(3)
    requests_ = [(rng.sample(pool, rng.randint(1, 4)), rng.choice((1, 3, 5))) for _ in range(200)]

    def ask(request):
        queries, topk = request
        answer = requests.post(url, json={"queries": queries, "topk": topk, "return_scores": True}, timeout=60)
        assert answer.status_code == 200, answer.text
        got = [[{**item["document"], "score": item["score"]} for item in docs] for docs in answer.json()["result"]]
        return got == [expected[(q, topk)] for q in queries]

    with concurrent.futures.ThreadPoolExecutor(8) as executor:
        assert all(executor.map(ask, requests_))


def test_server_without_scores(fresh, url):
    queries = [NAME0, "a river"]
    for body in ({"queries": queries, "topk": 2, "return_scores": False}, {"queries": queries, "topk": 2}):
        result = requests.post(url, json=body, timeout=30).json()["result"]
        expected = fresh.search(queries, 2)
        assert result == [[{"document": {"id": d["id"], "contents": d["contents"]}} for d in docs] for docs in expected]


MALFORMED = [(b"{not json", "not valid JSON"), (b"\xff\xfe\xfa", "not valid JSON"), (b"[1, 2]", "JSON object"),
             (b'"queries"', "JSON object"), ({}, "'queries'"),
             ({"queries": "who"}, "'queries'"), ({"queries": [1]}, r"'queries'\[0\]"),
             ({"queries": ["a", None]}, r"'queries'\[1\]"),
             ({"queries": ["a"], "topk": "3"}, "'topk'"), ({"queries": ["a"], "topk": 2.5}, "'topk'"),
             ({"queries": ["a"], "topk": True}, "'topk'"), ({"queries": ["a"], "topk": 0}, "'topk'"),
             ({"queries": ["a"], "topk": 101}, "'topk'"), ({"queries": ["a"], "topk": -1}, "'topk'"),
             ({"queries": ["a"], "return_scores": "yes"}, "'return_scores'"),
             ({"queries": ["a"], "return_scores": 1}, "'return_scores'")]


@pytest.mark.parametrize("body,match", MALFORMED, ids=[str(i) for i in range(len(MALFORMED))])
def test_server_rejects_malformed_request(url, body, match):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, payload = post_raw(url, raw)
    assert status == 400 and set(payload) == {"error"}
    assert re.search(match, payload["error"]), payload
    assert requests.post(url, json={"queries": ["a river"]}, timeout=30).status_code == 200  # still serving


def test_server_rejects_bad_length_and_paths(url):
    for headers in ({"Content-Length": str(10 ** 9)}, {}):
        status, payload = post_raw(url, b"", headers)
        assert status == 400 and "Content-Length" in payload["error"]
    assert post_status(url, b"", {"Content-Length": "-5"}) == 400  # refused by h11 (uvicorn), in its own words
    status, payload = post_raw(url, b'{"queries": ["a"]}', path="/search")
    assert status == 404 and "/search" in payload["error"]
    answer = requests.get(url.replace("/retrieve", "/nope"), timeout=30)
    assert answer.status_code == 404 and "error" in answer.json()
    assert requests.get(url.replace("/retrieve", "/health"), timeout=30).status_code == 200


def test_remote_retriever_matches_dense(fresh, url):
    queries = [NAME0, "a city known since 1507", NAME0, "who is a painter"]
    for base in (url, url.replace("/retrieve", "/")):
        assert R.RemoteRetriever(base).search(queries, topk=4) == fresh.search(queries, topk=4)


def test_remote_retriever_errors(url):
    with pytest.raises(RuntimeError, match=r"HTTP 400.*'topk'"):
        R.RemoteRetriever(url).search(["a river"], topk=101)
    with pytest.raises(ValueError, match="queries"):
        R.RemoteRetriever(url).search("a river")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RuntimeError, match="failed after 2 attempts"):
        R.RemoteRetriever(f"http://127.0.0.1:{port}", timeout=5, retries=1, backoff=0.01).search(["a river"])


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


# --- issue 10: Search-R1's client, its launch line, load (each of these failed on the http.server version) ---

def as_docs(result):
    return [[{**item["document"], "score": item["score"]} for item in docs] for docs in result]


def test_server_answers_search_r1_empty_batch_and_empty_query(fresh, url):
    """Search-R1's trainer sends {"queries": []} when no row searched, and "" for <search> </search>."""
    assert requests.post(url, json={"queries": []}, timeout=30).json() == {"result": []}
    queries = ["", " ", NAME0]
    answer = requests.post(url, json={"queries": queries, "topk": 3, "return_scores": True}, timeout=30)
    assert answer.status_code == 200 and as_docs(answer.json()["result"]) == fresh.search(queries, 3)
    assert [len(docs) for docs in answer.json()["result"]] == [3, 3, 3]
    assert R.RemoteRetriever(url).search([]) == [] and R.RemoteRetriever(url).search([""]) == fresh.search([""])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_search_r1_launch_line(world, fresh, tmp_path):
    """retrieval_launch.sh with our script name, on an index *file* (+ --port/--device, as this test needs)."""
    index_file = str(tmp_path / "e5_Flat.index")
    shutil.copy(os.path.join(world.index_dir, "index.faiss"), index_file)
    port = free_port()
    line = ["--index_path", index_file, "--corpus_path", world.corpus, "--topk", "2", "--retriever_name", "minilm",
            "--retriever_model", "minilm", "--faiss_gpu"]
    args = R.parse_args(line + ["--host", "0.0.0.0"])
    assert (args.command, args.host, args.topk, args.faiss_gpu) == ("serve", "0.0.0.0", 2, True)
    assert args.index == index_file and args.corpus == world.corpus
    child = subprocess.Popen([sys.executable, os.path.join(ROOT, "retriever.py"), *line, "--port", str(port),
                              "--device", "cpu"], env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        for _ in range(600):
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).ok:
                    break
            except requests.RequestException:
                assert child.poll() is None, "the server exited"
                time.sleep(0.2)
        answer = requests.post(f"http://127.0.0.1:{port}/retrieve", json={"queries": [NAME0, "a king"],
                                                                          "return_scores": True}, timeout=60)
        assert as_docs(answer.json()["result"]) == fresh.search([NAME0, "a king"], 2)  # --topk is the default
    finally:
        child.terminate()
        child.wait(timeout=60)
    assert os.path.exists(index_file + ".twice/meta.json")
    assert R.search_r1_prefixes("e5") == ("query: ", "passage: ") and R.search_r1_prefixes("bge")[1] == ""
    with pytest.raises(SystemExit):
        R.parse_args(["--index_path", index_file, "--retriever_name", "bm25"])


def test_serve_freezes_the_loaded_heap(monkeypatch):
    """A full garbage collection walks every object loaded (~4e5 with torch and the model, ~160 ms holding the GIL,
    every request in flight waiting): the server's process exempts them before it serves."""
    seen = {}

    class Server:
        server_port = 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False  # exceptions propagate

        def serve_forever(self):
            seen["frozen"] = gc.get_freeze_count()

    monkeypatch.setattr(R, "DenseRetriever", lambda *args: SimpleNamespace(n_rows=1))
    monkeypatch.setattr(R, "make_server", lambda *args, **options: Server())
    assert gc.get_freeze_count() == 0
    try:
        R.serve("an index")
    finally:
        gc.unfreeze()
    assert seen["frozen"] > 10_000  # torch, transformers, pytest: the whole heap, not a handful


def test_bench_server_measures_a_child_server(world):
    """`retriever.py bench-server`, scaled down: it starts a server, loads it, and checks every answer against
    in-process search; the server's CPU time is read from its process."""
    figures = R.bench_server(world.index_dir, clients=3, per_client=2, size=2, big=40)
    load = figures["load"]
    assert (load["requests"], load["errors"], figures["interleave"]["errors"], figures["differ"]) == (6, 0, 0, 0)
    assert 0 < load["p50_ms"] <= load["p99_ms"] <= load["max_ms"] and load["server_cpu_ms_per_query"] > 0


def test_batcher_splits_big_requests_round_robin():
    """A request of 100 queries goes in slices of 8 (16 a round); a 3-query one sent meanwhile rides in round 2.
    With token costs, a round stops before the query that would pass its budget; a longer query goes alone."""
    gate, calls = threading.Event(), []

    class Recorder:
        def search_batch(self, items):
            calls.append([query for query, _ in items])
            gate.wait(10)
            return [[{"id": query}] for query, _ in items]

    batcher = R.Batcher(Recorder(), round_cost=16)
    big = batcher.submit([f"b{i}" for i in range(100)], 3)
    while not calls:
        time.sleep(0.01)
    small = batcher.submit(["s0", "s1", "s2"], 3)
    gate.set()
    assert small.result(10) == [[{"id": "s0"}], [{"id": "s1"}], [{"id": "s2"}]]
    assert [len(c) for c in calls] == [16] * 6 + [7] and calls[1][8:11] == ["s0", "s1", "s2"]  # b24..b28 next
    assert [docs[0]["id"] for docs in big.result(10)] == [f"b{i}" for i in range(100)]
    batcher.close()

    calls.clear()
    batcher = R.Batcher(Recorder(), round_cost=100, cost=lambda queries: [int(q[1:]) for q in queries])
    job = batcher.submit(["t30", "t30", "t30", "t20", "t150", "t5", "t90"], 3)
    assert [docs[0]["id"] for docs in job.result(10)] == ["t30", "t30", "t30", "t20", "t150", "t5", "t90"]
    assert calls == [["t30", "t30", "t30"], ["t20"], ["t150"], ["t5", "t90"]]  # 30 x 3 + 20 > 100: t20 waits
    assert batcher.submit([], 3).result(1) == []
    batcher.close()


def test_batcher_workers_share_rounds_and_finish_out_of_order():
    """Two workers take rounds of 16 out of 40 waiting queries; the second round finishes first, the answer is still
    in order; the last 8 wait for a free worker. Less than a round's budget waiting never starts a round beside a
    busy worker."""
    first_done, calls = threading.Event(), []

    class Recorder:
        def search_batch(self, items):
            calls.append([query for query, _ in items])
            if items[0][0] == "q0":
                assert first_done.wait(10)  # the first round waits for the second one to finish
            elif items[0][0] == "q16":
                first_done.set()
            return [[{"id": query}] for query, _ in items]

    batcher = R.Batcher(Recorder(), round_cost=16, workers=2)
    job = batcher.submit([f"q{i}" for i in range(40)], 3)
    assert [docs[0]["id"] for docs in job.result(10)] == [f"q{i}" for i in range(40)]
    assert [len(c) for c in calls] == [16, 16, 8] and calls[2][0] == "q32"
    batcher.close()

    gate, sizes = threading.Event(), []

    class Slow:
        def search_batch(self, items):
            sizes.append(len(items))
            gate.wait(10)
            return [[{"id": query}] for query, _ in items]

    batcher = R.Batcher(Slow(), round_cost=16, workers=2)
    first = batcher.submit(["a"], 3)
    while not sizes:
        time.sleep(0.01)
    second = batcher.submit([f"b{i}" for i in range(15)], 3)
    time.sleep(0.3)
    assert sizes == [1]  # the idle worker waits: too few queries to fill its packs
    gate.set()
    assert len(first.result(10)) == 1 and len(second.result(10)) == 15
    batcher.close()


def test_big_request_does_not_stall_small_ones(world):
    retriever = R.DenseRetriever(world.index_dir, device="cpu", cache_size=0)
    server, url = R.start_server(retriever)
    big = R.bench_queries(240, "big")  # ~1.2 s of encoding on one free core
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            job = pool.submit(R._timed_post, url, big)
            time.sleep(0.3)
            small_s, small = R._timed_post(url, [NAME0])
            small_done_first = not job.done()
            big_s, big_result = job.result()
    finally:
        server.shutdown()
        server.server_close()
    assert small_done_first and small_s < big_s / 2, (small_s, big_s)
    assert R.bench_exactness(retriever, [(big, big_result), ([NAME0], small)]) == 0
    retriever.close()


def test_concurrent_load_and_connection_burst(world, fresh, url):
    """16 clients x 4 requests of 4 queries, then 64 connections opened at once: all answered, none waits 1 s."""
    stats, sent = R.bench_load(url, clients=16, per_client=4, size=4)
    assert stats["errors"] == 0 and R.bench_exactness(fresh, sent) == 0
    host, port = url.split("//")[1].split("/")[0].split(":")
    barrier, body = threading.Barrier(64), json.dumps({"queries": [NAME0]}).encode()

    def connect_and_ask(_):
        barrier.wait()
        start = time.perf_counter()
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.connect()  # a SYN dropped by a full listen queue is resent after 1 s
        connect_s = time.perf_counter() - start
        conn.request("POST", "/retrieve", body, {"Content-Type": "application/json"})
        status = conn.getresponse().status
        conn.close()
        return connect_s, status

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(connect_and_ask, range(64)))
    assert all(status == 200 for _, status in answers)
    assert max(seconds for seconds, _ in answers) < 0.9, sorted(seconds for seconds, _ in answers)[-5:]


def test_queries_per_request_are_capped(dense):
    server, url = R.start_server(dense, max_queries=5)
    try:
        status, payload = post_raw(url, json.dumps({"queries": ["a king"] * 6}).encode())
        assert status == 400 and re.search(r"'queries' holds 6 queries, at most 5 per request", payload["error"])
        assert requests.post(url, json={"queries": ["a king"] * 5}, timeout=30).status_code == 200
    finally:
        server.shutdown()
        server.server_close()


def test_slow_clients_are_cut_off(dense):
    server, url = R.start_server(dense, head_timeout=1.0, body_timeout=1.0)
    try:
        with socket.create_connection(("127.0.0.1", server.server_port), timeout=10) as sock:
            sock.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\n")  # and the rest of the head never comes
            start = time.perf_counter()
            assert sock.recv(1000) == b"" and time.perf_counter() - start < 5  # closed by the server
        with socket.create_connection(("127.0.0.1", server.server_port), timeout=10) as sock:
            sock.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b'{"queries": ')
            assert sock.recv(1000).startswith(b"HTTP/1.1 408 ")
        assert requests.post(url, json={"queries": ["a river"]}, timeout=30).status_code == 200  # still serving
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("body", [b"[" * 100_000 + b"]" * 100_000,
                                  b'{"queries": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"])
def test_deeply_nested_json_gets_400(url, body):
    status, payload = post_raw(url, body)
    assert status == 400 and "nested too deeply" in payload["error"]


def test_lone_surrogate_is_refused_not_retried(url):
    status, payload = post_raw(url, b'{"queries": ["fine", "\\ud800"]}')
    assert status == 400 and re.search(r"'queries'\[1\] is not valid Unicode", payload["error"])
    dead = f"http://127.0.0.1:{free_port()}"  # a client that tried to send would fail with RuntimeError
    with pytest.raises(ValueError, match="not valid Unicode"):
        R.RemoteRetriever(dead, retries=3, backoff=0.01).search(["\ud800"])


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
    gpu = R.DenseRetriever(world.index_dir, device="cuda", cache_size=0)
    queries = queries_of_mixed_lengths(world.rows)
    alone = bits([gpu.search([q])[0] for q in queries])
    assert bits(gpu.search(queries)) == alone
    for got, want in zip(gpu.search(queries), fresh.search(queries)):
        assert [d["id"] for d in got] == [d["id"] for d in want]
        np.testing.assert_allclose([d["score"] for d in got], [d["score"] for d in want], atol=1e-4)
    gpu.close()
