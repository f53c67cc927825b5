"""Scoring and evaluation for the search agent: answer extraction, SQuAD normalisation, exact match, QA loading.

The training reward and the evaluation use the same functions (`extract_answer` + `exact_match`), so they cannot
drift apart. Reward (DESIGN.md section 3): exact match after SQuAD normalisation of the last `<answer>` of the
episode's response (everything after the prompt) against any gold answer; 1.0 or 0.0. This equals Search-R1's
`qa_em.compute_score_em`, which searches the whole sequence and skips the prompt's `<answer> Beijing </answer>`
example by requiring two matches.

`python eval.py report GRPO=DIR TWICE=DIR --paper 3b` turns result files into the paper's table (make reproduce-3b).
"""
import json
import os
import re
import string

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
QA_FIELDS = ("id", "question", "golden_answers", "data_source")


def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lowercase, drop punctuation, drop articles a/an/the, collapse whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def extract_answer(response: str):
    """Content of the last `<answer>...</answer>` in the response, stripped; None when there is none."""
    matches = ANSWER_RE.findall(response)
    return matches[-1].strip() if matches else None


def exact_match(prediction, golden_answers) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer, else 0.0 (None scores 0)."""
    if prediction is None:
        return 0.0
    if isinstance(golden_answers, str):
        golden_answers = [golden_answers]
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golden_answers))


def reward(response: str, golden_answers) -> float:
    """The episode reward: exact match of the last answer in the response."""
    return exact_match(extract_answer(response), golden_answers)


# A character that normalize_answer keeps whatever surrounds it (not punctuation, whitespace or a letter of a/an/the):
# it settles most answers without normalize_answer, which is ~20 us an answer (0.7 s for 20k rows of two answers)
_SURELY_NONEMPTY = re.compile(r"[^\santhe" + re.escape(string.punctuation) + "]")


def _lone_surrogate(text: str):
    """Position of a lone UTF-16 surrogate in text, else None. The JSON escape "\ud800" without its low half survives
    json.loads but not UTF-8 encoding, which the tokenizer does at the step that samples the row."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _refuse_lone_surrogates(row: dict):
    texts = [(field, t) for field, v in row.items() for t in (v if isinstance(v, list) else [v])]
    if _lone_surrogate("".join(t for _, t in texts)) is None:  # one encode per row; locate only when there is one
        return
    field, text = next((field, t) for field, t in texts if _lone_surrogate(t) is not None)
    at = _lone_surrogate(text)
    raise ValueError(f"field {field!r} has a lone surrogate \\u{ord(text[at]):04x} at character {at} "
                     f"({text[max(0, at - 20):at]!r}...): an invalid JSON \\u escape, which cannot be encoded as "
                     "UTF-8 and would crash training when the row is sampled; fix the text")


def _check_row(row) -> dict:
    """A QA row -> {id, question, golden_answers, data_source}, or ValueError saying what is wrong and how to fix it
    (the caller prefixes file:line)."""
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    missing = [k for k in QA_FIELDS if row.get(k) is None]  # `datasets` fills a key that a row lacks with None
    if missing:
        raise ValueError(f"missing field(s) {missing}; a QA row needs {list(QA_FIELDS)}")
    gold = row["golden_answers"]
    if hasattr(gold, "tolist"):  # parquet list columns may arrive as numpy arrays
        gold = gold.tolist()
    if isinstance(gold, str):
        gold = [gold]
    if not isinstance(gold, list) or not gold or not all(isinstance(g, str) for g in gold):
        raise ValueError(f"field 'golden_answers' must be a non-empty list of strings, got {gold!r}")
    if not isinstance(row["question"], str) or not row["question"].strip():
        raise ValueError("field 'question' must be a non-empty string")
    out = {"id": str(row["id"]), "question": row["question"], "golden_answers": gold,
           "data_source": str(row["data_source"])}
    _refuse_lone_surrogates(out)
    # DEVIATION E10: Search-R1 keeps such answers; an empty <answer></answer> would then score 1.0 (exact_match)
    empty = [g for g in gold if not _SURELY_NONEMPTY.search(g.lower()) and not normalize_answer(g)]
    if empty:
        raise ValueError(f"golden answer(s) {empty} normalise to an empty string (lowercase, no punctuation, no "
                         "a/an/the), so an empty answer would score 1.0: remove them from 'golden_answers' (or drop "
                         "the row if no answer is left)")
    return out


