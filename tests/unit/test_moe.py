"""Mixture of experts (issue 30, part 1): the config fields, the sparse MoE block against an fp64 formula written
here, the whole model against transformers' Qwen3MoeForCausalLM (logits, load-balancing loss, loss), the norm
switches around it, generation with the KV cache, and the dense default left as it was."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

from model.config import MiniNormConfig
from model.generation import GenerationEngine, GenerationSettings
from model.llama_compat import NotExportable, check_exportable, to_llama_key
from model.model import MiniNormForCausalLM, SparseMoE, SwiGLU
from trainer.flops import flops_per_token

TINY = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, max_position_embeddings=64)


def moe_config(**overrides) -> MiniNormConfig:
    return MiniNormConfig(**{**TINY, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                             "norm_impl": "eager", **overrides})


@pytest.mark.parametrize("field, value", [
    ("num_experts", -1), ("num_experts", 2.0), ("num_experts", True),
    ("num_experts_per_tok", 0), ("num_experts_per_tok", 5),
    ("moe_intermediate_size", 0), ("moe_intermediate_size", "48"),
    ("norm_topk_prob", "yes"), ("router_aux_loss_coef", -0.1), ("router_aux_loss_coef", float("inf")),
    ("router_z_loss_coef", -1.0), ("router_z_loss_coef", "0.1"),
])
def test_bad_moe_fields_are_refused_in_one_line_naming_the_field(field: str, value) -> None:
    with pytest.raises(ValueError) as info:
        moe_config(**{field: value})
    message = str(info.value)
    assert message.startswith(f"{field}={value!r} is not allowed") and "\n" not in message


def test_dense_default_and_moe_defaults() -> None:
    dense = MiniNormConfig()
    assert dense.num_experts == 0 and not dense.is_moe
    model = MiniNormForCausalLM(MiniNormConfig(**TINY))
    assert all(isinstance(block.mlp, SwiGLU) for block in model.model.layers)
    ids = torch.randint(0, 96, (1, 8))
    out = model(input_ids=ids, labels=ids)
    assert type(out) is CausalLMOutputWithPast  # no router fields on a dense model
    moe = MiniNormConfig(**TINY, num_experts=3)
    assert moe.moe_intermediate_size == moe.intermediate_size and moe.num_experts_per_tok == 1
    preset = MiniNormConfig.from_preset("cpu-moe")
    assert (preset.num_experts, preset.num_experts_per_tok, preset.hidden_size) == (4, 1, 320)


def test_minimind_3_moe_preset_has_minimind_3_moe_published_size() -> None:
    """MiniMind-3-MoE: "198M-A64M" (its README), from its model_minimind.py: hidden 768, 8 layers, 8 query and 4
    key/value heads of 96, per-head QK-norm, vocabulary 6400 tied to the head, 4 SwiGLU experts of width
    ceil(768 pi / 64) * 64 with a 768 x 4 router, top-1 with renormalised weights. Counted here by hand."""
    import math

    config = MiniNormConfig.from_preset("minimind-3-moe")
    hidden, layers, heads, kv_heads, vocab, experts = 768, 8, 8, 4, 6400, 4
    width = math.ceil(hidden * math.pi / 64) * 64
    head_dim = hidden // heads
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2 + 2 * head_dim  # q, o, k, v; QK-norm
    expert = 3 * hidden * width
    per_block = attention + 2 * hidden + hidden * experts  # + the block's two norms and the router
    total = vocab * hidden + layers * (per_block + experts * expert) + hidden  # + the final norm
    active = vocab * hidden + layers * (per_block + 1 * expert) + hidden
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (experts, 1, width)
    assert (config.norm_topk_prob, config.router_aux_loss_coef, config.rope_theta, config.vocab_size) == (
        True, 5e-4, 1e6, vocab)
    assert config.qk_norm and config.qk_norm_scope == "head" and config.tie_word_embeddings
    with torch.device("meta"):
        model = MiniNormForCausalLM(config)
    count = sum(p.numel() for p in model.parameters())
    idle = sum(p.numel() for block in model.model.layers for e in block.mlp.experts[config.num_experts_per_tok:]
               for p in e.parameters())
    assert (count, count - idle) == (total, active)
    assert (round(total / 1e6), round(active / 1e6)) == (198, 64)  # the published "198M-A64M"


def reference_moe(block: SparseMoE, x: torch.Tensor, top_k: int, renormalise: bool) -> torch.Tensor:
    """fp64, every expert on every token, the chosen ones weighted by their (renormalised) probability."""
    x = x.double().reshape(-1, x.shape[-1])
    probs = torch.softmax(x @ block.gate.weight.double().T, dim=-1)
    chosen = probs.argsort(dim=-1, descending=True)[:, :top_k]
    mask = torch.zeros_like(probs).scatter(1, chosen, 1.0)
    weights = probs * mask
    if renormalise:
        weights = weights / weights.sum(-1, keepdim=True)
    outputs = []
    for expert in block.experts:
        gate, up, down = (p.weight.double() for p in (expert.gate_proj, expert.up_proj, expert.down_proj))
        outputs.append((F.silu(x @ gate.T) * (x @ up.T)) @ down.T)
    return torch.einsum("te,teh->th", weights, torch.stack(outputs, dim=1))


@pytest.mark.parametrize("top_k, renormalise", [(1, False), (2, False), (2, True), (4, True)])
def test_sparse_block_matches_an_fp64_dense_formula(top_k: int, renormalise: bool) -> None:
    torch.manual_seed(0)
    config = moe_config(num_experts_per_tok=top_k, norm_topk_prob=renormalise)
    block = MiniNormForCausalLM(config).model.layers[0].mlp
    x = torch.randn(3, 7, 32)
    out, logits = block(x)
    assert logits.shape == (21, 4)
    torch.testing.assert_close(out.double().reshape(21, 32), reference_moe(block, x, top_k, renormalise),
                               rtol=1e-5, atol=1e-6)


def to_qwen3_moe(model: MiniNormForCausalLM) -> Qwen3MoeForCausalLM:
    """A transformers Qwen3-MoE model holding `model`'s weights: the experts stacked into its 3-D tensors."""
    config = model.config
    theirs = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        moe_intermediate_size=config.moe_intermediate_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim, num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
        norm_topk_prob=config.norm_topk_prob, router_aux_loss_coef=config.router_aux_loss_coef,
        rms_norm_eps=config.norm_eps, rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        max_position_embeddings=config.max_position_embeddings, tie_word_embeddings=True, attention_dropout=0.0,
        experts_implementation="eager"))
    state = {to_llama_key(key): value for key, value in model.state_dict().items() if ".experts." not in key}
    for index, block in enumerate(model.model.layers):
        experts = block.mlp.experts
        prefix = f"model.layers.{index}.mlp.experts."
        state[prefix + "gate_up_proj"] = torch.stack(
            [torch.cat((e.gate_proj.weight, e.up_proj.weight)) for e in experts])
        state[prefix + "down_proj"] = torch.stack([e.down_proj.weight for e in experts])
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    theirs.tie_weights()
    return theirs.eval()


