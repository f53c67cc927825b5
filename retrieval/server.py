"""Search-R1 compatible retrieval server (Search-R1's retrieval_server.py) over an index folder.

The server knows HTTP, request checks, rounds of queries and their threads; it knows nothing of
encoders, FAISS or the corpus: every search is `Retriever.search_batch` from retrieval/search.py (a
dense folder, retrieval/dense.py, or a BM25 one, retrieval/bm25.py), so an answer over HTTP equals
an in-process search bit for bit (retrieval/dense.py, Determinism (1) and (2)). It never imports
retriever.py (the top-level front), and nothing below it imports this file. Its load bench is
perf/bench_server.py, which `bench` runs in a child process: this file never imports it, and
defines only its flags (`add_bench_flags`), so that a bad one is refused before anything starts.

Contract (DESIGN.md sections 3, 10 and 12; Search-R1 compatible)
- POST /retrieve {"queries": [str, ...], "topk": k, "return_scores": bool}
  -> {"result": [[{"document": {"id": str, "contents": str}, "score": float}, ...] per query]};
  GET /health -> {"status": "ok", "n_rows": N}. As in Search-R1, "queries": [] answers
  {"result": []} and "" is a query like any other. Another method on either path gets 405 with an
  Allow header (FastAPI's status for Search-R1's server), any other path 404, both as
  {"error": "..."}. Served by uvicorn (as Search-R1); `--workers` encoder threads (default: CPU
  cores // torch threads, 1 on a GPU) each take a round of the waiting requests' queries
  (ROUND_TOKENS tokens), round-robin, SLICE_QUERIES at a time, so concurrent requests share
  forwards and a huge one does not stall the rest. A request is tokenized once, in its own thread
  and without a lock; the encoder threads get its tokens.

Deviations from Search-R1 (DESIGN.md section 13; tagged `# DEVIATION S<n>:` in the code; S1, S4,
S14: retrieval/dense.py)
S2. "return_scores": false (the default of Search-R1's schema) answers [{"document": {...}}, ...]
   per query, where Search-R1's server crashes. "topk" defaults to 3 and must be in [1, 100]; a
   topk above the corpus size returns every row (retrieval/dense.py S2).
S3. Malformed requests get HTTP 400 {"error": "..."} naming the field (FastAPI: 422).
Reliability deviations (DESIGN.md section 12)
S10. At most MAX_QUERIES queries per request (400 naming the cap; --max_queries); Search-R1 has no
     cap.
S11. A query that is not valid Unicode (a lone surrogate) is refused with 400 (retrieval/search.py's
     `check_queries`); Search-R1's server answers 500.
S12. A request head must arrive within HEAD_TIMEOUT s and its body within BODY_TIMEOUT s (else
     closed / 408); uvicorn alone waits for ever. JSON nested too deeply for the parser gets 400.
S13. It listens on 127.0.0.1 unless --host 0.0.0.0 is given (Search-R1 always binds 0.0.0.0), and
     the encoder runs in float32 unless --fp16 is given (Search-R1's launcher always uses fp16).
S15. A query over MAX_QUERY_BYTES (16 KiB of UTF-8; --max_query_bytes) gets 400 naming it and the
     cap: only its first 256 tokens are read, but the tokenizer reads it whole. Search-R1 has no
     cap.
S16. At most --max_connections connections are open (default: what the descriptor limit, ulimit
     -n, leaves); a new one past that gets 503 and is closed at once, and out of descriptors,
     accepting pauses with one log line per LOG_INTERVAL. A request whose client closes its
     connection before the answer is dropped from the queue. Search-R1 (uvicorn alone) logs a
     traceback per failed accept and computes abandoned requests to the end.
Every numeric flag is range-checked at startup (exit status 2, naming the flag), before the index
is loaded. `--port 0 --port_file PATH` binds any free port and writes its number to PATH
(atomically, once the socket listens): a parent reads it (perf/bench_server.py's `start_child`),
so no port is picked in advance.

Commands (building an index: retriever.py)
  # tiny world (CPU)
  python -m retrieval.server serve --index data/tinyworld/index --port 8000
  # CPU: a worker per core, 1 thread each
  OMP_NUM_THREADS=1 python -m retrieval.server serve --index data/tinyworld/index
  # wiki-18 (folder from `retriever.py describe-prebuilt`), searched on the GPUs when there are any
  python -m retrieval.server serve --index data/wiki18/index --host 0.0.0.0 --port 8000 --fp16
  # Search-R1's retrieval_launch.sh line, our script name substituted (the index file gets an index
  # folder beside it)
  python -m retrieval.server --index_path $file_path/e5_Flat.index \
      --corpus_path $file_path/wiki-18.jsonl --topk 3 --retriever_name e5 \
      --retriever_model intfloat/e5-base-v2 --faiss_gpu
  # any free port, its number in a file once listening (what tests and the bench use)
  python -m retrieval.server serve --index data/tinyworld/index --port 0 --port_file /tmp/port
  # load test of a server on this machine (DESIGN.md section 12): perf/bench_server.py
  python -m retrieval.server bench --index data/tinyworld/index
"""
import argparse
import asyncio
import collections
import concurrent.futures
import gc
import json
import os
import socket
import subprocess
import sys
import threading

