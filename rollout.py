"""Rollouts for TWICE: the Search-R1 episode protocol, keyed Gumbel-max sampling and twin episodes.

Protocol (DESIGN.md section 3, Search-R1 compatible byte for byte where it matters): one user message made of the
Search-R1 instruction and the question, chat-templated when the tokenizer has a template; each turn is one
generation that stops right after the first `</search>` or `</answer>`; the first `<search>`/`<answer>` of the
turn is the action; a search appends `\\n\\n<information>{docs}</information>\\n\\n`, an answer ends the episode,
anything else appends Search-R1's invalid-action message. Turns 0..max_turns-1 execute their action (Search-R1's
`max_turns` loop: at most max_turns searches); turn max_turns is the final turn, whose search is not executed.

Keyed sampling (DESIGN.md section 4): token v at position `pos` of turn `t` of an episode is drawn as
    y = argmax_v  l_v / T + g_v,   g_v = -log(-log u_v),   u_v = U(turn_key(episode_key, t), pos, v)
with U a counter-based hash (the splitmix64 stream seeded by mix(turn_key, pos), element v+1), so every row is a
pure function of its key: any episode regenerates alone, in any batch, with any left padding, on any device.
Twins (DESIGN.md section 5) replace one turn's key by alt_key(episode_key, t, j) and replay the factual keys after
it: D_t = U - U' (E[D_t | s_t, y_t] = Q(s_t, y_t) - V(s_t)).

Deviations (README "Deviations"; each tagged `# DEVIATION R<n>:` below):
  R1. An empty or whitespace-only search query is an invalid action (Search-R1 sends "" to the retriever).
  R2. Queries longer than `max_query_chars` are truncated before retrieval (Search-R1 sends them whole).
  R3. An episode whose context reaches `max_context` tokens ends there, scored on its response so far; observations
     are cut to fit (Search-R1 left-truncates the rolling context instead, which would change what later tokens
     condition on between a factual episode and its twin).
  R4. An EOS token stays in the response as sampled (loss mask 1); Search-R1's decode/re-encode drops it.
  R5. The reward and the recorded answer come from the agent's own sampled text, never observations.

Engine (issue 14, README-speed.md): each episode keeps its KV cache across turns, branches start from their parent's
cache, identical sequences share one decode row and stopped rows leave the batch (continuous batching); the plain
`model.generate` path stays as Protocol(engine="generate"). Deviations P1-P6 of README-speed.md are tagged below.

Launch: `python rollout.py bench` (keyed vs multinomial generation time, CPU or GPU); the episode loop is driven by
train_twice.py and audit.py.
"""
import argparse
import contextlib
import hashlib
import math
import re
import statistics
import string
import time
import weakref
from dataclasses import dataclass, field, fields

import numpy as np
import torch
from transformers import (GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria,
                          StoppingCriteriaList)

import credit

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
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


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
    action here (# DEVIATION R1: Search-R1 would send the empty string to the retriever).
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
    """The episode reward: exact match of the last answer in the agent's own text (finish() passes only the
    sampled turns, never observations: DEVIATION R5)."""
    return exact_match(extract_answer(response), golden_answers)


@dataclass
class Protocol:
    """Episode settings (DESIGN.md section 3; Search-R1 defaults)."""
    max_turns: int = 4            # turns that execute their action (so at most this many searches); one final turn
    topk: int = 3                 # documents per search
    max_new_tokens: int = 500     # sampled tokens per turn
    max_obs_tokens: int = 500     # observation (information block / invalid-action message) tokens, cut after this
    max_context: int = 4096       # prompt + response tokens; an episode that reaches it ends (DEVIATION R3)
    temperature: float = 1.0      # T; 0 = greedy (evaluation)
    top_p: float = 1.0            # nucleus mass kept before the noise; 1 = off
    top_k: int = 0                # most likely tokens kept before the noise; 0 = off
    gen_batch_size: int = 64      # rows per generate call (episodes sorted by context length, then chunked)
    max_query_chars: int = 1024   # a search query is cut to this many characters before retrieval (DEVIATION R2)
    fused_sampler: bool = False   # torch.compile the keyed sampler into one kernel (use on GPU; eager is reference)
    engine: str = "cached"        # "cached": KV reuse + continuous batching; "generate": model.generate per turn


def protocol_from(cfg, greedy: bool = False) -> Protocol:
    """The Protocol of any script's config: every Protocol field the config has (train_twice, audit, eval share
    the names); greedy sets T = 0 (evaluation)."""
    proto = Protocol(**{f.name: getattr(cfg, f.name) for f in fields(Protocol) if hasattr(cfg, f.name)})
    if greedy:
        proto.temperature = 0.0
    return proto


# --- keys (DESIGN.md section 4): integer mixing only, never Python's hash(), which is salted per process ---
M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # splitmix64 increment, 2^64 / golden ratio
FMIX = ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB), (31, None))  # splitmix64 finaliser (Steele et al. 2014)
U_BITS = 23  # u = (k + 1/2) / 2^23: exactly representable in float32, never 0 or 1, so g is finite (|g| < 17)
TURN_TAG, ALT_TAG, UNCOUPLED_TAG, MC_Q_TAG, MC_V_TAG = 0x7475726E, 0x616C74, 0x756E63, 0x6D6371, 0x6D6376  # ASCII
BRANCH_TAG = 0x6272616E  # "bran": the budget rule's branch draws, independent of every sampling key
# the baselines' extra rollouts (baselines.py, learned.py), ASCII like the tags above: "ind", "vine", "arpo", "tree"
INDEPENDENT_TAG, VINE_TAG, ARPO_TAG, TREE_TAG = 0x696E64, 0x76696E65, 0x6172706F, 0x74726565


def _fmix64(x: int) -> int:
    for shift, mult in FMIX:
        x ^= x >> shift
        if mult:
            x = x * mult & M64
    return x


def mix(*ints: int) -> int:
    """Unsigned 64-bit mix of integers (splitmix64 finaliser after each): order-sensitive, stable across runs."""
    h = 0
    for a in ints:
        h = _fmix64(((h ^ (a & M64)) + GOLDEN) & M64)
    return h


def stable_id(s: str) -> int:
    """Prompt uid from a string id (blake2b, 8 bytes): the same in every process, unlike hash()."""
    return int.from_bytes(hashlib.blake2b(s.encode("utf-8"), digest_size=8).digest(), "little")


def episode_key(run_seed: int, step: int, uid: int, line: int) -> int:
    return mix(run_seed, step, uid, line)  # line = index inside the GRPO group: lines get independent noise


def turn_key(ep_key: int, turn: int) -> int:
    return mix(ep_key, TURN_TAG, turn)


def alt_key(ep_key: int, turn: int, j: int) -> int:
    """Key of the j-th alternative decision at `turn`: independent of the factual turn's keys (DESIGN.md 5)."""
    return mix(ep_key, ALT_TAG, turn, j)


def fresh_key(ep_key: int, tag: int, *idx: int) -> int:
    """Seed of uncoupled noise (independent twins, Monte Carlo rollouts): turns then use turn_key(seed, turn)."""
    return mix(ep_key, tag, *idx)


def branch_uniform(*key: int) -> float:
    """Keyed uniform in [0, 1) of a budget-rule branch draw (decision t branches iff u < q_t), e.g. key =
    (run seed, step, uid, line, turn): reproducible, and independent of every sampling key."""
    return mix(*key, BRANCH_TAG) / 2.0 ** 64


def _signed(u: int) -> int:
    """uint64 -> the int64 with the same bits (torch has no usable uint64 arithmetic)."""
    u &= M64
    return u - (1 << 64) if u >> 63 else u


# --- keyed uniforms: int64 arithmetic wraps, so it is uint64 arithmetic bit for bit; shifts are made logical ---
_FMIX_T = tuple((shift, (1 << (64 - shift)) - 1, _signed(mult) if mult else None) for shift, mult in FMIX)
_WEYL = {}  # (vocab, device) -> (V,) int64 (v + 1) * GOLDEN


