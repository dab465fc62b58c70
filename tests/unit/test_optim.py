"""The optimizers: which parameters Muon takes (the 2-D hidden matrices only), two steps of --optimizer muon against
an independent fp64 reference of Muon (torch's docstring formula: Nesterov momentum, Newton-Schulz orthogonalization,
decoupled decay, the shape factor) and of AdamW, the state surviving state_dict/load_state_dict inside one
optimizer object, the WSD schedule, the one-line refusals. Training with Muon, exact resume and several processes:
tests/integration/test_train_resume.py and tests/integration/test_train_processes.py."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from model import MiniNormConfig, MiniNormForCausalLM
from trainer.optim import ADAMW_BETAS, ADAMW_EPS, build_optimizer, muon_split
from trainer.schedule import lr_multiplier

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's defaults (Keller Jordan's quintic)
NS_STEPS = 5


# The trainer flags' Muon defaults (trainer/arg_fields.py), which build_optimizer takes as required keywords.
MUON = dict(muon_lr=0.02, muon_weight_decay=0.01, muon_momentum=0.95, muon_adjust_lr="original")


def tiny_model(**overrides) -> MiniNormForCausalLM:
    torch.manual_seed(0)
    fields = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=80, norm_impl="eager")
    return MiniNormForCausalLM(MiniNormConfig(**{**fields, **overrides}))


def names(model: torch.nn.Module, params: list[torch.nn.Parameter]) -> set[str]:
    ids = {id(p) for p in params}
    return {name for name, p in model.named_parameters(remove_duplicate=False) if id(p) in ids}


@pytest.mark.parametrize("tied", [True, False])
def test_muon_takes_the_hidden_matrices_only(tied):
    model = tiny_model(tie_word_embeddings=tied, qk_norm=True)
    muon, adamw = muon_split(model)
    projections = {f"model.layers.{i}.{part}.weight" for i in range(2) for part in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")}
    assert names(model, muon) == projections
    rest = names(model, adamw)
    assert "model.embed_tokens.weight" in rest and "lm_head.weight" in rest  # 2-D, but token maps: AdamW's
    assert {n for n in rest if "norm" in n} and all(p.ndim == 1 for p in adamw if p is not model.lm_head.weight
                                                     and p is not model.model.embed_tokens.weight)
    assert len(muon) + len(adamw) == len(list(model.parameters()))  # every parameter once, a tied one too


def newton_schulz_fp64(matrix: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """NS_k^(a,b,c) of torch.optim.Muon's docstring, in fp64: X = M / ||M||_F (wide orientation), then k times
    X <- a X + (b A + c A^2) X with A = X X^T."""
    a, b, c = NS_COEFFICIENTS
    x = matrix.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / max(x.norm().item(), eps)
    for _ in range(NS_STEPS):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


@pytest.mark.parametrize("fp32, tolerance", [(False, 0.04), (True, 1e-4)], ids=["bf16", "fp32"])
def test_two_muon_steps_match_an_fp64_reference(fp32, tolerance):
    """Steps with two different gradients, so the momentum buffer and Nesterov's look-ahead both matter. Muon:
    B_t = mu B_{t-1} + g_t, U = g_t + mu B_t, W <- W (1 - lr wd) - lr sqrt(max(1, rows/cols)) NS(U) (torch scales
    B by (1 - mu), which NS's normalization cancels). AdamW: the textbook bias-corrected update with decoupled
    decay. torch orthogonalizes in bf16, hence the tolerance on Muon's update: 4% in Frobenius norm (bf16 gives
    1.3-2%; a missing Nesterov term, a wrong orientation or shape factor is tens of percent off); orthogonalized in
    fp32 (what an fp32 run on a CPU does), the update is within 1e-4."""
    model = tiny_model(tie_word_embeddings=False)
    lr, muon_lr, wd, muon_wd, mu = 1e-2, 0.05, 0.5, 2.0, 0.95  # large decays, so a wrong decay shows
    optimizer = build_optimizer(model, lr, wd, "muon", muon_lr=muon_lr, muon_weight_decay=muon_wd, muon_momentum=mu,
                                muon_adjust_lr="original", orthogonalize_in_fp32=fp32)
    muon_ids = {id(p) for p in muon_split(model)[0]}
    params = dict(model.named_parameters())
    start = {n: p.detach().double().clone() for n, p in params.items()}
    torch.manual_seed(1)
    grads = [{n: torch.randn_like(p) for n, p in params.items()} for _ in range(2)]
    reference = {n: w.clone() for n, w in start.items()}
    buffers = {n: torch.zeros_like(w) for n, w in start.items()}
    exp_avg = {n: torch.zeros_like(w) for n, w in start.items()}
    exp_avg_sq = {n: torch.zeros_like(w) for n, w in start.items()}
    beta1, beta2 = ADAMW_BETAS
    for t, step_grads in enumerate(grads, start=1):
        before = {n: w.clone() for n, w in reference.items()}
        for name, param in params.items():
            param.grad = step_grads[name].clone()
            g = step_grads[name].double()
            if id(param) in muon_ids:
                buffers[name] = mu * buffers[name] + g
                update = newton_schulz_fp64(g + mu * buffers[name])
                rows, cols = g.shape
                reference[name] = (reference[name] * (1 - muon_lr * muon_wd)
                                   - muon_lr * math.sqrt(max(1.0, rows / cols)) * update)
            else:
                decay = wd if param.ndim == 2 and name != "model.embed_tokens.weight" else 0.0
                exp_avg[name] = beta1 * exp_avg[name] + (1 - beta1) * g
                exp_avg_sq[name] = beta2 * exp_avg_sq[name] + (1 - beta2) * g * g
                m_hat, v_hat = exp_avg[name] / (1 - beta1 ** t), exp_avg_sq[name] / (1 - beta2 ** t)
                reference[name] = reference[name] * (1 - lr * decay) - lr * m_hat / (v_hat.sqrt() + ADAMW_EPS)
        optimizer.step()
        for name, param in params.items():
            got, want = param.detach().double(), reference[name]
            if id(param) in muon_ids:
                # Compare the updates (the weights are dominated by their start), relative to the update's size.
                got_update, want_update = got - before[name], want - before[name]
                error = ((got_update - want_update).norm() / want_update.norm()).item()
                assert error < tolerance, (name, t, error)
            else:
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=f"{name}, step {t}")
            param.data.copy_(want)  # both sides go on from the same weights


@pytest.mark.parametrize("tied", [True, False])
def test_muon_step_equals_torchs_muon_step(tied):
    """Our Muon step (Newton-Schulz batched by shape) against torch.optim.Muon's own step on a copy of the same
    matrices, three steps with different gradients, warmup-scaled learning rates and both shape-factor rules: every
    update within 1% of torch's in Frobenius norm (both orthogonalize in bf16: batching changes the order of no
    sum, but a BLAS may block a batched product differently; a wrong momentum, Nesterov term, orientation or decay is
    tens of percent off). The momentum buffers match too."""
    for adjust in ("original", "match_rms_adamw"):
        model = tiny_model(tie_word_embeddings=tied)
        ours = build_optimizer(model, 1e-2, 0.1, "muon", muon_lr=0.05, muon_weight_decay=0.5, muon_momentum=0.95,
                               muon_adjust_lr=adjust)
        matrices = muon_split(model)[0]
        copies = [torch.nn.Parameter(p.detach().clone()) for p in matrices]
        reference = torch.optim.Muon(copies, lr=0.05, weight_decay=0.5, momentum=0.95, nesterov=True,
                                     adjust_lr_fn=adjust)
        torch.manual_seed(3)
        for step, scale in enumerate((0.3, 1.0, 0.7)):
            for group in ours.param_groups:
                group["lr"] = (0.05 if group["update"] == "muon" else 1e-2) * scale
            reference.param_groups[0]["lr"] = 0.05 * scale
            before = [p.detach().clone() for p in matrices]
            for param in model.parameters():
                param.grad = torch.randn_like(param)
            for param, twin in zip(matrices, copies):
                twin.grad = param.grad.clone()
            ours.step()
            reference.step()
            for index, (param, twin, start) in enumerate(zip(matrices, copies, before)):
                got, want = param.detach() - start, twin.detach() - start
                error = ((got - want).norm() / want.norm()).item()
                assert error < 1e-2, (adjust, step, index, error)
                torch.testing.assert_close(ours.state[param]["momentum_buffer"],
                                           reference.state[twin]["momentum_buffer"])
                param.data.copy_(twin.detach())  # both go on from the same weights


def test_orthogonalize_batches_each_shape_into_one_product(monkeypatch):
    """The matrices of one wide-orientation shape (a tall one transposed joins the wide ones) go through one batched
    product per operation: 3 shapes -> 3 x 5 Gram products for 7 matrices, not 7 x 5. Each result equals the
    matrix orthogonalized alone (fp32) and torch's per-matrix function (bf16, to its precision)."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    from trainer.optim import orthogonalize

    torch.manual_seed(0)
    shapes = [(12, 20), (20, 12), (12, 20), (6, 20), (20, 6), (16, 16), (6, 20)]
    matrices = [torch.randn(shape) for shape in shapes]
    calls = []
    bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda x, y: calls.append(x.shape[0]) or bmm(x, y))
    batched = orthogonalize(matrices, NS_COEFFICIENTS, NS_STEPS, 1e-7, torch.float32)
    assert sorted(calls) == sorted([3] * NS_STEPS + [3] * NS_STEPS + [1] * NS_STEPS)
    monkeypatch.setattr(torch, "bmm", bmm)
    for matrix, got in zip(matrices, batched):
        assert got.shape == matrix.shape and got.dtype == torch.float32
        alone = orthogonalize([matrix], NS_COEFFICIENTS, NS_STEPS, 1e-7, torch.float32)[0]
        torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got, newton_schulz_fp64(matrix).float(), rtol=1e-4, atol=1e-4)
        torchs = _zeropower_via_newtonschulz(matrix, NS_COEFFICIENTS, NS_STEPS, 1e-7)
        in_bf16 = orthogonalize([matrix], NS_COEFFICIENTS, NS_STEPS, 1e-7)[0]
        assert in_bf16.dtype == torch.bfloat16
        assert ((in_bf16.float() - torchs.float()).norm() / torchs.float().norm()).item() < 1e-2


