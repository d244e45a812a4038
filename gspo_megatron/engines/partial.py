"""A prompt's group generated through weight syncs (``rollout.inflight_updates``, rank 0).

``generate_group`` sends the group's G samples as one request to one engine. In ``in_place`` and
``retract`` modes a sync pauses the engine and the request simply answers later, its tokens' versions
in sglang 0.5.23's ``meta_info.weight_versions`` spans. In ``abort`` mode (slime's partial rollout) a
sync's ``/pause_generation`` answers every running request with its partial output (``finish_reason``
``abort``: ``tokenizer_manager.py`` ``_handle_abort_req``, ``scheduler.py`` ``abort_request``); each
unfinished sample is resubmitted at once as a continuation: ``prompt + tokens so far`` as input, the
budget left as ``max_new_tokens``. sglang holds a request that arrives while paused until
``/continue_generation`` (``generate_request`` waits on ``is_pause_cond``), so the continuation is
prefilled under the new weights; its tokens carry the new version. The merged sample's tokens,
log-probs and versions are those of each part, in order.

What a continuation changes: nothing in the sampled distribution (the prefix is prefilled again from
the same tokens under the new weights, as sglang's ``retract`` does), only the seed stream: a
continuation's seed is the sample's seed plus 7919 times the tokens it already has.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from gspo_megatron.engines.base import RolloutSample, SamplingParams


def _merge(head: RolloutSample, tail: RolloutSample) -> RolloutSample:
    """``head``'s response followed by ``tail``'s (``tail`` continues ``head``)."""
    versions = None
    if head.token_versions is not None and tail.token_versions is not None:
        versions = list(head.token_versions) + list(tail.token_versions)
    return RolloutSample(
        prompt_ids=list(head.prompt_ids),
        response_ids=list(head.response_ids) + list(tail.response_ids),
        response_logprobs=list(head.response_logprobs) + list(tail.response_logprobs),
        finish_reason=tail.finish_reason,
        token_versions=versions,
        spec_verify_ct=head.spec_verify_ct + tail.spec_verify_ct,
        spec_num_correct_drafts=head.spec_num_correct_drafts + tail.spec_num_correct_drafts,
        spec_num_proposed_drafts=head.spec_num_proposed_drafts + tail.spec_num_proposed_drafts,
    )


def _settle(sample: RolloutSample, params: SamplingParams) -> RolloutSample:
    """An aborted part that ended the sample anyway (its last token a stop token, or the budget
    spent: sglang keeps the token of the abort's last decode with ``finish_reason`` abort) finishes
    as ``stop`` / ``length``."""
    if sample.finish_reason != "abort":
        return sample
    if sample.response_ids and sample.response_ids[-1] in params.stop_token_ids:
        return dataclasses.replace(sample, finish_reason="stop")
    if len(sample.response_ids) >= params.max_new_tokens:
        return dataclasses.replace(sample, finish_reason="length")
    return sample


def generate_group(
    engine, prompt_ids: Sequence[int], n: int, params: SamplingParams, index: int
) -> tuple[list[RolloutSample], int]:
    """The ``n`` finished samples of one prompt from ``engine`` (an ``SGLangRolloutEngine``: its
    ``generate_partial``), to engine ``index`` modulo the engines, continuing every aborted one
    (module docstring). Returns (samples, continuations sent). Sample j's seed is ``params.seed + j``."""
    if n < 1:
        raise ValueError(f"generate_group: n must be >= 1, got {n}")
    parts: list[RolloutSample | None] = [None] * n
    pending, resubmitted = list(range(n)), 0
    while pending:
        inputs, sps = [], []
        for j in pending:
            held = parts[j]
            so_far = held.response_ids if held is not None else []
            seed = None if params.seed is None else params.seed + j + 7919 * len(so_far)
            inputs.append(list(prompt_ids) + list(so_far))
            sps.append(dataclasses.replace(params, max_new_tokens=params.max_new_tokens - len(so_far), seed=seed))
        outputs = engine.generate_partial(inputs, sps, index)
        still = []
        for j, out in zip(pending, outputs):
            part = dataclasses.replace(out, prompt_ids=list(prompt_ids))
            head = parts[j]
            merged = _settle(part if head is None else _merge(head, part), params)
            parts[j] = merged
            if merged.finish_reason == "abort":
                still.append(j)
        resubmitted += len(still)
        pending = still
    done = [p for p in parts if p is not None]
    assert len(done) == n  # every sample finished (the loop ends when none is pending)
    return done, resubmitted
