"""`python -m asyncrl.ctl COMMAND --run-dir runs/<experiment>`: act on a running job.

Commands: `status [--json] [--live]` (a table read from `<run-dir>/status.json`, no Ray), `scale N`,
`swap-verifier FILE.yaml [--dry-run [--last N]]`, `checkpoint`, `stop`.
The job is found through `<run-dir>/job.json` (Ray address + namespace, written by the launcher).
Each command is queued on the job's coordinator; the driver executes it between learner steps and
posts the result, which is printed here. Exit status: 0 done, 1 the job refused or failed it (the
reason is printed), 2 bad usage or no running job.

The job side (asyncrl.job.commands): `execute` runs one queued command through the job's table of named handlers
(asyncrl.job.commands.handlers); a command it does not know, or one that raises, becomes an
`{"ok": false, "error": ...}` result for the caller instead of an error in the job.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

CONNECT_TIMEOUT_S = 15.0  # joining the job's Ray cluster and finding its coordinator

def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--run-dir", default=argparse.SUPPRESS, help="run directory of the job (default: newest under runs/)")
    common.add_argument("--timeout", type=float, default=argparse.SUPPRESS, help="seconds to wait for the job to act")
    p = argparse.ArgumentParser(prog="python -m asyncrl.ctl", description=__doc__, parents=[common],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    st = sub.add_parser("status", parents=[common], help="print the job's state and latest metrics (a table)")
    st.add_argument("--json", action="store_true", help="print the status as JSON")
    st.add_argument("--live", action="store_true",
                    help="ask the job's coordinator through Ray (default: read <run-dir>/status.json, instant)")
    s = sub.add_parser("scale", parents=[common], help="set the number of rollout actors")
    s.add_argument("n", type=int)
    w = sub.add_parser("swap-verifier", parents=[common],
                       help="deploy a new verifier version from a config file (its `verifier:` section)")
    w.add_argument("file")
    w.add_argument("--dry-run", action="store_true",
                   help="do not swap: replay the verifier's last stored requests through the new version "
                        "and report agreement (STOP decisions, hallucination scores, guidance length)")
    w.add_argument("--last", type=int, default=64, help="stored requests to replay with --dry-run")
    sub.add_parser("checkpoint", parents=[common], help="write a checkpoint now")
    sub.add_parser("stop", parents=[common], help="checkpoint and stop the job")
    return p


def _find_run_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    candidates = sorted(Path("runs").glob("*/job.json"), key=lambda p: p.stat().st_mtime)
    if not candidates:
        raise SystemExit("error: no running job found (no runs/*/job.json); pass --run-dir")
    return candidates[-1].parent


def _not_running(job: dict) -> str:
    """Why the job of a `job.json` is certainly not running ("" if it may be), in well under a
    second: its launcher process is gone (same host), or its Ray address does not accept connections
    (ray.init would retry for minutes)."""
    import socket

    pid, host = job.get("pid"), job.get("host")
    if isinstance(pid, int) and host in (None, socket.gethostname()):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return f"its launcher (pid {pid}) has exited"
        except PermissionError:
            pass
        if _pid_reused(pid, job.get("started")):
            return f"its launcher (pid {pid}) has exited (that pid now belongs to a process started later)"
    from asyncrl.startup import StartupError, check_reachable

    try:
        check_reachable(str(job.get("ray_address", "")), timeout_s=3.0)
    except StartupError as exc:
        return str(exc)
    return ""


def _pid_reused(pid: int, started: object) -> bool:
    """Whether the process now at `pid` started after the job did (the launcher's pid was reused)."""
    import psutil

    if not isinstance(started, (int, float)):
        return False
    try:
        return psutil.Process(pid).create_time() > float(started) + 1.0
    except psutil.Error:
        return False


def _connect(job: dict, timeout_s: float = CONNECT_TIMEOUT_S) -> tuple[Any, str]:
    """(the job's coordinator handle, "") or (None, why not) within `timeout_s`: `ray.init` against an
    address that accepts connections but is not (or no longer) this job's Ray cluster can wait for
    minutes, so it runs in a daemon thread the caller stops waiting for."""
    import threading

    out: dict[str, Any] = {}

    def connect() -> None:
        import ray

        try:
            ray.init(address=job["ray_address"], namespace=job["namespace"], logging_level="ERROR",
                     log_to_driver=False)
            out["coordinator"] = ray.get_actor(job["coordinator"])
        except Exception as exc:  # noqa: BLE001 - a user-facing edge: reported by the caller
            out["error"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=connect, name="ctl-connect", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return None, (f"no answer from its Ray address {job.get('ray_address')} within {timeout_s:.0f}s (the job "
                      "may have died without cleaning up and something else now uses that address)")
    return out.get("coordinator"), out.get("error", "")


def _last_seen(run_dir: Path, job: dict) -> str:
    """When the job last wrote anything: its newest metrics row, else its start."""
    times = [p.stat().st_mtime for p in (run_dir / "metrics.jsonl", run_dir / "job.json") if p.exists()]
    when = max(times + [float(job.get("started", 0.0))])
    return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(when))}, {time.time() - when:.0f} s ago"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.run_dir = getattr(args, "run_dir", None)
    args.timeout = getattr(args, "timeout", 600.0)
    run_dir = _find_run_dir(args.run_dir)
    if args.command == "status" and not args.live:
        return _status_from_file(run_dir, args.json)
    job_file = run_dir / "job.json"
    if not job_file.exists():
        print(f"error: {job_file} not found: is a job running in {run_dir}?", file=sys.stderr)
        return 2
    job = json.loads(job_file.read_text())
    cmd_args: dict = {}
    command = args.command
    if args.command == "scale":
        if args.n < 0:
            print("error: scale N needs N >= 0", file=sys.stderr)
            return 2
        cmd_args = {"n": args.n}
    elif args.command == "swap-verifier":
        from asyncrl.config import ConfigError, load_config

        try:
            new = load_config(args.file)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        cmd_args = {"verifier": new.verifier.model_dump(mode="json")}
        if args.dry_run:
            command, cmd_args = "dry-run-verifier", {**cmd_args, "last": args.last}

    stale = _not_running(job)
    if stale:
        print(f"error: the job of {run_dir} is not running (last seen {_last_seen(run_dir, job)}): {stale}",
              file=sys.stderr)
        return 2
    if job.get("ray_auth_mode"):
        os.environ.setdefault("RAY_AUTH_MODE", job["ray_auth_mode"])  # token in ~/.ray/auth_token
    coordinator, why = _connect(job)
    if coordinator is None:
        print(f"error: cannot reach the job of {run_dir} (last seen {_last_seen(run_dir, job)}): {why}",
              file=sys.stderr)
        sys.stderr.flush()
        os._exit(2)  # a connection attempt may still hang in its thread; nothing else to finish here
    import ray
    if args.command == "status":
        status = ray.get(coordinator.status.remote(), timeout=30)
        if args.json:
            print(json.dumps(status, indent=2, default=str))
        else:
            from asyncrl.job.status import format_status

            print(format_status(status))
        return 0
    cid = ray.get(coordinator.submit.remote(command, cmd_args), timeout=30)
    deadline = time.time() + args.timeout
    while time.time() < deadline:
        result = ray.get(coordinator.result.remote(cid), timeout=30)
        if result is not None:
            print(json.dumps(result, indent=2, default=str))
            return 0 if result.get("ok") else 1
        time.sleep(0.5)
    print(f"error: the job did not act on '{args.command}' within {args.timeout:.0f}s", file=sys.stderr)
    return 1


def _status_from_file(run_dir: Path, as_json: bool) -> int:
    """`status` from the file the job rewrites every step (no Ray: answers at once)."""
    from asyncrl.job.status import STATUS_FILE, format_status, read_status

    status = read_status(run_dir)
    job_file = run_dir / "job.json"
    job = json.loads(job_file.read_text()) if job_file.exists() else None
    stale = _not_running(job) if job is not None else ""  # a SIGKILLed job leaves its job.json behind
    if stale:
        print(f"{'error' if status is None else 'note'}: the job of {run_dir} is not running "
              f"(last seen {_last_seen(run_dir, job)}): {stale}", file=sys.stderr)
    if status is None:
        if not stale:
            print(f"error: {run_dir / STATUS_FILE} not found: no step finished yet in {run_dir} "
                  "(or not a run directory); `status --live` asks the job itself", file=sys.stderr)
        return 2
    running = job is not None and not stale
    if as_json:
        print(json.dumps({**status, "running": running}, indent=2, default=str))
    else:
        print(format_status(status, running=running))
    return 0


if __name__ == "__main__":
    sys.exit(main())
