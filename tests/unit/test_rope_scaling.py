"""rope_scaling (linear, dynamic, YaRN): the same logits as transformers' LlamaForCausalLM with the same weights and
rope_parameters, at positions up to factor x the original length; validation; default models unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eval.chat import main as chat_main
from eval.evaluate import evaluate_model_dir
from model.config import MiniNormConfig
from model.model import MiniNormForCausalLM
from model.rope import extend_context, set_rope_scaling
from scripts.server.served_model import load_served_model
from tests.llama_reference import llama_from_mininorm, with_random_norm_gains
from trainer.export import save_model_dir

ORIGINAL = 64  # the "trained" length
FACTOR = 4
# head_dim 32 and theta 1e4: YaRN's ramp then spans frequencies 0..5 of 16 (kept, blended and interpolated ones).
SHAPE = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             rope_theta=1e4, norm_impl="eager")
SCALINGS = {
    "linear": ({"rope_type": "linear", "factor": FACTOR}, ORIGINAL * FACTOR),
    "dynamic": ({"rope_type": "dynamic", "factor": FACTOR}, ORIGINAL),  # grows past max_position_embeddings
    "yarn": ({"rope_type": "yarn", "factor": FACTOR, "original_max_position_embeddings": ORIGINAL},
             ORIGINAL * FACTOR),
    "yarn-betas": ({"rope_type": "yarn", "factor": 2.5, "original_max_position_embeddings": ORIGINAL,
                    "beta_fast": 8, "beta_slow": 2, "truncate": False}, ORIGINAL * FACTOR),
    "yarn-mscale": ({"rope_type": "yarn", "factor": FACTOR, "original_max_position_embeddings": ORIGINAL,
                     "mscale": 0.8, "mscale_all_dim": 0.5}, ORIGINAL * FACTOR),
    "yarn-attention-factor": ({"rope_type": "yarn", "factor": FACTOR, "original_max_position_embeddings": ORIGINAL,
                               "attention_factor": 1.3}, ORIGINAL * FACTOR),
}


def scaled_model(scaling: dict | None, max_positions: int, seed: int = 0) -> MiniNormForCausalLM:
    torch.manual_seed(seed)
    config = MiniNormConfig(**SHAPE, max_position_embeddings=max_positions, rope_scaling=scaling)
    return with_random_norm_gains(MiniNormForCausalLM(config), 0.3)


@pytest.mark.parametrize("name", list(SCALINGS))
def test_logits_equal_llama_with_the_same_rope_scaling(name: str) -> None:
    scaling, max_positions = SCALINGS[name]
    ours = scaled_model(scaling, max_positions)
    llama = llama_from_mininorm(ours).eval()
    assert llama.config.rope_parameters["rope_type"] == scaling["rope_type"]
    ids = torch.randint(0, 512, (2, ORIGINAL * FACTOR), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = llama(ids).logits
        torch.testing.assert_close(ours(ids).logits, expected, atol=2e-5, rtol=0)
        # The scaling matters at these positions: plain RoPE on the same weights gives other logits.
        plain = scaled_model(None, max_positions)
        plain.load_state_dict(ours.state_dict())
        assert (plain(ids).logits - expected).abs().max() > 1e-3


def test_yarn_generation_with_the_kv_cache_matches_one_pass() -> None:
    scaling, max_positions = SCALINGS["yarn"]
    ours = scaled_model(scaling, max_positions)
    ids = torch.randint(0, 512, (1, 200), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole = ours(ids).logits
        prefix = ours(ids[:, :150], use_cache=True)
        rest = ours(ids[:, 150:], past_key_values=prefix.past_key_values).logits
    torch.testing.assert_close(rest, whole[:, 150:], atol=2e-5, rtol=0)


def test_rope_scaling_survives_save_and_load(tmp_path) -> None:
    scaling, max_positions = SCALINGS["yarn-betas"]
    scaled_model(scaling, max_positions).save_pretrained(tmp_path)
    loaded = MiniNormConfig.from_pretrained(tmp_path)
    assert loaded.rope_scaling == scaling


def test_default_config_round_trips_without_rope_scaling(tmp_path) -> None:
    MiniNormConfig().save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["rope_scaling"] is None
    assert MiniNormConfig.from_pretrained(tmp_path).rope_scaling is None


def test_plain_rope_is_unchanged_bit_for_bit() -> None:
    """Without rope_scaling, cos and sin are exactly what RoPE's formula gave before rope_scaling existed."""
    model = MiniNormForCausalLM(MiniNormConfig.from_preset("cpu-default"))
    positions = torch.arange(512).expand(2, -1)
    cos, sin = model.model.rotary(positions, torch.float32)
    head_dim = model.config.head_dim
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    angles = torch.cat([positions[..., None].float() * inv_freq] * 2, dim=-1)
    assert torch.equal(cos, angles.cos()) and torch.equal(sin, angles.sin())


