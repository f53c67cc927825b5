"""Retrieval for the search agent: in-process search over an index folder, dense or BM25, and the
client of a Search-R1 compatible HTTP server.

The library's front: `Retriever` (search over an index folder: its cache, its corpus rows),
`RemoteRetriever` (the HTTP client with the same `search`), the query checks, the observation
text, `build_index` and the command line. A folder's meta.json picks its kind: "bm25" is
retrieval/bm25.py's `BM25Index` (Lucene's BM25, as pyserini's, without Java), any other encoder
retrieval/dense.py's `DenseIndex` (a transformer encoder + an exact inner-product FAISS index);
both answer "an encoder, then the top k rows of each query". The folder's format (corpus,
offsets, meta.json, their checks) is retrieval/index.py's. It knows nothing of serving: the HTTP
server is retrieval/server.py and its load bench perf/bench_server.py, which import this file
(never the reverse).

Contract (DESIGN.md sections 3 and 10; Search-R1 compatible)
- Corpus and index folder: retrieval/index.py. Rows are read on demand from the corpus (pread, by
  byte offset), checked at load against the folder: a stale folder is refused, naming the file.
- Search: `Retriever.search(queries, topk)` -> per query, in input order, the top-k documents
  [{"id", "contents", "score"}, ...], ties to the lower row. A query's results are a pure function
  of its text, whatever batch it comes in (retrieval/dense.py, Determinism (1) and (2); a BM25
  query's scores are its own sums): a twin episode (DESIGN.md section 5) replays a query inside
  another batch and must see the same documents. Answers are cached per (query, topk), least
  recently used out first, within cache_size entries and cache_bytes bytes; callers get copies.
- Observation text: `format_docs`, Search-R1's `_passages2string` byte for byte.
- Client: `RemoteRetriever.search` posts {"queries": [...], "topk": k, "return_scores": true} to
  POST /retrieve of a Search-R1 compatible server (retrieval/server.py's or Search-R1's own) and
  returns what `Retriever.search` returns; refused connections and 5xx answers are retried, any
  other refusal is raised at once.

Deviations from Search-R1 (DESIGN.md section 13; tagged `# DEVIATION S<n>:` in the code; the
encoder's and the index's: retrieval/dense.py; BM25's: retrieval/bm25.py; the server's:
retrieval/server.py)
S10. At most MAX_QUERIES queries per search (`check_queries`: a ValueError naming the cap);
     Search-R1 has no cap.
S11. A query that is not valid Unicode (a lone surrogate) is refused with a ValueError: the
     tokenizer would fail.

Commands (serving an index: retrieval/server.py)
  # tiny world (CPU): build, query
  python retriever.py build --corpus data/tinyworld/corpus.jsonl --encoder minilm \
      --out data/tinyworld/index
  python retriever.py search --index data/tinyworld/index --topk 3 "who founded the city"
  # wiki-18 with Search-R1's prebuilt E5 flat index (no re-encoding)
  python retriever.py describe-prebuilt --index_file e5_Flat.index --corpus wiki-18.jsonl \
      --out data/wiki18/index
  # or encode wiki-18 yourself (one GPU)
  python retriever.py build --corpus wiki-18.jsonl --encoder e5 --out data/wiki18/index_e5 \
      --batch_size 512 --fp16
"""
import argparse
import collections
import os
import sys
import threading
import time
from collections import OrderedDict

import numpy as np
import requests

from retrieval import bm25, dense
from retrieval.index import (E5, MAX_LENGTH, META_FILE, describe_prebuilt, load_index_dir,
                             parse_row)

TOPK = 3  # documents per search (Search-R1 retrieval_topk)
MAX_QUERIES = 10_000  # queries per request (Search-R1's trainer sends <= 512 x 5 per turn),
#   DEVIATION S10
MAX_QUERY_BYTES = 16 << 10  # UTF-8 bytes per query the server accepts, DEVIATION S15: a query is
#   read up to MAX_LENGTH tokens, and 256 tokens of any natural text take well under 16 KiB
#   (English ~4.5 bytes per wordpiece, CJK 3), so no real query is refused; eight 1 MB ones grew
#   the server by ~420 MB (tokenized whole, then cut)
CACHE_BYTES = 256 << 20  # bytes of answers the cache holds (queries and documents, as Python
#   objects); ~100,000 wiki-18 top-3 answers, the entry bound's default


def format_docs(docs: list) -> str:
    """Search-R1 `_passages2string`: `Doc i(Title: {first line of contents}) {other lines}\\n` per
    document."""
    out = ""
    for i, doc in enumerate(docs):
        lines = doc["contents"].split("\n")
        text = "\n".join(lines[1:])
        out += f"Doc {i + 1}(Title: {lines[0]}) {text}\n"
    return out


