"""Autotuning results kept in a file across restarts. Triton's own autotuning cache skips kernels whose configs
carry a pre-hook (the prefill kernel's sets the TMA tile), so without this every start would tune every query
length bucket again: seconds each, most of a warm start."""
import hashlib
import json
import logging
from pathlib import Path

import torch
import triton

from kernels.prefill import _prefill_kernel

log = logging.getLogger(__name__)
TUNED = {"prefill": _prefill_kernel}


def _file(directory: Path) -> Path:
    # Results hold for one GPU model, one Triton and one list of configs: a change to any starts a new file.
    ident = [triton.__version__, torch.cuda.get_device_name()] + [[list(map(str, k.configs)), k.keys]
                                                                     for k in TUNED.values()]
    return Path(directory) / f"autotune-{hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:16]}.json"


def load(directory: str | Path) -> int:
    """Seeds the autotuners with the results saved in directory; returns how many keys it seeded."""
    try:
        saved = json.loads(_file(directory).read_text())
    except (OSError, ValueError):
        return 0
    seeded = 0
    for name, kernel in TUNED.items():
        for key, index in saved.get(name, []):
            if 0 <= index < len(kernel.configs):
                kernel.cache.setdefault(tuple(key), kernel.configs[index])
                seeded += 1
    return seeded


def save(directory: str | Path) -> None:
    """Writes every autotuner's results (key -> index of the chosen config) to directory, atomically."""
    tuned = {name: [[list(key), kernel.configs.index(config)] for key, config in kernel.cache.items()
                    if config in kernel.configs] for name, kernel in TUNED.items()}
    path = _file(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(tuned))
    partial.replace(path)
    log.info("saved %d autotuning results to %s", sum(map(len, tuned.values())), path)
