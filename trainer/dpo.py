"""Direct Preference Optimization (Rafailov et al. 2023): the DPO loss and its objective for the training core.

For a prompt x with a chosen answer y_c and a rejected one y_r, the policy pi (being trained) and the frozen
reference model (the starting weights) give summed log-probabilities of each answer's tokens; the implicit
rewards are r_c = beta * (log pi(y_c|x) - log ref(y_c|x)) and r_r likewise, and the loss is

    -log sigmoid(r_c - r_r) = -log sigmoid(beta * ((pi_c - pi_r) - (ref_c - ref_r)))

averaged over pairs (--loss_type sigmoid, the default). --label_smoothing eps gives conservative DPO (Mitchell
2023, "A note on DPO with noisy preferences and relationship to IPO": each label flipped with probability eps):
-(1 - eps) log sigmoid(h) - eps log sigmoid(-h), h = r_c - r_r. --loss_type hinge is SLiC's (Zhao et al. 2023,
arXiv:2305.10425) max(0, 1 - h); ipo is IPO's (Azar et al. 2023, arXiv:2310.12036, equation 17) squared loss
(d - 1 / (2 beta))^2 on d = the per-token mean of (log pi - log ref) of the chosen answer minus the rejected's, the
mean over each answer's tokens as TRL's DPOTrainer takes it. The answer's tokens are its content and closing
<|im_end|> (dataset/dpo_dataset.py, the SFT mask rule restricted to the final answer). The reference's
log-probabilities are computed once per batch without gradients, in the same autocast as the policy's forward, so
at the first step r_c = r_r = 0 and the loss is log 2 (sigmoid, whatever eps), 1 (hinge) or 1 / (4 beta^2) (ipo).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from enum import StrEnum
from typing import Callable

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader

from model.model import shift_labels
from trainer.evaluation import LoggedEval
from trainer.run_dir import DPO_VAL_METRICS

STAT_NAMES = tuple(name for name in DPO_VAL_METRICS.values() if name != "loss")  # what a pair adds beside its loss


def sequence_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per row, the sum of log p(label[t + 1] | tokens up to t) over the labelled targets (-100: not counted), in
    fp32: the log-probability of a row's labelled tokens given what precedes them."""
    targets = shift_labels(labels)
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=-100,
                          reduction="none")
    return -nll.view(targets.shape).sum(dim=-1)


