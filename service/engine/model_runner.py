"""The runner owns the forward pass's inputs and the KV-cache tensors: it turns a scheduled batch into tensors
(one builder for steps, warm-up, memory profiling and graph capture), then replays a captured CUDA graph or runs
the model eagerly, and returns the logits of the rows to sample. Engine-core process.

A small model's step is bound by the host launching ~1,000 kernels, not by the GPU (a 128-token prefill: 30 ms
eager, 3 ms of GPU time), so both kinds of step replay graphs: pure-decode steps one per batch size, and prefill
or mixed steps one per (token count, sequence count) bucket, whose padding tokens write no cache slot and whose
padding sequences are empty (the varlen kernel's programs for them return at once). Steps that serve LoRA adapters
replay graphs of their own, captured with the LoRA path: the runner keeps up to `max_loras` adapters in device
slots (service/model/lora.py LoRASlots), and a step's inputs say which rows use which slot (kernels/lora.py).
Steps with dense adapters, or ranks past `max_lora_rank`, run eagerly through the adapters' forward hooks.

A speculative verify (a sequence's last token and its draft tokens, every row sampled) runs as decode rows: row j
attends its sequence's keys up to its own token, in its sequence's blocks, as if it were a sequence of its own. A
step of decodes and verifies then replays a decode graph (its argmax inside) by its row count, and the split-KV
decode kernel computes each row as plain decoding computes that token; a verify costs its rows, not a prefill
graph's bucket.

A decode input may be a token the previous step sampled that the host has not seen yet (PENDING): the runner
takes it from that step's sampled tokens on the device, so no step waits for the host to learn the previous one.

A step is planned on the host (plan: which graph, its inputs packed in numpy arrays, a StepPlan) and then executed
(execute: copies, replay or eager forward, logits). Under tensor parallelism rank 0 plans, sends the plan to the
other ranks (service.engine.tp_workers), and every rank executes it.
"""
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kernels import configs as kernel_configs
from kernels import lora as lora_kernels
from kernels.decode import choose_num_splits
from kernels.pdl_primer import prime, wants_primer
from kernels.prefill import max_tiles, multi_row_tiles
from kvcache import KVCache, num_blocks_for_bytes, num_blocks_for_gpu
from service.config import Settings
from service.engine.sampler import greedy
from service.engine.scheduler import ScheduledBatch
from service.engine.sequence import PENDING
from service.metrics import STEP_KINDS
from service.model.attention import AttentionMetadata

log = logging.getLogger(__name__)
GRAPH_BATCH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
# Steps of 1.5x the powers of two too: a full decode batch plus one prompt (256 + 128 tokens, the common mixed step
# under steady load) padded to 512 rows would compute a third of its GEMM rows for nothing.
PREFILL_GRAPH_TOKENS = [16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192]
PREFILL_GRAPH_SEQS = [1, 4, 16, 64, 256, 1024]  # coarse: a padding sequence costs only programs that return
NUMPY_DTYPES = {torch.int32: np.int32, torch.int64: np.int64}
DECODE_COLUMNS = 8  # of a decode step's per-sequence int32 row (6 used, 32 bytes), see _decode_rows
DECODE_GRAPH, PREFILL_GRAPH, EAGER = 0, 1, 2  # (service.metrics.STEP_KINDS names them in this order)


@dataclass
class StepPlan:
    """One step as ModelRunner.execute runs it on every tensor-parallel rank: the host's decisions (which graph)
    and its inputs packed in numpy arrays (_decode_rows, or _pack's three)."""
    kind: int  # DECODE_GRAPH, PREFILL_GRAPH or EAGER
    key: tuple[int, int]  # the graph's: (batch size, 0) or (tokens, sequences)
    num_tokens: int
    num_seqs: int
    num_samples: int  # rows sampled
    pending: int  # length of the previous step's sampled tokens it reads (0: it reads none)
    copies: list[tuple[int, int]]  # copy-on-write block copies, before the step
    adapters_changed: dict[str, str | None] | None  # see ModelRunner._adapter_changes
    arrays: list[np.ndarray] = field(default_factory=list)
    max_seqlen_q: int = 1  # eager steps only, from here on
    max_seqlen_k: int = 0
    decode: bool = False  # every sequence has one query row
    tiles: int = -1  # the prefill kernel's tiles beside single-row sequences (-1: it computes every row)
    adapters: list[str | None] | None = None  # each token row's LoRA adapter, served eagerly through hooks
    lora_loads: list[tuple[int, str]] = field(default_factory=list)  # (slot, adapter) to load before the step
    lora: bool = False  # adapters served from slots: arrays[-1] are the LoRA tiles (kernels.lora.lora_tiles)


