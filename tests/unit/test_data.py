"""Datasets and the default corpus: SFT label masks token by token, packing, MiniMind files, bad input,
deterministic and leak-free splits."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from dataset import corpus as corpus_module
from dataset.corpus import _is_current, corpus_paths, ensure_default_corpus
from dataset.splits import is_validation
from dataset.jsonl import load_jsonl
from dataset.pretrain_dataset import PretrainDataset
from dataset.sft_dataset import IGNORE_INDEX, SFTDataset
from tests.training_runs import write_jsonl
from tests.paths import REPO

IM_START, IM_END, PAD, THINK, THINK_END = 1, 2, 0, 7, 8


def expected_tokens(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Independent expectation, built piece by piece from the format definition: each message is
    <|im_start|> + "role\\n" + content + <|im_end|> + "\\n", an assistant's content preceded by its think block
    <think> + "\\n" + reasoning + "\\n" + </think> + "\\n\\n" (an empty one when it has no reasoning). Labelled: an
    assistant's content and <|im_end|>, and its think block when it has reasoning."""
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    ids: list[int] = []
    labels: list[int] = []
    for m in messages:
        supervised = m["role"] == "assistant"
        header, content, newline = [IM_START, *enc(m["role"] + "\n")], enc(m["content"] or ""), enc("\n")
        ids += header
        labels += [IGNORE_INDEX] * len(header)
        if supervised:
            reasoning = m.get("reasoning_content") or ""
            think = [THINK, *enc(f"\n{reasoning}\n"), THINK_END, *enc("\n\n")]
            ids += think
            labels += think if reasoning else [IGNORE_INDEX] * len(think)
        ids += content + [IM_END] + newline
        labels += (content + [IM_END]) if supervised else [IGNORE_INDEX] * (len(content) + 1)
        labels += [IGNORE_INDEX] * len(newline)
    return ids, labels


SINGLE = [{"role": "user", "content": "What is a cat?"}, {"role": "assistant", "content": "A small furry animal."}]
MULTI = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Tell me a joke."},
    {"role": "assistant", "content": "Why did the chicken cross the road?"},
    {"role": "user", "content": "Why?"},
    {"role": "assistant", "content": "To get to the other side 🐔."},
]
RLAIF = [{"role": "user", "content": "鉴别一组中文文章的风格和特点"}, {"role": "assistant", "content": ""}]
WITH_SYSTEM = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "你好，你是谁？"},
    {"role": "assistant", "content": "我是一个小模型。"},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "You're welcome."},
]


@pytest.fixture()
def cache(tmp_path):
    return tmp_path / "hf_cache"


# ---------------------------------------------------------------- SFT masks


@pytest.mark.parametrize("messages", [SINGLE, MULTI, WITH_SYSTEM], ids=["single", "multi_turn", "system"])
def test_sft_labels_token_by_token(tmp_path, cache, tokenizer, messages):
    path = write_jsonl(tmp_path / "sft.jsonl", [{"conversations": messages}])
    ds = SFTDataset(path, tokenizer, max_seq_len=512, cache_dir=cache)
    ids, labels = expected_tokens(tokenizer, messages)
    item = ds[0]
    assert item["input_ids"].tolist() == ids
    assert item["labels"].tolist() == labels
    # The same ids inference gets from the chat template.
    assert ids == tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]
    # Every assistant turn is supervised, and nothing else: content + <|im_end|> per turn.
    supervised = [t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX]
    answers = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
    assert tokenizer.decode(supervised) == "".join(answers)
    assert labels.count(IM_END) == len(answers)
    assert ds.stats["supervised_tokens"] == len(supervised)


def test_sft_learns_an_assistant_turn_with_two_tool_calls_whole(tmp_path, cache, tokenizer):
    """An assistant message with content and two tool calls: everything the model writes after its header and the
    empty think block -- the content, both <tool_call> blocks, the newline between them, <|im_end|> -- is learned,
    as the tokenizer's own chat template renders it, and nothing else."""
    calls = [{"type": "function", "function": {"name": "lookup", "arguments": {"city": "Paris"}}},
             {"type": "function", "function": {"name": "lookup", "arguments": {"city": "Rome"}}}]
    messages = [{"role": "user", "content": "Weather in Paris and Rome?"},
                {"role": "assistant", "content": "Checking both.", "tool_calls": calls}]
    ds = SFTDataset(write_jsonl(tmp_path / "t.jsonl", [{"conversations": messages}]), tokenizer, 512, cache_dir=cache)
    ids, labels = ds[0]["input_ids"].tolist(), ds[0]["labels"].tolist()
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    header = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    turn = text[text.index(header) + len(header):text.rindex("<|im_end|>") + len("<|im_end|>")]
    assert turn.count("<tool_call>") == 2 and "</tool_call>\n<tool_call>" in turn
    supervised = [t for t, label in zip(ids, labels) if label != IGNORE_INDEX]
    assert tokenizer.decode(supervised) == turn
    assert all(label in (IGNORE_INDEX, t) for t, label in zip(ids, labels))  # a label is its token's id


