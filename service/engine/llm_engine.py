"""The synchronous engine: loads the model, owns the KV cache, scheduler, runner and sampler, and advances
every live request by one step at a time. AsyncEngine and LLM drive it."""
import gc
import logging
import math
import threading
import time
from pathlib import Path

import torch

from service.config import Settings
from service.engine.detokenizer import IncrementalDetokenizer
from service.engine.model_runner import ModelRunner
from service.engine.outputs import StepStats, TokenOutput
from service.engine.sampler import Sampler
from service.engine.sampling_params import MAX_TOP_K, SamplingParams
from service.engine.scheduler import ScheduledBatch, Scheduler
from service.engine.sequence import Sequence
from service.model.attention import AttentionMetadata
from service.model.config import ModelConfig
from service.model.loader import eos_token_ids, load_model, load_tokenizer, resolve_dtype, resolve_model_dir

log = logging.getLogger(__name__)


class EngineOverloaded(Exception):
    """The waiting queue is full (HTTP 429)."""


class RequestRejected(ValueError):
    """The request can never be served: prompt too long, cannot fit the cache, bad parameters (HTTP 4xx)."""


class EngineStepError(RuntimeError):
    """A step failed; raised to the streams of the requests in that step (HTTP 500)."""

    def __init__(self, message: str, request_ids: list[str] = ()):
        super().__init__(message)
        self.request_ids = list(request_ids)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class LLMEngine:
    def __init__(self, settings: Settings):
        from kvcache import BlockManager, KVCache

        self.settings = settings
        self.model_dir = resolve_model_dir(settings.model)
        cfg = ModelConfig.from_dir(self.model_dir)
        self.device = resolve_device(settings.device)
        dtype = resolve_dtype(settings.dtype, cfg, self.device)
        local = settings.model is None or self.model_dir == Path(settings.model)
        self.model_name = settings.served_model_name or (self.model_dir.resolve().name if local else settings.model)
        log.info("loading %s (%s, %s) on %s", self.model_dir, cfg.architecture, dtype, self.device)
        self.model = load_model(self.model_dir, dtype, self.device)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.eos_token_ids = eos_token_ids(self.model_dir, self.tokenizer)
        self.special_ids = set(self.tokenizer.all_special_ids)
        self.max_model_len = min(settings.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        num_blocks = self._num_kv_blocks(cfg, dtype)
        self.kv_cache = KVCache(cfg.num_hidden_layers, num_blocks, settings.block_size, cfg.num_key_value_heads,
                                cfg.head_dim, dtype, str(self.device))
        log.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, settings.block_size,
                 self.kv_cache.nbytes / 2**20)
        self.block_manager = BlockManager(num_blocks, settings.block_size, settings.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, settings.max_num_seqs, settings.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.kv_cache, self.block_manager, self.max_model_len,
                                  settings.max_num_seqs, settings.max_num_batched_tokens, settings.cuda_graphs)
        self.sampler = Sampler()
        self.requests: dict[str, Sequence] = {}
        self.lock = threading.Lock()  # add/abort (event loop) vs step (worker thread)
        # Weights' metadata, the tokenizer and compiled kernels live as long as the engine: freezing them keeps
        # the garbage collector from rescanning them in pauses between steps.
        gc.collect()
        gc.freeze()

    # -- setup -------------------------------------------------------------------------------------------
    def _num_kv_blocks(self, cfg: ModelConfig, dtype) -> int:
        from kvcache import num_blocks_for_bytes, num_blocks_for_gpu

        s = self.settings
        shape = (cfg.num_hidden_layers, s.block_size, cfg.num_key_value_heads, cfg.head_dim, dtype)
        if s.num_kv_blocks is not None:
            return s.num_kv_blocks
        if self.device.type != "cuda":
            return num_blocks_for_bytes(s.cpu_kv_cache_bytes, *shape)
        return num_blocks_for_gpu(s.gpu_memory_utilization, self._profile_activations(cfg, dtype), *shape,
                                  device=self.device)

    @torch.inference_mode()
    def _profile_activations(self, cfg: ModelConfig, dtype) -> int:
        """Peak activation memory of a full-budget prefill step, run against a throwaway cache."""
        from kvcache import KVCache

        s = self.settings
        tokens = min(s.max_num_batched_tokens, s.max_num_seqs * self.max_model_len)
        seqs = max(1, min(s.max_num_seqs, tokens))
        lens = [tokens // seqs + (i < tokens % seqs) for i in range(seqs)]
        blocks_per = [-(-n // s.block_size) for n in lens]
        cache = KVCache(cfg.num_hidden_layers, sum(blocks_per), s.block_size, cfg.num_key_value_heads, cfg.head_dim,
                        dtype, str(self.device))
        self.model.bind_kv_cache(cache.k_caches, cache.v_caches)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        dev = self.device
        table = torch.zeros(seqs, max(blocks_per), dtype=torch.int32)
        first = 0
        for i, b in enumerate(blocks_per):
            table[i, :b] = torch.arange(first, first + b)
            first += b
        positions = torch.cat([torch.arange(n) for n in lens]).to(dev)
        slots = torch.cat([table[i, :(-(-n // s.block_size))].repeat_interleave(s.block_size)[:n] * s.block_size
                           + torch.arange(n) % s.block_size for i, n in enumerate(lens)]).to(dev)
        seqlens = torch.tensor(lens, dtype=torch.int32, device=dev)
        cu = torch.nn.functional.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0))
        meta = AttentionMetadata(slot_mapping=slots, block_table=table.to(dev), seqlens_k=seqlens, cu_seqlens_q=cu,
                                 cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))
        hidden = self.model(torch.zeros(tokens, dtype=torch.long, device=dev), positions, meta)
        self.model.compute_logits(hidden[:seqs]).float().softmax(-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del cache, hidden
        torch.cuda.empty_cache()
        log.info("profiled activation peak: %.1f MiB for %d tokens", peak / 2**20, tokens)
        return peak

    # -- requests ----------------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise RequestRejected("the prompt is empty")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise RequestRejected(f"prompt token ids must be in [0, {vocab})")
        if params.max_new_tokens < 1:
            raise RequestRejected("max_new_tokens must be >= 1")
        if not (0 <= params.temperature < math.inf and 0 < params.top_p <= 1 and 0 <= params.top_k <= MAX_TOP_K
                and 0 < params.repetition_penalty < math.inf):
            raise RequestRejected(f"need 0 <= temperature < inf, 0 < top_p <= 1, 0 <= top_k <= {MAX_TOP_K}, "
                                  "0 < repetition_penalty < inf")
        if params.seed is not None and not -2**63 <= params.seed < 2**64:
            raise RequestRejected("seed must be in [-2**63, 2**64)")
        if params.top_logprobs < 0 or params.top_logprobs > 20:
            raise RequestRejected("top_logprobs must be in 0..20")
        total = len(prompt_token_ids) + params.max_new_tokens
        if total > self.max_model_len:
            raise RequestRejected(f"prompt ({len(prompt_token_ids)} tokens) + max_new_tokens "
                                  f"({params.max_new_tokens}) exceeds the context length {self.max_model_len}")
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if total > capacity:
            raise RequestRejected(f"prompt + max_new_tokens ({total}) exceeds the KV cache ({capacity} tokens)")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    adapter: str | None = None) -> None:
        self.validate(prompt_token_ids, params)
        if adapter is not None:
            from service.finetune.lora import has_adapter
            if not has_adapter(self.model, adapter):
                raise RequestRejected(f"unknown adapter {adapter!r}")
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        seq = Sequence(request_id, list(prompt_token_ids), params,
                       IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop,
                                              params.include_stop_str_in_output), generator, adapter)
        with self.lock:
            if request_id in self.requests:
                raise RequestRejected(f"request id {request_id!r} is already in use")
            self.requests[request_id] = seq
            self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        with self.lock:
            seq = self.requests.pop(request_id, None)
            if seq is None:
                return False
            self.scheduler.free(seq)
            return True

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_usage(self) -> float:
        return self.block_manager.usage

    # -- stepping ----------------------------------------------------------------------------------------
    def step(self) -> tuple[list[TokenOutput], StepStats | None]:
        """One scheduling + forward + sampling round. Raises EngineStepError (after freeing the step's
        requests) if the model or sampler fails."""
        # Inference mode for the sampler too: it edits the logits in place, which are inference tensors.
        with self.lock, torch.inference_mode():
            start = time.perf_counter()
            batch = self.scheduler.schedule()
            if not batch.seqs:
                return [], None
            try:
                outputs = self._run(batch)
            except Exception as e:
                ids = [s.request_id for s in batch.seqs]
                for seq in batch.seqs:
                    self.requests.pop(seq.request_id, None)
                    self.scheduler.free(seq)
                log.exception("engine step failed")
                raise EngineStepError(f"engine step failed: {type(e).__name__}: {e}", ids) from e
            stats = StepStats(
                step_seconds=time.perf_counter() - start, batch_size=len(batch.seqs),
                num_prefill_tokens=batch.num_prefill_tokens,
                num_decode_tokens=sum(batch.num_tokens) - batch.num_prefill_tokens,
                num_running=self.num_running, num_waiting=self.num_waiting, kv_usage=self.kv_usage,
                num_preemptions=batch.num_preemptions, prefix_queried_tokens=batch.prefix_queried_tokens,
                prefix_hit_tokens=batch.prefix_hit_tokens)
            return outputs, stats

    def _run(self, batch: ScheduledBatch) -> list[TokenOutput]:
        logits, index = self.runner.run(batch.seqs, batch.num_tokens, batch.copies)
        for seq, n, prefill in zip(batch.seqs, batch.num_tokens, batch.is_prefill):
            seq.num_computed_tokens += n
            if prefill and seq.num_computed_tokens == len(seq.token_ids):
                # The prompt's KV is now written: publish its full blocks to the prefix cache at once.
                self.kv_cache.copy_blocks(self.block_manager.append(seq.request_id, seq.cache_keys))
        if not index:
            return []
        seqs = [batch.seqs[i] for i in index]
        sampled = self.sampler(logits, [s.params for s in seqs], [s.generator for s in seqs],
                               [s.token_ids for s in seqs])
        outputs = []
        for i, seq in enumerate(seqs):
            token = sampled.token_ids[i]
            seq.token_ids.append(token)
            text, hit_stop = seq.detokenizer.add(token) if seq.params.detokenize else ("", False)
            p, n_out = seq.params, len(seq.token_ids) - seq.num_prompt_tokens
            reason = None
            if hit_stop or token in p.stop_token_ids:
                reason = "stop"
            elif token in self.eos_token_ids and not p.ignore_eos:
                reason = "eos_token"
            elif n_out >= p.max_new_tokens or len(seq.token_ids) >= self.max_model_len:
                reason = "length"
            if reason is not None and not hit_stop and seq.params.detokenize:
                text += seq.detokenizer.flush()
            outputs.append(TokenOutput(
                request_id=seq.request_id, token_id=token, text=text,
                logprob=sampled.logprobs[i] if sampled.logprobs is not None and p.logprobs else None,
                special=token in self.special_ids, index=n_out - 1, finished=reason is not None,
                finish_reason=reason, prompt_tokens=seq.num_prompt_tokens,
                cached_prompt_tokens=seq.num_cached_prompt_tokens,
                top_logprobs=sampled.top_logprobs[i] if sampled.top_logprobs is not None else None,
                queue_seconds=seq.queue_seconds if n_out == 1 else None))
            if reason is not None:
                self.requests.pop(seq.request_id, None)
                self.scheduler.free(seq)
        return outputs
