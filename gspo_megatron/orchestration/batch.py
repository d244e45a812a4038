"""One rollout batch: prompts -> G responses each -> rewards -> group advantages (rank 0 only).

Dynamic sampling (rollout.dynamic_sampling): groups whose rewards are all equal carry no signal; they
are dropped and new prompts are drawn, up to rollout.max_resample_rounds extra rounds. The batch size
stays prompts_per_step * group_size: when the rounds run out, zero-variance groups fill the rest
(their advantages are 0, so they add nothing to the gradient but keep the batch layout fixed).
Over-sampling (rollout.over_sample > 1): each round draws ceil(over_sample * needed) prompts at once
and stops consuming the engine's groups (``engine.generate_stream``) as soon as enough informative
groups are in; engines that deliver groups as they finish (SGLang) skip the requests not yet
started. The batch lists its groups in prompt order (round, then the prompt's place in the round),
whatever order the engines delivered them in: the same seed and engine results give the same batch
(with ``rollout.engine_deterministic`` two runs sample the same tokens; over-sampling's early stop
still takes whichever groups came first).

Custom rollouts (rollout.custom_function): every sample is produced by the user's hook
(``engines/custom.py``); its Samples carry a ``loss_mask`` (the policy's tokens) and its rewards come
from the hook (or reward.function when it leaves them out).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from gspo_megatron.config import Config
from gspo_megatron.data.dataset import decode_response
from gspo_megatron.distill.teachers import distill_metrics
from gspo_megatron.engines.base import SamplingParams
from gspo_megatron.engines.sglang_engine import engine_spec_metrics
from gspo_megatron.errors import UserInputError
from gspo_megatron.losses.advantages import group_advantages
from gspo_megatron.sample import Sample


@dataclass
class RolloutBatch:
    """records: one :class:`~gspo_megatron.sample.Sample` per sequence, group by group (G consecutive
    Samples share a prompt)."""

    records: list[Sample]
    metrics: dict = field(default_factory=dict)


def sampling_params(cfg: Config, tokenizer, seed: int) -> SamplingParams:
    stop_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for s in cfg.rollout.stop:
        ids = tokenizer.encode(s, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(
                f"rollout.stop entry {s!r} is not a single token ({ids}); only single-token stop strings are supported"
            )
        stop_ids.append(ids[0])
    r = cfg.rollout
    return SamplingParams(
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=r.max_new_tokens,
        stop_token_ids=stop_ids,
        seed=seed,
    )


def _records(samples, scores, k0) -> list[Sample]:
    """One group's Samples from the engine's responses (``engines.base.RolloutSample``) and their
    rewards ``scores[k0:k0 + len(samples)]``."""
    recs = []
    for j, s in enumerate(samples):
        if len(s.response_logprobs) != len(s.response_ids):
            raise RuntimeError("rollout engine returned log-probs that do not match its response ids")
        recs.append(
            Sample(
                prompt_ids=list(s.prompt_ids),
                response_ids=list(s.response_ids),
                engine_logprobs=list(s.response_logprobs),
                reward=float(scores[k0 + j]),
                finish_reason=s.finish_reason,
                token_versions=list(s.token_versions) if s.token_versions is not None else None,
                routed_experts=getattr(s, "routed_experts", None),
                indexer_topk=getattr(s, "indexer_topk", None),
                spec_verify_ct=int(getattr(s, "spec_verify_ct", 0) or 0),  # speculative decoding's counts
                spec_num_correct_drafts=int(getattr(s, "spec_num_correct_drafts", 0) or 0),
                spec_num_proposed_drafts=int(getattr(s, "spec_num_proposed_drafts", 0) or 0),
            )
        )
    return recs


def score_group(cfg: Config, row, samples, tokenizer, rewards) -> tuple[list[Sample], dict]:
    """One prompt's G engine samples (``engines.base.RolloutSample``) -> its Samples, rewarded by
    ``rewards.score`` and given their group advantages, and the reward's stats (the in-flight
    producer scores each group as it finishes: ``orchestration.inflight``)."""
    G = len(samples)
    texts = [decode_response(tokenizer, s) for s in samples]
    scores, stats = rewards.score([row.prompt] * G, texts, [row.label] * G, group_size=G)
    recs = _records(samples, scores, 0)
    adv = group_advantages(
        torch.tensor([r.reward for r in recs]), G, normalize_std=cfg.gspo.std_normalize, eps=cfg.gspo.adv_eps
    )
    for j, rec in enumerate(recs):
        rec.advantage = float(adv.advantages[j])
    return recs, stats


def _stream_groups(cfg, engine, rows, tokenizer, rewards, seed):
    """Generate and score ``rows``, G samples each; yields (groups, reward stats, each group's row
    index) as the engine delivers them (``engine.generate_stream``), a group being a list of Samples."""
    params = sampling_params(cfg, tokenizer, seed)
    if cfg.rollout.custom_function:
        groups, stats = _custom_groups(cfg, engine, rows, tokenizer, rewards, params)
        yield groups, stats, list(range(len(groups)))
        return
    stream = engine.generate_stream([r.prompt_ids for r in rows], cfg.rollout.group_size, params)
    try:
        for delivered in stream:
            prompts, responses, labels = [], [], []
            for i, group in delivered:
                for s in group:
                    prompts.append(rows[i].prompt)
                    responses.append(decode_response(tokenizer, s))
                    labels.append(rows[i].label)
            scores, stats = rewards.score(prompts, responses, labels, group_size=cfg.rollout.group_size)
            groups, k = [], 0
            for i, group in delivered:
                groups.append(_records(group, scores, k))
                k += len(group)
            yield groups, stats, [i for i, _ in delivered]
    finally:
        stream.close()


def _custom_groups(cfg, engine, rows, tokenizer, rewards, params) -> tuple[list[list[Sample]], dict]:
    """The rollout hook (rollout.custom_function) on every sample of ``rows``: (groups, stats)."""
    from gspo_megatron.engines.custom import HookSample, check_result, load_hook, run_hooks

    spec, G = cfg.rollout.custom_function, cfg.rollout.group_size
    hook = load_hook(spec)
    samples = [
        HookSample(
            prompt=r.prompt,
            prompt_ids=list(r.prompt_ids),
            label=r.label,
            index=j,
            tokenizer=tokenizer,
            params=params,
            max_response_tokens=cfg.model.max_seq_len - len(r.prompt_ids),
            source=r.source,
        )
        for r in rows
        for j in range(G)
    ]
    results, calls = run_hooks(hook, spec, engine, samples, params)
    checked = [check_result(res, smp, c, spec) for res, smp, c in zip(results, samples, calls)]  # Samples
    unscored = [i for i, c in enumerate(checked) if c.reward is None]
    stats: dict = {}
    if unscored:  # the hook left the reward to reward.function: score the decoded response
        stop = set(params.stop_token_ids)
        texts = []
        for i in unscored:
            ids = checked[i].response_ids
            ids = ids[:-1] if not checked[i].truncated and ids[-1] in stop else ids
            texts.append(tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))
        if cfg.reward.group and len(unscored) != len(checked):
            raise UserInputError(
                f"rollout.custom_function {spec!r} returned a reward for some samples and None for "
                "others: with reward.group every sample's reward must come from the group function"
            )
        scores, stats = rewards.score(
            [samples[i].prompt for i in unscored], texts, [samples[i].label for i in unscored], group_size=G
        )
        for i, v in zip(unscored, scores):
            checked[i].reward = float(v)
    return [checked[gi * G : (gi + 1) * G] for gi in range(len(rows))], stats


def collect_rollouts(
    cfg: Config, step: int, engine, dataset, sampler, tokenizer, rewards, teachers=None
) -> RolloutBatch:
    """Rank 0: a full rollout batch for ``step`` (deterministic given the seed, step and weights,
    for engines that deliver in order). ``teachers`` (``distill.teachers.TeacherPool``, or None):
    each group the batch keeps is scored by its teacher in the background as soon as it is
    generated; the batch waits for the last of them (``perf/teacher_wait_s``)."""
    t0 = time.perf_counter()
    scoring: dict[int, Any] = {}  # id(group) -> the teacher's Future
    row_of: dict[int, Any] = {}  # id(group) -> its prompt row
    r = cfg.rollout
    G, want = r.group_size, r.prompts_per_step
    # (round, row index in the round) -> group: the batch takes them in that order (module docstring)
    kept: list[tuple[tuple[int, int], list[Sample]]] = []
    spare: list[tuple[tuple[int, int], list[Sample]]] = []  # zero-variance groups (dynamic sampling), to fill up
    stats_sum: dict[str, float] = {}
    rounds, first_round, drawn, generated = 0, None, 0, 0
    while len(kept) < want:
        need = want - len(kept)
        ask = math.ceil(need * r.over_sample) if r.dynamic_sampling else need
        seed = (cfg.seed * 1_000_003 + step * 1009 + rounds) % (2**31)
        rows = [dataset[i] for i in sampler.next_indices(ask)]
        drawn += ask
        round_rewards, round_zero = [], []
        stream = _stream_groups(cfg, engine, rows, tokenizer, rewards, seed)
        try:
            for groups, stats, indices in stream:
                generated += len(groups)
                for key, v in stats.items():
                    stats_sum[key] = stats_sum.get(key, 0.0) + v
                rewards_t = torch.tensor([rec.reward for g in groups for rec in g])
                adv = group_advantages(rewards_t, G, normalize_std=cfg.gspo.std_normalize, eps=cfg.gspo.adv_eps)
                round_rewards += rewards_t.tolist()
                round_zero += adv.zero_variance.tolist()
                for gi, g in enumerate(groups):
                    for j, rec in enumerate(g):
                        rec.advantage = float(adv.advantages[gi * G + j])
                    zero = bool(adv.zero_variance[gi])
                    (spare if zero and r.dynamic_sampling else kept).append(((rounds, indices[gi]), g))
                    row_of[id(g)] = rows[indices[gi]]
                    if teachers is not None and not (zero and r.dynamic_sampling):
                        scoring[id(g)] = teachers.submit(row_of[id(g)], g)
                if r.dynamic_sampling and len(kept) >= want:
                    break  # enough informative groups: the rest is not generated
        finally:
            stream.close()
        if first_round is None:
            first_round = (round_rewards, sum(round_zero) / max(len(round_zero), 1))
        rounds += 1
        if not r.dynamic_sampling or rounds > r.max_resample_rounds:
            break
    chosen = [g for _, g in (sorted(kept, key=lambda kg: kg[0]) + sorted(spare, key=lambda kg: kg[0]))[:want]]
    records = [rec for g in chosen for rec in g]
    wait_s = _await_teachers(teachers, chosen, scoring, row_of)
    if first_round is None:  # the loop runs at least once (prompts_per_step >= 1)
        raise ValueError(f"rollout.prompts_per_step must be >= 1, got {want}")
    all_rewards, first_zero_frac = first_round
    batch_rewards = [rec.reward for rec in records if rec.reward is not None]
    if len(batch_rewards) != len(records):  # every group was scored before its advantages
        raise RuntimeError("collect_rollouts: an unscored sample reached the batch")
    lens = [rec.response_len for rec in records]
    metrics = {
        # reward statistics of the first round: what the current policy scores on fresh prompts
        "reward/mean": float(sum(all_rewards) / len(all_rewards)),
        "reward/std": float(torch.tensor(all_rewards).std(unbiased=False)),
        "reward/batch_mean": sum(batch_rewards) / len(records),
        "rollout/zero_variance_frac": float(first_zero_frac),
        "rollout/rounds": float(rounds),
        "rollout/groups_generated": float(generated),
        "rollout/prompts_drawn": float(drawn),
        "rollout/response_len_mean": sum(lens) / len(lens),
        "rollout/truncated_frac": sum(rec.truncated for rec in records) / len(records),
        "perf/rollout_s": time.perf_counter() - t0,
        "data/skipped_rows": float(getattr(dataset, "skipped_rows", 0)),
        **{k if k.startswith("reward/") else f"reward/{k}": v for k, v in stats_sum.items()},
    }
    metrics.update(custom_metrics(records))
    metrics.update(engine_spec_metrics(records))  # rollout.speculative: the engines' acceptance
    if teachers is not None:
        metrics.update(distill_metrics(records, teachers.take_busy_s()))
        metrics["perf/teacher_wait_s"] = wait_s
    return RolloutBatch(records=records, metrics=metrics)


def _await_teachers(teachers, chosen: list[list[Sample]], scoring: dict[int, Any], row_of: dict[int, Any]) -> float:
    """Wait for the teachers' scores of the ``chosen`` groups (the zero-variance groups that fill a
    dynamic-sampling batch are scored now); returns the seconds waited. A teacher's failure
    (``UserInputError`` naming it) is raised here, on rank 0, before the batch is broadcast."""
    if teachers is None:
        return 0.0
    t0 = time.perf_counter()
    pending = [scoring.get(id(g)) or teachers.submit(row_of[id(g)], g) for g in chosen]
    for f in pending:
        f.result()
    return time.perf_counter() - t0


def custom_metrics(records: list[Sample]) -> dict:
    """Custom-hook rollouts: the trained share of response tokens, generate calls per sample, and
    the hook's own metrics averaged over the batch (``custom/<key>``). Each Sample's ``metrics`` are
    cleared (they are not broadcast to the training ranks)."""
    if not records or records[0].generate_calls is None:
        return {}
    out = {
        "rollout/trained_token_frac": sum(rec.trained_tokens for rec in records)
        / max(sum(rec.response_len for rec in records), 1),
        "rollout/generate_calls_mean": sum(rec.generate_calls for rec in records if rec.generate_calls is not None)
        / len(records),
    }  # (every custom-hook Sample counts its calls)
    sums: dict[str, list[float]] = {}
    for rec in records:
        for k, v in rec.metrics.items():
            sums.setdefault(k, []).append(v)
        rec.metrics = {}
    out.update({f"custom/{k}": sum(v) / len(v) for k, v in sums.items()})
    return out