def test_sft_mask_boundaries(tmp_path, cache, tokenizer):
    """The header before an answer and the newline after its <|im_end|> are never labelled."""
    ds = SFTDataset(write_jsonl(tmp_path / "s.jsonl", [{"conversations": MULTI}]), tokenizer, 512, cache_dir=cache)
    ids, labels = ds[0]["input_ids"].tolist(), ds[0]["labels"].tolist()
    header = tokenizer("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    for i in range(len(ids)):
        if ids[i : i + len(header)] == header:
            assert all(lab == IGNORE_INDEX for lab in labels[i : i + len(header)])
            assert labels[i + len(header)] != IGNORE_INDEX  # the first content token is learned
        if ids[i] == IM_END:
            assert labels[i + 1 : i + 1 + len(newline)] == [IGNORE_INDEX] * len(newline)


def test_sft_truncation_keeps_prefix_and_drops_unsupervised(tmp_path, cache, tokenizer):
    long_user = [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]
    path = write_jsonl(tmp_path / "t.jsonl", [{"conversations": MULTI}, {"conversations": long_user}])
    full_ids, full_labels = expected_tokens(tokenizer, MULTI)
    # Cut in the middle of the second answer.
    cut = full_labels.index(IM_END) + 12
    ds = SFTDataset(path, tokenizer, max_seq_len=cut, cache_dir=cache)
    assert len(ds) == 1
    assert ds[0]["input_ids"].tolist() == full_ids[:cut]
    assert ds[0]["labels"].tolist() == full_labels[:cut]
    assert ds.stats["conversations"] == 2
    assert ds.stats["samples"] == 1
    assert ds.stats["dropped_no_supervision"] == 1
    assert ds.stats["truncated"] == 1
    assert ds.stats["supervised_tokens"] == sum(lab != IGNORE_INDEX for lab in full_labels[:cut])
    # The kept sample lost the second answer's end and the whole third answer; the long user turn's conversation,
    # dropped, is counted as dropped, not as cut.
    assert ds.stats["supervision_cut"] == 1
    assert ds.stats["supervised_tokens_cut"] == sum(lab != IGNORE_INDEX for lab in full_labels[cut:])
    for i in range(len(ds)):
        assert (ds[i]["labels"] != IGNORE_INDEX).any()


def test_sft_stats_count_no_cut_when_the_supervision_ends_within_max_seq_len(tmp_path, cache, tokenizer):
    """A row cut after its last reply's <|im_end|> (only the closing newline goes) is truncated but loses no
    supervised token."""
    full_ids, full_labels = expected_tokens(tokenizer, SINGLE)
    last_supervised = max(i for i, lab in enumerate(full_labels) if lab != IGNORE_INDEX)
    path = write_jsonl(tmp_path / "s.jsonl", [{"conversations": SINGLE}])
    ds = SFTDataset(path, tokenizer, max_seq_len=last_supervised + 1, cache_dir=cache)
    assert ds.stats["truncated"] == 1 and len(full_ids) > last_supervised + 1
    assert ds.stats["supervision_cut"] == 0 and ds.stats["supervised_tokens_cut"] == 0
    shorter = SFTDataset(path, tokenizer, max_seq_len=last_supervised, cache_dir=cache)
    assert shorter.stats["supervision_cut"] == 1 and shorter.stats["supervised_tokens_cut"] == 1


def test_sft_a_row_of_exactly_max_seq_len_tokens_is_whole_and_not_truncated(tmp_path, cache, tokenizer):
    full_ids, full_labels = expected_tokens(tokenizer, SINGLE)
    path = write_jsonl(tmp_path / "s.jsonl", [{"conversations": SINGLE}])
    ds = SFTDataset(path, tokenizer, max_seq_len=len(full_ids), cache_dir=cache)
    assert ds[0]["input_ids"].tolist() == full_ids and ds[0]["labels"].tolist() == full_labels
    assert ds.stats["truncated"] == 0 and ds.stats["supervision_cut"] == 0
    assert SFTDataset(path, tokenizer, max_seq_len=len(full_ids) - 1, cache_dir=cache).stats["truncated"] == 1
    with pytest.raises(ValueError, match="max_seq_len must be at least 2, got 1"):
        SFTDataset(path, tokenizer, max_seq_len=1, cache_dir=cache)


def test_dpo_stats_count_the_supervised_tokens_cut_from_both_answers(tmp_path, cache, tokenizer):
    from dataset.dpo_dataset import DPODataset

    prompt = [{"role": "user", "content": "Name a colour."}]
    chosen = [*prompt, {"role": "assistant", "content": "Blue, the colour of a clear sky at noon."}]
    rejected = [*prompt, {"role": "assistant", "content": "Seven."}]
    chosen_ids, chosen_labels = expected_tokens(tokenizer, chosen)
    _, rejected_labels = expected_tokens(tokenizer, rejected)
    rejected_end = max(i for i, lab in enumerate(rejected_labels) if lab != IGNORE_INDEX) + 1
    cut = rejected_end + 2  # the rejected answer whole, the chosen one cut short
    assert cut < max(i for i, lab in enumerate(chosen_labels) if lab != IGNORE_INDEX)
    path = write_jsonl(tmp_path / "p.jsonl", [{"chosen": chosen, "rejected": rejected}])
    ds = DPODataset(path, tokenizer, max_seq_len=cut, cache_dir=cache)
    assert ds[0]["input_ids"].tolist() == chosen_ids[:cut]
    assert ds.stats["supervision_cut"] == 1
    assert ds.stats["supervised_tokens_cut"] == sum(lab != IGNORE_INDEX for lab in chosen_labels[cut:])
    assert set(ds[0]) == {"input_ids", "labels", "rejected_input_ids", "rejected_labels"}


def test_dpo_drops_a_pair_whose_answers_differ_only_past_the_cut(tmp_path, cache, tokenizer):
    """Two answers that differ only after max_seq_len give two equal rows: a pair that prefers nothing (loss log 2,
    no gradient), which the line check refuses when the answers are equal; it was kept and trained on."""
    from dataset.dpo_dataset import DPODataset

    prompt = [{"role": "user", "content": "Name a colour."}]
    same = "Blue, the colour of a clear sky at noon, and of the sea. "
    pairs = [{"chosen": [*prompt, {"role": "assistant", "content": same + "Yes."}],
              "rejected": [*prompt, {"role": "assistant", "content": same + "No."}]},
             {"chosen": [*prompt, {"role": "assistant", "content": "Red."}],
              "rejected": [*prompt, {"role": "assistant", "content": "Seven."}]}]
    ids, labels = expected_tokens(tokenizer, pairs[0]["chosen"])
    cut = next(i for i, lab in enumerate(labels) if lab != IGNORE_INDEX) + 8  # 8 tokens of the same start
    assert cut < len(ids) and cut > len(expected_tokens(tokenizer, pairs[1]["rejected"])[0])
    path = write_jsonl(tmp_path / "p.jsonl", pairs)
    ds = DPODataset(path, tokenizer, max_seq_len=cut, cache_dir=cache)
    assert len(ds) == 1 and ds.stats["pairs"] == 2 and ds.stats["dropped_no_supervision"] == 1
    assert ds[0]["input_ids"].tolist() != ds[0]["rejected_input_ids"].tolist()
    # a file of such pairs only: the one line says both reasons (it said "no pair keeps a token of both answers",
    # which every pair did)
    with pytest.raises(ValueError, match="keeps a token of both answers, and a difference between them, within"):
        DPODataset(write_jsonl(tmp_path / "same.jsonl", pairs[:1]), tokenizer, max_seq_len=cut, cache_dir=cache)


def test_dpo_learns_only_the_final_answers_and_collates_chosen_rows_first(tmp_path, cache, tokenizer):
    """A pair's labels cover its last assistant message only (the answers it compares; an earlier assistant turn is
    prompt), collate stacks B pairs as the B chosen rows then the B rejected ones, right-padded, and a pair is
    truncated when either side is longer than max_seq_len."""
    from dataset.dpo_dataset import DPODataset

    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there, friend."},
               {"role": "user", "content": "Name a colour."}]
    pairs = [{"chosen": [*history, {"role": "assistant", "content": "Blue."}],
              "rejected": [*history, {"role": "assistant", "content": "Seven, or perhaps eight."}]},
             {"chosen": [history[2], {"role": "assistant", "content": "Red, like a fire engine."}],
              "rejected": [history[2], {"role": "assistant", "content": "No."}]}]
    ds = DPODataset(write_jsonl(tmp_path / "p.jsonl", pairs), tokenizer, max_seq_len=512, cache_dir=cache)

    def final_only(messages):
        ids, labels = expected_tokens(tokenizer, messages)
        earlier, _ = expected_tokens(tokenizer, messages[:-1])
        return ids, [IGNORE_INDEX] * len(earlier) + labels[len(earlier):]

    for index, pair in enumerate(pairs):
        for prefix, side in (("", "chosen"), ("rejected_", "rejected")):
            ids, labels = final_only(pair[side])
            assert ds[index][f"{prefix}input_ids"].tolist() == ids and ds[index][f"{prefix}labels"].tolist() == labels
    batch = ds.collate([ds[0], ds[1]])
    rows = [ds[0]["input_ids"], ds[1]["input_ids"], ds[0]["rejected_input_ids"], ds[1]["rejected_input_ids"]]
    width = max(len(row) for row in rows)
    assert batch["input_ids"].shape == (4, width)
    for row, ids in enumerate(rows):
        assert batch["input_ids"][row, :len(ids)].tolist() == ids.tolist()
        assert (batch["input_ids"][row, len(ids):] == tokenizer.pad_token_id).all()
        assert (batch["labels"][row, len(ids):] == IGNORE_INDEX).all()
        assert batch["attention_mask"][row].tolist() == [1] * len(ids) + [0] * (width - len(ids))
    longer = len(final_only(pairs[1]["chosen"])[0]) - 1  # the chosen answer loses its last token, the other fits
    assert DPODataset(write_jsonl(tmp_path / "q.jsonl", pairs[1:]), tokenizer, max_seq_len=longer,
                      cache_dir=cache).stats["truncated"] == 1
    # both answers cut: the supervised tokens lost are both sides' together
    chosen_ids, chosen_labels = final_only(pairs[1]["chosen"])
    _, rejected_labels = final_only(pairs[1]["rejected"])
    cut = next(i for i, label in enumerate(rejected_labels) if label != IGNORE_INDEX) + 1
    both = DPODataset(write_jsonl(tmp_path / "b.jsonl", pairs[1:]), tokenizer, max_seq_len=cut, cache_dir=cache)
    lost = [sum(label != IGNORE_INDEX for label in labels[cut:]) for labels in (chosen_labels, rejected_labels)]
    assert min(lost) > 0 and both.stats["supervised_tokens_cut"] == sum(lost) and both.stats["supervision_cut"] == 1


def test_dpo_takes_trls_explicit_prompt_as_the_pairs_shared_start(tmp_path, cache, tokenizer):
    """TRL's conversational pair, {"prompt": [messages], "chosen": [answer], "rejected": [answer]}: the prompt comes
    before both answers. It was an extra field, ignored: the pair trained with no question, in silence. A prompt
    that is not a list of messages is a bad line naming it."""
    from dataset.dpo_dataset import DPODataset

    question = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    blue, seven = {"role": "assistant", "content": "Blue."}, {"role": "assistant", "content": "Seven."}
    ds = DPODataset(write_jsonl(tmp_path / "trl.jsonl", [{"prompt": question, "chosen": [blue], "rejected": [seven]}]),
                    tokenizer, max_seq_len=512, cache_dir=cache)
    for key, answer in (("input_ids", blue), ("rejected_input_ids", seven)):
        ids, _ = expected_tokens(tokenizer, [*question, answer])
        assert ds[0][key].tolist() == ids
    earlier, _ = expected_tokens(tokenizer, question)
    assert (ds[0]["labels"][:len(earlier)] == IGNORE_INDEX).all()  # the prompt is not learned
    # UltraFeedback's rows: the question as a "prompt" string (or list) and again as the conversations' first turns
    for prompt in ("Name a colour.", question):
        whole = DPODataset(write_jsonl(tmp_path / "uf.jsonl", [{"prompt": prompt, "chosen": [*question, blue],
                                                                 "rejected": [*question, seven]}]),
                           tokenizer, max_seq_len=512, cache_dir=cache)
        assert whole[0]["input_ids"].tolist() == expected_tokens(tokenizer, [*question, blue])[0]
    # A null prompt is none, as before "prompt" was read (`datasets`' to_json writes null where a row had none);
    # beside answer-only conversations that leaves no prompt at all, refused as a pair with none is
    unset = DPODataset(write_jsonl(tmp_path / "null.jsonl", [{"prompt": None, "chosen": [*question, blue],
                                                               "rejected": [*question, seven]}]),
                       tokenizer, max_seq_len=512, cache_dir=cache)
    assert unset[0]["input_ids"].tolist() == expected_tokens(tokenizer, [*question, blue])[0]
    for prompt, reason in (("Name a colour.", '"prompt" is a string but "chosen" and "rejected" hold only the answer'),
                           ([], '"prompt" must be a non-empty list of messages'),
                           ([{"role": "user"}], 'prompt[0] has no "content" string'),
                           (None, '"chosen" and "rejected" hold only their answers and there is no "prompt"')):
        path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": prompt, "chosen": [blue], "rejected": [seven]}])
        with pytest.raises(ValueError, match=re.escape(f"{path}:1: {reason}")):
            DPODataset(path, tokenizer, max_seq_len=512, cache_dir=cache)