def _fmix64_(x, tmp, rounds=3):
    """splitmix64 finaliser in place on an int64 tensor (tmp: scratch of the same shape, or None)."""
    for shift, low, mult in _FMIX_T[:rounds]:
        tmp = torch.bitwise_right_shift(x, shift, out=tmp)
        x.bitwise_xor_(tmp.bitwise_and_(low))  # clear the sign-extended bits: logical shift
        if mult is not None:
            x.mul_(mult)
    return x


def _row_seeds(keys, pos):
    """mix(key, pos) for a (B,) int64 tensor of keys: the seed of the row's noise stream at position pos."""
    h = _fmix64_(keys + _signed(GOLDEN), None)
    return _fmix64_((h ^ pos) + _signed(GOLDEN), None)


def _weyl(vocab: int, device) -> torch.Tensor:
    key = (vocab, str(device))
    if key not in _WEYL:
        _WEYL[key] = torch.arange(1, vocab + 1, dtype=torch.int64, device=device).mul_(_signed(GOLDEN))
    return _WEYL[key]


def _stream_top_bits(seeds, weyl, x=None, tmp=None):
    """(B, V) signed top U_BITS bits of splitmix64 output v+1 of each row's stream, in [-2^22, 2^22).

    The finaliser's last xorshift (>> 31) leaves the top 31 bits unchanged, so two rounds give the same top bits.
    """
    x = _fmix64_(torch.add(seeds[:, None], weyl, out=x), tmp, rounds=2)
    return torch.bitwise_right_shift(x, 64 - U_BITS, out=tmp)  # arithmetic shift: the top bits, as a signed int


def _log_uniform_(k, out=None):
    """log u with u = (k + 2^22 + 1/2) / 2^23 (k from _stream_top_bits): every step exact in float32 but the log."""
    u = torch.mul(k, 2.0 ** -U_BITS, out=out) if out is None else out.copy_(k).mul_(2.0 ** -U_BITS)
    return u.add_(0.5 + 2.0 ** -(U_BITS + 1)).log_()


def keyed_uniform(row_keys, pos, vocab: int, device=None) -> torch.Tensor:
    """(B, V) float32 uniforms in (0, 1), a pure function of (row key, pos, v): U of DESIGN.md section 4.

    row_keys: B keys (python ints, uint64 values) or an int64 tensor; pos: int or (B,) tensor.
    """
    if not torch.is_tensor(row_keys):
        row_keys = torch.tensor([_signed(k) for k in row_keys], dtype=torch.int64, device=device)
    k = _stream_top_bits(_row_seeds(row_keys, pos), _weyl(vocab, row_keys.device))
    return k.float().mul_(2.0 ** -U_BITS).add_(0.5 + 2.0 ** -(U_BITS + 1))  # (B, V)


def gumbel_noise(u: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(u))


def keyed_gumbel_argmax(logits, row_keys, pos, temperature: float = 1.0) -> torch.Tensor:
    """The definition of a keyed draw (DESIGN.md section 4), written as its formula: the reference of the fast
    exponential race below (identical tokens, tested)."""
    return (logits / temperature + gumbel_noise(keyed_uniform(row_keys, pos, logits.shape[-1]))).argmax(-1)


def _keyed_race(l, seeds, weyl, e=None, x=None, tmp=None, f=None):
    """Keyed Gumbel-max on scaled, masked logits l (B, V), modified in place -> (token, log-prob, entropy), (B,).

    argmax_v l_v + g_v = argmax_v exp(l_v - m) / E_v with E_v = -log u_v ~ Exp(1) (the exponential race): the
    same draw, one log per element instead of two, and exp(l - m) is needed for the entropy anyway. Optional
    e/x/tmp/f are (B, V) scratch buffers (eager CPU: reusing them avoids page faults); torch.compile passes none.
    """
    m = l.amax(-1, keepdim=True)  # (B, 1)
    l.sub_(m).clamp_(min=torch.finfo(l.dtype).min)  # finite -inf masks keep 0 * log 0 = 0 in the entropy
    e = torch.exp(l, out=e)  # (B, V) unnormalised probabilities, max 1
    z = e.sum(-1)  # (B,)
    log_z = z.log()
    entropy = log_z - (e * l).sum(-1) / z
    log_u = _log_uniform_(_stream_top_bits(seeds, weyl, x, tmp), f)  # (B, V), < 0
    token = e.div_(log_u).argmin(-1)  # e / log u = -e / E: its minimum is the race winner
    logprob = l.gather(1, token[:, None]).squeeze(1) - log_z
    return token, logprob, entropy


_COMPILED = {}  # "race" -> torch.compile(_keyed_race): one fused kernel over (B, V), compiled on first use


def _mask_top_k_top_p(l, top_k: int, top_p: float):
    """Mask to -inf outside top-k, then outside the nucleus (transformers' TopK/TopPLogitsWarper, same order)."""
    if top_k > 0 and top_k < l.shape[-1]:
        l.masked_fill_(l < torch.topk(l, top_k).values[..., -1:], -math.inf)
    if top_p < 1.0:
        sorted_l, order = torch.sort(l, descending=False)
        drop = sorted_l.softmax(-1).cumsum(-1) <= 1 - top_p  # (B, V) in ascending order
        drop[..., -1:] = False  # keep at least the most likely token
        l.masked_fill_(drop.scatter(1, order, drop), -math.inf)
    return l


class KeyedGumbelProcessor(LogitsProcessor):
    """Keyed Gumbel-max sampling inside `model.generate(do_sample=False)` (DESIGN.md section 4).

    Row b's token at position pos of the turn (pos = generated length, never the padded length) is
    argmax_v l_v / T + g_v with masking (top-k, top-p) applied before the noise: an exact sample from softmax of the
    masked l / T. The processor draws it itself and returns the scores with +inf at that token, so greedy search picks
    it whatever it would do with ties (and no (B, V) write). T = 0 is greedy (no noise). It records, per row and step,
    the token's log-prob under the sampling distribution and the entropy of that distribution (at T = 0: those of
    softmax(logits)); finished rows (`rows`, set by TurnStopper) are skipped and record nan.
    """

    def __init__(self, turn_keys, start_len: int, temperature=1.0, top_k=0, top_p=1.0, fused=False):
        self.keys = turn_keys  # (B,) int64, the turn key of each row
        self.start_len = start_len  # input length of this generate call (prompt + padding)
        self.temperature, self.top_k, self.top_p, self.fused = temperature, top_k, top_p, fused
        self.rows = None  # (b,) indices of rows still generating; None = all
        self.logprobs, self.entropy = [], []  # one (B,) tensor per step
        self._buffers = None

    def __call__(self, input_ids, scores):  # (B, L), (B, V) float32, a copy owned by generate
        pos = input_ids.shape[1] - self.start_len
        rows = self.rows
        logits = scores if rows is None else scores.index_select(0, rows)  # (b, V)
        keys = self.keys if rows is None else self.keys.index_select(0, rows)
        token, logprob, entropy = self._draw(logits, keys, pos)
        if rows is None:
            rows = torch.arange(scores.shape[0], device=scores.device)
            self.logprobs.append(logprob)
            self.entropy.append(entropy)
        else:
            self.logprobs.append(torch.full_like(scores[:, 0], math.nan).index_copy_(0, rows, logprob))
            self.entropy.append(torch.full_like(scores[:, 0], math.nan).index_copy_(0, rows, entropy))
        scores[rows, token] = math.inf
        return scores

    def _draw(self, l, keys, pos):
        if self.temperature == 0:  # greedy: argmax of the logits, statistics of softmax(logits)
            token = l.argmax(-1)
            log_p = torch.log_softmax(l, -1)
            return token, log_p.gather(1, token[:, None]).squeeze(1), -(log_p.exp() * log_p.nan_to_num()).sum(-1)
        if self.temperature != 1:
            l.div_(self.temperature)
        _mask_top_k_top_p(l, self.top_k, self.top_p)
        seeds, weyl = _row_seeds(keys, pos), _weyl(l.shape[1], l.device)
        if self.fused:
            race = _COMPILED.setdefault("race", torch.compile(_keyed_race, dynamic=True))
            return race(l, seeds, weyl)
        return _keyed_race(l, seeds, weyl, *self._scratch(l))

    def _scratch(self, l):
        """(b, V) views of per-call buffers: e, x, tmp, f (allocated once, at the first step's full batch)."""
        if self._buffers is None or self._buffers[0].shape[0] < l.shape[0]:
            shape, dev = l.shape, l.device
            self._buffers = (torch.empty(shape, dtype=l.dtype, device=dev), torch.empty(shape, dtype=torch.int64,
                             device=dev), torch.empty(shape, dtype=torch.int64, device=dev), torch.empty_like(l))
        return tuple(buf[: l.shape[0]] for buf in self._buffers)

    def records(self):
        """(B, n) log-probs and entropies on the CPU."""
        if not self.logprobs:
            n = self.keys.shape[0]
            return torch.zeros(n, 0), torch.zeros(n, 0)
        return torch.stack(self.logprobs, 1).cpu(), torch.stack(self.entropy, 1).cpu()


