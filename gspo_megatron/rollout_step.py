"""One rollout batch: prompts -> G responses each -> rewards -> group advantages (rank 0 only).

Dynamic sampling (rollout.dynamic_sampling): groups whose rewards are all equal carry no signal; they
are dropped and new prompts are drawn, up to rollout.max_resample_rounds extra rounds. The batch size
stays prompts_per_step * group_size: when the rounds run out, zero-variance groups fill the rest
(their advantages are 0, so they add nothing to the gradient but keep the batch layout fixed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from gspo_megatron.config import Config
from gspo_megatron.data.dataset import decode_response
from gspo_megatron.losses.advantages import group_advantages
from gspo_megatron.rollout.base import SamplingParams


@dataclass
class RolloutBatch:
    """records: one dict per sequence, group by group (see pipeline.py for the record keys)."""

    records: list[dict]
    metrics: dict = field(default_factory=dict)


def sampling_params(cfg: Config, tokenizer, seed: int) -> SamplingParams:
    stop_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for s in cfg.rollout.stop:
        ids = tokenizer.encode(s, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"rollout.stop entry {s!r} is not a single token ({ids}); "
                             "only single-token stop strings are supported")
        stop_ids.append(ids[0])
    r = cfg.rollout
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                          max_new_tokens=r.max_new_tokens, stop_token_ids=stop_ids, seed=seed)


def _generate_groups(cfg, engine, dataset, indices, tokenizer, rewards, seed):
    """Generate and score one round. Returns (groups, reward stats); a group is a list of records."""
    rows = [dataset[i] for i in indices]
    params = sampling_params(cfg, tokenizer, seed)
    samples = engine.generate([r.prompt_ids for r in rows], cfg.rollout.group_size, params)
    prompts, responses, labels = [], [], []
    for row, group in zip(rows, samples):
        for s in group:
            prompts.append(row.prompt)
            responses.append(decode_response(tokenizer, s))
            labels.append(row.label)
    scores, stats = rewards.score(prompts, responses, labels, group_size=cfg.rollout.group_size)
    groups, k = [], 0
    for row, group in zip(rows, samples):
        recs = []
        for s in group:
            if len(s.response_logprobs) != len(s.response_ids):
                raise RuntimeError("rollout engine returned log-probs that do not match its response ids")
            recs.append(dict(tokens=list(s.prompt_ids) + list(s.response_ids), prompt_len=len(s.prompt_ids),
                             engine_logprobs=list(s.response_logprobs), reward=float(scores[k]),
                             truncated=s.finish_reason == "length", response_len=len(s.response_ids),
                             token_versions=s.token_versions))
            k += 1
        groups.append(recs)
    return groups, stats


def collect_rollouts(cfg: Config, step: int, engine, dataset, sampler, tokenizer, rewards) -> RolloutBatch:
    """Rank 0: a full rollout batch for ``step`` (deterministic given the seed, step and weights)."""
    t0 = time.perf_counter()
    G, want = cfg.rollout.group_size, cfg.rollout.prompts_per_step
    kept, spare, stats_sum = [], [], {}
    rounds, first_zero_frac, all_rewards = 0, None, []
    while len(kept) < want:
        need = want - len(kept)
        seed = (cfg.seed * 1_000_003 + step * 1009 + rounds) % (2**31)
        groups, stats = _generate_groups(cfg, engine, dataset, sampler.next_indices(need), tokenizer,
                                         rewards, seed)
        for key, v in stats.items():
            stats_sum[key] = stats_sum.get(key, 0.0) + v
        rewards_t = torch.tensor([r["reward"] for g in groups for r in g])
        adv = group_advantages(rewards_t, G, normalize_std=cfg.gspo.std_normalize, eps=cfg.gspo.adv_eps)
        if first_zero_frac is None:
            first_zero_frac = adv.zero_variance_fraction
            all_rewards = rewards_t.tolist()
        for gi, g in enumerate(groups):
            for j, rec in enumerate(g):
                rec["advantage"] = float(adv.advantages[gi * G + j])
            zero = bool(adv.zero_variance[gi])
            (spare if zero and cfg.rollout.dynamic_sampling else kept).append(g)
        rounds += 1
        if not cfg.rollout.dynamic_sampling or rounds > cfg.rollout.max_resample_rounds:
            break
    kept = (kept + spare)[:want]
    records = [r for g in kept for r in g]
    lens = [r["response_len"] for r in records]
    metrics = {
        # reward statistics of the first round: what the current policy scores on fresh prompts
        "reward/mean": float(sum(all_rewards) / len(all_rewards)),
        "reward/std": float(torch.tensor(all_rewards).std(unbiased=False)),
        "reward/batch_mean": sum(r["reward"] for r in records) / len(records),
        "rollout/zero_variance_frac": float(first_zero_frac),
        "rollout/rounds": float(rounds),
        "rollout/response_len_mean": sum(lens) / len(lens),
        "rollout/truncated_frac": sum(r["truncated"] for r in records) / len(records),
        "perf/rollout_s": time.perf_counter() - t0,
        "data/skipped_rows": float(getattr(dataset, "skipped_rows", 0)),
        **{k if k.startswith("reward/") else f"reward/{k}": v for k, v in stats_sum.items()},
    }
    return RolloutBatch(records=records, metrics=metrics)
