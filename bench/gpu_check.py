"""GPU check kit: on a machine with one NVIDIA GPU, Python 3.12, a CUDA build of torch and no network,
install this project from a folder of wheels, run the GPU tests that need neither SGLang nor
Transformer Engine, and the GPU benchmarks; write everything to one JSON file.

Before (on a machine with network; any OS):

    python bench/gpu_check.py --print-download > download.sh && sh download.sh   # fills ./wheels

(``pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_X_x86_64
... -r bench/gpu_kit/requirements.txt -d wheels``: the pinned list, for CPython 3.12 manylinux
x86_64. torch and its own dependencies -- triton, nvidia-*, sympy, networkx, jinja2, filelock,
fsspec, typing-extensions -- are not in it: the GPU machine's CUDA torch brings them.)

On the GPU machine (copy the checkout and ./wheels):

    python3.12 bench/gpu_check.py --wheels ./wheels --out gpu_check.json

Steps (each recorded in the JSON with its command, exit code, seconds and output tail):
  1. check: Python 3.12, torch with CUDA and one GPU visible; every pinned wheel present in --wheels
     and built for cp312 / abi3 / py3 on manylinux x86_64 (or any);
  2. install: ``pip install --no-index --find-links WHEELS --no-deps -r bench/gpu_kit/requirements.txt``,
     then this project ``pip install --no-index --no-deps --no-build-isolation -e .`` (its own pins are
     the CPU CI's; the CUDA torch stays);
  3. tests: ``pytest -m gpu`` over GPU_TESTS (the GPU tests that import neither SGLang nor TE);
  4. benchmarks: bench/logprobs.py (fused vs chunked vs full log_softmax, V=151,936, 8k-32k tokens,
     hidden 2048, bf16), bench/gpu_bench.py train (one bf16 GSPO step of a ~1.6B MoE: tokens/s, MFU,
     padded and -- when the checkout has sequence packing -- packed) and export (weight-sync export
     stream bytes/s).
``--skip-install`` skips step 2 (an environment that already has the packages).

``--dry-run`` (CPU, no GPU, no install): checks the pinned list (parses, pins every package, covers
the project's core dependencies but torch with versions they allow, leaves torch's own stack out), the
--wheels folder if given, that every GPU test file is either in GPU_TESTS or in NEEDS_SGLANG_OR_TE,
that the test files collect, and runs each benchmark command in a CPU form (bench/logprobs.py at tiny
sizes; bench/gpu_bench.py's config for the real model, then its whole code on the demo's tiny MoE);
prints the commands. tests/test_gpu_check.py runs it.

Only the Python standard library is imported at the top: the script runs before anything is installed.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQS = os.path.join(REPO, "bench", "gpu_kit", "requirements.txt")

# GPU tests (pytest -m gpu) that need neither SGLang nor Transformer Engine, and those that do.
GPU_TESTS = ["tests/losses/test_vocab_parallel_gpu.py", "tests/losses/test_fused_logprobs_gpu.py",
             "tests/checkpoint/test_direct_writes_gpu.py"]
NEEDS_SGLANG_OR_TE = ["tests/gpu/test_sglang_gpu.py", "tests/gpu/test_fp8_te_gpu.py",
                      "tests/gpu/test_packing_gpu.py"]  # THD packing runs through Transformer Engine

# torch's own stack: comes with the machine's CUDA torch, never in the kit's list
TORCH_STACK = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*|sympy|mpmath|networkx|jinja2|markupsafe|filelock|"
                         r"fsspec|typing-extensions)$")
PLATFORMS = [f"manylinux_2_{x}_x86_64" for x in range(39, 16, -1)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_requirements(path: str = REQS) -> tuple[dict[str, str], list[str]]:
    """{normalized name: version} of the pinned list, and the problems found (one line each)."""
    pins, problems = {}, []
    with open(path) as f:
        for i, raw in enumerate(f, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)", line)
            if not m:
                problems.append(f"{path}:{i}: not a 'name==version' pin: {line!r}")
                continue
            name = norm(m[1])
            if TORCH_STACK.match(name):
                problems.append(f"{path}:{i}: {m[1]} belongs to the CUDA torch's own stack; leave it out")
            if name in pins:
                problems.append(f"{path}:{i}: {m[1]} pinned twice")
            pins[name] = m[2]
    return pins, problems


def check_core_dependencies(pins: dict[str, str]) -> list[str]:
    """Every core dependency of pyproject.toml (for Python 3.12) but torch is pinned at a version its
    specifier allows. Needs ``packaging`` and ``tomllib`` (the dry run's environment has them)."""
    import tomllib

    from packaging.requirements import Requirement

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    env = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
           "platform_machine": "x86_64", "implementation_name": "cpython", "os_name": "posix"}
    problems = []
    for d in deps:
        req = Requirement(d)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = norm(req.name)
        if name == "torch":
            continue
        if name not in pins:
            problems.append(f"{REQS}: core dependency {req} is not pinned")
        elif not req.specifier.contains(pins[name], prereleases=True):
            problems.append(f"{REQS}: {req.name}=={pins[name]} does not satisfy the project's {req}")
    return problems


