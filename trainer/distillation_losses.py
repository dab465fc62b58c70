"""Knowledge distillation's loss as pure functions of logits (no model, no data; trainer/distillation.py is its
objective): Hinton's KL at temperature T (Hinton et al. 2015) or GKD's generalized Jensen-Shannon divergence
(Agarwal et al. 2024; TRL's generalized_jsd_loss), beside alpha x the CE to the labels. Kept apart from the
objective so that the run's flags (trainer/args.py) can name the divergences without loading the data and
sampling code the objective needs.
"""

from __future__ import annotations

import math
from enum import StrEnum

import torch
import torch.nn.functional as F


class DistillLoss(StrEnum):
    """The soft term's divergence (--distill_loss)."""

    KL = "kl"    # Hinton's KL(p_teacher^T || p_student^T)
    JSD = "jsd"  # GKD's generalized Jensen-Shannon divergence, interpolated by --jsd_beta


def soft_divergences(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float,
                     loss: str = DistillLoss.KL, beta: float = 0.5) -> torch.Tensor:
    """The per-row divergence between q_t = softmax(teacher / T) and q_s = softmax(student / T), logits (N, V) ->
    (N,), in the logits' dtype. kl: KL(q_t || q_s). jsd (TRL's generalized_jsd_loss): with the mixture
    m = beta q_t + (1 - beta) q_s, beta KL(q_t || m) + (1 - beta) KL(q_s || m); at beta 0 and 1, where that sum
    vanishes, the forward KL(q_t || q_s) and the reverse KL(q_s || q_t) themselves, as TRL's."""
    student_log_p = F.log_softmax(student_logits / temperature, dim=-1)
    teacher_log_p = F.log_softmax(teacher_logits / temperature, dim=-1)
    if loss == DistillLoss.KL or beta == 0:
        return (teacher_log_p.exp() * (teacher_log_p - student_log_p)).sum(dim=-1)
    if beta == 1:
        return (student_log_p.exp() * (student_log_p - teacher_log_p)).sum(dim=-1)
    mixture_log_p = torch.logsumexp(torch.stack([teacher_log_p + math.log(beta),
                                                 student_log_p + math.log1p(-beta)]), dim=0)
    to_teacher = (teacher_log_p.exp() * (teacher_log_p - mixture_log_p)).sum(dim=-1)
    to_student = (student_log_p.exp() * (student_log_p - mixture_log_p)).sum(dim=-1)
    return beta * to_teacher + (1 - beta) * to_student


def distillation_losses(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor,
                        alpha: float, temperature: float, loss: str = DistillLoss.KL,
                        beta: float = 0.5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-token loss, per-token CE, per-token soft divergence) for N supervised tokens: logits (N, V), targets
    (N,), in fp32 (fp64 inputs stay fp64). The divergence is soft_divergences' (`loss`, `beta`), before the
    (1 - alpha) T^2 weight."""
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    student, teacher = student_logits.to(dtype), teacher_logits.to(dtype)
    ce = F.cross_entropy(student, targets, reduction="none")
    divergence = soft_divergences(student, teacher, temperature, loss, beta)
    return alpha * ce + (1 - alpha) * temperature ** 2 * divergence, ce, divergence
