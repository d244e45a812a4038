"""GPU tests: the weight-sync payloads as they cross processes on a real GPU, and the DeepSeek bucket
grouping of the export stream on the GPU.

- CUDA IPC through sglang's own code: a CUDA bucket of mixed dtypes is flattened by sglang's
  ``FlattenedTensorBucket`` and serialized by its ``MultiprocessingSerializer`` (CUDA IPC handles,
  with sglang's torch-reduction patch: the handle names the device by UUID), opened in a separate
  spawned process exactly as an sglang TP rank does (``monkey_patch_torch_reductions`` then the
  payload, ``weight_updater.deserialize_own_rank`` / ``_update_weights_from_flattened_bucket``), and
  compared by sha256 of every tensor's bytes.
- ``CudaIpcTransport`` against an engine in another process, with FP8 on: each quantized weight's
  ``weight_scale_inv`` arrives in the same payload (the same ``load_weights`` call) as the weight.
- The export stream of a tiny DeepSeek-V3 built on the GPU, cut into buckets small enough that the
  plan's name order, cut greedily, would split ``q_a_proj`` / ``kv_a_proj_with_mqa`` (sglang fuses the
  two only when both arrive in one ``load_weights`` call and drops a lone half): every bucket holds
  both halves of every fuse group.

Skipped on CPU (conftest) and without sglang (installed with ``--no-deps``, as the Makefile and the
GPU check kit do); the CPU twins of the first two are in tests/weight_sync/test_transports_cpu.py.
Spawned children re-import this module: keep its top level to pytest and torch.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import traceback

import pytest
import torch

pytestmark = pytest.mark.gpu

RECV_TIMEOUT_S = 300


def _need_sglang():
    pytest.importorskip("sglang")
    from gspo_megatron.weight_sync import cuda_ipc

    try:
        cuda_ipc.multiprocessing_serializer()
        ok = cuda_ipc.flattened_bucket_class() is not None
    except ImportError as e:
        pytest.skip(f"sglang's weight-sync pieces do not import here: {e}")
    if not ok:
        pytest.skip("this sglang has no FlattenedTensorBucket")
    return cuda_ipc


def _digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes in row-major order (on whatever device it lives)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


def _describe(t: torch.Tensor) -> tuple:
    return str(t.dtype), tuple(t.shape), _digest(t)


# ---------------------------------------------------------------- the engine side (spawned process)


def _engine_process(conn, device_index: int | None, decode: bool = False) -> None:
    """A stand-in sglang TP rank: patch torch's reductions as sglang's tp_worker / weight_updater do,
    then, for every message (a list of payload strings), open each payload on the GPU with
    ``cuda_ipc.deserialize_payload`` and answer with, per payload, ``[(name, device, dtype, shape,
    sha256), ...]``. The producer waits for the answer (as the HTTP call waits for the engine) and
    only then may free its buffer. ``decode``: the payloads are delta wire entries, rebuilt as the
    delta loader does (``weight_sync.delta.decode_entries`` with this process's host copy); the
    answer describes the rebuilt tensors (device: where the payload's tensors arrived)."""
    try:
        if device_index is not None:
            torch.cuda.set_device(device_index)
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        from gspo_megatron.weight_sync import cuda_ipc
        from gspo_megatron.weight_sync.delta import decode_entries

        monkey_patch_torch_reductions()
        copy: dict = {}
        conn.send(("ready", None))
    except Exception:  # noqa: BLE001 - reported to the test
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        msg = conn.recv()
        if msg is None:
            break
        try:
            out = []
            for payload in msg:
                tensors = cuda_ipc.deserialize_payload(payload)
                if decode and tensors:
                    device = tensors[0][1].device.type
                    tensors = [(name, t.to(device)) for name, t in decode_entries(tensors, copy)]
                out.append([(name, t.device.type, *_describe(t)) for name, t in tensors])
                del tensors
            if device_index is not None:
                torch.cuda.synchronize()
            conn.send(("ok", out))
        except Exception:  # noqa: BLE001 - reported to the test
            conn.send(("error", traceback.format_exc()))
    conn.close()


class _Engine:
    """The spawned engine process and its end of the pipe."""

    def __init__(self, device_index: int | None = None, decode: bool = False):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_engine_process, args=(child, device_index, decode), daemon=True)
        self.proc.start()
        child.close()
        self._answer()  # "ready"

    def _answer(self):
        if not self.conn.poll(RECV_TIMEOUT_S):
            raise TimeoutError(f"engine process gave no answer in {RECV_TIMEOUT_S} s (alive: {self.proc.is_alive()})")
        status, value = self.conn.recv()
        if status == "error":
            raise RuntimeError(f"engine process failed:\n{value}")
        return value

    def load(self, payloads: list[str]) -> list[list[tuple]]:
        self.conn.send(list(payloads))
        return self._answer()

    def close(self):
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=10)


