"""The running job: join the cluster, check it, build the topology, train, shut down.

`run(cfg)` is what `python -m asyncrl.launch` calls after the config validated: it prepares the
run directory, starts or joins Ray (`ray_init`), checks the live cluster (`preflight`), builds
every component (asyncrl.job.topology.build_topology, one screen in start order), hands them to the
learner-paced loop (asyncrl.job.loop.Trainer; the rollout fleet, asyncrl.actors.fleet, runs on its
own, paced only by the buffer's admission tickets) and tears everything down at the end.

Failure behaviour: every start-up wait has a timeout (`cluster.startup_timeout_s`) and a component
that cannot start fails the launch with its name, before any training step, with everything that
was started torn down (exit 1). Ctrl-C / SIGTERM: admission stops, a checkpoint is written
(learner, buffer snapshot, data cursor, versions), then the job shuts down; a second signal exits
at once. A component that dies during training: one line naming it, a checkpoint, exit 3.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.cluster import embedded_ray_options, ray_init  # noqa: F401 - re-exported: the job starts Ray this way
from asyncrl.config import Config
from asyncrl.logs import echo, log_dir, quiet_console, verbose
from asyncrl.startup import RepeatedFailure, StartupError, StopFlag, check_reachable, say, step_timer

if TYPE_CHECKING:
    from asyncrl.metrics import MetricLogger


# ------------------------------------------------------------------------------------- run dir
def prepare_run_dir(cfg: Config) -> Path:
    cfg.trainer.run_dir = str(Path(cfg.trainer.run_dir).resolve())  # actors may run in another cwd
    run_dir = cfg.run_path
    for sub in ("checkpoints", "samples", "plots"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    (run_dir / "config.resolved.json").write_text(cfg.to_json())
    return run_dir


def find_resume(cfg: Config, run_dir: Path) -> Path | None:
    """The checkpoint to resume from. A fresh run's empty checkpoint directory is answered without
    importing the checkpoint module (it imports torch: seconds on the driver before Ray starts)."""
    mode = cfg.trainer.resume
    if mode == "never":
        return None
    if mode == "auto":
        if not any((run_dir / "checkpoints").glob("step_*")):
            return None
        from asyncrl.learner.checkpoint import latest_checkpoint

        return latest_checkpoint(run_dir / "checkpoints")
    path = Path(mode)
    if not path.exists():
        raise StartupError(f"trainer.resume: checkpoint {path} does not exist")
    return path


def preflight(cfg: Config) -> None:
    """Checks on the live cluster before any component starts: resources (placement feasible),
    /dev/shm and interfaces of the nodes, the registered node checks (asyncrl.checks.preflight), listener addresses resolved and loudly reported when
    they are open beyond loopback without authentication. The model paths were resolved and the
    models checked against the config before Ray started (`check_models`)."""
    import ray

    from asyncrl.addresses import insecure_listeners, is_loopback, resolve_hosts
    from asyncrl.checks.preflight import check_nodes, refusals
    from asyncrl.cluster import (
        interface_problems,
        probe_nodes,
        probe_this_node,
        resource_problems,
        shm_problems,
    )

    where = cfg.cluster.ray_address or "embedded"
    problems = resource_problems(cfg, ray.nodes(), where)
    if problems:
        raise StartupError("the cluster cannot place this job: " + "; ".join(problems))
    # the embedded cluster's one node is the driver's: probed here, without a task's worker process
    probes = probe_nodes(cfg.cluster.startup_timeout_s) if cfg.cluster.ray_address else probe_this_node()
    problems = shm_problems(cfg, probes) + interface_problems(cfg, probes) + refusals(check_nodes(cfg, probes))
    if problems:
        raise StartupError("; ".join(problems))
    resolve_hosts(cfg)
    if len(probes) > 1:
        for key, host in (("buffer.host", cfg.buffer.host), ("learner.weights.host", cfg.learner.weights.host)):
            if is_loopback(host):
                say(f"WARNING: {key}={host} on a {len(probes)}-node cluster: components on other nodes cannot "
                    "reach it (use auto; python -m asyncrl.doctor checks this)")
    for line in insecure_listeners(cfg):
        say(f"WARNING: listening beyond loopback without authentication: {line}")


def check_models(cfg: Config) -> bool:
    """The model against the config, before Ray (asyncrl.checks.preflight): one `error:` line per
    problem on the console; False when the job must not start."""
    from asyncrl.checks.preflight import check_model, refusals

    rows = check_model(cfg)
    for line in refusals(rows):
        echo(f"error: {line}", err=True)
    for row in rows:
        if row.ok and row.notice:
            say(row.result)
    return all(row.ok for row in rows)


def resolve_lora_sync(cfg: Config) -> None:
    """`model.lora.sync: auto` decided once, here, and written into the config every process is
    given (and the run directory's config.json): the learner and every engine read the same answer
    instead of each asking vLLM's model registry (`weights.adapter.sync_kind`)."""
    if cfg.model.lora.enable and cfg.model.lora.sync == "auto":
        from asyncrl.weights.adapter import sync_kind

        cfg.model.lora.sync = sync_kind(cfg, warn=True)


def run(cfg: Config) -> int:
    """The job, with the console kept for asyncrl's lines (asyncrl.logs: the rest goes to files).
    Exit 2 when the run directory belongs to another live job or the model cannot hold the config
    (nothing started), else the job's status."""
    from asyncrl.job.run_lock import RunDirLocked, acquire, took_over_line

    try:
        lock = acquire(cfg.run_path)  # one job per run directory, held to the end (asyncrl.job.run_lock)
    except RunDirLocked as exc:
        echo(f"error: {exc}", err=True)
        return 2
    try:
        if took_over_line(lock):
            say(took_over_line(lock))
        return _run_locked(cfg)
    finally:
        lock.release()


def _run_locked(cfg: Config) -> int:
    resolve_lora_sync(cfg)
    if not check_models(cfg):
        return 2
    if cfg.cluster.ray_address:  # a refused connection: now, not after importing Ray
        try:
            check_reachable(cfg.cluster.ray_address)
        except StartupError as exc:
            echo(f"error: {exc}", err=True)
            return 1
    run_dir = prepare_run_dir(cfg)
    with quiet_console(run_dir) as logs_dir:
        if logs_dir is not None:
            say(f"logs: {logs_dir}/ (driver, buffer, verifier, rollout-N, learner-N; serve/: one line per "
                "verifier request); --verbose or ASYNCRL_VERBOSE=1 shows them here")
        return _run_job(cfg, run_dir)


def _run_job(cfg: Config, run_dir: Path) -> int:
    import ray

    from asyncrl.reaper import procs_dir, reap

    stop = StopFlag()
    namespace = f"asyncrl-{cfg.trainer.experiment_name}-{os.getpid()}"
    topo = None
    left = reap(procs_dir(run_dir))  # a previous job on this run directory that died without cleaning up
    if left:
        say(f"ended {len(left)} process(es) an earlier job of {run_dir} left running: {', '.join(left)}")
    try:
        resume = find_resume(cfg, run_dir)
        rows = _load_rows_in_background(cfg)
        with step_timer("ray" + (f" (joining {cfg.cluster.ray_address})" if cfg.cluster.ray_address else " (embedded)")):
            ray_init(cfg, namespace)
        with step_timer("preflight (resources, nodes, addresses)"):
            preflight(cfg)
        (run_dir / "config.resolved.json").write_text(cfg.to_json())  # with the resolved hosts and paths
        stop.install()  # after ray.init, which installs its own SIGTERM handler in the driver
        from asyncrl.job.loop import Trainer
        from asyncrl.job.topology import build_topology

        topo = build_topology(cfg, run_dir, resume, rows)  # its data step takes the rows (or fails with the file's error)
        (run_dir / "job.json").write_text(json.dumps({
            "ray_address": ray.get_runtime_context().gcs_address, "namespace": namespace,
            "coordinator": "coordinator", "pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
            "ray_auth_mode": os.environ.get("RAY_AUTH_MODE", "")}))
        trainer = Trainer(cfg, topo, run_dir, stop, resume)
        try:
            summary = trainer.train()
        except RepeatedFailure:
            raise  # a fault no restart fixes (e.g. an unreachable address): its one message, exit 1 (below)
        except Exception as exc:  # noqa: BLE001 - a component died: one message, a checkpoint, exit 3
            return trainer.on_failure(exc)
        finish_run(run_dir, summary, trainer.logger)
        return 0
    except StartupError as exc:
        line = str(exc)  # one line, first; the traceback below goes to driver.log when quiet
        if exc.__cause__ is not None and "(traceback: " not in line and not verbose():
            line += f" (traceback: {log_dir(run_dir) / 'driver.log'})"
        echo(f"error: {line}", err=True)
        if exc.__cause__ is not None:
            traceback.print_exception(exc.__cause__, file=sys.stderr)
        return 1
    finally:
        if topo is not None:
            say("shutting down")
            topo.shutdown()
        (run_dir / "job.json").unlink(missing_ok=True)
        if ray.is_initialized():
            t0 = time.monotonic()
            ray.shutdown()
            logging.getLogger(__name__).info("ray.shutdown took %.2fs", time.monotonic() - t0)
        left = reap(procs_dir(run_dir))  # what Ray's shutdown did not end (engine cores, stuck workers)
        if left:
            say(f"ended {len(left)} process(es) the job left running: {', '.join(left)}")


def _load_rows_in_background(cfg: Config) -> threading.Thread:
    """The training rows (the files, the tokenizer of the overlong filter) loaded in a thread while
    Ray starts and the driver starts the learner and the engines; the data step of the topology then
    takes them (asyncrl.data.preload_training_rows), and a file that did not load stops the launch
    before the learner and the engines are asked for (`build_topology`'s `fail_early`). It starts
    beside `ray.init` since it is cheap (the JSON reader and the tokenizer import no torch, pandas or
    pyarrow; a heavier load beside `ray.init` would slow Ray's start on a small machine). The thread
    runs at the niceness of Ray's workers (15; Linux: niceness is per thread): at the driver's 0 it
    would take the cores from the engine and learner builds, at 19 it starved behind them and the
    coordinator, which needs the rows and which the engines need next, came late."""
    from asyncrl.data import preload_training_rows
    from asyncrl.small_machine.process import set_thread_niceness

    def preload() -> None:
        set_thread_niceness(15)
        preload_training_rows(cfg)

    thread = threading.Thread(target=preload, name="asyncrl-rows", daemon=True)
    thread.start()
    return thread


# ------------------------------------------------------------------------------------- the end
def finish_run(run_dir: Path, summary: dict[str, Any], logger: MetricLogger) -> None:
    """What a finished run leaves for a person: summary.json (with the staleness histogram of every
    trained group), the metric sinks closed, PNG plots, the console table and report.html. Plots
    and report are conveniences: a failure there is one line, never a failed run."""
    from asyncrl.eval import print_summary
    from asyncrl.metrics import save_plots, staleness_total

    rows = logger.rows
    summary = {**summary, "staleness_hist": staleness_total(rows)}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    logger.close()
    try:
        save_plots(rows, run_dir / "plots")
    except Exception as exc:  # noqa: BLE001 - plots are a convenience; never fail the run for them
        say(f"plots not written: {exc}")
    print_summary(summary)
    try:
        from asyncrl.report import write_report

        say(f"report: {write_report(run_dir)} (open it in a browser; logs in {run_dir / 'logs'})")
    except Exception as exc:  # noqa: BLE001 - the report is a convenience; never fail the run for it
        say(f"report not written: {type(exc).__name__}: {exc}")
