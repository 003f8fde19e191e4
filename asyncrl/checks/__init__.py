"""What is checked before a job starts, in one vocabulary: each check returns `Row`s (ok / warn /
refuse, naming the key, file or host at fault).

- `preflight`: the checks of a config against its model files, data and this machine (run by the
  launcher before Ray starts, and by `python -m asyncrl.doctor`).
- `models`: reading a model directory's config (context length, vision type, chat template) without
  loading it.
- `fit`: the memory and disk rows (does the job fit this machine and its run directory).
- `rows`: `Row`, the one type every check returns.
- `doctor`: `python -m asyncrl.doctor`'s report, which adds the probes of every node of a cluster.
"""
