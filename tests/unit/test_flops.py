"""Training FLOPs per token (trainer/flops.py, the numerator of MFU) against torch's FlopCounterMode, which counts
every matmul of a real forward + backward: tied and untied LM heads, and the attention products."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from model import MiniNormConfig, MiniNormForCausalLM
from trainer.flops import flops_per_token

BATCH, SEQ = 2, 32


@pytest.mark.parametrize("tied, head_dim", [(True, None), (False, None), (True, 32)],
                         ids=["tied", "untied", "head_dim_32"])
def test_flops_per_token_counts_what_a_training_step_computes(tied: bool, head_dim: int | None) -> None:
    """head_dim 32 with hidden 64 and 4 heads: the attention products are 128 wide, twice the residual stream."""
    config = MiniNormConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, norm_impl="eager", tie_word_embeddings=tied, head_dim=head_dim)
    torch.manual_seed(0)
    model = MiniNormForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:  # the math backend shows attention as bmm ops
        model(input_ids=ids, labels=ids).loss.backward()
    counted = {str(op): flops / (BATCH * SEQ) for op, flops in counter.get_flop_counts()["Global"].items()}
    num_params = sum(p.numel() for p in model.parameters())
    ours = flops_per_token(config, num_params, SEQ)
    # The matmuls of the projections, the MLP and the LM head: 6 per weight, the head once whether tied or not.
    # Our count also charges 6 per norm gain (elementwise work, not a matmul): take those out to compare.
    attention = 6 * config.num_hidden_layers * SEQ * 4 * (head_dim or 64 // 4)
    norm_gains = (2 * config.num_hidden_layers + 1) * config.hidden_size
    assert ours - attention - 6 * norm_gains == counted["aten.mm"]
    # The counter charges the full T x T score and value products; a causal model needs half of them.
    assert attention == counted["aten.bmm"] / 2
