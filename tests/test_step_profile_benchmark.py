"""benchmarks/step_profile.py's host side on the CPU: the module imports, and every configuration its sweeps time
(kernels/decode_linear.py's and kernels/lora.py's) launches and computes the reference result in the interpreter,
so that a sweep on the GPU cannot fail on a configuration the launchers no longer accept."""
import numpy as np
import torch

from benchmarks import step_profile
from kernels.decode_linear import decode_linear, decode_linear_ref
from kernels.lora import lora_add_, lora_add_ref, lora_tiles, max_tiles
from tests.helpers import rel_err


def test_every_swept_decode_linear_configuration_computes_the_projection():
    for rows in (3, max(step_profile.LINEAR_ROWS)):
        x, w = torch.randn(rows, 96), torch.randn(64, 96) / 10
        want = decode_linear_ref(x, w)
        for cfg in step_profile.LINEAR_CONFIGS + step_profile.SPLIT_CONFIGS:
            out = decode_linear(x, w, config=cfg, partials=cfg[-1] > 1)
            assert rel_err(out.sum(0) if out.dim() == 3 else out, want) < 1e-5, (rows, cfg)


def test_every_swept_lora_configuration_adds_the_updates():
    rows, k, n, rank, slots = 20, 48, 40, 16, 3
    weights, scales = torch.randn(slots, rank * (k + n)) / 4, torch.rand(slots) + 0.5
    x = torch.randn(rows, k)
    row_slots = np.arange(rows, dtype=np.int32) % slots
    tiles = torch.from_numpy(lora_tiles(row_slots, max_tiles(rows, slots)))
    want = torch.zeros(rows, n)
    lora_add_ref(x, [(want, 0, rank * k)], weights, scales, torch.from_numpy(row_slots), rank)
    for cfg in step_profile.LORA_CONFIGS[::4]:
        y = torch.zeros(rows, n)
        lora_add_(x, [(y, 0, rank * k)], weights, scales, tiles, rank, config=cfg)
        assert rel_err(y, want) < 1e-5, cfg


def test_every_path_switch_is_a_setting_of_kernels_configs():
    from kernels import configs
    for _, _, switches in step_profile.PATHS:
        assert all(isinstance(getattr(configs, key), bool) for key in switches)


def test_every_lora_case_is_a_valid_decode_linear_call():
    """The projection groups of --sections decode_lora and lora (here of a small shape) with their slot layouts:
    decode_linear with one adapter matches its reference."""
    shape = {"hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 2, "num_key_value_heads": 1}
    rank, slots = 16, 2
    for rows in (3, max(m for m, _ in step_profile.DECODE_LORA_ROWS)):
        for proj, (k, widths, silu, partials, parts, size) in step_profile.lora_cases(shape, rank).items():
            gen = torch.Generator().manual_seed(len(proj))
            x, w = torch.randn(rows, k, generator=gen), torch.randn(sum(widths), k, generator=gen) / k ** 0.5
            lw, scales = torch.randn(slots, size, generator=gen) / 4, torch.rand(slots, generator=gen) + 0.5
            row_slots = np.arange(rows, dtype=np.int32) % (slots + 1) - 1
            lora = (lw, scales, torch.from_numpy(lora_tiles(row_slots, max_tiles(rows, slots))), rank, parts)
            out = decode_linear(x, w, silu_mul=silu, lora=lora, partials=partials)
            ref = decode_linear_ref(x, w, silu_mul=silu, lora=lora, row_slots=torch.from_numpy(row_slots))
            assert rel_err(out.sum(0) if partials else out, ref) < 1e-5, (rows, proj)
