"""The GPU check kit's CPU-safe parts: the pinned wheel list, the wheel-folder check and split, the
test lists and their probes, and the whole --dry-run (list, GPU test files, collection, every benchmark
command in its CPU form)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))

import gpu_check  # noqa: E402


def test_pinned_list_is_complete_and_leaves_torch_out():
    pins, problems = gpu_check.read_requirements()
    assert problems == []
    assert gpu_check.check_core_dependencies(pins) == []
    assert pins["megatron-core"] == "0.16.1" and "pytest" in pins and "torch" not in pins
    # sglang (installed --no-deps) and its weight-sync import chain (pyproject's sglang-cpu extra, less
    # triton, which the CUDA torch brings)
    assert pins["sglang"] == "0.5.23"
    for name in ("orjson", "pybase64", "requests", "starlette", "msgspec", "pyzmq", "ipython", "aiohttp"):
        assert name in pins, name
    assert "triton" not in pins and "typing-extensions" not in pins


def test_list_problems_are_named(tmp_path):
    bad = tmp_path / "req.txt"
    bad.write_text("numpy>=1.26\ntorch==2.14.1\nrich==15.0.0\nrich==15.0.0\n")
    _, problems = gpu_check.read_requirements(str(bad))
    assert len(problems) == 3
    assert "req.txt:1" in problems[0] and "pin" in problems[0]
    assert "torch" in problems[1] and "twice" in problems[2]
    pins = {"transformers": "5.19.0", "safetensors": "0.8.0"}
    missing = gpu_check.check_core_dependencies(pins)
    assert any("transformers==5.19.0 does not satisfy" in p for p in missing)
    assert any("megatron-core" in p and "not pinned" in p for p in missing)


def test_wheel_folder_check(tmp_path):
    pins = {"numpy": "2.5.5", "rich": "15.0.0", "psutil": "7.2.2", "tokenizers": "0.23.3", "pyyaml": "6.0.3"}
    names = [
        "numpy-2.5.5-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl",
        "rich-15.0.0-py3-none-any.whl",
        "psutil-7.2.2-cp36-abi3-manylinux2010_x86_64.manylinux_2_12_x86_64.whl",
        "tokenizers-0.23.3-cp310-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
        "PyYAML-6.0.3-cp312-cp312-manylinux2014_x86_64.whl",
    ]
    for n in names:
        (tmp_path / n).write_bytes(b"")
    assert gpu_check.check_wheels(str(tmp_path), pins) == []
    (tmp_path / names[1]).unlink()
    (tmp_path / names[0]).unlink()
    (tmp_path / "numpy-2.5.5-cp312-cp312-macosx_14_0_arm64.whl").write_bytes(b"")
    (tmp_path / "rich-14.0.0-py3-none-any.whl").write_bytes(b"")
    (tmp_path / names[4]).unlink()
    (tmp_path / "PyYAML-6.0.3-cp311-cp311-manylinux2014_x86_64.whl").write_bytes(b"")
    problems = gpu_check.check_wheels(str(tmp_path), {**pins, "tqdm": "4.70.1"})
    assert any("numpy==2.5.5: no cp312" in p for p in problems)
    assert any("rich==15.0.0: only ['14.0.0']" in p for p in problems)
    assert any("pyyaml==6.0.3: no cp312" in p for p in problems)
    assert any("tqdm==4.70.1: missing" in p for p in problems)
    assert len(problems) == 4
    assert gpu_check.check_wheels(str(tmp_path / "nope"), pins)[0].startswith("--wheels")


def test_wheel_folders_below_and_several(tmp_path):
    pins = {"rich": "15.0.0", "tqdm": "4.70.1"}
    (tmp_path / "part1").mkdir()
    (tmp_path / "part2").mkdir()
    (tmp_path / "part1" / "rich-15.0.0-py3-none-any.whl").write_bytes(b"")
    (tmp_path / "part2" / "tqdm-4.70.1-py3-none-any.whl").write_bytes(b"")
    assert gpu_check.check_wheels(str(tmp_path), pins) == []
    assert gpu_check.wheel_dirs(str(tmp_path)) == [str(tmp_path / "part1"), str(tmp_path / "part2")]
    assert gpu_check.check_wheels([str(tmp_path / "part1"), str(tmp_path / "part2")], pins) == []
    assert any("tqdm==4.70.1: missing" in p for p in gpu_check.check_wheels([str(tmp_path / "part1")], pins))


def test_split_wheels_into_parts_under_the_limit(tmp_path):
    sizes = {"a": 5, "b": 4, "c": 3, "d": 3, "e": 1, "f": 9}  # MiB; f alone is over the limit
    for name, mib in sizes.items():
        (tmp_path / f"{name}-1.0-py3-none-any.whl").write_bytes(b"x" * (mib << 20))
    parts = gpu_check.split_wheels(str(tmp_path), part_mib=8)
    assert [os.path.basename(d) for d, _ in parts] == ["part1", "part2", "part3"]
    assert [s >> 20 for _, s in parts] == [9, 8, 8]  # f; a + c; b + d + e (first fit, largest first)
    assert not list(tmp_path.glob("*.whl"))
    assert sorted(p.name[0] for p in tmp_path.glob("part*/*.whl")) == sorted(sizes)
    # again over the parts (e.g. with another limit): every wheel is placed anew
    parts = gpu_check.split_wheels(str(tmp_path), part_mib=100)
    assert [s >> 20 for _, s in parts] == [25] and sorted(p.name for p in tmp_path.iterdir()) == ["part1"]
    pins = {name: "1.0" for name in sizes}
    assert gpu_check.check_wheels(str(tmp_path), pins) == []


def test_every_gpu_test_file_is_in_one_list():
    assert gpu_check.check_test_lists() == []
    assert "tests/gpu/test_weight_payloads_gpu.py" in gpu_check.NEEDS_SGLANG
    assert "tests/gpu/test_fp8_te_gpu.py" in gpu_check.NEEDS_TE
    assert "tests/gpu/test_sglang_gpu.py" in gpu_check.NOT_IN_KIT  # a real SGLang server: the Docker image
    assert set(gpu_check.STEP_PROBES) == {"gpu_tests_sglang", "gpu_tests_te"}


@pytest.mark.parametrize("sglang_ok", [True, False])
def test_sglang_tests_must_run_te_tests_run_when_te_imports(tmp_path, monkeypatch, sglang_ok):
    """After the install sglang's pieces must import (it is in the list): a failing probe fails the kit;
    Transformer Engine is the machine's own: without it its tests are recorded as skipped."""
    py = sys.executable
    monkeypatch.setattr(gpu_check, "environment", lambda _py: {"python": "3.12.3", "gpus": 1})
    monkeypatch.setattr(
        gpu_check,
        "commands",
        lambda args, _py: [(n, [py, "-c", "pass"]) for n in ("gpu_tests", "gpu_tests_sglang", "gpu_tests_te")],
    )
    monkeypatch.setattr(
        gpu_check,
        "STEP_PROBES",
        {
            "gpu_tests_sglang": ("pass" if sglang_ok else "import no_such_mod", True),
            "gpu_tests_te": ("import no_such_mod", False),
        },
    )
    out = tmp_path / "r.json"
    rc = gpu_check.main(["--out", str(out), "--skip-install"])
    res = json.loads(out.read_text())
    steps = {s["name"]: s for s in res["steps"]}
    assert list(steps) == ["gpu_tests", "gpu_tests_sglang", "gpu_tests_te"]
    assert steps["gpu_tests_te"]["skipped"] and steps["gpu_tests_te"]["rc"] is None
    assert "no_such_mod" in steps["gpu_tests_te"]["output_tail"]
    # --skip-install: the environment is the user's, so a missing sglang is a skip there too
    assert rc == 0 and res["ok"]
    assert steps["gpu_tests_sglang"]["rc"] == (0 if sglang_ok else None)
    if not sglang_ok:  # installing from the kit, the same probe failure fails the kit
        monkeypatch.setattr(gpu_check, "check_wheels", lambda folders, pins: [])
        rc = gpu_check.main(["--out", str(out), "--wheels", str(tmp_path)])
        res = json.loads(out.read_text())
        steps = {s["name"]: s for s in res["steps"]}
        assert rc == 1 and not res["ok"] and steps["gpu_tests_sglang"]["rc"] == 1


