"""BM25 retrieval without Java: the Lucene BM25 that Search-R1 gets from pyserini, on bm25s (pure
Python, numpy).

Search-R1's BM25 retriever is pyserini's LuceneSearcher (Java, Lucene): Anserini's default English
analyzer and BM25 with k1 = 0.9, b = 0.4. This file gives the same model through the bm25s library
(method "lucene") and PyStemmer. It knows terms and scores: the folder around its files
(offsets.npy, meta.json) has the format of retrieval/index.py, shared with dense folders, and the
corpus rows and the cache are retrieval/search.py's `Retriever`, which picks `BM25Index` from the folder's
meta.json ("encoder": "bm25") where it picks retrieval/dense.py's `DenseIndex` otherwise. Both
answer alike (an encoder, then `tops`), so every caller of `Retriever` (the search CLI,
retrieval/server.py, eval.py, training) gets BM25 from a BM25 folder unchanged. It never imports
retrieval/dense.py, nor retrieval/search.py.

Contract (DESIGN.md section 10)
- Analyzer (`analyze`), Anserini's DefaultEnglishAnalyzer (Lucene StandardTokenizer,
  EnglishPossessiveFilter, LowerCaseFilter, StopFilter with Lucene's 33 English stopwords,
  PorterStemFilter), applied to documents and queries alike: words (`TOKEN`), a trailing 's removed,
  lowercased, stopwords dropped, stemmed as Lucene's PorterStemmer does (`_porter`: words of one or
  two characters are left as they are).
- Score of query q (terms t_1..t_m, repeats kept) for document d of |d| terms, N documents, avgdl
  their mean length:
      idf(t) = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5))
      s(q, d) = sum_i idf(t_i) tf(t_i, d) / (tf(t_i, d) + k1 (1 - b + b |d| / avgdl)),   k1 = 0.9, b = 0.4
  (Lucene's BM25Similarity; a term repeated in the query counts each time, as Anserini's
  bag-of-words query boosts it by its count; a term absent from the corpus adds nothing). Each
  term's part is stored in float32 at build time (bm25s's eager index) and a query's parts are
  summed in its own term order: a score is a function of the query alone, never of the batch it
  comes in.
- Top k: the k highest scores, ties to the lower corpus row (Lucene: to the lower document id),
  always min(k, N) rows (S19).
- Files (the folder's `bm25/`): bm25s's own, written by `BM25.save`:
  data/indices/indptr.csc.index.npy (the (term, row) score matrix), vocab.index.json (term ->
  column, in order of first appearance: two builds of one corpus write identical bytes),
  params.index.json (k1, b, method, rows).

Deviations from Search-R1's pyserini BM25 (DESIGN.md section 13; tagged `# DEVIATION S<n>:` below)
S17. The analyzer approximates Lucene's: `TOKEN` stands for the UAX#29 word rules of
     StandardTokenizer (CJK runs stay one token, no 255-character cut), and Lucene's PorterStemmer
     (Porter's reference code) is Snowball's Porter (the published algorithm) with the reference
     code's two extra rules applied to its stems (`_porter`): the same except where a later suffix
     hid their ending (a word ending -loginess).
S18. Document lengths are exact; Lucene stores each in one byte (SmallFloat.intToByte4: exact below
     24, then ~3 significant bits), so scores differ slightly and near-ties may order differently. N
     and avgdl count rows without any term, which Lucene leaves out.
S19. Every search returns min(k, N) rows, as the dense retriever does: when fewer rows share a term
     with the query, rows of score 0 follow, lowest row first. pyserini returns only rows that match
     a term (none for "").
S20. Only the first max_length (256) terms of a query are read, as the dense encoder reads 256
     tokens; pyserini reads them all (and Lucene refuses a query of more than 1024 distinct terms).

Commands (building goes through retriever.py; serving: retrieval/server.py)
  python retriever.py build --corpus data/tinyworld/corpus.jsonl --encoder bm25 --out data/tinyworld/index_bm25
  python retriever.py search --index data/tinyworld/index_bm25 --topk 3 "who founded the city"
  python -m retrieval.server serve --index data/tinyworld/index_bm25 --port 8000
"""
import array
import importlib.metadata
import json
import os
import re
import threading

import bm25s
import numpy as np
import Stemmer
from tqdm import tqdm

