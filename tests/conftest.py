"""Shared pytest fixtures (keep them generic: several test files use them)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    """The tokenizer committed in model/."""
    from dataset.tokenization import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def default_corpus(tmp_path_factory):
    """The default corpus, built once per test session into a temp dir (about 10 s)."""
    from dataset.corpus import ensure_default_corpus

    return ensure_default_corpus(tmp_path_factory.mktemp("default_corpus"), quiet=True)
