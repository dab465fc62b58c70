"""GKD in the distillation objective (trainer/distillation.py): the generalized JSD at beta 0, 1 and between, its
value and gradient against fp64 formulas written out here with the math module (and equal to the KL forms at 0
and 1); a step's batch with --lmbda 1 trains on completions the student samples for the data's prompts, with
--seq_kd on the teacher's, with the sampled tokens as labels; the step's choice is a digest of (seed, step) and the
completions' seeds do not depend on how the step is split between processes; the flags' one-line refusals; a
checkpoint recorded before the flags existed is read as Hinton's KL on the data's answers."""

from __future__ import annotations

import math
from contextlib import nullcontext

import pytest
import torch

from dataset.chat_format import IM_END
from model import MiniNormConfig, MiniNormForCausalLM
from model.generation import GenerationEngine
from trainer import distillation
from trainer.distillation import (CompletionSettings, CompletionSource, Distillation, last_answer_start, step_source,
                                  with_completions)
from trainer.distillation_losses import distillation_losses, soft_divergences

VOCAB = 11


def _softmax(row: list[float], temperature: float) -> list[float]:
    top = max(row)
    exps = [math.exp((x - top) / temperature) for x in row]
    return [e / sum(exps) for e in exps]


def _kl(p: list[float], q: list[float]) -> float:
    return sum(a * (math.log(a) - math.log(b)) for a, b in zip(p, q))


def _jsd_by_hand(student: list[float], teacher: list[float], beta: float, temperature: float
                 ) -> tuple[float, list[float]]:
    """(generalized JSD, its gradient in the student's logits) in Python floats. q = softmax(logits / T); beta 0:
    KL(q_t || q_s), 1: KL(q_s || q_t), else beta KL(q_t || m) + (1 - beta) KL(q_s || m) with m = beta q_t +
    (1 - beta) q_s. The gradient: d/dq_s is (1 - beta) log(q_s / m) (the reverse KL's log(q_s / q_t) + 1, whose 1
    the softmax cancels), through the softmax q_s (g - <g>_q_s), and 1/T for the logits; the forward KL's is
    (q_s - q_t) / T."""
    q_s, q_t = _softmax(student, temperature), _softmax(teacher, temperature)
    if beta == 0:
        return _kl(q_t, q_s), [(s - t) / temperature for s, t in zip(q_s, q_t)]
    if beta == 1:
        g = [math.log(s) - math.log(t) for s, t in zip(q_s, q_t)]
        value = _kl(q_s, q_t)
    else:
        m = [beta * t + (1 - beta) * s for s, t in zip(q_s, q_t)]
        g = [(1 - beta) * (math.log(s) - math.log(x)) for s, x in zip(q_s, m)]
        value = beta * _kl(q_t, m) + (1 - beta) * _kl(q_s, m)
    mean = sum(s * x for s, x in zip(q_s, g))
    return value, [s * (x - mean) / temperature for s, x in zip(q_s, g)]


def _logits(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    student = 3 * torch.randn(4, VOCAB, generator=generator, dtype=torch.float64)
    return student, 3 * torch.randn(4, VOCAB, generator=generator, dtype=torch.float64)


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5, 0.2])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_the_jsd_and_its_gradient_match_fp64_by_hand(beta, temperature):
    student, teacher = _logits(seed=1)
    student.requires_grad_(True)
    values = soft_divergences(student, teacher, temperature, "jsd", beta)
    values.sum().backward()
    for n in range(len(student)):
        value, grad = _jsd_by_hand(student[n].tolist(), teacher[n].tolist(), beta, temperature)
        assert values[n].item() == pytest.approx(value, rel=1e-10, abs=1e-12)
        assert student.grad[n].tolist() == pytest.approx(grad, rel=1e-8, abs=1e-12)
    assert (values > 0).all()