def test_download_command_targets_cp312_manylinux():
    cmd = gpu_check.download_command()
    assert cmd[:2] == ["pip", "download"] and "--no-deps" in cmd and "--only-binary=:all:" in cmd
    assert cmd[cmd.index("--python-version") + 1] == "3.12"
    assert "manylinux2014_x86_64" in cmd and cmd[-1] == "bench/gpu_kit/requirements.txt"


def test_real_run_refuses_without_gpu_before_installing(tmp_path):
    out = tmp_path / "r.json"
    rc = gpu_check.main(["--out", str(out), "--skip-install"])
    res = json.loads(out.read_text())
    assert rc == 1 and res["steps"] == []
    assert any("no CUDA GPU" in p or "Python 3.12" in p for p in res["problems"])


@pytest.mark.timeout(600)
def test_dry_run(tmp_path):
    out = tmp_path / "gpu_check.json"
    p = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "gpu_check.py"), "--dry-run", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    res = json.loads(out.read_text())
    assert p.returncode == 0 and res["ok"], p.stdout[-3000:] + p.stderr[-3000:]
    assert [s["name"] for s in res["steps"]] == [
        "gpu_tests",
        "gpu_tests_sglang",
        "gpu_tests_te",
        "bench_logprobs",
        "bench_gpu_config",
        "bench_gpu",
        "bench_offload",
        "bench_step_profile",
    ]
    collected = res["steps"][0]["output_tail"]
    assert "test_fused_logprobs_gpu.py" in collected and "test_vocab_parallel_gpu.py" in collected
    assert "test_weight_payloads_gpu.py" in res["steps"][1]["output_tail"]
    assert "test_fp8_te_gpu.py" in res["steps"][2]["output_tail"]
    assert {"full", "chunked", "fused"} <= set(res["bench"]["logprobs"]["results"][0]["paths"])
    assert res["bench"]["gpu"]["train_step"]["runs"]["padded"]["tokens_per_s"] > 0
    assert res["bench"]["gpu"]["weight_export"]["bytes"] > 0
    assert res["bench"]["offload"]["host_grown_bytes"] == 0 and res["bench"]["offload"]["first_offload_baseline_s"] > 0
    padded = res["bench"]["step_profile"]["baseline"]["padded"]
    assert padded["ratio_ours_over_megatron"] > 0 and len(set(padded["tokens_through_model"].values())) == 1
    assert sum(res["bench"]["step_profile"]["profile"]["padded"]["percent"].values()) == pytest.approx(100)
