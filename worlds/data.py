"""Data in: Search-R1's datasets from the hub, and the user's own files (DESIGN.md section 10). The
built-in worlds are worlds/build.py's.

1. `searchr1` (`make reproduce-3b` runs it): Search-R1's NQ + HotpotQA training set, the seven
   FlashRAG test sets, wiki-18 and its prebuilt E5 flat index from the Hugging Face hub
   (hf_hub_download at a pinned commit, then checked against the hub's checksums), in the layout
   above SR1_TRAIN. A rerun skips every finished step and file; a broken transfer continues inside
   hf_hub_download, but a download abandoned (process killed, every retry failed) starts over.
2. `convert`: a Search-R1 / verl parquet (the question inside `prompt`, after Search-R1's
   instruction; the gold answers in `reward_model.ground_truth.target`) or a FlashRAG jsonl.
3. `world`: a corpus in Search-R1's rows and questions -> a world folder for train_twice.py's
   --world (no policy in it: give --model), indexed by retriever.build_index (minilm, bm25: no hub).
Every QA file comes out in eval.load_qa's schema (`id`, `question`, `golden_answers`,
`data_source`). Every input row is checked (eval.py's checks) and a bad one named by file:line or
`file: row N` before anything is written; outputs go to a temporary name in the same folder and are
renamed at the end. It knows file formats, not the retriever's internals nor training.

Deviations: D1 training-time evaluation uses val.jsonl (100 questions per test set); final policies
are scored on every question by eval.py. D4 ids get their data source as prefix (qa_row). D10 gold
answers that normalise to nothing are removed (_drop_empty_gold).

Launch:
  python -m worlds.data searchr1 --out data/searchr1         # ~80 GB download (corpus + index)
  python -m worlds.data convert --input train.parquet --out data/mine/train.jsonl
  python -m worlds.data world --corpus docs.jsonl --questions qa.jsonl --encoder bm25 \
      --out data/mine
  python train_twice.py --world=data/mine --model=Qwen/Qwen2.5-3B
"""
import argparse
import json
import os
import shutil
import sys
import time

import numpy as np

from eval import write_jsonl

# `searchr1 --out DIR` writes, resumably (a rerun skips every finished file):
#   train.jsonl        Search-R1's merged NQ + HotpotQA training split
#   test/{name}.jsonl  the seven test sets (FlashRAG's test split, else dev: Search-R1's test merge)
#   val.jsonl          VAL_PER_SOURCE questions of each test set: the evaluation during training
#   wiki-18.jsonl      the corpus; e5_Flat.index: the prebuilt E5 flat index, joined from its parts
#   index/             retriever.py's folder for it (describe_prebuilt), or one built: --index build
#   manifest.json      sources (repo, commit, checksum), outputs and row counts; written last: done
#   raw/{repo}/        the downloads (hf_hub_download's local_dir, its records in
#                      .cache/huggingface); the big ones (corpus .gz, index parts) go once converted
# Sources, checked against Search-R1 (github PeterGriffinJin/Search-R1: scripts/download.py, the
# README's cat part_*, scripts/nq_hotpotqa/README.md,
# scripts/data_process/qa_search_{train,test}_merge.py) and FlashRAG's dataset card.
SR1_TRAIN = ("PeterJinGo/nq_hotpotqa_train", "train.parquet")  # hub dataset repo, file
# {dataset}/{split}.jsonl rows: id, question, golden_answers, metadata
FLASHRAG = "RUC-NLPIR/FlashRAG_datasets"
SR1_TESTS = {
    "nq": "test", "triviaqa": "test", "popqa": "test", "hotpotqa": "dev", "2wikimultihopqa": "dev",
    "musique": "dev", "bamboogle": "test"
}
# DPR's 2018 Wikipedia, 100-word passages
SR1_CORPUS = ("PeterJinGo/wiki-18-corpus", "wiki-18.jsonl.gz")
# e5_Flat.index = cat part_aa part_ab
SR1_INDEX = ("PeterJinGo/wiki-18-e5-index", ("part_aa", "part_ab"))
# FlashRAG card
SR1_ROWS = {"train": 169_615, "nq": 3_610, "triviaqa": 11_313, "popqa": 14_267, "hotpotqa": 7_405,
            # DPR psgs_w100
            "2wikimultihopqa": 12_576, "musique": 2_417, "bamboogle": 125, "corpus": 21_015_324}
