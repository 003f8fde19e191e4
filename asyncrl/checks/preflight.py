"""The model against the config, in the driver, before Ray starts anything.

`check_model(cfg)` resolves every model path once (asyncrl.cluster.resolve_model_paths), reads the
policy's (and a model verifier's) `config.json` and tokenizer files, and runs every registered check.
Each check returns rows (`Row`: one ✔/✘ line with the fix), which `python -m asyncrl.doctor` shows
in its table and the launcher turns into one `error:` line per ✘ and exit status 2. Reading the files
is plain JSON (no torch, transformers or vLLM import), so a refused launch ends in about a second.
The built-in checks, in order: the policy's context against the lengths and the engine's
`max_model_len`; the engine's token budget and CPU KV cache; chat templates; vision keys against
the model type; a model verifier's context; `env:` secrets and CurveZMQ key files; the data's
prompt/answer columns; fixed listener ports and `trainer.resume`; the rule verifier's task; an HTTP
verifier's server accepting connections; weight files whole (plus whatever else is registered, e.g. the memory guard).

The policy's context follows vLLM 0.32's own derivation (`vllm.config.model._get_and_verify_max_len`
with `ModelArchConfigConvertor.derive_max_model_len_and_key`), on the text part of the config
(`text_config` of a vision-language model, as `get_hf_text_config`):
- the smallest of `max_position_embeddings`, `n_positions`, `max_seq_len`, `seq_length`,
  `model_max_length`, `max_target_positions`, `max_sequence_length`, `max_seq_length`, `seq_len`,
  except that a `model_max_length` of the text config wins outright (Command-R);
- not capped by the tokenizer's `model_max_length` (vLLM reads it only for pooling models with
  absolute positions, `ModelConfig.get_and_verify_max_len`);
- times the RoPE `factor` unless the rope type is su/longrope/llama3/yarn/deepseek_yarn/
  deepseek_llama_scaling (their `max_position_embeddings` is already scaled) or the model is gemma3;
- a sliding window does not cap it (vLLM does so only with `disable_sliding_window`, never set here);
- a configured `max_model_len` above it is refused unless the config's `model_max_length` allows
  it or `VLLM_ALLOW_LONG_MAX_MODEL_LEN` is set. With none of the keys vLLM assumes 2048; here the
  config is then read through transformers' `AutoConfig`, whose class defaults vLLM sees too.

What a job asks of that context (asyncrl.actors.guided.conversation, asyncrl.actors.guided.training):
the prompt budget `data.max_prompt_length` (P) is enforced before every policy turn by dropping old
turns, so one engine request is at most P + `data.max_response_length` (R) tokens, and so is a
learner sample (final_turn: the last turn's context + its response; full_turn: at most P + R by
construction). The engine is built with `rollout.max_model_len`, derived as P + turns x (R +
`rollout.guide.sampling.max_tokens`) unless set; a derived value longer than the model's context is
capped to it here (P + R still fits), a configured one is refused. The verifier sees the problem and
every policy turn, so a verifier request is at least its template + the problem (<= P) + turns x R,
plus `rollout.guide.sampling.max_tokens` for its reply. On vLLM's CPU build (no chunked prefill) one
sequence of `max_model_len` must fit `rollout.max_num_batched_tokens` and the KV cache
(`rollout.cpu_kvcache_gb`).

More checks plug in with `register_check(fn)`: `fn(cfg, models) -> list[Row]`, run in order before
Ray; checks that need the live nodes (e.g. their memory) with `register_node_check(fn)`:
`fn(cfg, probes) -> list[Row]`, run once Ray is up, before any component starts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.config import Config

# vLLM 0.32, ModelArchConfigConvertor.derive_max_model_len_and_key: candidates, the smallest wins.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
# vLLM 0.32, _get_and_verify_max_len: rope types whose max_position_embeddings is already scaled.
PRESCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")
# transformers' get_text_config: where a composite config keeps its text model.
TEXT_CONFIG_NAMES = ("text_encoder", "decoder", "generator", "text_config")
VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
KV_CACHE_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class Row:
    """One line of the preflight: a ✔ or a ✘ with what to change."""

    check: str
    ok: bool
    result: str
    fix: str = ""
    notice: bool = False  # a ✔ the launcher says aloud (something was derived differently)


@dataclass
class Context:
    """A model's context length as vLLM derives it, and where the number comes from."""

    tokens: int
    source: str  # e.g. "max_position_embeddings=1024 in assets/tiny-policy/config.json"
    allows: int = 0  # a configured max_model_len up to this passes vLLM's check (model_max_length / env)


