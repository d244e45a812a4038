"""The CPU rollout engine on Hugging Face transformers (used where SGLang cannot run).

Called on global rank 0 only (directly, or inside a child process via ``subprocess_engine``).
Weights arrive in the *on-disk HF checkpoint layout* (one tensor per expert); transformers 5.x keeps
MoE experts fused in memory (``experts.gate_up_proj`` [E, 2I, H] = cat(gate, up) per expert along
dim 1, ``experts.down_proj`` [E, H, I]), so :class:`HFCheckpointLayout` maps each checkpoint name to
a view of the in-memory parameter. transformers' own converters (conversion_mapping.py) need the
whole expert set at once (MergeModulelist), which a partial weight-sync bucket does not provide,
hence this small explicit adapter; tests check it against ``revert_weight_conversion``.

A vision-language checkpoint (Qwen3.5-MoE's ``Qwen3_5MoeForConditionalGeneration``, model_type
qwen3_5_moe: ``text_config`` + ``vision_config``) is served as its language model alone: the engine
builds transformers' causal LM from ``config.get_text_config()`` (``Qwen3_5MoeForCausalLM``: prompts
are text, and for text transformers' vision-language forward is that model's forward) and
:class:`HFCheckpointLayout` names its ``model.*`` parameters as the checkpoint does,
``model.language_model.*`` (``lm_head.weight`` as is). Loading follows sglang 0.5.23's
``Qwen3_5MoeForConditionalGeneration.load_weights`` (``srt/models/qwen3_5.py``): a name with
``model.language_model.`` loads as ``model.`` (so the bare ``model.*`` spelling loads too), names
containing ``mtp`` are skipped, and the vision tower (``model.visual.*``, which sglang loads into its own
vision tower) is skipped here: the text-only engine holds none (:func:`language_model_of`).
"""

from __future__ import annotations

import copy
import glob
import os
import re
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, PretrainedConfig

from gspo_megatron.engines.base import RolloutEngine, RolloutSample, SamplingParams
from gspo_megatron.models.carried import COUNT_FIELDS as MTP_COUNT_FIELDS
from gspo_megatron.models.mtp_naming import MTP_BRANCH
from gspo_megatron.models.registry import expert_naming, experts_stacked, families, supported_model_types

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_FUSED_SUFFIXES = (".experts.gate_up_proj", ".experts.down_proj")
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
# model_type -> the name prefix a vision-language checkpoint of it (a config with ``text_config``) keeps the
# language model's ``model.`` under (transformers 5.23's ``Qwen3_5MoeModel.language_model``): the family's
# ``language_model_prefix``
LANGUAGE_MODEL_PREFIXES: dict[str, str] = {
    mt: f.language_model_prefix for f in families() if f.language_model_prefix for mt in f.model_types
}
# what sglang 0.5.23's Qwen3_5MoeForConditionalGeneration.load_weights does not load into its language model:
# names containing "mtp" (skipped) and the vision tower (``model.visual.``, loaded as ``visual.``): the
# families' ``language_model_excluded``
_NOT_LANGUAGE_MODEL: tuple[str, ...] = tuple(dict.fromkeys(p for f in families() for p in f.language_model_excluded))


def language_model_of(config: PretrainedConfig) -> tuple[PretrainedConfig, str | None]:
    """(the config transformers' causal LM is built from, the checkpoint prefix of its ``model.`` names):
    ``(text_config, "model.language_model.")`` for a vision-language checkpoint's config
    (:data:`LANGUAGE_MODEL_PREFIXES`), ``(config, None)`` for any other. The text config (a copy) takes
    the checkpoint's top-level ``tie_word_embeddings``, as transformers' conditional-generation model
    ties by it and sglang's ``Qwen3VLForConditionalGeneration.__init__`` (``models/qwen3_vl.py``) copies it."""
    prefix = LANGUAGE_MODEL_PREFIXES.get(str(getattr(config, "model_type", "")))
    if prefix is None or getattr(config, "text_config", None) is None:
        return config, None
    text = copy.deepcopy(config.get_text_config())
    if hasattr(config, "tie_word_embeddings"):
        text.tie_word_embeddings = config.tie_word_embeddings
    return text, prefix


