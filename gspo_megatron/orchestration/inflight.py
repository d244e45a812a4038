"""Engines that never drain (``rollout.inflight_updates``; rank 0): in-flight weight updates and
partial rollouts, PipelineRL / slime ``--partial-rollout`` / miles ``--pause-generation-mode``.

The producer keeps up to ``rollout.inflight_groups`` prompt groups generating or waiting (default 2 *
``prompts_per_step``): one worker thread per slot draws a prompt, generates its G samples as one
request (``engines.partial.generate_group``), scores the group and queues it, then draws the next
while the groups generating plus the finished ones not yet taken are fewer than the slots (each step
frees ``prompts_per_step`` of them; generation faster than training then idles slots instead of
generating groups that only grow stale and are dropped). A
step takes the first ``prompts_per_step`` finished groups (in finishing order); groups still
generating stay in the engines (``in_place`` / ``retract``) or continue as resubmitted partial outputs
(``abort``), and finished groups beyond the step's wait for the next step ("carried"). A group is
trained only when all its samples are done. A weight sync never waits for generation: the engines'
clients pause in the mode (``sglang_client.open_weight_update``: ``/pause_generation`` with
``mode``), the weights are loaded, and ``/continue_generation`` lets every request go on.

Per-token versions. Each token carries the weight version that sampled it: sglang 0.5.23 records
``(old_version, len(output_ids))`` on every live request when the version changes
(``scheduler.py`` ``record_weight_version_change``) and reports the spans in
``meta_info.weight_versions`` (``engines.sglang_engine.token_versions``). What the version means:

- ``retract``: running requests go back to the waiting queue without their KV cache and are
  prefilled again over ``prompt + output so far`` under the new weights (the clients flush the radix
  cache around the update). A token of version v was sampled from a plain forward of v's weights
  over the whole prefix: the trainer's forward with v's weights (``trainer.behaviour_policy``)
  reproduces its log-prob. The prefix's tokens keep their own, older versions: they were sampled
  under the old weights, and their behaviour log-probs are the old weights' (the re-prefill changes
  the KV the new tokens attend to, not how the old tokens were drawn).
- ``abort``: the same, by resubmission (``engines/partial.py``).
- ``in_place``: requests keep their KV cache; a token sampled after the update attends to a prefix
  whose keys and values older weights computed, a distribution no single version's forward gives.
  Those tokens (a sample's tokens after its first version change) get ``Sample.engine_behaviour`` 1:
  their behaviour log-prob is the engine's own (the distribution they were drawn from, up to the
  engine/trainer numerical gap), never a version's recomputation. Their engines run without a radix
  cache (``features/inflight.py``).

Staleness (``rollout.max_staleness`` N) applies per token: a sample is as old as its oldest token, and
a finished group whose oldest token is more than N versions behind the trainer is dropped when a step
looks for groups (``rollout/stale_groups_dropped``; the trainer keeps weights of N + 1 versions only).
A group generating through the sync after step s began under version s - 1; if it finishes after
step s + 1 took its groups, it is trained at step s + 2 (trainer version s + 1, age 2): such carried
groups need N >= 2, with N = 1 they are dropped.

Not reproducible run to run (which groups finish first depends on timing), and not resumable to the
sample: a checkpoint keeps the prompt position after the last prompt drawn; prompts generating at the
checkpoint are not trained after a resume.

Metrics (per step, rank 0): the staleness ones of ``async_producer`` (``rollout/staleness_mean`` /
``_max``, ``rollout/trainer_wait_s``, ``rollout/engine_policy_version``), and
``rollout/version_span_max`` / ``_mean`` (a sample's newest minus oldest token version),
``rollout/stale_token_frac`` (tokens older than the trainer's version), ``rollout/engine_behaviour_tokens``,
``rollout/stale_groups_dropped``, ``rollout/carried_groups`` (finished, left for later steps),
``rollout/inflight_groups`` (generating when the step took its batch), ``rollout/engine_busy_frac``
(slot-seconds with a group generating / slot-seconds since the previous step), and
``rollout/resubmitted_samples`` (``abort``: continuations sent).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from gspo_megatron.distill.teachers import distill_metrics
from gspo_megatron.engines.partial import generate_group
from gspo_megatron.engines.sglang_engine import engine_spec_metrics
from gspo_megatron.features.inflight import inflight_slots
from gspo_megatron.orchestration.batch import RolloutBatch, custom_metrics, sampling_params, score_group
from gspo_megatron.sample import Sample
from gspo_megatron.trainer.behaviour_policy import WeightHistory


@dataclass
class _Finished:
    records: list[Sample]
    stats: dict
    resubmitted: int


def first_span(versions: list[str]) -> int:
    """How many leading tokens share the first token's version."""
    n = 0
    while n < len(versions) and versions[n] == versions[0]:
        n += 1
    return n


