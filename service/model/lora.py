"""LoRA adapters on the model's nn.Linear projections, for training and for serving several adapters at once.

An adapter adds to a projection's output y = W x either a low-rank update (alpha / rank) * B A x (LoRA), or a
dense update D x (full fine-tuning of the projection, D = W_tuned - W). The update is attached with a forward
hook on each targeted nn.Linear: the module tree and checkpoint names stay untouched, and the base weights are
shared by every adapter.

Which adapter applies to which rows is per thread (threading.local), so a training step in one worker thread
and an engine step in another can run through the same modules at once:
- training: `with activate([(adapter, None)])`, the adapter applies to every row;
- serving from slots (LoRA adapters up to the slots' rank): LoRASlots holds `max_loras` adapters on the device in
  a buffer allocated once; `with serving_slots(slots, tiles, row_slots)` the decoder adds (add_slot_updates), a
  shrink and an expand kernel per input of projections (kernels/lora.py), the update of each row's slot. The
  buffer never moves, so CUDA graphs capture this path and replay it for any mix of adapters;
- serving eagerly (dense adapters, ranks past the slots'): `with serving_adapters(model, names)` with one adapter
  name (or None = base) per flat token row; each distinct adapter adds its update to its own rows.
"""
import contextlib
import json
import os
import threading
from dataclasses import asdict, dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BASE_KEY = "base_fingerprint"  # the metadata entry of the base model's fingerprint (service.model.fingerprint)
_local = threading.local()


class AdapterMismatch(ValueError):
    """An adapter made for another base model."""


@dataclass
class LoRAConfig:
    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = TARGETS
    full: bool = False  # a dense update per projection instead of a low-rank one

    def __post_init__(self):
        self.targets = tuple(self.targets)
        unknown = set(self.targets) - set(TARGETS)
        if unknown or not self.targets:
            raise ValueError(f"target modules must be a non-empty subset of {TARGETS}, got {list(self.targets)}")
        if not self.full and not 1 <= self.rank <= 1024:
            raise ValueError(f"lora rank must be in 1..1024, got {self.rank}")
        if not self.alpha > 0:
            raise ValueError(f"lora alpha must be > 0, got {self.alpha}")

    @property
    def scale(self) -> float:
        return 1.0 if self.full else self.alpha / self.rank


