"""MiniNorm: a compact LLaMA-style decoder whose normalization type and placement are config switches.

Token embedding -> N blocks (causal GQA attention with RoPE, SwiGLU MLP or a sparse mixture of SwiGLU experts) ->
final norm -> LM head tied to the embedding. It is a transformers PreTrainedModel, so save_pretrained/from_pretrained/
generate work as usual.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

from model.config import MiniNormConfig, NormPlacement, QKNormScope, deepnorm_alpha, deepnorm_beta
from model.norms import DyT, build_norm
from model.rope import inverse_frequencies


@dataclass
class MoeOutput(MoeCausalLMOutputWithPast):
    """transformers' MoE output (loss, aux_loss, logits, router_logits, ...) plus the router z-loss."""

    z_loss: torch.FloatTensor | None = None


class RotaryEmbedding(nn.Module):
    """RoPE with the rotate-half layout (as LLaMA checkpoints use): cos/sin per position, duplicated halves, with
    the config's rope_scaling (linear, dynamic or YaRN, as transformers computes them; model/rope.py)."""

    def __init__(self, head_dim: int, theta: float, rope_scaling: dict[str, Any] | None = None,
                 max_position_embeddings: int = 0) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.rope_scaling, self.max_position_embeddings = rope_scaling, max_position_embeddings

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # The frequencies are recomputed (head_dim/2 numbers) rather than kept in a buffer: a non-persistent
        # buffer is left uninitialised when from_pretrained builds the model on the meta device.
        dynamic = bool(self.rope_scaling) and self.rope_scaling["rope_type"] == "dynamic"
        seq_len = position_ids.max() + 1 if dynamic and position_ids.numel() else None  # read by dynamic only
        inv_freq, attention_factor = inverse_frequencies(self.head_dim, self.theta, self.rope_scaling,
                                                         self.max_position_embeddings, seq_len, position_ids.device)
        freqs = position_ids[..., None].float() * inv_freq  # (B, T, head_dim/2), always fp32
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if attention_factor != 1.0:  # YaRN scales the attention logits by attention_factor^2 through q and k
            cos, sin = cos * attention_factor, sin * attention_factor
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, heads, T, head_dim); cos/sin: (B, T, head_dim)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


def attention_mask_4d(padding_mask: torch.Tensor | None, q_len: int, kv_len: int,
                      device: torch.device) -> torch.Tensor | None:
    """Boolean (B|1, 1, q_len, kv_len) mask, True where a query may attend; None when plain causal suffices.

    The queries are the last q_len of kv_len positions. A query that would see no key at all (a left-padding
    position) is allowed to see itself, so softmax never runs over an empty row and yields NaN.
    """
    if padding_mask is None and (q_len == kv_len or q_len == 1):
        return None
    query_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    key_pos = torch.arange(kv_len, device=device)[None, :]
    allowed = (key_pos <= query_pos)[None, None]
    if padding_mask is not None:
        allowed = allowed & padding_mask[:, None, None, -kv_len:].bool()
        allowed = allowed | (key_pos == query_pos)
    return allowed