import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from infra.config import check_flags
from retrieval.dense import PACK_TOKENS
from retrieval.limits import (ACCEPT_PAUSE, BACKLOG, BODY_TIMEOUT, HEAD_TIMEOUT, LOG,
                              OUT_OF_RESOURCES, Connections, DeadlineH11, ListeningSocket,
                              descriptor_budget, descriptor_limit)
from retrieval.index import E5, search_r1_index_dir
from retrieval.search import (CACHE_BYTES, MAX_QUERIES, MAX_QUERY_BYTES, TOPK, Retriever,
                              check_queries)

MAX_TOPK = 100  # largest topk the server accepts
MAX_BODY_BYTES = 16 << 20  # largest request body the server reads
SLICE_QUERIES = 8  # queries a request gets per turn of the server's round-robin
# query tokens encoded together per round, at most: a request waits for a round in progress, then
# its own. Two packs, less a little so that longest-first packing rarely needs a third: packs 93%
# full on the benchmark's queries, against 82% for rounds of 16 queries (64: 91%, but 4x longer
# waits)
ROUND_TOKENS = 2 * PACK_TOKENS - 8
# --workers (serve's, and the bench's for the server it starts): its help, its range error's end
WORKERS_HELP = "encoder threads of the server (default: CPU cores // torch threads; 1 on a GPU)"
WORKERS_DEFAULT = " (omit it for the default: CPU cores // torch threads, 1 on a GPU)"


# --- HTTP server (Search-R1's POST /retrieve) ---

def parse_request(payload, default_topk: int = TOPK, max_queries: int = MAX_QUERIES,
                  max_query_bytes: int = MAX_QUERY_BYTES) -> tuple:
    """A /retrieve body -> (queries, topk, return_scores); ValueError naming the bad field."""
    if not isinstance(payload, dict):
        raise ValueError("the request body must be a JSON object")
    # DEVIATION S15: bytes capped
    queries = check_queries(payload.get("queries"), max_queries, max_query_bytes)
    topk = default_topk if payload.get("topk") is None else payload["topk"]
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= MAX_TOPK:
        raise ValueError(f"field 'topk' must be an integer in [1, {MAX_TOPK}], got {topk!r}")
    return_scores = payload.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise ValueError(f"field 'return_scores' must be true or false, got {return_scores!r}")
    return queries, topk, return_scores


def parse_body(body: bytes, default_topk: int = TOPK, max_queries: int = MAX_QUERIES,
               max_query_bytes: int = MAX_QUERY_BYTES) -> tuple:
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"the request body is not valid JSON ({e})") from None
    except RecursionError:  # DEVIATION S12: the connection used to die with no reply
        raise ValueError("the request body is JSON nested too deeply") from None
    return parse_request(payload, default_topk, max_queries, max_query_bytes)


def _wire(doc: dict, return_scores: bool) -> dict:
    item = {"document": {"id": doc["id"], "contents": doc["contents"]}}
    # DEVIATION S2: without return_scores Search-R1's server crashes; here the score is left out
    if return_scores:
        item["score"] = doc["score"]
    return item