class Adapter:
    """The update of every targeted projection: weights[name] = (A [r, in], B [out, r]) or (D [out, in],)."""

    def __init__(self, config: LoRAConfig, weights: dict[str, tuple[torch.Tensor, ...]], source=None):
        self.config, self.weights, self.scale = config, weights, config.scale
        self.source = source  # the file it was loaded from: tensor-parallel workers load it from there too
        self.training: dict[str, tuple[torch.Tensor, ...]] | None = None  # start_training's copies and buffers

    @classmethod
    def init(cls, model: nn.Module, config: LoRAConfig, seed: int = 0) -> "Adapter":
        """Trainable float32 weights (the master copy; cast to the model's dtype in the forward). B (or D)
        starts at zero so the adapted model starts equal to the base."""
        g = torch.Generator().manual_seed(seed)
        weights = {}
        for name, linear in target_linears(model, config.targets).items():
            dev = linear.weight.device
            if config.full:
                weights[name] = (torch.zeros(linear.out_features, linear.in_features, device=dev),)
            else:
                a = torch.randn(config.rank, linear.in_features, generator=g) / linear.in_features ** 0.5
                weights[name] = (a.to(dev), torch.zeros(linear.out_features, config.rank, device=dev))
        for tensors in weights.values():
            for t in tensors:
                t.requires_grad_(True)
        return cls(config, weights)

    def parameters(self) -> list[torch.Tensor]:
        return [t for tensors in self.weights.values() for t in tensors]

    def start_training(self, dtype: torch.dtype) -> None:
        """LoRA training in `dtype`: the forward reads copies of A and B in that dtype (sync_training_copies renews
        them after each optimizer step, one launch for all, instead of a cast per projection and forward), and the
        backward adds their gradients straight into float32 buffers that are the master weights' .grad, kept for
        the whole run (zero them, never set them to None)."""
        self.training = {}
        for name, (a, b) in self.weights.items():
            a.grad, b.grad = torch.zeros_like(a), torch.zeros_like(b)
            copies = [t.detach().to(dtype).requires_grad_(True) for t in (a, b)]  # see kernels.training.lora_linear
            self.training[name] = (*copies, a.grad, b.grad)

    def sync_training_copies(self) -> None:
        copies = [t for a, b, _, _ in self.training.values() for t in (a, b)]
        with torch.no_grad():
            torch._foreach_copy_(copies, self.parameters())

    def delta(self, name: str, x: torch.Tensor) -> torch.Tensor:
        tensors = [t.to(x.dtype) for t in self.weights[name]]
        if len(tensors) == 1:
            return x @ tensors[0].t()
        a, b = tensors
        return (x @ a.t()) @ b.t() * self.scale

    def to(self, device, dtype) -> "Adapter":
        """A frozen copy for serving."""
        return Adapter(self.config, {n: tuple(t.detach().to(device, dtype) for t in ts)
                                     for n, ts in self.weights.items()}, self.source)

    def save(self, path, metadata: dict | None = None, base: dict | None = None) -> None:
        """Atomically (tmp file + os.replace), so a crash never leaves a half-written adapter. base: the
        fingerprint of the model it was trained on, which servers check before serving it (saved_base)."""
        tensors = {}
        for name, ts in self.weights.items():
            keys = ("delta",) if self.config.full else ("lora_A", "lora_B")
            tensors |= {f"{name}.{k}": t.detach().float().cpu().contiguous() for k, t in zip(keys, ts)}
        meta = {"lora_config": json.dumps(asdict(self.config)), **(metadata or {})}
        if base is not None:
            meta[BASE_KEY] = json.dumps(base)
        tmp = f"{path}.tmp"
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, path)

    def shard(self, cfg, tp) -> "Adapter":
        """The slices rank tp.rank applies, cut like the projections they update (service.model.parallel): a
        column-split projection's B (or D) by rows, a row-split one's A (or D) by columns, whose partial update
        the projection's all-reduce then sums."""
        from service.model.parallel import shard_range

        weights = {}
        for name, tensors in self.weights.items():
            cut = shard_range(name.rsplit(".", 1)[-1], cfg, tp)
            if cut is not None:
                dim, start, stop = cut
                which = 0 if len(tensors) == 1 else (1 if dim == 0 else 0)  # D, else B for rows and A for columns
                t = tensors[which]
                piece = t[start:stop] if dim == 0 else t[:, start:stop]
                tensors = tuple(piece.contiguous() if i == which else x for i, x in enumerate(tensors))
            weights[name] = tensors
        return Adapter(self.config, weights, self.source)

    @classmethod
    def load(cls, path, device, dtype) -> "Adapter":
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            config = LoRAConfig(**json.loads(f.metadata()["lora_config"]))
            keys = ("delta",) if config.full else ("lora_A", "lora_B")
            names = sorted({k.rsplit(".", 1)[0] for k in f.keys()})
            weights = {n: tuple(f.get_tensor(f"{n}.{k}").to(dtype) for k in keys) for n in names}
        return cls(config, weights, str(path))


