"""One engine TP rank of the CPU server (a process; the engine's ranks form a gloo world).

Ranks: TP rank 0 receives each command from the HTTP front (a pipe), broadcasts it to every TP rank
(``broadcast_object_list`` over the engine's gloo world, which spans nodes with ``--nnodes``), every
rank runs it on its own shards, and ``gather_object`` brings the per-rank answers back to rank 0,
which merges them (all must succeed, as sglang's ``FanOutCommunicator.merge_results``). Commands
run one at a time, like sglang's scheduler loop.

Per command (sglang 0.5.23 ``managers/scheduler_components/weight_updater.py`` and
``model_executor/model_runner_components/weight_updater.py``):
- ``update_tensor``: refused outside a begin/end session; TP rank i deserializes
  ``serialized_named_tensors[i]`` (sglang's serializer, CPU tensors by file_system shared memory)
  and loads it (``flattened_bucket`` or a plain list; a load_format named by ``--custom-weight-loader``
  is imported by name and called as ``loader(model, named_tensors)`` with :class:`LoaderModel`, whose
  ``load_weights`` is the store + sglang's model; any other load_format raises sglang's
  ``NotImplementedError("Unknown load_format=...")``); barrier. Any exception on that path ends
  the server, as it ends sglang's scheduler (``sglang_runtime.SchedulerDeath``).
- ``init_group`` / ``destroy_group``: join / leave a custom process group at rank
  ``rank_offset + tp_rank`` (sglang's ``init_custom_process_group``).
- ``update_distributed``: refused outside a session; receive each tensor (or one flattened bucket)
  by broadcast from group rank 0 in the given order, then load.
- ``submit`` / ``step`` / ``pause`` / ``continue`` / ``abort_all`` (``stepping.py``): requests live on
  rank 0 across commands, one forward per ``step``; when the shards changed since the last step,
  every rank sends its shards to rank 0 (gather), which assembles the full tensors into its
  transformers model (a running request keeps its KV cache: sglang's in-place update).
- sglang's own loader (``--sglang-loader-check``, on when sglang imports; ``sglang_models.py``):
  each rank also holds sglang 0.5.23's model class for the checkpoint and hands it every bucket
  (one ``load_weights`` call per bucket, as sglang's weight updater); ``begin`` fills its parameters
  with NaN and ``end`` of a session that loaded anything fails, naming them, when a parameter was
  left (partly) unwritten (e.g. DeepSeek's ``fused_qkv_a_proj_with_mqa`` when ``q_a_proj`` and
  ``kv_a_proj_with_mqa`` came in different buckets). Generation still runs the transformers model.
- ``release`` / ``resume``: memory tags; with ``--enable-memory-saver`` the ``weights`` tag frees
  and restores the shards' storage (contents lost, as without CPU backup) and rank 0's assembled
  model; without it only the tags are recorded (sglang's no-op memory saver).
- speculative decoding (``--speculative-algorithm``, ``cpu_server/speculative.py``): two runners, the
  target and the draft (the MTP layer ``model.layers.{N}.*``: its own shard store and, with the loader
  check, sglang's draft class sharing the target's embedding and head). ``begin`` / ``update_tensor`` /
  ``update_distributed`` take sglang's ``selector`` (``target`` | ``draft`` | ``all``, default ``all``):
  each selected runner loads the whole bucket (its loader keeps its own names), ``begin`` poisons the
  selected runners' sglang models and ``end`` checks those of the session's runners that stored
  anything (a sync that sends no MTP tensor leaves the draft as it was, as in sglang). At start-up the
  draft reads the MTP layer from ``--speculative-draft-model-path`` (default ``--model-path``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gspo_megatron.cpu_server.args import ServerArgs
from gspo_megatron.cpu_server.generation import Sampler, eos_token_ids
from gspo_megatron.cpu_server.routes import IndexerRecorder, RouteRecorder
from gspo_megatron.cpu_server.scheduler import StepScheduler
from gspo_megatron.cpu_server.sglang_runtime import (
    LoaderModel,
    SchedulerDeath,
    capturer_assert,
    custom_loader,
    deserialize_own_rank,
    weight_updater,
)
from gspo_megatron.cpu_server.sharding import Layout, assemble, owner_ranks
from gspo_megatron.cpu_server.speculative import SpeculativeDecoder, parse_selector
from gspo_megatron.cpu_server.stepping import SchedulingOps
from gspo_megatron.cpu_server.weights import ShardStore, iter_checkpoint, load_config, resolve_dtype
from gspo_megatron.dtypes import torch_dtype
from gspo_megatron.engines.hf_engine import HFRolloutEngine
from gspo_megatron.engines.mtp_draft import MTPDraft, mtp_shapes
from gspo_megatron.engines.sglang_compat import (
    multiprocessing_serializer,
    require_flattened_bucket_class,
    use_cpu_shared_memory,
)

ALL_TAGS = ("kv_cache", "weights", "cuda_graph")  # sglang GPU_MEMORY_ALL_TYPES


def log(rank: int, msg: str) -> None:
    print(f"[cpu_server TP{rank}] {msg}", flush=True)


class TPWorker(SchedulingOps):
    """State of one TP rank; ``handle`` runs one command on it and returns this rank's answer."""

    def __init__(self, args: ServerArgs, tp_rank: int):
        self.args, self.tp_rank = args, tp_rank
        self.config = load_config(args.model_path)
        capturer_assert(args, self.config)
        self.layout = Layout.from_config(self.config, args.tp_size, args.ep_size)
        self.layout.check()
        self.dtype = resolve_dtype(args.dtype, self.config)
        self.store = ShardStore(self.config, self.layout, tp_rank, self.dtype)
        self.sglang = self._sglang_model()
        # speculative decoding: the draft runner (the MTP layer), its shard store and sglang's draft class
        self.draft_store: ShardStore | None = None
        self.draft_sglang = None
        if args.speculative_algorithm:
            self._check_draft_model()
            shapes = mtp_shapes(self.config)
            self.draft_store = ShardStore(self.config, self.layout, tp_rank, self.dtype, full_shapes=shapes)
            self.draft_sglang = self._sglang_draft_model() if self.sglang is not None else None
        roles = self.roles("all")
        if args.load_format == "dummy":  # sglang's model: random init, written by the first sync
            self.store.load_dummy(args.random_seed)
            if self.draft_store is not None:
                self.draft_store.load_dummy(args.random_seed)
        else:  # one read of each checkpoint, in one load_weights call as sglang's DefaultModelLoader
            for model in self._sglang_models(roles).values():
                model.poison()
            draft_path = args.speculative_draft_model_path or args.model_path
            if self.draft_store is None or draft_path == args.model_path:
                self._read_checkpoint(args.model_path, roles)
            else:
                self._read_checkpoint(args.model_path, {"target"})
                self._read_checkpoint(draft_path, {"draft"})
            for model in self._sglang_models(roles).values():
                model.check_written()
        self.groups: dict[str, Any] = {}
        self.session: dict | None = None
        self.offload_tags: set[str] = set()
        self.dirty = True  # rank 0's assembled model is out of date
        self.sampler: Sampler | None = None
        # rank 0's live requests (stepping.py); empty on the other ranks
        self.sched = StepScheduler(max_running=args.max_running_requests)
        # seeded once, as sglang seeds its sampling RNG once at start (``set_random_seed`` in
        # managers/tp_worker.py and scheduler.py); release / resume and weight updates never reseed it
        self.generator = torch.Generator(device="cpu").manual_seed(args.random_seed)
        self.eos_ids = eos_token_ids(args.model_path, self.config)
        # what a custom weight loader is handed as ``model``, per runner (sglang: each runner's get_model())
        self.loader_models = {role: LoaderModel(self, role) for role in roles}
        self.loader_model = self.loader_models["target"]
        # sglang's own WeightUpdater per runner when sglang's model is held (sglang_runtime.py)
        self.updaters: dict[str, Any] = {
            role: weight_updater(model, self.loader_models[role], tp_rank)
            for role, model in self._sglang_models(roles).items()
        }
        self.updater = self.updaters.get("target")
        from gspo_megatron.cpu_server.lora import WorkerLoras

        self.loras = WorkerLoras(args, self.config)  # --enable-lora's adapters (cpu_server/lora.py)

    def _sglang_model(self):
        """sglang's own model class for this rank (``--sglang-loader-check``; the caller loads the
        checkpoint into it), or None when the check is off (``auto`` and sglang does not import here)."""
        mode = self.args.sglang_loader_check
        if mode == "off":
            return None
        from gspo_megatron.cpu_server import sglang_models

        why = sglang_models.import_error()
        if why is not None:
            if mode == "on":
                raise RuntimeError(f"--sglang-loader-check on: {why}")
            log(self.tp_rank, f"sglang loader check off: {why}")
            return None
        model = self._new_sglang_model(custom_weight_loader=self.args.custom_weight_loader)
        log(
            self.tp_rank,
            f"sglang {sglang_models.SGLANG_VERSION}'s {type(model.model).__name__} holds this rank's "
            f"weights too (every bucket goes to its load_weights)",
        )
        return model

    # -- speculative decoding: the runners ------------------------------------------------------------
    def roles(self, selector: Any) -> set[str]:
        """The runners a weight update's ``selector`` names that this engine has (sglang's
        ``_select_runners``: the draft only when there is a draft worker); a bad selector raises sglang's
        ``ValueError`` (``speculative.parse_selector``)."""
        roles = parse_selector(selector, use_sglang=self.sglang is not None)
        return roles if self.draft_store is not None else roles - {"draft"}

    def _stores(self, roles) -> dict[str, ShardStore]:
        stores = {"target": self.store, "draft": self.draft_store}
        return {r: s for r in ("target", "draft") if r in roles and (s := stores[r]) is not None}

    def _sglang_models(self, roles) -> dict[str, Any]:
        models = {"target": self.sglang, "draft": self.draft_sglang}
        return {r: models[r] for r in ("target", "draft") if r in roles and models[r] is not None}

    def _check_draft_model(self) -> None:
        """Refuse (one line) a checkpoint whose MTP layer cannot be the draft (``models.mtp.mtp_errors``)."""
        from gspo_megatron.models.hf_config import load_hf_config
        from gspo_megatron.models.mtp import mtp_errors

        errors = mtp_errors(load_hf_config(self.args.speculative_draft_model_path or self.args.model_path))
        if errors:
            raise RuntimeError(f"--speculative-algorithm {self.args.speculative_algorithm}: {'; '.join(errors)}")

    def _new_sglang_model(self, **kw):
        """``sglang_models.SglangModel`` of this rank's checkpoint, TP / EP place and dtype (``kw``: the
        target's custom loader, or the draft's ``draft_of`` / ``draft_path``)."""
        from gspo_megatron.cpu_server import sglang_models

        args = self.args
        return sglang_models.SglangModel(args.model_path, args.tp_size, self.tp_rank, args.ep_size, self.dtype, **kw)

    def _sglang_draft_model(self):
        """sglang's draft class for this rank (``sglang_models.SglangModel(draft_of=...)``)."""
        model = self._new_sglang_model(draft_of=self.sglang, draft_path=self.args.speculative_draft_model_path)
        log(self.tp_rank, f"sglang's draft {type(model.model).__name__} loads the MTP layer too")
        return model

    def _read_checkpoint(self, path: str, roles: set[str]) -> None:
        """Start-up: every tensor of the checkpoint at ``path`` to the runners ``roles``; a draft that finds
        no complete MTP layer there fails start-up (one line), as sglang's draft loader would."""
        named = list(iter_checkpoint(path))
        self._load_both(named, roles)
        if "draft" in roles and self.draft_store is not None:
            missing = sorted(set(self.draft_store.full_shapes) - {n for n, _ in named})
            if missing:
                raise RuntimeError(
                    f"--speculative-algorithm {self.args.speculative_algorithm}: the draft checkpoint {path} lacks "
                    f"{len(missing)} tensors of the MTP layer, e.g. {missing[0]} (--speculative-draft-model-path)"
                )

    # -- the full model on rank 0 ----------------------------------------------------------------
    def _refresh_full_model(self) -> None:
        """Collective: rank 0 rebuilds its transformers model from every rank's shards."""
        # every rank's shards, filled in on rank 0
        gathered: list[dict[str, torch.Tensor]] | None = (
            [{} for _ in range(self.args.tp_size)] if self.tp_rank == 0 else None
        )
        dist.gather_object(self.store.shards, gathered, dst=0)
        draft: list[dict[str, torch.Tensor]] | None = None
        if self.draft_store is not None:  # the draft's shards too
            draft = [{} for _ in range(self.args.tp_size)] if self.tp_rank == 0 else None
            dist.gather_object(self.draft_store.shards, draft, dst=0)
        if gathered is not None:  # rank 0
            if self.sampler is None:
                engine = HFRolloutEngine(self.config, None, dtype=self.dtype, seed=self.args.random_seed)
                recorder = None
                if self.args.enable_return_routed_experts or self.args.router_logit_perturbation:
                    recorder = RouteRecorder(engine.model, self.args.router_logit_perturbation)
                indexer = IndexerRecorder(engine.model) if self.args.enable_return_indexer_topk else None
                self.sampler = Sampler(engine, self.generator, recorder, indexer)
            bucket = []
            for name, shape in self.store.full_shapes.items():
                parts = [gathered[r][name] for r in owner_ranks(name, self.layout)]
                bucket.append((name, assemble(name, parts, self.layout, shape)))
            self.sampler.engine.update_weights(bucket)
            if draft is not None and self.draft_store is not None:
                mtp = {}
                for name, shape in self.draft_store.full_shapes.items():
                    parts = [draft[r][name] for r in owner_ranks(name, self.layout)]
                    mtp[name] = assemble(name, parts, self.layout, shape)
                model = self.sampler.engine.model
                embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
                if self.sampler.speculative is None:  # the target's live embedding and head, shared
                    mtp_draft = MTPDraft(self.config, mtp, embed, head, dtype=self.dtype)
                    self.sampler.speculative = SpeculativeDecoder(
                        self.sampler.engine, mtp_draft, int(self.args.speculative_num_steps or 1), self.sampler.recorder
                    )
                else:
                    self.sampler.speculative.draft.load(mtp.items())
        self.dirty = False

    # -- commands --------------------------------------------------------------------------------
    def handle(self, op: str, kw: dict) -> dict:
        fn = getattr(self, f"op_{op}", None)
        if fn is None:
            return {"success": False, "message": f"unknown command {op!r}"}
        return fn(**kw)

    def op_ready(self) -> dict:
        return {"success": True, "message": "ready"}

    def op_lora_load(self, **kw) -> dict:
        result = self.loras.load(self.tp_rank, **kw)
        dist.barrier()
        return result

    def op_lora_load_path(self, **kw) -> dict:
        result = self.loras.load_from_path(self.tp_rank, **kw)
        dist.barrier()
        return result

    def op_lora_unload(self, lora_name: str) -> dict:
        return self.loras.unload(lora_name)

    def op_begin(self, selector: str = "all") -> dict:
        if self.session is not None:
            return {
                "success": False,
                "message": "a weight-update session is already open; call end_weight_update() first",
            }
        roles = self.roles(selector)  # sglang: _select_runners(recv_req.selector), recorded for end
        self.session = {"loaded": False, "stored": {r: 0 for r in roles}, "roles": roles}
        for model in self._sglang_models(roles).values():
            if not model.released:
                model.poison()  # a full sync writes every parameter: NaN left at end = unwritten
        dist.barrier()
        return {"success": True, "message": "Success"}

    def op_end(self) -> dict:
        if self.session is None:
            return {"success": False, "message": "no weight-update session is open; call begin_weight_update() first"}
        result = {"success": True, "message": "Success"}
        for role, model in self._sglang_models(self.session["roles"]).items():
            if not self.session["stored"].get(role):  # a runner this session wrote nothing to: no sync
                continue
            try:
                model.check_written()
            except RuntimeError as e:
                result = {"success": False, "message": f"end_weight_update: {e}"}
                break
        self.session = None
        dist.barrier()
        return result

    def _load_both(self, named, roles=("target",)) -> dict[str, int]:
        """One bucket into the shard stores of the runners ``roles``, then (when held) one ``load_weights``
        call of each one's sglang model (each keeps its own names: the target skips the MTP layer, the draft
        everything else); returns how many tensors each store kept on this rank."""
        named = list(named)
        stored = {role: store.load(named) for role, store in self._stores(roles).items()}
        for model in self._sglang_models(
            roles
        ).values():  # after the stores: sglang's loaders may write into the tensors
            model.load(named)
        return stored

    def _load(self, named, roles=("target",)) -> None:
        if self.session is None:  # the update ops load only inside a begin/end session
            raise RuntimeError("weights loaded outside a weight-update session (begin_weight_update() first)")
        stored = self._load_both(named, roles)
        self.dirty = True
        self.session["loaded"] = True
        for role, n in stored.items():
            self.session["stored"][role] = self.session["stored"].get(role, 0) + n

    def update_tensor(self, serialized_named_tensors: list, load_format: str | None, selector: str = "all") -> dict:
        if self.session is None:
            return {
                "success": False,
                "message": "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()",
            }
        try:  # sglang catches nothing from here on: an exception ends the engine (``SchedulerDeath``)
            roles = self.roles(selector)
            if self.updaters:  # sglang's own deserialization and dispatch, runner by runner
                return self._sglang_update_tensor(roles, serialized_named_tensors, load_format)
            if self.tp_rank >= len(serialized_named_tensors):
                raise IndexError(
                    f"serialized_named_tensors has {len(serialized_named_tensors)} payload(s); "
                    f"TP rank {self.tp_rank} reads item {self.tp_rank} (one per TP rank)"
                )
            use_cpu_shared_memory()
            obj = multiprocessing_serializer().deserialize(serialized_named_tensors[self.tp_rank])
            if load_format == "flattened_bucket":
                named = require_flattened_bucket_class()(
                    flattened_tensor=obj["flattened_tensor"], metadata=obj["metadata"]
                ).reconstruct_tensors()
            elif load_format is None:
                named = list(obj)
            elif load_format in (self.args.custom_weight_loader or []):
                # sglang: ``dynamic_import(load_format)(model, named_tensors)`` for a name in its
                # --custom-weight-loader list (weight_updater.py update_weights_from_tensor), once per
                # selected runner with its model; the loader ends in load_weights, which here is that
                # runner's store and sglang model (_load)
                named = None
                for role in sorted(roles, key=("target", "draft").index):
                    custom_loader(load_format)(self.loader_models[role], list(obj))
            else:
                raise NotImplementedError(f"Unknown load_format={load_format}")
            if named is not None:
                self._load(named, roles)
            del obj, named
        except Exception as e:  # re-raised as what it is in sglang: the end of the engine
            raise SchedulerDeath(f"update_weights_from_tensor: {type(e).__name__}: {e}") from e
        dist.barrier()
        return {"success": True, "message": "Success"}

    def _sglang_update_tensor(self, roles: set[str], serialized_named_tensors: list, load_format: str | None) -> dict:
        """sglang's scheduler path of ``update_weights_from_tensor`` (``sglang_runtime.py``;
        ``managers/scheduler_components/weight_updater.py``): its deserializer once, then for each selected
        runner (target first) its ``WeightUpdater.update_weights_from_tensor`` (which loads through that
        runner's :class:`LoaderModel` into its store and sglang model), stopping at the first
        ``(False, reason)``, which is the answer; barrier."""
        use_cpu_shared_memory()
        named = deserialize_own_rank(serialized_named_tensors)
        success, message = True, "Success"
        for role in sorted(roles, key=("target", "draft").index):
            success, message = self.updaters[role].update_weights_from_tensor(
                named_tensors=named, load_format=load_format
            )
            if not success:
                break
        del named
        dist.barrier()
        return {"success": bool(success), "message": message}

    def op_init_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
    ) -> dict:
        from gspo_megatron.weight_sync.nccl_broadcast import init_external_process_group

        rank = rank_offset + self.tp_rank
        log(
            self.tp_rank,
            f"init custom process group: master_address={master_address}, master_port={master_port}, "
            f"rank_offset={rank_offset}, rank={rank}, world_size={world_size}, "
            f"group_name={group_name}, backend={backend}",
        )
        try:
            self.groups[group_name] = init_external_process_group(
                backend, f"tcp://{master_address}:{master_port}", world_size, rank, group_name, prefer_sglang=True
            )
            return {"success": True, "message": "Succeeded to initialize custom process group."}
        except Exception as e:  # noqa: BLE001 - answered as sglang's route answers, not raised
            return {"success": False, "message": f"Failed to initialize custom process group: {e}."}

    def op_destroy_group(self, group_name: str) -> dict:
        if group_name not in self.groups:
            return {"success": False, "message": "The group to be destroyed does not exist."}
        try:
            dist.destroy_process_group(self.groups.pop(group_name))
            return {"success": True, "message": "Succeeded to destroy custom process group."}
        except Exception as e:  # noqa: BLE001 - answered as sglang's route answers, not raised
            return {"success": False, "message": f"Failed to destroy custom process group: {e}."}

    def update_distributed(
        self,
        names: list,
        dtypes: list,
        shapes: list,
        group_name: str,
        load_format: str | None = None,
        selector: str = "all",
    ) -> dict:
        if self.session is None:
            return {
                "success": False,
                "message": "update_weights_from_distributed must run between "
                "begin_weight_update() and end_weight_update()",
            }
        try:
            if group_name not in self.groups:
                raise AssertionError(
                    f"Group {group_name} not in {list(self.groups)}. Please call `init_weights_update_group` first."
                )
            group = self.groups[group_name]
            if load_format == "flattened_bucket":
                bucket = require_flattened_bucket_class().empty(names, dtypes, shapes, "cpu")
                dist.broadcast(bucket.get_flattened_tensor(), src=0, group=group)
                weights = bucket.reconstruct_tensors()
            else:
                weights, handles = [], []
                for name, dtype, shape in zip(names, dtypes, shapes):
                    t = torch.empty(shape, dtype=torch_dtype(dtype))
                    handles.append(dist.broadcast(t, src=0, group=group, async_op=True))
                    weights.append((name, t))
                for h in handles:
                    h.wait()
        except Exception as e:  # noqa: BLE001 - answered as sglang's route answers, not raised
            return {"success": False, "message": f"Failed to receive weights: {e}"}
        try:  # only the target joined the group; every selected runner loads what it received (sglang)
            self._load(weights, self.roles(selector))
        except Exception as e:  # noqa: BLE001 - answered as sglang's route answers, not raised
            return {
                "success": False,
                "message": f"Failed to update parameter online: {e}. The full weights of "
                "the ModelRunner are partially updated. Please discard the whole weights.",
            }
        return {"success": True, "message": "Succeeded to update parameter online."}

    def op_get_weights_by_name(self, name: str, truncate_size: int = 100) -> dict:
        # sglang: model.get_weights_by_name exists for Llama-style models only; for qwen2, qwen3,
        # qwen3_moe and mixtral the AttributeError is logged and the route answers an error.
        return {"success": False, "message": "Get parameter by name failed"}

    def op_release(self, tags: list | None) -> dict:
        self.check_idle_for_release()
        tags = list(tags) if tags else list(ALL_TAGS)
        self.offload_tags.update(tags)
        if "weights" in tags and self.args.enable_memory_saver and not self.store.released:
            backup = self.args.enable_weights_cpu_backup
            for store in self._stores({"target", "draft"}).values():
                store.release(cpu_backup=backup)
            for model in self._sglang_models({"target", "draft"}).values():
                model.release(cpu_backup=backup)
            if self.sampler is not None:  # rank 0's assembled copy goes too
                self.sampler = None
            self.dirty = True
        dist.barrier()
        return {"success": True}

    def op_resume(self, tags: list | None) -> dict:
        tags = list(tags) if tags else list(ALL_TAGS)
        try:
            for tag in tags:
                self.offload_tags.remove(tag)
        except KeyError as e:
            return {"success": False, "message": str(e)}
        if "weights" in tags and self.args.enable_memory_saver and self.store.released:
            for store in self._stores({"target", "draft"}).values():
                store.resume()
            for model in self._sglang_models({"target", "draft"}).values():
                model.resume()
            self.dirty = True
        dist.barrier()
        return {"success": True}

    def op_shards(self, names: list) -> dict:
        """The named shards, encoded here: no tensor crosses the pipe to the front (sglang's
        ``monkey_patch_torch_reductions``, which its weight updater applies in this process, breaks
        the multiprocessing pickling of CPU tensors). Encoded from clones: ``Tensor.numpy()`` makes a
        storage non-resizable, and the memory saver resizes the shards."""
        from gspo_megatron.cpu_server.http_front import encode_tensor

        shards = dict(self.store.shards)
        if self.draft_store is not None:  # the draft's MTP layer (model.layers.{N}.*)
            shards.update(self.draft_store.shards)
        return {"success": True, "shards": {n: encode_tensor(shards[n].clone()) for n in names if n in shards}}

    def op_memory(self) -> dict:
        assembled = 0
        if self.sampler is not None:
            assembled = sum(p.untyped_storage().nbytes() for p in self.sampler.engine.model.parameters())
        return {
            "success": True,
            "weights_bytes": self.store.resident_bytes(),
            "draft_weights_bytes": self.draft_store.resident_bytes() if self.draft_store is not None else 0,
            "assembled_model_bytes": assembled,
            "sglang_model_bytes": self.sglang.resident_bytes() if self.sglang is not None else 0,
            "offload_tags": sorted(self.offload_tags),
        }

    def op_shutdown(self) -> dict:
        return {"success": True}
