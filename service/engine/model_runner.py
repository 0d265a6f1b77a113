"""Turns a scheduled batch into tensors, runs the model (eagerly, or by replaying a CUDA graph for pure-decode
steps) and returns the logits of the rows to sample."""
import logging

import torch

from service.model.attention import AttentionMetadata

log = logging.getLogger(__name__)
GRAPH_BATCH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


def decode_num_splits(batch_size: int, nheads_k: int, sm_count: int) -> int:
    """Split-KV count of a decode step: enough programs to fill the GPU for small batches, none extra for
    large ones. A function of the batch size only, so a step computes the same in a graph and eagerly, and
    the kernel never reads sequence lengths on the host."""
    return max(1, min(16, -(-2 * sm_count // (batch_size * nheads_k))))


class ModelRunner:
    def __init__(self, model, kv_cache, block_manager, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, cuda_graphs: bool):
        self.model = model
        self.kv_cache = kv_cache
        self.block_manager = block_manager
        block_size = block_manager.block_size
        self.device = next(model.parameters()).device
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        model.bind_kv_cache(kv_cache.k_caches, kv_cache.v_caches)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.sm_count = torch.cuda.get_device_properties(self.device).multi_processor_count \
            if self.device.type == "cuda" else 1
        if self.device.type == "cuda":
            self._warm_up_prefill(min(max_num_batched_tokens, max_model_len))
        if cuda_graphs and self.device.type == "cuda":
            self._capture_graphs(max_num_seqs)

    def _tensor(self, data, dtype):
        return torch.tensor(data, dtype=dtype, pin_memory=self.device.type == "cuda").to(self.device, non_blocking=True)

    @torch.inference_mode()
    def run(self, seqs, num_tokens: list[int], copies) -> tuple[torch.Tensor, list[int]]:
        """Computes num_tokens[i] new tokens of seqs[i] (from its num_computed_tokens on). Returns logits of
        the sequences whose chunk reaches their last token, and those sequences' indices in seqs."""
        self.kv_cache.copy_blocks(copies)
        input_ids, positions, slots, seqlens_q, seqlens_k, tables = [], [], [], [], [], []
        sample_rows, sample_index, row = [], [], 0
        for i, (seq, n) in enumerate(zip(seqs, num_tokens)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += self.block_manager.slot_mapping(seq.request_id, start, end)
            seqlens_q.append(n)
            seqlens_k.append(end)
            tables.append(self.block_manager.tables[seq.request_id])
            row += n
            if end == len(seq.token_ids):
                sample_rows.append(row - 1)
                sample_index.append(i)
        decode = all(n == 1 for n in num_tokens)
        batch = len(seqs)
        adapters = any(seq.adapter is not None for seq in seqs)
        graph_bs = next((bs for bs in self.graphs if bs >= batch), None) if decode and not adapters else None
        if graph_bs is not None:
            logits = self._replay(graph_bs, input_ids, positions, slots, seqlens_k, tables)[:batch]
            return logits[sample_rows], sample_index
        width = max(map(len, tables))
        block_table = self._tensor([t + [0] * (width - len(t)) for t in tables], torch.int32)
        cu_q = self._tensor([0] + seqlens_q, torch.int32).cumsum(0, dtype=torch.int32)
        cu_k = self._tensor([0] + seqlens_k, torch.int32).cumsum(0, dtype=torch.int32)
        meta = AttentionMetadata(slot_mapping=self._tensor(slots, torch.int64), block_table=block_table,
                                 seqlens_k=self._tensor(seqlens_k, torch.int32), cu_seqlens_q=cu_q,
                                 cu_seqlens_k=cu_k, max_seqlen_q=max(seqlens_q), max_seqlen_k=max(seqlens_k),
                                 decode=decode,
                                 num_splits=decode_num_splits(batch, self.model.config.num_key_value_heads,
                                                              self.sm_count))
        if adapters:  # LoRA on the rows of the sequences that asked for one (hooks, so never in a graph)
            from service.finetune.lora import serving_adapters
            rows = [seq.adapter for seq, n in zip(seqs, num_tokens) for _ in range(n)]
            with serving_adapters(self.model, rows, self.device):
                hidden = self.model(self._tensor(input_ids, torch.long), self._tensor(positions, torch.long), meta)
        else:
            hidden = self.model(self._tensor(input_ids, torch.long), self._tensor(positions, torch.long), meta)
        return self.model.compute_logits(hidden[self._tensor(sample_rows, torch.long)]), sample_index

    @torch.inference_mode()
    def _warm_up_prefill(self, max_tokens: int):
        """One throwaway prefill per query-length bucket of the prefill kernel's autotuner (powers of two up to
        the step budget): tuning and compiling a bucket takes seconds, which belongs to start-up, not to the
        first request that reaches that length. Slots are -1, so the cache is never written."""
        lengths = [1 << i for i in range(max_tokens.bit_length()) if 1 << i < max_tokens] + [max_tokens]
        block_size = self.block_manager.block_size
        for n in lengths:
            ids = torch.zeros(n, dtype=torch.long, device=self.device)
            cu = torch.tensor([0, n], dtype=torch.int32, device=self.device)
            meta = AttentionMetadata(slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=self.device),
                                     block_table=torch.zeros(1, -(-n // block_size), dtype=torch.int32,
                                                             device=self.device),
                                     seqlens_k=cu[1:], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=n,
                                     max_seqlen_k=n)
            hidden = self.model(ids, torch.arange(n, device=self.device), meta)
            self.model.compute_logits(hidden[-1:])
        torch.cuda.synchronize(self.device)
        log.info("warmed up prefill for query lengths %s", lengths)

    # -- CUDA graphs for decode --------------------------------------------------------------------------
    def _capture_graphs(self, max_num_seqs: int):
        sizes = [bs for bs in GRAPH_BATCH_SIZES if bs < max_num_seqs] + [max_num_seqs]
        sizes = sorted({min(bs, max_num_seqs) for bs in sizes})
        max_bs = sizes[-1]
        dev = self.device
        nheads_k = self.model.config.num_key_value_heads
        self.static = {
            "input_ids": torch.zeros(max_bs, dtype=torch.long, device=dev),
            "positions": torch.zeros(max_bs, dtype=torch.long, device=dev),
            "slot_mapping": torch.full((max_bs,), -1, dtype=torch.int64, device=dev),
            "seqlens_k": torch.zeros(max_bs, dtype=torch.int32, device=dev),
            "block_table": torch.zeros(max_bs, self.max_blocks_per_seq, dtype=torch.int32, device=dev),
        }
        self.graph_logits = {}
        pool = None
        for bs in reversed(sizes):  # largest first so the memory pool fits all
            s = {k: v[:bs] for k, v in self.static.items()}
            splits = decode_num_splits(bs, nheads_k, self.sm_count)
            meta = AttentionMetadata(slot_mapping=s["slot_mapping"], block_table=s["block_table"],
                                     seqlens_k=s["seqlens_k"], decode=True, num_splits=splits)

            def forward():
                hidden = self.model(s["input_ids"], s["positions"], meta)
                return self.model.compute_logits(hidden)

            with torch.inference_mode():
                s["seqlens_k"].fill_(1)
                forward()  # compile kernels and settle allocations outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.graph_logits[bs] = forward()
                pool = graph.pool() if pool is None else pool
                s["seqlens_k"].zero_()
                graph.replay()  # the first replay uploads the graph: pay for it here, not in a request
            self.graphs[bs] = graph
        self.graphs = dict(sorted(self.graphs.items()))
        log.info("captured decode CUDA graphs for batch sizes %s", sorted(self.graphs))

    def _replay(self, bs, input_ids, positions, slots, seqlens_k, tables):
        width = max(map(len, tables))
        rows = [[t, p, slot, n] + table + [0] * (width - len(table))
                for t, p, slot, n, table in zip(input_ids, positions, slots, seqlens_k, tables)]
        rows += [[0, 0, -1, 0] + [0] * width] * (bs - len(rows))  # padding rows: no slot, no keys
        dev = self._tensor(rows, torch.int64)
        s = self.static
        s["input_ids"][:bs] = dev[:, 0]
        s["positions"][:bs] = dev[:, 1]
        s["slot_mapping"][:bs] = dev[:, 2]
        s["seqlens_k"][:bs] = dev[:, 3]
        s["block_table"][:bs, :width] = dev[:, 4:]
        self.graphs[bs].replay()
        return self.graph_logits[bs]
