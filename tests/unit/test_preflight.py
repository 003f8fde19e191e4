"""The model against the config before anything starts (asyncrl.checks.preflight), and the launcher's
refusal: a context too short for the lengths (the issue's command), a model verifier whose context
is too short, a tokenizer without a chat template and a vision key on a text model each exit 2 in
under 5 s with the keys named, without ever importing Ray (so no Ray can have started). The
context derivation's numbers are derived by hand from vLLM 0.32's rules (the module docstring);
tests/integration/test_preflight_vllm.py checks the same cases against vLLM's own code."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.checks.preflight import check_model, model_context, read_model, refusals
from asyncrl.config import load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "assets" / "tiny-policy"
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
LAUNCH_ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore::DeprecationWarning"}


def model_dir(tmp: Path, name: str = "m", config: dict | None = None, tokenizer: dict | None = None,
              template: bool = True) -> Path:
    """The tiny policy's config and tokenizer files (no weights: preflight never reads them), with
    `config` / `tokenizer` keys replaced (None values removed)."""
    out = tmp / name
    out.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json") + (("chat_template.jinja",) if template else ()):
        shutil.copy(TINY / f, out / f)
    for fname, changes in (("config.json", config), ("tokenizer_config.json", tokenizer)):
        data = json.loads((out / fname).read_text())
        for k, v in (changes or {}).items():
            if v is None:
                data.pop(k, None)
            else:
                data[k] = v
        (out / fname).write_text(json.dumps(data))
    return out


# ------------------------------------------------------------------------------ the derivation
CONTEXT_CASES = {
    # name: (config.json changes, tokenizer_config.json changes, tokens vLLM derives)
    "plain": ({}, {}, 1024),  # max_position_embeddings 1024, tokenizer model_max_length 1024
    "tokenizer does not cap": ({}, {"model_max_length": 512}, 1024),  # read for pooling models only
    "linear rope x2": ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
                       {"model_max_length": None}, 2048),  # 1024 x factor 2
    "yarn is prescaled": ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                               "original_max_position_embeddings": 256}},
                          {"model_max_length": None}, 1024),  # yarn: factor not applied again
    "sliding window does not cap": ({"use_sliding_window": True, "sliding_window": 256, "max_window_layers": 0},
                                    {}, 1024),  # vLLM caps only with disable_sliding_window
}


@pytest.mark.parametrize("case", CONTEXT_CASES)
def test_context_derived_as_vllm_does(tmp_path: Path, case: str) -> None:
    config, tokenizer, tokens = CONTEXT_CASES[case]
    ctx = model_context(read_model("model.path", str(model_dir(tmp_path, config=config, tokenizer=tokenizer)), None))
    assert ctx.tokens == tokens


def test_vl_context_is_the_text_configs() -> None:
    ctx = model_context(read_model("model.path", str(ROOT / "assets" / "tiny-vl-policy"), None))
    assert ctx.tokens == 4096 and "max_position_embeddings=4096" in ctx.source  # text_config's, not the top level


def test_quickstart_passes_and_a_derived_length_is_capped(tmp_path: Path) -> None:
    cfg = load_config(str(QUICKSTART), [f"trainer.run_dir={tmp_path}"])
    rows = check_model(cfg)
    assert refusals(rows) == [] and cfg.rollout.max_model_len == 768  # 256 + 4 x (64 + 64), untouched
    # 10 turns: derived 256 + 10 x (64 + 64) = 1536 > 1024, but one turn needs only 256 + 64 = 320
    cfg = load_config(str(QUICKSTART), ["rollout.guide.max_turns=10"])
    rows = check_model(cfg)
    assert refusals(rows) == [] and cfg.rollout.max_model_len == 1024
    assert any(r.notice and "capped" in r.result for r in rows)
    # the same length configured by hand is the user's number: refused, not capped
    cfg = load_config(str(QUICKSTART), ["rollout.max_model_len=1500"])
    (line,) = refusals(check_model(cfg))
    assert "rollout.max_model_len=1500 exceeds" in line and "1024" in line


def test_engine_budget_and_kv_cache(tmp_path: Path) -> None:
    cfg = load_config(str(QUICKSTART), ["rollout.max_num_seqs=4096", "rollout.max_num_batched_tokens=2048"])
    assert any("rollout.max_num_seqs=4096" in line for line in refusals(check_model(cfg)))
    # a 128-layer, 64-kv-head, head_dim 128 model: 2 x 128 x 64 x 128 x 4 B = 8 MiB per token (float32),
    # x 768 tokens = 6 GiB > the 1 GiB of rollout.cpu_kvcache_gb=1
    big = {"num_hidden_layers": 128, "num_key_value_heads": 64, "num_attention_heads": 64, "head_dim": 128}
    cfg = load_config(str(QUICKSTART), [f"model.path={model_dir(tmp_path, config=big)}"])
    (line,) = [r for r in refusals(check_model(cfg)) if "rollout.cpu_kvcache_gb" in r]  # (+ the memory guard's)
    assert "6.000 GiB" in line


# ------------------------------------------------------------------------------ the launcher
def launch(*overrides: str) -> tuple[int, float, str, bool]:
    """`python -m asyncrl.launch --config quickstart.yaml OVERRIDES` in a fresh process: exit code,
    seconds, stderr + stdout, and whether Ray was ever imported (no import: no Ray started)."""
    code = ("import sys; from asyncrl.launch import main; rc = main(sys.argv[1:]); "
            "print('RAY_IMPORTED' if 'ray' in sys.modules else 'NO_RAY'); sys.exit(rc)")
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-c", code, "--config", str(QUICKSTART), *overrides],
                          capture_output=True, text=True, cwd=ROOT, env=LAUNCH_ENV, timeout=60)
    seconds = time.time() - t0
    out = proc.stderr + proc.stdout
    return proc.returncode, seconds, out, "NO_RAY" not in proc.stdout


def assert_refused(overrides: list[str], *named: str) -> str:
    rc, seconds, out, ray_imported = launch(*overrides, "trainer.run_dir=/nonexistent-run-dir")
    assert rc == 2, out
    assert seconds < 5, f"{seconds:.1f}s"  # generous: ~0.3 s here
    assert not ray_imported and "Started a local Ray instance" not in out
    assert out.startswith("error: ")
    for key in named:
        assert key in out, (key, out)
    return out


def test_the_issues_context_case_exits_2_at_once() -> None:
    out = assert_refused(["data.max_prompt_length=2048", "data.max_response_length=2048",
                          "rollout.max_num_batched_tokens=8192"],
                         "data.max_prompt_length", "data.max_response_length", "rollout.max_model_len",
                         "rollout.max_num_batched_tokens", "max_position_embeddings=1024")
    assert "2048 + 2048 = 4096" in out and "10496" in out  # 2048 + 4 x (2048 + 64)


def test_a_model_verifier_whose_context_is_too_short(tmp_path: Path) -> None:
    # the verifier's context is 1024; its template alone is ~2069 tokens of the tiny tokenizer
    out = assert_refused(["verifier.backend=vllm", f"verifier.model_path={TINY}", "verifier.max_model_len=1024"],
                         "verifier.max_model_len", "data.max_response_length", "rollout.guide.sampling.max_tokens")
    assert "raise verifier.max_model_len to at least" in out
    out = assert_refused(["verifier.backend=vllm", f"verifier.model_path={TINY}"],  # default 4096 > 1024
                         "verifier.max_model_len=4096 exceeds the context of verifier.model_path")


def test_a_tokenizer_without_chat_template(tmp_path: Path) -> None:
    bare = model_dir(tmp_path, template=False)
    assert_refused([f"model.path={bare}"], "no chat template", str(bare), "model.tokenizer_path")


def test_a_vision_key_on_a_text_model() -> None:
    assert_refused(["rollout.limit_images=1", "model.freeze_vision_tower=true"],
                   "rollout.limit_images=1", "model.freeze_vision_tower=True", "text model")


def test_a_text_history_on_a_vision_model() -> None:
    assert_refused(["model.path=assets/tiny-vl-policy", "rollout.guide.history=guided_grpo",
                    "rollout.guide.train_scope=final_turn"], "rollout.guide.history=guided_grpo")


def test_an_unset_secret_and_a_missing_key_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASYNCRL_TEST_NO_SUCH_SECRET", raising=False)
    cfg = load_config(str(QUICKSTART), ["verifier.api_key=env:ASYNCRL_TEST_NO_SUCH_SECRET", "buffer.curve.enable=true",
                                        "buffer.curve.server_secret_key_file=/nonexistent/server.key_secret"])
    (line,) = refusals(check_model(cfg))
    assert "verifier.api_key=env:ASYNCRL_TEST_NO_SUCH_SECRET" in line and "buffer.curve.server_secret_key_file" in line
    monkeypatch.setenv("ASYNCRL_TEST_NO_SUCH_SECRET", "s3cret")
    cfg = load_config(str(QUICKSTART), ["verifier.api_key=env:ASYNCRL_TEST_NO_SUCH_SECRET"])
    assert refusals(check_model(cfg)) == []


def test_registered_checks_become_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook a launch-time memory guard plugs into: a model check before Ray, a node check after."""
    from asyncrl.checks import preflight

    monkeypatch.setattr(preflight, "CHECKS", list(preflight.CHECKS))
    monkeypatch.setattr(preflight, "NODE_CHECKS", [])

    @preflight.register_check
    def guard(cfg, models):  # noqa: ANN001, ANN202
        return [preflight.Row("memory guard", False, f"{models['policy'].key} needs 99 GiB", "lower it")]

    @preflight.register_node_check
    def per_node(cfg, probes):  # noqa: ANN001, ANN202
        return [preflight.Row("node memory", len(probes) == 1, f"{len(probes)} node(s)")]

    rows = check_model(load_config(str(QUICKSTART)))
    assert rows[-1].check == "memory guard" and refusals(rows) == ["model.path needs 99 GiB -> lower it"]
    assert [r.ok for r in preflight.check_nodes(load_config(str(QUICKSTART)), [{"ip": "10.0.0.1"}])] == [True]