class ModelRunner:
    def __init__(self, model, block_size: int, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_prefill_graph_tokens: int = 0):
        self.model = model
        self.cfg = model.config
        self.tp = model.tp
        self.num_kv_heads = model.model.layers[0].self_attn.num_kv_heads  # this rank's
        self.workers = None  # rank 0 of a tensor-parallel model: the other ranks' handle (send(plan))
        self._adapters_sent: dict[str, str | None] = {}
        # A worker rank's adapter files being read (name: the read), and the one thread that reads them: see
        # _apply_adapter_changes. The thread only turns a file into an Adapter; the registry is this thread's.
        self._adapter_reads: dict[str, Future] = {}
        self._adapter_reader: ThreadPoolExecutor | None = None
        self._pending: torch.Tensor | None = None  # a worker's copy of rank 0's sampled tokens
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.pdl_primer = wants_primer(self.device)  # a no-op PDL launch before each replay (kernels/pdl_primer.py)
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.kv_cache: KVCache | None = None
        self.max_prefill_graph_tokens = min(max_prefill_graph_tokens, max_num_batched_tokens)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # decode, by batch size
        # their outputs: logits, and each row's argmax and its logprob (greedy rows need nothing else)
        self.graph_logits: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.prefill_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # by (tokens, sequences)
        self.prefill_hidden: dict[tuple[int, int], torch.Tensor] = {}
        self._num_tiles = 0  # the prefill graphs' q_tiles width (their largest grid)
        # Decode graphs' block tables: sequence -> (its table as last written, its row, entries written, last one)
        self._table_rows: dict = {}
        self._free_table_rows: list[int] = []
        self.slots = None  # LoRASlots, when adapters are served from slots (set before the graphs are captured)
        self.lora_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # decode graphs with the LoRA path, by batch size
        self.lora_graph_logits: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.lora_prefill_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.lora_prefill_hidden: dict[tuple[int, int], torch.Tensor] = {}
        self.last_step = ("eager", "none")  # how the last step ran, and whose adapters (service.metrics' names)

    # -- inputs ------------------------------------------------------------------------------------------
    def _tensor(self, data, dtype):
        """A host list (flat or rectangular) or array on the device, without waiting: through numpy, which converts a
        list of ints 3x faster than torch.tensor, and pinned memory, which a non-blocking copy needs."""
        host = torch.from_numpy(np.asarray(data, dtype=NUMPY_DTYPES[dtype]))
        if self.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def _copy_in(self, dst: torch.Tensor, data: np.ndarray) -> None:
        """dst[...] = data without waiting: from pinned memory, ordered on the stream after the step in flight."""
        host = torch.from_numpy(data)
        dst.copy_(host.pin_memory() if self.device.type == "cuda" else host, non_blocking=True)

    def _pack(self, input_ids: list[int], seqlens_q: list[int], seqlens_k: list[int], tables: list[list[int]],
              num_tokens: int, num_seqs: int, sources: np.ndarray | None = None, sample_rows: list[int] = (),
              write_cache: bool = True, num_tiles: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A prefill or mixed step's inputs as host arrays, padded to num_tokens tokens and num_seqs sequences (a
        graph's bucket, or the step's own size); sequence b's new tokens are the last seqlens_q[b] of its
        seqlens_k[b], in the blocks tables[b]. Returns
        - int64 [5, num_tokens]: token ids; the row of the previous step's sampled tokens to take each id from
          instead (sources, -1: none); positions; cache slots (-1: padding, or write_cache=False); the rows to
          sample, first;
        - int32 [6, _section(max(num_seqs, num_tiles))]: cu_seqlens_q, cu_seqlens_k, seqlens_k,
          single_row_seqlens_k (padding sequences are empty), then the prefill kernel's q_tiles (two rows, padded
          to num_tiles; default: as many as there are), see _metadata;
        - the block table, int32 [batch, widest table rounded up to 16 columns].
        Vectorized in numpy: no per-token host loop, and one copy to the device per array. Every row starts
        16-byte aligned and the table's row stride is a multiple of 16, as in the graphs' buffers: Triton
        specializes kernels on both, and an eager step must not compile a variant the graphs did not."""
        n, batch, block = len(input_ids), len(seqlens_q), self.block_size
        lens_q, lens_k = np.asarray(seqlens_q, dtype=np.int64), np.asarray(seqlens_k, dtype=np.int64)
        width = min(-(-max(map(len, tables)) // 16) * 16, self.max_blocks_per_seq)
        table = np.asarray([t + [0] * (width - len(t)) for t in tables], dtype=np.int32)
        flat = np.zeros((5, num_tokens), dtype=np.int64)
        flat[0, :n] = input_ids
        flat[1] = -1
        if sources is not None:
            flat[1, :n] = sources
        cu_q = np.zeros(batch + 1, dtype=np.int64)
        np.cumsum(lens_q, out=cu_q[1:])
        seq = np.repeat(np.arange(batch), lens_q)
        positions = np.arange(n) - cu_q[seq] + (lens_k - lens_q)[seq]
        flat[2, :n] = positions
        flat[3] = -1
        if write_cache:
            flat[3, :n] = table[seq, positions // block].astype(np.int64) * block + positions % block
        flat[4, :len(sample_rows)] = sample_rows
        tiles = multi_row_tiles(lens_q, num_tiles)
        lens = np.zeros((6, _section(max(num_seqs, tiles.shape[1]))), dtype=np.int32)
        lens[4:] = -1
        lens[4:, :tiles.shape[1]] = tiles
        lens[0, :batch + 1], lens[0, batch + 1:] = cu_q, n
        np.cumsum(lens_k, out=lens[1, 1:batch + 1])
        lens[1, batch + 1:] = lens[1, batch]
        lens[2, :batch] = lens_k
        lens[3, :batch] = np.where(lens_q == 1, lens_k, 0)
        return flat, lens, table

    def _metadata(self, slots: torch.Tensor, block_table: torch.Tensor, lens: torch.Tensor, batch: int,
                  max_seqlen_q: int, max_seqlen_k: int, num_tiles: int | None) -> AttentionMetadata:
        """A prefill or mixed step's metadata for its first `batch` sequences, over `lens`, the device copy of
        _pack's int32 array. With num_tiles (a graph's, or a step with one-row sequences), the one-row
        sequences (decodes) go to the decode kernel, split as for the smallest graph bucket that holds `batch`
        sequences (graph and eager steps share the few kernel variants the graph captures compiled, and no step
        compiles another), and the prefill kernel runs over the first num_tiles of q_tiles. Without, the prefill
        kernel computes every row (an eager prefill: long prompts, the tiles' shorter BLOCK_M would cost)."""
        meta = AttentionMetadata(slot_mapping=slots, block_table=block_table, seqlens_k=lens[2, :batch],
                                 cu_seqlens_q=lens[0, :batch + 1], cu_seqlens_k=lens[1, :batch + 1],
                                 max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
        if num_tiles is not None:
            bucket = next((b for b in PREFILL_GRAPH_SEQS if b >= batch), batch)
            meta.num_splits = choose_num_splits(bucket, self.num_kv_heads, self.device)
            meta.single_row_seqlens_k, meta.q_tiles = lens[3, :batch], lens[4:, :num_tiles]
        return meta

    def _inputs(self, input_ids: list[int], seqlens_q: list[int], seqlens_k: list[int], tables: list[list[int]],
                write_cache: bool = True) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Token ids, positions, attention metadata and the rows to sample of an eager start-up step (warm-up,
        profiling); write_cache=False leaves the cache untouched (slots -1)."""
        plan = StepPlan(EAGER, (0, 0), len(input_ids), len(seqlens_q), 0, 0, [], None)
        self._plan_eager(plan, input_ids, seqlens_q, seqlens_k, tables, write_cache=write_cache)
        return self._eager_inputs(plan, *plan.arrays, None)

    def _plan_eager(self, plan: StepPlan, input_ids: list[int], seqlens_q: list[int], seqlens_k: list[int],
                    tables: list[list[int]], sources: np.ndarray | None = None, sample_rows: list[int] = (),
                    write_cache: bool = True) -> None:
        """Fills in an eager step's packed inputs (_pack, at the step's own size) and what its metadata needs."""
        plan.arrays = list(self._pack(input_ids, seqlens_q, seqlens_k, tables, -(-len(input_ids) // 16) * 16,
                                      len(seqlens_q), sources, sample_rows, write_cache))
        plan.max_seqlen_q, plan.max_seqlen_k = max(seqlens_q), max(seqlens_k)
        plan.decode = all(q == 1 for q in seqlens_q)
        plan.tiles = int((plan.arrays[1][4] >= 0).sum()) if 1 in seqlens_q else -1

    def _eager_inputs(self, plan: StepPlan, flat: np.ndarray, packed: np.ndarray, table: np.ndarray,
                      pending: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """An eager step's token ids (PENDING ones taken from `pending`, see _pack), positions, attention metadata
        and rows to sample, on the device."""
        n, batch = plan.num_tokens, plan.num_seqs
        flat, lens, block_table = (self._tensor(flat, torch.long), self._tensor(packed, torch.int32),
                                   self._tensor(table, torch.int32))
        ids, positions, slots = _take_pending(flat[0, :n], flat[1, :n], pending), flat[2, :n], flat[3, :n]
        if plan.decode:
            meta = self._decode_metadata(slots, block_table, lens[2, :batch])
        else:
            meta = self._metadata(slots, block_table, lens, batch, plan.max_seqlen_q, plan.max_seqlen_k,
                                  None if plan.tiles < 0 else plan.tiles)
        return ids, positions, meta, flat[4, :plan.num_samples]

    def _decode_metadata(self, slots, block_table, seqlens_k) -> AttentionMetadata:
        # Split as the graph that would hold this batch does: an eager step (LoRA adapters, a batch past the
        # largest graph) computes what that graph would, and reuses the kernel variants its capture compiled.
        batch = block_table.shape[0]
        bucket = next((b for b in GRAPH_BATCH_SIZES if b >= batch), batch)
        splits = choose_num_splits(bucket, self.num_kv_heads, self.device)
        return AttentionMetadata(slot_mapping=slots, block_table=block_table, seqlens_k=seqlens_k, decode=True,
                                 num_splits=splits)

    # -- steps -------------------------------------------------------------------------------------------
    def run(self, batch: ScheduledBatch, pending: torch.Tensor | None
            ) -> tuple[torch.Tensor, list[int], tuple[torch.Tensor, torch.Tensor] | None]:
        """Computes batch.num_tokens[i] new tokens of batch.seqs[i] from batch.starts[i] on; pending: the
        previous step's sampled tokens on the device (for PENDING inputs). Returns logits of the sequences whose
        chunk reaches their last token, those sequences' indices in the batch, and, from a decode graph, each
        row's argmax and its logprob (else None). Tensor-parallel workers run the same step from its plan."""
        plan, sample_index = self.plan(batch, pending)
        adapters = "hooks" if plan.adapters else "slots" if plan.lora else "none"  # (service.metrics.STEP_ADAPTERS)
        self.last_step = STEP_KINDS[plan.kind], adapters
        if self.workers is not None:
            self.workers.send(plan)
        logits, greedy = self.execute(plan, pending)
        return logits, sample_index, greedy

    def plan(self, batch: ScheduledBatch, pending: torch.Tensor | None) -> tuple[StepPlan, list[int]]:
        """The step's host work: which graph (or none) runs it and its packed inputs; and the indices in the batch
        of the sequences it samples, row by row (a speculative verify's sequence once per row: its last token's and
        each draft token's)."""
        input_ids, seqlens_q, seqlens_k, fill_rows, from_rows, sample_rows, sample_index = [], [], [], [], [], [], []
        drafts = batch.drafts
        for i, (seq, start, n) in enumerate(zip(batch.seqs, batch.starts, batch.num_tokens)):
            end = start + n
            if drafts and i in drafts:  # a verify: its last token and its draft, every row sampled
                input_ids += seq.token_ids[start:]
                input_ids += drafts[i]
                seqlens_q.append(n)
                seqlens_k.append(end)
                sample_rows += range(len(input_ids) - n, len(input_ids))
                sample_index += [i] * n
                continue
            input_ids += seq.token_ids[start:end]
            if input_ids[-1] == PENDING:  # only a sequence's last token can be
                fill_rows.append(len(input_ids) - 1)
                from_rows.append(seq.pending_row)
            seqlens_q.append(n)
            seqlens_k.append(end)
            if end == len(seq.token_ids):
                sample_rows.append(len(input_ids) - 1)
                sample_index.append(i)
        plan = StepPlan(EAGER, (0, 0), len(input_ids), len(batch.seqs), len(sample_rows),
                        len(pending) if pending is not None and fill_rows else 0, batch.copies,
                        self._adapter_changes())
        adapters = any(seq.adapter for seq in batch.seqs)
        seq_slots = self._assign_slots(plan, batch.seqs) if adapters else None
        hooks = adapters and seq_slots is None  # adapters that only the eager forward's hooks can serve
        graphs, prefill_graphs = ((self.lora_graphs, self.lora_prefill_graphs) if seq_slots is not None
                                  else (self.graphs, self.prefill_graphs))
        # A decode graph samples every row: a one-token prompt chunk that is not the prompt's last (room for one
        # more token beside the decodes) makes the step a mixed one. Verifies are decode rows (the module's doc)
        # unless their rows outnumber the largest decode graph's, or the attention kernel writes a row's K/V itself
        # (DECODE_ROPE_IN_ATTENTION: a verify's rows read each other's).
        tables = batch.block_tables
        decode = len(input_ids) == len(sample_rows)
        if decode and len(input_ids) > len(batch.seqs):
            decode = not kernel_configs.DECODE_ROPE_IN_ATTENTION and len(input_ids) <= max(graphs, default=1 << 30)
            if decode:
                tables = [table for table, n in zip(tables, seqlens_q) for _ in range(n)]
                seqlens_k = [end - n + j + 1 for n, end in zip(seqlens_q, seqlens_k) for j in range(n)]
                seqlens_q = [1] * len(input_ids)
                plan.num_seqs = len(input_ids)
        if decode:
            key = next((bs for bs in graphs if bs >= len(input_ids)), None)
        else:
            key = next((k for k in prefill_graphs if k[0] >= len(input_ids) and k[1] >= len(batch.seqs)), None)
        plan.lora = seq_slots is not None
        row_slots = np.repeat(seq_slots, batch.num_tokens) if plan.lora else None  # each flat token row's slot
        if key is not None and not hooks and decode:
            plan.kind, plan.key = DECODE_GRAPH, (key, 0)
            plan.arrays = self._decode_rows(key, batch, input_ids, seqlens_k, tables)
            if plan.lora:
                plan.arrays.append(lora_kernels.lora_tiles(row_slots, self._lora_tiles(key)))
            return plan, sample_index
        sources = None
        if fill_rows:
            sources = np.full(len(input_ids), -1, dtype=np.int64)
            sources[fill_rows] = from_rows
        if key is not None and not hooks:
            plan.kind, plan.key = PREFILL_GRAPH, key
            plan.arrays = list(self._pack(input_ids, seqlens_q, seqlens_k, tables,
                                          self.prefill_static["tokens"].shape[1], self.prefill_static["block_table"]
                                          .shape[0], sources, sample_rows, num_tiles=self._num_tiles))
            if plan.lora:
                plan.arrays.append(lora_kernels.lora_tiles(row_slots, self._lora_tiles(key[0])))
            return plan, sample_index
        self._plan_eager(plan, input_ids, seqlens_q, seqlens_k, tables, sources, sample_rows)
        if plan.lora:
            plan.arrays += [lora_kernels.lora_tiles(row_slots, self._lora_tiles(len(input_ids))), row_slots]
        elif hooks:
            plan.adapters = [seq.adapter for seq, n in zip(batch.seqs, batch.num_tokens) for _ in range(n)]
        return plan, sample_index

    def _lora_tiles(self, rows: int) -> int:
        """The LoRA kernels' tiles of a step (or graph) of `rows` token rows."""
        return lora_kernels.max_tiles(rows, self.slots.count)

    def _assign_slots(self, plan: StepPlan, seqs: list) -> np.ndarray | None:
        """Each sequence's LoRA slot (-1: the base model), the loads that puts the step's adapters in slots going
        into the plan; None when an adapter cannot live in a slot (dense, or a rank past max_lora_rank)."""
        names = {seq.adapter for seq in seqs if seq.adapter}
        registry = self.model.lora_adapters
        if self.slots is None or len(names) > self.slots.count or not all(self.slots.fits(registry[n])
                                                                           for n in names):
            return None
        slot_of, plan.lora_loads = self.slots.assign(names)
        return np.asarray([slot_of[seq.adapter] if seq.adapter else -1 for seq in seqs], dtype=np.int32)

    def _adapter_changes(self) -> dict[str, str | None] | None:
        """The served LoRA adapters added (name: file) or removed (name: None) since the last step's plan, which
        tensor-parallel workers read (cut to their slices) before any step uses them (_apply_adapter_changes)."""
        if self.workers is None:
            return None
        served = {name: a.source for name, a in getattr(self.model, "lora_adapters", {}).items()}
        if served == self._adapters_sent:
            return None
        changes = {name: path for name, path in served.items() if self._adapters_sent.get(name) != path}
        changes |= {name: None for name in self._adapters_sent if name not in served}
        self._adapters_sent = served
        return changes

    @torch.inference_mode()
    def execute(self, plan: StepPlan, pending: torch.Tensor | None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Runs a planned step on this rank: (logits of the rows to sample, a decode graph's argmax and logprobs
        of them or None). Under tensor parallelism every rank runs it; rank 0's `pending` reaches the others."""
        if plan.adapters_changed:
            self._apply_adapter_changes(plan.adapters_changed)
        if self._adapter_reads:
            self._install_adapter_reads(plan)
        for slot, name in plan.lora_loads:
            self.slots.load(slot, name)
        self.kv_cache.copy_blocks(plan.copies)
        pending = self._share_pending(plan, pending)
        n = plan.num_samples
        tiles = plan.arrays[-1] if plan.lora and plan.kind != EAGER else None
        if plan.kind == DECODE_GRAPH:
            logits, tokens, logprobs = self._replay(plan.key[0], *plan.arrays[:2], pending, tiles)
            return logits[:n], (tokens[:n], logprobs[:n])
        flat, packed, table = plan.arrays[:3]
        if plan.kind == PREFILL_GRAPH:
            hidden, rows = self._replay_prefill(plan.key, plan.num_tokens, plan.num_seqs, flat, packed, table,
                                                pending, tiles)
            return self.model.compute_logits(hidden[rows[:n]]), None
        ids, positions, meta, rows = self._eager_inputs(plan, flat, packed, table, pending)
        if plan.lora:  # adapters from slots, each row's given by the tiles (CUDA) or its slot (the CPU)
            from service.model.lora import serving_slots
            tiles, row_slots = plan.arrays[3:5]
            on_cuda = self.device.type == "cuda"
            with serving_slots(self.slots, self._tensor(tiles, torch.int32) if on_cuda else None,
                               None if on_cuda else torch.from_numpy(row_slots).long()):
                hidden = self.model(ids, positions, meta)
        elif plan.adapters:  # adapters slots cannot hold, on the rows of the sequences that asked for them
            from service.model.lora import serving_adapters
            with serving_adapters(self.model, plan.adapters, self.device):
                hidden = self.model(ids, positions, meta)
        else:
            hidden = self.model(ids, positions, meta)
        return self.model.compute_logits(hidden[rows]), None

    def _share_pending(self, plan: StepPlan, pending: torch.Tensor | None) -> torch.Tensor | None:
        """The previous step's sampled tokens, if this step reads any: rank 0 sampled them and broadcasts them."""
        if not plan.pending:
            return None
        if self.tp.size == 1:
            return pending
        if self.tp.rank == 0:
            pending = pending.contiguous()
        else:
            if self._pending is None or len(self._pending) < plan.pending:
                self._pending = torch.zeros(max(plan.pending, self.max_num_seqs), dtype=torch.long,
                                            device=self.device)
            pending = self._pending[:plan.pending]
        torch.distributed.broadcast(pending, 0)
        return pending

    def _apply_adapter_changes(self, changes: dict[str, str | None]) -> None:
        """A worker rank's side of rank 0's adapter changes. Reading a file here would stall every rank for the
        step (they meet in its collectives), though the adapter is rarely used by the step that announces it: the
        files are read on a thread, and each adapter installed by _install_adapter_reads before the first step that
        uses it. A changed or removed name leaves the registry at once, so no step can use a version rank 0 no
        longer serves."""
        if self.tp.rank == 0:  # rank 0 served them already: its plan reports what it serves
            return
        from service.model.lora import has_adapter, remove_adapter
        from service.model.peft import load_adapter
        if self._adapter_reader is None:
            self._adapter_reader = ThreadPoolExecutor(1, "adapter-reader", self._reader_start)
        for name, path in changes.items():
            superseded = self._adapter_reads.pop(name, None)
            if superseded is not None:
                superseded.cancel()
            if has_adapter(self.model, name):  # on a model without a registry, it would make one without the hooks
                remove_adapter(self.model, name)
            if path is not None:
                self._adapter_reads[name] = self._adapter_reader.submit(load_adapter, path, self.device, self.dtype)

    def _reader_start(self) -> None:
        if self.device.type == "cuda":  # a thread starts on GPU 0: keep this rank's reads off another rank's GPU
            torch.cuda.set_device(self.device)

    def _install_adapter_reads(self, plan: StepPlan) -> None:
        """Installs the adapters read since the last step, and waits for the reads of those this step uses (in a
        slot it loads, or through the hooks). A read that failed raises here, as it did in the step before reads
        moved to the thread: the worker ends, and the watchdog with it rank 0."""
        from service.model.lora import add_adapter
        used = {name for _, name in plan.lora_loads} | set(plan.adapters or ())
        for name, read in list(self._adapter_reads.items()):
            if read.done() or name in used:
                del self._adapter_reads[name]
                add_adapter(self.model, name, read.result())

    # -- start-up ----------------------------------------------------------------------------------------
    def _cache(self, num_blocks: int) -> KVCache:
        cfg = self.cfg
        return KVCache(cfg.num_hidden_layers, num_blocks, self.block_size, self.num_kv_heads, cfg.head_dim,
                       self.dtype, str(self.device))

    def _full_budget_batch(self) -> tuple[list[int], list[list[int]]]:
        """The largest prefill step: max_num_batched_tokens split over as many sequences as allowed, each with its
        own consecutive blocks."""
        tokens = min(self.max_num_batched_tokens, self.max_num_seqs * self.max_model_len)
        seqs = max(1, min(self.max_num_seqs, tokens))
        lens = [tokens // seqs + (i < tokens % seqs) for i in range(seqs)]
        tables, first = [], 0
        for n in lens:
            blocks = -(-n // self.block_size)
            tables.append(list(range(first, first + blocks)))
            first += blocks
        return lens, tables

    @torch.inference_mode()
    def profile_activation_peak(self) -> int:
        """Peak activation memory (bytes) of a full-budget prefill step, run against a throwaway cache."""
        lens, tables = self._full_budget_batch()
        cache = self._cache(tables[-1][-1] + 1)
        self.model.bind_kv_cache(cache.k_caches, cache.v_caches)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        ids, positions, meta, _ = self._inputs([0] * sum(lens), lens, lens, tables)
        hidden = self.model(ids, positions, meta)
        self.model.compute_logits(hidden[:len(lens)]).float().softmax(-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del cache, hidden
        torch.cuda.empty_cache()
        log.info("profiled activation peak: %.1f MiB for %d tokens", peak / 2**20, sum(lens))
        return peak

    def allocate_kv_cache(self, num_blocks: int, cuda_graphs: bool) -> KVCache:
        """Allocates the KV cache, binds it to the model, and on CUDA tunes prefill and captures decode graphs."""
        self.kv_cache = self._cache(num_blocks)
        self.model.bind_kv_cache(self.kv_cache.k_caches, self.kv_cache.v_caches)
        if self.device.type == "cuda":
            self._warm_up_prefill(min(self.max_num_batched_tokens, self.max_model_len))
            if cuda_graphs:
                self._capture_graphs()
        return self.kv_cache

    @torch.inference_mode()
    def _warm_up_prefill(self, max_tokens: int):
        """One throwaway prefill per query-length bucket of the prefill kernel's autotuner (powers of two up to
        the step budget): tuning and compiling a bucket takes seconds, which belongs to start-up, not to the
        first request that reaches that length. The cache is never written."""
        lengths = [1 << i for i in range(max_tokens.bit_length()) if 1 << i < max_tokens] + [max_tokens]
        for n in lengths:
            ids, positions, meta, _ = self._inputs([0] * n, [n], [n], [[0] * -(-n // self.block_size)],
                                                   write_cache=False)
            self.model.compute_logits(self.model(ids, positions, meta)[-1:])
        torch.cuda.synchronize(self.device)
        log.info("warmed up prefill for query lengths %s", lengths)

    # -- CUDA graphs ---------------------------------------------------------------------------------------
    def _capture_graphs(self):
        """Decode graphs, then prefill graphs, largest first in one memory pool so that it fits them all. Each
        forward runs once before its capture: the kernels compile and the allocations settle outside it (the
        prefill kernel's tiles were tuned by _warm_up_prefill for every token bucket)."""
        self._pool = None
        self._capture_decode_graphs()
        self._capture_prefill_graphs()

    def _capture(self, forward, warm_up: bool = True, lora_rows: int = 0
                 ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """A graph of forward(); with lora_rows, of forward() serving the adapters in slots, for steps of that many
        token rows (its LoRA kernels read the first _lora_tiles(lora_rows) tiles of the static tiles buffer)."""
        if lora_rows:
            from service.model.lora import serving_slots
            tiles = self.lora_static[:self._lora_tiles(lora_rows)]
            return self._capture(lambda: _within(serving_slots(self.slots, tiles, None), forward), warm_up)
        with torch.inference_mode():
            if warm_up:
                forward()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = forward()
            self._pool = graph.pool() if self._pool is None else self._pool
            graph.replay()  # the first replay uploads the graph: pay for it here, not in a request
        return graph, out

    def _capture_decode_graphs(self):
        sizes = sorted({min(bs, self.max_num_seqs) for bs in GRAPH_BATCH_SIZES + [self.max_num_seqs]})
        max_bs, dev = sizes[-1], self.device
        # One int32 row per sequence (see _replay), written by one copy a step, and the block tables, kept on the
        # device across steps (a table's row stride a multiple of 16 entries, as in eager steps: Triton specializes
        # on it).
        rows = torch.zeros(max_bs, DECODE_COLUMNS, dtype=torch.int32, device=dev)
        rows[:, 1], rows[:, 3], rows[:, 4] = -1, -1, 1  # captured with one key each, then emptied
        tables = torch.zeros(max_bs, -(-self.max_blocks_per_seq // 16) * 16, dtype=torch.int32, device=dev)
        self.static = {"rows": rows, "pending": torch.zeros(max_bs, dtype=torch.long, device=dev), "tables": tables}
        self._free_table_rows = list(range(max_bs))
        if self.slots is not None:  # empty tiles (-1) until a step writes its own
            max_t = max(max_bs, max(self._prefill_graph_keys(), default=(0, 0))[0])
            self.lora_static = torch.full((self._lora_tiles(max_t), 1 + lora_kernels.BLOCK_M), -1, dtype=torch.int32,
                                          device=dev)
        for bs in reversed(sizes):
            self.graphs[bs], self.graph_logits[bs] = self._capture(self._decode_forward(bs))
            if self.slots is not None:
                self.lora_graphs[bs], self.lora_graph_logits[bs] = self._capture(self._decode_forward(bs),
                                                                                  lora_rows=bs)
        rows[:, 4] = 0
        self.graphs = dict(sorted(self.graphs.items()))
        self.lora_graphs = dict(sorted(self.lora_graphs.items()))
        log.info("captured decode CUDA graphs for batch sizes %s%s", sorted(self.graphs),
                 " (and their LoRA variants)" if self.lora_graphs else "")

    def _prefill_graph_keys(self) -> list[tuple[int, int]]:
        return [(t, b) for t in PREFILL_GRAPH_TOKENS if t <= self.max_prefill_graph_tokens
                for b in sorted({min(b, t, self.max_num_seqs) for b in PREFILL_GRAPH_SEQS})]

    def _capture_prefill_graphs(self):
        keys = self._prefill_graph_keys()
        if not keys:
            return
        max_t, max_b, dev = max(t for t, _ in keys), max(b for _, b in keys), self.device
        self._num_tiles = max(max_tiles(t, b) for t, b in keys)
        # _pack's arrays at the largest bucket's size, each filled by one copy per step. All-empty sequences and
        # unwritten slots: captures run the kernels' launches, not their work.
        tokens = torch.zeros(5, max_t, dtype=torch.long, device=dev)
        tokens[3] = -1
        self.prefill_static = {
            "tokens": tokens, "lens": torch.zeros(6, _section(max(max_b, self._num_tiles)), dtype=torch.int32,
                                                  device=dev),
            "block_table": torch.zeros(max_b, self.max_blocks_per_seq, dtype=torch.int32, device=dev),
        }
        for t, b in sorted(keys, reverse=True):
            # One warm-up per token count: the sequence count changes only the attention kernel's grid.
            warm_up = (t, b) == max(k for k in keys if k[0] == t)
            self.prefill_graphs[(t, b)], self.prefill_hidden[(t, b)] = self._capture(
                self._prefill_forward((t, b)), warm_up=warm_up)
            if self.slots is not None:
                self.lora_prefill_graphs[(t, b)], self.lora_prefill_hidden[(t, b)] = self._capture(
                    self._prefill_forward((t, b)), warm_up=warm_up, lora_rows=t)
        self.prefill_graphs = dict(sorted(self.prefill_graphs.items()))
        self.lora_prefill_graphs = dict(sorted(self.lora_prefill_graphs.items()))
        log.info("captured prefill CUDA graphs for (tokens, sequences) %s", list(self.prefill_graphs))

    def _decode_forward(self, bs: int):
        """The graph reads its inputs from the rows _replay writes, and takes each PENDING token from the previous
        step's sampled tokens (copied into `pending`) itself: a replay is two copies and the graph."""
        rows, pending, tables = self.static["rows"][:bs], self.static["pending"], self.static["tables"]

        def forward():
            ids = _take_pending(rows[:, 0].long(), rows[:, 1], pending)
            block_table = tables.index_select(0, rows[:, 5])
            meta = self._decode_metadata(rows[:, 3].long(), block_table, rows[:, 4].contiguous())
            logits = self.model.compute_logits(self.model(ids, rows[:, 2].long(), meta))
            # Greedy sampling inside the graph costs GPU time only, which a step at a large batch has to spare
            # and the host has not.
            return logits, *greedy(logits)
        return forward

    def _prefill_forward(self, key: tuple[int, int]):
        (t, b), s = key, self.prefill_static
        tokens = s["tokens"]
        # No sequence is longer than the context: the kernel's grid (and its tuned tile) need no more rows.
        meta = self._metadata(tokens[3, :t], s["block_table"][:b], s["lens"], b, min(t, self.max_model_len),
                              self.max_model_len, max_tiles(t, b))
        return lambda: self.model(tokens[0, :t], tokens[2, :t], meta)

    def _decode_rows(self, bs: int, batch: ScheduledBatch, input_ids: list[int], seqlens_k: list[int],
                     tables: list[list[int]]) -> list[np.ndarray]:
        """A decode graph's inputs: a row per token (a sequence's, or one of a verify's: seqlens_k and tables per
        row) of its id, the row of the previous step's sampled tokens to take it from instead (-1: none), its
        position, slot and key count, and its sequence's row of the block tables on the device; and the (row,
        column, block) entries of those tables that changed (see _sync_tables)."""
        block_size, n = self.block_size, len(input_ids)
        table_rows, updates = self._sync_tables(batch.seqs, batch.block_tables)
        owners = [(seq, row) for seq, row, k in zip(batch.seqs, table_rows, batch.num_tokens) for _ in range(k)]
        head = []
        for token, table, keys, (seq, row) in zip(input_ids, tables, seqlens_k, owners):
            at = keys - 1
            head += (token, seq.pending_row if token == PENDING else -1, at,
                     table[at // block_size] * block_size + at % block_size, keys, row)
        rows = np.zeros((bs, DECODE_COLUMNS), dtype=np.int32)
        rows[:n, :6] = np.asarray(head, dtype=np.int32).reshape(n, 6)
        rows[n:, 1] = rows[n:, 3] = -1  # padding rows: no slot, no keys
        return [rows, updates]

    @torch.inference_mode()
    def _replay(self, bs: int, rows: np.ndarray, updates: np.ndarray, pending: torch.Tensor | None,
                tiles: np.ndarray | None = None) -> tuple:
        """Replays the decode graph of batch size bs on its inputs (_decode_rows), written into the graphs' static
        buffers by stream-ordered copies (the step in flight has read them by then); returns its outputs. With
        tiles (its adapters' rows, kernels.lora.lora_tiles): the graph with the LoRA path."""
        s = self.static
        self._update_tables(updates)
        self._copy_in(s["rows"][:bs], rows)
        if pending is not None:
            s["pending"][:len(pending)] = pending
        if tiles is not None:
            self._copy_in(self.lora_static[:len(tiles)], tiles)
            self._replay_graph(self.lora_graphs[bs])
            return self.lora_graph_logits[bs]
        self._replay_graph(self.graphs[bs])
        return self.graph_logits[bs]

    def _replay_graph(self, graph: torch.cuda.CUDAGraph) -> None:
        """Replays a captured graph, after the primer that lets its kernels overlap as captured
        (kernels/pdl_primer.py)."""
        if self.pdl_primer:
            prime(self.device)
        graph.replay()

    def _sync_tables(self, seqs: list, tables: list[list[int]]) -> tuple[list[int], np.ndarray]:
        """Each sequence's row in the decode graphs' block tables on the device, and the (row, column, block)
        entries to write there: what changed since its last decode step: all of a table the rows do not hold (a
        sequence new to decode steps, or whose table was replaced: preempted and readmitted), else its new blocks,
        and its last block again if copy-on-write replaced it or the table lost blocks (those a verify's rejected
        draft tokens reached: entries past a table's end stay, never read). A sequence absent from a decode step
        gives its row back."""
        held, present = self._table_rows, set(seqs)
        for seq in [seq for seq in held if seq not in present]:
            self._free_table_rows.append(held.pop(seq)[1])
        updates, rows = [], []
        for seq, table in zip(seqs, tables):
            entry = held.get(seq)
            if entry is None or entry[0] is not table:
                row = entry[1] if entry is not None else self._free_table_rows.pop()
                start = 0
            else:
                row, synced, last = entry[1], entry[2], entry[3]
                if synced == len(table) and table[-1] == last:
                    rows.append(row)
                    continue
                if synced > len(table):  # blocks given back since (a verify's rejected lookahead, its last new)
                    start = len(table) - 1
                else:
                    start = synced - 1 if table[synced - 1] != last else synced
            for col in range(start, len(table)):
                updates += (row, col, table[col])
            held[seq] = (table, row, len(table), table[-1])
            rows.append(row)
        return rows, np.asarray(updates, dtype=np.int32).reshape(-1, 3)

    def _update_tables(self, updates: np.ndarray) -> None:
        if len(updates):
            u = self._tensor(updates, torch.int32)
            self.static["tables"][u[:, 0], u[:, 1]] = u[:, 2]

    @torch.inference_mode()
    def _replay_prefill(self, key: tuple[int, int], n: int, batch: int, flat: np.ndarray, lens: np.ndarray,
                        table: np.ndarray, pending: torch.Tensor | None,
                        tiles: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies a prefill or mixed step's inputs (_pack's arrays at the graphs' size) into the static buffers of
        the prefill graph of (tokens, sequences) `key` (padding: tokens without a slot, sequences without tokens),
        in three stream-ordered copies, and replays it. Returns its hidden states of all `key[0]` rows (the step's
        are the first n) and, on the device, the rows to sample."""
        s = self.prefill_static
        tokens = s["tokens"]
        self._copy_in(tokens, flat)
        self._copy_in(s["lens"], lens)
        self._copy_in(s["block_table"][:batch, :table.shape[1]], table)
        if pending is not None:
            tokens[0, :n] = _take_pending(tokens[0, :n], tokens[1, :n], pending)
        if tiles is not None:
            self._copy_in(self.lora_static[:len(tiles)], tiles)
            self._replay_graph(self.lora_prefill_graphs[key])
            return self.lora_prefill_hidden[key], tokens[4]
        self._replay_graph(self.prefill_graphs[key])
        return self.prefill_hidden[key], tokens[4]


def start_runner(model, s: Settings, max_model_len: int) -> ModelRunner:
    """The runner of a loaded model (one rank's, under tensor parallelism), its KV cache allocated (as many blocks
    as fit this rank's memory, the fewest of any rank), its kernels tuned and its CUDA graphs captured."""
    runner = ModelRunner(model, s.block_size, max_model_len, s.max_num_seqs, s.max_num_batched_tokens,
                         s.cuda_graph_max_prefill_tokens)
    if s.max_loras:  # before the KV cache is sized from the memory left, and before the graphs are captured
        from service.model.lora import LoRASlots
        runner.slots = LoRASlots(model, s.max_loras, s.max_lora_rank)
    cfg, device, tp = model.config, runner.device, runner.tp
    shape = (cfg.num_hidden_layers, s.block_size, runner.num_kv_heads, cfg.head_dim, runner.dtype)
    tuning_dir = Path(s.compile_cache_dir).expanduser()
    if device.type == "cuda":
        from kernels import tuning
        log.info("autotuning results from earlier starts: %d", tuning.load(tuning_dir))
    if s.num_kv_blocks is not None:
        num_blocks = s.num_kv_blocks
    elif device.type == "cuda":
        num_blocks = num_blocks_for_gpu(s.gpu_memory_utilization, runner.profile_activation_peak(), *shape,
                                        device=device)
    else:
        num_blocks = num_blocks_for_bytes(s.cpu_kv_cache_bytes, *shape)
    if tp.size > 1:  # every rank holds the same block ids
        fewest = torch.tensor([num_blocks], device=device)
        torch.distributed.all_reduce(fewest, torch.distributed.ReduceOp.MIN)
        num_blocks = int(fewest.item())
    kv_cache = runner.allocate_kv_cache(num_blocks, s.cuda_graphs)
    if device.type == "cuda" and tp.rank == 0:
        tuning.save(tuning_dir)
    log.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, s.block_size, kv_cache.nbytes / 2**20)
    return runner


def _within(context, forward):
    with context:
        return forward()


def _section(num_seqs: int) -> int:
    """Entries per row of _pack's int32 array: num_seqs + 1, rounded up to 16 bytes."""
    return -(-(num_seqs + 1) // 4) * 4


def _take_pending(ids: torch.Tensor, sources: torch.Tensor, pending: torch.Tensor | None) -> torch.Tensor:
    """ids, except where sources >= 0: there the previous step's sampled token of that row (still on the device)."""
    if pending is None:
        return ids
    return torch.where(sources >= 0, pending[sources.clamp(min=0, max=len(pending) - 1)], ids)
