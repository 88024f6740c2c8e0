"""The checkout stands on its own. It imports itself: run from the repository root, Python finds
the checkout's draftlab/ folder before any installed copy (the current directory comes first on
sys.path), and that folder holds none of the subpackages pyproject.toml maps from the top-level
folders: they must be found from it with a regular (wheel) install as well as with the editable
one. And it names no path outside itself."""

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
IMPORTS = "import draftlab.kernels, draftlab.inference.decoder; print(draftlab.kernels.__file__); print(draftlab.inference.decoder.__file__)"


def _expect_checkout_files(res):
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == [str(REPO / "kernels" / "__init__.py"), str(REPO / "inference" / "decoder.py")]


def test_the_root_imports_the_checkout_without_the_editable_finder():
    # what a regular install leaves behind: no editable-install finder on sys.meta_path, so only
    # the checkout's own draftlab/ folder (first on sys.path from the root) can answer
    drop_editable = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path "
                     "if 'editable' not in getattr(f, '__module__', '')]; ")
    res = subprocess.run([sys.executable, "-c", drop_editable + IMPORTS], cwd=REPO, capture_output=True, text=True, timeout=120)
    _expect_checkout_files(res)


# a folder beside the checkout, or a path of one machine (a temporary or home directory)
OUTSIDE = re.compile(r"\.\./shared|[\"']shared[\"']|/work/|/tmp/|/home/|/root/|/mnt/")
SCANNED = ("draftlab", "data", "models", "losses", "train", "inference", "kernels", "export", "bench", "recipes", "scripts")


def test_nothing_outside_the_repository_is_named():
    """Product code, recipes, benchmarks and their records cite files of the repository (and papers),
    never ../shared or a path that exists on one machine only."""
    files = [p for d in SCANNED for p in (REPO / d).rglob("*") if p.suffix in (".py", ".md", ".yaml", ".sh", ".toml")]
    files += [REPO / "README.md", REPO / "BENCHMARKS.md", REPO / "pyproject.toml"]
    hits = [f"{p.relative_to(REPO)}:{i}: {line.strip()[:120]}" for p in files
            for i, line in enumerate(p.read_text().splitlines(), 1) if OUTSIDE.search(line)]
    assert not hits, "\n".join(hits)


@pytest.mark.slow
def test_a_wheel_install_runs_the_checkouts_tests_from_the_root(tmp_path):
    """The README's promise, as a new user meets it: draftlab installed from its wheel (not
    editable), ``python -c 'import ...'`` and ``python -m pytest`` run from the repository root."""
    src = tmp_path / "src"  # build from a copy: pip writes build/ and *.egg-info beside the sources
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".venv", ".git", "runs", "build", "*.egg-info",
                                                              "__pycache__", ".pytest_cache"))
    run = dict(capture_output=True, text=True, timeout=600)
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                          str(tmp_path / "whl"), str(src)], **run)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (wheel,) = (tmp_path / "whl").glob("draftlab-*.whl")
    env_dir = tmp_path / "wheelenv"
    res = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], **run)
    assert res.returncode == 0, res.stderr[-2000:]
    python = env_dir / "bin" / "python"
    res = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                          str(wheel)], **run)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    # the new environment borrows this one's dependencies; a path in a .pth runs none of the .pth
    # files there, so the editable install's finder stays out
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               **run).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    installed = subprocess.run([str(python), "-c", "import draftlab; print(draftlab.__file__)"], cwd=tmp_path, **run)
    assert installed.stdout.strip() == str(site / "draftlab" / "__init__.py"), installed.stderr[-2000:]

    _expect_checkout_files(subprocess.run([str(python), "-c", IMPORTS], cwd=REPO, **run))
    res = subprocess.run([str(python), "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/test_kernels.py"],
                         cwd=REPO, **run)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]


def test_the_checkout_folders_hide_no_installed_package(tmp_path):
    """From the checkout's root, a top-level name that an installed package also has (Hugging Face's
    ``kernels``, which transformers imports) resolves to the installed package; one that nothing
    installed has stays the folder; the folder names are pyproject's package-dir folders."""
    import tomllib

    from draftlab.checkout import FOLDERS

    mapping = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert sorted(FOLDERS) == sorted(v for v in mapping.values() if v != "draftlab")
    fake = tmp_path / "site" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("WHO = 'installed'\n")
    code = ("import draftlab, kernels, losses, draftlab.kernels as k; "
            "print(getattr(kernels, 'WHO', kernels.__file__), losses.__file__, k.__file__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path / 'site'}"})
    assert out.returncode == 0, out.stderr
    who, losses_file, ours = out.stdout.split()
    assert who == "installed"
    assert Path(losses_file) == REPO / "losses" / "__init__.py" and Path(ours) == REPO / "kernels" / "__init__.py"
