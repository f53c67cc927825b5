"""Dense retrieval: a transformer encoder (E5, MiniLM) + an exact inner-product FAISS index.

It owns the encoder (`Encoder`: texts -> unit vectors), the vectors of a dense folder and their
FAISS index (`DenseIndex`: query vectors -> each one's top k rows with exact scores) and the
dense build (`build_index`: a corpus encoded into a folder). It knows nothing of the corpus rows,
the cache, HTTP or other kinds of index: the folder's format is retrieval/index.py's, and
retrieval/search.py's `Retriever` turns rows into documents; it picks this file's `DenseIndex` for a
folder whose meta.json names an encoder, as it picks BM25 for the others (retrieval/bm25.py,
which this file never imports).

Contract (DESIGN.md sections 3 and 10; Search-R1 compatible)
- Embedding of a text x (after its prefix, E5: "query: " / "passage: "), from last-layer hidden
  states h_i and the attention mask m_i over at most max_length = 256 tokens:
      u(x) = sum_i m_i h_i / sum_i m_i        (mean pooling over real tokens)
      e(x) = u(x) / ||u(x)||_2                (L2 normalisation)
- Score: s(q, d) = <e(q), e(d)> (cosine), top-k over all rows (IndexFlatIP), ties broken by row
  number.

Determinism: a query's results are a pure function of its text, whatever batch it comes in (a
twin episode, DESIGN.md section 5, replays a query inside another batch and must see the same
documents):
  (1) every query forward has a shape that the query alone decides. Matmul kernels are chosen
      by shape, so its embedding does not depend on its companions, where batches of free size
      moved it by ~2e-7 (and a batch of 1 by ~7e-8 against 2+). Queries of any requests can
      thus share a forward.
      (1a) BERT encoders (MiniLM, E5) in float32 on a CPU: the queries' tokens are laid back to
           back, unpadded, in one (PACK_TOKENS, H) matrix (a longer query alone, its length
           rounded up to a multiple); the linear layers see only that shape, attention and mean
           pooling run per query over its own tokens (`Encoder._forward_packed`). BertModel's
           forward up to float rounding (< 2e-6 per coordinate); no padding, so 3.9 ms per
           query on one core against 5.6 ms for (1b) in rounds of 32 benchmark queries (14
           tokens each, ~20 padded).
      (1b) any other encoder or device: QUERY_ROWS rows (spare rows are copies of a real one),
           each padded to the query's token length rounded up to LENGTH_STEP.
      Both measured bit-identical across shufflings of the queries (tests: alone, in any batch,
      at any offset). The vectors do depend on torch's thread count (~1e-7), so the server and
      an in-process search compare at one count.
  (2) FAISS only proposes topk + CANDIDATE_MARGIN rows; each score is then recomputed from the
      stored float32 vectors as the exactly rounded sum of exact float64 products (math.fsum):
      a function of (query, row) alone. The batch could only matter if more than
      CANDIDATE_MARGIN rows were within float32 rounding of the k-th score. Rows that a float64
      sum and its error bound rule out of the top k are not summed exactly (`exact_top`): same
      answer.

Deviations from Search-R1 (DESIGN.md section 13; tagged `# DEVIATION S<n>:` in the code; the
rest: retrieval/search.py and retrieval/server.py)
S1. Scores are the exact inner products of (2), not FAISS's float32 sums (they differ by ~1e-7).
S2. A topk above the corpus size returns every row (FAISS would pad with row -1); the rest of S2
    is the server's.
S4. An fp16 encoder's hidden states are pooled and normalised in float32 (Search-R1 pools in
    fp16).
S14. Queries are encoded in packs or fixed-shape batches, Determinism (1) (Search-R1 pads
     free-size batches of 512).
S21. index_fp16 keeps the index's GPU shards in float16 (half of each training GPU's share;
     Search-R1 shards float32 or searches on the CPU): the candidates of each query are
     re-scored exactly as always, and a query whose candidates are not certified to hold the
     exact top k (`certified`) is searched again with twice as many, so the answers equal the
     float32 index's.

Commands: retriever.py (build, search); serving: retrieval/server.py.
"""
import array
import collections
import math
import os
import threading

import faiss
import numpy as np
import tokenizers
import torch
from tqdm import tqdm
from transformers import AutoModel, AutoTokenizer

