"""Tuning for a small machine (a few cores shared by every process of a job, no GPU), behind one
switch: `cluster.small_machine` (None = derived: on when the job uses no GPU; the CPU quick starts
set it). A GPU reader never meets any of it:

- `patches.lean_head`: the embedded Ray head starts without its idle daemons;
- `asyncrl.engine_setup.engine_core_forked`: vLLM's engine core forked from its builder, not spawned;
- `process.gc_paused`: heavy imports without the cyclic garbage collector;
- `process.renice` / `yield_while_building` / `raise_priority`: the learner, the job's critical
  path, scheduled before the rollout engines.

Every use of a dependency's private internals, small-machine or not, is in `patches` (one function
per patch, each naming the version it was checked against).
"""
