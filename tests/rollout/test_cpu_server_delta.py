"""Delta sync on the CPU server: sglang's ``--custom-weight-loader`` route of
``update_weights_from_tensor`` (an unregistered load_format raises sglang's ``NotImplementedError``
and, like a delta without a base, ends the server as it ends sglang's scheduler; a restarted engine
gets a full sync instead, found by its weight version; the delta loader applied on every TP rank, its full tensors reaching the
shard store and sglang's own model class, whose NaN check at ``end_weight_update`` passes only when
every parameter was written), driven by the real ``CudaIpcTransport(delta=True)`` from two trainer ranks.
"""

import time

import pytest
import torch
import torch.distributed as dist
from transformers import AutoConfig

from cpu_server_util import CpuServer, free_port
from gspo_megatron.cpu_server import expected_shard, read_weight_shards
from gspo_megatron.engines.sglang_client import SGLangError, SGLangHttpClient
from gspo_megatron.engines.sglang_compat import multiprocessing_serializer, use_cpu_shared_memory
from gspo_megatron.weight_sync.cuda_ipc import CudaIpcTransport
from gspo_megatron.weight_sync.delta import DeltaEncoder
from gspo_megatron.weight_sync.delta_loader import LOADER_NAME


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = CpuServer(
        model_dir,
        str(tmp_path_factory.mktemp("logs")),
        tp=2,
        extra=("--custom-weight-loader", LOADER_NAME, "--enable-memory-saver"),
    )
    yield s
    s.stop()


def per_rank(entries, tp=2):
    """One payload per TP rank (a CPU payload is opened once)."""
    use_cpu_shared_memory()
    return [multiprocessing_serializer().serialize(list(entries), output_str=True) for _ in range(tp)]


def shards_equal(url, config, state, tp=2):
    names = sorted(state)
    shards = read_weight_shards(url, names)
    for rank in range(tp):
        for n in names:
            want = expected_shard(n, state[n], rank, tp, 1, config)
            if want is not None and not torch.equal(
                shards[rank][n].view(-1).view(torch.int32), want.contiguous().view(-1).view(torch.int32)
            ):
                return f"{n} on TP rank {rank}"
    return None


def _bad_update(kind: str, client, saved) -> None:
    """One update_weights_from_tensor call that sglang's code path raises on (module docstring)."""
    enc = DeltaEncoder()
    if kind == "unregistered_loader":  # exists, but not in --custom-weight-loader: NotImplementedError
        client.update_weights_from_tensor(
            per_rank(enc.encode_bucket(sorted(saved.items()))),
            load_format="gspo_megatron.weight_sync.delta.decode_entries",
        )
    else:  # deltas of another trainer's copy (another epoch): the loader has no base for them
        enc.copy.update({n: t.clone() for n, t in saved.items()})
        client.update_weights_from_tensor(per_rank(enc.encode_bucket(sorted(saved.items()))), load_format=LOADER_NAME)


