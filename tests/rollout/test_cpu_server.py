"""The CPU rollout server driven by the project's own SGLang client and weight transports.

One tp-2 engine (tiny qwen3_moe, fp32) serves most tests; a two-"node" tp-2 / ep-2 engine (two
launches on this machine) serves the memory-saver and deterministic-inference tests; a tp-1 engine
the single-process CUDA-IPC path and the kill -9 test. Reference log-probs come from transformers'
own forward of the same tokens; every engine TP rank's shard is compared with ``expected_shard``.
"""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from cpu_server_util import CpuServer, alive, free_port
from gspo_megatron.cpu_server import expected_shard, read_weight_shards
from gspo_megatron.engines.base import SamplingParams
from gspo_megatron.engines.sglang_client import SGLangError, SGLangHttpClient
from gspo_megatron.engines.sglang_engine import SGLangRolloutEngine
from gspo_megatron.weight_sync.cuda_ipc import CudaIpcTransport, serialize_bucket
from gspo_megatron.weight_sync.nccl_broadcast import NcclBroadcastTransport

PROMPTS = [[5, 17, 42, 9], [100, 3]]


@pytest.fixture(scope="module")
def config(model_dir):
    return AutoConfig.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def tp2(model_dir, tmp_path_factory):
    server = CpuServer(model_dir, str(tmp_path_factory.mktemp("logs")), tp=2)
    print(f"tp2 server started in {server.start_s:.1f}s")
    yield server
    server.stop()


def perturbed(saved, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in saved.items()}


def reference_model(model_dir, state):
    """transformers' own model from the checkpoint (fp32), with ``state`` (checkpoint names) loaded."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if state is not None:
        from gspo_megatron.engines.hf_engine import HFCheckpointLayout

        layout = HFCheckpointLayout(model)
        for n, t in state.items():
            layout.load(n, t)
    return model


def reference_logprobs(model, prompt, response, temperature):
    """log_softmax(logits / T) of each response token under one unpadded forward."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / temperature, -1)
    return logp.gather(-1, ids[0, len(prompt) :, None])[:, 0]


def check_generation(url, model_dir, state, temperature=0.8, engine=None):
    engine = engine or SGLangRolloutEngine.attach([url])
    out = engine.generate(PROMPTS, 2, SamplingParams(temperature=temperature, max_new_tokens=6))
    model = reference_model(model_dir, state)
    for p, samples in zip(PROMPTS, out):
        for s in samples:
            assert s.response_ids and s.finish_reason in ("stop", "length")
            ref = reference_logprobs(model, p, s.response_ids, temperature)
            assert torch.allclose(torch.tensor(s.response_logprobs), ref, atol=1e-5, rtol=0), (s, ref)
    return out


def check_shards(url, config, state, tp, ep=1, names=None):
    names = sorted(names or state)
    shards = read_weight_shards(url, names)
    assert len(shards) == tp
    for rank in range(tp):
        for n in names:
            want = expected_shard(n, state[n], rank, tp, ep, config)
            if want is None:
                assert n not in shards[rank], (n, rank)
            else:
                assert torch.equal(shards[rank][n], want), (n, rank)


# -- tp 2 --------------------------------------------------------------------------------------------
def test_generate_logprobs_equal_transformers(tp2, model_dir, saved, config):
    client = SGLangHttpClient(tp2.url)
    assert client.tp_size == 2 and client.health()
    check_shards(tp2.url, config, saved, 2)
    check_generation(tp2.url, model_dir, None, temperature=0.8)
    # temperature 0: sglang samples argmax and, all requests greedy, reports log_softmax(logits)
    out = client.generate([PROMPTS[0]], [{"temperature": 0.0, "max_new_tokens": 4}], return_logprob=True)[0]
    ids = out["output_ids"]
    model = reference_model(model_dir, None)
    ref = reference_logprobs(model, PROMPTS[0], ids, 1.0)
    got = torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(got, ref, atol=1e-5, rtol=0)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    # top_k 1 with T=0.5 in an all-greedy batch: the temperature is skipped (sglang is_all_greedy)
    out = client.generate([PROMPTS[0]], [{"temperature": 0.5, "top_k": 1, "max_new_tokens": 3}])[0]
    ref = reference_logprobs(model, PROMPTS[0], out["output_ids"], 1.0)
    assert torch.allclose(torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]]), ref, atol=1e-5)


