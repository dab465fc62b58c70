"""Train MiniNorm's byte-level BPE tokenizer on the default pretraining corpus.

    python scripts/train_tokenizer.py                 # writes model/tokenizer.json + tokenizer_config.json
                                                      # (+ tokenizer_files.json, dataset/tokenization.py)
    python scripts/train_tokenizer.py --vocab_size 8000 --out_dir /tmp/tok --data_path my_pretrain.jsonl

Byte-level BPE (GPT-2 style pre-tokenization, no normalizer) round-trips any text exactly. The special tokens
and the chat template come from ``dataset/chat_format.py``: ``<|endoftext|>``=0 (pad/unk), ``<|im_start|>``=1,
``<|im_end|>``=2 (eos) in MiniMind's order, then ``<tool_call>`` ``</tool_call>`` ``<tool_response>``
``</tool_response>`` ``<think>`` ``</think>`` (3-8) and four spares ``<|reserved_0|>``... (9-12); there is no bos.
The vocabulary size counts them. Only the training split is used, so validation text stays unseen.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script, from the repo root or from scripts/
    if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)  # nothing in scripts/ may shadow an installed package (`tokenizers`, `sweeps`, ...)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.cli import quiet_ctrl_c_while_loading  # noqa: E402

quiet_ctrl_c_while_loading(__name__)  # a Ctrl-C while the imports below load: one line, exit 130

import re  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Iterator  # noqa: E402

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from dataset.atomic_io import atomic_path, check_folder_path, make_dirs  # noqa: E402
from dataset.chat_format import CHATML_TEMPLATE, ENDOFTEXT, IM_END, SPECIAL_TOKENS  # noqa: E402
from dataset.jsonl import check_data_file, iter_records  # noqa: E402
from dataset.tokenization import (  # noqa: E402
    DEFAULT_TOKENIZER_DIR,
    begin_tokenizer_save,
    end_tokenizer_save,
    model_dir_lock,
)
from dataset.tokenizer_marker import TOKENIZER_MARKER  # noqa: E402
from trainer.cli import ToolParser, int_within, output_folder, path_arg, run_main  # noqa: E402
from trainer.run_dir import is_model_dir, report_error, resolve_input_path  # noqa: E402

DEFAULT_VOCAB_SIZE = 6400  # MiniMind's size: small enough that the embedding does not dominate a tiny model
# The vocabulary always holds the 256 byte symbols and the special tokens: a smaller size would silently give this
# many. The top is far beyond any vocabulary a small model uses (its embedding alone would be gigabytes).
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
MAX_VOCAB_SIZE = 2**24
MODEL_MAX_LENGTH = 32768
# The BPE trainer's time grows with the square of a word's length (a 200,000-character run took 38 s, a 50 MB line
# ran for over 10 minutes): a longer run of non-space characters is trained on in pieces of this many. No merge a
# small vocabulary keeps spans that far (the default corpus' longest run is 248 characters, so it trains as before).
LONGEST_TRAINING_RUN = 1000
LONG_RUN = re.compile(r"\S{%d,}" % (LONGEST_TRAINING_RUN + 1))


def training_pieces(text: str) -> Iterator[str]:
    """`text` as the trainer is given it: whole, or, where it holds a run of more than LONGEST_TRAINING_RUN
    non-space characters, the text around each run and the run in pieces of at most that many."""
    start = 0
    for run in LONG_RUN.finditer(text):
        if run.start() > start:
            yield text[start:run.start()]
        for piece in range(run.start(), run.end(), LONGEST_TRAINING_RUN):
            yield text[piece:min(piece + LONGEST_TRAINING_RUN, run.end())]
        start = run.end()
    if start < len(text) or not start:
        yield text[start:]


def iter_texts(path: Path) -> Iterator[str]:
    """The texts of a pretraining jsonl file, checked line by line as training reads them (dataset/jsonl.py): a
    bad line is a ValueError naming the file and the line, and so is a file with no text at all."""
    try:
        check_data_file(path)
    except FileNotFoundError as error:
        raise ValueError(f"--data_path: {error}") from None
    texts = 0
    for _, record, _ in iter_records(path, "text"):
        texts += 1
        yield from training_pieces(record["text"])
    if not texts:
        raise ValueError(f"{path}: no text records; refusing to train a tokenizer on nothing")


def train_bpe(texts: Iterator[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols up front, so no input can ever need an unknown token.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == token_id, (token, tokenizer.token_to_id(token))
    return tokenizer


def wrap(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=ENDOFTEXT,
        bos_token=None,
        chat_template=CHATML_TEMPLATE,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,  # decoding must give back the exact text
        padding_side="right",
    )


def save(tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> list[Path]:
    """Save only the tokenizer files into ``out_dir`` (which may hold other files, like model/; made if missing).
    Each file is replaced whole, and the files jointly, as a model directory's are (trainer/export.py): the
    folder's TOKENIZER_MARKER says a save is under way before the first and lists them after the last, so a kill
    between two leaves a folder that load_tokenizer refuses, not a mix of two tokenizers that loads as one; and
    they hold the folder (model_dir_lock) against another save into it at the same time."""
    with tempfile.TemporaryDirectory() as tmp:
        # save_jinja_files=False keeps the chat template inside tokenizer_config.json.
        tokenizer.save_pretrained(tmp, save_jinja_files=False)
        names = sorted(p.name for p in Path(tmp).iterdir())
        make_dirs(out_dir)
        with model_dir_lock(out_dir):  # a model's save into the folder meanwhile would mix its files with these
            begin_tokenizer_save(out_dir, names)
            written = []
            for name in names:
                with atomic_path(out_dir / name) as target:  # a kill leaves the old file or the new, never half
                    shutil.copyfile(Path(tmp) / name, target)
                written.append(out_dir / name)
            end_tokenizer_save(out_dir, names)
    return [*written, out_dir / TOKENIZER_MARKER]


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab_size", type=int_within(MIN_VOCAB_SIZE, MAX_VOCAB_SIZE,
                                                        "the byte symbols and special tokens included"),
                        default=DEFAULT_VOCAB_SIZE, help="tokens in the trained vocabulary")
    parser.add_argument("--data_path", type=path_arg, default=None,
                        help="pretraining jsonl ({'text': ...} lines); default: the built-in corpus")
    parser.add_argument("--out_dir", type=output_folder, default=None,
                        help="where tokenizer.json goes (default: model/, the committed tokenizer)")
    args = parser.parse_args(argv)
    try:
        out_dir = Path(args.out_dir) if args.out_dir is not None else DEFAULT_TOKENIZER_DIR
        check_folder_path(out_dir, "--out_dir")  # a file in the way is found now, not after the training
        if is_model_dir(out_dir):  # its embedding indexes the tokenizer there: a new one would be lost on it
            raise ValueError(f"--out_dir {out_dir} holds a model (config.json and its weights), whose token ids are "
                             f"its tokenizer's: a new tokenizer there would leave it reading other tokens; choose "
                             f"another --out_dir")
        if args.data_path is None:
            from dataset.corpus import ensure_default_corpus

            data_path = ensure_default_corpus().pretrain_train
        else:
            data_path = resolve_input_path(args.data_path)  # from here, else from the repo root
        tokenizer = wrap(train_bpe(iter_texts(data_path), args.vocab_size))
        written = save(tokenizer, out_dir)
    except ValueError as error:
        return report_error(error)
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    run_main(main)
