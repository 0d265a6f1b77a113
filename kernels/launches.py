"""Host fast paths for launching a Triton or Gluon kernel again with a signature it has already run: autotuned
kernels (CompiledLaunches) and plain ones (KernelLaunches, the Gluon kernels of kernels/hopper_*.py).

Triton's own path spends about 100 us of host time per call on an H100 host (the autotuner's key: a `hasattr` and
`str(dtype)` per argument; binding and specializing ~35 arguments; looking up the compiled program), more than
the GPU time of a small prefill, and a serving step runs 24+ such calls. The first call of a signature goes through
Triton (tuning, compiling); its compiled program and config are kept under the caller's key, and later calls launch
that program directly: one dict lookup and the C launcher.

The key must be at least as fine as Triton's specialization of the arguments, or a program compiled for one
signature would run another's: callers key on exact integer values (strides, sizes) and pointer alignment (`aligned`)
along with everything that is a constexpr. The interpreter keeps Triton's path (it has no compiled programs).
"""
import os

import torch
import triton

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _three_dims(grid: tuple) -> tuple:
    """A compiled program's launcher reads x, y and z where Triton's own path takes one to three dimensions."""
    return (*grid, 1, 1)[:3]


def aligned(*tensors: torch.Tensor) -> tuple[bool, ...]:
    """Which pointers Triton would specialize as 16-byte aligned: part of every key."""
    return tuple(t.data_ptr() % 16 == 0 for t in tensors)


class CompiledLaunches:
    """Compiled programs of one `triton.autotune`d kernel, by the caller's key. `args` are the kernel's runtime
    arguments and `constexprs` its remaining constexpr arguments except the config's, in the kernel's order."""

    def __init__(self, kernel: triton.runtime.Autotuner):
        self.kernel = kernel
        self.programs: dict[tuple, tuple[object, triton.Config]] = {}

    def config(self, key: tuple) -> triton.Config | None:
        """The config a launch of `key` will run, or None if `key` has not run yet (then `launch` tunes)."""
        hit = self.programs.get(key)
        return hit[1] if hit is not None else None

    def launch(self, key: tuple, grid, args: tuple, constexprs: dict) -> None:
        """grid(config kwargs) -> the launch grid. On a known key the caller must already have prepared `args` for
        the config `config(key)` returns (a descriptor's block shape, say); on a new key the config's pre-hook
        does, as it would on Triton's path."""
        hit = self.programs.get(key)
        if hit is not None:
            program, config = hit
            program[_three_dims(grid(config.kwargs))](*args, *constexprs.values(), *config.kwargs.values())
            return
        program = self.kernel[grid](*args, **constexprs)
        if not _INTERPRET:
            self.programs[key] = (program, self.kernel.best_config)


def _specialization(arg) -> object:
    """What Triton 3.6 specializes a runtime argument on (triton.runtime.jit's binder): a tensor's dtype and 16-byte
    alignment; an integer being 1, a multiple of 16, and its width; a tensor descriptor's dtype, block shape and
    layout; nothing for a float."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.get_device(), arg.data_ptr() % 16 == 0
    if isinstance(arg, bool) or arg is None:
        return arg
    if isinstance(arg, int):
        return arg == 1, arg % 16 == 0, -2**31 <= arg < 2**31
    if isinstance(arg, float):
        return float
    return arg.base.dtype, arg.base.get_device(), tuple(arg.block_shape), arg.layout  # a TensorDescriptor


class KernelLaunches:
    """Compiled programs of one plain (not autotuned) kernel, keyed by what Triton would compile anew for: the
    specialization of each runtime argument, the constexprs and the compile options. Triton's own path costs the
    Gluon forward about 40 us of host time a call in binding and specializing; here the key is built from the
    arguments directly and a known one launches its program through the C launcher."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.programs: dict[tuple, object] = {}

    def launch(self, grid: tuple, args: tuple, constexprs: dict, **options) -> None:
        """args: the kernel's runtime arguments and constexprs the rest, both in the kernel's order."""
        key = (*map(_specialization, args), *constexprs.values(), *options.items())
        program = self.programs.get(key)
        if program is not None:
            program[_three_dims(grid)](*args, *constexprs.values())
            return
        program = self.kernel[grid](*args, **constexprs, **options)
        if not _INTERPRET:
            self.programs[key] = program
