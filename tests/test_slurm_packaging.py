"""A wheel install can submit: the templates ship as package data.

Builds the wheel from a copy of the checkout, installs it (not editable, no dependencies)
into a fresh venv that borrows the project venv's packages for etcslurm's dependencies,
and renders the example run file from there.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False, **kw)
    assert res.returncode == 0, f"{cmd}: {res.stderr[-3000:]}"
    return res


def test_wheel_install_renders_the_example_run_file(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", "runs", ".ruff_cache",
        ".hypothesis", ".pytest_cache"))
    run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
         "-q", "-w", str(tmp_path / "dist")])
    wheel = next((tmp_path / "dist").glob("etcslurm-*.whl"))
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    py = venv / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index",
         "-q", str(wheel)])
    # the dependencies (torch, redis, ...) from the project venv, after the wheel's own
    # site-packages (a plain path: the project's editable-install hook is not run)
    own = Path(run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
               .stdout.strip())
    (own / "project-deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ETCSLURM_TEMPLATES")}
    where = run([str(py), "-c", "import etcslurm.slurm.templates as t; print(t.templates_dir())"],
                cwd=tmp_path, env=env).stdout.strip()
    assert where.startswith(str(own)), where
    res = run([str(venv / "bin" / "etcslurm"), "submit", str(ROOT / "examples" / "run.toml"),
               "--dry-run"], cwd=tmp_path, env=env)
    lines = res.stdout.splitlines()
    for line in ("#SBATCH --account=my-project", "#SBATCH --qos=normal",
                 "#SBATCH --gres=gpu:h100:8", "#SBATCH --constraint=h100&ib",
                 "#SBATCH --comment=elastic-llama3-8b"):
        assert line in lines, line
    assert f"PY='{py}'" in lines  # the installed interpreter runs the job's Python
