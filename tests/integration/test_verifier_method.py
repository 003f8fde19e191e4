"""The three stages of the Guided-GRPO method through their commands, on real parts.

Proves: Stage 1 (`python -m asyncrl.synth`, the real topology: Ray, the Serve rule teacher, a vLLM
CPU rollout actor) killed with SIGKILL after its first chunk and run again finishes without a
duplicate row, with every kept row's teacher label equal to the arith checker's (recomputed here
from the verifier request), loadable by `datasets`; Stage 2 (`python -m asyncrl.sft`) on a small
synthetic set lowers the loss and its checkpoint, served by the `vllm` verifier back-end (the
replica class Serve runs, vLLM's CPU engine), answers in the `[SCORE]` / `###STOP###` grammar; a
teacher checkpoint vLLM cannot load exits 2 naming its config.json; Stage 3: the learned-verifier
quick start trains, and `ctl swap-verifier` swaps rule <-> learned mid-run (slow tier).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
POLICY = ROOT / "assets" / "tiny-policy"
VERIFIER = ROOT / "assets" / "tiny-verifier"
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not (POLICY / "config.json").exists(), reason="quick-start policy not built")]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
                "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"})
    return env


SYNTH = [sys.executable, "-m", "asyncrl.synth", "--config", "configs/verifier/synth_arith.yaml", "--limit", "48",
         "synth.chunk_prompts=4", "synth.samples_per_prompt=2", "synth.heldout_fraction=0.25"]


def _kill_tree(pid: int) -> None:
    """SIGKILL the synthesis driver and what it started (its embedded Ray), by pid."""
    try:
        proc = psutil.Process(pid)
        children = proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for p in [proc, *children]:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


@pytest.mark.slow  # two start-ups of the topology: ~2-4 min on 2 cores
def test_synthesis_killed_after_a_chunk_resumes_without_duplicates(tmp_path: Path) -> None:
    from asyncrl.tasks.arith_verifier import parse_verifier_request
    from asyncrl.verifier_training.rows import CHECKERS

    out = tmp_path / "data"
    first_log = tmp_path / "first.log"
    with open(first_log, "w") as log:
        proc = subprocess.Popen([*SYNTH, "--out", str(out)], cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 400
        while time.time() < deadline:
            prog = out / "progress.json"
            if prog.exists() and json.loads(prog.read_text())["done"]:
                break
            assert proc.poll() is None, f"synthesis ended before it could be killed:\n{first_log.read_text()[-3000:]}"
            time.sleep(0.1)
        else:
            raise AssertionError("no chunk finished in 400 s")
    finally:
        _kill_tree(proc.pid)
        proc.wait(timeout=60)
    done_before = len(json.loads((out / "progress.json").read_text())["done"])
    assert 1 <= done_before < 12
    second = subprocess.run([*SYNTH, "--out", str(out)], cwd=ROOT, env=_env(), capture_output=True, text=True,
                            timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"{done_before}/12 chunks already done" in second.stderr
    rows = [json.loads(ln) for ln in (out / "rows.jsonl").read_text().splitlines()]
    ids = [r["id"] for r in rows]
    assert rows and len(ids) == len(set(ids))
    for r in rows:  # the label, recomputed from the request the verifier was sent
        problem, _, turns = parse_verifier_request(r["messages"])
        assert r["step_label"] == r["checker_label"] == CHECKERS["arith"](problem, turns)
    import datasets

    ds = datasets.load_dataset(str(out), cache_dir=str(tmp_path / "hf-cache"))
    assert len(ds["train"]) + len(ds.get("heldout", [])) == json.loads((out / "summary.json").read_text())["counts"]["kept"]


def _synthetic_rows(n_dialogues: int, template: str) -> list[dict]:
    """Rows as Stage 1 writes them, from the scripted arith dialogues the tiny policy was SFT'd on,
    answered by the rule oracle (no fleet: this test is about Stage 2)."""
    from asyncrl.actors.guided import render_verifier_messages
    from asyncrl.tasks.arith import generate_split
    from asyncrl.tasks.arith_dialogues import synth_dialogue
    from asyncrl.tasks.arith_verifier import verify_turns

    rng = random.Random(0)
    rows = []
    for i, r in enumerate(generate_split("train", n_dialogues, seed=7)):
        turns = [m["content"] for m in synth_dialogue(r["problem"], rng, "guided") if m["role"] == "assistant"]
        for k in range(len(turns)):
            v = verify_turns(r["problem"], turns[: k + 1])
            rows.append({"id": f"t/{i}/0/{k}", "prompt_uid": f"t/{i}",
                         "messages": render_verifier_messages(r["problem"], r["answer"], turns[: k + 1], template),
                         "reply": v.text, "step_label": int(v.score == 0), "checker_label": int(v.score == 0),
                         "problem": r["problem"], "answer": r["answer"]})
    return rows


@pytest.mark.slow  # SFT (~1 min) + one vLLM engine start (~30-60 s) on 2 busy cores
def test_sft_lowers_the_loss_and_the_vllm_backend_serves_it_in_the_grammar(tmp_path: Path) -> None:
    import yaml

    from asyncrl.verifier_training.rows import reply_parses

    template = yaml.safe_load((ROOT / "configs/verifier/synth_arith.yaml").read_text())["rollout"]["guide"]["prompt_template"]
    rows = _synthetic_rows(60, template)
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:-8]))
    (data / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[-8:]))
    ckpt = tmp_path / "verifier"
    r = subprocess.run([sys.executable, "-m", "asyncrl.sft", "--data", str(data), "--out", str(ckpt), "--steps", "80",
                        "--batch-size", "8", "--lr", "3e-3", "--no-baseline", "--policy", str(POLICY)],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((ckpt / "sft_report.json").read_text())
    assert report["loss_last"] < 0.5 * report["loss_first"], report["loss_curve"]

    from asyncrl.config import VerifierConfig
    from asyncrl.serve.backends import VLLMVerifier

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # in this process: vLLM's CPU default reserves 92 % of RAM
    cfg = VerifierConfig(backend="vllm", model_path=str(ckpt), version="sft-test", dtype="float32",
                         max_model_len=1024).model_dump()

    async def ask() -> list[str]:
        replica = VLLMVerifier(cfg)
        replies = []
        for row in rows[-8:]:
            body = await replica.chat({"model": "verifier", "messages": row["messages"], "max_tokens": 64,
                                       "temperature": 0.0})
            assert "error" not in body, body
            replies.append(body["choices"][0]["message"]["content"])
        replica.engine.shutdown()
        return replies

    replies = asyncio.run(ask())
    parsed = [reply_parses(t)[0] for t in replies]
    assert sum(parsed) >= 6, replies  # the grammar: STOP, or guidance ending in a [SCORE] line


def test_a_teacher_checkpoint_vllm_cannot_load_exits_2_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "ckpt"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"], "model_type": "x"}))
    r = subprocess.run([sys.executable, "-m", "asyncrl.synth", "--config", "configs/verifier/synth_arith.yaml",
                        "--out", str(tmp_path / "o"), "--limit", "2", "verifier.backend=vllm",
                        f"verifier.model_path={bad}"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and str(bad / "config.json") in r.stderr and "NoSuchForCausalLM" in r.stderr


def _wait_for(path: Path, pattern: str, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and pattern in path.read_text():
            return
        time.sleep(2)
    raise AssertionError(f"{pattern!r} not seen in {path} within {timeout}s:\n{path.read_text()[-3000:]}")


def _ctl(run: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "asyncrl.ctl", *args, "--run-dir", str(run)], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # the learned-verifier quick start: three vLLM engines' start-ups and a few steps, ~4-8 min
@pytest.mark.skipif(not (VERIFIER / "config.json").exists(), reason="learned verifier not built")
def test_learned_verifier_quick_start_trains_and_swaps_rule_and_back(tmp_path: Path) -> None:
    log = tmp_path / "launch.log"
    run = tmp_path / "learned"
    cmd = [sys.executable, "-m", "asyncrl.launch", "-c", "configs/quickstart_learned_verifier.yaml",
           f"trainer.run_dir={tmp_path}", "trainer.experiment_name=learned", "trainer.max_steps=8",
           "trainer.eval_every=-1", "trainer.eval_before_after=false", "trainer.logger=[jsonl]",
           "trainer.save_every=-1", "rollout.n=4", "data.rollout_batch_size=2"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT)
        try:
            _wait_for(run / "metrics.jsonl", '"step": 2,', 900)  # 2 steps with the learned verifier: it trains
            to_rule = _ctl(run, "swap-verifier", "configs/verifier/rule_arith.yaml")
            assert to_rule.returncode == 0 and "arith-rule-v1" in to_rule.stdout, to_rule.stdout + to_rule.stderr
            back = _ctl(run, "swap-verifier", "configs/verifier/learned_arith.yaml")
            assert back.returncode == 0 and "arith-learned-v1" in back.stdout, back.stdout + back.stderr
            assert proc.wait(timeout=900) == 0, log.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=120)
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step" in r and "resumed_from" not in r]
    assert [r["step"] for r in rows] == list(range(1, 9))
    versions = " ".join(str(r.get("verifier/versions_in_batch", "")) for r in rows)
    assert "arith-learned-v1" in versions and "arith-rule-v1" in versions, versions
    assert all(r["train/loss"] == r["train/loss"] for r in rows if "train/loss" in r)  # finite (not NaN)
