"""Tests for retrieval/server.py (the Search-R1 compatible HTTP server) and its load bench (perf/bench_server.py) over
test_retriever.py's 50-row MiniLM index (CPU, offline), and for RemoteRetriever against it."""
import ast
import asyncio
import concurrent.futures
import contextlib
import errno
import gc
import http.client
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests

import retriever as R
from perf import bench_server as B
from retrieval import index as I
from retrieval import limits as L
from retrieval import search
from retrieval import server as S
from test_retriever import KINDS, NAME0, ROOT, bits, dense, fresh, one_thread, world  # noqa: F401


@pytest.fixture(scope="module")
def url(dense):
    server, url = S.start_server(dense)
    yield url
    server.shutdown()
    server.server_close()


SERVER = [sys.executable, "-m", "retrieval.server"]
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


def stop(child):
    child.terminate()
    child.wait(timeout=60)


@contextlib.contextmanager
def refusing_port():
    """A port on 127.0.0.1 that refuses connections for as long as it is held: bound here, never
    listening, so no other process can take it meanwhile (a port merely found free can be)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def test_retriever_knows_nothing_of_serving():
    """retrieval/server.py searches through retrieval/search.py and never imports retriever.py; neither the search
    nor retriever.py imports the server or loads a web framework."""
    def imported(path):
        tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read())
        names = {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        return names
    for library in ("retriever.py", "retrieval/search.py"):
        names = imported(library)
        assert "retrieval.server" not in names and not {n.split(".")[0] for n in names} & {"uvicorn", "starlette",
                                                                                         "h11"}, (library, names)
    assert "retrieval.search" in imported("retrieval/server.py") and "retriever" not in imported("retrieval/server.py")


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


def test_a_wrong_method_gets_405_naming_the_allowed_ones(url):
    """GET /retrieve answered 404 as if the path did not exist: now 405 with Allow, in the server's
    JSON error shape; /health takes GET (and HEAD) only; an unknown path stays 404 whatever the
    method."""
    base = url.replace("/retrieve", "")
    for method, path, allow in [("GET", "/retrieve", "POST"), ("PUT", "/retrieve", "POST"),
                                ("DELETE", "/retrieve", "POST"), ("POST", "/health", "GET, HEAD"),
                                ("PATCH", "/health", "GET, HEAD")]:
        answer = requests.request(method, base + path, json={"queries": ["a"]}, timeout=30)
        assert answer.status_code == 405 and answer.headers["Allow"] == allow, (method, path)
        error = answer.json()["error"]
        assert set(answer.json()) == {"error"} and f"{method} {path}" in error, error
    assert requests.head(base + "/retrieve", timeout=30).status_code == 405
    assert requests.head(base + "/health", timeout=30).status_code == 200
    for method in ("GET", "POST", "PUT", "PATCH", "OPTIONS"):
        answer = requests.request(method, base + "/nope", timeout=30)
        assert answer.status_code == 404 and "/nope" in answer.json()["error"], method
    assert requests.post(url, json={"queries": ["a river"]}, timeout=30).status_code == 200


def test_remote_retriever_matches_dense(fresh, url):
    queries = [NAME0, "a city known since 1507", NAME0, "who is a painter"]
    for base in (url, url.replace("/retrieve", "/")):
        assert R.RemoteRetriever(base).search(queries, topk=4) == fresh.search(queries, topk=4)


def test_remote_retriever_errors(url):
    with pytest.raises(RuntimeError, match=r"HTTP 400.*'topk'"):
        R.RemoteRetriever(url).search(["a river"], topk=101)
    with pytest.raises(ValueError, match="queries"):
        R.RemoteRetriever(url).search("a river")
    with refusing_port() as port, pytest.raises(RuntimeError, match="failed after 2 attempts"):
        R.RemoteRetriever(f"http://127.0.0.1:{port}", timeout=5, retries=1, backoff=0.01).search(["a river"])


# --- Search-R1's client, its launch line, load (each of these failed on the http.server version) ---

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


def test_search_r1_launch_line(world, fresh, tmp_path):
    """retrieval_launch.sh with our script name, on an index *file* (+ --port/--device, as this test needs)."""
    index_file = str(tmp_path / "e5_Flat.index")
    shutil.copy(os.path.join(world.index_dir, "index.faiss"), index_file)
    line = ["--index_path", index_file, "--corpus_path", world.corpus, "--topk", "2", "--retriever_name", "minilm",
            "--retriever_model", "minilm", "--faiss_gpu"]
    args = S.parse_args(line + ["--host", "0.0.0.0"])
    assert (args.command, args.host, args.topk, args.faiss_gpu) == ("serve", "0.0.0.0", 2, True)
    assert args.index == index_file and args.corpus == world.corpus
    # the child binds --port 0 and reports its port (perf/bench_server.py's start_child)
    child, port, _ = B.start_child([*SERVER, *line, "--device", "cpu"], str(tmp_path), ONE_THREAD)
    try:
        answer = requests.post(f"http://127.0.0.1:{port}/retrieve", json={"queries": [NAME0, "a king"],
                                                                          "return_scores": True}, timeout=60)
        assert as_docs(answer.json()["result"]) == fresh.search([NAME0, "a king"], 2)  # --topk is the default
    finally:
        stop(child)
    assert os.path.exists(index_file + ".twice/meta.json")
    assert I.search_r1_prefixes("e5") == ("query: ", "passage: ") and I.search_r1_prefixes("bge")[1] == ""
    with pytest.raises(SystemExit):
        S.parse_args(["--index_path", index_file, "--retriever_name", "bm25"])


def test_a_bm25_folder_is_served_like_a_dense_one(world, tmp_path, capsys):
    """`retrieval/server.py` over a BM25 folder (retrieval/bm25.py), launched with Search-R1's BM25 flags: its answers equal in-process
    search bit for bit, over HTTP and through RemoteRetriever; a folder without meta.json (a pyserini Lucene index)
    is refused naming the command that builds ours."""
    index = str(tmp_path / "bm25")
    R.build_index(world.corpus, "bm25", index)
    retriever = R.Retriever(index, cache_size=0)
    queries = [NAME0, "a king", "", "river " * 300, "Zorvak's unknown words"]
    line = ["--index_path", index, "--retriever_name", "bm25", "--topk", "4"]
    child, port, _ = B.start_child([*SERVER, *line], str(tmp_path), ONE_THREAD)
    try:
        url = f"http://127.0.0.1:{port}/retrieve"
        assert requests.get(url.replace("/retrieve", "/health"), timeout=30).json() == {"status": "ok", "n_rows": 50}
        answer = requests.post(url, json={"queries": queries, "return_scores": True}, timeout=60).json()["result"]
        assert bits(as_docs(answer)) == bits(retriever.search(queries, 4)) and answer[0][0]["document"]["id"] == "doc0"
        assert bits(R.RemoteRetriever(url).search(queries, 2)) == bits(retriever.search(queries, 2))
    finally:
        stop(child)
    retriever.close()
    with pytest.raises(SystemExit):
        S.parse_args(["--index_path", str(tmp_path), "--retriever_name", "bm25"])
    assert "retriever.py build --encoder bm25" in capsys.readouterr().err


def test_servers_started_at_once_report_distinct_ports_they_bound(world, tmp_path):
    """A test used to pick a free port, close it and start the server on it: another process took
    it meanwhile (Address already in use). Now each child binds --port 0 itself and writes the
    port to --port_file once it listens; two started at once come up on two ports, each reported
    in full, and a child that exits first is reported with its output."""
    command = [*SERVER, "serve", "--index", world.index_dir, "--device", "cpu", "--workers", "1"]
    folders = [tmp_path / "a", tmp_path / "b"]
    for folder in folders:
        folder.mkdir()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        started = list(pool.map(lambda folder: B.start_child(command, str(folder), ONE_THREAD),
                                folders))
    try:
        ports = [port for _, port, _ in started]
        assert len(set(ports)) == 2 and 0 not in ports, ports
        for folder, (_, port, log) in zip(folders, started):
            assert (folder / "server.port").read_text() == f"{port}\n"
            assert sorted(os.listdir(folder)) == ["server.log", "server.port"]  # no temporary left
            assert f"at http://127.0.0.1:{port}/retrieve" in Path(log).read_text()
            health = requests.get(f"http://127.0.0.1:{port}/health", timeout=30).json()
            assert health == {"status": "ok", "n_rows": 50}
    finally:
        for child, _, _ in started:
            stop(child)
    missing = str(tmp_path / "no index here")
    with pytest.raises(RuntimeError, match=r"exited with status 1(.|\n)*no index here"):
        B.start_child([*SERVER, "serve", "--index", missing], str(tmp_path), ONE_THREAD)
    S.write_port_file(str(tmp_path / "port"), 8000)
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "port", "server.log"]
    assert (tmp_path / "port").read_text() == "8000\n"

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

    monkeypatch.setattr(S, "Retriever", lambda *args: SimpleNamespace(n_rows=1))
    monkeypatch.setattr(S, "make_server", lambda *args, **options: Server())
    assert gc.get_freeze_count() == 0
    try:
        S.serve("an index")
    finally:
        gc.unfreeze()
    assert seen["frozen"] > 10_000  # torch, transformers, pytest: the whole heap, not a handful


def test_bench_server_measures_a_child_server(world):
    """`retrieval/server.py bench`, scaled down: it starts a server, loads it, and checks every answer against
    in-process search; the server's CPU time is read from its process."""
    figures = B.bench_server(world.index_dir, clients=3, per_client=2, size=2, big=40)
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

    batcher = S.Batcher(Recorder(), round_cost=16)
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
    batcher = S.Batcher(Recorder(), round_cost=100, cost=lambda queries: [int(q[1:]) for q in queries])
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

    batcher = S.Batcher(Recorder(), round_cost=16, workers=2)
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

    batcher = S.Batcher(Slow(), round_cost=16, workers=2)
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
    retriever = R.Retriever(world.index_dir, device="cpu", cache_size=0)
    server, url = S.start_server(retriever)
    # the big request must outlast the 0.3 s head start by far on any CPU: sized from a timed in-process batch
    start = time.perf_counter()
    retriever.search(B.bench_queries(64, "calibrate"), topk=3)
    per_query = (time.perf_counter() - start) / 64
    big = B.bench_queries(int(min(5000, max(240, 2.0 / per_query))), "big")  # ~2 s of encoding
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            job = pool.submit(B._timed_post, url, big)
            time.sleep(0.3)
            small_s, small = B._timed_post(url, [NAME0])
            small_done_first = not job.done()
            big_s, big_result = job.result()
    finally:
        server.shutdown()
        server.server_close()
    assert small_done_first and small_s < big_s / 2, (small_s, big_s)
    assert B.bench_exactness(retriever, [(big, big_result), ([NAME0], small)]) == 0
    retriever.close()


