"""Rollouts for TWICE: the Search-R1 episode protocol, keyed Gumbel-max sampling and twin episodes.

Protocol (DESIGN.md section 3, Search-R1 compatible byte for byte where it matters): one user message made of the
Search-R1 instruction and the question, chat-templated when the tokenizer has a template; each turn is one
generation that stops right after the first `</search>` or `</answer>`; the first `<search>`/`<answer>` of the
turn is the action; a search appends `\\n\\n<information>{docs}</information>\\n\\n`, an answer ends the episode,
anything else appends Search-R1's invalid-action message.
"""
import re

# --- protocol constants (Search-R1 compatibility: byte for byte, typo "as your want" included) ---
INSTRUCTION = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get "
    "new information. After reasoning, if you find you lack some knowledge, you can call a search engine by "
    "<search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as your want. If you find no further external knowledge "
    "needed, you can directly provide the answer inside <answer> and </answer>, without detailed illustrations. "
    "For example, <answer> Beijing </answer>. "
)
INVALID_ACTION_MSG = (
    "\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
    "</search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. "
    "Let me try again.\n"
)
STOP_STRINGS = ("</search>", "</answer>")
ACTION_RE = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)  # Search-R1 postprocess_predictions


def user_message(question: str) -> str:
    """The single user message of an episode: instruction + `Question: {q}?\\n` (Search-R1 nq_search.py)."""
    question = question.strip()
    if not question:
        raise ValueError("empty question")
    if question[-1] != "?":
        question += "?"
    return f"{INSTRUCTION}Question: {question}\n"


def render_prompt(tokenizer, question: str) -> str:
    """Prompt text: the chat template with the generation prompt when the tokenizer has one, else the raw message."""
    message = user_message(question)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                             tokenize=False)
    return message


def parse_action(text: str):
    """First `<search>...</search>` or `<answer>...</answer>` of a turn -> (action, stripped content).

    Returns (None, "") when the turn holds neither. An empty (or whitespace-only) search query is not a valid
    action here (# DEVIATION: Search-R1 would send the empty string to the retriever).
    """
    match = ACTION_RE.search(text)
    if match is None:
        return None, ""
    action, content = match.group(1), match.group(2).strip()
    if action == "search" and not content:
        return None, ""
    return action, content


def information_block(docs_text: str) -> str:
    """Observation appended after a search (Search-R1 execute_predictions)."""
    return f"\n\n<information>{docs_text.strip()}</information>\n\n"
