"""The runner owns the forward pass's inputs and the KV-cache tensors: it turns a scheduled batch into tensors
(one builder for steps, warm-up, memory profiling and graph capture), then replays a captured CUDA graph or runs
the model eagerly, and returns the logits of the rows to sample. Engine-core process.

A small model's step is bound by the host launching ~1,000 kernels, not by the GPU (a 128-token prefill: 30 ms
eager, 3 ms of GPU time), so both kinds of step replay graphs: pure-decode steps one per batch size, and prefill
or mixed steps one per (token count, sequence count) bucket, whose padding tokens write no cache slot and whose
padding sequences are empty (the varlen kernel's programs for them return at once). Steps that serve LoRA adapters
run eagerly: the adapters are forward hooks (service/model/lora.py).

A decode input may be a token the previous step sampled that the host has not seen yet (PENDING): the runner
takes it from that step's sampled tokens on the device, so no step waits for the host to learn the previous one.
"""
import logging

import numpy as np
import torch

from kernels.decode import choose_num_splits
from kernels.prefill import max_tiles, multi_row_tiles
from kvcache import KVCache
from service.engine.sampler import greedy
from service.engine.scheduler import ScheduledBatch
from service.engine.sequence import PENDING
from service.model.attention import AttentionMetadata

log = logging.getLogger(__name__)
GRAPH_BATCH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
# Steps of 1.5x the powers of two too: a full decode batch plus one prompt (256 + 128 tokens, the common mixed step
# under steady load) padded to 512 rows would compute a third of its GEMM rows for nothing.
PREFILL_GRAPH_TOKENS = [16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192]
PREFILL_GRAPH_SEQS = [1, 4, 16, 64, 256, 1024]  # coarse: a padding sequence costs only programs that return
NUMPY_DTYPES = {torch.int32: np.int32, torch.int64: np.int64}
DECODE_COLUMNS = 8  # of a decode step's per-sequence int32 row (6 used, 32 bytes), see _replay


