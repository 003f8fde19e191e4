"""The guided conversation state machine, its token-exact history and the async driver.

Proves (with a real byte-level BPE tokenizer and a ChatML template built in the test, a scripted
policy and a scripted verifier):
- token fidelity: at every turn the context fed to the policy equals the chat template's rendering
  of the conversation so far, and final context + response equals the rendering of the whole
  conversation; policy ids are kept exactly as sampled even when they are not canonical;
- the turn logic (STOP+answer ends, STOP without answer -> continue prompt,
  guidance after an answer continues, max_turns, no verifier call after the last turn unless a
  score is needed), finish reasons verifier_stop | max_turns | verifier_error | length;
- on_error stop | continue | drop_group, verifier_sees_reference, history full | guided_grpo and
  the prompt budget; per-turn and aggregated hallucination scores;
- distinct seeds within a group; conversations of a group advance independently.
"""

from __future__ import annotations

import asyncio

import pytest
from conftest import bpe_chatml_tokenizer

from asyncrl.actors.guided import (
    CONTINUE_PROMPT,
    Conversation,
    GenerateStep,
    GroupDropped,
    GuideOptions,
    PolicyChat,
    VerifyOutcome,
    VerifyStep,
    build_training_sample,
    make_group,
    run_conversation,
    run_group,
    sample_metadata,
    sample_seed,
)

CORPUS = [
    "You are a student. What is 2 + 3 * 4? <think>3*4=12</think> <answer>\\boxed{14}</answer>",
    "Step 1 is wrong. What is 3 * 4? Please continue and provide the final answer in the required format.",
    "system user assistant Correct. hello world the answer is 14 [SCORE] hallucination_detect=1\n",
]
STOP = "###STOP###"
SYSTEM = {"role": "system", "content": "You are a student."}
PROBLEM = {"role": "user", "content": "What is 2 + 3 * 4?"}
ANSWER = "<think>3*4=12</think> <answer>\\boxed{14}</answer>"


@pytest.fixture(scope="module")
def tokenizer():
    return bpe_chatml_tokenizer(CORPUS * 5, vocab_size=500)


@pytest.fixture(scope="module")
def chat(tokenizer) -> PolicyChat:
    return PolicyChat(tokenizer)


class ScriptedPolicy:
    """Samples the canonical ids of scripted texts + <|im_end|>; logprob of token k of turn t is
    -(t + 1) / 10 - k / 1000; version = 10 + turn; records every prompt it was given."""

    def __init__(self, chat: PolicyChat, texts: list[str], eos: bool = True):
        self.chat, self.texts, self.eos, self.prompts, self.seeds = chat, texts, eos, [], []

    async def __call__(self, prompt_ids: list[int], seed: int | None):
        t = len(self.prompts)
        self.prompts.append(list(prompt_ids))
        self.seeds.append(seed)
        ids = self.chat.encode_text(self.texts[min(t, len(self.texts) - 1)])
        if self.eos:
            ids = ids + [self.chat.tokenizer.convert_tokens_to_ids("<|im_end|>")]
        return ids, [-(t + 1) / 10 - k / 1000 for k in range(len(ids))], 10 + t, "stop" if self.eos else "length"


class ScriptedVerifier:
    def __init__(self, replies: list[object]):
        self.replies, self.requests = replies, []

    async def __call__(self, messages):
        self.requests.append(messages)
        r = self.replies[min(len(self.requests) - 1, len(self.replies) - 1)]
        return r if not isinstance(r, str) else VerifyOutcome(True, r, "v-test")


def run(conv, policy, verifier):
    return asyncio.run(asyncio.wait_for(run_conversation(conv, policy, verifier), timeout=10))


def new_conv(chat, **opts) -> Conversation:
    training = opts.pop("training", True)
    return Conversation([SYSTEM, PROBLEM], chat=chat, options=GuideOptions(training=training, **opts),
                        ground_truth="14", seed=123)


# ------------------------------------------------------------------------------- token fidelity
def test_pieces_derived_from_template(chat):
    assert chat.encode_user_turn("G") == chat.encode_text("\n<|im_start|>user\nG<|im_end|>\n<|im_start|>assistant\n")
    assert chat.user_turn_pieces == ("\n<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")
    assert chat.eos_token_ids == {chat.tokenizer.convert_tokens_to_ids("<|im_end|>")}


