"""The built wheel holds every package folder as ``megaloom/...`` and imports on its own; the torch
floor in pyproject.toml is what the code needs, and CI installs torch's CPU build as the README says.

The source is copied to a temporary folder first, so the build never writes into the
checkout (``build/``, ``*.egg-info``) and concurrent builds cannot collide.
"""
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
# top-level folder -> its import name (setuptools package-dir in pyproject.toml)
LAYERS = {"megaloom": "megaloom", "runtime": "megaloom/runtime", "scheduler": "megaloom/scheduler",
          "ops": "megaloom/ops", "comm": "megaloom/comm", "graphs": "megaloom/graphs"}


def package_dirs() -> list[str]:
    """Every folder with an ``__init__.py`` under the layers, as its path inside the wheel."""
    out = []
    for top, target in LAYERS.items():
        for dirpath, dirnames, filenames in os.walk(ROOT / top):
            dirnames[:] = [d for d in dirnames if d != "__pycache__" and not d.startswith(".")]
            if "__init__.py" in filenames:
                rel = Path(dirpath).relative_to(ROOT / top).as_posix()
                out.append(target if rel == "." else f"{target}/{rel}")
    return sorted(out)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")
    for top in LAYERS:
        shutil.copytree(ROOT / top, src / top, ignore=ignore)
    for f in ROOT.iterdir():
        if f.is_file() and (f.name in ("pyproject.toml", "README.md") or f.name.startswith("LICENSE")):
            shutil.copy(f, src / f.name)
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wheels = list(out.glob("megaloom-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_every_package_folder_is_in_the_wheel(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    want = package_dirs()
    assert {"megaloom/runtime", "megaloom/runtime/executors", "megaloom/ops", "megaloom/commands"} <= set(want)
    missing = [p for p in want if f"{p}/__init__.py" not in names]
    assert not missing, f"package folders missing from the wheel (add them to pyproject.toml packages): {missing}"
    assert not [n for n in names if n.split("/")[0] in set(LAYERS) - {"megaloom"}], "a layer escaped megaloom/"


def test_profiles_ship_with_the_wheel(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in (ROOT / "scheduler" / "profiles").glob("*.yaml"):
        assert f"megaloom/scheduler/profiles/{f.name}" in names


def test_compiled_simulator_loop_ships_when_built(wheel):
    from megaloom.scheduler import fastpath

    if not fastpath.AVAILABLE:
        pytest.skip("the _fastsim extension was not built here (no compiler?)")
    names = zipfile.ZipFile(wheel).namelist()
    assert [n for n in names if n.startswith("megaloom/scheduler/_fastsim") and n.endswith(".so")]


def test_compiled_vector_kernels_ship_when_built(wheel):
    from megaloom.ops import native

    if not native.AVAILABLE:
        pytest.skip("the _native extension was not built here (no compiler?)")
    names = zipfile.ZipFile(wheel).namelist()
    assert [n for n in names if n.startswith("megaloom/ops/_native") and n.endswith(".so")]


def test_runtime_imports_from_the_wheel(wheel, tmp_path):
    code = ("import megaloom.runtime as r, megaloom.ops; g = r.TaskGraph(); g.task('noop');"
            "r.ThreadExecutor(kernels='null').run(g); print(r.__file__)")
    env = {**os.environ, "PYTHONPATH": str(wheel)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().startswith(str(wheel)), proc.stdout


# torch features the code relies on, with the first torch release that has them: the floor in
# pyproject.toml is the newest of these (a feature that leaves the code leaves this table)
TORCH_FEATURES = {
    "float8_e8m0fnu": (2, 7),  # MXFP8 scales (runtime/dtypes.py); added by pytorch/pytorch#147466, in 2.7
    "torch.library.custom_op": (2, 4),  # the graph families' torch ops (graphs/common/torch_ops.py), new in 2.4
}


def _torch_floor(text: str) -> tuple[int, int]:
    found = re.findall(r'"torch>=(\d+)\.(\d+)[^"]*"', text)
    assert len(found) == 1, f"pyproject.toml should require torch>=X.Y once, found {found}"
    return int(found[0][0]), int(found[0][1])


def test_torch_floor_is_what_the_code_needs():
    source = "\n".join(p.read_text(encoding="utf-8") for top in LAYERS for p in (ROOT / top).rglob("*.py"))
    gone = [f for f in TORCH_FEATURES if f not in source]
    assert not gone, f"no longer used (drop them from TORCH_FEATURES): {gone}"
    floor = _torch_floor((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert floor == max(TORCH_FEATURES.values()), f"pyproject.toml requires torch>={floor}, the code needs more"
    assert tuple(int(v) for v in torch.__version__.split(".")[:2]) >= floor
    readme = re.findall(r"needs torch >= (\d+)\.(\d+)", (ROOT / "README.md").read_text(encoding="utf-8"))
    assert [tuple(map(int, v)) for v in readme] == [floor], "README.md states another torch floor"


def test_ci_installs_the_cpu_build_of_the_tested_torch():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    pinned = set(re.findall(r"torch==([\d.]+)", ci + readme))
    assert len(pinned) == 1, f"CI and README pin different torch versions: {pinned}"
    cpu = "https://download.pytorch.org/whl/cpu"
    assert f"--extra-index-url \"${{TORCH_INDEX:-{cpu}}}\"" in ci and f"--index-url {cpu}" in readme