_GT_TOKENS = weakref.WeakKeyDictionary()  # tokenizer -> {token id: its decoded text contains ">"}


class TurnStopper(StoppingCriteria):
    """Ends a row right after the first `</search>` / `</answer>` in the decoded text of its turn, at EOS, or at its
    own token budget; keeps TurnStopper.length / .reason per row and tells the processor which rows still run.

    Both stop strings end with ">", so a stop can only complete on a token whose text contains ">" (true for
    byte-level BPE, sentencepiece byte fallback, word-level): only then is the row's turn decoded, in full, so tags
    split across tokens are found exactly where the decoded text first contains them.
    """

    def __init__(self, tokenizer, start_len: int, budgets, eos_ids, processor=None):
        self.tokenizer, self.start_len, self.budgets, self.processor = tokenizer, start_len, list(budgets), processor
        self.eos_token_id = list(eos_ids)  # generate pads finished rows when a criterion has this attribute
        self.length, self.reason = [None] * len(budgets), [None] * len(budgets)
        self.live = list(range(len(budgets)))
        self.done = None
        try:
            self.gt = _GT_TOKENS.setdefault(tokenizer, {})
        except TypeError:  # tokenizer not weak-referenceable
            self.gt = {}

    def _has_gt(self, tok: int) -> bool:
        if tok not in self.gt:  # ids past the tokenizer (padded embedding rows, e.g. Qwen2.5) have no text
            self.gt[tok] = tok < len(self.tokenizer) and ">" in self.tokenizer.decode([tok], skip_special_tokens=False)
        return self.gt[tok]

    def _stops(self, row_ids) -> bool:
        text = self.tokenizer.decode(row_ids[self.start_len:].tolist(), skip_special_tokens=False)
        return any(s in text for s in STOP_STRINGS)

    def __call__(self, input_ids, scores, **kwargs):
        n = input_ids.shape[1] - self.start_len  # tokens generated so far
        last = input_ids[:, -1].tolist()
        ended = []
        for b in self.live:
            if self._has_gt(last[b]) and self._stops(input_ids[b]):
                self.reason[b] = "stop"
            elif last[b] in self.eos_token_id:
                self.reason[b] = "eos"
            elif n >= self.budgets[b]:
                self.reason[b] = "length"
            else:
                continue
            self.length[b] = n
            ended.append(b)
        if self.done is None:
            self.done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if ended:
            self.done[ended] = True
            self.live = [b for b in self.live if self.reason[b] is None]
            if self.processor is not None:
                self.processor.rows = torch.tensor(self.live, dtype=torch.long, device=input_ids.device)
        return self.done.clone()


# --- records ---
@dataclass
class Turn:
    """One generation turn: ids[start:end] sampled (mask 1), ids[obs_start:obs_end] its observation (mask 0)."""
    start: int
    end: int
    obs_start: int
    obs_end: int
    text: str               # decoded sampled text
    action: str | None      # "search" | "answer" | None (invalid)
    content: str            # stripped query / answer
    doc_ids: tuple          # retrieved document ids, in rank order (empty unless a search was executed)
    logprobs: list          # per sampled token, under the sampling distribution
    entropy: list           # per sampled token, of softmax(masked logits / T)
    key: int                # the turn key its noise was drawn with
    stop: str               # "stop" | "eos" | "length"


@dataclass
class Episode:
    """One episode (or a branch of one). Its noise keys are fully described by key, key_overrides and fresh_*."""
    uid: int                # stable_id(question id)
    line: int               # index inside the GRPO group
    key: int                # episode_key(run_seed, step, uid, line)
    question: str
    golden_answers: list
    prompt_ids: list
    ids: list = field(default_factory=list)    # response: sampled + observation tokens, after the prompt
    mask: list = field(default_factory=list)   # 1 sampled / 0 observation
    turns: list = field(default_factory=list)
    answer: str | None = None
    reward: float = 0.0
    done: bool = False
    n_generated: int = 0    # tokens sampled by this record (a branch counts from its branch point)
    key_overrides: dict = field(default_factory=dict)  # turn -> key (a twin's alternative turn)
    fresh_seed: int | None = None  # uncoupled: turns >= fresh_from use turn_key(fresh_seed, turn)
    fresh_from: int = 0
    branch_turn: int | None = None  # the turn this record branched at (None: factual)

    def key_for(self, turn: int) -> int:
        if turn in self.key_overrides:
            return self.key_overrides[turn]
        if self.fresh_seed is not None and turn >= self.fresh_from:
            return turn_key(self.fresh_seed, turn)
        return turn_key(self.key, turn)


@dataclass
class Generation:
    """A sampled turn before its action is executed."""
    ids: list
    logprobs: list
    entropy: list
    stop: str
    key: int


def _encode(tokenizer, text: str, chat: bool) -> list:
    return tokenizer(text, add_special_tokens=not chat)["input_ids"]  # a chat template already holds any BOS


def start_episodes(tokenizer, questions, run_seed: int, step: int, group_size: int = 1) -> list:
    """G = group_size lines per question (dicts with id, question, golden_answers), keyed by (seed, step, uid, line)."""
    chat = bool(getattr(tokenizer, "chat_template", None))
    episodes = []
    for i, q in enumerate(questions):
        missing = [k for k in ("id", "question", "golden_answers") if k not in q]
        if missing:
            raise ValueError(f"question {i}: missing field(s) {missing}")
        uid, gold = stable_id(str(q["id"])), q["golden_answers"]
        if q.get("occurrence"):  # the same row twice in one step (epoch wrap): distinct keys for each occurrence
            uid = mix(uid, q["occurrence"])
        prompt = _encode(tokenizer, render_prompt(tokenizer, q["question"]), chat)
        for line in range(group_size):
            episodes.append(Episode(uid=uid, line=line, key=episode_key(run_seed, step, uid, line),
                                    question=q["question"], golden_answers=[gold] if isinstance(gold, str) else
                                    list(gold), prompt_ids=list(prompt)))
    return episodes