def test_incremental_tokens_equal_template_rendering(chat):
    policy = ScriptedPolicy(chat, ["hello world", "<think>3*4=12</think> is it 14?", ANSWER])
    verifier = ScriptedVerifier(["Step 1 is wrong. What is 3 * 4?\n[SCORE] hallucination_detect=0", STOP,
                                 f"{STOP}\n[SCORE] hallucination_detect=1"])
    conv = new_conv(chat, max_turns=5)
    transcripts = []
    while (step := conv.next_step()) is not None:
        if isinstance(step, GenerateStep):
            transcripts.append(conv.messages())
            conv.on_generated(*asyncio.run(policy(step.prompt_ids, step.seed)))
        else:
            conv.on_verified(asyncio.run(verifier(step.messages)))
    assert conv.finish_reason == "verifier_stop" and conv.num_turns == 3
    # the context of every turn == the template's rendering of the conversation so far
    for prompt, msgs in zip(policy.prompts, transcripts, strict=True):
        assert prompt == chat.encode_prompt(msgs)
    assert transcripts[2][-1] == {"role": "user", "content": CONTINUE_PROMPT}  # STOP without an answer
    # the whole trajectory == the rendering of the whole conversation (which adds one "\n" after <|im_end|>)
    s = build_training_sample(conv, "full_turn")
    whole = chat.encode_text(chat.render(conv.messages(), add_generation_prompt=False))
    assert s.prompt_ids.tolist() + s.response_ids.tolist() + chat.encode_text("\n") == whole
    f = build_training_sample(conv, "final_turn")
    assert f.prompt_ids.tolist() + f.response_ids.tolist() == s.prompt_ids.tolist() + s.response_ids.tolist()


def test_policy_ids_kept_exactly_when_not_canonical(chat):
    eot = chat.tokenizer.convert_tokens_to_ids("<|im_end|>")
    odd = [i for ch in "hello" for i in chat.encode_text(ch)]  # character by character
    assert odd != chat.encode_text("hello")  # not the canonical tokenisation

    async def policy(prompt_ids, seed):
        return (odd + [eot] if len(prompt_ids) < 40 else chat.encode_text(ANSWER) + [eot]), None, 1, "stop"

    conv = run(new_conv(chat), policy, ScriptedVerifier(["Go on.", STOP]))
    assert conv.turns[0].token_ids == odd + [eot] and conv.turns[0].text == "hello"
    assert conv.turns[1].prompt_ids == conv.initial_ids + odd + [eot] + chat.encode_user_turn("Go on.")
    s = build_training_sample(conv, "full_turn")
    assert s.response_ids.tolist()[: len(odd) + 1] == odd + [eot]
    assert s.behaviour_logprobs.tolist() == [0.0] * len(s.response_ids)  # engine gave no logprobs


# ------------------------------------------------------------------------------- turn logic
@pytest.mark.parametrize("texts,replies,max_turns,score,reason,turns,calls", [
    ([ANSWER], [STOP], 5, True, "verifier_stop", 1, 1),                          # STOP + answer
    (["no answer", ANSWER], [STOP, STOP], 5, True, "verifier_stop", 2, 2),       # STOP w/o answer -> continue
    ([ANSWER, ANSWER], ["Explain step 2.", STOP], 5, True, "verifier_stop", 2, 2),  # guidance after an answer
    (["x"], ["Try again."], 3, True, "max_turns", 3, 3),                          # score needed: last call made
    (["x"], ["Try again."], 3, False, "max_turns", 3, 2),                         # no call after the last turn
    (["x", "y", ANSWER], ["a", "b", STOP], 3, True, "verifier_stop", 3, 3),      # STOP at the last turn
    ([ANSWER], ["Correct. ###STOP###"], 2, True, "max_turns", 2, 2),              # inline stop is guidance
])
def test_turn_logic(chat, texts, replies, max_turns, score, reason, turns, calls):
    verifier = ScriptedVerifier(replies)
    conv = run(new_conv(chat, max_turns=max_turns, enable_hallucination_score=score),
               ScriptedPolicy(chat, texts), verifier)
    assert (conv.finish_reason, conv.num_turns, len(verifier.requests)) == (reason, turns, calls)
    assert conv.next_step() is None


def test_length_ends_without_verifier_call(chat):
    verifier = ScriptedVerifier([STOP])
    conv = run(new_conv(chat), ScriptedPolicy(chat, ["cut off mid"], eos=False), verifier)
    assert (conv.finish_reason, conv.num_turns, verifier.requests) == ("length", 1, [])
    s = build_training_sample(conv)
    assert s.response_mask.tolist() == [1] * len(chat.encode_text("cut off mid"))  # no EOS: all trained