class Job:
    """One request's queries, answered slice by slice; a cancelled future (its client left) drops
    what is left."""

    def __init__(self, queries: list, topk: int, costs: list, features=None):
        self.items, self.done, self.next = [(query, topk)
                                            for query in queries], [None] * len(queries), 0
        self.costs = costs  # per query, in the units of the round budget (tokens)
        # per query, its tokens (Encoder.query_features), or None: the retriever tokenizes
        self.features = features
        # queries not answered yet: with several workers, slices finish in any order
        self.left = len(queries)
        self.future = concurrent.futures.Future()


class Batcher:
    """The threads that encode for the server (`workers`, each searching one round at a time). Each
    round takes up to SLICE_QUERIES queries from each waiting request in turn (round-robin), until
    the next one would pass the round's budget (`round_cost`; cost(queries) gives each one's, e.g.
    its tokens; default 1), and searches them together: concurrent requests share forwards, and a
    request of thousands of queries is split so that small ones interleave with it. An idle worker
    starts a round beside a busy one only once a full round waits. With `tokenize`
    (Encoder.query_features) a request is tokenized once, in the submitting thread: its costs are
    its token counts and the retriever gets the tokens. A request whose future is cancelled (its
    client left) is dropped unsearched."""

    def __init__(self, retriever, slice_queries: int = SLICE_QUERIES,
                 round_cost: int = ROUND_TOKENS, workers: int = 1, cost=None, tokenize=None):
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(
                f"workers must be an integer >= 1, got {workers!r}: with none, requests wait "
                "for ever")
        self.retriever, self.slice, self.round = retriever, slice_queries, round_cost
        self.workers = workers
        self.cost, self.tokenize = cost or (lambda queries: [1] * len(queries)), tokenize
        self._waiting, self._wake, self._closed = collections.deque(), threading.Condition(), False
        # cost (tokens) of the queries not yet taken; workers waiting for a round
        self._queued = self._idle = 0
        for i in range(workers):
            threading.Thread(target=self._loop, daemon=True, name=f"retriever-batcher-{i}").start()

    def submit(self, queries: list, topk: int) -> concurrent.futures.Future:
        # here, in the request's thread, outside every lock
        if self.tokenize is not None and queries:
            features = self.tokenize(queries)
            job = Job(queries, topk, [len(ids) for ids, _ in features], features)
        else:
            job = Job(queries, topk, self.cost(queries) if queries else [])
        if not queries:  # Search-R1's trainer sends [] when no rollout searched
            job.future.set_result([])
            return job.future
        with self._wake:
            self._waiting.append(job)
            self._queued += sum(job.costs)
            self._wake.notify()
        return job.future

    def close(self):
        with self._wake:
            self._closed = True
            self._wake.notify_all()

    def _next_round(self) -> list:
        """[(job, start, end), ...]: round-robin slices; a job with queries left goes back to the
        end of the line."""
        with self._wake:
            self._idle += 1
            # beside a busy worker, only a full round starts: a few queries would fill their packs
            # badly
            while not self._closed and (not self._waiting or
                                        self._idle < self.workers and self._queued < self.round):
                self._wake.wait()
            taken, budget = [], self.round
            self._idle -= 1
            while self._waiting:
                job = self._waiting[0]
                if job.future.cancelled():  # its client is gone: nobody would read the answer
                    self._waiting.popleft()
                    self._queued -= sum(job.costs[job.next:])
                    continue
                start = end = job.next
                stop = min(start + self.slice, len(job.items))
                # one query at least
                while end < stop and (job.costs[end] <= budget or not taken and end == start):
                    budget -= job.costs[end]
                    end += 1
                if end == start:  # its next query does not fit: the round is full
                    break
                self._waiting.popleft()
                job.next = end
                taken.append((job, start, end))
                self._queued -= sum(job.costs[start:end])
                if end < len(job.items):
                    self._waiting.append(job)
            if self._waiting:
                self._wake.notify()  # the next idle worker takes the rest
            return taken

    def _loop(self):
        while not self._closed:
            taken = self._next_round()
            if not taken:  # closed, or only cancelled requests were waiting
                continue
            items = [item for job, a, b in taken for item in job.items[a:b]]
            try:
                if self.tokenize is None:
                    docs = self.retriever.search_batch(items)
                else:
                    features = [f for job, a, b in taken for f in job.features[a:b]]
                    for job, a, b in taken:
                        # searched: the tokens are not needed again
                        job.features[a:b] = [None] * (b - a)
                    docs = self.retriever.search_batch(items, features)
            except Exception as e:  # keep serving; these requests see why
                with self._wake:
                    for job, _, _ in taken:
                        _settle(job.future, error=e)
                continue
            with self._wake:
                for job, start, end in taken:
                    job.done[start:end], docs = docs[:end - start], docs[end - start:]
                    job.left -= end - start
                    if job.left == 0:
                        _settle(job.future, job.done)


