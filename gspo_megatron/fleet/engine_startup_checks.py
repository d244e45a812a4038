"""SGLang 0.5.23's start-up refusals of the flags a config derives (``fleet/engine_args.py``),
checked at ``gspo-train --check`` time (config validation, ``validate_model_layout``), so a config
whose engines would abort while their model runners start is refused first, in one line naming the
config fields.

What sglang refuses at start-up (read from the installed 0.5.23 source; the engines run on GPUs, so the
checks are restated here, each with its place):

- ``state_capturer/indexer_topk.py`` ``IndexerTopkCapturer.__init__`` (built by
  ``create_indexer_capturer`` from ``ModelRunner.init_indexer_capturer``,
  ``model_executor/model_runner.py``, in every TP rank's process whenever
  ``--enable-return-indexer-topk`` is set on a CUDA/NPU device and the model has indexer layers):
  ``assert attn_tp_size == 1, "IndexerTopkCapturer now only supports DP attention"``, with
  ``attn_tp_size = tp_size // attn_dp_size // attn_cp_size`` (``runtime_context.py``
  ``derive_attn_tp_size``). ``attn_dp_size`` is ``--attn-dp-size`` (``arg_groups/fields/parallel.py``;
  the deprecated ``--enable-dp-attention --dp-size N`` resolves to ``attn_dp_size = N``,
  ``arg_groups/parallel_hook.py`` ``handle_deprecated_dp_attention``). ``rollout.routing_replay=r3`` on
  a DSA model (DeepSeek-V3.2, GLM-5) sets the flag, and this trainer launches engines without
  attention DP (``--tp-size rollout.engine_tp``; its weight sync, planner and engine-layout checks
  count attention sharded over the engine's TP ranks), so any ``rollout.engine_tp > 1`` aborts;
- ``arg_groups/parallel_hook.py`` ``handle_data_parallelism``: ``attn_dp_size >= 1``, no
  ``dp_size > 1`` next to ``attn_dp_size > 1``, and ``tp_size % attn_dp_size == 0`` (restated for the
  flags a user adds to attached engines' command lines; the trainer derives none of them);
- ``state_capturer/routed_experts.py`` ``RoutedExpertsCapturer.__init__`` has no assert (it reads
  ``num_experts_per_tok`` and ``num_hidden_layers``; a model without routed experts is refused by
  ``validate_model_layout`` already).

The rest of sglang's validation needs a resolved ``ServerArgs`` (its resolution pipeline loads the
model config and detects the device; with sglang installed ``--no-deps`` it does not even import).
What runs on CPU is :func:`sglang_cli_errors`: sglang's own argument parser
(``ServerArgs.add_cli_args``) reads the command line the trainer would launch with and
``ServerArgs.from_cli_args`` builds the record from it, which refuses an unknown or misspelt flag, a
bad choice or a value of the wrong type; the tests run it over every combination of flags the config
can derive.
"""

from __future__ import annotations

from typing import Any

#: sglang 0.5.23 ``state_capturer/indexer_topk.py`` ``IndexerTopkCapturer.__init__``'s message
INDEXER_CAPTURER_ASSERT = "IndexerTopkCapturer now only supports DP attention"


def attn_tp_size(args: dict[str, Any]) -> int:
    """sglang's attention-TP width for ServerArgs fields ``args`` (``runtime_context.py``
    ``derive_attn_tp_size``: ``tp_size // attn_dp_size // attn_cp_size``; the deprecated
    ``enable_dp_attention`` + ``dp_size`` read as ``attn_dp_size = dp_size``)."""
    tp = int(args.get("tp_size", 1) or 1)
    attn_dp = int(args.get("attn_dp_size", 1) or 1)
    if args.get("enable_dp_attention") and attn_dp == 1:
        attn_dp = int(args.get("dp_size", 1) or 1)
    return tp // max(attn_dp, 1) // max(int(args.get("attn_cp_size", 1) or 1), 1)


def server_args_errors(args: dict[str, Any]) -> list[str]:
    """What sglang 0.5.23 refuses at start-up in ServerArgs fields ``args`` (module docstring), one
    line each in sglang's terms (flags); :func:`startup_errors` names the config fields instead."""
    e: list[str] = []
    tp = int(args.get("tp_size", 1) or 1)
    attn_dp = int(args.get("attn_dp_size", 1) or 1)
    dp = int(args.get("dp_size", 1) or 1)
    if attn_dp < 1:
        e.append(f"--attn-dp-size must be positive (got {attn_dp}) (parallel_hook.py handle_data_parallelism)")
    elif attn_dp > 1 and dp > 1:
        e.append(f"--dp-size {dp} with --attn-dp-size {attn_dp} is not supported (handle_data_parallelism)")
    elif tp % attn_dp:
        e.append(f"--attn-dp-size {attn_dp} must divide --tp-size {tp} (handle_data_parallelism)")
    if args.get("enable_return_indexer_topk") and attn_tp_size(args) != 1:
        e.append(
            f"--enable-return-indexer-topk needs attn_tp_size = tp_size / attn_dp_size = 1, got "
            f"{attn_tp_size(args)} (state_capturer/indexer_topk.py: {INDEXER_CAPTURER_ASSERT})"
        )
    return e