def test_a_wrong_prompt_column_exits_2_at_once() -> None:
    out = assert_refused(["data.prompt_key=question"], "data.prompt_key", "no column 'question'",
                         "assets/arith/train.jsonl", "'problem'")
    assert out.count("error: ") == 1  # one line naming every split's file


def test_a_taken_port_two_listeners_on_one_port_and_a_missing_checkpoint() -> None:
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        cfg = load_config(str(QUICKSTART), [f"buffer.port={port}", "learner.weights.port=29901", "verifier.port=29901",
                                            "trainer.resume=/nonexistent/checkpoint"])
        ports, resume = refusals(check_model(cfg))
    assert f"buffer.port={port}: 127.0.0.1:{port} is taken" in ports
    assert "learner.weights.port and verifier.port are all 29901" in ports
    assert resume.startswith("trainer.resume=/nonexistent/checkpoint: no such checkpoint")


def test_an_unknown_rule_task_exits_2_at_once() -> None:
    assert_refused(["verifier.task=nosuch"], "verifier.task=nosuch", "known tasks: arith")


def test_a_truncated_weight_file(tmp_path: Path) -> None:
    model = tmp_path / "policy"
    shutil.copytree(TINY, model)
    weights = model / "model.safetensors"
    size = weights.stat().st_size
    os.truncate(weights, size - 100)  # an interrupted download: the header promises 100 bytes more
    out = assert_refused([f"model.path={model}"], "model.safetensors is truncated", f"{size - 100} bytes",
                         f"needs {size}")
    assert out.count("error: ") == 1


