"""Retrieval for the search agent: in-process search over an index folder, dense or BM25, and the
client of a Search-R1 compatible HTTP server.

The library's front: `Retriever` (search over an index folder, retrieval/search.py: its cache, its
corpus rows, the query checks), `RemoteRetriever` (the HTTP client with the same `search`), the
observation text, `build_index` and the command line. The kinds of index are retrieval/dense.py's
and retrieval/bm25.py's, the folder's format retrieval/index.py's. It knows nothing of serving:
the HTTP server is retrieval/server.py and its load bench perf/bench_server.py; both search
through retrieval/search.py, and nothing in retrieval/ imports this file.

Contract (DESIGN.md sections 3 and 10; Search-R1 compatible)
- Search: `Retriever.search(queries, topk)`, retrieval/search.py's contract (top-k documents per
  query, a pure function of its text, cached).
- Observation text: `format_docs`, Search-R1's `_passages2string` byte for byte.
- Client: `RemoteRetriever.search` posts {"queries": [...], "topk": k, "return_scores": true} to
  POST /retrieve of a Search-R1 compatible server (retrieval/server.py's or Search-R1's own) and
  returns what `Retriever.search` returns; refused connections and 5xx answers are retried, any
  other refusal is raised at once. Its queries pass the same checks (retrieval/search.py's S10,
  S11).

Deviations from Search-R1 (DESIGN.md section 13): the search's, retrieval/search.py; the
encoder's and the index's, retrieval/dense.py; BM25's, retrieval/bm25.py; the server's,
retrieval/server.py.

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
import time

import requests

from infra.config import check_flags
from retrieval import bm25, dense
from retrieval.index import E5, MAX_LENGTH, describe_prebuilt
from retrieval.search import TOPK, Retriever, check_queries


def format_docs(docs: list) -> str:
    """Search-R1 `_passages2string`: `Doc i(Title: {first line of contents}) {other lines}\\n` per
    document."""
    out = ""
    for i, doc in enumerate(docs):
        lines = doc["contents"].split("\n")
        text = "\n".join(lines[1:])
        out += f"Doc {i + 1}(Title: {lines[0]}) {text}\n"
    return out


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