def test_yarn_original_length_defaults_to_max_position_embeddings() -> None:
    config = MiniNormConfig(**SHAPE, max_position_embeddings=128, rope_scaling={"rope_type": "yarn", "factor": 2})
    assert config.rope_scaling == {"rope_type": "yarn", "factor": 2, "original_max_position_embeddings": 128}


@pytest.mark.parametrize(("scaling", "named"), [
    ({"rope_type": "llama3", "factor": 8}, "rope_type='llama3'"),
    ({"factor": 2}, "rope_type=None"),
    ({"rope_type": "yarn", "factor": 0.5}, "factor=0.5"),
    ({"rope_type": "linear", "factor": "2"}, "factor='2'"),
    ({"rope_type": "linear", "factor": 2, "beta_fast": 32}, "beta_fast=32"),
    ({"rope_type": "yarn", "factor": 2, "original_max_position_embeddings": 0}, "original_max_position_embeddings=0"),
    ({"rope_type": "yarn", "factor": 2, "truncate": "yes"}, "truncate='yes'"),
    ("yarn", "rope_scaling='yarn'"),
])
def test_bad_rope_scaling_is_refused_naming_the_key(scaling, named: str) -> None:
    with pytest.raises(ValueError, match=named.replace("(", r"\(")) as info:
        MiniNormConfig(**SHAPE, rope_scaling=scaling)
    assert "\n" not in str(info.value)


def test_dynamic_scaling_with_two_dimensional_heads_is_refused_in_one_line() -> None:
    """Dynamic NTK raises the base to d / (d - 2): with head_dim d = 2 the model ran to max_position_embeddings and
    died with a ZeroDivisionError one position later (and transformers could not even build its export), found by a
    randomized parity sweep. The config, and set_rope_scaling on a loaded model, now refuse it up front."""
    dynamic = {"rope_type": "dynamic", "factor": 2.0}
    tiny = dict(vocab_size=11, hidden_size=2, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                max_position_embeddings=4, norm_impl="eager")
    with pytest.raises(ValueError, match=r"rope_type='dynamic' is not allowed with head_dim=2") as info:
        MiniNormConfig(**tiny, rope_scaling=dynamic)
    assert "\n" not in str(info.value)
    model = MiniNormForCausalLM(MiniNormConfig(**tiny))  # plain RoPE at head_dim 2 is fine, past nothing
    with pytest.raises(ValueError, match=r"rope_type='dynamic' is not allowed with head_dim=2"):
        set_rope_scaling(model, dynamic, 4)
    assert model.config.rope_scaling is None and model.model.rotary.rope_scaling is None  # left as it was
    MiniNormConfig(**{**tiny, "hidden_size": 4}, rope_scaling=dynamic)  # head_dim 4: d / (d - 2) = 2
    for other in ({"rope_type": "linear", "factor": 2.0}, {"rope_type": "yarn", "factor": 2.0}):  # no such exponent
        assert MiniNormConfig(**tiny, rope_scaling=other).rope_scaling["rope_type"] == other["rope_type"]
        set_rope_scaling(model, other, 4)
        assert model.model.rotary.rope_scaling["rope_type"] == other["rope_type"]


