"""The Search-R1 episode protocol and its reward (DESIGN.md section 3): what the agent is shown,
what counts as its action, what it is shown back, and how its answer is scored.

Search-R1 compatible (github PeterGriffinJin/Search-R1) byte for byte where it matters: one user
message made of the Search-R1 instruction and the question, chat-templated when the tokenizer has a
template; each turn is one generation that stops right after the first `</search>` or `</answer>`
(STOP_STRINGS); the first `<search>`/`<answer>` of the turn is the action; a search appends
`\\n\\n<information>{docs}</information>\\n\\n`, an answer ends the episode, anything else appends
Search-R1's invalid-action message. Turns 0..max_turns-1 execute their action (Search-R1's
`max_turns` loop: at most max_turns searches); turn max_turns is the final turn, whose search is not
executed. Protocol holds these settings with Search-R1's defaults.

Reward: exact match, after SQuAD normalisation (lowercase, no punctuation, no a/an/the, single
spaces), of the last `<answer>` against any gold answer: 1.0 or 0.0. eval.py scores with the same
functions, so the training reward and the evaluation cannot drift.

It knows no model, no noise keys and no retriever: it turns a question into a prompt, a turn's text
into an action and a response into a score; rollout.py runs the episodes.

Deviations (DESIGN.md section 13; tagged `# DEVIATION R<n>:` where they act):
  R1. An empty or whitespace-only search query is an invalid action (Search-R1 sends "" to
      the retriever).
  R2-R5 act on episodes and are rollout.py's; two of them are settings here (max_query_chars: R2,
  max_context: R3).
"""
import re
import string
from dataclasses import dataclass, fields

# --- protocol constants (Search-R1 compatibility: byte for byte, typo "as your want" included) ---
INSTRUCTION = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every "
    "time you get new information. After reasoning, if you find you lack some knowledge, you can "
    "call a search engine by <search> query </search> and it will return the top searched results "
    "between <information> and </information>. You can search as many times as your want. If you "
    "find no further external knowledge needed, you can directly provide the answer inside "
    "<answer> and </answer>, without detailed illustrations. "
    "For example, <answer> Beijing </answer>. ")
INVALID_ACTION_MSG = (
    "\nMy previous action is invalid. If I want to search, I should put the query between <search> "
    "and </search>. If I want to give the final answer, I should put the answer between <answer> "
    "and </answer>. Let me try again.\n")
STOP_STRINGS = ("</search>", "</answer>")
# Search-R1 postprocess_predictions
ACTION_RE = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def user_message(question: str) -> str:
    """The single user message of an episode: instruction + `Question: {q}?\\n` (Search-R1's
    nq_search.py)."""
    question = question.strip()
    if not question:
        raise ValueError("empty question")
    if question[-1] != "?":
        question += "?"
    return f"{INSTRUCTION}Question: {question}\n"


def render_prompt(tokenizer, question: str) -> str:
    """Prompt text: the chat template with the generation prompt when the tokenizer has one,
    else the raw message."""
    message = user_message(question)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                             add_generation_prompt=True, tokenize=False)
    return message


def parse_action(text: str):
    """First `<search>...</search>` or `<answer>...</answer>` of a turn ->
    (action, stripped content).

    Returns (None, "") when the turn holds neither. An empty (or whitespace-only) search query is
    not a valid action here (# DEVIATION R1: Search-R1 would send the empty string to the
    retriever).
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


# --- reward (DESIGN.md section 3): the training reward and the evaluation share these functions ---
def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lowercase, drop punctuation, drop articles a/an/the, collapse
    whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def extract_answer(response: str):
    """Content of the last `<answer>...</answer>` in the response, stripped; None when there
    is none."""
    matches = ANSWER_RE.findall(response)
    return matches[-1].strip() if matches else None


def exact_match(prediction, golden_answers) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer, else 0.0 (None
    scores 0)."""
    if prediction is None:
        return 0.0
    if isinstance(golden_answers, str):
        golden_answers = [golden_answers]
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golden_answers))


def reward(response: str, golden_answers) -> float:
    """The episode reward: exact match of the last answer in the agent's own text (rollout.finish
    passes only the sampled turns, never observations: DEVIATION R5)."""
    return exact_match(extract_answer(response), golden_answers)


@dataclass
class Protocol:
    """Episode settings (DESIGN.md section 3; Search-R1 defaults)."""
    max_turns: int = 4            # turns that execute their action (so at most this many
    #                               searches); then one final turn
    topk: int = 3                 # documents per search
    max_new_tokens: int = 500     # sampled tokens per turn
    max_obs_tokens: int = 500     # observation tokens (information block / invalid-action
    #                               message), cut after this
    max_context: int = 4096       # prompt + response tokens; an episode that reaches it
    #                               ends (DEVIATION R3)
    temperature: float = 1.0      # T; 0 = greedy (evaluation)
    top_p: float = 1.0            # nucleus mass kept before the noise; 1 = off
    top_k: int = 0                # most likely tokens kept before the noise; 0 = off
    gen_batch_size: int = 64      # rows per generate call (episodes sorted by context
    #                               length, then chunked)
    max_query_chars: int = 1024   # a search query is cut to this many characters before
    #                               retrieval (DEVIATION R2)
    fused_sampler: bool = True    # torch.compile the keyed draw into one kernel, on CUDA
    #                               (the CPU stays eager)
    engine: str = "cached"        # "cached": KV reuse + continuous batching;
    #                               "generate": model.generate per turn
    sync_every: int = 16          # cached engine: decode steps between read-backs of the
    #                               sampled tokens (host syncs)
    kv_budget_gib: float = 0.0    # cached engine: KV cache entries held at once (GiB; 0 = no
    #                               cap); over it episodes wait a turn and kept caches are
    #                               dropped (generation/kvbudget.py: the same tokens)
    cuda_graphs: bool = False     # cached engine on CUDA: replay the decode step as CUDA
    #                               graphs (one per shape)
    line_keys: str = "group"      # reading of "line" in the key tuple: "group" (the sample's line
    #                               in its group: keys (turn, position)) or "text" (the text line in
    #                               the turn: keys restart after every newline), DESIGN.md section 5


def protocol_from(cfg, greedy: bool = False) -> Protocol:
    """The Protocol of any script's config: every Protocol field the config has (train_twice,
    audit, eval share the names); greedy sets T = 0 (evaluation)."""
    proto = Protocol(**{f.name: getattr(cfg, f.name) for f in fields(Protocol)
                        if hasattr(cfg, f.name)})
    if greedy:
        proto.temperature = 0.0
    return proto
