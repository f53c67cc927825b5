"""Preparation of the real datasets (DESIGN.md section 10); the built-in worlds are
worlds/build.py's.

Real datasets (`searchr1`, DESIGN.md section 10; `make reproduce-3b` runs it): Search-R1's NQ +
HotpotQA training set, the seven FlashRAG test sets, wiki-18 and its prebuilt E5 flat index from the
Hugging Face hub (downloaded by huggingface_hub.hf_hub_download at a pinned commit, then checked
against the hub's checksums), converted to the QA schema of worlds/build.py (`id`, `question`,
`golden_answers`, `data_source`); see the comment above SR1_TRAIN. A rerun skips every finished step
and file; a transfer that breaks is continued from where it stopped inside hf_hub_download, but a
file whose download was abandoned (process killed, every retry failed) starts over. DEVIATION D1:
training-time evaluation uses val.jsonl (100 questions per test set); final policies are scored on
every question by eval.py.

Launch:
  python -m worlds.data searchr1 --out data/searchr1                         # ~80 GB download (corpus + index)
"""
import argparse
import json
import os
import shutil
import time

import numpy as np

from eval import write_jsonl

# `python -m worlds.data searchr1 --out data/searchr1` writes, resumably (a rerun skips every
# finished file): train.jsonl            Search-R1's merged NQ + HotpotQA training split, in our QA
# schema test/{name}.jsonl      the seven test sets (FlashRAG's test split, else dev, as Search-R1's
# test merge) val.jsonl              VAL_PER_SOURCE questions of each test set: the periodic
# evaluation during training wiki-18.jsonl          the corpus; e5_Flat.index the prebuilt E5 flat
# index (joined from its parts); index/                 retriever.py's folder for it
# (describe_prebuilt), or one encoded here (--index build) manifest.json          sources (repo,
# commit, checksum), outputs and row counts; written last = "done" raw/{repo}/            the
# downloads (hf_hub_download's local_dir; its records in .cache/huggingface); the big ones (corpus
# .gz, index parts) are deleted once converted Sources, checked against Search-R1 (github
# PeterGriffinJin/Search-R1: scripts/download.py, the README's cat part_*,
# scripts/nq_hotpotqa/README.md, scripts/data_process/qa_search_{train,test}_merge.py) and
# FlashRAG's dataset card.
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
                raise IOError(
                    f"{where}: download interrupted ({type(e).__name__}: {e}); finished files are kept, "
                    "rerun to continue") from e
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
    # parquet list columns arrive as numpy arrays
    gold = gold.tolist() if hasattr(gold, "tolist") else gold
    return [gold] if isinstance(gold, str) else list(gold)


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
        print(
            f"{src}: removed gold answers that normalise to nothing from {trimmed} row(s); dropped the "
            f"{len(dropped)} left without an answer: {dropped[:10]}", flush=True)
    return kept, dropped


def _write_qa(rows: list, dest: str, src: str) -> int:
    """Write QA rows atomically, once ids are unique and eval.load_qa (what training reads) accepts
    the file. The ids of rows dropped for want of a usable gold answer go to dest.dropped.json,
    written before dest (a rerun skips dest) and counted by the row check."""
    import eval as qa_eval
    seen = set()
    for i, r in enumerate(rows):
        if r["id"] in seen:
            raise ValueError(f"{src}: row {i}: duplicate id {r['id']!r}")
        seen.add(r["id"])
    rows, dropped = _drop_empty_gold(rows, src)
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    write_jsonl(dest + ".partial", rows)
    try:
        qa_eval.load_qa(dest + ".partial")
    except ValueError as e:
        raise ValueError(f"{src}: converted rows are not valid QA rows: {e}") from None
    if dropped:
        with open(dest + ".dropped.json", "w") as f:
            json.dump(dropped, f)
    os.replace(dest + ".partial", dest)
    return len(rows)


def _dropped(dest: str) -> list:
    if not os.path.exists(dest + ".dropped.json"):
        return []
    with open(dest + ".dropped.json") as f:
        return json.load(f)


def convert_train(src: str, dest: str) -> int:
    """Search-R1's merged train.parquet -> QA jsonl. FlashRAG numbers each dataset's rows from
    train_0, so NQ and HotpotQA ids collide and the id gets its data source as prefix (the rollout
    keys prompts by id)."""
    import pandas as pd
    df = pd.read_parquet(src)
    missing = [c for c in ("question", "data_source") if c not in df.columns]
    if missing or not {"golden_answers", "reward_model"} & set(df.columns):
        raise ValueError(
            f"{src}: missing column(s) {missing or ['golden_answers']}; columns: {list(df.columns)}"
        )
    rows = []
    for i, r in enumerate(df.to_dict("records")):
        gold = r.get("golden_answers")
        gold = r["reward_model"]["ground_truth"]["target"] if gold is None else gold
        rid = r.get("id") if r.get("id") is not None else r["extra_info"]["index"]
        rows.append({
            "id": f"{r['data_source']}_{rid}", "question": r["question"],
            "golden_answers": _as_list(gold), "data_source": str(r["data_source"])
        })
    return _write_qa(rows, dest, src)


def convert_flashrag(src: str, name: str, dest: str) -> int:
    """A FlashRAG {split}.jsonl (id, question, golden_answers, metadata) -> QA jsonl with
    data_source = name."""
    from eval import read_jsonl
    rows = []
    for lineno, r in read_jsonl(src):
        missing = [k for k in ("id", "question", "golden_answers") if k not in r]
        if missing:
            raise ValueError(f"{src}:{lineno}: missing field(s) {missing}")
        # DEVIATION D4: FlashRAG numbers every dataset from train_0, and rollout keys prompts by id:
        # prefix the source
        rows.append({"id": f"{name}_{r['id']}", "question": r["question"],
                     "golden_answers": _as_list(r["golden_answers"]), "data_source": name})
    return _write_qa(rows, dest, src)


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
    with open(src, "rb") as raw, gzip.GzipFile(fileobj=raw) as fin, open(dest + ".partial", "wb") as fout, \
            tqdm(total=os.path.getsize(src), unit="B", unit_scale=True, desc=f"gunzip {src}") as bar:
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
            f"not enough free disk space in {os.path.abspath(out)}: about {total / GiB:.1f} GiB needed "
            f"({parts}, +1 GiB margin), {free / GiB:.1f} GiB free. Free some space or choose another --out"
        )


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
    path and
    info(repo, files, revision) -> (commit, {file: {size, sha256, git_sha1}}) default to the hub (hub_fetch,
    hub_info); tests pass stand-ins. expected_rows: {output: rows} to check (None: no check);
    retries: automatic retries of a failed download. Returns the manifest."""
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
        convert_train(by["train"]["path"], made["train"])
    for name in SR1_TESTS:
        if not os.path.exists(made[name]):
            convert_flashrag(by[name]["path"], name, made[name])
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
    args = parser.parse_args(argv)
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