def test_a_preference_scan_cached_before_the_prompt_beside_whole_conversations_is_read_again(tmp_path, monkeypatch):
    """A scan cached under SCAN_VERSION 8, whose check put a "prompt" list before conversations that already begin
    with it (an UltraFeedback row: the question twice), is not reused: the file is checked again, the question once."""
    import dataset.jsonl as jsonl

    question = [{"role": "user", "content": "Name a colour."}]
    chosen, rejected = [*question, {"role": "assistant", "content": "Blue."}], [*question, {"role": "assistant",
                                                                                            "content": "Seven."}]
    path = write_jsonl(tmp_path / "uf.jsonl", [{"prompt": question, "chosen": chosen, "rejected": rejected}])
    with monkeypatch.context() as version_8:  # that version's check: the prompt list before both, always
        version_8.setattr(jsonl, "SCAN_VERSION", 8)
        version_8.setattr(jsonl, "_pair_prompt", lambda obj, *conversations: jsonl._check_messages(obj, "prompt"))
        stale, _ = load_jsonl(path, "preference", cache_dir=tmp_path / "cache")
        assert [m["content"] for m in stale[0]["chosen"]] == ["Name a colour.", "Name a colour.", "Blue."]
    fresh, _ = load_jsonl(path, "preference", cache_dir=tmp_path / "cache")
    assert [m["content"] for m in fresh[0]["chosen"]] == ["Name a colour.", "Blue."]


def test_supervision_cut_note_names_the_flag_and_the_share():
    from trainer.data import supervision_cut_note

    assert supervision_cut_note({"samples": 10, "supervised_tokens": 400, "supervision_cut": 0,
                                 "supervised_tokens_cut": 0}, 384) is None
    assert supervision_cut_note({"documents": 3, "tokens": 900}, 256) is None  # pretraining has no supervision stats
    note = supervision_cut_note({"samples": 1000, "supervised_tokens": 9000, "supervision_cut": 120,
                                 "supervised_tokens_cut": 1000}, 384)
    assert note == ("note: --max_seq_len 384 cuts the supervised end off 120 of 1,000 samples (1,000 of their "
                    "10,000 supervised tokens, 10.0%); a larger --max_seq_len keeps them")


def test_sft_collate_pads_right(tmp_path, cache, tokenizer):
    path = write_jsonl(tmp_path / "c.jsonl", [{"conversations": SINGLE}, {"conversations": MULTI}])
    ds = SFTDataset(path, tokenizer, 512, cache_dir=cache)
    batch = next(iter(DataLoader(ds, batch_size=2, collate_fn=ds.collate)))
    lengths = [len(ds[0]["input_ids"]), len(ds[1]["input_ids"])]
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (2, max(lengths))
    short = lengths.index(min(lengths))
    n = lengths[short]
    assert batch["input_ids"][short, :n].tolist() == ds[short]["input_ids"].tolist()
    assert (batch["input_ids"][short, n:] == PAD).all()
    assert (batch["labels"][short, n:] == IGNORE_INDEX).all()
    assert batch["attention_mask"][short].tolist() == [1] * n + [0] * (max(lengths) - n)
    assert batch["input_ids"].dtype == torch.long


def test_minimind_sft_file_loads_unchanged(tmp_path, cache, tokenizer):
    rows = [
        {"conversations": [{"role": "system", "content": "You are MiniMind."}, *SINGLE]},
        {"conversations": [{"role": "user", "content": "2+2?"},
                           {"role": "assistant", "content": "4", "reasoning_content": "Add them."}],
         "tools": "[]"},
        {"conversations": [{"role": "user", "content": "Weather?"},
                           {"role": "assistant", "content": None, "reasoning_content": "Look at the sky."},
                           {"role": "assistant", "content": "Sunny."}],
         "tools": [{"name": "weather", "parameters": {"city": "Paris"}}]},
    ]
    path = write_jsonl(tmp_path / "sft_mini.jsonl", rows)
    ds = SFTDataset(path, tokenizer, 512, cache_dir=cache)
    assert len(ds) == 3 and ds.stats["skipped_lines"] == 0
    ids, labels = expected_tokens(tokenizer, rows[0]["conversations"])
    assert ds[0]["input_ids"].tolist() == ids and ds[0]["labels"].tolist() == labels
    # The reasoning is learned (a record's top-level "tools" is not MiniMind's place for them: ignored); a null
    # content is an empty message (one with nothing else in it is a bad line: an answer of nothing).
    ids, labels = expected_tokens(tokenizer, rows[1]["conversations"])
    assert ds[1]["input_ids"].tolist() == ids and ds[1]["labels"].tolist() == labels
    weather = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "", "reasoning_content": "Look at the sky."},
               {"role": "assistant", "content": "Sunny."}]
    assert ds[2]["labels"].tolist() == expected_tokens(tokenizer, weather)[1]


def test_sft_rejects_non_chatml_tokenizer(tmp_path, cache, tokenizer):
    import copy

    other = copy.deepcopy(tokenizer)
    other.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ValueError, match="ChatML"):
        SFTDataset(write_jsonl(tmp_path / "x.jsonl", [{"conversations": SINGLE}]), other, 64, cache_dir=cache)


# ---------------------------------------------------------------- packing


def _docs(n: int) -> list[str]:
    return [f"Document {i}: " + "lorem ipsum dolor " * (i % 7) + ("你好" if i % 3 == 0 else "end.") for i in range(n)]


