"""The independent reference for GGUF exports: stock llama.cpp (llama-cpp-python) computing a file's logits."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from llama_cpp import GGML_TYPE_F32, Llama


def llama_cpp_logits(path: Path, ids: Sequence[int], n_ctx: int = 128) -> np.ndarray:
    """llama.cpp's logits (tokens x vocabulary) for `ids` on the GGUF file at `path`, one thread. Its KV cache is
    f16 by default (logits then differ by ~2e-3); f32 keeps a comparison about the file."""
    llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=1, logits_all=True, seed=0, verbose=False,
                type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32)
    try:
        llm.eval(list(ids))
        return np.array(llm.scores[:len(ids)])
    finally:
        llm.close()
