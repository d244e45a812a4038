"""The one record of a sequence, from rollout to loss: :class:`Sample`.

Where a Sample is made and what fills it (rank 0 unless said otherwise):

- ``orchestration.batch._records``: one per engine response (``engines.base.RolloutSample``): prompt and
  response ids, the engine's log-probs, finish reason, the engine's weight version per token, and the
  reward ``rewards.score`` gave it;
- ``engines.custom.check_result``: one per call of the user's rollout hook (rollout.custom_function),
  converted from the hook's documented dict at that boundary: response ids, ``loss_mask``, the
  engine's log-probs on the policy's tokens, the hook's reward (or None: ``orchestration.batch`` scores it
  with reward.function), its metrics and its number of generate calls;
- ``orchestration.batch.collect_rollouts``: ``advantage`` (group-relative, ``losses.advantages``) once the
  whole group is scored; dynamic sampling keeps or drops whole groups; the hook's ``metrics`` are
  averaged into the batch's metrics and cleared (they are not broadcast);
- ``orchestration.async_producer.AsyncProducer.take`` / ``orchestration.inflight.InflightProducer.take``
  (off-policy runs): ``behaviour_version`` from ``token_versions`` (and ``engine_behaviour``, in-place updates);
- ``distill.teachers.TeacherPool``: ``teacher_logprobs`` and ``teacher``, the teacher's log-probs of the
  response by prefill (``distill.coef`` > 0), as each group is generated;
- ``orchestration.batch._records``: ``routed_experts``, the engine's MoE routes, when the engine was asked
  for them (``SGLangRolloutEngine(route_spec=...)``; decoded and validated in ``engines/routing.py``).

``RolloutSession.rollout`` broadcasts the list to every rank; ``trainer.step.split_batch`` cuts it into
mini- and micro-batches and ``trainer.micro_batches.collate`` / ``trainer.packing.collate_packed`` lay each Sample on a
row: tokens, labels, ``loss_mask`` and every field of :data:`PER_TOKEN_FIELDS` that the first Sample
of the micro-batch carries become [b, s] tensors of the same name, ``advantage`` the [b] tensor
``advantages``. Position t of a row predicts token t+1, so response token j (0-based) is the label at
position ``prompt_len - 1 + j``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: the optional per-response-token float fields of a Sample that collate lays on the label positions
#: of its row, each as a [b, s] float tensor of the same name
PER_TOKEN_FIELDS = (
    "old_logprobs",
    "engine_logprobs",
    "ref_logprobs",
    "behaviour_version",
    "engine_behaviour",
    "teacher_logprobs",
)


@dataclass
class Sample:
    """One prompt + response sequence and what the loss needs about it (R = len(response_ids)).

    prompt_ids: list[int] [P], P >= 1; response_ids: list[int] [R] (the stop token included when one
        ended the response).
    engine_logprobs: list[float] [R], the rollout engine's log p(response_ids[t] | ...) (0.0 on tokens
        a custom rollout does not train); their gap to the trainer's log-probs is a metric and
        truncated importance sampling uses them. None only for records built by tools/tests.
    reward: float, the scalar reward; None until scored.
    advantage: float, the group-relative advantage A_i = (r_i - mean_group) [/ (std_group + eps)];
        None until the whole group is scored.
    loss_mask: list[int] [R] of 0/1, the response tokens the loss counts (custom rollouts: the
        policy's tokens, not tool output or user turns); None = every response token.
    token_versions: list[str] [R], the engine's weight version (a sync's version string) that
        produced each token; None when the engine does not report it.
    behaviour_version: list[int] [R], the trainer's policy version that generated each token
        (off-policy runs, mapped from token_versions); None on on-policy runs.
    engine_behaviour: list[int] [R] of 0/1, 1 on the tokens whose behaviour log-prob is the engine's
        (``rollout.inflight_updates=in_place``: sampled by newer weights over a prefix whose KV cache
        older weights computed, which no single version's forward reproduces; ``orchestration.inflight``);
        None: every token's behaviour is its version's forward.
    teacher_logprobs: list[float] [R], a distillation teacher's log p_teacher(response_ids[t] | ...)
        by prefill of prompt + response (``distill.teachers``, ``distill/teachers.py``); None without
        distillation. teacher: the name of the teacher that scored it. teacher_topk_ids (int) /
        teacher_topk_logprobs (float): numpy [R, K], the teacher's K most likely tokens at each
        response position and their log-probs (``distill.topk`` > 0, the top-k objectives).
    finish_reason: "stop" (a stop token ended it) or "length" (it hit the token budget).
    metrics: the custom rollout hook's own numbers (str -> float), averaged into ``custom/<key>``.
    generate_calls: how many generate calls the custom hook made for it; None for engine samples.
    old_logprobs / ref_logprobs: list[float] [R], given by tests and tools (the trainer computes both
        on the collated batch instead).
    routed_experts: int32 numpy [P + R - 1, num_layers, topk], the engine's top-k expert ids of
        token t (the input at row position t) in row t: sglang's ``[0, seqlen - 1)``, the last token
        has none (``engines/routing.py``); None when the engine was not asked for routes.
    indexer_topk: DSA models, int32 numpy [P + R - 1, num_layers, index_topk], the key positions
        the engine's indexer selected for query t in row t (-1 where fewer keys exist; sglang's
        ``meta_info["indexer_topk"]``, ``engines/routing.py``); None when not asked for.
    spec_verify_ct / spec_num_correct_drafts / spec_num_proposed_drafts: a speculatively decoding engine's
        counts for this response (``engines.base.RolloutSample``: target verify forwards, accepted draft
        tokens, ``verify_ct * (num_draft_tokens - 1)`` proposed draft tokens); 0 without speculation.
        ``engines.sglang_engine.engine_spec_metrics`` sums them over a step into ``spec/engine_accept_length``
        (sum R / sum verify_ct) and ``spec/engine_accept_rate`` (sum correct / sum proposed).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    engine_logprobs: list[float] | None = None
    reward: float | None = None
    advantage: float | None = None
    loss_mask: list[int] | None = None
    token_versions: list[str] | None = None
    behaviour_version: list[int] | None = None
    engine_behaviour: list[int] | None = None
    teacher_logprobs: list[float] | None = None
    teacher: str | None = None
    teacher_topk_ids: Any = None
    teacher_topk_logprobs: Any = None
    finish_reason: str = "stop"
    metrics: dict[str, float] = field(default_factory=dict)
    generate_calls: int | None = None
    old_logprobs: list[float] | None = None
    ref_logprobs: list[float] | None = None
    routed_experts: Any = None
    indexer_topk: Any = None
    spec_verify_ct: int = 0
    spec_num_correct_drafts: int = 0
    spec_num_proposed_drafts: int = 0

    @classmethod
    def from_tokens(cls, tokens, prompt_len: int, **fields) -> "Sample":
        """A Sample from one prompt + response id list and the prompt's length (scoring, tests)."""
        tokens = list(tokens)
        return cls(prompt_ids=tokens[:prompt_len], response_ids=tokens[prompt_len:], **fields)

    @property
    def tokens(self) -> list[int]:
        """prompt_ids + response_ids: the row's token ids [P + R]."""
        return list(self.prompt_ids) + list(self.response_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def response_len(self) -> int:
        return len(self.response_ids)

    @property
    def length(self) -> int:
        """P + R, the tokens of its row (or packed segment) before padding."""
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def truncated(self) -> bool:
        """The response hit the token budget (rollout.max_new_tokens or the hook's budget)."""
        return self.finish_reason == "length"

    @property
    def trained_tokens(self) -> int:
        """The response tokens the loss counts: loss_mask's ones (every response token without one)."""
        return self.response_len if self.loss_mask is None else int(sum(self.loss_mask))
