"""Evaluation of a search agent on QA sets: QA loading and validation, greedy episodes, EM per data
source.

The episodes are scored by protocol.py's reward (`extract_answer` + `exact_match` after SQuAD
normalisation, DESIGN.md section 3), the same function that scores training episodes, so the two
cannot drift apart. The reward reads the agent's own sampled text only (DEVIATION R5); Search-R1's
`qa_em.compute_score_em` reads prompt + response and skips the prompt's `<answer> Beijing </answer>`
example by requiring two matches.

Launch:
  python eval.py --model runs/demo/twice/step_000030/policy --data data/tinyworld/test.jsonl \
      --index data/tinyworld/index
  python eval.py --help                                  # every option with its default
The paper's table from result files is lab/report.py's (`python -m lab.report paper GRPO=DIR
TWICE=DIR --paper 3b`).
"""
import json
import os
import re
import string
import sys
from dataclasses import dataclass

from infra import config
import protocol
import rollout
from protocol import normalize_answer

QA_FIELDS = ("id", "question", "golden_answers", "data_source")


# A character that normalize_answer keeps whatever surrounds it (not punctuation, whitespace or a
# letter of a/an/the): it settles most answers without normalize_answer, which is ~20 us an answer
# (0.7 s for 20k rows of two answers)
_SURELY_NONEMPTY = re.compile(r"[^\santhe" + re.escape(string.punctuation) + "]")


def _lone_surrogate(text: str):
    """Position of a lone UTF-16 surrogate in text, else None. The JSON escape "\ud800" without its
    low half survives json.loads but not UTF-8 encoding, which the tokenizer does at the step that
    samples the row."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _refuse_lone_surrogates(row: dict):
    texts = [(field, t) for field, v in row.items() for t in (v if isinstance(v, list) else [v])]
    # one encode per row; locate only when there is one
    if _lone_surrogate("".join(t for _, t in texts)) is None:
        return
    field, text = next((field, t) for field, t in texts if _lone_surrogate(t) is not None)
    at = _lone_surrogate(text)
    raise ValueError(
        f"field {field!r} has a lone surrogate \\u{ord(text[at]):04x} at character {at} "
        f"({text[max(0, at - 20):at]!r}...): an invalid JSON \\u escape, which cannot be encoded as "
        "UTF-8 and would crash training when the row is sampled; fix the text")


def _check_row(row) -> dict:
    """A QA row -> {id, question, golden_answers, data_source}, or ValueError saying what is wrong
    and how to fix it (the caller prefixes file:line)."""
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    # `datasets` fills a key that a row lacks with None
    missing = [k for k in QA_FIELDS if row.get(k) is None]
    if missing:
        raise ValueError(f"missing field(s) {missing}; a QA row needs {list(QA_FIELDS)}; "
                         "convert Search-R1 or FlashRAG files: python -m worlds.data convert")
    gold = row["golden_answers"]
    if hasattr(gold, "tolist"):  # parquet list columns may arrive as numpy arrays
        gold = gold.tolist()
    if isinstance(gold, str):
        gold = [gold]
    if not isinstance(gold, list) or not gold or not all(isinstance(g, str) for g in gold):
        raise ValueError(
            f"field 'golden_answers' must be a non-empty list of strings, got {gold!r}")
    if not isinstance(row["question"], str) or not row["question"].strip():
        raise ValueError("field 'question' must be a non-empty string")
    out = {"id": str(row["id"]), "question": row["question"], "golden_answers": gold,
           "data_source": str(row["data_source"])}
    _refuse_lone_surrogates(out)
    # DEVIATION E10: Search-R1 keeps such answers; an empty <answer></answer> would then score 1.0
    # (exact_match)
    empty = [g for g in gold if not _SURELY_NONEMPTY.search(g.lower()) and not normalize_answer(g)]
    if empty:
        raise ValueError(
            f"golden answer(s) {empty} normalise to an empty string (lowercase, no punctuation, no "
            "a/an/the), so an empty answer would score 1.0: remove them from 'golden_answers' (or drop "
            "the row if no answer is left)")
    return out


def read_jsonl(path: str):
    """Yield (line number, parsed object) of a jsonl file, skipping blank lines; a malformed line or
    one that is not UTF-8 names file:line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}:{lineno}: not UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of "
                    "the line); re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
                ) from None
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: malformed JSON ({e.msg})") from None