def test_verifier_sees_policy_turns_only_and_reference_rule(chat):
    verifier = ScriptedVerifier(["Check step one.", STOP])
    run(new_conv(chat), ScriptedPolicy(chat, ["first try", ANSWER]), verifier)
    user = verifier.requests[1][1]["content"]
    assert "Assistant: first try\nAssistant: " + ANSWER + "\n\nProvide" in user
    assert "Check step one." not in user and "### Reference Answer\n14\n" in user
    for mode, training, shown in [("train_only", True, True), ("train_only", False, False),
                                  ("always", False, True), ("never", True, False)]:
        v = ScriptedVerifier([STOP])
        run(new_conv(chat, verifier_sees_reference=mode, training=training), ScriptedPolicy(chat, [ANSWER]), v)
        assert ("### Reference Answer\n14\n" in v.requests[0][1]["content"]) is shown
        assert ("### Reference Answer\nN/A\n" in v.requests[0][1]["content"]) is not shown


def test_score_hidden_from_policy_unless_asked(chat):
    for show in (False, True):
        policy = ScriptedPolicy(chat, ["x", ANSWER])
        conv = run(new_conv(chat, show_score_to_policy=show),
                   policy, ScriptedVerifier(["Fix it.\n[SCORE] hallucination_detect=0", STOP]))
        expected = "Fix it.\n[SCORE] hallucination_detect=0" if show else "Fix it."
        assert conv.turns[0].user_content == expected
        assert policy.prompts[1][-len(chat.encode_user_turn(expected)):] == chat.encode_user_turn(expected)


def test_hallucination_scores(chat):
    replies = ["a\n[SCORE] hallucination_detect=0", "b", "c [SCORE] hallucination_detect=1",
               f"{STOP}\n[SCORE] hallucination_detect=1"]
    conv = run(new_conv(chat), ScriptedPolicy(chat, ["x", "y", "z", ANSWER]), ScriptedVerifier(replies))
    assert conv.hallucination_scores == [0, None, 1, 1]
    assert conv.hallucination_score == pytest.approx(2 / 3)  # (0 + 1 + 1) / 3 scored turns
    off = run(new_conv(chat, enable_hallucination_score=False), ScriptedPolicy(chat, ["x", ANSWER]),
              ScriptedVerifier(replies[:1] + [STOP]))
    assert off.hallucination_scores == [None, None] and off.hallucination_score == 0.5


# ------------------------------------------------------------------------------- verifier errors
ERR = VerifyOutcome(False, "", None, "timeout after 3 attempts")


def test_on_error_stop(chat):
    conv = run(new_conv(chat, on_error="stop"), ScriptedPolicy(chat, [ANSWER]), ScriptedVerifier([ERR]))
    assert (conv.finish_reason, conv.verifier_errors, conv.drop_group) == ("verifier_error", 1, False)
    assert conv.turns[0].verifier_error == "timeout after 3 attempts"


def test_on_error_continue(chat):
    conv = run(new_conv(chat, on_error="continue"), ScriptedPolicy(chat, ["x", ANSWER]),
               ScriptedVerifier([ERR, STOP]))
    assert (conv.finish_reason, conv.verifier_errors, conv.num_turns) == ("verifier_stop", 1, 2)
    assert conv.turns[0].user_content == CONTINUE_PROMPT
    last = run(new_conv(chat, on_error="continue", max_turns=1), ScriptedPolicy(chat, [ANSWER]), ScriptedVerifier([ERR]))
    assert (last.finish_reason, last.verifier_errors) == ("max_turns", 1)


def test_on_error_drop_group_cancels_the_rest(chat):
    opts = GuideOptions(on_error="drop_group", max_turns=4)
    convs = make_group([SYSTEM, PROBLEM], chat=chat, options=opts, n=3, ground_truth="14", prompt_uid="p")
    release = asyncio.Event()

    async def policy(prompt_ids, seed):
        if seed != convs[0].seed:
            await release.wait()  # the others never get past turn 1
        return chat.encode_text("x") + [chat.eos_token_ids.__iter__().__next__()], None, 0, "stop"

    async def verifier(messages):
        return ERR

    async def main():
        with pytest.raises(GroupDropped) as info:
            await run_group(convs, policy, verifier)
        return info.value

    exc = asyncio.run(asyncio.wait_for(main(), timeout=10))
    assert exc.conversations[0].finish_reason == "verifier_error" and exc.conversations[0].drop_group
    assert [c.done for c in convs[1:]] == [False, False]  # cancelled, not awaited to completion


