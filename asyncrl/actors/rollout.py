"""`RolloutActor`: one vLLM engine turning prompts into guided groups, forever.

Loop: admission ticket from the buffer → a prompt from the coordinator → the `n`
guided conversations of the group, concurrently (asyncrl.actors.guided; verifier through the
service client) → rewards (off the event loop) → training samples for the configured
`train_scope` → push the group (acknowledged by the buffer; the pushes of concurrent groups are
pipelined through a `replay.PushWindow` of `buffer.push_window`) → mark the prompt done.
Up to `rollout.groups_in_flight` groups run at once, so the engine batches across groups.

Guarantees
- A group that was acknowledged by the buffer is never lost by this actor; a group that is not
  finished when the actor stops is abandoned: its ticket is released and its prompt is re-issued by
  the coordinator (so a restart loses nothing and repeats nothing that reached the buffer).
- Every policy token carries the engine version that sampled it. Weight updates arrive while
  conversations run (`in_flight`): the next turn uses the new weights, so one trajectory can span
  versions, which the per-token versions record. With `between_groups` the actor stops starting
  groups, lets the running ones finish, then loads the newest weights from the weight store.
- A restarted actor (Ray `max_restarts`) loads the newest published weights before it generates.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asyncrl.config import Config, rollout_cpu_nice
from asyncrl.small_machine.process import renice, renice_children

log = logging.getLogger("asyncrl.rollout")
BUSY_STATE_S = 0.5  # how often a loop with every group slot busy asks the coordinator whether to stop


class RolloutWorker:
    """The actor's logic as a plain class (wrapped by `make_rollout_actor_class` for Ray)."""

    def __init__(self, cfg_json: str, actor_id: str, buffer_address: str, namespace: str,
                 buffer: Any = None):
        """`buffer_address` "" = not known at launch (the topology launches the fleet before the
        replay buffer listens, so the engine builds meanwhile): the actor asks `buffer` (the
        BufferHost actor) for it once its engine is up."""
        from asyncrl.logs import redirect_output

        redirect_output(actor_id)  # vLLM and its engine processes write to <run_dir>/logs/<actor_id>.log
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        self.cfg = Config.model_validate_json(cfg_json)
        # the engine's weight receivers sign their (re)join requests with the job's secret; its
        # processes inherit it from here (asyncrl.weights.receiver.SECRET_ENV), never from a file
        os.environ["ASYNCRL_WEIGHTS_SECRET"] = self.cfg.learner.weights.secret
        self.actor_id = actor_id
        self.buffer_address = buffer_address
        self.buffer_host = buffer
        self.namespace = namespace
        self.engine: Any = None
        self.vl: Any = None  # group.VLContext for a vision-language policy (set by start)
        self.pushes: Any = None  # replay.PushWindow (set by start)
        self._zmq = ThreadPoolExecutor(max_workers=1, thread_name_prefix="buffer")  # zmq sockets: one thread
        self._running = False
        self._drain_s = 30.0  # how long a stopped loop lets its groups in flight finish
        self._tasks: set[asyncio.Task] = set()
        self._paused_for_weights = False
        self._requests = 0
        # statistics since the last report
        self._stats = Counter()
        self._finish = Counter()
        self._turns: deque[float] = deque(maxlen=512)
        self._resp_len: deque[float] = deque(maxlen=512)
        self._rewards: deque[float] = deque(maxlen=512)
        self._unique: deque[float] = deque(maxlen=128)
        self._idle_s = 0.0
        self._t_report = time.time()
        self._policy_tokens = 0
        self._weight_update_s = 0.0

    # ---------------------------------------------------------------- start-up
    async def start(self) -> dict[str, Any]:
        """Build the engine (from `model.path`, i.e. version 0), the verifier client and the reward
        function; a restarted or late actor then loads the newest published weights. A failure is
        one line for the driver, its traceback in this actor's log (asyncrl.startup.starting)."""
        from asyncrl.startup import starting

        with starting(f"rollout actor {self.actor_id}"):
            return await self._start()

    async def _start(self) -> dict[str, Any]:
        from asyncrl.small_machine.process import gc_paused

        with gc_paused():  # transformers' import and the tokenizer's (the engine's: in PolicyEngine)
            import ray
            from transformers import AutoTokenizer

            from asyncrl.actors.engine import EngineSpec, PolicyEngine
            from asyncrl.actors.guided import PolicyChat
            from asyncrl.replay.client import BufferClient
            from asyncrl.replay.window import PushWindow
            from asyncrl.rewards import load_reward
            from asyncrl.rewards.guard import RewardGuard
            from asyncrl.serve.client import VerifierClient

        t0 = time.time()
        cfg = self.cfg
        if self.engine is not None:  # start() again on a live actor (after a failed loop)
            self.engine.shutdown()
        _kill_orphans(self._pid_file())  # engine processes left by a previous incarnation (SIGKILL/OOM)
        with gc_paused(cfg.cluster.small_machine):
            self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
        self.chat = PolicyChat(self.tokenizer)
        self.vl = self._vl_context()
        self.verifier = VerifierClient(cfg.verifier, app_name="verifier") if cfg.rollout.guide.enable else None
        loop = asyncio.get_running_loop()
        # Serve's import and the handle's router in a thread while the engine core builds, started
        # after its fork (not awaited: a verifier still deploying is looked up at the first turn)
        prepare = (lambda: loop.run_in_executor(None, self.verifier.prepare)) if self.verifier is not None else None
        self.engine = PolicyEngine(EngineSpec.from_job(cfg, self.actor_id, vl=self.vl is not None),
                                   beside_build=prepare)
        _record_children(self._pid_file())
        from asyncrl.reaper import procs_dir, record

        record(procs_dir(cfg.run_path), f"rollout actor {self.actor_id}")  # the launcher ends them at the job's end
        # The engine is built at Ray's niceness: it is what the first step waits for (at 19 it got
        # ~30 % of a core against the learner's start, at 15 like the learner). Generating, it
        # yields to the learner, the job's critical path from now on (`rollout.cpu_nice`).
        nice = rollout_cpu_nice(cfg.rollout.gpus_per_actor, cfg.rollout.cpu_nice) if cfg.cluster.small_machine \
            else cfg.rollout.cpu_nice
        renice(nice)
        renice_children(nice)
        self.reward_fn = RewardGuard(load_reward(cfg.reward), cfg.reward.call_timeout_s,
                                     cfg.reward.max_consecutive_failures)
        # the job's services, which may have started while the engine was being built
        self.coordinator = await _named_actor("coordinator", self.namespace, cfg.cluster.startup_timeout_s)
        if not self.buffer_address:
            self.buffer_address = await self.buffer_host.start.remote()  # idempotent: its address
        self.buffer = BufferClient(self.buffer_address, cfg.buffer.curve if cfg.buffer.curve.enable else None,
                                   secret=cfg.buffer.secret if cfg.buffer.auth else None, actor_id=self.actor_id)
        if self.pushes is not None:
            self.pushes.close()
        # pushes of concurrent groups overlap on the wire; each group still awaits its own ack
        self.pushes = PushWindow(self.buffer, cfg.buffer.push_window)
        state = await self.coordinator.get_state.remote()
        if state["version"] > 0:  # restarted or late joiner: newest weights before generating
            await self.engine.load_weights_from_store(min_version=0)

        return {"actor_id": self.actor_id, "start_s": time.time() - t0, "version": self.engine.version,
                "host": ray.util.get_node_ip_address(), "engine_core": self.engine.engine_core_start}

    def _vl_context(self) -> Any:
        """A `VLContext` for a Qwen-VL policy (processor chat, placeholder ban, image token id), else
        None. VL conversations need rollout.guide.history=full (processor-made prompt ids)."""
        from transformers import AutoConfig

        from asyncrl.vision import is_vl_config

        cfg = self.cfg
        hf_config = AutoConfig.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
        if not is_vl_config(hf_config):
            return None
        from transformers import AutoProcessor

        from asyncrl.actors.group import VLContext
        from asyncrl.actors.guided import PolicyChat
        from asyncrl.vision import vision_logit_bias

        if cfg.rollout.guide.history != "full":
            raise ValueError("a vision-language policy needs rollout.guide.history=full")
        processor = AutoProcessor.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
        self.chat = PolicyChat(processor)
        return VLContext(processor, vision_logit_bias(hf_config), int(hf_config.image_token_id))

    # ---------------------------------------------------------------- main loop
    async def run(self) -> dict[str, Any]:
        """Produce groups until the coordinator says stop; returns final counters."""
        self._running = True
        limit = self.cfg.rollout.groups_in_flight
        asked_at = -float("inf")  # when the coordinator's state was last asked for
        while self._running:
            busy = len(self._tasks) >= limit  # every group slot is generating (not idle)
            # While busy, the state is only needed to notice a stop: asked for every BUSY_STATE_S, not on
            # every 50 ms pass (`RolloutWorker.stop` ends the loop at once either way).
            if not busy or time.monotonic() - asked_at >= BUSY_STATE_S:
                state = await self.coordinator.get_state.remote()
                asked_at = time.monotonic()
                if state["stopping"]:
                    break
            if busy:  # until a slot frees (then at once) or 50 ms
                await asyncio.wait(set(self._tasks), timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
                continue
            if self._paused_for_weights or not state["admitting"]:
                await self._idle(0.05)
                continue
            t_wait = time.time()
            ticket = await asyncio.get_running_loop().run_in_executor(
                self._zmq, lambda: self.buffer.acquire_ticket(timeout_s=1.0))
            if ticket is None:
                self._idle_s += time.time() - t_wait
                continue
            self._requests += 1  # request id: a call retried across a coordinator restart is answered once
            prompt = await self.coordinator.next_prompt.remote(self.actor_id, f"{os.getpid()}-{self._requests}")
            if prompt is None:
                await self._zmq_call(self.buffer.release_ticket, ticket)
                await self._idle(0.1)
                continue
            self._idle_s += time.time() - t_wait
            task = asyncio.create_task(self._group(prompt, ticket))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        await self._drain(self._drain_s)
        return dict(self._stats)

    async def _idle(self, seconds: float) -> None:
        t = time.time()
        await asyncio.sleep(seconds)
        self._idle_s += time.time() - t

    async def _zmq_call(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self._zmq, lambda: fn(*args, **kwargs))

    async def _drain(self, timeout_s: float = 30.0) -> None:
        if not self._tasks:
            return
        done, pending = await asyncio.wait(set(self._tasks), timeout=timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    def stop(self, abandon_in_flight: bool = False) -> None:
        """End the loop. Its groups in flight finish first (up to 30 s), or with `abandon_in_flight`
        are cancelled at once: each releases its admission ticket and the coordinator re-issues its
        prompt (the job's end: nothing would train them)."""
        self._drain_s = 0.0 if abandon_in_flight else 30.0
        self._running = False

    # ---------------------------------------------------------------- one group
    async def _group(self, prompt: dict[str, Any], ticket: int) -> None:
        from asyncrl.actors.group import build_group
        from asyncrl.actors.guided import GroupDropped
        from asyncrl.rewards.guard import RewardCallError

        pushed = False
        vp = None
        try:
            if self.vl is not None:
                from asyncrl.actors.group import PromptTooLong, prepare_vl_prompt

                try:
                    vp = await asyncio.to_thread(prepare_vl_prompt, self.cfg, prompt, self.vl)
                except PromptTooLong:  # would fail on every re-issue: complete it and count it
                    log.warning("dropping prompt %s: too long with its images expanded", prompt.get("uid"))
                    self._stats["prompts_dropped_too_long"] += 1
                    pushed = await self._complete_untrained(prompt, ticket)  # nothing to abandon
                    return
            try:
                convs = await self._conversations(prompt, vp)
            except GroupDropped:  # on_error=drop_group: deliberately discarded, counted, prompt done
                self._stats["groups_dropped_verifier_error"] += 1
                pushed = await self._complete_untrained(prompt, ticket)  # nothing to abandon
                return
            ended = sum(1 for c in convs if c.finish_reason == "verifier_error")
            if ended:  # still the verifier's failure after the re-runs: never trained as the policy's failure
                self._note_reissued(prompt, convs, ended)
                return  # finally: its ticket is released and the coordinator issues the prompt again
            group = await build_group(self.cfg, prompt, convs, self.reward_fn, self.tokenizer,
                                         actor_id=self.actor_id, verifier=self.verifier,
                                         **({"vp": vp} if vp is not None else {}))
            self._account(group, convs)
            await asyncio.wrap_future(self.pushes.submit(group, ticket))
            pushed = True
            self._stats["groups_pushed"] += 1
            await self.coordinator.complete.remote(prompt["index"])
        except asyncio.CancelledError:
            raise
        except RewardCallError as exc:  # once per kind, in this actor's log: the job says it on the console
            if getattr(exc, "first_of_kind", True):  # (asyncrl.failure_watch, from health()); the guard counts
                log.info("group for prompt %s: %s (later failures of this kind are counted, not logged)",
                          prompt.get("uid"), exc, exc_info=exc)
            self._stats["groups_failed"] += 1
        except Exception:  # a failed group must not kill the actor: count, log, re-issue its prompt
            log.exception("group for prompt %s failed", prompt.get("uid"))
            self._stats["groups_failed"] += 1
        finally:
            if not pushed:
                try:
                    await self._zmq_call(self.buffer.release_ticket, ticket)
                except Exception:  # noqa: BLE001 - best effort; the buffer's ticket lease also expires
                    log.warning("could not release ticket %s", ticket)
                await self.coordinator.abandon.remote(prompt["index"])

    async def _conversations(self, prompt: dict[str, Any], vp: Any) -> list[Any]:
        """The group's conversations. Those a verifier failure ended are the verifier's failure, never
        the policy's: run again (fresh seeds, same slots) up to verifier.error_reruns times; any still
        ended so are the caller's to re-issue. `GroupDropped` (on_error=drop_group) passes through."""
        from asyncrl.actors.group import run_guided_group

        async def run(cfg: Config, n: int | None = None) -> list[Any]:
            extra = {"vp": vp, "vl": self.vl} if vp is not None else {}
            return await run_guided_group(cfg, prompt, self.engine, self.verifier, chat=self.chat, training=True,
                                          n=n, **extra)

        convs = await run(self.cfg)
        self._count_conversations(convs)
        for attempt in range(1, self.cfg.verifier.error_reruns + 1):
            failed = [i for i, c in enumerate(convs) if c.finish_reason == "verifier_error"]
            if not failed:
                break
            self._stats["conversations_rerun_verifier_error"] += len(failed)
            again = await run(_reseeded(self.cfg, attempt), n=len(failed))
            self._count_conversations(again)
            for i, conv in zip(failed, again):
                conv.uid = f"{prompt.get('uid', '')}/{i}"
                convs[i] = conv
        return convs

    async def _complete_untrained(self, prompt: dict[str, Any], ticket: int) -> bool:
        """A prompt done without a group (dropped on purpose): its ticket back, the coordinator told
        it is complete (not re-issued). True: nothing left to abandon."""
        await self._zmq_call(self.buffer.release_ticket, ticket)
        await self.coordinator.complete.remote(prompt["index"])
        return True

    def _note_reissued(self, prompt: dict[str, Any], convs: list[Any], ended: int) -> None:
        """Count a group re-issued for verifier errors; the first one is logged with its error."""
        self._stats["groups_reissued_verifier_error"] += 1
        if self._stats["groups_reissued_verifier_error"] == 1:
            log.info("group for prompt %s: %d conversation(s) ended by a verifier error (%s) after %d "
                     "re-run(s); the group is re-issued, not trained (later ones are counted: "
                     "rollout/groups_reissued_verifier_error)", prompt.get("uid"), ended,
                     next(c.turns[-1].verifier_error for c in convs if c.finish_reason == "verifier_error"),
                     self.cfg.verifier.error_reruns)

    def _count_conversations(self, convs: list[Any]) -> None:
        self._stats["conversations_done"] += len(convs)
        self._stats["conversations_verifier_error"] += sum(1 for c in convs if c.finish_reason == "verifier_error")

    def _account(self, group: Any, convs: list[Any]) -> None:
        texts = set()
        for sample in group.samples:
            self._turns.append(sample.num_turns)
            self._finish[sample.finish_reason] += 1
            self._rewards.append(sample.reward)
            n_policy = int(sample.response_mask.sum())
            self._resp_len.append(n_policy)
            self._policy_tokens += n_policy
            texts.add(bytes(sample.response_ids.tobytes()))
        if group.samples:
            self._unique.append(len(texts) / len(group.samples))

    # ---------------------------------------------------------------- weights
    def weight_members(self) -> list[str]:
        """This engine's member ids in the weight group (one per tensor-parallel rank)."""
        return self.engine.weight_member_ids(self.actor_id)

    async def receive_weights(self, address: str) -> dict[str, Any]:
        """Take part in the learner's broadcast (sender at `address`). A member that was dropped
        (watchdog) or is new gets "not_member": it catches up from the weight store instead and is
        in the group from the next broadcast on."""
        t0 = time.time()
        if self.cfg.rollout.weight_update_mode == "between_groups" and self._tasks:
            asyncio.create_task(self.catch_up())  # safe point: after the running groups
            return {"actor_id": self.actor_id, "status": "deferred"}
        report = await self.engine.update_weights_from_group(address, member_prefix=self.actor_id)
        if report.get("status") != "ok":
            report["catch_up"] = await self.engine.load_weights_from_store()
        self._weight_update_s += time.time() - t0
        mismatch = int(report.get("fingerprint_mismatch") or 0) + int((report.get("catch_up") or {}).get(
            "fingerprint_mismatch") or 0)
        return {"actor_id": self.actor_id, "version": self.engine.version, "seconds": time.time() - t0,
                "status": report.get("status"), "catch_up": report.get("catch_up"), "fingerprint_mismatch": mismatch,
                "phases": report.get("phases"), "engine_phases": report.get("engine_phases")}

    async def catch_up(self) -> dict[str, Any]:
        """Load the newest weights from the store (between_groups, dropped members, late joiners)."""
        t0 = time.time()
        if self.cfg.rollout.weight_update_mode == "between_groups":
            self._paused_for_weights = True
            await self._drain(timeout_s=600)
        try:
            report = await self.engine.load_weights_from_store()
        finally:
            self._paused_for_weights = False
        self._weight_update_s += time.time() - t0
        return {"actor_id": self.actor_id, "version": self.engine.version, "seconds": time.time() - t0, **report}

    def version(self) -> int:
        return self.engine.version if self.engine is not None else -1

    # ---------------------------------------------------------------- evaluation and stats
    async def evaluate(self, rows: list[dict[str, Any]], mode: str = "both", keep_conversations: int = 0) -> dict[str, Any]:
        """Greedy evaluation with this actor's engine (current weights): `{mode: summary}` in one
        layout for every back-end (asyncrl.eval.merge_shards merges the actors' answers). With the
        rule back-end this is exactly `python -m asyncrl.eval` (asyncrl.eval.evaluate_async, each mode
        with the transcripts of its first `keep_conversations` rows); otherwise, and for VL prompts,
        the guided protocol runs against the verifier service (asyncrl.actors.group.evaluate_rows)."""
        if self.vl is None and self.cfg.verifier.backend == "rule":
            from asyncrl.actors.group import make_generate
            from asyncrl.actors.guided.evaluation import evaluate_async

            generate = make_generate(self.cfg, self.engine, overrides=dict(self.cfg.rollout.val_override_config))
            modes = ["guided", "solver"] if mode == "both" else [mode]
            out = {}
            for m in modes:
                t0 = time.time()
                out[m] = await evaluate_async(generate, self.tokenizer, rows, m, task=self.cfg.verifier.task,
                                              max_turns=self.cfg.rollout.guide.max_turns,
                                              max_prompt_length=self.cfg.data.max_prompt_length,
                                              keep_conversations=keep_conversations)
                out[m]["wall_s"] = time.time() - t0
            return out
        from asyncrl.actors.group import evaluate_rows

        if self.vl is not None:  # raw data rows -> stream items (messages with image items, images, row) as in training
            from asyncrl.data import make_item

            rows = [make_item(rows, i, self.cfg.data, i, "eval").to_dict() for i in range(len(rows))]
        return await evaluate_rows(self.cfg, rows, self.engine, self.verifier, chat=self.chat, mode=mode, vl=self.vl)

    async def synthesize(self, items: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
        """Verifier SFT synthesis (asyncrl.verifier_training.synth): `n` training-mode conversations
        per stream item against the job's verifier service (the teacher), each as a plain record
        with every verifier request and reply (`guided.conversation.conversation_record`).
        Nothing is scored or pushed; the coordinator and the buffer are not involved."""
        from asyncrl.actors.group import run_guided_group
        from asyncrl.actors.guided import GroupDropped
        from asyncrl.actors.guided.conversation import conversation_record

        async def one(item: dict[str, Any]) -> list[dict[str, Any]]:
            try:
                convs = await run_guided_group(self.cfg, item, self.engine, self.verifier, chat=self.chat,
                                               training=True, n=n)
            except GroupDropped as exc:  # on_error=drop_group: its conversations are still reported
                convs = exc.conversations
            return [conversation_record(c, i) for i, c in enumerate(convs)]

        groups = await asyncio.gather(*(one(it) for it in items))
        return [rec for g in groups for rec in g]

    def stats(self) -> dict[str, Any]:
        """Rollout metrics since the previous call (rates) and over recent groups (means)."""
        now = time.time()
        dt = max(now - self._t_report, 1e-6)
        mean = (lambda xs: sum(xs) / len(xs) if xs else 0.0)  # noqa: E731
        out = {
            "rollout/tokens_per_s": self._policy_tokens / dt,
            "rollout/groups_per_s": self._stats["groups_pushed"] / dt,
            "rollout/turns_mean": mean(self._turns),
            "rollout/response_len_mean": mean(self._resp_len),
            "rollout/reward_mean": mean(self._rewards),
            "rollout/idle_ratio": min(1.0, self._idle_s / dt),
            "rollout/weight_update_s": self._weight_update_s,
            "rollout/group_unique_frac": mean(self._unique),
            "rollout/groups_in_flight": len(self._tasks),
            "rollout/version": self.version(),
            "rollout/groups_pushed": self._stats["groups_pushed"],
            "rollout/groups_failed": self._stats["groups_failed"],
            "rollout/groups_dropped_verifier_error": self._stats["groups_dropped_verifier_error"],
            "rollout/groups_reissued_verifier_error": self._stats["groups_reissued_verifier_error"],
            "rollout/conversations_rerun_verifier_error": self._stats["conversations_rerun_verifier_error"],
            # conversations ended by the verifier's failure, of those that ended (since the last report)
            "verifier/conversation_error_rate": (self._stats["conversations_verifier_error"]
                                                 / max(self._stats["conversations_done"], 1)),
            "rollout/policy_tokens": self._policy_tokens,
        }
        if self.vl is not None:
            out["rollout/prompts_dropped_too_long"] = self._stats["prompts_dropped_too_long"]
        total = sum(self._finish.values()) or 1
        for reason, count in self._finish.items():
            out[f"rollout/finish_reason/{reason}"] = count / total
        if self.verifier is not None:
            out.update(self.verifier.metrics(reset=True))
        self._stats["groups_pushed"] = 0
        self._stats["conversations_done"] = self._stats["conversations_verifier_error"] = 0
        self._policy_tokens = 0
        self._idle_s = 0.0
        self._weight_update_s = 0.0
        self._t_report = now
        return out

    def pid(self) -> int:
        return os.getpid()

    def health(self) -> dict[str, Any]:
        """Cumulative failure counters the job watches while it waits for batches
        (asyncrl.failure_watch): the reward guard's report and the verifier client's calls."""
        guard = getattr(self, "reward_fn", None)
        out: dict[str, Any] = {"reward": guard.report() if hasattr(guard, "report") else None,
                               "groups_reissued_verifier_error": self._stats["groups_reissued_verifier_error"]}
        if getattr(self, "verifier", None) is not None:
            out["verifier"] = self.verifier.health()
        return out

    def _pid_file(self) -> str:
        import tempfile

        return os.path.join(tempfile.gettempdir(), f"asyncrl-{self.namespace}-{self.actor_id}.pids")

    async def shutdown(self) -> None:
        self._running = False
        await self._drain(timeout_s=5)
        if self.engine is not None:
            self.engine.shutdown()
        if self.pushes is not None:
            self.pushes.close()
        self._zmq.shutdown(wait=False)


async def _named_actor(name: str, namespace: str, timeout_s: float) -> Any:
    """A named actor of the job, waited for: the driver creates the coordinator while the engines
    build (after the training rows are loaded), so an engine that is up first asks again."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get_actor(name, namespace=namespace)
        except ValueError:  # not created yet
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


def _reseeded(cfg: Config, attempt: int) -> Config:
    """`cfg` with another rollout seed, so re-run conversations do not repeat the group's samples."""
    return cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"seed": cfg.rollout.seed + 7919 * attempt})})