def checkpoint_name(name: str, prefix: str | None) -> str:
    """The checkpoint's spelling of a name sglang's ``load_weights`` loads into the language model:
    with ``prefix`` (``model.language_model.``), ``model.X`` (not the vision tower) -> ``prefix + X``;
    other names unchanged."""
    if prefix and name.startswith("model.") and not name.startswith((prefix, *_NOT_LANGUAGE_MODEL)):
        return prefix + name.removeprefix("model.")
    return name


_MTP_BRANCH = MTP_BRANCH.branch  # Qwen3-Next's / Qwen3.5's MTP layer, loaded by sglang as a draft model


def outside_language_model(name: str, prefix: str | None) -> bool:
    """With ``prefix`` (a vision-language checkpoint): a checkpoint name sglang does not load into the
    language model (``mtp`` in it, the vision tower), which a text-only engine skips."""
    return bool(prefix) and ("mtp" in name or name.startswith(_NOT_LANGUAGE_MODEL))


class HFCheckpointLayout:
    """Maps HF checkpoint-layout names to (views of) a transformers model's in-memory parameters.

    prefix: the checkpoint prefix of the model's ``model.`` names (a vision-language checkpoint's
    language model, :func:`language_model_of`), or None (names as in memory)."""

    def __init__(self, model: PreTrainedModel, prefix: str | None = None):
        self.prefix = prefix
        self.model_type: str = model.config.model_type
        self.params: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
        # persistent buffers are checkpoint tensors too (DeepSeek's router e_score_correction_bias)
        persistent = set(model.state_dict(keep_vars=True))
        self.params.update((n, b) for n, b in model.named_buffers() if n in persistent)
        has_fused = any(n.endswith(_FUSED_SUFFIXES) for n in self.params)
        self.naming = expert_naming(self.model_type)  # the family's checkpoint naming of experts
        if has_fused and self.naming is None and not experts_stacked(self.model_type):
            raise NotImplementedError(
                f"model_type {self.model_type!r} keeps fused experts in memory but has no checkpoint "
                f"naming rule; supported model_types: {', '.join(supported_model_types())}"
            )
        # the MTP layers the config declares, ``model.layers.{i}`` for N <= i < N + M, and the decoder layers
        # this model holds (:meth:`skipped`)
        self.num_layers = int(getattr(model.config, "num_hidden_layers", 0) or 0)
        self.mtp_layers = max(int(getattr(model.config, f, 0) or 0) for f in MTP_COUNT_FIELDS)
        self._held_layers = {int(m.group(1)) for n in self.params if (m := _LAYER_INDEX.match(self.memory_name(n)))}
        self._holds_mtp_branch = any(n.startswith(_MTP_BRANCH) for n in self.params)
        self._expert_re = None
        if self.naming is not None:
            n = self.naming
            self._expert_re = re.compile(
                rf"^(?P<prefix>.+)\.{re.escape(n.block)}\.experts\.(?P<expert>\d+)\."
                rf"(?P<proj>{re.escape(n.gate)}|{re.escape(n.up)}|{re.escape(n.down)})\.weight$"
            )

    def memory_name(self, name: str) -> str:
        """The in-memory spelling of checkpoint name ``name`` (``prefix + X`` -> ``model.X``)."""
        if self.prefix and name.startswith(self.prefix):
            return "model." + name.removeprefix(self.prefix)
        return name

    def skipped(self, name: str) -> bool:
        """A checkpoint name loads nowhere here, without error: outside a vision-language checkpoint's
        language model (:func:`outside_language_model`), or of a decoder layer at or past
        ``num_hidden_layers`` that the model does not hold: the multi-token-prediction layers
        ``model.layers.{i}.*``, N <= i < N + M, of a config declaring M > 0 of them
        (``num_nextn_predict_layers``...), which a weight sync sends with ``model.mtp``, as sglang 0.5.23's
        target loader skips them (``srt/models/glm4_moe.py`` ``load_weights`` and
        ``srt/models/deepseek_common/deepseek_weight_loader.py`` ``NextNDisabledConfig``: with
        ``num_nextn_predict_layers > 0`` a name of layer >= ``num_hidden_layers`` is ``continue``d; the
        draft loads them), and likewise Qwen3-Next's MTP branch ``mtp.*`` (``srt/models/qwen3_next.py``
        ``load_weights``: a name with ``mtp`` is ``continue``d unless ``is_mtp``) when the model holds none
        of it. Any other unknown name is an error (:meth:`target`)."""
        if outside_language_model(name, self.prefix):
            return True
        if name.startswith(_MTP_BRANCH) and self.mtp_layers and not self._holds_mtp_branch:
            return True
        m = _LAYER_INDEX.match(self.memory_name(name))
        if m is None or not self.mtp_layers:
            return False
        i = int(m.group(1))
        return self.num_layers <= i < self.num_layers + self.mtp_layers and i not in self._held_layers

    def target(self, name: str) -> torch.Tensor:
        """The in-memory view that checkpoint tensor ``name`` occupies (same shape as on disk)."""
        name = self.memory_name(name)
        if self._expert_re is not None:
            m = self._expert_re.match(name)
            if m is not None:
                return self._expert_view(name, m)
            if self.naming.block != "mlp":
                name_in_memory = name.replace(f".{self.naming.block}.", ".mlp.")
                if name_in_memory in self.params:
                    return self.params[name_in_memory]
        if name in self.params:
            return self.params[name]
        raise KeyError(f"unknown weight name {name!r} for model_type {self.model_type!r}")

    def _expert_view(self, name: str, m: re.Match) -> torch.Tensor:
        prefix, expert, proj = m.group("prefix"), int(m.group("expert")), m.group("proj")
        fused = "down_proj" if proj == self.naming.down else "gate_up_proj"
        param_name = f"{prefix}.mlp.experts.{fused}"
        if param_name not in self.params:
            raise KeyError(f"unknown weight name {name!r}: no parameter {param_name!r} in memory")
        param = self.params[param_name]
        if expert >= param.shape[0]:
            raise KeyError(f"weight {name!r}: expert {expert} out of range (num_experts={param.shape[0]})")
        if proj == self.naming.down:
            return param[expert]
        inter = param.shape[1] // 2
        return param[expert, :inter] if proj == self.naming.gate else param[expert, inter:]

    def checkpoint_names(self) -> list[str]:
        """Every name this model has in the checkpoint layout (tied weights listed once)."""
        names: list[str] = []
        seen: set[int] = set()
        for pname, param in self.params.items():
            if id(param) in seen:
                continue
            seen.add(id(param))
            if self.naming is not None and pname.endswith(_FUSED_SUFFIXES):
                prefix, fused = pname.rsplit(".mlp.experts.", 1)
                n = self.naming
                projs = (n.gate, n.up) if fused == "gate_up_proj" else (n.down,)
                for e in range(param.shape[0]):
                    names += [f"{prefix}.{n.block}.experts.{e}.{p}.weight" for p in projs]
            elif self.naming is not None and self.naming.block != "mlp" and ".mlp." in pname:
                names.append(pname.replace(".mlp.", f".{self.naming.block}.", 1))
            else:
                names.append(pname)
        return [checkpoint_name(n, self.prefix) for n in names]

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one checkpoint-layout tensor into the model (none for a :meth:`skipped` name); the
        shape must match exactly."""
        if self.skipped(name):
            return
        dst = self.target(name)
        if tuple(tensor.shape) != tuple(dst.shape):
            raise ValueError(
                f"weight {name!r}: shape {tuple(tensor.shape)} does not match the model's {tuple(dst.shape)}"
            )
        dst.copy_(tensor.to(device=dst.device, dtype=dst.dtype))


def _top_k_top_p_filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits [B, V] outside the top-k / nucleus (top-p) set with -inf (at least one token kept)."""
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        remove_sorted = mass_before >= top_p  # the first token always has mass_before == 0
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