# disk estimate of wiki-18.jsonl from its .gz size (English text gzips ~3x; rounded up)
CORPUS_GZ_RATIO = 3.5
VAL_PER_SOURCE = 100   # questions per test set in val.jsonl
# seconds before the first automatic retry of a failed download (then 2x, 3x, ...)
RETRY_WAIT = 5.0
GiB = 1 << 30


def hub_info(repo_id: str, filenames: list, revision: str = "main", endpoint=None) -> tuple:
    """(commit, {filename: {"size", "sha256" (LFS files, else None), "git_sha1"}}) of files of a hub
    dataset repo. The commit pins the downloads, so that files and checksums come from the same
    revision."""
    from huggingface_hub import HfApi
    api = HfApi(endpoint=endpoint)
    commit = api.dataset_info(repo_id, revision=revision).sha or revision
    found = {
        e.path: e
        for e in api.get_paths_info(repo_id, list(filenames), repo_type="dataset", revision=commit)
    }
    missing = [f for f in filenames if not hasattr(found.get(f), "blob_id")]
    if missing:
        raise FileNotFoundError(f"hub dataset {repo_id}@{revision} has no file(s) {missing}")
    return commit, {f: {"size": found[f].lfs.size if found[f].lfs else found[f].size,
                        "sha256": found[f].lfs.sha256 if found[f].lfs else None,
                        "git_sha1": None if found[f].lfs else found[f].blob_id} for f in filenames}


def hub_fetch(repo_id: str, filename: str, local_dir: str, revision: str, endpoint=None) -> str:
    """huggingface_hub.hf_hub_download of a hub dataset file at `revision` -> its path,
    local_dir/filename. It retries a broken transfer inside the call (HTTP Range from where it
    stopped, or Xet's chunked transfer when hf-xet is installed), checks the size, writes under a
    temporary name and renames, so a file under its name is whole; a file already in local_dir at
    this commit (its record in local_dir/.cache/huggingface) is not fetched."""
    from huggingface_hub import hf_hub_download
    return hf_hub_download(repo_id, filename, repo_type="dataset", revision=revision,
                           local_dir=local_dir, endpoint=endpoint)


def file_digest(path: str, kind: str) -> str:
    """The hub's checksum of a local file: "sha256" (LFS files) or "git_sha1" (git blob id of a
    small git file), computed by huggingface_hub's own helpers (those of `hf cache verify`)."""
    from huggingface_hub.utils.sha import git_hash, sha_fileobj
    with open(path, "rb") as f:
        # git files are <= 10 MB
        return sha_fileobj(f).hex() if kind == "sha256" else git_hash(f.read())


def fetch_verified(fetch, src: dict, retries: int = 3) -> str:
    """src["repo"]/src["file"]@src["commit"] -> src["path"] through fetch(repo, file, local_dir,
    commit), then checked against the hub's checksum (src["sha256"] or src["git_sha1"]):
    hf_hub_download only checks the size of what it fetched over HTTP. A failed call is retried
    `retries` times (after RETRY_WAIT x attempt seconds); the library has then already retried the
    broken transfer from where it stopped."""
    where, local_dir = f"{src['repo']}/{src['file']}", src["path"][:-len(src["file"])]
    for attempt in range(retries + 1):
        try:
            path = fetch(src["repo"], src["file"], local_dir, src["commit"])
            break
        except Exception as e:
            if attempt == retries:
                raise IOError(f"{where}: download interrupted ({type(e).__name__}: {e}); finished "
                              "files are kept, rerun to continue") from e
            print(f"{where}: {type(e).__name__}: {e}; retrying (retry {attempt + 1}/{retries})",
                  flush=True)
            time.sleep(RETRY_WAIT * (attempt + 1))
    kind = "sha256" if src.get("sha256") else "git_sha1"
    if src["size"] > GiB:
        print(f"{where}: checking its {kind} ({src['size'] / GiB:.1f} GiB)", flush=True)
    got = file_digest(path, kind)
    if got != src[kind]:
        os.remove(path)
        raise ValueError(
            f"{where}: {kind} checksum mismatch in {path} (got {got}, the hub says {src[kind]}); "
            "the corrupt download was deleted, rerun to fetch it again")
    return path


def _as_list(gold) -> list:
    """A gold answer or a list of them as a list; anything else as it is, for the row check to
    name."""
    gold = gold.tolist() if hasattr(gold, "tolist") else gold  # pandas' list columns: numpy arrays
    if isinstance(gold, str):
        return [gold]
    return list(gold) if isinstance(gold, (list, tuple)) else gold