# ---------------------------------------------------------------------------------------------- --rope_scaling_factor
@pytest.mark.parametrize("positions, trained", [(ORIGINAL, None), (2 * ORIGINAL, ORIGINAL)])
def test_extend_context_is_yarn_over_the_trained_length(positions: int, trained: int | None) -> None:
    """L is the run's --max_seq_len where recorded, else max_position_embeddings. The CPU presets train rows of 256
    of their 512 positions: YaRN over 512 stretched positions the model never attended over (measured worse,
    docs/chat_evaluate_export.md), and "4x the trained context" was 8x."""
    model = scaled_model(None, positions)
    said = extend_context(model, FACTOR, trained_length=trained)
    assert model.config.rope_scaling == SCALINGS["yarn"][0]  # original_max_position_embeddings: 64
    assert model.config.max_position_embeddings == ORIGINAL * FACTOR
    kind = "trained" if trained else "model's"
    assert said == f"YaRN x4 over the 64 {kind} positions: a context of {ORIGINAL * FACTOR} positions"
    reference = scaled_model(SCALINGS["yarn"][0], ORIGINAL * FACTOR)
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(0, 512, (1, ORIGINAL * FACTOR), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, llama_from_mininorm(reference).eval()(ids).logits,
                                   atol=2e-5, rtol=0)


def test_extend_context_never_shrinks_the_models_context() -> None:
    small = scaled_model(None, 2 * ORIGINAL)
    extend_context(small, 1.5, trained_length=ORIGINAL)  # 1.5 x 64 = 96 positions: the model's 128 stay
    assert (small.config.max_position_embeddings, small.config.rope_scaling["original_max_position_embeddings"]) == (
        2 * ORIGINAL, ORIGINAL)


@pytest.mark.parametrize(("factor", "named"), [(1.0, r"it must be a number in \(1, 1024\]"), (float("nan"), "nan")])
def test_extend_context_refuses_a_factor_that_extends_nothing(factor: float, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        extend_context(scaled_model(None, ORIGINAL), factor)


@pytest.mark.parametrize("factor", [1e30, 1024.5, float("inf")])
def test_extend_context_refuses_a_factor_past_any_context_extension(factor: float) -> None:
    """long_context.py's --scalings bound, for every tool's --rope_scaling_factor: 1e30 was taken by chat, evaluate
    and serve, which then reported a context of 32,000,000,000,000,000,636,307,994,836,992 positions (found by
    fuzzing the flags); 1024, the bound itself, is taken."""
    model = scaled_model(None, ORIGINAL)
    with pytest.raises(ValueError) as error:
        extend_context(model, factor)
    assert str(error.value) == f"--rope_scaling_factor={factor!r} is not allowed; it must be a number in (1, 1024]"
    assert model.config.rope_scaling is None and model.config.max_position_embeddings == ORIGINAL
    extend_context(model, 1024)
    assert model.config.max_position_embeddings == 1024 * ORIGINAL


def test_extend_context_refuses_a_model_it_cannot_change() -> None:
    with pytest.raises(ValueError, match="already has rope_scaling"):
        extend_context(scaled_model(SCALINGS["linear"][0], ORIGINAL), 2.0)
    with pytest.raises(ValueError) as info:  # its rope_scaling's type and factor, not the whole dict's repr
        extend_context(scaled_model({"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "original_max_position_embeddings": ORIGINAL}, 4 * ORIGINAL), 2.0)
    assert str(info.value) == ("--rope_scaling_factor is not allowed: the model already has rope_scaling (rope_type "
                               "'yarn', factor 4.0); it extends only a model without one")
    with pytest.raises(ValueError, match="model_type='llama'"):
        extend_context(llama_from_mininorm(scaled_model(None, ORIGINAL)), 2.0)


@pytest.fixture(scope="module")
def short_model(tmp_path_factory, tokenizer):
    """A model directory trained (as far as its config says) on 32 positions."""
    folder = tmp_path_factory.mktemp("short") / "pretrain"
    torch.manual_seed(0)
    config = MiniNormConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, max_position_embeddings=32, norm_impl="eager",
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    save_model_dir(MiniNormForCausalLM(config).eval(), tokenizer, folder)
    return folder


def test_evaluate_reads_past_the_trained_length(short_model, tmp_path) -> None:
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"text": "the river " * 60}) + "\n" for _ in range(3)))
    plain = evaluate_model_dir(short_model, [str(data)], max_seq_len=128, batch_size=2)
    extended = evaluate_model_dir(short_model, [str(data)], max_seq_len=128, batch_size=2, rope_scaling_factor=4)
    assert (plain["max_seq_len"], extended["max_seq_len"]) == (32, 128)
    assert extended["results"]["long"]["loss"] != plain["results"]["long"]["loss"]  # other windows, other RoPE
    assert torch.isfinite(torch.tensor(extended["results"]["long"]["loss"]))