def step_prompts(rows: list, prompts_per_step: int, seed: int, step: int, rank: int = 0, world: int = 1) -> list:
    """This rank's share of the step's prompts: epoch-wise permutations seeded by mix(seed, epoch), so any step's
    batch is known without replaying the run (exact resume). A row drawn twice in one step (epoch wrap on small data)
    carries its occurrence number, so its two groups get different keys."""
    n, k0 = len(rows), step * prompts_per_step
    perms, batch, seen = {}, [], {}
    for k in range(k0, k0 + prompts_per_step):
        epoch, i = divmod(k, n)
        if epoch not in perms:
            perms[epoch] = np.random.default_rng(mix(seed, epoch)).permutation(n)
        row = rows[perms[epoch][i]]
        seen[id(row)] = seen.get(id(row), -1) + 1
        batch.append(dict(row, occurrence=seen[id(row)]) if seen[id(row)] else row)
    return batch[rank::world]


def _special_ids(model, tokenizer):
    """(eos ids, pad id): EOS from the tokenizer and the model's generation config (Qwen2.5 chat: <|im_end|>)."""
    eos = set()
    for src in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        eos.update([src] if isinstance(src, int) else (src or []))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos, default=0)
    return sorted(eos), pad


@contextlib.contextmanager
def _plain_generation_config(model):
    """generate() fills every unset field from model.generation_config (Qwen2.5-Instruct sets repetition_penalty,
    top_k, ...), and such processors would silently change the keyed draw: swap in a blank config meanwhile."""
    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


def _generate_chunk(model, tokenizer, contexts, keys, budgets, proto) -> list:
    """One left-padded generate call -> a Generation per row, its ids exactly as sampled."""
    eos, pad = _special_ids(model, tokenizer)
    n, width = len(contexts), max(map(len, contexts))
    input_ids = torch.full((n, width), pad, dtype=torch.long)  # (B, L)
    attention = torch.zeros((n, width), dtype=torch.long)
    for b, ctx in enumerate(contexts):
        input_ids[b, width - len(ctx):] = torch.tensor(ctx, dtype=torch.long)
        attention[b, width - len(ctx):] = 1
    device = model.device
    proc = KeyedGumbelProcessor(torch.tensor([_signed(k) for k in keys], device=device), width, proto.temperature,
                                proto.top_k, proto.top_p, proto.fused_sampler)
    stopper = TurnStopper(tokenizer, width, budgets, eos, proc)
    config = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max(budgets), eos_token_id=eos or None,
                              pad_token_id=pad, use_cache=True)
    with _plain_generation_config(model), torch.no_grad():
        out = model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                             generation_config=config, logits_processor=LogitsProcessorList([proc]),
                             stopping_criteria=StoppingCriteriaList([stopper]))
    new = out[:, width:].cpu()  # (B, n_steps)
    COUNTS["positions"] += n * (width + max(new.shape[1] - 1, 0))  # prefill, then one column per decode step
    COUNTS["row_steps"] += n * new.shape[1]
    COUNTS["tokens"] += sum(stopper.length)
    logprobs, entropy = proc.records()
    gens = []
    for b in range(n):
        k = stopper.length[b]
        assert k is not None and k <= new.shape[1], f"row {b}: generation ended without a stop reason"
        gens.append(Generation(new[b, :k].tolist(), logprobs[b, :k].tolist(), entropy[b, :k].tolist(),
                               stopper.reason[b], keys[b]))
    return gens


def generate_turn(model, tokenizer, episodes, proto) -> list:
    """Sample the next turn of every episode (none may be done): the cached engine for a transformers model (below),
    else (proto.engine = "generate", or any object with only `generate`) left-padded generate calls in chunks of
    gen_batch_size, each re-prefilling its whole context."""
    if _cached_engine(model, proto):
        return _generate_cached(model, tokenizer, episodes, proto)
    order = sorted(range(len(episodes)), key=lambda i: len(episodes[i].prompt_ids) + len(episodes[i].ids))
    gens = [None] * len(episodes)
    for c in range(0, len(order), proto.gen_batch_size):
        chunk = order[c:c + proto.gen_batch_size]  # similar lengths together: less padding
        eps = [episodes[i] for i in chunk]
        contexts = [ep.prompt_ids + ep.ids for ep in eps]
        budgets = [min(proto.max_new_tokens, proto.max_context - len(ctx)) for ctx in contexts]
        assert min(budgets) > 0, "an episode without room for a token should have ended"
        keys = [ep.key_for(len(ep.turns)) for ep in eps]
        for i, g in zip(chunk, _generate_chunk(model, tokenizer, contexts, keys, budgets, proto)):
            gens[i] = g
    return gens


# --- the cached engine (issue 14): every context token goes through the model once per episode ---
# Each episode keeps the KV cache of its context (ep._kv: a KVEntry); a turn feeds only what the cache lacks (the
# previous turn's last token and the observation), identical contexts in a call (a group's prompt) are prefilled
# once, a branch starts from its parent's cache, and rows leave the decode batch as they finish while waiting rows
# take their slots (continuous batching). Noise keys are (turn key, position in turn): no token depends on this.
# bench.py's cost measures, summed over both engines since the last reset: body positions (padding included), of
# which padding; sampling row-steps; sampled tokens; LM-head-only positions (rows repeating a cache's own tokens)
COUNTS = {"positions": 0, "padding": 0, "row_steps": 0, "tokens": 0, "head_only": 0}


@dataclass
class KVEntry:
    """The KV cache of one token sequence: per layer (keys, values), each (1, H, len(ids), D), and the final hidden
    state (the LM head's input) at each position, (len(ids), hidden): a row that samples this sequence's own tokens
    again (a self-twin, a twin's shared first tokens) reads its logits off it without running the model."""
    ids: list
    kv: list
    hidden: object


def _cached_engine(model, proto) -> bool:
    from transformers import PreTrainedModel
    return proto.engine == "cached" and isinstance(model, PreTrainedModel)


def _usable(ep, ctx):
    """(entry, n): ep's cached entry and how many leading tokens of ctx it covers (at most len(ctx) - 1: the last
    context token is fed in the first decode step, which gives the first logits)."""
    entry = getattr(ep, "_kv", None)
    if entry is None:
        return None, 0
    n = min(len(entry.ids), len(ctx) - 1)
    if entry.ids[:n] != ctx[:n]:
        same = np.asarray(entry.ids[:n]) == np.asarray(ctx[:n])
        n = int(same.argmin())
    return entry, n


def _forward(model, ids, mask, pos, cache):
    """The model's own forward (a subclass may change its logits) over (b, S) new tokens on top of `cache` (updated
    in place) -> (logits of the last position (b, V) float32, final hidden states (b, S, hidden) or None when the
    model cannot be read that way). Padding: mask 0 (left of the cache, right of the new tokens)."""
    seen = []
    norm = getattr(model.base_model, "norm", None) if _can_track(model) else None
    hook = norm.register_forward_hook(lambda mod, args, out: seen.append(out)) if norm is not None else None
    try:
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                    logits_to_keep=1)
    finally:
        if hook is not None:
            hook.remove()
    COUNTS["positions"] += ids.numel()
    return out.logits[:, -1].float(), (seen[-1] if seen else None)


def _can_track(model) -> bool:
    """Logits = LM head(final norm output) holds for a transformers causal LM whose forward is the library's own;
    only then may a row read logits off stored hidden states."""
    forward = type(model).forward
    return forward.__module__.startswith("transformers.") and hasattr(model.base_model, "norm")


def _logits(model, hidden):
    """(n, V) float32 logits of (n, hidden) final hidden states: the model's own LM head, as its forward applies it."""
    return model.get_output_embeddings()(hidden).float()


def _stack_rows(rows, width):
    """Per-layer (keys, values) (b, H, width, D) of KVEntry slices (entry, n), left-padded with zeros."""
    first = next(entry for entry, n in rows if n).kv  # width > 0: some row has a cache
    layers = []
    for i in range(len(first)):
        k0 = first[i][0]
        ks = k0.new_zeros((len(rows), k0.shape[1], width, k0.shape[3]))
        vs = torch.zeros_like(ks)
        for b, (entry, n) in enumerate(rows):
            if n:
                ks[b, :, width - n:] = entry.kv[i][0][0, :, :n]
                vs[b, :, width - n:] = entry.kv[i][1][0, :, :n]
        layers.append((ks, vs))
    return layers