def _cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture
def engine():
    e = _Engine(torch.cuda.current_device())
    yield e
    e.close()


# ---------------------------------------------------------------- (a) serializer + FlattenedTensorBucket


def _mixed_bucket(dev: torch.device, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Mixed dtypes, in an order that puts bf16 tensors of odd numel ahead of wider ones (the
    flattened bucket must keep every dtype view aligned), a non-contiguous tensor, and tensors big
    enough to be more than a toy copy."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    return [
        ("model.embed_tokens.weight", randn(7, 5).to(torch.bfloat16).to(dev)),  # 35 bf16 elements
        ("model.layers.0.self_attn.q_proj.weight", randn(6, 5).to(dev)),  # fp32 after an odd bf16 run
        ("model.layers.0.mlp.experts.1.up_proj.weight", randn(3, 4).to(torch.float8_e4m3fn).to(dev)),
        ("model.layers.0.mlp.router.expert_bias", torch.arange(6, dtype=torch.int32).view(2, 3).to(dev)),
        ("model.layers.1.self_attn.o_proj.weight", randn(1001, 999).to(torch.bfloat16).to(dev)),  # odd numel
        ("model.layers.1.mlp.down_proj.weight", randn(511, 1023).to(dev)),
        ("model.layers.1.mlp.experts.0.gate_proj.weight", randn(257, 129).to(torch.float8_e4m3fn).to(dev)),
        ("model.layers.1.self_attn.k_proj.weight", randn(130, 66).to(torch.bfloat16).to(dev).t()),  # strided
        ("model.norm.weight", randn(129).to(torch.bfloat16).to(dev)),
        ("model.layers.2.counts", torch.randint(-(2**31), 2**31 - 1, (4097,), generator=g, dtype=torch.int32).to(dev)),
    ]


def _round_trip(engine: _Engine, dev: torch.device, seed: int = 0) -> list[list[tuple]]:
    """Serialize a mixed bucket on ``dev`` with cuda_ipc.serialize_bucket, have the engine process
    open it, and check every tensor bit for bit by sha256; returns the engine's answer."""
    from gspo_megatron.weight_sync import cuda_ipc

    bucket = _mixed_bucket(dev, seed)
    want = {name: _describe(t) for name, t in bucket}
    payloads = cuda_ipc.serialize_bucket(bucket)
    assert payloads and all(isinstance(p, str) for p in payloads)
    got = engine.load(payloads)
    assert sum(len(p) for p in got) == len(bucket)
    assert {name for p in got for name, device_type, *_ in p if device_type != dev.type} == set()
    assert {name: tuple(rest) for p in got for name, _, *rest in p} == want
    assert {name: _describe(t) for name, t in bucket} == want  # the producer's tensors are untouched
    return got


def test_cuda_ipc_payload_is_bitwise_equal_in_another_process(engine):
    _need_sglang()
    got = _round_trip(engine, _cuda())
    assert len(got) == 1  # sglang 0.5.23's FlattenedTensorBucket mixes dtypes: one payload, one load call


def test_cuda_ipc_per_dtype_payloads_when_flattening_is_single_dtype(engine, monkeypatch):
    """Older sglang flattened one dtype per bucket: one payload per dtype, each opened on the GPU."""
    cuda_ipc = _need_sglang()
    real = cuda_ipc.flattened_bucket_class()

    class SingleDtype(real):
        supports_multi_dtypes = False

    monkeypatch.setattr(cuda_ipc, "flattened_bucket_class", lambda: SingleDtype)
    got = _round_trip(engine, _cuda(), seed=1)
    assert len(got) == len({t.dtype for _, t in _mixed_bucket(torch.device("cpu"), 1)})
    assert all(len({dtype for _, _, dtype, _, _ in p}) == 1 for p in got)


