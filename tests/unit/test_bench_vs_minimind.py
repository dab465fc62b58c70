"""eval/benchmarks/bench_vs_minimind.py's reading of --data_path (the rest needs a MiniMind checkout)."""
from __future__ import annotations

import pytest

from eval.benchmarks import bench_vs_minimind


class _CharTokenizer:
    """One id per character, so a text's token count is its length."""

    def __call__(self, texts: list[str], add_special_tokens: bool, max_length: int, truncation: bool) -> dict:
        return {"input_ids": [list(text[:max_length]) for text in texts]}


def test_real_tokens_per_sample_reads_every_line_of_a_file_with_a_byte_order_mark(tmp_path, monkeypatch):
    """A data file saved with a UTF-8 byte order mark is read as the trainer reads it (dataset/jsonl.py): its first
    line counts, not skipped as unreadable; the mean is (bos + text + eos) per line: (2 + 6 + 2 + 2) / 2."""
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *args, **kwargs: _CharTokenizer())
    data = tmp_path / "data.jsonl"
    data.write_bytes(b'\xef\xbb\xbf{"text": "abcdef"}\n{"text": "gh"}\n')
    assert bench_vs_minimind.minimind_real_tokens_per_sample(tmp_path, data, seq_len=64) == pytest.approx(6.0)


def test_input_paths_are_read_from_here_else_from_the_repo_root(tmp_path, monkeypatch):
    """--minimind_dir and --data_path as every input flag: from the current directory when there, else from the repo
    root (they were read from the current directory only: README.md from elsewhere was "no such file"); made
    absolute, since MiniMind runs in its own trainer/ folder."""
    from trainer.run_dir import REPO_ROOT

    (tmp_path / "minimind" / "trainer").mkdir(parents=True)
    (tmp_path / "minimind" / "trainer" / "train_pretrain.py").write_text("")
    (tmp_path / "mine.jsonl").write_text('{"text": "a"}\n')
    monkeypatch.chdir(tmp_path)
    parser = bench_vs_minimind.build_parser()
    for data, expected in (("mine.jsonl", tmp_path / "mine.jsonl"), ("README.md", REPO_ROOT / "README.md")):
        args = parser.parse_args(["--minimind_dir", "minimind", "--data_path", data, "--log_dir",
                                  str(tmp_path / "logs")])
        bench_vs_minimind.validate_args(parser, args)
        assert args.minimind_dir == tmp_path / "minimind" and args.data_path == expected


def test_a_relative_log_dir_from_another_directory_is_made_under_the_repo_root(tmp_path, monkeypatch):
    """`cd /tmp && bench_vs_minimind.py ... --log_dir logs`: the logs' folder is relative to the repo root, as every
    output (trainer/cli.py output_folder), and so is its default "." (the repo root itself); both were the current
    directory's."""
    repo, elsewhere = tmp_path / "repo", tmp_path / "elsewhere"
    repo.mkdir()
    elsewhere.mkdir()
    (elsewhere / "minimind" / "trainer").mkdir(parents=True)
    (elsewhere / "minimind" / "trainer" / "train_pretrain.py").write_text("")
    monkeypatch.setattr("trainer.run_dir.REPO_ROOT", repo)
    monkeypatch.chdir(elsewhere)
    parser = bench_vs_minimind.build_parser()
    for argv, made in ((["--log_dir", "logs"], repo / "logs"), ([], repo)):
        args = parser.parse_args(["--minimind_dir", "minimind", *argv])
        bench_vs_minimind.validate_args(parser, args)
        assert args.log_dir == made and made.is_dir()
    assert not (elsewhere / "logs").exists()