def test_packing_has_no_padding_and_loses_no_token(tmp_path, cache, tokenizer):
    docs = _docs(2500)  # > 1000 rows: several Arrow chunks, so rows are gathered across chunk borders
    path = write_jsonl(tmp_path / "pre.jsonl", [{"text": d} for d in docs])
    L = 64
    ds = PretrainDataset(path, tokenizer, max_seq_len=L, cache_dir=cache)
    assert ds._tokens.data.column("input_ids").num_chunks > 1
    stream = []
    for d in docs:
        stream += tokenizer(d, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert len(ds) == len(stream) // L
    packed = torch.cat([ds[i]["input_ids"] for i in range(len(ds))]).tolist()
    assert packed == stream[: len(ds) * L]  # same tokens, same order, nothing lost but the short tail
    assert all(ds[i]["input_ids"].shape == (L,) and torch.equal(ds[i]["input_ids"], ds[i]["labels"])
               for i in range(len(ds)))
    assert PAD not in packed
    stats = ds.stats
    assert stats["documents"] == len(docs) and stats["tokens"] == len(stream)
    assert stats["sequences"] == len(ds) and stats["padding_tokens"] == 0
    assert stats["dropped_tail_tokens"] == len(stream) - len(ds) * L < L
    assert stats["packing_efficiency"] == pytest.approx(len(ds) * L / len(stream))
    assert stats["packing_efficiency"] >= 0.99
    assert stats["padded_baseline_efficiency"] < stats["packing_efficiency"]
    assert torch.equal(ds[-1]["input_ids"], ds[len(ds) - 1]["input_ids"])
    with pytest.raises(IndexError):
        ds[len(ds)]
    # Default collate; and a pickled copy (what DataLoader workers get) reads the same rows.
    batch = next(iter(DataLoader(ds, batch_size=4)))
    assert batch["input_ids"].shape == (4, L) and batch["input_ids"].dtype == torch.long
    clone = pickle.loads(pickle.dumps(ds))
    assert torch.equal(clone[7]["input_ids"], ds[7]["input_ids"])
    # The second load reuses the cached tokenization.
    again = PretrainDataset(path, tokenizer, max_seq_len=L, cache_dir=cache)
    assert again._tokens.cache_files == ds._tokens.cache_files and again.stats == stats


def test_an_empty_document_is_left_out_counted_and_said_once(tmp_path, cache, tokenizer, caplog, monkeypatch):
    """{"text": ""} (or only whitespace) was packed as a document of one eos (its whitespace's tokens, then eos):
    the model learnt to end a document before it began. It is left out of the stream, counted in the stats, said
    once; a scan cached before the rule is not served; a file of nothing else is refused as holding no text."""
    import logging

    import dataset.jsonl as jsonl

    docs = ["alpha beta gamma " * 4, "", " \n\t\u3000", "delta epsilon " * 4, ""]
    path = write_jsonl(tmp_path / "pre.jsonl", [{"text": d} for d in docs])
    with monkeypatch.context() as version_13:  # that version's scan: every text a document
        version_13.setattr(jsonl, "SCAN_VERSION", 13)
        version_13.setattr(jsonl, "is_empty_document", lambda kind, record: False)
        assert PretrainDataset(path, tokenizer, 8, cache_dir=cache).stats["documents"] == 5
    with caplog.at_level(logging.WARNING, logger="dataset.jsonl"):
        ds = PretrainDataset(path, tokenizer, 8, cache_dir=cache)
    stream = []
    for d in (docs[0], docs[3]):
        stream += tokenizer(d, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert torch.cat([ds[i]["input_ids"] for i in range(len(ds))]).tolist() == stream[: len(ds) * 8]
    assert (ds.stats["documents"], ds.stats["empty_documents"], ds.stats["tokens"]) == (2, 3, len(stream))
    said = [record.getMessage() for record in caplog.records if "empty document" in record.getMessage()]
    assert said == [f'{path}: left out 3 empty document(s) (a "text" of only whitespace, the first on line 2): '
                    f"nothing to learn from, and each would train an end of text after nothing"]
    assert PretrainDataset(path, tokenizer, 8, cache_dir=cache).stats == ds.stats  # the cached scan's counts
    empty = write_jsonl(tmp_path / "empty.jsonl", [{"text": ""}, {"text": "  "}])
    with pytest.raises(ValueError, match=rf"^{re.escape(str(empty))}: no text records in the file \(2 empty "
                                         rf"documents left out\); refusing to train on nothing$"):
        PretrainDataset(empty, tokenizer, 8, cache_dir=cache)


def test_packing_with_num_proc_matches(tmp_path, cache, tokenizer):
    path = write_jsonl(tmp_path / "pre.jsonl", [{"text": d} for d in _docs(300)])
    one = PretrainDataset(path, tokenizer, 32, cache_dir=cache)
    two = PretrainDataset(path, tokenizer, 32, num_proc=2, cache_dir=cache)
    assert len(one) == len(two)
    assert all(torch.equal(one[i]["input_ids"], two[i]["input_ids"]) for i in range(len(one)))


def test_minimind_pretrain_file_loads_unchanged(tmp_path, cache, tokenizer):
    rows = [{"text": "<|im_start|>鉴别一组中文文章的风格和特点。<|im_end|>"}, {"text": "Plain English text. " * 20}]
    path = write_jsonl(tmp_path / "pretrain_hq.jsonl", rows)
    assert load_jsonl(path, "text", cache_dir=cache)[0]["text"] == [row["text"] for row in rows]  # read unchanged
    # Its turn markers read as the control tokens with --control_tokens_in_text (MiniMind's reading of its file)
    ds = PretrainDataset(path, tokenizer, 16, cache_dir=cache, control_tokens=True)
    first = tokenizer(rows[0]["text"], add_special_tokens=False)["input_ids"]
    assert ds[0]["input_ids"].tolist() == first[:16]
    assert first[0] == IM_START


def test_documents_holding_control_token_strings_read_as_text_are_counted_and_noted(tmp_path, cache, tokenizer):
    """MiniMind's pretrain_hq.jsonl given without --control_tokens_in_text trained its turn marks as characters
    without a word: the documents that hold a special token's string are counted (each split its own), and the run
    prints a note naming the flag; read as the tokens, none is counted."""
    from trainer.data import control_text_note

    rows = ([{"text": "<|im_start|>鉴别一组中文文章的风格和特点。<|im_end|>"}, {"text": "A tool: <tool_call> as text."}]
            + [{"text": f"Plain English text number {i}. " * 8} for i in range(8)])
    path = write_jsonl(tmp_path / "pretrain_hq.jsonl", rows)
    as_text = PretrainDataset(path, tokenizer, 16, cache_dir=cache)
    assert as_text.stats["control_token_text"] == 2
    assert PretrainDataset(path, tokenizer, 16, cache_dir=cache, control_tokens=True).stats["control_token_text"] == 0
    train, val = as_text.split_documents(0.5, seed=0)
    held = {i for i in (0, 1) if i in val.documents}
    assert (train.stats["control_token_text"], val.stats["control_token_text"]) == (2 - len(held), len(held))
    assert control_text_note(as_text.stats) == (
        "note: 2 of 10 training documents hold control-token strings (<|im_start|>, <|im_end|>, ...), read as text; "
        "--control_tokens_in_text true reads them as the tokens, for files written that way (MiniMind's "
        "pretrain_hq.jsonl)")
    assert control_text_note({"documents": 3, "control_token_text": 0}) is None
    assert control_text_note({"samples": 3}) is None  # SFT's stats: no such count


def test_a_held_out_split_too_short_is_named_as_the_split(tmp_path, cache, tokenizer):
    """60 documents of 56 tokens and --val_fraction 0.01: the one held-out document is short of a row of 64, which
    was told as "FILE: 57 tokens is less than one sequence", of a file of 3,000 tokens."""
    path = write_jsonl(tmp_path / "short.jsonl", [{"text": "word " * 55}] * 60)
    data = PretrainDataset(path, tokenizer, 64, cache_dir=cache)
    tokens = data.stats["tokens"] // 60
    with pytest.raises(ValueError) as refused:
        data.split_documents(0.01, seed=0)
    assert str(refused.value) == (f"{path}: its validation split (1 of 60 documents, --val_fraction 0.01 held out) "
                                  f"holds {tokens} tokens, less than one sequence of max_seq_len=64; raise "
                                  f"--val_fraction or give --val_data_path")
    train, val = data.split_documents(0.1, seed=0)
    assert len(val) == 6 * tokens // 64


def test_pretrain_too_short_is_an_error(tmp_path, cache, tokenizer):
    with pytest.raises(ValueError, match="less than one sequence"):
        PretrainDataset(write_jsonl(tmp_path / "tiny.jsonl", [{"text": "hi"}]), tokenizer, 512, cache_dir=cache)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kind, rows, line, message",
    [
        ("text", [{"text": "ok"}, {"txt": "typo"}, {"text": "ok"}], 2, 'missing "text" field'),
        ("text", [{"text": "ok"}, {"text": "ok"}, '{"text": "unterminated'], 3, "invalid JSON"),
        ("text", [{"text": 5}], 1, '"text" must be a string'),
        ("text", [["a list"]], 1, "expected a JSON object"),
        ("conversations", [{"conversations": SINGLE}, {"messages": SINGLE}], 2, 'missing "conversations" field'),
        ("conversations", [{"conversations": []}], 1, "non-empty list"),
        ("conversations", [{"conversations": SINGLE}, {"conversations": [{"content": "no role"}]}], 2, 'no "role"'),
        ("conversations", [{"conversations": [{"role": "user", "content": 3}]}], 1, 'no "content"'),
        # ShareGPT's roles, a capital: such conversations were dropped silently (nothing an "assistant" said)
        ("conversations", [{"conversations": SINGLE}, {"conversations": [{"role": "human", "content": "hi"},
                                                                         {"role": "gpt", "content": "yo"}]}], 2,
         "conversations[0].role is 'human'; a role is one of system, user, assistant, tool"),
        ("conversations", [{"conversations": [{"role": "user", "content": "hi"},
                                              {"role": "Assistant", "content": "yo"}]}], 1,
         "conversations[1].role is 'Assistant'; a role is one of system, user, assistant, tool"),
        # MiniMind's rlaif.jsonl (a prompt, then the empty turn the policy writes) given to SFT: learnt, it is
        # <|im_end|> alone, an answer of nothing
        ("conversations", [{"conversations": SINGLE}, {"conversations": RLAIF}], 2,
         "conversations[1] is an empty assistant message (no content, tool_calls or reasoning_content): training on "
         "it teaches the model to answer nothing. This looks like prompt-only RL data (MiniMind's rlaif.jsonl), "
         "which train_grpo.py and train_ppo.py take, and train_distillation.py with --lmbda 1 or --seq_kd (every step "
         "samples its answers, reading such a row as its prompt)"),
        # no assistant message at all: nothing to learn (it was dropped without a word, or, every line so, refused as
        # "no conversation has a supervised token within max_seq_len")
        ("conversations", [{"conversations": SINGLE}, {"conversations": WITH_SYSTEM[:2]}], 2,
         '"conversations" holds no assistant message: nothing to learn (only the assistant\'s answers are trained '
         "on). A conversation of only a prompt is RL data, which train_grpo.py and train_ppo.py take"),
        ("conversations", [{"conversations": [*MULTI[:3], {"role": "assistant", "content": " \n\t"}, *MULTI[4:]]}],
         1, "conversations[3] is an empty assistant message"),
        # a thought of only whitespace is no thought: its label is the empty think block and <|im_end|>
        ("conversations", [{"conversations": [SINGLE[0], {"role": "assistant", "content": None,
                                                          "reasoning_content": " \n"}]}],
         1, "conversations[1] is an empty assistant message"),
        # a preference pair: one prompt, two different assistant answers
        ("preference", [{"chosen": SINGLE, "rejected": [{"role": "user", "content": "Other?"}, SINGLE[1]]}], 1,
         '"chosen" and "rejected" must share their prompt (every message before the last answer); chosen[0] and '
         'rejected[0] differ'),
        ("preference", [{"chosen": SINGLE, "rejected": SINGLE}], 1,
         '"chosen" and "rejected" have the same answer (chosen[1] and rejected[1]): the pair prefers nothing'),
        # named as the line gives them: TRL's "prompt" list, put before both, is not counted (it was: "message 2",
        # "message 1")
        ("preference", [{"prompt": WITH_SYSTEM[:2], "chosen": MULTI[2:4], "rejected": [MULTI[4], MULTI[3]]}], 1,
         "; chosen[0] and rejected[0] differ"),
        ("preference", [{"prompt": SINGLE[:1], "chosen": SINGLE[1:], "rejected": SINGLE[1:]}], 1,
         '"chosen" and "rejected" have the same answer (chosen[0] and rejected[0])'),
        ("preference", [{"chosen": MULTI[:4], "rejected": [MULTI[0], MULTI[3]]}], 1,
         '; "chosen" has 3 message(s) before its answer, "rejected" 1'),
        # answers with no prompt before them (TRL finds none in such a pair either, and fails on it): a preference for
        # no question
        ("preference", [{"chosen": SINGLE, "rejected": [SINGLE[0], {"role": "assistant", "content": "No."}]},
                        {"chosen": SINGLE[1:], "rejected": [{"role": "assistant", "content": "No."}]}], 2,
         '"chosen" and "rejected" hold only their answers and there is no "prompt": the pair prefers one answer to '
         "no question; put the prompt's messages before the answer in both, or give them as a \"prompt\" list of "
         "messages"),
        ("preference", [{"chosen": SINGLE, "rejected": SINGLE[:1]}], 1,
         "rejected[0] must be the assistant's answer, got role 'user'"),
        # an empty answer on either side, as SFT refuses one (a preferred nothing; a margin of <|im_end|> alone)
        ("preference", [{"chosen": [SINGLE[0], {"role": "assistant", "content": " \n"}], "rejected": SINGLE}], 1,
         "chosen[1] is an empty assistant answer (no content, tool_calls or reasoning_content): the pair would teach "
         "the model to prefer answering nothing"),
        ("preference", [{"chosen": SINGLE, "rejected": [SINGLE[0], {"role": "assistant", "content": "No."}]},
                        {"prompt": SINGLE[:1], "chosen": SINGLE[1:], "rejected": [{"role": "assistant",
                                                                                   "content": None}]}], 2,
         "rejected[0] is an empty assistant answer (no content, tool_calls or reasoning_content): the pair's margin "
         "would rest on one token, the closing <|im_end|>"),
    ],
)
def test_bad_line_error_names_file_and_line(tmp_path, cache, tokenizer, kind, rows, line, message):
    from dataset.dpo_dataset import DPODataset

    path = write_jsonl(tmp_path / "data.jsonl", rows)
    cls = {"text": PretrainDataset, "conversations": SFTDataset, "preference": DPODataset}[kind]
    with pytest.raises(ValueError) as info:
        cls(path, tokenizer, 8, cache_dir=cache)
    text = str(info.value)
    assert text.startswith(f"{path}:{line}: ") and message in text
    assert "\n" not in text


def test_skip_bad_lines_reports_count(tmp_path, cache, tokenizer):
    rows = [{"text": "good one " * 10}, "not json", {"wrong": 1}, "", {"text": "good two " * 10}]
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    with pytest.raises(ValueError, match=r"data\.jsonl:2: invalid JSON"):
        PretrainDataset(path, tokenizer, 8, cache_dir=cache)
    ds = PretrainDataset(path, tokenizer, 8, skip_bad_lines=True, cache_dir=cache)
    assert ds.stats["skipped_lines"] == 2 and ds.stats["documents"] == 2
    sft_rows = [{"conversations": SINGLE}, "{oops", {"conversations": MULTI}]
    sft = SFTDataset(write_jsonl(tmp_path / "s.jsonl", sft_rows), tokenizer, 512, skip_bad_lines=True, cache_dir=cache)
    assert sft.stats["skipped_lines"] == 1 and len(sft) == 2
    assert sft[1]["labels"].tolist() == expected_tokens(tokenizer, MULTI)[1]


def test_sft_skips_an_empty_answer_and_learns_a_tool_call_or_a_thought_without_content(tmp_path, cache, tokenizer):
    """--skip_bad_lines skips a prompt-only row as any bad line; an assistant message whose content is empty but
    that calls a tool or thinks has something to learn and is kept; `empty_answers` (GKD sampling every answer)
    reads the prompt-only row, its label <|im_end|> alone."""
    call = [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [{"name": "weather", "arguments": {"city": "Oslo"}}]}]
    thought = [{"role": "user", "content": "Say nothing."},
               {"role": "assistant", "content": "", "reasoning_content": "They asked for silence."}]
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"conversations": m} for m in (SINGLE, RLAIF, call, thought)])
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:2: conversations\[1\] is an empty assistant"):
        SFTDataset(path, tokenizer, 512, cache_dir=cache)
    kept = SFTDataset(path, tokenizer, 512, skip_bad_lines=True, cache_dir=cache)
    assert kept.stats["skipped_lines"] == 1 and len(kept) == 3
    assert kept[0]["labels"].tolist() == expected_tokens(tokenizer, SINGLE)[1]
    learnt_call = tokenizer.decode([label for label in kept[1]["labels"].tolist() if label != IGNORE_INDEX])
    assert '"city": "Oslo"' in learnt_call and learnt_call.endswith("<|im_end|>")
    assert kept[2]["labels"].tolist() == expected_tokens(tokenizer, thought)[1]
    prompts = SFTDataset(path, tokenizer, 512, skip_bad_lines=True, cache_dir=cache, empty_answers=True)  # not the
    # cached scan above
    assert prompts.stats["skipped_lines"] == 0 and len(prompts) == 4
    assert [label for label in prompts[1]["labels"].tolist() if label != IGNORE_INDEX] == [IM_END]