def check_queries(queries, max_queries: int = MAX_QUERIES, max_query_bytes=None) -> list:
    """A list of at most max_queries strings (empty ones too: Search-R1's trainer sends them), each
    of at most max_query_bytes UTF-8 bytes (None: any length), else ValueError naming the query."""
    if not isinstance(queries, (list, tuple)):
        raise ValueError("field 'queries' must be a list of strings")
    if len(queries) > max_queries:  # DEVIATION S10: a clear refusal instead of minutes of encoding
        raise ValueError(f"field 'queries' holds {len(queries)} queries, at most {max_queries} per "
                         "request; split the batch (or start the server with a larger "
                         "--max_queries)")
    for i, query in enumerate(queries):
        if not isinstance(query, str):
            raise ValueError(f"field 'queries'[{i}] must be a string, got {str(query)[:40]!r}")
        try:
            size = len(query.encode("utf-8"))
        except UnicodeEncodeError:
            # DEVIATION S11: the tokenizer would fail (Search-R1: 500, and clients retry)
            raise ValueError(f"field 'queries'[{i}] is not valid Unicode (a lone surrogate?): "
                             f"{query[:40]!r}") from None
        # DEVIATION S15, retrieval/server.py
        if max_query_bytes is not None and size > max_query_bytes:
            raise ValueError(f"field 'queries'[{i}] is {size} bytes long (UTF-8), at most "
                             f"{max_query_bytes} per query (only its first {MAX_LENGTH} tokens "
                             "are read); shorten it, or start the server with a larger "
                             "--max_query_bytes")
    return list(queries)


def _bytes(key: tuple, docs: list) -> int:
    """What a cache entry holds, as Python objects: its query string and each document's strings,
    dict and score."""
    return (sys.getsizeof(key[0]) + sys.getsizeof(key) + sys.getsizeof(docs)
            + sum(sys.getsizeof(d["id"]) + sys.getsizeof(d["contents"]) + sys.getsizeof(d) + 24
                  for d in docs))


