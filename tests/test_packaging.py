"""The built wheel installs the mapped sub-packages and imports from outside the repo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_wheel_imports_outside_the_repo(tmp_path: Path) -> None:
    wheels, site, elsewhere = tmp_path / "wheels", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(REPO)],
                   check=True, capture_output=True, cwd=tmp_path, timeout=180)
    (wheel,) = wheels.glob("freescale-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=120)
    probe = (
        "import freescale, freescale.dataloader, freescale.kernels, freescale.ft, freescale.models, freescale.trainer\n"
        "import freescale.sim.engine, freescale.report  # noqa: F401  (the simulator and the run report)\n"
        "from freescale import Trainer, TrainerConfig\n"
        "for m in (freescale, freescale.dataloader, freescale.kernels, freescale.ft):\n"
        "    print(m.__file__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # -S-free but isolated from the editable install: our site dir goes first on the path.
    env["PYTHONPATH"] = str(site)
    proc = subprocess.run([sys.executable, "-c", probe], cwd=elsewhere, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = proc.stdout.split()
    assert len(files) == 4 and all(f.startswith(str(site)) for f in files), files
    assert files[1].endswith("freescale/dataloader/__init__.py")
    cli = subprocess.run([sys.executable, "-m", "freescale.cli", "gen-data", "--out", "d", "--rows", "500",
                          "--eval-rows", "0"], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert (elsewhere / "d" / "dataset.json").is_file()


@pytest.mark.parametrize("name", ["ft", "kernels", "dataloader"])
def test_folder_name_import_fails_loudly(name: str) -> None:
    """From the repository root the folders are importable by their bare names: that would be a
    second copy of freescale.<name> (duplicate registries), so it raises, and the real name works."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    bare = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert bare.returncode == 1
    assert bare.stderr.strip().splitlines()[-1].startswith(f"ImportError: import freescale.{name}, not {name}: ")
    real = subprocess.run([sys.executable, "-c", f"import freescale.{name}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert real.returncode == 0, real.stderr[-3000:]


def test_every_kernel_module_imports_as_a_module() -> None:
    """``import freescale.kernels.<name> as m`` binds the module (its Triton kernels readable as ``m._fwd_kernel``),
    not a function the package re-exports under the same name."""
    import importlib
    import types

    import freescale.kernels as package

    names = sorted(p.stem for p in Path(package.__file__).parent.glob("*.py") if p.stem != "__init__")
    assert "triton_hstu_attention" in names and "triton_layer_norm_mul" in names
    for name in names:
        module = importlib.import_module(f"freescale.kernels.{name}")
        assert getattr(package, name) is module, f"freescale.kernels.{name} is not the module"
    import freescale.kernels.triton_hstu_attention as attention

    assert isinstance(attention, types.ModuleType) and hasattr(attention, "_fwd_kernel")