def _settle(future: concurrent.futures.Future, result=None, error=None):
    """Set a request's answer unless it is settled already: the event loop cancels it whenever its
    client leaves."""
    try:
        if not future.done():
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)
    except concurrent.futures.InvalidStateError:  # cancelled between done() and set_*
        pass


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


async def _read_body(request: Request) -> bytes:
    """The body, at most MAX_BODY_BYTES (a Content-Length or chunked encoding is required);
    ValueError otherwise."""
    length = request.headers.get("content-length", "")
    chunked = "chunked" in request.headers.get("transfer-encoding", "").lower()
    if not chunked and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
        raise ValueError(
            f"the body needs a Content-Length of at most {MAX_BODY_BYTES} bytes, got "
            f"{length[:20]!r}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise ValueError(f"the body is longer than {MAX_BODY_BYTES} bytes (Content-Length)")
    return bytes(body)


async def _client_gone(request: Request):
    """Returns once the client has closed its connection. Once the body is read, uvicorn's `receive`
    only answers "http.disconnect" (connection lost, or the response sent)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def make_app(batcher: Batcher, n_rows: int, default_topk: int = TOPK,
             max_queries: int = MAX_QUERIES, body_timeout: float = BODY_TIMEOUT,
             max_query_bytes: int = MAX_QUERY_BYTES) -> Starlette:
    """The ASGI app: POST /retrieve, GET /health, a JSON 405 (with Allow) for another method on
    either, a JSON 404 elsewhere. CPU work (parsing, tokenizing, searching, writing the answer)
    runs off the event loop, so slow or huge requests never hold up the others' I/O. A request
    whose client closes the connection before its answer is cancelled: what the encoder has not
    yet taken is dropped (DEVIATION S16)."""

    async def retrieve(request: Request) -> Response:
        try:
            body = await asyncio.wait_for(_read_body(request), body_timeout)
        except asyncio.TimeoutError:  # DEVIATION S12: a slow client is cut off
            return _error(408, f"the request body did not arrive within {body_timeout} s")
        except ValueError as e:
            return _error(400, str(e))
        loop = asyncio.get_running_loop()

        def parse_and_submit() -> tuple:  # submitting tokenizes the queries (the rounds' measure)
            queries, topk, return_scores = parse_body(body, default_topk, max_queries,
                                                      max_query_bytes)
            return batcher.submit(queries, topk), return_scores

        try:
            answered, return_scores = await loop.run_in_executor(None, parse_and_submit)
        # DEVIATION S3: 400 naming the field (FastAPI: 422 in its own shape)
        except ValueError as e:
            return _error(400, str(e))
        answer, gone = asyncio.wrap_future(answered), asyncio.ensure_future(_client_gone(request))
        await asyncio.wait((answer, gone), return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        # nobody would read it: the batcher drops a cancelled request's queries
        if not answer.done():
            answered.cancel()
            answer.cancel()
            return _error(499, "the client closed the connection before the answer")
        try:
            results = answer.result()
        except Exception as e:  # keep serving; the client sees why
            return _error(500, f"{type(e).__name__}: {e}")
        data = await loop.run_in_executor(None, lambda: json.dumps(
            {"result": [[_wire(doc, return_scores) for doc in docs] for docs in results]}).encode())
        return Response(data, media_type="application/json")

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "n_rows": n_rows})

    # Starlette raises these: 404 when no route has the path, 405 when none takes the method
    async def not_found(request: Request, exc) -> Response:
        return _error(404, f"unknown path {request.url.path}; use POST /retrieve or GET /health")

    async def wrong_method(request: Request, exc) -> Response:
        allow = sorted(exc.headers["Allow"].split(", "))  # a set's order: sorted, it is stable
        path, use = request.url.path, " or ".join(m for m in allow if m != "HEAD")
        response = _error(405, f"{request.method} {path} is not allowed; use {use} {path}")
        response.headers["Allow"] = ", ".join(allow)
        return response

    return Starlette(routes=[Route("/retrieve", retrieve, methods=["POST"]),
                             Route("/health", health, methods=["GET"])],  # Starlette adds HEAD
                     exception_handlers={404: not_found, 405: wrong_method})

def default_workers(device: torch.device) -> int:
    """Encoder threads of the server: on a CPU as many forwards at once as the cores hold at torch's
    thread count (OMP_NUM_THREADS=1 on 2 cores: 2; results do depend on that thread count, not on
    the number of workers); 1 on a GPU."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os,
                                                    "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // torch.get_num_threads()) if device.type == "cpu" else 1


class RetrievalServer:
    """uvicorn serving `make_app` on a socket bound at construction (port 0 picks a free port: read
    server_port), with the interface of the http.server it replaces: serve_forever, shutdown,
    server_close, a context manager."""

    def __init__(self, retriever, host: str = "127.0.0.1", port: int = 8000, *,
                 default_topk: int = TOPK, max_queries: int = MAX_QUERIES,
                 head_timeout: float = HEAD_TIMEOUT, body_timeout: float = BODY_TIMEOUT,
                 workers=None, max_query_bytes: int = MAX_QUERY_BYTES, max_connections=None):
        workers = default_workers(torch.device(
            retriever.encoder.device)) if workers is None else workers
        self.batcher = Batcher(retriever, workers=workers,
                               tokenize=retriever.encoder.query_features)
        self.retriever = retriever
        # the index and the encoder are loaded: their descriptors are counted
        budget = descriptor_budget()
        self.connections = Connections(budget if max_connections is None else max_connections)
        listening = socket.create_server((host, port), backlog=BACKLOG)
        self.socket = ListeningSocket(fileno=listening.detach())
        self.socket.connections = self.connections
        self.server_port = self.socket.getsockname()[1]
        protocol = type("_Protocol", (DeadlineH11, ),
                        {"head_timeout": head_timeout, "slots": self.connections})
        app = make_app(self.batcher, retriever.n_rows, default_topk, max_queries, body_timeout,
                       max_query_bytes)
        config = uvicorn.Config(app, http=protocol, lifespan="off", access_log=False,
                                log_level="warning", backlog=BACKLOG)
        self.uvicorn, self._stopped = uvicorn.Server(config), threading.Event()
        self._stopped.set()
        if self.connections.cap > budget:  # after uvicorn.Config, which sets up its logger
            LOG.warning(
                f"--max_connections {self.connections.cap} is above what the descriptor limit "
                f"leaves (ulimit -n {descriptor_limit()}: about {budget}); past that, accepting "
                "pauses")

    def serve_forever(self):
        # uvicorn.Server.run, on asyncio's loop (never uvloop: `ListeningSocket` needs asyncio's)
        async def serve():
            asyncio.get_running_loop().set_exception_handler(self._loop_error)
            await self.uvicorn.serve(sockets=[self.socket])

        self._stopped.clear()
        try:
            asyncio.run(serve())
        finally:
            self._stopped.set()

    def _loop_error(self, loop, context: dict):
        """Out of descriptors, asyncio pauses accepting for ACCEPT_PAUSE s and reports it here: one
        line per LOG_INTERVAL instead of a traceback per attempt. Anything else goes to asyncio's
        own handler."""
        error = context.get("exception")
        if isinstance(error,
                      OSError) and error.errno in OUT_OF_RESOURCES and "accept" in context.get(
                          "message", ""):
            self.connections.log(
                "accept", f"cannot accept connections ({error.strerror}): {self.connections.open} "
                f"open, the descriptor limit is {descriptor_limit()} (ulimit -n); "
                f"accepting pauses {ACCEPT_PAUSE:g} s at a time")
            return
        loop.default_exception_handler(context)

    def shutdown(self):
        self.uvicorn.should_exit = True
        self._stopped.wait()

    def server_close(self):
        self.socket.close()
        self.batcher.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server_close()


def make_server(retriever, host: str = "127.0.0.1", port: int = 8000, **options) -> RetrievalServer:
    """A server over `retriever`, not yet serving; options: default_topk, max_queries, head_timeout,
    body_timeout, workers, max_query_bytes, max_connections."""
    return RetrievalServer(retriever, host, port, **options)


def start_server(retriever, host: str = "127.0.0.1", port: int = 0, **options) -> tuple:
    """Serve in a daemon thread -> (server, url of /retrieve); stop with server.shutdown();
    server.server_close()."""
    server = make_server(retriever, host, port, **options)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://{host}:{server.server_port}/retrieve"


def freeze_heap():
    """Exempt everything loaded so far (torch, transformers, the model: ~4e5 objects) from Python's
    cyclic garbage collector. Else a full collection, due every few seconds under load, walks them
    all for ~160 ms while holding the GIL, and every request in flight waits: that stall was the
    whole p99 tail of the load test (DESIGN.md section 12; figures in RESULTS.md). Only in the
    server's own process: training keeps the default collector."""
    gc.collect()
    gc.freeze()


def write_port_file(path: str, port: int):
    """`port` into `path`, atomically (a temporary file beside it, then a rename): a reader sees no
    file or the whole number, never a part of it."""
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        f.write(f"{port}\n")
    os.replace(temporary, path)


def serve(index_dir: str, host: str = "127.0.0.1", port: int = 8000, device=None,
          cache_size: int = 100_000, corpus=None, fp16: bool = False, faiss_gpu=None,
          cache_bytes: int = CACHE_BYTES, index_fp16: bool = False, port_file=None, **options):
    """Load the index and serve it until interrupted; with `port_file`, the port it listens on is
    written there once the socket listens."""
    retriever = Retriever(index_dir, device, cache_size, corpus, fp16, faiss_gpu, cache_bytes,
                          index_fp16)
    with make_server(retriever, host, port, **options) as server:
        print(f"serving {index_dir} ({retriever.n_rows} rows) at "
              f"http://{host}:{server.server_port}/retrieve", flush=True)
        freeze_heap()
        # the socket listens: a client connecting now waits only for the event loop to start
        if port_file:
            write_port_file(port_file, server.server_port)
        server.serve_forever()  # uvicorn stops on Ctrl-C / SIGTERM


# --- command line: serve, or run the load bench (perf/bench_server.py) in a child process ---

def add_bench_flags(parser: argparse.ArgumentParser):
    """The load bench's flags: `bench` here checks them before anything starts, and
    perf/bench_server.py, which this file never imports, parses them with this."""
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=40, help="per client")
    parser.add_argument("--queries", type=int, default=4, help="distinct queries per request")
    parser.add_argument("--big", type=int, default=3000, help="queries of the big request")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the server (OMP_NUM_THREADS)")
    parser.add_argument("--index", default="data/tinyworld/index")
    parser.add_argument("--url", default=None,
                        help="measure this running server instead of starting one")
    parser.add_argument("--workers", type=int, default=None, help=WORKERS_HELP)
    parser.add_argument("--device", default="cpu", help="default: cuda if any, else cpu")


