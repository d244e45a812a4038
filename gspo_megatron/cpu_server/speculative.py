"""Speculative decoding in the CPU server: sglang 0.5.23's EAGLE with the checkpoint's MTP layer as the draft
(``--speculative-algorithm EAGLE`` / ``NEXTN``, top-1 chains), its flags, its two runners and its
acceptance rule.

Flags (:func:`resolve_args`, sglang's ``arg_groups/speculative_hook.py``): ``NEXTN`` and ``EAGLE`` resolve to
``EAGLE`` (``_resolve_speculative_algorithm_alias``); a name sglang does not know is its ``ValueError("Unknown
speculative algorithm name: ...")`` (``srt/speculative/spec_info.py`` ``SpeculativeAlgorithm.from_string``);
without ``--speculative-num-steps`` the three are auto-chosen (3, 1, 4) (``_auto_choose_speculative_params``,
after sglang's bare ``assert`` that ``--speculative-eagle-topk`` and ``--speculative-num-draft-tokens`` are
unset too); with top-k 1, ``num_draft_tokens`` becomes ``steps + 1`` (``_handle_eagle_family``); the draft path
defaults to ``--model-path`` for the architectures ``_handle_eagle_family`` lists (DeepSeek-V3 / V3.2, GLM-4.5,
GLM-5: :func:`draft_path_defaulted`) and stays unset for the others (Qwen3-Next, Qwen3.5: sglang's draft worker
then reads ``--model-path``, ``ModelConfig.from_server_args``: ``model_path or cfg.model_path``);
``--max-running-requests`` unset becomes 48 (``_handle_eagle_family``: "Max running requests is reset to 48 for
speculative decoding"; the scheduler admits no more, ``scheduler.StepScheduler``). Stand-in
limits, refused in one line: another algorithm (EAGLE3, STANDALONE, NGRAM, DFLASH...), ``--speculative-eagle-topk
> 1`` (trees), ``--speculative-num-steps < 1``.

Runners (``worker.TPWorker``): the target and the draft, each with its shard store and, with
``--sglang-loader-check``, sglang's own class: the draft's is the family's ``sglang_draft_modules`` class
(``Glm4MoeForCausalLMNextN`` / ``DeepseekV3ForCausalLMNextN``) built from ``ModelConfig(is_draft_model=True)``
(``configs/model_config.py`` renames the architecture), sharing the target's embedding and head
(``speculative/eagle_worker_v2.py`` ``init_lm_head`` -> ``set_embed_and_head``). Every weight update goes to
the runners its ``selector`` names (:func:`parse_selector`; ``managers/io_struct.py``
``BeginWeightUpdateReqInput`` / ``UpdateWeightsFromTensorReqInput`` / ``UpdateWeightsFromDistributedReqInput``
``selector: Literal["target", "draft", "all"] = "all"``; ``managers/scheduler_components/weight_updater.py``
``_select_runners``), each runner's loader taking the whole bucket and keeping its own names (the target skips
the MTP layer, the draft everything else: ``srt/models/glm4_moe.py`` ``load_weights(is_nextn=...)``).

Generation (:class:`SpeculativeDecoder`, one request at a time on rank 0, full recompute of the draft, the
target with a KV cache; :meth:`~SpeculativeDecoder.start` in the request's prefill iteration, one
:meth:`~SpeculativeDecoder.cycle` per later scheduler iteration, so that pauses, updates and retracts land
between cycles as between sglang's decode steps): the target's prefill samples the first token (as without
speculation) and gives the final hidden states h_j (after the final norm: what sglang's ``LogitsProcessor``
hands the draft). Then per cycle, with L committed tokens t_0..t_{L-1} and h_0..h_{L-2}:

1. draft (``engines/mtp_draft.MTPDraft``, the synced MTP layer with the target's current embedding and head):
   inputs (h_j, t_{j+1}) at positions j = 0..L-2 (sglang's draft extend: "The draft runs at absolute target
   positions", ``eagle_worker_v2.py``); d_1 = argmax of its last logits; each further step feeds its own
   g and proposal one position on (``eagle_worker_v2.py`` ``draft_forward``: top-1 ``argmax``,
   ``positions.add_(1)``), ``steps`` proposals in all;
2. verify: one target forward of (t_{L-1}, d_1..d_s) at positions L-1..L-1+s; row i is the target's
   distribution of the token after d_i;
3. accept (:func:`accept_greedy` / :func:`accept_sampled`, ``speculative/eagle_utils.py`` ``eagle_sample``):
   a batch of greedy requests (sglang's ``is_all_greedy``) accepts while d_{i+1} is the target's argmax of row
   i and adds the argmax of the first row not matched (``verify_tree_greedy_func``); otherwise sglang's
   ``tree_speculative_sampling_target_only`` (``kernels/jit/include/sgl_kernel/speculative/sampling.cuh``,
   ``TreeSpeculativeSamplingTargetOnly``) with ``draft_probs = 0`` and the default thresholds
   (``--speculative-accept-threshold-single`` / ``-acc`` 1.0): target probabilities q_i = softmax(logits_i /
   T) renormalized to top-k then top-p; d_{i+1} is accepted when q_i(d) > 0 and a fresh uniform u < q_i(d)
   (or q_i(d) >= 1); at the first rejection the token is drawn from q_i with d removed, renormalized
   (``relu(q - p)`` where the kernel wrote p(d) = q(d)); after s acceptances the bonus token is drawn from
   q_s. The emitted tokens are distributed exactly as plain sampling's (P(x) = q(d)[x = d] + (1 - q(d))
   q(x)[x != d] / (1 - q(d)) = q(x)). (sglang's own CPU platform verifies greedily whatever the
   temperature, ``_verify_uses_greedy``: ``is_cpu``; this stand-in follows the CUDA path the GPU engines run);
4. the accepted tokens and the bonus are committed (stop tokens and ``max_new_tokens`` cut the output as
   without speculation), their target hidden states appended, the KV cache cropped. A hybrid target's
   Gated DeltaNet states cannot be cropped (transformers' ``LinearAttentionLayer.crop`` raises): its cache is
   copied before the verify and, when a draft was rejected, restored and run on the accepted tokens, which
   leaves the state after them (sglang keeps the verify's per-draft states and commits the accepted one,
   ``layers/attention/hybrid_linear_attn_backend.py`` ``update_mamba_state_after_mtp_verify``: the same state).

Log-probs are the target's, from the rows each token was emitted at, as without speculation
(``log_softmax(logits / T)`` of the unfiltered distribution; ``log_softmax(logits)`` for a greedy batch).
Counts per request (``managers/scheduler_components/batch_result_processor.py``: every verify adds 1 to
``spec_verify_ct`` and its accepted drafts to ``spec_num_correct_drafts``, whatever the finish cuts
afterwards; the histogram of accepted drafts per verify, ``schedule_batch.py``), turned into meta_info by
:func:`spec_meta_info` (``managers/tokenizer_manager.py`` ``_calculate_spec_decoding_metrics``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from gspo_megatron.cpu_server.request_checks import literal_refusal
from gspo_megatron.models.hf_config import architecture_of
from gspo_megatron.wire_format import SPEC_DEFAULT_MAX_RUNNING

ALGORITHM = "EAGLE"
ALIASES = ("NEXTN", "EAGLE")  # -> EAGLE (_resolve_speculative_algorithm_alias)
# sglang 0.5.23's builtin algorithms (spec_info.py SpeculativeAlgorithm) besides NONE
BUILTIN = ("DFLASH", "UNO", "DSPARK", "EAGLE", "EAGLE3", "FROZEN_KV_MTP", "STANDALONE", "NGRAM")
AUTO_PARAMS = (3, 1, 4)  # _auto_choose_speculative_params for the MTP architectures
SELECTORS = ("target", "draft", "all")
THRESHOLD = 1.0  # --speculative-accept-threshold-single / -acc defaults (arg_groups/fields/spec.py)


# -- flags -------------------------------------------------------------------------------------------
def add_speculative_args(p) -> None:
    """sglang's speculative flags (``arg_groups/fields/spec.py``), the subset the CPU server serves."""
    p.add_argument(
        "--speculative-algorithm", default=None, help="EAGLE or NEXTN (-> EAGLE): the checkpoint's MTP layer drafts"
    )
    p.add_argument("--speculative-draft-model-path", "--speculative-draft-model", default=None)
    p.add_argument("--speculative-num-steps", type=int, default=None)
    p.add_argument("--speculative-eagle-topk", type=int, default=None)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None)


