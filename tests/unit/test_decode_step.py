"""model/decode_step.py through GenerationEngine's decode modes: the static KV cache (eager and compiled) against
references -- a cache-free full forward of each finished sequence (every logit vector a row sampled from), the
model's-forward engine ("forward", token for token, greedy and seeded sampling, batched with different prompt
lengths), and transformers' generate(). Only one test compiles."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from model import decode_step
from model.chat_session import encode_prompt
from model.decode_step import DecodeStep, StaticKVCache
from model.generation import GenerationEngine, GenerationSettings, _Row

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ("The history of", "Water is a chemical compound of hydrogen and", "北京是", "A",
           "A tiny language model learns to continue text one token at a time, and then")
NEVER = -1  # an eos id no model emits: generations run to their budget
BUDGETS = (9, 4, 12, 6, 7)


def ids(tokenizer, text: str) -> list[int]:
    return encode_prompt(tokenizer, [{"role": "user", "content": text}], use_template=False)


def run_batched(engine: GenerationEngine, tokenizer, settings: list[GenerationSettings], monkeypatch,
                max_steps: int = 500):
    """Submit PROMPTS with `settings`, some while the batch already decodes (rows join at different times with
    different prompt lengths and leave at different times); (generations, each one's logit vectors, batch sizes)."""
    seen: dict[int, list[torch.Tensor]] = {}
    original_sample, original_init = _Row.sample, _Row.__init__

    def recording_sample(self, logits):
        seen.setdefault(id(self.generation), []).append(logits.clone())
        return original_sample(self, logits)

    def init_through_sample(self, *args):
        original_init(self, *args)
        self.greedy = False  # greedy rows go through sample() too, which records their logits

    monkeypatch.setattr(_Row, "sample", recording_sample)
    monkeypatch.setattr(_Row, "__init__", init_through_sample)
    generations, sizes = [], []
    for index, (text, setting) in enumerate(zip(PROMPTS, settings)):
        generations.append(engine.submit(ids(tokenizer, text), setting))
        if index % 2:
            engine.step()
            sizes.append(engine.load[0])
    for _ in range(max_steps):
        if all(g.done for g in generations):
            break
        engine.step()
        sizes.append(engine.load[0])
    monkeypatch.setattr(_Row, "sample", original_sample)
    monkeypatch.setattr(_Row, "__init__", original_init)
    assert all(g.done for g in generations)
    return generations, [torch.stack(seen[id(g)]) for g in generations], sizes


@pytest.fixture(scope="module")
def post_ln_model(tiny_models):
    """The tiny untrained post-LN model (another block layout through the same decode step) and its tokenizer."""
    from model.loading import load_model

    return load_model(tiny_models.post_ln)


@pytest.fixture(scope="module")
def moe_qk_norm_model(tokenizer):
    """A tiny random sandwich-norm mixture-of-experts model with per-head QK-norm: the step's other branches
    (router logits returned beside the block's output, QK-norm, norms after the sublayers)."""
    from model import MiniNormConfig, MiniNormForCausalLM

    torch.manual_seed(3)
    config = MiniNormConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=128, norm_impl="eager",
                            norm_placement="sandwich", qk_norm=True, num_experts=3, num_experts_per_tok=2,
                            moe_intermediate_size=48)
    return MiniNormForCausalLM(config).eval(), tokenizer


def full_forward_logits(model, generation) -> torch.Tensor:
    full = torch.tensor([generation.prompt_ids + generation.token_ids[:-1]])
    with torch.no_grad():
        return model(input_ids=full).logits[0, len(generation.prompt_ids) - 1:].float()


def sampled(seed_base: int = 0) -> list[GenerationSettings]:
    return [GenerationSettings(max_new_tokens=budget, temperature=0.9, top_p=0.95, seed=seed_base + index)
            for index, budget in enumerate(BUDGETS)]


def greedy() -> list[GenerationSettings]:
    return [GenerationSettings(max_new_tokens=budget, temperature=0.0) for budget in BUDGETS]


def penalised() -> list[GenerationSettings]:
    """OpenAI's penalties, different per row, on greedy and sampled rows, one row without them."""
    penalties = [(0.7, 0.0), (0.0, 0.0), (-1.0, 1.5), (0.5, 0.3), (0.0, -2.0)]
    return [GenerationSettings(max_new_tokens=budget, temperature=0.9 * (index == 3), seed=index,
                               frequency_penalty=frequency, presence_penalty=presence)
            for index, (budget, (frequency, presence)) in enumerate(zip(BUDGETS, penalties))]


