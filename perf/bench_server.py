"""Load bench of the retrieval server (retrieval/server.py): latency, throughput, fairness and
exactness of a server under many clients (DESIGN.md section 12; measured figures: RESULTS.md).

A server started in a child process on 127.0.0.1 (`python -m retrieval.server serve`, or the one
at --url) gets `clients` threads of `requests` requests of distinct queries each (`bench_load`),
then one big request with a 1-query request every 0.5 s beside it (`bench_big`); every answer is
then checked against in-process search (`bench_exactness`: ids and scores to the bit, retrieval/search.py's
`Retriever`). The server's CPU time per query is read from its process (/proc).

It knows requests, clocks and processes; the server is reached only over HTTP (its flags are
retrieval/server.py's `add_bench_flags`: `python -m retrieval.server bench` checks them, then runs
this file in a child process). Nothing in the method imports this file. `start_child` starts a
server child on a port it binds itself (`--port 0`) and reads the port from the file the server
writes once it listens (`--port_file`): the bench and the tests never pick a port in advance, so
no other process can take it in between.

Commands
  # load test of a server on this machine (tiny world, CPU)
  python -m perf.bench_server --index data/tinyworld/index
  python -m retrieval.server bench --index data/tinyworld/index       # the same
  # a server already running elsewhere: latency and exactness against this machine's index
  python -m perf.bench_server --index data/tinyworld/index --url http://127.0.0.1:8000/retrieve
"""
import argparse
import concurrent.futures
import http.client
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import requests
import torch

from infra.config import check_flags
from retrieval.search import TOPK, Retriever
from retrieval.server import BENCH_RANGES, add_bench_flags

BENCH_WORDS = ("who founded the city river king painter ship festival language mountain when was "
               "born where is capital of first second largest oldest famous author song film "
               "country which year did").split()


def bench_queries(n: int, tag: str, seed: int = 0) -> list:
    """n distinct agent-like queries of 2-10 words (a numbered tag keeps them distinct: no cache
    hit helps)."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(BENCH_WORDS, rng.integers(2, 11))) + f" {tag}{i}" for i in range(n)]


def _timed_post(url: str, queries: list, topk: int = TOPK) -> tuple:
    start = time.perf_counter()
    try:
        answer = requests.post(url, json={"queries": queries, "topk": topk, "return_scores": True},
                               timeout=120)
        result = (answer.json()["result"] if answer.status_code == 200
                  else f"HTTP {answer.status_code}")
    except (requests.RequestException, ValueError, KeyError) as e:
        result = f"{type(e).__name__}: {e}"
    return time.perf_counter() - start, result


def bench_load(url: str, clients: int, per_client: int, size: int) -> tuple:
    """clients threads, each sending per_client requests of `size` distinct queries in turn ->
    (stats, sent)."""
    sent = [bench_queries(size, f"c{c}r{r}q", seed=c * 1000 + r)
            for c in range(clients) for r in range(per_client)]
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        start = time.perf_counter()
        lines = [pool.submit(lambda c: [_timed_post(url, q) for q in sent[c::clients]], c)
                 for c in range(clients)]
        answers = [None] * len(sent)
        for c, line in enumerate(lines):
            answers[c::clients] = line.result()
        wall = time.perf_counter() - start
    seconds = np.array([s for s, _ in answers])
    errors = [r for _, r in answers if isinstance(r, str)]
    stats = {"requests": len(sent), "errors": len(errors), "first_error": errors[:1],
             "p50_ms": 1e3 * np.median(seconds), "p99_ms": 1e3 * np.percentile(seconds, 99),
             "max_ms": 1e3 * seconds.max(), "wall_s": wall,
             "queries_per_s": len(sent) * size / wall}
    return stats, list(zip(sent, [r for _, r in answers]))


def bench_big(url: str, big: int, every: float = 0.5) -> tuple:
    """One request of `big` distinct queries; meanwhile a 1-query request every `every` s ->
    (stats, sent)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        queries = bench_queries(big, "big")
        job, smalls = pool.submit(_timed_post, url, queries), []
        # one small request at least, however soon the big one is answered
        while not job.done() or not smalls:
            time.sleep(every)
            small = bench_queries(1, f"small{len(smalls)}q")
            smalls.append((small, _timed_post(url, small)))
        big_s, big_result = job.result()
    small_s = [s for _, (s, _) in smalls]
    stats = {"big_queries": big, "big_s": big_s, "small_requests": len(smalls),
             "small_max_s": max(small_s), "small_median_s": float(np.median(small_s)),
             "errors": sum(isinstance(r, str) for _, (_, r) in smalls)
             + isinstance(big_result, str)}
    return stats, [(queries, big_result)] + [(q, r) for q, (_, r) in smalls]


def bench_exactness(retriever, sent: list) -> int:
    """How many answered queries differ from in-process search (ids, or scores by a single bit)."""
    answered = [(query, docs) for queries, result in sent if not isinstance(result, str)
                for query, docs in zip(queries, result)]
    # one call: the batch cannot matter (retrieval/dense.py, Determinism (1))
    wanted = retriever.search([query for query, _ in answered])
    return sum([(d["document"]["id"], np.float64(d["score"]).tobytes()) for d in got]
               != [(d["id"], np.float64(d["score"]).tobytes()) for d in want]
               for (_, got), want in zip(answered, wanted))


