"""Smeared keys (config.smeared_keys): the attention against an fp64 formula, the plain model as its limit, the KV
cache (chunks, beam search), padding, save/load, the exporters' refusal, and the copying it is there for."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from model.decode_step import supports_decode_step
from model.llama_compat import check_compatible
from model.model import MiniNormForCausalLM, apply_rotary
from tests.unit.test_model import pad_batch, random_ids, tiny_config, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
STEPS = 200


def reference_attention(attention: torch.nn.Module, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                        ) -> torch.Tensor:
    """The smeared-key attention written out in fp64, position by position: k'_t = s k_t + (1 - s) k_{t-1}
    (k_{-1} = 0), s = sigmoid(key_smear) per KV head, then RoPE and causal softmax attention."""
    x = x.double()
    heads, kv_heads, dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
    batch, length, _ = x.shape
    q = (x @ attention.q_proj.weight.double().T).view(batch, length, heads, dim).transpose(1, 2)
    k = (x @ attention.k_proj.weight.double().T).view(batch, length, kv_heads, dim).transpose(1, 2)
    v = (x @ attention.v_proj.weight.double().T).view(batch, length, kv_heads, dim).transpose(1, 2)
    own = 1 / (1 + torch.exp(-attention.key_smear.double()))
    smeared = torch.empty_like(k)
    for t in range(length):
        previous = k[:, :, t - 1] if t > 0 else torch.zeros_like(k[:, :, 0])
        smeared[:, :, t] = own[None, :, None] * k[:, :, t] + (1 - own[None, :, None]) * previous
    cos, sin = (part.double() for part in rope)
    q, smeared = apply_rotary(q, cos, sin), apply_rotary(smeared, cos, sin)
    group = heads // kv_heads
    out = torch.empty(batch, heads, length, dim, dtype=torch.float64)
    for h in range(heads):
        scores = q[:, h] @ smeared[:, h // group].transpose(-1, -2) / math.sqrt(dim)
        scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), -math.inf)
        out[:, h] = torch.softmax(scores, dim=-1) @ v[:, h // group]
    out = out.transpose(1, 2).reshape(batch, length, heads * dim)
    return out @ attention.o_proj.weight.double().T


def test_attention_matches_the_fp64_formula() -> None:
    model = tiny_model(smeared_keys=True)
    attention = model.model.layers[1].self_attn
    with torch.no_grad():
        attention.key_smear.copy_(torch.tensor([-1.5, 2.0]))  # one head mostly the previous key, one mostly its own
        x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(1))
        positions = torch.arange(9).expand(2, -1)
        rope = model.model.rotary(positions, torch.float32)
        ours = attention(x, rope, None, None)
    torch.testing.assert_close(ours.double(), reference_attention(attention, x, rope), atol=1e-5, rtol=1e-5)


def test_a_key_all_its_own_is_the_plain_model() -> None:
    smeared = tiny_model(smeared_keys=True)
    plain = MiniNormForCausalLM(tiny_config()).eval()
    missing, unexpected = plain.load_state_dict(smeared.state_dict(), strict=False)
    assert not missing and len(unexpected) == 2 and all("key_smear" in name for name in unexpected)
    ids = random_ids(2, 12)
    with torch.no_grad():
        for module in smeared.modules():
            if getattr(module, "key_smear", None) is not None:
                module.key_smear.fill_(40.0)  # sigmoid(40) = 1 in fp32
        torch.testing.assert_close(smeared(ids).logits, plain(ids).logits)
        for module in smeared.modules():
            if getattr(module, "key_smear", None) is not None:
                module.key_smear.fill_(0.0)
        assert not torch.allclose(smeared(ids).logits, plain(ids).logits, atol=1e-3)


def test_new_weights_start_half_and_half() -> None:
    torch.manual_seed(0)
    model = MiniNormForCausalLM(tiny_config(smeared_keys=True))
    weights = [module.key_smear for module in model.modules() if getattr(module, "key_smear", None) is not None]
    assert len(weights) == 2 and all(w.shape == (2,) and torch.equal(w, torch.zeros(2)) for w in weights)


def test_kv_cache_in_chunks_equals_the_full_forward() -> None:
    model = tiny_model(smeared_keys=True, qk_norm=True)
    ids = random_ids(2, 16)
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :6], use_cache=True)
        pieces = [out.logits]
        out = model(ids[:, 6:9], past_key_values=out.past_key_values, use_cache=True)
        pieces.append(out.logits)
        for t in range(9, 16):
            out = model(ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
            pieces.append(out.logits)
    assert out.past_key_values.get_seq_length() == 16
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("beams", [1, 3])
def test_generate_with_the_cache_equals_generate_without(beams: int) -> None:
    model = tiny_model(smeared_keys=True)
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "key_smear", None) is not None:
                module.key_smear.copy_(torch.tensor([-2.0, 1.0]))  # one head reads mostly the previous key
    ids = random_ids(2, 5)
    kwargs = dict(max_new_tokens=8, do_sample=False, num_beams=beams, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        cached = model.generate(ids, use_cache=True, **kwargs)
        uncached = model.generate(ids, use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("side", ["left", "right"])
def test_batch_equals_rows_with_padding(side: str) -> None:
    """A padded position is no token: the first real token after left padding smears with zero, as at a start."""
    model = tiny_model(smeared_keys=True)
    rows = [random_ids(1, n, seed=n)[0] for n in (11, 5, 8, 1)]
    ids, mask = pad_batch(rows, side)
    with torch.no_grad():
        batched = model(ids, attention_mask=mask).logits
        assert torch.isfinite(batched).all()
        for i, row in enumerate(rows):
            alone = model(row[None]).logits[0]
            torch.testing.assert_close(batched[i, mask[i].bool()], alone, atol=1e-5, rtol=1e-5, msg=f"row {i}")


def test_save_load_round_trip_keeps_the_weights(tmp_path) -> None:
    model = tiny_model(smeared_keys=True)
    model.save_pretrained(tmp_path)
    loaded = MiniNormForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.smeared_keys
    ids = random_ids(1, 10)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("architecture", ["llama", "qwen3", "qwen3_moe"])
def test_every_export_target_refuses_it_by_name(architecture: str) -> None:
    overrides = {"llama": {}, "qwen3": {"qk_norm": True}, "qwen3_moe": {"qk_norm": True, "num_experts": 2}}
    config = tiny_config(smeared_keys=True, **overrides[architecture])
    with pytest.raises(ValueError, match="smeared_keys=True is not"):
        check_compatible(config, architecture)
    check_compatible(tiny_config(**overrides[architecture]), architecture)


def test_the_static_decode_step_leaves_it_to_the_forward() -> None:
    assert supports_decode_step(tiny_model())
    assert not supports_decode_step(tiny_model(smeared_keys=True))


def test_config_refuses_a_non_boolean() -> None:
    with pytest.raises(ValueError, match="smeared_keys='yes' is not allowed"):
        tiny_config(smeared_keys="yes")


def copy_rows(generator: torch.Generator, rows: int, length: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens with one span (4-14 tokens, a length of its own per row, so no fixed offset finds it) repeated
    right after itself; and the mask of the positions whose next token is predictable: the repeat's 2nd token on."""
    ids = torch.randint(3, 67, (rows, length), generator=generator)
    predictable = torch.zeros(rows, length - 1, dtype=torch.bool)
    for row in range(rows):
        span = int(torch.randint(4, 15, (), generator=generator))
        start = int(torch.randint(0, length - 2 * span + 1, (), generator=generator))
        ids[row, start + span:start + 2 * span] = ids[row, start:start + span]
        predictable[row, start + span:start + 2 * span - 1] = True  # position t predicts t + 1
    return ids, predictable


def copy_loss(model: MiniNormForCausalLM, ids: torch.Tensor, predictable: torch.Tensor) -> torch.Tensor:
    logits = model(ids).logits[:, :-1][predictable]
    return F.cross_entropy(logits, ids[:, 1:][predictable])


def repeat_loss_after_training(smeared: bool, steps: int = STEPS) -> float:
    torch.manual_seed(0)
    model = MiniNormForCausalLM(tiny_config(vocab_size=67, hidden_size=32, num_attention_heads=2,
                                            num_key_value_heads=1, smeared_keys=smeared))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        loss = copy_loss(model, *copy_rows(generator, 32))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        return copy_loss(model, *copy_rows(torch.Generator().manual_seed(1), 256)).item()


def test_smeared_keys_learn_to_copy_where_the_plain_model_does_not_yet() -> None:
    """What the switch is for: with the same data, steps and seed, smeared keys find the copy (the loss on a
    repeated span far below ln 64 = 4.16, what guessing among the tokens gives), while the plain two-layer model
    still guesses."""
    assert repeat_loss_after_training(smeared=True) < 1.0
    assert repeat_loss_after_training(smeared=False) > 3.0
