"""`python -m asyncrl.rescore RUN_DIR --verifier SPEC [--verifier SPEC ...]`: replay a finished
run's stored policy turns to each verifier and write one table per verifier (docs/rescore.md).

SPEC is a YAML file (an asyncrl config with a `verifier:` section, or that section alone), deployed
here through Ray Serve (an embedded Ray, handles only, no HTTP proxy), or the OpenAI base URL of a
running deployment (`http://host:port/v1`, e.g. `python -m asyncrl.serve`). Everything named is
checked before Ray starts: a bad run directory or verifier spec exits 2 naming it. Exit 1 when some
verifier failed requests (its table counts them and names the first error; a rerun retries them),
else 0.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.config.roles import VerifierConfig


@dataclass
class Target:
    name: str
    spec: str
    cfg: VerifierConfig
    url: str | None = None


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "verifier"


def parse_spec(spec: str) -> Target:
    """A `Target` from a `--verifier` argument; ValueError (one line, naming it) when it names nothing."""
    import yaml

    from asyncrl.config import ConfigError, load_config

    if spec.startswith(("http://", "https://")):
        return Target(_slug(spec.split("://", 1)[1].removesuffix("/v1")), spec, VerifierConfig(), spec.rstrip("/"))
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"unknown verifier {spec!r}: not a file and not an http(s):// URL")
    tree = yaml.safe_load(path.read_text()) or {}
    if not isinstance(tree, dict):
        raise ValueError(f"verifier {spec}: a YAML mapping expected")
    try:
        cfg = load_config(path).verifier if "verifier" in tree else VerifierConfig(**tree)
    except (ConfigError, ValueError) as exc:
        raise ValueError(f"verifier {spec}: {str(exc).splitlines()[0]}") from None
    if cfg.backend == "rule":
        from asyncrl.tasks import get_rule_verifier

        try:
            get_rule_verifier(cfg.task)
        except ValueError as exc:
            raise ValueError(f"verifier {spec}: verifier.task: {exc}") from None
    if cfg.backend == "vllm" and not (cfg.model_path and Path(cfg.model_path).exists()):
        raise ValueError(f"verifier {spec}: verifier.model_path={cfg.model_path!r} is not a local checkpoint")
    if cfg.backend == "http" and not cfg.http.base_url:
        raise ValueError(f"verifier {spec}: verifier.http.base_url is empty")
    return Target(_slug(cfg.version), spec, cfg)


def _done(path: Path) -> dict[str, dict[str, Any]]:
    """Records already answered (the resume point); failed ones are asked again."""
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            if rec["ok"]:
                out[rec["key"]] = rec
    return out


async def _replay(targets: list[Target], clients: dict[str, Any], broken: dict[str, str], turns: list[Any],
                  sampling: dict[str, Any], template: str | None, stop_token: str, out: Path) -> dict[str, list]:
    from tqdm import tqdm

    from asyncrl.verifier_protocol import parse_verifier_reply, render_verifier_messages

    records: dict[str, list[dict[str, Any]]] = {}
    pending: list[tuple[Target, Any]] = []
    for t in targets:
        done = _done(out / t.name / "replies.jsonl")
        records[t.name] = list(done.values())
        pending += [(t, turn) for turn in turns if turn.key not in done]
    files = {t.name: open(out / t.name / "replies.jsonl", "a") for t in targets}  # noqa: SIM115
    bar = tqdm(total=len(pending), desc="re-scoring", unit="turn", file=sys.stderr)
    sem = asyncio.Semaphore(64)

    async def one(t: Target, turn: Any) -> None:
        base = {"key": turn.key, "run_label": turn.run_label, "run_stop": turn.run_stop,
                "truth_label": turn.truth_label, "reference_missing": turn.reference_missing}
        if t.name in broken:
            rec = {**base, "ok": False, "error": broken[t.name], "label": None, "stop": False, "tokens": 0,
                   "latency_ms": 0.0}
        else:
            async with sem:
                messages = render_verifier_messages(turn.problem, turn.reference, turn.policy_turns, template)
                seed = int(hashlib.sha1(turn.key.encode()).hexdigest()[:8], 16)
                res = await clients[t.name].chat(messages, seed=seed, request_id=f"rescore-{seed:x}-{t.name}",
                                                 **sampling)
            reply = parse_verifier_reply(res.text, stop_token) if res.ok else None
            rec = {**base, "ok": res.ok, "error": res.error, "text": res.text,
                   "label": reply.hallucination if reply else None, "stop": bool(reply and reply.kind == "stop"),
                   "tokens": res.tokens, "latency_ms": round(res.latency_ms, 2)}
        records[t.name].append(rec)
        files[t.name].write(json.dumps(rec) + "\n")
        files[t.name].flush()
        bar.update(1)

    try:
        await asyncio.gather(*(one(t, turn) for t, turn in pending))
    finally:
        bar.close()
        for f in files.values():
            f.close()
        for c in clients.values():
            await c.aclose()
    return records


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m asyncrl.rescore", description="Replay a finished run's stored "
                                     "policy turns to one or several verifiers (no policy) and write a table per "
                                     "verifier (docs/rescore.md).")
    parser.add_argument("run_dir", help="a run directory (config.resolved.json, samples/)")
    parser.add_argument("--verifier", "-v", action="append", required=True, metavar="SPEC",
                        help="a verifier config YAML (deployed here) or a running deployment's http(s)://.../v1; "
                             "repeat for several")
    parser.add_argument("--out", help="where the tables go (default RUN_DIR/rescore/<verifier>/)")
    parser.add_argument("--deadline-s", type=float, default=30.0, help="per request, retries included")
    parser.add_argument("--max-retries", type=int, default=1, help="retries after the first attempt")
    return parser


@contextmanager
def _verifier_clients(targets: list[Target], run_dir: str) -> Iterator[tuple[dict[str, Any], dict[str, str]]]:
    """(a client per verifier name, why each broken one is): URLs are called as they are; YAML specs
    are deployed in an embedded Ray (handles only), shut down on leaving."""
    from asyncrl.serve.client import VerifierClient

    clients: dict[str, Any] = {}
    broken: dict[str, str] = {}
    deployed = [t for t in targets if t.url is None]
    ray_started = False
    try:
        if deployed:
            import ray

            from asyncrl.serve.deploy import deploy_verifier

            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                     namespace=f"rescore-{_slug(Path(run_dir).name)}")
            ray_started = True
            for i, t in enumerate(deployed):
                try:
                    handle = deploy_verifier(t.cfg.model_copy(update={"ingress": False}), name=f"rescore-{i}",
                                             route_prefix=f"/rescore-{i}")
                    clients[t.name] = VerifierClient(t.cfg, handle=handle)
                except RuntimeError as exc:
                    broken[t.name] = f"deployment failed: {str(exc).splitlines()[0]}"
                    print(f"verifier {t.name} ({t.spec}): {broken[t.name]}", file=sys.stderr)
        for t in targets:
            if t.url is not None:
                clients[t.name] = VerifierClient(t.cfg, base_url=t.url)
        yield clients, broken
    finally:
        if ray_started:
            from ray import serve

            serve.shutdown()
            ray.shutdown()


def _write_tables(targets: list[Target], records: dict[str, list[dict[str, Any]]], out: Path) -> int:
    """One table per verifier (JSON and Markdown, also printed); how many verifiers failed requests."""
    from asyncrl.rescore.tables import render_markdown, verifier_table

    failing = 0
    for t in targets:
        table = verifier_table(t.name, records[t.name])
        table["spec"] = t.spec
        (out / t.name / "table.json").write_text(json.dumps(table, indent=2))
        (out / t.name / "table.md").write_text(render_markdown(table))
        print(render_markdown(table))
        if table["failed"]:
            failing += 1
            print(f"verifier {t.name} ({t.spec}): {table['failed']} of {table['turns']} requests failed; first: "
                  f"{table['first_error']}", file=sys.stderr)
    return failing


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    from asyncrl.rescore.turns import NoConversations, load_turns

    try:
        turns, run_cfg = load_turns(args.run_dir)
    except (FileNotFoundError, NoConversations) as exc:
        return _fail(str(exc))
    try:
        targets = [parse_spec(s) for s in args.verifier]
    except ValueError as exc:
        return _fail(str(exc))
    seen: dict[str, int] = {}
    for t in targets:  # two specs with one version label: keep both tables apart
        seen[t.name] = seen.get(t.name, 0) + 1
        t.name += f"-{seen[t.name]}" if seen[t.name] > 1 else ""
    out = Path(args.out) if args.out else Path(args.run_dir) / "rescore"
    for t in targets:
        (out / t.name).mkdir(parents=True, exist_ok=True)
        t.cfg = t.cfg.model_copy(update={"client": t.cfg.client.model_copy(update={
            "deadline_s": args.deadline_s, "max_retries": args.max_retries})})

    guide = (run_cfg.get("rollout") or {}).get("guide") or {}
    s = guide.get("sampling") or {}
    sampling = {"max_tokens": int(s.get("max_tokens", 256)), "temperature": float(s.get("temperature", 0.2)),
                "top_p": float(s.get("top_p", 0.95)), "top_k": s.get("top_k")}
    print(f"re-scoring {len(turns)} verifier turns of {args.run_dir} with {len(targets)} verifier(s): "
          + ", ".join(f"{t.name} ({t.spec})" for t in targets), file=sys.stderr)
    with _verifier_clients(targets, args.run_dir) as (clients, broken):
        records = asyncio.run(_replay(targets, clients, broken, turns, sampling, guide.get("prompt_template"),
                                      guide.get("stop_token", "###STOP###"), out))
    failing = _write_tables(targets, records, out)
    print(f"tables under {out}/<verifier>/table.md", file=sys.stderr)
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
