"""Start-up checks of everything the user gave us, before any model is built (``gspo-train`` and
``gspo-train --check`` run them; every rank runs them, no collectives, so every rank reaches the same
verdict and only rank 0 needs to print it).

In order (each raises :class:`~gspo_megatron.errors.UserInputError` with one line naming the field,
or the file and line):

1. the config: world size, layout against the model's dims (:func:`check_config`);
2. ``output_dir``: a directory we can create and write (:func:`check_output_dir`);
3. the model files: with ``model.init=pretrained``, ``model.hf_path`` holds config.json, readable
   safetensors (single file or index + shards) of a supported family (:func:`check_hf_dir`), and the MTP
   layer's tensors where the draft is used (:func:`check_mtp_tensors`);
4. the tokenizer the run will use: present, non-empty, its ids inside the model's vocabulary, a chat
   template when ``data.apply_chat_template`` (:func:`load_checked_tokenizer`);
5. the data: every row parsed, keys present, prompt lengths within ``data.max_prompt_len``, not empty
   (the very dataset the trainer builds, :func:`check_data`);
6. the reward function: imported (a syntax error is named with file:line), its signature bound to
   ``(prompt, response, label)`` (with ``reward.group``: ``(prompt, responses, label)``) and one call
   on the first data row returning a finite number (a list of them) (:func:`check_reward`); not with
   ``reward.url`` (a server is judged by its answers, counted during the run); the eval sets
   (``eval.datasets``, read and tokenized like the data: :func:`check_eval_data`);
6b. the custom rollout hook (``rollout.custom_function``): imported, callable as
   ``fn(generate, sample)``, and one call on the first data row with a stand-in engine that ends
   every turn at once returns a well-formed result (:func:`check_custom_rollout`);
6c. the distillation teachers (``distill.teachers``): running servers answer, every teacher's
   tokenizer is the student's (:func:`check_teachers`);
7. checkpoints to resume from (``checkpoint.load`` or ``output_dir/checkpoints``) and
   ``model.checkpoint``: the model config stored with them equals this model's, their ``model.lora``
   (metadata) equals the config's (:func:`check_lora_matches`), so does their ``model.mtp``
   (:func:`check_mtp_matches`), and a resume uses the layout the
   optimizer state was written in (:func:`check_checkpoints`).
"""

from __future__ import annotations

import inspect
import math
import os
import traceback
from dataclasses import fields
from typing import TYPE_CHECKING, Any, Callable

from gspo_megatron.config import Config
from gspo_megatron.errors import UserInputError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def run_all(cfg: Config, world_size: int | None = None) -> None:
    """Every start-up check (see the module docstring). Raises UserInputError."""
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    hf = check_config(cfg, world_size)
    check_output_dir(cfg.output_dir)
    if cfg.model.init == "pretrained":
        check_hf_dir(cfg.model.hf_path, "model.hf_path")
        check_mtp_tensors(cfg, hf)
    tokenizer = load_checked_tokenizer(cfg, hf)
    dataset = check_data(cfg, tokenizer)
    if cfg.reward.url is None:  # a reward server is checked by its answers (counted failures)
        check_reward(cfg.reward.function, dataset[0], group=cfg.reward.group)
    check_eval_data(cfg, tokenizer)
    if cfg.rollout.custom_function:
        check_custom_rollout(cfg, dataset[0], tokenizer)
    if cfg.distill.teachers:
        check_teachers(cfg, tokenizer)
    check_checkpoints(cfg, hf)


def check_teachers(cfg: Config, tokenizer) -> None:
    """``distill.teachers``: running servers answer, every teacher shares the student's tokenizer
    (``distill.teachers.check_teachers``)."""
    from gspo_megatron.distill.teachers import check_teachers as _check
    from gspo_megatron.features.distill import parse_teachers

    _check(parse_teachers(cfg.distill.teachers)[0], tokenizer)


