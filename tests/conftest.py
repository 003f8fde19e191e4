"""Helpers shared by test files (imported as `from conftest import ...`): a ChatML chat template,
the two kinds of tiny local tokenizers the tests build (no model hub here), and an event loop on
a thread for vLLM's async engine; and how the test process exits (`pytest_unconfigure`)."""

from __future__ import annotations

import asyncio
import atexit
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

import pytest


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    session.config.asyncrl_exitstatus = int(exitstatus)


@pytest.hookimpl(trylast=True)  # after every other plugin's unconfigure
def pytest_unconfigure(config: Any) -> None:
    """Leave the test process with pytest's own status once the tests and every report are done.
    vLLM engines built in this process (tests/integration/test_engine*.py, test_vl_*.py) keep
    native threads and an `AsyncLLM.__del__` that calls into modules the interpreter has already
    torn down; finalizing that process has ended in a segmentation fault (CI, after "1 failed,
    849 passed": `make test` exited 139 instead of 1), which would fail a green run too. So: the
    atexit handlers run (Ray's shutdown among them), then `os._exit` skips the finalization.
    ASYNCRL_TEST_FINALIZE=1 keeps Python's normal exit (to look at what crashes there)."""
    status = getattr(config, "asyncrl_exitstatus", None)
    if status is None or os.environ.get("ASYNCRL_TEST_FINALIZE") == "1":
        return
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


# The ChatML layout of Qwen-style models, as a chat template.
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATML_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 in both tokenizers below


def wordlevel_chatml_tokenizer(words: Sequence[str]) -> Any:
    """One token per whitespace-separated word (ids: the special tokens, `<unk>`, then `words` in
    order), ChatML template, `<|im_end|>` as EOS: token ids a test can write by hand."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate([*CHATML_SPECIAL, "<unk>", *words])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<|endoftext|>",
                                   eos_token="<|im_end|>", additional_special_tokens=CHATML_SPECIAL[1:])
    fast.chat_template = CHATML
    return fast


def bpe_chatml_tokenizer(corpus: Sequence[str], vocab_size: int) -> Any:
    """A byte-level BPE trained on `corpus` (any text round-trips; merges make ids non-canonical
    sequences possible, as in real tokenizers), ChatML template, `<|im_end|>` (id 2) as EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=CHATML_SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(corpus), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHATML)


class LoopThread:
    """One event loop on a daemon thread (vLLM's AsyncLLM binds to the loop that first uses it, so a
    test module keeps one loop for its engine and runs every coroutine on it)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 300) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)