class ModelRunner:
    def __init__(self, model, block_size: int, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_prefill_graph_tokens: int = 0):
        self.model = model
        self.cfg = model.config
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
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
            meta.num_splits = choose_num_splits(bucket, self.cfg.num_key_value_heads, self.device)
            meta.single_row_seqlens_k, meta.q_tiles = lens[3, :batch], lens[4:, :num_tiles]
        return meta

    def _inputs(self, input_ids: list[int], seqlens_q: list[int], seqlens_k: list[int], tables: list[list[int]],
                write_cache: bool = True, sources: np.ndarray | None = None, pending: torch.Tensor | None = None,
                sample_rows: list[int] = ()) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Token ids (PENDING ones taken from `pending` by `sources`, see _pack), positions, attention metadata and
        the rows to sample of an eager step; write_cache=False leaves the cache untouched (slots -1)."""
        n, batch = len(input_ids), len(seqlens_q)
        flat, packed, table = self._pack(input_ids, seqlens_q, seqlens_k, tables, -(-n // 16) * 16, batch, sources,
                                         sample_rows, write_cache)
        flat, lens, block_table = (self._tensor(flat, torch.long), self._tensor(packed, torch.int32),
                                   self._tensor(table, torch.int32))
        ids, positions, slots = _take_pending(flat[0, :n], flat[1, :n], pending), flat[2, :n], flat[3, :n]
        if all(q == 1 for q in seqlens_q):
            meta = self._decode_metadata(slots, block_table, lens[2, :batch])
        else:
            tiles = int((packed[4] >= 0).sum()) if 1 in seqlens_q else None
            meta = self._metadata(slots, block_table, lens, batch, max(seqlens_q), max(seqlens_k), tiles)
        return ids, positions, meta, flat[4, :len(sample_rows)]

    def _decode_metadata(self, slots, block_table, seqlens_k) -> AttentionMetadata:
        # Split as the graph that would hold this batch does: an eager step (LoRA adapters, a batch past the
        # largest graph) computes what that graph would, and reuses the kernel variants its capture compiled.
        batch = block_table.shape[0]
        bucket = next((b for b in GRAPH_BATCH_SIZES if b >= batch), batch)
        splits = choose_num_splits(bucket, self.cfg.num_key_value_heads, self.device)
        return AttentionMetadata(slot_mapping=slots, block_table=block_table, seqlens_k=seqlens_k, decode=True,
                                 num_splits=splits)

    # -- steps -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, pending: torch.Tensor | None
            ) -> tuple[torch.Tensor, list[int], tuple[torch.Tensor, torch.Tensor] | None]:
        """Computes batch.num_tokens[i] new tokens of batch.seqs[i] from batch.starts[i] on; pending: the
        previous step's sampled tokens on the device (for PENDING inputs). Returns logits of the sequences whose
        chunk reaches their last token, those sequences' indices in the batch, and, from a decode graph, each
        row's argmax and its logprob (else None)."""
        self.kv_cache.copy_blocks(batch.copies)
        input_ids, seqlens_q, seqlens_k, fill_rows, from_rows, sample_rows, sample_index = [], [], [], [], [], [], []
        for i, (seq, start, n) in enumerate(zip(batch.seqs, batch.starts, batch.num_tokens)):
            end = start + n
            input_ids += seq.token_ids[start:end]
            if input_ids[-1] == PENDING:  # only a sequence's last token can be
                fill_rows.append(len(input_ids) - 1)
                from_rows.append(seq.pending_row)
            seqlens_q.append(n)
            seqlens_k.append(end)
            if end == len(seq.token_ids):
                sample_rows.append(len(input_ids) - 1)
                sample_index.append(i)
        # A decode graph samples every row: a one-token prompt chunk that is not the prompt's last (room for one
        # more token beside the decodes) makes the step a mixed one.
        decode = len(input_ids) == len(batch.seqs) == len(sample_rows)
        adapters = any(seq.adapter for seq in batch.seqs)
        if decode:
            key = next((bs for bs in self.graphs if bs >= len(batch.seqs)), None)
            graphs = (self.graphs, self.graph_logits)
        else:
            key = next((k for k in self.prefill_graphs if k[0] >= len(input_ids) and k[1] >= len(batch.seqs)), None)
            graphs = (self.prefill_graphs, self.prefill_hidden)
        graph = None if key is None or adapters else (graphs[0][key], graphs[1][key])
        if graph is not None and decode:
            # A decode step samples every row. (Indexing with a host list would copy it to the device with a
            # blocking copy, which waits for the step in flight: no overlap.)
            logits, tokens, logprobs = self._replay(*graph, key, batch, input_ids, pending)
            n = len(sample_rows)
            return logits[:n], sample_index, (tokens[:n], logprobs[:n])
        sources = None
        if fill_rows:
            sources = np.full(len(input_ids), -1, dtype=np.int64)
            sources[fill_rows] = from_rows
        if graph is not None:
            hidden, rows = self._replay_prefill(*graph, key, input_ids, seqlens_q, seqlens_k, batch.block_tables,
                                                sources, pending, sample_rows)
            return self.model.compute_logits(hidden[rows]), sample_index, None
        ids, positions, meta, rows = self._inputs(input_ids, seqlens_q, seqlens_k, batch.block_tables,
                                                  sources=sources, pending=pending if fill_rows else None,
                                                  sample_rows=sample_rows)
        if adapters:  # LoRA on the rows of the sequences that asked for one, through hooks
            from service.model.lora import serving_adapters
            per_token = [seq.adapter for seq, n in zip(batch.seqs, batch.num_tokens) for _ in range(n)]
            with serving_adapters(self.model, per_token, self.device):
                hidden = self.model(ids, positions, meta)
        else:
            hidden = self.model(ids, positions, meta)
        return self.model.compute_logits(hidden[rows]), sample_index, None

    # -- start-up ----------------------------------------------------------------------------------------
    def _cache(self, num_blocks: int) -> KVCache:
        cfg = self.cfg
        return KVCache(cfg.num_hidden_layers, num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim,
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

    def _capture(self, forward, warm_up: bool = True) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
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
        for bs in reversed(sizes):
            self.graphs[bs], self.graph_logits[bs] = self._capture(self._decode_forward(bs))
        rows[:, 4] = 0
        self.graphs = dict(sorted(self.graphs.items()))
        log.info("captured decode CUDA graphs for batch sizes %s", sorted(self.graphs))

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
            self.prefill_graphs[(t, b)], self.prefill_hidden[(t, b)] = self._capture(
                self._prefill_forward((t, b)), warm_up=(t, b) == max(k for k in keys if k[0] == t))
        self.prefill_graphs = dict(sorted(self.prefill_graphs.items()))
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

    @torch.inference_mode()
    def _replay(self, graph: torch.cuda.CUDAGraph, outputs: tuple, bs: int, batch: ScheduledBatch,
                input_ids: list[int], pending: torch.Tensor | None) -> tuple:
        """Writes a decode step's inputs into the graphs' static buffers (stream-ordered copies: the step in
        flight has read them by then) and replays `graph`, a decode graph of batch size bs; returns its outputs.
        The inputs go over in one copy: a row per sequence of its token, the row of the previous step's sampled
        tokens to take it from instead (-1: none), its position, slot and key count, and its row of the block
        tables on the device; those rows change only where a table grew or was replaced (see _sync_tables)."""
        block_size, tables, n = self.block_size, batch.block_tables, len(batch.seqs)
        table_rows = self._sync_tables(batch.seqs, tables)
        head = []
        for token, table, start, seq, row in zip(input_ids, tables, batch.starts, batch.seqs, table_rows):
            head += (token, seq.pending_row if token == PENDING else -1, start,
                     table[start // block_size] * block_size + start % block_size, start + 1, row)
        rows = np.zeros((bs, DECODE_COLUMNS), dtype=np.int32)
        rows[:n, :6] = np.asarray(head, dtype=np.int32).reshape(n, 6)
        rows[n:, 1] = rows[n:, 3] = -1  # padding rows: no slot, no keys
        s = self.static
        self._copy_in(s["rows"][:bs], rows)
        if pending is not None:
            s["pending"][:len(pending)] = pending
        graph.replay()
        return outputs

    def _sync_tables(self, seqs: list, tables: list[list[int]]) -> list[int]:
        """Each sequence's row in the decode graphs' block tables on the device, after writing there what changed
        since its last decode step: all of a table the rows do not hold (a sequence new to decode steps, or whose
        table was replaced: preempted and readmitted), else its new blocks, and its last block again if
        copy-on-write replaced it. A sequence absent from a decode step gives its row back."""
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
                start = synced - 1 if table[synced - 1] != last else synced
            for col in range(start, len(table)):
                updates += (row, col, table[col])
            held[seq] = (table, row, len(table), table[-1])
            rows.append(row)
        if updates:
            u = self._tensor(updates, torch.int32).view(-1, 3)
            self.static["tables"][u[:, 0], u[:, 1]] = u[:, 2]
        return rows

    @torch.inference_mode()
    def _replay_prefill(self, graph: torch.cuda.CUDAGraph, hidden: torch.Tensor, key: tuple[int, int],
                        input_ids: list[int], seqlens_q: list[int], seqlens_k: list[int], tables: list[list[int]],
                        sources: np.ndarray | None, pending: torch.Tensor | None,
                        sample_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies a prefill or mixed step's inputs into the static buffers of `graph`, a prefill graph of (tokens,
        sequences) `key` (padding: tokens without a slot, sequences without tokens), in three stream-ordered
        copies, and replays it. Returns its hidden states of all `key[0]` rows (the step's are the first
        len(input_ids)) and, on the device, the rows to sample."""
        s, n, batch = self.prefill_static, len(input_ids), len(seqlens_q)
        tokens, max_b = s["tokens"], s["block_table"].shape[0]
        flat, lens, table = self._pack(input_ids, seqlens_q, seqlens_k, tables, tokens.shape[1], max_b, sources,
                                       sample_rows, num_tiles=self._num_tiles)
        self._copy_in(tokens, flat)
        self._copy_in(s["lens"], lens)
        self._copy_in(s["block_table"][:batch, :table.shape[1]], table)
        if sources is not None:
            tokens[0, :n] = _take_pending(tokens[0, :n], tokens[1, :n], pending)
        graph.replay()
        return hidden, tokens[4, :len(sample_rows)]


def _section(num_seqs: int) -> int:
    """Entries per row of _pack's int32 array: num_seqs + 1, rounded up to 16 bytes."""
    return -(-(num_seqs + 1) // 4) * 4


def _take_pending(ids: torch.Tensor, sources: torch.Tensor, pending: torch.Tensor | None) -> torch.Tensor:
    """ids, except where sources >= 0: there the previous step's sampled token of that row (still on the device)."""
    if pending is None:
        return ids
    return torch.where(sources >= 0, pending[sources.clamp(min=0, max=len(pending) - 1)], ids)
