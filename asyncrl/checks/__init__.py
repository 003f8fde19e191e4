"""What is checked before a job starts, in one vocabulary: each check returns `Row`s (ok / warn /
refuse, naming the key, file or host at fault).

- `preflight`: the checks of a config against its model files, data and this machine (run by the
  launcher before Ray starts, and by `python -m asyncrl.doctor`).
- `models`: reading a model directory's config (context length, weight bytes) without loading it.
- `doctor`: `python -m asyncrl.doctor`'s report, which adds the probes of every node of a cluster.
"""