def _row_entry(cache, hidden, b, start, end, ids):
    return KVEntry(ids, [(layer.keys[b:b + 1, :, start:end].clone(), layer.values[b:b + 1, :, start:end].clone())
                         for layer in cache.layers], None if hidden is None else hidden[b, start:end].clone())


def _stack_hidden(rows, width):
    """(b, width, hidden) of KVEntry hidden states (entry, n), left-padded with zeros."""
    h0 = next(entry for entry, n in rows if n).hidden
    out = h0.new_zeros((len(rows), width, h0.shape[-1]))
    for b, (entry, n) in enumerate(rows):
        if n:
            out[b, width - n:] = entry.hidden[:n]
    return out


def _prefill(model, episodes, contexts, proto, pad):
    """Give every episode a KVEntry of its context but the last token: the missing suffix only, rows with the same
    context computed once, in buckets of similar suffix length (little padding)."""
    todo = {}
    for ep, ctx in zip(episodes, contexts):
        entry, n = _usable(ep, ctx)
        if n < len(ctx) - 1:
            todo.setdefault(tuple(ctx[:-1]), []).append((ep, entry, n))
        else:
            ep._kv = entry
    _shared_head(model, todo, pad)
    jobs = sorted(todo.items(), key=lambda kv: len(kv[0]) - kv[1][0][2])  # by suffix length
    bucket = []
    for job in jobs + [None]:
        suffix = None if job is None else len(job[0]) - job[1][0][2]
        if bucket and (job is None or len(bucket) == proto.gen_batch_size or suffix > 1.25 * bucket[0][2] + 8):
            _prefill_bucket(model, bucket, pad)
            bucket = []
        if job is not None:
            bucket.append((job[0], job[1], suffix))


def _shared_head(model, todo, pad, least=16):
    """Fresh contexts (no cache yet: different questions behind one instruction) share their longest common prefix:
    computed once, it becomes their starting cache."""
    fresh = [ctx for ctx, eps in todo.items() if eps[0][1] is None]
    if len(fresh) < 2:
        return
    lcp = min(len(c) for c in fresh)
    first = fresh[0]
    for ctx in fresh[1:]:
        lcp = next((k for k in range(lcp) if ctx[k] != first[k]), lcp)
    lcp = min(lcp, min(len(c) for c in fresh) - 1)  # every context keeps a suffix of its own
    if lcp < least:
        return
    holder = argparse.Namespace(_kv=None)
    _prefill_bucket(model, [(first[:lcp], [(holder, None, 0)], lcp)], pad)
    for ctx in fresh:
        todo[ctx] = [(ep, holder._kv, lcp) for ep, _, _ in todo[ctx]]


def _prefill_bucket(model, bucket, pad):
    """One forward: row b = [left pad][its cached n_b][its suffix][right pad]; positions 0.. over the real tokens."""
    dev = model.device
    heads = [(eps[0][1], eps[0][2]) for _, eps, _ in bucket]  # (entry, n) of the first episode of each context
    width, span = max(n for _, n in heads), max(s for _, _, s in bucket)
    ids = torch.full((len(bucket), span), pad, dtype=torch.long)
    mask = torch.zeros((len(bucket), width + span), dtype=torch.long)
    pos = torch.zeros((len(bucket), span), dtype=torch.long)
    for b, ((ctx, _, s), (_, n)) in enumerate(zip(bucket, heads)):
        ids[b, :s] = torch.tensor(ctx[n:], dtype=torch.long)
        mask[b, width - n:width + s] = 1
        pos[b, :s] = torch.arange(n, n + s)
    from transformers import DynamicCache
    cache = DynamicCache(ddp_cache_data=_stack_rows(heads, width)) if width else DynamicCache()
    _, hidden = _forward(model, ids.to(dev), mask.to(dev), pos.to(dev), cache)  # hidden (b, span, H) or None
    COUNTS["padding"] += len(bucket) * span - sum(s for _, _, s in bucket)
    if width and hidden is not None:
        hidden = torch.cat([_stack_hidden(heads, width), hidden], 1)
    for b, ((ctx, eps, s), (_, n)) in enumerate(zip(bucket, heads)):
        entry = _row_entry(cache, hidden, b, width - n, width + s, list(ctx))
        for ep, _, _ in eps:
            ep._kv = entry  # shared, never written: a later turn makes a new entry


@dataclass
class _Row:
    """A row of the decode batch: its episode's context, key, budget and what it sampled so far."""
    i: int
    ctx: list
    key: int
    budget: int
    ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    entropy: list = field(default_factory=list)
    p: int = 0              # its physical row in the decode batch (_Batch)
    track: tuple | None = None  # (KVEntry, m): its sequence is the entry's first m tokens (no physical row)
    q: int = 0              # its row among the tracking logits


def _pad_left(t, width, dim):
    extra = width - t.shape[dim]
    if extra == 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t.new_zeros(shape), t], dim)


def _admit(model, batch, parts):
    """Join new physical rows, parts = (KVEntry, n) caching n tokens, to the batch: both padded on the left."""
    width = max(n for _, n in parts)
    mask = torch.zeros((len(parts), width), dtype=torch.long, device=model.device)
    for b, (_, n) in enumerate(parts):
        mask[b, width - n:] = 1
    layers = _stack_rows(parts, width)
    hidden = _stack_hidden(parts, width) if _can_track(model) else None
    if batch.cache is not None:
        width = max(width, batch.mask.shape[1])
        layers = [tuple(torch.cat([_pad_left(old, width, 2), _pad_left(add, width, 2)]) for old, add in
                        zip((layer.keys, layer.values), kv)) for layer, kv in zip(batch.cache.layers, layers)]
        mask = torch.cat([_pad_left(batch.mask, width, 1), _pad_left(mask, width, 1)])
        if hidden is not None:
            hidden = torch.cat([_pad_left(batch.hid, width, 1), _pad_left(hidden, width, 1)])
    from transformers import DynamicCache
    batch.cache, batch.mask, batch.hid = DynamicCache(ddp_cache_data=layers), mask, hidden


def _row_stop(stopper, row, tok: int):
    """TurnStopper's rule for one row after it sampled tok: a stop string, EOS, or its budget (that order)."""
    if stopper._has_gt(tok) and any(s in stopper.tokenizer.decode(row.ids, skip_special_tokens=False)
                                    for s in STOP_STRINGS):
        return "stop"
    if tok in stopper.eos_token_id:
        return "eos"
    return "length" if len(row.ids) >= row.budget else None


class _Batch:
    """The physical decode batch: one cache row per distinct sequence. Logical rows (episodes) with the same context
    and the same tokens so far share a physical row (a group's identical lines, twins of identical states) and fork
    when their keyed draws differ, so each distinct position goes through the model once. hid (P, W, hidden): the
    final hidden state at every cached position (what a finished row's KVEntry keeps)."""

    def __init__(self):
        self.cache = self.mask = self.hid = None
        self.tok, self.pos, self.seen = [], [], {}  # per physical row: next token, its position; dedup keys

    def add(self, model, rows):
        """Physical rows for rows = [(row, dedup key, KVEntry, n cached, next token)], one per distinct key."""
        parts = []
        for r, key, entry, n, tok in rows:
            if key not in self.seen:
                self.seen[key] = len(self.tok)
                self.tok.append(tok)
                self.pos.append(n)
                parts.append((entry, n))
            r.p, r.track = self.seen[key], None
        if parts:
            _admit(model, self, parts)

    def logits(self, model):
        """(P, V) float32 logits of every physical row's next position (one body position each)."""
        if not self.tok:
            return None
        dev = model.device
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.tok), 1))], 1)
        logits, hidden = _forward(model, torch.tensor(self.tok, device=dev)[:, None], self.mask,
                                  torch.tensor(self.pos, device=dev)[:, None], self.cache)  # hidden (P, 1, H)
        if hidden is not None:
            self.hid = torch.cat([self.hid, hidden], 1)
        return logits

    def regroup(self, live):
        """Physical rows for the physical rows still decoding: one per (parent row, sampled token)."""
        rows, src, tok, pos = {}, [], [], []
        for r in live:
            key = (r.p, r.ids[-1])
            if key not in rows:
                rows[key] = len(src)
                src.append(r.p)
                tok.append(r.ids[-1])
                pos.append(self.pos[r.p] + 1)
            r.p = rows[key]
        if not src:  # nothing left: the next admission starts a new cache
            self.cache = self.mask = self.hid = None
        elif src != list(range(len(self.tok))):
            idx = torch.tensor(src, dtype=torch.long, device=self.mask.device)
            self.cache.batch_select_indices(idx)
            self.mask, self.hid = self.mask[idx], None if self.hid is None else self.hid[idx]
        self.tok, self.pos, self.seen = tok, pos, {}