def _record_children(path: str) -> None:
    """Remember this actor's engine processes: vLLM's engine core outlives an actor killed with
    SIGKILL (OOM killer, chaos), so the next incarnation must be able to reap it."""
    import psutil

    pids = [p.pid for p in psutil.Process().children(recursive=True)]
    with open(path, "w") as f:
        f.write("\n".join(map(str, pids)))


def _kill_orphans(path: str) -> int:
    import psutil

    if not os.path.exists(path):
        return 0
    killed = 0
    for line in open(path).read().split():
        try:
            proc = psutil.Process(int(line))
            if proc.ppid() in (0, 1) or not psutil.pid_exists(proc.ppid()):
                proc.kill()
                killed += 1
        except (psutil.NoSuchProcess, ValueError):
            continue
    os.unlink(path)
    if killed:
        log.warning("reaped %d orphaned engine process(es) of a previous incarnation", killed)
    return killed


def make_rollout_actor_class(cfg: Config):
    """The Ray actor class with the role's resources (fractional CPUs on a CPU machine)."""
    import ray

    r = cfg.rollout
    return ray.remote(
        num_cpus=r.cpus_per_actor,
        num_gpus=r.gpus_per_actor,
        max_restarts=r.max_restarts,
        max_task_retries=0,
        max_concurrency=1000,
    )(RolloutWorker)