def test_muon_state_survives_state_dict_and_load_state_dict():
    """A fresh optimizer loaded with another's state_dict (as a checkpoint resume does) continues exactly: the
    momentum buffers and AdamW's moments reach the inner Muon and AdamW, not only the outer object."""
    def two_steps(model, optimizer, seed: int) -> None:
        torch.manual_seed(seed)
        for _ in range(2):
            for param in model.parameters():
                param.grad = torch.randn_like(param)
            optimizer.step()

    model = tiny_model()
    optimizer = build_optimizer(model, 1e-2, 0.1, "muon", **MUON)
    two_steps(model, optimizer, seed=1)
    saved_weights = {k: v.clone() for k, v in model.state_dict().items()}
    saved_state = copy.deepcopy(optimizer.state_dict())  # state_dict() holds the live tensors
    two_steps(model, optimizer, seed=2)
    resumed = tiny_model()
    resumed.load_state_dict(saved_weights)
    resumed_optimizer = build_optimizer(resumed, 1e-2, 0.1, "muon", **MUON)
    resumed_optimizer.load_state_dict(saved_state)
    assert [g["update"] for g in resumed_optimizer.param_groups] == ["adamw", "muon"]  # tied: nothing decayed
    two_steps(resumed, resumed_optimizer, seed=2)
    for (name, want), got in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(got, want), name


