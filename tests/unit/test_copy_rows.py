"""Copy rows (dataset/copy_rows.py) and the objective that adds them to language modeling (trainer/objectives.py):
the rows' structure, their seeds, and the loss against one computed by hand from the same rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dataset.copy_rows import SPAN_LENGTHS, copy_rows, cue_table
from tests.unit.test_model import VOCAB, random_ids, tiny_model
from trainer.objectives import CopySettings, LanguageModeling, LanguageModelingWithCopies

pytestmark = pytest.mark.usefixtures("one_thread")
TOKENS = range(10, VOCAB)


def repeated_span(ids: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    """(first supervised position, supervised count) of one row."""
    supervised = (labels != -100).nonzero().flatten().tolist()
    assert supervised == list(range(supervised[0], supervised[-1] + 1)), "one contiguous repeat"
    return supervised[0], len(supervised)


@pytest.mark.parametrize("length", [128, 32])
def test_each_row_repeats_one_span_supervised_on_the_repeat_only(length: int) -> None:
    text = random_ids(3, 200, seed=5)
    ids, labels = copy_rows(seed=3, rows=6, vocab=TOKENS, text=text, length=length)
    assert ids.shape == labels.shape == (6, length)
    for row in range(6):
        first, count = repeated_span(ids[row], labels[row])
        span = count + 1  # the repeat's first token is not supervised
        assert SPAN_LENGTHS[0] <= span <= min(SPAN_LENGTHS[1], length // 2 - 1)
        repeat = first - 1
        assert torch.equal(labels[row, first:first + count], ids[row, first:first + count])
        # an earlier occurrence of the whole span ends before the repeat starts
        sources = [s for s in range(0, repeat - span + 1) if torch.equal(ids[row, s:s + span],
                                                                          ids[row, repeat:repeat + span])]
        assert sources, f"row {row}: the repeated span has no earlier occurrence"
        outside = torch.cat([ids[row, :sources[-1]], ids[row, repeat + span:]])
        if row % 2:  # text rows keep the text outside the two occurrences
            source_row = text[(row // 2) % 3, :length]
            kept = torch.cat([source_row[:sources[-1]], source_row[repeat + span:]])
            assert torch.equal(outside, kept)
        else:
            assert int(ids[row].min()) >= TOKENS.start and int(ids[row].max()) < TOKENS.stop


def test_rows_are_a_function_of_the_seed() -> None:
    text = random_ids(2, 64)
    first, again = copy_rows(7, 4, TOKENS, text, 64), copy_rows(7, 4, TOKENS, text, 64)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(copy_rows(8, 4, TOKENS, text, 64)[0], first[0])


@pytest.mark.parametrize("length", [128, 12])
def test_cue_pairs_put_a_cue_before_the_span_its_partner_before_the_repeat_and_supervise_the_whole_repeat(
        length: int) -> None:
    text = random_ids(3, 200, seed=5)
    pairs = {tuple(pair) for pair in cue_table(TOKENS)[:4].tolist()}
    ids, labels = copy_rows(seed=3, rows=40, vocab=TOKENS, text=text, length=length, cue_pairs=4)
    used = set()
    for row in range(40):
        repeat, span = repeated_span(ids[row], labels[row])  # the repeat's first token is supervised too
        assert SPAN_LENGTHS[0] <= span <= min(SPAN_LENGTHS[1], length // 2 - 1)
        assert torch.equal(labels[row, repeat:repeat + span], ids[row, repeat:repeat + span])
        partner = int(ids[row, repeat - 1])
        cue = next(c for c, p in pairs if p == partner)
        sources = [s for s in range(1, repeat - span) if torch.equal(ids[row, s:s + span],
                                                                      ids[row, repeat:repeat + span])]
        assert any(int(ids[row, s - 1]) == cue for s in sources), f"row {row}: no source after the cue"
        used.add((cue, partner))
    assert used == pairs


def test_the_cue_table_pairs_distinct_tokens_once_for_every_run() -> None:
    table = cue_table(TOKENS)
    assert table.shape == (len(TOKENS) // 2, 2)
    tokens = table.flatten().tolist()
    assert len(set(tokens)) == len(tokens) and set(tokens) <= set(TOKENS)
    assert torch.equal(cue_table(TOKENS), table)  # one table for every run and row
    with pytest.raises(ValueError, match=f"{len(table) + 1} cue pairs are too many or too few; the vocabulary's "
                                         f"502 ordinary tokens make 0 to {len(table)} pairs"):
        copy_rows(0, 2, TOKENS, length=64, cue_pairs=len(table) + 1)


def test_rows_too_short_for_a_span_are_refused() -> None:
    with pytest.raises(ValueError, match="copy rows of 11 tokens are too short"):
        copy_rows(0, 2, TOKENS, length=11)
    with pytest.raises(ValueError, match="need text rows at least as long"):
        copy_rows(0, 2, TOKENS, text=random_ids(2, 20), length=32)


def objective(accumulation: int = 2, processes: int = 1, process_index: int = 0,
              cue_pairs: int = 0) -> LanguageModelingWithCopies:
    return LanguageModelingWithCopies(CopySettings(rows=3, weight=0.7, steps=2, weight_after=0.2,
                                                   cue_pairs=cue_pairs), TOKENS, seed=11,
                                      process_index=process_index, processes=processes,
                                      accumulation_steps=accumulation)


@pytest.mark.parametrize(("cue_pairs", "processes"), [(0, 1), (3, 1), (0, 2)])
def test_the_loss_is_language_modeling_plus_the_weighted_copy_mean_by_hand(cue_pairs: int, processes: int) -> None:
    model = tiny_model().train()
    ids = random_ids(2, 40)
    batch = {"input_ids": ids, "labels": ids}
    num_items = torch.tensor(150)  # the step's supervised tokens over all its micro-batches
    process = processes - 1  # the last process
    copies = objective(accumulation=2, processes=processes, process_index=process, cue_pairs=cue_pairs)
    plain, _ = LanguageModeling().loss(model, batch, num_items)
    for step, weight in ((1, 0.7), (2, 0.2)):
        copies.start_step(step)
        for micro_batch in range(2):
            loss, stats = copies.loss(model, batch, num_items)
            rows, labels = copy_rows(copies.row_seed(step, micro_batch, process), 3, TOKENS, ids, 40, cue_pairs)
            logits = model(rows).logits[:, :-1].double()
            targets = labels[:, 1:]
            copy_mean = F.cross_entropy(logits[targets != -100], targets[targets != -100])
            # The step's gradient is weight x the mean of its 2 x processes micro-batches' copy losses.
            expected = plain.double() + weight * copy_mean / (2 * processes)
            assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
            # over the step's 150 targets: the micro-batch's share of the mean of its 2 x processes copy losses
            assert float(stats[-1]) == pytest.approx(float(copy_mean) * 150 / (2 * processes), rel=1e-5)


def test_the_logged_loss_is_lm_loss_plus_weight_x_copy_loss_over_uneven_micro_batches() -> None:
    """What the run logs (the core sums the micro-batches' losses, and their statistics over the step's targets): the
    loss it minimizes is lm_loss + weight x copy_loss even where the micro-batches supervise different numbers of
    tokens (SFT). copy_loss weighted each micro-batch's copy rows by its supervised tokens, which the loss does not."""
    model = tiny_model().train()
    ids = random_ids(2, 40)
    sparse = ids.clone()
    sparse[:, :30] = -100  # 2 x 10 targets beside the first micro-batch's 78
    batches = [{"input_ids": ids, "labels": ids}, {"input_ids": ids, "labels": sparse}]
    copies = objective(accumulation=2)
    num_items = sum(copies.count_items(batch) for batch in batches)
    copies.start_step(1)  # weight 0.7
    losses, stats = zip(*(copies.loss(model, batch, num_items) for batch in batches))
    lm_loss, copy_loss = (sum(stats) / num_items).tolist()
    assert sum(losses).item() == pytest.approx(lm_loss + 0.7 * copy_loss, rel=1e-5)


