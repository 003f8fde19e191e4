"""asyncrl on a real multi-host Ray cluster: network namespaces as hosts (tests/integration/netns_cluster.py).

Proves, on a 2-node cluster (node a: learner + buffer + verifier + coordinator, node b: one vLLM CPU
rollout actor, placed by the custom resources node_a / node_b):
- the job trains 3 steps; the buffer and the weight rendezvous advertise node a's own address,
  the rollout actor runs on node b (groups cross the hosts), and after every weight sync across
  the hosts the engine's behaviour logprobs match the learner's (synchronous run: mismatch KL ~ 0);
- `python -m asyncrl.doctor` passes there, and fails with a named ✘ (buffer unreachable from node
  b) when `buffer.host=127.0.0.1` is forced;
- every recipe in configs/ that names more than one node stops at the GPU check ("needs N GPUs ...,
  cluster has 0"); (slow tier) other bad input fails with a message naming the part and a non-zero
  exit, leaving no actor alive: an unreachable `cluster.ray_address`, a resource no node has, a
  listener port already taken;
- teardown leaves no process, namespace or link (checked by the fixture).
Also (no namespaces): the embedded mode starts its own cluster even with a stale address file.
The slow tier: a rollout actor that fails the same way repeatedly stops the job with one message;
3 nodes with CurveZMQ on the buffer: a node joins mid-run and `ctl scale 2` puts an actor on it,
then node b's whole host is killed and the job trains on, losing and repeating no prompt.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from netns_cluster import NetnsCluster, available, base_env

ROOT = Path(__file__).resolve().parents[2]
POLICY = ROOT / "assets" / "tiny-policy"
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not (POLICY / "config.json").exists(), reason="quick-start policy not built")]
needs_netns = pytest.mark.skipif(available() is not None, reason=str(available()))

BASE = ["rollout.n=4", "data.rollout_batch_size=2", "rollout.cpus_per_actor=0.5", "learner.cpus_per_rank=0.5",
        "verifier.port=0", "trainer.logger=[jsonl]", "learner.weights.timeout_s=30", "rollout.num_actors=1",
        "trainer.eval_before_after=false"]
PLACEMENT = ["cluster.resources.learner.node_a=0.01", "cluster.resources.buffer.node_a=0.01",
             "cluster.resources.verifier.node_a=0.01", "cluster.resources.coordinator.node_a=0.01",
             "cluster.resources.rollout.node_b=0.01"]


def job_args(cluster: NetnsCluster) -> list[str]:
    # startup_timeout_s: the namespaces share this machine's 2 cores with whatever else runs on it
    return [f"cluster.ray_address={cluster.address}", "cluster.network_interface=asy0", "cluster.startup_timeout_s=900",
            *PLACEMENT]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    if available() is not None:
        pytest.skip(available())
    c = NetnsCluster(cpus=[4, 2], log_dir=tmp_path_factory.mktemp("netns"))
    c.start()
    try:
        yield c
    finally:
        c.close()
    assert not c.leftovers(), c.leftovers()


def python(cluster: NetnsCluster, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """`python args...` in node a's namespace (the driver's host)."""
    return cluster.run(0, [sys.executable, *args], timeout=timeout, check=False)


def alive_actors(cluster: NetnsCluster) -> list[str]:
    # GCS's actor table (the state API would need the dashboard, which these heads do not run)
    code = ("import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
            "from ray._private.state import actors; "
            "print('\\n'.join(a['ActorClassName'] for a in actors().values() if a['State'] == 'ALIVE'))")
    proc = python(cluster, "-c", code, cluster.address, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [line for line in proc.stdout.splitlines() if line.strip()]


def launch(cluster: NetnsCluster, run_dir: Path, *overrides: str, config: str = "configs/quickstart.yaml",
           timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return python(cluster, "-m", "asyncrl.launch", "-c", config, f"trainer.run_dir={run_dir}", *overrides,
                  timeout=timeout)


# ------------------------------------------------------------------------------------- training
@pytest.mark.slow  # a two-host training job (~2.5 min); default-suite time budget
@needs_netns
@pytest.mark.timeout(1800)  # a vLLM engine start took over 10 minutes here at load average 60
def test_two_node_job_trains_across_hosts_with_matching_logprobs(cluster: NetnsCluster, tmp_path: Path) -> None:
    a, b = cluster.nodes[0].ip, cluster.nodes[1].ip
    proc = launch(cluster, tmp_path, *BASE, *job_args(cluster), "trainer.experiment_name=mn", "trainer.max_steps=3",
                  "buffer.max_staleness=0", "learner.optim.lr=1e-3", "rollout.temperature=1.0",
                  "reward.kwargs.hallucination_weight=0.2", timeout=1700)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    # Listeners advertise node a's own address (never loopback or a wildcard) ...
    assert f"replay buffer listening at tcp://{a}:" in out, out[-3000:]
    assert f"weight rendezvous at {a}:" in out, out[-3000:]
    # ... and the rollout actor (its engine, its verifier calls) ran on node b.
    assert re.search(rf"rollout-0 on {re.escape(b)}: engine up", out), out[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "mn" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # every group was produced on b and trained on a, after a cross-host weight sync
        assert r["train/groups"] == 2 and r["buffer/staleness_max"] == 0
        assert r["train/mismatch_kl"] < 1e-4, (r["step"], r["train/mismatch_kl"])
        assert abs(r["train/is_weight_mean"] - 1.0) < 1e-2
        assert r["perf/weight_sync_dropped"] == 0
    assert rows[-1]["train/grad_norm"] > 0
    assert alive_actors(cluster) == []


# ------------------------------------------------------------------------------------- doctor
@needs_netns
def test_doctor_passes_on_two_node_cluster(cluster: NetnsCluster, tmp_path: Path) -> None:
    a, b = cluster.nodes[0].ip, cluster.nodes[1].ip
    proc = python(cluster, "-m", "asyncrl.doctor", "-c", "configs/quickstart.yaml", *BASE, *job_args(cluster),
                  timeout=600)
    (Path(os.environ.get("ASYNCRL_DOCTOR_TABLE", tmp_path / "doctor.txt"))).write_text(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert "✘" not in proc.stdout.replace("0 ✘", "")
    assert re.search(rf"✔ buffer reachable +tcp://{re.escape(a)}:\d+ from 2 node\(s\)", proc.stdout), proc.stdout
    assert re.search(rf"✔ weight rendezvous reachable +{re.escape(a)}:\d+ from 2 node\(s\)", proc.stdout)
    assert re.search(rf"✔ weight broadcast +.* to 1 node\(s\) \({re.escape(b)}\)", proc.stdout), proc.stdout
    assert alive_actors(cluster) == []


@needs_netns
def test_doctor_names_a_loopback_buffer_on_a_multi_node_job(cluster: NetnsCluster) -> None:
    b = cluster.nodes[1].ip
    proc = python(cluster, "-m", "asyncrl.doctor", "-c", "configs/quickstart.yaml", *BASE, *job_args(cluster),
                  "buffer.host=127.0.0.1", timeout=600)
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("✘ buffer reachable"))
    assert "tcp://127.0.0.1:" in line and f"from {b}" in line and "buffer.host=127.0.0.1" in line, line
    assert "fix: set buffer.host=auto" in proc.stdout
    assert alive_actors(cluster) == []


# ------------------------------------------------------------------------------------- bad input
@needs_netns
@pytest.mark.slow  # 23-24 s of the default suite's 15 minutes (fresh-clone runs, 2026-12-02)
def test_bad_cluster_input_fails_clearly_and_leaves_nothing(cluster: NetnsCluster, tmp_path: Path) -> None:
    a = cluster.nodes[0].ip
    unreachable = launch(cluster, tmp_path, *BASE, f"cluster.ray_address={a.rsplit('.', 1)[0]}.99:6379",
                         timeout=300)
    assert unreachable.returncode == 1 and "cluster.ray_address" in unreachable.stderr, unreachable.stderr[-2000:]

    missing = launch(cluster, tmp_path, *BASE, *job_args(cluster), "cluster.resources.rollout.node_z=1",
                     timeout=300)
    assert missing.returncode == 1, missing.stdout[-2000:] + missing.stderr[-2000:]
    assert "no node of the cluster" in missing.stderr and "node_z" in missing.stderr, missing.stderr[-2000:]
    assert alive_actors(cluster) == []

    # A listener port already taken on node a (held by a process in a's namespace).
    holder = subprocess.Popen(["ip", "netns", "exec", cluster.nodes[0].ns, sys.executable, "-c",
                               "import socket, sys, time; s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen();"
                               " print(s.getsockname()[1], flush=True); time.sleep(600)", a],
                              stdout=subprocess.PIPE, text=True)
    try:
        port = int(holder.stdout.readline())
        taken = launch(cluster, tmp_path, *BASE, *job_args(cluster), f"buffer.port={port}", timeout=600)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert taken.returncode == 1, taken.stdout[-2000:] + taken.stderr[-2000:]
    assert "replay buffer" in taken.stderr and f"{a}:{port}" in taken.stderr, taken.stderr[-2000:]
    assert alive_actors(cluster) == []


def _multi_node_recipes() -> list[Path]:
    return sorted(p for p in (ROOT / "configs").glob("*.yaml")
                  if re.search(r"Hardware: ([2-9]|\d\d+) nodes", p.read_text()))


# The recipes' hub models as the driver's model checks (asyncrl.checks.preflight) read them: config.json with
# their published context keys, a chat template, a (header-only) weight file; no hub is reachable here.
HUB_STUBS = {
    "Qwen/Qwen3-14B": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "max_position_embeddings": 40960},
    "Qwen/Qwen3-VL-8B-Instruct": {"model_type": "qwen3_vl", "architectures": ["Qwen3VLForConditionalGeneration"],
                                  "text_config": {"max_position_embeddings": 262144}},
    "ruitongl/Guided-Verifier-8B": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
                                    "max_position_embeddings": 40960},
}


def hub_stubs(root: Path) -> Path:
    for repo, config in HUB_STUBS.items():
        d = root / repo.replace("/", "--")
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(config))
        (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
        (d / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")
    return root


@needs_netns
def test_multi_node_recipes_stop_at_the_gpu_check(cluster: NetnsCluster, tmp_path: Path) -> None:
    recipes = _multi_node_recipes()
    assert len(recipes) >= 2, recipes
    models = hub_stubs(tmp_path / "models")
    for recipe in recipes:
        proc = launch(cluster, tmp_path, f"cluster.ray_address={cluster.address}", f"cluster.model_dir={models}",
                      config=str(recipe.relative_to(ROOT)), timeout=300)
        assert proc.returncode == 1, (recipe.name, proc.stdout[-2000:], proc.stderr[-2000:])
        assert re.search(r"needs \d+ GPUs \(.*\) on the cluster at .*, cluster has 0", proc.stderr), \
            (recipe.name, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr
    assert alive_actors(cluster) == []


# ------------------------------------------------------------------------------------- embedded
def test_embedded_mode_starts_its_own_cluster_despite_stale_address_file(tmp_path: Path) -> None:
    """A stale /tmp/ray/ray_current_cluster (here under RAY_TMPDIR) must not make the embedded mode
    join, or fail to join, another cluster."""
    tmp = Path(f"/tmp/i17s-{os.getpid()}")  # short: Ray's socket paths live under it
    (tmp / "ray").mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:  # an address where nothing listens
        s.bind(("127.0.0.1", 0))
        stale = f"127.0.0.1:{s.getsockname()[1]}"
    (tmp / "ray" / "ray_current_cluster").write_text(stale)
    code = ("from asyncrl.config import load_config; from asyncrl.job.runtime import ray_init; import ray\n"
            "cfg = load_config('configs/quickstart.yaml', ['cluster.num_cpus=2'])\n"
            "ray_init(cfg, 'stale-test'); print('GCS', ray.get_runtime_context().gcs_address); ray.shutdown()")
    env = dict(os.environ, RAY_TMPDIR=str(tmp), RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    try:
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
    finally:
        subprocess.run(["rm", "-rf", str(tmp)], check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    gcs = proc.stdout.split("GCS", 1)[1].split()[0]
    assert gcs != stale


# ------------------------------------------------------------------------------------- slow
@needs_netns
@pytest.mark.slow
def test_repeated_identical_failure_stops_the_job_with_one_message(cluster: NetnsCluster, tmp_path: Path) -> None:
    """Forced loopback buffer on a 2-node job: the actor on b cannot reach it; after 2 identical
    failures the job stops, naming the actor, its host and the unreachable address."""
    b = cluster.nodes[1].ip
    proc = launch(cluster, tmp_path, *BASE, *job_args(cluster), "buffer.host=127.0.0.1",
                  "cluster.max_identical_failures=2", "trainer.max_steps=2", timeout=900)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    err = proc.stderr
    assert f"rollout-0 on host {b} failed 2 times in a row" in err, err[-3000:]
    assert "unreachable address: tcp://127.0.0.1:" in err and "BufferTimeout" in err
    assert alive_actors(cluster) == []


def _wait_for(path: Path, pattern: str, timeout: float, proc: subprocess.Popen | None = None) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        text = path.read_text() if path.exists() else ""
        found = re.search(pattern, text)
        if found:
            return found.group(0)
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(2)
    raise AssertionError(f"{pattern!r} not seen in {path} within {timeout}s:\n{path.read_text()[-4000:]}")


def _curve_overrides(tmp_path: Path) -> list[str]:
    """CurveZMQ keys for the cross-host buffer traffic (server key + one authorised client key)."""
    import zmq.auth

    keys, clients = tmp_path / "keys", tmp_path / "clients"
    keys.mkdir()
    clients.mkdir()
    server_public, server_secret = zmq.auth.create_certificates(str(keys), "server")
    client_public, client_secret = zmq.auth.create_certificates(str(keys), "client")
    (clients / "client.key").write_text(Path(client_public).read_text())
    return ["buffer.curve.enable=true", f"buffer.curve.server_secret_key_file={server_secret}",
            f"buffer.curve.server_public_key_file={server_public}",
            f"buffer.curve.client_secret_key_file={client_secret}", f"buffer.curve.authorized_clients_dir={clients}"]


@needs_netns
@pytest.mark.slow
def test_three_nodes_late_node_scale_and_host_loss_with_curve(tmp_path: Path) -> None:
    """Node c joins after the job started and `ctl scale 2` puts a new actor on it (it catches up
    from the newest weights); then node b disappears (every process of its host SIGKILLed): the job
    keeps training, b's prompts are re-issued, no prompt is trained twice. Buffer traffic across
    the hosts is CurveZMQ-encrypted and authenticated."""
    if available() is not None:
        pytest.skip(available())
    # each rollout actor takes a whole `rollout` unit (Ray node resources are whole numbers): node b
    # holds exactly one, so the actor `ctl scale` adds must go to node c, which has room for two (the
    # restarted rollout-0 lands there too after b is gone)
    cluster = NetnsCluster(cpus=[4, 2], extra={1: {"rollout": 1}}, log_dir=tmp_path)
    log = tmp_path / "launch.log"
    run = tmp_path / "late"
    proc = None
    try:
        cluster.start()
        argv = ["ip", "netns", "exec", cluster.nodes[0].ns, sys.executable, "-m", "asyncrl.launch", "-c",
                "configs/quickstart.yaml", f"trainer.run_dir={tmp_path}", *BASE, "trainer.experiment_name=late",
                "trainer.max_steps=400", f"cluster.ray_address={cluster.address}", "cluster.network_interface=asy0",
                *[p for p in PLACEMENT if ".rollout." not in p], "cluster.resources.rollout.rollout=1",
                "rollout.max_restarts=3", *_curve_overrides(tmp_path)]
        with open(log, "w") as out:
            proc = subprocess.Popen(argv, cwd=ROOT, env=base_env(), stdout=out, stderr=subprocess.STDOUT)
        _wait_for(log, r"step 2/", 900, proc)
        c = cluster.add_node(2, {"rollout": 2})
        ctl = python(cluster, "-m", "asyncrl.ctl", "scale", "2", "--run-dir", str(run), timeout=600)
        assert ctl.returncode == 0 and '"added"' in ctl.stdout, ctl.stdout + ctl.stderr
        _wait_for(log, rf"rollout-\d+ on {re.escape(c.ip)}: engine up", 300, proc)
        steps_before = len((run / "metrics.jsonl").read_text().splitlines())
        _wait_for(run / "metrics.jsonl", f'"step": {steps_before + 2},', 600, proc)
        cluster.kill_node(1)  # node b: raylet, its workers and its engine processes
        _wait_for(log, r"rollout-0 (died|restarted|could not be restarted)", 600, proc)
        steps_killed = len((run / "metrics.jsonl").read_text().splitlines())
        _wait_for(run / "metrics.jsonl", f'"step": {steps_killed + 3},', 900, proc)
        stop = python(cluster, "-m", "asyncrl.ctl", "stop", "--run-dir", str(run), timeout=600)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert proc.wait(timeout=600) == 0, log.read_text()[-4000:]
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
        cluster.close()
    assert not cluster.leftovers(), cluster.leftovers()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    trained = [i for r in rows for i in r["train/prompt_indices"]]
    assert len(trained) == len(set(trained)), "a prompt was trained twice"
    assert all(r["buffer/staleness_max"] <= 1 for r in rows)
    last = rows[-1]
    # the buffer's accounting identity (asyncrl/replay/state.py): groups dropped stale at ingest were
    # never stored, so they are not part of `ingested`
    assert last["buffer/ingested"] == (last["buffer/consumed"] + last["buffer/size_groups"]
                                       + last["buffer/dropped_stale"] - last["buffer/dropped_stale_at_ingest"]
                                       + last["buffer/dropped_filtered"])
