"""MiniNormForCausalLM: LLaMA parity, KV cache, padding, generation, training per placement, save/load round trip."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from model.config import MiniNormConfig
from model.llama_compat import check_compatible, to_llama_config, to_llama_state_dict
from model.model import MiniNormForCausalLM
from tests.llama_reference import llama_from_mininorm
from tests.model_training import assert_fits_batch

VOCAB = 512
NORM_FIELDS = ("norm_type", "norm_placement", "prms_p", "norm_eps", "norm_impl", "qk_norm")


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_config(**overrides: object) -> MiniNormConfig:
    base = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=128, norm_impl="eager")
    return MiniNormConfig(**{**base, **overrides})


@torch.no_grad()
def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Weights far from the init (norm gains != 1, sharp attention), so a wrong mapping or mask shows up."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen)
        if param.ndim == 1:  # norm gains and biases
            param.copy_((0.0 if name.endswith("bias") else 1.0) + 0.2 * noise)
        else:
            param.copy_(noise * param.shape[-1] ** -0.5)
    return model


def tiny_model(seed: int = 0, **overrides: object) -> MiniNormForCausalLM:
    torch.manual_seed(seed)
    return randomize(MiniNormForCausalLM(tiny_config(**overrides)), seed).eval()


def random_ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    # Avoid 0 (pad) and 2 (eos) so generation and padding tests are not confused by them.
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def pad_batch(rows: list[torch.Tensor], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad 1-D id rows with 0 on `side`; returns (ids, attention_mask)."""
    width = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[i, span], mask[i, span] = row, 1
    return ids, mask


# ---------------------------------------------------------------------------------------------- LLaMA mapping


@pytest.mark.parametrize(("switch", "value"), [("norm_type", "prmsnorm"), ("norm_type", "layernorm"),
                                               ("norm_type", "none"), ("norm_placement", "post"),
                                               ("norm_placement", "sandwich"), ("norm_placement", "res_post"),
                                               ("qk_norm", True)])
def test_non_llama_switch_is_named(switch: str, value: object) -> None:
    config = tiny_config(**{switch: value})
    for call in (check_compatible, to_llama_config):
        with pytest.raises(ValueError, match=switch):
            call(config)


def test_llama_config_and_keys() -> None:
    config = tiny_config(norm_impl="compile", dropout=0.1, norm_eps=1e-5, rope_theta=5e4)
    check_compatible(config)  # implementation and dropout do not change the architecture
    llama = to_llama_config(config)
    assert (llama.hidden_size, llama.intermediate_size, llama.num_key_value_heads, llama.head_dim) == (64, 192, 2, 16)
    assert llama.rms_norm_eps == 1e-5 and llama.rope_parameters["rope_theta"] == 5e4 and llama.tie_word_embeddings
    keys = to_llama_state_dict(MiniNormForCausalLM(config).state_dict()).keys()
    assert "model.layers.1.input_layernorm.weight" in keys and "model.layers.1.post_attention_layernorm.weight" in keys
    assert not any("attn_norm" in key or "mlp_norm" in key for key in keys)


@pytest.mark.parametrize("overrides", [dict(), dict(norm_impl="compile"), dict(dropout=0.1, num_key_value_heads=4)],
                         ids=["eager", "compile", "mha-dropout"])
def test_logits_and_loss_match_llama(overrides: dict) -> None:
    model = tiny_model(**overrides)
    llama = llama_from_mininorm(model)
    ids = random_ids(2, 17)
    with torch.no_grad():
        ours, theirs = model(ids, labels=ids), llama(ids, labels=ids)
    assert ours.logits.abs().max() > 1  # the randomized weights give non-trivial logits
    torch.testing.assert_close(ours.logits, theirs.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.loss, theirs.loss, atol=1e-5, rtol=1e-5)


def test_gradients_match_llama() -> None:
    model = tiny_model().train()
    llama = llama_from_mininorm(model)
    ids = random_ids(2, 17)
    model(ids, labels=ids).loss.backward()
    llama(ids, labels=ids).loss.backward()
    theirs = dict(llama.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, theirs[to_llama_state_dict({name: param}).popitem()[0]].grad,
                                   atol=1e-5, rtol=1e-4, msg=name)


def test_greedy_generate_matches_llama() -> None:
    model = tiny_model()
    llama = llama_from_mininorm(model)
    prompt = random_ids(1, 7)
    kwargs = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    ours, theirs = model.generate(prompt, **kwargs), llama.generate(prompt, **kwargs)
    assert ours.shape == (1, 27)
    assert torch.equal(ours, theirs)
    assert len(set(ours[0, 7:].tolist())) > 1  # not a degenerate repeat of one token


