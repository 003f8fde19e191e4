"""Rollout side: the guided multi-turn protocol, the vLLM engine wrapper with its weight receiver,
and the `RolloutActor` that turns prompts into guided groups."""
