"""Where a LoRA-enabled vLLM CPU engine spends its time, against the same engine without LoRA.

    python analysis/profile_lora_engine.py [--config configs/quickstart_lora.yaml]
        [--variants plain lora lora:adapter=1 lora:rank=8,keep=1] [--rounds 3] [--py-spy DIR]

Each variant is a real `PolicyEngine` (asyncrl/actors/engine.py, built as the rollout actor builds
it) in its own process; all variants are built first, then timed in interleaved rounds (the order
rotates every round), so every ratio compares engines under the same machine load. A round is the
same fixed greedy batch for every variant: `--prompts` random prompts of `--prompt-len` tokens,
first prefilled alone (`max_tokens=1`: "prefill"), then fresh prompts generated to exactly
`--max-tokens` tokens (`ignore_eos`: "full"); prompts differ per round (no prefix-cache hits) and
are equal across variants. Reported per variant: median seconds and each round's ratio to the
first variant (median over rounds).

A variant is `plain` (no LoRA) or `lora[:key=value,...]` with keys `rank` (max_lora_rank and the
adapter's rank; default the config's `model.lora.rank`), `keep` (vLLM's max_loras; default
`buffer.max_staleness + 2`, as the rollout actor; max_cpu_loras follows as keep + 1) and `adapter` (1: a random non-zero adapter is loaded as version 1 and used; 0: version 0, no adapter).

`--py-spy DIR`: one more round per variant with py-spy sampling the engine-core process; the
samples are summarised by where they fall (LoRA ops, LoRA bookkeeping, the base model, ...) and
the raw stacks kept in DIR.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# (label, substring of a py-spy frame "function (file:line)"); a sample counts under the first
# label whose substring is on its stack, so the specific LoRA parts come before the model forward.
CATEGORIES = [
    ("lora punica ops (torch_ops shrink/expand)", "lora/ops/torch_ops"),
    ("lora punica wrapper (buffers, slicing)", "punica_cpu.py"),
    ("lora layer wrappers", "vllm/lora/layers"),
    ("lora per-step mapping (set_active_loras)", "set_active_loras"),
    ("lora manager (activate/add adapters)", "vllm/lora/"),
    ("model forward (base layers)", "_model_forward"),
    ("sampler / logits", "sample_tokens"),
    ("scheduler", "schedule ("),
]


def parse_variant(text: str, default_rank: int, default_keep: int) -> dict[str, Any]:
    """`plain` or `lora:rank=8,keep=1,adapter=1` -> a spec dict (exit 2 on an unknown key)."""
    kind, _, rest = text.partition(":")
    if kind == "plain" and not rest:
        return {"name": text, "lora": False}
    if kind != "lora":
        print(f"profile_lora_engine: variant {text!r}: expected 'plain' or 'lora[:key=value,...]'", file=sys.stderr)
        sys.exit(2)
    spec: dict[str, Any] = {"name": text, "lora": True, "rank": default_rank, "keep": default_keep, "adapter": 0}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in ("rank", "keep", "adapter") or not value.isdigit():
            print(f"profile_lora_engine: variant {text!r}: bad item {item!r} (keys: rank, keep, adapter)",
                  file=sys.stderr)
            sys.exit(2)
        spec[key] = int(value)
    return spec


# ---- child: one engine ------------------------------------------------------------------------
def random_adapter(model_path: str, adapter_cfg: dict[str, Any], seed: int) -> list[tuple[str, Any]]:
    """A PEFT adapter for `model_path` with random, non-zero lora_B (PEFT starts it at zero)."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    keys = ("r", "lora_alpha", "target_modules", "lora_dropout")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32),
                           LoraConfig(**{k: adapter_cfg[k] for k in keys}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return list(get_peft_model_state_dict(model).items())


def build_engine(args: argparse.Namespace, spec: dict[str, Any]) -> Any:
    """The rollout actor's `PolicyEngine` for `args.config`, with this variant's LoRA settings."""
    from asyncrl.actors.engine import EngineSpec, PolicyEngine
    from asyncrl.config import load_config
    from asyncrl.weights.adapter import adapter_config

    cfg = load_config(args.config, [])
    lora_kw: dict[str, Any] = {}
    if spec["lora"]:
        lora = cfg.model.lora.model_copy(update={"rank": spec["rank"]})
        lora_kw = {"lora_adapter": adapter_config(lora, cfg.model.path), "lora_keep": spec["keep"]}
    engine = PolicyEngine(EngineSpec(cfg.model.path, cfg.rollout, engine_id=f"profile-{os.getpid()}",
                          max_model_len=args.prompt_len + args.max_tokens + 8, seed=0, **lora_kw))
    return engine, cfg


def round_prompts(round_no: int, phase: str, n: int, length: int, vocab: int) -> list[list[int]]:
    """Fixed random prompts for one round and phase (equal across variants, new every round)."""
    import random

    rng = random.Random(f"{round_no}-{phase}")
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


async def timed_batch(engine: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    t0 = time.perf_counter()
    outs = await asyncio.gather(*[engine.generate(p, max_tokens, 0.0, ignore_eos=True) for p in prompts])
    return {"seconds": time.perf_counter() - t0, "tokens": sum(len(o.token_ids) for o in outs)}


async def child_main(args: argparse.Namespace) -> None:
    """Build one engine, say `ready` (with the engine-core pid), then time a round per `run N`."""
    import psutil
    from transformers import AutoConfig

    spec = json.loads(args.child)
    engine, cfg = build_engine(args, spec)
    if spec.get("adapter"):
        tensors = random_adapter(cfg.model.path, engine.adapters.config, seed=1)
        res = await engine.adapters.load(1, tensors)
        assert res["status"] == "ok", res
    vocab = AutoConfig.from_pretrained(cfg.model.path).vocab_size
    cores = [c.pid for c in psutil.Process().children(recursive=True)]
    await timed_batch(engine, round_prompts(-1, "warm", 4, args.prompt_len, vocab), 4)
    _reply({"ready": True, "engine_pids": cores, "version": engine.version})
    loop = asyncio.get_running_loop()
    while (line := (await loop.run_in_executor(None, sys.stdin.readline)).strip()) not in ("", "quit"):
        r = int(line.split()[1])
        pre = await timed_batch(engine, round_prompts(r, "prefill", args.prompts, args.prompt_len, vocab), 1)
        full = await timed_batch(engine, round_prompts(r, "full", args.prompts, args.prompt_len, vocab),
                                 args.max_tokens)
        _reply({"prefill_s": pre["seconds"], "full_s": full["seconds"], "tokens": full["tokens"]})
    engine.shutdown()


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write("RESULT " + json.dumps(obj) + "\n")
    sys.stdout.flush()


# ---- ops: vLLM's CPU LoRA kernels alone --------------------------------------------------------
def layer_slices(config: dict[str, Any]) -> list[tuple[str, int, list[int]]]:
    """(module, input width, output slices) of one decoder layer with LoRA on all seven
    projections, grouped as vLLM's merged layers are (qkv, o, gate_up, down)."""
    h, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    hd = int(config.get("head_dim") or h // heads)
    inter = int(config["intermediate_size"])
    return [("qkv_proj", h, [heads * hd, kv * hd, kv * hd]), ("o_proj", heads * hd, [h]),
            ("gate_up_proj", h, [inter, inter]), ("down_proj", inter, [h])]


def time_layer_ops(config: dict[str, Any], rank: int, tokens: int, seqs: int, slots: int,
                   grouped: bool, repeats: int = 3) -> float:
    """Median seconds of one layer's LoRA work for `tokens` tokens of `seqs` sequences that all use
    adapter slot 0: vLLM's `sgmv_shrink` + `sgmv_expand_slice` per slice (what `PunicaWrapperCPU`
    runs on CPU, where the mapping is always "prefill"), or, with `grouped`, the same arithmetic
    as two plain matmuls per slice (x @ A.T, then @ B.T), the floor for one adapter."""
    import torch
    from vllm.lora.ops.torch_ops import sgmv_expand_slice, sgmv_shrink

    torch.manual_seed(0)
    mods = [(name, i, outs, [torch.randn(slots, 1, rank, i) for _ in outs],
             [torch.randn(slots, 1, o, rank) for o in outs]) for name, i, outs in layer_slices(config)]
    xs = {i: torch.randn(tokens, i) for _, i, _, _, _ in mods}
    lens = torch.full((seqs,), tokens // seqs, dtype=torch.long)
    lens[-1] += tokens - int(lens.sum())
    starts = torch.cumsum(lens, 0) - lens
    idx = torch.zeros(seqs, dtype=torch.long)
    meta = (starts, lens, idx, seqs, int(lens.max()), tokens)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _, i, outs, a_s, b_s in mods:
            y = torch.zeros(tokens, sum(outs))
            offset = 0
            for o, a, b in zip(outs, a_s, b_s):
                buf = torch.zeros(tokens, rank)
                if grouped:
                    torch.mm(xs[i], a[0, 0].T, out=buf)
                    y[:, offset:offset + o].addmm_(buf, b[0, 0].T)
                else:
                    sgmv_shrink(xs[i], a, buf, *meta, 1.0)
                    sgmv_expand_slice(buf, b, y, *meta, offset, o, True)
                offset += o
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _config_json(path: str) -> dict[str, Any]:
    """A model's config.json (a model directory or the file itself); its text part if nested."""
    p = Path(path)
    config = json.loads((p / "config.json" if p.is_dir() else p).read_text())
    return config.get("text_config", config)


def ops_main(args: argparse.Namespace) -> None:
    """Per-layer cost of vLLM's CPU LoRA ops for the configured model and rank, against the same
    arithmetic as plain matmuls, for a decode step and a prefill of the profiled batch."""
    import torch

    from asyncrl.config import load_config

    torch.set_num_threads(1)
    cfg = load_config(args.config, [])
    shapes = {"policy": _config_json(cfg.model.path)}
    if args.ops_model:
        shapes[Path(args.ops_model).stem] = _config_json(args.ops_model)
    slots = cfg.buffer.max_staleness + 2
    out = []
    for (name, config), rank in itertools.product(shapes.items(), sorted({cfg.model.lora.rank, 8})):
        for phase, tokens, seqs in (("decode step", args.prompts, args.prompts),
                                    ("prefill", args.prompts * args.prompt_len, args.prompts)):
            vllm_s = time_layer_ops(config, rank, tokens, seqs, slots, grouped=False)
            mm_s = time_layer_ops(config, rank, tokens, seqs, slots, grouped=True)
            row = {"model": name, "rank": rank, "phase": phase, "tokens": tokens, "vllm_ms_per_layer": 1e3 * vllm_s,
                   "vllm_us_per_token_layer": 1e6 * vllm_s / tokens, "matmul_ms_per_layer": 1e3 * mm_s,
                   "ratio": vllm_s / mm_s}
            out.append(row)
            print(f"{name:<16} r{rank:<3} {phase:<12} {tokens:>5} tokens: vLLM ops {row['vllm_ms_per_layer']:8.2f} ms/layer "
                  f"({row['vllm_us_per_token_layer']:6.1f} us/token/layer), matmuls {row['matmul_ms_per_layer']:7.2f} "
                  f"ms/layer (x{row['ratio']:.1f})", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "ops.json").write_text(json.dumps(out, indent=2))


# ---- parent: build all, interleave rounds ------------------------------------------------------
class Child:
    def __init__(self, args: argparse.Namespace, spec: dict[str, Any], log_dir: Path) -> None:
        self.spec = spec
        log = open(log_dir / f"{spec['name'].replace(':', '_').replace(',', '_')}.log", "w")  # noqa: SIM115
        cmd = [sys.executable, __file__, "--child", json.dumps(spec), "--config", args.config,
               "--prompts", str(args.prompts), "--prompt-len", str(args.prompt_len),
               "--max-tokens", str(args.max_tokens)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        self.info: dict[str, Any] = {}

    def read(self) -> dict[str, Any]:
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[7:])
        raise RuntimeError(f"variant {self.spec['name']}: engine process ended (see its log)")

    def run(self, round_no: int) -> dict[str, Any]:
        self.proc.stdin.write(f"run {round_no}\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def py_spy_round(child: Child, out_dir: Path, round_no: int) -> dict[str, float]:
    """One round with py-spy sampling the engine-core process; the share of samples per category."""
    pid = child.info["engine_pids"][-1]
    raw = out_dir / f"{child.spec['name'].replace(':', '_').replace(',', '_')}.stacks.txt"
    spy = subprocess.Popen([str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(pid),
                            "--format", "raw", "--rate", "50", "--nonblocking", "-o", str(raw)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(2)
    child.run(round_no)
    spy.send_signal(signal.SIGINT)
    spy.wait(60)
    return summarise_stacks(raw)


def summarise_stacks(raw: Path) -> dict[str, float]:
    """Fraction of busy samples per CATEGORIES label (idle waiting on the input queue excluded)."""
    counts: dict[str, int] = {}
    busy = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if "execute_model" not in stack and "schedule (" not in stack:
            continue  # the engine core waiting for requests
        busy += int(n)
        label = next((lab for lab, key in CATEGORIES if key in stack), "other (engine core)")
        counts[label] = counts.get(label, 0) + int(n)
    return {"busy_samples": busy, **{k: v / max(busy, 1) for k, v in sorted(counts.items(), key=lambda kv: -kv[1])}}


def report(specs: list[dict[str, Any]], results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    base = specs[0]["name"]
    out: dict[str, Any] = {}
    for spec in specs:
        rows = results[spec["name"]]
        entry: dict[str, Any] = {}
        for key in ("prefill_s", "full_s"):
            entry[key] = statistics.median(r[key] for r in rows)
            entry[f"{key}_ratio"] = statistics.median(r[key] / b[key] for r, b in zip(rows, results[base]))
        entry["decode_s"] = statistics.median(r["full_s"] - r["prefill_s"] for r in rows)
        entry["decode_ratio"] = statistics.median((r["full_s"] - r["prefill_s"]) / (b["full_s"] - b["prefill_s"])
                                                  for r, b in zip(rows, results[base]))
        out[spec["name"]] = entry
        print(f"{spec['name']:<32} prefill {entry['prefill_s']:7.2f} s (x{entry['prefill_s_ratio']:.2f})  "
              f"full {entry['full_s']:7.2f} s (x{entry['full_s_ratio']:.2f})  "
              f"decode~ {entry['decode_s']:7.2f} s (x{entry['decode_ratio']:.2f})  vs {base}", flush=True)
    return out


def parent_main(args: argparse.Namespace) -> None:
    from asyncrl.config import load_config

    cfg = load_config(args.config, [])
    specs = [parse_variant(v, cfg.model.lora.rank, cfg.buffer.max_staleness + 2) for v in args.variants]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    children = [Child(args, spec, out_dir) for spec in specs]
    try:
        for c in children:
            c.info = c.read()
        print(f"built {len(children)} engines in {time.perf_counter() - t0:.0f} s", flush=True)
        results: dict[str, list[dict[str, Any]]] = {s["name"]: [] for s in specs}
        for r in range(args.rounds):
            order = children[r % len(children):] + children[:r % len(children)]
            for c in order:
                results[c.spec["name"]].append(c.run(r))
            print(f"round {r}: " + ", ".join(f"{c.spec['name']} {results[c.spec['name']][-1]['full_s']:.2f}s"
                                              for c in children), flush=True)
        summary = {"args": vars(args), "variants": report(specs, results), "rounds": results}
        if args.py_spy:
            summary["py_spy"] = {c.spec["name"]: py_spy_round(c, out_dir, 1000) for c in children}
            for name, shares in summary["py_spy"].items():
                print(name, json.dumps({k: round(v, 3) for k, v in shares.items()}), flush=True)
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    finally:
        for c in children:
            c.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/quickstart_lora.yaml")
    p.add_argument("--variants", nargs="+", default=["plain", "lora", "lora:adapter=1"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--py-spy", action="store_true", help="profile one more round per variant with py-spy")
    p.add_argument("--out", default="/tmp/profile_lora_engine")
    p.add_argument("--ops", action="store_true", help="time vLLM's CPU LoRA ops alone (no engine)")
    p.add_argument("--ops-model", help="also time the ops at this model's shapes (a directory or its config.json)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        asyncio.run(child_main(args))
    elif args.ops:
        ops_main(args)
    else:
        parent_main(args)


if __name__ == "__main__":
    main()
