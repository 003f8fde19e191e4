"""A real multi-host Ray cluster on one machine: Linux network namespaces as hosts.

Each node is a network namespace with its own loopback and one interface `asy0` on a shared
bridge (10.217.<net>.<i+1>/24), so `127.0.0.1` in one namespace does not reach another — the
property a multi-host test needs. Node 0 runs `ray start --head`, the others `ray start
--address`, each with its own `--temp-dir`, its own CPUs and a custom resource `node_<letter>`
for deterministic placement. Commands run in a node with `cluster.run(i, argv)`.

Teardown (`close`, also from the context manager, also after a failed start) stops every
`ray start --block` process group this helper started (SIGTERM, then SIGKILL), kills by PID every
process still inside one of its namespaces (`ip netns pids`) or naming one of its temp dirs,
deletes the namespaces, veths and bridge, and verifies nothing is left (`leftovers()`). Needs root and `ip`; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
IFACE = "asy0"


def available() -> str | None:
    """None when namespaces can be made here, else why not (for pytest.skip)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip command is missing"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    for key in ("RAY_ADDRESS", "RAY_TMPDIR"):
        env.pop(key, None)
    env.update({"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM":
                "false", "RAY_USAGE_STATS_ENABLED": "0", "VLLM_TARGET_DEVICE": "cpu",
                # Ray 2.60 heads enable token auth; a joining node and the driver must say so too.
                "RAY_AUTH_MODE": "token", "PYTHONUNBUFFERED": "1"})
    return env


@dataclass
class Node:
    name: str
    ns: str
    ip: str
    host_veth: str
    temp_dir: str
    resource: str
    proc: subprocess.Popen | None = None
    log: Path | None = None


