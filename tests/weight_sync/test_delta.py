"""Delta sync's codec (weight_sync/delta.py) and the engine-side loader (weight_sync/delta_loader.py)
without a server: round trips, the smaller-encoding choice, bit patterns (-0.0 / +0.0, NaN payloads)."""

import math

import pytest
import torch

from gspo_megatron.weight_sync import delta
from gspo_megatron.weight_sync.delta import (
    EPOCH,
    IDX,
    MASK,
    VAL,
    DeltaEncoder,
    changed_mask,
    choose_encoding,
    decode_entries,
    encoded_sizes,
    pack_bits,
    unpack_bits,
)
from gspo_megatron.weight_sync.delta_loader import COPY_ATTR, apply_deltas


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(delta.bit_view(a), delta.bit_view(b))


@pytest.mark.parametrize("n", [1, 7, 8, 9, 64, 1001])
def test_pack_bits_round_trip(n):
    g = torch.Generator().manual_seed(n)
    mask = torch.rand(n, generator=g) < 0.3
    packed = pack_bits(mask)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n / 8)
    assert torch.equal(unpack_bits(packed, n), mask)
    one = torch.zeros(n, dtype=torch.bool)
    one[n - 1] = True  # element i is bit i % 8 of byte i // 8
    assert pack_bits(one)[(n - 1) // 8] == 1 << ((n - 1) % 8)


def test_bit_patterns_count_signed_zero_and_nan_payloads():
    old = torch.tensor([0.0, 1.0, float("nan"), 2.0], dtype=torch.bfloat16)
    new = old.clone()
    new[0] = -0.0  # == 0.0 numerically, different bits
    raw = new.view(torch.int16)
    raw[2] = raw[2] | 1  # another NaN payload
    assert torch.equal(changed_mask(new, old), torch.tensor([True, False, True, False]))
    assert not changed_mask(old, old.clone()).any()  # NaN == NaN by bits


def test_choose_encoding_picks_the_smallest():
    # bf16, n = 1000: index k*6, bitmask 125 + k*2, full 2000
    assert choose_encoding(1000, 0, 2) == "index"
    assert choose_encoding(1000, 10, 2) == "index"  # 60 < 145
    assert choose_encoding(1000, 100, 2) == "bitmask"  # 600 > 325
    assert choose_encoding(1000, 937, 2) == "bitmask"  # 1999 < 2000
    assert encoded_sizes(1000, 938, 2)["bitmask"] == 2001
    assert choose_encoding(1000, 938, 2) == "full"  # not smaller
    assert choose_encoding(1000, 1000, 2) == "full"
    assert choose_encoding(0, 0, 2) == "full"  # nothing is smaller than an empty tensor


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_encoder_decoder_round_trip_over_many_syncs(dtype):
    g = torch.Generator().manual_seed(0)
    shapes = {"a.weight": (64, 48), "b.weight": (1000,), "c.bias": (3,), "d.empty": (0,)}
    state = {n: torch.randn(s, generator=g).to(dtype) for n, s in shapes.items()}
    enc, engine_copy = DeltaEncoder(), {}
    kinds = set()
    for step in range(8):
        if step:
            for n, t in state.items():  # a few changes of varied density, signed zeros included
                flat = t.view(-1)
                if flat.numel() == 0:
                    continue
                frac = (0.0, 0.001, 0.02, 0.3, 1.0)[step % 5]
                hit = torch.rand(flat.numel(), generator=g) < frac
                flat[hit] = flat[hit] + torch.randn(int(hit.sum()), generator=g).to(dtype) * 1e-2
                if step == 3:
                    flat[0] = -flat[0] if flat[0] == 0 else flat[0]
                    flat[-1] = 0.0 if step % 2 else -0.0
        entries = enc.encode_bucket(sorted(state.items()))
        assert entries[0][0] == EPOCH
        kinds |= {n.split("/")[1] for n, _ in entries if n.startswith(IDX) or n.startswith(MASK)}
        full = dict(decode_entries(entries, engine_copy))
        assert sorted(full) == sorted(state)  # every tensor, changed or not
        for n, t in state.items():
            assert bits_equal(full[n], t), (step, n)
            assert bits_equal(enc.copy[n], t)
    assert kinds == {"idx", "mask"}


def test_unchanged_tensor_costs_nothing_and_a_changed_one_only_its_elements():
    t = torch.randn(1000).to(torch.bfloat16)
    enc = DeltaEncoder()
    first = enc.encode_bucket([("w", t)])
    assert [n for n, _ in first] == [EPOCH, "w"] and enc.stats.wire_bytes == 2000
    enc.begin()
    same = enc.encode_bucket([("w", t.clone())])
    assert [n for n, _ in same] == [EPOCH, IDX + "w", VAL + "w"]
    assert enc.stats.wire_bytes == 0 and enc.stats.changed == 0
    t2 = t.clone()
    t2[[5, 500]] += 1
    enc.begin()
    out = dict(enc.encode_bucket([("w", t2)]))
    assert out[IDX + "w"].tolist() == [5, 500] and out[IDX + "w"].dtype == torch.int32
    assert enc.stats.wire_bytes == 2 * (4 + 2) and enc.stats.metrics()["sync/delta_fraction"] == 2 / 1000


def test_decoder_refuses_a_delta_without_its_base():
    t = torch.randn(100)
    enc = DeltaEncoder()
    engine_copy = {}
    decode_entries(enc.encode_bucket([("w", t)]), engine_copy)
    t[3] += 1
    entries = enc.encode_bucket([("w", t)])
    with pytest.raises(ValueError, match="holds no copy"):
        decode_entries(entries, {})  # a restarted engine
    other = DeltaEncoder()  # another trainer process (resume): another epoch
    other.copy["w"] = engine_copy["w"][1].clone()
    with pytest.raises(ValueError, match="epoch"):
        decode_entries(other.encode_bucket([("w", t)]), dict(engine_copy))
    enc.reset()  # after a reset everything goes full under a new epoch
    again = enc.encode_bucket([("w", t)])
    assert [n for n, _ in again] == [EPOCH, "w"]
    assert bits_equal(dict(decode_entries(again, {}))["w"], t)


def test_shape_change_goes_full():
    enc = DeltaEncoder()
    enc.encode_bucket([("w", torch.zeros(4))])
    assert [n for n, _ in enc.encode_bucket([("w", torch.zeros(5))])] == [EPOCH, "w"]


class _Model(torch.nn.Module):
    """Stands in for sglang's model: load_weights records what it was given and scribbles on it."""

    def __init__(self):
        super().__init__()
        self.loaded = {}

    def load_weights(self, weights):
        for n, t in weights:
            self.loaded[n] = t.clone()
            t.zero_()  # a loader may write into its input: the host copy must not change


def test_apply_deltas_is_the_custom_loader_signature_and_keeps_its_copy():
    model = _Model()
    g = torch.Generator().manual_seed(1)
    state = {"x": torch.randn(50, generator=g).to(torch.bfloat16), "y": torch.randn(7, generator=g)}
    enc = DeltaEncoder()
    for step in range(4):
        if step:
            state["x"][step] += 1
        apply_deltas(model, enc.encode_bucket(sorted(state.items())))
        for n, t in state.items():
            assert bits_equal(model.loaded[n], t)
            assert bits_equal(getattr(model, COPY_ATTR)[n][1], t)
    assert COPY_ATTR not in dict(model.named_parameters()) and COPY_ATTR not in dict(model.named_buffers())


class _RecordingClient:
    """An engine's HTTP client that runs what sglang 0.5.23 runs on update_weights_from_tensor with a
    custom loader: its own MultiprocessingSerializer.deserialize of TP rank i's payload, then the loader."""

    def __init__(self, tp: int):
        self.models = [torch.nn.Module() for _ in range(tp)]
        self.loaded: list[dict] = [{} for _ in range(tp)]
        for m, seen in zip(self.models, self.loaded):
            m.load_weights = lambda named, seen=seen: seen.update({n: t.clone() for n, t in named})

    def update_weights_from_tensor(self, payloads, load_format=None, flush_cache=False, weight_version=None):
        serializer = pytest.importorskip("sglang.srt.utils.common").MultiprocessingSerializer
        from gspo_megatron.weight_sync.delta_loader import LOADER_NAME

        assert load_format == LOADER_NAME and len(payloads) == len(self.models)
        for model, payload in zip(self.models, payloads):
            apply_deltas(model, serializer.deserialize(payload))


@pytest.mark.parametrize("dtype,fp8", [(torch.bfloat16, False), (torch.float32, False), (torch.bfloat16, True)])
def test_http_transport_by_value_and_files_rebuilds_every_sync_bitwise(tmp_path, dtype, fp8):
    """weight_sync/delta_http.py: each bucket's wire entries in a file the payload names (the payload
    pickled by value, read by sglang's own deserializer), the files gone after each sync; every engine
    TP rank holds the trainer's tensors bit for bit after every sync (``fp8``: the quantized tensors a
    full FP8 sync sends, FP8 codes in the safetensors files); a reset makes the next sync full."""
    import os

    from gspo_megatron.weight_sync.delta_http import DeltaHttpTransport
    from gspo_megatron.weight_sync.fp8_quant import quantize_bucket_fp8

    g = torch.Generator().manual_seed(1)
    big = "model.layers.0.self_attn.o_proj.weight"  # quantized with fp8 (2 blocks of 128)
    state = {big: torch.randn(128, 256, generator=g).to(dtype), "b.bias": torch.randn(5, generator=g).to(dtype)}
    clients = [_RecordingClient(2), _RecordingClient(1)]
    t = DeltaHttpTransport(
        clients, engine_world_sizes=[2, 1], full_dir=str(tmp_path / "d"), manage_session=False, fp8=fp8
    )
    for step in range(4):
        if step == 2:
            t.reset_delta()
        if step:
            flat = state[big].view(-1)
            flat[step::97] += 0.5
        t.begin(str(step))
        t.send_bucket(sorted(state.items()))
        t.end()
        want = dict(quantize_bucket_fp8(sorted(state.items()))) if fp8 else state
        full = t.delta_metrics()["sync/delta_tensors_full"]
        assert full == (len(want) if step in (0, 2) else 0), (step, full)  # the first sync and the one after a reset
        for c in clients:
            for seen in c.loaded:
                assert sorted(seen) == sorted(want) and all(bits_equal(seen[n], v) for n, v in want.items())
        assert not os.path.exists(tmp_path / "d") or not any((tmp_path / "d").iterdir())


def test_a_file_the_engine_host_cannot_see_is_named(tmp_path):
    from gspo_megatron.weight_sync.delta import file_entry

    entries = [(EPOCH, torch.tensor([7])), file_entry(str(tmp_path / "elsewhere.safetensors"))]
    with pytest.raises(ValueError, match="rollout.sync_delta_dir must be on a file system"):
        decode_entries(entries, {})


def _fp8_state(g: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """bf16 weights a DeepSeek-style FP8 sync quantizes (attention / expert projections; 3 x 2 blocks of
    128) and one it leaves alone (a norm), and the fp32 master weights behind the quantized one."""
    master = torch.randn(300, 256, generator=g) * 0.02
    return {
        "model.layers.0.mlp.experts.3.down_proj.weight": master.to(torch.bfloat16),
        "model.layers.0.post_attention_layernorm.weight": torch.randn(256, generator=g).to(torch.bfloat16),
    }, master


def _fp8_step(state, master, g, step: int) -> None:
    """An Adam-sized step (1e-4 per element) of the master weights, rounded to bf16; on step 3 one
    block's largest element doubles (its scale changes, so its codes change)."""
    name = "model.layers.0.mlp.experts.3.down_proj.weight"
    master -= 1e-4 * torch.sign(torch.randn(master.shape, generator=g))
    if step == 3:
        block = master[128:256, 0:128]
        r, c = divmod(int(block.abs().argmax()), block.shape[1])
        block[r, c] *= 2
    state[name] = master.to(torch.bfloat16)
    state["model.layers.0.post_attention_layernorm.weight"].view(-1)[step] += 1


def test_fp8_quantized_deltas_rebuild_the_fp8_sync_bitwise():
    """rollout.sync_delta with rollout.sync_fp8: the encoder compares the quantized bucket (FP8 codes,
    float32 block scales, unquantized tensors), the engine's copy rebuilds exactly what a full FP8 sync
    sends, a changed block scale arrives with its block, and after the first sync far fewer bytes go."""
    from gspo_megatron.weight_sync.fp8_quant import FP8_DTYPE, SCALE_SUFFIX, quantize_bucket_fp8

    g = torch.Generator().manual_seed(5)
    state, master = _fp8_state(g)
    enc, engine_copy = DeltaEncoder(), {}
    scale = "model.layers.0.mlp.experts.3.down_proj.weight" + SCALE_SUFFIX
    last_scale = None
    for step in range(5):
        if step:
            _fp8_step(state, master, g, step)
        sent = quantize_bucket_fp8(sorted(state.items()))
        assert {t.dtype for _, t in sent} == {FP8_DTYPE, torch.float32, torch.bfloat16}
        enc.begin()
        full = dict(decode_entries(enc.encode_bucket(sent), engine_copy))
        assert sorted(full) == sorted(n for n, _ in sent)
        for n, t in sent:
            assert bits_equal(full[n], t), (step, n)
        if step:
            assert enc.stats.wire_bytes < 0.5 * enc.stats.full_bytes, (step, enc.stats)
        if step == 3:
            assert not torch.equal(full[scale], last_scale)  # the doubled element's block re-scaled
        last_scale = full[scale].clone()


@pytest.mark.parametrize("fp8", [False, True])
def test_colocated_transport_fp8_deltas_reach_every_engine_rank_bitwise(fp8):
    """CudaIpcTransport(delta=True[, fp8=True]) on one trainer rank: the engine TP rank's loader (sglang's
    deserializer, then apply_deltas) holds after every sync what a full sync (FP8: quantized) gives."""
    pytest.importorskip("sglang")
    from gspo_megatron.weight_sync.cuda_ipc import CudaIpcTransport
    from gspo_megatron.weight_sync.fp8_quant import quantize_bucket_fp8

    g = torch.Generator().manual_seed(6)
    state, master = _fp8_state(g)
    client = _RecordingClient(1)
    t = CudaIpcTransport(client, gather_group=None, gather_src=0, fp8=fp8, delta=True, manage_session=False)
    for step in range(4):
        if step:
            _fp8_step(state, master, g, step)
        t.begin(str(step))
        t.send_bucket(sorted(state.items()))
        t.end()
        want = dict(quantize_bucket_fp8(sorted(state.items()))) if fp8 else state
        (seen,) = client.loaded
        assert sorted(seen) == sorted(want) and all(bits_equal(seen[n], v) for n, v in want.items()), step
        m = t.delta_metrics()
        assert m["sync/delta_tensors_full"] == (len(want) if step == 0 else 0), (step, m)
