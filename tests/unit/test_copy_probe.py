"""eval/copy_probe.py: its first-occurrence, repeat and repeat's-first-token losses against each row scored alone in
fp64 by transformers' AutoModelForCausalLM (the cue-pair probe's rows built from the copy rows' cue table), the JSON
table, and one-line refusals."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from dataset.copy_rows import cue_table
from eval.copy_probe import main


def reference(path, rows: list[list[int]], separators: list[list[int]],
              cues: list[list[int]] | None = None) -> tuple[float, float, float]:
    """Mean fp64 loss over each row's tokens 2..L of the first occurrence, of the repeat, and on the repeat's first
    token, rows (cue + row + separator + row) scored alone."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    first, repeat, repeat_first = [], [], []
    with torch.no_grad():
        for row, separator, cue in zip(rows, separators, cues or [[]] * len(rows)):
            ids = torch.tensor([cue + row + separator + row])
            nats = F.cross_entropy(model(input_ids=ids).logits[0, :-1].double(), ids[0, 1:], reduction="none")
            length, start = len(row), len(cue) + len(row) + len(separator)
            first += nats[len(cue):len(cue) + length - 1].tolist()  # nats[t] is the loss of token t + 1
            repeat += nats[start:start + length - 1].tolist()
            repeat_first.append(float(nats[start - 1]))
    return sum(first) / len(first), sum(repeat) / len(repeat), sum(repeat_first) / len(repeat_first)


def test_the_table_equals_each_row_scored_alone(tiny_models, tokenizer, tmp_path) -> None:
    texts = ["The river runs past the old mill and the bridge near the town.",
             "Numbers: " + " ".join(map(str, range(9))), "Too short."]
    data = tmp_path / "val.jsonl"
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts), encoding="utf-8")
    out = tmp_path / "copy.json"
    assert main(["--model_path", str(tiny_models.pretrain), "--lengths", "5,9", "--rows", "3", "--text", "8",
                 "--data", str(data), "--seed", "4", "--cue_pairs", "2", "--json", str(out)]) == 0
    probes = json.loads(out.read_text())["probes"]
    assert list(probes) == ["random 5", "random 9", "cue pair 5", "cue pair 9", "text 8"]

    def measured(name: str) -> tuple[float, float, float]:
        return probes[name]["first"], probes[name]["repeat"], probes[name]["repeat_first_token"]

    generator = torch.Generator().manual_seed(4)
    low, vocab = max(tokenizer.all_special_ids) + 1, len(tokenizer)
    for length in (5, 9):
        rows = torch.randint(low, vocab, (3, length), generator=generator).tolist()
        assert measured(f"random {length}") == pytest.approx(reference(tiny_models.pretrain, rows, [[]] * 3),
                                                             rel=1e-5)
    pairs = cue_table(range(low, vocab))[:2]
    for length in (5, 9):
        rows = torch.randint(low, vocab, (3, length), generator=generator).tolist()
        drawn = pairs[torch.randint(0, 2, (3,), generator=generator)].tolist()
        expected = reference(tiny_models.pretrain, rows, [[partner] for _, partner in drawn],
                             [[cue] for cue, _ in drawn])
        assert measured(f"cue pair {length}") == pytest.approx(expected, rel=1e-5)
    rows = [tokenizer(text, add_special_tokens=False)["input_ids"][:8] for text in texts[:2]]
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    assert measured("text 8") == pytest.approx(reference(tiny_models.pretrain, rows, [newline] * 2), rel=1e-5)


@pytest.mark.parametrize("flags, message", [(["--lengths", "5,x"], "--lengths '5,x' is not allowed"),
                                             (["--lengths", "1"], "error: --lengths '1' is not allowed; give "
                                                                  "comma-separated integers >= 2\n"),
                                             # a table of no probes, exit 0
                                             (["--lengths", ""], "error: --lengths '' is not allowed"),
                                             (["--lengths", " , "], "error: --lengths ' , ' is not allowed"),
                                             (["--text", "1"], "error: --text 1 is not allowed; give --text 0 or >= 2"),
                                             (["--cue_pairs", "100000"], "--cue_pairs 100000 is not allowed")])
def test_bad_flags_are_one_line(tiny_models, flags, message, capsys) -> None:
    assert main(["--model_path", str(tiny_models.pretrain), *flags]) != 0
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_rows_past_the_models_positions_are_refused_naming_the_largest_that_fits(tiny_models, tokenizer,
                                                                                 capsys) -> None:
    """The tiny model has 128 positions; a row is scored in all its tokens but the last, so a random length L
    fits while 2L - 1 <= 128 (64), 2L + 1 with a cue pair (63), and --text T while 2T + newline - 1 <= 128."""
    model = ["--model_path", str(tiny_models.pretrain), "--rows", "1"]
    assert main([*model, "--lengths", "64", "--text", "0"]) == 0
    assert main([*model, "--lengths", "63", "--text", "0", "--cue_pairs", "2"]) == 0
    newline = len(tokenizer("\n", add_special_tokens=False)["input_ids"])
    largest_text = (129 - newline) // 2
    capsys.readouterr()
    for flags, message in [(["--lengths", "17,100", "--text", "0"],
                            "--lengths 100 is not allowed: its rows of 200 tokens need 199 positions and the model "
                            "has 128; the largest length that fits is 64"),
                           (["--lengths", "64", "--text", "0", "--cue_pairs", "2"],
                            "--lengths 64 is not allowed: its rows of 130 tokens need 129 positions and the model "
                            "has 128; the largest length that fits is 63"),
                           (["--lengths", "5", "--text", str(largest_text + 1)],
                            f"--text {largest_text + 1} is not allowed: its rows of {2 * largest_text + 2 + newline} "
                            f"tokens need {2 * largest_text + 1 + newline} positions and the model has 128; the "
                            f"largest --text that fits is {largest_text}")]:
        assert main([*model, *flags]) != 0
        err = capsys.readouterr().err
        assert [line for line in err.splitlines() if line.startswith("error: ")] == [f"error: {message}"]
        assert "Traceback" not in err
