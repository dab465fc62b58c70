"""NormDiagnostics: the numbers it logs equal independently computed ones, and it leaves no trace when off."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch
from torch import nn

from model.config import MiniNormConfig
from model.model import MiniNormForCausalLM, causal_lm_loss
from tests.fake_memory import ALLOCATOR_SAID, fake_memory, refuse_allocation
from trainer.diagnostics import NORM_NAMES, NormDiagnostics, layer_quantities, metric_matrix, metric_series

PLACEMENTS = ("pre", "post", "sandwich", "res_post")
LAYERS = 3


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(placement: str, norm_type: str = "rmsnorm", seed: int = 0) -> MiniNormForCausalLM:
    torch.manual_seed(seed)
    config = MiniNormConfig(vocab_size=97, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=64, norm_type=norm_type,
                            norm_placement=placement, norm_impl="eager")
    return MiniNormForCausalLM(config)


def batch(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(seed))


def ref_rms(t: torch.Tensor) -> float:
    return t.detach().double().pow(2).mean().sqrt().item()


def manual_forward(model: MiniNormForCausalLM, ids: torch.Tensor):
    """The model's forward rewritten from the placement definitions in docs/architecture.md, recording every norm's
    input and output and keeping the residual stream after each block (with retained grads)."""
    trunk = model.model
    x = trunk.embed_tokens(ids)
    rope = trunk.rotary(torch.arange(ids.shape[1]).expand(ids.shape[0], -1), x.dtype)
    seen: dict[str, float] = {}
    resid: list[torch.Tensor] = []

    def norm(block: nn.Module, name: str, i: int, h: torch.Tensor) -> torch.Tensor:
        out = getattr(block, name)(h)
        seen[f"diag/{name}_in_rms/layer_{i:02d}"] = ref_rms(h)
        seen[f"diag/{name}_out_rms/layer_{i:02d}"] = ref_rms(out)
        return out

    placement = model.config.norm_placement
    for i, b in enumerate(trunk.layers):
        attn = lambda h: b.self_attn(h, rope, None, None)  # noqa: E731
        if placement == "pre":
            x = x + attn(norm(b, "attn_norm", i, x))
            x = x + b.mlp(norm(b, "mlp_norm", i, x))
        elif placement == "post":
            x = norm(b, "attn_out_norm", i, x + attn(x))
            x = norm(b, "mlp_out_norm", i, x + b.mlp(x))
        elif placement == "sandwich":
            x = x + norm(b, "attn_out_norm", i, attn(norm(b, "attn_norm", i, x)))
            x = x + norm(b, "mlp_out_norm", i, b.mlp(norm(b, "mlp_norm", i, x)))
        else:
            x = x + norm(b, "attn_out_norm", i, attn(x))
            x = x + norm(b, "mlp_out_norm", i, b.mlp(x))
        x.retain_grad()
        resid.append(x)
        seen[f"diag/resid_rms/layer_{i:02d}"] = ref_rms(x)
    if placement != "post":
        final = trunk.norm(x)
        seen["diag/final_norm_in_rms"], seen["diag/final_norm_out_rms"] = ref_rms(x), ref_rms(final)
        x = final
    return model.lm_head(x), seen, resid


def no_hooks_left(model: nn.Module) -> bool:
    for module in model.modules():
        if (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or "add_and_norm" in module.__dict__
                or "logit_observer" in module.__dict__):
            return False
    return True


def armed_step(model: MiniNormForCausalLM, ids: torch.Tensor) -> tuple[dict[str, float], torch.Tensor]:
    diag = NormDiagnostics(model)
    diag.arm()
    out = model(ids, labels=ids)
    out.loss.backward()
    return diag.after_backward(), out.logits.detach()


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("norm_type", ["rmsnorm", "layernorm", "none"])
def test_activation_stats_match_a_manual_forward(placement: str, norm_type: str) -> None:
    model = tiny_model(placement, norm_type)
    ids = batch()
    stats, logits = armed_step(model, ids)
    model.zero_grad()
    manual_logits, expected, resid = manual_forward(model, ids)
    torch.testing.assert_close(manual_logits, logits)  # the manual forward is the model's forward
    causal_lm_loss(manual_logits, ids).backward()
    for i, h in enumerate(resid):
        expected[f"diag/resid_grad_rms/layer_{i:02d}"] = ref_rms(h.grad)

    activation_keys = {k for k in stats if "rms" in k and k != "diag/logits_rms"}  # logits: a test of their own
    assert activation_keys == set(expected)
    for key, value in expected.items():
        assert stats[key] == pytest.approx(value, rel=1e-5, abs=1e-12), key
    # Exactly the norms this placement has, for every layer.
    has = {"pre": ("attn_norm", "mlp_norm"), "post": ("attn_out_norm", "mlp_out_norm"),
           "sandwich": NORM_NAMES, "res_post": ("attn_out_norm", "mlp_out_norm")}[placement]
    assert {k.split("/")[1] for k in activation_keys if k.split("/")[1].startswith(NORM_NAMES)} == \
        {f"{n}_{side}_rms" for n in has for side in ("in", "out")}


@pytest.mark.parametrize("placement", ["pre", "sandwich"])
def test_a_second_forward_on_other_rows_leaves_the_batchs_activation_statistics(placement: str) -> None:
    """The copy rows beside pretraining run the model a second time in the armed micro-batch: the activation,
    attention-logit and output-logit statistics stay those of the batch's own (first) forward."""
    model = tiny_model(placement)
    ids, other = batch(1), torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(9))
    alone, _ = armed_step(model, ids)
    model.zero_grad()
    diag = NormDiagnostics(model)
    diag.arm()
    loss = model(ids, labels=ids).loss + 0.5 * model(other, labels=other).loss
    loss.backward()
    both = diag.after_backward()
    observed = [key for key in alone if "grad_norm" not in key]  # parameter gradients do see both forwards
    assert observed and any("attn_logit_max" in key for key in observed)
    for key in observed:
        assert both[key] == pytest.approx(alone[key], rel=1e-6, abs=1e-12), key


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_grad_norms_match_clip_grad_norm(placement: str) -> None:
    model = tiny_model(placement)
    stats, _ = armed_step(model, batch())
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)
    assert stats["diag/grad_norm_global"] == pytest.approx(total.item(), rel=1e-6)
    for i, block in enumerate(model.model.layers):
        for key, module in (("grad_norm", block), ("grad_norm_attn", block.self_attn),
                            ("grad_norm_mlp", block.mlp)):
            expected = math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in module.parameters()))
            assert stats[f"diag/{key}/layer_{i:02d}"] == pytest.approx(expected, rel=1e-5)