from retrieval.index import (INDEX_FILE, MAX_LENGTH, META_FILE, OFFSETS_FILE, _check_out_dir,
                             _make_meta, _write_index_dir, encoder_prefixes, iter_corpus,
                             read_flat_index, resolve_encoder)

CANDIDATE_MARGIN = 16  # extra FAISS candidates re-scored exactly, Determinism (2)
FAISS_TEMP = 512 << 20  # bytes of scratch per GPU for FAISS's brute-force search (default 1.5 GiB;
#                        its distance tiles, 1 GiB, are allocated beside it: perf/ledger.SERVER_GIB)
PACK_TOKENS = 128  # token rows of every packed query forward, Determinism (1a); per token within
#                   ~6% of 256 or 512 on CPU, and half their cost for a query alone
QUERY_ROWS = 8  # rows of every padded query forward, Determinism (1b)
LENGTH_STEP = 8  # (1b): query token lengths are padded up to a multiple of this: fewer shapes,
#                  fuller batches
TOKENIZE_CHUNK = 64  # queries tokenized per call (`Encoder.query_features`)


def pack_queries(lengths: list, size: int) -> list:
    """Query indices -> packs of at most `size` tokens: longest first, each pack topped up with
    the longest that still fit; a query longer than `size` gets a pack of its own. Determinism
    (1a): which queries share a pack changes no number, so the choice only decides how few packs
    there are."""
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
    """Texts -> unit vectors (float32, (n, dim)): last hidden states, mean pooling over the mask,
    L2 normalisation."""

    def __init__(self, name_or_path, query_prefix=None, passage_prefix=None,
                 max_length=MAX_LENGTH, device=None, batch_size=64, fp16=False):
        self.query_prefix, self.passage_prefix = encoder_prefixes(name_or_path, query_prefix,
                                                                  passage_prefix)
        self.max_length, self.batch_size = max_length, batch_size
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        path = resolve_encoder(name_or_path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        dtype = torch.float16 if fp16 else torch.float32
        self.model = AutoModel.from_pretrained(path, dtype=dtype).to(self.device).eval()
        self.dim = self.model.config.hidden_size
        # Determinism (1a) re-implements BertModel's forward: BERT in float32 on a CPU only
        config = self.model.config
        self.packed = (self.device.type == "cpu" and dtype == torch.float32
                       and config.model_type == "bert"
                       and getattr(config, "position_embedding_type", "absolute") == "absolute")
        # a fast tokenizer called from two threads fails ("Already borrowed")
        self._tokenizer_lock = threading.Lock()
        # queries: a backend copy set up once, called from any thread without a lock
        self._query_tokenizer = None
        if self.tokenizer.is_fast:  # the call `self.tokenizer(texts, max_length=, truncation=True)`
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
        # similar lengths together: less padding
        order = np.argsort([len(t) for t in texts], kind="stable")
        for start in range(0, len(texts), self.batch_size):
            rows = order[start:start + self.batch_size]
            out[rows] = self._embed([texts[i] for i in rows])
        return out

    def query_features(self, queries: list) -> list:
        """Each query as encoded (prefix, truncation at max_length) -> (token ids, token type ids
        or None when all 0), int32 arrays: what `encode_tokens` takes. Thread safe without a lock
        (a fast tokenizer; the GIL is released), so the server tokenizes each request once, in the
        request's own thread."""
        texts = [self.query_prefix + q for q in queries]
        if self._query_tokenizer is not None:
            # in chunks: a text is tokenized whole before truncation, so 1000 queries of 16 KiB at
            # once held ~430 MB of tokens for a moment (and the process kept it); 64: ~30 MB
            pairs = [(e.ids, e.type_ids) for start in range(0, len(texts), TOKENIZE_CHUNK)
                     for e in self._query_tokenizer.encode_batch(
                         texts[start:start + TOKENIZE_CHUNK])]
        else:
            with self._tokenizer_lock:
                features = self.tokenizer(texts, max_length=self.max_length, truncation=True,
                                          return_token_type_ids=True)
            pairs = list(zip(features["input_ids"], features["token_type_ids"]))
        return [(array.array("i", ids), array.array("i", types) if any(types) else None)
                for ids, types in pairs]

    def query_tokens(self, queries: list) -> list:
        """Token count of each query as encoded (prefix, truncation)."""
        return [len(ids) for ids, _ in self.query_features(queries)]

    def encode_tokens(self, features: list) -> np.ndarray:
        """Determinism (1): query features (`query_features`) -> unit vectors (n, dim); a query's
        forward has a shape of its own, whatever queries come with it."""
        out = np.empty((len(features), self.dim), np.float32)
        if self.packed:
            ids = [list(x) for x, _ in features]
            for pack in pack_queries([len(x) for x in ids], PACK_TOKENS):
                out[pack] = self._forward_packed([ids[i] for i in pack])
            return out
        names = self.tokenizer.model_input_names  # the keys `self.tokenizer(...)` returns
        rows = []
        for ids, types in features:
            row = {"input_ids": list(ids),
                   "token_type_ids": list(types) if types else [0] * len(ids),
                   "attention_mask": [1] * len(ids)}  # one unpadded sequence: every token attended
            rows.append({key: value for key, value in row.items()
                         if key == "input_ids" or key in names})
        buckets = collections.defaultdict(list)  # (1b): padded length -> indices of texts
        for i, row in enumerate(rows):
            length = len(row["input_ids"])
            buckets[min(-(-length // LENGTH_STEP) * LENGTH_STEP, self.max_length)].append(i)
        for length, members in buckets.items():
            for start in range(0, len(members), QUERY_ROWS):
                part = members[start:start + QUERY_ROWS]
                # S14: spare rows are copies of a real one
                batch = [rows[i] for i in part] + [rows[part[0]]] * (QUERY_ROWS - len(part))
                with self._tokenizer_lock:
                    padded = self.tokenizer.pad(batch, padding="max_length", max_length=length,
                                                return_tensors="pt")
                out[part] = self._pool(padded)[:len(part)]
        return out

    @torch.inference_mode()
    def _forward_packed(self, seqs: list) -> np.ndarray:
        """Determinism (1a): BertModel's forward over queries laid back to back, without padding,
        in one matrix of PACK_TOKENS rows (a longer query alone, rounded up to a multiple): every
        matmul sees that one shape, and attention and pooling run per query over its own tokens.
        Token ids per query -> unit vectors (n, H)."""
        model, config = self.model, self.model.config
        lengths = [len(s) for s in seqs]
        used = sum(lengths)
        rows = -(-used // PACK_TOKENS) * PACK_TOKENS
        # spare rows: token 0 at position 0, attended by no query
        ids = torch.zeros(1, rows, dtype=torch.long)
        positions = torch.zeros(1, rows, dtype=torch.long)
        ids[0, :used] = torch.tensor([token for s in seqs for token in s])
        positions[0, :used] = torch.tensor([p for n in lengths for p in range(n)])
        hidden = model.embeddings(input_ids=ids, position_ids=positions,
                                  token_type_ids=torch.zeros_like(ids))[0]
        ends = np.cumsum(lengths).tolist()
        spans = list(zip([0] + ends[:-1], ends))
        heads = config.num_attention_heads
        size = config.hidden_size // heads
        spare = hidden.new_zeros(1, heads, rows - used, size)
        # BertLayer: self-attention, output + residual + LayerNorm, feed-forward
        for layer in model.encoder.layer:
            att = layer.attention.self
            q, k, v = (f(hidden).view(1, rows, heads, size).transpose(1, 2)
                       for f in (att.query, att.key, att.value))
            context = [torch.nn.functional.scaled_dot_product_attention(
                q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], scale=size ** -0.5) for a, b in spans]
            context = torch.cat(context + [spare], 2).transpose(1, 2).reshape(rows, -1)  # (rows, H)
            hidden = layer.attention.output(context, hidden)
            hidden = layer.output(layer.intermediate(hidden), hidden)  # (rows, H)
        # (n, H) mean over each query's tokens
        pooled = torch.stack([hidden[a:b].sum(0) / (b - a) for a, b in spans])
        return torch.nn.functional.normalize(pooled, dim=-1).numpy()

    def _embed(self, texts: list) -> np.ndarray:
        with self._tokenizer_lock:
            batch = self.tokenizer(texts, max_length=self.max_length, truncation=True,
                                   padding=True, return_tensors="pt")
        return self._pool(batch)

    @torch.inference_mode()
    def _pool(self, batch) -> np.ndarray:
        batch = batch.to(self.device)
        # DEVIATION S4: an fp16 model's hidden states are pooled in fp32
        hidden = self.model(**batch).last_hidden_state.float()  # (B, T, H)
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
        pooled = (hidden * mask).sum(1) / mask.sum(1)  # (B, H) mean over real tokens
        return torch.nn.functional.normalize(pooled, dim=-1).cpu().numpy()


# --- the vectors, their FAISS index, exact re-scoring ---

def load_vectors(index_path: str, meta: dict, gpu: bool, fp16: bool = False) -> tuple:
    """-> (exact float32 vectors for re-scoring, the index to search, its GPU resources or
    None). The index is the vectors themselves, or on GPUs their copy sharded over all of them:
    float32, or with fp16 float16 (half of every GPU's share: 3.8 GiB of wiki-18 on each of 8
    GPUs instead of 7.5; its candidates are certified, `certified`). fp16 without GPUs: a
    float16 scalar-quantized copy, the same rounding (what the tests run)."""
    # with GPUs the host copy is only mapped, not loaded
    vectors = read_flat_index(index_path, mmap=gpu)
    if vectors.ntotal != meta["n_rows"] or vectors.d != meta["dim"]:
        raise ValueError(f"{index_path} holds {vectors.ntotal} vectors of dim {vectors.d} but "
                         f"{META_FILE} and {OFFSETS_FILE} say {meta['n_rows']} rows of dim "
                         f"{meta['dim']}")
    if not gpu and not fp16:
        return vectors, vectors, None
    if not gpu:
        half = faiss.IndexScalarQuantizer(vectors.d, faiss.ScalarQuantizer.QT_fp16,
                                          faiss.METRIC_INNER_PRODUCT)
        half.add(vectors.reconstruct_n(0, vectors.ntotal))
        return vectors, half, None
    options = faiss.GpuMultipleClonerOptions()
    options.shard, options.useFloat16 = True, fp16
    resources = [faiss.StandardGpuResources() for _ in range(faiss.get_num_gpus())]
    for res in resources:
        res.setTempMemory(FAISS_TEMP)
    index = faiss.index_cpu_to_gpu_multiple_py(resources, vectors, co=options)
    return vectors, index, resources


def fp16_error(vectors, chunk: int = 1 << 20) -> float:
    """Bound, per unit of query norm, on |FAISS's float16 score - the exact inner product| of
    any row: a float16 query and row (relative rounding u = 2^-11 each) summed in float32 over d
    terms, |q . v| <= |q| max |v|."""
    top = 0.0
    # one pass over the mapped file (wiki-18: ~1 min at load)
    for start in range(0, vectors.ntotal, chunk):
        block = vectors.reconstruct_n(start, min(chunk, vectors.ntotal - start))
        norms = np.sqrt(np.einsum("ij,ij->i", block, block, dtype=np.float64))
        top = max(top, float(norms.max()))
    u, d = 2.0 ** -11, vectors.d
    return (2 * u + u * u + 1.01 * d * 2.0 ** -24) * top * 1.001 + d * 2.0 ** -24


def certified(exact_kth: float, approx: np.ndarray, error: float) -> bool:
    """The exact top k is among FAISS's candidates: every row it left out scored at most its last
    candidate's score approx[-1] approximately, so at most approx[-1] + error exactly, below the
    k-th exact score of the candidates (strictly: a tie could have been left out)."""
    return exact_kth > approx[-1] + error


def exact_top(rows: np.ndarray, products: np.ndarray, topk: int) -> tuple:
    """Determinism (2): the topk rows by exact score sum_i p_i (math.fsum of the exact float64
    products, (k, dim)), ties to the lower row -> (rows, scores). Only rows that float64 sums
    cannot rule out are summed exactly: any order of summing n terms is within
    (n - 1) u sum_i |p_i| of the exact sum (u = 2^-53; 4 n u here, for margin), so a row whose
    upper bound is below every lower bound of the float64 top k can be neither in the top k nor
    tied with it."""
    approx = products.sum(1)  # (k,)
    # (k,) bound on |approx - exact|
    slack = 4 * products.shape[1] * 2.0 ** -53 * np.abs(products).sum(1)
    top = np.argsort(-approx, kind="stable")[:topk]
    keep = approx + slack >= (approx[top] - slack[top]).min()  # the float64 top k always stays
    rows, scores = rows[keep], np.array([math.fsum(p) for p in products[keep].tolist()])
    best = np.lexsort((rows, -scores))[:topk]
    return rows[best], scores[best]


class DenseIndex:
    """A dense folder's search side: the vectors, their FAISS index (on the GPUs when there are
    any), the fp16 bound and the `Encoder` of its queries. `tops` answers each query vector's top
    k rows with exact scores; it is thread safe (FAISS's GPU indexes are not: one lock)."""

    def __init__(self, index_path: str, meta: dict, device=None, fp16: bool = False,
                 faiss_gpu=None, index_fp16: bool = False):
        self.n_rows = meta["n_rows"]
        gpu = torch.cuda.is_available() and faiss.get_num_gpus() > 0 and device != "cpu"
        gpu = gpu if faiss_gpu is None else gpu and faiss_gpu  # None: the GPUs when there are any
        self.vectors, self.index, self._resources = load_vectors(index_path, meta, gpu, index_fp16)
        # per unit query norm: certified() needs it
        self.error = fp16_error(self.vectors) if index_fp16 else None
        resolved = meta["encoder_resolved"]  # else the name: "minilm" moves with the virtualenv
        self.encoder = Encoder(resolved if os.path.isdir(resolved) else meta["encoder"],
                               meta["query_prefix"], meta["passage_prefix"], meta["max_length"],
                               device, fp16=fp16)
        if self.encoder.dim != meta["dim"]:
            raise ValueError(f"encoder {meta['encoder']} gives {self.encoder.dim}-d vectors, "
                             f"{index_path} holds {meta['dim']}-d ones")
        self._index_lock = threading.Lock()  # FAISS's GPU indexes are not thread safe

    def tops(self, vecs: np.ndarray, topk: int) -> list:
        """(rows, exact scores) of each query's top k: FAISS's candidates re-scored exactly."""
        k = min(topk + CANDIDATE_MARGIN, self.n_rows)  # DEVIATION S2: never more rows than exist
        with self._index_lock:
            # (Q, k) rows; FAISS's own scores depend on the batch
            approx, candidates = self.index.search(vecs, k)
        tops = []
        for vec, rows, scores in zip(vecs, candidates, approx):
            top, n = self._exact(vec, rows[rows >= 0], topk), k
            # DEVIATION S21: with a float16 index, a query whose candidates are not certified to
            # hold the exact top k is searched again with twice the candidates (the float32
            # index's exactness, kept)
            while self.error is not None and n < self.n_rows and len(top[1]) and \
                    not certified(top[1][-1], scores[rows >= 0],
                                  self.error * float(np.linalg.norm(vec))):
                n = min(2 * n, self.n_rows)
                with self._index_lock:
                    scores, rows = (a[0] for a in self.index.search(vec[None], n))
                top = self._exact(vec, rows[rows >= 0], topk)
            tops.append(top)
        return tops

    def _exact(self, vec, rows, topk) -> tuple:
        vectors = self.vectors.reconstruct_batch(rows).astype(np.float64)
        products = vectors * vec.astype(np.float64)  # (k, dim)
        return exact_top(rows, products, topk)  # DEVIATION S1: exact scores, Determinism (2)


def build_index(corpus: str, encoder: str, out: str, batch_size: int = 256,
                max_length: int = MAX_LENGTH, query_prefix=None, passage_prefix=None,
                device=None, fp16: bool = False) -> dict:
    """Encode every corpus row as a passage into an IndexFlatIP in the folder `out`; returns the
    meta.

    Rows are streamed; the vectors stay in RAM until written (wiki-18 with E5: 21M x 768 float32
    = 64 GB).
    """
    _check_out_dir(out)  # before hours of encoding
    enc = Encoder(encoder, query_prefix, passage_prefix, max_length, device, batch_size, fp16)
    index, offsets, chunk = faiss.IndexFlatIP(enc.dim), array.array("q"), []
    size = os.path.getsize(corpus)
    with tqdm(total=size, unit="B", unit_scale=True, desc=f"encode {corpus}") as bar:
        for offset, row in iter_corpus(corpus):
            offsets.append(offset)
            chunk.append(row["contents"])
            if len(chunk) == 16 * batch_size:  # several batches per call: sorting by length pays
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
    # survives a moved folder
    meta["corpus_relative"] = os.path.relpath(os.path.abspath(corpus), os.path.abspath(out))
    _write_index_dir(out, meta, np.frombuffer(offsets, np.int64), index)
    return meta
