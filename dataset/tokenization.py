"""Loading the tokenizer committed in ``model/`` (regenerate it with ``scripts/train_tokenizer.py``), making sure
a model is trained further with the tokenizer it was trained with, that a model directory's tokenizer files are not
a mix of two saves (TOKENIZER_MARKER), and where each token of a text starts."""

from __future__ import annotations

import hashlib
import json
import math
import re
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

from dataset.atomic_io import atomic_write_text, first_line, folder_lock, not_utf8
from dataset.json_text import json_file_value, strict_json
from dataset.shown_value import shown_json
from dataset.tokenizer_marker import TOKENIZER_MARKER

DEFAULT_TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "model"
_BYTE_OF_CHAR = {char: byte for byte, char in bytes_to_unicode().items()}  # byte-level BPE's alphabet, read back
_WORD_MARK = "\u2581"  # SentencePiece's "▁": a space before the word
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a byte no piece holds, as its own token


# TOKENIZER_MARKER, a model directory's record of its tokenizer files (trainer/export.py save_model_dir): {"writing":
# true, "files": [the names of the earlier save's and this one's]} while a save moves them in one by one, then
# {"files": [their names]} once they are all in place.
# Held by the one save moving files into a model directory (model_dir_lock), and how long another save waits for it:
# the moves take seconds at most, so a longer hold is a stopped or stuck process, and the second save is refused.
SAVE_LOCK = ".save.lock"
SAVE_LOCK_WAIT_S = 60.0