def test_wsd_holds_the_peak_then_decays_linearly_to_the_floor():
    def factor(step: int) -> float:
        return lr_multiplier(step, warmup_steps=10, total_steps=100, min_ratio=0.1, schedule="wsd",
                             decay_fraction=0.2)

    assert factor(0) == pytest.approx(1 / 11) and factor(9) == pytest.approx(10 / 11)
    assert all(factor(step) == 1.0 for step in range(10, 80))
    decay = [factor(step) for step in range(80, 100)]
    assert decay[0] == pytest.approx(1 - 0.9 / 20) and decay[-1] == pytest.approx(0.1)
    assert all(later < earlier for earlier, later in zip(decay, decay[1:]))
    # cosine, the default, is unchanged: the floor is approached at the end, the peak right after warmup
    assert lr_multiplier(10, 10, 100, 0.1, "cosine", 0.2) == pytest.approx(1.0)
    assert lr_multiplier(99, 10, 100, 0.1, "cosine", 0.2) == pytest.approx(0.1, abs=1e-3)


@pytest.mark.parametrize("setup, refused", [(DistributedType.DEEPSPEED, True), (DistributedType.FSDP, False),
                                            (DistributedType.MULTI_CPU, False)])
def test_muon_is_refused_where_it_cannot_run(setup, refused):
    from trainer.distributed import check_optimizer_supported

    accelerator = SimpleNamespace(distributed_type=setup)
    check_optimizer_supported(accelerator, "adamw")
    if refused:
        with pytest.raises(ValueError, match="--optimizer muon does not run under DeepSpeed: ZeRO flattens"):
            check_optimizer_supported(accelerator, "muon")
    else:
        check_optimizer_supported(accelerator, "muon")


@pytest.mark.parametrize("fraction", [0.2, 0.5])
def test_wsd_decays_after_the_warmup_when_the_run_is_short(fraction):
    """10 steps, 8 of warmup: the decay (2 steps at 0.2 of the run; 5 at 0.5, which would reach into the warmup)
    takes the steps after the warmup, linearly from the peak to the floor at the last step -- no step of the warmup
    is cut short, none after it jumps down."""
    factors = [lr_multiplier(step, 8, 10, 0.1, "wsd", fraction) for step in range(10)]
    assert factors[:8] == pytest.approx([(step + 1) / 9 for step in range(8)])
    assert factors[8:] == pytest.approx([1 - 0.9 / 2, 0.1])