def resolve_args(ns, error: Callable[[str], Any]) -> None:
    """sglang's resolution of the speculative flags on the parsed ``ns`` (module docstring); ``error``:
    argparse's (one line, exit 2)."""
    algo = ns.speculative_algorithm
    if algo is None:
        return
    upper = algo.upper()
    if upper not in BUILTIN and upper not in ALIASES:
        error(f"Unknown speculative algorithm name: {algo} (srt/speculative/spec_info.py)")
    if upper not in ALIASES:
        error(
            f"--speculative-algorithm {algo}: the CPU server serves EAGLE / NEXTN (the checkpoint's MTP layer as "
            "the draft) only"
        )
    ns.speculative_algorithm = ALGORITHM
    if ns.speculative_draft_model_path is None and architecture_of(ns.model_path) in draft_path_defaulted():
        ns.speculative_draft_model_path = ns.model_path
    if ns.max_running_requests is None:
        ns.max_running_requests = SPEC_DEFAULT_MAX_RUNNING
    if ns.speculative_num_steps is None:
        if ns.speculative_eagle_topk is not None or ns.speculative_num_draft_tokens is not None:
            error(
                "--speculative-eagle-topk / --speculative-num-draft-tokens without --speculative-num-steps: sglang "
                "asserts both unset before choosing all three (arg_groups/speculative_hook.py _handle_eagle_family)"
            )
        ns.speculative_num_steps, ns.speculative_eagle_topk, ns.speculative_num_draft_tokens = AUTO_PARAMS
    if ns.speculative_num_steps < 1:
        error(f"--speculative-num-steps {ns.speculative_num_steps}: the CPU server drafts at least 1 token per verify")
    if ns.speculative_eagle_topk is None:
        ns.speculative_eagle_topk = 1
    if ns.speculative_eagle_topk != 1:
        error(
            f"--speculative-eagle-topk {ns.speculative_eagle_topk}: the CPU server drafts top-1 chains only (no trees)"
        )
    # sglang: "speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 when speculative_eagle_topk == 1"
    ns.speculative_num_draft_tokens = ns.speculative_num_steps + 1


