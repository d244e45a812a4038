"""Launching and owning SGLang engines: the flags each engine starts with (``engine_args``, asking the
enabled components), the fleet of launched or attached engines (``engine_fleet``) and sglang's own
start-up refusals restated before a launch (``engine_startup_checks``)."""