def test_the_jsd_is_the_forward_kl_at_beta_0_and_the_reverse_kl_at_beta_1():
    student, teacher = _logits(seed=2)
    forward = soft_divergences(student, teacher, 2.0, "kl")
    assert torch.equal(soft_divergences(student, teacher, 2.0, "jsd", 0.0), forward)
    reverse = soft_divergences(teacher, student, 2.0, "kl")  # KL(q_s || q_t): the arguments swapped
    assert torch.equal(soft_divergences(student, teacher, 2.0, "jsd", 1.0), reverse)
    assert not torch.allclose(forward, reverse)
    # the mixture's formula tends to 0 at both ends, which is why beta 0 and 1 are the KLs themselves (TRL's)
    assert soft_divergences(student, teacher, 2.0, "jsd", 1e-6).abs().max() < 1e-4


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_the_loss_weighs_the_jsd_as_the_kl(beta):
    """alpha x CE + (1 - alpha) x T^2 x JSD, and --distill_loss jsd --jsd_beta 0 is today's loss bit for bit."""
    student, teacher = _logits(seed=3)
    targets = torch.tensor([0, 5, 10, 3])
    losses, ce, jsd = distillation_losses(student, teacher, targets, 0.3, 1.5, "jsd", beta)
    for n in range(4):
        hand_ce = -math.log(_softmax(student[n].tolist(), 1.0)[int(targets[n])])
        hand_jsd, _ = _jsd_by_hand(student[n].tolist(), teacher[n].tolist(), beta, 1.5)
        assert ce[n].item() == pytest.approx(hand_ce, rel=1e-12)
        assert losses[n].item() == pytest.approx(0.3 * hand_ce + 0.7 * 1.5 ** 2 * hand_jsd, rel=1e-10)
    if beta == 0:
        assert all(torch.equal(a, b) for a, b in zip((losses, ce, jsd),
                                                     distillation_losses(student, teacher, targets, 0.3, 1.5)))


def test_the_last_answer_starts_after_the_conversation_before_it():
    assert last_answer_start([-100, -100, 5, 6, -100, -100, 7, 8, 9, -100]) == 6
    assert last_answer_start([-100, 4, -100]) == 1
    assert last_answer_start([-100, -100]) is None
    assert last_answer_start([3, 4, 5]) == 0


def test_a_completion_replaces_its_rows_last_answer_and_a_row_without_one_is_kept():
    """Row 0: prompt [5, 6] then the completion [7, 8, 9] (labels -100 on the prompt); row 1, whose answer the
    data's truncation cut away (nothing supervised), keeps its three tokens, unsupervised; right-padded with 0."""
    batch = {"input_ids": torch.tensor([[5, 6, 3, 4, 0], [1, 2, 3, 0, 0]]),
             "labels": torch.tensor([[-100, -100, 3, 4, -100], [-100] * 5]),
             "attention_mask": torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])}
    out = with_completions(batch, {0: (2, [7, 8, 9])}, pad_id=0)
    assert out["input_ids"].tolist() == [[5, 6, 7, 8, 9], [1, 2, 3, 0, 0]]
    assert out["labels"].tolist() == [[-100, -100, 7, 8, 9], [-100] * 5]
    assert out["attention_mask"].tolist() == [[1] * 5, [1, 1, 1, 0, 0]]
    longer = with_completions(batch, {0: (2, [7, 8, 9, 10, 11])}, pad_id=0)
    assert longer["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11], [1, 2, 3, 0, 0, 0, 0]]
    assert longer["labels"][1].tolist() == [-100] * 7 and longer["attention_mask"][1].tolist() == [1] * 3 + [0] * 4


def test_the_steps_choice_is_a_seeded_draw_of_probability_lmbda():
    sometimes = CompletionSettings(lmbda=0.3)
    draws = [step_source(7, step, sometimes) for step in range(2000)]
    assert draws == [step_source(7, step, sometimes) for step in range(2000)]  # a resumed run draws the same
    assert 0.27 < draws.count(CompletionSource.STUDENT) / 2000 < 0.33
    assert set(draws) == {CompletionSource.STUDENT, CompletionSource.DATA}
    assert draws != [step_source(8, step, sometimes) for step in range(2000)]  # another seed, other steps
    assert {step_source(7, step, CompletionSettings(lmbda=1.0)) for step in range(200)} == {CompletionSource.STUDENT}
    assert {step_source(7, step, CompletionSettings()) for step in range(200)} == {CompletionSource.DATA}
    with_teacher = [step_source(7, step, CompletionSettings(lmbda=0.3, seq_kd=True)) for step in range(2000)]
    assert with_teacher == [CompletionSource.TEACHER if d == CompletionSource.DATA else d for d in draws]


def _model(vocab: int, hidden: int, seed: int) -> MiniNormForCausalLM:
    torch.manual_seed(seed)
    config = MiniNormConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=64, norm_impl="eager")
    return MiniNormForCausalLM(config)


def _chat_batch(tokenizer) -> dict[str, torch.Tensor]:
    """Two right-padded rows: a two-turn conversation (its first answer is kept as context) and a one-turn one."""
    from dataset.sft_dataset import collate_rows

    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    rows = [([30, 31, 32, 40, 41, im_end, 33, 34, 42, 43, 44, im_end], [-100] * 3 + [40, 41, im_end] + [-100] * 2
             + [42, 43, 44, im_end]),
            ([50, 51, 60, 61, im_end], [-100, -100, 60, 61, im_end])]
    return collate_rows([{"input_ids": torch.tensor(ids), "labels": torch.tensor(labels)} for ids, labels in rows],
                        tokenizer.pad_token_id)


