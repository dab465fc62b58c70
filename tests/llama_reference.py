"""The independent reference for model tests: transformers' LlamaForCausalLM carrying a MiniNorm model's weights."""

from __future__ import annotations

from transformers import LlamaForCausalLM

from model.llama_compat import to_llama_config, to_llama_state_dict
from model.model import MiniNormForCausalLM


def llama_from_mininorm(model: MiniNormForCausalLM, attn_implementation: str = "sdpa") -> LlamaForCausalLM:
    """A LlamaForCausalLM with the same shape and (copied) weights, in the same train/eval mode and dtype."""
    config = to_llama_config(model.config)
    config._attn_implementation = attn_implementation
    llama = LlamaForCausalLM(config)
    state = {key: tensor.detach().clone() for key, tensor in to_llama_state_dict(model.state_dict()).items()}
    llama.load_state_dict(state, strict=True)
    if config.tie_word_embeddings:
        assert llama.lm_head.weight.data_ptr() == llama.model.embed_tokens.weight.data_ptr()
    first = next(model.parameters())
    return llama.to(device=first.device, dtype=first.dtype).train(model.training)


def with_random_norm_gains(model, spread: float):
    """The model (eval mode) with every norm gain drawn around 1 (1 + spread * N(0, 1)), so that a norm weight mapped
    to the wrong place, or left out, changes the logits."""
    import torch

    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(1 + spread * torch.randn_like(parameter))
    return model.eval()
