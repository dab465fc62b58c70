"""One decode step of a MiniNorm model over a preallocated KV cache, eager or compiled: GenerationEngine's fast path.

The model's own forward (model/model.py) takes a growing DynamicCache and a padding mask, checks the mask on the
host and builds its 4D mask each call: right for training and prefill, but at one token per row most of a decode
step is then per-op Python overhead around small matrix products. Here a step feeds one token per row through the
same modules (embedding, rotary table, blocks, final norm, LM head) with

  - `StaticKVCache`: per-layer buffers (rows, kv heads, capacity, head dim) in which row r's token at position t
    sits in column t, so rows of different lengths need no left padding; each layer's new keys and values are
    written in place at the rows' own columns, and attention reads columns [0, length) under a mask
    `column <= row's position`;
  - optionally `torch.compile` of the whole step (one graph, dynamic in rows and length, Inductor's C++ wrapper),
    which removes most of that overhead. Where compiling fails (no compiler, an unsupported model), the step says
    so once and runs eagerly.

The step computes what the model's forward computes for the same tokens and positions, up to float rounding
(tests/unit/test_decode_step.py compares both paths' logits and greedy tokens).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from dataset.atomic_io import first_line

CAPACITY_CHUNK = 128  # the cache grows by whole chunks of columns, so a long generation reallocates rarely


def supports_decode_step(model: Any) -> bool:
    """Whether `decode_logits` can run this model: a MiniNorm causal LM (its trunk's modules are called directly)
    whose keys are not smeared (the static cache holds only the keys attention reads)."""
    from model.model import MiniNormForCausalLM

    return isinstance(model, MiniNormForCausalLM) and not model.config.smeared_keys


class StaticKVCache:
    """Per-row KV buffers without padding; `update` is the call model.Attention makes for each layer.

    Before each step the caller sets `positions` (rows,) -- the column each row's new token goes to, its
    position id -- and `length`, a column count past every row's position."""

    def __init__(self, config: Any, rows: int, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (rows, config.num_key_value_heads, capacity, config.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.length = 0

    @property
    def rows(self) -> int:
        return self.keys[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one token's keys and values (rows, kv heads, 1, head dim) at each row's column; the layer's
        columns [0, length)."""
        index = self.positions.view(-1, 1, 1, 1).expand_as(keys)
        self.keys[layer_idx].scatter_(2, index, keys)
        self.values[layer_idx].scatter_(2, index, values)
        return self.keys[layer_idx][:, :, :self.length], self.values[layer_idx][:, :, :self.length]

    def reserve(self, columns: int) -> None:
        """Make room for `columns` columns (whole chunks; the filled columns are copied)."""
        if columns <= self.capacity:
            return
        capacity = -(-columns // CAPACITY_CHUNK) * CAPACITY_CHUNK
        self.keys = [_widen(k, capacity) for k in self.keys]
        self.values = [_widen(v, capacity) for v in self.values]

    def append_row(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Add a row whose cache is `layers`: per layer (keys, values) of shape (1, kv heads, its length, head dim),
        its token t at column t (a prefill's DynamicCache)."""
        self.reserve(layers[0][0].shape[2])
        for index, (keys, values) in enumerate(layers):
            self.keys[index] = torch.cat([self.keys[index], _widen(keys, self.capacity)])
            self.values[index] = torch.cat([self.values[index], _widen(values, self.capacity)])
        self.positions = torch.cat([self.positions, self.positions.new_zeros(1)])

    def select_rows(self, keep: list[int]) -> None:
        index = torch.tensor(keep, dtype=torch.long, device=self.positions.device)
        self.keys = [k.index_select(0, index) for k in self.keys]
        self.values = [v.index_select(0, index) for v in self.values]
        self.positions = self.positions.index_select(0, index)


def _widen(tensor: torch.Tensor, capacity: int) -> torch.Tensor:
    """(rows, heads, columns, dim) zero-padded on the right to `capacity` columns."""
    return torch.nn.functional.pad(tensor, (0, 0, 0, capacity - tensor.shape[2]))


def decode_logits(model: Any, tokens: torch.Tensor, cache: StaticKVCache,
                  head_t: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The next-token logits (rows, vocab), fp32, of `tokens` (rows,) at `cache.positions`, each row attending to its
    columns up to its position, and each row's argmax and maximum (what greedy decoding reads: one more pass over
    the logits inside the compiled step instead of two eager ops). Mirrors MiniNormModel.forward and
    MiniNormForCausalLM.forward for one token per row, with the 4D mask built here. `head_t`: the LM head's weight
    transposed and contiguous (hidden, vocab), used in place of model.lm_head when given."""
    trunk = model.model
    positions = cache.positions[:, None]
    x = trunk.dropout(trunk.embed_tokens(tokens[:, None]))
    rope = trunk.rotary(positions, x.dtype)
    columns = torch.arange(cache.length, device=tokens.device)
    mask = (columns[None, :] <= positions)[:, None, None, :]
    for block in trunk.layers:
        x = block(x, rope, mask, cache)
        if isinstance(x, tuple):  # a mixture-of-experts block also returns its router logits
            x = x[0]
    hidden = trunk.norm(x)[:, -1]
    logits = (model.lm_head(hidden) if head_t is None else hidden @ head_t).float()
    return logits, logits.argmax(-1), logits.amax(-1)


def plain_head(model: Any) -> torch.Tensor | None:
    """The LM head's weight when the head is a plain bias-free nn.Linear (else None: call the module)."""
    head = model.lm_head
    return head.weight if type(head) is torch.nn.Linear and head.bias is None else None


class DecodeStep:
    """`decode_logits`, compiled when `compiled` is true and torch.compile works here, else eager."""

    _compiled_fn: Any = None
    _compile_failed = False  # once compiling failed in this process, every step runs eagerly

    def __init__(self, model: Any, compiled: bool) -> None:
        self.model, self.compiled = model, compiled
        self._head_t: torch.Tensor | None = None
        self._head_key: tuple[int, int] | None = None

    def head_t(self) -> torch.Tensor | None:
        """A contiguous copy of the LM head's weight, transposed: a (rows, hidden) x (hidden, vocab) product reads
        it row by row, 1.5-2.5x faster at 8 rows on a CPU than through the (vocab, hidden) weight's transpose view.
        Copied again when the weight changes (an optimizer step bumps its version)."""
        weight = plain_head(self.model)
        if weight is None:
            return None
        key = (weight.data_ptr(), weight._version)
        if key != self._head_key:
            self._head_t, self._head_key = weight.detach().t().contiguous(), key
        return self._head_t

    def __call__(self, tokens: torch.Tensor, cache: StaticKVCache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        head_t = self.head_t()
        if not self.compiled or DecodeStep._compile_failed:
            return decode_logits(self.model, tokens, cache, head_t)
        if DecodeStep._compiled_fn is None:
            # Dynamic from the start: rows and length change between steps, one graph serves them all. The C++
            # wrapper calls the kernels without a Python frame per op, the point at these sizes.
            DecodeStep._compiled_fn = torch.compile(decode_logits, dynamic=True, options={"cpp_wrapper": True})
        try:
            # The cache's kv heads and head dim are the model's, never dynamic: left symbolic, the kv heads' count was
            # duck-sized with the rows' when both were equal at the first step (2 and 2), and the step compiled a
            # third graph at the first other count of rows.
            for buffer in (*cache.keys, *cache.values):
                torch._dynamo.mark_static(buffer, 1)
                torch._dynamo.mark_static(buffer, 3)
            # "compiled" is asked for explicitly, so it overrides a force_eager stance (GRPO's rollouts decode under
            # one so that the prefill's varying shapes never compile the model's forward).
            with torch.compiler.set_stance("default"):
                return DecodeStep._compiled_fn(self.model, tokens, cache, head_t)
        except Exception as error:  # compiling failed; an eager rerun rewrites the same cache columns
            DecodeStep._compile_failed = True
            print(f"decode step: torch.compile failed ({first_line(error, named=True)}); "
                  "decoding eagerly", file=sys.stderr)
            return decode_logits(self.model, tokens, cache, head_t)
