"""The SGLang server flags a config needs, in one place: for the engines the trainer starts, for the
engines a user starts (``launch/sglang_node.sh``, ``launch/slurm/train.sbatch``), and the check of
engines already running (``rollout.engine_urls``) against them.

``config_server_args(cfg, hf)`` -> ``{ServerArgs field: value}`` (sglang 0.5.23's field names, which
``/server_info`` reports back: ``build_server_info`` in ``srt/utils/common.py`` returns
``server_args.resolved_dict()``):

- ``random_seed``: ``seed``; ``enable_deterministic_inference``: ``rollout.engine_deterministic``;
- ``ep_size``: ``rollout.engine_ep`` (when > 1);
- ``enable_return_routed_experts``: ``rollout.routing_replay=r3`` (``rollout/routing.py``), and for DSA
  models ``enable_return_indexer_topk`` plus the environment ``SGLANG_DSA_FUSE_TOPK=0`` (the engine
  returns positions, not KV-pool slots; :func:`config_server_env`);
- ``enable_lora`` / ``max_lora_rank`` / ``lora_target_modules`` / ``max_loras_per_batch`` /
  ``max_loaded_loras``: ``rollout.lora_sync=adapter`` (``weight_sync.lora_adapter.engine_lora_args``);
- ``custom_weight_loader``: ``rollout.sync_delta`` (``weight_sync.delta_loader``).

``attached_engine_errors(cfg, hf, url, info)``: what an engine's ``/server_info`` lacks of those (one
line each, naming the engine, the flag, the config field that needs it, and how to start it right),
each flag compared as its row of ``_CHECKS`` says (equal, at least, present). Without the check an engine started without ``--enable-return-routed-experts`` fails at the first
rollout, one without ``--ep-size`` generates with another layout than the planner counted, and one
without ``--enable-lora`` fails at the first sync, after the model is built.

Command line (``launch/sglang_node.sh`` with ``GSPO_CONFIG``, ``train.sbatch``)::

    python -m gspo_megatron.rollout.engine_args CONFIG.yaml [dotted.key=value ...]

prints the flags as shell words on stdout (``--env`` prints ``NAME=value`` lines of the environment
instead); a bad config is one line on stderr and exit 2.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from typing import Any


def config_server_args(cfg, hf: dict | None, route_spec: Any = None) -> dict[str, Any]:
    """The sglang ServerArgs fields ``cfg`` needs (module docstring). ``hf``: the model's config.json
    (for DSA's indexer flag; None when it cannot be read: the flag is then left out). ``route_spec``:
    ``rollout.routing.route_spec_of(hf)`` when the caller has it already (the factory, which hands it
    to the engines too); computed here from ``hf`` otherwise."""
    r = cfg.rollout
    args: dict[str, Any] = {"random_seed": cfg.seed}
    if r.engine_deterministic:
        args["enable_deterministic_inference"] = True
    if r.engine_ep > 1:
        args["ep_size"] = int(r.engine_ep)
    if r.routing_replay == "r3":
        args["enable_return_routed_experts"] = True
        if route_spec is None and hf is not None:
            from gspo_megatron.rollout.routing import route_spec_of

            route_spec = route_spec_of(hf)
        if route_spec is not None and route_spec.index_topk:
            args["enable_return_indexer_topk"] = True
    if cfg.model.lora.rank > 0 and r.lora_sync == "adapter":
        from gspo_megatron.weight_sync.lora_adapter import engine_lora_args

        args.update(engine_lora_args(cfg))
    if r.sync_delta:
        from gspo_megatron.weight_sync.delta_loader import LOADER_NAME

        args["custom_weight_loader"] = [LOADER_NAME]
    return args


def config_server_env(args: dict[str, Any]) -> dict[str, str]:
    """Environment the engine process needs for ``args``: sglang's DSA indexer ids as sequence
    positions, not KV-pool slots (``SGLANG_DSA_FUSE_TOPK=0``; ``rollout/routing.py``)."""
    return {"SGLANG_DSA_FUSE_TOPK": "0"} if args.get("enable_return_indexer_topk") else {}


@dataclass(frozen=True)
class _Check:
    """How an attached engine's value of one flag is checked against the wanted one. ``field``: the
    config field that needs the flag (named in the error). ``compare``: ``"equal"`` (the same value),
    ``"at_least"`` (a capacity: a number no smaller), ``"present"`` (a list holding every wanted
    entry) or ``"unchecked"`` (the flag only records or tunes: an engine without it still serves the
    run correctly). ``unlimited``: engine values (``"present"``: entries) that satisfy any want."""

    field: str
    compare: str = "equal"
    unlimited: tuple = ()

    def __post_init__(self):
        if self.compare not in ("equal", "at_least", "present", "unchecked"):
            raise ValueError(f"_Check({self.field!r}): unknown compare {self.compare!r}")


_LORA = "rollout.lora_sync=adapter"
#: every flag :func:`config_server_args` can ask for (a new flag: one row)
_CHECKS: dict[str, _Check] = {
    "random_seed": _Check("seed", "unchecked"),
    "ep_size": _Check("rollout.engine_ep"),
    "enable_deterministic_inference": _Check("rollout.engine_deterministic"),
    "enable_return_routed_experts": _Check("rollout.routing_replay=r3"),
    "enable_return_indexer_topk": _Check("rollout.routing_replay=r3 (a DSA model: the indexer's selection)"),
    "enable_lora": _Check(_LORA),
    "max_lora_rank": _Check(_LORA, "at_least"),
    # sglang's ["all"] holds every module
    "lora_target_modules": _Check(_LORA, "present", unlimited=("all",)),
    "max_loras_per_batch": _Check(_LORA, "at_least"),
    "max_loaded_loras": _Check(_LORA, "at_least", unlimited=(None,)),  # None: sglang sets no limit
    "custom_weight_loader": _Check("rollout.sync_delta", "present"),
}


def _lacks(check: _Check, want: Any, have: Any) -> bool:
    """Whether an engine value ``have`` falls short of ``want`` under ``check`` (:class:`_Check`)."""
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
            f"start it with the flags `python -m gspo_megatron.rollout.engine_args <config>` prints "
            f"(launch/sglang_node.sh does with GSPO_CONFIG)"
        )
    return errors


def _main(argv: list[str]) -> int:
    from gspo_megatron.config.loader import load_config
    from gspo_megatron.errors import UserInputError, one_line
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.rollout.sglang_engine import server_args_to_cli

    env_only = "--env" in argv
    argv = [a for a in argv if a != "--env"]
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m gspo_megatron.rollout.engine_args [--env] CONFIG.yaml [dotted.key=value ...]")
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