def test_an_empty_system_or_user_message_is_read(tmp_path, cache, tokenizer):
    """Only an assistant message must hold something (it is what is learnt): an empty system message (the default
    tool dialogues' offers only tools) or user message is read as it is."""
    messages = [{"role": "system", "content": ""}, {"role": "user", "content": " "}, SINGLE[1]]
    ds = SFTDataset(write_jsonl(tmp_path / "quiet.jsonl", [{"conversations": messages}]), tokenizer, 512,
                    cache_dir=cache)
    ids, labels = expected_tokens(tokenizer, messages)
    assert ds[0]["input_ids"].tolist() == ids and ds[0]["labels"].tolist() == labels


@pytest.mark.parametrize("task, flags, empty_answers", [
    ("sft", [], False), ("lora", [], False), ("distill", [], False), ("distill", ["--lmbda", "0.5"], False),
    ("distill", ["--lmbda", "1"], True), ("distill", ["--seq_kd", "true"], True),
    ("distill", ["--lmbda", "0.5", "--seq_kd", "true"], True)])
def test_only_a_distillation_that_samples_every_answer_reads_empty_answers(tmp_path, tokenizer, monkeypatch, task,
                                                                             flags, empty_answers):
    """A prompt-only file (MiniMind's rlaif.jsonl) is refused by the trainers that learn the data's answers (SFT,
    LoRA, a distillation with data steps), and read by a GKD run whose every step samples its answers."""
    import trainer.data
    from trainer.args import parse_args

    monkeypatch.setattr("datasets.config.HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    path = write_jsonl(tmp_path / "rlaif.jsonl", [{"conversations": RLAIF}] * 4)
    args = parse_args(task, ["--data_path", str(path), "--val_data_path", str(path), "--batch_size", "2", *flags])
    if not empty_answers:
        with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:1: conversations\[1\] is an empty"):
            trainer.data.build_run_data(args, tokenizer, quiet=True)
        return
    data = trainer.data.build_run_data(args, tokenizer, quiet=True)
    assert len(data.train) == 4 and data.train.stats["supervised_tokens"] == 4  # each row's <|im_end|>


@pytest.mark.parametrize("task", ["sft", "lora", "dpo"])
def test_the_trainers_refuse_a_sample_with_nothing_to_learn_naming_its_line(tmp_path, tokenizer, monkeypatch, task):
    """SFT or LoRA data with a conversation of no assistant message was dropped without a word (a file of such was
    "no conversation has a supervised token within max_seq_len"), and DPO answers with no prompt trained as a
    preference for no question; each trainer's data refuses the line, and --skip_bad_lines skips and counts it."""
    import trainer.data
    from trainer.args import parse_args

    monkeypatch.setattr("datasets.config.HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    if task == "dpo":
        good = {"chosen": SINGLE, "rejected": [SINGLE[0], {"role": "assistant", "content": "No."}]}
        empty = {"prompt": None, "chosen": SINGLE[1:], "rejected": [{"role": "assistant", "content": "No."}]}
        reason = '"chosen" and "rejected" hold only their answers and there is no "prompt"'
    else:
        good, empty = {"conversations": MULTI}, {"conversations": WITH_SYSTEM[:2]}
        reason = '"conversations" holds no assistant message'
    path = write_jsonl(tmp_path / "data.jsonl", [good, good, empty, good])
    flags = ["--data_path", str(path), "--val_data_path", str(path), "--batch_size", "2"]
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:3: {re.escape(reason)}"):
        trainer.data.build_run_data(parse_args(task, flags), tokenizer, quiet=True)
    data = trainer.data.build_run_data(parse_args(task, [*flags, "--skip_bad_lines", "true"]), tokenizer, quiet=True)
    assert len(data.train) == 3 and data.train.stats["skipped_lines"] == 1


def test_a_gkd_resume_across_every_step_sampling_is_refused_as_other_data(tmp_path, tokenizer, monkeypatch):
    """--lmbda 1 reads a file's prompt-only rows, --lmbda 0.5 (with --skip_bad_lines) skips them: the training set
    differs, so a checkpoint of the one does not resume as the other (its data position would map other samples)."""
    import trainer.data
    from trainer.args import parse_args
    from trainer.resume_checks import check_resume_compatible

    monkeypatch.setattr("datasets.config.HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"conversations": SINGLE}] * 3 + [{"conversations": RLAIF}] * 2)

    def run(lmbda: str):
        args = parse_args("distill", ["--data_path", str(path), "--val_data_path", str(path), "--batch_size", "2",
                                      "--skip_bad_lines", "true", "--lmbda", lmbda])
        return args, trainer.data.data_identity(trainer.data.build_run_data(args, tokenizer, quiet=True))

    (sampling, read), (mixed, skipped) = run("1"), run("0.5")
    assert (read["train_samples"], skipped["train_samples"]) == (5, 3)
    state = {"config": sampling.to_dict(), "data": read, "samples_done_in_epoch": 2, "step": 1}
    with pytest.raises(ValueError, match=r"--data_path was .*\(5 training samples.* is .*\(3 training samples"):
        check_resume_compatible(tmp_path / "checkpoint", state, mixed, skipped)


@pytest.mark.parametrize("cls", [PretrainDataset, SFTDataset])
def test_empty_file_is_an_error(tmp_path, cache, tokenizer, cls):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n", encoding="utf-8")
    with pytest.raises(ValueError, match=f"{path}: no .* records"):
        cls(path, tokenizer, 8, cache_dir=cache)
    only_bad = write_jsonl(tmp_path / "bad.jsonl", ["{", "[1"])
    with pytest.raises(ValueError, match=r"no .* records.*2 bad lines skipped"):
        cls(only_bad, tokenizer, 8, skip_bad_lines=True, cache_dir=cache)


# ---------------------------------------------------------------- default corpus


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_default_corpus_format_and_sizes(default_corpus):
    pretrain = _lines(default_corpus.pretrain_train) + _lines(default_corpus.pretrain_val)
    sft = _lines(default_corpus.sft_train) + _lines(default_corpus.sft_val)
    assert all(set(r) == {"text"} and r["text"].strip() for r in pretrain)
    assert len(pretrain) > 14_000 and len(sft) > 20_000
    for row in sft:
        turns = row["conversations"]
        roles = [m["role"] for m in turns]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and roles  # alternate, end on an answer
        assert all(m["content"].strip() for m in turns)
    assert sum(len(r["conversations"]) > 2 for r in sft) > 5_000  # plenty of multi-turn dialogs
    assert any("\u4e00" <= c <= "\u9fff" for r in sft[:5000] for m in r["conversations"] for c in m["content"])
    val_share = len(_lines(default_corpus.sft_val)) / len(sft)
    assert 0.01 < val_share < 0.03


def _segments(text: str) -> set[str]:
    """Sentence-or-line pieces long enough to identify their source."""
    return {piece.strip() for piece in re.split(r"(?<=[.!?])\s+|\n", text) if len(piece.strip()) >= 60}


def test_default_corpus_splits_are_disjoint(default_corpus):
    pretrain_train = {r["text"] for r in _lines(default_corpus.pretrain_train)}
    pretrain_val = {r["text"] for r in _lines(default_corpus.pretrain_val)}
    assert not pretrain_train & pretrain_val
    key = lambda r: json.dumps(r["conversations"])  # noqa: E731
    assert not {key(r) for r in _lines(default_corpus.sft_train)} & {key(r) for r in _lines(default_corpus.sft_val)}
    # No validation answer leaks into the pretraining train split either (one split key for both stages):
    # every long sentence of a val answer is found in the pretraining *val* text and nowhere in train.
    train_pieces = set().union(*map(_segments, pretrain_train))
    val_pieces = set().union(*map(_segments, pretrain_val))
    answers = [m["content"] for r in _lines(default_corpus.sft_val) for m in r["conversations"]
               if m["role"] == "assistant"]
    answer_pieces = set().union(*map(_segments, answers))
    assert len(answer_pieces) > 300
    assert len(answer_pieces & val_pieces) > 0.9 * len(answer_pieces)
    # Different articles share the odd stock sentence ("He is among the most influential ... figures in the
    # history of jazz" is in both Miles Davis and John Coltrane), so allow a handful, not a leak.
    assert len(answer_pieces & train_pieces) <= 3


def test_default_corpus_is_deterministic_and_cached(tmp_path, default_corpus, monkeypatch):
    rebuilt = ensure_default_corpus(tmp_path / "again", quiet=True)
    for name in ("pretrain_train", "pretrain_val", "sft_train", "sft_val", "sft_tools_train", "sft_tools_val"):
        assert getattr(rebuilt, name).read_bytes() == getattr(default_corpus, name).read_bytes(), name
    mtime = rebuilt.sft_train.stat().st_mtime_ns
    builds: list[Path] = []
    monkeypatch.setattr(corpus_module, "build_default_corpus", lambda cache_dir, quiet: builds.append(cache_dir))
    assert ensure_default_corpus(tmp_path / "again", quiet=True) == corpus_paths(tmp_path / "again")
    assert builds == [] and rebuilt.sft_train.stat().st_mtime_ns == mtime  # a current cache is not built again
    assert _is_current(tmp_path / "again")
    rebuilt.pretrain_val.write_text("", encoding="utf-8")  # a damaged cache is not current: it gets rebuilt
    assert not _is_current(tmp_path / "again")


def test_the_split_names_name_the_embedded_files_and_each_tasks_pair(tmp_path):
    """dataset/split_names.py owns the names: the builders' file names and the trainers' (train, val) pairs read
    them (as the cache on disk and the trainers' defaults have always called them)."""
    from dataclasses import astuple

    from dataset.post_training_data import post_training_paths
    from trainer.data import default_split_names

    assert [path.name for path in astuple(corpus_paths(tmp_path))] == [
        "pretrain_train.jsonl", "pretrain_val.jsonl", "sft_train.jsonl", "sft_val.jsonl", "sft_tools_train.jsonl",
        "sft_tools_val.jsonl"]
    assert [path.name for path in astuple(post_training_paths(tmp_path))] == [
        "lora_train.jsonl", "lora_val.jsonl", "dpo_train.jsonl", "dpo_val.jsonl", "grpo_train.jsonl", "grpo_val.jsonl"]
    assert {task: tuple(default_split_names(task)) for task in ("pretrain", "sft", "lora", "dpo", "grpo", "ppo")} == {
        "pretrain": ("pretrain_train", "pretrain_val"), "sft": ("sft_tools_train", "sft_tools_val"),
        "lora": ("lora_train", "lora_val"), "dpo": ("dpo_train", "dpo_val"), "grpo": ("grpo_train", "grpo_val"),
        "ppo": ("grpo_train", "grpo_val")}
    assert default_split_names("sft", "chat") == ("sft_train", "sft_val")
    assert default_split_names("sft", "tools") == ("sft_tools_train", "sft_tools_val")


def test_a_tool_names_a_split_without_loading_the_builders():
    """The tools' --data defaults and offered splits come from dataset/split_names.py, which imports none of ours
    and nothing heavy: dataset/corpus.py takes about 2 s (transformers)."""
    code = ("import sys, dataset.split_names; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('dataset', 'trainer', 'model', 'torch', "
            "'transformers')))")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stderr
    assert run.stdout == "['dataset', 'dataset.split_names']\n"


@pytest.mark.parametrize("manifest", [
    [], "text", {"build_version": 2, "files": []}, {"build_version": 2, "files": {"a.jsonl": 5}},
    {"build_version": 2, "files": {"a.jsonl": {"bytes": "3"}}},
    {"build_version": 2, "files": {"a.jsonl": {"bytes": True}}},  # True == 1 in Python
], ids=["list", "string", "files a list", "info an int", "bytes a string", "bytes a bool"])
def test_a_damaged_manifest_means_a_rebuild(tmp_path, manifest):
    from dataset.corpus import manifest_is_current
    from dataset.sources import package_versions

    (tmp_path / "a.jsonl").write_text("x")
    if isinstance(manifest, dict):
        manifest["packages"] = package_versions()
    (tmp_path / "m.json").write_text(json.dumps(manifest))
    assert manifest_is_current(tmp_path, "m.json", 2, ["a.jsonl"]) is False


def test_a_manifest_of_other_files_is_not_current(tmp_path):
    """A manifest that lists as many files as expected, but not the expected ones (another builder's, or names
    that lead out of the folder), does not make missing files current."""
    from dataset.corpus import manifest_is_current
    from dataset.sources import package_versions

    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "other.jsonl").write_text("abc")
    (tmp_path / "outside.jsonl").write_text("abc")
    for files in ({"other.jsonl": {"bytes": 3}}, {"../outside.jsonl": {"bytes": 3}}):
        (tmp_path / "cache" / "m.json").write_text(json.dumps({"build_version": 2, "packages": package_versions(),
                                                               "files": files}))
        assert manifest_is_current(tmp_path / "cache", "m.json", 2, ["a.jsonl"]) is False
    (tmp_path / "cache" / "a.jsonl").write_text("abc")
    (tmp_path / "cache" / "m.json").write_text(json.dumps({"build_version": 2, "packages": package_versions(),
                                                           "files": {"a.jsonl": {"bytes": 3}}}))
    assert manifest_is_current(tmp_path / "cache", "m.json", 2, ["a.jsonl"]) is True


@pytest.mark.parametrize("under", [False, True])
def test_a_data_cache_folder_that_is_a_file_is_one_line(tmp_path, under):
    from dataset.post_training_data import ensure_post_training_data

    blocker = tmp_path / "cache"
    blocker.write_text("x")
    cache_dir = blocker / "sub" if under else blocker
    expected = f"{cache_dir}: {blocker} is a file, not a folder" if under else f"{blocker} is a file, not a folder"
    for ensure in (ensure_default_corpus, ensure_post_training_data):
        with pytest.raises(ValueError) as refused:
            ensure(cache_dir)
        assert str(refused.value) == expected


def test_default_corpus_tool_files(default_corpus, monkeypatch):
    """sft_tools_* = the SFT split plus its tool-use dialogues and small talk with the tools offered: validation holds
    eval/tool_eval.py's default questions, whose titles and conversations no training dialogue holds; the dialogues
    are mixed in, not appended; a third of each kind continue a chat, after an exchange of the other kind."""
    from dataset.corpus import LOOKUP_PHRASINGS_TRAIN, SMALL_TALK_TRAIN, SMALL_TALK_VAL, TOOL_DIALOGUES_SEED, \
        TOOL_DIALOGUES_TRAIN, TOOL_DIALOGUES_VAL
    from dataset.sources import conversation_text, normalized_text
    from dataset.tool_dialogues import small_talk_dialogues, tool_dialogues
    from trainer.data import default_data

    key = lambda row: json.dumps(row, sort_keys=True)  # noqa: E731

    def without_the_exchange_before(row: dict) -> tuple[dict, list[dict] | None]:
        """A continued row as it was generated, and the exchange put before it (None: not continued)."""
        conversation = row["conversations"]
        if "tools" not in conversation[0]:
            return row, None
        users = [i for i, message in enumerate(conversation) if message["role"] == "user"]
        calls_first = bool(conversation[2].get("tool_calls"))
        if calls_first and len(users) > 1:  # small talk after a lookup, calculation or conversion
            end = users[1]
        elif not calls_first and any(message.get("tool_calls") for message in conversation):  # a call after a chat
            end = 3
        else:
            return row, None
        return {**row, "conversations": conversation[:1] + conversation[end:]}, conversation[1:end]

    titles, openings = {}, {}
    for split, held_out, counts, talks, phrasings in (
            ("train", False, TOOL_DIALOGUES_TRAIN, SMALL_TALK_TRAIN, LOOKUP_PHRASINGS_TRAIN),
            ("val", True, TOOL_DIALOGUES_VAL, SMALL_TALK_VAL, 1)):
        rows = _lines(getattr(default_corpus, f"sft_tools_{split}"))
        plain = _lines(getattr(default_corpus, f"sft_{split}"))
        dialogues = tool_dialogues("held_out" if held_out else "train", TOOL_DIALOGUES_SEED, *counts,
                                   questions_per_article=phrasings)
        small_talk = small_talk_dialogues("held_out" if held_out else "train", TOOL_DIALOGUES_SEED, talks)
        generated, befores = zip(*map(without_the_exchange_before, rows))
        assert sorted(map(key, generated)) == sorted(map(key, plain + dialogues + small_talk)), split
        assert len(dialogues) > 0.99 * sum(counts) and len(small_talk) == talks
        # what came before is the first exchange of a dialogue of the same split, of the other kind
        exchanges_of_split = [key(d["conversations"][1:3]) for d in small_talk] + \
            [key(d["conversations"][1:]) for d in dialogues]
        continued = [before for before in befores if before is not None]
        assert continued and {key(before) for before in continued} <= set(exchanges_of_split), split
        assert 0.25 < len(continued) / (len(dialogues) + len(small_talk)) < 0.42, split
        # each small-talk dialogue is a conversation of the split's plain SFT rows (which are deduplicated up to case
        # and spacing), with the tools' system turn
        text = lambda conversation: normalized_text(conversation_text(conversation))  # noqa: E731
        assert {text(d["conversations"][1:]) for d in small_talk} <= {text(row["conversations"]) for row in plain}
        openings[split] = {key(d["conversations"]) for d in small_talk}
        positions = [i for i, row in enumerate(rows) if "tools" in row["conversations"][0]]
        assert positions[0] < len(rows) // 10 and positions[-1] > len(rows) * 9 // 10, split  # shuffled in
        calls = [json.loads(row["conversations"][2]["tool_calls"])[0] for row in dialogues]
        titles[split] = {call["arguments"]["title"] for call in calls if call["name"] == "wiki"}
    assert len(titles["val"]) == TOOL_DIALOGUES_VAL[0] and not titles["val"] & titles["train"]
    assert not openings["val"] & openings["train"]
    monkeypatch.setattr("dataset.corpus.DEFAULT_CACHE_DIR", default_corpus.sft_train.parent)
    assert default_data("sft", True) == (default_corpus.sft_tools_train, default_corpus.sft_tools_val)
    assert default_data("sft", True, "chat") == (default_corpus.sft_train, default_corpus.sft_val)


def test_sft_data_flag_picks_the_embedded_set(default_corpus, monkeypatch):
    """An SFT run without --data_path reads sft_tools_{train,val} (--sft_data tools, the default), or sft_{train,val}
    with --sft_data chat; a distillation's SFT data is the conversations."""
    import trainer.data
    from trainer.args import parse_args

    class Recorded(list):  # a dataset that only remembers its file
        def __init__(self, path, *args, **kwargs):
            super().__init__(range(64))
            self.path = path

    monkeypatch.setattr("dataset.corpus.DEFAULT_CACHE_DIR", default_corpus.sft_train.parent)
    monkeypatch.setattr(trainer.data, "dataset_class", lambda task: Recorded)
    for task, flags, expected in (("sft", [], ("sft_tools_train", "sft_tools_val")),
                                  ("sft", ["--sft_data", "tools"], ("sft_tools_train", "sft_tools_val")),
                                  ("sft", ["--sft_data", "chat"], ("sft_train", "sft_val")),
                                  ("distill", [], ("sft_train", "sft_val"))):
        data = trainer.data.build_run_data(parse_args(task, flags), tokenizer=None, quiet=True)
        assert (data.train.path, data.val.path) == tuple(getattr(default_corpus, name) for name in expected)


def test_default_corpus_loads_into_datasets(tmp_path, default_corpus, tokenizer):
    pre = PretrainDataset(default_corpus.pretrain_val, tokenizer, 256, cache_dir=tmp_path)
    assert pre.stats["packing_efficiency"] >= 0.99
    sft = SFTDataset(default_corpus.sft_val, tokenizer, 512, cache_dir=tmp_path)
    assert sft.stats["samples"] > 400 and sft.stats["supervised_tokens"] > 10_000


def test_split_assignment_and_windows():
    # The same keys get the same side in another interpreter with another str-hash seed (hash() would not).
    keys = [f"chitchat\x00{i}" for i in range(2000)]
    script = ("import sys; sys.path.insert(0, sys.argv[1]); from dataset.splits import is_validation; "
              f"print(''.join('v' if is_validation(k) else 't' for k in {keys!r}))")
    other = subprocess.run([sys.executable, "-c", script, str(REPO)], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert other.returncode == 0, other.stderr
    here = "".join("v" if is_validation(k) else "t" for k in keys)
    assert other.stdout.strip() == here and 10 < here.count("v") < 70
    share = sum(is_validation(f"k{i}") for i in range(20_000)) / 20_000
    assert 0.015 < share < 0.025
    turns = ["q1", "a1" * 10, "q2", "a2", "q3"]  # trailing question without a reply is dropped
    from dataset.sources import dialog_windows

    windows = dialog_windows(turns, max_chars=25)
    assert windows == [
        [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1" * 10}],
        [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}],
    ]
    assert dialog_windows(turns, max_chars=1000) == [windows[0] + windows[1]]


def test_the_split_rule_is_the_keys_sha256_below_20_per_mille():
    """The assignment itself, not only its determinism: a key is validation when the first 8 bytes of its UTF-8
    SHA-256, read as a big-endian number (the digest's first 16 hex digits), are below 20 modulo 1000. Another
    byte order or a `<=` keeps the share near 2 % but moves which documents are held out (and so every rebuilt
    default corpus); the keys at 19 and 20 tell the boundary, and a dialog's key holds its source."""
    import hashlib

    from dataset.sources import Dialog
    from dataset.splits import dialog_split_key

    def per_mille(key):
        return int(hashlib.sha256(key.encode("utf-8")).hexdigest()[:16], 16) % 1000

    keys = [f"k{i}" for i in range(3000)] + ["wikipedia_en\x00Été", "chitchat\x00日本"]
    assert [is_validation(key) for key in keys] == [per_mille(key) < 20 for key in keys]
    boundary = {value: next(key for key in map(str, range(10**6)) if per_mille(key) == value) for value in (19, 20)}
    assert is_validation(boundary[19]) and not is_validation(boundary[20])
    assert dialog_split_key(Dialog("chitchat", "42", ("hi", "hello"))) == "chitchat\x0042"


@pytest.mark.parametrize("force", [False, True])
def test_the_corpus_command_names_a_file_in_the_way_of_its_cache_in_one_line(tmp_path, capsys, force):
    """`python dataset/corpus.py --cache_dir FILE` (and with --force, which builds first) is one line, not a
    traceback after the build."""
    from dataset.corpus import main

    blocker = tmp_path / "cache"
    blocker.write_text("not a folder")
    with pytest.raises(SystemExit) as exit_info:
        main(["--cache_dir", str(blocker)] + (["--force"] if force else []))
    assert exit_info.value.code == 2
    assert f"error: --cache_dir {blocker} is a file, not a folder" in capsys.readouterr().err


# ---------------------------------------------------------------- the run's loaders (trainer/data.py)


def test_the_epoch_order_is_a_permutation_per_epoch_and_a_resume_starts_inside_it():
    """Each epoch is a permutation of every sample, the same for any sampler of the same (seed, epoch) and another for
    the next epoch or another seed; set_position starts the order at a sample, which the loader's set_epoch of the
    same epoch keeps and a new epoch's resets."""
    from trainer.data import EpochShuffleSampler

    def order(seed, epoch, start=0):
        sampler = EpochShuffleSampler(50, seed)
        sampler.set_position(epoch, start)
        return list(sampler)

    first, second = order(7, 0), order(7, 1)
    assert sorted(first) == sorted(second) == list(range(50))
    assert first != second and first != order(8, 0) and first == order(7, 0)
    resumed = EpochShuffleSampler(50, 7)
    resumed.set_position(1, 20)
    resumed.set_epoch(1)  # Accelerate's loader, at the start of the resumed pass
    assert list(resumed) == second[20:] and len(resumed) == 30
    resumed.set_epoch(2)
    assert list(resumed) == order(7, 2) and len(resumed) == 50


def test_the_validation_split_holds_out_a_fraction_of_the_samples_and_refuses_to_take_all():
    from trainer.data import _split_off_validation

    train, val = _split_off_validation(list(range(40)), 0.1, seed=3)
    assert (len(train), len(val)) == (36, 4)
    assert sorted([*train, *val]) == list(range(40)) and list(train) == sorted(train)
    assert len(_split_off_validation(list(range(40)), 0.001, seed=3)[1]) == 1  # at least one sample
    with pytest.raises(ValueError, match="has only 2 samples: too few to hold out a validation split"):
        _split_off_validation([0, 1], 0.9, seed=3)  # round(1.8) = 2: nothing would be left to train on


def test_a_training_set_of_exactly_one_batch_loads_and_a_smaller_one_is_refused(tmp_path, monkeypatch):
    """A training set of --batch_size samples makes one batch (the loader drops an incomplete last batch); one sample
    fewer is refused naming the file. Without --val_data_path the validation split is held out of the training
    file, which RunData names as the validation file."""
    import trainer.data
    from trainer.args import parse_args

    sizes = {"train.jsonl": 8, "val.jsonl": 3}

    class Recorded(list):  # a dataset of as many samples as its file is given
        def __init__(self, path, *args, **kwargs):
            super().__init__({"input_ids": torch.tensor([i])} for i in range(sizes[path.name]))

    monkeypatch.setattr(trainer.data, "dataset_class", lambda task: Recorded)
    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    flags = ["--data_path", str(train), "--val_data_path", str(val)]
    data = trainer.data.build_run_data(parse_args("sft", [*flags, "--batch_size", "8"]), tokenizer=None, quiet=True)
    assert len(data.train_loader) == 1 and len(data.val) == 3
    assert len(trainer.data.build_run_data(parse_args("sft", [*flags, "--batch_size", "3"]), None).train_loader) == 2
    with pytest.raises(ValueError, match=rf"^{re.escape(str(train))}: 8 training samples, fewer than --batch_size=9$"):
        trainer.data.build_run_data(parse_args("sft", [*flags, "--batch_size", "9"]), tokenizer=None, quiet=True)
    sizes["train.jsonl"] = 100
    held_out = trainer.data.build_run_data(parse_args("sft", ["--data_path", str(train), "--batch_size", "8"]), None)
    assert (len(held_out.train), len(held_out.val)) == (99, 1) and held_out.val_path == held_out.train_path == train


def test_the_data_identity_sees_every_sampled_position_and_both_sides_of_a_pair():
    """data_identity's digest covers samples from the first to the last (8 evenly spaced) and, for a preference
    pair, the rejected answer's token ids as well as the chosen's: data that differs there is other data."""
    from types import SimpleNamespace

    from trainer.data import data_identity

    def identity(rows):
        return data_identity(SimpleNamespace(train=rows, train_path=Path("/d/pairs.jsonl")))

    rows = [{"input_ids": torch.tensor([i, i + 1]), "labels": torch.tensor([-100, i + 1]),
             "rejected_input_ids": torch.tensor([i, 99])} for i in range(30)]
    base = identity(rows)
    assert base["train_samples"] == 30 and base["path"] == "/d/pairs.jsonl"
    for index, key in ((29, "input_ids"), (0, "rejected_input_ids"), (round(3 * 29 / 7), "input_ids")):
        changed = [dict(row) for row in rows]
        changed[index][key] = torch.tensor([5, 5])
        assert identity(changed)["digest"] != base["digest"], (index, key)
    relabelled = [{**row, "labels": torch.tensor([7, 7])} for row in rows]
    assert identity(relabelled) == base  # labels follow from the ids: not part of the digest


@pytest.mark.parametrize("world", [2, 3, 4])
def test_validation_shards_are_padded_with_target_free_copies_of_the_first_sample(world):
    """shard_loader pads the validation set to a multiple of the processes with copies of sample 0 whose labels
    (both of a pair's) are all -100, or, for an RL prompt without labels, marked `padding`; each real sample is in
    exactly one shard and every shard has the same length."""
    from trainer.data import shard_loader

    def shards(samples):
        loader = DataLoader(samples, batch_size=1, collate_fn=lambda batch: batch[0])
        return [list(shard_loader(loader, rank, world)) for rank in range(world)]

    pairs = [{"input_ids": torch.tensor([i]), "labels": torch.tensor([i]), "rejected_labels": torch.tensor([i])}
             for i in range(5)]
    got = shards(pairs)
    assert len({len(shard) for shard in got}) == 1 and sum(map(len, got)) == 5 + (-5 % world)
    real = [s for shard in got for s in shard if s["labels"].item() != -100]
    padding = [s for shard in got for s in shard if s["labels"].item() == -100]
    assert sorted(s["input_ids"].item() for s in real) == list(range(5))
    assert all(s["rejected_labels"].item() == -100 and s["input_ids"].item() == 0 for s in padding)
    prompts = [{"input_ids": torch.tensor([i])} for i in range(5)]
    marked = [s for shard in shards(prompts) for s in shard if s.get("padding")]
    assert len(marked) == -5 % world and all(s["input_ids"].item() == 0 for s in marked)
