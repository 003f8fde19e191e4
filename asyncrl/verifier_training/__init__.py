"""Making a guided verifier: Stage 1, data synthesis (synth.py, rows.py), and Stage 2, verifier
SFT (sft.py). Stage 3, guided RL with the result, is the ordinary training job with
`verifier.backend: vllm` (configs/quickstart_learned_verifier.yaml). docs/guided_method.md."""
