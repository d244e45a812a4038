"""GPU check kit: on a machine with one NVIDIA GPU, Python 3.12, a CUDA build of torch and no network,
install this project from a folder of wheels, run the GPU tests (those that need no SGLang server;
the Transformer Engine ones when TE imports), and the GPU benchmarks; write everything to one JSON file.

Before (on a machine with network; any OS):

    python bench/gpu_check.py --print-download > download.sh && sh download.sh   # fills ./wheels

(``pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_X_x86_64
... -r bench/gpu_kit/requirements.txt -d wheels``: the pinned list, for CPython 3.12 manylinux
x86_64. torch and its own dependencies -- triton, nvidia-*, sympy, networkx, jinja2, filelock,
fsspec, typing-extensions -- are not in it: the GPU machine's CUDA torch brings them. sglang is in it,
installed --no-deps with the packages its weight-sync import chain needs, not its server stack.)

The wheels come to about 180 MB. Where one transfer is limited (this project's device calls carry
64 MiB), ``--split-wheels wheels --part-mib 60`` moves them into wheels/part1, wheels/part2, ... of at
most that size each (one transfer each); ``--wheels`` reads a folder and the folders below it.

On the GPU machine (copy the checkout and ./wheels):

    python3.12 bench/gpu_check.py --wheels ./wheels --out gpu_check.json

Steps (each recorded in the JSON with its command, exit code, seconds and output tail):
  1. check: Python 3.12, torch with CUDA and one GPU visible; every pinned wheel present in --wheels
     (the folder or one below it; --wheels may be given more than once) and built for cp312 / abi3 /
     py3 on manylinux x86_64 (or any);
  2. install: ``pip install --no-index --find-links WHEELS --no-deps -r bench/gpu_kit/requirements.txt``,
     then this project ``pip install --no-index --no-deps --no-build-isolation -e .`` (its own pins are
     the CPU CI's; the CUDA torch stays);
  3. tests: ``pytest -m gpu`` over GPU_TESTS (the GPU tests that import neither SGLang nor TE), then
     over NEEDS_SGLANG (sglang's own weight-sync code on the GPU: CUDA IPC payloads through its
     serializer and FlattenedTensorBucket into another process, the transport with FP8, the DeepSeek
     bucket grouping; a failure when sglang's pieces do not import after the install), then over
     NEEDS_TE when ``transformer_engine.pytorch`` imports (FP8 step, THD packing; recorded as skipped
     otherwise). NOT_IN_KIT (a real SGLang server) needs the Docker image;
  4. benchmarks: bench/logprobs.py (fused vs chunked vs full log_softmax, V=151,936, 8k-32k tokens,
     hidden 2048, bf16), bench/gpu_bench.py train (one bf16 GSPO step of a ~1.6B MoE: tokens/s, MFU,
     padded and -- when the checkout has sequence packing -- packed) and export (weight-sync export
     stream bytes/s), bench/offload.py (the first offload of an 8 GiB training state with its pinned
     host memory reserved 10 s before, against allocating it inside the offload).
``--skip-install`` skips step 2 (an environment that already has the packages).

``--dry-run`` (CPU, no GPU, no install): checks the pinned list (parses, pins every package, covers
the project's core dependencies but torch with versions they allow, leaves torch's own stack out), the
--wheels folder if given, that every GPU test file is in exactly one of GPU_TESTS, NEEDS_SGLANG,
NEEDS_TE and NOT_IN_KIT, that the kit's test files collect, and runs each benchmark command in a CPU form (bench/logprobs.py at tiny
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

# GPU test files (pytest -m gpu), each in one list: those that need neither SGLang nor Transformer
# Engine; those that need sglang's weight-sync pieces (the kit installs sglang --no-deps); those that
# need TE (run when it imports); those that need a real SGLang server (not in the kit: the Docker image).
GPU_TESTS = [
    "tests/losses/test_vocab_parallel_gpu.py",
    "tests/losses/test_fused_logprobs_gpu.py",
    "tests/checkpoint/test_direct_writes_gpu.py",
    "tests/gpu/test_ipc_foreign_context_gpu.py",  # the planner's owner-direct foreign-context cost
]
NEEDS_SGLANG = ["tests/gpu/test_weight_payloads_gpu.py"]
NEEDS_TE = [
    "tests/gpu/test_fp8_te_gpu.py",
    "tests/gpu/test_packing_gpu.py",  # THD packing runs through Transformer Engine
    "tests/gpu/test_deepseek_v3_te_gpu.py",  # MLA / DSA on TE's layer spec against transformers
    "tests/gpu/test_lora_te_gpu.py",  # LoRA on TE's linears and grouped expert GEMM against the local spec's
]
NOT_IN_KIT = ["tests/gpu/test_sglang_gpu.py"]
TEST_LISTS = {"GPU_TESTS": GPU_TESTS, "NEEDS_SGLANG": NEEDS_SGLANG, "NEEDS_TE": NEEDS_TE, "NOT_IN_KIT": NOT_IN_KIT}
# what makes a list runnable, checked in the target Python after the install (None: always)
SGLANG_PROBE = (
    "from gspo_megatron.weight_sync import cuda_ipc; cuda_ipc.multiprocessing_serializer(); "
    "assert cuda_ipc.flattened_bucket_class() is not None; "
    "from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions"
)
TE_PROBE = "import transformer_engine.pytorch"

# torch's own stack: comes with the machine's CUDA torch, never in the kit's list
TORCH_STACK = re.compile(
    r"^(torch|triton|nvidia-.*|cuda-.*|sympy|mpmath|networkx|jinja2|markupsafe|filelock|"
    r"fsspec|typing-extensions)$"
)
PLATFORMS = [f"manylinux_2_{x}_x86_64" for x in range(39, 16, -1)] + [
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
    "linux_x86_64",
]


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
    env = {
        "python_version": "3.12",
        "python_full_version": "3.12.0",
        "sys_platform": "linux",
        "platform_machine": "x86_64",
        "implementation_name": "cpython",
        "os_name": "posix",
    }
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


def wheel_dirs(folders: str | list[str]) -> list[str]:
    """The folders holding wheels: each of ``folders`` and every folder below it that has a .whl."""
    out = []
    for folder in [folders] if isinstance(folders, str) else folders:
        for path in sorted(glob.glob(os.path.join(folder, "**", "*.whl"), recursive=True)):
            d = os.path.dirname(path)
            if d not in out:
                out.append(d)
    return out


def check_wheels(folders: str | list[str], pins: dict[str, str]) -> list[str]:
    """One line per pinned package without an installable wheel of its pinned version in ``folders``
    (a folder or a list of them; the folders below each are searched too)."""
    folders = [folders] if isinstance(folders, str) else list(folders)
    bad = [f for f in folders if not os.path.isdir(f)]
    if bad:
        return [f"--wheels: {f} is not a directory" for f in bad]
    folder = ", ".join(folders)
    found: dict[str, list[tuple[str, bool]]] = {}
    for path in (p for d in wheel_dirs(folders) for p in glob.glob(os.path.join(d, "*.whl"))):
        tags = wheel_tags(os.path.basename(path))
        if tags:
            name, version, py, abi, plat = tags
            found.setdefault(name, []).append((version, wheel_fits(py, abi, plat)))
    problems = []
    for name, version in sorted(pins.items()):
        have = found.get(name, [])
        if not any(v == version and ok for v, ok in have):
            what = (
                (
                    f"only {sorted({v for v, _ in have})}"
                    if not any(v == version for v, _ in have)
                    else "no cp312/abi3/py3 manylinux x86_64 build"
                )
                if have
                else "missing"
            )
            problems.append(f"--wheels {folder}: {name}=={version}: {what}")
    return problems


def split_wheels(folder: str, part_mib: float = 60.0) -> list[tuple[str, int]]:
    """Move the wheels of ``folder`` (and of any part folders already there) into ``folder``/part1,
    part2, ... of at most ``part_mib`` MiB each (first fit, largest first), so that each part goes in
    one size-limited transfer; returns (part folder, bytes) per part. A wheel larger than the limit
    gets a part of its own."""
    import shutil

    limit = int(part_mib * (1 << 20))
    wheels = sorted(
        glob.glob(os.path.join(folder, "*.whl")) + glob.glob(os.path.join(folder, "part*", "*.whl")),
        key=lambda p: (-os.path.getsize(p), os.path.basename(p)),
    )
    parts: list[list] = []  # [bytes, [paths]]
    for path in wheels:
        size = os.path.getsize(path)
        for part in parts:
            if part[0] + size <= limit:
                part[0] += size
                part[1].append(path)
                break
        else:
            parts.append([size, [path]])
    staging = os.path.join(folder, ".split")
    os.makedirs(staging, exist_ok=True)
    for path in wheels:  # out of the way first: a wheel may move from part2 to part1
        shutil.move(path, os.path.join(staging, os.path.basename(path)))
    for old in glob.glob(os.path.join(folder, "part*")):
        if os.path.isdir(old) and not os.listdir(old):
            os.rmdir(old)
    out = []
    for i, (size, paths) in enumerate(parts, 1):
        dest = os.path.join(folder, f"part{i}")
        os.makedirs(dest, exist_ok=True)
        for path in paths:
            shutil.move(os.path.join(staging, os.path.basename(path)), os.path.join(dest, os.path.basename(path)))
        out.append((dest, size))
    os.rmdir(staging)
    return out


def download_command(dest: str = "wheels") -> list[str]:
    plats = [a for p in PLATFORMS for a in ("--platform", p)]
    return [
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        *plats,
        "-d",
        dest,
        "-r",
        os.path.relpath(REQS, REPO),
    ]


def gpu_test_files() -> list[str]:
    """Every test file under tests/ that uses the gpu mark."""
    out = []
    for path in glob.glob(os.path.join(REPO, "tests", "**", "*.py"), recursive=True):
        with open(path) as f:
            if "mark.gpu" in f.read():
                out.append(os.path.relpath(path, REPO))
    return sorted(out)


def check_test_lists() -> list[str]:
    """Every GPU test file is in exactly one of the kit's lists, and every listed file exists."""
    problems = []
    listed = [f for files in TEST_LISTS.values() for f in files]
    for f in gpu_test_files():
        if f not in listed:
            problems.append(f"{f}: a GPU test file in none of bench/gpu_check.py's lists ({', '.join(TEST_LISTS)})")
    problems += [
        f"{f}: in more than one of bench/gpu_check.py's lists" for f in sorted(set(listed)) if listed.count(f) > 1
    ]
    problems += [
        f"{f}: listed in bench/gpu_check.py but missing" for f in listed if not os.path.isfile(os.path.join(REPO, f))
    ]
    return problems


