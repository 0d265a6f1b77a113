"""The decoder. Module names follow Hugging Face checkpoints (model.layers.N.self_attn.q_proj, ...) so weights
load by name and LoRA adapters can wrap the nn.Linear projections.

Two forwards share every layer:
- inference: a flat batch of new tokens [num_tokens] with positions and AttentionMetadata (prefill chunks and
  decodes mixed), reading and writing the paged KV cache bound by `bind_kv_cache`;
- training: input_ids [batch, seq] (or packed [tokens] with cu_seqlens), differentiable, no cache.
"""
import torch
from torch import nn

from service.model.attention import (
    AttentionMetadata,
    decode_attention_rope,
    dense_attention,
    paged_attention,
    paged_attention_shrinks,
    rope_in_attention,
    varlen_attention,
)
from service.model.config import ModelConfig
from service.model.layers import MLP, RMSNorm, RotaryEmbedding, fuse_linears, fused_inference, fused_projection
from service.model.lora import add_slot_updates, slot_merge_shrinks, slot_shrinks, slot_update_in_norm
from service.model.parallel import SINGLE, TensorParallel, all_reduce, embed, gather_logits, local_heads, vocab_rows


class Attention(nn.Module):
    """Under tensor parallelism: this rank's query and KV heads (service.model.parallel)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads = local_heads(cfg, tp)
        self.head_dim = cfg.head_dim
        self.scale = self.head_dim ** -0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_cache = self.v_cache = None

    def fuse(self, lora_columns: int = 0) -> None:
        """One [q + k + v, hidden] weight and bias (the modules' become its views), see service.model.layers;
        lora_columns: LoRA slots' columns beside it and beside o's (fuse_linears)."""
        self.qkv_weight, self.qkv_bias = fuse_linears(self.q_proj, self.k_proj, self.v_proj, lora_columns=lora_columns)
        if lora_columns:
            fuse_linears(self.o_proj, lora_columns=lora_columns)

    def _forward_fused(self, x, positions, rotary, meta: AttentionMetadata, shrunk):
        """Inference on CUDA: one projection for q, k and v; rotation and the cache write in one kernel, or in the
        attention kernel of a decode step (service.model.attention.rope_in_attention). Up to
        decode_linear's rows, both projections hand float32 partial sums over ranges of K to the kernel after them
        (more programs stream the weight), except where the q/k norms need whole q and k, or o's output is
        all-reduced first. o's LoRA updates are left to the residual add after it where slot_update_in_norm says so
        (one rank: the add reads the whole attention output): returned as (o's input, A offset, B offset); o's
        shrinks come from the attention's merge where slot_merge_shrinks says so."""
        rows, d = x.shape[0], self.head_dim
        qkv = fused_projection(x, self.qkv_weight, self.qkv_bias, (self.q_proj, self.k_proj, self.v_proj),
                               partials=not hasattr(self, "q_norm"), shrunk=shrunk)
        q, k, v = (t.unflatten(-1, (-1, d)) for t in qkv.split([self.num_heads * d, self.num_kv_heads * d,
                                                                self.num_kv_heads * d], dim=-1))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        update = slot_update_in_norm(self.o_proj, rows) if self.tp.size == 1 else None
        o_shrunk = None  # o's [input | shrinks] from the attention's merge (slot_merge_shrinks)
        if rope_in_attention(q, meta, d):
            out = decode_attention_rope(q, k, v, positions, rotary.cos_sin, self.k_cache, self.v_cache, meta,
                                        self.scale).reshape(rows, -1)
        else:
            q = rotary(positions, q, k, store=(v, self.k_cache, self.v_cache, meta.slot_mapping))[0]
            o_shrinks = slot_merge_shrinks(self.o_proj, rows) if update is None else None
            out, o_shrunk = paged_attention_shrinks(q, self.k_cache, self.v_cache, meta, self.scale, o_shrinks)
        projected = fused_projection(out, self.o_proj.weight, None, (self.o_proj,), partials=self.tp.size == 1,
                                     shrunk=o_shrunk, lora=update is None)
        return all_reduce(projected, self.tp), None if update is None else (out, *update)

    def forward(self, x, positions, rotary, meta: AttentionMetadata | None, cu_seqlens=None, max_seqlen=0,
                shrunk=None):
        """Returns (the output, o's LoRA update still to add: None, or what _forward_fused says). shrunk: the LoRA
        shrinks of q, k and v, computed by the norm before (RMSNorm.add), on the fused path."""
        if meta is not None and fused_inference(self, "qkv_weight", x):
            return self._forward_fused(x, positions, rotary, meta, shrunk)
        shape = x.shape[:-1]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        add_slot_updates(x, (self.q_proj, q), (self.k_proj, k), (self.v_proj, v))
        q = q.view(*shape, self.num_heads, self.head_dim)
        k = k.view(*shape, self.num_kv_heads, self.head_dim)
        v = v.view(*shape, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        if meta is not None:
            out = paged_attention(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        elif cu_seqlens is not None:
            out = varlen_attention(q, k, v, cu_seqlens, max_seqlen, self.scale)
        else:
            out = dense_attention(q, k, v, self.scale)
        out = out.reshape(*shape, -1)
        projected = self.o_proj(out)
        add_slot_updates(out, (self.o_proj, projected))  # before the all-reduce: this rank's share of the sum
        return all_reduce(projected, self.tp), None


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size // tp.size, tp)

    def forward(self, x, residual, positions, rotary, meta, cu_seqlens=None, max_seqlen=0):
        """x: the previous layer's output, added to the residual stream here (None at the first layer); returns
        this layer's output and the stream. The add and the next norm are one kernel with fused projections."""
        attn, mlp = self.self_attn, self.mlp
        fused = fused_inference(attn, "qkv_weight", residual)
        # Serving adapters from slots, each norm also computes the LoRA shrinks of the projections that read it
        rows = residual.shape[0]
        shrinks = slot_shrinks(rows, attn.q_proj, attn.k_proj, attn.v_proj) if fused and meta is not None else None
        h, residual, shrunk = self.input_layernorm.add(x, residual, fused, shrinks)
        out, update = attn(h, positions, rotary, meta, cu_seqlens, max_seqlen, shrunk=shrunk)
        shrinks = slot_shrinks(rows, mlp.gate_proj, mlp.up_proj) if fused else None
        h, residual, shrunk = self.post_attention_layernorm.add(out, residual, fused, shrinks, update)
        return mlp(h, shrunk=shrunk), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp, self.vocab_size = tp, cfg.vocab_size
        weight = torch.empty(vocab_rows(cfg.vocab_size, tp)[1], cfg.hidden_size)
        if not weight.is_meta:  # on the meta device (loading) a random init imports torch._dynamo: 5 s of a start
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(*weight.shape, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)

    def forward(self, input_ids, positions, meta=None, cu_seqlens=None, max_seqlen=0):
        x, residual = None, embed(self.embed_tokens.weight, input_ids, self.vocab_size, self.tp)
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.rotary_emb, meta, cu_seqlens, max_seqlen)
        return self.norm.add(x, residual, fused_inference(self.layers[0].self_attn, "qkv_weight", residual))[0]


class LlamaForCausalLM(nn.Module):
    """tp: this rank's place when the model is sharded (service.model.parallel); its weights are then slices."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.config, self.tp = cfg, tp
        self.lora_columns = 0  # per projection, beside the fused weights (add_lora_columns)
        self.model = LlamaModel(cfg, tp)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab_rows(cfg.vocab_size, tp)[1], bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def fuse_projections(self, on: bool = True) -> None:
        """Inference on CUDA runs fused projections and kernels from now on (service.model.layers); off: the
        module-by-module path again (the fused weights stay the modules' storage), to compare the two."""
        for layer in self.model.layers:
            if on:
                layer.self_attn.fuse(self.lora_columns)
                layer.mlp.fuse(self.lora_columns)
            else:
                layer.self_attn.qkv_weight = layer.self_attn.qkv_bias = layer.mlp.gate_up_weight = None

    def add_lora_columns(self, columns: int) -> None:
        """Room for LoRA slots beside every fused weight: `columns` more per projection (fuse_linears), now if the
        projections are fused, else when they are."""
        self.lora_columns = columns
        if getattr(self.model.layers[0].self_attn, "qkv_weight", None) is not None:
            self.fuse_projections()

    def bind_kv_cache(self, k_caches, v_caches) -> None:
        """Per-layer paged caches [num_blocks, block_size, heads_k, head_dim] the inference forward uses."""
        for layer, k, v in zip(self.model.layers, k_caches, v_caches, strict=True):
            layer.self_attn.k_cache, layer.self_attn.v_cache = k, v

    def forward(self, input_ids, positions, meta: AttentionMetadata):
        """Inference: flat new tokens [num_tokens] -> final hidden states [num_tokens, hidden] (logits are
        computed only for the rows that are sampled, see compute_logits)."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden):
        return gather_logits(self.lm_head(hidden), self.config.vocab_size, self.tp)

    def forward_train(self, input_ids, positions=None, cu_seqlens=None, max_seqlen: int = 0):
        """Training logits. input_ids [batch, seq] (positions default 0..seq-1), or packed [tokens] with
        cu_seqlens int32 [batch + 1] (positions default restart at 0 in every sequence)."""
        if cu_seqlens is None:
            if positions is None:
                positions = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
        elif positions is None:
            starts = torch.repeat_interleave(cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long())
            positions = torch.arange(input_ids.shape[0], device=input_ids.device) - starts
        hidden = self.model(input_ids, positions, None, cu_seqlens, max_seqlen)
        return self.lm_head(hidden)
