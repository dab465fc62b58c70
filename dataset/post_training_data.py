"""Default data for LoRA, DPO and GRPO: Wikipedia question-answer conversations and arithmetic word problems.

    python dataset/post_training_data.py        # build (no-op when the cache is current); prints the files

Written under ``dataset/cache/`` beside the default corpus, with the corpus's train/validation split (the article
title decides, so an article never crosses it):

- ``lora_{train,val}.jsonl``: one topic, the Wikipedia question-answer conversations about
  ``LORA_TOPIC`` (MiniMind's ``{"conversations": [...]}`` format) -- a small domain set for a LoRA adapter.
- ``dpo_{train,val}.jsonl``: preference pairs (MiniMind's ``{"chosen": [...], "rejected": [...]}``) on every
  article's question: chosen is the article's own answer; rejected is, alternately, the answer to another
  article's question from another topic (off-topic) or the true answer's first words repeated (degenerate).
  These pairs demonstrate the mechanics of DPO -- the trained model learns to prefer on-topic, non-repeating
  answers -- not alignment quality: no human judged them.
- ``grpo_{train,val}.jsonl``: arithmetic word problems (dataset/arithmetic.py) as prompt rows
  ``{"prompt": ..., "answer": N}`` for the ``math_answer`` reward: training prompts that the default SFT data
  does not contain, and the held-out problems (whose arithmetic no training file contains).
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
from dataclasses import astuple, dataclass  # noqa: E402

from dataset.arithmetic import rl_problems  # noqa: E402
from dataset.atomic_io import atomic_write_text, make_dirs  # noqa: E402
from dataset.corpus import DEFAULT_CACHE_DIR, manifest_is_current  # noqa: E402
from dataset.json_text import strict_json  # noqa: E402
from dataset.split_names import POST_TRAINING_FILES  # noqa: E402
from dataset.splits import is_validation, wiki_split_key  # noqa: E402
from dataset.sources import WikiArticle, package_versions, read_wikipedia  # noqa: E402
from dataset.wiki_qa import conversations_for  # noqa: E402

BUILD_VERSION = 2  # 2: the GRPO files
MANIFEST_NAME = "post_training_manifest.json"
LORA_TOPIC = "Biology and health sciences"
REPEATED_WORDS = 4   # a degenerate answer repeats the true answer's first words ...
REPEATS = 6          # ... this many times


@dataclass(frozen=True)
class PostTrainingPaths:  # a field per file, named as dataset/split_names.py's POST_TRAINING_FILES name them
    lora_train: Path
    lora_val: Path
    dpo_train: Path
    dpo_val: Path
    grpo_train: Path
    grpo_val: Path


def post_training_paths(cache_dir: Path) -> PostTrainingPaths:
    return PostTrainingPaths(**{name: cache_dir / f"{name}.jsonl" for name in POST_TRAINING_FILES})


def _pick(title: str, salt: str, modulo: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{salt}\x00{title}".encode()).digest()[:8], "big") % modulo


def degenerate_answer(answer: str) -> str:
    """The answer's first words over and over: the repetition loop small models fall into."""
    head = " ".join(answer.split()[:REPEATED_WORDS]).rstrip(".,;:")
    return " ".join([head] * REPEATS)


def preference_pairs(articles: list[WikiArticle]) -> list[tuple[WikiArticle, dict]]:
    """One pair per article with an answer: its question and answer as chosen, and as rejected another topic's
    answer (even pick) or a degenerate repetition (odd pick); the choices are fixed by the titles."""
    qa = [(article, conversations_for(article)[0][:2]) for article in articles]
    qa = [(article, messages) for article, messages in qa if messages]
    pairs = []
    for index, (article, messages) in enumerate(qa):
        question, answer = messages[0]["content"], messages[1]["content"]
        if _pick(article.title, "dpo-kind", 2) == 0:
            # Walk from a title-chosen start to the first answer about another topic.
            start = _pick(article.title, "dpo-other", len(qa))
            other = next((qa[(start + step) % len(qa)] for step in range(len(qa))
                          if qa[(start + step) % len(qa)][0].topic != article.topic), None)
            rejected = other[1][1]["content"] if other is not None else degenerate_answer(answer)
        else:
            rejected = degenerate_answer(answer)
        prompt = [{"role": "user", "content": question}]
        pairs.append((article, {"chosen": prompt + [{"role": "assistant", "content": answer}],
                                "rejected": prompt + [{"role": "assistant", "content": rejected}]}))
    return pairs


def _write(path: Path, records: list[dict]) -> dict:
    text = "".join(strict_json(record, ensure_ascii=False) + "\n" for record in records)
    atomic_write_text(path, text)
    return {"records": len(records), "bytes": len(text.encode("utf-8"))}


def build_post_training_data(cache_dir: Path) -> dict:
    """Write the six files and the manifest (last: its presence says the files are complete); return it."""
    articles = list(read_wikipedia())
    paths = post_training_paths(cache_dir)
    lora = [(article, {"conversations": conversation}) for article in articles if article.topic == LORA_TOPIC
            for conversation in conversations_for(article)]
    dpo = preference_pairs(articles)
    files = {}
    for (train_path, val_path), items in (((paths.lora_train, paths.lora_val), lora),
                                          ((paths.dpo_train, paths.dpo_val), dpo)):
        val = [record for article, record in items if is_validation(wiki_split_key(article))]
        train = [record for article, record in items if not is_validation(wiki_split_key(article))]
        files[train_path.name], files[val_path.name] = _write(train_path, train), _write(val_path, val)
    rl_train, rl_val = rl_problems()
    files[paths.grpo_train.name] = _write(paths.grpo_train, [problem.prompt_row() for problem in rl_train])
    files[paths.grpo_val.name] = _write(paths.grpo_val, [problem.prompt_row() for problem in rl_val])
    manifest = {"build_version": BUILD_VERSION, "packages": package_versions(), "lora_topic": LORA_TOPIC,
                "files": files}
    atomic_write_text(cache_dir / MANIFEST_NAME, strict_json(manifest, indent=2, ensure_ascii=False) + "\n")
    return manifest


def ensure_post_training_data(cache_dir: Path | None = None) -> PostTrainingPaths:
    """The LoRA, DPO and GRPO default files, built first unless the cache is current (a few seconds)."""
    cache_dir = make_dirs(Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_DIR)
    names = [path.name for path in astuple(post_training_paths(cache_dir))]
    if not manifest_is_current(cache_dir, MANIFEST_NAME, BUILD_VERSION, names):
        build_post_training_data(cache_dir)
    return post_training_paths(cache_dir)


def main() -> None:
    paths = ensure_post_training_data()
    manifest = json.loads((paths.lora_train.parent / MANIFEST_NAME).read_text(encoding="utf-8"))
    for name, info in manifest["files"].items():
        print(f"{paths.lora_train.parent / name}: {info['records']:,} records, {info['bytes'] / 1e6:.1f} MB")


if __name__ == "__main__":
    from trainer.cli import run_main  # dataset/ imports trainer/ only inside functions: trainer/ imports dataset/

    run_main(main)