from retrieval.index import (MAX_LENGTH, _check_out_dir, _write_index_dir, corpus_fingerprint,
                             iter_corpus)

# meta.json's "encoder" of a BM25 folder: what the loader reads to pick this retriever
ENCODER = "bm25"
K1, B = 0.9, 0.4  # pyserini's LuceneSearcher defaults (Search-R1's BM25 retriever sets neither)
METHOD = "lucene"  # bm25s's name for Lucene's BM25 (idf and term-frequency parts above)
INDEX_DIR = "bm25"  # the bm25s files, inside the index folder (meta.json's "index_file")
FILES = ("params.index.json", "vocab.index.json", "data.csc.index.npy", "indices.csc.index.npy",
         "indptr.csc.index.npy")
# Lucene's EnglishAnalyzer.ENGLISH_STOP_WORDS_SET (33 words)
STOPWORDS = frozenset(bm25s.stopwords.STOPWORDS_EN)
# DEVIATION S17: UAX#29 approximated: a run of letters, digits and underscores, joined across ' . :
# between letters (U.S.A, Zorvak's) and across . , ; ' between digits (3.14, 1,000)
TOKEN = re.compile(
    r"\w+(?:(?:(?<=[^\W\d_])[.:'\u2019\u00b7](?=[^\W\d_])|(?<=\d)[.,;'\u2019](?=\d))\w+)*")
POSSESSIVE = re.compile(r"['\u2019\uff07][sS]$")  # Lucene's EnglishPossessiveFilter
# in meta.json: a folder built with another analyzer is refused (its terms would not match the
# queries')
ANALYZER = "anserini-english-v2: words, possessive, lowercase, lucene stopwords, lucene porter"
# a PyStemmer Stemmer is not thread safe: one per thread (the server analyzes in many)
_local = threading.local()


def _stemmer():
    if not hasattr(_local, "stemmer"):
        _local.stemmer = Stemmer.Stemmer("porter")  # Snowball's: Porter's published algorithm
    return _local.stemmer


def _measure(word: str) -> int:
    """Porter's m: the number of vowel-consonant sequences of [C](VC)^m[V] (y is a vowel after a
    consonant)."""
    vowel = []
    for i, ch in enumerate(word):
        vowel.append(ch in "aeiou" or (ch == "y" and i > 0 and not vowel[i - 1]))
    return sum(vowel[i - 1] and not vowel[i] for i in range(1, len(word)))


def _porter(word: str, stem: str) -> str:
    """Lucene's PorterStemmer from Snowball's Porter stem: words of one or two characters stay as
    they are, and the two step-2 rules of Porter's reference code that Lucene ports (bli -> ble, not
    only abli -> able; logi -> log), which leave their ending in the published algorithm's stem, are
    applied to it (DEVIATION S17: exact unless a later suffix hid the ending, as in a word ending
    -loginess)."""
    if len(word) <= 2:
        return word
    if stem.endswith("logi") and _measure(stem[:-4]) > 0:
        return stem[:-1]
    if stem.endswith("bli") and not stem.endswith("abli") and _measure(stem[:-3]) > 0:
        # "ble" goes on through steps 3 to 5, as in Lucene
        return _stemmer().stemWord(stem[:-1] + "e")
    return stem


def analyze(text: str) -> list:
    """A text's terms, in order (Anserini's DefaultEnglishAnalyzer, S17): words, a trailing 's
    removed, lowercased, stopwords dropped, Porter stems of the words longer than two characters."""
    words = [
        w for w in (POSSESSIVE.sub("", token).lower() for token in TOKEN.findall(text))
        if w not in STOPWORDS
    ]
    return [_porter(w, stem) for w, stem in zip(words, _stemmer().stemWords(words))]