def test_weight_zero_is_plain_language_modeling_without_the_rows() -> None:
    model = tiny_model().train()
    ids = random_ids(2, 40)
    batch = {"input_ids": ids, "labels": ids}
    copies = LanguageModelingWithCopies(CopySettings(rows=3, weight=1.0, steps=1, weight_after=0.0), TOKENS, 11,
                                        0, 1, 1)
    copies.start_step(1)
    calls = []
    model.register_forward_hook(lambda *args: calls.append(1))
    loss, stats = copies.loss(model, batch, torch.tensor(78))
    assert torch.equal(loss, LanguageModeling().loss(model, batch, torch.tensor(78))[0])
    assert len(calls) == 2  # one forward each: no copy rows drawn
    # lm_loss's token sum (the micro-batch's loss x the step's 78 targets), then a copy_loss of 0
    assert stats.tolist() == pytest.approx([loss.item() * 78, 0.0], rel=1e-6)


def test_more_cue_pairs_than_the_vocabulary_makes_are_refused_before_any_step() -> None:
    with pytest.raises(ValueError, match=r"--copy_cue_pairs=252 is not allowed; 252 cue pairs are too many or too few; "
                                         r"the vocabulary's 502 ordinary tokens make 0 to 251 pairs"):
        objective(cue_pairs=252)
    assert objective(cue_pairs=251).settings.cue_pairs == 251


def test_a_micro_batch_draws_the_rows_of_its_global_index() -> None:
    """Micro-batch 1 of one process (accumulation 2) holds the data of micro-batch 0 on process 1 of two: both draw
    the same rows, so the step is the same however it is split."""
    one, two = objective(accumulation=2, processes=1), objective(accumulation=1, processes=2, process_index=1)
    assert one.row_seed(5, 1, 0) == two.row_seed(5, 0, 1)
    seeds = {one.row_seed(step, micro, 0) for step in range(50) for micro in range(2)}
    assert len(seeds) == 100
