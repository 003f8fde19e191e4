"""asyncrl: asynchronous actor-learner RL from verifiable rewards, the Guided-GRPO way.

Rollout actors (vLLM) produce guided multi-turn groups, a ZeroMQ replay buffer bounds their
staleness, and a DeepSpeed learner trains on them and broadcasts weights back. README.md
(Architecture) has the picture; each package's docstring states its contracts.
Importing this package imports nothing heavy (no torch, ray or vllm).
"""

__version__ = "0.1.0"
