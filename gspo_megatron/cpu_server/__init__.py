"""The CPU stand-in for SGLang 0.5.23's HTTP server, so that CI runs the GPU wiring on CPU.

``python -m gspo_megatron.cpu_server --model-path DIR --tp-size 2 --port 30000 ...`` takes
``sglang.launch_server``'s flags (the subset the project passes; see ``args``) and answers the
routes the project's client calls with sglang's request / response fields and refusals. One engine
is ``tp_size`` processes joined by gloo, each holding its own TP shard of every weight, sharded by
name as SGLang's model runner does (``sharding``); generation runs the transformers model code on
rank 0 over the weights assembled from those shards. It is a test stand-in, not an inference
server: no batching across calls, no KV cache reuse, no speed. See docs/cpu_server.md.

Test helpers (never used by the trainer): :func:`read_weight_shards` reads every TP rank's shards
through the test-only route ``POST /cpu_server/weight_shards``; :func:`expected_shard` says what
SGLang's sharding puts on a rank.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Sequence

import torch

from gspo_megatron.cpu_server.sharding import expected_shard


def read_weight_shards(url: str, names: Sequence[str], timeout_s: float = 600.0) -> list[dict[str, torch.Tensor]]:
    """Every TP rank's shard of ``names`` (one dict per TP rank, rank order; a name a rank does not
    hold, e.g. another EP rank's expert, is absent from its dict). Test-only route."""
    from gspo_megatron.cpu_server.http_front import decode_tensor

    req = urllib.request.Request(
        f"{url.rstrip('/')}/cpu_server/weight_shards",
        data=json.dumps({"names": list(names)}).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        ranks = json.loads(resp.read())["ranks"]
    return [{n: decode_tensor(d) for n, d in r.items()} for r in ranks]


__all__ = ["expected_shard", "read_weight_shards"]
