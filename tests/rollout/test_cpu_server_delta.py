"""Delta sync on the CPU server: sglang's ``--custom-weight-loader`` route of
``update_weights_from_tensor`` (refusal of an unregistered load_format, as sglang's
``NotImplementedError``; the delta loader applied on every TP rank, its full tensors reaching the
shard store and sglang's own model class, whose NaN check at ``end_weight_update`` passes only when
every parameter was written), driven by the real ``CudaIpcTransport(delta=True)`` from two trainer ranks.
"""

import pytest
import torch
import torch.distributed as dist
from transformers import AutoConfig

from cpu_server_util import CpuServer, free_port
from gspo_megatron.rollout.cpu_server import expected_shard, read_weight_shards
from gspo_megatron.rollout.sglang_client import SGLangError, SGLangHttpClient
from gspo_megatron.rollout.sglang_compat import multiprocessing_serializer, use_cpu_shared_memory
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


def test_unregistered_loader_refused_and_stale_delta_fails(server, saved):
    client = SGLangHttpClient(server.url)
    info = client.server_info()
    assert info["custom_weight_loader"] == [LOADER_NAME]
    enc = DeltaEncoder()
    assert client.begin_weight_update()
    try:
        # a loader that exists but is not in --custom-weight-loader: sglang raises NotImplementedError
        with pytest.raises(SGLangError, match="Unknown load_format=gspo_megatron.weight_sync.delta.decode_entries"):
            client.update_weights_from_tensor(
                per_rank(enc.encode_bucket(sorted(saved.items()))),
                load_format="gspo_megatron.weight_sync.delta.decode_entries",
            )
        enc.reset()
        client.update_weights_from_tensor(per_rank(enc.encode_bucket(sorted(saved.items()))), load_format=LOADER_NAME)
        stale = DeltaEncoder()  # another trainer's copy (another epoch): the engine refuses its deltas
        stale.copy.update({n: t.clone() for n, t in saved.items()})
        with pytest.raises(SGLangError, match="epoch"):
            client.update_weights_from_tensor(
                per_rank(stale.encode_bucket(sorted(saved.items()))), load_format=LOADER_NAME
            )
    finally:
        client.end_weight_update()


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
