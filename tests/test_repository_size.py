"""The tracked tree fits the 64 MiB a GPU machine's transfer takes (the tree is copied whole
to it) beside what every GPU run carries with it (benchmarks/gpu/run_on_device.sh needs
the stand-in model's statistics, .gpu/smollm2-stats, ignored by git), so a result or model
that would push it over fails here, not on the device."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIMIT_BYTES = 64 * 2**20
CARRIED = REPO / ".gpu" / "smollm2-stats"
# Room kept for CARRIED where this checkout has not made it (3.6 MiB when made, mostly the
# tokenizer's JSON).
CARRIED_RESERVE_BYTES = 4 * 2**20


def tracked_bytes(root: Path) -> int | None:
    """Bytes of the files git tracks under `root` as they are on disk (a tracked file
    deleted from the work tree counts 0); None when `root` is not in a git checkout."""
    git = shutil.which("git")
    if git is None:
        return None
    listed = subprocess.run([git, "ls-files", "-z"], cwd=root, capture_output=True)
    if listed.returncode:
        return None
    paths = [root / name for name in listed.stdout.decode().split("\0") if name]
    return sum(path.stat().st_size for path in paths if path.is_file())


def test_the_tracked_tree_fits_the_device_transfer():
    total = tracked_bytes(REPO)
    if total is None:
        pytest.skip("not a git checkout")
    carried = (sum(path.stat().st_size for path in CARRIED.rglob("*") if path.is_file()) if CARRIED.is_dir()
               else CARRIED_RESERVE_BYTES)
    assert total + carried <= LIMIT_BYTES, (
        f"tracked files hold {total / 2**20:.1f} MiB and a GPU run carries {carried / 2**20:.1f} MiB more, over the "
        f"{LIMIT_BYTES / 2**20:.0f} MiB a GPU machine's transfer takes; keep large results or weights out of the tree")


def test_tracked_bytes_counts_tracked_files_only(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git not installed")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.bin").write_bytes(b"x" * 1000)
    (tmp_path / "sub" / "b.bin").write_bytes(b"y" * 234)
    (tmp_path / "untracked.bin").write_bytes(b"z" * 5000)
    subprocess.run(["git", "add", "a.bin", "sub/b.bin"], cwd=tmp_path, check=True)
    assert tracked_bytes(tmp_path) == 1234
    assert tracked_bytes(tmp_path / "sub") == 234  # git lists paths relative to the directory it runs in
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / ".git").write_text("gitdir: /nonexistent\n")  # not a checkout: git fails, the sum is None
    assert tracked_bytes(outside) is None