def commands(args, py: str) -> list[tuple[str, list[str]]]:
    """(step name, argv) of everything the kit runs, in order; --dry-run variants where they exist.
    ``STEP_PROBES`` says which steps run only when a probe imports (checked when the step comes)."""
    out = os.path.abspath(args.out)
    work = os.path.splitext(out)[0] + "_parts"
    steps = []
    if not args.skip_install and not args.dry_run:
        steps += [
            (
                "install_wheels",
                [
                    py,
                    "-m",
                    "pip",
                    "install",
                    "--no-index",
                    *[a for d in wheel_dirs(args.wheels or []) for a in ("--find-links", d)],
                    "--no-deps",
                    "-r",
                    REQS,
                ],
            ),
            (
                "install_project",
                [py, "-m", "pip", "install", "--no-index", "--no-deps", "--no-build-isolation", "-e", REPO],
            ),
        ]
    tests = [
        ("gpu_tests", GPU_TESTS, None),
        ("gpu_tests_sglang", NEEDS_SGLANG, SGLANG_PROBE),
        ("gpu_tests_te", NEEDS_TE, TE_PROBE),
    ]
    if args.dry_run:
        steps += [
            (name, [py, "-m", "pytest", "-q", "--collect-only", "-m", "gpu", "-p", "no:cacheprovider", *files])
            for name, files, _ in tests
        ]
        steps += [
            (
                "bench_logprobs",
                [
                    py,
                    "bench/logprobs.py",
                    "--tokens",
                    "64",
                    "--vocab",
                    "1000",
                    "--hidden",
                    "16",
                    "--device",
                    "cpu",
                    "--json",
                    os.path.join(work, "logprobs.json"),
                ],
            ),
            ("bench_gpu_config", [py, "bench/gpu_bench.py", "all", "--dry-run"]),
            (
                "bench_gpu",
                [
                    py,
                    "bench/gpu_bench.py",
                    "all",
                    "--tiny",
                    "--sequences",
                    "6",
                    "--prompt",
                    "4",
                    "--max-response",
                    "24",
                    "--micro-batch-size",
                    "2",
                    "--bucket-mb",
                    "1",
                    "--repeats",
                    "1",
                    "--json",
                    os.path.join(work, "gpu_bench.json"),
                ],
            ),
            (
                "bench_offload",
                [
                    py,
                    "bench/offload.py",
                    "--gib",
                    "0.02",
                    "--device",
                    "cpu",
                    "--json",
                    os.path.join(work, "offload.json"),
                ],
            ),
            (
                "bench_step_profile",
                [
                    py,
                    "bench/step_profile.py",
                    "all",
                    "--tiny",
                    "--sequences",
                    "6",
                    "--prompt",
                    "4",
                    "--max-response",
                    "24",
                    "--micro-batch-size",
                    "2",
                    "--repeats",
                    "1",
                    "--json",
                    os.path.join(work, "step_profile.json"),
                ],
            ),
        ]
    else:
        steps += [
            (
                name,
                [
                    py,
                    "-m",
                    "pytest",
                    "-q",
                    "-m",
                    "gpu",
                    "-p",
                    "no:cacheprovider",
                    "--timeout",
                    "900",
                    "--junitxml",
                    os.path.join(work, f"{name}.xml"),
                    *files,
                ],
            )
            for name, files, _ in tests
        ]
        steps += [
            (
                "bench_logprobs",
                [
                    py,
                    "bench/logprobs.py",
                    "--tokens",
                    "8192,16384,32768",
                    "--vocab",
                    "151936",
                    "--hidden",
                    "2048",
                    "--dtype",
                    "bf16",
                    "--repeats",
                    "2",
                    "--json",
                    os.path.join(work, "logprobs.json"),
                ],
            ),
            ("bench_gpu", [py, "bench/gpu_bench.py", "all", "--json", os.path.join(work, "gpu_bench.json")]),
            (
                "bench_offload",
                [
                    py,
                    "bench/offload.py",
                    "--gib",
                    "8",
                    "--overlap-s",
                    "10",
                    "--json",
                    os.path.join(work, "offload.json"),
                ],
            ),
            (
                "bench_step_profile",
                [py, "bench/step_profile.py", "all", "--json", os.path.join(work, "step_profile.json")],
            ),
        ]
    return steps