def launch_args(cfg, hf: dict | None, route_spec: Any = None) -> dict[str, Any]:
    """The ServerArgs fields the trainer launches an engine with that sglang validates: ``tp_size``
    (``rollout.engine_tp``, ``fleet/engine_fleet.py``) and every flag
    ``engine_args.config_server_args`` derives."""
    from gspo_megatron.fleet.engine_args import config_server_args

    return {"tp_size": int(cfg.rollout.engine_tp), **config_server_args(cfg, hf, route_spec)}


def startup_errors(cfg, hf: dict | None) -> list[str]:
    """One line per sglang start-up refusal of ``cfg``'s engines (``hf``: the model's config.json),
    naming the config fields and the values that would work. Nothing for the hf engine; the CPU
    stand-in server (``rollout.engine_server=cpu``) refuses the same at its start
    (``cpu_server/worker.py``: the indexer capturer's assert), so it is checked for it too."""
    r = cfg.rollout
    if r.engine != "sglang":
        return []
    args = launch_args(cfg, hf)
    e: list[str] = []
    if args.get("enable_return_indexer_topk") and attn_tp_size(args) != 1:
        model_type = (hf or {}).get("model_type", "a DSA model")
        e.append(
            f"rollout.routing_replay=r3 on {model_type} (DSA: the engines return the indexer's selection, "
            f"--enable-return-indexer-topk) with rollout.engine_tp={r.engine_tp}: sglang 0.5.23's "
            f"IndexerTopkCapturer asserts attn_tp_size == 1 ('{INDEXER_CAPTURER_ASSERT}', "
            "state_capturer/indexer_topk.py) and the engines run --tp-size rollout.engine_tp without "
            "attention DP, so they would abort at start-up; set rollout.routing_replay=r2 (the trainer "
            "replays its own routes; the indexer selects its keys itself) or off, or rollout.engine_tp=1"
        )
    # anything else sglang refuses of the derived flags (none today: the trainer derives no DP layout)
    e.extend(x for x in server_args_errors(args) if "--enable-return-indexer-topk" not in x)
    return e


def startup_refusals(cfg, hf: dict | None) -> None:
    """ConfigError (one line per refusal) when :func:`startup_errors` finds any; ``gspo-train --check``
    (``preflight.check_config``) and the planner call it after ``config.validate_model_layout``."""
    from gspo_megatron.errors import ConfigError

    errors = startup_errors(cfg, hf)
    if errors:
        raise ConfigError(errors)


def sglang_cli_errors(args: dict[str, Any], model_path: str = "dummy") -> list[str] | None:
    """sglang's own parse of the command line ``args`` launch with (``sglang_engine.server_args_to_cli``):
    ``ServerArgs.add_cli_args`` + ``parse_args`` + ``ServerArgs.from_cli_args``, then every field read
    back equal to what was asked, plus :func:`server_args_errors` on the parsed record. None when sglang
    does not import here; otherwise one line per refusal (empty: accepted). Runs on CPU (no device, no
    model: the record is not resolved)."""
    import argparse

    try:
        from sglang.srt.server_args import ServerArgs
    except ImportError:
        return None
    from gspo_megatron.engines.sglang_engine import server_args_to_cli

    class _Parser(argparse.ArgumentParser):
        def error(self, message):  # raise instead of exiting
            raise ValueError(message)

    parser = _Parser(prog="sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    cli = ["--model-path", model_path, *server_args_to_cli(args)]
    try:
        record = ServerArgs.from_cli_args(parser.parse_args(cli))
    except (ValueError, TypeError) as err:
        return [f"sglang refuses `{' '.join(cli)}`: {err}"]
    errors = []
    for key, want in args.items():
        have = getattr(record, key, None)
        if (list(map(str, want)) if isinstance(want, (list, tuple)) else want) != (
            list(map(str, have)) if isinstance(have, (list, tuple)) else have
        ):
            errors.append(f"sglang reads {key}={have!r} from `{' '.join(cli)}`, not {want!r}")
    fields = {k: getattr(record, k, None) for k in ("tp_size", "dp_size", "attn_dp_size", "attn_cp_size")}
    fields.update(enable_dp_attention=getattr(record, "enable_dp_attention", False))
    fields.update(enable_return_indexer_topk=getattr(record, "enable_return_indexer_topk", False))
    errors.extend(server_args_errors(fields))
    return errors
