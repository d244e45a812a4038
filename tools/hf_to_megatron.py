"""Convert a Hugging Face checkpoint into a Megatron-Core distributed checkpoint (torch_dist).

    python tools/hf_to_megatron.py --hf-dir HF_DIR --output CKPT_DIR [--dtype bfloat16]
    torchrun --nproc-per-node 4 tools/hf_to_megatron.py --hf-dir HF_DIR --output CKPT_DIR --tp 2 --pp 2

The layout it runs in only decides how the work is spread: the checkpoint loads into any TP/PP/EP
layout. Under torchrun with no layout flags the ranks split the model (pipeline stages, else expert
parallel: convert.split_layout), each reading and writing its share. Each rank holds only its own shard (allocated without random init) plus one HF tensor.
The dtype defaults to the one in config.json, so HF -> Megatron -> HF is bitwise. Tokenizer files
and generation_config.json are kept in the checkpoint for the way back.
Exit status: 0 done, 2 bad input (one-line message on stderr).
"""

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

PROG = "hf_to_megatron"


def parse_args(argv=None) -> argparse.Namespace:
    from gspo_megatron.convert import DTYPE_NAMES, add_layout_args

    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-dir", required=True, help="HF model directory (config.json + safetensors)")
    p.add_argument("--output", required=True, help="checkpoint directory to write")
    p.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        default=None,
        help="parameter dtype (default: config.json's torch_dtype / dtype)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    add_layout_args(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    from gspo_megatron import convert

    args = parse_args(argv)
    with convert.cli_errors(PROG):
        hf = convert.check_hf_dir(args.hf_dir)  # everything below is checked before heavy work
        dtype = args.dtype or convert.hf_dtype(hf)
        args.tp, args.pp, args.ep, args.etp = convert.split_layout(hf, args.tp, args.pp, args.ep, args.etp)
        convert.check_world_layout(hf, args.tp, args.pp, args.ep, args.etp)
        convert.prepare_output_dir(args.output, args.overwrite)
        out = convert.run_distributed(
            lambda: convert.hf_to_megatron(args.hf_dir, args.output, args.tp, args.pp, args.ep, args.etp, dtype),
            args.tp,
            args.pp,
            args.ep,
            args.etp,
        )
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"wrote Megatron checkpoint {out} ({dtype})")
    return 0


if __name__ == "__main__":
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(megatron|torch\.distributed)\.")
    sys.exit(main())
