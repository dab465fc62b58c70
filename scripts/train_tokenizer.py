"""Train MiniNorm's byte-level BPE tokenizer on the default pretraining corpus.

    python scripts/train_tokenizer.py                 # writes model/tokenizer.json + tokenizer_config.json
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

import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Iterator  # noqa: E402

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from dataset.chat_format import CHATML_TEMPLATE, ENDOFTEXT, IM_END, SPECIAL_TOKENS  # noqa: E402
from dataset.tokenization import DEFAULT_TOKENIZER_DIR  # noqa: E402
from trainer.cli import ToolParser  # noqa: E402

DEFAULT_VOCAB_SIZE = 6400  # MiniMind's size: small enough that the embedding does not dominate a tiny model
MODEL_MAX_LENGTH = 32768
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def iter_texts(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)["text"]


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
    """Save only the tokenizer files into ``out_dir`` (which may hold other files, like model/)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        # save_jinja_files=False keeps the chat template inside tokenizer_config.json.
        tokenizer.save_pretrained(tmp, save_jinja_files=False)
        written = []
        for name in sorted(p.name for p in Path(tmp).iterdir()):
            shutil.copyfile(Path(tmp) / name, out_dir / name)
            written.append(out_dir / name)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = ToolParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab_size", type=int, default=DEFAULT_VOCAB_SIZE, help="tokens in the trained vocabulary")
    parser.add_argument("--data_path", type=Path, default=None,
                        help="pretraining jsonl ({'text': ...} lines); default: the built-in corpus")
    parser.add_argument("--out_dir", type=Path, default=DEFAULT_TOKENIZER_DIR,
                        help="where tokenizer.json goes (default: model/, the committed tokenizer)")
    args = parser.parse_args(argv)
    if args.data_path is None:
        from dataset.corpus import ensure_default_corpus

        args.data_path = ensure_default_corpus().pretrain_train
    tokenizer = wrap(train_bpe(iter_texts(args.data_path), args.vocab_size))
    for path in save(tokenizer, args.out_dir):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