def wheel_tags(filename: str) -> tuple[str, str, list[str], list[str], list[str]] | None:
    """(name, version, python tags, abi tags, platform tags) of a wheel file name, or None."""
    parts = filename[:-4].split("-") if filename.endswith(".whl") else []
    if len(parts) not in (5, 6):
        return None
    name, version = parts[0], parts[1]
    py, abi, plat = parts[-3], parts[-2], parts[-1]
    return norm(name), version, py.split("."), abi.split("."), plat.split(".")


def wheel_fits(py: list[str], abi: list[str], plat: list[str]) -> bool:
    """Installable on CPython 3.12, linux x86_64 (manylinux)."""
    def py_ok(t: str) -> bool:
        if t in ("py3", "py312", "cp312"):
            return True
        m = re.fullmatch(r"cp3(\d+)", t)
        return bool(m) and "abi3" in abi and int(m[1]) <= 12
    plat_ok = any(p == "any" or p in PLATFORMS or re.fullmatch(r"manylinux_2_\d+_x86_64", p) for p in plat)
    abi_ok = any(a in ("none", "abi3", "cp312") for a in abi)
    return any(py_ok(t) for t in py) and abi_ok and plat_ok


def check_wheels(folder: str, pins: dict[str, str]) -> list[str]:
    """One line per pinned package without an installable wheel of its pinned version in ``folder``."""
    if not os.path.isdir(folder):
        return [f"--wheels: {folder} is not a directory"]
    found: dict[str, list[tuple[str, bool]]] = {}
    for path in glob.glob(os.path.join(folder, "*.whl")):
        tags = wheel_tags(os.path.basename(path))
        if tags:
            name, version, py, abi, plat = tags
            found.setdefault(name, []).append((version, wheel_fits(py, abi, plat)))
    problems = []
    for name, version in sorted(pins.items()):
        have = found.get(name, [])
        if not any(v == version and ok for v, ok in have):
            what = (f"only {sorted({v for v, _ in have})}" if not any(v == version for v, _ in have)
                    else "no cp312/abi3/py3 manylinux x86_64 build") if have else "missing"
            problems.append(f"--wheels {folder}: {name}=={version}: {what}")
    return problems


def download_command(dest: str = "wheels") -> list[str]:
    plats = [a for p in PLATFORMS for a in ("--platform", p)]
    return ["pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", *plats,
            "-d", dest, "-r", os.path.relpath(REQS, REPO)]


def gpu_test_files() -> list[str]:
    out = []
    for path in glob.glob(os.path.join(REPO, "tests", "**", "*.py"), recursive=True):
        with open(path) as f:
            if "mark.gpu" in f.read():
                out.append(os.path.relpath(path, REPO))
    return sorted(out)


def commands(args, py: str) -> list[tuple[str, list[str]]]:
    """(step name, argv) of everything the kit runs, in order; --dry-run variants where they exist."""
    out = os.path.abspath(args.out)
    work = os.path.splitext(out)[0] + "_parts"
    steps = []
    if not args.skip_install and not args.dry_run:
        steps += [
            ("install_wheels", [py, "-m", "pip", "install", "--no-index", "--find-links", args.wheels, "--no-deps",
                                "-r", REQS]),
            ("install_project", [py, "-m", "pip", "install", "--no-index", "--no-deps", "--no-build-isolation",
                                 "-e", REPO]),
        ]
    if args.dry_run:
        steps += [
            ("gpu_tests", [py, "-m", "pytest", "-q", "--collect-only", "-m", "gpu", "-p", "no:cacheprovider",
                           *GPU_TESTS]),
            ("bench_logprobs", [py, "bench/logprobs.py", "--tokens", "64", "--vocab", "1000", "--hidden", "16",
                                "--device", "cpu", "--json", os.path.join(work, "logprobs.json")]),
            ("bench_gpu_config", [py, "bench/gpu_bench.py", "all", "--dry-run"]),
            ("bench_gpu", [py, "bench/gpu_bench.py", "all", "--tiny", "--sequences", "6", "--prompt", "4",
                           "--max-response", "24", "--micro-batch-size", "2", "--bucket-mb", "1", "--repeats", "1",
                           "--json", os.path.join(work, "gpu_bench.json")]),
        ]
    else:
        steps += [
            ("gpu_tests", [py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "--timeout", "900",
                           "--junitxml", os.path.join(work, "gpu_tests.xml"), *GPU_TESTS]),
            ("bench_logprobs", [py, "bench/logprobs.py", "--tokens", "8192,16384,32768", "--vocab", "151936",
                                "--hidden", "2048", "--dtype", "bf16", "--repeats", "2",
                                "--json", os.path.join(work, "logprobs.json")]),
            ("bench_gpu", [py, "bench/gpu_bench.py", "all", "--json", os.path.join(work, "gpu_bench.json")]),
        ]
    return steps


