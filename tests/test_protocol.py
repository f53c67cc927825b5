"""Tests for protocol.py: the Search-R1 prompt byte for byte and the action parser on arbitrary text; the observations,
stop rule and reward in whole episodes are tested in test_rollout.py."""
from hypothesis import given, settings, strategies as st
from test_rollout import PIECES, encode, one_thread, questions, word_tok  # noqa: F401

import protocol
import rollout


def test_prompt_is_search_r1_byte_for_byte(word_tok):
    instruction = (
        "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get "
        "new information. After reasoning, if you find you lack some knowledge, you can call a search engine by "
        "<search> query </search> and it will return the top searched results between <information> and "
        "</information>. You can search as many times as your want. If you find no further external knowledge "
        "needed, you can directly provide the answer inside <answer> and </answer>, without detailed illustrations. "
        "For example, <answer> Beijing </answer>. ")
    assert protocol.render_prompt(word_tok, "  who wrote it ") == (
        f"<|im_start|>user\n{instruction}Question: who wrote it?\n<|im_end|>\n<|im_start|>assistant\n")
    assert protocol.user_message("who wrote it?") == f"{instruction}Question: who wrote it?\n"
    ep = rollout.start_episodes(word_tok, questions(1), 0, 0)[0]
    assert ep.prompt_ids == encode(word_tok, protocol.render_prompt(word_tok, ep.question))


@settings(max_examples=60, deadline=None)
@given(parts=st.lists(PIECES | st.text(max_size=12), max_size=14))
def test_parse_action_of_arbitrary_text(parts):
    action, content = protocol.parse_action("".join(parts))
    assert action in (None, "search", "answer") and content == content.strip()
    assert not (action == "search" and not content)