def test_left_padded_generate_matches_llama_and_rows() -> None:
    model = tiny_model()
    llama = llama_from_mininorm(model)
    rows = [random_ids(1, n, seed=n)[0] for n in (9, 4, 6)]
    ids, mask = pad_batch(rows, "left")
    kwargs = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    batched = model.generate(ids, attention_mask=mask, **kwargs)
    assert torch.equal(batched, llama.generate(ids, attention_mask=mask, **kwargs))
    for i, row in enumerate(rows):
        alone = model.generate(row[None], **kwargs)
        assert torch.equal(batched[i, ids.shape[1]:], alone[0, len(row):]), f"row {i}"


def test_sampling_is_reproducible_with_a_seed() -> None:
    model = tiny_model()
    prompt = random_ids(2, 5)
    kwargs = dict(max_new_tokens=15, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None,
                  pad_token_id=0)
    outputs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        outputs.append(model.generate(prompt, **kwargs))
    assert torch.equal(outputs[0], outputs[1])
    assert not torch.equal(outputs[0], outputs[2])
    assert not torch.equal(outputs[0], model.generate(prompt, **{**kwargs, "do_sample": False}))


# ---------------------------------------------------------------------------------------------- KV cache, padding


@pytest.mark.parametrize("overrides", [dict(), dict(norm_type="prmsnorm", norm_placement="sandwich", qk_norm=True),
                                       dict(norm_type="layernorm", norm_placement="post")],
                         ids=["llama", "prms-sandwich-qk", "ln-post"])
def test_kv_cache_decoding_equals_full_forward(overrides: dict) -> None:
    model = tiny_model(**overrides)
    ids = random_ids(2, 16)
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :6], use_cache=True)
        pieces = [out.logits]
        cache = out.past_key_values
        # Three tokens at once (a query block that is not the whole sequence), then one at a time.
        out = model(ids[:, 6:9], past_key_values=cache, use_cache=True)
        pieces.append(out.logits)
        for t in range(9, 16):
            out = model(ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
            pieces.append(out.logits)
    assert out.past_key_values.get_seq_length() == 16
    # One-query attention sums in another order than the full causal pass; the out-norms of sandwich / post
    # rescale the sublayer outputs and with them that fp32 rounding, hence the looser bound there (logits ~10).
    atol = 1e-5 if not overrides else 5e-5
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=atol, rtol=1e-5)


@pytest.mark.parametrize("side", ["left", "right"])
def test_batch_equals_rows_with_padding(side: str) -> None:
    model = tiny_model(norm_type="prmsnorm", qk_norm=True)
    rows = [random_ids(1, n, seed=n)[0] for n in (11, 5, 8, 1)]
    ids, mask = pad_batch(rows, side)
    with torch.no_grad():
        batched = model(ids, attention_mask=mask).logits
        assert torch.isfinite(batched).all()  # fully padded query rows must not produce NaN
        for i, row in enumerate(rows):
            alone = model(row[None]).logits[0]
            real = mask[i].bool()
            torch.testing.assert_close(batched[i, real], alone, atol=1e-5, rtol=1e-5, msg=f"row {i}")


@pytest.mark.parametrize("side", ["left", "right", "none"])
def test_padding_mask_compiles_without_graph_break(side: str) -> None:
    """SFT's batches carry a padding mask, and --compile compiles the model whole: the mask must not break the graph
    (fullgraph=True raises on a break), and the compiled logits are the eager ones, with and without padding."""
    model = tiny_model(norm_type="prmsnorm", qk_norm=True)
    rows = [random_ids(1, n, seed=n)[0] for n in ((7, 7) if side == "none" else (11, 5, 8))]
    ids, mask = pad_batch(rows, "right" if side == "none" else side)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        real = mask.bool()
        torch.testing.assert_close(compiled(ids, attention_mask=mask).logits[real],
                                   model(ids, attention_mask=mask).logits[real], atol=1e-5, rtol=1e-5)


def test_logits_to_keep() -> None:
    model = tiny_model()
    ids = random_ids(2, 9)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, logits_to_keep=1).logits, model(ids).logits[:, -1:], atol=1e-6,
                                   rtol=1e-6)


# ---------------------------------------------------------------------------------------------- training


TRAIN_CASES = [
    *[dict(norm_type=t, norm_placement=p) for p in ("pre", "post", "sandwich", "res_post")
      for t in ("rmsnorm", "prmsnorm", "layernorm")],
    dict(norm_type="rmsnorm", norm_placement="pre", qk_norm=True),
    # No norm at all: every placement is the same plain residual net. Without a final norm the logits start
    # ~100x smaller, so it learns slower; it still must not diverge and must fit most of the batch.
    dict(norm_type="none", norm_placement="pre", steps=40, ratio=0.6),
]


