"""`pip install .` ships the trained `world` model (package data), and the installed
package's embedded default finds it: installed into a folder from a copy of the
source tree (the build writes build/ and *.egg-info beside setup.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("setup.py", "setup.cfg", "pyproject.toml", "MANIFEST.in", "package.xml",
           "requirements.lock", "resource", "launch", "config", "embodied_kv")  # fmt: skip
DATA = ("weights.safetensors", "tokenizer.json")


def test_installed_package_has_the_shipped_world_model(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--no-compile", "--target", str(site), str(src)],
        check=True, capture_output=True, timeout=240,
    )  # fmt: skip
    for preset in ("world", "world_smooth"):
        shipped = site / "embodied_kv" / "data" / preset
        missing = [n for n in DATA if not (shipped / n).is_file()]
        assert not missing, (
            f"the installed package lacks {missing} in embodied_kv/data/{preset}/ (the trained "
            "model is committed there before merging to main)"
        )
        source = ROOT / "embodied_kv" / "data" / preset
        for name in DATA:
            assert (shipped / name).read_bytes() == (source / name).read_bytes()
        code = ("from embodied_kv.engine.loading import shipped_weights; "
                f"print(shipped_weights({preset!r}))")  # fmt: skip
        out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path,
                             env={"PYTHONPATH": str(site)}, check=True, capture_output=True,
                             text=True, timeout=120)  # fmt: skip
        assert Path(out.stdout.strip()) == shipped / "weights.safetensors"
