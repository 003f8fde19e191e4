"""`python -m asyncrl.serve` as a user runs it (a real subprocess, its own Ray).

Proves: with the quick start's config (whose job keeps Serve handles only, `verifier.ingress: false`)
the service alone serves HTTP anyway: it prints the OpenAI base URL, the official `openai` client gets
the rule verifier's reply with the configured version, and Ctrl-C (SIGINT) stops it cleanly (exit 0).
`verifier.ingress=false` on the command line with an embedded Ray exits 2 before Ray starts, naming
the key.
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
from pathlib import Path

import pytest

from asyncrl.serve.__main__ import ingress_turned_off
from asyncrl.tasks import get_rule_verifier
from asyncrl.verifier_protocol import render_verifier_messages

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def test_quickstart_config_serves_http_to_the_openai_client():
    from openai import OpenAI

    namespace = f"test-serve-cli-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.serve", "--config", str(QUICKSTART),
                             "cluster.num_cpus=2", f"cluster.namespace={namespace}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=ROOT)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True).start()
    seen: list[str] = []
    try:
        url, deadline = None, time.monotonic() + 180
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            seen.append(line)
            if "serving at http://" in line:
                url = line.split("serving at ")[1].split()[0]
        assert url is not None, "no URL printed:\n" + "".join(seen[-30:])
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1"), url
        messages = render_verifier_messages("Compute 2 + 3 * 4.", "14", ["3 * 4 = 12"])
        client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30)
        resp = client.chat.completions.create(model="ve", messages=messages, max_tokens=256, temperature=0.2,
                                              top_p=0.95, extra_body={"top_k": -1})
        assert resp.choices[0].message.content == get_rule_verifier("arith")(messages)
        assert resp.model_extra["version"] == "arith-rule-v1"  # the quick start's verifier.version
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_ingress_off_on_the_command_line_with_embedded_ray_exits_2():
    proc = subprocess.run([sys.executable, "-m", "asyncrl.serve", "--config", str(QUICKSTART),
                           "verifier.ingress=false"], capture_output=True, text=True, env=_env(), cwd=ROOT,
                          timeout=60)
    assert proc.returncode == 2 and "verifier.ingress=false" in proc.stderr, proc.stderr


def test_only_the_command_line_turns_ingress_off():
    assert not ingress_turned_off([])                       # the file's `ingress: false` is not asked here
    assert not ingress_turned_off(["verifier.port=0", "verifier.ingress=true"])
    assert ingress_turned_off(["verifier.ingress=false"])
    assert not ingress_turned_off(["verifier.ingress=false", "verifier.ingress=true"])  # last one wins
