"""Checkpoints: save / resume / prune (manager), Megatron dist-checkpoint writes (writer) and reads
in place (in_place_reads), and safetensors shard files laid out ahead for the HF export
(safetensors_shards)."""