class Retriever:
    """In-process retriever over an index folder; `search` is thread safe and a pure function of
    each query. meta.json's encoder picks the index: "bm25" a bm25.BM25Index (queries -> terms,
    searched exactly, nothing to re-score), any other a dense.DenseIndex (its encoder, FAISS,
    exact re-scoring). Either gives the queries' encoder (`encoder`) and answers `tops`."""

    def __init__(self, index_dir: str, device=None, cache_size: int = 100_000, corpus=None,
                 fp16: bool = False, faiss_gpu=None, cache_bytes: int = CACHE_BYTES,
                 index_fp16: bool = False):
        self.meta, self.offsets, self.corpus, index_path = load_index_dir(index_dir, corpus)
        self.n_rows = len(self.offsets)
        if self.meta["encoder"] == bm25.ENCODER:
            self.index = bm25.BM25Index(index_path, self.meta, os.path.join(index_dir, META_FILE))
        else:
            self.index = dense.DenseIndex(index_path, self.meta, device, fp16, faiss_gpu,
                                          index_fp16)
        self.encoder = self.index.encoder  # the server tokenizes each request with it
        # rows are read with pread: no file position shared between threads
        self._file = open(self.corpus, "rb")
        self._size = os.fstat(self._file.fileno()).st_size
        for i in sorted({0, self.n_rows - 1,
                         *np.linspace(0, self.n_rows - 1, 16).astype(int).tolist()}):
            self._row(i)  # spot checks: a row that does not parse means the offsets are stale
        # (query, topk) -> (docs, bytes), oldest first
        self.cache_size, self._cache = cache_size, OrderedDict()
        # the cache's byte budget, and what it holds (`_bytes`)
        self.cache_bytes, self.cache_used = cache_bytes, 0
        self.cache_hits = self.cache_misses = 0  # per distinct (query, topk) of each call
        self._cache_lock = threading.Lock()  # held for lookups only: a hit never waits for encoding

    def _row(self, i: int) -> dict:
        start = int(self.offsets[i])
        end = int(self.offsets[i + 1]) if i + 1 < self.n_rows else self._size
        where = f"{self.corpus}: row {i} at byte {start}"
        try:
            if start > 0 and os.pread(self._file.fileno(), 1, start - 1) != b"\n":
                raise ValueError(f"{where} does not start a line")
            return parse_row(os.pread(self._file.fileno(), end - start, start), where)
        except ValueError as e:
            raise ValueError(f"{e}; the corpus changed since the index was built, "
                             "rebuild the index") from None

    def search(self, queries: list, topk: int = TOPK) -> list:
        """Top-k documents per query, in input order: [[{"id", "contents", "score"}, ...], ...]."""
        queries = check_queries(queries)
        if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
            raise ValueError(f"topk must be a positive integer, got {topk!r}")
        return self.search_batch([(query, topk) for query in queries])

    def search_batch(self, items: list, features=None) -> list:
        """[(query, topk), ...] -> docs per item; the server's path too, so both give identical
        results. features: each item's query as `encoder.query_features` gives it (the server
        tokenizes once, as a request arrives)."""
        keys, found = list(dict.fromkeys(items)), {}
        with self._cache_lock:
            for key in keys:
                if key in self._cache:
                    self._cache.move_to_end(key)
                    found[key] = self._cache[key][0]
            misses = [key for key in keys if key not in found]
            self.cache_hits += len(found)
            self.cache_misses += len(misses)
        if misses:
            if features is None:  # the server's workers: at once
                vecs = self.encoder.encode([query for query, _ in misses], "query")
            else:
                of = dict(zip(items, features))
                vecs = self.encoder.encode_tokens([of[key] for key in misses])
            by_topk = collections.defaultdict(list)  # one FAISS call per topk: k = topk + margin
            for i, (_, topk) in enumerate(misses):
                by_topk[topk].append(i)
            for topk, rows in by_topk.items():
                for i, docs in zip(rows, self._search_vectors(vecs[rows], topk)):
                    found[misses[i]] = docs
            with self._cache_lock:
                for key in misses:
                    self._remember(key, found[key])
        return [[dict(doc) for doc in found[key]] for key in items]

    def _search_vectors(self, vecs: np.ndarray, topk: int) -> list:
        tops = self.index.tops(vecs, topk)  # (rows, scores) per query
        return [[{**self._row(int(row)), "score": float(score)} for row, score in zip(*top)]
                for top in tops]

    def _remember(self, key, docs: list) -> list:
        """Cache an answer, least recently used out first, within both bounds: cache_size entries,
        cache_bytes bytes (entries alone let a few huge queries, or huge documents, hold
        gigabytes)."""
        size = _bytes(key, docs)
        if self.cache_size > 0 and size <= self.cache_bytes and key not in self._cache:
            self._cache[key] = (docs, size)
            self.cache_used += size
            while len(self._cache) > self.cache_size or self.cache_used > self.cache_bytes:
                self.cache_used -= self._cache.popitem(last=False)[1][1]
        return docs

    def close(self):
        self._file.close()


class RemoteRetriever:
    """Client of a Search-R1 compatible server (ours or theirs), with the same `search` as
    Retriever."""

    def __init__(self, url: str, timeout: float = 60.0, retries: int = 3, backoff: float = 1.0):
        url = url.rstrip("/")
        self.url = url if url.endswith("/retrieve") else url + "/retrieve"
        # backoff: the first wait (s), then doubled
        self.timeout, self.retries, self.backoff = timeout, retries, backoff

    def search(self, queries: list, topk: int = TOPK) -> list:
        payload = {"queries": check_queries(queries), "topk": topk, "return_scores": True}
        if not queries:  # nothing to ask (Search-R1's server would answer {"result": []})
            return []
        return [[{"id": str(item["document"]["id"]), "contents": item["document"]["contents"],
                  "score": float(item["score"])} for item in docs] for docs in self._post(payload)]

    def _post(self, payload: dict) -> list:
        error = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                response = requests.post(self.url, json=payload, timeout=self.timeout)
            except requests.RequestException as e:
                # refused or timed out: the server may still be loading
                error = f"{type(e).__name__}: {e}"
                continue
            if response.status_code >= 500:
                error = f"HTTP {response.status_code}: {response.text[:300]}"
                continue
            if response.status_code != 200:  # the request itself is wrong: retrying cannot help
                raise RuntimeError(f"retriever {self.url} answered HTTP {response.status_code}: "
                                   f"{response.text[:300]}")
            result = response.json().get("result") if response.text.startswith("{") else None
            if not isinstance(result, list) or len(result) != len(payload["queries"]):
                raise RuntimeError(f"retriever {self.url} gave a malformed answer: "
                                   f"{response.text[:300]}")
            return result
        raise RuntimeError(f"retriever {self.url} failed after {self.retries + 1} attempts; "
                           f"last error: {error}")


