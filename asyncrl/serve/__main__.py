"""`python -m asyncrl.serve --config X.yaml [verifier.port=8001 ...]`: just the verifier service.

Starts Ray (embedded, or `cluster.ray_address`), Serve's HTTP proxy on `verifier.host:port`
(`port=0` picks a free one) and the `verifier` application, prints the OpenAI base URL, and runs
until Ctrl-C / SIGTERM, then deletes the application and stops what it started. The config is
parsed before Ray is imported, so `--help` and config errors answer at once.

HTTP is on by default: a service started alone exists to be reached from outside, so a job config's
`verifier.ingress: false` (a training job keeps Serve handles only, e.g. the quick start) is read as
"the job's choice" and overridden here. Only `verifier.ingress=false` on this command line turns the
proxy off; the app is then reachable through Serve handles on the Ray cluster only, which needs a
shared `cluster.ray_address` (an embedded Ray has no other client: exit 2).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading


def main(argv: list[str] | None = None) -> int:
    from asyncrl.cli import add_config_args, config_from_args

    parser = argparse.ArgumentParser(prog="python -m asyncrl.serve", description="Run the verifier service alone "
                                     "(Ray Serve app `verifier`, OpenAI-compatible HTTP); prints its URL.")
    add_config_args(parser)
    args = parser.parse_args(argv)
    cfg = config_from_args(args, require_files=False)
    if not ingress_turned_off(args.overrides):
        cfg = cfg.model_copy(update={"verifier": cfg.verifier.model_copy(update={"ingress": True})})
    elif cfg.cluster.ray_address is None:
        print("error: verifier.ingress=false on the command line with an embedded Ray: nothing could reach the "
              "service (no HTTP, no other Ray client); drop the override or set cluster.ray_address",
              file=sys.stderr)
        return 2

    import ray

    from asyncrl.addresses import resolve_host
    from asyncrl.serve.deploy import deploy_verifier, resolve_port, shutdown_verifier, verifier_url

    embedded = cfg.cluster.ray_address is None
    vcfg = resolve_port(cfg.verifier.model_copy(update={"host": resolve_host(cfg.verifier.host, not embedded)}),
                        cfg.cluster.port_range)

    if embedded:
        ray.init(address="local", num_cpus=cfg.cluster.num_cpus, num_gpus=cfg.cluster.num_gpus,
                 namespace=cfg.cluster.namespace, include_dashboard=False)  # never a stale cluster's address
    else:
        ray.init(address=cfg.cluster.ray_address, namespace=cfg.cluster.namespace)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        deploy_verifier(vcfg)
        if vcfg.ingress:
            print(f"verifier {vcfg.version} ({vcfg.backend}) serving at {verifier_url()} "
                  f"(POST /chat/completions, GET /models, GET /health); Ctrl-C stops", flush=True)
        else:
            print(f"verifier {vcfg.version} ({vcfg.backend}) serving Serve handles only (app `verifier`, "
                  f"namespace {cfg.cluster.namespace!r} on {cfg.cluster.ray_address}); Ctrl-C stops", flush=True)
        stop.wait()
    except RuntimeError as exc:
        print(f"error: the verifier could not start: {exc}", file=sys.stderr)
        return 1
    finally:
        print("stopping the verifier", flush=True)
        try:
            shutdown_verifier()
            if embedded:
                from ray import serve

                serve.shutdown()
        finally:
            ray.shutdown()
    return 0


def ingress_turned_off(overrides: list[str]) -> bool:
    """Whether this command line (not the config file) sets `verifier.ingress` false; the last
    occurrence wins, as in the config loader."""
    import yaml

    value = None
    for item in overrides:
        key, sep, raw = item.partition("=")
        if sep and key.strip() == "verifier.ingress":
            value = yaml.safe_load(raw)
    return value is False


if __name__ == "__main__":
    sys.exit(main())
