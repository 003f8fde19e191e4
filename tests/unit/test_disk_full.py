"""Proves the job-level side of a full disk (asyncrl.job.disk_watch), with real ENOSPC errors (writes to
/dev/full, and a small tmpfs filled to the last byte where the machine lets us mount one): low free
space pauses admission with one line and resumes it with another; a pause that outlasts
`trainer.disk_full_wait_s` ends the job with `DiskFull`; ENOSPC is recognised through exception
chains, Ray-style causes and remote error texts (and nothing else is); on a full run directory the
named stop still writes its error log (elsewhere), tries the emergency checkpoint, and exits 3; the
coordinator keeps serving when its state file cannot be written."""

from __future__ import annotations

import errno
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.failure_watch import stop_named
from asyncrl.job.disk_watch import DiskFull, DiskWatch, emergency_root, is_disk_full
from asyncrl.job.recovery import Progress

MB = 2**20


def _enospc() -> OSError:
    try:
        with open("/dev/full", "w") as f:
            f.write("x")
            f.flush()
    except OSError as exc:
        return exc
    raise AssertionError("/dev/full accepted a write")


def test_enospc_is_recognised_through_chains_and_remote_texts() -> None:
    real = _enospc()
    assert real.errno == errno.ENOSPC and is_disk_full(real)
    try:
        try:
            raise real
        except OSError as exc:
            raise RuntimeError("the learner's checkpoint failed") from exc
    except RuntimeError as wrapped:
        assert is_disk_full(wrapped)

    class RemoteError(Exception):  # as ray.exceptions.RayTaskError carries what the task raised
        def __init__(self, cause: BaseException):
            super().__init__("ray::Learner.save_checkpoint() failed")
            self.cause = cause

    assert is_disk_full(RemoteError(real))
    assert is_disk_full(RuntimeError("ErrorReply:bad_request: OSError [Errno 28] No space left on device"))
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not is_disk_full(RuntimeError("is the rollout fleet alive?"))


def test_the_replay_buffers_named_full_disk_conditions_are_recognised() -> None:
    from asyncrl.replay.client import BufferDiskFull, BufferRequestError
    from asyncrl.replay.wal import LogFull

    quota = LogFull(Path("/run/state/buffer.wal"), 4096, OSError(errno.EDQUOT, "Disk quota exceeded"))
    too_big = LogFull(Path("/run/state/buffer.wal"), 4096, OSError(errno.EFBIG, "File too large"))
    assert is_disk_full(quota) and is_disk_full(too_big)  # EFBIG only as the log's named condition
    assert is_disk_full(BufferDiskFull("disk_full", "durable log: disk full"))
    assert is_disk_full(BufferRequestError("disk_full", "the push was not stored"))
    assert not is_disk_full(BufferRequestError("out_of_range", "timeout_s=inf"))
    assert not is_disk_full(OSError(errno.EFBIG, "File too large"))


def test_the_buffers_unwritable_log_pauses_admission_with_a_line_and_ends_after_the_wait(tmp_path: Path) -> None:
    """The run directory's free space check switched off (min_free_mb=0), the buffer's gauge on."""
    log_full = [False]
    admitting: list[bool] = []
    lines: list[str] = []
    watch = DiskWatch(tmp_path, min_free_mb=0, wait_s=0.3, set_admitting=admitting.append, echo=lines.append,
                      buffer_log_full=lambda: log_full[0])
    watch.check()
    assert admitting == [] and lines == []
    log_full[0] = True
    watch.check()
    watch.check()
    assert admitting == [False] and len(lines) == 1
    assert "admission paused (disk full)" in lines[0] and "buffer/disk_full" in lines[0]
    log_full[0] = False
    watch.check()
    assert admitting == [False, True] and "admission resumed" in lines[-1] and not watch.paused
    log_full[0] = True
    watch.check()
    time.sleep(0.4)
    with pytest.raises(DiskFull, match="the replay buffer's durable log stayed full for 0s"):
        watch.check()