def test_concurrent_load_and_connection_burst(world, fresh, url):
    """16 clients x 4 requests of 4 queries, then 64 connections opened at once: all answered, none waits 1 s."""
    stats, sent = B.bench_load(url, clients=16, per_client=4, size=4)
    assert stats["errors"] == 0 and B.bench_exactness(fresh, sent) == 0
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
    server, url = S.start_server(dense, max_queries=5)
    try:
        status, payload = post_raw(url, json.dumps({"queries": ["a king"] * 6}).encode())
        assert status == 400 and re.search(r"'queries' holds 6 queries, at most 5 per request", payload["error"])
        assert requests.post(url, json={"queries": ["a king"] * 5}, timeout=30).status_code == 200
    finally:
        server.shutdown()
        server.server_close()


def test_slow_clients_are_cut_off(dense):
    server, url = S.start_server(dense, head_timeout=1.0, body_timeout=1.0)
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
    with refusing_port() as port, pytest.raises(ValueError, match="not valid Unicode"):
        # a client that tried to send would fail with RuntimeError
        R.RemoteRetriever(f"http://127.0.0.1:{port}", retries=3, backoff=0.01).search(["\ud800"])




# --- startup flags, long queries, descriptors, abandoned requests ---

BAD_FLAGS = [(["--workers", "-1"], "--workers"), (["--workers", "0"], "--workers"), (["--topk", "0"], "--topk"),
             (["--topk", "101"], "--topk"), (["--max_queries", "-1"], "--max_queries"), (["--port", "70000"], "--port"),
             (["--port", "-1"], "--port"), (["--cache_size", "-1"], "--cache_size"),
             (["--cache_bytes", "-1"], "--cache_bytes"), (["--max_query_bytes", "0"], "--max_query_bytes"),
             (["--max_connections", "0"], "--max_connections")]