def draft_path_defaulted() -> tuple[str, ...]:
    """The architectures whose ``--speculative-draft-model-path`` sglang defaults to ``--model-path``
    (``_handle_eagle_family``'s list, as far as a registered family serves them: each family's
    ``sglang_draft_path_defaulted``)."""
    from gspo_megatron.models.registry import families

    return tuple(arch for f in families() if f.sglang_draft_path_defaulted for arch in f.architectures)


def parse_selector(selector: Any, use_sglang: bool = True) -> set[str]:
    """The runners a weight update's ``selector`` names: sglang's ``_parse_runner_selector``
    (``managers/scheduler_components/weight_updater.py``): ``all`` -> both, ``target`` / ``draft`` -> that
    one, anything else its ``ValueError`` ("invalid selector ...; expected 'target', 'draft', or 'all'").
    ``use_sglang``: call sglang's own function (the server holds sglang's models); else its three lines."""
    if not use_sglang:
        return _restated_selector(selector)
    try:
        from sglang.srt.managers.scheduler_components.weight_updater import _parse_runner_selector
    except Exception:  # noqa: BLE001 - sglang not importable here: the same three lines
        return _restated_selector(selector)
    return set(_parse_runner_selector(selector))


def _restated_selector(selector: Any) -> set[str]:
    if selector == "all":
        return {"target", "draft"}
    if selector in ("target", "draft"):
        return {selector}
    raise ValueError(f"invalid selector {selector!r}; expected 'target', 'draft', or 'all'")