def saved_base(path) -> dict | None:
    """The fingerprint of the base model an adapter file was trained on (None: saved before fingerprints), read
    without loading its tensors."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    return json.loads(meta[BASE_KEY]) if BASE_KEY in meta else None


def target_linears(model: nn.Module, targets=TARGETS) -> dict[str, nn.Linear]:
    found = {name: m for name, m in model.named_modules()
             if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets}
    if not found:
        raise ValueError(f"the model has no nn.Linear named any of {list(targets)}")
    return found


def _hook(module, inputs, output):
    active = getattr(_local, "active", None)
    if not active:
        return None
    x = inputs[0]
    for adapter, rows in active:
        if module._lora_name not in adapter.weights:
            continue
        if rows is None and adapter.training is not None and torch.is_grad_enabled():
            from kernels.training import lora_linear
            output = lora_linear(x, output.detach(), module.weight, *adapter.training[module._lora_name],
                                 adapter.scale)
        elif rows is None:
            output = output + adapter.delta(module._lora_name, x)
        else:
            output = output.index_add(0, rows, adapter.delta(module._lora_name, x[rows]))
    return output


def install(model: nn.Module) -> None:
    """Hooks every projection adapters may target (idempotent); without an active adapter a hook returns at
    once. Also gives the model its registry of served adapters, model.lora_adapters."""
    if hasattr(model, "lora_adapters"):
        return
    for name, linear in target_linears(model).items():
        linear._lora_name = name
        linear.register_forward_hook(_hook)
    model.lora_adapters = {}


def has_adapter(model: nn.Module, name: str) -> bool:
    return name in getattr(model, "lora_adapters", {})


def _whole_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection as an adapter stores it: whole, where a tensor-parallel rank holds a slice."""
    linears = target_linears(model)
    tp = getattr(model, "tp", None)
    if tp is None or tp.size == 1:
        return {name: (linear.out_features, linear.in_features) for name, linear in linears.items()}
    cfg = model.config
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    h, m = cfg.hidden_size, cfg.intermediate_size
    whole = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (m, h),
             "up_proj": (m, h), "down_proj": (h, m)}
    return {name: whole[name.rsplit(".", 1)[-1]] for name in linears}


def _check_fits(model: nn.Module, adapter: Adapter) -> None:
    """AdapterMismatch unless every tensor has the shape its projection needs: lora_A [rank, in], lora_B [out, rank]
    or delta [out, in]; one that does not would fail every step that applies it. (An adapter of another base with
    the same shapes fits: only its fingerprint, service.model.fingerprint, tells.)"""
    shapes = _whole_shapes(model)
    missing = set(adapter.weights) - set(shapes)
    if missing:
        raise AdapterMismatch(f"the adapter targets modules the model lacks: {sorted(missing)[:3]}")
    r = adapter.config.rank
    for name, tensors in adapter.weights.items():
        out, inp = shapes[name]
        want = [(out, inp)] if adapter.config.full else [(r, inp), (out, r)]
        got = [tuple(t.shape) for t in tensors]
        if got != want:
            raise AdapterMismatch(f"the adapter's {name} has shapes {got}, the model's {out}x{inp} projection needs "
                                  f"{want}: it was trained on another base model")


def add_adapter(model: nn.Module, name: str, adapter: Adapter) -> None:
    """Serves `adapter` (whole, as trained) under `name` from now on (a dict assignment: safe while steps run); a
    tensor-parallel rank keeps its slices. AdapterMismatch if its shapes do not fit the model's projections."""
    _check_fits(model, adapter)
    install(model)
    tp = getattr(model, "tp", None)
    if tp is not None and tp.size > 1:
        adapter = adapter.shard(model.config, tp)
    model.lora_adapters = {**model.lora_adapters, name: adapter}


def remove_adapter(model: nn.Module, name: str) -> None:
    model.lora_adapters = {k: v for k, v in getattr(model, "lora_adapters", {}).items() if k != name}


@contextlib.contextmanager
def activate(active: list[tuple[Adapter, torch.Tensor | None]]):
    """Applies the adapters to the forwards run by this thread inside the block."""
    previous = getattr(_local, "active", None)
    _local.active = active
    try:
        yield
    finally:
        _local.active = previous


def serving_adapters(model: nn.Module, token_adapters: list[str | None], device):
    """For the engine: a context that applies token_adapters[i] (a served adapter's name, or None for the base
    model) to flat token row i of the forwards inside it."""
    if not any(token_adapters):
        return activate([])
    registry = model.lora_adapters
    rows: dict[str, list[int]] = {}
    for i, name in enumerate(token_adapters):
        if name is not None:
            rows.setdefault(name, []).append(i)
    return activate([(registry[name], torch.tensor(r, device=device)) for name, r in rows.items()])