# step -> (probe code, whether a failing probe fails the kit): sglang is in the kit's list, so after the
# install its pieces must import; TE is not, so its tests run only where the machine has it
STEP_PROBES = {"gpu_tests_sglang": (SGLANG_PROBE, True), "gpu_tests_te": (TE_PROBE, False)}


def probe(py: str, code: str, timeout: float = 600) -> tuple[bool, str]:
    """Whether ``code`` runs in ``py`` (with the checkout importable), and its output tail."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        p = subprocess.run([py, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout:.0f} s"
    return p.returncode == 0, (p.stdout + p.stderr)[-3000:]


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
    probe = (
        "import json, torch; print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, "
        "'gpus': torch.cuda.device_count(), 'gpu': torch.cuda.get_device_name() "
        "if torch.cuda.is_available() else None}))"
    )
    try:
        p = subprocess.run([py, "-c", probe], capture_output=True, text=True, timeout=300)
        env.update(
            json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {"torch_error": p.stderr[-500:]}
        )
    except Exception as e:  # noqa: BLE001 - recorded, checked below
        env["torch_error"] = str(e)
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--wheels",
        action="append",
        default=None,
        help="folder of the pinned wheels (searched with the folders below it; may be repeated)",
    )
    ap.add_argument("--out", default="gpu_check.json", help="the one results file")
    ap.add_argument("--skip-install", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="CPU: check the list and the commands only")
    ap.add_argument("--print-download", action="store_true", help="print the pip download command and exit")
    ap.add_argument(
        "--split-wheels",
        metavar="FOLDER",
        default=None,
        help="move FOLDER's wheels into FOLDER/part1, part2, ... of at most --part-mib each, and exit",
    )
    ap.add_argument("--part-mib", type=float, default=60.0)
    ap.add_argument("--step-timeout", type=float, default=3600.0)
    args = ap.parse_args(argv)
    if args.print_download:
        print(shlex.join(download_command()))
        return 0
    if args.split_wheels:
        parts = split_wheels(args.split_wheels, args.part_mib)
        for dest, size in parts:
            print(
                f"{os.path.relpath(dest)}: {size / (1 << 20):.1f} MiB, "
                f"{len(glob.glob(os.path.join(dest, '*.whl')))} wheels"
            )
        print(f"{len(parts)} parts, {sum(s for _, s in parts) / (1 << 20):.1f} MiB in all")
        return 0
    py = sys.executable
    pins, problems = read_requirements()
    if args.dry_run:
        problems += check_core_dependencies(pins)
        problems += check_test_lists()
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
    result: dict = {
        "kit": "gpu_check",
        "dry_run": args.dry_run,
        "env": env,
        "pins": pins,
        "problems": problems,
        "steps": [],
        "bench": {},
    }
    os.makedirs(os.path.splitext(os.path.abspath(args.out))[0] + "_parts", exist_ok=True)
    ok = not problems
    for p in problems:
        print(f"[gpu_check] problem: {p}", flush=True)
    if ok:
        for name, cmd in commands(args, py):
            if name in STEP_PROBES and not args.dry_run:
                code, required = STEP_PROBES[name]
                usable, why = probe(py, code)
                if not usable:
                    required = required and not args.skip_install
                    print(
                        f"[gpu_check] {name}: {'FAILED' if required else 'skipped'}: `{code}` does not run here",
                        flush=True,
                    )
                    result["steps"].append(
                        {
                            "name": name,
                            "cmd": shlex.join(cmd),
                            "rc": 1 if required else None,
                            "skipped": not required,
                            "seconds": 0.0,
                            "output_tail": f"probe `{code}` failed:\n{why}",
                        }
                    )
                    ok = ok and not required
                    continue
            step = run_step(name, cmd, args.step_timeout)
            result["steps"].append(step)
            if step["rc"] != 0 and name.startswith("install"):
                ok = False
                break
            ok = ok and step["rc"] == 0
        parts = os.path.splitext(os.path.abspath(args.out))[0] + "_parts"
        for key, fname in (
            ("logprobs", "logprobs.json"),
            ("gpu", "gpu_bench.json"),
            ("offload", "offload.json"),
            ("step_profile", "step_profile.json"),
        ):
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