# ------------------------------------------------------------------------------- history + budget
def test_history_guided_grpo_rewrites_like_the_original(chat):
    policy = ScriptedPolicy(chat, ["first", "second", ANSWER])
    verifier = ScriptedVerifier(["Guide one.", "Guide two.", STOP])
    conv = run(new_conv(chat, history="guided_grpo"), policy, verifier)
    assert conv.finish_reason == "verifier_stop"
    a1, a2 = {"role": "assistant", "content": "first"}, {"role": "assistant", "content": "second"}
    # turn 3 sees [S][P][A1][A2][V2]: V1 is removed (1.6)
    assert policy.prompts[2] == chat.encode_prompt([SYSTEM, PROBLEM, a1, a2, {"role": "user", "content": "Guide two."}])
    assert policy.prompts[1] == chat.encode_prompt([SYSTEM, PROBLEM, a1, {"role": "user", "content": "Guide one."}])
    s = build_training_sample(conv)
    assert s.prompt_ids.tolist() == policy.prompts[2] and s.scope == "final_turn"
    with pytest.raises(ValueError, match="full_turn requires history=full"):
        GuideOptions(history="guided_grpo", train_scope="full_turn")


def test_history_guided_grpo_budget_drops_oldest_assistant(chat):
    long = "hello world " * 6
    base = len(chat.encode_prompt([SYSTEM, PROBLEM, {"role": "assistant", "content": "second"},
                                   {"role": "user", "content": "G2"}]))
    policy = ScriptedPolicy(chat, [long.strip(), "second", ANSWER])
    verifier = ScriptedVerifier(["G1", "G2", STOP])
    conv = run(new_conv(chat, history="guided_grpo", max_prompt_length=base + 2), policy, verifier)
    assert conv.turns[2].dropped_turns == 1
    assert "Assistant: second" in verifier.requests[2][1]["content"]
    assert long.strip() not in verifier.requests[2][1]["content"]  # the original's verifier loses it too


def test_history_full_budget_drops_whole_oldest_turns(chat):
    pol = ScriptedPolicy(chat, ["hello world hello world hello world", "second", ANSWER])
    probe = run(new_conv(chat), pol, ScriptedVerifier(["G1", "G2", STOP]))
    t = probe.turns
    # budget: turn 3's full context minus one token -> turn 1 (+ its user turn) must go
    budget = len(t[2].prompt_ids) - 1
    pol2 = ScriptedPolicy(chat, ["hello world hello world hello world", "second", ANSWER])
    conv = run(new_conv(chat, max_prompt_length=budget, train_scope="full_turn"), pol2,
               ScriptedVerifier(["G1", "G2", STOP]))
    assert conv.finish_reason == "verifier_stop"
    assert conv.turns[2].dropped_turns == 1
    assert pol2.prompts[2] == conv.initial_ids + t[1].token_ids + t[1].user_ids
    assert pol2.prompts[2] == chat.encode_prompt([SYSTEM, PROBLEM, {"role": "assistant", "content": "second"},
                                                  {"role": "user", "content": "G2"}])
    s = build_training_sample(conv)  # full_turn asked, history dropped -> final_turn for this sample
    assert (s.scope, s.fallback) == ("final_turn", True) and s.prompt_ids.tolist() == pol2.prompts[2]
    assert sample_metadata(conv)["dropped_turns"] == 1


def test_history_full_over_budget_ends_with_length(chat):
    huge = "hello world " * 30
    conv = new_conv(chat, max_prompt_length=len(chat.encode_prompt([SYSTEM, PROBLEM])) + 20)
    run(conv, ScriptedPolicy(chat, ["x"]), ScriptedVerifier([huge]))
    assert (conv.finish_reason, conv.num_turns) == ("length", 1)
    with pytest.raises(ValueError, match="max_prompt_length"):
        new_conv(chat, max_prompt_length=3)