def _start(episodes, r):
    """A waiting row: tracking its cache's own tokens when the cache already covers its whole context (a branch
    from a longer episode), else (dedup key, entry, n, token) of a physical row feeding its last context token."""
    entry, m = episodes[r.i]._kv, len(r.ctx)
    if entry.hidden is not None and len(entry.ids) >= m and entry.ids[m - 1] == r.ctx[-1]:
        r.track = (entry, m)  # _prefill checked the first m - 1 tokens
        return None
    return (r, tuple(r.ctx), entry, m - 1, r.ctx[-1])


def _track_logits(model, rows):
    """(Q, V) logits of tracking rows, one per distinct (entry, length): the LM head on stored hidden states."""
    index, states = {}, []
    for r in rows:
        entry, m = r.track
        if (id(entry), m) not in index:
            index[id(entry), m] = len(states)
            states.append(entry.hidden[m - 1])
        r.q = index[id(entry), m]
    COUNTS["head_only"] += len(states)
    return _logits(model, torch.stack(states)) if states else None


def _decode(model, tokenizer, episodes, rows, proto, eos) -> list:
    """Continuous batching: at most gen_batch_size rows decode together; a row leaves the batch the step it stops
    (its cache kept as its episode's KVEntry) and a waiting row takes the slot. Rows with identical sequences share
    one physical row (_Batch); a row whose tokens repeat its cache's own (a twin's first tokens) runs no model
    position until it diverges.
    DEVIATION P5: slots refill within one turn's call only; turns stay a barrier (retrieval is batched per turn)."""
    # DEVIATION P6: the keyed draw (the processor's own _draw: same noise, same law) runs in this loop rather than
    # inside model.generate (DESIGN.md 4), which can neither drop and refill rows nor start from kept caches.
    proc = KeyedGumbelProcessor(None, 0, proto.temperature, proto.top_k, proto.top_p, proto.fused_sampler)
    stopper = TurnStopper(tokenizer, 0, [r.budget for r in rows], eos)
    queue, live, batch, gens = list(rows), [], _Batch(), [None] * len(episodes)
    dev = model.device
    while queue or live:
        if queue and len(live) < proto.gen_batch_size:
            new, queue = queue[:proto.gen_batch_size - len(live)], queue[proto.gen_batch_size - len(live):]
            batch.add(model, [p for p in (_start(episodes, r) for r in new) if p is not None])
            live += new
        phys = batch.logits(model)  # (P, V) or None
        tracking = [r for r in live if r.track is not None]
        track = _track_logits(model, tracking)
        n_phys = 0 if phys is None else phys.shape[0]
        logits = torch.cat([x for x in (phys, track) if x is not None])
        src = torch.tensor([r.p if r.track is None else n_phys + r.q for r in live], device=dev)
        COUNTS["row_steps"] += len(live)
        COUNTS["tokens"] += len(live)
        keys = torch.tensor([_signed(r.key) for r in live], device=dev)
        steps = torch.tensor([len(r.ids) for r in live], device=dev)
        # DEVIATION P1: the logits come from cached keys/values, not a full re-prefill: equal up to float rounding,
        # so a draw at an exact near-tie (|gap| ~ 1e-6) could differ from the generate path; none did in tests/bench.
        token, logprob, entropy = proc._draw(logits.index_select(0, src), keys, steps)
        keep, diverged = [], []
        for r, tok, lp, ent in zip(live, token.tolist(), logprob.tolist(), entropy.tolist()):
            r.ids.append(tok)
            r.logprobs.append(lp)
            r.entropy.append(ent)
            stop = _row_stop(stopper, r, tok)
            if stop is not None:
                _finish_row(episodes, batch, r)
                gens[r.i] = Generation(r.ids, r.logprobs, r.entropy, stop, r.key)
            elif r.track is None:
                keep.append(r)
            else:
                entry, m = r.track
                if m < len(entry.ids) and entry.ids[m] == tok:
                    r.track = (entry, m + 1)
                else:  # a token of its own: from here on it needs the model
                    diverged.append((r, tuple(entry.ids[:m]) + (tok,), entry, m, tok))  # key: the sequence
        batch.regroup(keep)
        batch.add(model, diverged)
        live = [r for r in live if gens[r.i] is None]
    return gens


def _finish_row(episodes, batch, r):
    """A stopped row's KVEntry: its context and every sampled token but the last."""
    if r.track is not None:  # its tokens are its cache's own: that entry covers them
        episodes[r.i]._kv = r.track[0]
        return
    n, width = len(r.ctx) + len(r.ids) - 1, batch.mask.shape[1]
    # DEVIATION P3: the entry lives as long as the episode object (twins need it after the rollout); at 3B it is
    # ~36 KB per token in bf16 (+ 4 KB of hidden state), no offload to the host.
    episodes[r.i]._kv = _row_entry(batch.cache, batch.hid, r.p, width - n, width, r.ctx + r.ids[:-1])


def _generate_cached(model, tokenizer, episodes, proto) -> list:
    """generate_turn with the cached engine (same tokens as _generate_chunk: keyed noise, same stop rule)."""
    eos, pad = _special_ids(model, tokenizer)
    contexts = [ep.prompt_ids + ep.ids for ep in episodes]
    order = sorted(range(len(episodes)), key=lambda i: len(contexts[i]))  # similar cache widths decode together
    rows = [_Row(i, contexts[i], episodes[i].key_for(len(episodes[i].turns)),
                 min(proto.max_new_tokens, proto.max_context - len(contexts[i]))) for i in order]
    assert min(r.budget for r in rows) > 0, "an episode without room for a token should have ended"
    with torch.no_grad():
        _prefill(model, episodes, contexts, proto, pad)
        return _decode(model, tokenizer, episodes, rows, proto, eos)


def _format_docs(docs) -> str:
    from retriever import format_docs  # lazy: the retriever module brings its encoder / FAISS dependencies
    return format_docs(docs)


def _add_turn(ep, gen, tokenizer) -> Turn:
    """Append a sampled turn (mask 1) and parse its first action."""
    text = tokenizer.decode(gen.ids, skip_special_tokens=False)
    action, content = parse_action(text)
    start = len(ep.ids)
    turn = Turn(start, start + len(gen.ids), start + len(gen.ids), start + len(gen.ids), text, action, content, (),
                gen.logprobs, gen.entropy, gen.key, gen.stop)
    ep.ids += gen.ids  # DEVIATION R4: an EOS ending the turn stays, as sampled (Search-R1's re-encode drops it)
    ep.mask += [1] * len(gen.ids)
    ep.n_generated += len(gen.ids)
    ep.turns.append(turn)
    return turn


