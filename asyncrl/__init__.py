"""asyncrl: asynchronous actor-learner RL from verifiable rewards, the Guided-GRPO way.

Rollout actors (vLLM) produce guided multi-turn groups, a ZeroMQ replay buffer bounds their
staleness, and a DeepSpeed learner trains on them and broadcasts weights back. docs/architecture.md
has the picture; each package's docstring states its contracts.
Importing this package imports nothing heavy (no torch, ray or vllm). It does put the
interpreter's bin directory first on PATH when that directory holds `ninja` (a venv with the
ninja wheel), so that every process of a job, and every process they start, builds and reuses
DeepSpeed's just-in-time ops with one ninja (asyncrl/learner/ops.py says why).
"""

from asyncrl.learner.ops import pin_toolchain as _pin_toolchain

__version__ = "0.1.0"

_pin_toolchain()