def _cpu_seconds(pid: int):
    """CPU time (user + system) of a running process, from /proc; None where there is no /proc (or
    no such pid)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_child(command: list, folder: str, env=None, timeout: float = 120.0) -> tuple:
    """Start a server in a child process and wait until it answers /health on 127.0.0.1 ->
    (child, port, log).

    `command` runs retrieval/server.py's `serve` without --port; `--port 0 --port_file` are added,
    so the child binds any free port itself and reports it: no port is picked in advance, none can
    be taken meanwhile. Its stdout and stderr go to `folder`/server.log. RuntimeError with that log
    if the child exits first, or after `timeout` s (the child is then killed).
    """
    port_file, log = os.path.join(folder, "server.port"), os.path.join(folder, "server.log")
    with open(log, "w") as out:
        child = subprocess.Popen([*command, "--port", "0", "--port_file", port_file], env=env,
                                 stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    try:
        while not os.path.exists(port_file):
            _check_child(child, log, deadline, "wrote no port")
            time.sleep(0.05)
        with open(port_file) as f:
            port = int(f.read())
        while not _healthy(port):  # it listens already: this waits for its loop, not for a port
            _check_child(child, log, deadline, "did not answer /health")
            time.sleep(0.05)
        return child, port, log
    except BaseException:
        child.kill()
        child.wait()
        raise


def _healthy(port: int) -> bool:
    """GET /health on 127.0.0.1 answers 200 (http.client: no proxy from the environment)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", "/health")
        return connection.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        connection.close()


def _check_child(child: subprocess.Popen, log: str, deadline: float, what: str):
    status = child.poll()
    if status is None and time.monotonic() < deadline:
        return
    why = f"exited with status {status}" if status is not None else f"{what} in time"
    with open(log, errors="replace") as f:
        raise RuntimeError(f"the server {why}; its output ({log}):\n{f.read()[-4000:]}")


def bench_server(index_dir: str, clients: int = 16, per_client: int = 40, size: int = 4,
                 big: int = 3000, threads: int = 1, device: str = "cpu", url=None,
                 workers=None) -> dict:
    """Start `retrieval/server.py serve` in a child process on 127.0.0.1 (or use the server at
    `url`) and measure it; prints and returns the figures. Exactness compares with retrieval/search.py's
    in-process search."""
    # `-m retrieval.server` imports from the repository's root
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads),
           "PYTHONPATH": os.pathsep.join([repo, *filter(None, [os.environ.get("PYTHONPATH")])])}
    command = [sys.executable, "-m", "retrieval.server", "serve", "--index", index_dir,
               "--device", device]
    command += ["--workers", str(workers)] if workers else []
    measured = url is None  # the server's CPU time is read from its process: only one started here
    folder = tempfile.TemporaryDirectory(prefix="bench_server_")
    child = None
    try:
        if measured:
            child, port, log = start_child(command, folder.name, env)
            url = f"http://127.0.0.1:{port}/retrieve"
        cpu = _cpu_seconds(child.pid) if measured else None
        load, sent = bench_load(url, clients, per_client, size)
        # nan: not our child, or no /proc
        cpu = _cpu_seconds(child.pid) - cpu if cpu is not None else float("nan")
        load["server_cpu_ms_per_query"] = 1e3 * cpu / (load["requests"] * size)
        print(f"load: {clients} clients x {per_client} requests x {size} distinct queries: "
              f"{load['errors']} errors, p50 {load['p50_ms']:.0f} ms, p99 {load['p99_ms']:.0f} ms, "
              f"max {load['max_ms']:.0f} ms, {load['queries_per_s']:.0f} queries/s, server CPU "
              f"{load['server_cpu_ms_per_query']:.1f} ms per query", flush=True)
        interleave, sent_big = bench_big(url, big)
        print(f"big request: {big} distinct queries in {interleave['big_s']:.1f} s; meanwhile "
              f"{interleave['small_requests']} 1-query requests: max "
              f"{interleave['small_max_s']:.2f} s, median {interleave['small_median_s']:.2f} s; "
              f"{interleave['errors']} errors", flush=True)
    finally:
        if child is not None:
            child.terminate()
            child.wait(timeout=60)
            with open(log, errors="replace") as f:  # the server's own lines, warnings included
                sys.stderr.write(f.read())
        folder.cleanup()
    torch.set_num_threads(threads)
    retriever = Retriever(index_dir, device, cache_size=0)
    differ = bench_exactness(retriever, sent + sent_big)
    print(f"exactness: {differ} of {sum(len(q) for q, _ in sent + sent_big)} queries differ from "
          "in-process search")
    return {"load": load, "interleave": interleave, "differ": differ}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()  # what it measures: this file's docstring
    add_bench_flags(parser)  # retrieval/server.py's, whose `bench` forwards them here
    args = parser.parse_args(argv)
    check_flags(parser, args, BENCH_RANGES)
    return args


def main(argv=None):
    args = parse_args(argv)
    bench_server(args.index, args.clients, args.requests, args.queries, args.big, args.threads,
                 args.device, args.url, args.workers)


if __name__ == "__main__":
    main()
