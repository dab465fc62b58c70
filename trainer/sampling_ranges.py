"""The numeric bounds of a sampling setting wherever one is read: eval/chat.py's flags and the server's requests
(trainer/inference_flags.py, scripts/server/protocol.py) and a model directory's generation_config.json
(model/generation_defaults.py). Imports nothing: the flags' module stays free of torch, and the model's reader
would otherwise import the command-line helpers, which import the model's loader."""

from __future__ import annotations

# A temperature or repetition penalty below SMALLEST_DIVISOR (or a penalty above LARGEST_FACTOR) turns float32
# logits into infinities and NaN (transformers' sampled generate at a temperature of 1e-300: "probability tensor
# contains either `inf`, `nan` or element < 0").
SMALLEST_DIVISOR, LARGEST_FACTOR = 1e-5, 1e5
