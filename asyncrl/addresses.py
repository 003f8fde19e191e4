"""One rule for every listener of a job (replay buffer ROUTER, weight-group TCPStore, verifier
HTTP ingress): which interface it binds and which address it advertises.

`host` values (the `buffer.host`, `learner.weights.host`, `verifier.host` keys):
- ``auto`` (default): loopback on the embedded single-host cluster; the node's own address
  when the job joins a cluster (`cluster.ray_address` set). The driver turns ``auto`` into
  ``127.0.0.1`` or ``node`` once (`resolve_hosts`) before any listener starts;
- ``node``: the address of the node the listener runs on, i.e. Ray's node IP *of the hosting
  process* (`ray.util.get_node_ip_address()` inside that actor), bound and advertised;
- a wildcard (``0.0.0.0``, ``::``, ``*``): binds every interface, advertises the node IP — a
  wildcard is never handed to a client;
- any other address: bound and advertised as given.

Guarantee: `bind_and_advertise` never returns a wildcard as the advertised address, and a
listener whose bind address is not loopback is reported by `insecure_listeners` unless it is
authenticated (CurveZMQ for the buffer, an API key for the verifier; the TCPStore has no
authentication, so the weight rendezvous is always reported beyond loopback).
Ports: an explicit port is used as is; port 0 picks a free one, from `cluster.port_range`
("lo-hi") when set so a firewall can allow a fixed range.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from typing import Any, TypeVar

WILDCARDS = ("0.0.0.0", "::", "*", "")
T = TypeVar("T")


def node_ip() -> str:
    """Ray's IP of the node this process runs on (loopback when Ray is not initialised)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - no Ray in this process: a plain process is a loopback service
        pass
    return "127.0.0.1"


def is_loopback(host: str) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_and_advertise(host: str) -> tuple[str, str]:
    """`(bind, advertise)` for a listener configured with `host` (see the module docstring)."""
    if host == "auto":  # not resolved by a driver: a standalone process serves loopback
        return "127.0.0.1", "127.0.0.1"
    if host == "node":
        ip = node_ip()
        return ip, ip
    if host in WILDCARDS:
        return "0.0.0.0", node_ip()
    return host, host


def resolve_host(host: str, multi_node: bool) -> str:
    return ("node" if multi_node else "127.0.0.1") if host == "auto" else host


def resolve_hosts(cfg: Any) -> None:
    """Turn every ``auto`` listener host of `cfg` into loopback (embedded cluster) or ``node``."""
    multi = bool(cfg.cluster.ray_address)
    cfg.buffer.host = resolve_host(cfg.buffer.host, multi)
    cfg.learner.weights.host = resolve_host(cfg.learner.weights.host, multi)
    cfg.verifier.host = resolve_host(cfg.verifier.host, multi)


def parse_port_range(spec: str | None) -> tuple[int, int] | None:
    """`"20000-20099"` -> (20000, 20099); None/"" -> None. Raises ValueError naming the key."""
    if not spec:
        return None
    try:
        lo, hi = (int(p) for p in str(spec).split("-", 1))
    except ValueError:
        raise ValueError(f"cluster.port_range must look like 20000-20099, got {spec!r}") from None
    if not 0 < lo <= hi <= 65535:
        raise ValueError(f"cluster.port_range {spec!r} is not within 1-65535 with lo <= hi")
    return lo, hi


def candidate_ports(port: int, port_range: str | None) -> list[int]:
    """Ports to try in order: the explicit one, else the pinned range, else [0] (= any free)."""
    if port:
        return [port]
    rng = parse_port_range(port_range)
    return list(range(rng[0], rng[1] + 1)) if rng else [0]


def bind_first(ports: list[int], bind: Callable[[int], T], what: str, host: str) -> T:
    """`bind(port)` for the first port that is free; an OSError-like failure on every port
    raises one message naming the listener, the address and the ports tried."""
    last: BaseException | None = None
    for port in ports:
        try:
            return bind(port)
        except Exception as exc:  # noqa: BLE001 - zmq, torch and socket raise different types for "in use"
            last = exc
    shown = str(ports[0]) if len(ports) == 1 else f"{ports[0]}-{ports[-1]}"
    raise OSError(f"{what}: cannot listen on {host}:{shown} ({type(last).__name__}: {last}); "
                  "choose a free port or cluster.port_range") from None


def free_port(host: str, port_range: str | None = None) -> int:
    """A port that is free on `host` now (port 0 -> any, or the first free one of the range)."""
    def probe(port: int) -> int:
        with socket.socket() as s:
            s.bind((host, port))
            return int(s.getsockname()[1])

    return bind_first(candidate_ports(0, port_range), probe, "free port", host)


def insecure_listeners(cfg: Any) -> list[str]:
    """Listeners of `cfg` that would bind beyond loopback without authentication (one line each)."""
    out = []
    if not is_loopback(cfg.buffer.host) and not cfg.buffer.curve.enable:
        out.append(f"replay buffer ({cfg.buffer.host}) without CurveZMQ (buffer.curve.enable)")
    if not is_loopback(cfg.learner.weights.host):
        out.append(f"weight rendezvous ({cfg.learner.weights.host}): torch TCPStore, no authentication")
    if not is_loopback(cfg.verifier.host) and not cfg.verifier.api_key:
        out.append(f"verifier HTTP ingress ({cfg.verifier.host}) without verifier.api_key")
    return out


IFNAME_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


def interface_env(cfg: Any) -> dict[str, str]:
    """NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME for every role that joins a collective: from
    `cluster.network_interface`, else the driver's own standard variables (empty when unset)."""
    import os

    iface = cfg.cluster.network_interface
    if iface:
        return dict.fromkeys(IFNAME_VARS, iface)
    return {k: os.environ[k] for k in IFNAME_VARS if os.environ.get(k)}
