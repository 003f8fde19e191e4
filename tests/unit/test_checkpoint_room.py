"""A checkpoint that cannot fit its disk is refused before anything is written: at launch (the
`disk` preflight row) and before each save (`check_room`; the trainer skips a periodic one, said
aloud). Found at real size: with the disk full, the 18-layer resume job's checkpoint failed half-way
in torch's writer ("unexpected pos 4325371520 vs 4325371416") and the job ended on a remote traceback.
Also: a remote error is named by what the task raised, not by Ray's frame header."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

import asyncrl.learner.checkpoint as ckpt
from asyncrl.checks.preflight import checkpoint_estimate, disk_fit, read_model
from asyncrl.config import load_config
from asyncrl.learner.memory import checkpoint_bytes


def test_checkpoint_bytes_by_hand():
    # fp32: module weights 4 + Adam moments 8 + HF export 4 = 16 bytes per parameter; the 18-layer
    # Qwen2.5-0.5B shape (404.6M) -> 6.474e9, measured 6,473,319,314 bytes.
    assert checkpoint_bytes(404.6e6, 404.6e6, bf16=False) == int(404.6e6 * 16)
    # bf16: weights 2 + export 2 + (fp32 master 4 + Adam 8) = 16 as well; LoRA: only the adapter is optimised
    assert checkpoint_bytes(1e9, 1e9, bf16=True) == 16 * 10**9
    assert checkpoint_bytes(1e9, 1e7, bf16=True) == 4 * 10**9 + 12 * 10**7


def _checkpoint(root: Path, step: int, size: int) -> Path:
    d = root / f"step_{step}"
    d.mkdir(parents=True)
    (d / "model.bin").write_bytes(b"\0" * size)
    return d


def test_the_next_checkpoint_needs_what_the_newest_took(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    monkeypatch.setattr(ckpt, "free_bytes", lambda path: 5000)
    ckpt.check_room(root, estimate=4000)  # none yet: the estimate (4000) fits in 5000
    with pytest.raises(ckpt.CheckpointNoRoom, match=r"no room for a checkpoint in .*checkpoints: 0\.00 GB free, "
                                                      r"one takes ~0\.00 GB \(estimated\)"):
        ckpt.check_room(root, estimate=6000)
    _checkpoint(root, 5, 7000)  # the newest took 7000 bytes: the estimate no longer counts
    with pytest.raises(ckpt.CheckpointNoRoom, match=r"the newest \(step_5\) took"):
        ckpt.check_room(root, estimate=10)
    monkeypatch.setattr(ckpt, "free_bytes", lambda path: 7000)
    ckpt.check_room(root, estimate=10**12)


def test_free_bytes_of_a_directory_not_created_yet_is_its_filesystems(tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: asked.append(p) or SimpleNamespace(free=7))
    assert ckpt.free_bytes(tmp_path / "runs" / "x" / "checkpoints") == 7
    assert asked == [tmp_path.resolve()]  # the nearest directory that exists


def test_the_disk_row_refuses_a_run_whose_first_checkpoint_cannot_fit(tmp_path, monkeypatch):
    cfg = load_config("configs/quickstart.yaml", [f"trainer.run_dir={tmp_path}"])  # 150 steps, every 25, all kept
    models = {"policy": read_model("model.path", cfg.model.path, None)}
    size = checkpoint_estimate(cfg, models["policy"])
    assert size > 0
    monkeypatch.setattr(ckpt, "free_bytes", lambda path: size - 1)
    (row,) = disk_fit(cfg, models)
    assert not row.ok and "not even one fits" in row.result and "trainer.save_limit" in row.fix
    monkeypatch.setattr(ckpt, "free_bytes", lambda path: 3 * size)
    (row,) = disk_fit(cfg, models)
    assert row.ok and "3 of the 7 this run keeps fit" in row.result  # 150 // 25 periodic + the final
    monkeypatch.setattr(ckpt, "free_bytes", lambda path: 10 * size)
    (row,) = disk_fit(cfg, models)
    assert row.ok and "(7 kept)" in row.result


def test_a_periodic_checkpoint_without_room_is_skipped_aloud_and_an_emergency_one_raises(monkeypatch, capsys):
    import asyncrl.job.loop as trainer

    def no_room(*args, **kwargs):
        raise ckpt.CheckpointNoRoom("no room for a checkpoint in /x: 0.00 GB free, the newest (step_5) took 6.47 GB")

    monkeypatch.setattr(trainer, "write_job_checkpoint", no_room)
    me = SimpleNamespace(topo=None, run_dir=Path("/x"), progress=None, fleet=[], step=7)
    assert trainer.Trainer.checkpoint(me) is None
    assert "checkpoint at step 7 skipped: no room for a checkpoint in /x" in capsys.readouterr().out
    with pytest.raises(ckpt.CheckpointNoRoom):
        trainer.Trainer.checkpoint(me, emergency=True)


def test_a_remote_error_is_named_by_what_the_task_raised():
    from ray.exceptions import RayTaskError

    from asyncrl.startup import one_line, root_cause

    inner = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4325371520 vs 4325371416")
    remote = RayTaskError("LearnerActor.save_checkpoint", "Traceback (most recent call last): ...", inner)
    remote = remote.as_instanceof_cause()
    assert root_cause(remote) is inner
    assert one_line(root_cause(remote)).startswith("RuntimeError: [enforce fail at inline_container.cc:672]")
    plain = ValueError("x")
    assert root_cause(plain) is plain


def test_a_config_without_a_decoders_dimensions_gives_no_disk_row(tmp_path):
    # the multi-node recipes' hub stubs (tests/integration/test_multinode.py) carry a bare config.json:
    # a check must not raise (the launch then failed on a KeyError instead of its GPU-count row)
    cfg = load_config("configs/quickstart.yaml", [f"trainer.run_dir={tmp_path}"])
    stub = SimpleNamespace(text={"model_type": "qwen3"})
    assert disk_fit(cfg, {"policy": stub}) == []
