"""Distillation (trainer/distillation.py): the loss, its CE and KL, and its gradient against an fp64 computation
written out here with the math module; the objective on a hand-made batch (a larger teacher, masked tokens, padding)
against the same reference from each model's own logits; KL = 0 when teacher == student; the teacher is refused in
one line unless it shares the student's tokenizer and vocabulary."""

from __future__ import annotations

import copy
import math
from contextlib import nullcontext

import pytest
import torch

from model import MiniNormConfig, MiniNormForCausalLM
from trainer.distillation import Distillation, load_teacher, tokenizer_mismatch
from trainer.distillation_losses import distillation_losses

VOCAB = 13


def _softmax(row: list[float], temperature: float = 1.0) -> list[float]:
    top = max(row)
    exps = [math.exp((x - top) / temperature) for x in row]
    return [e / sum(exps) for e in exps]


def _reference(student: list[float], teacher: list[float], target: int, alpha: float,
               temperature: float) -> tuple[float, float, float, list[float]]:
    """(loss, CE, KL, d loss / d student logits) of one token, in Python floats (fp64). The gradient: CE gives
    softmax(s) - onehot, and T^2 KL(q_t || q_s) with q = softmax(. / T) gives T (q_s - q_t)."""
    p = _softmax(student)
    ce = -math.log(p[target])
    q_s, q_t = _softmax(student, temperature), _softmax(teacher, temperature)
    kl = sum(t * (math.log(t) - math.log(s)) for t, s in zip(q_t, q_s))
    loss = alpha * ce + (1 - alpha) * temperature ** 2 * kl
    grad = [alpha * (p[v] - (v == target)) + (1 - alpha) * temperature * (q_s[v] - q_t[v]) for v in range(len(p))]
    return loss, ce, kl, grad


@pytest.mark.parametrize("alpha, temperature", [(0.5, 2.0), (0.0, 1.0), (1.0, 3.0), (0.3, 0.7)])
def test_loss_ce_kl_and_gradient_match_fp64_by_hand(alpha, temperature):
    generator = torch.Generator().manual_seed(0)
    student = (3 * torch.randn(5, VOCAB, generator=generator, dtype=torch.float64)).requires_grad_(True)
    teacher = 3 * torch.randn(5, VOCAB, generator=generator, dtype=torch.float64)
    targets = torch.tensor([0, 4, 12, 7, 4])
    losses, ce, kl = distillation_losses(student, teacher, targets, alpha, temperature)
    losses.sum().backward()
    for n in range(5):
        loss, ref_ce, ref_kl, grad = _reference(student[n].tolist(), teacher[n].tolist(), int(targets[n]), alpha,
                                                temperature)
        assert losses[n].item() == pytest.approx(loss, rel=1e-12, abs=1e-12)
        assert ce[n].item() == pytest.approx(ref_ce, rel=1e-12)
        assert kl[n].item() == pytest.approx(ref_kl, rel=1e-10, abs=1e-12)
        assert student.grad[n].tolist() == pytest.approx(grad, rel=1e-10, abs=1e-12)


def _model(hidden: int, layers: int, seed: int) -> MiniNormForCausalLM:
    torch.manual_seed(seed)
    config = MiniNormConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
                            num_key_value_heads=1, max_position_embeddings=16, norm_impl="eager")
    model = MiniNormForCausalLM(config).double().eval()
    with torch.no_grad():  # untrained weights are near-uniform: spread the logits so the two models differ clearly
        for parameter in model.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    return model


# Two rows, right-padded (pad id 0, attention 0); -100 marks unsupervised tokens (a prompt, the padding).
INPUT_IDS = torch.tensor([[5, 3, 8, 1, 9, 2], [7, 7, 2, 11, 0, 0]])
ATTENTION = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
LABELS = torch.tensor([[-100, -100, 8, 1, 9, 2], [-100, 7, 2, 11, -100, -100]])