# ---------------------------------------------------------------------------------------------
def check_config(cfg: Config, world_size: int) -> dict:
    """World size and layout vs. the model's dims; returns the model's HF config (a dict)."""
    import torch

    from gspo_megatron.config import validate, validate_model_layout
    from gspo_megatron.fleet.engine_startup_checks import startup_refusals
    from gspo_megatron.models.arch import model_hf_config

    validate(cfg, world_size=world_size)
    hf, where = model_hf_config(cfg)
    try:
        validate_model_layout(cfg, hf)
        startup_refusals(cfg, hf)
    except UserInputError:
        raise
    except ValueError as e:  # ModelDims.from_hf_config: a config.json it cannot read
        raise UserInputError(f"{where}: {e}") from None
    if cfg.parallel.cp > 1 and not torch.cuda.is_available():
        raise UserInputError(
            "parallel.cp > 1 needs Transformer Engine's context-parallel attention (a CUDA GPU); this machine has none"
        )
    return hf


def check_output_dir(path: str) -> None:
    """``output_dir`` is a directory (or can be created as one) that we can write in."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserInputError(f"output_dir {path!r} is a file, not a directory; choose another output_dir")
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise UserInputError(f"output_dir {path!r} cannot be created: {probe!r} is a file")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserInputError(f"output_dir {path!r}: no permission to write in {probe!r}")


def check_hf_dir(path: str | None, field: str) -> dict:
    """config.json + safetensors (index and shards) of a supported family; returns config.json."""
    from gspo_megatron.convert import check_hf_dir as _check

    if not path:
        raise UserInputError(f"{field} must name a Hugging Face model directory")
    try:
        return _check(path)
    except (ValueError, FileNotFoundError, KeyError) as e:  # UsageError (a UserInputError) included
        raise UserInputError(f"{field}: {e}") from None


def check_mtp_tensors(cfg: Config, hf: dict) -> None:
    """With the checkpoint's MTP layer in use (``model.mtp``: the model loads it from ``model.hf_path``;
    ``rollout.speculative``: the engines' draft loads it from there, sglang's ``--speculative-draft-model-path``
    defaulting to the model path), ``model.hf_path`` holds its tensors: its own four and its decoder layer's
    (``models/mtp_naming.py``). A config.json declaring the layer over safetensors without it is common:
    transformers' ``save_pretrained`` keeps the config field and drops the tensors."""
    from gspo_megatron.models.carried import COUNT_FIELDS, mtp_layers
    from gspo_megatron.models.mtp import mtp_naming
    from gspo_megatron.models.safetensors_reader import SafetensorsReader

    if not (cfg.mtp_in_model or cfg.rollout.speculative) or not mtp_layers(hf) or not cfg.model.hf_path:
        return  # nothing loads the layer here, or a checkpoint without one (refused with the config's checks)
    naming = mtp_naming(hf)
    reader = SafetensorsReader(cfg.model.hf_path)
    try:
        names = set(reader.names())
    finally:
        reader.close()
    prefix = naming.prefix(hf)
    missing = [n for n in naming.own(hf).values() if n not in names]
    if not any(n.startswith(prefix) for n in names):
        missing.append(prefix + "*")
    if missing:
        declared = next((f for f in COUNT_FIELDS if hf.get(f)), COUNT_FIELDS[0])
        raise UserInputError(
            f"model.hf_path {cfg.model.hf_path}: config.json declares an MTP layer ({declared}={mtp_layers(hf)}) "
            f"but its safetensors lack {len(missing)} of its tensors, e.g. {missing[0]} (transformers' "
            "save_pretrained drops them); rollout.speculative and model.mtp need the layer: use a checkpoint "
            "with it (the published one), or set rollout.speculative=false and model.mtp=false"
        )


# ---------------------------------------------------------------------------------------------
def tokenizer_dir(cfg: Config) -> str | None:
    """Where the run's tokenizer comes from (mirrors factory.hf_init_dir): model.hf_path for
    pretrained; for random init an existing ``output_dir/hf_init``, else model.hf_path when it has
    tokenizer files, else None (the built-in demo tokenizer)."""
    if cfg.model.init == "pretrained":
        return cfg.model.hf_path
    init = os.path.join(cfg.output_dir, "hf_init")
    if os.path.exists(os.path.join(init, "model.safetensors")):
        return init
    hf_path = cfg.model.hf_path
    if hf_path and os.path.exists(os.path.join(hf_path, "tokenizer_config.json")):
        return hf_path
    return None