class _Recorder:
    """trainer.distillation's sample_completions, recording its calls."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.real = distillation.sample_completions

    def __call__(self, model, tokenizer, prompt_ids, settings, decode):
        completions = self.real(model, tokenizer, prompt_ids, settings, decode)
        self.calls.append({"model": model, "prompts": [list(p) for p in prompt_ids], "settings": list(settings),
                           "completions": completions})
        return completions


@pytest.mark.parametrize("sampler", ["student", "teacher"])
def test_a_sampled_step_trains_on_the_samplers_completions(sampler, tokenizer, monkeypatch):
    """--lmbda 1: the student's completions; --seq_kd (lmbda 0): the teacher's. Each row's prompt is the row
    before its last answer; the labels are the sampled tokens (the end-of-turn token included), not the data's;
    each completion is the one the sampler generates alone for that prompt with that seed."""
    recorder = _Recorder()
    monkeypatch.setattr(distillation, "sample_completions", recorder)
    student, teacher = _model(len(tokenizer), 32, seed=1), _model(len(tokenizer), 48, seed=2)
    # the static step decoded eagerly (--compile off's): what is sampled, not how it decodes, is tested here;
    # compiling it per test cost 10-40 s (the compiled step equals it: test_decode_step)
    settings = CompletionSettings(lmbda=1.0 if sampler == "student" else 0.0, seq_kd=sampler == "teacher",
                                  max_new_tokens=5, temperature=1.3, decode="static")
    objective = Distillation(teacher, 0.5, 2.0, nullcontext, "jsd", 0.5, settings, tokenizer, seed=11)
    data = _chat_batch(tokenizer)
    [batch] = objective.rollouts(student, [data], step=4, accelerator=None)
    [call] = recorder.calls
    assert call["model"] is (student if sampler == "student" else teacher)
    assert call["prompts"] == [data["input_ids"][0, :8].tolist(), data["input_ids"][1, :2].tolist()]
    for row, (prompt, completion, setting) in enumerate(zip(call["prompts"], call["completions"], call["settings"])):
        assert (setting.temperature, setting.max_new_tokens, setting.top_p) == (1.3, 5, 1.0)
        alone = GenerationEngine(call["model"], tokenizer, max_batch=1).generate(prompt, setting).token_ids
        assert completion == alone and 1 <= len(completion) <= 5
        length = len(prompt) + len(completion)
        assert batch["input_ids"][row, :length].tolist() == prompt + completion
        assert batch["labels"][row, :length].tolist() == [-100] * len(prompt) + completion
        assert batch["attention_mask"][row].tolist() == [1] * length + [0] * (batch["input_ids"].shape[1] - length)
        assert (batch["labels"][row, length:] == -100).all()
    assert batch["labels"][0, 8:12].tolist() != [42, 43, 44, tokenizer.convert_tokens_to_ids(IM_END)]
    assert int(objective.count_items(batch)) == sum(len(c) for c in call["completions"])
    loss, stats = objective.loss(student, batch, objective.count_items(batch))
    assert objective.stat_names == (("ce", "jsd", "on_policy") if sampler == "student" else ("ce", "jsd"))
    if sampler == "student":  # the on-policy share of the step's tokens: all of them
        assert stats[2].item() == int(objective.count_items(batch))
    loss.backward()
    assert all(p.grad is None for p in teacher.parameters())
    [again] = objective.rollouts(student, [data], step=4, accelerator=None)
    assert torch.equal(again["input_ids"], batch["input_ids"])  # the same step samples the same completions


def test_a_data_step_trains_on_the_data_and_samples_nothing(tokenizer, monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(distillation, "sample_completions", recorder)
    objective = Distillation(_model(len(tokenizer), 32, seed=2), 0.5, 2.0, nullcontext,
                             completions=CompletionSettings(lmbda=0.3), tokenizer=tokenizer, seed=7)
    data_step = next(step for step in range(50) if step_source(7, step, objective.completions) == "data")
    data = _chat_batch(tokenizer)
    [batch] = objective.rollouts(_model(len(tokenizer), 32, seed=1), [data], step=data_step, accelerator=None)
    assert batch is data and recorder.calls == []
    _, stats = objective.loss(_model(len(tokenizer), 32, seed=1), batch, objective.count_items(batch))
    assert stats[2].item() == 0  # on_policy: none of the step's tokens


@pytest.mark.parametrize("settings", [CompletionSettings(lmbda=0.5), CompletionSettings(seq_kd=True)])
def test_sampling_completions_without_the_tokenizer_is_refused(settings):
    """--lmbda > 0 or --seq_kd alone samples, which needs the tokenizer: refused when built without it (mutants that
    dropped the check, or seq_kd from `samples`, survived)."""
    assert settings.samples
    with pytest.raises(ValueError, match=r"^sampling completions \(lmbda > 0 or seq_kd\) needs the tokenizer$"):
        Distillation(_model(VOCAB, 32, seed=2), 0.5, 2.0, nullcontext, completions=settings)


def test_a_completions_seed_is_its_rows_place_in_the_steps_global_batch(tokenizer, monkeypatch):
    """One process with both rows samples them with the seeds two processes of one row each do."""
    recorder = _Recorder()
    monkeypatch.setattr(distillation, "sample_completions", recorder)
    student, teacher = _model(len(tokenizer), 32, seed=1), _model(len(tokenizer), 32, seed=2)
    settings = CompletionSettings(lmbda=1.0, max_new_tokens=3, decode="static")  # not compiled: as above
    data = _chat_batch(tokenizer)
    Distillation(teacher, 0.5, 2.0, nullcontext, completions=settings, tokenizer=tokenizer, seed=3).rollouts(
        student, [data], step=2, accelerator=None)
    for process in (0, 1):
        row = {name: tensor[process:process + 1] for name, tensor in data.items()}
        Distillation(teacher, 0.5, 2.0, nullcontext, completions=settings, tokenizer=tokenizer, seed=3,
                     process_index=process, world=2).rollouts(student, [row], step=2, accelerator=None)
    one, *two = recorder.calls
    assert [s.seed for s in one["settings"]] == [call["settings"][0].seed for call in two]
    assert len({s.seed for s in one["settings"]}) == 2
    assert one["completions"] == [call["completions"][0] for call in two]


def test_pretraining_text_has_no_prompt_to_sample_for(tokenizer):
    objective = Distillation(_model(len(tokenizer), 32, seed=2), 0.5, 2.0, nullcontext,
                             completions=CompletionSettings(lmbda=1.0), tokenizer=tokenizer)
    text = {"input_ids": torch.tensor([[5, 6, 7]]), "labels": torch.tensor([[5, 6, 7]]),
            "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    with pytest.raises(ValueError, match="use --distill_data sft$"):
        objective.rollouts(_model(len(tokenizer), 32, seed=1), [text], step=0, accelerator=None)


def test_a_rows_empty_last_answer_is_sampled_for_after_the_conversation_before_it(tokenizer, tmp_path):
    """A conversation whose last assistant turn is empty (MiniMind's rlaif.jsonl, read with empty_answers for a run
    whose every step samples) after an answered turn: the completion answers the whole conversation before that
    turn, prompted as a generation prompt is (the earlier answer kept, the open header and the closed empty think
    block of encode_chatml's add_generation_prompt), and replaces only the empty turn's <|im_end|>."""
    from dataset.chat_format import encode_chatml
    from dataset.sft_dataset import SFTDataset
    from tests.training_runs import write_jsonl

    before = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
              {"role": "user", "content": "Again?"}]
    path = write_jsonl(tmp_path / "rlaif.jsonl", [{"conversations": [*before, {"role": "assistant", "content": ""}]}])
    row = SFTDataset(path, tokenizer, 512, cache_dir=tmp_path / "cache", empty_answers=True)[0]
    ids, labels = row["input_ids"].tolist(), row["labels"].tolist()
    start = last_answer_start(labels)
    assert ids[:start] == encode_chatml(tokenizer, before, add_generation_prompt=True).input_ids
    assert ids[start] == labels[start] == tokenizer.convert_tokens_to_ids(IM_END)
    assert set(labels[start + 1:]) <= {-100}  # the newline after it, unsupervised


SAMPLED = ("it must be in 1e-05 .. 2 (OpenAI's range, chat's and the server's, less its 0: the completions are "
           "sampled)")


@pytest.mark.parametrize("flags, message", [
    (["--distill_loss", "tvd"], "--distill_loss='tvd' is not allowed; choose one of kl, jsd"),
    (["--distill_loss", "jsd", "--jsd_beta", "1.5"], "--jsd_beta=1.5 is not allowed; it must be in [0, 1]"),
    (["--jsd_beta", "0.2"], "--jsd_beta=0.2 is not allowed; only --distill_loss jsd uses it: give --distill_loss "
                            "jsd with it, or leave --jsd_beta out"),
    (["--lmbda", "-0.1"], "--lmbda=-0.1 is not allowed; it must be in [0, 1]"),
    (["--lmbda", "1", "--max_new_tokens", "0"], "--max_new_tokens=0 is not allowed; it must be >= 1"),
    (["--seq_kd", "--sampling_temperature", "0"], f"--sampling_temperature=0.0 is not allowed; {SAMPLED}"),
    # past OpenAI's 2 every token was all but equally likely (1e308 divided the logits to zeros), as chat's flag
    (["--seq_kd", "--sampling_temperature", "2.5"], f"--sampling_temperature=2.5 is not allowed; {SAMPLED}"),
    (["--max_new_tokens", "16"], "--max_new_tokens=16 is not allowed; only --lmbda > 0 or --seq_kd (sampled "
                                 "completions) uses it: give --lmbda or --seq_kd with it, or leave --max_new_tokens "
                                 "out"),
    # --lmbda 1 samples the student's completions at every step: the teacher's (--seq_kd) would never be used
    (["--lmbda", "1", "--seq_kd"], "--seq_kd=True is not allowed; with --lmbda 1 every step trains on the student's "
                                   "completions, never on the teacher's: leave one of them out"),
    (["--lmbda", "0.5", "--distill_data", "pretrain"], "--lmbda=0.5 is not allowed; a sampled completion answers a "
                                                       "conversation's prompt, which pretraining text has none of: use "
                                                       "--distill_data sft"),
    (["--seq_kd", "--distill_data", "pretrain"], "--seq_kd=True is not allowed; a sampled completion answers a "
                                                 "conversation's prompt, which pretraining text has none of: use "
                                                 "--distill_data sft"),
    (["--lmbda", "1.5"], "--lmbda=1.5 is not allowed; it must be in [0, 1]"),
    (["--seq_kd", "--sampling_temperature", "inf"], f"--sampling_temperature=inf is not allowed; {SAMPLED}"),
    (["--sampling_temperature", "0.5"], "--sampling_temperature=0.5 is not allowed; only --lmbda > 0 or --seq_kd "
                                        "(sampled completions) uses it: give --lmbda or --seq_kd with it, or leave "
                                        "--sampling_temperature out"),
])
def test_bad_gkd_flags_are_one_line(flags, message, capsys):
    from trainer.args import parse_args

    with pytest.raises(SystemExit):
        parse_args("distill", flags)
    assert capsys.readouterr().err.splitlines()[0] == f"error: {message}"


@pytest.mark.parametrize("flags, expected", [
    (["--distill_loss", "jsd", "--jsd_beta", "0"], {"jsd_beta": 0.0}),
    (["--distill_loss", "jsd", "--jsd_beta", "1"], {"jsd_beta": 1.0}),
    (["--lmbda", "1"], {"lmbda": 1.0}),
    (["--seq_kd", "--max_new_tokens", "16", "--sampling_temperature", "0.5"],
     {"seq_kd": True, "max_new_tokens": 16, "sampling_temperature": 0.5}),
])
def test_gkd_flags_at_their_bounds_are_taken(flags, expected):
    """The ends of [0, 1] (beta 0 and 1: the forward and reverse KL) and --seq_kd's own sampling flags are taken
    (mutants that refused them survived)."""
    from trainer.args import parse_args

    args = parse_args("distill", flags)
    assert {name: getattr(args, name) for name in expected} == expected


def test_a_checkpoint_from_before_the_gkd_flags_is_hintons_kl_on_the_data():
    """Resuming a distillation recorded before the flags existed with the defaults notes nothing; with GKD's
    settings it notes each one (it was silent: the flags are not in its config)."""
    from trainer.args import parse_args
    from trainer.resume_checks import changed_flags

    old = {"config": {"task": "distill", "alpha": 0.5, "temperature": 2.0}}
    assert changed_flags(old, parse_args("distill", []).to_dict()) == ""
    gkd = parse_args("distill", ["--distill_loss", "jsd", "--lmbda", "0.5", "--seq_kd"]).to_dict()
    assert changed_flags(old, gkd) == ("--distill_loss was kl there and is jsd now, --lmbda was 0.0 there and is 0.5 "
                                       "now, --seq_kd was False there and is True now")
    recorded = {"config": {**old["config"], "distill_loss": "jsd", "jsd_beta": 0.5, "lmbda": 0.5, "seq_kd": True}}
    assert changed_flags(recorded, gkd) == ""