def test_update_ratio_of_an_sgd_step() -> None:
    model = tiny_model("pre")
    diag = NormDiagnostics(model)
    diag.arm()
    model(batch(), labels=batch()).loss.backward()
    diag.after_backward()
    before = [[p.detach().clone() for p in b.parameters() if p.ndim == 2] for b in model.model.layers]
    grads = [[p.grad.clone() for p in b.parameters() if p.ndim == 2] for b in model.model.layers]
    lr = 0.05
    torch.optim.SGD(model.parameters(), lr=lr).step()
    stats = diag.after_step()
    for i in range(LAYERS):
        # Plain SGD moves each weight by lr * grad.
        delta = math.sqrt(sum((lr * g.double()).pow(2).sum().item() for g in grads[i]))
        weight = math.sqrt(sum(w.double().pow(2).sum().item() for w in before[i]))
        assert stats[f"diag/update_ratio/layer_{i:02d}"] == pytest.approx(delta / weight, rel=1e-4)
    assert 0 < stats["diag/update_ratio_global"] < 1
    assert diag.after_step() == {}  # the snapshot is used once


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_no_trace_when_not_armed(placement: str) -> None:
    model = tiny_model(placement)
    ids = batch()
    with torch.no_grad():
        reference = model(ids).logits
    diag = NormDiagnostics(model)
    assert no_hooks_left(model)  # construction registers nothing
    diag.arm()
    assert not no_hooks_left(model)
    _, armed_logits = armed_step_with(diag, model, ids)
    assert no_hooks_left(model)
    assert torch.equal(armed_logits, reference)  # hooks only observe
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference)
    diag.arm()
    diag.disarm()  # arming and then skipping the step also leaves nothing behind
    assert no_hooks_left(model)


