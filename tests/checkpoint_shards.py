"""A saved checkpoint's model.safetensors split into shards, as the sharded-index tests of the import and the
exports damage it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from safetensors.torch import load_file, save_file


def two_shards(metadata: bool = True, twice: str | None = None) -> Callable[[Path], None]:
    """An edit of a model folder: model.safetensors split into two shards and their index (with `metadata` or
    without), the tensor `twice` in both shards."""
    def edit(folder: Path) -> None:
        weights = load_file(folder / "model.safetensors")
        (folder / "model.safetensors").unlink()
        keys = sorted(weights)
        halves = {"model-1.safetensors": keys[::2], "model-2.safetensors": keys[1::2]}
        for name, half in halves.items():
            save_file({key: weights[key] for key in {*half, *([twice] if twice else [])}}, folder / name,
                      metadata={"format": "pt"})
        index = {"weight_map": {key: name for name, half in halves.items() for key in half}}
        if metadata:
            index["metadata"] = {}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return edit