def test_wsd_decays_over_at_least_its_last_step():
    """A --decay_fraction too small for the run (0.01 of 10 steps rounds to none) still decays: the last step is at
    the floor, as a WSD run's end must be."""
    factors = [lr_multiplier(step, 0, 10, 0.1, "wsd", 0.01) for step in range(10)]
    assert factors[:9] == [1.0] * 9 and factors[9] == pytest.approx(0.1)


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_past_the_planned_end_the_rate_stays_at_the_floor(schedule):
    """A run on a time budget re-plans its length and may end up past it: the factor stays at min_ratio there (a
    cosine must not climb back up its next period)."""
    for step in (100, 101, 150, 199, 250):
        assert lr_multiplier(step, 10, 100, 0.1, schedule, 0.2) == pytest.approx(0.1)


def test_warmup_longer_than_the_run_is_cut_to_the_run():
    """build_scheduler: warmup never runs past the end, so a 10-step run asked for 50 warmup steps warms up over its
    10 steps ((step + 1) / 11), also when its length is a plan read at every step (a time budget)."""
    from trainer.schedule import build_scheduler

    for total in (10, lambda: 10):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
        scheduler = build_scheduler(optimizer, warmup_steps=50, total_steps=total, min_ratio=0.1, schedule="cosine",
                                    decay_fraction=0.2)
        lrs = []
        for _ in range(10):
            lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        assert lrs == pytest.approx([2.0 * (step + 1) / 11 for step in range(10)])


@pytest.mark.parametrize("warmup, total", [(50, 10), (10, 10), (9, 10)])
def test_a_warmup_not_shorter_than_the_run_is_noted_with_the_rate_it_reaches(warmup, total):
    """warmup_note: a --warmup_steps of the run's length or more is cut to the run, whose rate then rises to
    total / (total + 1) of its peak at the last step and never decays (the scheduler's own rates, read here); one
    step shorter reaches the peak at the last step, and is not noted."""
    from trainer.schedule import build_scheduler, warmup_note

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_scheduler(optimizer, warmup_steps=warmup, total_steps=total, min_ratio=0.1, schedule="cosine",
                                decay_fraction=0.2)
    rates = []
    for _ in range(total):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    if warmup < total:
        assert max(rates) == 1.0 and warmup_note(warmup, total) is None
        return
    assert rates == sorted(rates) and rates[-1] == pytest.approx(total / (total + 1))
    assert warmup_note(warmup, total) == (
        f"note: --warmup_steps {warmup} is not shorter than the run's 10 optimizer steps: the learning rate rises all "
        f"run, to 10/11 of its peak at the last step, and never decays; a --warmup_steps below 10 reaches the peak")


def test_the_logged_rates_are_adamws_and_muons_own():
    from trainer.optim import scheduled_lrs

    assert scheduled_lrs(build_optimizer(tiny_model(), 3e-4, 0.1, "adamw", **MUON)) == {"lr": 3e-4}
    assert scheduled_lrs(build_optimizer(tiny_model(), 3e-4, 0.1, "muon", **{**MUON, "muon_lr": 0.03})) == {
        "lr": 3e-4, "muon_lr": 0.03}


def test_muon_on_a_model_without_hidden_matrices_is_refused_in_one_line():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.LayerNorm(4))
    with pytest.raises(ValueError, match=r"^--optimizer muon: the model has no 2-D hidden weight matrices for Muon$"):
        build_optimizer(model, 1e-3, 0.1, "muon", **MUON)


def test_a_muon_matrix_without_a_gradient_is_left_as_it_is():
    """A matrix that took no part in the loss (its .grad None, as zero_grad leaves it) is neither moved nor decayed,
    nor given momentum, as torch's optimizers skip it; the others step."""
    model = tiny_model()
    optimizer = build_optimizer(model, 1e-2, 0.1, "muon", **{**MUON, "muon_weight_decay": 0.5})
    model(torch.randint(0, 96, (2, 8)), labels=torch.randint(0, 96, (2, 8))).loss.backward()
    idle, moved = model.model.layers[0].mlp.down_proj.weight, model.model.layers[1].mlp.down_proj.weight
    idle.grad = None
    before, moved_before = idle.detach().clone(), moved.detach().clone()
    optimizer.step()
    assert torch.equal(idle, before) and "momentum_buffer" not in optimizer.state[idle]
    assert not torch.equal(moved, moved_before)
