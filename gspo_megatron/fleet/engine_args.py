"""The SGLang server flags a config needs, in one place: for the engines the trainer starts, for the
engines a user starts (``launch/sglang_node.sh``, ``launch/slurm/train.sbatch``), and the check of
engines already running (``rollout.engine_urls``) against them.

``config_server_args(cfg, hf)`` -> ``{ServerArgs field: value}`` (sglang 0.5.23's field names, which
``/server_info`` reports back: ``build_server_info`` in ``srt/utils/common.py`` returns
``server_args.resolved_dict()``):

- ``random_seed``: ``seed``; ``enable_deterministic_inference``: ``rollout.engine_deterministic``;
- ``ep_size``: ``rollout.engine_ep`` (when > 1);
- ``max_running_requests``: ``rollout.engine_max_running_requests`` (``features/speculative.py``
  ``max_running_requests``: when set, or with ``rollout.speculative`` the requests a rollout sends at
  once, ``rollout_requests``, since sglang 0.5.23 otherwise caps a speculative engine at 48:
  ``arg_groups/speculative_hook.py`` ``_handle_eagle_family``; sglang still lowers it to what its KV cache
  and Mamba-state pool hold, ``mem_cache/kv_cache_configurator.py`` ``resolve_max_num_reqs``);
- each enabled component's (``features/``, ``Feature.engine_args`` and ``engine_env``):
  ``enable_return_routed_experts`` for ``rollout.routing_replay=r3`` (and on DSA models
  ``enable_return_indexer_topk`` with the environment ``SGLANG_DSA_FUSE_TOPK=0``);
  ``enable_lora`` / ``max_lora_rank`` / ``lora_target_modules`` / ``max_loras_per_batch`` /
  ``max_loaded_loras`` for ``rollout.lora_sync=adapter``; ``custom_weight_loader`` for
  ``rollout.sync_delta``.

``attached_engine_errors(cfg, hf, url, info)``: what an engine's ``/server_info`` lacks of those (one
line each, naming the engine, the flag, the config field that needs it, and how to start it right),
each flag compared as its row of ``_CHECKS`` says (equal, at least, present). Without the check an engine started without ``--enable-return-routed-experts`` fails at the first
rollout, one without ``--ep-size`` generates with another layout than the planner counted, and one
without ``--enable-lora`` fails at the first sync, after the model is built.

Command line (``launch/sglang_node.sh`` with ``GSPO_CONFIG``, ``train.sbatch``)::

    python -m gspo_megatron.fleet.engine_args CONFIG.yaml [dotted.key=value ...]

prints the flags as shell words on stdout (``--env`` prints ``NAME=value`` lines of the environment
instead); a bad config is one line on stderr and exit 2.
"""

from __future__ import annotations

import shlex
import sys
from typing import Any

from gspo_megatron.features import FEATURES, EngineFlag, enabled_features, engine_flags
from gspo_megatron.features.speculative import max_running_requests


def config_server_args(cfg, hf: dict | None, route_spec: Any = None) -> dict[str, Any]:
    """The sglang ServerArgs fields ``cfg`` needs (module docstring): the engine's own settings, then
    each enabled component's (``features/``: routing replay, adapter sync, delta sync...). ``hf``: the
    model's config.json (for DSA's indexer flag; None when it cannot be read: the flag is then left
    out). ``route_spec``: ``engines.routing.route_spec_of(hf)`` when the caller has it already (the
    factory, which hands it to the engines too); computed here from ``hf`` otherwise."""
    r = cfg.rollout
    args: dict[str, Any] = {"random_seed": cfg.seed}
    if r.engine_deterministic:
        args["enable_deterministic_inference"] = True
    if r.engine_ep > 1:
        args["ep_size"] = int(r.engine_ep)
    running = max_running_requests(cfg)
    if running is not None:
        args["max_running_requests"] = running
    for feature in enabled_features(cfg):
        args.update(feature.engine_args(cfg, hf, route_spec))
    return args


