"""`AdapterSlots`: an engine's LoRA policy versions (`model.lora` with adapter sync), beside
`engine.py` because it is the other place that talks to vLLM (its LoRA API).

Guarantees:
- Version N is loaded as a NEW adapter, name `policy-vN`, id N (`AsyncLLM.add_lora`), never with
  `load_inplace`: vLLM 0.32 re-reads an in-place adapter from disk at every scheduling step and
  keeps the prefix-cache keys of its name, so old KV blocks would serve new weights. Version 0 is
  the base model (PEFT starts `lora_B` at zero): no adapter.
- At most `keep` (= `buffer.max_staleness + 2`) versions stay loaded; older ones are unloaded
  (`remove_lora`) and their directories deleted one load later, so a request that still names an
  unloaded version (vLLM reloads it from its path) finds its files for one more sync; the whole
  directory goes at `close`, or at the next start of the same engine if its process was killed.
- Loading an adapter does not touch the base weights, so generation never pauses for it; the
  version moves only after the adapter is on disk, read back equal to what arrived (the wire's
  fingerprint samples), and accepted by vLLM.
- Every token is stamped with the version of the adapter that sampled it. An update while a
  request runs is taken in flight: the request is stopped at its next chunk and continued under
  the new adapter from the tokens so far (a new request: prompt + tokens, the remaining budget, its
  own seed), so one response can span versions and each token carries its own.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from asyncrl.weights.adapter import fast_local_dir, read_adapter_tensors, write_adapter_dir
from asyncrl.weights.wire import fingerprint_mismatches, fingerprint_of, sample_values

log = logging.getLogger(__name__)


def adapter_name(version: int) -> str:
    return f"policy-v{int(version)}"


class AdapterSlots:
    """The adapters one `AsyncLLM` holds, by version. `config` is the `adapter_config.json` dict."""

    def __init__(self, llm: Any, engine_id: str, config: dict[str, Any], keep: int) -> None:
        self.llm, self.config, self.keep = llm, config, max(2, int(keep))
        self.root = adapter_root(engine_id)
        self.version = 0
        self.current: Any = None  # LoRARequest of `version`; None = the base model (version 0)
        self.loaded: list[tuple[int, Any]] = []  # (version, LoRARequest), oldest first
        self._unloaded_dirs: list[Path] = []  # deleted at the next load

    # ---- loading ----------------------------------------------------------------------------
    async def load(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        """Write version `version` of the adapter, check the file, add it to vLLM, make it current
        and evict beyond `keep`. Returns status ok / fingerprint_mismatch / failed (current kept)."""
        from vllm.lora.request import LoRARequest

        tensors = list(tensors)
        if version == 0:  # the initial adapter is zero (lora_B = 0): the base model itself
            self.version, self.current = 0, None
            return {"status": "ok", "version": 0, "fingerprint_mismatch": 0, "loaded_versions": []}
        name = adapter_name(version)
        path = await asyncio.to_thread(write_adapter_dir, self.root, name, tensors, self.config)
        bad = await asyncio.to_thread(_readback_mismatches, path, tensors)
        if bad:
            shutil.rmtree(path, ignore_errors=True)
            return {"status": "fingerprint_mismatch", "version": self.version, "fingerprint_mismatch": len(bad),
                    "error": f"adapter file differs from what arrived (e.g. {bad[0]})"}
        request = LoRARequest(name, int(version), str(path))
        try:
            await self.llm.add_lora(request)
        except Exception as exc:  # noqa: BLE001 - vLLM refused the adapter: keep serving the current one
            log.exception("engine: vLLM refused adapter %s", name)
            return {"status": "failed", "version": self.version, "error": f"{type(exc).__name__}: {exc}"}
        self.loaded = [(v, r) for v, r in self.loaded if v != version] + [(version, request)]
        self.version, self.current = int(version), request
        await self._evict()
        return {"status": "ok", "version": self.version, "fingerprint_mismatch": 0, "adapter_path": str(path),
                "loaded_versions": [v for v, _ in self.loaded]}

    async def _evict(self) -> None:
        """Delete the directories unloaded at the previous load, then unload beyond `keep`."""
        for d in self._unloaded_dirs:
            shutil.rmtree(d, ignore_errors=True)
        self._unloaded_dirs = []
        while len(self.loaded) > self.keep:
            version, request = self.loaded.pop(0)
            await self.llm.remove_lora(request.lora_int_id)
            self._unloaded_dirs.append(Path(request.lora_path))

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    # ---- generation -------------------------------------------------------------------------
    async def generate(self, prompt: dict[str, Any], params: Any, request_id: str,
                       on_tokens: Callable[[int], None] | None) -> tuple[list[int], list[float], str, list[int]]:
        """Sample one response under the current adapter, continuing under a newer one when it
        arrives mid-request. Returns (token ids, logprobs, finish reason, version per token)."""
        base_ids = list(prompt["prompt_token_ids"])
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        segment = 0
        while True:
            version, lora = self.version, self.current
            seg_params = params.clone()
            seg_params.max_tokens = params.max_tokens - len(tokens)
            if params.seed is not None and segment:
                seg_params.seed = params.seed + len(tokens)  # a fresh, still reproducible stream
            seg_prompt = dict(prompt, prompt_token_ids=base_ids + tokens, cache_salt=f"v{version}")
            rid = f"{request_id}-s{segment}" if segment else request_id
            finish, switched = "abort", False
            stream = self.llm.generate(seg_prompt, seg_params, rid, lora_request=lora)
            try:
                async for out in stream:
                    chunk = out.outputs[0]
                    new = list(chunk.token_ids)
                    logprobs.extend(float(chunk.logprobs[i][t].logprob) for i, t in enumerate(new))
                    tokens.extend(new)
                    versions.extend([version] * len(new))
                    if on_tokens is not None and new:
                        on_tokens(len(tokens))
                    if chunk.finish_reason is not None:
                        finish = str(chunk.finish_reason)
                        break
                    if self.version != version:  # a newer adapter: continue under it
                        switched = True
                        break
            finally:
                await stream.aclose()  # vLLM aborts a request whose stream is closed early
            if not switched:
                return tokens, logprobs, finish, versions
            segment += 1


def adapter_root(engine_id: str, base: str | None = None) -> Path:
    """A fresh directory for this process's adapters, `asyncrl-lora-<engine>-<pid>` under /dev/shm.
    Directories of the same engine whose process is gone (killed before `close`, e.g. SIGKILL or
    the OOM killer) are removed first, so a restarted actor does not leak memory-backed files."""
    import psutil

    base_dir = Path(base or fast_local_dir())
    stem = f"asyncrl-lora-{engine_id.replace('/', '_')}-"
    for old in base_dir.glob(f"{stem}*"):
        pid = old.name.removeprefix(stem)
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    root = base_dir / f"{stem}{os.getpid()}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    return root


def _readback_mismatches(path: Path, tensors: list[tuple[str, torch.Tensor]]) -> list[str]:
    """Names whose sampled elements in the written adapter file differ from what arrived."""
    on_disk = read_adapter_tensors(path)
    arrived = {n: fingerprint_of(sample_values(n, t)) for n, t in tensors}
    written = {n: fingerprint_of(sample_values(n, t)) for n, t in on_disk.items()}
    return fingerprint_mismatches(arrived, written)