@pytest.mark.parametrize("top_k, renormalise", [(1, False), (2, True)])
def test_logits_aux_loss_and_loss_equal_transformers_qwen3_moe(top_k: int, renormalise: bool) -> None:
    torch.manual_seed(1)
    config = moe_config(qk_norm=True, qk_norm_scope="head", num_experts_per_tok=top_k, norm_topk_prob=renormalise,
                        router_aux_loss_coef=0.3)
    ours = MiniNormForCausalLM(config).double().eval()
    with torch.no_grad():  # the router starts at zero in neither model; spread its logits so top-k is clear-cut
        for block in ours.model.layers:
            block.mlp.gate.weight.normal_(0, 0.5)
    theirs = to_qwen3_moe(ours).double()
    ids = torch.randint(0, 96, (2, 12))
    # In fp64, except the fp32 steps both take (the router softmax and the
    # load-balancing loss, RoPE's angles, Qwen3's RMSNorm): equal to fp32 rounding.
    mine = ours(input_ids=ids, labels=ids)
    ref = theirs(input_ids=ids, labels=ids, output_router_logits=True)
    torch.testing.assert_close(mine.logits, ref.logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(mine.aux_loss.float(), ref.aux_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(mine.loss, ref.loss.double(), rtol=1e-6, atol=1e-7)
    assert mine.aux_loss > 1.0  # the loss is not trivially at its uniform value k
    # Padding: only the real tokens enter the load-balancing loss, in both models.
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    mine, ref = ours(input_ids=ids, attention_mask=mask), theirs(input_ids=ids, attention_mask=mask,
                                                                 output_router_logits=True)
    torch.testing.assert_close(mine.aux_loss.float(), ref.aux_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(mine.logits[1], ref.logits[1], rtol=0, atol=1e-6)


def test_z_loss_is_the_mean_squared_logsumexp_and_enters_the_loss() -> None:
    torch.manual_seed(2)
    ids = torch.randint(0, 96, (2, 9))
    base = MiniNormForCausalLM(moe_config(router_aux_loss_coef=0.0)).double()
    with_z = MiniNormForCausalLM(moe_config(router_aux_loss_coef=0.0, router_z_loss_coef=0.5)).double()
    with_z.load_state_dict(base.state_dict())
    out = with_z(input_ids=ids, labels=ids)
    logits = torch.cat(out.router_logits).double()
    expected = (torch.logsumexp(logits, dim=-1) ** 2).mean()
    torch.testing.assert_close(out.z_loss, expected)
    torch.testing.assert_close(out.loss, base(input_ids=ids, labels=ids).loss + 0.5 * expected)


def test_router_loss_split_over_micro_batches_sums_to_the_token_weighted_mean() -> None:
    """With num_items_in_batch (gradient accumulation), each micro-batch's router terms are weighted by its share
    of the supervised tokens: the micro-batch losses sum to the CE token mean + coef x the token-weighted aux."""
    torch.manual_seed(3)
    model = MiniNormForCausalLM(moe_config(router_aux_loss_coef=0.2)).double()
    first, second = torch.randint(0, 96, (1, 10)), torch.randint(0, 96, (1, 6))
    total = 9 + 5  # supervised tokens: the last position of each has no target
    outs = [model(input_ids=ids, labels=ids, num_items_in_batch=total) for ids in (first, second)]
    expected_ce = sum(F.cross_entropy(o.logits[0, :-1], ids[0, 1:], reduction="sum")
                      for o, ids in zip(outs, (first, second))) / total
    expected_aux = (9 * outs[0].aux_loss + 5 * outs[1].aux_loss) / total
    torch.testing.assert_close(outs[0].loss + outs[1].loss, expected_ce + 0.2 * expected_aux)


def test_the_logged_router_terms_are_token_weighted_means_over_the_steps_micro_batches() -> None:
    """The training objective's aux_loss and z_loss statistics (trainer/objectives.py), summed over a step's
    micro-batches and divided by its supervised tokens as the training core does: each micro-batch's term weighted
    by its own supervised tokens (9 and 5 here), as the loss weights it, not a plain mean of the two."""
    from trainer.objectives import LanguageModeling
    torch.manual_seed(3)
    model = MiniNormForCausalLM(moe_config(router_aux_loss_coef=0.2, router_z_loss_coef=0.1)).double()
    rows = (torch.randint(0, 96, (1, 10)), torch.randint(0, 96, (1, 6)))
    batches = [{"input_ids": ids, "labels": ids} for ids in rows]
    objective, total = LanguageModeling(moe=True), torch.tensor(14)
    assert objective.stat_names == ("aux_loss", "z_loss")
    logged = sum(objective.loss(model, batch, total)[1] for batch in batches) / total
    outs = [model(input_ids=batch["input_ids"]) for batch in batches]
    expected = [(9 * getattr(outs[0], name) + 5 * getattr(outs[1], name)) / 14 for name in ("aux_loss", "z_loss")]
    torch.testing.assert_close(logged, torch.stack(expected).float())
    assert abs(outs[0].aux_loss - outs[1].aux_loss) > 1e-3  # the weighting matters here


@pytest.mark.parametrize("switches", [
    dict(norm_type="layernorm", norm_placement="sandwich"), dict(norm_type="dyt", norm_placement="post"),
    dict(norm_type="prmsnorm", norm_placement="mix", mix_ln_ratio=0.5, qk_norm=True, qk_norm_scope="full"),
    dict(norm_placement="deepnorm", norm_depth_scaling=True), dict(norm_placement="res_post", norm_affine=False),
])
def test_every_norm_switch_applies_around_the_moe_block(switches: dict) -> None:
    torch.manual_seed(4)
    model = MiniNormForCausalLM(moe_config(**switches))
    dense = MiniNormForCausalLM(MiniNormConfig(**{**TINY, "norm_impl": "eager", **switches}))
    assert all(isinstance(block.mlp, SparseMoE) for block in model.model.layers)
    norms = lambda m: sorted(k for k in m.state_dict() if "norm" in k or "alpha" in k)  # noqa: E731
    assert norms(model) == norms(dense)  # the same norms around a different MLP
    ids = torch.randint(0, 96, (2, 8))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.loss) and all(p.grad is not None for p in model.model.layers[0].mlp.gate.parameters())


def test_an_expert_no_token_chose_gets_a_zero_gradient() -> None:
    """DDP needs a gradient for every parameter in every step: an idle expert's is zero, not missing."""
    torch.manual_seed(9)
    block = MiniNormForCausalLM(moe_config(num_experts_per_tok=1)).model.layers[0].mlp
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.weight[0] = 1.0
    x = torch.rand(2, 5, 32) + 0.1  # positive: expert 0's logit is the largest for every token
    out, _ = block(x)
    out.sum().backward()
    assert block.experts[0].gate_proj.weight.grad.abs().sum() > 0
    idle = [p.grad for expert in block.experts[1:] for p in expert.parameters()]
    assert all(grad is not None and bool((grad == 0).all()) for grad in idle)


def test_gradient_checkpointing_gives_the_plain_gradients() -> None:
    """The trainer's --gradient_checkpointing recomputes each block, its router and experts included."""
    torch.manual_seed(8)
    plain = MiniNormForCausalLM(moe_config(router_z_loss_coef=0.1)).train()
    checkpointed = MiniNormForCausalLM(moe_config(router_z_loss_coef=0.1)).train()
    checkpointed.load_state_dict(plain.state_dict())
    checkpointed.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 96, (2, 10))
    for model in (plain, checkpointed):
        model(input_ids=ids, labels=ids).loss.backward()
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=name)


