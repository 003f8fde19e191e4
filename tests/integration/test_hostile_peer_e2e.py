"""A live quick-start job (`python -m asyncrl.launch`: real Ray, vLLM CPU engines, ZeroMQ buffer,
DeepSpeed learner) with a hostile peer beside it finishes: a process that has the buffer's secret
(the worst case: a member gone wrong) pushes poisoned groups (token ids outside the vocabulary,
positive log-probs), parks huge batch requests and sends admin requests all through the run, and a
stranger without the secret sends requests too; the job still trains every step and exits 0, and
its metrics count each refusal by reason. (Slow tier: a whole job.)"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from asyncrl.protocol import BatchRequest, Push, SetVersion, SnapshotRequest, TicketRequest, encode
from asyncrl.replay.auth import new_secret, sign
from asyncrl.replay.synthetic import synthetic_group

ROOT = Path(__file__).resolve().parents[2]
POLICY = ROOT / "assets" / "tiny-policy"
pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(not (POLICY / "config.json").exists(), reason="quick-start policy not built")]


def hostile(address: str, secret: str | None, stop: threading.Event, sent: list[int]) -> None:
    rng = np.random.default_rng(0)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    i = 0
    while not stop.is_set():
        g = synthetic_group(rng, prompt_uid=f"EVIL/{i}", version=0, n=2, min_tokens=8, max_tokens=8)
        if i % 2:  # ids within the quick-start vocabulary (384), log-probs positive
            for smp in g.samples:
                smp.prompt_ids, smp.response_ids = smp.prompt_ids % 384, smp.response_ids % 384
            g.samples[0].behaviour_logprobs = np.abs(g.samples[0].behaviour_logprobs) + 1.0
        # else: ids up to 150,000, far outside the quick-start vocabulary
        for msg, extra in ((Push(-1), [encode(g)]), (BatchRequest(10**6, 0, 1.0), []), (BatchRequest(1, 0, 1e6), []),
                           (TicketRequest("evil", float("inf")), []), (SnapshotRequest("/tmp/evil.snap"), []),
                           (SetVersion(10**9), [])):
            frames = [struct.pack("<Q", i), encode(msg), *extra]
            sock.send_multipart(sign(frames, secret) if secret is not None else frames)
            sent[0] += 1
        while sock.poll(0):
            sock.recv_multipart()
        i += 1
        time.sleep(0.2)
    sock.close()
    ctx.term()


def test_a_job_with_a_hostile_peer_beside_it_finishes(tmp_path: Path) -> None:
    secret = new_secret()
    cmd = [sys.executable, "-m", "asyncrl.launch", "-c", "configs/quickstart.yaml", f"trainer.run_dir={tmp_path}",
           "rollout.n=4", "data.rollout_batch_size=2", "rollout.cpus_per_actor=0.5", "learner.cpus_per_rank=0.5",
           "verifier.port=0", "trainer.logger=[jsonl]", "trainer.experiment_name=hostile", "trainer.max_steps=4",
           "trainer.eval_before_after=false", "rollout.num_actors=1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}
    # the test plays a member gone wrong: it learns the secret the way the job's processes do (the config)
    proc = subprocess.Popen([*cmd, f"buffer.secret={secret}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    stop, threads, sent, out = threading.Event(), [], [0], []
    try:
        for line in proc.stdout:
            out.append(line)
            m = re.search(r"replay buffer listening at (tcp://\S+)", line)
            if m and not threads:
                for s in (secret, None):
                    threads.append(threading.Thread(target=hostile, args=(m.group(1), s, stop, sent), daemon=True))
                    threads[-1].start()
        proc.wait(timeout=900)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        if proc.poll() is None:
            proc.kill()
    text = "".join(out)
    assert threads, "the job never said where its buffer listens:\n" + text[-3000:]
    assert proc.returncode == 0, text[-4000:]
    assert secret not in (tmp_path / "hostile" / "config.resolved.json").read_text()
    rows = [json.loads(x) for x in (tmp_path / "hostile" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step" in r and "resumed_from" not in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    last = rows[-1]
    assert sent[0] > 0
    for reason in ("token_id", "logprob", "num_groups", "timeout", "admin", "unauthenticated"):
        assert last[f"buffer/refused/{reason}"] > 0, reason
    trained = [i for r in rows for i in r["train/prompt_indices"]]
    assert len(trained) == len(set(trained)) == 4 * 2  # only the job's own groups were trained
    assert not Path("/tmp/evil.snap").exists()