def build(texts, where: str) -> tuple:
    """Rows' texts -> (a bm25s index of them, the fields meta.json records). Terms are numbered in
    order of first appearance, so the same texts always give the same files (bm25s's own vocabulary
    is a set: its order would change with Python's hash seed). where: the corpus, named in errors.
    """
    vocab, rows = {}, []
    for text in texts:
        rows.append(array.array("i", [vocab.setdefault(term, len(vocab))
                                      for term in analyze(text)]))
    if not rows:
        raise ValueError(f"{where}: the corpus has no rows")
    if not vocab:
        raise ValueError(
            f"{where}: no row has a searchable term (every word is a stopword, or there are none)")
    # float32 scores, numpy backend: no numba, no torch
    model = bm25s.BM25(k1=K1, b=B, method=METHOD)
    # DEVIATION S18: exact document lengths (Lucene: one byte each); N and avgdl count rows without
    # terms
    model.index((rows, vocab), create_empty_token=False, show_progress=False)
    fields = {
        "encoder": ENCODER, "encoder_resolved": ENCODER, "query_prefix": "", "passage_prefix": "",
        "metric": "bm25", "dim": len(vocab), "index_file": INDEX_DIR, "bm25": {
            "method": METHOD, "k1": K1, "b": B, "analyzer": ANALYZER,
            "bm25s_version": bm25s.__version__,
            "pystemmer_version": importlib.metadata.version("PyStemmer")
        }
    }
    return model, fields


def save(model, index_dir: str):
    """bm25s's files into the index folder being written (its INDEX_DIR)."""
    model.save(os.path.join(index_dir, INDEX_DIR), show_progress=False)


def build_index(corpus: str, out: str, max_length: int = MAX_LENGTH) -> dict:
    """A BM25 folder: bm25s's files in bm25/, offsets.npy and meta.json as a dense folder's
    (retrieval/index.py); returns the meta."""
    out, offsets = _check_out_dir(out), array.array("q")

    def texts():
        for offset, row in iter_corpus(corpus):
            offsets.append(offset)
            yield row["contents"]
    model, meta = build(tqdm(texts(), desc=f"analyze {corpus}", unit=" rows"), corpus)
    meta |= {"max_length": max_length, "n_rows": len(offsets), "corpus": os.path.abspath(corpus),
             "corpus_relative": os.path.relpath(os.path.abspath(corpus), out),
             "corpus_fingerprint": corpus_fingerprint(corpus, len(offsets))}
    _write_index_dir(out, meta, np.frombuffer(offsets, np.int64), lambda tmp: save(model, tmp))
    return meta


def top_rows(scores: np.ndarray, topk: int) -> tuple:
    """The min(topk, N) rows of highest score, ties to the lower row -> (rows, scores). O(N): a
    partition finds the k-th best score, then every row above it and the lowest rows equal to it are
    sorted."""
    k = min(topk, len(scores))
    kth = scores[np.argpartition(-scores, k - 1)[k - 1]]
    above = np.flatnonzero(scores > kth)
    rows = np.concatenate([above, np.flatnonzero(scores == kth)[:k - len(above)]])
    order = np.lexsort((rows, -scores[rows]))
    return rows[order], scores[rows][order]


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e}); rebuild the index folder") from None
    if not isinstance(value, dict):
        raise ValueError(
            f"{path}: expected a JSON object, got {type(value).__name__}; rebuild the index folder")
    return value


def _read_array(path: str, kind: str) -> np.ndarray:
    """A 1-d .npy array of the given dtype kind ("f", "i"), memory-mapped read-only (nothing is
    written)."""
    try:
        values = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(
            f"{path}: not a readable .npy array ({e}); rebuild the index folder") from None
    if values.ndim != 1 or values.dtype.kind not in (kind + "u" if kind == "i" else kind):
        raise ValueError(
            f"{path}: expected a 1-d {'float' if kind == 'f' else 'integer'} array, got {values.dtype} "
            f"of shape {values.shape}; rebuild the index folder")
    return values