def test_an_http_verifier_nobody_serves_is_refused_before_ray() -> None:
    import socket

    from asyncrl.checks.preflight import check_http_verifier

    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    http = ["verifier.backend=http", "verifier.http.model=m"]
    cfg = load_config("configs/quickstart.yaml", [*http, f"verifier.http.base_url=http://127.0.0.1:{dead}/v1"])
    [row] = check_http_verifier(cfg, {})
    assert not row.ok and row.result == (f"verifier.http.base_url=http://127.0.0.1:{dead}/v1: nothing answers "
                                         f"at 127.0.0.1:{dead} (connection refused)")
    # on a cluster the driver's view is not the replica's: said aloud, left to the probe through Serve
    on_cluster = load_config("configs/quickstart.yaml", [*http, f"verifier.http.base_url=http://127.0.0.1:{dead}/v1",
                                                         "cluster.ray_address=10.0.0.1:6379"])
    [row] = check_http_verifier(on_cluster, {})
    assert row.ok and row.notice and "the probe through Serve decides" in row.result
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        cfg = load_config("configs/quickstart.yaml", [*http, f"verifier.http.base_url=http://127.0.0.1:{port}/v1"])
        [row] = check_http_verifier(cfg, {})
    assert row.ok and row.result == f"127.0.0.1:{port} accepts connections"
    assert check_http_verifier(load_config("configs/quickstart.yaml", []), {}) == []  # rule back-end: nothing to do


def test_the_launchers_model_preflight_imports_neither_torch_nor_transformers() -> None:
    """`check_model` runs in the launcher before Ray starts: importing torch there cost 1.7 s of every
    launch (the disk row's helpers in learner.checkpoint and weights.adapter imported it at module
    level). A fresh interpreter runs it on the quick start and reports what it imported."""
    code = ("import sys; from asyncrl.config import load_config; from asyncrl.checks.preflight import check_model; "
            "check_model(load_config('configs/quickstart.yaml', [])); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