def armed_step_with(diag: NormDiagnostics, model: MiniNormForCausalLM,
                    ids: torch.Tensor) -> tuple[dict[str, float], torch.Tensor]:
    out = model(ids, labels=ids)
    out.loss.backward()
    return diag.after_backward(), out.logits.detach()


def test_layer_key_padding_grows_with_depth() -> None:
    diag = NormDiagnostics(tiny_model("pre"))
    assert diag.key("resid_rms", 3) == "diag/resid_rms/layer_03"
    diag.width = 3
    assert diag.key("resid_rms", 3) == "diag/resid_rms/layer_003"


def test_metric_matrix_and_heatmaps(tmp_path) -> None:
    lines = [
        {"step": 0, "loss": 5.0},
        {"step": 10, "diag/resid_rms/layer_00": 1.0, "diag/resid_rms/layer_01": 2.0, "diag/grad_norm_global": 3.0},
        {"step": 20, "diag/resid_rms/layer_00": 1.5, "diag/grad_norm/layer_01": 0.1, "diag/grad_norm_global": 2.0},
        {"step": 20, "diag/resid_rms/layer_01": 2.5},  # the same step logged in two lines merges
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n{broken\n")
    assert layer_quantities(lines) == ["grad_norm", "resid_rms"]
    steps, matrix = metric_matrix(path, "resid_rms")
    np.testing.assert_array_equal(steps, [10, 20])
    np.testing.assert_array_equal(matrix, [[1.0, 1.5], [2.0, 2.5]])
    steps, matrix = metric_matrix(path, "grad_norm")
    np.testing.assert_array_equal(steps, [20])
    assert np.isnan(matrix[0, 0]) and matrix[1, 0] == 0.1
    steps, values = metric_series(path, "diag/grad_norm_global")
    np.testing.assert_array_equal(values, [3.0, 2.0])

    from eval.studies.diagnostics import main
    written = main([str(tmp_path), "--out", str(tmp_path / "plots")])
    assert {p.name for p in written} == {"resid_rms.png", "grad_norm.png", "global.png"}
    assert all(p.stat().st_size > 1000 for p in written)


def test_a_torn_line_in_the_middle_of_the_metrics_is_said_on_stderr_and_the_plots_are_drawn(tmp_path, capsys) -> None:
    """A metrics.jsonl line before the last that is no record (torn by a kill a later append ended) is one note line
    on stderr naming it, as the ablation report says it (run_dir.note_on_stderr); the plots are of the other lines."""
    from eval.studies.diagnostics import main
    lines = [json.dumps({"step": 10, "diag/resid_rms/layer_00": 1.0}), '{"step": 20, "diag/resid_rm',
             json.dumps({"step": 30, "diag/resid_rms/layer_00": 2.0})]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    written = main([str(tmp_path), "--out", str(tmp_path / "plots")])
    assert [p.name for p in written] == ["resid_rms.png"]
    err = capsys.readouterr().err
    assert err == f"note: {tmp_path / 'metrics.jsonl'}: 1 line skipped, torn or damaged (line 2); the rest is read\n"


@pytest.mark.parametrize(("line", "expected"), [
    ({"step": 1, "diag/grad_norm/layer_9999999": 1.0}, "metrics.jsonl:3: diag/grad_norm/layer_9999999: layer index "
                                                       "9999999 is out of range; the records log 3 distinct"),
    ({"step": 1, "diag/grad_norm/layer_00": "x"}, "metrics.jsonl:3: diag/grad_norm/layer_00 is 'x', expected a number"),
    ({"step": "a", "diag/grad_norm/layer_00": 1.0}, "metrics.jsonl:3: step is 'a', expected an integer >= 0"),
    ({"step": 1, "diag/grad_norm_global": "x"}, "metrics.jsonl:3: diag/grad_norm_global is 'x', expected a number"),
    # JSON's Infinity reads as a float, which int() overflows on
    ({"step": float("inf"), "diag/grad_norm/layer_00": 1.0}, "metrics.jsonl:3: step is inf, expected an integer >= 0"),
])
def test_diagnostics_refuse_a_bad_metrics_line_in_one_line(tmp_path, capsys, monkeypatch, line, expected) -> None:
    """A layer index beyond the layers logged is refused rather than sized into a dense matrix (layer_99999999 asked
    for 16 GB), and a value that is not a number names FILE:LINE and its key; the command prints one line."""
    import sys

    from eval.studies.diagnostics import command_line
    path = tmp_path / "metrics.jsonl"
    good = {"step": 0, "diag/resid_rms/layer_00": 1.0, "diag/resid_rms/layer_01": 2.0}
    path.write_text("\n".join(json.dumps(r) for r in ({"step": 0, "loss": 5.0}, good, line)) + "\n")
    with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path))}/{re.escape(expected)}"):
        if "diag/grad_norm_global" in line:
            metric_series(path, "diag/grad_norm_global")
        else:
            metric_matrix(path, "grad_norm")
    monkeypatch.setattr(sys, "argv", ["diagnostics.py", str(path), "--out", str(tmp_path / "plots")])
    assert command_line() == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err