@pytest.mark.parametrize("which", ["pretrained", "post_ln_model", "moe_qk_norm_model"])
def test_static_rows_see_the_logits_of_a_full_forward(which, request, monkeypatch) -> None:
    model, tokenizer = request.getfixturevalue(which)
    engine = GenerationEngine(model, tokenizer, max_batch=3, eos_token_ids=[NEVER], decode="static")
    assert isinstance(engine._step, DecodeStep) and not engine._step.compiled
    generations, logits, sizes = run_batched(engine, tokenizer, sampled(), monkeypatch)
    assert max(sizes) == 3 and engine.batched_rows > engine.steps  # it really ran batched
    for generation, budget, seen in zip(generations, BUDGETS, logits):
        assert len(generation.token_ids) == budget
        torch.testing.assert_close(seen, full_forward_logits(model, generation), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("settings", [greedy, sampled, penalised])
def test_static_tokens_equal_the_forward_engines(pretrained, settings, monkeypatch) -> None:
    """Batched, different prompt lengths, rows joining and leaving: the same tokens as decoding through the model's
    forward (left-padded DynamicCache), greedy, with seeded sampling and with OpenAI's penalties."""
    model, tokenizer = pretrained
    tokens = {}
    for decode in ("forward", "static"):
        engine = GenerationEngine(model, tokenizer, max_batch=3, eos_token_ids=[NEVER], decode=decode)
        generations, _, _ = run_batched(engine, tokenizer, settings(), monkeypatch)
        tokens[decode] = [g.token_ids for g in generations]
    assert tokens["static"] == tokens["forward"]


@pytest.mark.parametrize("which", ["sft", "pretrained"])
def test_static_greedy_equals_transformers_generate(which, request) -> None:
    model, tokenizer = request.getfixturevalue(which)
    engine = GenerationEngine(model, tokenizer, max_batch=1, decode="static")
    for text in PROMPTS:
        prompt = (encode_prompt(tokenizer, [{"role": "user", "content": text}], use_template=True) if which == "sft"
                  else ids(tokenizer, text))
        ours = engine.generate(prompt, GenerationSettings(max_new_tokens=24, temperature=0.0)).token_ids
        x = torch.tensor([prompt])
        theirs = model.generate(input_ids=x, attention_mask=torch.ones_like(x), pad_token_id=0, max_new_tokens=24,
                                do_sample=False, eos_token_id=tokenizer.eos_token_id)[0, len(prompt):].tolist()
        assert ours == theirs


def test_the_cache_grows_by_chunks_and_keeps_its_columns(pretrained, monkeypatch) -> None:
    """A generation several chunks long reallocates the cache (copying the filled columns) and its tokens stay
    the argmax of a full forward; the context limit still ends it."""
    model, tokenizer = pretrained
    monkeypatch.setattr(decode_step, "CAPACITY_CHUNK", 16)
    engine = GenerationEngine(model, tokenizer, max_batch=1, eos_token_ids=[NEVER], decode="static")
    prompt = ids(tokenizer, "The history of")
    generation = engine.generate(prompt, GenerationSettings(max_new_tokens=10_000, temperature=0.0))
    assert len(prompt) + len(generation.token_ids) == model.config.max_position_embeddings
    assert engine._cache is None and model.config.max_position_embeddings > 4 * decode_step.CAPACITY_CHUNK
    reference = full_forward_logits(model, generation).argmax(-1).tolist()
    assert generation.token_ids == reference


def test_an_in_place_weight_update_reaches_the_next_step(pretrained) -> None:
    """GRPO updates the policy in place between rollouts: the step's copy of the LM head follows the weights (the
    same engine, before and after an optimizer-like in-place update, each time the tokens of a full forward)."""
    model, tokenizer = pretrained
    model = copy.deepcopy(model)
    engine = GenerationEngine(model, tokenizer, max_batch=1, eos_token_ids=[NEVER], decode="static")
    prompt = ids(tokenizer, "Water is")
    settings = GenerationSettings(max_new_tokens=10, temperature=0.0)
    for _ in range(2):
        generation = engine.generate(prompt, settings)
        assert generation.token_ids == full_forward_logits(model, generation).argmax(-1).tolist()
        before = generation.token_ids
        with torch.no_grad():
            model.lm_head.weight.mul_(torch.linspace(0.2, 3.0, model.lm_head.weight.shape[0])[:, None])
    assert engine.generate(prompt, settings).token_ids != before


def test_compiled_step_equals_the_eager_step(pretrained, monkeypatch) -> None:
    """The one test that compiles: batched rows of different lengths (the batch shrinks to one row at the end, a
    second graph), greedy and seeded sampling; the same tokens and, within float rounding, the same logits."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    model, tokenizer = pretrained
    monkeypatch.setattr(DecodeStep, "_compile_failed", False)
    graphs_before = len(_debug_get_cache_entry_list(decode_step.decode_logits.__code__))
    results = {}
    for decode in ("static", "compiled"):
        engine = GenerationEngine(model, tokenizer, max_batch=3, eos_token_ids=[NEVER], decode=decode)
        settings = [s if i % 2 else g for i, (s, g) in enumerate(zip(sampled(7), greedy()))]
        results[decode] = run_batched(engine, tokenizer, settings, monkeypatch)
    assert not DecodeStep._compile_failed
    # At most the two graphs (fewer when this process compiled them before): the rows' and the one row's. The kv
    # heads' count, 2 like the first step's rows, once made a third.
    assert len(_debug_get_cache_entry_list(decode_step.decode_logits.__code__)) - graphs_before <= 2
    (eager, eager_logits, sizes), (compiled, compiled_logits, _) = results["static"], results["compiled"]
    assert max(sizes) == 3 and min(sizes[:-1]) == 1
    assert [g.token_ids for g in compiled] == [g.token_ids for g in eager]
    for ours, reference in zip(compiled_logits, eager_logits):
        torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)


def test_a_failing_compile_decodes_eagerly_and_says_so_once(pretrained, monkeypatch, capsys) -> None:
    model, tokenizer = pretrained

    def broken_compile(fn, **kwargs):
        def fail(*args, **kw):
            raise RuntimeError("no C++ compiler\nmore detail")
        return fail

    monkeypatch.setattr(torch, "compile", broken_compile)
    monkeypatch.setattr(DecodeStep, "_compiled_fn", None)
    monkeypatch.setattr(DecodeStep, "_compile_failed", False)
    prompt = ids(tokenizer, "Water is")
    settings = GenerationSettings(max_new_tokens=8, temperature=0.0)
    expected = GenerationEngine(model, tokenizer, max_batch=1, decode="forward").generate(prompt, settings).token_ids
    for _ in range(2):
        engine = GenerationEngine(model, tokenizer, max_batch=1, decode="compiled")
        assert engine.generate(prompt, settings).token_ids == expected
    err = capsys.readouterr().err
    assert err.count("decode step: torch.compile failed (RuntimeError: no C++ compiler); decoding eagerly") == 1


def test_a_model_that_is_not_mininorm_decodes_through_its_forward(tokenizer) -> None:
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    engine = GenerationEngine(model, tokenizer, max_batch=2, eos_token_ids=[NEVER], decode="compiled")
    assert engine._step is None
    prompt = ids(tokenizer, "The history of")
    ours = engine.generate(prompt, GenerationSettings(max_new_tokens=6, temperature=0.0)).token_ids
    x = torch.tensor([prompt])
    theirs = model.generate(input_ids=x, attention_mask=torch.ones_like(x), pad_token_id=0, max_new_tokens=6,
                            min_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
    assert ours == theirs


def test_a_bad_decode_mode_is_refused_in_one_line(pretrained) -> None:
    model, tokenizer = pretrained
    with pytest.raises(ValueError, match=r"^decode='fast' is not allowed; choose one of 'forward', 'static', "
                                         r"'compiled'$"):
        GenerationEngine(model, tokenizer, decode="fast")


def test_update_writes_each_row_at_its_own_column() -> None:
    """StaticKVCache.update against indexing by hand: row r's new key and value land in column positions[r], the
    other columns keep theirs, and the layer's columns [0, length) come back."""
    config = LlamaConfig(num_hidden_layers=1, num_key_value_heads=2, hidden_size=8, num_attention_heads=2)
    cache = StaticKVCache(config, rows=3, capacity=8, dtype=torch.float64, device=torch.device("cpu"))
    before = torch.randn(3, 2, 8, 4, dtype=torch.float64)
    cache.keys[0].copy_(before)
    cache.values[0].copy_(-before)
    cache.positions = torch.tensor([0, 5, 2])
    cache.length = 6
    new = torch.randn(3, 2, 1, 4, dtype=torch.float64)
    keys, values = cache.update(new, -new, 0)
    expected = before.clone()
    for row, column in enumerate((0, 5, 2)):
        expected[row, :, column] = new[row, :, 0]
    assert torch.equal(keys, expected[:, :, :6]) and torch.equal(values, -expected[:, :, :6])
    assert torch.equal(cache.keys[0][:, :, 6:], before[:, :, 6:])
