"""The names of the embedded data's (train, val) files, the one owner: dataset/corpus.py and
dataset/post_training_data.py write each as <name>.jsonl (their paths' fields are so named), the trainers read a
task's pair (trainer/data.default_split_names) and the tools offer the validation halves by name (--data). On its
own, importing nothing, so a tool names a split without loading the builders (dataset/corpus.py loads transformers).
"""

from __future__ import annotations

from typing import NamedTuple


class SplitNames(NamedTuple):
    train: str
    val: str


PRETRAIN = SplitNames("pretrain_train", "pretrain_val")
SFT = SplitNames("sft_train", "sft_val")  # the SFT conversations (the trainer's --sft_data chat)
SFT_TOOLS = SplitNames("sft_tools_train", "sft_tools_val")  # the same plus tool-use dialogues (--sft_data tools)
LORA = SplitNames("lora_train", "lora_val")  # one topic's question-answer conversations
DPO = SplitNames("dpo_train", "dpo_val")
GRPO = SplitNames("grpo_train", "grpo_val")  # the arithmetic prompts of GRPO and PPO

CORPUS_FILES = (*PRETRAIN, *SFT, *SFT_TOOLS)  # dataset/corpus.py's, in CorpusPaths's order
POST_TRAINING_FILES = (*LORA, *DPO, *GRPO)  # dataset/post_training_data.py's, in PostTrainingPaths's order

DEFAULT_TEXT_DATA = PRETRAIN.val  # a tool's --data default: the validation text of the embedded corpus