def read_jsonl(path: str):
    """Yield (line number, parsed object) of a jsonl file, skipping blank lines; a malformed line or one that is not
    UTF-8 names file:line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of "
                                 "the line); re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: malformed JSON ({e.msg})") from None


def write_jsonl(path: str, rows):
    """One JSON object per line, UTF-8, non-ASCII kept as is (the format every QA and corpus file of the project uses)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def _datasets_records(path: str, kind: str) -> list:
    """The records of a "json" (jsonl) or "parquet" file, read by `datasets` (Arrow) into memory. Its cache goes to a
    temporary folder that is deleted at once, so loading leaves nothing in ~/.cache."""
    import tempfile
    import datasets
    datasets.disable_progress_bars()  # a bar per small file would drown the training log
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its parse errors are reported by load_qa, with line
    try:
        with tempfile.TemporaryDirectory(prefix="qa-cache-") as cache:
            ds = datasets.load_dataset(kind, data_files=path, split="train", cache_dir=cache, keep_in_memory=True)
    finally:
        datasets.logging.set_verbosity(verbosity)
    return ds.to_list()


def _nonblank_lineno(path: str, index: int) -> int:
    """1-based line number of the index-th (0-based) non-blank line: the line of `datasets`' row `index`."""
    with open(path, "rb") as f:
        rows = (lineno for lineno, raw in enumerate(f, 1) if raw.strip())
        return next(lineno for i, lineno in enumerate(rows) if i == index)


