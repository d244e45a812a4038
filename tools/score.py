"""Per-token log-probs of token sequences under a Megatron checkpoint or an HF model.

    torchrun --nproc-per-node N tools/score.py --checkpoint PATH --input IN.jsonl --output OUT.jsonl \
        [--tp T --pp P --ep E --etp X] [--micro-batch-size 4] [--max-tokens-per-micro-batch N]
        [--temperature 1.0]

PATH is a Megatron checkpoint (converted, training step or training root) or an HF directory.
Each input row is {"input_ids": [ints]}; each output row, in the same order, is
{"logprobs": [floats]}: log p(token_t | tokens_<t) for t = 1..n-1. N > tp*pp means data parallel
(rows are spread over the replicas). Log-probs are computed vocab-parallel (no vocab gather).
--max-tokens-per-micro-batch N > 0 packs whole rows into micro-batches of at most N tokens (no
padding between rows; rows balanced over the replicas by tokens) instead of --micro-batch-size rows.
Exit status: 0 done, 2 bad input (one-line message naming the argument, file or line).
"""

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

PROG = "score"


def parse_args(argv=None) -> argparse.Namespace:
    from gspo_megatron.convert import add_layout_args

    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="Megatron checkpoint or HF directory")
    p.add_argument("--input", required=True, help='JSONL with {"input_ids": [...]} per line')
    p.add_argument("--output", required=True, help='JSONL to write {"logprobs": [...]} per line')
    p.add_argument("--micro-batch-size", type=int, default=4, help="rows per forward pass")
    p.add_argument(
        "--max-tokens-per-micro-batch",
        type=int,
        default=0,
        help="pack whole rows into micro-batches of at most this many tokens (0 = off)",
    )
    p.add_argument("--temperature", type=float, default=1.0, help="logits are divided by it")
    p.add_argument("--dtype", default=None, help="override the checkpoint's dtype")
    add_layout_args(p, with_cp=True)
    return p.parse_args(argv)


def _model_config(path: str) -> dict:
    from gspo_megatron import convert

    if not os.path.exists(path):
        raise convert.UsageError(f"--checkpoint {path} does not exist")
    if convert.is_hf_dir(path):
        return convert.check_hf_dir(path)
    return convert.checkpoint_meta(path)[1]["hf_config"]


def main(argv=None) -> int:
    import torch

    from gspo_megatron import convert, score

    args = parse_args(argv)
    with convert.cli_errors(PROG):
        if args.cp > 1 and not torch.cuda.is_available():
            raise convert.UsageError(
                "--cp > 1 needs Transformer Engine's context-parallel attention (a CUDA GPU); "
                "it cannot run on this machine"
            )
        if args.micro_batch_size < 1:
            raise convert.UsageError(f"--micro-batch-size must be >= 1, got {args.micro_batch_size}")
        if not args.temperature > 0:
            raise convert.UsageError(f"--temperature must be > 0, got {args.temperature}")
        if args.dtype is not None and args.dtype not in convert.DTYPE_NAMES:
            raise convert.UsageError(f"--dtype must be one of {', '.join(convert.DTYPE_NAMES)}")
        hf = _model_config(args.checkpoint)
        convert.check_world_layout(hf, args.tp, args.pp, args.ep, args.etp, args.cp)
        rows = score.read_rows(args.input, hf["vocab_size"])
        budget = args.max_tokens_per_micro_batch
        if budget < 0:
            raise convert.UsageError(f"--max-tokens-per-micro-batch must be >= 0 (0 = off), got {budget}")
        seg = 2 * args.cp if args.cp > 1 else 1
        longest = max((-(-len(r) // seg) * seg for r in rows), default=0)
        if budget and longest > budget:
            raise convert.UsageError(
                f"--max-tokens-per-micro-batch={budget} is below the longest row of "
                f"{args.input} ({longest} tokens); rows are never split"
            )
        out_dir = os.path.dirname(os.path.abspath(args.output))
        if not os.path.isdir(out_dir):
            raise convert.UsageError(f"--output directory {out_dir} does not exist")

        def run() -> int:
            model, _ = convert.load_model(args.checkpoint, args.tp, args.pp, args.ep, args.etp, args.cp, args.dtype)
            return score.score_to_file(
                model, rows, args.output, args.micro_batch_size, args.temperature, max_tokens_per_micro_batch=budget
            )

        n = convert.run_distributed(run, args.tp, args.pp, args.ep, args.etp, args.cp)
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"scored {n} rows -> {args.output}")
    return 0


if __name__ == "__main__":
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(megatron|torch\.distributed)\.")
    sys.exit(main())