def selector_refusal(body: dict) -> tuple[int, dict] | None:
    """What sglang's HTTP server answers for a body whose ``selector`` is not one of the Literal's values:
    FastAPI validates the msgspec struct through pydantic (``utils/msgspec_utils.py``
    ``msgspec_struct_pydantic_core_schema``) and answers 422 with pydantic's ``literal_error`` before the
    scheduler sees it. None for a valid (or absent: ``all``) selector."""
    return literal_refusal(body, "selector", SELECTORS)


# -- acceptance --------------------------------------------------------------------------------------
def accept_greedy(logits: torch.Tensor, drafts: Sequence[int]) -> tuple[int, int]:
    """sglang's greedy verify of a top-1 chain (``verify_tree_greedy_func``): logits [s + 1, V] of the verify
    rows, drafts [s]. Returns (n accepted drafts, the target's argmax of row n: the bonus token)."""
    target = logits.argmax(dim=-1).tolist()
    n = 0
    while n < len(drafts) and int(drafts[n]) == int(target[n]):
        n += 1
    return n, int(target[n])


def accept_sampled(
    probs: torch.Tensor,
    drafts: Sequence[int],
    coins: Sequence[float],
    final_coin: float,
    threshold_single: float = THRESHOLD,
    threshold_acc: float = THRESHOLD,
) -> tuple[int, int]:
    """sglang's ``TreeSpeculativeSamplingTargetOnly`` on a top-1 chain with ``draft_probs = 0`` (module
    docstring). probs [s + 1, V]: the target's (temperature, top-k, top-p renormalized) probabilities of the
    verify rows; drafts [s]; coins [s]: the uniform of each row (the kernel's ``uniform_samples`` at the last
    accepted node); final_coin: the uniform of the final draw. Returns (n accepted drafts, the token drawn
    after them: from row n with the rejected draft removed, or the bonus from row s)."""
    n, removed = 0, None
    for j, d in enumerate(drafts):
        p = float(probs[n, int(d)])
        if p > 0 and (float(coins[n]) < p / max(threshold_acc, 1e-9) or p >= threshold_single):
            n = j + 1
            continue
        removed = int(d)
        break
    q = probs[n].double().clone()
    if removed is not None:
        q[removed] = 0.0  # relu(q - draft_probs), draft_probs[d] = q[d]
    cums = torch.cumsum(q, 0)
    u = float(final_coin) * float(cums[-1])
    above = torch.nonzero(cums > u)
    valid = torch.nonzero(q > 0)
    if len(above):
        token = int(above[0])
    else:  # u at the very top of the mass: the kernel's last valid id
        token = int(valid[-1]) if len(valid) else q.numel() - 1
    return n, token


# -- generation --------------------------------------------------------------------------------------
@dataclass
class SpecCounts:
    """One request's speculative counts (sglang's ``Req`` fields)."""

    verify_ct: int = 0
    num_correct_drafts: int = 0
    histogram: list | None = None

    def add(self, n: int) -> None:
        self.verify_ct += 1
        self.num_correct_drafts += n
        h = self.histogram if self.histogram is not None else []
        h.extend([0] * (n + 1 - len(h)))
        h[n] += 1
        self.histogram = h

    def as_dict(self) -> dict:
        return {"verify_ct": self.verify_ct, "num_correct_drafts": self.num_correct_drafts, "histogram": self.histogram}