def test_a_layer_index_past_the_runs_model_is_refused_where_its_config_records_the_layers(tmp_path, capsys,
                                                                                          monkeypatch) -> None:
    """A 2-block run's records with a stray layer_02 key: the bound was the distinct indices logged (0, 1 and the
    stray 2: three), so the heatmap drew a row for a block the model does not have; where the run's
    train_config.yaml records num_hidden_layers, that bounds the index (one line naming FILE:LINE, the key and
    0 .. 1). A metrics file without a recorded config keeps the distinct-indices bound."""
    import sys

    from eval.studies.diagnostics import command_line
    from trainer.diagnostics import recorded_layers

    path = tmp_path / "metrics.jsonl"
    good = {"step": 0, "diag/resid_rms/layer_00": 1.0, "diag/resid_rms/layer_01": 2.0,
            "diag/grad_norm/layer_00": 1.0, "diag/grad_norm/layer_01": 1.0}
    stray = {"step": 1, "diag/grad_norm/layer_02": 1.0}
    path.write_text("\n".join(json.dumps(r) for r in (good, stray)) + "\n")
    assert recorded_layers(path) is None
    assert metric_matrix(path, "grad_norm")[1].shape == (3, 2)  # no config: the stray index passes the bound
    (tmp_path / "train_config.yaml").write_text("task: pretrain\nnum_hidden_layers: 2\n")
    assert recorded_layers(path) == 2
    expected = (f"{path}:2: diag/grad_norm/layer_02: layer index 2 is out of range; the run's model has 2 layers "
                f"(num_hidden_layers in its train_config.yaml), so 0 .. 1")
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        metric_matrix(path, "grad_norm", recorded_layers(path))
    assert metric_matrix(path, "resid_rms", 2)[1].shape == (2, 1)  # within the bound: drawn as before
    monkeypatch.setattr(sys, "argv", ["diagnostics.py", str(tmp_path), "--out", str(tmp_path / "plots")])
    assert command_line() == 2
    assert capsys.readouterr().err == f"error: {expected}\n"
    assert not (tmp_path / "plots" / "grad_norm.png").exists()


@pytest.mark.parametrize("recorded", ["0", "-1", "true", "2.5", "two", "[2]"])
def test_a_config_that_records_no_count_of_layers_bounds_nothing(tmp_path, recorded) -> None:
    """A train_config.yaml whose num_hidden_layers is not an integer >= 1 records no model (a 0 would refuse every
    index, naming the range 0 .. -1): the distinct-indices bound holds, as without a config."""
    from trainer.diagnostics import recorded_layers

    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 0, "diag/resid_rms/layer_00": 1.0, "diag/resid_rms/layer_01": 2.0}) + "\n")
    (tmp_path / "train_config.yaml").write_text(f"task: pretrain\nnum_hidden_layers: {recorded}\n")
    assert recorded_layers(path) is None
    assert metric_matrix(path, "resid_rms", recorded_layers(path))[1].tolist() == [[1.0], [2.0]]