def _drop_empty_gold(rows: list, src: str) -> tuple:
    """(rows without gold answers that normalise to nothing, ids of the rows left with no answer at
    all). # DEVIATION D10: Search-R1 keeps gold answers such as "" or "A" (SQuAD normalisation drops
    articles), so an empty <answer></answer> scores 1.0 on them; eval.load_qa refuses them, so
    conversion removes them here."""
    from protocol import normalize_answer
    kept, dropped, trimmed = [], [], 0
    for r in rows:
        gold = [g for g in r["golden_answers"] if normalize_answer(g)]
        trimmed += len(gold) < len(r["golden_answers"])
        if gold:
            kept.append({**r, "golden_answers": gold})
        else:
            dropped.append(r["id"])
    if trimmed:
        print(f"{src}: removed gold answers that normalise to nothing from {trimmed} row(s); "
              f"dropped the {len(dropped)} left without an answer: {dropped[:10]}", flush=True)
    return kept, dropped


def _write_qa(rows: list, dest: str, src: str) -> int:
    """Write QA rows atomically, once eval.load_qa (what training reads) accepts the file (ids
    unique too). The ids of rows dropped for want of a usable gold answer go to dest.dropped.json,
    written before dest (a rerun skips dest) and counted by the row check."""
    import eval as qa_eval
    rows, dropped = _drop_empty_gold(rows, src)
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    try:  # nothing half-written stays: the partial file goes on any error
        write_jsonl(dest + ".partial", rows)
        try:
            qa_eval.load_qa(dest + ".partial")
        except ValueError as e:
            raise ValueError(f"{src}: converted rows are not valid QA rows: {e}") from None
        if dropped:
            with open(dest + ".dropped.json", "w") as f:
                json.dump(dropped, f)
        elif os.path.exists(dest + ".dropped.json"):  # an older conversion's
            os.remove(dest + ".dropped.json")
        os.replace(dest + ".partial", dest)
    finally:
        if os.path.exists(dest + ".partial"):
            os.remove(dest + ".partial")
    return len(rows)


def _dropped(dest: str) -> list:
    if not os.path.exists(dest + ".dropped.json"):
        return []
    with open(dest + ".dropped.json") as f:
        return json.load(f)


# --- any QA file in: Search-R1 / verl parquet, FlashRAG jsonl (python -m worlds.data convert) ---

def question_from_prompt(prompt) -> str:
    """The question in a Search-R1 / verl `prompt` (a chat list of {role, content}): the first user
    message's text after "Question: ", the line that ends Search-R1's instruction
    (protocol.user_message, Search-R1's make_prefix); after the last one where the message does not
    start with that instruction (a few-shot template ends with the real question)."""
    from protocol import INSTRUCTION
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    user = next((m.get("content") for m in messages
                 if isinstance(m, dict) and m.get("role") == "user"), None)
    if not isinstance(user, str):
        raise ValueError("field 'prompt' has no user message with text content; expected "
                         "Search-R1's chat list [{'role': 'user', 'content': ...}]")
    if user.startswith(INSTRUCTION + "Question: "):
        question = user[len(INSTRUCTION + "Question: "):]
    else:
        question = user.rpartition("Question:")[2] if "Question:" in user else ""
    if not question.strip():
        raise ValueError("the user message of field 'prompt' has no 'Question: ...' (Search-R1's "
                         "instruction, then the question); give the row a 'question' field")
    return question.strip()


def _field(row: dict, *path):
    """row[path[0]][path[1]]..., None where a level is missing."""
    for key in path:
        row = row.get(key) if isinstance(row, dict) else None
    return row