# ---------------------------------------------------------------- (b) CudaIpcTransport, FP8 on


class _EngineClient:
    """The engine client as CudaIpcTransport sees it (engines.sglang_client's methods): session calls
    are recorded, ``update_weights_from_tensor`` hands the payloads to the engine process and returns
    once it has loaded them, as sglang's HTTP endpoint does."""

    tp_size = 1

    def __init__(self, engine: _Engine):
        self.engine = engine
        self.calls: list = []
        self.loaded: list[list[list[tuple]]] = []

    def __getattr__(self, name):
        if name in {
            "pause_generation",
            "flush_cache",
            "begin_weight_update",
            "end_weight_update",
            "continue_generation",
        }:
            return lambda: self.calls.append(name)
        raise AttributeError(name)

    def update_weights_from_tensor(self, payloads, load_format=None, flush_cache=False, weight_version=None):
        self.calls.append(("update", len(payloads), load_format, flush_cache, weight_version))
        self.loaded.append(self.engine.load(payloads))


def _fp8_buckets(dev: torch.device) -> list[list[tuple[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(3)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype).to(dev)

    return [
        [
            ("model.layers.0.mlp.down_proj.weight", randn(300, 200)),  # 3 x 2 blocks, partial edges
            ("model.layers.0.self_attn.q_proj.weight", randn(130, 64)),
            ("model.layers.0.input_layernorm.weight", randn(64)),
        ],
        [
            ("model.layers.1.mlp.experts.3.up_proj.weight", randn(257, 128, dtype=torch.float32)),
            ("model.embed_tokens.weight", randn(33, 64)),
            ("model.norm.weight", torch.ones(64, device=dev)),
        ],
    ]


def _fp8_transport(engine: _Engine, dev: torch.device) -> None:
    """Two buckets through CudaIpcTransport(fp8=True) to the engine process: the session calls in
    order, one update per bucket, and each quantized weight's scale in the same payload as the weight,
    every tensor equal bit for bit to what the trainer quantized."""
    from gspo_megatron.weight_sync import cuda_ipc
    from gspo_megatron.weight_sync.fp8_quant import SCALE_SUFFIX, quantize_bucket_fp8

    buckets = _fp8_buckets(dev)
    client = _EngineClient(engine)
    t = cuda_ipc.CudaIpcTransport(client, fp8=True)
    t.begin("7")
    for b in buckets:
        t.send_bucket(b)
    t.end()
    assert client.calls[:3] == ["pause_generation", "flush_cache", "begin_weight_update"]
    assert client.calls[-3:] == ["end_weight_update", "flush_cache", "continue_generation"]
    assert [c for c in client.calls if isinstance(c, tuple)] == [("update", 1, "flattened_bucket", False, "7")] * 2
    assert len(client.loaded) == 2
    fp8 = str(torch.float8_e4m3fn)
    for b, loaded in zip(buckets, client.loaded):
        (payload,) = loaded  # one TP rank, one multi-dtype payload: one load_weights call
        got = {name: tuple(rest) for name, device_type, *rest in payload}
        assert {device_type for _, device_type, *_ in payload} == {dev.type}
        # quantizing is deterministic: what the trainer quantized is what the engine read, bit for bit
        assert got == {name: _describe(x) for name, x in quantize_bucket_fp8(b)}
        quantized = sorted(n for n, (dtype, _, _) in got.items() if dtype == fp8)
        assert quantized == sorted(n for n, x in b if x.dim() == 2 and "embed_tokens" not in n)
        for name, x in b:
            if name in quantized:  # the scale rides in the same payload as its weight
                assert got[name][1] == tuple(x.shape)
                assert got[name + SCALE_SUFFIX][:2] == (
                    str(torch.float32),
                    (-(-x.shape[0] // 128), -(-x.shape[1] // 128)),
                )
            else:  # norms, embeddings: sent as they are
                assert got[name] == _describe(x)


def test_cuda_ipc_transport_fp8_sends_scales_beside_weights(engine):
    _need_sglang()
    from gspo_megatron.weight_sync.fp8_quant import SCALE_SUFFIX, dequantize_blockwise_fp8, quantize_bucket_fp8

    _fp8_transport(engine, _cuda())
    # and the blockwise quantization is close on the GPU (e4m3: 3 mantissa bits)
    bucket = _fp8_buckets(_cuda())[0]
    w = bucket[0][1].float()
    q = dict(quantize_bucket_fp8(bucket))
    back = dequantize_blockwise_fp8(q[bucket[0][0]], q[bucket[0][0] + SCALE_SUFFIX])
    assert back.is_cuda and (back - w).abs().max() <= 0.07 * w.abs().max()


# ---------------------------------------------------------------- (c) DeepSeek-V3 fuse groups, GPU export

MLA_PAIR = ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa")


def _split_mla_layers(bucket_names: list[list[str]], num_layers: int, suffix: str = "weight") -> list[int]:
    """Layers whose q_a_proj and kv_a_proj_with_mqa ``<suffix>`` are not in one bucket (or missing)."""
    where = {n: i for i, names in enumerate(bucket_names) for n in names}
    out = []
    for layer in range(num_layers):
        q, kv = (where.get(f"model.layers.{layer}.{m}.{suffix}") for m in MLA_PAIR)
        if q is None or q != kv:
            out.append(layer)
    return out


def _name_order_greedy(items, bucket_bytes: int) -> list[list[str]]:
    """HF names per bucket of the plan in its sort-key (name) order cut greedily, item by item: the
    bucketer before fuse groups existed."""
    buckets, bucket, size = [], [], 0
    for it in sorted(items, key=lambda it: it.key):
        if bucket and size + it.nbytes > bucket_bytes:
            buckets.append(bucket)
            bucket, size = [], 0
        bucket.extend(it.hf_names)
        size += it.nbytes
    if bucket:
        buckets.append(bucket)
    return buckets


def _deepseek_export_worker(rank, world):
    from gspo_megatron.models.build import ModelOptions, build_model
    from gspo_megatron.models.registry import get_family
    from gspo_megatron.models.weights import build_export_plan, export_hf_weights
    from gspo_megatron.runtime.distributed import ParallelLayout, init_distributed
    from gspo_megatron.weight_sync.fp8_quant import quantize_bucket_fp8
    from tiny_models import tiny_hf_config

    init_distributed(ParallelLayout())
    hf = tiny_hf_config("deepseek_v3")
    layers = int(hf["num_hidden_layers"])
    # MLA runs on Megatron's local spec only (deepseek_v3.check_transformer_impl)
    model = build_model(hf, opts=ModelOptions(dtype="bfloat16", transformer_impl="local"))
    devices = {p.device.type for p in model.parameters()}
    plan = build_export_plan(model)
    items = plan[0]
    # a bucket size that holds a whole q_a / kv_a pair, at which the plan's name order cut greedily
    # splits the most layers' pairs (the smallest such size)
    pair = max(
        sum(it.nbytes for it in items if any(f".{i}.{m}." in n for n in it.hf_names for m in MLA_PAIR))
        for i in range(layers)
    )
    splits = {s: len(_split_mla_layers(_name_order_greedy(items, s), layers)) for s in range(pair, 1 << 19, 128)}
    size = max(splits, key=lambda s: (splits[s], -s))
    streamed, fp8_names, stream_devices = [], [], set()
    for bucket in export_hf_weights(model, size, plan=plan):
        stream_devices |= {t.device.type for _, t in bucket}
        streamed.append([(n, _digest(t)) for n, t in bucket])
        fp8_names.append([n for n, _ in quantize_bucket_fp8(bucket)])
    whole = {n: _digest(t) for bucket in export_hf_weights(model, 1 << 40, plan=plan) for n, t in bucket}
    names = [[n for n, _ in b] for b in streamed]
    mapping = get_family(hf).mapping(hf)
    fuse_key = getattr(mapping, "fuse_key", None)  # the declared fuse groups (models/mapping.py), if any
    groups = None
    if fuse_key is not None:
        groups = {}
        for i, b in enumerate(names):
            for n in b:
                k = fuse_key([n])
                if k is not None:
                    groups.setdefault(repr(k), set()).add(i)
        groups = {k: sorted(v) for k, v in groups.items()}
    return dict(
        layers=layers,
        devices=sorted(devices),
        stream_devices=sorted(stream_devices),
        size=size,
        pair=pair,
        old_split=splits[size],
        names=names,
        fp8=fp8_names,
        groups=groups,
        streamed={n: d for b in streamed for n, d in b},
        whole=whole,
    )


def test_deepseek_export_on_gpu_keeps_fuse_groups_in_one_bucket():
    from distributed_harness import run_ranks

    r = run_ranks(_deepseek_export_worker, 1, timeout=900)[0]
    assert r["devices"] == ["cuda"] and r["stream_devices"] == ["cuda"]
    # the bucket size is one at which the plan's name order, cut greedily, splits a pair
    assert r["old_split"] > 0, r["size"]
    assert len(r["names"]) > 3
    assert _split_mla_layers(r["names"], r["layers"]) == []
    if r["groups"] is not None:  # every declared fuse group instance lies in one bucket
        assert len(r["groups"]) == r["layers"], r["groups"]
        assert {k: v for k, v in r["groups"].items() if len(v) != 1} == {}
    # FP8 on sync quantizes per bucket: the scale pair lands together too
    assert _split_mla_layers(r["fp8"], r["layers"], "weight_scale_inv") == []
    # the bucketed stream carries the same bytes as one unbucketed export
    assert r["streamed"] == r["whole"]


# ---------------------------------------------------------------- (d) owner-direct payloads


def _flat_bucket(tensors: list[tuple[str, torch.Tensor]], slots: dict, dev: torch.device):
    """``tensors`` copied into one buffer on ``dev`` as the export stream's ``FlatBucket`` of a routed
    bucket (views into the buffer, ``slots`` as a holder's)."""
    from gspo_megatron.models.flat_layout import flat_layout, view
    from gspo_megatron.weight_sync.buckets import FlatBucket

    offsets, _, total = flat_layout([(0, t.element_size(), t.numel() * t.element_size()) for _, t in tensors])
    flat = torch.empty(total, dtype=torch.uint8, device=dev)
    bucket = FlatBucket()
    for (name, t), o in zip(tensors, offsets):
        v = view(flat, o, t.shape, t.dtype)
        v.copy_(t)
        bucket.append((name, v))
    bucket.flat, bucket.slots = flat, slots
    return bucket


def test_owner_direct_payloads_describe_one_cuda_buffer_per_engine_rank():
    """``OwnerDirectIpcTransport._payloads``: one CUDA buffer of a holder, described once per engine TP
    rank it serves (sglang's ``flattened_bucket`` payload with a metadata subset: the same IPC handle
    serialized per payload), each payload opened by its own engine process exactly once; the empty
    payloads (a fresh 1-byte buffer each) open as no tensors. Then with FP8: one flattened copy of the
    quantized bucket, the scales in the payload of their weight's engine rank."""
    _need_sglang()
    from types import SimpleNamespace

    from gspo_megatron.weight_sync.fp8_quant import quantize_bucket_fp8
    from gspo_megatron.weight_sync.owner_direct import OwnerDirectIpcTransport, OwnerDirectRouting

    dev = _cuda()
    tensors = [
        ("model.embed_tokens.weight", torch.randn(64, 32).to(torch.bfloat16)),  # every rank's
        ("model.layers.0.mlp.experts.0.up_proj.weight", torch.randn(256, 128)),  # engine TP rank 0's
        ("model.layers.0.mlp.experts.3.down_proj.weight", torch.randn(128, 256).to(torch.bfloat16)),  # rank 1's
        ("model.norm.weight", torch.randn(33).to(torch.bfloat16)),
    ]
    slots = {tensors[1][0]: ((0, 0),), tensors[2][0]: ((0, 1),)}
    bucket = _flat_bucket(tensors, slots, dev)
    routing = OwnerDirectRouting([SimpleNamespace(index=0, train_ranks=(0, 1))], [0, 0], engine_ep=2, num_experts=4)
    engines = [_Engine(torch.cuda.current_device()) for _ in range(2)]
    try:
        for fp8 in (False, True):
            transport = OwnerDirectIpcTransport(object(), routing=routing, world_group=None, fp8=fp8)
            sent = quantize_bucket_fp8(list(bucket)) if fp8 else list(bucket)
            want = {name: _describe(t) for name, t in sent}
            payloads = dict(transport._payloads(bucket))
            assert sorted(payloads) == [(0, 0), (0, 1)]
            got = [engines[i].load([payloads[(0, i)], transport._empty_payload()]) for i in range(2)]
            for i, (loaded, empty) in enumerate(got):
                assert empty == []
                names = {name for name, *_ in loaded}
                mine = {n for n, _ in tensors if slots.get(n, ((0, 0),))[0] == (0, i)}
                assert {n.removesuffix("_scale_inv") for n in names} == mine
                assert {n: tuple(rest) for n, device_type, *rest in loaded} == {n: want[n] for n in names}
                assert {device_type for _, device_type, *_ in loaded} == {"cuda"}
            transport._keep.clear()
    finally:
        for e in engines:
            e.close()


@pytest.mark.parametrize("fp8", [False, True])
def test_owner_direct_delta_payloads_rebuild_bitwise_in_engine_processes(fp8):
    """``OwnerDirectIpcTransport`` with delta: each engine TP rank's payload (a plain list of CUDA
    tensors: the epoch, full tensors, changed-element records) opened in its own process and rebuilt
    by the delta loader's decoding (``_engine_process(decode=True)``); the first sync is whole, the
    second sends changes only, and both rebuild every tensor of the rank bit for bit. ``fp8``: the
    bucket quantized first, the rebuilt tensors those a full FP8 sync sends (codes + block scales)."""
    _need_sglang()
    from types import SimpleNamespace

    from gspo_megatron.weight_sync.fp8_quant import SCALE_SUFFIX, quantize_bucket_fp8
    from gspo_megatron.weight_sync.owner_direct import OwnerDirectIpcTransport, OwnerDirectRouting

    dev = _cuda()
    g = torch.Generator().manual_seed(5)
    tensors = [
        ("model.embed_tokens.weight", torch.randn(64, 32, generator=g).to(torch.bfloat16)),
        ("model.layers.0.mlp.experts.0.up_proj.weight", torch.randn(256, 128, generator=g).to(torch.bfloat16)),
        ("model.layers.0.mlp.experts.3.down_proj.weight", torch.randn(128, 256, generator=g).to(torch.bfloat16)),
    ]
    slots = {tensors[1][0]: ((0, 0),), tensors[2][0]: ((0, 1),)}
    bucket = _flat_bucket(tensors, slots, dev)
    routing = OwnerDirectRouting([SimpleNamespace(index=0, train_ranks=(0, 1))], [0, 0], engine_ep=2, num_experts=4)
    transport = OwnerDirectIpcTransport(object(), routing=routing, world_group=None, delta=True, fp8=fp8)
    engines = [_Engine(torch.cuda.current_device(), decode=True) for _ in range(2)]
    try:
        for sync in range(2):
            if sync:  # a few elements of each tensor change, as an optimizer step does
                for _, v in bucket:
                    v.view(-1)[:: max(1, v.numel() // 7)] += 1
            transport.encoder.begin()
            payloads = dict(transport._payloads(bucket))
            sent = quantize_bucket_fp8(list(bucket)) if fp8 else list(bucket)
            for i in range(2):
                (rebuilt,) = engines[i].load([payloads[(0, i)]])
                mine = [n for n, _ in sent if slots.get(n.removesuffix(SCALE_SUFFIX), ((0, 0),))[0] == (0, i)]
                assert [r[0] for r in rebuilt] == mine
                assert {r[1] for r in rebuilt} == {"cuda"}  # the payload's tensors arrived on the GPU
                assert {r[0]: tuple(r[2:]) for r in rebuilt} == {n: _describe(v) for n, v in sent if n in mine}
            stats = transport.encoder.stats
            assert (stats.encodings["full"] == len(sent)) if sync == 0 else (stats.wire_bytes < stats.full_bytes / 2)
            transport._keep.clear()
    finally:
        for e in engines:
            e.close()
