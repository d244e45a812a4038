"""Weight-sync time against a plain transfer of the same bytes; bytes per rank and node of the recipes.

Part ``time`` (measured, CPU, gloo): a world of 2 trainer ranks (tp2 for colocated, pp2 for
disaggregated, so the export's TP gather and the per-stage routing both run) holds a random
Qwen3-MoE of tens of MB and runs the trainer's own sync, ``WeightSyncer(model, topology,
bucket_mb).sync()``, with the topology built by ``weight_sync.topology.build_sync_topology`` and its
real transports, into engine processes that receive as SGLang's TP ranks do:
- colocated (``CudaIpcTransport``): engine e shares training ranks [e*tp, (e+1)*tp); engine TP rank
  i gets payload i of ``update_weights_from_tensor`` and deserializes it with sglang's serializer
  and FlattenedTensorBucket (``weight_sync.cuda_ipc.deserialize_payload``; CPU tensors travel as
  shared-memory segments), then copies every tensor into its own storage;
- disaggregated (``NcclBroadcastTransport``, gloo): every engine TP rank joins each stage's
  weight-update group (``init_external_process_group``, as SGLang's init_weights_update_group does),
  and per ``update_weights_from_distributed`` allocates by the metadata, receives the broadcast(s)
  (one per bucket for ``load_format="flattened_bucket"``, as sglang 0.5.23; else one per tensor)
  and copies into its storage.
Baselines, over the same processes in the same run: colocated = one payload per engine TP rank of
one flat uint8 tensor of the model's total bytes, through the same serializer, gather and engine
call; disaggregated = one ``dist.broadcast`` of a flat uint8 buffer of each stage's bytes over that
stage's group from its source (stages one after the other). Printed: median seconds of each and
the ratio sync / baseline, for 1 and 2 engines, and the same for the sync as it was before issue
23's overhead work ("old": plain export stream, per-tensor broadcasts, polling store lock), timed
in the same processes, interleaved (new, baseline, old per repeat; ``--no-old`` skips it). After the runs every engine TP rank's tensors are
compared with the HF checkpoint bitwise. Engines' pause / flush / session calls are no-ops here.

Part ``bytes`` (computed, bench/sync_bytes.py): the bytes each rank class, engine GPU and node sends
per sync for configs/qwen3_30b_a3b_gspo.yaml (2x8 GPUs) and configs/qwen3_235b_a22b_gspo.yaml (8x8),
both sync modes, from the recipe's layout and the planner's parameter counts.

Usage: python bench/weight_sync.py [--part time|bytes|all] [--hidden 256] [--experts 8] [--layers 4]
    [--vocab 8192] [--bucket-mb 8] [--repeats 3] [--disagg-engine-tp 1] [--no-old] [--workdir DIR]
At the defaults (45 MB fp32 model, 4 cases, each starting 2 Megatron ranks and its engine processes)
it took about 10 minutes on the shared 2-core machine under heavy load; tests/weight_sync/
test_bench_weight_sync.py runs it on a 1 MB model. ``BENCH_DUMP_S=N``: every child process dumps its
Python stacks after N seconds (to see where a case hangs). ``BENCH_PROFILE=PATH``: each trainer rank
dumps a cProfile of 3 extra (untimed) syncs to ``PATH.<mode><engines>.rank<r>``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from types import SimpleNamespace

from gspo_megatron.runtime.ports import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout
sys.path.insert(0, HERE)

BASELINE = "baseline.flat"


# ------------------------------------------------------------------ engine side (one process per TP rank)
def _engine_rank(engine: int, tp_rank: int, cmd_q, reply_q, hf_dir: str) -> None:
    """Receives like an SGLang TP rank; every tensor ends in ``store`` (a copy, as load_weights does)."""
    import torch
    import torch.distributed as dist

    from gspo_megatron.engines.sglang_compat import use_cpu_shared_memory
    from gspo_megatron.weight_sync.cuda_ipc import deserialize_payload
    from gspo_megatron.weight_sync.nccl_broadcast import init_external_process_group

    torch.set_num_threads(1)
    use_cpu_shared_memory()
    if os.environ.get("BENCH_DUMP_S"):
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["BENCH_DUMP_S"]))
    store: dict[str, torch.Tensor] = {}
    groups: dict[str, object] = {}

    def load(name, t):
        old = store.get(name)
        if old is None or old.shape != t.shape or old.dtype != t.dtype:
            store[name] = t.clone()
        else:
            old.copy_(t)

    try:
        while True:
            msg = cmd_q.get(timeout=600)
            op = msg[0]
            if op == "tensor":  # update_weights_from_tensor: this TP rank's payload
                for name, t in deserialize_payload(msg[1]):
                    load(name, t)
                reply_q.put("ok")
            elif op == "init":
                _, addr, port, off, world, name, backend = msg
                reply_q.put("joining")  # SGLang's call returns after joining; the trainer joins concurrently
                groups[name] = init_external_process_group(
                    backend,
                    f"tcp://{addr}:{port}",
                    world,
                    off + tp_rank,
                    name,
                    timedelta(seconds=600),
                    prefer_sglang=False,
                )
            elif op == "dist":  # update_weights_from_distributed: allocate by metadata, receive, load
                _, names, dtypes, shapes, name, load_format = msg
                if load_format == "flattened_bucket":  # sglang 0.5.23's bucketed receive
                    from gspo_megatron.engines.sglang_compat import require_flattened_bucket_class

                    bucket = require_flattened_bucket_class().empty(names, dtypes, shapes, "cpu")
                    dist.broadcast(bucket.get_flattened_tensor(), 0, group=groups[name])
                    for n, t in bucket.reconstruct_tensors():
                        load(n, t)
                else:
                    for n, d, s in zip(names, dtypes, shapes):
                        buf = torch.empty(s, dtype=getattr(torch, d))
                        dist.broadcast(buf, 0, group=groups[name])
                        load(n, buf)
                reply_q.put("ok")
            elif op == "destroy":
                dist.destroy_process_group(groups.pop(msg[1]))
                reply_q.put("ok")
            elif op == "check":
                from safetensors.torch import load_file

                ref = load_file(os.path.join(hf_dir, "model.safetensors"))
                got = {k: v for k, v in store.items() if k != BASELINE}
                bad = sorted(k for k in ref if k not in got or not torch.equal(got[k], ref[k]))
                reply_q.put(
                    (
                        engine,
                        tp_rank,
                        len(ref),
                        bad[:5] + (["..."] if len(bad) > 5 else []),
                        sorted(set(got) - set(ref))[:5],
                    )
                )
                return
    except Exception:  # noqa: BLE001 - reported to the trainer
        reply_q.put("ERROR engine %d tp %d\n%s" % (engine, tp_rank, traceback.format_exc()))


class _Client:
    """Trainer-side stand-in for ``engines.sglang_client``: forwards each call to the engine's TP
    processes and waits for all of them (as the HTTP call returns when every TP rank is done)."""

    def __init__(self, cmd_queues, reply_queue, tp_size: int):
        self.cmds, self.replies, self.tp_size = cmd_queues, reply_queue, tp_size

    def _wait(self):
        out = [self.replies.get(timeout=600) for _ in self.cmds]
        errors = [r for r in out if isinstance(r, str) and r.startswith("ERROR")]
        if errors:
            raise RuntimeError("\n".join(errors))
        return out

    def _all(self, *msg):
        for q in self.cmds:
            q.put(msg)
        return self._wait()

    # the session calls carry no weights
    def pause_generation(self):
        pass

    def continue_generation(self):
        pass

    def flush_cache(self):
        pass

    def begin_weight_update(self):
        pass

    def end_weight_update(self):
        pass

    def update_weights_from_tensor(
        self, serialized_named_tensors, load_format=None, flush_cache=False, weight_version=None
    ):
        if len(serialized_named_tensors) != len(self.cmds):
            raise ValueError(f"{len(serialized_named_tensors)} payloads for {len(self.cmds)} TP ranks")
        for q, p in zip(self.cmds, serialized_named_tensors):
            q.put(("tensor", p))
        self._wait()

    def init_weights_update_group(self, addr, port, rank_offset, world_size, group_name, backend):
        self._all("init", addr, port, rank_offset, world_size, group_name, backend)

    def update_weights_from_distributed(
        self, names, dtypes, shapes, group_name, flush_cache=False, weight_version=None, load_format=None
    ):
        self._all("dist", names, dtypes, shapes, group_name, load_format)

    def destroy_weights_update_group(self, group_name):
        self._all("destroy", group_name)

    def check(self):
        return self._all("check")


class _Fleet:
    """What ``build_sync_topology`` reads of ``fleet.engine_fleet.EngineFleet``."""

    def __init__(self, specs, clients, world_sizes):
        self.specs, self._clients, self.world_sizes = specs, clients, world_sizes
        self.urls = [f"engine{i}" for i in range(len(clients))]

    def client(self, e):
        return self._clients[e]


# ------------------------------------------------------------------ trainer side (2 gloo ranks)
def _trainer(rank, world, port, mode, engines, engine_tp, cmd_queues, reply_queues, hf_dir, args, result_q):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    try:
        result_q.put(_trainer_body(rank, mode, engines, engine_tp, cmd_queues, reply_queues, hf_dir, args))
    except Exception:  # noqa: BLE001
        result_q.put("ERROR trainer rank %d\n%s" % (rank, traceback.format_exc()))


def _trainer_body(rank, mode, engines, engine_tp, cmd_queues, reply_queues, hf_dir, args):
    import torch
    import torch.distributed as dist

    from gspo_megatron.engines.placement import EngineSpec
    from gspo_megatron.models.build import build_model
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.models.weights import load_hf_weights
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed
    from gspo_megatron.weight_sync.cuda_ipc import serialize_bucket
    from gspo_megatron.weight_sync.sync import WeightSyncer
    from gspo_megatron.weight_sync.topology import build_sync_topology

    torch.set_num_threads(1)
    if os.environ.get("BENCH_DUMP_S"):
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["BENCH_DUMP_S"]))
    bench_mode, (mode, layout, owner_direct) = mode, CASES[mode]
    init_distributed(ParallelLayout(**layout))
    model = build_model(load_hf_config(hf_dir), layout.get("tp", 1), layout.get("pp", 1), layout.get("ep", 1))
    load_hf_weights(model, hf_dir)
    clients = [_Client(cmd_queues[e], reply_queues[e], engine_tp) for e in range(engines)]
    specs = [
        EngineSpec(
            index=e,
            tp=engine_tp,
            train_ranks=tuple(range(e * engine_tp, (e + 1) * engine_tp)) if mode == "colocated" else (),
        )
        for e in range(engines)
    ]
    cfg = SimpleNamespace(
        rollout=SimpleNamespace(
            sync_mode=mode, sync_fp8=False, sync_delta=False, sync_owner_direct=owner_direct, engine_ep=1
        ),
        model=SimpleNamespace(hf_path=hf_dir, arch=None),
    )
    topology = build_sync_topology(cfg, fleet=_Fleet(specs, clients, [engine_tp] * engines))
    syncer = WeightSyncer(model, topology, bucket_mb=args.bucket_mb)
    items = syncer.plan[0]
    total = sum(it.nbytes for it in items)
    transport = topology.transport
    g = torch.Generator().manual_seed(rank)

    if mode == "colocated":
        flat = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=g)

        def baseline():
            # the transport's own steps with one payload of the same bytes
            payloads = serialize_bucket([(BASELINE, flat)])
            if transport.group is not None:
                gathered = [None] * transport.group_size if transport.is_src else None
                dist.gather_object(payloads, gathered, dst=transport.src, group=transport.group)
            else:
                gathered = [payloads]
            if transport.is_src:
                transport.client.update_weights_from_tensor([p[0] for p in gathered], load_format=transport.load_format)
            if transport.group is not None:
                dist.barrier(group=transport.group)
    else:
        mine = sum(it.nbytes for it in items if topology.dst(it.owner) == rank)
        flat = torch.randint(0, 256, (mine,), dtype=torch.uint8, generator=g) if transport else None
        pool = ThreadPoolExecutor(max_workers=engines)

        def baseline():
            for src in topology.sources:  # stages one after the other, as the engines load one update at a time
                if rank == src:
                    futures = [
                        pool.submit(
                            c.update_weights_from_distributed, [BASELINE], ["uint8"], [[mine]], transport.group_name
                        )
                        for c in transport.clients
                    ]
                    dist.broadcast(flat, 0, group=transport.group)
                    for f in futures:
                        f.result()
                dist.barrier()

    def timed(fn):
        dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        dist.barrier()
        return time.perf_counter() - t0, out

    new_path = (syncer.bucket_buffer, getattr(transport, "flattened", None), getattr(transport, "lock", None))

    def old_sync():
        """The sync as it was before issue 23's overhead work, in the same processes: plain export
        stream (per-tensor world broadcasts, colocated; the serializer flattens each bucket into a
        fresh buffer), one broadcast per tensor (disaggregated) and the polling store lock."""
        syncer.bucket_buffer = None
        if mode == "disaggregated" and transport is not None:
            transport.flattened = False
            if transport.lock is not None:
                transport.lock = _PollingStoreLock(transport.lock.store)
        try:
            return syncer.sync()
        finally:
            syncer.bucket_buffer = new_path[0]
            if mode == "disaggregated" and transport is not None:
                transport.flattened, transport.lock = new_path[1], new_path[2]

    timed(syncer.sync)  # warm-up: engines allocate their storage, groups settle
    timed(baseline)
    old = args.old and not owner_direct  # the old path is the broadcast (owner-direct did not exist)
    if old:
        timed(old_sync)
    t_sync, t_base, t_old, metrics = [], [], [], None
    for _ in range(args.repeats):  # interleaved: new, baseline, old
        t, metrics = timed(syncer.sync)
        t_sync.append(t)
        t_base.append(timed(baseline)[0])
        if old:
            t_old.append(timed(old_sync)[0])
        if syncer.errors:
            raise RuntimeError(f"sync failed: {syncer.errors}")
    if os.environ.get("BENCH_PROFILE"):  # cProfile of extra syncs (not timed) per trainer rank
        import cProfile

        prof = cProfile.Profile()
        for _ in range(3):
            dist.barrier()
            prof.runcall(syncer.sync)
        prof.dump_stats(f"{os.environ['BENCH_PROFILE']}.{bench_mode}{engines}.rank{rank}")
    checks = None
    if mode == "disaggregated" and transport is not None:
        transport.close()
    dist.barrier()
    if rank == 0:
        checks = [r for c in clients for r in c.check()]
    destroy_distributed()
    return {
        "rank": rank,
        "bytes": total,
        "sync_s": statistics.median(t_sync),
        "base_s": statistics.median(t_base),
        "old_s": statistics.median(t_old) if t_old else float("nan"),
        "bytes_max_rank": metrics["sync/bytes_max_rank"],
        "buckets": metrics["sync/buckets"],
        "layout": "".join(f"{k}{v}" for k, v in layout.items()),
        "checks": checks,
    }


class _PollingStoreLock:
    """The store lock the disaggregated sync used before issue 23 (compare_set, 50 ms polls)."""

    def __init__(self, store, key: str = "gspo_weight_sync_lock_old", poll_s: float = 0.05):
        self.store, self.key, self.poll_s = store, key, poll_s
        self.token = f"held-by-{os.getpid()}-{id(self)}"

    def __enter__(self):
        while True:
            got = self.store.compare_set(self.key, "", self.token)
            if (got.decode() if isinstance(got, bytes) else got) == self.token:
                return self
            time.sleep(self.poll_s)

    def __exit__(self, *exc):
        self.store.set(self.key, "")


# bench mode -> (rollout.sync_mode, the 2 trainer ranks' layout, rollout.sync_owner_direct)
CASES = {
    "colocated": ("colocated", {"tp": 2}, False),
    "colocated-ep2": ("colocated", {"ep": 2}, False),
    "owner-direct": ("colocated", {"ep": 2}, True),
    "disaggregated": ("disaggregated", {"pp": 2}, False),
}


def run_case(mode: str, engines: int, engine_tp: int, hf_dir: str, args) -> dict:
    """One (mode, engines) case in fresh processes: 2 trainer ranks + engines * engine_tp engine ranks."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    cmd = [[ctx.Queue() for _ in range(engine_tp)] for _ in range(engines)]
    rep = [ctx.Queue() for _ in range(engines)]
    result_q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_engine_rank, args=(e, tp, cmd[e][tp], rep[e], hf_dir), daemon=True)
        for e in range(engines)
        for tp in range(engine_tp)
    ]
    procs += [
        ctx.Process(
            target=_trainer, args=(r, 2, port, mode, engines, engine_tp, cmd, rep, hf_dir, args, result_q), daemon=True
        )
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        results = [result_q.get(timeout=args.case_timeout) for _ in range(2)]
        errors = [r for r in results if isinstance(r, str)]
        if errors:
            raise RuntimeError("\n".join(errors))
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:  # only this case's own children
            if p.is_alive():
                p.kill()
                p.join()
    return next(r for r in results if r["rank"] == 0)


def part_time(args) -> None:
    import torch

    from gspo_megatron.models.tiny import save_tiny_hf_model

    work = args.workdir or tempfile.mkdtemp(prefix="bench_weight_sync_")
    hf_dir = os.path.join(work, "hf")
    h = args.hidden
    save_tiny_hf_model(
        "qwen3_moe",
        hf_dir,
        seed=0,
        dtype=torch.float32,
        vocab_size=args.vocab,
        hidden_size=h,
        intermediate_size=2 * h,
        moe_intermediate_size=h,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=h // 8,
        num_experts=args.experts,
        num_experts_per_tok=2,
    )
    size = os.path.getsize(os.path.join(hf_dir, "model.safetensors"))
    print(
        f"model: Qwen3-MoE hidden {h}, {args.layers} layers, {args.experts} experts, vocab {args.vocab}, "
        f"fp32: {size / 1e6:.0f} MB; bucket {args.bucket_mb} MB; median of {args.repeats}; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    cases = [
        (m, n, (2 // n) if CASES[m][0] == "colocated" else args.disagg_engine_tp)
        for m in args.modes.split(",")
        for n in (int(e) for e in args.engines.split(","))
    ]
    print(
        f"{'mode':<14}{'train':>6}{'engines':>9}{'MB':>6}{'max MB/rank':>12}{'buckets':>8}"
        f"{'sync s':>9}{'baseline s':>11}{'sync/base':>10}{'old s':>8}{'old/base':>9}  engines' tensors == HF"
    )
    failed = 0
    for mode, engines, tp in cases:
        r = run_case(mode, engines, tp, hf_dir, args)
        ok = all(not bad and not extra for _, _, _, bad, extra in r["checks"])
        failed += not ok
        detail = f"{len(r['checks'])} TP ranks x {r['checks'][0][2]} tensors: " + ("yes" if ok else f"NO {r['checks']}")
        print(
            f"{mode:<14}{r['layout']:>6}{f'{engines}xTP{tp}':>9}{r['bytes'] / 1e6:>6.0f}"
            f"{r['bytes_max_rank'] / 1e6:>12.0f}{int(r['buckets']):>8}{r['sync_s']:>9.3f}{r['base_s']:>11.3f}"
            f"{r['sync_s'] / r['base_s']:>9.2f}x{r['old_s']:>8.3f}{r['old_s'] / r['base_s']:>8.2f}x  {detail}",
            flush=True,
        )
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    if not args.keep and args.workdir is None:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    if failed:
        sys.exit(f"{failed} case(s): an engine's tensors differ from the HF checkpoint")


def part_bytes(args) -> None:
    import sync_bytes as sb

    root = os.path.dirname(HERE)
    for name, nodes in (("qwen3_30b_a3b_gspo", 2), ("qwen3_235b_a22b_gspo", 8)):
        lay, dims, dtype_bytes = sb.recipe_layout(
            os.path.join(root, "configs", f"{name}.yaml"), nodes, args.gpus_per_node
        )
        print(sb.table(f"configs/{name}.yaml", sb.stage_bytes(dims, lay.pp, dtype_bytes), lay))
        print()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["time", "bytes", "all"], default="all")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--layers", type=int, default=4, help="even (pp2)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--bucket-mb", type=float, default=8.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--disagg-engine-tp", type=int, default=1, help="TP ranks per disaggregated engine")
    p.add_argument(
        "--modes",
        default="colocated,disaggregated",
        help=f"comma-separated, of {', '.join(CASES)} (colocated-ep2 / owner-direct: the trainer ranks "
        "expert-parallel, each owning half the experts; owner-direct with rollout.sync_owner_direct)",
    )
    p.add_argument("--engines", default="1,2", help="engine counts to run (colocated: 2 // engines TP ranks each)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="for --part bytes")
    p.add_argument("--case-timeout", type=float, default=900.0, help="seconds per case before giving up")
    p.add_argument("--workdir", default=None)
    p.add_argument("--keep", action="store_true")
    p.add_argument(
        "--no-old",
        dest="old",
        action="store_false",
        help="skip timing the pre-issue-23 sync path (columns 'old s', 'old/base')",
    )
    args = p.parse_args()
    if args.layers % 2:
        p.error("--layers must be even (the disaggregated case runs pp2)")
    unknown = sorted(set(args.modes.split(",")) - set(CASES))
    if unknown:
        p.error(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(CASES)}")
    if args.part in ("bytes", "all"):
        part_bytes(args)
    if args.part in ("time", "all"):
        os.environ.setdefault("TQDM_DISABLE", "1")
        os.environ.setdefault("PYTHONWARNINGS", "ignore")  # Megatron's start-up warnings, in every child
        part_time(args)


if __name__ == "__main__":
    main()
