"""Learner side: advantage estimators, policy losses with off-policy correction, the DeepSpeed
`Learner`, the bucketed weight sender and checkpoints."""