def _add_observation(ep, turn, tokenizer, text: str, proto):
    """Observation tokens (mask 0), tokenised alone and cut to max_obs_tokens (Search-R1 max_obs_length)."""
    room = proto.max_context - len(ep.prompt_ids) - len(ep.ids)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max(0, min(proto.max_obs_tokens, room))]
    turn.obs_start, turn.obs_end = len(ep.ids), len(ep.ids) + len(ids)
    ep.ids += ids
    ep.mask += [0] * len(ids)


def agent_text(ep) -> str:
    """What the agent itself wrote: its sampled turns, without any observation or invalid-action message."""
    return "".join(turn.text for turn in ep.turns)


def finish(ep, tokenizer):
    """End the episode: answer and reward from the agent's own text (the training reward is the evaluation's).

    DEVIATION R5: Search-R1 scores prompt + response, so an `<answer>` inside a retrieved document or the
    invalid-action message ("... between <answer> and </answer> ...") counts as the agent's answer; here only
    sampled tokens do (tested: neither can earn a reward or be recorded as the answer)."""
    text = agent_text(ep)
    ep.answer, ep.reward, ep.done = extract_answer(text), reward(text, ep.golden_answers), True


def execute_turn(tokenizer, retriever, episodes, gens, proto):
    """Append each sampled turn and execute its action; searches of all episodes go to the retriever at once."""
    searches = []
    for ep, gen in zip(episodes, gens):
        turn = _add_turn(ep, gen, tokenizer)
        if turn.action == "answer" or len(ep.turns) > proto.max_turns:  # the final turn executes nothing
            finish(ep, tokenizer)
        elif turn.action == "search":
            searches.append((ep, turn))
        else:
            _add_observation(ep, turn, tokenizer, INVALID_ACTION_MSG, proto)
    if searches:
        # DEVIATION R2: an over-long query is cut to max_query_chars before retrieval.
        docs = retriever.search([turn.content[:proto.max_query_chars] for _, turn in searches], topk=proto.topk)
        for (ep, turn), hits in zip(searches, docs):
            turn.doc_ids = tuple(str(d["id"]) for d in hits)
            _add_observation(ep, turn, tokenizer, information_block(_format_docs(hits)), proto)
    for ep in episodes:
        if not ep.done and len(ep.prompt_ids) + len(ep.ids) >= proto.max_context:
            finish(ep, tokenizer)  # DEVIATION R3: the context is full: the episode ends, no left truncation


def step_turn(model, tokenizer, retriever, episodes, proto):
    """One turn for every episode not done: batched keyed generation, then the actions."""
    live = [ep for ep in episodes if not ep.done]
    for ep in live:
        if proto.max_context - len(ep.prompt_ids) - len(ep.ids) <= 0:  # e.g. a prompt longer than max_context
            finish(ep, tokenizer)
    live = [ep for ep in live if not ep.done]
    if live:
        execute_turn(tokenizer, retriever, live, generate_turn(model, tokenizer, live, proto), proto)
    return episodes


def run_episodes(model, tokenizer, retriever, episodes, proto):
    """Step all episodes until every one is done (at most max_turns + 1 turns each)."""
    while any(not ep.done for ep in episodes):
        step_turn(model, tokenizer, retriever, episodes, proto)
    return episodes


# --- twins and Monte Carlo continuations (DESIGN.md section 5) ---
def branch(ep, turn: int, include_turn=False, key_overrides=None, fresh_seed=None) -> Episode:
    """A new episode in state s_t (the factual prefix before `turn`), or after it with include_turn.

    Keys: the parent's for the kept turns; key_overrides on top; with fresh_seed, every turn from the branch point on
    (turn, or turn + 1 with include_turn) not overridden uses turn_key(fresh_seed, t).
    """
    if not 0 <= turn < len(ep.turns):
        raise ValueError(f"branch: turn {turn} outside the episode's {len(ep.turns)} turns")
    cut = ep.turns[turn].obs_end if include_turn else ep.turns[turn].start
    start = turn + int(include_turn)
    overrides = {t: k for t, k in ep.key_overrides.items() if t < start}
    overrides.update(key_overrides or {})
    new = Episode(uid=ep.uid, line=ep.line, key=ep.key, question=ep.question, golden_answers=ep.golden_answers,
                  prompt_ids=ep.prompt_ids, ids=ep.ids[:cut], mask=ep.mask[:cut], turns=list(ep.turns[:start]),
                  key_overrides=overrides, fresh_seed=ep.fresh_seed if fresh_seed is None else fresh_seed,
                  fresh_from=ep.fresh_from if fresh_seed is None else start, branch_turn=turn)
    new._kv = getattr(ep, "_kv", None)  # the cached engine starts the branch from its parent's cache
    if include_turn and start == len(ep.turns) and ep.done:  # the turn ended the episode: nothing left to sample
        new.answer, new.reward, new.done = ep.answer, ep.reward, True
    return new


@dataclass
class Decisions:
    """Every (episode, turn) decision of a batch, the budget rule's inputs (DESIGN.md section 5)."""
    index: list             # (episode i, turn t) pairs, episode-major
    features: object        # (n, F) discordance-predictor features (credit.featurize)
    cost: object            # (n,) c_t: tokens of y_t and of every factual token sampled after it


def decision_table(episodes, group_success) -> Decisions:
    """c_t counts what a twin from s_t is predicted to generate: y_t and the factual turns after it."""
    index, cost = [], []
    cols = {k: [] for k in ("turn", "action", "entropy", "group_success", "outcome", "turns_remaining")}
    for i, ep in enumerate(episodes):
        for t, turn in enumerate(ep.turns):
            index.append((i, t))
            cols["turn"].append(t)
            cols["action"].append(turn.action)
            cols["entropy"].append(float(np.mean(turn.entropy)) if turn.entropy else 0.0)
            cols["group_success"].append(group_success[i])
            cols["outcome"].append(ep.reward)
            cols["turns_remaining"].append(len(ep.turns) - 1 - t)
            cost.append(max(1, sum(u.end - u.start for u in ep.turns[t:])))
    return Decisions(index, credit.featurize(**cols), np.asarray(cost, dtype=np.float64))


@dataclass
class TwinResult:
    request: int        # index into run_twins' requests
    turn: int           # t
    j: int              # alternative index
    kind: str           # "self" | "same_evidence" | "rollout"
    outcome: float      # U' (the factual U when not rolled out)
    diff: float         # D_t = U - U'
    tokens: int         # tokens generated: the alternative turn + the continuation
    twin: Episode


def _same_evidence(factual: Turn, alt: Turn) -> bool:
    return factual.action == alt.action == "search" and bool(alt.doc_ids) and alt.doc_ids == factual.doc_ids


def run_twins(model, tokenizer, retriever, requests, proto, coupling=True, same_evidence_shortcut=True,
              independent=False) -> list:
    """Twin of each (finished episode, turn t, j), all batched: y' ~ pi(. | s_t) with alt_key(key, t, j), then
    the factual keys for every later (turn, pos) (coupling) or fresh ones. Self-twins (y' == y_t token for token)
    and, with the shortcut, searches retrieving the same ids in the same order take D = 0 without a rollout.

    independent=True is the textbook independent counterfactual (method=independent): y' and every later turn use
    turn_key(fresh_key(key, INDEPENDENT_TAG, t, j), turn), every twin is rolled out (a self-twin too: its future
    noise is fresh, so it is not the factual episode) and the shortcut is off. coupling=False alone keeps the old
    ablation, which still scores self-twins and shortcuts as D = 0 (a coupled outcome).
    """
    twins = []
    for i, (ep, t, j) in enumerate(requests):
        if not ep.done:
            raise ValueError(f"request {i}: twins branch from finished episodes")
        if independent:
            twins.append(branch(ep, t, fresh_seed=fresh_key(ep.key, INDEPENDENT_TAG, t, j)))
            continue
        fresh = None if coupling else fresh_key(ep.key, UNCOUPLED_TAG, t, j)
        twins.append(branch(ep, t, key_overrides={t: alt_key(ep.key, t, j)}, fresh_seed=fresh))
    gens = generate_turn(model, tokenizer, twins, proto) if twins else []
    kinds, live = [], []
    for (ep, t, _), twin, gen in zip(requests, twins, gens):
        fact = ep.turns[t]
        if gen.ids == ep.ids[fact.start:fact.end] and not independent:
            _add_turn(twin, gen, tokenizer)
            kinds.append("self")
        else:
            live.append((twin, gen))
            kinds.append("rollout")
    execute_turn(tokenizer, retriever, [tw for tw, _ in live], [g for _, g in live], proto)
    for i, (ep, t, _) in enumerate(requests):
        shortcut = same_evidence_shortcut and not independent
        if kinds[i] == "rollout" and shortcut and _same_evidence(ep.turns[t], twins[i].turns[t]):
            kinds[i] = "same_evidence"
        if kinds[i] != "rollout":
            twins[i].answer, twins[i].reward, twins[i].done = ep.answer, ep.reward, True
    run_episodes(model, tokenizer, retriever, [tw for tw, kind in zip(twins, kinds) if kind == "rollout"], proto)
    return [TwinResult(i, t, j, kind, tw.reward, ep.reward - tw.reward, tw.n_generated, tw)
            for i, ((ep, t, j), kind, tw) in enumerate(zip(requests, kinds, twins))]