BENCH_RANGES = {"workers": (1, None, WORKERS_DEFAULT)}  # flag -> (lowest, highest, hint)
BENCH_RANGES |= {name: (1, None, "") for name in ("clients", "requests", "queries", "big",
                                                  "threads")}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Search-R1 compatible retrieval server: serve an index folder "
        "(retriever.py build), load-test a server.")
    sub = parser.add_subparsers(dest="command", required=True)
    server = sub.add_parser(
        "serve", help="Search-R1 compatible HTTP server (also: Search-R1's launch flags alone)")
    server.add_argument("--host", default="127.0.0.1",
                        help="0.0.0.0 to serve other machines (DEVIATION S13)")
    server.add_argument("--port", type=int, default=8000, help="0: any free port")
    server.add_argument("--port_file", default=None,
                        help="write the port listened on here (atomically) once listening")
    server.add_argument("--cache_size", type=int, default=100_000,
                        help="answers cached, at most (0: no cache)")
    server.add_argument("--cache_bytes", type=int, default=CACHE_BYTES,
                        help="bytes of cached answers, at most")
    server.add_argument("--topk", type=int, default=TOPK,
                        help="for requests without 'topk' (Search-R1 --topk)")
    server.add_argument("--max_queries", type=int, default=MAX_QUERIES,
                        help="queries per request (DEVIATION S10)")
    server.add_argument("--max_query_bytes", type=int, default=MAX_QUERY_BYTES,
                        help="UTF-8 bytes per query (DEVIATION S15)")
    server.add_argument(
        "--max_connections", type=int, default=None,
        help="open connections, at most; past it a new "
        "one gets 503 (default: what the descriptor limit leaves; DEVIATION S16)")
    server.add_argument("--retriever_name", default="e5",
                        help="Search-R1's: sets the prefixes of an index file")
    server.add_argument("--retriever_model", default=E5,
                        help="Search-R1's: the encoder of an index file")
    server.add_argument("--faiss_gpu", action="store_true",
                        help="Search-R1's: FAISS on the GPUs (default: if any)")
    bench = sub.add_parser("bench",
                           help="load test of a server started on 127.0.0.1 (DESIGN.md section 12)")
    add_bench_flags(bench)
    server.add_argument("--workers", type=int, default=None, help=WORKERS_HELP)
    # --index_path / --corpus_path: Search-R1's names; an index file is accepted too
    server.add_argument("--index", "--index_path", dest="index", required=True)
    server.add_argument(
        "--corpus", "--corpus_path", dest="corpus", default=None,
        help="the corpus, if it moved since the build (required with an index file)")
    server.add_argument("--device", default=None, help="default: cuda if any, else cpu")
    server.add_argument("--fp16", action="store_true",
                        help="run the encoder in half precision (GPU)")
    server.add_argument(
        "--index_fp16", action="store_true", help="the index's GPU shards in float16, answers "
        "certified exact (half the memory on each GPU beside training; DEVIATION S21)")
    argv = sys.argv[1:] if argv is None else list(argv)
    # Search-R1's launch line names no subcommand
    if argv and argv[0].startswith("--") and argv[0] != "--help":
        argv = ["serve", *argv]
    args = parser.parse_args(argv)
    ranges = {"port": (0, 65535, ""), "topk": (1, MAX_TOPK, ""),
              "workers": (1, None, WORKERS_DEFAULT)}  # the rest: >= 0 or 1
    ranges |= {name: (0, None, "") for name in ("cache_size", "cache_bytes")}
    ranges |= {name: (1, None, "")
               for name in ("max_queries", "max_query_bytes", "max_connections")}
    check_flags(parser, args, ranges | BENCH_RANGES)
    if args.command == "serve" and "bm25" in args.retriever_name.lower() and not os.path.isfile(
            # a pyserini (Lucene) index: Java's format, not read here
            os.path.join(args.index, "meta.json")):
        parser.error(
            f"--retriever_name bm25: {args.index} is not an index folder of retriever.py; build "
            "a BM25 one with `python retriever.py build --encoder bm25 --corpus CORPUS --out DIR` "
            "(retrieval/bm25.py)")
    if args.command == "serve" and os.path.isfile(args.index) and not args.corpus:
        parser.error(
            f"--index_path {args.index} is an index file: give its corpus with --corpus_path")
    return args


def run_bench(argv: list):
    """`bench`: perf/bench_server.py with these flags, in a child process (perf sits above this
    file, which never imports it); its exit status is this process's."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # `-m perf` imports here
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([repo, *filter(None, [os.environ.get("PYTHONPATH")])])}
    status = subprocess.call([sys.executable, "-m", "perf.bench_server", *argv], env=env)
    if status:
        raise SystemExit(status)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.command == "bench":
        run_bench(argv[1:])
    else:
        index = search_r1_index_dir(args.index, args.corpus, args.retriever_model,
                                    args.retriever_name)
        # a described folder records its corpus
        corpus = None if index != args.index else args.corpus
        serve(index, args.host, args.port, args.device, args.cache_size, corpus, args.fp16,
              True if args.faiss_gpu else None, args.cache_bytes, args.index_fp16,
              default_topk=args.topk, max_queries=args.max_queries, workers=args.workers,
              max_query_bytes=args.max_query_bytes, max_connections=args.max_connections,
              port_file=args.port_file)


if __name__ == "__main__":
    main()