@pytest.mark.parametrize("kind", ["unregistered_loader", "delta_without_base"])
def test_an_exception_in_the_update_ends_the_server_as_it_ends_sglangs_scheduler(kind, model_dir, saved, tmp_path):
    """sglang 0.5.23 has no handler around the update's load (``weight_updater.py``): the scheduler
    exits and the server with it. So does the CPU server (no ``success: false`` answer to go on from)."""
    s = CpuServer(model_dir, str(tmp_path), tp=2, extra=("--custom-weight-loader", LOADER_NAME))
    try:
        client = SGLangHttpClient(s.url, timeout_s=60)
        assert client.server_info()["custom_weight_loader"] == [LOADER_NAME]
        assert client.begin_weight_update()
        with pytest.raises(SGLangError):
            _bad_update(kind, client, saved)
        deadline = time.monotonic() + 30
        while s.procs[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert s.procs[0].poll() is not None, "the CPU server outlived an exception sglang has no handler for"
        with open(s.log_path) as f:
            log = f.read()
        assert "Scheduler hit an exception" in log
        assert ("Unknown load_format" if kind == "unregistered_loader" else "no copy of it") in log
    finally:
        s.stop()


def test_delta_sync_to_a_restarted_engine_is_full_not_fatal(model_dir, saved, tmp_path):
    """An attached engine restarted behind the trainer's back reports sglang's initial weight version:
    the syncer's check (``weight_sync.sync.engines_stale``) resets the encoder, so the next sync is full
    under a new epoch and the engine's weights are right, where a delta would have ended it."""
    from gspo_megatron.weight_sync.sync import engines_stale

    config = AutoConfig.from_pretrained(model_dir)
    g = torch.Generator().manual_seed(5)
    states = [{n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in saved.items()}]
    for _ in range(2):  # a few elements of every tensor change per step
        states.append({n: t.clone() for n, t in states[-1].items()})
        for t in states[-1].values():
            t.view(-1)[:: max(1, t.numel() // 5)] += 0.5
    s = CpuServer(model_dir, str(tmp_path), tp=1, extra=("--custom-weight-loader", LOADER_NAME))
    try:
        transport = CudaIpcTransport(SGLangHttpClient(s.url), delta=True)
        for version, state in enumerate(states[:2], start=1):
            assert not engines_stale(transport, str(version - 1)) or version == 1
            transport.begin(str(version))
            transport.send_bucket(sorted((n, t.clone()) for n, t in state.items()))
            transport.end()
        assert transport.delta_metrics()["sync/delta_wire_bytes"] < transport.delta_metrics()["sync/delta_full_bytes"]
        port = s.port
        s.stop()  # restarted at the same address (an attached engine restarted by its operator)
        s = CpuServer(model_dir, str(tmp_path), tp=1, extra=("--custom-weight-loader", LOADER_NAME), port=port)
        assert transport.engine_versions() == ["default"]  # sglang's weight_version before any update
        assert engines_stale(transport, "2")
        transport.reset_delta()
        transport.begin("3")
        transport.send_bucket(sorted((n, t.clone()) for n, t in states[2].items()))
        transport.end()
        m = transport.delta_metrics()
        assert m["sync/delta_wire_bytes"] == m["sync/delta_full_bytes"]
        assert shards_equal(s.url, config, states[2], tp=1) is None
        assert not engines_stale(transport, "3")
    finally:
        s.stop()


def _delta_rank(rank, world, port, url, model_dir, states):
    """A trainer rank colocated with engine TP rank ``rank``: CudaIpcTransport(delta=True), one sync
    per state with the engine's weights released (zero-filled) in between; rank 0 checks every TP
    rank's shards bitwise after each sync and the bytes sent."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group([0, 1], backend="gloo")
    client = SGLangHttpClient(url) if rank == 0 else None
    transport = CudaIpcTransport(client, gather_group=group, gather_src=0, delta=True)
    config = AutoConfig.from_pretrained(model_dir)
    for k, state in enumerate(states):
        if rank == 0 and k:
            client.release_memory_occupation(["weights"])
            client.resume_memory_occupation(["weights"])
        names = sorted(state)
        transport.begin(str(k + 1))
        for chunk in (names[: len(names) // 2], names[len(names) // 2 :]):
            transport.send_bucket([(n, state[n].clone()) for n in chunk])
        transport.end()
        if rank == 0:
            bad = shards_equal(url, config, state)
            assert bad is None, f"sync {k}: {bad}"
            m = transport.delta_metrics()
            full = sum(t.numel() * 4 for t in state.values())
            assert m["sync/delta_full_bytes"] == full
            if k == 0:
                assert m["sync/delta_wire_bytes"] == full
            else:
                assert m["sync/delta_wire_bytes"] < 0.01 * full, m
        dist.barrier()
    dist.destroy_process_group()


def run_trainer_ranks(fn, world, *args):
    ctx = torch.multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=fn, args=(r, world, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    assert [p.exitcode for p in procs] == [0] * world


def test_delta_syncs_through_the_transport_equal_full_syncs_bitwise(server, model_dir, saved):
    g = torch.Generator().manual_seed(3)
    states = [{n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in saved.items()}]
    for k in range(2):  # a handful of elements change per sync, a signed zero among them
        nxt = {n: t.clone() for n, t in states[-1].items()}
        for i, (n, t) in enumerate(sorted(nxt.items())):
            if i % 3 == k:
                t.view(-1)[(7 * i) % t.numel()] += 0.5
        first = sorted(nxt)[0]
        nxt[first].view(-1)[0] = -0.0 if k else 0.0
        states.append(nxt)
    run_trainer_ranks(_delta_rank, 2, server.url, model_dir, states)