@dataclass(eq=False)
class SpecState:
    """One request between scheduler steps (:meth:`SpeculativeDecoder.start` / :meth:`~SpeculativeDecoder.cycle`):
    its target KV cache and final hidden states h_j of the committed tokens, the tokens committed since its
    prefill (``out_ids``, their log-probs) and its counts; ``routes``: the target forwards' route rows kept
    (None without a recorder)."""

    prompt: list[int]
    params: Any
    generator: torch.Generator
    stop_ids: Any
    cache: Any
    recurrent: bool  # a hybrid target's cache (Gated DeltaNet states: restored, not cropped)
    hidden: torch.Tensor
    counts: SpecCounts
    routes: list | None
    out_ids: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    stopped: bool = False

    @property
    def done(self) -> bool:
        return self.stopped or len(self.out_ids) >= self.params.max_new_tokens

    def emit(self, tokens: list[int], logps: list[float]) -> None:
        """Commit ``tokens`` in order until a stop token or ``max_new_tokens`` (as without speculation)."""
        for t, lp in zip(tokens, logps):
            self.out_ids.append(t)
            self.logps.append(lp)
            self.stopped = t in self.stop_ids
            if self.done:
                return

    def route_rows(self) -> torch.Tensor:
        """The route rows of ``prompt + out_ids`` over sglang's ``[0, seqlen - 1)``."""
        assert self.routes is not None
        return torch.cat(self.routes)[: len(self.prompt) + len(self.out_ids) - 1]


def spec_meta_info(counts: dict | None, completion_tokens: int, num_draft_tokens: int) -> dict:
    """sglang's ``_calculate_spec_decoding_metrics`` (``managers/tokenizer_manager.py``): nothing unless the
    request had a verify forward; else ``spec_accept_rate`` = correct / proposed (proposed = verify_ct *
    (num_draft_tokens - 1)), ``spec_accept_length`` = completion_tokens / verify_ct (the bonus included),
    ``spec_num_correct_drafts``, ``spec_num_proposed_drafts``, ``spec_verify_ct`` and the histogram."""
    if not counts or int(counts.get("verify_ct", 0)) <= 0:
        return {}
    verify = int(counts["verify_ct"])
    proposed = verify * (int(num_draft_tokens) - 1)
    out: dict = {}
    if proposed > 0:
        correct = int(counts["num_correct_drafts"])
        out = {
            "spec_accept_rate": correct / proposed,
            "spec_accept_length": completion_tokens / verify,
            "spec_num_correct_drafts": correct,
            "spec_num_proposed_drafts": proposed,
            "spec_verify_ct": verify,
        }
        if counts.get("histogram"):
            out["spec_correct_drafts_histogram"] = list(counts["histogram"])
    return out