class Attention(nn.Module):
    # Called with (queries, keys, mask) after RoPE when set on an instance: how diagnostics see the attention logits,
    # which scaled_dot_product_attention never materialises.
    logit_observer: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], None] | None = None

    def __init__(self, config: MiniNormConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.o_proj.scaled_by_depth = True
        for proj in (self.v_proj, self.o_proj):
            proj.deepnorm_gain = True
        # QK-norm: the configured norm over each head's query and key vectors (scope "head": Gemma-3, Qwen-3), or
        # one norm over all query heads together and one over all key heads (scope "full": OLMo-2).
        self.qk_norm_full = config.qk_norm_scope == QKNormScope.FULL
        q_width = self.num_heads * self.head_dim if self.qk_norm_full else self.head_dim
        k_width = self.num_kv_heads * self.head_dim if self.qk_norm_full else self.head_dim
        self.q_norm = build_norm(config, q_width) if config.qk_norm else None
        self.k_norm = build_norm(config, k_width) if config.qk_norm else None
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)
        # Smeared keys: one logit per KV head, the weight sigmoid(key_smear) of a key's own position against the
        # previous one's (initialised to 0: half and half).
        self.key_smear = nn.Parameter(torch.zeros(self.num_kv_heads)) if config.smeared_keys else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                cache: Cache | None) -> torch.Tensor:
        batch, q_len, _ = x.shape
        q, k = self.q_proj(x), self.k_proj(x)
        if self.q_norm is not None and self.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(batch, q_len, self.num_heads, self.head_dim)
        k = k.view(batch, q_len, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, q_len, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        raw_k = k
        if self.key_smear is not None:
            k = self._smear(k, mask, cache)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if cache is not None and self.key_smear is not None:
            # The cache keeps each position's own key beside the key attention reads, so the next call can smear
            # with it; beam reordering and cropping then stay exact, as they act on the whole tensor.
            both, v = cache.update(torch.cat([k, raw_k], dim=-1), v, self.layer_idx)
            k = both[..., :self.head_dim]
        elif cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        if self.logit_observer is not None:  # set only on a diagnostics step (trainer/diagnostics.py)
            self.logit_observer(q, k, mask)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
            is_causal=mask is None and q_len == k.shape[2] and q_len > 1,
            enable_gqa=self.num_kv_heads != self.num_heads)
        out = out.transpose(1, 2).reshape(batch, q_len, self.num_heads * self.head_dim)
        return self.resid_dropout(self.o_proj(out))


    def _smear(self, k: torch.Tensor, mask: torch.Tensor | None, cache: Cache | None) -> torch.Tensor:
        """k'_t = s k_t + (1 - s) k_{t-1} per KV head, s = sigmoid(key_smear); k: (B, kv heads, T, head_dim), the
        keys before RoPE. The previous key of the first position is the cache's last own key, or zero at the start of
        a sequence and where the previous position is padding."""
        batch, _, q_len, _ = k.shape
        past = cache.get_seq_length(self.layer_idx) if cache is not None else 0
        if past:
            first = cache.layers[self.layer_idx].keys[:, :, -1:, self.head_dim:].to(k.dtype)
        else:
            first = k.new_zeros(batch, self.num_kv_heads, 1, self.head_dim)
        previous = torch.cat([first, k[:, :, :-1]], dim=2)
        if mask is not None:  # (B|1, 1, q_len, past + q_len), True where a query may attend
            before = torch.arange(past - 1, past + q_len - 1, device=k.device)
            readable = mask[:, 0, torch.arange(q_len, device=k.device), before.clamp(min=0)] & (before >= 0)
            previous = previous * readable[:, None, :, None].to(k.dtype)
        own = torch.sigmoid(self.key_smear.float()).to(k.dtype)[None, :, None, None]
        return own * k + (1 - own) * previous