def test_where_the_config_records_the_layers_an_index_the_records_skip_is_a_row_of_nan(tmp_path) -> None:
    """A 4-block run's records that log layers 0 and 3 only (the others' keys lost): with the model's 4 blocks
    recorded, index 3 is in range and the skipped blocks are rows of NaN, as docs/diagnostics.md says (the
    distinct-indices bound, 2 here, is the one without a config; it refused index 3 as out of range, 0 .. 1)."""
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 5, "diag/resid_rms/layer_00": 1.0, "diag/resid_rms/layer_03": 4.0}) + "\n")
    with pytest.raises(ValueError, match=r"layer index 3 is out of range; the records log 2 distinct"):
        metric_matrix(path, "resid_rms")
    steps, matrix = metric_matrix(path, "resid_rms", 4)
    assert steps.tolist() == [5] and matrix[[0, 3], 0].tolist() == [1.0, 4.0] and np.isnan(matrix[1:3, 0]).all()


def test_end_to_end_with_adamw_and_real_log_lines(tmp_path) -> None:
    """A few training steps as the training core runs them, logged to jsonl and plotted."""
    model = tiny_model("sandwich", "prmsnorm")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    diag = NormDiagnostics(model)
    path = tmp_path / "metrics.jsonl"
    with path.open("w") as f:
        for step in range(4):
            if step % 2 == 0:
                diag.arm()
            ids = batch(step)
            model(ids, labels=ids).loss.backward()
            stats = diag.after_backward() if diag.armed else {}
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            stats.update(diag.after_step())
            f.write(json.dumps({"step": step, **stats}) + "\n")
            assert no_hooks_left(model)
    steps, matrix = metric_matrix(path, "update_ratio")
    np.testing.assert_array_equal(steps, [0, 2])
    assert matrix.shape == (LAYERS, 2) and np.isfinite(matrix).all() and (matrix > 0).all()
    assert len(layer_quantities(json.loads(line) for line in path.read_text().splitlines())) == 15


def test_loss_scale_divides_gradient_statistics() -> None:
    """With fp16 loss scaling the grads are still scaled when after_backward runs; loss_scale undoes it."""
    ids = batch()
    plain, _ = armed_step(tiny_model("pre"), ids)
    model = tiny_model("pre")
    diag = NormDiagnostics(model)
    diag.arm()
    (model(ids, labels=ids).loss * 1024.0).backward()
    scaled = diag.after_backward(loss_scale=1024.0)
    assert scaled.keys() == plain.keys()
    for key, value in plain.items():
        assert scaled[key] == pytest.approx(value, rel=1e-5), key


def test_grad_at_init_script_smoke(tmp_path) -> None:
    """eval/studies/grad_at_init.py end to end (random tokens: loading the real tokenizer takes seconds): tables, PNG,
    the no-norm runs shared by all placements, and --head_dim measuring heads of its width."""
    from eval.studies.grad_at_init import main
    results = main(["--layers", "2", "--seq_len", "16", "--batch_size", "2", "--batches", "2", "--seeds", "2",
                    "--placements", "pre,post", "--norm_types", "rmsnorm,none", "--random_tokens",
                    "--head_dim", "16", "--threads", "1", "--out", str(tmp_path / "out")])
    assert [(r["placement"], r["norm_type"]) for r in results["runs"]] == \
        [("pre", "rmsnorm"), ("pre", "none"), ("post", "rmsnorm"), ("post", "none")]
    assert all(len(r["ffn_w2_mean"]) == 2 and min(r["block_mean"]) > 0 for r in results["runs"])
    assert "(hidden 256, 8 heads of 16, " in (tmp_path / "out" / "grad_at_init.md").read_text()
    for name in ("results.json", "grad_at_init.md", "grad_at_init.png"):
        assert (tmp_path / "out" / name).stat().st_size > 500
    # A gradient that was not finite is null in results.json (strict JSON); --replot draws it as NaN, not a crash.
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    saved["runs"][1]["ffn_w2_mean"][1] = saved["runs"][1]["block_mean"][0] = None
    (tmp_path / "out" / "results.json").write_text(json.dumps(saved))
    main(["--replot", "--out", str(tmp_path / "out")])
    assert "| pre | none | " in (table := (tmp_path / "out" / "grad_at_init.md").read_text()) and "nan" in table