# ------------------------------------------------------------------------------- seeds + driver
def test_seeds_distinct_within_group_and_turns(chat):
    opts = GuideOptions(max_turns=3)
    convs = make_group([SYSTEM, PROBLEM], chat=chat, options=opts, n=8, base_seed=1, prompt_index=5, prompt_uid="p5")
    assert len({c.seed for c in convs}) == 8 and [c.uid for c in convs][:2] == ["p5/0", "p5/1"]
    assert [c.seed for c in convs] == [sample_seed(1, 5, i) for i in range(8)]  # deterministic
    assert sample_seed(1, 6, 0) != sample_seed(1, 5, 0) and sample_seed(2, 5, 0) != sample_seed(1, 5, 0)
    policies = [ScriptedPolicy(chat, ["x"]) for _ in convs]
    for c, p in zip(convs, policies, strict=True):
        run(c, p, ScriptedVerifier(["again"]))
    per_turn = list(zip(*[p.seeds for p in policies], strict=True))
    assert len(per_turn) == 3 and all(len(set(s)) == 8 for s in per_turn)  # distinct at every turn
    assert all(len(set(p.seeds)) == 3 for p in policies)  # and across one sample's turns
    assert make_group([PROBLEM], chat=chat, options=opts, n=2, base_seed=None)[0].seed is None


def test_group_conversations_advance_independently(chat):
    """Conversation 0 must finish all its turns while conversation 1 is still in its first
    generation: a lock-step driver would deadlock here (and time out)."""
    opts = GuideOptions(max_turns=4, enable_hallucination_score=False)
    convs = make_group([SYSTEM, PROBLEM], chat=chat, options=opts, n=2, ground_truth="14")
    first_done = asyncio.Event()
    eot = chat.tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def policy(prompt_ids, seed):
        if seed == convs[1].seed:
            await first_done.wait()
        return chat.encode_text("x") + [eot], None, 0, "stop"

    async def verifier(messages):
        return "Go on."

    async def main():
        task = asyncio.ensure_future(run_group(convs, policy, verifier))
        while not convs[0].done:
            await asyncio.sleep(0)
        assert convs[1].num_turns == 0
        first_done.set()
        return await task

    out = asyncio.run(asyncio.wait_for(main(), timeout=10))
    assert [c.finish_reason for c in out] == ["max_turns", "max_turns"] and [c.num_turns for c in out] == [4, 4]


def test_step_protocol_misuse_raises(chat):
    conv = new_conv(chat)
    assert isinstance(conv.next_step(), GenerateStep) and isinstance(conv.next_step(), GenerateStep)  # idempotent
    with pytest.raises(RuntimeError):
        conv.on_verified("x")
    conv.on_generated(chat.encode_text("x") + [2], None, 0)
    assert isinstance(conv.next_step(), VerifyStep)
    with pytest.raises(RuntimeError):
        conv.on_generated([1], None, 0)


def test_with_the_arith_rule_verifier(chat):
    """End to end with the world's real rule verifier (asyncrl.tasks), adapted by rule_verify."""
    tasks = pytest.importorskip("asyncrl.tasks")
    from asyncrl.actors.guided import rule_verify

    verify = rule_verify(tasks.get_rule_verifier("arith"))
    policy = ScriptedPolicy(chat, ["4 * 8 = 30", "4 * 8 = 32", "32 - 6 = 26 <answer>\\boxed{26}</answer>"])
    conv = Conversation([{"role": "user", "content": "Compute 4 * 8 - 6."}], chat=chat, ground_truth="26",
                        options=GuideOptions(max_turns=5), seed=1)
    run(conv, policy, verify)
    assert conv.finish_reason == "verifier_stop" and conv.num_turns == 3
    assert conv.hallucination_scores == [0, 1, None]  # wrong step, right step, STOP
    assert conv.turns[0].reply.kind == "guidance" and "[SCORE]" not in conv.turns[0].user_content
    assert sample_metadata(conv)["verifier_version"] == "rule"


def test_options_from_config():
    from asyncrl.config import Config, GuideConfig

    g = GuideConfig(max_turns=4, on_error="continue", history="guided_grpo", stop_token=" ###STOP### ")
    o = GuideOptions.from_config(g, max_prompt_length=99, training=False)
    assert (o.max_turns, o.on_error, o.history, o.stop_token, o.max_prompt_length, o.training) == \
        (4, "continue", "guided_grpo", "###STOP###", 99, False)
    assert GuideOptions() == GuideOptions.from_config(GuideConfig())  # same defaults as the config section
    cfg = Config()
    r = GuideOptions.from_root(cfg)
    assert r.max_prompt_length == cfg.data.max_prompt_length and r.train_scope == cfg.rollout.guide.train_scope
    with pytest.raises(ValueError, match="on_error"):
        GuideOptions(on_error="ignore")