def test_greedy_generation_with_the_kv_cache_equals_the_no_cache_argmax() -> None:
    torch.manual_seed(5)
    model = MiniNormForCausalLM(moe_config(num_experts_per_tok=1)).eval()
    prompt = torch.randint(3, 96, (1, 6))
    generated = model.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    ids = prompt
    with torch.no_grad():
        for _ in range(8):
            ids = torch.cat((ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(generated, ids)


def test_the_generation_engine_batches_an_moe_model_as_the_no_cache_argmax(tokenizer) -> None:
    """The engine of chat and the server: rows of different lengths, left-padded into one batch, each decode its
    no-cache greedy continuation (the padding's routing touches no real token)."""
    torch.manual_seed(7)
    model = MiniNormForCausalLM(moe_config(vocab_size=len(tokenizer), num_experts_per_tok=1)).eval()
    with torch.no_grad():
        for block in model.model.layers:
            block.mlp.gate.weight.normal_(0, 0.5)
    prompts = [[5, 9, 40, 7], [300, 12], [8, 8, 90, 100, 33, 21, 17]]
    engine = GenerationEngine(model, tokenizer, max_batch=3, eos_token_ids=[-1])
    engine.start()
    try:
        generations = [engine.submit(ids, GenerationSettings(max_new_tokens=6, temperature=0.0)) for ids in prompts]
        assert all(g.wait(60) for g in generations)
    finally:
        engine.close()
    for prompt, generation in zip(prompts, generations):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(6):
                ids = torch.cat((ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)), dim=1)
        assert generation.token_ids == ids[0, len(prompt):].tolist()


def test_save_and_load_keep_the_experts(tmp_path) -> None:
    torch.manual_seed(6)
    model = MiniNormForCausalLM(moe_config(norm_topk_prob=True, router_z_loss_coef=0.01))
    model.save_pretrained(tmp_path)
    loaded = MiniNormForCausalLM.from_pretrained(tmp_path)
    assert (loaded.config.num_experts, loaded.config.norm_topk_prob, loaded.config.router_z_loss_coef) == (4, True,
                                                                                                           0.01)
    ids = torch.randint(0, 96, (1, 7))
    torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize(("architecture", "hint"), [("llama", "not a mixture of experts"),
                                                     ("qwen3", "--target qwen3_moe")])
def test_llama_and_qwen3_exports_refuse_moe_naming_num_experts(architecture: str, hint: str, tmp_path) -> None:
    config = moe_config(norm_type="layernorm")  # the experts are named first, before any norm switch
    with pytest.raises(NotExportable) as info:
        check_exportable(config, tmp_path, "transformers", architecture)
    message = str(info.value)
    assert "num_experts=4" in message and hint in message and "\n" not in message
    check_exportable(moe_config(qk_norm=True), tmp_path, "transformers", "qwen3_moe")  # Qwen3-MoE takes it
    with pytest.raises(NotExportable, match="num_experts=0 is not Qwen3-MoE-compatible; Qwen3-MoE needs num_experts "
                                            ">= 1"):
        check_exportable(MiniNormConfig(**TINY, qk_norm=True), tmp_path, "transformers", "qwen3_moe")


def test_flops_per_token_counts_the_active_experts_only() -> None:
    """An MoE model with top-1 routing and experts as wide as the dense MLP does a dense model's FLOPs per token
    (plus its router's): the idle experts' parameters are not counted."""
    dense = MiniNormForCausalLM(MiniNormConfig(**TINY))
    moe = MiniNormForCausalLM(moe_config(num_experts_per_tok=1, moe_intermediate_size=64))
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    router = 4 * 32 * 2  # experts x hidden x layers
    assert count(moe) > count(dense) + 2 * router
    gap = flops_per_token(moe.config, count(moe), 16) - flops_per_token(dense.config, count(dense), 16)
    assert gap == 6 * router
