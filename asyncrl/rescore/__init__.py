"""Re-scoring a finished run's conversations with other verifiers, without the policy
(`python -m asyncrl.rescore RUN_DIR --verifier A --verifier B`, docs/rescore.md).

- `turns.py` reads the policy turns a run stored (`samples/train_*.json`: trained trajectories;
  `samples/eval_*.json`: guided evaluation transcripts) into `ReplayTurn`s: one verifier request
  each, as the run sent it (the problem, the reference answer when the run showed it, the policy
  turns so far), with the run's own reply, its step label and STOP decision, and the task's
  ground-truth step label where the task has a checker.
- `tables.py` folds the replies of one verifier into its table: step-label agreement with the
  run's verifier and with the ground truth, `[SCORE]` parse rate, STOP decisions, tokens, latency,
  failures.
- `__main__.py` is the entry point: it deploys each verifier (a config file, through Ray Serve) or
  reaches it (an OpenAI-compatible URL), replays every turn with a progress bar, appends each reply
  to `rescore/<name>/replies.jsonl` as it comes (a rerun skips what is there: resumable) and writes
  `table.md` / `table.json`.

Guarantees: the policy is never loaded; a verifier that cannot be reached or fails is named and
its failed requests counted (they are retried by the next run); bad input (a run directory without
conversations, a verifier spec that names nothing) exits 2 naming it before anything starts.
"""