def run_step(name: str, argv: list[str], timeout: float) -> dict:
    print(f"[gpu_check] {name}: {shlex.join(argv)}", flush=True)
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        p = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = 124, f"timed out after {timeout:.0f} s\n{(e.stdout or b'')[-4000:]!r}"
    sec = time.perf_counter() - t0
    print(f"[gpu_check] {name}: exit {rc} in {sec:.1f} s", flush=True)
    if rc != 0:
        print(text[-3000:], flush=True)
    return {"name": name, "cmd": shlex.join(argv), "rc": rc, "seconds": sec, "output_tail": text[-6000:]}


def environment(py: str) -> dict:
    env = {"python": platform.python_version(), "machine": platform.machine()}
    probe = ("import json, torch; print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, "
             "'gpus': torch.cuda.device_count(), 'gpu': torch.cuda.get_device_name() "
             "if torch.cuda.is_available() else None}))")
    try:
        p = subprocess.run([py, "-c", probe], capture_output=True, text=True, timeout=300)
        env.update(json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else
                   {"torch_error": p.stderr[-500:]})
    except Exception as e:  # noqa: BLE001 - recorded, checked below
        env["torch_error"] = str(e)
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheels", default=None, help="folder of the pinned wheels (see --print-download)")
    ap.add_argument("--out", default="gpu_check.json", help="the one results file")
    ap.add_argument("--skip-install", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="CPU: check the list and the commands only")
    ap.add_argument("--print-download", action="store_true", help="print the pip download command and exit")
    ap.add_argument("--step-timeout", type=float, default=3600.0)
    args = ap.parse_args(argv)
    if args.print_download:
        print(shlex.join(download_command()))
        return 0
    py = sys.executable
    pins, problems = read_requirements()
    if args.dry_run:
        problems += check_core_dependencies(pins)
        missing = [f for f in gpu_test_files() if f not in GPU_TESTS + NEEDS_SGLANG_OR_TE]
        problems += [f"{f}: a GPU test file the kit neither runs (GPU_TESTS) nor excludes (NEEDS_SGLANG_OR_TE)"
                     for f in missing]
        problems += [f"{f}: listed in bench/gpu_check.py but missing" for f in GPU_TESTS + NEEDS_SGLANG_OR_TE
                     if not os.path.isfile(os.path.join(REPO, f))]
    if args.wheels:
        problems += check_wheels(args.wheels, pins)
    elif not args.dry_run and not args.skip_install:
        problems.append("--wheels is required to install (or pass --skip-install)")
    env = {} if args.dry_run else environment(py)
    if not args.dry_run:
        if not env.get("python", "").startswith("3.12"):
            problems.append(f"Python 3.12 expected, this is {env.get('python')}")
        if not env.get("gpus"):
            problems.append(f"torch sees no CUDA GPU ({env.get('torch_error') or env.get('torch')})")
    result: dict = {"kit": "gpu_check", "dry_run": args.dry_run, "env": env, "pins": pins, "problems": problems,
                    "steps": [], "bench": {}}
    os.makedirs(os.path.splitext(os.path.abspath(args.out))[0] + "_parts", exist_ok=True)
    ok = not problems
    for p in problems:
        print(f"[gpu_check] problem: {p}", flush=True)
    if ok:
        for name, cmd in commands(args, py):
            step = run_step(name, cmd, args.step_timeout)
            result["steps"].append(step)
            if step["rc"] != 0 and name.startswith("install"):
                ok = False
                break
            ok = ok and step["rc"] == 0
        parts = os.path.splitext(os.path.abspath(args.out))[0] + "_parts"
        for key, fname in (("logprobs", "logprobs.json"), ("gpu", "gpu_bench.json")):
            path = os.path.join(parts, fname)
            if os.path.isfile(path):
                with open(path) as f:
                    result["bench"][key] = json.load(f)
    result["ok"] = ok
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"[gpu_check] {'OK' if ok else 'FAILED'}; results in {args.out}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