class LoRASlots:
    """`count` slots on the device, each holding one LoRA adapter of rank up to `max_rank` (padded to
    kernels.lora.slot_rank), allocated once: one buffer [count, per-slot size] in which every targeted projection
    has its A [count, R, in] and B [count, out, R] views, and scales [count]. An adapter is packed into one flat
    tensor in that layout once (zeros where it targets nothing), and loading it into a slot is one copy.

    The runner assigns slots (`assign`, on the host: which adapter goes where) and loads them (`load`, on every
    tensor-parallel rank, each from its own slices); copies are stream-ordered, so a slot is never rewritten under
    a step still reading it. Each slot's B is also copied beside the fused weights (the model's add_lora_columns:
    kernels.lora's columns layout), where the GEMMs of steps of a few dozen rows read it (slot_columns)."""

    def __init__(self, model: nn.Module, count: int, max_rank: int):
        from kernels.lora import slot_rank

        install(model)
        self.model, self.count, self.max_rank, self.rank = model, count, max_rank, slot_rank(max_rank)
        if hasattr(model, "add_lora_columns"):
            model.add_lora_columns(count * self.rank)
        weight = next(model.parameters())
        self.linears = target_linears(model)
        self.layout: dict[str, tuple[int, int, int, int]] = {}  # projection -> (offset of A, of B, in, out)
        size = 0
        for name, linear in self.linears.items():
            n_in, n_out = linear.in_features, linear.out_features
            self.layout[name] = (size, size + self.rank * n_in, n_in, n_out)
            size += self.rank * (n_in + n_out)
        self.storage = torch.zeros(count, size, device=weight.device, dtype=weight.dtype)
        self.scales = torch.zeros(count, device=weight.device, dtype=torch.float32)
        self.held: list[Adapter | None] = [None] * count  # the adapter each slot holds
        self._last_used = [0] * count
        self._clock = 0
        self._packed: dict[int, tuple[Adapter, torch.Tensor]] = {}  # id(adapter) -> (it, its packed weights)
        self.loads = self.evictions = 0  # adapters copied into a slot; of those, into one another adapter held

    def fits(self, adapter: Adapter) -> bool:
        """Whether the adapter can live in a slot (a dense one, or a rank past max_rank, is served eagerly)."""
        return not adapter.config.full and adapter.config.rank <= self.max_rank

    def assign(self, names: set[str]) -> tuple[dict[str, int], list[tuple[int, str]]]:
        """Slots for a step's adapters (at most `count`, each fits): {name: slot}, and the (slot, name) loads that
        puts adapters not in a slot yet into the least recently used slots this step does not need."""
        registry = self.model.lora_adapters
        slot_of = {}
        for slot, held in enumerate(self.held):
            for name in names:
                if held is not None and registry[name] is held:  # the same object: a reloaded name is reloaded
                    slot_of[name] = slot
        self._clock += 1
        loads = []
        free = sorted((s for s in range(self.count) if s not in slot_of.values()), key=lambda s: self._last_used[s])
        for name in sorted(names - slot_of.keys()):
            slot = free.pop(0)
            slot_of[name] = slot
            self.evictions += self.held[slot] is not None
            self.held[slot] = registry[name]
            loads.append((slot, name))
        self.loads += len(loads)
        for slot in slot_of.values():
            self._last_used[slot] = self._clock
        return slot_of, loads

    def load(self, slot: int, name: str) -> None:
        """Copies a served adapter into a slot (this rank's slices of it, under tensor parallelism)."""
        adapter = self.model.lora_adapters[name]
        self.held[slot] = adapter
        self.storage[slot].copy_(self._pack(adapter), non_blocking=True)
        self.scales[slot].fill_(adapter.scale)
        for name, linear in self.linears.items():
            if getattr(linear, "_lora_columns", None) is not None:
                wide, row, col = linear._lora_columns
                _, b_at, _, n_out = self.layout[name]
                b = self.storage[slot, b_at:b_at + n_out * self.rank].view(n_out, self.rank)
                wide[row:row + n_out, col + slot * self.rank:col + (slot + 1) * self.rank].copy_(b)

    def _pack(self, adapter: Adapter) -> torch.Tensor:
        entry = self._packed.get(id(adapter))
        if entry is None or entry[0] is not adapter:
            served = {id(a) for a in self.model.lora_adapters.values()}
            self._packed = {k: v for k, v in self._packed.items() if k in served}  # adapters since removed
            flat = torch.zeros(self.storage.shape[1], dtype=self.storage.dtype)
            for name, (a_at, b_at, n_in, n_out) in self.layout.items():
                if name in adapter.weights:
                    lora_a, lora_b = (t.detach().to("cpu", self.storage.dtype) for t in adapter.weights[name])
                    r = lora_a.shape[0]
                    flat[a_at:b_at].view(self.rank, n_in)[:r] = lora_a
                    flat[b_at:b_at + self.rank * n_out].view(n_out, self.rank)[:, :r] = lora_b
            if self.storage.is_cuda:
                flat = flat.pin_memory()
            entry = self._packed[id(adapter)] = (adapter, flat)
        return entry[1]

    def apply(self, x: torch.Tensor, projections: tuple[tuple[nn.Linear, torch.Tensor], ...],
              shrunk: torch.Tensor | None = None) -> None:
        """Adds the update of each row's slot to the outputs of projections of input x (in place); shrunk (CUDA):
        their shrinks, already computed (slot_shrinks)."""
        tiles, row_slots = _local.slots_batch
        outputs = []
        for linear, y in projections:
            a_at, b_at, _, _ = self.layout[linear._lora_name]
            outputs.append((y.view(-1, y.shape[-1]), a_at, b_at))
        x = x.reshape(-1, x.shape[-1])
        if x.is_cuda:
            from kernels.lora import lora_add_
            lora_add_(x, outputs, self.storage, self.scales, tiles, self.rank, shrunk=shrunk)
        else:
            from kernels.lora import lora_add_ref
            lora_add_ref(x, outputs, self.storage, self.scales, row_slots, self.rank)