class InflightProducer:
    """Rank 0's producer of in-flight generation (module docstring). Has the interface the
    ``async_producer.Overlap`` drives: ``take``, ``hold_for_sync`` / ``release_after_sync``,
    ``state_dict`` / ``load_state_dict``, ``close``."""

    def __init__(
        self,
        cfg,
        engine,
        dataset,
        sampler,
        tokenizer,
        rewards,
        history: WeightHistory,
        *,
        start_step: int,
        teachers=None,
    ):
        r = cfg.rollout
        self.cfg, self.engine, self.dataset, self.sampler = cfg, engine, dataset, sampler
        self.tokenizer, self.rewards, self.history = tokenizer, rewards, history
        self.teachers = teachers  # distill.teachers: each finished group scored by its teacher
        self.mode, self.n, self.want, self.G = (
            r.inflight_updates,
            int(r.max_staleness),
            r.prompts_per_step,
            r.group_size,
        )
        self.slots = inflight_slots(r)
        self.engine_version = start_step
        self.cond = threading.Condition()
        self.score_lock = threading.Lock()  # one reward call at a time (the scorer is not shared-safe)
        self.finished: deque[_Finished] = deque()
        self.epoch, self.started, self.stop = 0, False, False
        self.error: BaseException | None = None
        self.drawn = 0  # prompts drawn since start (each group's seed offset)
        self.busy, self.busy_s, self.mark = 0, 0.0, time.perf_counter()
        self.window_start = self.mark
        self.dropped = 0

    # -- the workers -----------------------------------------------------------------------------
    def _tick(self, delta: int) -> None:
        """Under ``cond``: account slot-seconds, then change the count of groups generating."""
        now = time.perf_counter()
        self.busy_s += self.busy * (now - self.mark)
        self.mark, self.busy = now, self.busy + delta

    def _work(self, epoch: int) -> None:
        while True:
            with self.cond:  # backpressure: groups generating + finished untaken stay within the slots
                self.cond.wait_for(
                    lambda: self.stop or epoch != self.epoch or len(self.finished) + self.busy < self.slots
                )
                if self.stop or epoch != self.epoch:
                    return
                index = self.sampler.next_indices(1)[0]
                k = self.drawn
                self.drawn += 1
                self._tick(+1)
            try:
                row = self.dataset[index]
                seed = (self.cfg.seed * 1_000_003 + k * 1009) % (2**31)
                params = sampling_params(self.cfg, self.tokenizer, seed)
                samples, resubmitted = generate_group(self.engine, row.prompt_ids, self.G, params, k)
                with self.score_lock:
                    records, stats = score_group(self.cfg, row, samples, self.tokenizer, self.rewards)
                if self.teachers is not None:
                    self.teachers.score(row, records)
                for rec in records:
                    if rec.token_versions is None:
                        raise RuntimeError(
                            "rollout.inflight_updates needs engines that report the weight version of each "
                            "token (sglang's meta_info.weight_versions); this engine does not"
                        )
                    if self.mode == "in_place":
                        head = first_span(rec.token_versions)
                        rec.engine_behaviour = [0] * head + [1] * (rec.response_len - head)
            except BaseException as e:  # noqa: BLE001 - handed to the trainer by take()
                with self.cond:
                    self._tick(-1)
                    if epoch == self.epoch and not self.stop and self.error is None:
                        self.error = e
                    self.cond.notify_all()
                return
            with self.cond:
                self._tick(-1)
                if epoch != self.epoch:
                    return
                self.finished.append(_Finished(records, stats, resubmitted))
                self.cond.notify_all()

    def _start(self) -> None:
        self.stop, self.error, self.started = False, None, True
        for i in range(self.slots):
            threading.Thread(target=self._work, args=(self.epoch,), name=f"gspo-inflight-{i}", daemon=True).start()

    def close(self) -> None:
        """Stop drawing prompts and forget every group; workers in a request end with it (their
        results are dropped: the epoch moved on). Nothing waits for the engines."""
        with self.cond:
            self.stop, self.started = True, False
            self.epoch += 1
            self.finished.clear()
            self.error = None
            self.cond.notify_all()

    # -- what the trainer calls ------------------------------------------------------------------
    def _age(self, rec: Sample, trainer_version: int) -> int:
        return trainer_version - min(rec.behaviour_version or [trainer_version])

    def take(self, step: int, trainer_version: int) -> RolloutBatch:
        """The first ``prompts_per_step`` finished groups no more than N versions old (blocks until
        they are in); raises a worker's error."""
        if not self.started:
            self._start()
        t0 = time.perf_counter()
        with self.cond:
            while True:
                if self.error is not None:
                    error, self.error = self.error, None
                    self.close()
                    raise error
                self._drop_stale(trainer_version)
                if len(self.finished) >= self.want:
                    break
                self.cond.wait(timeout=1.0)
            taken = [self.finished.popleft() for _ in range(self.want)]
            self.cond.notify_all()  # workers held back by a full queue draw again
            self._tick(0)
            window = max(time.perf_counter() - self.window_start, 1e-9)
            busy_frac = self.busy_s / (self.slots * window)
            self.busy_s, self.window_start = 0.0, time.perf_counter()
            carried, generating, dropped = len(self.finished), self.busy, self.dropped
            self.dropped = 0
        waited = time.perf_counter() - t0
        records = [rec for f in taken for rec in f.records]
        metrics = self._metrics(records, taken, trainer_version)
        metrics.update(
            {
                "rollout/trainer_wait_s": waited,
                "perf/rollout_s": waited,
                "rollout/engine_policy_version": float(self.engine_version),
                "rollout/stale_groups_dropped": float(dropped),
                "rollout/carried_groups": float(carried),
                "rollout/inflight_groups": float(generating),
                "rollout/engine_busy_frac": busy_frac,
            }
        )
        return RolloutBatch(records=records, metrics=metrics)

    def _drop_stale(self, trainer_version: int) -> None:
        """Under ``cond``: map each finished group's token versions to policy versions and drop the
        groups whose oldest token is more than N versions behind ``trainer_version``."""
        keep: deque[_Finished] = deque()
        for f in self.finished:
            for rec in f.records:
                if rec.behaviour_version is None or len(rec.behaviour_version) != rec.response_len:
                    rec.behaviour_version = [self.history.policy_version(v) for v in rec.token_versions or []]
            if max(self._age(rec, trainer_version) for rec in f.records) > self.n:
                self.dropped += 1
            else:
                keep.append(f)
        self.finished = keep

    def _metrics(self, records: list[Sample], taken: list[_Finished], trainer_version: int) -> dict:
        ages = [self._age(r, trainer_version) for r in records]
        spans = [max(r.behaviour_version or [0]) - min(r.behaviour_version or [0]) for r in records]
        tokens = sum(r.response_len for r in records)
        stale = sum(sum(1 for v in (r.behaviour_version or []) if v < trainer_version) for r in records)
        rewards = [float(r.reward) for r in records if r.reward is not None]
        stats: dict[str, float] = {}
        for f in taken:
            for key, v in f.stats.items():
                stats[key] = stats.get(key, 0.0) + v
        return {
            "reward/mean": sum(rewards) / len(rewards),
            "reward/std": float(torch.tensor(rewards).std(unbiased=False)),
            "reward/batch_mean": sum(rewards) / len(rewards),
            "rollout/response_len_mean": tokens / len(records),
            "rollout/truncated_frac": sum(r.truncated for r in records) / len(records),
            "rollout/staleness_mean": sum(ages) / len(ages),
            "rollout/staleness_max": float(max(ages)),
            "rollout/version_span_max": float(max(spans)),
            "rollout/version_span_mean": sum(spans) / len(spans),
            "rollout/stale_token_frac": stale / max(tokens, 1),
            "rollout/engine_behaviour_tokens": float(sum(sum(r.engine_behaviour or []) for r in records)),
            "rollout/resubmitted_samples": float(sum(f.resubmitted for f in taken)),
            **{k if k.startswith("reward/") else f"reward/{k}": v for k, v in stats.items()},
            **(distill_metrics(records, self.teachers.take_busy_s()) if self.teachers is not None else {}),
            **custom_metrics(records),  # as a synchronous step's (orchestration/batch.py)
            **engine_spec_metrics(records),  # rollout.speculative: the engines' acceptance
        }

    def hold_for_sync(self, target: int) -> float:
        """A sync never waits for generation (the engines pause in place, retract or abort)."""
        return 0.0

    def release_after_sync(self, version: int | None) -> None:
        if version is not None:
            with self.cond:
                self.engine_version = version

    # -- the sampler interface RolloutSession and the checkpoint use ------------------------------
    def state_dict(self) -> dict:
        """The prompt sampler's position after the last prompt drawn (module docstring)."""
        with self.cond:
            return dict(self.sampler.state_dict())

    def load_state_dict(self, state: dict) -> None:
        """After an engine failure or on resume: forget every group and restart drawing at ``state``."""
        self.close()
        with self.cond:
            self.sampler.load_state_dict(state)
