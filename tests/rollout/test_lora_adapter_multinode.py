"""Colocated adapter sync (``rollout.lora_sync=adapter``, weight_sync/lora_adapter.py) to an engine whose
TP ranks span two simulated nodes (CPU server ``--nnodes 2``; node 1's processes run with
``GSPO_SIM_HOST=1``, so the CPU server's TP rank 1 is on another host than this process, the trainer's
rank 0): sglang's ``/load_lora_adapter_from_tensors`` has every TP rank deserialize its own payload, and
a CPU tensor that ForkingPickler put in a shared-memory segment of the trainer's host cannot be opened
there (the CPU server refuses it as sglang's rank would fail, cpu_server/hosts.py ``segments_of_host``).
The sync sends the adapters by value: both ranks decode them bitwise equal to what the trainer sent
(sglang's ``expected_checksums`` check, run by every TP rank) and the engine serves the adapter."""

from __future__ import annotations

import hashlib
import types

import pytest
import torch

from cpu_server_util import CpuServer
from gspo_megatron.engines.sglang_client import SGLangError, SGLangHttpClient
from gspo_megatron.engines.sglang_compat import multiprocessing_serializer, use_cpu_shared_memory
from test_cpu_server_lora import ALPHA, RANK, adapter, generate, merged_logprobs, post

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def two_nodes(model_dir, tmp_path_factory):
    extra = ("--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", *TARGETS)
    s = CpuServer(
        model_dir,
        str(tmp_path_factory.mktemp("two_nodes")),
        tp=2,
        nnodes=2,
        extra=(*extra, "--max-loras-per-batch", "2", "--max-loaded-loras", "2"),
        node_env={1: {"GSPO_SIM_HOST": "1"}},  # node 1's processes on another (simulated) host
    )
    yield s
    s.stop()


def sha256(t: torch.Tensor) -> str:  # managers/tp_worker.py's expected_checksums digest
    return hashlib.sha256(t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()).hexdigest()


class CheckingClient(SGLangHttpClient):
    """Adds sglang's ``expected_checksums`` (sha256 of each tensor the trainer sends) to the sync's
    ``/load_lora_adapter_from_tensors``: every engine TP rank checks what it decoded against them."""

    expected: dict[str, str] = {}

    def post(self, route, payload=None, **kw):
        if route == "load_lora_adapter_from_tensors":
            payload = dict(payload, expected_checksums=self.expected)
        return super().post(route, payload, **kw)


def shared_a_adapter(saved: dict, seed: int) -> tuple[dict, list[str]]:
    """The trainer's PEFT tensors (q/k/v of one fused linear share A, as ``gathered_peft_tensors``
    exports them) and their modules."""
    t = adapter(saved, seed, modules=TARGETS)
    mods = sorted({k.split(".lora_")[0].removeprefix("base_model.model.") for k in t})
    for m in mods:
        if m.endswith(".q_proj"):
            for p in ("k_proj", "v_proj"):
                t[f"base_model.model.{m[: -len('q_proj')]}{p}.lora_A.weight"] = t[f"base_model.model.{m}.lora_A.weight"]
    return t, mods


def syncer_for(client, monkeypatch):
    """An AdapterSyncer that runs its engine-side step (``_send_adapter``) only: the trainer's gather is
    replaced by the tensors the test hands it."""
    from gspo_megatron.weight_sync import lora_adapter as la

    monkeypatch.setattr(la, "unwrap_gpt", lambda m: types.SimpleNamespace(lora={"rank": RANK, "alpha": ALPHA}))
    s = la.AdapterSyncer.__new__(la.AdapterSyncer)
    s.model, s.adapter_dir, s.current, s.version, s.name = None, None, None, 1, la.ADAPTER_NAME
    s.engine = types.SimpleNamespace(clients=[client], lora_path=None)
    return s


def test_shared_memory_payload_refused_on_the_other_node(two_nodes, saved):
    """What the colocated sync sent before: ForkingPickler (sglang's MultiprocessingSerializer) with
    ``file_system`` sharing; TP rank 0 (this host) opens it, TP rank 1 (node 1) cannot."""
    use_cpu_shared_memory()
    tensors = adapter(saved, 1, modules=TARGETS)
    payloads = [multiprocessing_serializer().serialize(dict(tensors), output_str=True) for _ in range(2)]
    cfg = {"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": TARGETS}
    body = {"lora_name": "shm", "config_dict": cfg, "serialized_named_tensors": payloads}
    status, out = post(two_nodes.url, "load_lora_adapter_from_tensors", body)
    assert status == 400 and not out["success"], out
    assert "cannot open it" in out["error_message"] and "node1" in out["error_message"], out


def test_colocated_adapter_sync_across_two_nodes(two_nodes, model_dir, saved, monkeypatch):
    """Two syncs through ``AdapterSyncer._send_adapter``: each loads ``policy-v<N>`` on both nodes' TP
    ranks, bitwise what was sent (checked by every rank), unloads the previous version, and the engine
    serves the adapter (log-probs of the checkpoint with it merged)."""
    from gspo_megatron.weight_sync.lora_adapter import fuse_shared_a

    client = CheckingClient(two_nodes.url, timeout_s=600)
    syncer = syncer_for(client, monkeypatch)
    prompt = [5, 17, 42, 9, 3]
    for version, seed in ((1, 2), (2, 3)):
        tensors, mods = shared_a_adapter(saved, seed)
        sent, _ = fuse_shared_a(tensors, mods)
        assert any(".qkv_proj.lora_A." in k for k in sent)  # the fused form goes
        client.expected = {k: sha256(v) for k, v in sent.items()}
        syncer.version = version
        nbytes = syncer._send_adapter(f"policy-v{version}", tensors, mods)
        assert nbytes == sum(v.numel() * v.element_size() for v in sent.values())
        assert syncer.engine.lora_path == syncer.current == f"policy-v{version}"
        status, outs = generate(two_nodes.url, [prompt], lora_path=f"policy-v{version}")
        assert status == 200, outs
        got = [x[0] for x in outs[0]["meta_info"]["output_token_logprobs"]]
        want = merged_logprobs(model_dir, saved, tensors, prompt, outs[0]["output_ids"])
        assert max(abs(g - w) for g, w in zip(got, want)) < 1e-4, (got, want)
    status, out = generate(two_nodes.url, [prompt], lora_path="policy-v1")
    assert status == 400, out  # unloaded by the second sync
    with pytest.raises(SGLangError, match="MISMATCH"):  # the ranks do check: a wrong digest fails the load
        client.expected = dict(client.expected, **{next(iter(client.expected)): "0" * 64})
        syncer.version = 3
        syncer._send_adapter("policy-v3", *shared_a_adapter(saved, 3))
