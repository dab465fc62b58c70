"""Model FLOPs per token and MFU (model FLOPs utilisation)."""

from __future__ import annotations

import torch

from model.config import MiniNormConfig

# Dense peak FLOP/s. The CPU numbers were measured on our 2-core development machine (bf16 uses AMX);
# pass --peak_flops for other hardware.
PEAK_FLOPS = {
    ("cpu", "bfloat16"): 520e9, ("cpu", "float16"): 520e9, ("cpu", "float32"): 160e9,
    ("H100", "bfloat16"): 989e12, ("H100", "float16"): 989e12, ("H100", "float32"): 67e12,
    ("H200", "bfloat16"): 989e12, ("H200", "float16"): 989e12, ("H200", "float32"): 67e12,
    ("A100", "bfloat16"): 312e12, ("A100", "float16"): 312e12, ("A100", "float32"): 19.5e12,
}


def flops_per_token(config: MiniNormConfig, num_params: int, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): 6 per parameter of the blocks and the final norm, plus the LM
    head matmul (6 * hidden * vocab, once, whether or not its weight is tied to the embedding), plus the attention
    score/value products (6 * layers * seq_len * heads * head_dim, the causal half of 12: the query heads' width,
    which is hidden unless head_dim is set apart from it). The embedding lookup is free.
    `num_params` counts a tied weight once, an untied head separately. A mixture of experts counts only the
    num_experts_per_tok experts a token runs through (the router counts in full)."""
    matrix = config.vocab_size * config.hidden_size
    embedding_and_head = matrix if config.tie_word_embeddings else 2 * matrix
    idle_experts = (config.num_experts - config.num_experts_per_tok) if config.num_experts else 0
    idle = idle_experts * 3 * config.hidden_size * config.moe_intermediate_size * config.num_hidden_layers
    blocks = num_params - embedding_and_head - idle
    attention = 6 * config.num_hidden_layers * seq_len * config.num_attention_heads * config.head_dim
    return 6 * blocks + 6 * matrix + attention


def peak_flops_for(device: torch.device, dtype: str) -> float | None:
    if device.type == "cpu":
        return PEAK_FLOPS[("cpu", dtype)]
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for (chip, kind), value in PEAK_FLOPS.items():
            if chip != "cpu" and chip in name and kind == dtype:
                return value
    return None


def model_flops_utilization(tokens_per_s: float, flops_per_token: float, peak_flops: float | None) -> float:
    """MFU: the model FLOP/s achieved over the device's peak (NaN when the peak is unknown)."""
    return tokens_per_s * flops_per_token / peak_flops if peak_flops else float("nan")
