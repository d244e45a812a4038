"""Facts of the wire between the trainer and the engines that two layers share (a leaf: imports nothing).

- ``NO_ROUTE``: the filler of a token position without an engine route in sglang's routed-experts
  payload laid on token positions (padding, a sequence's last token); written by
  ``engines/routing.py``, read by ``trainer/route_replay.py`` and ``trainer/packing.py``.
- ``FP8_BLOCK``: the side of the square weight blocks of sglang's block-wise FP8
  (``quantization_config.weight_block_size = [128, 128]``, one float32 ``weight_scale_inv`` per
  block); the trainer quantizes in it (``weight_sync/fp8_quant.py``) and the engines' config names it
  (``engines/engine_model.py``).
- ``SPEC_DEFAULT_MAX_RUNNING``: the ``--max-running-requests`` sglang 0.5.23 sets for speculative
  decoding (EAGLE family, which MTP drafts resolve to) when none is given (``server_args.py``
  ``_handle_eagle_family``: "Max running requests is reset to 48"); the CPU server reproduces it
  (``cpu_server/speculative.py``), the trainer's speculative component sets the flag above it
  (``features/speculative.py``).
"""

NO_ROUTE = -1
FP8_BLOCK = 128
SPEC_DEFAULT_MAX_RUNNING = 48
