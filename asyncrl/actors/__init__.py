"""Rollout side: the guided multi-turn protocol, the vLLM engine wrapper (`engine`) with its worker
extension that loads broadcast weights (`worker_extension`), and the `RolloutActor` that turns
prompts into guided groups. Weights arrive through `asyncrl.weights`; this package never imports
`asyncrl.learner`."""