@dataclass
class NetnsCluster:
    """`NetnsCluster(cpus=[4, 2])` -> nodes a (head) and b; `start()`, `add_node(cpus)`, `close()`."""

    cpus: list[float]
    extra: dict[int, dict[str, float]] = field(default_factory=dict)
    """More custom resources per node index (e.g. {1: {"rollout": 1}})."""
    net: int = 217
    log_dir: Path = field(default_factory=lambda: Path("/tmp"))
    uid: str = field(default_factory=lambda: uuid.uuid4().hex[:4])
    nodes: list[Node] = field(default_factory=list)
    bridge: str = ""
    port: int = 6379

    def __post_init__(self) -> None:
        self.bridge = f"a17{self.uid}br"

    # ------------------------------------------------------------------ network
    @property
    def head(self) -> Node:
        return self.nodes[0]

    @property
    def address(self) -> str:
        return f"{self.head.ip}:{self.port}"

    def _make_node(self, index: int) -> Node:
        letter = "abcdefgh"[index]
        node = Node(name=letter, ns=f"a17{self.uid}{letter}", ip=f"10.{self.net}.{int(self.uid[:2], 16)}.{index + 1}",
                    host_veth=f"a17{self.uid}h{letter}", temp_dir=f"/tmp/ray-i17-{self.uid}-{letter}",
                    resource=f"node_{letter}")
        self.nodes.append(node)  # recorded first: a half-made node is still torn down
        _ip("netns", "add", node.ns)
        _ip("link", "add", node.host_veth, "type", "veth", "peer", "name", IFACE, "netns", node.ns)
        _ip("link", "set", node.host_veth, "master", self.bridge)
        _ip("link", "set", node.host_veth, "up")
        _ip("-n", node.ns, "link", "set", "lo", "up")
        _ip("-n", node.ns, "addr", "add", f"{node.ip}/24", "dev", IFACE)
        _ip("-n", node.ns, "link", "set", IFACE, "up")
        return node

    # ------------------------------------------------------------------ ray
    def _ray_start(self, node: Node, cpus: float, timeout_s: float) -> None:
        head = node is self.nodes[0]
        argv = [str(VENV_BIN / "ray"), "start", "--block", "--node-ip-address", node.ip, "--temp-dir", node.temp_dir,
                "--num-cpus", f"{cpus:g}", "--num-gpus", "0",
                "--resources", json.dumps({node.resource: 1, **self.extra.get(self.nodes.index(node), {})}),
                "--disable-usage-stats"]
        argv += (["--head", "--port", str(self.port), "--include-dashboard", "false"] if head
                 else ["--address", self.address])
        node.log = self.log_dir / f"ray-{node.ns}.log"
        # Every "host" sees the whole machine's memory, shared with other work: Ray's per-node memory
        # monitor would kill this cluster's workers for memory they do not use.
        env = dict(base_env(), RAY_memory_monitor_refresh_ms="0")
        with open(node.log, "w") as out:
            node.proc = subprocess.Popen(["ip", "netns", "exec", node.ns, *argv], cwd=ROOT, env=env,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.wait_nodes(len([n for n in self.nodes if n.proc is not None]), timeout_s, node)

    def wait_nodes(self, count: int, timeout_s: float, node: Node | None = None) -> None:
        """Until `count` nodes are alive (asked from inside the head's namespace)."""
        deadline = time.time() + timeout_s
        probe = ("import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
                 "print(sum(1 for n in ray.nodes() if n['Alive']))")
        last = ""
        while time.time() < deadline:
            if node is not None and node.proc is not None and node.proc.poll() is not None:
                raise RuntimeError(f"ray start on {node.ns} exited {node.proc.returncode}:\n{node.log.read_text()[-3000:]}")
            proc = self.run(0, [sys.executable, "-c", probe, self.address], timeout=60, check=False)
            last = proc.stdout.strip().splitlines()[-1:] or [proc.stderr[-500:]]
            if proc.returncode == 0 and int(last[0]) >= count:
                return
            time.sleep(2)
        raise RuntimeError(f"{count} Ray node(s) not alive within {timeout_s}s (last: {last})")

    def start(self, timeout_s: float = 240.0) -> NetnsCluster:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for i, cpus in enumerate(self.cpus):
                node = self._make_node(i)
                self._ray_start(node, cpus, timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def add_node(self, cpus: float, resources: dict[str, float] | None = None, timeout_s: float = 240.0) -> Node:
        """A node that joins the running cluster (a late host)."""
        self.extra[len(self.nodes)] = dict(resources or {})
        node = self._make_node(len(self.nodes))
        self._ray_start(node, cpus, timeout_s)
        return node

    def kill_node(self, index: int) -> None:
        """The whole host disappears: its Ray processes are killed (SIGKILL), the namespace stays."""
        self._stop(self.nodes[index], sig=signal.SIGKILL)

    # ------------------------------------------------------------------ commands
    def run(self, index: int, argv: list[str], *, timeout: float, check: bool = True,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """`argv` in node `index`'s namespace (cwd = the repository), bounded by `timeout`."""
        proc = subprocess.run(["ip", "netns", "exec", self.nodes[index].ns, *argv], cwd=ROOT,
                              env=env or base_env(), capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{argv[:4]} in {self.nodes[index].ns} exited {proc.returncode}:\n"
                               f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        return proc

    # ------------------------------------------------------------------ teardown
    def _pids_of(self, node: Node) -> list[int]:
        """Every process in this node's namespace (only ours run there: Ray, its workers, vLLM's
        engine processes), plus any that names its temp dir (none should live outside)."""
        out = set()
        proc = _ip("netns", "pids", node.ns, check=False)
        out.update(int(p) for p in proc.stdout.split() if p.isdigit())
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if node.temp_dir in cmd:
                out.add(int(entry.name))
        out.discard(os.getpid())
        return sorted(out)

    def _stop(self, node: Node, sig: int = signal.SIGTERM) -> None:
        if node.proc is not None and node.proc.poll() is None:
            try:
                os.killpg(node.proc.pid, sig)
                # `ray start --block` answers SIGTERM by stopping every child gracefully and took
                # the full 30 s it was once given here (31 s of the default suite's teardown); a
                # test cluster needs no grace: what is left after 5 s is killed below
                node.proc.wait(timeout=5)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
            if node.proc.poll() is None:
                os.killpg(node.proc.pid, signal.SIGKILL)
                node.proc.wait(timeout=10)
        deadline = time.time() + 20
        while (pids := self._pids_of(node)) and time.time() < deadline:
            for pid in pids:  # what left the process group (Ray workers, engine processes)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.5)

    def close(self) -> None:
        for node in reversed(self.nodes):
            self._stop(node)
        for node in self.nodes:
            _ip("netns", "del", node.ns, check=False)
            _ip("link", "del", node.host_veth, check=False)
        _ip("link", "del", self.bridge, check=False)
        for node in self.nodes:
            shutil.rmtree(node.temp_dir, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """Anything of this cluster still present (processes, namespaces, links)."""
        out = [f"pid {p} ({n.ns})" for n in self.nodes for p in self._pids_of(n)]
        names = _ip("netns", "list").stdout + _ip("link").stdout
        out += [f"netns/link {n.ns}" for n in self.nodes if n.ns in names]
        out += [f"link {self.bridge}"] if self.bridge in names else []
        return out

    def __enter__(self) -> NetnsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