def _cuda_ipc_rank(rank, world, port, url, state, names):
    """A trainer rank colocated with engine TP rank ``rank``: the real CudaIpcTransport, CPU tensors."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group([0, 1], backend="gloo")
    client = SGLangHttpClient(url) if rank == 0 else None
    transport = CudaIpcTransport(client, gather_group=group, gather_src=0)
    transport.begin("1")
    for chunk in (names[: len(names) // 2], names[len(names) // 2 :]):
        transport.send_bucket([(n, state[n].clone()) for n in chunk])
    transport.end()
    dist.destroy_process_group()


def run_trainer_ranks(fn, world, *args):
    """Spawn ``world`` ranks and wait with ``join()`` (waitpid). Not ``distributed_harness``: its
    sentinel-based join never returns here, because the torch_shm_manager daemons that CPU tensor
    sharing starts inherit the children's sentinel pipes and live as long as the server's ranks."""
    ctx = torch.multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=fn, args=(r, world, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    assert [p.exitcode for p in procs] == [0] * world


def test_update_through_cuda_ipc_transport_one_payload_per_tp_rank(tp2, model_dir, saved, config):
    state = perturbed(saved, 1)
    run_trainer_ranks(_cuda_ipc_rank, 2, tp2.url, state, sorted(state))
    check_shards(tp2.url, config, state, 2)
    check_generation(tp2.url, model_dir, state)


def test_update_through_broadcast_transport_gloo(tp2, model_dir, saved, config):
    state = perturbed(saved, 2)
    client = SGLangHttpClient(tp2.url)
    transport = NcclBroadcastTransport(
        [client],
        engine_world_sizes=[client.tp_size],
        master_address="127.0.0.1",
        master_port=free_port(),
        backend="gloo",
        device="cpu",
        timeout_s=300,
    )  # sglang's group helper on both sides
    names = sorted(state)
    transport.begin("1")
    for chunk in (names[:10], names[10:]):
        transport.send_bucket([(n, state[n]) for n in chunk])
    transport.end()
    transport.close()
    check_shards(tp2.url, config, state, 2)
    check_generation(tp2.url, model_dir, state)


def test_each_sample_reports_the_weight_version_of_its_tokens(tp2, saved):
    """sglang 0.5.23's meta_info.weight_version / weight_versions (spans) on every sample, read by
    the client into per-token versions: each update's version, on every token generated after it."""
    engine = SGLangRolloutEngine.attach([tp2.url])
    client = SGLangHttpClient(tp2.url)
    for k, version in enumerate(("11", "12")):
        state = perturbed(saved, 10 + k)
        transport = NcclBroadcastTransport(
            [client],
            engine_world_sizes=[client.tp_size],
            master_address="127.0.0.1",
            master_port=free_port(),
            backend="gloo",
            device="cpu",
            timeout_s=300,
        )
        transport.begin(version)
        transport.send_bucket(sorted(state.items()))
        transport.end()
        transport.close()
        assert client.weight_version() == version
        out = engine.generate(PROMPTS, 2, SamplingParams(temperature=1.0, max_new_tokens=4))
        for group in out:
            for s in group:
                assert s.token_versions == [version] * len(s.response_ids), s
        raw = client.generate([PROMPTS[0]], [{"max_new_tokens": 3, "temperature": 1.0}])[0]["meta_info"]
        assert raw["weight_version"] == version
        assert raw["weight_versions"] == [{"version": version, "start": 0, "end": raw["completion_tokens"]}]


def test_refusals_as_sglang(tp2, saved, config):
    client = SGLangHttpClient(tp2.url)
    name = "model.layers.0.self_attn.q_proj.weight"
    before = read_weight_shards(tp2.url, [name])

    def per_rank(bucket):  # one payload per TP rank (a CPU payload is opened once: file_system refcount)
        return [serialize_bucket(bucket)[0] for _ in range(2)]

    with pytest.raises(SGLangError, match="must run between begin_weight_update"):
        client.update_weights_from_tensor(
            per_rank([(name, torch.zeros_like(saved[name]))]), load_format="flattened_bucket"
        )
    with pytest.raises(SGLangError, match="must run between begin_weight_update"):
        client.update_weights_from_distributed([name], ["float32"], [[64, 64]], "nope")
    with pytest.raises(SGLangError, match="no weight-update session is open"):
        client.post("end_weight_update", {})
    with pytest.raises(SGLangError, match="Get parameter by name failed"):
        client.get_weights_by_name(name)
    assert client.begin_weight_update()
    try:
        with pytest.raises(SGLangError, match="already open"):
            client.begin_weight_update()
        # sglang's load_weights skips names the model does not have: accepted, nothing changes
        client.update_weights_from_tensor(
            per_rank([("model.layers.0.no_such.weight", torch.ones(3))]), load_format="flattened_bucket"
        )
        with pytest.raises(SGLangError, match="Failed to receive weights"):
            client.update_weights_from_distributed([name], ["float32"], [[64, 64]], "no_group")
        # a tensor sglang's loader raises on (a shape mismatch) ends the server, as it ends sglang's
        # scheduler: test_cpu_server_delta.py::test_an_exception_in_the_update_ends_the_server_...
    finally:
        client.end_weight_update()
    after = read_weight_shards(tp2.url, [name])
    assert all(torch.equal(a[name], b[name]) for a, b in zip(before, after))
    # sampling_seed is ignored without --enable-deterministic-inference
    sp = {"temperature": 1.0, "max_new_tokens": 8, "sampling_seed": 7}
    a, b = (client.generate([PROMPTS[0]], [sp])[0]["output_ids"] for _ in range(2))
    assert a != b


