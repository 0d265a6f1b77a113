"""Which tree a benchmark's results come from."""
import os
import subprocess
from pathlib import Path


def git_commit() -> str | None:
    """BENCH_COMMIT when set (a copied tree's .git may be stale: the device machine's is), else git's HEAD; None
    without git."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent)
    except OSError:
        return None
    return done.stdout.strip() or None
