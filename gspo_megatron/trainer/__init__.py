"""The trainer: one GSPO step (step), micro-batches and Megatron passes (micro_batches), sequence
packing (packing), the optimizer (optimizer), the behaviour policy's log-probs (behaviour_policy)
and offloading the training state around rollouts (offload)."""
