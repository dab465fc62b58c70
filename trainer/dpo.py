"""Direct Preference Optimization (Rafailov et al. 2023): the DPO loss, TRL's other preference losses, and their
objective for the training core.

For a prompt x with a chosen answer y_c and a rejected one y_r, the policy pi (being trained) and the frozen
reference model (the starting weights) give summed log-probabilities of each answer's tokens; the log-ratios are
l_c = log pi(y_c|x) - log ref(y_c|x) and l_r likewise, the implicit rewards r_c = beta l_c and r_r = beta l_r, the
margin h = r_c - r_r, and the default loss (--loss_type sigmoid) is

    -log sigmoid(h) = -log sigmoid(beta * ((pi_c - pi_r) - (ref_c - ref_r)))

averaged over pairs. The other loss types are TRL DPOTrainer's, by its names (per pair; sigma = sigmoid, eps =
--label_smoothing, which only the types in LABEL_SMOOTHED read):

    sigmoid       -(1 - eps) log sigma(h) - eps log sigma(-h)     conservative DPO (Mitchell 2023) for eps > 0
    hinge         max(0, 1 - h)                                    SLiC (Zhao et al. 2023, arXiv:2305.10425)
    ipo           (d - 1 / (2 beta))^2, d = l_c / n_c - l_r / n_r  IPO (Azar et al. 2023, eq. 17), per-token means
    robust        (-(1 - eps) log sigma(h) + eps log sigma(-h)) / (1 - 2 eps)   rDPO (Chowdhury et al. 2024)
    exo_pair      sigma(h) (log sigma(h) - log(1 - eps)) + sigma(-h) (log sigma(-h) - log eps)   EXO (Ji et al.
                  2024, eq. 16; eps > 0)
    nca_pair      -log sigma(r_c) - log sigma(-r_c) / 2 - log sigma(-r_r) / 2   NCA (Chen et al. 2024)
    bco_pair      -log sigma(r_c - m) - log sigma(-(r_r - m)), m the running mean of the rewards (BCO, Jung et
                  al. 2024; BCORunningMean)
    sppo_hard     (l_c - 1 / (2 beta))^2 + (l_r + 1 / (2 beta))^2  SPPO (Wu et al. 2024) with hard probabilities
    aot           h' = beta (sort(pi_c - pi_r) - sort(ref_c - ref_r)) over the micro-batch's pairs, then sigmoid's
                  smoothed loss on h' (AOT, Melnyk et al. 2024)
    aot_unpaired  the same with h' = beta (sort(l_c) - sort(l_r)); aot_pair is its name in TRL before 2026-02
    apo_zero      1 - sigma(r_c) + sigma(r_r)                      APO (D'Oosterlinck et al. 2024, eq. 7)
    apo_down      sigma(r_c) + 1 - sigma(h)                        APO, eq. 8
    discopop      (1 - w) (-log sigma(h)) + w exp(-h), w = sigma(h / tau)   DiscoPOP (Lu et al. 2024, eq. 5;
                  tau = --discopop_tau)
    sigmoid_norm  -log sigma(beta d), d as ipo's
    sft           -pi_c / n_c: the chosen answer's mean token NLL (TRL: the micro-batch's token mean)

n_c and n_r are the answers' token counts. Several types, comma-separated (`sigmoid,sft`), are summed with
--loss_weights (1 each by default), TRL's combination (its MPO recipe). The answer's tokens are its content and
closing <|im_end|> (dataset/dpo_dataset.py, the SFT mask rule restricted to the final answer). The reference's
log-probabilities are computed once per batch without gradients, in the same autocast as the policy's forward, so
at the first step every log-ratio is 0 (sigmoid's loss is then log 2, whatever eps; docs/post_training.md lists
each type's).
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader

from model.model import shift_labels
from trainer.evaluation import LoggedEval
from trainer.run_dir import DPO_VAL_METRICS

STAT_NAMES = tuple(name for name in DPO_VAL_METRICS.values() if name != "loss")  # what a pair adds beside its loss
DEFAULT_DISCOPOP_TAU = 0.05  # TRL's discopop_tau, the DiscoPOP paper's


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
    ROBUST = "robust"
    EXO_PAIR = "exo_pair"
    NCA_PAIR = "nca_pair"
    BCO_PAIR = "bco_pair"
    SPPO_HARD = "sppo_hard"
    AOT = "aot"
    AOT_UNPAIRED = "aot_unpaired"
    AOT_PAIR = "aot_pair"
    APO_ZERO = "apo_zero"
    APO_DOWN = "apo_down"
    DISCOPOP = "discopop"
    SIGMOID_NORM = "sigmoid_norm"
    SFT = "sft"


# The loss types --label_smoothing applies to (TRL's, and sigmoid's conservative DPO); the others refuse it.
LABEL_SMOOTHED = (DPOLossType.SIGMOID, DPOLossType.ROBUST, DPOLossType.EXO_PAIR, DPOLossType.AOT,
                  DPOLossType.AOT_UNPAIRED, DPOLossType.AOT_PAIR)
# The loss types whose per-pair loss needs the answers' token counts.
PER_TOKEN = (DPOLossType.IPO, DPOLossType.SIGMOID_NORM, DPOLossType.SFT)


def parse_loss_types(text: str) -> tuple[DPOLossType, ...]:
    """The loss types of a --loss_type value: one name or several, comma-separated (`sigmoid,sft`)."""
    names = [name.strip() for name in str(text).split(",")]
    for name in names:
        if name not in tuple(DPOLossType):
            shown = text if len(names) == 1 else name
            raise ValueError(f"--loss_type={shown!r} is not allowed; choose one or several (comma-separated) of "
                             f"{', '.join(DPOLossType)}")
    return tuple(DPOLossType(name) for name in names)


def check_label_smoothing(loss_types: Sequence[str], label_smoothing: float) -> None:
    """Refuse, in one line, a --label_smoothing none of `loss_types` reads, and exo_pair without one (its log eps)."""
    if label_smoothing and not any(kind in LABEL_SMOOTHED for kind in loss_types):
        raise ValueError(f"--label_smoothing={label_smoothing!r} is not allowed; only --loss_type "
                         f"{', '.join(LABEL_SMOOTHED)} use it: leave it 0 with --loss_type {','.join(loss_types)}")
    if DPOLossType.EXO_PAIR in loss_types and not label_smoothing:
        raise ValueError(f"--label_smoothing={label_smoothing!r} is not allowed; --loss_type exo_pair needs its "
                         f"epsilon > 0 (the EXO paper recommends 1e-3)")

def _log_sigmoid_smoothed(logits: torch.Tensor, eps: float) -> torch.Tensor:
    """-(1 - eps) log sigmoid(x) - eps log sigmoid(-x): eps 0 is -log sigmoid(x) bit for bit."""
    losses = -F.logsigmoid(logits)
    return (1 - eps) * losses - eps * F.logsigmoid(-logits) if eps else losses


def _sorted_difference(first: torch.Tensor, second: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    """sort(first) - sort(second) over the real pairs (AOT's quantile matching), in their places; 0 elsewhere."""
    if real is None:
        return torch.sort(first).values - torch.sort(second).values
    out = torch.zeros_like(first)
    out[real] = torch.sort(first[real]).values - torch.sort(second[real]).values
    return out


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, reference_chosen: torch.Tensor,
             reference_rejected: torch.Tensor, beta: float, loss_type: str = DPOLossType.SIGMOID,
             label_smoothing: float = 0.0, chosen_tokens: torch.Tensor | None = None,
             rejected_tokens: torch.Tensor | None = None, *, loss_weights: Sequence[float] | None = None,
             discopop_tau: float = DEFAULT_DISCOPOP_TAU, bco_mean: float = 0.0,
             real: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair losses of `loss_type`, chosen rewards, rejected rewards) from per-pair summed log-probabilities
    (the module's docstring has the formulas). `loss_type` is one type or several, comma-separated, summed with
    `loss_weights` (1 each when None); ipo, sigmoid_norm and sft also need each answer's token count, bco_pair the
    running mean of the rewards, aot and aot_unpaired which pairs are `real` (the others are left out of their
    sorting; None: all). The rewards, beta x the summed log-ratio whatever the loss, are detached (they are
    reported, not trained on)."""
    loss_types = parse_loss_types(loss_type)
    weights = [1.0] * len(loss_types) if loss_weights is None else list(loss_weights)
    if len(weights) != len(loss_types):
        raise ValueError(f"--loss_weights={weights!r} is not allowed; give one weight per --loss_type "
                         f"({len(loss_types)})")
    check_label_smoothing(loss_types, label_smoothing)
    if any(kind in PER_TOKEN for kind in loss_types) and (chosen_tokens is None or rejected_tokens is None):
        raise ValueError(f"dpo_loss: loss_type {loss_type} needs the answers' token counts")
    eps = label_smoothing
    chosen_ratio, rejected_ratio = policy_chosen - reference_chosen, policy_rejected - reference_rejected
    chosen_rewards, rejected_rewards = beta * chosen_ratio, beta * rejected_ratio
    margins = chosen_rewards - rejected_rewards
    if chosen_tokens is not None and rejected_tokens is not None:  # ipo's and sigmoid_norm's d
        per_token = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
    total = torch.zeros_like(margins)
    for kind, weight in zip(loss_types, weights):
        if kind == DPOLossType.SIGMOID:
            losses = _log_sigmoid_smoothed(margins, eps)
        elif kind == DPOLossType.HINGE:
            losses = torch.relu(1 - margins)
        elif kind == DPOLossType.IPO:
            losses = (per_token - 1 / (2 * beta)) ** 2
        elif kind == DPOLossType.ROBUST:
            losses = (-(1 - eps) * F.logsigmoid(margins) + eps * F.logsigmoid(-margins)) / (1 - 2 * eps)
        elif kind == DPOLossType.EXO_PAIR:
            losses = (torch.sigmoid(margins) * (F.logsigmoid(margins) - math.log1p(-eps))
                      + torch.sigmoid(-margins) * (F.logsigmoid(-margins) - math.log(eps)))
        elif kind == DPOLossType.NCA_PAIR:
            losses = (-F.logsigmoid(chosen_rewards) - 0.5 * F.logsigmoid(-chosen_rewards)
                      - 0.5 * F.logsigmoid(-rejected_rewards))
        elif kind == DPOLossType.BCO_PAIR:
            losses = -F.logsigmoid(chosen_rewards - bco_mean) - F.logsigmoid(-(rejected_rewards - bco_mean))
        elif kind == DPOLossType.SPPO_HARD:
            losses = (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2
        elif kind == DPOLossType.AOT:
            shifted = _sorted_difference(policy_chosen - policy_rejected, reference_chosen - reference_rejected, real)
            losses = _log_sigmoid_smoothed(beta * shifted, eps)
        elif kind in (DPOLossType.AOT_UNPAIRED, DPOLossType.AOT_PAIR):
            losses = _log_sigmoid_smoothed(beta * _sorted_difference(chosen_ratio, rejected_ratio, real), eps)
        elif kind == DPOLossType.APO_ZERO:
            losses = 1 - torch.sigmoid(chosen_rewards) + torch.sigmoid(rejected_rewards)
        elif kind == DPOLossType.APO_DOWN:
            losses = torch.sigmoid(chosen_rewards) + 1 - torch.sigmoid(margins)
        elif kind == DPOLossType.DISCOPOP:
            mix = torch.sigmoid(margins / discopop_tau)
            losses = -F.logsigmoid(margins) * (1 - mix) + torch.exp(-margins) * mix
        elif kind == DPOLossType.SIGMOID_NORM:
            losses = -F.logsigmoid(beta * per_token)
        else:  # sft
            losses = -policy_chosen / chosen_tokens.clamp(min=1)
        # one type at weight 1 (the usual run) is its loss exactly, bit for bit
        total = losses if len(loss_types) == 1 and weight == 1 else total + weight * losses
    return total, chosen_rewards.detach(), rejected_rewards.detach()


@dataclass
class BCORunningMean:
    """bco_pair's m: the mean of every reward (r_c and r_r of each pair) of the optimizer steps done, as TRL's
    RunningMoments keeps it. It is folded in once per step from the step's global reward means (all processes and
    micro-batches), so it is the same whatever the number of processes; a checkpoint saves it (`state`)."""

    mean: float = 0.0
    pairs: int = 0

    def add_step(self, chosen_mean: float, rejected_mean: float, pairs: int) -> None:
        """Fold in a step of `pairs` pairs whose mean chosen and rejected rewards these are."""
        if pairs <= 0:
            return
        total = self.pairs + pairs
        self.mean += ((chosen_mean + rejected_mean) / 2 - self.mean) * pairs / total
        self.pairs = total


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
                 label_smoothing: float = 0.0, loss_weights: Sequence[float] | None = None,
                 discopop_tau: float = DEFAULT_DISCOPOP_TAU) -> None:
        self.reference, self.beta, self.autocast = reference.eval().requires_grad_(False), beta, autocast
        self.loss_type, self.label_smoothing = loss_type, label_smoothing
        self.loss_weights, self.discopop_tau = loss_weights, discopop_tau
        # bco_pair's running mean of the rewards: trainer state, saved with a checkpoint (state, load_state)
        self.bco = BCORunningMean() if DPOLossType.BCO_PAIR in parse_loss_types(loss_type) else None

    def count_items(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return real_pairs(batch).sum()

    def _pair_terms(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]):
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch.get("attention_mask")}
        policy = sequence_log_probs(model(**inputs).logits, batch["labels"])
        with torch.no_grad(), self.autocast():
            reference = sequence_log_probs(self.reference(**inputs).logits, batch["labels"])
        pairs = policy.shape[0] // 2
        tokens = (shift_labels(batch["labels"]) != -100).sum(dim=-1).to(policy.dtype)
        real = real_pairs(batch)
        losses, chosen, rejected = dpo_loss(policy[:pairs], policy[pairs:], reference[:pairs], reference[pairs:],
                                            self.beta, self.loss_type, self.label_smoothing, tokens[:pairs],
                                            tokens[pairs:], loss_weights=self.loss_weights,
                                            discopop_tau=self.discopop_tau,
                                            bco_mean=self.bco.mean if self.bco is not None else 0.0, real=real)
        return losses, chosen, rejected, real

    def end_step(self, stats: dict[str, float], pairs: int) -> None:
        """After each optimizer step, with its statistics (means over its `pairs` pairs, all processes): bco_pair
        folds the step's rewards into its running mean, which the next step's loss uses."""
        if self.bco is not None:
            self.bco.add_step(stats["chosen_reward"], stats["rejected_reward"], pairs)

    def state(self) -> dict[str, Any]:
        """What a checkpoint saves of the objective beyond the weights: bco_pair's running mean ({} otherwise)."""
        return {} if self.bco is None else {"bco_mean": self.bco.mean, "bco_pairs": self.bco.pairs}

    def load_state(self, state: dict[str, Any]) -> None:
        """A checkpoint's `state` back; one saved before bco_pair's mean existed (or by another loss type) leaves
        the mean at its start, 0 over no pairs."""
        if self.bco is not None and "bco_mean" in state:
            self.bco = BCORunningMean(float(state["bco_mean"]), int(state.get("bco_pairs", 0)))

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