def add_slot_updates(x: torch.Tensor, *projections: tuple[nn.Linear, torch.Tensor],
                     shrunk: torch.Tensor | None = None) -> None:
    """Serving from slots: adds each token row's adapter update to the outputs of these projections of input x, in
    place (kernels.lora.lora_add_: two launches, or one with the shrinks `shrunk` already computed). Nothing unless
    this thread serves from slots (serving_slots)."""
    slots = getattr(_local, "slots", None)
    if slots is not None:
        slots.apply(x, projections, shrunk)


def slot_lora(linears) -> tuple | None:
    """kernels.decode_linear's `lora` argument for projections of one input whose weights are fused in this order:
    the slots this thread serves from, the step's tiles, and each projection's (columns, A offset, B offset); None
    when the thread serves no slots."""
    slots = getattr(_local, "slots", None)
    if slots is None:
        return None
    parts = []
    for linear in linears:
        a_at, b_at, _, n_out = slots.layout[linear._lora_name]
        parts.append((n_out, a_at, b_at))
    return slots.storage, slots.scales, _local.slots_batch[0], slots.rank, parts


def slot_shrinks(rows: int, *linears: nn.Linear) -> tuple | None:
    """The `shrinks` argument of kernels.elementwise's norms for the projections of one input that read the norm
    (rows of it), and last whether the norm writes them in the columns layout (slot_columns): their LoRA shrinks
    computed in the norm's kernel, from slot_lora's slots, tiles and A offsets; None when the thread serves no
    slots."""
    lora = slot_lora(linears)
    if lora is None:
        return None
    return *lora[:4], [a_at for _, a_at, _ in lora[4]], slot_columns(linears, rows, normed=True) is not None