def test_chat_and_server_take_the_flag(short_model, capsys) -> None:
    assert chat_main(["--model_path", str(short_model), "--prompt", "The river", "--max_new_tokens", "40",
                      "--temperature", "0", "--rope_scaling_factor", "4", "--no_stream"]) == 0
    with pytest.raises(SystemExit) as refused:  # as the flag is read, before the model loads (tests/unit/test_cli.py)
        chat_main(["--model_path", str(short_model), "--prompt", "x", "--rope_scaling_factor", "0.5"])
    assert refused.value.code == 2
    assert "argument --rope_scaling_factor: 0.5 is not allowed" in capsys.readouterr().err.strip().splitlines()[-2]
    served = load_served_model(short_model, device="cpu", rope_scaling_factor=4)
    try:
        assert served.max_context == 128 and served.model.config.rope_scaling["factor"] == 4
    finally:
        served.engine.close()


def test_the_tools_scale_over_the_runs_recorded_length(short_model, tmp_path, capsys) -> None:
    """chat, evaluate and serve take L from the run's train_config.yaml (its --max_seq_len), and chat says so."""
    import shutil

    model_dir = tmp_path / "pretrain"
    shutil.copytree(short_model, model_dir)
    (model_dir / "train_config.yaml").write_text("task: pretrain\nmax_seq_len: 16\n")
    served = load_served_model(model_dir, device="cpu", rope_scaling_factor=4)
    try:  # 4 x 16 = 64 positions, over the model's 32
        assert served.max_context == 64 and served.model.config.rope_scaling["original_max_position_embeddings"] == 16
    finally:
        served.engine.close()
    assert chat_main(["--model_path", str(model_dir), "--prompt", "The river", "--max_new_tokens", "4",
                      "--rope_scaling_factor", "4", "--no_stream"]) == 0
    assert "YaRN x4 over the 16 trained positions: a context of 64 positions" in capsys.readouterr().err
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"text": "the river " * 60}) + "\n")
    assert evaluate_model_dir(model_dir, [str(data)], max_seq_len=128, rope_scaling_factor=4)["max_seq_len"] == 64


@pytest.mark.parametrize(("rope_type", "head_dim", "theta", "original", "factor"),
                         [("yarn", 64, 1e4, 4096, 4.0), ("yarn", 128, 1e6, 32768, 4.0), ("yarn", 128, 5e5, 8192, 8.0),
                          ("yarn", 64, 1e4, 65536, 2.0), ("linear", 64, 1e4, 4096, 4.0),
                          ("dynamic", 128, 1e6, 32768, 4.0)])
def test_inverse_frequencies_equal_transformers_at_real_model_lengths(rope_type: str, head_dim: int, theta: float,
                                                                      original: int, factor: float) -> None:
    """The frequencies and attention factor of transformers' rope init functions, for lengths and thetas of real
    models and with YaRN's betas left to their defaults (beta_fast 32, beta_slow 1): at the test models' short
    original length both ramp ends clamp to 0, which hides the defaults; at 65536 with theta 1e4 the slow end passes
    the last frequency and is clamped to head_dim - 1, as transformers clamps it. Dynamic scaling grows the base as
    soon as the sequence is longer than max_position_embeddings."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from model.rope import check_rope_scaling, inverse_frequencies

    scaling = {"rope_type": rope_type, "factor": factor}
    if rope_type == "yarn":
        scaling["original_max_position_embeddings"] = original
    max_positions = int(original * factor) if rope_type != "dynamic" else original
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=max_positions, rope_parameters={**scaling, "rope_theta": theta})
    seq_len = original * 3 // 2 if rope_type == "dynamic" else None  # past the length, not yet twice it
    want, want_factor = ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=seq_len)
    got, got_factor = inverse_frequencies(head_dim, theta, check_rope_scaling(scaling, max_positions), max_positions,
                                          seq_len=None if seq_len is None else torch.tensor(seq_len))
    torch.testing.assert_close(got, want, atol=0, rtol=1e-6)
    assert got_factor == pytest.approx(want_factor, rel=1e-12)
    assert not torch.allclose(got, inverse_frequencies(head_dim, theta, None, max_positions)[0])  # it scales


@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "yarn"])
def test_a_factor_of_1_is_accepted_and_scales_nothing(rope_type: str) -> None:
    """Some published config.json files carry {"type": "linear", "factor": 1.0}; transformers accepts a factor >= 1, and
    with 1 every frequency is plain RoPE's (while a sequence fits max_position_embeddings, for dynamic)."""
    config = MiniNormConfig(**SHAPE, max_position_embeddings=ORIGINAL, rope_scaling={"type": rope_type, "factor": 1.0})
    assert config.rope_scaling["rope_type"] == rope_type and config.rope_scaling["factor"] == 1.0
    from model.rope import inverse_frequencies

    plain, _ = inverse_frequencies(32, 1e4, None, ORIGINAL)
    got, attention_factor = inverse_frequencies(32, 1e4, config.rope_scaling, ORIGINAL,
                                                  seq_len=torch.tensor(ORIGINAL))  # dynamic: within the length
    torch.testing.assert_close(got, plain, atol=0, rtol=1e-6)
    assert attention_factor == 1.0


