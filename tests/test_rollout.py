"""Tests for rollout.py: Search-R1 protocol conformance of whole episodes (observations, stop rule, limits, batched
retrieval, reward from the agent's own text), twin coupling, continuations and collate, with tiny models built from
configs. The fixtures here (tokenizers, tiny models, a fake retriever, a scripted model) serve the other test files."""
import collections

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

import protocol
import rollout
import sampler
from protocol import Protocol
from retriever import format_docs

TAGS = ["<search>", "</search>", "<answer>", "</answer>", "<think>", "</think>", "<information>", "</information>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DOCS = [
    {"id": "d1", "contents": '"Paris"\nParis is the capital of France.'},
    {"id": "d2", "contents": '"Berlin"\nBerlin is the capital of Germany.\nIt is large.'},
    {"id": "d3", "contents": '"Rome"\nRome is the capital of Italy.'},
    {"id": "d4", "contents": '"Lyon"\nLyon is a city of France.'},
]
WORDS = "paris PARIS france capital berlin germany rome italy lyon city what is the of a x y z".split()
LONG_Q = "Q" * 2500  # one added token of the byte-level tokenizer: 10k-character queries in 4 tokens


# --- fixtures: tokenizers, models, retriever ---
@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: a second intra-op thread only adds synchronisation (and on a loaded 2-core machine
    OpenMP spin-waiting made a 2 s test take 80 s). Restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _wrap(tok, added):
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                   clean_up_tokenization_spaces=False)
    fast.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    fast.add_tokens(added)
    fast.chat_template = CHATML
    return fast


