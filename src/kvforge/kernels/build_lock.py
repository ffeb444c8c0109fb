"""The lock around a kernel build: no kvforge process ever waits forever on another.

torch's `cpp_extension.load` guards a build directory with a bare file (`<dir>/lock`,
created exclusively, deleted at the end). A process killed while compiling (Ctrl-C, a
timeout) leaves that file behind, and every later process waits on it forever, silently.

kvforge takes its own lock first: `fcntl.flock` on `<dir>/kvforge-build.lock`, which the
operating system releases when the holder dies, so a dead holder is detected without
guessing. The holder writes its pid into the file, for the message. While kvforge holds
its lock, no other kvforge build runs in that directory, so a torch `lock` file found
there was left by a dead build and is removed. A live holder is waited for up to a
timeout (`KVFORGE_BUILD_LOCK_TIMEOUT` seconds, default 600: a compile takes minutes), and
then `BuildLockTimeout` names the lock file, its holder and how to clear it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

LOCK_NAME = "kvforge-build.lock"
TORCH_BATON = "lock"  # torch.utils.cpp_extension's FileBaton in the build directory
TIMEOUT_ENV = "KVFORGE_BUILD_LOCK_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0


class BuildLockTimeout(RuntimeError):
    """Another live process held the build lock for longer than the timeout."""


def lock_timeout() -> float:
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    try:
        return float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        logger.warning("ignoring %s=%r (not a number of seconds)", TIMEOUT_ENV, raw)
        return DEFAULT_TIMEOUT_S


@contextmanager
def build_lock(build_dir: str | Path, timeout_s: float | None = None, poll_s: float = 0.1) -> Iterator[None]:
    """Hold the kvforge build lock of `build_dir` for the block (see the module docstring)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, torch's baton alone
        yield
        return
    directory = Path(build_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_NAME
    timeout_s = lock_timeout() if timeout_s is None else timeout_s
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        waited = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = _holder(fd)
                if time.monotonic() >= deadline:
                    raise BuildLockTimeout(
                        f"the kernel build lock {path} has been held by process {holder} for more than "
                        f"{timeout_s:.0f} s. If that process is not building kvforge kernels, delete {path} and "
                        f"{directory / TORCH_BATON}; to wait longer set {TIMEOUT_ENV}=SECONDS") from None
                if not waited:
                    logger.warning("kvforge: waiting for process %s, which is building a kernel in %s", holder,
                                   directory)
                    waited = True
                time.sleep(poll_s)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        baton = directory / TORCH_BATON
        if baton.exists():  # no live kvforge build here: a dead build left it
            logger.warning("kvforge: removing %s, left by a build that was killed", baton)
            baton.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _holder(fd: int) -> str:
    try:
        return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
    except OSError:
        return "unknown"
