"""Does the production topology learn as the same run does in-process? Reward curves side by side.

The Qwen3-30B recipe's shape at tiny scale (configs/topology_30b_tiny.yaml: 4 ranks, TP2 x EP2, two
engines of TP2) trained for ``--steps`` steps with the same seed, data and hyper-parameters in each
of these placements:

- ``inprocess``: the transformers engine inside rank 0 (``rollout.engine=hf``): the reference;
- ``colocated``: two CPU-server engines (sglang's protocol) colocated with training, one node of 4 ranks;
- ``colocated-2nodes``: the same as two simulated nodes (``torchrun --nnodes 2 --node-rank K``);
- ``disaggregated``: two CPU-server engines on their own "GPUs", fed by NCCL-style broadcast (gloo);
- ``colocated-perturbed``: ``colocated`` with the engines' router moved
  (``GSPO_CPU_SERVER_ROUTER_PERTURBATION``, the CPU server's ``--router-logit-perturbation``, at
  ``--perturbation``): the engines route other experts than the trainer, as bf16 engines do;
- ``colocated-r3``: the same with ``rollout.routing_replay=r3`` (the trainer replays the engines' routes).

Prints the mean reward per step of each (and a 5-step moving average), and the first / last five
steps' means: a placement whose curve stays flat while the in-process run climbs replays something
(issue 21, defect 9: the colocated engines reseeded their sampler on every memory resume). Also the
mean ``rollout/logprob_abs_diff`` (engine vs trainer old-policy log-prob) and, where logged (r3),
``rollout/route_agreement`` of each run.
Not a test (minutes of CPU): ``python bench/topology_learning.py --steps 40``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gspo_megatron.cpu_server.args import PERTURBATION_ENV  # noqa: E402
from gspo_megatron.runtime.ports import free_port  # noqa: E402

CONFIG = os.path.join(ROOT, "configs", "topology_30b_tiny.yaml")
PLACEMENTS = {
    "inprocess": (1, ["rollout.engine=hf", "rollout.sync_mode=inprocess", "rollout.num_engines=1"]),
    "colocated": (1, []),
    "colocated-2nodes": (2, []),
    "disaggregated": (1, ["rollout.sync_mode=disaggregated", "rollout.num_engines=2"]),
    # + the engines' router perturbation (PERTURBED); without replay the post-sync log-prob probe
    # sees the routing gap (docs/training.md, "Routing replay"), so it is off in that run
    "colocated-perturbed": (1, ["rollout.sync_verify=false"]),
    "colocated-r3": (1, ["rollout.routing_replay=r3"]),
}
PERTURBED = ("colocated-perturbed", "colocated-r3")


def run(placement: str, steps: int, out: str, extra: list[str], perturbation: float = 3.0) -> list[dict]:
    nodes, overrides = PLACEMENTS[placement]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop(PERTURBATION_ENV, None)
    if placement in PERTURBED:
        env[PERTURBATION_ENV] = str(perturbation)
    per_node = 4 // nodes
    procs = []
    for node in range(nodes):
        cmd = [
            torchrun,
            "--nnodes",
            str(nodes),
            "--node-rank",
            str(node),
            "--nproc-per-node",
            str(per_node),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "-m",
            "gspo_megatron.train",
            "--config",
            CONFIG,
            f"output_dir={out}",
            f"train.steps={steps}",
            *overrides,
            *extra,
        ]
        log = open(os.path.join(os.path.dirname(out), f"{placement}-node{node}.log"), "w")
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    codes = [p.wait() for p in procs]
    if codes != [0] * nodes:
        raise SystemExit(f"{placement}: exit codes {codes}; logs in {os.path.dirname(out)}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def moving(xs: list[float], k: int = 5) -> list[float]:
    return [sum(xs[max(0, i - k + 1) : i + 1]) / len(xs[max(0, i - k + 1) : i + 1]) for i in range(len(xs))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--placements", default=",".join(PLACEMENTS), help="comma-separated: " + ", ".join(PLACEMENTS))
    ap.add_argument(
        "--perturbation",
        type=float,
        default=3.0,
        help="the engines' --router-logit-perturbation in " + " and ".join(PERTURBED),
    )
    ap.add_argument(
        "--workdir",
        default=None,
        help="keep the runs' outputs and logs here (default: a temporary directory, removed at the end)",
    )
    ap.add_argument("overrides", nargs="*", help="extra config overrides for every run (e.g. seed=7)")
    args = ap.parse_args()
    curves, seconds, gaps, agree = {}, {}, {}, {}
    with (
        contextlib.nullcontext(args.workdir)
        if args.workdir
        else tempfile.TemporaryDirectory(prefix="topology_learning_")
    ) as tmp:
        for placement in args.placements.split(","):
            t0 = time.monotonic()
            metrics = run(placement, args.steps, os.path.join(tmp, placement), args.overrides, args.perturbation)
            seconds[placement] = time.monotonic() - t0
            curves[placement] = [m["reward/mean"] for m in metrics]
            gaps[placement] = [m["rollout/logprob_abs_diff"] for m in metrics if "rollout/logprob_abs_diff" in m]
            agree[placement] = [m["rollout/route_agreement"] for m in metrics if "rollout/route_agreement" in m]
            print(f"{placement}: {seconds[placement]:.0f} s", flush=True)
    names = list(curves)
    print("step  " + "  ".join(f"{n:>22}" for n in names))
    smooth = {n: moving(c) for n, c in curves.items()}
    for i in range(args.steps):
        print(f"{i + 1:>4}  " + "  ".join(f"{curves[n][i]:>10.3f} ({smooth[n][i]:>8.3f})" for n in names))
    for n in names:
        c = curves[n]
        gap = f"{sum(gaps[n]) / len(gaps[n]):.3g}" if gaps[n] else "-"
        agreement = f", mean route_agreement {sum(agree[n]) / len(agree[n]):.4f}" if agree[n] else ""
        ratio = (
            f"ratio of time to inprocess {seconds[n] / seconds['inprocess']:.2f}, " if "inprocess" in seconds else ""
        )
        print(
            f"{n}: first 5 steps {sum(c[:5]) / 5:.3f}, last 5 steps {sum(c[-5:]) / 5:.3f}, {ratio}"
            f"mean logprob_abs_diff {gap}{agreement}, {seconds[n]:.0f} s"
        )


if __name__ == "__main__":
    main()
