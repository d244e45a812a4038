"""The GPU environment runs the versions the CPU suite runs (issue 21, defect 3).

pyproject's `gpu` extra is what the Docker image resolves (Dockerfile step 1). It used to allow
`megatron-core>=0.16.1,<0.20`; pip then picked 0.19.2, which has no `GroupedMLP`, while the suite
runs 0.16.1. So every requirement on megatron-core, sglang and transformer-engine, in the `gpu` extra
and in the core dependencies (whatever its environment marker), must be one exact `==` pin, equal to:
- megatron-core: the version installed in this test environment;
- sglang: the version installed here (with --no-deps, Makefile) = ``SGLANG_VERSION_TESTED``;
- transformer-engine: ``TE_VERSION_READ`` (it does not install without CUDA; the version whose source
  the FP8 rules were read from: trainer/micro_batches.py, tests/pipeline/test_fp8_padding.py).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = os.path.join(os.path.dirname(__file__), "..")
TE_VERSION_READ = "2.20.2"
CHECKED = ("megatron-core", "sglang", "transformer-engine")


def expected_versions() -> dict[str, str]:
    from gspo_megatron.engines.sglang_compat import SGLANG_VERSION_TESTED

    return {
        "megatron-core": importlib.metadata.version("megatron-core"),
        "sglang": SGLANG_VERSION_TESTED,
        "transformer-engine": TE_VERSION_READ,
    }


def _exact(req: Requirement) -> str | None:
    """The version a requirement pins exactly (one ``==``/``===`` without a wildcard), else None."""
    specs = list(req.specifier)
    if len(specs) == 1 and specs[0].operator in ("==", "===") and "*" not in specs[0].version:
        return specs[0].version
    return None


def pin_problems(pyproject: dict, expected: dict[str, str]) -> list[str]:
    """One line per requirement on a checked package that is not exactly the expected version, and
    per checked package the `gpu` extra lacks (megatron-core: also the core dependencies)."""
    lists = {
        "dependencies": pyproject["project"]["dependencies"],
        "optional-dependencies.gpu": pyproject["project"]["optional-dependencies"]["gpu"],
    }
    problems = []
    for where, lines in lists.items():
        seen = set()
        for line in lines:
            req = Requirement(line)
            name = canonicalize_name(req.name)
            if name not in expected:
                continue
            seen.add(name)
            version = _exact(req)
            if version != expected[name]:
                problems.append(
                    f"{where}: {line!r} allows other versions than {name}=={expected[name]}, the one the CPU suite runs"
                )
        needed = set(expected) if where.endswith("gpu") else {"megatron-core"}
        problems += [f"{where}: no requirement on {n}" for n in sorted(needed - seen)]
    return problems


def test_gpu_extra_and_core_dependencies_pin_what_the_suite_runs():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        pyproject = tomllib.load(f)
    assert pin_problems(pyproject, expected_versions()) == []


def test_expected_versions_are_the_installed_ones():
    exp = expected_versions()
    assert exp["megatron-core"] == "0.16.1"  # the Megatron-Core every module here was read against
    assert importlib.metadata.version("sglang") == exp["sglang"]


def test_makefile_installs_the_pinned_sglang():
    with open(os.path.join(ROOT, "Makefile")) as f:
        pins = re.findall(r"sglang==([\w.]+)", f.read())
    assert pins and set(pins) == {expected_versions()["sglang"]}


def test_the_check_refuses_ranges_and_markers_that_escape_the_pin():
    """The lines this check exists for (pyproject before the fix) are reported, each one."""
    old = {
        "project": {
            "dependencies": [
                "torch==2.13.0",
                "megatron-core==0.16.1; python_version < '3.12'",
                "megatron-core>=0.16.1,<0.20; python_version >= '3.12'",
            ],
            "optional-dependencies": {
                "gpu": [
                    "sglang==0.5.23",
                    "sglang-router==0.3.2",
                    "megatron-core>=0.16.1,<0.20",
                    "transformer-engine[core_cu13]==2.20.2",
                ]
            },
        }
    }
    problems = pin_problems(old, expected_versions())
    assert len(problems) == 2 and all("megatron-core>=0.16.1,<0.20" in p for p in problems), problems
    wrong = {
        "project": {
            "dependencies": ["megatron-core==0.16.1"],
            "optional-dependencies": {
                "gpu": ["sglang>=0.5.23", "megatron-core==0.16.*", "transformer_engine[core_cu13]==2.21.0"]
            },
        }
    }
    assert len(pin_problems(wrong, expected_versions())) == 3
    missing = {"project": {"dependencies": [], "optional-dependencies": {"gpu": ["sglang==0.5.23"]}}}
    assert sorted(pin_problems(missing, expected_versions())) == [
        "dependencies: no requirement on megatron-core",
        "optional-dependencies.gpu: no requirement on megatron-core",
        "optional-dependencies.gpu: no requirement on transformer-engine",
    ]