@pytest.mark.parametrize("flags", [["--placements", "prenorm"], ["--norm_types", "bogus"],
                                   ["--placements", "deepnorm", "--norm_types", "none"], ["--replot"]])
def test_grad_at_init_refuses_bad_variants_in_one_line_and_keeps_the_results(tmp_path, capsys, monkeypatch,
                                                                             flags) -> None:
    """An unknown placement or norm type is refused up front naming the flag and the library's values; a grid the
    config refuses entirely writes nothing (the committed results stay); --replot without results.json is one line."""
    import sys

    from eval.studies.grad_at_init import command_line
    out = tmp_path / "out"
    if flags != ["--replot"]:
        out.mkdir()
        for name in ("results.json", "grad_at_init.md"):
            (out / name).write_text("good results")
    monkeypatch.setattr(sys, "argv", ["grad_at_init.py", *flags, "--layers", "1", "--seq_len", "16", "--batch_size",
                                      "1", "--batches", "1", "--seeds", "1", "--random_tokens", "--out", str(out)])
    try:
        code = command_line()
    except SystemExit as exit_:  # argparse's refusal of a flag's value
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err
    assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1 and "Traceback" not in err
    expected = {"prenorm": "--placements: 'prenorm' not allowed; choose from 'pre'",
                "bogus": "--norm_types: 'bogus' not allowed; choose from 'rmsnorm'",
                "deepnorm": "no variant to measure", "--replot": "results.json does not exist"}
    assert next(text for key, text in expected.items() if key in flags) in err
    if flags != ["--replot"]:
        assert sorted(p.name for p in out.iterdir()) == ["grad_at_init.md", "results.json"]
        assert (out / "results.json").read_text() == "good results"


def test_grad_at_init_sizes_past_the_memory_are_one_line(tmp_path, capsys, monkeypatch) -> None:
    """Sizes within their bounds whose batches and one batch's logits alone are past the memory: one line naming the
    flags, before the data is read or a network built (it was the allocator's traceback); an allocation that fails
    in a network's forward and backward anyway is the trainer's kind of line, naming it and what to lower."""
    import sys

    from eval.studies import grad_at_init

    def run(*sizes: str) -> str:
        monkeypatch.setattr(sys, "argv", ["grad_at_init.py", "--layers", "1", "--seeds", "1", "--placements", "pre",
                                          "--norm_types", "rmsnorm", "--random_tokens", *sizes,
                                          "--out", str(tmp_path / "out")])
        assert grad_at_init.command_line() == 2
        return capsys.readouterr().err

    fake_memory(monkeypatch)
    monkeypatch.setattr(grad_at_init, "input_batches", lambda args: pytest.fail("the batches were made"))
    assert run("--batches", "2", "--batch_size", "4", "--seq_len", "16") == (
        "error: --batches 2 x --batch_size 4 x --seq_len 16: the batches' token ids (int64) and one batch's logits "
        "(6400 vocabulary, fp32) would take 1.6 MiB, more than the 1.0 MiB of a fake 1 MiB memory: lower "
        "--batch_size, --seq_len or --batches\n")

    monkeypatch.undo()  # input_batches and the machine's memory back
    monkeypatch.setattr(grad_at_init, "measure", refuse_allocation)
    assert run("--batches", "1", "--batch_size", "1", "--seq_len", "16") == (
        f"error: out of memory in the pre rmsnorm network's forward and backward ({ALLOCATOR_SAID}): lower "
        f"--batch_size, --seq_len or the model's sizes (--layers, --hidden_size, --intermediate_size)\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag", ["--seq_len", "--batch_size", "--batches", "--seeds"])
