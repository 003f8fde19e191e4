"""`python -m asyncrl.serve --config X.yaml` as a user runs it (a real subprocess, its own Ray).

Proves: it prints the OpenAI base URL once the verifier serves, the URL answers Guided-GRPO's
request body with the configured version, and Ctrl-C (SIGINT) stops it cleanly (exit status 0).
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid

import httpx
import pytest
import yaml

from asyncrl.verifier_protocol import render_verifier_messages

pytestmark = pytest.mark.integration


def test_python_m_asyncrl_serve(tmp_path):
    cfg = tmp_path / "verifier.yaml"
    cfg.write_text(yaml.safe_dump({
        "verifier": {"backend": "rule", "task": "arith", "version": "cli-v1", "port": 0},
        "cluster": {"num_cpus": 2, "namespace": f"test-serve-cli-{uuid.uuid4().hex[:8]}"},
    }))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.serve", "--config", str(cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True).start()
    try:
        url, deadline = None, time.monotonic() + 180
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            if "serving at http://" in line:
                url = line.split("serving at ")[1].split()[0]
        assert url is not None and url.startswith("http://127.0.0.1:") and url.endswith("/v1"), "no URL printed"
        body = {"model": "ve", "messages": render_verifier_messages("Compute 2 + 3 * 4.", "14", ["3 * 4 = 12"]),
                "max_tokens": 256, "temperature": 0.2, "top_p": 0.95, "top_k": -1}
        r = httpx.post(url + "/chat/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["version"] == "cli-v1", r.text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
