"""Conversion throughput: HF -> Megatron -> HF against a plain copy of the same bytes, on 1 and 2 ranks.

Generates a random Qwen3-MoE checkpoint of a few hundred MB (fp32, written by transformers'
save_pretrained), then times
  1. the baseline: shutil.copyfile of the HF safetensors file (same bytes, same disk; page cache,
     no fsync), and the same copy followed by fsync;
  2. HF -> Megatron (gspo_megatron.convert.hf_to_megatron: build the model without random init,
     read the safetensors into it, save the dist checkpoint, which fsyncs);
  3. Megatron -> HF (convert.megatron_to_hf: build, load the dist checkpoint, write the safetensors and fsync them);
each on one process and on 2 ranks under torchrun (no layout flags: the ranks split the model as
the tools do, convert.split_layout). Each conversion runs in a worker process (python or torchrun)
``--repeats`` times after start-up (imports, process group, outside the timings); the table shows
the first run of each (what a tool, one conversion per process, sees: one-time costs included) and
the best run (the machine is shared: the least disturbed one), their MB/s, their ratios to the
best plain copy measured in the same run (with and without fsync; "first" copies are the first
copy too, the ratios use the best copy), and the 2-rank speed-up. The outputs
are checked bitwise against the original tensors.

Usage: python bench/convert.py [--hidden 512] [--experts 16] [--layers 4] [--repeats 3] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout


def _dir_bytes(path: str, suffix: str = "") -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files if f.endswith(suffix))
    return total


def _copy(src: str, dst: str, fsync: bool) -> float:
    t0 = time.perf_counter()
    shutil.copyfile(src, dst)
    if fsync:
        with open(dst, "rb+") as f:
            os.fsync(f.fileno())
    t = time.perf_counter() - t0
    os.remove(dst)
    return t


def worker(args) -> None:
    """One rank of a timed conversion (python: a world of one; torchrun: N ranks)."""
    import torch.distributed as dist

    from gspo_megatron import convert
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed

    hf = load_hf_config(args.hf)
    tp, pp, ep, etp = convert.split_layout(hf, 1, 1, 1, None)
    init_distributed(ParallelLayout(tp=tp, pp=pp, ep=ep, etp=etp))
    rank0 = dist.get_rank() == 0
    times = {"in": [], "out": []}
    try:
        for r in range(args.repeats):
            ckpt, out = f"{args.out}_ckpt{r}", f"{args.out}_hf{r}"
            dist.barrier()
            t0 = time.perf_counter()
            convert.hf_to_megatron(args.hf, ckpt, tp, pp, ep, etp)
            dist.barrier()
            t1 = time.perf_counter()
            convert.megatron_to_hf(ckpt, out, tp, pp, ep, etp, max_shard_size=5 * 10**9)
            dist.barrier()
            times["in"].append(t1 - t0)
            times["out"].append(time.perf_counter() - t1)
            if rank0 and r < args.repeats - 1:
                shutil.rmtree(ckpt)
                shutil.rmtree(out)
            dist.barrier()
    finally:
        destroy_distributed()
    if rank0:
        print(
            "BENCH " + json.dumps(dict(times, layout=dict(tp=tp, pp=pp, ep=ep), ckpt_dir=ckpt, hf_out_dir=out)),
            flush=True,
        )


def _run_worker(hf: str, out: str, nproc: int, repeats: int) -> dict:
    args = [os.path.abspath(__file__), "--worker", "--hf", hf, "--out", out, "--repeats", str(repeats)]
    if nproc > 1:
        cmd = [
            os.path.join(os.path.dirname(sys.executable), "torchrun"),
            "--standalone",
            f"--nproc-per-node={nproc}",
            *args,
        ]
    else:
        cmd = [sys.executable, *args]
    env = dict(os.environ, TQDM_DISABLE="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"worker ({nproc} ranks) failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("BENCH ") :])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each conversion (best shown)")
    p.add_argument("--workdir", default=None, help="where to write (default: a temp dir, removed)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--hf", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TQDM_DISABLE", "1")  # progress bars would interleave with the table
    if args.worker:
        return worker(args)

    import torch
    from safetensors.torch import load_file

    from gspo_megatron.models.tiny import save_tiny_hf_model

    work = args.workdir or tempfile.mkdtemp(prefix="bench_convert_")
    hf_dir = os.path.join(work, "hf")
    h = args.hidden
    save_tiny_hf_model(
        "qwen3_moe",
        hf_dir,
        seed=0,
        vocab_size=args.vocab,
        hidden_size=h,
        intermediate_size=2 * h,
        moe_intermediate_size=h,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=h // 8,
        num_experts=args.experts,
        num_experts_per_tok=2,
    )
    mb = _dir_bytes(hf_dir, ".safetensors") / 1e6
    print(
        f"model: Qwen3-MoE hidden {h}, {args.layers} layers, {args.experts} experts, fp32: "
        f"{mb:.0f} MB of safetensors; best of {args.repeats} runs"
    )
    src = os.path.join(hf_dir, "model.safetensors")
    copies = {False: [], True: []}

    def sample_copies():
        for _ in range(args.repeats):
            for fsync in (False, True):
                copies[fsync].append(_copy(src, os.path.join(work, "copy.safetensors"), fsync))

    sample_copies()
    runs = {n: _run_worker(hf_dir, os.path.join(work, f"r{n}"), n, args.repeats) for n in (1, 2)}
    sample_copies()  # before and after: the copy sees the same machine as the conversions
    t_copy, t_sync = min(copies[False]), min(copies[True])

    original = load_file(src)
    bitwise = {}
    for n, r in runs.items():
        out = load_file(os.path.join(r["hf_out_dir"], "model.safetensors"))
        bitwise[n] = sorted(out) == sorted(original) and all(torch.equal(out[k], original[k]) for k in original)

    print(
        f"{'step':<34}{'first s':>8}{'MB/s':>7}{'x copy':>8}{'x c+fsync':>10}"
        f"{'best s':>8}{'MB/s':>7}{'x copy':>8}{'x c+fsync':>10}"
    )
    rows = [("plain copy (shutil.copyfile)", copies[False][0], t_copy), ("plain copy + fsync", copies[True][0], t_sync)]
    for n, r in runs.items():
        layout = "" if n == 1 else " (" + ", ".join(f"{k}={v}" for k, v in r["layout"].items() if v > 1) + ")"
        rows += [
            (f"HF -> Megatron, {n} rank{'s' * (n > 1)}{layout}", r["in"][0], min(r["in"])),
            (f"Megatron -> HF, {n} rank{'s' * (n > 1)}{layout}", r["out"][0], min(r["out"])),
        ]
    for name, first, best in rows:
        print(
            f"{name:<34}"
            + "".join(f"{t:>8.2f}{mb / t:>7.0f}{t / t_copy:>8.1f}{t / t_sync:>10.1f}" for t in (first, best))
        )
    for d in ("in", "out"):
        label = "HF -> Megatron" if d == "in" else "Megatron -> HF"
        print(
            f"2-rank speed-up, {label}: first run {runs[1][d][0] / runs[2][d][0]:.2f}x, "
            f"best {min(runs[1][d]) / min(runs[2][d]):.2f}x"
        )
    print(
        "all runs (s): "
        + "; ".join(
            f"{n} rank(s) {d}: {', '.join(f'{t:.2f}' for t in r[d])}" for n, r in runs.items() for d in ("in", "out")
        )
    )
    print(f"output bitwise identical to the original: 1 rank {bitwise[1]}, 2 ranks {bitwise[2]}")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":  # the workers start processes (torchrun, Megatron's checkpoint writers)
    main()