class SwiGLU(nn.Module):
    def __init__(self, config: MiniNormConfig, width: int | None = None) -> None:
        super().__init__()
        width = config.intermediate_size if width is None else width
        self.gate_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, config.hidden_size, bias=False)
        self.down_proj.scaled_by_depth = True
        for proj in (self.gate_proj, self.up_proj, self.down_proj):
            proj.deepnorm_gain = True
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class SparseMoE(nn.Module):
    """A sparse mixture of SwiGLU experts in place of the MLP (Switch / Qwen3-MoE routing):

        p = softmax(W_r x)  (fp32),   S = top-k of p,   y = sum_{i in S} w_i E_i(x)

    with w_i = p_i, or p_i / sum_{j in S} p_j under norm_topk_prob. forward returns (y, router logits); the
    model turns the logits of every block into the load-balancing and z losses (moe_losses)."""

    def __init__(self, config: MiniNormConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(config, config.moe_intermediate_size) for _ in range(config.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.reshape(-1, x.shape[-1])
        logits = self.gate(flat)  # (tokens, experts)
        weights, chosen = torch.topk(F.softmax(logits, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(flat)
        # One pass per expert over the tokens routed to it (gathered with index_select, scattered back with
        # index_add): the work is the routed tokens' only, and there is no Python loop over tokens. An expert no
        # token chose still runs, on zero rows, so that its gradient is zero rather than missing: DDP expects every
        # parameter to receive one in every step.
        for expert_index, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == expert_index)
            out.index_add_(0, token, (expert(flat.index_select(0, token)) * weights[token, slot, None]).to(out.dtype))
        return out.view_as(x), logits


def moe_losses(router_logits: list[torch.Tensor], top_k: int,
               token_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(load-balancing loss, router z-loss) over all MoE blocks' router logits (each (tokens, experts)), the
    tokens where token_mask (flat, same order) is 0 left out.

    Load balancing (Switch Transformer eq. 4-6, as transformers' Qwen3-MoE computes it): with f_i the fraction of
    (token, block) pairs whose top-k includes expert i (summing to k) and P_i the mean router probability of
    expert i, both over all blocks' tokens, aux = E * sum_i f_i P_i (k at uniform routing). z-loss (ST-MoE): the
    mean over tokens and blocks of logsumexp(router logits)^2."""
    num_experts = router_logits[0].shape[-1]
    logits = torch.cat(router_logits)  # (blocks * tokens, experts), in fp32 at least
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    weight = None if token_mask is None else token_mask.reshape(-1).to(logits.dtype).repeat(len(router_logits))
    probs = F.softmax(logits, dim=-1)
    counts = F.one_hot(torch.topk(probs, top_k, dim=-1).indices, num_experts).sum(dim=1).to(logits.dtype)
    z = torch.logsumexp(logits, dim=-1) ** 2
    if weight is None:
        return num_experts * (counts.mean(0) * probs.mean(0)).sum(), z.mean()
    total = weight.sum().clamp(min=1)
    fraction, mean_prob = (counts * weight[:, None]).sum(0) / total, (probs * weight[:, None]).sum(0) / total
    return num_experts * (fraction * mean_prob).sum(), (z * weight).sum() / total


class Block(GradientCheckpointingLayer):
    """One decoder block. For a sublayer f (attention, then the MLP), the placements are:

        pre:       x = x + f(N(x))          x ─┬───────────────(+)─>   final norm before the LM head
                                               └─ N ─ f ────────┘
        post:      x = N(x + f(x))          x ─┬──────────(+)─ N ─>   no final norm (Vaswani et al.)
                                               └─ f ───────┘
        sandwich:  x = x + N2(f(N1(x)))     x ─┬─────────────────────(+)─>   + final norm (Gemma-2, Peri-LN)
                                               └─ N1 ─ f ─ N2 ─────────┘
        res_post:  x = x + N(f(x))          x ─┬──────────────(+)─>   + final norm (OLMo-2, Swin-v2)
                                               └─ f ─ N ────────┘
        deepnorm:  x = N(alpha * x + f(x))  post-LN with the residual weighted by alpha = (2L)^(1/4); no final
                                            norm (DeepNet; the init gain beta is in _init_weights)
        mix:       the first floor(mix_ln_ratio * L) blocks post, the rest pre (Mix-LN); each Block gets its own
                   placement (MiniNormConfig.block_placements), so a Block is never "mix" itself

    norm_depth_scaling multiplies the output of each of the block's norms (not the QK-norms) by 1/sqrt(l), l the
    1-based block index (LayerNorm Scaling, Sun et al. 2025).

    With `model.activation_checkpointing_enable()` (the trainer's --gradient_checkpointing) a block keeps only its
    input for the backward and recomputes the rest, its dropout masks included (torch.utils.checkpoint restores
    the RNG state), so the gradients are the plain run's.
    """

    def __init__(self, config: MiniNormConfig, layer_idx: int) -> None:
        super().__init__()
        self.placement = config.block_placements()[layer_idx]
        self.self_attn = Attention(config, layer_idx)
        self.mlp = SparseMoE(config) if config.is_moe else SwiGLU(config)
        has_in = self.placement in (NormPlacement.PRE, NormPlacement.SANDWICH)
        has_out = self.placement != NormPlacement.PRE
        dim = config.hidden_size
        self.attn_norm = build_norm(config, dim) if has_in else None
        self.mlp_norm = build_norm(config, dim) if has_in else None
        self.attn_out_norm = build_norm(config, dim) if has_out else None
        self.mlp_out_norm = build_norm(config, dim) if has_out else None
        # None where nothing is multiplied (block 1 scales by 1 too), so those blocks run exactly as without it.
        self.norm_scale = 1 / math.sqrt(layer_idx + 1) if config.norm_depth_scaling and layer_idx > 0 else None
        self.residual_alpha = deepnorm_alpha(config.num_hidden_layers)

    def _norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        y = norm(x)
        return y if self.norm_scale is None else y * self.norm_scale

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                cache: Cache | None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The block's output; with a mixture-of-experts MLP, (output, router logits)."""
        if not isinstance(self.mlp, SparseMoE):
            return self._sublayers(x, rope, mask, cache, self.mlp)
        router_logits = []

        def mlp(h: torch.Tensor) -> torch.Tensor:
            out, logits = self.mlp(h)
            router_logits.append(logits)
            return out

        x = self._sublayers(x, rope, mask, cache, mlp)
        return x, router_logits[0]

    def _sublayers(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                   cache: Cache | None, mlp: Any) -> torch.Tensor:
        n = self._norm
        if self.placement == NormPlacement.PRE:
            # The residual add after attention and the MLP's input norm run as one fused step.
            mlp_in, x = self.mlp_norm.add_and_norm(self.self_attn(n(self.attn_norm, x), rope, mask, cache), x)
            if self.norm_scale is not None:
                mlp_in = mlp_in * self.norm_scale
            return x + mlp(mlp_in)
        if self.placement == NormPlacement.POST:
            x = n(self.attn_out_norm, x + self.self_attn(x, rope, mask, cache))
            return n(self.mlp_out_norm, x + mlp(x))
        if self.placement == NormPlacement.DEEPNORM:
            alpha = self.residual_alpha
            x = n(self.attn_out_norm, alpha * x + self.self_attn(x, rope, mask, cache))
            return n(self.mlp_out_norm, alpha * x + mlp(x))
        if self.placement == NormPlacement.SANDWICH:
            x = x + n(self.attn_out_norm, self.self_attn(n(self.attn_norm, x), rope, mask, cache))
            return x + n(self.mlp_out_norm, mlp(n(self.mlp_norm, x)))
        x = x + n(self.attn_out_norm, self.self_attn(x, rope, mask, cache))
        return x + n(self.mlp_out_norm, mlp(x))


class MiniNormPreTrainedModel(PreTrainedModel):
    config_class = MiniNormConfig
    config: MiniNormConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Block"]
    _skip_keys_device_placement = ["past_key_values"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        config = self.config
        std = config.initializer_range
        if isinstance(module, Attention) and module.key_smear is not None:
            init.zeros_(module.key_smear)
        if isinstance(module, nn.Linear):
            if config.norm_placement == NormPlacement.DEEPNORM:
                # DeepNet: the value, output and MLP projections' init std is multiplied by beta (query and key
                # keep 1); beta takes the place of the depth scaling below.
                if getattr(module, "deepnorm_gain", False):
                    std = std * deepnorm_beta(config.num_hidden_layers)
            elif config.init_depth_scaling and getattr(module, "scaled_by_depth", False):
                # Residual output projections shrink with depth so the residual stream's variance stays O(1).
                std = std / math.sqrt(2 * config.num_hidden_layers)
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, DyT):
            init.constant_(module.alpha, module.alpha_init)
            if module.weight is not None:
                init.ones_(module.weight)
                init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            if module.weight is not None:
                init.ones_(module.weight)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif hasattr(module, "weight") and isinstance(module.weight, nn.Parameter) and module.weight.ndim == 1:
            init.ones_(module.weight)  # RMSNorm gain


class MiniNormModel(MiniNormPreTrainedModel):
    """The decoder trunk: embeddings, blocks and the final norm (absent when the last block is post-LN or DeepNorm)."""

    def __init__(self, config: MiniNormConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.norm = build_norm(config, config.hidden_size) if config.has_final_norm else nn.Identity()
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling,
                                      config.max_position_embeddings)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: Cache | None = None,
                use_cache: bool = False) -> tuple[torch.Tensor, Cache | None, list[torch.Tensor]]:
        """(final hidden states, the cache, each MoE block's router logits (tokens, experts); empty when dense)."""
        batch, q_len = input_ids.shape
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
        kv_len = past_len + q_len
        # No padding: take SDPA's causal fast path. Asking needs the mask's values, which a compiled graph cannot
        # branch on (a graph break); compiled, the mask is applied as it is, with the same result.
        if attention_mask is not None and not torch.compiler.is_compiling() and bool(attention_mask.all()):
            attention_mask = None
        if position_ids is None:
            if attention_mask is not None:
                # Left padding shifts the positions: count only real tokens.
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -q_len:]
            else:
                position_ids = torch.arange(past_len, kv_len, device=input_ids.device).expand(batch, -1)
        x = self.dropout(self.embed_tokens(input_ids))
        rope = self.rotary(position_ids, x.dtype)
        mask = attention_mask_4d(attention_mask, q_len, kv_len, x.device)
        router_logits = []
        for block in self.layers:
            x = block(x, rope, mask, past_key_values)
            if isinstance(x, tuple):
                x, logits = x
                router_logits.append(logits)
        return self.norm(x), past_key_values, router_logits


class MiniNormForCausalLM(MiniNormPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: MiniNormConfig) -> None:
        super().__init__(config)
        self.model = MiniNormModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: Cache | None = None,
                labels: torch.Tensor | None = None, use_cache: bool | None = None,
                logits_to_keep: int = 0, num_items_in_batch: int | torch.Tensor | None = None,
                **kwargs: Any) -> CausalLMOutputWithPast | MoeOutput:
        """`labels` are the input ids themselves (shifted here), -100 where no loss is taken.
        `num_items_in_batch`: when given, the loss is the token sum divided by it (exact gradient accumulation
        over micro-batches with different numbers of supervised tokens); otherwise the token mean.

        A mixture-of-experts model returns a MoeOutput: `aux_loss` (the load-balancing loss),
        `z_loss` and `router_logits` besides, and `loss` = the cross-entropy + router_aux_loss_coef * aux_loss +
        router_z_loss_coef * z_loss. Given `num_items_in_batch`, the router terms are weighted by this
        micro-batch's share of the supervised tokens, so that summed over micro-batches (and processes) they are
        the token-weighted mean, as the cross-entropy is."""
        hidden, cache, router_logits = self.model(input_ids, attention_mask, position_ids, past_key_values,
                                                  use_cache=bool(use_cache))
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = causal_lm_loss(logits, labels, num_items_in_batch)
        if not router_logits:
            return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache)
        token_mask = None if attention_mask is None else attention_mask[:, -input_ids.shape[1]:]
        aux_loss, z_loss = moe_losses(router_logits, self.config.num_experts_per_tok, token_mask)
        if loss is not None:
            router_loss = self.config.router_aux_loss_coef * aux_loss + self.config.router_z_loss_coef * z_loss
            if num_items_in_batch is not None:
                router_loss = router_loss * (shift_labels(labels) != -100).sum() / num_items_in_batch
            loss = loss + router_loss
        return MoeOutput(loss=loss, aux_loss=aux_loss, z_loss=z_loss, logits=logits,
                         past_key_values=cache, router_logits=tuple(router_logits))


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """The target of every position: labels[:, t + 1], and -100 (no loss) at the last position."""
    return F.pad(labels[:, 1:], (0, 1), value=-100)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor,
                   num_items_in_batch: int | torch.Tensor | None = None) -> torch.Tensor:
    """Next-token cross-entropy in fp32: position t predicts labels[t + 1]; -100 is ignored. The token mean, or,
    given `num_items_in_batch`, the token sum divided by it (num_items_in_batch=1: the sum, as validation uses)."""
    # Shift the labels, not the logits: logits[:, :-1] would copy B*T*V floats, and its backward would zero-fill a
    # tensor as big (~3% of a cpu-default training step). The last position gets label -100 instead.
    shifted = shift_labels(labels).reshape(-1)
    flat = logits.reshape(-1, logits.shape[-1]).float()
    if num_items_in_batch is None:
        return F.cross_entropy(flat, shifted, ignore_index=-100)
    return F.cross_entropy(flat, shifted, ignore_index=-100, reduction="sum") / num_items_in_batch


AutoModelForCausalLM.register(MiniNormConfig, MiniNormForCausalLM)