@pytest.mark.parametrize("case", TRAIN_CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_each_placement_trains(case: dict) -> None:
    case = dict(case)
    steps, ratio = case.pop("steps", 25), case.pop("ratio", 0.5)
    torch.manual_seed(0)
    model = MiniNormForCausalLM(tiny_config(prms_p=0.25, **case)).train()
    assert_fits_batch(model, random_ids(4, 32), steps, ratio)


def test_dropout_acts_in_training_only() -> None:
    """Dropout (`dropout` > 0) drops and rescales at the embedding, the attention probabilities and both
    sublayer outputs while training, and does nothing in eval mode."""
    p = 0.3
    ids = random_ids(2, 16)
    model = tiny_model(dropout=p)
    plain = tiny_model(dropout=0.0)
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain(ids).logits)  # eval: exactly the model without dropout
    # Training: every nn.Dropout zeroes about p of its input and scales the rest by 1 / (1 - p).
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = [module.register_forward_hook(lambda m, args, out, name=name: seen.__setitem__(name, (args[0], out)))
             for name, module in model.named_modules() if isinstance(module, nn.Dropout)]
    sdpa_dropout: list[float] = []
    original_sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(*args, **kwargs):
        sdpa_dropout.append(kwargs.get("dropout_p", 0.0))
        return original_sdpa(*args, **kwargs)

    model.train()
    try:
        torch.nn.functional.scaled_dot_product_attention = recording_sdpa
        torch.manual_seed(1)
        first = model(ids).logits
        torch.manual_seed(1)
        again = model(ids).logits
        second = model(ids).logits
    finally:
        torch.nn.functional.scaled_dot_product_attention = original_sdpa
        for hook in hooks:
            hook.remove()
    assert len(seen) == 1 + 2 * model.config.num_hidden_layers  # embedding, attention output, MLP output
    for name, (before, after) in seen.items():
        dropped = after == 0
        assert abs(dropped.float().mean().item() - p) < 0.05, name
        torch.testing.assert_close(after[~dropped], before[~dropped] / (1 - p))
    assert sdpa_dropout == [p] * (3 * model.config.num_hidden_layers)  # three forwards, p on every layer
    assert torch.equal(first, again) and not torch.equal(first, second)  # masks follow the seed
    with torch.no_grad():
        assert not torch.allclose(first, plain(ids).logits, atol=1e-3)


def test_gradient_checkpointing_recomputes_blocks_with_the_same_gradients() -> None:
    """Each block keeps only its input and runs again in the backward (its dropout masks included): the
    gradients equal the plain run's bit for bit, and less activation memory is saved for the backward."""
    ids = random_ids(2, 32)

    def step(model: MiniNormForCausalLM) -> tuple[dict[str, torch.Tensor], int, int]:
        calls = {"mlp": 0}
        # A pre-hook: the recomputation stops as soon as it has every saved tensor back, before the MLP returns.
        hook = model.model.layers[0].mlp.register_forward_pre_hook(
            lambda *_: calls.__setitem__("mlp", calls["mlp"] + 1))
        saved = {"bytes": 0}

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved["bytes"] += t.numel() * t.element_size()
            return t

        torch.manual_seed(3)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(ids, labels=ids).loss
        loss.backward()
        hook.remove()
        return {n: p.grad for n, p in model.named_parameters()}, calls["mlp"], saved["bytes"]

    plain = tiny_model(dropout=0.1).train()
    checkpointed = tiny_model(dropout=0.1).train()
    checkpointed.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    grads, plain_calls, plain_bytes = step(plain)
    grads_ckpt, ckpt_calls, ckpt_bytes = step(checkpointed)
    assert (plain_calls, ckpt_calls) == (1, 2)  # the MLP ran again during the backward
    assert ckpt_bytes < plain_bytes / 2
    assert grads.keys() == grads_ckpt.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, grads_ckpt[name]), name


# ---------------------------------------------------------------------------------------------- save / load


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(norm_type="prmsnorm", norm_placement="sandwich", prms_p=0.25, norm_eps=1e-5, qk_norm=True),
    dict(norm_type="layernorm", norm_placement="post", norm_eps=1e-4),
    dict(norm_type="none", norm_placement="res_post", norm_impl="auto"),
], ids=["llama", "prms-sandwich-qk", "ln-post", "none-res_post"])
def test_save_pretrained_round_trip(tmp_path, overrides: dict) -> None:
    model = tiny_model(**overrides)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "config.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is MiniNormForCausalLM
    for field in NORM_FIELDS:
        assert getattr(loaded.config, field) == getattr(model.config, field), field
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    ours, theirs = model.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[key], theirs[key]) for key in ours)
    ids = random_ids(2, 13)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