def test_objective_on_a_hand_made_batch_with_a_larger_teacher():
    student, teacher = _model(16, 1, seed=1), _model(32, 3, seed=2)
    alpha, temperature = 0.4, 1.7
    objective = Distillation(teacher, alpha, temperature, nullcontext)
    batch = {"input_ids": INPUT_IDS, "attention_mask": ATTENTION, "labels": LABELS}
    num_items = objective.count_items(batch)
    assert int(num_items) == 7  # targets labels[t + 1]: 4 in the first row, 3 in the second
    loss, stat_sums = objective.loss(student, batch, num_items=torch.tensor(10))  # e.g. a step of two micro-batches
    total = ce_sum = kl_sum = 0.0
    for row in range(2):
        length = int(ATTENTION[row].sum())
        ids = INPUT_IDS[row:row + 1, :length]  # each row alone, unpadded: no mask involved
        with torch.no_grad():
            s_logits, t_logits = student(input_ids=ids).logits[0], teacher(input_ids=ids).logits[0]
        for t in range(length - 1):
            target = int(LABELS[row, t + 1])
            if target == -100:
                continue
            value, ce, kl, _ = _reference(s_logits[t].tolist(), t_logits[t].tolist(), target, alpha, temperature)
            total, ce_sum, kl_sum = total + value, ce_sum + ce, kl_sum + kl
    assert loss.item() == pytest.approx(total / 10, rel=1e-9)
    assert stat_sums.tolist() == pytest.approx([ce_sum, kl_sum], rel=1e-9)
    loss.backward()
    assert all(p.grad is None for p in teacher.parameters())  # the teacher is frozen
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in student.parameters())


def test_kl_is_zero_when_the_teacher_is_the_student():
    student = _model(16, 2, seed=3)
    objective = Distillation(copy.deepcopy(student), 0.0, 2.0, nullcontext)
    batch = {"input_ids": INPUT_IDS, "attention_mask": ATTENTION, "labels": LABELS}
    loss, stat_sums = objective.loss(student, batch, num_items=objective.count_items(batch))
    assert stat_sums[0].item() > 1  # the CE is not 0 ...
    assert stat_sums[1].item() == pytest.approx(0.0, abs=1e-12)  # ... the KL is
    assert loss.item() == pytest.approx(0.0, abs=1e-12)  # alpha = 0: only the KL term
    loss.backward()
    assert max(p.grad.abs().max().item() for p in student.parameters()) < 1e-12


def _save(tmp_path, name: str, tokenizer, vocab_size: int):
    config = MiniNormConfig(vocab_size=vocab_size, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, max_position_embeddings=16)
    path = tmp_path / name
    MiniNormForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_a_teacher_is_refused_unless_it_shares_the_tokenizer(tokenizer, tmp_path):
    same = _save(tmp_path, "same", tokenizer, len(tokenizer))
    assert isinstance(load_teacher(str(same), tokenizer, len(tokenizer)), MiniNormForCausalLM)

    other = copy.deepcopy(tokenizer)
    other.add_tokens(["<|teacher_only|>"])
    with pytest.raises(ValueError) as error:
        load_teacher(str(_save(tmp_path, "more_tokens", other, len(other))), tokenizer, len(tokenizer))
    message = str(error.value)
    assert "\n" not in message and message.startswith("--teacher ") and "its tokenizer differs" in message
    assert f"{len(other)} tokens in the teacher's vocabulary, {len(tokenizer)} in the student's" in message

    with pytest.raises(ValueError, match="vocab_size 100, the student's is"):
        load_teacher(str(_save(tmp_path, "other_vocab", tokenizer, 100)), tokenizer, len(tokenizer))
    with pytest.raises(FileNotFoundError, match="no model there; create it with"):
        load_teacher(str(tmp_path / "nothing"), tokenizer, len(tokenizer))


class _Vocab:
    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


def test_tokenizers_of_one_size_with_other_ids_differ():
    student = _Vocab({"a": 0, "b": 1, "c": 2})
    assert tokenizer_mismatch(student, _Vocab({"a": 0, "b": 1, "c": 2})) is None
    differ = "{} of 3 tokens have another id or are missing"
    assert tokenizer_mismatch(student, _Vocab({"a": 0, "b": 2, "c": 1})) == differ.format(2)
    assert tokenizer_mismatch(student, _Vocab({"a": 0, "b": 1, "d": 2})) == differ.format(1)


@pytest.mark.parametrize("flags, message", [
    (["--alpha", "1.5"], "--alpha=1.5 is not allowed; it must be in [0, 1]"),
    (["--temperature", "0"], "--temperature=0.0 is not allowed; it must be a positive number"),
    (["--distill_data", "dpo"], "--distill_data='dpo' is not allowed; choose one of sft, pretrain"),
])
def test_bad_distillation_flags_are_one_line(flags, message, capsys):
    from trainer.args import parse_args

    with pytest.raises(SystemExit):
        parse_args("distill", flags)
    assert capsys.readouterr().err.splitlines()[0] == f"error: {message}"