class HFRolloutEngine(RolloutEngine):
    """Batched sampling with a KV cache on a transformers causal LM (fp32 on CPU by default).

    config: a ``PretrainedConfig``, its ``to_dict()`` (must hold ``model_type``), or a directory.
    weights: a checkpoint-layout state dict, a directory of ``*.safetensors``, or None (random init;
    weights then come through ``update_weights``). max_batch_size bounds sequences per forward.
    """

    def __init__(
        self,
        config: PretrainedConfig | Mapping | str | os.PathLike,
        weights: Mapping[str, torch.Tensor] | str | os.PathLike | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        attn_implementation: str = "sdpa",
        max_batch_size: int = 256,
        seed: int = 0,
        device: str = "cpu",
    ):
        self.config = _as_config(config)
        lm_config, prefix = language_model_of(self.config)  # a vision-language checkpoint: its language model
        model_cls = AutoModelForCausalLM._model_mapping.get(type(lm_config), None)
        # transformers 5 annotates the mapping's values as (class, class) pairs; this one holds a class
        if attn_implementation == "sdpa" and model_cls is not None and not model_cls._supports_sdpa:  # type: ignore[attr-defined]
            attn_implementation = "eager"  # e.g. gpt-oss (attention sinks): transformers has no SDPA path
        with torch.random.fork_rng(devices=[]):  # random init must not move the caller's RNG
            torch.manual_seed(seed)
            self.model = AutoModelForCausalLM.from_config(
                lm_config, attn_implementation=attn_implementation, dtype=dtype
            )
        self.model.to(device).eval()
        self.device = torch.device(device)
        self.layout = HFCheckpointLayout(self.model, prefix)
        self.max_batch_size = max_batch_size
        self._generator = torch.Generator(device="cpu").manual_seed(seed)
        self.weight_version = 0
        if weights is not None:
            self.load_weights(weights)

    # ----------------------------------------------------------------------------------- weights
    def load_weights(self, weights: Mapping[str, torch.Tensor] | str | os.PathLike) -> None:
        """Load a full checkpoint-layout state dict or a directory of safetensors files."""
        if isinstance(weights, (str, os.PathLike)):
            files = sorted(glob.glob(os.path.join(str(weights), "*.safetensors")))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in weights directory {weights}")
            for f in files:
                self.update_weights(list(load_file(f).items()))
        else:
            self.update_weights(list(weights.items()))

    def update_weights(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in bucket:
            self.layout.load(name, tensor)

    def end_weight_update(self) -> None:
        self.weight_version += 1

    def weight_checksums(self, names: Iterable[str]) -> dict[str, float]:
        return {n: float(self.layout.target(n).detach().to(torch.float64).sum()) for n in names}

    def checkpoint_names(self) -> list[str]:
        """All weight names of the model in the HF checkpoint layout."""
        return self.layout.checkpoint_names()

    # -------------------------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams) -> list[list[RolloutSample]]:
        _check_params(params, n)
        generator = self._generator
        if params.seed is not None:
            generator = torch.Generator(device="cpu").manual_seed(params.seed)
        flat = [list(map(int, p)) for p in prompts for _ in range(n)]
        for i, p in enumerate(flat):
            if not p:
                raise ValueError(f"prompt {i // n} is empty")
        samples: list[RolloutSample] = []
        for start in range(0, len(flat), self.max_batch_size):
            samples += self._generate_batch(flat[start : start + self.max_batch_size], params, generator)
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _generate_batch(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        generator: torch.Generator,
        recorder: Any = None,
        indexer_recorder: Any = None,
    ) -> list[RolloutSample]:
        """recorder: a ``cpu_server.routes.RouteRecorder`` on this model, or None; with one, each
        sample's ``routed_experts`` is int32 [P + R - 1, num_hidden_layers, topk]: the prompt's
        routes from the prefill, then each output token's but the last from the decode step that
        fed it in (sglang's ``[0, seqlen - 1)``). indexer_recorder: a ``cpu_server.routes.IndexerRecorder``
        (DSA models) or None; with one, ``indexer_topk`` int32 [P + R - 1, num_hidden_layers,
        index_topk] the same way: each query's selected key positions (-1 where fewer keys exist)."""
        batch, width = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.zeros(batch, width, dtype=torch.long)
        mask = torch.zeros(batch, width, dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding
            input_ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        stop_ids = torch.tensor(sorted(set(params.stop_token_ids)), dtype=torch.long, device=self.device)
        cache = DynamicCache(config=self.model.config)
        tokens_out, logprobs_out = [], []
        finished = torch.zeros(batch, dtype=torch.bool, device=self.device)
        stopped = torch.zeros(batch, dtype=torch.bool, device=self.device)
        step_ids, step_pos = input_ids, positions
        step_routes: list[torch.Tensor] = []  # per forward: [batch, step_len, layers, topk]
        step_index: list[torch.Tensor] = []  # per forward: [batch, step_len, layers, index_topk]
        pads = torch.tensor([width - len(p) for p in prompts])
        for _ in range(params.max_new_tokens):
            out = self.model(
                input_ids=step_ids,
                attention_mask=mask,
                position_ids=step_pos,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            cache = out.past_key_values
            if recorder is not None:
                step_routes.append(recorder.take(batch, step_ids.shape[1]))
            if indexer_recorder is not None:
                step_index.append(indexer_recorder.take(pads, step_pos))
            token, logprob = self._sample(out.logits[:, -1, :].float(), params, generator)
            tokens_out.append(torch.where(finished, -1, token))
            logprobs_out.append(logprob)
            if stop_ids.numel():
                hit = torch.isin(token, stop_ids) & ~finished
                stopped |= hit
                finished |= hit
            if bool(finished.all()):
                break
            mask = torch.cat([mask, torch.ones(batch, 1, dtype=mask.dtype, device=self.device)], dim=1)
            step_pos = step_pos[:, -1:] + 1
            step_ids = token[:, None]
        tokens = torch.stack(tokens_out, dim=1).cpu()
        logprobs = torch.stack(logprobs_out, dim=1).cpu()
        result = []
        for i in range(batch):
            keep = tokens[i] >= 0
            routes = selection = None
            n_out = int(keep.sum())
            if recorder is not None:
                parts = [step_routes[0][i, width - len(prompts[i]) :]] + [r[i] for r in step_routes[1:n_out]]
                routes = torch.cat(parts).to(torch.int32).numpy()
            if indexer_recorder is not None:
                parts = [step_index[0][i, width - len(prompts[i]) :]] + [r[i] for r in step_index[1:n_out]]
                selection = torch.cat(parts).to(torch.int32).numpy()
            result.append(
                RolloutSample(
                    prompt_ids=prompts[i],
                    response_ids=tokens[i][keep].tolist(),
                    response_logprobs=logprobs[i][keep].tolist(),
                    finish_reason="stop" if bool(stopped[i]) else "length",
                    routed_experts=routes,
                    indexer_topk=selection,
                )
            )
        return result

    @staticmethod
    def _sample(
        logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw one token per row of ``logits`` [B, V]; return (token [B], log-prob [B]).

        The log-prob is log_softmax(logits / T)[token] of the unfiltered distribution; T == 0 means
        greedy, with the log-prob of the T == 1 distribution."""
        if params.temperature == 0:
            token = logits.argmax(dim=-1)
            return token, torch.log_softmax(logits, dim=-1).gather(-1, token[:, None])[:, 0]
        scaled = logits / params.temperature
        logp = torch.log_softmax(scaled, dim=-1)
        filtered = _top_k_top_p_filter(scaled, params.top_k, params.top_p)
        probs = torch.softmax(filtered, dim=-1)
        token = torch.multinomial(probs.cpu(), 1, generator=generator)[:, 0].to(logits.device)
        return token, logp.gather(-1, token[:, None])[:, 0]


def _check_params(params: SamplingParams, n: int) -> None:
    if n < 1:
        raise ValueError(f"n (samples per prompt) must be >= 1, got {n}")
    if params.temperature < 0:
        raise ValueError(f"SamplingParams.temperature must be >= 0, got {params.temperature}")
    if not 0.0 < params.top_p <= 1.0:
        raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {params.top_p}")
    if params.top_k == 0 or params.top_k < -1:
        raise ValueError(f"SamplingParams.top_k must be -1 (off) or >= 1, got {params.top_k}")
    if params.max_new_tokens < 1:
        raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {params.max_new_tokens}")


def _as_config(config: PretrainedConfig | Mapping | str | os.PathLike) -> PretrainedConfig:
    if isinstance(config, PretrainedConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        return AutoConfig.from_pretrained(str(config))
    if isinstance(config, Mapping):
        if "model_type" not in config:
            raise ValueError("config dict has no 'model_type' field")
        cfg = dict(config)
        return AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    raise TypeError(f"config must be a PretrainedConfig, a dict or a directory, got {type(config).__name__}")
