"""Where a job's output goes: asyncrl's story on the console, every other line in files.

Quiet mode (the default of `python -m asyncrl.launch`):
- The console shows asyncrl's own lines (start-up with timings, progress, evaluations, the summary),
  errors, and warnings that need the user: WARNING and above from the `asyncrl.*` loggers of every
  process, and from third-party loggers unless the message is on the known-harmless list
  (`HARMLESS`: vLLM's CPU build, DeepSpeed, torch and Ray notices that every CPU run prints).
- Everything else goes to `<run_dir>/logs/`: one file per role with every byte the process wrote
  to its stdout/stderr, C extensions and child processes included (`driver.log`, `coordinator.log`,
  `buffer.log`, `verifier.log`, `rollout-N.log`, `learner-N.log`), and `serve/` with Ray Serve's
  controller, proxy and replica logs (one line per verifier request). `attention.log` collects the
  lines the actors meant for the console (the driver echoes them). Nothing is dropped.

Verbose mode (`--verbose` or `ASYNCRL_VERBOSE=1`): nothing is redirected; every process prints to the
console as Ray forwards it (Ray's session directory keeps its usual copies).

Contract with the roles: each Ray actor of a job calls `redirect_output(role)` first in its
constructor. It is a no-op outside a job (`ASYNCRL_LOG_DIR` unset) and in verbose mode. The driver
wraps the job in `quiet_console(run_dir)` and writes its own lines with `echo` (asyncrl.startup.say).
Multi-node jobs: each node writes its roles' files under the same path on its own disk; the driver
echoes the attention lines of its own node only.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

LOG_DIR_ENV = "ASYNCRL_LOG_DIR"
VERBOSE_ENV = "ASYNCRL_VERBOSE"
ATTENTION_FILE = "attention.log"

# Warnings every CPU run prints and no user can act on; they stay in the files.
HARMLESS = tuple(re.compile(p) for p in (
    r"No CUDA runtime is found",
    r"Triton is (installed, but doesn't include CPU backend|not installed)",
    r"does not officially support disabling chunked prefill",
    r"Enforce eager set, disabling torch\.compile",
    r"Inductor compilation was disabled",
    r"Reset SSM cache type",
    r"Model Runner V2 requires Triton",
    r"Token authentication is enabled for this Ray cluster",
    r"Connecting to existing Serve app",
    r"RotaryEmbedding: Failed to load weights",  # vLLM's layer-wise reload: RoPE has no weights
    r"lib(tcmalloc|iomp) is not found in LD_PRELOAD",
    r"Passing raw prompts to InputProcessor is deprecated",
    r"deepspeed_shm_comm_op built successfully",
))


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "").lower() in ("1", "true", "yes", "on")


def is_harmless(message: str) -> bool:
    return any(p.search(message) for p in HARMLESS)


class _NotHarmless(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return not is_harmless(record.getMessage())
        except Exception:  # noqa: BLE001 - a badly formatted record is not a reason to hide it
            return True


def log_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "logs"


def worker_env() -> dict[str, str]:
    """Environment for every process of the job (Ray runtime_env): where the role files go and the
    Serve switch that keeps its components off stderr. Empty outside `quiet_console`."""
    if verbose():
        return {VERBOSE_ENV: "1"}
    if not os.environ.get(LOG_DIR_ENV):
        return {}
    return {LOG_DIR_ENV: os.environ[LOG_DIR_ENV], "RAY_SERVE_LOG_TO_STDERR": "0"}


def serve_logging_config() -> dict[str, str] | None:
    """Ray Serve's LoggingConfig for the controller, proxy and replicas: their logs (one line per
    request) under `logs/serve/` of the run. None (Serve's defaults) outside a quiet job."""
    if verbose() or not os.environ.get(LOG_DIR_ENV):
        return None
    return {"logs_dir": str(Path(os.environ[LOG_DIR_ENV]) / "serve"), "enable_access_log": True}


_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_redirected: str | None = None


def redirect_output(role: str) -> Path | None:
    """Send this process's stdout and stderr (file descriptors 1 and 2, so C extensions and child
    processes started later too) to `logs/<role>.log`; WARNING+ log records (third-party ones unless
    harmless) also go to `logs/attention.log`, which the driver echoes. Returns the file, or None when
    not in a quiet job. Idempotent per process."""
    global _redirected
    directory = os.environ.get(LOG_DIR_ENV)
    if not directory or verbose():
        return None
    path = Path(directory) / f"{role}.log"
    if _redirected is not None:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    _redirected = role
    print(f"===== {role} (pid {os.getpid()}) {time.strftime('%Y-%m-%d %H:%M:%S')} =====", flush=True)
    attention = logging.FileHandler(Path(directory) / ATTENTION_FILE)
    attention.setLevel(logging.WARNING)
    attention.addFilter(_NotHarmless())
    attention.setFormatter(logging.Formatter(f"[{role}] %(levelname)s %(name)s: %(message)s"))
    _install_root_handlers(attention)
    return path


def role_log_file() -> Path | None:
    """This process's log file once `redirect_output` sent it there; None otherwise (verbose mode,
    outside a job): then its output, tracebacks included, is on the console."""
    if _redirected is None:
        return None
    return Path(os.environ[LOG_DIR_ENV]) / f"{_redirected}.log"


def _install_root_handlers(console: logging.Handler) -> None:
    """Root: every record to stderr (now the role's file) + `console` for what needs the user;
    `asyncrl.*` at INFO (its records reach the root's handlers)."""
    root = logging.getLogger()
    to_file = logging.StreamHandler(sys.stderr)
    to_file.setFormatter(logging.Formatter(_FORMAT))
    root.addHandler(to_file)
    root.addHandler(console)
    logging.getLogger("asyncrl").setLevel(logging.INFO)
    for name in ("ray", "ray.serve"):  # their own stream handlers write to the file; add the console
        logging.getLogger(name).addHandler(console)


# ------------------------------------------------------------------------------------- driver
_console: TextIO | None = None
_console_err: TextIO | None = None
_driver_log: TextIO | None = None


def echo(line: str, *, err: bool = False) -> None:
    """One asyncrl line on the console (stderr with `err`), and in `logs/driver.log` when quiet."""
    stream = (_console_err if err else _console) or (sys.stderr if err else sys.stdout)
    print(line, file=stream, flush=True)
    if _driver_log is not None:
        try:
            print(line, file=_driver_log, flush=True)
        except OSError:  # a full disk: the console has the line; the error path must not fail on its log
            pass


def console() -> TextIO:
    """The stream asyncrl's own output (progress bar, summary) should use."""
    return _console or sys.stdout


class _Echo(threading.Thread):
    """Echo new lines of `attention.log` (the actors' warnings) to the console."""

    def __init__(self, path: Path) -> None:
        super().__init__(name="asyncrl-attention", daemon=True)
        self.path, self.offset, self.done = path, 0, threading.Event()
        if path.exists():
            self.offset = path.stat().st_size  # a resumed run: earlier lines were shown by earlier runs

    def drain(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # whole lines only
        self.offset += end
        for line in data[:end].decode(errors="replace").splitlines():
            if line.strip():
                echo(line, err=True)

    def run(self) -> None:
        while not self.done.wait(0.5):
            self.drain()


@contextmanager
def quiet_console(run_dir: str | Path) -> Iterator[Path | None]:
    """The driver's side of quiet mode for the job in `run_dir` (see the module docstring). Yields
    the log directory (None in verbose mode). On exit the console is restored; an exception leaving
    the block is written to `driver.log` first, then propagates (Python prints it on the console)."""
    global _console, _console_err, _driver_log
    if verbose() or _console is not None:
        yield None
        return
    directory = log_dir(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    _console = os.fdopen(os.dup(1), "w", buffering=1)
    _console_err = os.fdopen(os.dup(2), "w", buffering=1)
    fd = os.open(directory / "driver.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    _driver_log = sys.stdout  # fd 1 is the file now
    old_env = {k: os.environ.get(k) for k in (LOG_DIR_ENV, "RAY_SERVE_LOG_TO_STDERR")}
    os.environ[LOG_DIR_ENV] = str(directory)
    os.environ["RAY_SERVE_LOG_TO_STDERR"] = "0"
    to_console = logging.StreamHandler(_console_err)
    to_console.setLevel(logging.WARNING)
    to_console.addFilter(_NotHarmless())
    to_console.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    before = {name: list(logging.getLogger(name).handlers) for name in ("", "ray", "ray.serve")}
    _install_root_handlers(to_console)
    tail = _Echo(directory / ATTENTION_FILE)
    tail.start()
    try:
        yield directory
    except BaseException:
        traceback.print_exc(file=sys.stderr)  # into driver.log; Python prints it again on the console
        raise
    finally:
        tail.done.set()
        tail.join(timeout=2)
        tail.drain()
        for name, handlers in before.items():
            logging.getLogger(name).handlers[:] = handlers
        for key, value in old_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        os.close(saved_out)
        os.close(saved_err)
        for stream in (_console, _console_err):
            stream.close()
        _console = _console_err = _driver_log = None
