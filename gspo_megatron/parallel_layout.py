"""The one check of a parallel layout (TP / PP / EP / ETP / CP) against the world size and the model.

Every caller uses :func:`layout_errors`: the config checks (``config.validation.validate`` with the world
size, ``validate_model_layout`` with the model; the trainer, ``gspo-train --dry-run`` and the planner
run them), the conversion and scoring tools (``convert.check_world_layout``), the model builder
(``models.build.check_layout``) and ``runtime.distributed.init_distributed``. Each error is one line
that names the field; ``prefix`` says how fields are spelled: ``"parallel."`` for the config
(``parallel.tp=3 must divide ...``), ``"--"`` for the tools' flags (``--tp=3 must divide ...``).

The rules (Megatron-Core's):
- every size >= 1;
- world: tp * pp * cp divides the world size (DP = world / (tp * pp * cp)), and so does
  ep * etp * pp (the expert layers' own decomposition);
- model: tp divides the attention heads, the KV heads (Megatron's num_query_groups), the vocabulary
  (the vocab-parallel output layer), the dense MLP width, the shared-expert width and the family's
  further TP-split dims (e.g. MLA's low-rank projections); ep divides the routed experts; etp divides
  one expert's width; pp divides the layers; ep > 1 needs experts; an MoE model with tp > 1 needs
  sequence parallelism.
"""

from __future__ import annotations

from gspo_megatron.runtime.world_layout import world_layout_errors

SIZES = ("tp", "pp", "ep", "etp", "cp")


def layout_errors(
    tp: int,
    pp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    cp: int = 1,
    *,
    world_size: int | None = None,
    hf: dict | None = None,
    sequence_parallel: bool | None = None,
    prefix: str = "parallel.",
) -> list[str]:
    """Every problem of the layout, one line each (empty: the layout works).

    ``etp`` None means etp = tp. ``world_size`` None skips the world checks, ``hf`` (config.json as a
    dict) None the model checks, ``sequence_parallel`` None the MoE sequence-parallel check. A
    config.json that no family reads raises the family's ValueError (naming the field)."""
    etp_v = tp if etp is None else etp
    sizes = {"tp": tp, "pp": pp, "ep": ep, "etp": etp_v, "cp": cp}
    e = world_layout_errors(tp, pp, ep, etp_v, cp, world_size=world_size, prefix=prefix)
    if e and (e[0].startswith("world size must") or any(v < 1 for v in sizes.values())):
        return e
    if hf is not None:
        e += _model_errors(hf, sizes, sequence_parallel, prefix)
    return e


def _model_errors(hf: dict, s: dict[str, int], sequence_parallel: bool | None, prefix: str) -> list[str]:
    from gspo_megatron.models.dims import ModelDims
    from gspo_megatron.models.registry import get_family

    d = ModelDims.from_hf_config(hf)
    tp, ep, etp, pp = s["tp"], s["ep"], s["etp"], s["pp"]
    e: list[str] = []

    def divides(name: str, size: int, what: str, n: int, why: str = "") -> None:
        if n % size:
            e.append(f"{prefix}{name}={size} must divide {what} = {n}{why}")

    divides("tp", tp, "num_attention_heads", d.num_heads)
    divides("tp", tp, "num_key_value_heads", d.num_kv_heads, " (Megatron needs num_query_groups % tp == 0)")
    padded = -(-d.vocab_size // tp) * tp
    divides(
        "tp",
        tp,
        "vocab_size",
        d.vocab_size,
        f" (the output layer is split over the TP ranks); pad the vocabulary to {padded} rows (with "
        f"transformers: model.resize_token_embeddings({padded}); model.save_pretrained(DIR)) or choose "
        f"a {prefix}tp that divides it",
    )
    if d.num_dense_layers:
        divides("tp", tp, "intermediate_size", d.ffn_hidden)
    for what, n in get_family(hf).tp_divisible(hf):
        divides("tp", tp, what, n)
    if d.num_experts:
        divides("ep", ep, "the number of experts", d.num_experts)
        divides("etp", etp, "moe_intermediate_size", d.moe_ffn_hidden)
        if d.shared_expert_ffn:
            divides("tp", tp, "the shared expert intermediate size", d.shared_expert_ffn)
        if tp > 1 and sequence_parallel is False:
            e.append(f"{prefix}sequence_parallel must be true for an MoE model with {prefix}tp > 1")
    elif ep > 1:
        e.append(f"{prefix}ep={ep} needs an MoE model; {d.model_type} has no experts")
    divides("pp", pp, "num_hidden_layers", d.num_layers)
    try:  # what Megatron-Core cannot build for this family (e.g. gpt_oss: expert biases need etp=1)
        get_family(hf).check_layout(hf, tp, pp, ep, etp)
    except ValueError as err:
        e.append(str(err).replace("parallel.", prefix))
    return e