def load_checked_tokenizer(cfg: Config, hf: dict):
    """The tokenizer the run will use, checked against the model's vocabulary and the data options."""
    from gspo_megatron.data.tokenizer import build_demo_tokenizer, load_tokenizer

    src = tokenizer_dir(cfg)
    tok: PreTrainedTokenizerBase
    if src is None:
        tok, where = build_demo_tokenizer(), "the built-in demo tokenizer"
    else:
        field = "model.hf_path" if src == cfg.model.hf_path else "output_dir"
        present = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(src, f))]
        if not present:
            raise UserInputError(
                f"{field}: {src} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); save the "
                "model's tokenizer there (tokenizer.save_pretrained(dir))"
            )
        try:
            tok = load_tokenizer(src)
        except Exception as e:  # noqa: BLE001 - transformers raises many types for a bad tokenizer
            raise UserInputError(
                f"{field}: cannot load the tokenizer in {src}: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
            ) from None
        where = f"the tokenizer in {src}"
    n = len(tok)
    if n == 0 or not tok.encode("hello", add_special_tokens=False):
        raise UserInputError(f"{where} is empty (it encodes text to no tokens)")
    vocab = int(hf.get("vocab_size") or 0)
    if vocab and n > vocab:
        raise UserInputError(
            f"{where} has {n} tokens but the model's vocab_size is {vocab}: token ids would fall outside the "
            "embedding table (a tokenizer of another model?)"
        )
    if cfg.data.apply_chat_template and not getattr(tok, "chat_template", None):
        raise UserInputError(
            f"data.apply_chat_template=true but {where} has no chat template; add one "
            "(chat_template.jinja) or set data.apply_chat_template=false to feed prompts as plain text"
        )
    return tok


def check_data(cfg: Config, tokenizer):
    """The trainer's dataset, built exactly as rank 0 builds it (every row parsed and tokenized)."""
    from gspo_megatron.factory import build_dataset

    try:
        return build_dataset(cfg, tokenizer)
    except UserInputError:
        raise
    except (OSError, ValueError) as e:
        raise UserInputError(f"data.path: {e}") from None


# ---------------------------------------------------------------------------------------------
def _user_frame(tb, path: str | None) -> str:
    """``file:line`` of the innermost traceback frame in the user's file (or the innermost frame)."""
    frames = traceback.extract_tb(tb)
    if not frames:
        return ""
    mine = [f for f in frames if path and os.path.abspath(f.filename) == path]
    f = (mine or frames)[-1]
    return f" at {f.filename}:{f.lineno}"


def check_eval_data(cfg: Config, tokenizer) -> None:
    """Every eval.datasets entry, built as rank 0 builds it (every row parsed and tokenized)."""
    from gspo_megatron.evaluation import build_eval_sets

    if cfg.eval.interval > 0:
        build_eval_sets(cfg, tokenizer)


def check_reward(spec: str, row, group: bool = False) -> None:
    """Import the reward function, bind its signature, call it once on ``row`` (a PromptRow) with the
    label as the response; the result must be a finite number. ``group`` (reward.group): called as
    fn(prompt, [label, label], label), the result must be two finite numbers."""
    from gspo_megatron.rewards.grouping import as_group_rewards
    from gspo_megatron.rewards.outcomes import as_reward
    from gspo_megatron.rewards.registry import get_reward_fn

    user_file = os.path.abspath(spec.rpartition(":")[0]) if spec.rpartition(":")[0].endswith(".py") else None
    try:
        # with ``group`` a group reward: fn(prompt, [responses], label) -> [rewards]
        fn: Callable[..., Any] = get_reward_fn(spec)
    except SyntaxError as e:
        raise UserInputError(f"reward.function {spec!r}: syntax error at {e.filename}:{e.lineno}: {e.msg}") from None
    except Exception as e:  # noqa: BLE001 - the user's module may raise anything while importing
        raise UserInputError(
            f"reward.function {spec!r}: {type(e).__name__}: {e}"
            f"{_user_frame(e.__traceback__, user_file) if user_file else ''}"
        ) from None
    name = getattr(fn, "__name__", spec)
    response = [str(row.label)] * 2 if group else str(row.label)
    shown = "responses" if group else "response"
    try:
        sig = inspect.signature(fn)
        sig.bind(row.prompt, response, row.label)
    except TypeError as e:
        raise UserInputError(
            f"reward.function {spec!r}: {name}{sig} cannot be called as {name}(prompt, {shown}, label): {e}"
        ) from None
    except ValueError:  # no signature (a builtin): the call below checks it
        pass
    try:
        value = fn(row.prompt, response, row.label)
        values = as_group_rewards(value, 2) if group else [as_reward(value)]
    except Exception as e:  # noqa: BLE001
        what = "responses = [label, label], reward.group=true" if group else "response = its label"
        raise UserInputError(
            f"reward.function {spec!r} failed when called on {row.source} ({what}): "
            f"{type(e).__name__}: {e}{_user_frame(e.__traceback__, user_file)}"
        ) from None
    if not all(math.isfinite(v) for v in values):
        raise UserInputError(f"reward.function {spec!r} returned {value} on {row.source} (response = its label)")