def test_bad_server_flags_exit_2_naming_the_flag_before_loading(tmp_path, capsys):
    """`serve --workers -1` used to start no encoder thread: /health answered, every retrieve waited for ever."""
    missing = str(tmp_path / "no index here")  # loading it would fail with another error and status 1
    start = time.perf_counter()
    child = subprocess.run([sys.executable, "-m", "retrieval.server", "serve", "--index", missing,
                            "--workers", "-1"], capture_output=True, text=True, timeout=120)
    assert child.returncode == 2 and "--workers must be an integer >= 1, got -1" in child.stderr, child.stderr
    assert time.perf_counter() - start < 60
    for flags, name in BAD_FLAGS + [(["bench", "--clients", "0"], "--clients"), (["bench", "--threads", "0"],
                                                                                  "--threads")]:
        argv = flags if flags[0] == "bench" else ["serve", "--index", missing, *flags]
        with pytest.raises(SystemExit) as stop:
            S.parse_args(argv)
        assert stop.value.code == 2 and f"{name} must be an integer" in capsys.readouterr().err, flags
    assert S.parse_args(["serve", "--index", missing, "--port", "0", "--cache_size", "0", "--topk", "100"]).port == 0
    with pytest.raises(ValueError, match="workers must be an integer >= 1"):
        S.Batcher(None, workers=0)


