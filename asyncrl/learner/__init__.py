"""Learner side: advantage estimators, policy losses with off-policy correction, KL, batching, the
rank's builders (`build`) and training step (`learner`), the Ray `LearnerGroup`, VL inputs and
checkpoints. Weights leave through `asyncrl.weights` (the sender lives there, shared with the
actors' receivers); this package never imports `asyncrl.actors`."""
