"""Scoring and evaluation for the search agent: answer extraction, SQuAD normalisation, exact match, QA loading.

The training reward and the evaluation use the same functions (`extract_answer` + `exact_match`), so they cannot
drift apart. Reward (DESIGN.md section 3): exact match after SQuAD normalisation of the last `<answer>` of the
episode's response (everything after the prompt) against any gold answer; 1.0 or 0.0. This equals Search-R1's
`qa_em.compute_score_em`, which searches the whole sequence and skips the prompt's `<answer> Beijing </answer>`
example by requiring two matches.
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


def _check_row(row, where: str) -> dict:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing = [k for k in QA_FIELDS if k not in row]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}; a QA row needs {list(QA_FIELDS)}")
    gold = row["golden_answers"]
    if hasattr(gold, "tolist"):  # parquet list columns arrive as numpy arrays
        gold = gold.tolist()
    if isinstance(gold, str):
        gold = [gold]
    if not isinstance(gold, list) or not gold or not all(isinstance(g, str) for g in gold):
        raise ValueError(f"{where}: field 'golden_answers' must be a non-empty list of strings, got {gold!r}")
    if not isinstance(row["question"], str) or not row["question"].strip():
        raise ValueError(f"{where}: field 'question' must be a non-empty string")
    return {"id": str(row["id"]), "question": row["question"], "golden_answers": gold,
            "data_source": str(row["data_source"])}


def load_qa(path: str) -> list:
    """Load QA rows (`id`, `question`, `golden_answers`, `data_source`) from a .jsonl or .parquet file.

    A malformed row raises ValueError naming the file and the line (jsonl, 1-based) or row (parquet, 0-based).
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"QA file not found: {path}")
    rows = []
    if path.endswith(".parquet"):
        import pandas as pd
        for i, row in enumerate(pd.read_parquet(path).to_dict("records")):
            rows.append(_check_row(row, f"{path}: row {i}"))
    else:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: malformed JSON ({e.msg})") from None
                rows.append(_check_row(row, f"{path}:{lineno}"))
    if not rows:
        raise ValueError(f"{path}: no QA rows")
    return rows
