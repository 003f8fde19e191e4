"""asyncrl.logs: quiet mode keeps asyncrl's lines and real warnings on the console and every other
byte in the role files (Python prints, C-level writes, child processes, harmless warnings included);
verbose mode redirects nothing. Each case runs in a fresh interpreter, since it rewires fds 1 and 2."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _py(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, PYTHONPATH=str(ROOT))
    for key in ("ASYNCRL_LOG_DIR", "ASYNCRL_VERBOSE"):
        full.pop(key, None)
    full.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=full, capture_output=True,
                          text=True, timeout=60)


def test_harmless_list_matches_the_cpu_noise_only() -> None:
    from asyncrl.logs import is_harmless

    assert is_harmless("W1201 08:42:22 cpp_extension.py:178] No CUDA runtime is found, using CUDA_HOME='/usr/local'")
    assert is_harmless("Triton is installed, but doesn't include CPU backend. Disabling Triton.")
    assert is_harmless("This model does not officially support disabling chunked prefill. Disabling this manually")
    assert not is_harmless("weight sync: dropping member rollout-1/tp0 (timeout)")
    assert not is_harmless("CUDA out of memory")


def test_redirect_output_sends_everything_to_the_role_file_and_warnings_to_attention(tmp_path: Path) -> None:
    proc = _py("""
        import logging, os, subprocess, sys
        from asyncrl.logs import redirect_output
        path = redirect_output("rollout-0")
        print("python print", flush=True)
        os.write(1, b"c-level write\\n")
        subprocess.run(["sh", "-c", "echo child process; echo child stderr >&2"])
        logging.getLogger("asyncrl.rollout").info("an info line")
        logging.getLogger("asyncrl.rollout").warning("group for prompt 7 failed")
        logging.getLogger("vllm.x").warning("No CUDA runtime is found")
        print("stderr line", file=sys.stderr, flush=True)
    """, {"ASYNCRL_LOG_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr == ""  # nothing left on the process's own stdout/stderr
    text = (tmp_path / "rollout-0.log").read_text()
    for needle in ("===== rollout-0 (pid", "python print", "c-level write", "child process", "child stderr",
                   "an info line", "group for prompt 7 failed", "No CUDA runtime is found", "stderr line"):
        assert needle in text, needle
    attention = (tmp_path / "attention.log").read_text().splitlines()
    assert attention == ["[rollout-0] WARNING asyncrl.rollout: group for prompt 7 failed"]


def test_redirect_output_is_a_no_op_outside_a_job_and_in_verbose_mode(tmp_path: Path) -> None:
    code = """
        from asyncrl.logs import redirect_output
        print(redirect_output("buffer"))
        print("still here")
    """
    assert _py(code).stdout.split() == ["None", "still", "here"]
    proc = _py(code, {"ASYNCRL_LOG_DIR": str(tmp_path), "ASYNCRL_VERBOSE": "1"})
    assert proc.stdout.split() == ["None", "still", "here"]
    assert not (tmp_path / "buffer.log").exists()


def test_quiet_console_keeps_asyncrl_lines_and_real_warnings_on_the_console(tmp_path: Path) -> None:
    proc = _py(f"""
        import logging, os, sys, time
        from asyncrl.logs import echo, quiet_console, worker_env
        with quiet_console({str(tmp_path)!r}) as logs:
            echo("[asyncrl] starting ray ...")
            print("third-party print")
            os.write(2, b"third-party C stderr\\n")
            logging.getLogger("ray").warning("Token authentication is enabled for this Ray cluster.")
            logging.getLogger("somelib").warning("disk almost full")
            logging.getLogger("asyncrl.serve").info("verifier serving")
            env = worker_env()
            with open(os.path.join(str(logs), "attention.log"), "a") as f:
                f.write("[rollout-1] WARNING asyncrl.rollout: reaped 1 orphaned engine process\\n")
            time.sleep(1.2)
            echo("error: something the user must see", err=True)
        print("after the block")
        print(sorted(env))
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[asyncrl] starting ray ...", "after the block",
                                        "['ASYNCRL_LOG_DIR', 'RAY_SERVE_LOG_TO_STDERR']"]
    err = proc.stderr.splitlines()
    assert "WARNING somelib: disk almost full" in err
    assert "[rollout-1] WARNING asyncrl.rollout: reaped 1 orphaned engine process" in err
    assert "error: something the user must see" in err
    assert not any("Token authentication" in line or "third-party" in line for line in err)
    driver = (tmp_path / "logs" / "driver.log").read_text()
    for needle in ("[asyncrl] starting ray ...", "third-party print", "third-party C stderr", "Token authentication",
                   "disk almost full", "verifier serving", "error: something the user must see"):
        assert needle in driver, needle


def test_quiet_console_writes_an_escaping_traceback_to_the_file_and_the_console(tmp_path: Path) -> None:
    proc = _py(f"""
        from asyncrl.logs import quiet_console
        with quiet_console({str(tmp_path)!r}):
            raise ValueError("boom at step 3")
    """)
    assert proc.returncode == 1
    assert "ValueError: boom at step 3" in proc.stderr
    assert "ValueError: boom at step 3" in (tmp_path / "logs" / "driver.log").read_text()


def test_verbose_mode_redirects_nothing(tmp_path: Path) -> None:
    proc = _py(f"""
        from asyncrl.logs import quiet_console, worker_env
        with quiet_console({str(tmp_path)!r}) as logs:
            print("a third-party line", logs, worker_env())
    """, {"ASYNCRL_VERBOSE": "1"})
    assert proc.stdout.strip() == "a third-party line None {'ASYNCRL_VERBOSE': '1'}"
    assert not (tmp_path / "logs").exists()