def qa_row(raw: dict, number: int, source: str) -> dict:
    """One source row -> a QA row: a Search-R1 / verl row (prompt, reward_model.ground_truth.target
    or a ground_truth that is the answer itself, data_source, extra_info.index) or a FlashRAG row
    (id, question, golden_answers). A `question`,
    `golden_answers`, `id` or `data_source` field wins over what is derived; `source` stands in for
    a missing data_source, the row's number (0-based) for an id where extra_info has no index.
    DEVIATION D4: FlashRAG numbers every dataset from train_0, and rollout keys prompts by id, so
    the id gets its data source as prefix."""
    if not isinstance(raw, dict):
        raise ValueError(f"expected a JSON object, got {type(raw).__name__}")
    question = raw.get("question")
    if question is None and raw.get("prompt") is not None:
        question = question_from_prompt(raw["prompt"])
    gold, truth = raw.get("golden_answers"), _field(raw, "reward_model", "ground_truth")
    if gold is None:  # Search-R1's {"target": [...]}; other verl sets give the answer itself
        gold = truth.get("target") if isinstance(truth, dict) else truth
    rid = next((r for r in (raw.get("id"), _field(raw, "extra_info", "index"), number)
                if r is not None))
    source = str(raw.get("data_source") if raw.get("data_source") is not None else source)
    for name, value, where in (("question", question, "'question' or 'prompt'"),
                               ("gold answers", gold, "'golden_answers' or "
                                "'reward_model.ground_truth.target'")):
        if value is None:
            raise ValueError(f"no {name}: the row needs {where}; fields: {sorted(raw)}")
    return {"id": f"{source}_{rid}", "question": question, "golden_answers": _as_list(gold),
            "data_source": source}


def _checked(row: dict) -> dict:
    """eval's row check (eval._check_row). Gold answers that normalise to nothing are not an error
    here: _write_qa removes them, and drops a row left without one (DEVIATION D10)."""
    import eval as qa_eval
    from protocol import normalize_answer
    gold = probe = row["golden_answers"]
    if isinstance(gold, list) and gold and all(isinstance(g, str) for g in gold):
        # a row with none left is dropped later; its other fields are checked all the same
        probe = [g for g in gold if normalize_answer(g)] or ["x"]
    return {**qa_eval._check_row({**row, "golden_answers": probe}), "golden_answers": gold}


def read_records(src: str):
    """Yield (where, row) of a .parquet (`file: row N`, 0-based, as eval.qa_where) or a jsonl file
    (`file:line`, eval.read_jsonl)."""
    from eval import read_jsonl
    if not os.path.exists(src):
        raise FileNotFoundError(f"no such file: {src}")
    if not src.endswith(".parquet"):
        yield from ((f"{src}:{lineno}", row) for lineno, row in read_jsonl(src))
        return
    import pyarrow.parquet as pq
    try:
        rows = pq.read_table(src).to_pylist()  # nested columns as dicts and lists
    except Exception as e:
        raise ValueError(f"{src}: not a readable parquet file ({type(e).__name__}: {e})") from None
    yield from ((f"{src}: row {i}", row) for i, row in enumerate(rows))


def read_qa(src: str, source: str = "") -> list:
    """Every row of a QA source file as a checked QA row (qa_row, _checked); a bad or repeated row
    raises ValueError naming the file and its line (jsonl) or row (parquet)."""
    rows, first = [], {}
    source = source or default_source(src)
    for number, (where, raw) in enumerate(read_records(src)):
        try:
            row = _checked(qa_row(raw, number, source))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if row["id"] in first:
            raise ValueError(f"{where}: duplicate id {row['id']!r}, first at {first[row['id']]}; "
                             "ids key each question's sampling noise and must be unique")
        first[row["id"]] = where
        rows.append(row)
    if not rows:
        raise ValueError(f"{src}: no QA rows")
    return rows


def default_source(path: str) -> str:
    """A file's data_source when its rows have none: the file's name, or its folder's where the name
    is a split (FlashRAG's {dataset}/{split}.jsonl)."""
    stem = os.path.basename(path).split(".")[0]
    folder = os.path.basename(os.path.dirname(os.path.abspath(path)))
    return folder if stem in ("train", "dev", "test", "val", "validation") and folder else stem


def convert_qa(src: str, dest: str, source: str = "") -> int:
    """A QA source file (read_qa) -> the project's QA jsonl at dest, written atomically (_write_qa);
    returns its rows."""
    if os.path.abspath(src) == os.path.abspath(dest):
        raise ValueError(f"--out {dest} is the input file; write elsewhere")
    return _write_qa(read_qa(src, source), dest, src)


def write_val(test_files: dict, dest: str, per_source: int, seed: int = 0) -> int:
    """A fixed random sample of `per_source` questions of each test set (in file order), for
    periodic evaluation. # DEVIATION D1: Search-R1 validates on all 51,713 test questions every
    test_freq steps; with HF generate that would cost hours per evaluation, so training curves use
    this sample and only the final policy is scored on everything."""
    import eval as qa_eval
    rows = []
    for k, (name, path) in enumerate(sorted(test_files.items())):
        qa = qa_eval.load_qa(path)
        keep = np.sort(np.random.default_rng([seed, k]).permutation(len(qa))[:per_source])
        rows += [qa[i] for i in keep]
    return _write_qa(rows, dest, "val sample of " + ", ".join(sorted(test_files)))