def test_guided_grpo_history_rejects_multimodal(chat):
    mm = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Angle?"}]}]
    with pytest.raises(ValueError, match="history=full"):
        Conversation(mm, chat=chat, options=GuideOptions(history="guided_grpo"), prompt_ids=[1, 2, 3])
    conv = Conversation(mm, chat=chat, options=GuideOptions(), prompt_ids=[1, 2, 3], ground_truth="30")
    v = ScriptedVerifier([STOP])
    run(conv, ScriptedPolicy(chat, [ANSWER]), v)
    assert conv.turns[0].prompt_ids == [1, 2, 3]  # the processor's ids are used as given
    assert v.requests[0][1]["content"].startswith("### Problem Statement\n[IMAGE]\nAngle?\n\n")


QWEN25_LIKE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'system' and loop.first %}{%- else %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
INST_LIKE = "{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]{% else %}{{ m.content }}{% endif %}{% endfor %}"


def test_template_variants(tokenizer):
    import copy

    qwen = copy.deepcopy(tokenizer)
    qwen.chat_template = QWEN25_LIKE
    chat = PolicyChat(qwen)  # default system prompt rendered only at the start: the pieces are the same
    assert chat.encode_user_turn("G") == chat.encode_text("\n<|im_start|>user\nG<|im_end|>\n<|im_start|>assistant\n")
    conv = run(Conversation([PROBLEM], chat=chat, options=GuideOptions(), ground_truth="14"),
               ScriptedPolicy(chat, ["x", ANSWER]), ScriptedVerifier(["Go on.", STOP]))
    assert conv.turns[1].prompt_ids == chat.encode_prompt(conv.messages()[:-1])
    thinking_off = PolicyChat(qwen, template_kwargs={"enable_thinking": False})  # a Qwen3-style kwarg
    assert thinking_off.encode_user_turn("G") == chat.encode_text(
        "\n<|im_start|>user\nG<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    inst = copy.deepcopy(tokenizer)
    inst.chat_template = INST_LIKE  # closes no assistant turn with <|im_end|>: token-exact history impossible
    inst_chat = PolicyChat(inst)
    with pytest.raises(ValueError, match="history=guided_grpo"):
        Conversation([PROBLEM], chat=inst_chat, options=GuideOptions(history="full"))
    # the original's text rewriting works with any template
    policy = ScriptedPolicy(inst_chat, ["x", ANSWER])
    conv = run(Conversation([PROBLEM], chat=inst_chat, options=GuideOptions(history="guided_grpo")),
               policy, ScriptedVerifier(["Go on.", STOP]))
    assert conv.finish_reason == "verifier_stop"
    assert policy.prompts[1] == inst_chat.encode_text(f"[INST] {PROBLEM['content']} [/INST]x[INST] Go on. [/INST]")


def test_worked_example_1_15_in_parity_mode(chat):
    """A worked three-turn example (a wrong step, guidance, a corrected answer, STOP) with the
original's settings (guided_grpo history, score shown)."""
    v1 = "Step 2 is wrong because 3*4=12. What is 3 * 4?\n[SCORE] hallucination_detect=0"
    a1, a2 = "<think>2 + 3 = 5</think> then 5 * 4", "<answer>\\boxed{14}</answer>"
    policy, verifier = ScriptedPolicy(chat, [a1, a2]), ScriptedVerifier([v1, STOP])
    conv = run(new_conv(chat, max_turns=3, history="guided_grpo", show_score_to_policy=True), policy, verifier)
    assert (conv.finish_reason, conv.num_turns, conv.hallucination_score) == ("verifier_stop", 2, 0.0)
    assert verifier.requests[0][1]["content"].endswith(f"### Conversation History\nAssistant: {a1}\n\n"
                                                       "Provide the next piece of guidance following the rules above.")
    assert f"Assistant: {a1}\nAssistant: {a2}\n\n" in verifier.requests[1][1]["content"]
    s = build_training_sample(conv)
    turn2_ctx = [SYSTEM, PROBLEM, {"role": "assistant", "content": a1}, {"role": "user", "content": v1}]
    assert s.prompt_ids.tolist() == chat.encode_prompt(turn2_ctx)  # [S][P][A1][V1] + generation prompt
    assert s.response_ids.tolist() == chat.encode_text(a2) + [chat.tokenizer.convert_tokens_to_ids("<|im_end|>")]