def check_custom_rollout(cfg: Config, row, tokenizer) -> None:
    """The rollout hook loads, binds ``(generate, sample)`` and returns a well-formed result on
    ``row`` (see ``engines.custom.dry_run``)."""
    from gspo_megatron.engines.custom import dry_run

    assert cfg.rollout.custom_function, "called only with rollout.custom_function set"
    dry_run(cfg.rollout.custom_function, row, tokenizer, cfg.model.max_seq_len, tokenizer.eos_token_id)


# ---------------------------------------------------------------------------------------------
def _dims(hf: dict):
    from gspo_megatron.models.dims import ModelDims

    try:
        return ModelDims.from_hf_config(hf)
    except ValueError:
        return None


def model_config_difference(stored: dict, current: dict) -> list[str]:
    """The architecture dims that differ between two HF configs (``name stored -> current``)."""
    a, b = _dims(stored), _dims(current)
    if a is None or b is None:
        keys = (
            "model_type",
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "moe_intermediate_size",
            "num_experts",
            "num_local_experts",
        )
        return [f"{k} {stored.get(k)} vs {current.get(k)}" for k in keys if stored.get(k) != current.get(k)]
    return [
        f"{f.name} {getattr(a, f.name)} vs {getattr(b, f.name)}"
        for f in fields(a)
        if getattr(a, f.name) != getattr(b, f.name)
    ]


def _newest_checkpoint(root: str, field: str, required: bool) -> tuple[str, dict] | None:
    from gspo_megatron.checkpoint.manager import CheckpointError, list_checkpoints, read_meta, resolve_checkpoint

    if not os.path.exists(root):
        if required:
            raise UserInputError(f"{field}: {root} does not exist")
        return None
    if not required and not list_checkpoints(root):
        return None
    try:
        path = resolve_checkpoint(root)[0]
        return path, read_meta(path)
    except CheckpointError as e:
        if not required:
            return None  # incomplete ones only: the trainer warns and starts fresh / falls back
        raise UserInputError(f"{field}: {e}") from None


LORA_KEYS = ("rank", "alpha", "dropout", "target_modules")  # what a checkpoint's adapters depend on


def lora_of(lora) -> dict | None:
    """``model.lora`` as compared with a checkpoint's metadata (its ``lora``): None when off (rank 0
    or absent), else {rank, alpha, dropout, target_modules} (the init seed does not matter once the
    adapters are loaded)."""
    if lora is None:
        return None
    get: Callable[[str], Any] = lora.get if isinstance(lora, dict) else lambda k: getattr(lora, k)
    if not get("rank"):
        return None
    return dict(
        rank=int(get("rank")),
        alpha=float(get("alpha")),
        dropout=float(get("dropout")),
        target_modules=list(get("target_modules")),
    )