class BM25Index:
    """The BM25 side of an index folder, in the two roles of a dense folder's `DenseIndex`
    (retrieval/dense.py): its own `encoder`, and the index that answers `tops`, as retrieval/search.py's
    `Retriever` asks: queries -> `query_features` (term ids; the server analyzes each request once,
    in its own thread) -> `encode_tokens` -> `tops`. Every file is checked against meta.json, each
    error naming its file."""
    device = "cpu"

    def __init__(self, path: str, meta: dict, meta_path: str):
        recorded = meta.get("bm25")
        fields = {"method": str, "k1": float, "b": float, "analyzer": str}
        if not isinstance(recorded, dict) or any(not isinstance(recorded.get(k), t)
                                                 for k, t in fields.items()):
            raise ValueError(
                f"{meta_path}: field 'bm25' must be an object with {sorted(fields)}, got "
                f"{json.dumps(recorded)[:80]}; rebuild the index folder")
        if recorded["analyzer"] != ANALYZER:
            raise ValueError(
                f"{meta_path}: built with the analyzer {recorded['analyzer']!r}, this code analyzes "
                f"queries with {ANALYZER!r}; rebuild the index folder")
        missing = [name for name in FILES if not os.path.isfile(os.path.join(path, name))]
        if missing:
            raise FileNotFoundError(
                f"BM25 index {path} is incomplete, missing {missing}; rebuild the index folder")
        files = {name: os.path.join(path, name) for name in FILES}
        params = _read_json(files["params.index.json"])
        wanted = {
            "method": recorded["method"], "k1": recorded["k1"], "b": recorded["b"],
            "num_docs": meta["n_rows"]
        }
        differ = [
            f"{k} {params.get(k)!r} != {v!r}" for k, v in wanted.items() if params.get(k) != v
        ]
        if differ:
            raise ValueError(
                f"{files['params.index.json']} does not match {meta_path}: {'; '.join(differ)}; rebuild "
                "the index folder")
        vocab = _read_json(files["vocab.index.json"])
        if len(vocab) != meta["dim"] or sorted(vocab.values()) != list(range(len(vocab))):
            raise ValueError(
                f"{files['vocab.index.json']} holds {len(vocab)} terms, not numbered 0..n-1 as the "
                f"{meta['dim']} terms of {meta_path}; rebuild the index folder")
        data, indices, indptr = (_read_array(files[n], k)
                                 for n, k in (("data.csc.index.npy", "f"), ("indices.csc.index.npy",
                                                                            "i"),
                                              ("indptr.csc.index.npy", "i")))
        if len(indptr) != len(vocab) + 1 or indptr[0] != 0 or indptr[-1] != len(data) or len(
                indices) != len(data):
            raise ValueError(
                f"{files['indptr.csc.index.npy']} ({len(indptr)} pointers, last {indptr[-1:]}) does not "
                f"fit {len(vocab)} terms and {len(data)} scores ({files['data.csc.index.npy']}, "
                f"{len(indices)} rows in {files['indices.csc.index.npy']}); rebuild the index folder"
            )
        # read-only maps: any storage will do
        self.model = bm25s.BM25.load(path, mmap=True, show_progress=False)
        self.vocab, self.max_length, self.n_rows = self.model.vocab_dict, meta["max_length"], meta[
            "n_rows"]

    def query_features(self, queries: list) -> list:
        """Each query -> (term ids, None): its first max_length terms (S20) that the corpus holds,
        repeats kept, in order; what `encode_tokens` takes and the server's cost measure (their
        number)."""
        # DEVIATION S20: a query is read up to max_length terms, as the dense encoder reads
        # max_length tokens
        return [(array.array(
            "i", [self.vocab[t] for t in analyze(q)[:self.max_length] if t in self.vocab]), None)
                for q in queries]

    def encode_tokens(self, features: list) -> np.ndarray:
        """Term ids per query as an object array (n,), so that a retriever picks queries with
        vecs[rows]."""
        out = np.empty(len(features), object)
        for i, (ids, _) in enumerate(features):
            out[i] = np.frombuffer(ids, np.int32) if len(ids) else np.zeros(0, np.int32)
        return out

    def encode(self, texts: list, kind: str) -> np.ndarray:
        if kind != "query":
            raise ValueError(f"a BM25 index encodes queries only, got kind={kind!r}")
        return self.encode_tokens(self.query_features(texts))

    @property
    def encoder(self):
        """Queries -> terms: this index itself (a dense folder's is its `Encoder`)."""
        return self

    def tops(self, vecs: np.ndarray, topk: int) -> list:
        """(rows, scores) of each query's topk: its own terms (`encode_tokens`), searched alone."""
        return [self.top(terms, topk) for terms in vecs]

    def top(self, terms: np.ndarray, topk: int) -> tuple:
        """(rows, scores) of one query's topk, ties to the lower row; the query's parts summed in
        its term order."""
        scores = self.model.get_scores_from_ids(terms)  # (N,) float32
        return top_rows(scores, topk)  # DEVIATION S19: min(topk, N) rows, rows of score 0 included