def gunzip_corpus(src: str, dest: str):
    """Decompress the corpus to dest through dest.partial (progress in compressed bytes)."""
    import gzip
    from tqdm import tqdm
    with open(src, "rb") as raw, gzip.GzipFile(fileobj=raw) as fin, \
            open(dest + ".partial", "wb") as fout, \
            tqdm(total=os.path.getsize(src), unit="B", unit_scale=True,
                 desc=f"gunzip {src}") as bar:
        for block in iter(lambda: fin.read(1 << 24), b""):
            fout.write(block)
            bar.update(raw.tell() - bar.n)
    os.replace(dest + ".partial", dest)


def join_parts(parts: list, sizes: dict, dest: str, delete: bool = True):
    """`cat parts > dest`, resumable, peak disk = the index + one part. Each part is deleted once
    appended (delete), so after an interruption dest.partial holds exactly the parts that are gone:
    it is cut back to their total size (`sizes`, from the hub) and the remaining parts are appended
    again."""
    from tqdm import tqdm
    partial = dest + ".partial"
    gone = [p for p in parts if not os.path.exists(p)]
    if gone and (not os.path.exists(partial) or gone != parts[:len(gone)]):
        raise FileNotFoundError(
            f"cannot join {dest}: part(s) {gone} are missing and were not appended to {partial}; "
            f"delete {partial} (if any) and rerun to download them again")
    offset = sum(sizes[p] for p in gone)
    if gone and os.path.getsize(partial) < offset:
        raise IOError(
            f"{partial} is shorter than the parts already appended to it; delete it and rerun")
    with open(partial, "ab") as f, tqdm(total=sum(sizes.values()), initial=offset, unit="B",
                                        unit_scale=True, desc=f"join {dest}") as bar:
        f.truncate(offset)
        for p in parts[len(gone):]:
            with open(p, "rb") as src:
                for block in iter(lambda: src.read(1 << 24), b""):
                    f.write(block)
                    bar.update(len(block))
            f.flush()
            os.fsync(f.fileno())
            if delete:
                os.remove(p)
    check_flat_index(partial)
    os.replace(partial, dest)


def check_flat_index(path: str):
    """The joined file must be a FAISS IndexFlatIP whose header's ntotal x dim float32 vectors fill
    the file."""
    from retrieval.index import read_flat_index
    try:
        index = read_flat_index(path, mmap=True)
    except RuntimeError as e:
        raise ValueError(
            f"{path}: not a readable FAISS index ({str(e).splitlines()[0]}); a part is missing or "
            "corrupt: delete it and rerun") from None
    need, size = index.ntotal * index.d * 4, os.path.getsize(path)
    if not need <= size <= need + 4096:  # + the header
        raise ValueError(
            f"{path}: {size} bytes, but its header says {index.ntotal} vectors of dim {index.d} "
            f"({need} bytes of vectors): a part is missing or corrupt; delete it and rerun")


def check_disk(out: str, need: dict, disk_free=None):
    """Fail before downloading when the folder's disk cannot take `need` ({what: bytes}) plus a 1
    GiB margin."""
    free = (disk_free or (lambda p: shutil.disk_usage(p).free))(out)
    total = sum(need.values()) + GiB
    if free < total:
        parts = ", ".join(f"{k} {v / GiB:.1f}" for k, v in need.items() if v)
        raise OSError(
            f"not enough free disk space in {os.path.abspath(out)}: about {total / GiB:.1f} GiB "
            f"needed ({parts}, +1 GiB margin), {free / GiB:.1f} GiB free. Free some space or "
            "choose another --out")


def searchr1_sources(out: str, index: str) -> list:
    """Every file to download: {name, repo, file, path (under out/raw)}; the index parts only for a
    prebuilt index."""
    src = [("train", *SR1_TRAIN)] + [(n, FLASHRAG, f"{n}/{split}.jsonl")
                                     for n, split in SR1_TESTS.items()]
    src += [("corpus", *SR1_CORPUS)]
    src += [("index", SR1_INDEX[0], part) for part in SR1_INDEX[1]] if index == "prebuilt" else []
    return [{
        "name": n, "repo": r, "file": f, "path": os.path.join(out, "raw", r.replace("/", "__"), f)
    } for n, r, f in src]


def count_lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(block.count(b"\n") for block in iter(lambda: f.read(1 << 24), b""))


