"""`python -m asyncrl.doctor --config X.yaml [key=value ...]`: preflight of a cluster for a job.

First the model against the config, as the launcher does before Ray (asyncrl.checks.preflight: context
lengths, engine token budget, KV cache, chat templates, vision settings, every registered check).
Then it joins the cluster the config names (or starts the embedded single-host one, as the launcher
does) and checks, each as one row of a ✔/✘ table with the fix for every ✘:
- Ray connection and token authentication (`RAY_AUTH_MODE`) of the driver and every node;
- the nodes' CPUs / GPUs / custom resources against what the roles ask (placement feasible);
- /dev/shm on nodes that can host an engine or a learner rank, and the collectives' interface;
- reachability of every listener the job would advertise, with a real connection from an
  actor on each node: the replay buffer (a real `BufferHost` with the job's buffer config, one
  stats request), the weight rendezvous (a real `WeightSender` TCPStore on the learner's node)
  and the verifier's HTTP ingress;
- a dummy weight broadcast of the configured model's size (capped by `--broadcast-mb`) from the
  learner's node to each node that can host a rollout actor, over the job's own gloo/NCCL path:
  GB/s and the estimated seconds per sync.
Exit status 0 when every row is ✔, 1 otherwise (2 for a config error). Everything it started
(probe actors, the buffer, Serve is never started) is removed before it exits.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from asyncrl.checks.preflight import Row, check_model, check_nodes
from asyncrl.config import Config


class Probe:
    """Ray actor body placed on one node: connects, listens, sends and receives weights."""

    def __init__(self) -> None:
        self.sender: Any = None
        self.listener: Any = None

    def ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def buffer_stats(self, address: str, curve_json: str | None, timeout_s: float,
                     secret: str | None = None) -> str | None:
        """None when one stats request is answered, else the error."""
        from asyncrl.config import CurveConfig
        from asyncrl.replay import BufferClient

        curve = CurveConfig.model_validate_json(curve_json) if curve_json else None
        client = BufferClient(address, curve, secret=secret, actor_id="doctor", reply_grace_s=timeout_s)
        try:
            client.stats()
            return None
        except Exception as exc:  # noqa: BLE001 - the error is the result
            return f"{type(exc).__name__}: {exc}"
        finally:
            client.close()

    def store_connect(self, address: str, timeout_s: float) -> str | None:
        from asyncrl.weights.group import make_store
        from asyncrl.weights.wire import PREFIX

        host, port = address.rsplit(":", 1)
        try:
            store = make_store(host, int(port), is_master=False, timeout_s=timeout_s)
            store.check([f"{PREFIX}/gen"])
            return None
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"

    def tcp_connect(self, host: str, port: int, timeout_s: float) -> str | None:
        import socket

        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                return None
        except OSError as exc:
            return f"{type(exc).__name__}: {exc}"

    def listen(self, bind: str, port: int, port_range: str | None) -> int:
        import socket

        from asyncrl.addresses import bind_first, candidate_ports

        def open_(p: int) -> socket.socket:
            s = socket.socket()
            s.bind((bind, p))
            s.listen(16)
            return s

        self.listener = bind_first(candidate_ports(port, port_range), open_, "verifier ingress", bind)
        return int(self.listener.getsockname()[1])

    def start_sender(self, weights_json: str, port_range: str | None) -> str:
        from asyncrl.config import WeightSyncConfig
        from asyncrl.weights.sender import WeightSender

        self.sender = WeightSender(WeightSyncConfig.model_validate_json(weights_json), port_range=port_range)
        return self.sender.address

    def add_receivers(self, ids: list[str]) -> None:
        self.sender.add_receivers(ids)

    def broadcast(self, nbytes: int, version: int) -> dict[str, Any]:
        import torch

        tensor = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
        return self.sender.broadcast([("doctor.weight", tensor)], version).as_dict()

    def receive(self, address: str, member_id: str, timeout_s: float) -> dict[str, Any]:
        from asyncrl.weights.receiver import WeightReceiver

        if getattr(self, "receiver", None) is None:
            self.receiver = WeightReceiver(address, member_id, timeout_s)
        out = self.receiver.receive(lambda tensors: sum(1 for _ in tensors))
        return {k: v for k, v in out.items() if k != "tensors"}


def model_bytes(cfg: Config) -> int | None:
    """Bytes of the policy's weight files (a local directory), None when unknown."""
    path = Path(cfg.model.path).expanduser()
    if not path.is_dir():
        return None
    return sum(f.stat().st_size for f in path.iterdir() if f.suffix in (".safetensors", ".bin", ".pt"))