def test_queries_past_the_byte_cap_get_400_naming_them(dense):
    """Eight legal 1 MB queries used to stall every small request for 2-4 s and grow the server by ~630 MB."""
    with pytest.raises(ValueError, match=r"'queries'\[0\] is 1048576 bytes long \(UTF-8\), at most 16384 per query"):
        S.parse_request({"queries": ["x" * (1 << 20)]})
    # the default cap holds any query of our rollout (cut to 1024 characters, DEVIATION R2) and 256 tokens of text
    assert search.check_queries(["\U0001F600" * 1024, "word " * 3000], max_query_bytes=search.MAX_QUERY_BYTES)
    server, url = S.start_server(dense, max_query_bytes=100)
    try:
        status, payload = post_raw(url, json.dumps({"queries": ["a king", "é" * 51]}).encode())  # 102 UTF-8 bytes
        assert status == 400 and re.search(r"'queries'\[1\] is 102 bytes long \(UTF-8\), at most 100 per query",
                                           payload["error"]) and "--max_query_bytes" in payload["error"], payload
        assert requests.post(url, json={"queries": ["é" * 50]}, timeout=30).status_code == 200  # 100 bytes: fits
    finally:
        server.shutdown()
        server.server_close()


def test_requests_are_tokenized_once_without_the_tokenizer_lock(world, fresh):
    """A request's queries used to be tokenized twice under one lock (for the rounds' costs, then to encode), so one
    request of long queries held every other request up. Now once, in the request's thread, with no lock."""
    retriever = R.Retriever(world.index_dir, device="cpu", cache_size=0)
    queries, body = [NAME0, "a king", "founded " * 400 + "the city"], {"topk": 3, "return_scores": True}
    server, url = S.start_server(retriever)
    try:
        with retriever.encoder._tokenizer_lock:  # held for the whole request: it must not be needed
            answer = requests.post(url, json={"queries": queries, **body}, timeout=30)
    finally:
        server.shutdown()
        server.server_close()
    assert answer.status_code == 200
    assert bits(as_docs(answer.json()["result"])) == bits(fresh.search(queries, 3))  # bit for bit as in-process
    calls, tokenize = [], retriever.encoder.query_features
    retriever.encoder.query_features = lambda queries: calls.append(list(queries)) or tokenize(queries)
    server, url = S.start_server(retriever)
    try:
        assert requests.post(url, json={"queries": queries, **body}, timeout=30).status_code == 200
    finally:
        server.shutdown()
        server.server_close()
    assert calls == [queries]  # once, all of the request's queries together
    retriever.close()


def test_a_request_whose_client_left_is_not_computed(world):
    """A request still queued when its client disconnects is dropped: its queries never reach the encoder."""
    retriever = R.Retriever(world.index_dir, device="cpu", cache_size=0)
    searched, gate, search = [], threading.Event(), retriever.search_batch

    def recording(items, *rest):
        searched.append([query for query, _ in items])
        if "hold the worker" in searched[-1]:
            assert gate.wait(30)
        return search(items, *rest)

    retriever.search_batch = recording
    server, url = S.start_server(retriever, workers=1)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(requests.post, url, json={"queries": ["hold the worker"]}, timeout=60)
            while not searched:
                time.sleep(0.01)
            body = json.dumps({"queries": ["never computed"]}).encode()
            with socket.create_connection(("127.0.0.1", server.server_port), timeout=10) as sock:
                sock.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                time.sleep(0.5)  # parsed, tokenized and queued behind the held round
            time.sleep(0.5)  # the server sees the connection close
            gate.set()
            assert first.result().status_code == 200
        assert requests.post(url, json={"queries": ["asked after"]}, timeout=30).status_code == 200
    finally:
        gate.set()
        server.shutdown()
        server.server_close()
    assert searched == [["hold the worker"], ["asked after"]], searched
    retriever.close()