def config_server_env(args: dict[str, Any]) -> dict[str, str]:
    """Environment the engine process needs for ``args``: what each component asks for (e.g. routing
    replay on a DSA model: sglang's indexer ids as sequence positions, ``SGLANG_DSA_FUSE_TOPK=0``)."""
    env: dict[str, str] = {}
    for feature in FEATURES:
        env.update(feature.engine_env(args))
    return env


#: every flag :func:`config_server_args` can ask for: the engine's own rows here, the components' from
#: their ``flags`` (``features/``)
_CHECKS: dict[str, EngineFlag] = {
    "random_seed": EngineFlag("seed", "unchecked"),
    "ep_size": EngineFlag("rollout.engine_ep"),
    # a tuning flag: an attached engine with another limit generates the same samples, in other waves
    "max_running_requests": EngineFlag("rollout.engine_max_running_requests", "unchecked"),
    "enable_deterministic_inference": EngineFlag("rollout.engine_deterministic"),
    **engine_flags(),
}


def _lacks(check: EngineFlag, want: Any, have: Any) -> bool:
    """Whether an engine value ``have`` falls short of ``want`` under ``check`` (:class:`EngineFlag`)."""
    if check.compare == "unchecked":
        return False
    if check.compare == "present":
        held = have if isinstance(have, (list, tuple, set)) else ([] if have in (None, "") else [have])
        if any(h in check.unlimited for h in held):
            return False
        wanted = want if isinstance(want, (list, tuple, set)) else [want]
        return not set(map(str, wanted)) <= set(map(str, held))
    if check.compare == "at_least":
        if have in check.unlimited:
            return False
        return have is None or int(have) < int(want)
    return have != want


def attached_engine_errors(cfg, hf: dict | None, url: str, info: dict, route_spec: Any = None) -> list[str]:
    """One line per flag ``info`` (the engine's ``/server_info``) lacks of :func:`config_server_args`
    (``hf``, ``route_spec``: as there), compared as :data:`_CHECKS` says."""
    errors = []
    for key, want in config_server_args(cfg, hf, route_spec).items():
        check, have = _CHECKS[key], info.get(key)
        if not _lacks(check, want, have):
            continue
        flag = "--" + key.replace("_", "-")
        value = " ".join(map(str, want)) if isinstance(want, list) else ("" if want is True else str(want))
        errors.append(
            f"engine {url} runs with {key}={have!r} but {check.field} needs {flag}{' ' + value if value else ''}: "
            f"start it with the flags `python -m gspo_megatron.fleet.engine_args <config>` prints "
            f"(launch/sglang_node.sh does with GSPO_CONFIG)"
        )
    return errors


def _main(argv: list[str]) -> int:
    from gspo_megatron.config.loader import load_config
    from gspo_megatron.engines.sglang_engine import server_args_to_cli
    from gspo_megatron.errors import UserInputError, one_line
    from gspo_megatron.models.hf_config import load_hf_config

    env_only = "--env" in argv
    argv = [a for a in argv if a != "--env"]
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m gspo_megatron.fleet.engine_args [--env] CONFIG.yaml [dotted.key=value ...]")
        return 0 if argv else 2
    try:
        cfg = load_config(argv[0], argv[1:], check_files=False)
    except UserInputError as e:
        print(f"engine_args: error: {one_line(e)}", file=sys.stderr)
        return 2
    hf = None
    if cfg.model.hf_path:
        try:
            hf = load_hf_config(cfg.model.hf_path)
        except (OSError, ValueError):  # no model directory on this host: DSA's indexer flag undecided
            print(f"engine_args: cannot read {cfg.model.hf_path}/config.json; DSA flags left out", file=sys.stderr)
    args = config_server_args(cfg, hf)
    if env_only:
        for k, v in config_server_env(args).items():
            print(f"{k}={v}")
    else:
        print(shlex.join(server_args_to_cli(args)))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
