"""Helpers of the replay-buffer integration tests: a buffer server in its own process (the
`python -m asyncrl.replay serve` CLI, durable log in `tmp`) and small indexed groups."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from asyncrl.replay.auth import new_secret
from asyncrl.replay.synthetic import synthetic_group

SECRET = new_secret()  # the buffer processes' secret (handed over in their environment, as a job would)


def indexed_group(rng: np.random.Generator, index: int, version: int = 0, tokens: int = 16, n: int = 2):
    """A synthetic group of `n` samples of `tokens` tokens whose prompt index is `index`."""
    g = synthetic_group(rng, prompt_uid=f"p/{index}", version=version, n=n, min_tokens=tokens, max_tokens=tokens)
    g.metadata["prompt_index"] = index
    return g


def start_buffer_process(tmp: Path, port: int, *, recover: bool, tag: str, batch_size: int) -> tuple[subprocess.Popen, str]:
    """A buffer server process with its durable log at `tmp/buffer.wal` (max_staleness 1); returns
    the process and its address once it listens (`port` 0: any free port)."""
    addr_file = tmp / f"addr-{tag}"
    cmd = [sys.executable, "-m", "asyncrl.replay", "serve", "--batch-size", str(batch_size),
           "--address-file", str(addr_file), "--log", str(tmp / "buffer.wal"), "buffer.max_staleness=1",
           f"buffer.port={port}", *(["--recover"] if recover else [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "ASYNCRL_BUFFER_SECRET": SECRET})
    end = time.monotonic() + 60
    while not addr_file.exists() and time.monotonic() < end and proc.poll() is None:
        time.sleep(0.05)
    assert addr_file.exists(), proc.stderr.read() if proc.poll() is not None else "no address"
    return proc, addr_file.read_text()