def test_connections_past_the_cap_get_503_and_the_server_keeps_serving(dense):
    server, url = S.start_server(dense, max_connections=4)
    idle = [socket.create_connection(("127.0.0.1", server.server_port), timeout=10) for _ in range(4)]
    try:
        time.sleep(0.3)  # accepted: the four hold the cap
        with socket.create_connection(("127.0.0.1", server.server_port), timeout=10) as extra:
            assert extra.recv(1000).startswith(b"HTTP/1.1 503 ")
        for sock in idle:
            sock.close()
        time.sleep(0.3)
        assert requests.get(url.replace("/retrieve", "/health"), timeout=30).status_code == 200
        for _ in range(100):  # the server sees the health request's connection close a moment later
            if server.connections.open == 0:
                break
            time.sleep(0.05)
        assert server.connections.open == 0  # every place given back
    finally:
        for sock in idle:
            sock.close()
        server.shutdown()
        server.server_close()


def test_descriptor_exhaustion_is_logged_once_per_interval(world, tmp_path):
    """A server at ulimit -n 160 with 300 idle connections: CPython's accept loop logged a traceback per attempt
    (~56k lines a second). Now the connections past the cap (what the limit leaves) get 503 and are closed, a line per
    interval is logged, and once the clients close, /health answers again."""
    launcher = ("import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (160, 160)); "
                "sys.argv = sys.argv[1:]; runpy.run_module('retrieval.server', run_name='__main__', alter_sys=True)")
    command = [sys.executable, "-c", launcher, "retrieval/server.py", "serve", "--index",
               world.index_dir, "--device", "cpu"]
    child, port, log = B.start_child(command, str(tmp_path), ONE_THREAD)
    log, idle = Path(log), []
    try:
        before = len(log.read_text().splitlines())
        start = time.perf_counter()
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(300)]
        time.sleep(3)
        lines = log.read_text().splitlines()[before:]
        seconds = time.perf_counter() - start
        for sock in idle:
            sock.setblocking(False)
        refused = sum(_received(sock).startswith(b"HTTP/1.1 503 ") for sock in idle)
        assert 300 - 160 <= refused < 300, refused  # the cap is below the limit, and above nothing
        assert len(lines) <= 2 * seconds / L.LOG_INTERVAL + 2, lines[:5]
        for sock in idle:
            sock.close()
        assert requests.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200
    finally:
        for sock in idle:
            sock.close()
        stop(child)


def _received(sock) -> bytes:
    try:
        return sock.recv(1000)
    except (BlockingIOError, ConnectionError):
        return b""


def test_out_of_descriptors_accept_pauses_and_logs_once(dense, monkeypatch):
    """Past the cap (an explicit --max_connections above what the limit leaves), accept() fails with EMFILE. asyncio
    pauses accepting 1 s but its loop goes on calling accept() up to BACKLOG times, logging each failure: now the
    calls after the first report nothing waiting, and the loop's error handler logs one line per interval."""
    server = S.make_server(dense, port=0)
    calls = []

    def exhausted(self):
        calls.append(1)
        raise OSError(errno.EMFILE, "Too many open files")
    monkeypatch.setattr(socket.socket, "accept", exhausted)
    try:
        with pytest.raises(OSError) as first:
            server.socket.accept()
        assert first.value.errno == errno.EMFILE
        for _ in range(2000):  # the rest of asyncio's loop over BACKLOG accepts
            with pytest.raises(BlockingIOError):
                server.socket.accept()
        assert len(calls) == 1
        lines, loop = [], asyncio.new_event_loop()
        monkeypatch.setattr(S.LOG, "warning", lines.append)  # uvicorn's logger does not propagate to caplog's
        for _ in range(1000):
            server._loop_error(loop, {"message": "socket.accept() out of system resource", "exception": first.value})
        loop.close()
        assert len(lines) == 1 and "cannot accept connections (Too many open files)" in lines[0], lines[:3]
    finally:
        server.server_close()
