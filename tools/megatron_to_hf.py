"""Export a Megatron-Core checkpoint (converted, or a training run's) to a Hugging Face directory.

    python tools/megatron_to_hf.py --checkpoint CKPT --output HF_DIR [--max-shard-size 5GB]
    torchrun --nproc-per-node 2 tools/megatron_to_hf.py --checkpoint RUN/checkpoints --output HF_DIR --tp 2

CKPT is a converted checkpoint, a training step directory, or a training checkpoint root (its
newest complete step). The checkpoint is loaded resharded into the layout this runs in (under
torchrun with no layout flags the ranks split the model: convert.split_layout); rank 0
lays out the safetensors shards (model.safetensors, or model-0000i-of-0000N.safetensors + index)
and every rank writes the tensors it owns into them; rank 0 writes config.json,
generation_config.json and tokenizer files. The output loads with
transformers.AutoModelForCausalLM.from_pretrained. Each rank holds its shard of the model plus one
gathered tensor.
A LoRA checkpoint exports merged (W + (alpha/r) B A); with --lora-format peft the adapters alone,
as a PEFT adapter directory (gspo_megatron/models/lora_peft.py; one process):
    python tools/megatron_to_hf.py --checkpoint RUN/checkpoints --output ADAPTER_DIR --lora-format peft
Exit status: 0 done, 2 bad input (one-line message on stderr).
"""

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

PROG = "megatron_to_hf"


def parse_args(argv=None) -> argparse.Namespace:
    from gspo_megatron.convert import add_layout_args

    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="checkpoint dir, step dir or checkpoint root")
    p.add_argument("--output", required=True, help="HF directory to write")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (e.g. 5GB, 500MB)")
    p.add_argument("--overwrite", action="store_true", help="replace the model files in --output")
    p.add_argument(
        "--lora-format",
        choices=("merged", "peft"),
        default="merged",
        help="a LoRA checkpoint: merged (the adapters folded into the base weights: a full HF model) "
        "or peft (adapter_config.json + adapter_model.safetensors only; one process; "
        "gspo_megatron/models/lora_peft.py)",
    )
    p.add_argument(
        "--base-model", default=None, help="--lora-format peft: base_model_name_or_path written to adapter_config.json"
    )
    add_layout_args(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    from gspo_megatron import convert
    from gspo_megatron.models.registry import get_family

    args = parse_args(argv)
    with convert.cli_errors(PROG):
        max_shard = convert.parse_size(args.max_shard_size)
        ckpt_dir, meta = convert.checkpoint_meta(args.checkpoint)
        get_family(meta["hf_config"])
        if args.lora_format == "peft":
            return _peft(args, ckpt_dir, meta)
        args.tp, args.pp, args.ep, args.etp = convert.split_layout(
            meta["hf_config"], args.tp, args.pp, args.ep, args.etp
        )
        convert.check_world_layout(meta["hf_config"], args.tp, args.pp, args.ep, args.etp)
        convert.prepare_output_dir(args.output, args.overwrite)
        files = convert.run_distributed(
            lambda: convert.megatron_to_hf(ckpt_dir, args.output, args.tp, args.pp, args.ep, args.etp, max_shard),
            args.tp,
            args.pp,
            args.ep,
            args.etp,
        )
        if files is not None:
            print(
                f"wrote {args.output} from {ckpt_dir} (step {meta['step']}): {len(files)} "
                f"safetensors file(s), {meta.get('dtype')}"
            )
    return 0


def _peft(args, ckpt_dir: str, meta: dict) -> int:
    """--lora-format peft: the adapters as a PEFT directory (one process: the adapters are whole)."""
    from gspo_megatron import convert
    from gspo_megatron.models.lora_peft import export_peft

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or (args.tp, args.pp, args.ep) != (1, 1, 1):
        raise convert.UsageError("--lora-format peft runs in one process (no torchrun, no --tp / --pp / --ep)")
    if not meta.get("lora"):
        raise convert.UsageError(
            f"--lora-format peft: {ckpt_dir} has no LoRA adapters (no model.lora in its "
            "metadata); export it without --lora-format"
        )
    os.makedirs(args.output, exist_ok=True)
    names = ("adapter_config.json", "adapter_model.safetensors")
    if not args.overwrite and any(os.path.exists(os.path.join(args.output, n)) for n in names):
        raise convert.UsageError(f"--output {args.output} already holds a PEFT adapter (pass --overwrite)")
    modules = convert.run_distributed(lambda: export_peft(ckpt_dir, args.output, args.base_model), 1, 1, 1, None)
    print(
        f"wrote PEFT adapter {args.output} from {ckpt_dir} (step {meta['step']}): r={meta['lora']['rank']}, "
        f"lora_alpha={meta['lora']['alpha']}, {len(modules)} modules"
    )
    return 0


if __name__ == "__main__":
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(megatron|torch\.distributed)\.")
    sys.exit(main())