def load_tokenizer(path: str | Path | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer at ``path`` (a directory or hub id); by default MiniNorm's own from ``model/``. A directory
    whose save stopped while it moved the tokenizer files in is refused (ValueError, check_tokenizer_files)."""
    if path is not None and Path(path).is_dir():
        check_tokenizer_files(Path(path))
    return AutoTokenizer.from_pretrained(str(path) if path is not None else str(DEFAULT_TOKENIZER_DIR))


_NO_MARKER = object()  # _tokenizer_record where the folder holds no TOKENIZER_MARKER (a marker may hold null)


def _tokenizer_record(folder: Path) -> Any:
    """TOKENIZER_MARKER's content; _NO_MARKER where there is none; the error where it cannot be read as JSON."""
    try:
        return json.loads((folder / TOKENIZER_MARKER).read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError):  # no marker, or `folder` is not a folder (its loader says so)
        return _NO_MARKER
    except (OSError, ValueError) as error:  # not UTF-8, not JSON, unreadable
        return error


@contextmanager
def model_dir_lock(folder: Path) -> Iterator[None]:
    """Hold model directory `folder` while a save moves its files in (trainer/export.py save_model_dir,
    scripts/train_tokenizer.py): two saves at once would interleave their moves and leave a mix of both. A second
    save waits up to SAVE_LOCK_WAIT_S seconds, then is refused in one line naming the folder and the holder
    (dataset/atomic_io.py folder_lock; a killed holder's lock is taken over)."""
    with folder_lock(folder, SAVE_LOCK, SAVE_LOCK_WAIT_S, "another save into it"):
        yield


def begin_tokenizer_save(folder: Path, names: Iterable[str]) -> None:
    """Before a save moves the tokenizer files `names` into `folder` one by one: mark the save as under way (a kill
    from here on leaves files of two saves, which load_tokenizer refuses), and remove the files the previous save
    recorded that this one does not write (a chat_template.jinja beside a tokenizer that has none would be read
    as its template). The marker lists, besides, every file that may be in the folder once this save stops (the
    earlier record's and this save's): a save stopped in its turn leaves the next one a list to remove from."""
    record = _tokenizer_record(folder)
    recorded = record.get("files") if isinstance(record, dict) else None
    earlier = [name for name in (recorded if isinstance(recorded, list) else [])
               if isinstance(name, str) and Path(name).name == name and name != TOKENIZER_MARKER]
    names = set(names)
    atomic_write_text(folder / TOKENIZER_MARKER, strict_json({"writing": True, "files": sorted({*earlier, *names})}))
    for name in earlier:
        if name not in names and (folder / name).is_file():
            (folder / name).unlink()


def end_tokenizer_save(folder: Path, names: Iterable[str]) -> None:
    """After the tokenizer files `names` are all in `folder`: record them, last, and the save as complete."""
    atomic_write_text(folder / TOKENIZER_MARKER, strict_json({"files": sorted(names)}, indent=2))


def check_tokenizer_files(folder: Path) -> None:
    """Refuse, in one line, a folder whose tokenizer files a save stopped moving in (they may be of two saves: the
    new tokenizer_config.json beside the old chat_template.jinja loads as a tokenizer that neither wrote). A folder
    without TOKENIZER_MARKER (written before it, or by another program) is not checked; nor are edits made after
    a save (a chat template edited by hand is the user's). A marker that is not valid JSON, or not of the shape a
    save writes, is refused too: it vouches for no save."""
    record = _tokenizer_record(folder)
    problem = _marker_problem(record)
    if problem is not None:
        raise ValueError(f"{folder / TOKENIZER_MARKER}: {problem}, so whether a save of {folder} stopped midway cannot "
                         f"be told: save the model directory again, or delete that file to load the tokenizer files "
                         f"unchecked")
    if isinstance(record, dict) and record.get("writing") is True:
        raise ValueError(f"{folder / TOKENIZER_MARKER}: a save of {folder} stopped while it moved its tokenizer files "
                         f"in, which may now be from two saves: save the model directory again (a run stopped in its "
                         f"final save writes it again with --resume auto) or load another tokenizer")


def _marker_problem(record: Any) -> str | None:
    """What is wrong with TOKENIZER_MARKER's content (`record`, as _tokenizer_record read it), in words, or None:
    it is absent, or the JSON object {"files": [names]}, with "writing": true while a save is under way."""
    if record is _NO_MARKER:
        return None
    if isinstance(record, UnicodeDecodeError):
        return not_utf8(record)
    if isinstance(record, ValueError):
        return f"not valid JSON ({first_line(record)})"
    if isinstance(record, OSError):
        return f"cannot be read ({record.strerror or first_line(record)})"
    shape = 'not {"files": [file names]} (with "writing": true while a save is under way)'
    if not isinstance(record, dict):
        return f"{shape}: it holds {_json_kind(record)}"
    if not set(record) <= {"files", "writing"}:
        return f"{shape}: it holds the keys {', '.join(shown_json(key) for key in record)}"
    if "files" not in record:
        return f'{shape}: it has no "files"'
    if not isinstance(files := record["files"], list):
        return f'{shape}: its "files" is {_json_kind(files)}'
    if odd := [name for name in files if not isinstance(name, str)]:
        return f'{shape}: its "files" hold {_json_kind(odd[0])}'
    if record.get("writing", True) is not True:
        return f"{shape}: its \"writing\" is {_json_kind(record['writing'])}"
    return None


def not_a_json_object(file: Path) -> str | None:
    """'holds a list, not a JSON object' where `file` (a tokenizer.json or tokenizer_config.json, each an object) is
    valid JSON of another kind; None otherwise (missing, unreadable or not JSON: the loader's own words name that)."""
    value = json_file_value(file)
    return None if value is None or isinstance(value, dict) else f"holds {_json_kind(value)}, not a JSON object"


def _json_kind(value: Any) -> str:
    """A JSON value in a few words, for a refusal: `a list`, `an object`, or the value itself as JSON (quoted by
    dataset/shown_value.py's shown_json: one line, cut at MAX_SHOWN characters)."""
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return shown_json(value)


def is_byte_fallback(token: str) -> bool:
    """Whether a token is a byte-fallback one ("<0xE4>": a byte no piece holds, as SentencePiece spells it)."""
    return _BYTE_FALLBACK.fullmatch(token) is not None


def byte_fallback_value(token: str) -> int | None:
    """The byte a byte-fallback token ("<0xE4>") spells, or None for any other token."""
    match = _BYTE_FALLBACK.fullmatch(token)
    return int(match[1], 16) if match else None


def _decoder_steps(backend: Tokenizer) -> list[dict[str, Any]]:
    """The steps of a tokenizers decoder, in order, as their JSON (a Sequence's decoders, else the one decoder)."""
    decoder = json.loads(backend.decoder.__getstate__())
    return (decoder.get("decoders") or []) if decoder.get("type") == "Sequence" else [decoder]


def decodes_byte_runs_whole(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether `tokenizer` decodes each run of byte-fallback tokens as tokenizers' ByteFallback decoder does, and
    nothing after it changes the run's text: the run's bytes as UTF-8 when they are valid and end on a whole
    character, else one U+FFFD per byte (a stray byte anywhere in the run, or a character cut short at its end,
    turns the whole run into U+FFFDs). Known to hold for a decoder that is ByteFallback, optionally after Replace
    of the word mark (whose pattern no "<0x..>" holds) and before Fuse, then Strips of leading characters only (of
    the whole text once fused: Llama's); and no clean-up of spaces (which would edit the run's text)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.decoder is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    steps = _decoder_steps(backend)
    kinds = [step.get("type") for step in steps]
    if kinds.count("ByteFallback") != 1:
        return False
    at = kinds.index("ByteFallback")
    if not all(step.get("type") == "Replace" and step.get("pattern") == {"String": _WORD_MARK}
               for step in steps[:at]):
        return False
    fused = False
    for step in steps[at + 1:]:
        fused = fused or step.get("type") == "Fuse"
        if step.get("type") != "Fuse" and not (step.get("type") == "Strip" and fused and step.get("stop") == 0):
            return False
    return True


def start_strips(tokenizer: PreTrainedTokenizerBase) -> tuple[tuple[str, int], ...]:
    """What the decoder of a tokenizer that decodes_byte_runs_whole takes off the start of the whole text, in its
    order: (character, at most how many of it) for each Strip step (Llama's: (" ", 1), its first space)."""
    return tuple((step["content"], step["start"]) for step in _decoder_steps(tokenizer.backend_tokenizer)
                 if step.get("type") == "Strip")


def stripped_start(text: str, strips: Sequence[tuple[str, int]]) -> str:
    """`text` with start_strips' steps applied, as tokenizers' Strip decoder does: each takes off up to its count
    of its character from the start."""
    for character, count in strips:
        taken = 0
        while taken < min(count, len(text)) and text[taken] == character:
            taken += 1
        text = text[taken:]
    return text


def token_map_digest(backend: Tokenizer) -> str:
    """A digest of what gives a token id its meaning: the vocabulary, the merges and the added tokens with their ids
    (not padding, truncation or the chat template)."""
    spec = json.loads(backend.to_str())
    added = sorted((token["id"], token["content"], token["special"]) for token in spec.get("added_tokens", []))
    key = json.dumps([spec.get("model"), spec.get("pre_tokenizer"), spec.get("normalizer"), added], sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def check_same_tokenizer(tokenizer: PreTrainedTokenizerBase, model_dir: Path, flag: str) -> None:
    """Refuse, in one line, to train the model in ``model_dir`` further with another tokenizer than the one saved
    beside it: with the same vocabulary size nothing else would notice, and every id would mean another token. A
    directory without a tokenizer.json is not checked."""
    saved = model_dir / "tokenizer.json"
    if not saved.is_file() or not getattr(tokenizer, "is_fast", False):
        return
    if token_map_digest(Tokenizer.from_file(str(saved))) != token_map_digest(tokenizer.backend_tokenizer):
        source = getattr(tokenizer, "name_or_path", "") or "the given tokenizer"
        raise ValueError(f"{flag} {model_dir}: its tokenizer.json differs from the tokenizer in {source} (a model "
                         f"made before MiniNorm's tool and thinking tokens?); its ids would mean other tokens -- pass "
                         f"--tokenizer_path {model_dir}, or train it again from scratch with today's tokenizer")


def token_starts(tokenizer: PreTrainedTokenizerBase, text: str) -> list[tuple[int, int]]:
    """Each token of `text` (no special tokens) with the offset of its first character in `text`."""
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [(token, start) for token, (start, _) in zip(encoding["input_ids"], encoding["offset_mapping"])]


def token_bytes(tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int]) -> list[bytes]:
    """Each token's own bytes, which may be part of a character only (the first byte of a 3-byte Chinese
    character): a byte-level BPE token's bytes (MiniNorm's and Qwen's tokenizers); a SentencePiece-style token's
    text with its word mark "▁" as a space, or its one byte for a byte-fallback token ("<0xE4>"; Llama's
    tokenizers); an added token's text (<|im_end|>) in UTF-8. A token of any other kind is the UTF-8 of its
    decoded text."""
    added = tokenizer.added_tokens_decoder
    kind = _piece_kind(tokenizer)
    out = []
    for token_id, piece in zip(token_ids, tokenizer.convert_ids_to_tokens(list(token_ids))):
        if token_id in added or piece is None:
            out.append(tokenizer.decode([token_id]).encode("utf-8"))
        elif kind == "byte_level" and all(char in _BYTE_OF_CHAR for char in piece):
            out.append(bytes(_BYTE_OF_CHAR[char] for char in piece))
        elif kind == "sentencepiece" and (byte := _BYTE_FALLBACK.fullmatch(piece)):
            out.append(bytes([int(byte.group(1), 16)]))
        elif kind == "sentencepiece":
            out.append(piece.replace(_WORD_MARK, " ").encode("utf-8"))
        else:
            out.append(tokenizer.decode([token_id]).encode("utf-8"))
    return out


# Pre-tokenizer steps that only split the text (Split keeping what it matched, as Qwen's does): each character stays
# in some piece. The others may drop text (Whitespace drops spaces), so a tokenizer with them gets no bound.
_SPLITTING_STEPS = {"ByteLevel", "Split", "Digits", "Punctuation"}
_LONGEST_TOKENS: "weakref.WeakKeyDictionary[PreTrainedTokenizerBase, int | None]" = weakref.WeakKeyDictionary()


def longest_token_bytes(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The most bytes of text one token covers, for a byte-level BPE tokenizer that changes no text first (no
    normalizer; a ByteLevel pre-tokenizer, beside steps that only split): its vocabulary's longest piece, one
    character per byte (MiniNorm's: 16). None for any other tokenizer, which gets no bound (NFC, say, merges
    characters). Read once per tokenizer. text_token_range bounds a text's tokens with it."""
    if tokenizer in _LONGEST_TOKENS:
        return _LONGEST_TOKENS[tokenizer]
    longest = None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.normalizer is None and backend.pre_tokenizer is not None:
        spec = json.loads(backend.to_str())
        steps = spec["pre_tokenizer"].get("pretokenizers") or [spec["pre_tokenizer"]]
        kinds = [step.get("type") for step in steps]
        splits_only = all(kind in _SPLITTING_STEPS and step.get("behavior") != "Removed"
                          for kind, step in zip(kinds, steps))
        if spec["model"].get("type") == "BPE" and "ByteLevel" in kinds and splits_only:
            longest = max(len(piece) for piece in backend.get_vocab(with_added_tokens=False))
    _LONGEST_TOKENS[tokenizer] = longest
    return longest


def text_token_range(tokenizer: PreTrainedTokenizerBase, text: str) -> tuple[int, int] | None:
    """The fewest and the most tokens `text` can take encoded as text (control-token strings in it as characters:
    chat_format's encode_text, pretraining's encode_documents), known without tokenizing it, for a tokenizer that
    longest_token_bytes bounds (None for another): a token covers one to longest_token_bytes bytes, a character one
    byte or more (one more for the space a ByteLevel step may put first). A 15 MB text takes ~30 s to tokenize;
    its length alone tells that it cannot fit a context of 512."""
    longest = longest_token_bytes(tokenizer)
    if longest is None:
        return None
    return math.ceil(len(text) / longest), len(text.encode("utf-8", "surrogatepass")) + 1


def _piece_kind(tokenizer: PreTrainedTokenizerBase) -> str:
    """How the tokenizer writes a token's bytes, read from its decoder: "byte_level" (one character per byte),
    "sentencepiece" ("▁" for a space) or "other". A tokenizer without a fast backend is taken as byte-level,
    as MiniNorm's own are."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.decoder is None:
        return "byte_level" if backend is None else "other"
    decoder = json.loads(backend.decoder.__getstate__())
    steps = decoder.get("decoders") or [decoder]
    types = {step.get("type") for step in steps}
    if "ByteLevel" in types:
        return "byte_level"
    if "Metaspace" in types or any(step.get("type") == "Replace" and step.get("pattern", {}).get("String")
                                   == _WORD_MARK for step in steps):
        return "sentencepiece"
    return "other"