def build_index(corpus: str, encoder: str, out: str, batch_size: int = 256,
                max_length: int = MAX_LENGTH, query_prefix=None, passage_prefix=None,
                device=None, fp16: bool = False) -> dict:
    """Index the corpus into the folder `out`; returns the meta. encoder "bm25": a BM25 folder
    (`bm25.build_index`); any other: its vectors in an IndexFlatIP (`dense.build_index`)."""
    if encoder == bm25.ENCODER:
        return bm25.build_index(corpus, out, max_length)
    return dense.build_index(corpus, encoder, out, batch_size, max_length, query_prefix,
                             passage_prefix, device, fp16)


def check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, ranges: dict):
    """Refuse (exit status 2, naming the flag) any numeric flag outside its range, before anything
    is loaded. ranges: flag name -> (lowest, highest or None, what else to say)."""
    for name, (low, high, hint) in ranges.items():
        value = getattr(args, name, None)
        if value is not None and not (low <= value and (high is None or value <= high)):
            within = f"in [{low}, {high}]" if high is not None else f">= {low}"
            parser.error(f"--{name} must be an integer {within}, got {value}{hint}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Retriever (dense, or BM25: retrieval/bm25.py): "
                                                 "build an index, describe a prebuilt one, search "
                                                 "it (serve it: retrieval/server.py).")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="encode a jsonl corpus into an index folder")
    build.add_argument("--encoder", required=True,
                       help="minilm, e5, a local folder or a hub id; bm25: BM25")
    build.add_argument("--batch_size", type=int, default=256)
    prebuilt = sub.add_parser("describe-prebuilt",
                              help="index folder for an existing flat IP index (no encoding)")
    prebuilt.add_argument("--index_file", required=True)
    prebuilt.add_argument("--encoder", default=E5)
    for p in (build, prebuilt):
        p.add_argument("--corpus", required=True)
        p.add_argument("--out", required=True)
        p.add_argument("--max_length", type=int, default=MAX_LENGTH)
        p.add_argument("--query_prefix", default=None,
                       help="default: the encoder's (E5: 'query: ')")
        p.add_argument("--passage_prefix", default=None,
                       help="default: the encoder's (E5: 'passage: ')")
    search = sub.add_parser("search", help="print the top-k documents of each query")
    search.add_argument("--topk", type=int, default=TOPK)
    search.add_argument("queries", nargs="+")
    # --index_path / --corpus_path: Search-R1's names (retrieval/server.py serve takes the same)
    search.add_argument("--index", "--index_path", dest="index", required=True)
    search.add_argument("--corpus", "--corpus_path", dest="corpus", default=None,
                        help="the corpus, if it moved since the build "
                             "(required with an index file)")
    for p in (build, search):
        p.add_argument("--device", default=None, help="default: cuda if any, else cpu")
        p.add_argument("--fp16", action="store_true",
                       help="run the encoder in half precision (GPU)")
    args = parser.parse_args(argv)
    check_flags(parser, args, {"batch_size": (1, None, ""), "max_length": (1, None, ""),
                               "topk": (1, None, "")})
    encoder_flags = ("query_prefix", "passage_prefix", "device")
    if getattr(args, "encoder", None) == bm25.ENCODER and (args.command != "build" or args.fp16
                                                           or any(getattr(args, f) is not None
                                                                  for f in encoder_flags)):
        parser.error("--encoder bm25 goes with `build` only, and takes no prefixes, --device or "
                     "--fp16")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.command == "build":
        meta = build_index(args.corpus, args.encoder, args.out, args.batch_size, args.max_length,
                           args.query_prefix, args.passage_prefix, args.device, args.fp16)
        what = "terms" if args.encoder == bm25.ENCODER else "dim"
        print(f"built {args.out}: {meta['n_rows']} rows, {what} {meta['dim']}")
    elif args.command == "describe-prebuilt":
        meta = describe_prebuilt(args.index_file, args.corpus, args.encoder, out_dir=args.out,
                                 max_length=args.max_length, query_prefix=args.query_prefix,
                                 passage_prefix=args.passage_prefix)
        print(f"described {args.index_file} in {args.out}: {meta['n_rows']} rows, "
              f"dim {meta['dim']}")
    else:
        retriever = Retriever(args.index, args.device, corpus=args.corpus, fp16=args.fp16)
        for query, docs in zip(args.queries, retriever.search(args.queries, args.topk)):
            scores = " ".join(f"{d['score']:.6f}" for d in docs)
            print(f"# query: {query}\n{format_docs(docs)}# ids: {' '.join(d['id'] for d in docs)}"
                  f"\n# scores: {scores}")


if __name__ == "__main__":
    main()
