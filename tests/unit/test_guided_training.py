"""Training arrays of a hand-built two-turn conversation, final_turn and full_turn.

Proves: final_turn = (context of the last turn, last turn's sampled ids); full_turn = (first
context, turn 1 + user turn + turn 2) with response_mask 1 exactly on sampled tokens through each
turn's end-of-turn token and 0 on template/verifier tokens; behaviour logprobs and per-token
policy versions (two versions: an in-flight weight update between turns) aligned with the
response ids; the original's EOS rule inside a turn; the per-sample metadata.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import bpe_chatml_tokenizer

from asyncrl.actors.guided import (
    Conversation,
    GuideOptions,
    PolicyChat,
    build_training_sample,
    sample_metadata,
)

EOT = 2  # <|im_end|>: the third special token


@pytest.fixture(scope="module")
def chat() -> PolicyChat:
    hf = bpe_chatml_tokenizer(["user assistant system hint answer"] * 5, vocab_size=300)
    assert hf.convert_tokens_to_ids("<|im_end|>") == EOT
    return PolicyChat(hf)


def two_turns(chat: PolicyChat, scope: str = "final_turn") -> Conversation:
    conv = Conversation([{"role": "user", "content": "Q"}], chat=chat, ground_truth="1",
                        options=GuideOptions(train_scope=scope, max_turns=2))
    conv.next_step()
    conv.on_generated([50, 51, EOT], [-0.1, -0.2, -0.3], version=3)          # turn 1, policy v3
    conv.next_step()
    conv.on_verified({"ok": True, "text": "hint\n[SCORE] hallucination_detect=1", "version": "ver-A",
                      "latency_ms": 12.5, "tokens": 9})
    conv.next_step()
    conv.on_generated([60, 61, 62, EOT], [-1.0, -1.1, -1.2, -1.3], version=4)  # turn 2, after an update
    conv.next_step()
    conv.on_verified({"ok": True, "text": "###STOP###", "version": "ver-A"})
    return conv


def test_final_turn(chat):
    conv = two_turns(chat)
    s = build_training_sample(conv, "final_turn")
    user = chat.encode_user_turn("hint")
    assert s.prompt_ids.tolist() == conv.initial_ids + [50, 51, EOT] + user  # the exact context of turn 2
    assert s.response_ids.tolist() == [60, 61, 62, EOT]
    assert s.response_mask.tolist() == [1, 1, 1, 1]
    np.testing.assert_allclose(s.behaviour_logprobs, [-1.0, -1.1, -1.2, -1.3], rtol=0, atol=1e-7)
    assert s.token_versions.tolist() == [4, 4, 4, 4]
    assert (s.scope, s.fallback) == ("final_turn", False)
    assert (s.prompt_ids.dtype, s.response_ids.dtype, s.response_mask.dtype, s.behaviour_logprobs.dtype,
            s.token_versions.dtype) == (np.int32, np.int32, np.int8, np.float32, np.int32)


def test_full_turn(chat):
    conv = two_turns(chat, "full_turn")
    s = build_training_sample(conv)  # scope from the options
    user = chat.encode_user_turn("hint")
    u = len(user)
    assert user == chat.encode_text("\n<|im_start|>user\nhint<|im_end|>\n<|im_start|>assistant\n")
    assert s.prompt_ids.tolist() == conv.initial_ids
    assert s.response_ids.tolist() == [50, 51, EOT] + user + [60, 61, 62, EOT]
    # 1 on the 3 + 4 sampled tokens (each through its <|im_end|>), 0 on the u template/verifier tokens
    assert s.response_mask.tolist() == [1, 1, 1] + [0] * u + [1, 1, 1, 1]
    np.testing.assert_allclose(s.behaviour_logprobs, [-0.1, -0.2, -0.3] + [0.0] * u + [-1.0, -1.1, -1.2, -1.3],
                               rtol=0, atol=1e-7)
    assert s.token_versions.tolist() == [3, 3, 3] + [-1] * u + [4, 4, 4, 4]
    assert len(s.response_ids) == len(s.response_mask) == len(s.behaviour_logprobs) == len(s.token_versions)


def test_eos_rule_inside_a_turn(chat):
    # tokens after the first end-of-turn token (engine run with ignore_eos) are not trained
    conv = Conversation([{"role": "user", "content": "Q"}], chat=chat, options=GuideOptions(max_turns=1,
                        enable_hallucination_score=False))
    conv.next_step()
    conv.on_generated([50, EOT, 51, EOT], [-1.0, -2.0, -3.0, -4.0], version=0)
    s = build_training_sample(conv)
    assert conv.finish_reason == "max_turns"
    assert s.response_mask.tolist() == [1, 1, 0, 0]
    assert s.behaviour_logprobs.tolist() == [-1.0, -2.0, 0.0, 0.0] and s.token_versions.tolist() == [0, 0, -1, -1]


def test_errors(chat):
    conv = Conversation([{"role": "user", "content": "Q"}], chat=chat, options=GuideOptions())
    with pytest.raises(ValueError, match="no policy turn"):
        build_training_sample(conv)
    with pytest.raises(ValueError, match="unknown train scope"):
        build_training_sample(two_turns(chat), "all_turns")
    with pytest.raises(ValueError, match="logprobs for"):
        conv.next_step()
        conv.on_generated([1, 2], [0.0], 0)


def test_metadata(chat):
    conv = two_turns(chat)
    m = sample_metadata(conv, include_text=True)
    assert m["num_turns"] == 2 and m["finish_reason"] == "max_turns"  # STOP without an answer at the last turn
    assert m["has_final_answer"] is False  # "text" of [60, 61, 62] is not an <answer>
    assert m["hallucination_scores"] == [1, None] and m["verifier_hallucination_score"] == 1.0
    assert m["tokens"] == {"prompt": len(conv.initial_ids), "policy": 7, "user": len(chat.encode_user_turn("hint")), "verifier": 9,
                           "policy_per_turn": [3, 4]}
    assert m["turn_versions"] == [3, 4] and m["verifier_version"] == "ver-A"
    assert m["verifier_latency_ms"] == [12.5, None] and m["verifier_errors"] == 0
    assert m["stop_causes"] == ["", "stop_token"]
    assert m["messages"][-1] == {"role": "assistant", "content": conv.turns[1].text}
    assert m["messages"][2] == {"role": "user", "content": "hint"}
    import json
    json.dumps(m)  # JSON-able


def test_to_protocol_sample_roundtrip(chat):
    protocol = pytest.importorskip("asyncrl.protocol")
    from asyncrl.actors.group import build_sample

    conv = two_turns(chat, "full_turn")
    conv.uid, conv.prompt_uid = "p/0", "p"
    s = build_sample(conv, {"overall": 0.9, "accuracy": 1.0}, scope="full_turn")
    group = protocol.Group.from_samples([s], actor_id="a0")
    assert (group.min_version, group.max_version) == (3, 4)
    back = protocol.decode(protocol.encode(group)).samples[0]
    assert back.response_ids.tolist() == build_training_sample(conv).response_ids.tolist()
    assert (back.num_turns, back.finish_reason, back.verifier_version) == (2, "max_turns", "ver-A")
    assert back.metadata["scope_fallback"] is False and back.metadata["hallucination_scores"] == [1, None]
    assert (back.uid, back.prompt_uid, back.reward, back.reward_parts) == ("p/0", "p", 0.9, {"overall": 0.9, "accuracy": 1.0})
    assert back.metadata["messages"] == conv.messages()  # the transcript travels with the sample