def check_lora_matches(cfg: Config, meta: dict, field: str, path: str) -> None:
    """A checkpoint holds exactly the adapters its ``model.lora`` built (the model loads strictly):
    a different ``model.lora`` is refused here, before any model is built, with both values."""
    here, stored = lora_of(cfg.model.lora), lora_of(meta.get("lora"))
    if here == stored:
        return
    hint = (
        "resume with the checkpoint's model.lora"
        if field != "model.checkpoint"
        else "start from the checkpoint's model.lora, or export it (tools/megatron_to_hf.py: the adapters merged) "
        "and start from model.hf_path"
    )
    if here and stored:
        what = ", ".join(f"{k} {here[k]} here vs {stored[k]}" for k in LORA_KEYS if here[k] != stored[k])
    else:
        what = f"{here or 'off (rank 0)'} here vs {stored or 'off (rank 0)'}"
    raise UserInputError(
        f"model.lora differs from the one {field}'s checkpoint {path} was trained with "
        f"({what} in the checkpoint); {hint}"
    )


def check_mtp_matches(cfg: Config, meta: dict, field: str, path: str) -> None:
    """A checkpoint holds the MTP layer exactly when its model did (``model.mtp``, its metadata's ``mtp``):
    the model loads strictly, and a checkpoint written with the layer keeps only its ``embed_tokens`` /
    ``shared_head.head`` carried (``models/carried.py``), so reading it without the layer would lose the
    trained draft. Refused here, before any model is built."""
    here, stored = bool(cfg.mtp_in_model), bool(meta.get("mtp"))
    if here == stored:
        return
    if here:
        fix = (
            "set model.mtp=false (rollout.speculative then drafts with the checkpoint's published MTP layer)"
            if field == "model.checkpoint"
            else "resume with model.mtp=false"
        )
        raise UserInputError(
            f"model.mtp=true but {field}'s checkpoint {path} holds no MTP layer (written without model.mtp, e.g. "
            f"by tools/hf_to_megatron.py); {fix}, or start from model.hf_path"
        )
    raise UserInputError(
        f"model.mtp=false but {field}'s checkpoint {path} holds the trained MTP layer (written with model.mtp); "
        "set model.mtp=true (or rollout.speculative=true with model.mtp null)"
    )


def check_checkpoints(cfg: Config, hf: dict) -> None:
    """The newest checkpoint a run would resume from (and model.checkpoint) fits this model and its
    ``model.lora`` and ``model.mtp``; the resumed optimizer state needs the layout it was written in."""
    p = cfg.parallel
    here = dict(tp=p.tp, pp=p.pp, ep=p.ep, etp=p.etp, cp=p.cp)
    resume_field = "checkpoint.load" if cfg.checkpoint.load else "output_dir"
    root = cfg.checkpoint.load or os.path.join(cfg.output_dir, "checkpoints")
    found = _newest_checkpoint(root, resume_field, required=bool(cfg.checkpoint.load))
    if found is not None:
        path, meta = found
        diff = model_config_difference(meta.get("hf_config") or {}, hf)
        if diff:
            raise UserInputError(
                f"{resume_field}: the checkpoints in {root} belong to another model ({'; '.join(diff)} "
                f"in {path} vs this config's model); use a new output_dir, or the model they were trained with"
            )
        stored = {k: meta.get("layout", {}).get(k) for k in here}
        if meta.get("has_optimizer") and stored != here:
            raise UserInputError(
                f"{resume_field}: {path} was written with layout {stored}, this run uses {here}; resuming "
                "the optimizer needs the same layout (to change it, start a new output_dir with "
                f"model.checkpoint={path}: the weights load into any layout)"
            )
        check_lora_matches(cfg, meta, resume_field, path)
        check_mtp_matches(cfg, meta, resume_field, path)
    if cfg.model.checkpoint:
        found = _newest_checkpoint(cfg.model.checkpoint, "model.checkpoint", required=True)
        assert found is not None  # required=True raises instead of returning None
        path, meta = found
        diff = model_config_difference(meta.get("hf_config") or {}, hf)
        if diff:
            raise UserInputError(f"model.checkpoint: {path} holds another model than the config's ({'; '.join(diff)})")
        check_lora_matches(cfg, meta, "model.checkpoint", path)
        check_mtp_matches(cfg, meta, "model.checkpoint", path)