def prepare_searchr1(out: str, index: str = "prebuilt", encoder: str = "e5", revision: str = "main",
                     fetch=None, info=None, expected_rows=SR1_ROWS, keep_downloads: bool = False,
                     disk_free=None, val_per_source: int = VAL_PER_SOURCE,
                     retries: int = 3) -> dict:
    """Download, check and convert Search-R1's data into `out` (layout at the top of this section);
    resumable.

    index: "prebuilt" (Search-R1's E5 flat index, joined from its parts), "build" (encode the corpus
    here with `encoder`, retriever.build_index) or "none". fetch(repo, file, local_dir, revision) ->
    path and info(repo, files, revision) -> (commit, {file: {size, sha256, git_sha1}}) default to
    the hub (hub_fetch, hub_info); tests pass stand-ins. expected_rows: {output: rows} to check
    (None: no check); retries: automatic retries of a failed download. Returns the manifest."""
    import retriever
    from retrieval.index import META_FILE, describe_prebuilt
    if index not in ("prebuilt", "build", "none"):
        raise ValueError(f"index must be prebuilt, build or none, got {index!r}")
    fetch, info = fetch or hub_fetch, info or hub_info
    manifest_path = os.path.join(out, "manifest.json")
    if os.path.exists(manifest_path):
        print(
            f"{manifest_path} exists: nothing to do (delete it to check and redo the missing steps)"
        )
        with open(manifest_path) as f:
            return json.load(f)
    os.makedirs(out, exist_ok=True)
    corpus, index_file, index_dir = (os.path.join(out, x)
                                     for x in ("wiki-18.jsonl", "e5_Flat.index", "index"))
    made = {"train": os.path.join(out, "train.jsonl"), "corpus": corpus, "index": index_file,
            **{n: os.path.join(out, "test", f"{n}.jsonl") for n in SR1_TESTS}}
    sources = searchr1_sources(out, index)
    commits, meta = {}, {}
    for repo in dict.fromkeys(s["repo"] for s in sources):
        commits[repo], files = info(repo, [s["file"]
                                           for s in sources if s["repo"] == repo], revision)
        meta.update({(repo, f): m for f, m in files.items()})
    for s in sources:
        s.update(commit=commits[s["repo"]], **meta[(s["repo"], s["file"])])

    # 1. downloads: skipped when the file, or what was made of it, exists (parts being joined count
    # as made)
    joining = os.path.exists(index_file + ".partial")
    todo = [s for s in sources if not (os.path.exists(s["path"]) or os.path.exists(made[s["name"]])
                                       or (s["name"] == "index" and joining))]
    by = {s["name"]: s for s in sources if s["name"] != "index"}
    gz, parts = by["corpus"], [s for s in sources if s["name"] == "index"]
    need = {"downloads": sum(s["size"] for s in todo),
            "wiki-18.jsonl": 0 if os.path.exists(corpus) else int(CORPUS_GZ_RATIO * gz["size"]),
            # the part being appended + its copy
            "index join": 0 if not parts or os.path.exists(index_file) else
            (sum if keep_downloads else max)(p["size"] for p in parts)}
    check_disk(out, need, disk_free)
    for k, s in enumerate(todo, 1):
        print(f"[{k}/{len(todo)}] {s['repo']}/{s['file']} ({s['size'] / GiB:.2f} GiB)", flush=True)
        fetch_verified(fetch, s, retries)

    # 2. conversions, each written under a temporary name and renamed: an existing output is a
    # finished one
    if not os.path.exists(made["train"]):
        convert_qa(by["train"]["path"], made["train"])
    for name in SR1_TESTS:
        if not os.path.exists(made[name]):
            convert_qa(by[name]["path"], made[name], name)
    val = os.path.join(out, "val.jsonl")
    if not os.path.exists(val):
        write_val({n: made[n] for n in SR1_TESTS}, val, val_per_source)
    if not os.path.exists(corpus):
        gunzip_corpus(gz["path"], corpus)
        if not keep_downloads:
            os.remove(gz["path"])
    has_index = os.path.exists(os.path.join(index_dir, META_FILE))
    if index == "prebuilt" and not os.path.exists(index_file):
        join_parts([p["path"] for p in parts], {p["path"]: p["size"]
                                                for p in parts}, index_file, not keep_downloads)
    if index == "prebuilt" and not has_index:
        describe_prebuilt(index_file, corpus, encoder, out_dir=index_dir)
    # float32 vectors in RAM and on disk; 768 = E5-base's width
    if index == "build" and not has_index:
        check_disk(out, {"index build (768-dim vectors)": count_lines(corpus) * 768 * 4}, disk_free)
        retriever.build_index(corpus, encoder, index_dir)

    # 3. row counts against Search-R1's, then the manifest (last: its existence means "done")
    rows = {name: count_lines(path) for name, path in made.items() if name != "index"}
    rows["val"] = count_lines(val)
    dropped = {name: ids for name in ["train", *SR1_TESTS] if (ids := _dropped(made[name]))}  # D10
    bad = {k: f"{rows.get(k)} != {v}" for k, v in (expected_rows or {}).items()
           if rows.get(k) is None or rows[k] + len(dropped.get(k, [])) != v}
    if bad:
        raise ValueError(
            f"row counts differ from Search-R1's data: {bad}; a changed hub revision? Pass "
            "--skip_row_check to accept them")
    manifest = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "revision": revision, "index": index,
        "encoder": encoder, "rows": rows, "dropped_ids": dropped, "sources": [{
            k: s[k] for k in ("name", "repo", "file", "commit", "size", "sha256", "git_sha1")
        } for s in sources], "outputs": {
            "train": "train.jsonl", "test": {n: f"test/{n}.jsonl" for n in SR1_TESTS},
            "val": "val.jsonl", "corpus": "wiki-18.jsonl", "index_file": "e5_Flat.index"
            if index == "prebuilt" else None, "index_dir": "index" if index != "none" else None
        }
    }
    with open(manifest_path + ".partial", "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(manifest_path + ".partial", manifest_path)
    return manifest


# --- a world from the user's own corpus and questions (python -m worlds.data world) ---

def split_questions(rows: list, test_fraction: float, seed: int = 0) -> tuple:
    """(train, test): a seeded random test_fraction of the rows (at least one) held out; both keep
    file order."""
    n_test = max(1, round(test_fraction * len(rows)))
    if not 0 < test_fraction < 1 or n_test >= len(rows):
        raise ValueError(f"cannot hold out {test_fraction} of {len(rows)} question(s) and train on "
                         "the rest: give more questions, another --test_fraction, or a test file")
    held = set(np.random.default_rng(seed).permutation(len(rows))[:n_test].tolist())
    return ([r for i, r in enumerate(rows) if i not in held],
            [r for i, r in enumerate(rows) if i in held])


def _point_index_at(index_dir: str, corpus: str):
    """Record the corpus's final path in the index's meta.json (it was built in the temporary
    folder; its relative path, which wins, is the same in both)."""
    from retrieval.index import META_FILE
    path = os.path.join(index_dir, META_FILE)
    with open(path, encoding="utf-8") as f:
        meta = json.load(f)
    with open(path + ".partial", "w", encoding="utf-8") as f:
        json.dump({**meta, "corpus": corpus}, f, indent=2)
    os.replace(path + ".partial", path)


def build_world(corpus: str, questions: list, out: str, encoder: str = "minilm",
                test_fraction: float = 0.1, seed: int = 0, source: str = "") -> dict:
    """A world folder from the user's files, which train_twice.py takes with `--world=out
    --model=...` (it has no policy): corpus.jsonl (a copy; Search-R1's rows {"id", "contents"}, the
    contents a quoted title line, then the text), train.jsonl and test.jsonl (questions = [train,
    test] files, or one file split by split_questions; any format convert reads), index/
    (retriever.build_index) and manifest.json (what went in). Every input row is checked before
    anything is written; the folder is built in a temporary sibling and renamed into place at the
    end, and an error removes it."""
    import tempfile
    import retriever
    from retrieval.index import iter_corpus
    if len(questions) not in (1, 2):
        raise ValueError("--questions takes one file (split into train and test) or two: "
                         "TRAIN,TEST")
    out = os.path.abspath(out)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise FileExistsError(f"{out} exists and is not empty: remove it or choose another --out")
    n_docs = sum(1 for _ in iter_corpus(corpus))  # checks every row, naming file:line
    if not n_docs:
        raise ValueError(f"{corpus}: no corpus rows")
    qa = [read_qa(path, source) for path in questions]
    parts = dict(zip(("train", "test"), qa if len(qa) == 2 else
                     split_questions(qa[0], test_fraction, seed)))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=os.path.dirname(out))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; a world is shared like any data folder
    try:
        shutil.copyfile(corpus, os.path.join(tmp, "corpus.jsonl"))
        rows = {name: _write_qa(part, os.path.join(tmp, f"{name}.jsonl"),
                                questions[-1] if name == "test" else questions[0])
                for name, part in parts.items()}
        index = os.path.join(tmp, "index")
        retriever.build_index(os.path.join(tmp, "corpus.jsonl"), encoder, index)
        _point_index_at(index, os.path.join(out, "corpus.jsonl"))
        manifest = {"created": time.strftime("%Y-%m-%dT%H:%M:%S"), "encoder": encoder,
                    "corpus": os.path.abspath(corpus),
                    "questions": [os.path.abspath(q) for q in questions],
                    "test_fraction": test_fraction if len(questions) == 1 else None, "seed": seed,
                    "rows": {"corpus": n_docs, **rows}}
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1)
        os.rename(tmp, out)  # replaces an empty folder
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sr = sub.add_parser(
        "searchr1", help="download and convert Search-R1's QA sets, wiki-18 and its E5 index "
        "(DESIGN.md section 10); resumable")
    sr.add_argument("--out", default="data/searchr1", help="output folder (a rerun resumes it)")
    sr.add_argument(
        "--index", choices=("prebuilt", "build", "none"), default="prebuilt",
        help="prebuilt: Search-R1's E5 flat index (~65 GB download); build: encode wiki-18 here "
        "(retriever.py build, one GPU, hours); none: corpus and QA only")
    sr.add_argument("--encoder", default="e5",
                    help="encoder of the index (e5 = intfloat/e5-base-v2)")
    sr.add_argument("--revision", default="main",
                    help="hub revision of every source repo (recorded as a commit)")
    sr.add_argument("--keep_downloads", action="store_true",
                    help="keep wiki-18.jsonl.gz and the index parts")
    sr.add_argument("--skip_row_check", action="store_true",
                    help="accept row counts that differ from Search-R1's")
    sr.add_argument("--val_per_source", type=int, default=VAL_PER_SOURCE,
                    help="questions per test set in val.jsonl")
    cv = sub.add_parser("convert", help="a Search-R1 / verl parquet or FlashRAG jsonl -> QA jsonl")
    wd = sub.add_parser("world", help="a world folder from your corpus and questions, no hub")
    for p in (cv, wd):
        p.add_argument("--data_source", default="",
                       help="data_source of rows without one (default: the file's name, or its "
                       "folder's for FlashRAG's {dataset}/{split}.jsonl)")
    cv.add_argument("--input", required=True, help=".parquet (Search-R1 / verl) or .jsonl")
    cv.add_argument("--out", required=True, help="the QA jsonl to write")
    wd.add_argument("--corpus", required=True, help='Search-R1\'s jsonl: {"id", "contents"}, '
                    "the contents a quoted title line, then the text")
    wd.add_argument("--questions", required=True, help="QA.jsonl (split) or TRAIN,TEST; any "
                    "format convert reads")
    wd.add_argument("--encoder", default="minilm", help="minilm (a PyPI package, no hub), bm25 "
                    "(no model), or any retriever.py build takes")
    wd.add_argument("--out", required=True, help="the world folder (must not exist, or be empty)")
    wd.add_argument("--test_fraction", type=float, default=0.1,
                    help="questions held out as test.jsonl when one file is given")
    wd.add_argument("--seed", type=int, default=0, help="seed of that split")
    args = parser.parse_args(argv)
    try:
        if args.command == "convert":
            n = convert_qa(args.input, args.out, args.data_source)
            print(f"{args.out}: {n} QA rows from {args.input}")
        elif args.command == "world":
            manifest = build_world(args.corpus, args.questions.split(","), args.out, args.encoder,
                                   args.test_fraction, args.seed, args.data_source)
            print(f"{args.out}: {manifest['rows']}; train with: python train_twice.py "
                  f"--world={args.out} --model=MODEL")
    except (ValueError, OSError) as e:
        print(f"python -m worlds.data {args.command}: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    if args.command == "searchr1":
        manifest = prepare_searchr1(args.out, args.index, args.encoder, args.revision,
                                    expected_rows=None if args.skip_row_check else SR1_ROWS,
                                    keep_downloads=args.keep_downloads,
                                    val_per_source=args.val_per_source)
        print(
            json.dumps({"out": args.out, "rows": manifest["rows"], "outputs": manifest["outputs"]},
                       indent=1))


if __name__ == "__main__":
    main()