def test_grad_at_init_huge_sizes_are_one_line(tmp_path, capsys, flag) -> None:
    """A --seq_len or --batch_size of 10**30 was torch.randint's 'Overflow when unpacking long long' traceback (with
    the C++ frames), --seeds of 10**30 'Python int too large to convert to C ssize_t': now bounded by the model's
    size bound (model/config.py's MAX_SIZE), refused by argparse naming the flag."""
    from eval.studies.grad_at_init import main
    sizes = {"--layers": "1", "--seq_len": "16", "--batch_size": "1", "--batches": "1", "--seeds": "1",
             flag: str(10**30)}
    with pytest.raises(SystemExit) as exit_info:
        main([*(item for pair in sizes.items() for item in pair), "--random_tokens", "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag}: " in err and "2147483647" in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_grad_at_init_no_norm_is_one_network_for_every_placement() -> None:
    """The premise that lets eval/studies/grad_at_init.py measure the no-norm model once and reuse it for every
    placement."""
    from eval.studies.grad_at_init import measure
    ids = [batch()]
    reference = measure(tiny_model("pre", norm_type="none").config, ids, seeds=[0])
    for placement in PLACEMENTS[1:]:
        measured = measure(tiny_model(placement, norm_type="none").config, ids, seeds=[0])
        for quantity, values in reference.items():
            np.testing.assert_array_equal(measured[quantity], values, err_msg=f"{placement}: {quantity}")


class _CharTokenizer:
    """A stand-in tokenizer: one id per character, eos = 0."""

    eos_token_id = 0

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [1 + ord(ch) % 90 for ch in text]}

    def __len__(self) -> int:
        return 91


def test_grad_at_init_packs_documents_with_eos(tmp_path) -> None:
    from eval.studies.grad_at_init import token_batches
    data = tmp_path / "tiny.jsonl"
    data.write_text("".join(json.dumps({"text": "ab" * 7}) + "\n" for _ in range(20)))
    batches, label = token_batches(str(data), 2, 3, 5, tokenizer=_CharTokenizer())
    assert len(batches) == 2 and all(b.shape == (3, 5) for b in batches)
    stream = torch.cat([b.flatten() for b in batches])
    assert set(stream.tolist()) <= {0, 1 + ord("a") % 90, 1 + ord("b") % 90}
    assert "tiny.jsonl" in label


def test_grad_at_init_reads_a_data_file_as_the_trainer_does(tmp_path) -> None:
    """--data_path is read past a leading UTF-8 byte order mark, as every jsonl reader of the trainer reads it
    (dataset/jsonl.py numbered_lines): the batches equal those of the file without it; a bad line names its file
    and line."""
    from eval.studies.grad_at_init import token_batches
    lines = b'{"text": "abcdefgh"}\n\n{"text": "ijklmnop"}\n'
    plain, marked, bad = tmp_path / "plain.jsonl", tmp_path / "marked.jsonl", tmp_path / "bad.jsonl"
    plain.write_bytes(lines)
    marked.write_bytes(b"\xef\xbb\xbf" + lines)
    bad.write_bytes(lines + b'{"text": \n')
    expected, _ = token_batches(str(plain), 1, 2, 9, tokenizer=_CharTokenizer())
    got, _ = token_batches(str(marked), 1, 2, 9, tokenizer=_CharTokenizer())
    assert [b.tolist() for b in got] == [b.tolist() for b in expected]
    documents = [[1 + ord(c) % 90 for c in text] + [0] for text in ("abcdefgh", "ijklmnop")]  # _CharTokenizer's ids
    assert sorted(expected[0].tolist()) == documents
    with pytest.raises(ValueError, match=f"^{re.escape(str(bad))}:4: "):
        token_batches(str(bad), 1, 2, 9, tokenizer=_CharTokenizer())


def reference_attention_logit_max(model: MiniNormForCausalLM, ids: torch.Tensor) -> tuple[list[float], torch.Tensor]:
    """Per block, max over heads, batch and causal (query, key) pairs of q.k/sqrt(d), in fp64 from the block's
    attention input, its weights and RoPE written out here (rotate-half, inv_freq = theta^(-2i/d)); and the
    logits of the same forward."""
    config, trunk = model.config, model.model
    d, heads, kv_heads = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    batch_size, length = ids.shape
    inv_freq = config.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()

    def rotate(t: torch.Tensor) -> torch.Tensor:
        first, second = t[..., :d // 2], t[..., d // 2:]
        return t * cos + torch.cat((-second, first), -1) * sin

    inputs: list[torch.Tensor] = []
    handles = [b.self_attn.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach()))
               for b in trunk.layers]
    with torch.no_grad():
        logits = model(ids).logits
    for handle in handles:
        handle.remove()
    maxima = []
    for block, h in zip(trunk.layers, inputs):
        attn = block.self_attn
        q = (h.double() @ attn.q_proj.weight.double().T).view(batch_size, length, heads, d)
        k = (h.double() @ attn.k_proj.weight.double().T).view(batch_size, length, kv_heads, d)
        if attn.q_norm is not None:  # per-head QK-norm: RMSNorm over head_dim with the module's gains
            q = q * (q.pow(2).mean(-1, keepdim=True) + config.norm_eps).rsqrt() * attn.q_norm.weight.double()
            k = k * (k.pow(2).mean(-1, keepdim=True) + config.norm_eps).rsqrt() * attn.k_norm.weight.double()
        q, k = rotate(q.transpose(1, 2)), rotate(k.transpose(1, 2)).repeat_interleave(heads // kv_heads, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        maxima.append(scores.masked_fill(~causal, float("-inf")).max().item())
    return maxima, logits


@pytest.mark.parametrize("qk_norm", [False, True])
def test_attention_logit_max_and_output_logits_match_fp64(qk_norm: bool) -> None:
    torch.manual_seed(0)
    config = MiniNormConfig(vocab_size=97, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=64, norm_impl="eager", qk_norm=qk_norm,
                            rope_theta=100.0)
    model = MiniNormForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():  # gains away from 1, so a skipped QK-norm gain would show
            parameter.add_(0.3 * torch.randn_like(parameter))
    ids = batch()
    maxima, logits = reference_attention_logit_max(model, ids)
    stats, armed_logits = armed_step(model, ids)
    assert torch.equal(armed_logits, logits)  # observing changes nothing
    for i, expected in enumerate(maxima):
        assert stats[f"diag/attn_logit_max/layer_{i:02d}"] == pytest.approx(expected, rel=1e-5)
    assert stats["diag/logits_rms"] == pytest.approx(ref_rms(logits), rel=1e-6)
    assert stats["diag/logits_max"] == pytest.approx(logits.max().item(), rel=1e-6)
    assert no_hooks_left(model)



def test_spike_steps_follow_the_running_median_rule() -> None:
    from trainer.diagnostics import spike_steps

    # 12 steady values, then a 1.6x jump (a spike), a 1.4x one (not), a NaN (always), a later 2x one.
    values = [2.0, 2.2, 1.8, 2.0, 2.1, 1.9, 2.0, 2.0, 2.2, 1.8, 2.0, 2.0, 3.2, 2.8, float("nan"), 2.0, 4.1]
    steps = list(range(10, 10 + len(values)))
    # Medians of the finite values before each: 2.0 throughout (written out: the spikes barely move it).
    assert spike_steps(steps, values) == [22, 24, 26]
    assert spike_steps(steps, values, min_history=13) == [24, 26]  # step 22 has 12 values before it
    assert spike_steps(steps, values, factor=1.3) == [22, 23, 24, 26]
    assert spike_steps(steps, values, window=1, min_history=1) == [22, 24, 26]  # each against its predecessor
    assert spike_steps([], []) == []
    # One huge spike does not hide the next one, as it would under a running mean (3.64 x 1.5 > 3.5).
    assert spike_steps(range(12), [2.0] * 10 + [20.0, 3.5]) == [10, 11]
