"""The driver's room: what runs a job, and nothing a role imports.

- `runtime`: `run(cfg)` — the run directory, Ray, the pre-flight checks, the topology, the loop, the end.
- `topology`: `build_topology` starts every component in dependency order (`plan` runs the steps);
  `Topology` holds them and stops them in reverse order.
- `loop`: the training loop (`Trainer`): learner steps, weight rounds, evaluation, checkpoints, ctl commands.
- `recovery`: a stateful component that died is rebuilt without losing a group or a prompt.
- `checkpoint`: a whole-job checkpoint (learner, buffer snapshot, data cursor) and its resume.
- `commands`: `python -m asyncrl.ctl`'s commands as the loop carries them out.
- `coordinator`: the named control-plane actor (the prompt cursor, admission, the version, ctl's mailbox).
- `step_metrics`, `status`: what a step reports, and the status `ctl status` reads.
"""