class Doctor:
    def __init__(self, cfg: Config, broadcast_mb: float, timeout_s: float) -> None:
        self.cfg, self.broadcast_mb, self.timeout_s = cfg, broadcast_mb, timeout_s
        self.rows: list[Row] = []
        self.actors: list[Any] = []
        self.nodes: list[dict[str, Any]] = []
        self.probes: list[dict[str, Any]] = []

    def add(self, check: str, ok: bool, result: str, fix: str = "") -> bool:
        self.rows.append(Row(check, ok, result, fix))
        return ok

    def probe_on(self, node_id: str | None = None, resources: dict[str, float] | None = None) -> Any:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        opts: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 4}
        if node_id is not None:
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
        if resources:
            opts["resources"] = dict(resources)
        actor = ray.remote(Probe).options(**opts).remote()
        self.actors.append(actor)
        return actor

    def on_every_node(self) -> dict[str, Any]:
        return {p["ip"]: self.probe_on(p["node_id"]) for p in self.probes}

    # ------------------------------------------------------------------ checks
    def connect(self) -> bool:
        from asyncrl.cluster import ray_init
        from asyncrl.startup import StartupError

        t0 = time.time()
        where = self.cfg.cluster.ray_address or "embedded single-host cluster"
        mode = os.environ.get("RAY_AUTH_MODE", "")  # before ray.init, which may set it for a new cluster
        try:
            ray_init(self.cfg, f"asyncrl-doctor-{os.getpid()}")
        except StartupError as exc:
            auth = "InvalidAuthToken" in str(exc) or "uthentication" in str(exc)
            fix = ("export RAY_AUTH_MODE=token and make the head's token readable here (~/.ray/auth_token, "
                   "RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN), on the driver and on every joining node") if auth else (
                   "start the head (ray start --head) or fix cluster.ray_address; is the GCS port (6379) open "
                   "from this host?")
            return self.add("ray connection", False, str(exc)[:300], fix)
        return self.add("ray connection", True, f"joined {where} in {time.time() - t0:.1f}s "
                        f"(driver RAY_AUTH_MODE={mode or 'unset'})")

    def check_nodes(self) -> bool:
        import ray

        from asyncrl.cluster import interface_problems, probe_nodes, resource_problems, shm_problems

        self.nodes = ray.nodes()
        self.probes = probe_nodes(self.timeout_s)
        modes = {p["ip"]: p["env"]["RAY_AUTH_MODE"] or "unset" for p in self.probes}
        multi = len(self.probes) > 1
        unset = [ip for ip, m in modes.items() if m != "token"]
        self.add("ray token auth on nodes", not (multi and unset),
                 ", ".join(f"{ip}: {m}" for ip, m in modes.items()),
                 "start every joining node with RAY_AUTH_MODE=token (Ray 2.60 heads enable token auth; a "
                 "joining node without it fails with InvalidAuthToken)" if multi and unset else "")
        where = self.cfg.cluster.ray_address or "embedded"
        problems = resource_problems(self.cfg, self.nodes, where)
        self.add("placement (resources)", not problems, "; ".join(problems) or _demands(self.cfg),
                 "add nodes with these resources, or lower the roles' counts / resources in the config"
                 if problems else "")
        shm = shm_problems(self.cfg, self.probes)
        self.add("/dev/shm", not shm, "; ".join(shm) or ", ".join(
            f"{p['ip']}: {p['shm_bytes'] / 2**30:.1f} GiB" for p in self.probes), "see the message" if shm else "")
        iface = interface_problems(self.cfg, self.probes)
        from asyncrl.addresses import interface_env

        env = interface_env(self.cfg)
        shown = ", ".join(f"{k}={v}" for k, v in env.items()) or "not set (gloo/NCCL choose by hostname)"
        self.add("collective interface", not iface, "; ".join(iface) or shown,
                 "set cluster.network_interface to an interface every node has" if iface else "")
        self.rows += check_nodes(self.cfg, self.probes)  # registered node checks (asyncrl.checks.preflight)
        return not problems

    def check_buffer(self) -> None:
        import ray

        from asyncrl.replay.host import BufferHost

        cfg = self.cfg
        host = BufferHost.options(num_cpus=0, resources=cfg.cluster.resources.get("buffer")).remote(
            cfg.buffer.model_dump_json(), cfg.data.rollout_batch_size, port_range=cfg.cluster.port_range)
        self.actors.append(host)
        try:
            address = ray.get(host.start.remote(), timeout=self.timeout_s)
        except Exception as exc:  # noqa: BLE001
            cause = getattr(exc, "cause", None) or exc
            self.add("buffer listener", False, f"{type(cause).__name__}: {cause}"[:300],
                     "buffer.port is taken on that node: choose another port, 0, or cluster.port_range")
            return
        curve = cfg.buffer.curve.model_dump_json() if cfg.buffer.curve.enable else None
        secret = cfg.buffer.secret if cfg.buffer.auth else None
        results = {ip: a.buffer_stats.remote(address, curve, 5.0, secret) for ip, a in self.on_every_node().items()}
        self._reachability("buffer", address, results, f"buffer.host={cfg.buffer.host}",
                           "set buffer.host=auto (or node / the buffer node's own address); loopback reaches only "
                           "its own node, and a firewall must let every node reach this port")
        ray.get(host.stop.remote(), timeout=30)

    def check_weights(self) -> None:
        import ray

        cfg = self.cfg
        self.sender = self.probe_on(resources=cfg.cluster.resources.get("learner"))
        try:
            self.weight_address = ray.get(self.sender.start_sender.remote(
                cfg.learner.weights.model_dump_json(), cfg.cluster.port_range), timeout=self.timeout_s)
        except Exception as exc:  # noqa: BLE001
            self.weight_address = None
            cause = getattr(exc, "cause", None) or exc
            self.add("weight rendezvous listener", False, f"{type(cause).__name__}: {cause}"[:300],
                     "learner.weights.port is taken on the learner's node: choose another, 0, or cluster.port_range")
            return
        results = {ip: a.store_connect.remote(self.weight_address, 5.0) for ip, a in self.on_every_node().items()}
        self._reachability("weight rendezvous", self.weight_address, results,
                           f"learner.weights.host={cfg.learner.weights.host}",
                           "set learner.weights.host=auto (or node); open this port from the rollout nodes")

    def check_verifier(self) -> None:
        import ray

        from asyncrl.serve.deploy import head_node_ip, ingress_hosts

        cfg = self.cfg
        bind, advertise, location = ingress_hosts(cfg.verifier)
        head = next(p for p in self.probes if p["ip"] == head_node_ip()) if location else None
        listener = self.probe_on(head["node_id"] if head else None)
        try:
            port = ray.get(listener.listen.remote(bind, cfg.verifier.port, cfg.cluster.port_range), timeout=60)
        except Exception as exc:  # noqa: BLE001
            cause = getattr(exc, "cause", None) or exc
            self.add("verifier ingress", False, f"{type(cause).__name__}: {cause}"[:300],
                     "verifier.port is taken: choose another, 0, or cluster.port_range")
            return
        listener_ip = ray.get(listener.ip.remote())
        url = f"http://{advertise}:{port}/v1"
        if location is None:  # loopback: one proxy per node, each on its own loopback
            err = ray.get(listener.tcp_connect.remote(advertise, port, 5.0))
            self.add("verifier ingress", err is None, f"{url} on each node's loopback (rollout actors use Serve "
                     f"handles){'; ' + err if err else ''}", "" if err is None else "check the interface")
            return
        results = {ip: a.tcp_connect.remote(advertise, port, 5.0) for ip, a in self.on_every_node().items()}
        self._reachability("verifier ingress", url, results, f"verifier.host={cfg.verifier.host} (on {listener_ip})",
                           "open the ingress port from the clients' hosts, or keep verifier.host=auto")

    def _reachability(self, what: str, address: str, results: dict[str, Any], setting: str, fix: str) -> None:
        import ray

        bad = {}
        for ip, ref in results.items():
            try:
                err = ray.get(ref, timeout=60)
            except Exception as exc:  # noqa: BLE001
                err = f"{type(exc).__name__}: {exc}"
            if err:
                bad[ip] = err
        if bad:
            detail = "; ".join(f"from {ip}: {err[:160]}" for ip, err in bad.items())
            self.add(f"{what} reachable", False, f"{address} ({setting}) unreachable {detail}", fix)
        else:
            self.add(f"{what} reachable", True, f"{address} from {len(results)} node(s): {', '.join(results)}")

    def check_broadcast(self) -> None:
        import ray

        from asyncrl.cluster import role_demands

        cfg = self.cfg
        if self.weight_address is None or cfg.rollout.num_actors == 0:
            return
        unit = next(u for role, _, u in role_demands(cfg) if role == "rollout")
        targets = [p for p in self.probes if all(p["resources"].get(k, 0.0) >= v for k, v in unit.items())]
        full = model_bytes(cfg)
        nbytes = int(min(full or self.broadcast_mb * 2**20, self.broadcast_mb * 2**20))
        receivers = {f"doctor-{p['ip']}": self.probe_on(p["node_id"]) for p in targets}
        ray.get(self.sender.add_receivers.remote(list(receivers)))
        reports = []
        try:
            for version in (1, 2):  # the first round also builds the group; the second is the steady state
                refs = [a.receive.remote(self.weight_address, mid, cfg.learner.weights.timeout_s)
                        for mid, a in receivers.items()]
                report = ray.get(self.sender.broadcast.remote(nbytes, version), timeout=4 * cfg.learner.weights.timeout_s)
                ray.get(refs, timeout=4 * cfg.learner.weights.timeout_s + 30)
                reports.append(report)
        except Exception as exc:  # noqa: BLE001
            self.add("weight broadcast", False, f"{type(exc).__name__}: {str(exc)[:200]}",
                     "set cluster.network_interface (GLOO/NCCL_SOCKET_IFNAME) to the interface between the nodes")
            return
        last = reports[-1]
        missing = sorted(set(receivers) - set(last.get("acked", [])))
        seconds = max(last["seconds"], 1e-9)
        rate = last["bytes"] / seconds
        est = f"{(full or nbytes) / rate:.3f}s per sync of the {((full or nbytes) / 2**20):.1f} MiB model"
        detail = (f"{last['bytes'] / 2**20:.1f} MiB to {len(receivers)} node(s) ({', '.join(p['ip'] for p in targets)})"
                  f" in {seconds:.3f}s = {rate / 1e9:.3f} GB/s (first round, with the group build: "
                  f"{reports[0]['seconds']:.2f}s); est. {est}")
        self.add("weight broadcast", not missing, detail + (f"; not acked: {missing}" if missing else ""),
                 "set cluster.network_interface (GLOO/NCCL_SOCKET_IFNAME) to the interface between the nodes"
                 if missing else "")

    # ------------------------------------------------------------------ run
    def run(self) -> int:
        import ray

        from asyncrl.addresses import resolve_hosts

        self.rows += check_model(self.cfg)  # before Ray, as the launcher
        try:
            if self.connect():
                resolve_hosts(self.cfg)
                feasible = self.check_nodes()
                if feasible:
                    self.check_buffer()
                    self.check_weights()
                    self.check_verifier()
                    self.check_broadcast()
                else:
                    self.add("listeners and weight broadcast", False, "skipped: the job cannot be placed",
                             "fix the placement row first")
        finally:
            for actor in self.actors:
                ray.kill(actor)
            if ray.is_initialized():
                ray.shutdown()
        self.print()
        return 0 if all(r.ok for r in self.rows) else 1

    def print(self) -> None:
        where = self.cfg.cluster.ray_address or "embedded single-host cluster"
        lines = [f"asyncrl doctor: {where}, {len(self.probes)} node(s)"]
        for p in self.probes:
            res = p["resources"]
            custom = " ".join(f"{k}={v:g}" for k, v in sorted(res.items())
                              if k not in ("CPU", "GPU", "memory", "object_store_memory") and not k.startswith("node:"))
            lines.append(f"  node {p['ip']:<15} CPU {res.get('CPU', 0):g}  GPU {res.get('GPU', 0):g}  "
                         f"/dev/shm {p['shm_bytes'] / 2**30:.1f} GiB  {custom}")
        width = max(len(r.check) for r in self.rows) if self.rows else 10
        for r in self.rows:
            lines.append(f"{'✔' if r.ok else '✘'} {r.check:<{width}}  {r.result}")
            if not r.ok and r.fix:
                lines.append(f"  {'':<{width}}  fix: {r.fix}")
        bad = sum(not r.ok for r in self.rows)
        lines.append(f"{len(self.rows) - bad} ✔, {bad} ✘")
        print("\n".join(lines), flush=True)


def _demands(cfg: Config) -> str:
    from asyncrl.cluster import role_demands

    parts = []
    for role, count, unit in role_demands(cfg):
        if count and unit:
            parts.append(f"{role} {count} x " + ",".join(f"{k}={v:g}" for k, v in unit.items()))
    return "fits: " + "; ".join(parts)