@pytest.fixture(scope="module")
def word_tok():
    """Word-level tokenizer, the tags added tokens (each one token)."""
    words = protocol.INSTRUCTION.split() + WORDS + ["Question:", "self?", "choice?"] + [w + "?" for w in WORDS]
    words = sorted(set(words))
    vocab = {w: i for i, w in enumerate(["[UNK]", "<|endoftext|>", "<|im_start|>", "<|im_end|>"] + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return _wrap(tok, TAGS)


@pytest.fixture(scope="module")
def byte_tok():
    """Byte-level BPE (any text round-trips); the tags are NOT added tokens, so `</search>` spans several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"])
    tok.train_from_iterator([protocol.INSTRUCTION] + [d["contents"] for d in DOCS] * 3, trainer)
    fast = _wrap(tok, [LONG_Q])
    assert len(fast("</search>", add_special_tokens=False)["input_ids"]) > 1
    return fast


def tiny_model(vocab, seed=0, hidden=32):
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         initializer_range=0.3)
    return Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def word_model(word_tok):
    return tiny_model(len(word_tok))


class FakeRetriever:
    """Deterministic word-overlap search over DOCS (case-insensitive), recording every query batch."""

    def __init__(self):
        self.calls = []

    def search(self, queries, topk=3):
        self.calls.append(list(queries))
        out = []
        for q in queries:
            words = set(q.lower().split())
            score = {d["id"]: len(words & set(d["contents"].lower().replace(".", " ").split())) for d in DOCS}
            ranked = sorted(DOCS, key=lambda d: (-score[d["id"]], d["id"]))[:topk]
            out.append([{"id": d["id"], "contents": d["contents"], "score": float(score[d["id"]])} for d in ranked])
        return out


class ScriptedModel:
    """A stand-in for a causal LM with transformers' greedy generate loop (processors, argmax, pad finished rows,
    stopping criteria). Its logits put +1e4 on the script's next token(s); a step may offer several equally likely
    tokens, which the keyed noise then chooses between. script(question, turn) -> list of steps (id or tuple), the
    turn read off the context as the number of observations so far."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script = tokenizer, script
        self.device, self.generation_config = torch.device("cpu"), GenerationConfig()

    def _plan(self, context):
        question, response = self.tokenizer.decode(context).split("Question: ", 1)[1].split("?", 1)
        return self.script(question.strip(), response.count("<information>") + response.count("action is invalid"))

    def generate(self, input_ids, attention_mask, generation_config, logits_processor, stopping_criteria):
        plans = [self._plan(row[mask.bool()].tolist()) for row, mask in zip(input_ids, attention_mask)]
        unfinished = torch.ones(len(plans), dtype=torch.bool)
        eos, pad = self.tokenizer.eos_token_id, generation_config.pad_token_id
        for step in range(generation_config.max_new_tokens):
            scores = torch.zeros(len(plans), len(self.tokenizer))  # (B, V)
            for b, plan in enumerate(plans):
                scores[b, list(np.atleast_1d(plan[step] if step < len(plan) else eos))] = 1e4
            next_ids = logits_processor(input_ids, scores).argmax(-1)
            next_ids = torch.where(unfinished, next_ids, torch.full_like(next_ids, pad))
            input_ids = torch.cat([input_ids, next_ids[:, None]], 1)
            unfinished &= ~stopping_criteria(input_ids, None)
            if not unfinished.any():
                break
        return input_ids


def encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def questions(n, extra=""):
    return [{"id": f"q{i}", "question": f"what is the capital of {WORDS[i % len(WORDS)]}{extra}",
             "golden_answers": ["paris"]} for i in range(n)]



# --- protocol conformance (DESIGN.md section 3), with a scripted model ---
def scripted_run(tok, turns, proto, n_questions=1, golden=("paris",)):
    """Run episodes whose every turn is given as text (the same script for each question)."""
    model = ScriptedModel(tok, lambda q, t: encode(tok, turns[t]) if t < len(turns) else [])
    retr = FakeRetriever()
    eps = rollout.start_episodes(tok, [dict(q, golden_answers=list(golden)) for q in questions(n_questions)], 0, 0)
    return rollout.run_episodes(model, tok, retr, eps, proto), retr


def obs_text(tok, ep, turn):
    return tok.decode(ep.ids[turn.obs_start:turn.obs_end])


def test_search_observation_answer_and_reward(byte_tok):
    proto = Protocol(max_new_tokens=64)
    turns = ["<think>hm</think> <search> capital of France </search> trailing words",
             "<answer> Paris </answer> after"]
    (ep,), retr = scripted_run(byte_tok, turns, proto)
    t0, t1 = ep.turns
    assert t0.text == "<think>hm</think> <search> capital of France </search>"  # stopped right after the split tag
    assert t0.stop == "stop" and (t0.action, t0.content) == ("search", "capital of France")
    assert retr.calls == [["capital of France"]] and t0.doc_ids == ("d1", "d2", "d3")
    expected = ('\n\n<information>Doc 1(Title: "Paris") Paris is the capital of France.\n'
                'Doc 2(Title: "Berlin") Berlin is the capital of Germany.\nIt is large.\n'
                'Doc 3(Title: "Rome") Rome is the capital of Italy.</information>\n\n')
    assert obs_text(byte_tok, ep, t0) == expected
    assert ep.ids[t0.obs_start:t0.obs_end] == encode(byte_tok, expected)
    assert t1.text == "<answer> Paris </answer>" and t1.start == t0.obs_end and t1.end == len(ep.ids)
    assert ep.done and ep.answer == "Paris" and ep.reward == 1.0
    assert ep.mask == [1] * t0.end + [0] * (t0.obs_end - t0.obs_start) + [1] * (t1.end - t1.start)
    assert ep.n_generated == sum(ep.mask) and len(t0.logprobs) == len(t0.entropy) == t0.end - t0.start


def test_invalid_action_message_and_eos(byte_tok):
    (ep,), retr = scripted_run(byte_tok, ["I am not sure", "<search>   </search>", "<answer>rome</answer>"], Protocol())
    t0, t1, t2 = ep.turns
    literal = ("\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
               "</search>. If I want to give the final answer, I should put the answer between <answer> and "
               "</answer>. Let me try again.\n")
    assert t0.stop == "eos" and t0.text == "I am not sure<|im_end|>" and t0.action is None
    assert obs_text(byte_tok, ep, t0) == literal == protocol.INVALID_ACTION_MSG
    assert t1.action is None and obs_text(byte_tok, ep, t1) == literal  # empty query: invalid, never retrieved
    assert retr.calls == [] and ep.answer == "rome" and ep.reward == 0.0


def test_max_turns_then_final_turn_without_search(byte_tok):
    proto = Protocol(max_turns=3)
    (ep,), retr = scripted_run(byte_tok, [f"<search> capital {w} </search>" for w in WORDS], proto)
    assert [t.action for t in ep.turns] == ["search"] * 4 and len(retr.calls) == 3  # the 4th is not executed
    assert ep.turns[-1].obs_start == ep.turns[-1].obs_end == len(ep.ids) and ep.turns[-1].doc_ids == ()
    assert ep.done and ep.answer is None and ep.reward == 0.0


def test_observation_truncation_and_length_stop(byte_tok):
    first = "<search> paris </search>"
    proto = Protocol(max_obs_tokens=12, max_new_tokens=len(encode(byte_tok, first)))
    (ep,), _ = scripted_run(byte_tok, [first, "one two three four five six seven " * 3], proto)
    t0, t1 = ep.turns[:2]
    full = encode(byte_tok, protocol.information_block(format_docs(FakeRetriever().search(["paris"])[0])))
    assert ep.ids[t0.obs_start:t0.obs_end] == full[:12] and t0.stop == "stop"
    assert t1.stop == "length" and t1.end - t1.start == proto.max_new_tokens and t1.action is None


def test_context_cap_ends_episode(byte_tok):
    prompt_len = len(rollout.start_episodes(byte_tok, questions(1), 0, 0)[0].prompt_ids)
    proto = Protocol(max_context=prompt_len + 30)
    (ep,), _ = scripted_run(byte_tok, ["<search> paris </search>"] * 5, proto)
    assert ep.done and len(ep.prompt_ids) + len(ep.ids) <= proto.max_context and len(ep.turns) == 1


def test_batched_retrieval_and_query_truncation(byte_tok):
    proto = Protocol(max_query_chars=100)
    eps, retr = scripted_run(byte_tok, [f"<search> paris {LONG_Q * 4} </search>", "<answer>x</answer>"], proto,
                             n_questions=5)
    assert len(retr.calls) == 1 and len(retr.calls[0]) == 5  # one retriever call for the whole turn
    assert all(q == ("paris " + LONG_Q)[:100] for q in retr.calls[0])
    assert len(eps[0].turns[0].content) == 6 + 10_000


PIECES = st.sampled_from(["<search>", "</search>", "<answer>", "</answer>", "<search", "</sea", "rch>", "<", ">", "/",
                          " ", "\n", "\t", "paris", LONG_Q, "日本語", "é", "🙂", "<information>", "</think>"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(PIECES | st.text(max_size=12), max_size=14))
def test_arbitrary_turn_text_never_crashes(byte_tok, parts):
    text = "".join(parts)
    ids = encode(byte_tok, text)
    proto = Protocol(max_new_tokens=40, max_query_chars=50)
    model, retr = ScriptedModel(byte_tok, lambda q, t: ids), FakeRetriever()
    (ep,) = rollout.step_turn(model, byte_tok, retr, rollout.start_episodes(byte_tok, questions(1), 0, 0), proto)
    (t0,) = ep.turns
    sampled = ep.ids[t0.start:t0.end]
    stops = [k for k in range(1, len(ids) + 1) if any(s in byte_tok.decode(ids[:k]) for s in protocol.STOP_STRINGS)]
    cut = stops[0] if stops else None
    if cut is not None and cut <= 40:
        assert sampled == ids[:cut] and t0.stop == "stop"
    elif len(ids) < 40:
        assert sampled == ids + [byte_tok.eos_token_id] and t0.stop == "eos"
    else:
        assert sampled == ids[:40] and t0.stop == "length"
    assert (t0.action, t0.content) == protocol.parse_action(t0.text)
    if t0.action == "search":
        assert retr.calls[0] == [t0.content[:50]]
    elif t0.action is None:
        assert obs_text(byte_tok, ep, t0) == protocol.INVALID_ACTION_MSG and not retr.calls
    assert ep.mask == [1] * t0.end + [0] * (len(ep.ids) - t0.end) and ep.done is (t0.action == "answer")


# --- twins, continuations and the training batch (DESIGN.md section 5) ---
@pytest.fixture(scope="module")
def factual(word_tok, word_model):
    proto = Protocol(max_turns=2, max_new_tokens=10)
    eps = rollout.start_episodes(word_tok, questions(6), 3, 1)
    return rollout.run_episodes(word_model, word_tok, FakeRetriever(), eps, proto), proto


def test_twin_with_the_factual_key_replays_the_factual_episode(word_tok, word_model, factual):
    eps, proto = factual
    for ep in eps:
        for t in range(len(ep.turns)):
            twin = rollout.branch(ep, t, key_overrides={t: ep.key_for(t)})
            rollout.run_episodes(word_model, word_tok, FakeRetriever(), [twin], proto)
            assert twin.ids == ep.ids and twin.mask == ep.mask and twin.reward == ep.reward
            assert twin.n_generated == sum(t2.end - t2.start for t2 in ep.turns[t:])


def test_twins_couple_later_turns_and_count_tokens(word_tok, word_model, factual):
    eps, proto = factual
    requests = [(ep, t, j) for ep in eps for t in range(len(ep.turns) - 1) for j in range(2)]
    for coupling in (True, False):
        results = rollout.run_twins(word_model, word_tok, FakeRetriever(), requests, proto, coupling=coupling)
        rolled = [r for r in results if r.kind == "rollout"]
        assert rolled, "expected some twins to need a rollout"
        for r in results:
            ep, t, j = requests[r.request]
            assert r.twin.ids[:ep.turns[t].start] == ep.ids[:ep.turns[t].start]  # state s_t
            assert r.twin.turns[t].key == sampler.alt_key(ep.key, t, j) != ep.turns[t].key
            assert r.tokens == sum(x.end - x.start for x in r.twin.turns[t:]) and r.diff == ep.reward - r.outcome
        for r in rolled:
            ep, t, j = requests[r.request]
            later = [(x.key, y.key) for x, y in zip(r.twin.turns[t + 1:], ep.turns[t + 1:])]
            assert all((a == b) is coupling for a, b in later)


def test_self_twin_and_same_evidence(word_tok):
    paris, upper = word_tok.convert_tokens_to_ids(["paris", "PARIS"])
    s, cap, end = word_tok.convert_tokens_to_ids(["<search>", "capital", "</search>"])
    answer = encode(word_tok, "<answer> paris </answer>")
    scripts = {  # question -> per-turn steps; a tuple step is a keyed choice between equally likely tokens
        "self": lambda t: [s, paris, cap, end] if t == 0 else answer,
        "choice": lambda t: [s, (paris, upper), cap, end] if t == 0 else answer,
    }
    model = ScriptedModel(word_tok, lambda q, t: scripts[q](t))
    qs = [{"id": "a", "question": "self", "golden_answers": ["paris"]},
          {"id": "b", "question": "choice", "golden_answers": ["paris"]}]
    proto = Protocol()
    eps = rollout.run_episodes(model, word_tok, FakeRetriever(), rollout.start_episodes(word_tok, qs, 0, 0), proto)
    assert [ep.reward for ep in eps] == [1.0, 1.0]
    requests = [(eps[0], 0, 0)] + [(eps[1], 0, j) for j in range(12)]
    for shortcut in (True, False):
        results = rollout.run_twins(model, word_tok, FakeRetriever(), requests, proto,
                                    same_evidence_shortcut=shortcut)
        assert results[0].kind == "self" and results[0].diff == 0 and results[0].tokens == 4
        kinds = collections.Counter(r.kind for r in results[1:])
        assert kinds["self"] > 0 and kinds["same_evidence" if shortcut else "rollout"] > 0, kinds
        for r in results[1:]:
            assert r.diff == 0 and r.tokens == (4 if r.kind != "rollout" else 4 + len(answer))


def test_continue_from_uses_fresh_keys(word_tok, word_model, factual):
    eps, proto = factual
    ep = max(eps, key=lambda e: len(e.turns))
    requests = [(ep, 1, inc, sampler.fresh_key(ep.key, sampler.MC_Q_TAG if inc else sampler.MC_V_TAG, 1, k))
                for inc in (True, False) for k in range(3)]
    outs = rollout.continue_from(word_model, word_tok, FakeRetriever(), requests, proto)
    for (_, t, inc, seed), out in zip(requests, outs):
        cut = ep.turns[t].obs_end if inc else ep.turns[t].start
        assert out.done and out.ids[:cut] == ep.ids[:cut] and out.turns[:t + inc] == ep.turns[:t + inc]
        assert all(x.key == sampler.turn_key(seed, i) for i, x in enumerate(out.turns) if i >= t + inc)


def test_collate(word_tok, factual):
    eps, _ = factual
    batch = rollout.collate(eps, pad_id=word_tok.pad_token_id)
    lengths = [len(ep.prompt_ids) + len(ep.ids) for ep in eps]
    assert batch["input_ids"].shape == batch["loss_mask"].shape == (len(eps), max(lengths))
    for b, ep in enumerate(eps):
        p, n = len(ep.prompt_ids), lengths[b]
        assert batch["input_ids"][b, :n].tolist() == ep.prompt_ids + ep.ids
        assert batch["attention_mask"][b].tolist() == [1] * n + [0] * (max(lengths) - n)
        assert batch["loss_mask"][b].tolist() == [0] * p + ep.mask + [0] * (max(lengths) - n)
        assert batch["response_start"][b] == p and batch["loss_mask"][b].sum() == ep.n_generated


class AnswerInDocRetriever(FakeRetriever):
    """Every search returns a document whose text holds `<answer> paris </answer>` (the gold answer)."""

    def search(self, queries, topk=3):
        self.calls.append(list(queries))
        doc = {"id": "trap", "contents": '"Trap"\nThe reply is <answer> paris </answer> here.', "score": 1.0}
        return [[doc] * topk for _ in queries]


def test_an_answer_inside_a_retrieved_document_earns_nothing(byte_tok):
    """DEVIATION R5: only the agent's own text is scored (Search-R1 would score this episode 1.0)."""
    turns = ["<search> capital of France </search>", "I read it but say nothing"]
    model = ScriptedModel(byte_tok, lambda q, t: encode(byte_tok, turns[t]) if t < len(turns) else [])
    (ep,) = rollout.run_episodes(model, byte_tok, AnswerInDocRetriever(),
                                 rollout.start_episodes(byte_tok, questions(1), 0, 0), Protocol(max_turns=1))
    assert "<answer> paris </answer>" in byte_tok.decode(ep.ids)  # the document is in the context ...
    assert ep.answer is None and ep.reward == 0.0  # ... but the agent never answered


def test_an_unanswered_episode_records_no_answer(byte_tok):
    """The invalid-action message says "... between <answer> and </answer> ...": its 'and' is not an answer."""
    (ep,), _ = scripted_run(byte_tok, ["I am not sure", "still unsure"], Protocol(max_turns=1), golden=("and",))
    assert protocol.INVALID_ACTION_MSG in byte_tok.decode(ep.ids)
    assert ep.answer is None and ep.reward == 0.0
    assert rollout.agent_text(ep) == "".join(t.text for t in ep.turns)


def test_a_row_drawn_twice_in_a_step_gets_distinct_keys(word_tok):
    q = questions(1)[0]
    first, second = rollout.start_episodes(word_tok, [q, dict(q, occurrence=1)], run_seed=0, step=0, group_size=2)[::2]
    again = rollout.start_episodes(word_tok, [q], run_seed=0, step=0, group_size=2)[0]
    assert first.key == again.key  # the first occurrence keeps the key it always had
    assert second.key != first.key and second.uid != first.uid


def test_collate_and_batch_logprobs_refuse_a_row_past_max_context(word_tok, word_model):
    """Every pass over a training batch is bounded by max_context: a row past it (a prompt that was never checked)
    is refused by collate and by batch_logprobs before any forward, not allocated."""
    from generation import logprobs
    (q,) = questions(1)
    long_q = dict(q, question=q["question"] + " capital" * 300)
    ep, long_ep = rollout.start_episodes(word_tok, [q, long_q], 0, 0)
    for e in (ep, long_ep):
        e.ids, e.mask = [5, 6, 7], [1, 1, 1]
    n, cap = len(long_ep.prompt_ids) + 3, len(ep.prompt_ids) + 3
    # what the load-time check measures (batched) is what the rollout encodes
    assert rollout.prompt_lengths(word_tok, [q, long_q], chunk=1) == [len(ep.prompt_ids), n - 3]
    assert rollout.prompt_lengths(word_tok, [q, long_q]) == [len(ep.prompt_ids), n - 3]
    ok = rollout.collate([ep], word_tok.pad_token_id, max_context=cap)  # exactly at the cap
    with pytest.raises(ValueError, match=rf"collate: 1 row\(s\) longer than max_context={cap} \(row 1, question "
                                         rf".*{len(long_ep.prompt_ids)} prompt \+ 3 response = {n} tokens\)"):
        rollout.collate([ep, long_ep], word_tok.pad_token_id, max_context=cap)
    batch = rollout.collate([ep, long_ep], word_tok.pad_token_id)  # unchecked: the path of callers without a cap

    def no_forward(*a, **k):
        raise AssertionError("a forward pass ran on an over-long batch")
    with pytest.raises(ValueError, match=rf"batch_logprobs: row 1 has {n} tokens, past max_context={cap} \(1 such"):
        logprobs.batch_logprobs(no_forward, batch, 1.0, 2, max_context=cap)
    lp, _ = logprobs.batch_logprobs(word_model, ok, 1.0, 2, max_context=cap)
    assert lp.shape == (1, len(ep.prompt_ids) + 2) and (lp[0, -3:] < 0).all()