def load_qa(path: str) -> list:
    """Load QA rows (`id`, `question`, `golden_answers`, `data_source`) from a .jsonl or .parquet file, through
    `datasets`, each row checked by _check_row.

    A bad row raises ValueError naming the file and the line (jsonl, 1-based) or row (parquet, 0-based). Arrow's JSON
    errors name neither a line nor a byte (nor does it accept what Python's json does: a lone surrogate escape), so
    when `datasets` fails on a jsonl file, the file is read again line by line to name the bad line.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"QA file not found: {path}")
    kind = "parquet" if path.endswith(".parquet") else "json"
    try:
        records = _datasets_records(path, kind)
    except Exception as e:
        if kind == "parquet":
            raise ValueError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from e
        rows = []
        for lineno, row in read_jsonl(path):
            try:
                rows.append(_check_row(row))
            except ValueError as bad:
                raise ValueError(f"{path}:{lineno}: {bad}") from None
        if rows:  # every line is a good row: `datasets` failed on something else (e.g. mixed types of extra fields)
            print(f"{path}: read line by line (datasets: {type(e).__name__}: {str(e)[:200]})", flush=True)
    else:
        rows = []
        for i, row in enumerate(records):
            try:
                rows.append(_check_row(row))
            except ValueError as bad:
                where = f"{path}: row {i}" if kind == "parquet" else f"{path}:{_nonblank_lineno(path, i)}"
                raise ValueError(f"{where}: {bad}") from None
    if not rows:
        raise ValueError(f"{path}: no QA rows")
    return rows


# --- evaluation of a policy on QA sets (greedy episodes, DESIGN.md section 3) ---

def em_table(per_source: dict) -> str:
    """Markdown table: one row per data source plus the unweighted average over sources (Search-R1's 'Avg.')."""
    lines = ["| dataset | n | EM |", "|---|---:|---:|"]
    for name, (n, em) in per_source.items():
        lines.append(f"| {name} | {n} | {100 * em:.1f} |")
    if per_source:
        avg = sum(em for _, em in per_source.values()) / len(per_source)
        lines.append(f"| **average** | {sum(n for n, _ in per_source.values())} | **{100 * avg:.1f}** |")
    return "\n".join(lines)


def summarize(rows: list, rewards: list) -> dict:
    """{data_source: (n, mean EM)} in order of first appearance."""
    out = {}
    for row, r in zip(rows, rewards):
        n, s = out.get(row["data_source"], (0, 0.0))
        out[row["data_source"]] = (n + 1, s + r)
    return {k: (n, s / n) for k, (n, s) in out.items()}


def evaluate(model, tokenizer, retriever, rows: list, proto, chunk: int = 256, progress: bool = True) -> list:
    """Greedy episodes (proto.temperature must be 0) for every row -> the finished Episode records, in order."""
    import rollout
    from tqdm import tqdm
    if proto.temperature != 0:
        raise ValueError("evaluation is greedy: set temperature 0 (DESIGN.md section 3)")
    episodes = []
    for c in tqdm(range(0, len(rows), chunk), desc="eval", unit="chunk", disable=not progress):
        batch = rollout.start_episodes(tokenizer, rows[c:c + chunk], run_seed=0, step=0, group_size=1)
        episodes += rollout.run_episodes(model, tokenizer, retriever, batch, proto)
    return episodes


def load_policy(path: str, device=None, dtype=None):
    """(model, tokenizer) from an HF folder or hub id; refuses a tokenizer whose ids the model cannot embed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto")
    n_embed = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > n_embed:
        raise ValueError(f"{path}: tokenizer has {len(tokenizer)} tokens but the model embeds only {n_embed}: "
                         "mismatched tokenizer and model")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device or "cpu").eval(), tokenizer


def load_retriever(index: str = "", url: str = ""):
    """In-process dense retriever over an index folder, or a client of a Search-R1-style HTTP server."""
    import retriever
    if url:
        return retriever.RemoteRetriever(url)
    if not index:
        raise ValueError("give --index DIR or --retriever_url URL")
    return retriever.DenseRetriever(index)


def main(argv=None):
    import argparse
    import rollout
    import torch
    ap = argparse.ArgumentParser(description="Greedy exact-match evaluation of a search agent on QA sets.")
    ap.add_argument("--model", required=True, help="HF folder or hub id of the policy")
    ap.add_argument("--data", required=True, help="comma-separated QA files (.jsonl / .parquet)")
    ap.add_argument("--index", default="", help="retriever index folder (retriever.py build)")
    ap.add_argument("--retriever_url", default="", help="Search-R1-style server, e.g. http://127.0.0.1:8000/retrieve")
    ap.add_argument("--out", default="", help="write per-question records and the table as json here")
    ap.add_argument("--limit", type=int, default=0, help="first N questions of each file (0 = all)")
    ap.add_argument("--max_turns", type=int, default=4)
    ap.add_argument("--topk", type=int, default=3)
    ap.add_argument("--max_new_tokens", type=int, default=500)
    ap.add_argument("--max_obs_tokens", type=int, default=500)
    ap.add_argument("--max_context", type=int, default=4096)
    ap.add_argument("--gen_batch_size", type=int, default=64)
    args = ap.parse_args(argv)
    rows = []
    for path in args.data.split(","):
        rows += load_qa(path)[:args.limit or None]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_policy(args.model, device, torch.bfloat16 if device == "cuda" else torch.float32)
    proto = rollout.Protocol(max_turns=args.max_turns, topk=args.topk, max_new_tokens=args.max_new_tokens,
                             max_obs_tokens=args.max_obs_tokens, max_context=args.max_context, temperature=0.0,
                             gen_batch_size=args.gen_batch_size)
    episodes = evaluate(model, tokenizer, load_retriever(args.index, args.retriever_url), rows, proto)
    per_source = summarize(rows, [ep.reward for ep in episodes])
    table = em_table(per_source)
    print(table)
    if args.out:
        records = [{"id": r["id"], "data_source": r["data_source"], "question": r["question"], "answer": ep.answer,
                    "golden_answers": r["golden_answers"], "em": ep.reward, "turns": len(ep.turns),
                    "response": tokenizer.decode(ep.ids, skip_special_tokens=False)} for r, ep in zip(rows, episodes)]
        result = {"model": args.model, "per_source": {k: {"n": n, "em": em} for k, (n, em) in per_source.items()},
                  "average_em": sum(em for _, em in per_source.values()) / len(per_source), "table": table,
                  "records": records}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        tmp = args.out + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, args.out)  # atomic: an interrupted run never leaves half a results file
    return per_source


# --- the paper-scale results table (`make reproduce-3b`): `python eval.py report METHOD=PATH ...` ---

# Search-R1's column order and names
TEST_SETS = {"nq": "NQ", "triviaqa": "TriviaQA", "popqa": "PopQA", "hotpotqa": "HotpotQA", "2wikimultihopqa": "2wiki",
             "musique": "Musique", "bamboogle": "Bamboogle"}
# arXiv 2610.31544: average EM (%) over the seven sets; its per-set figures are not available to us
PAPER_AVG_EM = {"3b": {"GRPO": 37.4, "TWICE": 42.7}, "7b": {"GRPO": 42.0, "TWICE": 46.5}}


def _result_files(path: str) -> list:
    if os.path.isdir(path):
        return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".json"))
    return [path]


def report_table(results_jsons: dict, paper: dict = None) -> str:
    """Markdown table in the paper's layout: one row per method, EM (%) per test set and the unweighted average
    over the sets (Search-R1's "Avg."), then TWICE - GRPO style differences of the first two methods and the paper's
    averages. results_jsons: {method: [eval.py --out files, or folders of them]}; paper: {method: average EM (%)}."""
    per = {}
    for method, paths in results_jsons.items():
        per[method] = {}
        for path in (f for p in paths for f in _result_files(p)):
            with open(path, encoding="utf-8") as f:
                result = json.load(f)
            if "per_source" not in result:
                raise ValueError(f"{path}: not an `eval.py --out` file (no field 'per_source')")
            for source, v in result["per_source"].items():
                if source in per[method]:
                    raise ValueError(f"{path}: {source} is scored twice for {method}")
                per[method][source] = (v["n"], 100 * v["em"])
        if not per[method]:
            raise ValueError(f"{method}: no results in {paths}")
    seen = {s for scores in per.values() for s in scores}
    cols = [s for s in TEST_SETS if s in seen] + sorted(seen - set(TEST_SETS))
    lines = ["| method | " + " | ".join(TEST_SETS.get(s, s) for s in cols) + " | Avg. |",
             "|---|" + "---:|" * (len(cols) + 1)]
    avgs = {}
    for method, scores in per.items():
        avgs[method] = sum(em for _, em in scores.values()) / len(scores)
        partial = "" if len(scores) == len(cols) else f" ({len(scores)}/{len(cols)} sets)"
        cells = [f"{scores[s][1]:.1f}" if s in scores else "-" for s in cols]
        lines.append(f"| {method} | " + " | ".join(cells) + f" | **{avgs[method]:.1f}**{partial} |")
    if len(per) >= 2:
        (a, sa), (b, sb) = list(per.items())[:2]
        cells = [f"{sb[s][1] - sa[s][1]:+.1f}" if s in sa and s in sb else "-" for s in cols]
        lines.append(f"| {b} - {a} | " + " | ".join(cells) + f" | {avgs[b] - avgs[a]:+.1f} |")
    for method, avg in (paper or {}).items():
        lines.append(f"| {method} (paper) | " + " | ".join("-" for _ in cols) + f" | {avg:.1f} |")
    counts = {s: n for scores in per.values() for s, (n, _) in scores.items()}
    lines.append("| questions | " + " | ".join(str(counts[s]) for s in cols) + " | |")
    return "\n".join(lines)


def report_main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(description="GRPO vs TWICE table from eval.py --out files (the paper's layout).")
    ap.add_argument("results", nargs="+", help="METHOD=PATH[,PATH...]: result files or folders of them")
    ap.add_argument("--paper", choices=sorted(PAPER_AVG_EM) + ["none"], default="none", help="add the paper's rows")
    ap.add_argument("--out", default="", help="write the markdown here as well")
    args = ap.parse_args(argv)
    runs = {}
    for item in args.results:
        method, sep, paths = item.partition("=")
        if not sep or not paths:
            ap.error(f"expected METHOD=PATH, got {item!r}")
        runs[method] = paths.split(",")
    paper = PAPER_AVG_EM.get(args.paper, {})
    text = (f"# Exact match (%) on the seven test sets{f' (Qwen2.5-{args.paper.upper()})' if paper else ''}\n\n"
            f"{report_table(runs, paper)}\n\nGreedy decoding, one sample per question, exact match after SQuAD "
            "normalisation; Avg. is the unweighted mean over the test sets. Paper rows: arXiv 2610.31544, average "
            "only (its per-set figures are not available here).\n")
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    return text


if __name__ == "__main__":
    import sys
    if sys.argv[1:2] == ["report"]:
        report_main(sys.argv[2:])
    else:
        main()