def test_the_trained_length_is_the_longest_over_the_runs_that_made_the_weights(tmp_path) -> None:
    """A DPO or LoRA run at 256 from an SFT at 384 trained rows of 384 too (YaRN over 256 gave a 2x 'extension' of
    no position, and squeezed 256-384); a GRPO run's rows are its prompts plus its completions (the session's
    reviewer)."""
    from trainer.run_dir import trained_length

    def run(name: str, text: str) -> Path:
        (tmp_path / name).mkdir()
        (tmp_path / name / "train_config.yaml").write_text(text)
        return tmp_path / name

    pre = run("pre", "task: pretrain\nmax_seq_len: 256\n")
    sft = run("sft", f"task: sft\nmax_seq_len: 384\nfrom_weight: {pre}\n")
    dpo = run("dpo", f"task: dpo\nmax_seq_len: 256\nfrom_weight: {sft}\n")
    grpo = run("grpo", f"task: grpo\nmax_seq_len: 400\nmax_completion_length: 64\nfrom_weight: {dpo}\n")
    lora = run("lora", f"task: lora\nmax_seq_len: 128\nfrom_weight: {pre}\n")
    loop = run("loop", f"task: sft\nmax_seq_len: 96\nfrom_weight: {tmp_path / 'loop'}\n")
    assert [trained_length(folder) for folder in (pre, sft, dpo, grpo, lora, loop)] == [256, 384, 384, 464, 256, 96]
    assert trained_length(sft, lora) == 384 and trained_length(tmp_path / "nothing") is None
    assert trained_length(tmp_path / "nothing", lora) == 256
    # a task edited into a list (or a mapping) by hand is no task: its own rows count, no default folder is followed
    edited = run("edited", "task: [sft]\nmax_seq_len: 200\n")
    assert trained_length(edited) == 200
    # a length edited into no length is named, where it was read as none (the tools' default length, no word): in
    # the folder itself or in a run before it; a GRPO run's completion length too
    damaged = run("damaged", "task: pretrain\nmax_seq_len: '256'\n")
    after = run("after", f"task: sft\nmax_seq_len: 96\nfrom_weight: {damaged}\n")
    rollouts = run("rollouts", "task: grpo\nmax_seq_len: 96\nmax_completion_length: 0.5\n")
    for folder, named, key in ((damaged, damaged, "max_seq_len"), (after, damaged, "max_seq_len"),
                               (rollouts, rollouts, "max_completion_length")):
        with pytest.raises(ValueError, match=rf"^{named}/train_config.yaml: {key} is .*, expected an integer >= 1"):
            trained_length(folder)


def test_evaluates_rows_with_a_factor_are_the_trained_ones_times_it(tokenizer, tmp_path) -> None:
    """A model without a record (an import, 32k-40k positions) took F x its max_position_embeddings as the row
    length: a 4096-position model at factor 4 asked for rows of 16384 tokens (the session's reviewer). Now: 256
    (the rows of a model that records none) times F."""
    folder = tmp_path / "imported"
    config = MiniNormConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, max_position_embeddings=1024, norm_impl="eager",
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    save_model_dir(MiniNormForCausalLM(config).eval(), tokenizer, folder)
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"text": "the river " * 300}) + "\n" for _ in range(4)))
    assert evaluate_model_dir(folder, [str(data)], rope_scaling_factor=2)["max_seq_len"] == 512  # not 2048