def continue_from(model, tokenizer, retriever, requests, proto) -> list:
    """Monte Carlo rollouts from turn boundaries: requests of (episode, turn, include_turn, seed), all batched.

    include_turn=True: from just after turn t (a sample of Q(s_t, y_t)); False: from s_t (V(s_t)). The noise of
    every sampled turn uses turn_key(seed, turn): e.g. seed = fresh_key(ep.key, MC_Q_TAG, t, k) for the k-th.
    """
    branches = [branch(ep, t, include_turn=inc, fresh_seed=seed) for ep, t, inc, seed in requests]
    return run_episodes(model, tokenizer, retriever, branches, proto)


def observation_of(turn: Turn):
    """What the environment showed after a turn: the retrieved ids of an executed search, "invalid" for Search-R1's
    invalid-action message, None when nothing was appended (an answer, or the final turn)."""
    if turn.doc_ids:
        return turn.doc_ids
    return "invalid" if turn.obs_end > turn.obs_start else None


def evidence_states(ep) -> list:
    """GiGPO/HGPO state of each turn t: (uid, observations of turns 0..t-1), the prompt's state for t = 0.

    The environment state of a search episode is the evidence it has been shown; the agent's own words (thoughts,
    query wording) are the policy's, not the environment's, as GiGPO's ALFWorld anchors are the environment's
    observations, not the agent's text. Two lines that retrieved the same ids in the same order share a state.
    """
    obs = [observation_of(turn) for turn in ep.turns]
    return [(ep.uid, tuple(obs[:t])) for t in range(len(ep.turns))]


def mask_shared_prefix(ep) -> int:
    """Loss mask 0 on a tree branch's tokens before its branch turn (they are its parent's, trained in the parent's
    row): each shared token enters the loss once. Returns how many sampled tokens were masked."""
    if ep.branch_turn is None:
        return 0
    cut = ep.turns[ep.branch_turn].start if ep.branch_turn < len(ep.turns) else len(ep.ids)
    masked = sum(ep.mask[:cut])
    ep.mask[:cut] = [0] * cut
    return masked


def collate(episodes, pad_id: int) -> dict:
    """Right-padded prompt + response: input_ids, attention_mask, loss_mask (1 on sampled tokens) (B, L) and
    response_start (B,) (the prompt length, where response position 0 sits)."""
    rows = [ep.prompt_ids + ep.ids for ep in episodes]
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (B, L)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, (ep, row) in enumerate(zip(episodes, rows)):
        assert len(ep.mask) == len(ep.ids), f"episode {b}: mask and ids differ in length"
        input_ids[b, :len(row)] = torch.tensor(row, dtype=torch.long)
        attention_mask[b, :len(row)] = 1
        loss_mask[b, len(ep.prompt_ids):len(row)] = torch.tensor(ep.mask, dtype=torch.long)
    response_start = torch.tensor([len(ep.prompt_ids) for ep in episodes], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask,
            "response_start": response_start}


def turn_spans(episodes) -> list:
    """Per episode, (start, end) of each turn's sampled tokens in collate's rows (the response follows the prompt)."""
    return [[(len(ep.prompt_ids) + t.start, len(ep.prompt_ids) + t.end) for t in ep.turns] for ep in episodes]


# --- benchmark: keyed sampling against plain multinomial sampling, same model, batch and length ---
def bench_overhead(vocab=32000, hidden=256, layers=4, batch=32, new_tokens=64, prompt_len=32, reps=5, fused=False,
                   device=None) -> dict:
    """Generation wall time of a random Qwen2 (no EOS: every row makes new_tokens tokens) with the keyed processor,
    with do_sample=True multinomial sampling (T = 1, no top-k) and greedy; interleaved in one run so load changes hit
    all three. Returns medians and the median per-repetition ratio keyed / plain."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
                         tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config).to(device).eval()
    model.generation_config = GenerationConfig()
    prompt = torch.randint(0, vocab, (batch, prompt_len), device=device)
    keys = torch.tensor([_signed(turn_key(mix(0, b), 0)) for b in range(batch)], device=device)
    common = dict(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens, pad_token_id=0)
    runs = {"plain": lambda: model.generate(**common, do_sample=True, temperature=1.0, top_k=0, top_p=1.0),
            "keyed": lambda: model.generate(**common, do_sample=False, logits_processor=LogitsProcessorList(
                [KeyedGumbelProcessor(keys, prompt_len, fused=fused)])),
            "greedy": lambda: model.generate(**common, do_sample=False)}  # what the model alone costs

    def timed(name):
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = runs[name]()
        sync()
        assert out.shape[1] == prompt_len + new_tokens, "unequal lengths: the comparison would be unfair"
        return time.perf_counter() - t0

    for name in runs:
        timed(name)  # warm-up (and compilation when fused)
    times = {name: [] for name in runs}
    for r in range(reps):
        for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            times[name].append(timed(name))
    ratio = [k / p for k, p in zip(times["keyed"], times["plain"])]
    return {"vocab": vocab, "hidden": hidden, "layers": layers, "params": sum(p.numel() for p in model.parameters()),
            "batch": batch, "new_tokens": new_tokens, "device": str(device), "fused": fused,
            **{f"{name}_s": statistics.median(t) for name, t in times.items()}, "ratio": statistics.median(ratio),
            "ratios": [round(x, 3) for x in ratio],
            "vs_greedy": statistics.median(k / g for k, g in zip(times["keyed"], times["greedy"]))}


def main(argv=None):
    parser = argparse.ArgumentParser(description="python rollout.py bench: keyed vs multinomial generation time")
    parser.add_argument("cmd", choices=["bench"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--fused", action="store_true", help="torch.compile the keyed sampler")
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    for size in (dict(vocab=2048, hidden=64, layers=2, batch=80), dict(vocab=32000, hidden=256, layers=4, batch=32)):
        r = bench_overhead(**size, reps=args.reps, fused=args.fused, device=args.device)
        print(f"vocab {r['vocab']} | hidden {r['hidden']} x {r['layers']} | {r['params'] / 1e6:.1f}M params | batch "
              f"{r['batch']} x {r['new_tokens']} tokens | {r['device']} fused={r['fused']} threads "
              f"{torch.get_num_threads()} | plain {r['plain_s']:.3f}s keyed {r['keyed_s']:.3f}s greedy "
              f"{r['greedy_s']:.3f}s | keyed/plain {r['ratio']:.3f} {r['ratios']} | keyed/greedy {r['vs_greedy']:.3f}")


if __name__ == "__main__":
    main()