# -- two nodes, tp 2, ep 2, memory saver, deterministic, dummy weights ---------------------------------
def test_two_node_ep_engine_memory_and_seeds(model_dir, saved, config, tmp_path):
    server = CpuServer(
        model_dir,
        str(tmp_path),
        tp=2,
        nnodes=2,
        extra=("--ep-size", "2", "--enable-memory-saver", "--enable-deterministic-inference", "--load-format", "dummy"),
    )
    try:
        client = SGLangHttpClient(server.url)
        expert = "model.layers.0.mlp.experts.3.up_proj.weight"
        shards = read_weight_shards(server.url, [expert])
        assert expert not in shards[0] and not torch.equal(shards[1][expert], saved[expert])  # dummy init
        # sync the checkpoint (one payload per TP rank, as the colocated transport sends)
        engine = SGLangRolloutEngine([client])
        fmt = "flattened_bucket"

        def sync():
            engine.begin_weight_update()
            names = sorted(saved)
            bucket = [(n, saved[n]) for n in names]
            # one payload per TP rank, as each colocated trainer rank sends its own
            for p0, p1 in zip(serialize_bucket(bucket), serialize_bucket(bucket)):
                client.update_weights_from_tensor([p0, p1], load_format=fmt)
            engine.end_weight_update()

        sync()
        check_shards(server.url, config, saved, 2, ep=2)
        check_generation(server.url, model_dir, None, engine=engine)
        # per-request sampling_seed honoured with --enable-deterministic-inference
        sp = {"temperature": 1.0, "max_new_tokens": 8, "sampling_seed": 7}
        a = client.generate([PROMPTS[0], PROMPTS[1]], [sp, dict(sp, sampling_seed=8)])
        b = client.generate([PROMPTS[0]], [sp])[0]
        assert (
            a[0]["output_ids"] == b["output_ids"]
            and a[0]["output_ids"] != client.generate([PROMPTS[0]], [dict(sp, sampling_seed=8)])[0]["output_ids"]
        )
        # release / resume: the shards' storage goes and comes back (contents lost: sync again)
        mem = client.request("GET", "cpu_server/memory")["ranks"]
        assert all(r["weights_bytes"] > 0 for r in mem)
        engine.release_memory()
        mem = client.request("GET", "cpu_server/memory")["ranks"]
        assert all(r["weights_bytes"] == 0 and r["assembled_model_bytes"] == 0 for r in mem)
        assert all(set(r["offload_tags"]) == {"weights", "kv_cache"} for r in mem)
        with pytest.raises(SGLangError):
            client.generate([PROMPTS[0]], [sp])
        engine.resume_memory(["weights"])
        with pytest.raises(SGLangError, match="kv_cache|weights"):
            client.resume_memory_occupation(["weights"])  # not released any more: sglang's KeyError
        mem = client.request("GET", "cpu_server/memory")["ranks"]
        assert all(r["weights_bytes"] > 0 for r in mem)
        zeros = read_weight_shards(server.url, [expert])
        assert not zeros[1][expert].any()
        sync()
        engine.resume_memory(["kv_cache"])
        check_shards(server.url, config, saved, 2, ep=2)
        check_generation(server.url, model_dir, None, engine=engine)
    finally:
        server.stop()
    assert not any(alive(p) for p in server.pids())


# -- tp 1: single-process CUDA-IPC path, lifecycle ---------------------------------------------------
def test_tp1_cuda_ipc_and_kill9_leaves_no_process(model_dir, saved, config, tmp_path):
    server = CpuServer(model_dir, str(tmp_path), tp=1)
    try:
        client = SGLangHttpClient(server.url)
        state = perturbed(saved, 3)
        transport = CudaIpcTransport(client)
        transport.begin("1")
        transport.send_bucket(list(state.items()))
        transport.end()
        check_shards(server.url, config, state, 1)
        pids = server.pids()
        assert len(pids) >= 2  # launcher, TP rank 0 (and multiprocessing's resource tracker)
        os.kill(server.procs[0].pid, signal.SIGKILL)
        server.procs[0].wait()
        deadline = time.monotonic() + 60
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(p) for p in pids)
        assert not client.health(timeout_s=2)
    finally:
        server.stop()