@dataclass
class ModelFiles:
    """What the checks read of one model directory: its config and its tokenizer's files."""

    key: str  # the config key naming it: model.path or verifier.model_path
    path: Path
    tokenizer_path: Path
    config: dict[str, Any]
    tokenizer_config: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> dict[str, Any]:
        """The text model's part of the config (vLLM's `hf_text_config`)."""
        found = [self.config[n] for n in TEXT_CONFIG_NAMES if isinstance(self.config.get(n), dict)]
        return found[0] if len(found) == 1 else self.config

    @property
    def is_vl(self) -> bool:
        return self.config.get("model_type", "") in VL_MODEL_TYPES

    def has_chat_template(self) -> bool:
        """Where transformers looks: tokenizer_config.json's `chat_template`, chat_template.jinja,
        chat_template.json (processors), additional_chat_templates/."""
        t = self.tokenizer_path
        return bool(self.tokenizer_config.get("chat_template")) or (t / "chat_template.jinja").is_file() or \
            (t / "chat_template.json").is_file() or any((t / "additional_chat_templates").glob("*.jinja"))


def read_model(key: str, path: str, tokenizer_path: str | None) -> ModelFiles:
    """The config of a local model directory (already resolved); ValueError naming `key` if unreadable."""
    directory = Path(path)
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{key}={path}: no readable config.json ({type(exc).__name__}: {exc})") from None
    tok = Path(tokenizer_path or path)
    try:
        tok_cfg = json.loads((tok / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        tok_cfg = {}
    return ModelFiles(key, directory, tok, config, tok_cfg)


def model_context(model: ModelFiles) -> Context:
    """The model's context length, derived as vLLM 0.32 derives it (see the module docstring)."""
    text = model.text
    where = f"in {model.path}/config.json"
    tokens, key = float("inf"), None
    for name in CONTEXT_KEYS:
        value = text.get(name)
        if isinstance(value, (int, float)) and value < tokens:
            tokens, key = value, name
    if isinstance(text.get("model_max_length"), (int, float)) and text["model_max_length"]:
        tokens, key = text["model_max_length"], "model_max_length"
    if key is None:  # class defaults fill the keys: read them the way vLLM does
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(str(model.path)).get_text_config()
        text = {**hf.to_dict(), **text}
        return model_context(ModelFiles(model.key, model.path, model.tokenizer_path,
                                        {**model.config, "text_config": text}, model.tokenizer_config))
    source = f"{key}={tokens:g} {where}"
    factor = rope_factor(text, model.config.get("model_type", ""))
    if factor != 1.0:
        tokens, source = tokens * factor, f"{source} x RoPE factor {factor:g}"
    allows = int(text.get("model_max_length") or 0)
    if os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "").lower() in ("1", "true"):
        allows = 1 << 40
    return Context(int(tokens), source, allows)


def rope_factor(text: dict[str, Any], model_type: str) -> float:
    """vLLM's scaling of the derived length: the last `factor` of the rope parameters whose type
    is not pre-scaled (transformers' `rope_parameters`, or a legacy `rope_scaling`)."""
    params = text.get("rope_parameters") or text.get("rope_scaling")
    if not isinstance(params, dict) or not params or "gemma3" in model_type:
        return 1.0
    nested = all(isinstance(v, dict) for v in params.values())
    factor = 1.0
    for p in (params.values() if nested else [params]):
        rope_type = p.get("rope_type", p.get("type", "default"))
        if rope_type not in PRESCALED_ROPE:
            factor = p.get("factor", factor)
    return 1.0 if factor is None else float(factor)


def max_model_len_error(model: ModelFiles, ctx: Context, key: str, value: int) -> str | None:
    """vLLM's refusal of a configured max_model_len, phrased for the config key, or None."""
    if value <= ctx.tokens or (ctx.allows and value <= ctx.allows):
        return None
    return (f"{key}={value} exceeds the context of {model.key}={model.path}: {ctx.tokens} tokens "
            f"({ctx.source})")


# ------------------------------------------------------------------------------------- registry
Check = Callable[[Config, dict[str, ModelFiles]], list[Row]]
CHECKS: list[Check] = []


def register_check(check: Check) -> Check:
    """Add a check to every preflight (launcher and doctor); returns it (usable as a decorator).
    A check gets the config and the models read (`policy`, and `verifier` for a model verifier)
    and returns its rows; raising is a bug, not a ✘."""
    CHECKS.append(check)
    return check


NodeCheck = Callable[[Config, list[dict[str, Any]]], list[Row]]
NODE_CHECKS: list[NodeCheck] = []


def register_node_check(check: NodeCheck) -> NodeCheck:
    """Add a check of the live nodes, run once Ray is up (the launcher's `runtime.preflight`, any ✘
    stops the job before a component starts; doctor's table): `check(cfg, probes) -> list[Row]`,
    `probes` one dict per alive node from `asyncrl.cluster.probe_nodes` (ip, resources, shm_bytes...)."""
    NODE_CHECKS.append(check)
    return check


def check_nodes(cfg: Config, probes: list[dict[str, Any]]) -> list[Row]:
    """Every registered node check's rows."""
    return [row for check in NODE_CHECKS for row in check(cfg, probes)]


def check_model(cfg: Config) -> list[Row]:
    """Every registered check's rows, after resolving the model paths in `cfg` (in place)."""
    from asyncrl.cluster import resolve_model_paths

    try:
        resolve_model_paths(cfg)
        models = {"policy": read_model("model.path", cfg.model.path, cfg.model.tokenizer_path)}
        if cfg.verifier.backend == "vllm" and cfg.verifier.model_path:
            models["verifier"] = read_model("verifier.model_path", cfg.verifier.model_path,
                                            cfg.verifier.tokenizer_path)
    except ValueError as exc:
        return [Row("model files", False, str(exc), "point the key at a model directory (config.json, tokenizer)")]
    rows = [Row("model files", True, ", ".join(f"{m.key}={m.path}" for m in models.values()))]
    for check in CHECKS:
        rows += check(cfg, models)
    return rows


def refusals(rows: list[Row]) -> list[str]:
    """One line per ✘ row: what is wrong, with the numbers and keys, and the fix."""
    return [f"{r.result}{f' -> {r.fix}' if r.fix else ''}" for r in rows if not r.ok]


# ------------------------------------------------------------------------------------- checks
def derived_max_model_len(cfg: Config) -> int:
    """`rollout.max_model_len` as the config derives it when unset (asyncrl.config.schema)."""
    d, g = cfg.data, cfg.rollout.guide
    turns = g.max_turns if g.enable else 1
    return d.max_prompt_length + turns * (d.max_response_length + g.sampling.max_tokens)


@register_check
def check_policy_context(cfg: Config, models: dict[str, ModelFiles]) -> list[Row]:
    """P + R against the policy's context; the engine's max_model_len against it (a derived one
    is capped to it, a configured one is refused)."""
    policy, d, r = models["policy"], cfg.data, cfg.rollout
    ctx = model_context(policy)
    need = d.max_prompt_length + d.max_response_length
    fits = need <= ctx.tokens
    rows = [Row("policy context", fits,
                f"data.max_prompt_length + data.max_response_length = {d.max_prompt_length} + {d.max_response_length} = "
                f"{need} tokens (the longest policy turn and learner sample) {'fits' if fits else 'exceeds'}"
                f" the context of {policy.key}={policy.path}: {ctx.tokens} tokens "
                f"({ctx.source})",
                "" if fits else f"lower data.max_prompt_length + data.max_response_length to at most {ctx.tokens}, "
                "or use a model with a longer context")]
    derived = derived_max_model_len(cfg)
    error = max_model_len_error(policy, ctx, "rollout.max_model_len", r.max_model_len)
    how = (f" (derived: data.max_prompt_length + rollout.guide.max_turns x (data.max_response_length + "
           f"rollout.guide.sampling.max_tokens) = {derived})" if r.max_model_len == derived else "")
    if error and fits and r.max_model_len == derived:
        rows.append(Row("engine max_model_len", True, f"rollout.max_model_len{how} capped to the model's "
                        f"{ctx.tokens} tokens (a policy turn needs at most {need})", notice=True))
        r.max_model_len = ctx.tokens
    elif error:
        fix = (f"set rollout.max_model_len to at most {ctx.tokens} (a policy turn needs data.max_prompt_length + "
               f"data.max_response_length = {need})" if fits else "it follows once the lengths above fit")
        rows.append(Row("engine max_model_len", False, error + how, fix))
    else:
        rows.append(Row("engine max_model_len", True, f"rollout.max_model_len={r.max_model_len}{how} <= {ctx.tokens}"))
    return rows


@register_check
def check_engine_budget(cfg: Config, models: dict[str, ModelFiles]) -> list[Row]:
    """vLLM's scheduler checks (SchedulerConfig.verify_max_model_len) and, on its CPU build, one
    `max_model_len` sequence's KV cache against `rollout.cpu_kvcache_gb`."""
    r = cfg.rollout
    problems = []
    if r.gpus_per_actor == 0 and r.max_num_batched_tokens < r.max_model_len:  # CPU: no chunked prefill
        problems.append(f"rollout.max_num_batched_tokens={r.max_num_batched_tokens} is below one sequence: "
                        f"rollout.max_model_len={r.max_model_len} (vLLM's CPU build runs without chunked prefill)")
    if r.max_num_batched_tokens < r.max_num_seqs:
        problems.append(f"rollout.max_num_batched_tokens={r.max_num_batched_tokens} is below "
                        f"rollout.max_num_seqs={r.max_num_seqs}")
    rows = [Row("engine token budget", not problems, "; ".join(problems) or
                f"rollout.max_num_batched_tokens={r.max_num_batched_tokens} holds one sequence "
                f"(max_model_len {r.max_model_len}) and max_num_seqs {r.max_num_seqs}",
                "raise rollout.max_num_batched_tokens or lower rollout.max_model_len / rollout.max_num_seqs"
                if problems else "")]
    if r.gpus_per_actor == 0:
        rows.append(_cpu_kv_cache_row(cfg, models["policy"]))
    return rows


def _cpu_kv_cache_row(cfg: Config, policy: ModelFiles) -> Row:
    """KV bytes of one max_model_len sequence (2 x layers x kv heads x head dim x dtype bytes per
    token, no block rounding: a lower bound) against `rollout.cpu_kvcache_gb` (the engine's
    `kv_cache_memory_bytes`, asyncrl.actors.engine)."""
    t = policy.text
    heads = t.get("num_attention_heads") or 0
    layers, kv_heads = t.get("num_hidden_layers") or 0, t.get("num_key_value_heads") or heads
    head_dim = t.get("head_dim") or ((t.get("hidden_size") or 0) // heads if heads else 0)
    dtype = cfg.rollout.engine_dtype
    per_token = 2 * layers * kv_heads * head_dim * KV_CACHE_DTYPE_BYTES.get(dtype, 4)
    space = cfg.rollout.cpu_kvcache_gb
    need = per_token * cfg.rollout.max_model_len
    ok = need <= int(space * 2**30)
    return Row("CPU KV cache", ok, f"one sequence of rollout.max_model_len={cfg.rollout.max_model_len} needs "
               f"{need / 2**30:.3f} GiB ({per_token} B/token in {dtype}), rollout.cpu_kvcache_gb gives {space:g} GiB",
               "" if ok else "raise rollout.cpu_kvcache_gb or lower rollout.max_model_len")


@register_check
def check_chat_templates(cfg: Config, models: dict[str, ModelFiles]) -> list[Row]:
    """The rollout renders every prompt and user turn with the policy tokenizer's chat template
    (asyncrl.actors.guided.chat); a vllm verifier applies its own tokenizer's."""
    rows = []
    for role, model in models.items():
        key = "model.tokenizer_path" if role == "policy" else "verifier.tokenizer_path"
        named = key if (cfg.model if role == "policy" else cfg.verifier).tokenizer_path else model.key
        ok = model.has_chat_template()
        note = ("; data.override_chat_template is applied by the data filter only, not by the rollout"
                if role == "policy" and cfg.data.override_chat_template and not ok else "")
        rows.append(Row(f"{role} chat template", ok,
                        f"{named}={model.tokenizer_path}: {'has a chat template' if ok else 'no chat template'}"
                        f"{note}",
                        "" if ok else f"add chat_template.jinja to {model.tokenizer_path}, or set {key} to a "
                        "tokenizer with one"))
    return rows


VISION_KEYS = (("rollout", "limit_images"), ("model", "freeze_vision_tower"), ("data", "image_dir"),
               ("data", "min_pixels"), ("data", "max_pixels"))


@register_check
def check_vision(cfg: Config, models: dict[str, ModelFiles]) -> list[Row]:
    """Vision settings need a vision-language policy; a vision-language policy needs
    `rollout.guide.history=full` (processor-made prompt ids, asyncrl.actors.rollout)."""
    policy = models["policy"]
    kind = policy.config.get("model_type", "?")
    if not policy.is_vl:
        set_keys = [f"{s}.{k}={getattr(getattr(cfg, s), k)}" for s, k in VISION_KEYS
                    if k in getattr(cfg, s).model_fields_set and getattr(getattr(cfg, s), k)]
        return [Row("vision settings", not set_keys,
                    f"{policy.key}={policy.path} is a text model (model_type {kind})"
                    + (f" but vision keys are set: {', '.join(set_keys)}" if set_keys else ""),
                    f"remove them, or use a vision-language model ({', '.join(VL_MODEL_TYPES)})" if set_keys else "")]
    history = cfg.rollout.guide.history
    ok = history == "full"
    return [Row("vision settings", ok, f"{policy.key}={policy.path} is a vision-language model (model_type {kind})"
                + ("" if ok else f" but rollout.guide.history={history}"),
                "" if ok else "set rollout.guide.history=full (images need the processor's token ids kept)")]


@register_check
def check_verifier_context(cfg: Config, models: dict[str, ModelFiles]) -> list[Row]:
    """A model verifier: `verifier.max_model_len` within its model's context, and room for its
    template + one full policy turn + its reply (the smallest request a full-length turn makes);
    the longest conversation's request is reported."""
    model = models.get("verifier")
    if model is None:
        return []
    v, d, g = cfg.verifier, cfg.data, cfg.rollout.guide
    ctx = model_context(model)
    error = max_model_len_error(model, ctx, "verifier.max_model_len", v.max_model_len)
    rows = [Row("verifier context", error is None, error or f"verifier.max_model_len={v.max_model_len} <= "
                f"{ctx.tokens} ({ctx.source})", f"set verifier.max_model_len to at most {ctx.tokens}" if error else "")]
    template = verifier_template_tokens(cfg, model)
    least = template + d.max_response_length + g.sampling.max_tokens
    turns = g.max_turns if g.enable else 1
    most = template + d.max_prompt_length + turns * d.max_response_length + g.sampling.max_tokens
    ok = least <= v.max_model_len
    rows.append(Row("verifier request", ok,
                    f"one full policy turn needs {least} tokens (template {template} + data.max_response_length "
                    f"{d.max_response_length} + rollout.guide.sampling.max_tokens {g.sampling.max_tokens}); the "
                    f"longest conversation up to {most} (+ problem <= data.max_prompt_length, x rollout.guide."
                    f"max_turns {turns}); verifier.max_model_len={v.max_model_len}"
                    + ("" if most <= v.max_model_len or not ok else ": longer requests get a 400 (verifier_error)"),
                    "" if ok else f"raise verifier.max_model_len to at least {least} (the model's context is "
                    f"{ctx.tokens}), or lower data.max_response_length / rollout.guide.sampling.max_tokens"))
    return rows


def verifier_template_tokens(cfg: Config, model: ModelFiles) -> int:
    """Tokens of the verifier's prompt with an empty problem and no turns, counted with the
    verifier's tokenizer.json (`tokenizers`, no transformers import); 0 when it has none."""
    path = model.tokenizer_path / "tokenizer.json"
    if not path.is_file():
        return 0
    from tokenizers import Tokenizer

    from asyncrl.verifier_protocol import render_verifier_messages

    messages = render_verifier_messages("", None, [], cfg.rollout.guide.prompt_template)
    return len(Tokenizer.from_file(str(path)).encode("\n".join(m["content"] for m in messages),
                                                    add_special_tokens=False).ids)


@register_check
def check_secrets(cfg: Config, models: dict[str, ModelFiles]) -> list[Row]:  # noqa: ARG001 - the registry's signature
    """`env:NAME` secrets must be set where they are read: on an embedded cluster every process
    inherits the driver's environment, so an unset variable here fails the verifier replica and
    every rollout actor (asyncrl.serve.replica.resolve_secret); CurveZMQ key files must exist."""
    problems = []
    secrets = {"verifier.api_key": cfg.verifier.api_key}
    if cfg.verifier.backend == "http":
        secrets["verifier.http.api_key"] = cfg.verifier.http.api_key
    for key, value in secrets.items():
        name = value[4:] if value.startswith("env:") else None
        if name and not os.environ.get(name) and not cfg.cluster.ray_address:
            problems.append(f"{key}=env:{name} but the environment variable {name} is not set")
    if cfg.buffer.curve.enable:
        for field_name in ("server_secret_key_file", "server_public_key_file", "client_secret_key_file",
                           "authorized_clients_dir"):
            value = getattr(cfg.buffer.curve, field_name)
            if value and not Path(value).expanduser().exists():
                problems.append(f"buffer.curve.{field_name}: no such file or directory: {value}")
    return [Row("secrets", not problems, "; ".join(problems) or "every env: secret is set, key files exist",
                "export the variables (or give the secret inline) and create the key files "
                "(zmq.auth.create_certificates)" if problems else "")]


@register_check
def check_data_columns(cfg: Config, models: dict[str, ModelFiles]) -> list[Row]:  # noqa: ARG001 - the registry's signature
    """The prompt and answer columns in the first row of each local .jsonl file and the schema of
    each local .parquet file of the data splits (hub datasets and .json arrays are checked when
    the job loads them, asyncrl.data.sources): a wrong `data.prompt_key` is found here in a moment,
    not after Ray and the data step started."""
    from asyncrl.data.sources import parse_data_spec

    d = cfg.data
    problems, seen = [], []
    for key in ("train_files", "val_files", "test_files"):
        spec = getattr(d, key)
        if not spec:
            continue
        path = Path(parse_data_spec(spec)[0]).expanduser()
        files = [path] if path.is_file() else sorted(path.rglob("*.jsonl")) + sorted(path.rglob("*.parquet")) \
            if path.is_dir() else []
        for f in files[:8]:
            columns = _first_columns(f)
            if columns is None:
                continue
            seen.append(f.name)
            for col, field_name in ((d.prompt_key, "prompt_key"), (d.answer_key, "answer_key")):
                if col not in columns:
                    problems.append(f"data.{key}={f}: no column {col!r} (columns: {columns}); set data.{field_name}")
    return [Row("data columns", not problems, "; ".join(problems) or
                f"data.prompt_key={d.prompt_key!r}, data.answer_key={d.answer_key!r} in {', '.join(seen) or 'no local file'}",
                "" if not problems else "name the columns the files have")]


def _first_columns(path: Path) -> list[str] | None:
    """Column names of a local data file from its first row (.jsonl) or schema (.parquet); None
    for other kinds or an unreadable file (the data step reports those with the row)."""
    try:
        if path.suffix == ".jsonl":
            with open(path) as f:
                line = next((ln for ln in f if ln.strip()), "")
            row = json.loads(line) if line else None
            return list(row) if isinstance(row, dict) else None
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return list(pq.read_schema(path).names)
    except (OSError, ValueError):
        return None
    return None


@register_check
def check_ports_and_resume(cfg: Config, models: dict[str, ModelFiles]) -> list[Row]:  # noqa: ARG001 - the registry's signature
    """Fixed listener ports: two listeners on one port, or (embedded cluster: every listener on
    this host) a port something already listens on, fail here rather than at the listener's
    start a minute later; `trainer.resume` naming a checkpoint that does not exist."""
    import socket

    from asyncrl.addresses import bind_and_advertise, resolve_host

    fixed = {key: (host, port) for key, host, port in (
        ("buffer.port", cfg.buffer.host, cfg.buffer.port), ("learner.weights.port", cfg.learner.weights.host,
                                                             cfg.learner.weights.port),
        ("verifier.port", cfg.verifier.host, cfg.verifier.port if cfg.rollout.guide.enable else 0)) if port}
    problems = []
    by_port: dict[int, list[str]] = {}
    for key, (_, port) in fixed.items():
        by_port.setdefault(port, []).append(key)
    problems += [f"{' and '.join(keys)} are all {port}" for port, keys in by_port.items() if len(keys) > 1]
    for key, (host, port) in fixed.items() if not cfg.cluster.ray_address else ():
        bind = bind_and_advertise(resolve_host(host, False))[0]
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no conflict, a listener is
            try:
                s.bind((bind, port))
            except OSError as exc:
                problems.append(f"{key}={port}: {bind}:{port} is taken ({exc.strerror})")
    rows = [Row("listener ports", not problems, "; ".join(problems) or (
        f"fixed ports free: {', '.join(f'{k}={p}' for k, (_, p) in fixed.items())}" if fixed else
        "every listener picks a free port"), "choose another port, 0 (any free one) or cluster.port_range"
        if problems else "")]
    resume = cfg.trainer.resume
    missing = resume not in ("auto", "never") and not Path(resume).expanduser().exists()
    rows.append(Row("resume", not missing, f"trainer.resume={resume}" + (": no such checkpoint" if missing else ""),
                    "point trainer.resume at a checkpoint directory, or auto / never" if missing else ""))
    return rows


@register_check
def memory_fit(cfg: Config, models: dict[str, ModelFiles]) -> list[Row]:
    """A CPU job on this machine (the embedded cluster) fits its memory: learner ranks, rollout
    engines and the WeightStore's two copies (current + next), estimated by `asyncrl.learner.memory` against 90% of the
    machine (Ray's memory monitor kills workers at 95%). A GPU job's per-GPU fit is estimated by
    scripts/gpu_check.py (S3); a joined cluster's nodes are not this machine."""
    if cfg.cluster.ray_address or cfg.learner.num_gpus > 0 or cfg.rollout.gpus_per_actor > 0:
        return []
    import psutil

    return memory_rows(cfg, models["policy"], psutil.virtual_memory().total)


def memory_rows(cfg: Config, policy: ModelFiles, machine_bytes: int) -> list[Row]:
    from asyncrl.learner import memory as mem

    shape = mem.shape_from_config(policy.text, cfg.model.path)
    samples = cfg.data.rollout_batch_size * cfg.rollout.n
    tokens = min(cfg.learner.micro_batch_tokens, samples * (cfg.data.max_prompt_length + cfg.data.max_response_length))
    adapter = mem.lora_params(policy.text, cfg.model.lora.rank, cfg.model.lora.target_modules) \
        if cfg.model.lora.enable else None
    rank = mem.rank_bytes(shape, ranks=cfg.learner_world_size, zero_stage=cfg.learner.zero_stage,
                          bf16=cfg.learner_precision == "bf16", micro_batch_tokens=tokens,
                          logit_tokens=min(tokens, samples * (cfg.data.max_response_length + 1)),
                          reference=cfg.learner.kl.enable, gpu=False, adapter_params=adapter)
    from asyncrl.weights.adapter import sync_kind
    from asyncrl.weights.store import shm_bytes_needed

    trainable = float(adapter) if adapter is not None else shape.params
    synced = trainable if adapter is not None and sync_kind(cfg) == "adapter" else shape.params
    churn = rank["parameters"] + rank["gradients"] + rank["optimizer (fp32 master + Adam moments)"]
    rank.update(mem.cpu_learner_extras(shape, trainable=trainable, churn_bytes=churn))
    sync_copy = (2 if cfg.learner_precision == "bf16" else 4) * synced  # the sender's HostArena, rank 0
    engine = mem.engine_host_bytes(shape, int(cfg.rollout.cpu_kvcache_gb * mem.GiB), cfg.rollout.max_num_batched_tokens)
    parts = {f"learner rank x{cfg.learner_world_size}": sum(rank.values()) * cfg.learner_world_size,
             "learner's weight-sync host copy (rank 0)": int(sync_copy),
             f"rollout engine x{cfg.rollout.num_actors}": sum(engine.values()) * cfg.rollout.num_actors,
             # the store holds the current version while the next one is put (object store): at 20 of
             # Qwen2.5-0.5B's layers, accepted with one copy counted, Ray's monitor killed an actor
             "weight store copy x2 (current + next)": shm_bytes_needed(int(sync_copy)),
             "driver and services": mem.CPU_RUNTIME_BYTES}
    budget = int(0.9 * machine_bytes)
    total = sum(parts.values())
    detail = (f"{mem.describe(parts, budget)}; one learner rank: "
              f"{mem.describe(rank, budget).split('(', 1)[1].rstrip(')')}")
    if total <= budget:
        return [Row("memory", True, f"{shape.params / 1e9:.2f}B parameters: {detail}")]
    return [Row("memory", False, f"{shape.params / 1e9:.2f}B parameters do not fit this machine: {detail}",
                "a smaller model, learner.zero_stage=0 (no DeepSpeed fp32 partition copies), learner.kl.enable="
                "false (no reference replica), fewer rollout.num_actors, or a machine with more memory")]



def checkpoint_estimate(cfg: Config, policy: ModelFiles) -> int:
    """Bytes of one job checkpoint of this policy (`asyncrl.learner.memory.checkpoint_bytes`)."""
    from asyncrl.learner import memory as mem

    shape = mem.shape_from_config(policy.text, cfg.model.path)
    adapter = mem.lora_params(policy.text, cfg.model.lora.rank, cfg.model.lora.target_modules) \
        if cfg.model.lora.enable else None
    return mem.checkpoint_bytes(shape.params, float(adapter) if adapter is not None else shape.params,
                                bf16=cfg.learner_precision == "bf16")


@register_check
def disk_fit(cfg: Config, models: dict[str, ModelFiles]) -> list[Row]:
    """The run directory's filesystem holds the checkpoints this run keeps (the periodic ones, up
    to `trainer.save_limit`, and the final one): refused when not even one fits (the job would
    fail at its first checkpoint), said aloud when only some do. The driver's filesystem: in the
    embedded mode the learner writes there; on a joined cluster learner rank 0 writes the same
    `trainer.run_dir`, which must then be shared storage."""
    from asyncrl.learner.checkpoint import free_bytes

    try:
        one = checkpoint_estimate(cfg, models["policy"])
    except (KeyError, TypeError, ValueError):  # a config.json without a decoder's dimensions: no estimate
        return []
    t = cfg.trainer
    writes = 1 + (t.max_steps // t.save_every if t.max_steps and t.save_every > 0 else 0)
    kept = min(writes, t.save_limit) if t.save_limit > 0 else writes
    free = free_bytes(cfg.run_path)
    where = f"trainer.run_dir: {cfg.run_path} has {free / 1e9:.2f} GB free; one checkpoint takes ~{one / 1e9:.2f} GB"
    fix = "free space there, point trainer.run_dir elsewhere, or lower trainer.save_limit"
    if free < one:
        return [Row("disk", False, f"{where}: not even one fits", fix)]
    if free < one * kept:
        return [Row("disk", True, f"{where}: {int(free // one)} of the {kept} this run keeps fit "
                    "(a checkpoint that does not fit is skipped, said aloud)")]
    return [Row("disk", True, f"{where} ({kept} kept)")]


@register_check
def check_rule_verifier(cfg: Config, models: dict[str, ModelFiles]) -> list[Row]:  # noqa: ARG001 - the registry's signature
    """The rule back-end's task, built here as its replica builds it (asyncrl.tasks)."""
    if cfg.verifier.backend != "rule" or not cfg.rollout.guide.enable:
        return []
    from asyncrl.tasks import get_rule_verifier

    try:
        get_rule_verifier(cfg.verifier.task)
    except ValueError as exc:
        return [Row("rule verifier", False, f"verifier.task={cfg.verifier.task}: {exc}",
                    "set verifier.task to a built-in task, or verifier.backend=vllm / http")]
    if cfg.verifier.task == "mathds":  # a question the rule cannot read would fail every request for it
        from asyncrl.tasks.mathds_verifier import first_unreadable

        for key in ("train_files", "val_files", "test_files"):
            spec = getattr(cfg.data, key)
            path = Path(os.path.expanduser(spec.split("@", 1)[0])) if spec else None
            if path is None or path.suffix != ".jsonl" or not path.is_file():
                continue
            bad = first_unreadable(path, cfg.data.prompt_key)
            if bad:
                return [Row("rule verifier", False, f"data.{key}: {bad}",
                            "the mathds verifier reads the Mathematics Dataset's arithmetic questions only")]
    return [Row("rule verifier", True, f"verifier.task={cfg.verifier.task}")]


@register_check
def check_http_verifier(cfg: Config, models: dict[str, ModelFiles]) -> list[Row]:  # noqa: ARG001 - the registry's signature
    """An HTTP verifier's server answers a TCP connect (3 s) from the driver, so a wrong port or host
    fails in a second rather than after Ray, Serve and the engines have started (the probe request
    through Serve, later, checks the API itself). Refused only for a single-node (embedded) job,
    where the driver's view is the replica's; on a cluster an address the driver cannot reach is
    said aloud and left to that probe."""
    if cfg.verifier.backend != "http" or not cfg.rollout.guide.enable:
        return []
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(cfg.verifier.http.base_url)
    host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=3):
            pass
    except OSError as exc:
        why = "connection refused" if isinstance(exc, ConnectionRefusedError) else \
            "no such host" if isinstance(exc, socket.gaierror) else f"{type(exc).__name__}: {exc}"
        where = f"verifier.http.base_url={cfg.verifier.http.base_url}: nothing answers at {host}:{port} ({why})"
        if cfg.cluster.ray_address:
            return [Row("http verifier", True, f"{where} from the driver; the probe through Serve decides",
                        notice=True)]
        return [Row("http verifier", False, where, "start the verifier's server first, or fix the URL")]
    return [Row("http verifier", True, f"{host}:{port} accepts connections")]


@register_check
def check_weight_files(cfg: Config, models: dict[str, ModelFiles]) -> list[Row]:  # noqa: ARG001 - the registry's signature
    """Every model directory has its weights, whole: the shards its index names exist, and each
    .safetensors file holds what its header says (8-byte length + JSON header + the tensors' byte
    range), so a truncated download fails here, not in the learner and every engine minutes later."""
    problems, counted = [], []
    for model in models.values():
        files = sorted(model.path.glob("*.safetensors"))
        index = model.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                shards = set(json.loads(index.read_text())["weight_map"].values())
            except (OSError, ValueError, KeyError) as exc:
                problems.append(f"{model.key}={model.path}: unreadable {index.name} ({type(exc).__name__})")
                continue
            problems += [f"{model.key}={model.path}: shard {s} named by {index.name} is missing"
                         for s in sorted(shards) if not (model.path / s).is_file()]
        if not files and not any(model.path.glob("*.bin")) and not any(model.path.glob("*.pt")):
            problems.append(f"{model.key}={model.path}: no weight files (*.safetensors, *.bin)")
        problems += [f"{model.key}={model.path}: {f.name} {err}" for f in files if (err := _safetensors_problem(f))]
        counted.append(f"{model.key}: {len(files)} safetensors file(s)")
    return [Row("weight files", not problems, "; ".join(problems) or ", ".join(counted),
                "download the model again (an interrupted download leaves truncated files)" if problems else "")]


def _safetensors_problem(path: Path) -> str | None:
    """Why a .safetensors file is not whole, or None."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or 8 + n > size:
                return f"is truncated or not safetensors (header of {n} bytes, file of {size})"
            header = json.loads(f.read(n))
    except (OSError, ValueError) as exc:
        return f"has an unreadable header ({type(exc).__name__})"
    end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
    return None if 8 + n + end <= size else f"is truncated: {size} bytes, its header needs {8 + n + end}"