class DPOLossType(StrEnum):
    SIGMOID = "sigmoid"
    IPO = "ipo"
    HINGE = "hinge"


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, reference_chosen: torch.Tensor,
             reference_rejected: torch.Tensor, beta: float, loss_type: str = DPOLossType.SIGMOID,
             label_smoothing: float = 0.0, chosen_tokens: torch.Tensor | None = None,
             rejected_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair losses of `loss_type`, chosen rewards, rejected rewards) from per-pair summed log-probabilities
    (the module's docstring has the formulas); ipo also needs each answer's token count. The rewards, beta x the
    summed log-ratio whatever the loss, are detached (they are reported, not trained on)."""
    if loss_type not in tuple(DPOLossType):
        raise ValueError(f"--loss_type={loss_type!r} is not allowed; choose one of {', '.join(DPOLossType)}")
    if loss_type != DPOLossType.SIGMOID and label_smoothing:
        raise ValueError(f"--label_smoothing={label_smoothing!r} is not allowed; it smooths the sigmoid loss only")
    chosen_ratio, rejected_ratio = policy_chosen - reference_chosen, policy_rejected - reference_rejected
    chosen_rewards, rejected_rewards = beta * chosen_ratio, beta * rejected_ratio
    margins = chosen_rewards - rejected_rewards
    if loss_type == DPOLossType.SIGMOID:
        losses = -F.logsigmoid(margins)
        if label_smoothing:
            losses = (1 - label_smoothing) * losses - label_smoothing * F.logsigmoid(-margins)
    elif loss_type == DPOLossType.HINGE:
        losses = torch.relu(1 - margins)
    else:
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("dpo_loss: loss_type ipo needs the answers' token counts")
        per_token = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
        losses = (per_token - 1 / (2 * beta)) ** 2
    return losses, chosen_rewards.detach(), rejected_rewards.detach()


def real_pairs(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Which pairs of a collated batch (2B rows: B chosen, then B rejected) carry a target: validation shards are
    padded with target-free samples, which must count nowhere."""
    pairs = batch["input_ids"].shape[0] // 2
    return (batch["labels"][:pairs] != -100).any(dim=-1)


@dataclass(frozen=True)
class DPOEval(LoggedEval):
    metrics = DPO_VAL_METRICS

    loss: float              # mean DPO loss over the pairs
    reward_accuracy: float   # fraction of pairs whose chosen reward exceeds the rejected one
    reward_margin: float     # mean r_c - r_r
    chosen_reward: float     # mean r_c
    rejected_reward: float   # mean r_r
    pairs: int

    def describe(self) -> str:
        return (f"val DPO loss {self.loss:.4f}, reward accuracy {self.reward_accuracy:.1%}, margin "
                f"{self.reward_margin:.3f} (chosen {self.chosen_reward:.3f}, rejected {self.rejected_reward:.3f})")


class DirectPreference:
    """The DPO objective: its unit is the preference pair. `reference` is the frozen starting model on the
    training device; `autocast` is the mixed-precision context the policy's forward runs in."""

    stat_names = STAT_NAMES
    progress_labels = {"reward_accuracy": "acc", "reward_margin": "margin"}

    def __init__(self, reference: torch.nn.Module, beta: float,
                 autocast: Callable[[], AbstractContextManager], loss_type: str = DPOLossType.SIGMOID,
                 label_smoothing: float = 0.0) -> None:
        self.reference, self.beta, self.autocast = reference.eval().requires_grad_(False), beta, autocast
        self.loss_type, self.label_smoothing = loss_type, label_smoothing

    def count_items(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return real_pairs(batch).sum()

    def _pair_terms(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]):
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch.get("attention_mask")}
        policy = sequence_log_probs(model(**inputs).logits, batch["labels"])
        with torch.no_grad(), self.autocast():
            reference = sequence_log_probs(self.reference(**inputs).logits, batch["labels"])
        pairs = policy.shape[0] // 2
        tokens = (shift_labels(batch["labels"]) != -100).sum(dim=-1).to(policy.dtype)
        losses, chosen, rejected = dpo_loss(policy[:pairs], policy[pairs:], reference[:pairs], reference[pairs:],
                                            self.beta, self.loss_type, self.label_smoothing, tokens[:pairs],
                                            tokens[pairs:])
        return losses, chosen, rejected, real_pairs(batch)

    @staticmethod
    def _stat_sums(chosen: torch.Tensor, rejected: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        real = real.float()
        return torch.stack([((chosen > rejected).float() * real).sum(), ((chosen - rejected) * real).sum(),
                            (chosen * real).sum(), (rejected * real).sum()])

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor],
             num_items: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        losses, chosen, rejected, real = self._pair_terms(model, batch)
        return (losses * real).sum() / num_items, self._stat_sums(chosen, rejected, real)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, loader: DataLoader, accelerator: Accelerator,
                 token_bytes: torch.Tensor | None = None, max_batches: int = 0) -> DPOEval:
        was_training = model.training
        model.eval()
        totals = torch.zeros(2 + len(STAT_NAMES), dtype=torch.float64, device=accelerator.device)  # loss, pairs
        for index, batch in enumerate(loader):
            if max_batches and index >= max_batches:
                break
            batch = {key: value.to(accelerator.device) for key, value in batch.items()}
            losses, chosen, rejected, real = self._pair_terms(model, batch)
            totals[0] += (losses * real).sum().double()
            totals[1] += real.sum()
            totals[2:] += self._stat_sums(chosen, rejected, real).double()
        totals = accelerator.reduce(totals, reduction="sum")
        model.train(was_training)
        pairs = int(totals[1])
        means = (totals / max(pairs, 1)).tolist() if pairs else [float("nan")] * len(totals)
        return DPOEval(means[0], *means[2:], pairs=pairs)
