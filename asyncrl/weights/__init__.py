"""The weight wire between learner rank 0 and the rollout engines: a neutral package that both
`asyncrl.learner` (the sender) and `asyncrl.actors` (the receivers) import; it imports neither.

Layout (one job per module):
- `wire`: buckets, manifests, dtype names and the integrity fingerprint (pure torch, no I/O);
- `group`: the rendezvous TCPStore, the weight process groups, bounded waits and aborts, NCCL error handling;
- `nccl_env`: the job's one NCCL_CUMEM_ENABLE and the members' check of it (no torch: the launcher reads it);
- `sender`: `WeightSender`, rank 0's side of the membership protocol and of every round;
- `receiver`: `WeightReceiver`, one member's side (plain torch; what loads it into a vLLM engine
  lives with the engine, in `asyncrl.actors.worker_extension`: the worker extension, and the
  transfer engine registered in vLLM's factory for `rollout.weight_transfer: native`);
- `store`: the `WeightStore` Ray actor (started explicitly by the topology), publish and fetch;
- `local`: `LocalFeed`, the loopback path a process uses to load a store copy (or any named
  tensors) into its own engine workers over the same wire.

Wire format (`wire`, shared by `sender` and `receiver`): the named tensors are packed into
flat per-dtype buckets of about `bucket_mb`; each bucket travels as ONE collective
(`broadcast`, root = learner rank 0), never one per parameter. Its manifest
(`{"dtype", "numel", "params": [[name, shape, offset], ...]}`) and the version travel through the
rendezvous TCPStore as JSON, so NCCL and gloo groups carry only tensor bytes and no pickle is on
the path.

Membership protocol (all keys in the sender's TCPStore, which is also the rendezvous):
- generation g: the sender writes `g{g}/plan` (members -> ranks 1..n, backend), sets `gen = g`;
  each member sets `g{g}/ready/{id}`; members missing after `timeout_s` are dropped, the
  generation is aborted (`g{g}/built = abort`) and g+1 is planned without them; otherwise
  `built = go` and everyone builds the process group `PrefixStore("asyncrl_w/g{g}")`.
- round r of generation g: each member sets `g{g}/r{r}/enter/{id}` when it is ready to receive;
  members that have not entered within `timeout_s` are dropped, the round is aborted and the group
  rebuilt for the rest. Then `start = go`, the buckets flow, every member acks `g{g}/r{r}/ack/{id}`.
- every collective has a deadline the sender and the receivers enforce themselves (`wait_work`
  polls `work.is_completed()`, so it holds on NCCL, whose `wait()` does not block, as on gloo).
  Receivers heartbeat (`.../alive/{id}`) while they wait inside a round and write
  `.../progress/{id}` only once a bucket's data has arrived. When a collective fails or passes its
  deadline the sender retires the group without blocking (`abort_group`), drops the members that
  fell silent within a short grace (else the lowest progress), sets `.../abort` and the end header
  (`failed`), and rebuilds the group without them at the next broadcast; the dropped member's
  process, or its restart under the same id, sees `g{g}/out/{id}` and re-feeds from the store.
- NCCL: the group is built with TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (a timeout aborts the
  communicator, never the process) and a backstop timeout later than every deadline above; it is
  built and connected (its first collective, where NCCL creates the communicator) under the
  sender's deadline (`group.connect_group`), members silent there are dropped; NCCL_CUMEM_ENABLE is
  one value for the whole job (`nccl_env.job_nccl_env`, in every process's environment before it
  starts): the sender's value travels in the plan, each member's in its ready key, and a group
  whose members disagree is refused with `NcclEnvMismatch` naming them; `set_device` before the
  sends and the exporter's gathers.
- integrity: the end header carries a fingerprint of every tensor (float64 sum and |sum| of 64
  elements at indices fixed by the tensor's name), so a receiver checks what arrived exactly.
- a dropped member that calls `receive` again asks to rejoin (`joinreq/{n}`); the sender takes it
  back at the next broadcast (a new generation). Scaling uses the same `rebuild(members)`.
Guarantee: no sender call blocks longer than about `timeout_s` per bucket plus a second of
grace whatever the members do; every member that acks a round holds exactly the broadcast
tensors (fingerprint-checked); every `publish_every`-th version is also published (a host copy
taken at broadcast time into one reused host arena, page-locked on a GPU: `store.HostArena`) to
the `WeightStore` named Ray actor for late joiners, restarts and dropped members, by default from
a background thread (`publish_mode`), in version order. The topology publishes version 0 at
start-up, so the store is never empty.

Departure from Guided-GRPO (EasyR1/verl): there the rollout shares the learner's GPUs and weights
move in-process; asyncrl's rollout fleet is separate, so weights move over the network.
"""
