"""Conversion throughput: HF -> Megatron -> HF against a plain copy of the same bytes.

Generates a random Qwen3-MoE checkpoint of a few hundred MB (fp32, written by transformers'
save_pretrained), then in one process (a world of one, gloo) times
  1. HF -> Megatron: build the model without random init, stream the safetensors in, save the
     dist checkpoint (gspo_megatron.convert.hf_to_megatron);
  2. Megatron -> HF: build, load the dist checkpoint, stream export buckets into safetensors
     shards (gspo_megatron.convert.megatron_to_hf);
  3. the baseline: shutil.copy of the HF safetensors file (same bytes, same disk),
and prints MB/s of each and the ratios (conversion time / copy time). The round trip is checked
bitwise. Python/Megatron start-up (imports, process group) is outside the timings.

Usage: python bench/convert.py [--hidden 512] [--experts 16] [--layers 4] [--workdir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout


def _dir_bytes(path: str, suffix: str = "") -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files if f.endswith(suffix))
    return total


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--workdir", default=None, help="where to write (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the files")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TQDM_DISABLE", "1")  # progress bars would interleave with the table

    import torch
    from safetensors.torch import load_file

    from gspo_megatron import convert
    from gspo_megatron.models.tiny import save_tiny_hf_model
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed

    work = args.workdir or tempfile.mkdtemp(prefix="bench_convert_")
    hf_dir, ckpt, out = (os.path.join(work, n) for n in ("hf", "ckpt", "hf_out"))
    h = args.hidden
    save_tiny_hf_model("qwen3_moe", hf_dir, seed=0, vocab_size=args.vocab, hidden_size=h,
                       intermediate_size=2 * h, moe_intermediate_size=h, num_hidden_layers=args.layers,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=h // 8,
                       num_experts=args.experts, num_experts_per_tok=2)
    size = _dir_bytes(hf_dir, ".safetensors")
    mb = size / 1e6
    print(f"model: Qwen3-MoE hidden {h}, {args.layers} layers, {args.experts} experts, fp32: "
          f"{mb:.0f} MB of safetensors")

    init_distributed(ParallelLayout())
    try:
        _, t_in = _timed(lambda: convert.hf_to_megatron(hf_dir, ckpt))
        _, t_out = _timed(lambda: convert.megatron_to_hf(ckpt, out, max_shard_size=5 * 10**9))
    finally:
        destroy_distributed()
    _, t_copy = _timed(lambda: shutil.copy(os.path.join(hf_dir, "model.safetensors"),
                                           os.path.join(work, "copy.safetensors")))
    a, b = load_file(os.path.join(hf_dir, "model.safetensors")), load_file(os.path.join(out, "model.safetensors"))
    bitwise = sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)

    print(f"{'step':<28}{'seconds':>9}{'MB/s':>9}{'x copy':>9}")
    for name, t in (("plain copy (shutil.copy)", t_copy), ("HF -> Megatron", t_in),
                    ("Megatron -> HF", t_out), ("round trip", t_in + t_out)):
        copies = 2 if name == "round trip" else 1
        print(f"{name:<28}{t:>9.2f}{copies * mb / t:>9.0f}{t / (copies * t_copy):>9.1f}")
    print(f"round trip bitwise identical: {bitwise}")
    if not args.keep and args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":  # dist_checkpointing's save starts a multiprocessing manager
    main()
