"""sglang 0.5.23's own runtime code for what the CPU server does with weights (not a model of it).

Where the TP rank holds sglang's model class (``--sglang-loader-check``, ``sglang_models.py``), an
``update_weights_from_tensor`` runs through the very functions sglang's scheduler and model runner
call, so what they accept, refuse, return and raise is sglang's:

- :func:`deserialize_own_rank`: ``managers/tp_worker.py`` ``TpModelWorker.deserialize_own_rank``, its
  two calls made with sglang's own functions (``monkey_patch_torch_reductions``, then
  ``MultiprocessingSerializer.deserialize`` of the payload at ``get_parallel().tp_rank``; too few
  payloads: IndexError). The method itself is not called: importing ``tp_worker`` imports the whole
  scheduler (``setproctitle``, zmq, ...), which the CPU extra does not install.
- :func:`weight_updater`: ``model_executor/model_runner_components/weight_updater.py``
  ``WeightUpdater``, built with the fields ``model_runner.py`` gives it (``custom_weight_loaders`` from
  the published ``--custom-weight-loader``), whose ``update_weights_from_tensor`` does the dispatch:
  the derived-weight-cache refusal (``(False, reason)``), the weight-cache assert, ``flattened_bucket``
  (``FlattenedTensorBucket.reconstruct_tensors``), ``direct``, a ``--custom-weight-loader`` name
  (``dynamic_import(load_format)(model, named_tensors)``), plain ``load_weights``, and
  ``NotImplementedError("Unknown load_format=...")`` for anything else. Its ``get_model`` is the
  worker's :class:`LoaderModel` (below) (``load_weights``: the shard
  store, then sglang's model), so the twin's generation sees what sglang's model was given.

Also here, the rules of sglang's runtime the server restates where sglang's code cannot run: its
failure semantics (:class:`SchedulerDeath`), the state capturers' constructor assert
(:func:`capturer_assert`) and ``dynamic_import`` without sglang (:func:`custom_loader`).

What the model runner does beside this and cannot do on CPU (CUDA graph recapture) is never reached
by ``update_weights_from_tensor``; ``update_model_fields`` / ``recapture_cuda_graph`` belong to
``update_weights_from_disk``, which the CPU server does not serve, and raise if called.
"""

from __future__ import annotations

from typing import Any


def deserialize_own_rank(serialized_named_tensors: list) -> Any:
    """sglang's ``TpModelWorker.deserialize_own_rank`` (module docstring)."""
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()
    return MultiprocessingSerializer.deserialize(serialized_named_tensors[get_parallel().tp_rank])


def weight_updater(sglang_model: Any, loader_model: Any, tp_rank: int) -> Any:
    """sglang's ``WeightUpdater`` for this rank, as ``model_runner.py`` builds it (module docstring).
    ``sglang_model``: the rank's :class:`~gspo_megatron.cpu_server.sglang_models.SglangModel`
    (its published server args carry ``--custom-weight-loader``); ``loader_model``: what ``get_model``
    returns."""
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.runtime_context import get_model

    def not_served(*args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("the CPU server does not serve update_weights_from_disk")

    return WeightUpdater(
        tp_rank=tp_rank,
        device="cpu",
        gpu_id=0,
        model_config=sglang_model.model_config,
        custom_weight_loaders=get_model().custom_weight_loader,
        get_model=lambda: loader_model,
        update_model_fields=not_served,
        recapture_cuda_graph=not_served,
        get_model_runner=not_served,
    )


class SchedulerDeath(Exception):
    """An exception where sglang 0.5.23 has no handler: ``update_weights_from_tensor`` (the scheduler's
    ``managers/scheduler_components/weight_updater.py`` and the model runner's
    ``model_runner_components/weight_updater.py``) calls the deserializer, the flattened bucket, a custom
    weight loader and ``load_weights`` bare, so their exception leaves the scheduler's event loop;
    ``managers/scheduler.py`` ``run_scheduler_process`` logs "Scheduler hit an exception" and sends
    SIGQUIT to the server process, which ends. ``run_worker`` does the same: the rank exits, the server
    process sees a TP process gone and shuts down, the request in flight gets no answer."""


def capturer_assert(args: Any, config: Any) -> None:
    """sglang's state capturers' constructor asserts, which end an engine at start-up: the model runner
    builds ``IndexerTopkCapturer`` when ``--enable-return-indexer-topk`` is set and the model has indexer
    layers (``state_capturer/indexer_topk.py``), and it asserts ``attn_tp_size == 1``; this server runs no
    attention DP, so attn_tp_size is ``--tp-size``. (``RoutedExpertsCapturer`` asserts nothing.)"""
    from gspo_megatron.fleet.engine_startup_checks import INDEXER_CAPTURER_ASSERT

    text = getattr(config, "text_config", None) or config
    if args.enable_return_indexer_topk and getattr(text, "index_topk", None) and args.tp_size != 1:
        raise AssertionError(f"{INDEXER_CAPTURER_ASSERT} (attn_tp_size = {args.tp_size})")


def custom_loader(name: str):
    """sglang's ``dynamic_import(load_format)`` (``srt/utils/common.py``: module path + attribute)."""
    try:
        from sglang.srt.utils import dynamic_import
    except ImportError:  # the CPU server without sglang: the same two lines
        import importlib

        def dynamic_import(path: str):
            module, _, attr = path.rpartition(".")
            if not module:
                raise ValueError("func_path should contain both module name and func name (such as 'module.func')")
            return getattr(importlib.import_module(module), attr)

    return dynamic_import(name)


class LoaderModel:
    """The ``model`` argument of a custom weight loader (``--custom-weight-loader``): sglang hands
    its runner's model object, whose ``load_weights`` a loader calls; here ``load_weights`` is this rank's
    store-then-sglang-model load of the runner ``role`` (``"target"`` or, speculative, ``"draft"``;
    ``worker.TPWorker._load``). One object per worker and runner, kept for its lifetime (a loader may keep state on
    it, as on sglang's model; a restarted server starts without it)."""

    def __init__(self, worker: Any, role: str = "target"):
        self._worker = worker
        self.role = role

    def load_weights(self, weights) -> None:
        self._worker._load(weights, (self.role,))

    def modules(self):
        """``nn.Module.modules`` of the runner's sglang model class when this rank holds it
        (``--sglang-loader-check``: a loader asks its ``FusedMoE`` layers which experts the rank loads),
        else none."""
        sglang = self._worker._sglang_models((self.role,)).get(self.role)
        return sglang.model.modules() if sglang is not None else iter(())
