"""The loop that drives a step (rank 0's side): the :class:`~gspo_megatron.orchestration.session.RolloutSession`
(rollout, sync, restarts), the rollout batch (``batch``), the off-policy producer (``async_producer``),
the colocation of engines and training state (``colocation``), the check after a sync (``probe``) and
the session's construction from the config (``build``). Above the trainer and the weight sync, which it
drives; see docs/architecture.md, "Floors"."""