def write_jsonl(path: str, rows):
    """One JSON object per line, UTF-8, non-ASCII kept as is (every QA and corpus file of the
    project)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def _datasets_records(path: str, kind: str) -> list:
    """The records of a "json" (jsonl) or "parquet" file, read by `datasets` (Arrow) into memory.
    Its cache goes to a temporary folder that is deleted at once, so loading leaves nothing in
    ~/.cache."""
    import tempfile
    import datasets
    datasets.disable_progress_bars()  # a bar per small file would drown the training log
    verbosity = datasets.logging.get_verbosity()
    # its parse errors are reported by load_qa, with line
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        with tempfile.TemporaryDirectory(prefix="qa-cache-") as cache:
            ds = datasets.load_dataset(kind, data_files=path, split="train", cache_dir=cache,
                                       keep_in_memory=True)
    finally:
        datasets.logging.set_verbosity(verbosity)
    return ds.to_list()


def _nonblank_lineno(path: str, index: int) -> int:
    """1-based line number of the index-th (0-based) non-blank line: the line of `datasets`' row
    `index`."""
    with open(path, "rb") as f:
        rows = (lineno for lineno, raw in enumerate(f, 1) if raw.strip())
        return next(lineno for i, lineno in enumerate(rows) if i == index)


def qa_where(path: str, index: int) -> str:
    """Where row `index` (0-based) of a QA file sits: `file:line` (jsonl: one row per non-blank
    line) or `file: row N` (parquet)."""
    return f"{path}: row {index}" if path.endswith(
        ".parquet") else f"{path}:{_nonblank_lineno(path, index)}"


def _refuse_duplicate_ids(path: str, rows: list):
    """Every row's sampling keys derive from its id (sampler.stable_id), so two questions sharing an
    id would share their noise: any repeated id is refused, naming both rows (identical rows too: a
    row twice is a data error)."""
    first = {}
    for i, row in enumerate(rows):
        j = first.setdefault(row["id"], i)
        if j != i:
            raise ValueError(
                f"{qa_where(path, i)}: duplicate id {row['id']!r}, first at {qa_where(path, j)}; ids "
                "key each question's sampling noise and must be unique within a file")


def load_qa(path: str) -> list:
    """Load QA rows (`id`, `question`, `golden_answers`, `data_source`) from a .jsonl or .parquet
    file, through `datasets`, each row checked by _check_row, ids unique (as strings: 7 and "7" are
    one id).

    A bad row raises ValueError naming the file and the line (jsonl, 1-based) or row (parquet,
    0-based). Arrow's JSON errors name neither a line nor a byte (nor does it accept what Python's
    json does: a lone surrogate escape), so when `datasets` fails on a jsonl file, the file is read
    again line by line to name the bad line.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"QA file not found: {path}")
    kind = "parquet" if path.endswith(".parquet") else "json"
    try:
        records = _datasets_records(path, kind)
    except Exception as e:
        if kind == "parquet":
            raise ValueError(
                f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from e
        rows = []
        for lineno, row in read_jsonl(path):
            try:
                rows.append(_check_row(row))
            except ValueError as bad:
                raise ValueError(f"{path}:{lineno}: {bad}") from None
        # every line is a good row: `datasets` failed on something else (e.g. mixed types of extra
        # fields)
        if rows:
            print(f"{path}: read line by line (datasets: {type(e).__name__}: {str(e)[:200]})",
                  flush=True)
    else:
        rows = []
        for i, row in enumerate(records):
            try:
                rows.append(_check_row(row))
            except ValueError as bad:
                raise ValueError(f"{qa_where(path, i)}: {bad}") from None
    if not rows:
        raise ValueError(f"{path}: no QA rows")
    _refuse_duplicate_ids(path, rows)
    return rows


def refuse_long_prompts(rows: list, tokenizer, max_context: int, max_new_tokens: int,
                        path: str = ""):
    """Refuse any row whose prompt leaves less than one full turn (max_new_tokens) of room under
    max_context, naming `file:line` (path given: rows as load_qa returned them) or the question's
    id, with its token count.

    Refused rather than truncated: a cut question may no longer hold what its answer depends on, so
    training or scoring it would be training or scoring another question. Such a row can never
    produce a full turn, and its prompt went whole into every log-prob pass (a 40,000-word question
    ran a run to 24 GB before the kernel killed it); refusing at load time costs one tokenisation of
    the file, before any model runs."""
    limit = max_context - max_new_tokens
    lengths = rollout.prompt_lengths(tokenizer, rows)
    over = [i for i, n in enumerate(lengths) if n > limit]
    if not over:
        return
    i = over[0]
    where = qa_where(
        path, i) if path else f"question {rows[i].get('id')!r} of {rows[i].get('data_source')}"
    raise ValueError(
        f"{where}: the prompt is {lengths[i]} tokens, past the {limit} that leave one turn "
        f"(max_new_tokens={max_new_tokens}) under max_context={max_context}; {len(over)} such row(s), "
        f"longest {max(lengths[j] for j in over)} tokens: shorten or remove them, or raise max_context"
    )


# --- evaluation of a policy on QA sets (greedy episodes, DESIGN.md section 3) ---

def em_table(per_source: dict) -> str:
    """Markdown table: one row per data source plus the unweighted average over sources (Search-R1's
    'Avg.')."""
    lines = ["| dataset | n | EM |", "|---|---:|---:|"]  # EM a fraction in [0, 1], as training's
    for name, (n, em) in per_source.items():
        lines.append(f"| {name} | {n} | {em:.3f} |")
    if per_source:
        avg = sum(em for _, em in per_source.values()) / len(per_source)
        lines.append(
            f"| **average** | {sum(n for n, _ in per_source.values())} | **{avg:.3f}** |")
    return "\n".join(lines)


def summarize(rows: list, rewards: list) -> dict:
    """{data_source: (n, mean EM)} in order of first appearance."""
    out = {}
    for row, r in zip(rows, rewards):
        n, s = out.get(row["data_source"], (0, 0.0))
        out[row["data_source"]] = (n + 1, s + r)
    return {k: (n, s / n) for k, (n, s) in out.items()}


def evaluate(model, tokenizer, retriever, rows: list, proto, chunk: int = 256,
             progress: bool = True) -> list:
    """Greedy episodes (proto.temperature must be 0) for every row -> the finished Episode records,
    in order."""
    from tqdm import tqdm
    if proto.temperature != 0:
        raise ValueError("evaluation is greedy: set temperature 0 (DESIGN.md section 3)")
    # before any episode runs
    refuse_long_prompts(rows, tokenizer, proto.max_context, proto.max_new_tokens)
    episodes = []
    for c in tqdm(range(0, len(rows), chunk), desc="eval", unit="chunk", disable=not progress):
        batch = rollout.start_episodes(tokenizer, rows[c:c + chunk], run_seed=0, step=0,
                                       group_size=1)
        episodes += rollout.run_episodes(model, tokenizer, retriever, batch, proto)
    return episodes


def evaluate_on_ranks(accel, model, tokenizer, retriever, rows: list, proto, gather_list) -> dict:
    """evaluate() with rows sharded over accelerate ranks -> {"eval_em": mean over sources,
    "eval_em/<source>": EM}, EM a fraction in [0, 1]. gather_list(accel, items) concatenates every
    rank's list in rank order."""
    shard = list(range(accel.process_index, len(rows), accel.num_processes))
    eps = evaluate(model, tokenizer, retriever, [rows[i] for i in shard], proto,
                   progress=accel.is_main_process)
    scored = sorted(gather_list(accel, [(i, ep.reward) for i, ep in zip(shard, eps)]))
    out = {f"eval_em/{k}": em for k, (_, em) in summarize(rows, [r for _, r in scored]).items()}
    out["eval_em"] = sum(out.values()) / len(out)
    return out


def load_policy(path: str, device=None, dtype=None):
    """(model, tokenizer) from an HF folder or hub id; refuses a tokenizer whose ids the model
    cannot embed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    # on a GPU each tensor goes from the file straight to the device: no whole host copy per rank (8
    # ranks of 7B in fp32 held ~245 GB of host RAM at once)
    direct = {"device_map": str(device)} if str(device or "cpu").startswith("cuda") else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto", **direct)
    except OSError as e:  # the hub's answer for an id it does not know, a file that is missing
        raise ValueError(f"model {path}: {str(e).splitlines()[0]}") from None
    n_embed = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > n_embed:
        raise ValueError(
            f"{path}: tokenizer has {len(tokenizer)} tokens but the model embeds only {n_embed}: "
            "mismatched tokenizer and model")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device or "cpu").eval(), tokenizer


def reference_model(cfg, device):
    """The trainer's frozen reference in the rollout dtype: on the GPU, or with ref_offload in host
    memory (pinned if the system lets every rank pin it: read asynchronously) until its log-prob
    pass moves it (infra/weights.py's on_device)."""
    import torch
    ref, _ = load_policy(cfg.model, "cpu" if cfg.ref_offload else device,
                         torch.bfloat16 if cfg.bf16 else torch.float32)
    ref.requires_grad_(False)
    if cfg.ref_offload and device.type == "cuda":
        try:
            for p in ref.parameters():
                p.data = p.data.pin_memory()
        except RuntimeError as e:
            print(f"ref_offload: the reference stays in pageable memory ({e})", file=sys.stderr)
    return ref


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # a model on the Hugging Face hub: org/name
DATA_FIELDS = ("train_data", "eval_data", "data")  # the scripts' QA file fields (comma-separated)


def check_inputs(cfg):
    """Every path a script reads, checked before anything loads (a model takes 20 s on the tiny
    world, minutes at 3B): each QA file of DATA_FIELDS exists, the index folder holds its files
    (unless retriever_url replaces it), the model is a model folder or a hub id. cfg: any script's
    config with some of these fields (train_twice.py, eval.py, lab/audit.py). One ValueError naming
    every field and path at fault."""
    from retrieval.index import META_FILE, OFFSETS_FILE
    bad = [f"{field} {path}: no such file" for field in DATA_FIELDS
           for path in filter(None, getattr(cfg, field, "").split(",")) if not os.path.isfile(path)]
    index = "" if getattr(cfg, "retriever_url", "") else getattr(cfg, "index", "")
    missing = [f for f in (META_FILE, OFFSETS_FILE) if not os.path.isfile(os.path.join(index, f))]
    if index and not os.path.isdir(index):
        bad.append(f"index {index}: no such folder (python retriever.py build writes one)")
    elif index and missing:
        bad.append(f"index {index}: not an index folder, no {' or '.join(missing)} (python "
                   "retriever.py build writes one)")
    model = getattr(cfg, "model", "")
    if model and _model_problem(model):
        bad.append(f"model {model}: {_model_problem(model)}")
    world = getattr(cfg, "world", "")  # train_twice.py's paths default to the world's files
    if bad and world and not os.path.isdir(world):
        bad.insert(0, f"world {world}: no such folder (`make world` builds the tiny world there)")
    if bad:
        raise ValueError("; ".join(bad))


def _model_problem(path: str) -> str:
    """Why `path` cannot be loaded as a policy, or '': a model folder (config.json, or a LoRA
    adapter's adapter_config.json), or a hub id of the form org/name (in the local cache when
    HF_HUB_OFFLINE is set)."""
    if os.path.isdir(path):
        if any(os.path.isfile(os.path.join(path, f)) for f in ("config.json",
                                                               "adapter_config.json")):
            return ""
        inner = os.path.isdir(os.path.join(path, "policy"))
        return "a folder without config.json" + (": a checkpoint? its policy/ holds the model"
                                                  if inner else ", not a model folder")
    if not HUB_ID.fullmatch(path):
        return "no such folder (nor a hub id of the form org/name)"
    offline = any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
                  for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    if offline:
        from huggingface_hub import try_to_load_from_cache
        try:
            cached = isinstance(try_to_load_from_cache(path, "config.json"), str)
        except ValueError:  # not a valid repo id after all
            cached = False
        if not cached:
            return "no such folder, and not in the Hugging Face cache (HF_HUB_OFFLINE is set)"
    return ""


def load_retriever(index: str = "", url: str = ""):
    """In-process retriever over an index folder (dense, or BM25 when its meta.json says so:
    retrieval/bm25.py), or a client of a Search-R1-style HTTP server."""
    import retriever
    if url:
        return retriever.RemoteRetriever(url)
    if not index:
        raise ValueError("give --index DIR or --retriever_url URL")
    return retriever.Retriever(index)


@dataclass
class Config:
    """Greedy exact-match evaluation of a search agent on QA sets (DESIGN.md section 3)."""
    model: str = ""                 # HF folder or hub id of the policy
    data: str = ""                  # comma-separated QA files (.jsonl / .parquet)
    index: str = ""                 # retriever index folder (retriever.py build)
    retriever_url: str = ""         # Search-R1-style server, e.g. http://127.0.0.1:8000/retrieve;
    #                                 replaces index
    out: str = ""                   # write per-question records and the table as json here
    limit: int = 0                  # first N questions of each file (0 = all)
    max_turns: int = 4              # searches per episode, then one final turn
    topk: int = 3                   # documents per search
    max_new_tokens: int = 500       # tokens per turn
    max_obs_tokens: int = 500       # tokens per observation
    max_context: int = 4096         # prompt + response tokens
    gen_batch_size: int = 64        # rows per generate call

    def checks(self):
        return [("model", bool(self.model), "a policy folder or hub id"),
                ("data", bool(self.data), "one or more QA files"),
                ("index", bool(self.index or
                               self.retriever_url), "an index folder, or set retriever_url"),
                ("limit", self.limit >= 0, ">= 0"), ("max_turns", self.max_turns >= 0, ">= 0"),
                ("topk", self.topk >= 1, ">= 1"),
                ("max_new_tokens", self.max_new_tokens >= 1, ">= 1"),
                ("max_obs_tokens", self.max_obs_tokens >= 0, ">= 0"),
                ("max_context", self.max_context >= 2, ">= 2"),
                ("gen_batch_size", self.gen_batch_size >= 1, ">= 1")]


def check_writable(path: str):
    """Fail before the evaluation, not after it: the results file's folder is created and a probe
    file written."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        open(path + ".tmp", "w", encoding="utf-8").close()
        os.remove(path + ".tmp")
    except OSError as e:
        raise ValueError(f"--out {path}: cannot write there ({e.strerror})") from None


def main(cfg: Config):
    import torch
    if cfg.out:
        check_writable(cfg.out)
    check_inputs(cfg)  # the QA files, the index and the model, before anything loads
    rows = []
    for path in cfg.data.split(","):
        rows += load_qa(path)[:cfg.limit or None]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_policy(cfg.model, device,
                                   torch.bfloat16 if device == "cuda" else torch.float32)
    proto = protocol.protocol_from(cfg, greedy=True)
    episodes = evaluate(model, tokenizer, load_retriever(cfg.index, cfg.retriever_url), rows, proto)
    per_source = summarize(rows, [ep.reward for ep in episodes])
    table = em_table(per_source)
    print(table)
    if cfg.out:
        records = [{
            "id": r["id"], "data_source": r["data_source"], "question": r["question"],
            "answer": ep.answer, "golden_answers": r["golden_answers"], "em": ep.reward,
            "turns": len(ep.turns), "response": tokenizer.decode(ep.ids, skip_special_tokens=False)
        } for r, ep in zip(rows, episodes)]
        result = {
            "model": cfg.model, "per_source": {
                k: {"n": n, "em": em} for k, (n, em) in per_source.items()
            }, "average_em": sum(em for _, em in per_source.values()) / len(per_source),
            "table": table, "records": records
        }
        os.makedirs(os.path.dirname(os.path.abspath(cfg.out)), exist_ok=True)
        tmp = cfg.out + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, cfg.out)  # atomic: an interrupted run never leaves half a results file
    return per_source


if __name__ == "__main__":
    try:
        main(config.cli(Config, prog="eval.py", presets=False))
    except ValueError as e:
        print(f"eval.py: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