def test_low_space_pauses_admission_resumes_then_ends_after_the_wait(tmp_path: Path) -> None:
    free = [500 * MB]
    admitting: list[bool] = []
    lines: list[str] = []
    watch = DiskWatch(tmp_path, min_free_mb=64, wait_s=0.3, set_admitting=admitting.append,
                      free=lambda _: free[0], echo=lines.append)
    watch.check()
    assert admitting == [] and lines == []
    free[0] = 10 * MB
    watch.check()
    watch.check()
    assert admitting == [False] and len(lines) == 1 and "admission paused" in lines[0] and "10 MB free" in lines[0]
    free[0] = 100 * MB  # above the floor but below twice it: still paused (no flapping)
    watch.check()
    assert watch.paused and admitting == [False]
    free[0] = 200 * MB
    watch.check()
    assert admitting == [False, True] and "admission resumed" in lines[-1] and not watch.paused
    free[0] = 1 * MB
    watch.check()
    time.sleep(0.4)
    with pytest.raises(DiskFull) as info:
        watch.check()
    assert "stayed full" in str(info.value) and str(tmp_path) in str(info.value)


def _fill(directory: Path) -> None:
    """Write into `directory` until its filesystem has no byte left."""
    try:
        with open(directory / "filler", "wb", buffering=0) as f:
            while True:
                f.write(b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MB tmpfs (skipped where mounting is not allowed); `_fill` fills it."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if shutil.which("mount") is None or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def full_tmpfs(tmpfs: Path) -> Path:
    _fill(tmpfs)
    return tmpfs


def test_a_named_stop_on_a_full_run_directory_still_reports_and_checkpoints_elsewhere(
        full_tmpfs: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run_dir = full_tmpfs / "run"
    try:
        run_dir.mkdir()
    except OSError:
        run_dir = full_tmpfs  # no room even for a directory entry
    with pytest.raises(OSError) as info:
        (run_dir / "metrics.jsonl").write_text("x" * 100_000)
    assert is_disk_full(info.value)
    saved: list[Path] = []
    elsewhere = emergency_root(str(tmp_path / "spare"), run_dir)

    def checkpoint() -> Path:
        elsewhere.mkdir(parents=True, exist_ok=True)
        (elsewhere / "step_3").mkdir()
        saved.append(elsewhere / "step_3")
        return elsewhere / "step_3"

    class Logger:
        def close(self) -> None:
            raise _enospc()

    full = DiskFull(f"a write of the job failed on a full disk ({info.value})")
    code = stop_named(full, run_dir, Progress(step=3, version=3), Logger(), checkpoint)
    out = capsys.readouterr().out
    assert code == 3 and saved == [elsewhere / "step_3"]
    assert "error: DiskFull: a write of the job failed on a full disk" in out
    assert f"emergency checkpoint written outside the run directory: {elsewhere / 'step_3'}" in out
    assert "Traceback: " in out and "not written" not in out  # error.log went to the fallback directory


def test_the_coordinator_keeps_serving_when_its_state_file_cannot_be_written(tmpfs: Path) -> None:
    from asyncrl.config import DataConfig
    from asyncrl.job.coordinator import Coordinator

    rows = [{"problem": f"Compute {i} + 1.", "answer": str(i + 1)} for i in range(4)]
    coord = Coordinator(rows, DataConfig(shuffle=False).model_dump_json(), state_path=str(tmpfs / "c.json"))
    (tmpfs / "c.json").unlink()  # the disk fills during the run, after its first save
    _fill(tmpfs)
    item = coord.next_prompt("a", "r1")
    coord.complete(item["index"])
    coord.set_admitting(False)
    assert coord.get_state()["admitting"] is False and coord.next_prompt("a", "r2") is None
    assert coord.counters["state_save_failed"] >= 3
