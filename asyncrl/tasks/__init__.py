"""Built-in tasks with rule verifiers (the offline quick-start world `arith`)."""
