"""Test instrumentation for the multi-node runs, and their launcher: torchrun runs this file, which
runs gspo-train (``train.main``) with :func:`check` as the session's ``after_sync`` argument. After
every sync, every engine TP rank's weights, read from the CPU server's processes by its
test-only route, must equal the trainer's HF export of that shard exactly. Rank 0 appends one line
per sync to ``$GSPO_SYNC_CHECK_FILE``.

An engine killed by the test between the sync and this check cannot be read: the line then says
``"unreachable"`` (the run's next engine call finds the engine dead, restarts it and re-syncs, and
that sync is checked); the check must never be what stops the run."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist


def check(syncer) -> None:
    from gspo_megatron.cpu_server import expected_shard, read_weight_shards
    from gspo_megatron.engines.sglang_client import SGLangHttpClient
    from gspo_megatron.models.weights import export_hf_weights

    full: dict[str, torch.Tensor] = {}
    for bucket in export_hf_weights(syncer.model, syncer.bucket_bytes, plan=syncer.plan, dst=0):
        if bucket:
            full.update((n, t.clone()) for n, t in bucket)
    if dist.get_rank() != 0:
        return
    hf_config = syncer.model.hf_config
    result = {"version": syncer.version, "engines": [], "mismatches": []}
    for url in syncer.topology.engine_urls:
        try:
            info = SGLangHttpClient(url).server_info()
            tp, ep = int(info["tp_size"]), int(info.get("ep_size", 1) or 1)
            shards = read_weight_shards(url, sorted(full))
        except Exception as e:  # noqa: BLE001 - a killed engine; see the module docstring
            result["unreachable"] = f"{url}: {type(e).__name__}: {e}"
            break
        checked = 0
        for tp_rank, held in enumerate(shards):
            for name, tensor in full.items():
                want = expected_shard(name, tensor, tp_rank, tp, ep, hf_config)
                if want is None:
                    continue
                got = held.get(name)
                checked += 1
                if got is None or got.dtype != want.dtype or not torch.equal(got, want):
                    result["mismatches"].append(f"{url} tp{tp_rank} {name}")
        result["engines"].append({"url": url, "tp": tp, "checked": checked})
    with open(os.environ["GSPO_SYNC_CHECK_FILE"], "a") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    from gspo_megatron.train import main

    sys.exit(main(sys.argv[1:], after_sync=check))
