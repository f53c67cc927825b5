"""In-process search over an index folder, dense or BM25: `Retriever`, its answer cache and the
query checks that every way in (in process, the HTTP server, the client) shares.

A folder's meta.json picks its kind: "bm25" is retrieval/bm25.py's `BM25Index` (Lucene's BM25, as
pyserini's, without Java), any other encoder retrieval/dense.py's `DenseIndex` (a transformer encoder
+ an exact inner-product FAISS index); both answer "an encoder, then the top k rows of each query".
The folder's format (corpus, offsets, meta.json, their checks) is retrieval/index.py's. This file
knows nothing of HTTP: the server (retrieval/server.py) and the front (retriever.py: the client,
the observation text, the build / search command line) import it, never the reverse.

Contract (DESIGN.md sections 3 and 10; Search-R1 compatible)
- Rows are read on demand from the corpus (pread, by byte offset), checked at load against the
  folder: a stale folder is refused, naming the file.
- Search: `Retriever.search(queries, topk)` -> per query, in input order, the top-k documents
  [{"id", "contents", "score"}, ...], ties to the lower row. A query's results are a pure function
  of its text, whatever batch it comes in (retrieval/dense.py, Determinism (1) and (2); a BM25
  query's scores are its own sums): a twin episode (DESIGN.md section 5) replays a query inside
  another batch and must see the same documents. Answers are cached per (query, topk), least
  recently used out first, within cache_size entries and cache_bytes bytes; callers get copies.

Deviations from Search-R1 (DESIGN.md section 13; tagged `# DEVIATION S<n>:` in the code)
S10. At most MAX_QUERIES queries per search (`check_queries`: a ValueError naming the cap);
     Search-R1 has no cap.
S11. A query that is not valid Unicode (a lone surrogate) is refused with a ValueError: the
     tokenizer would fail.
"""
import collections
import os
import sys
import threading
from collections import OrderedDict

import numpy as np

from retrieval import bm25, dense
from retrieval.index import MAX_LENGTH, META_FILE, load_index_dir, parse_row

TOPK = 3  # documents per search (Search-R1 retrieval_topk)
MAX_QUERIES = 10_000  # queries per request (Search-R1's trainer sends <= 512 x 5 per turn),
#   DEVIATION S10
MAX_QUERY_BYTES = 16 << 10  # UTF-8 bytes per query the server accepts, DEVIATION S15: a query is
#   read up to MAX_LENGTH tokens, and 256 tokens of any natural text take well under 16 KiB
#   (English ~4.5 bytes per wordpiece, CJK 3), so no real query is refused; eight 1 MB ones grew
#   the server by ~420 MB (tokenized whole, then cut)
CACHE_BYTES = 256 << 20  # bytes of answers the cache holds (queries and documents, as Python
#   objects); ~100,000 wiki-18 top-3 answers, the entry bound's default


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