class SpeculativeDecoder:
    """Rank 0's speculative generation (module docstring) on the transformers model of ``engine``
    (``engines.hf_engine.HFRolloutEngine``) with ``draft`` (``engines.mtp_draft.MTPDraft`` sharing that
    model's embedding and head) and ``steps`` draft tokens per verify. ``recorder``: a
    ``cpu_server.routes.RouteRecorder`` on the model, or None."""

    def __init__(self, engine: Any, draft: Any, steps: int, recorder: Any = None):
        self.engine, self.draft, self.steps, self.recorder = engine, draft, int(steps), recorder

    def _forward(self, ids: list[int], start: int, cache) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """One target forward of ``ids`` at positions ``start..``: (final hidden [n, H], logits [n, V] fp32,
        the routes [n, layers, topk] or None)."""
        dev = self.engine.device
        out = self.engine.model(
            input_ids=torch.tensor([ids], device=dev),
            position_ids=torch.arange(start, start + len(ids), device=dev)[None],
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=True,
        )
        routes = self.recorder.take(1, len(ids))[0] if self.recorder is not None else None
        return out.hidden_states[-1][0], out.logits[0].float(), routes

    def _propose(self, hidden: torch.Tensor, seq: list[int]) -> list[int]:
        """``steps`` top-1 draft tokens after ``seq`` (L tokens), from the target's h_0..h_{L-2} ``hidden``."""
        dev = hidden.device
        h, x = hidden, torch.tensor(seq[1:], device=dev)
        drafts = []
        for _ in range(self.steps):
            g, logits = self.draft(h, x, torch.arange(len(x), device=dev))
            d = int(logits[-1].float().argmax())
            drafts.append(d)
            h = torch.cat([h, g[-1:].to(h.dtype)])
            x = torch.cat([x, torch.tensor([d], device=dev)])
        return drafts

    @torch.no_grad()
    def start(
        self, prompt: Sequence[int], params: Any, generator: torch.Generator, stop_ids, counts: SpecCounts | None = None
    ) -> SpecState:
        """A request's prefill: the target's forward of ``prompt`` and its first token (as without speculation).
        params: ``engines.base.SamplingParams`` (temperature 0: a greedy batch); stop_ids: the request's stop
        tokens; counts: the request's counts so far (a retracted request's), else new."""
        from transformers import DynamicCache
        from transformers.cache_utils import LinearAttentionCacheLayerMixin

        from gspo_megatron.engines.hf_engine import HFRolloutEngine

        cache = DynamicCache(config=self.engine.model.config)
        prompt = [int(t) for t in prompt]
        hidden, logits, routes = self._forward(prompt, 0, cache)
        tok, lp = HFRolloutEngine._sample(logits[-1:], params, generator)
        state = SpecState(
            prompt=prompt,
            params=params,
            generator=generator,
            stop_ids=stop_ids,
            cache=cache,
            recurrent=any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers),
            hidden=hidden,
            counts=counts if counts is not None else SpecCounts(),
            routes=[routes] if routes is not None else None,
        )
        state.emit([int(tok[0])], [float(lp[0])])
        return state

    @torch.no_grad()
    def cycle(self, state: SpecState) -> None:
        """One draft-verify-accept cycle of an unfinished request (module docstring, steps 1-4), with
        ``state.params`` (the batch's greedy decision may change between cycles, as sglang's
        ``is_all_greedy``). The tokens it commits are appended to ``state``."""
        from gspo_megatron.engines.hf_engine import _top_k_top_p_filter

        params, generator = state.params, state.generator
        greedy = params.temperature == 0
        seq = state.prompt + state.out_ids
        drafts = self._propose(state.hidden, seq)
        L, last_committed = len(seq), seq[-1]
        before = copy.deepcopy(state.cache) if state.recurrent else None  # step 4: a state that cannot be cropped
        v_hidden, v_logits, v_routes = self._forward([last_committed] + drafts, L - 1, state.cache)
        if greedy:
            n, last = accept_greedy(v_logits, drafts)
        else:
            scaled = v_logits / params.temperature
            probs = torch.softmax(_top_k_top_p_filter(scaled, params.top_k, params.top_p), dim=-1)
            coins = torch.rand(len(drafts), generator=generator).tolist()
            final = float(torch.rand(1, generator=generator))
            n, last = accept_sampled(probs, drafts, coins, final)
        state.counts.add(n)
        emitted = drafts[:n] + [last]
        logp = torch.log_softmax(v_logits if greedy else v_logits / params.temperature, dim=-1)
        state.emit([int(t) for t in emitted], [float(logp[i, t]) for i, t in enumerate(emitted)])
        state.hidden = torch.cat([state.hidden, v_hidden[: n + 1]])
        if state.routes is not None:
            state.routes.append(v_routes[: n + 1])
        # keep positions 0..L+n-1 (the committed tokens but the last): drop the s - n rejected rows
        if before is None:
            state.cache.crop(-(len(drafts) - n))
        elif n < len(drafts):  # the state before the verify, run on the accepted tokens (routes dropped)
            state.cache = before
            self._forward([last_committed] + drafts[:n], L - 1, state.cache)

    def generate(self, prompt: Sequence[int], params: Any, generator: torch.Generator, stop_ids) -> dict:
        """One request from its prefill to its end (:meth:`start`, then :meth:`cycle` until it stops or
        reaches ``max_new_tokens``). Returns ``{"output_ids", "logprobs", "stopped", "spec": {...}, "routes"}``
        (routes int64 [P + R - 1, layers, topk] or None)."""
        state = self.start(prompt, params, generator, stop_ids)
        while not state.done:
            self.cycle(state)
        result: dict = {"output_ids": state.out_ids, "logprobs": state.logps, "stopped": state.stopped}
        result["spec"] = state.counts.as_dict()
        if state.routes is not None:
            result["routes"] = state.route_rows()
        return result