def slot_update_in_norm(linear: nn.Linear, rows: int) -> tuple[int, int] | None:
    """Where the residual add that reads the output of `linear` (o) adds its LoRA updates itself
    (kernels.elementwise.add_rms_norm_shrinks' `update`: no shrink launch, no slots' columns in o's GEMM): serving
    from slots, up to kernels.lora.UPDATE_IN_NORM_MAX_ROWS rows (no more than ROW_SHRINK_MAX_ROWS: the norm computes
    the next projections' shrinks there); then the projection's (A offset, B offset) in the slots, else None."""
    from kernels import lora

    slots = getattr(_local, "slots", None)
    if slots is None or rows > min(lora.UPDATE_IN_NORM_MAX_ROWS, lora.ROW_SHRINK_MAX_ROWS) or lora.tiled_columns(rows):
        return None
    a_at, b_at, _, _ = slots.layout[linear._lora_name]
    return a_at, b_at


def slot_merge_shrinks(linear: nn.Linear, rows: int) -> tuple | None:
    """kernels.decode.decode_attention_shrinks' `shrinks` for `linear` (o, which reads the attention's output) where a
    decode step's merge computes them (kernels.lora.SHRINKS_IN_MERGE): o in the slots' columns (slot_columns) and up
    to kernels.lora.ROW_SHRINK_MAX_ROWS rows; else None."""
    from kernels import lora

    shrinks = slot_shrinks(rows, linear) if lora.SHRINKS_IN_MERGE and rows <= lora.ROW_SHRINK_MAX_ROWS else None
    return shrinks[:-1] if shrinks is not None and shrinks[-1] else None  # (the last: in the slots' columns)


def slot_columns(linears, rows: int, normed: bool) -> torch.Tensor | None:
    """The fused weight of these projections with the slots' B beside it (kernels.lora's columns layout), where a
    step of `rows` token rows adds the slots' updates in its GEMM: serving from slots, past
    kernels.decode_linear.MAX_ROWS rows and up to kernels.lora.COLUMNS_MAX_ROWS, for projections whose input comes
    from a norm (`normed`: the norm writes the shrinks) or, with kernels.lora.COLUMNS_SHRINK_LAUNCH, any; else
    None."""
    from kernels import lora
    from kernels.decode_linear import MAX_ROWS

    columns = getattr(linears[0], "_lora_columns", None)
    if getattr(_local, "slots", None) is None or columns is None or not MAX_ROWS < rows <= lora.COLUMNS_MAX_ROWS:
        return None
    return columns[0] if normed or lora.COLUMNS_SHRINK_LAUNCH else None


def slot_columns_input(x: torch.Tensor, linears, up: torch.Tensor | None = None) -> torch.Tensor:
    """[x | shrinks] in the columns layout for projections whose input no norm produced (o, down; up: x is the gate
    and up the up projection of the SwiGLU whose result the projections read): kernels.elementwise.columns_input
    with the slots this thread serves from."""
    from kernels.elementwise import columns_input
    from kernels.lora import used_tiles

    weights, scales, tiles, rank, parts = slot_lora(linears)
    return columns_input(x, weights, scales, tiles, rank, [a_at for _, a_at, _ in parts],
                         used_tiles(tiles, x.shape[0], weights.shape[0]), up=up)


def eager_adapters_active() -> bool:
    """Whether adapters apply through the projections' forward hooks in this thread (training, eager serving)."""
    return bool(getattr(_local, "active", None))


@contextlib.contextmanager
def serving_slots(slots: LoRASlots, tiles: torch.Tensor | None, row_slots: torch.Tensor | None):
    """Applies the adapters in `slots` to the forwards this thread runs inside the block: on CUDA, those of
    `tiles` (kernels.lora.lora_tiles, on the device: a graph captures the buffer it is in); on the CPU, each flat
    token row's slot in row_slots (-1: none)."""
    _local.slots, _local.slots_batch = slots, (tiles, row_slots)
    try:
        yield
    finally:
        _local.slots = _local.slots_batch = None
