"""Does the production topology learn as the same run does in-process? Reward curves side by side.

The Qwen3-30B recipe's shape at tiny scale (configs/topology_30b_tiny.yaml: 4 ranks, TP2 x EP2, two
engines of TP2) trained for ``--steps`` steps with the same seed, data and hyper-parameters in each
of these placements:

- ``inprocess``: the transformers engine inside rank 0 (``rollout.engine=hf``): the reference;
- ``colocated``: two CPU-server engines (sglang's protocol) colocated with training, one node of 4 ranks;
- ``colocated-2nodes``: the same as two simulated nodes (``torchrun --nnodes 2 --node-rank K``);
- ``disaggregated``: two CPU-server engines on their own "GPUs", fed by NCCL-style broadcast (gloo).

Prints the mean reward per step of each (and a 5-step moving average), and the first / last five
steps' means: a placement whose curve stays flat while the in-process run climbs replays something
(issue 21, defect 9: the colocated engines reseeded their sampler on every memory resume).
Not a test (minutes of CPU): ``python bench/topology_learning.py --steps 40``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gspo_megatron.runtime.ports import free_port  # noqa: E402

CONFIG = os.path.join(ROOT, "configs", "topology_30b_tiny.yaml")
PLACEMENTS = {
    "inprocess": (1, ["rollout.engine=hf", "rollout.sync_mode=inprocess", "rollout.num_engines=1"]),
    "colocated": (1, []),
    "colocated-2nodes": (2, []),
    "disaggregated": (1, ["rollout.sync_mode=disaggregated", "rollout.num_engines=2"]),
}


def run(placement: str, steps: int, out: str, extra: list[str]) -> list[dict]:
    nodes, overrides = PLACEMENTS[placement]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    per_node = 4 // nodes
    procs = []
    for node in range(nodes):
        cmd = [torchrun, "--nnodes", str(nodes), "--node-rank", str(node), "--nproc-per-node", str(per_node),
               "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "gspo_megatron.train",
               "--config", CONFIG, f"output_dir={out}", f"train.steps={steps}", *overrides, *extra]
        log = open(os.path.join(os.path.dirname(out), f"{placement}-node{node}.log"), "w")
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    codes = [p.wait() for p in procs]
    if codes != [0] * nodes:
        raise SystemExit(f"{placement}: exit codes {codes}; logs in {os.path.dirname(out)}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def moving(xs: list[float], k: int = 5) -> list[float]:
    return [sum(xs[max(0, i - k + 1):i + 1]) / len(xs[max(0, i - k + 1):i + 1]) for i in range(len(xs))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--placements", default=",".join(PLACEMENTS), help="comma-separated: " + ", ".join(PLACEMENTS))
    ap.add_argument("overrides", nargs="*", help="extra config overrides for every run (e.g. seed=7)")
    args = ap.parse_args()
    curves, seconds = {}, {}
    with tempfile.TemporaryDirectory(prefix="topology_learning_") as tmp:
        for placement in args.placements.split(","):
            t0 = time.monotonic()
            metrics = run(placement, args.steps, os.path.join(tmp, placement), args.overrides)
            seconds[placement] = time.monotonic() - t0
            curves[placement] = [m["reward/mean"] for m in metrics]
            print(f"{placement}: {seconds[placement]:.0f} s", flush=True)
    names = list(curves)
    print("step  " + "  ".join(f"{n:>22}" for n in names))
    smooth = {n: moving(c) for n, c in curves.items()}
    for i in range(args.steps):
        print(f"{i + 1:>4}  " + "  ".join(f"{curves[n][i]:>10.3f} ({smooth[n][i]:>8.3f})" for n in names))
    for n in names:
        c = curves[n]
        print(f"{n}: first 5 steps {sum(c[:5]) / 5:.3f}, last 5 steps {sum(c[-5:]) / 5:.3f}, "
              f"ratio of time to inprocess {seconds[n] / seconds.get('inprocess', seconds[n]):.2f}")


if __name__ == "__main__":
    main()
