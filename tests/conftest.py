"""Shared pytest fixtures (keep them generic: several test files use them)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.paths import REPO
from trainer.threads import bound_openmp_waits

# Before any test loads torch (libgomp reads it then), as every command that runs a model does: OpenMP's idle threads
# soon sleep instead of spinning on a core that the suite's other worker (-n) or a test's subprocesses need.
bound_openmp_waits()


@contextmanager
def run_wide_folder(tmp_path_factory, worker_id: str, name: str) -> Iterator[Path]:
    """The folder `name` of this test run, held under a file lock while the block runs: under pytest-xdist it is
    in the run's shared temp folder (the basetemp's parent, each run's own), so what the first worker builds there
    the others wait for and reuse (pytest-xdist's documented pattern); without workers, in this session's basetemp.
    A session fixture built here is paid once per run, not once per worker. (Make it and mark it done inside the
    block: a worker killed mid-build leaves no mark, and the next one builds again.)"""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        root = root.parent
    path = root / name
    with FileLock(str(path) + ".lock"):
        yield path


@pytest.fixture(scope="session")
def tokenizer():
    """The tokenizer committed in model/."""
    from dataset.tokenization import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def sentencepiece_tokenizer():
    """A Llama-style (SentencePiece) tokenizer, as an imported checkpoint may bring: "▁" marks a word's space (the
    decoder strips the first one), "<0xE4>" byte-fallback tokens spell characters the vocabulary lacks."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{byte:02X}>": 3 + byte for byte in range(256)}}
    for piece in ("▁", "a", "c", "f", "▁a", "▁c", "▁ca", "北"):
        vocab[piece] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a"), ("▁", "c"), ("▁c", "a")], byte_fallback=True,
                                   unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")


@pytest.fixture(scope="session")
def default_corpus(tmp_path_factory, worker_id):
    """The default corpus, built once per test run into a temp dir (about 17 CPU-s; ensure_default_corpus reuses a
    current build)."""
    from dataset.corpus import ensure_default_corpus

    with run_wide_folder(tmp_path_factory, worker_id, "default_corpus") as folder:
        return ensure_default_corpus(folder, quiet=True)


# ---------------------------------------------------------------- tiny trained model directories (chat, eval, export)
TINY_REPLY = "I am a tiny model."
_TINY_QUESTIONS = ("Hi!", "Hello", "Who are you?", "What is the capital of France?", "Tell me a joke.", "你好",
                   "How are you?", "What is your name?", "Good morning", "Bye")
_TINY_TEXTS = ("The history of the city begins with a small fishing village on the river.",
               "Water is a chemical compound of hydrogen and oxygen. It covers most of the Earth.",
               "北京是中华人民共和国的首都，也是政治和文化中心。",
               "A tiny language model learns to continue text one token at a time.")


@dataclass(frozen=True)
class TinyModels:
    sft: Path             # trained to answer every question with TINY_REPLY and then <|im_end|>
    chat: Path            # the same, also trained on two-turn conversations: its answer follows a history too
    pretrain: Path        # untrained, Llama-compatible (rmsnorm, pre), task: pretrain
    post_ln: Path         # untrained, norm_placement="post" (not Llama-compatible)
    sft_data: Path        # the SFT jsonl the sft model was trained on
    pretrain_data: Path   # a small {"text"} jsonl
    reply: str = TINY_REPLY


def _tiny_model(tokenizer, seed: int, **overrides):
    import torch

    from model import MiniNormConfig, MiniNormForCausalLM

    torch.manual_seed(seed)
    fields = dict(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, norm_impl="eager",
                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    config = MiniNormConfig(**{**fields, **overrides})
    return MiniNormForCausalLM(config)


def _perturbed(model):
    """Untrained weights plus noise, so norm gains differ from 1 and a mis-mapped norm key would show."""
    import torch

    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    return model.eval()


def _write_conversations(path: Path, conversations: list[list[str]]) -> None:
    """One jsonl line per conversation: each question answered with TINY_REPLY."""
    lines = [{"conversations": [turn for question in questions
                                for turn in ({"role": "user", "content": question},
                                             {"role": "assistant", "content": TINY_REPLY})]}
             for questions in conversations]
    path.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")


def _trained_sft(data_path: Path, tokenizer, cache_dir: Path):
    """A tiny model trained, full-batch, until it answers every conversation of `data_path` with TINY_REPLY."""
    import torch

    from dataset.sft_dataset import SFTDataset

    data = SFTDataset(data_path, tokenizer, max_seq_len=64, cache_dir=cache_dir)
    batch = data.collate([data[i] for i in range(len(data))])
    model = _tiny_model(tokenizer, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(80):  # full-batch steps until the fixed reply (and its <|im_end|>) is memorized
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model.eval()


def _save_tiny(model, tokenizer, path: Path, task: str) -> Path:
    import yaml

    from trainer.export import save_model_dir
    from trainer.run_dir import CONFIG_FILE

    save_model_dir(model, tokenizer, path)
    (path / CONFIG_FILE).write_text(yaml.safe_dump({"task": task}))  # how the trainer records the task
    return path


def _write_tiny_models(root: Path, tokenizer) -> None:
    sft_data, pretrain_data = root / "sft.jsonl", root / "pretrain.jsonl"
    _write_conversations(sft_data, [[q] for q in _TINY_QUESTIONS])
    two_turns = [[q, r] for q, r in zip(_TINY_QUESTIONS, _TINY_QUESTIONS[1:])]
    _write_conversations(root / "chat.jsonl", [[q] for q in _TINY_QUESTIONS] + two_turns)
    pretrain_data.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in _TINY_TEXTS),
                             encoding="utf-8")
    _save_tiny(_trained_sft(sft_data, tokenizer, root / "cache"), tokenizer, root / "sft", "sft")
    _save_tiny(_trained_sft(root / "chat.jsonl", tokenizer, root / "cache"), tokenizer, root / "chat", "sft")
    _save_tiny(_perturbed(_tiny_model(tokenizer, seed=1)), tokenizer, root / "pretrain", "pretrain")
    _save_tiny(_perturbed(_tiny_model(tokenizer, seed=2, norm_placement="post")), tokenizer, root / "post_ln",
               "pretrain")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, tokenizer, worker_id) -> TinyModels:
    """Tiny model directories written like the trainer's (about 15 CPU-s, once per test run: run_wide_folder): an
    SFT model that reliably stops at <|im_end|>, an untrained pretrained one, a post-LN one, and their data files.
    Every worker would build the same ones (fixed seeds and data)."""
    with run_wide_folder(tmp_path_factory, worker_id, "tiny_models") as root:
        if not (root / "done").is_file():
            root.mkdir(exist_ok=True)
            _write_tiny_models(root, tokenizer)
            (root / "done").touch()
    return TinyModels(sft=root / "sft", chat=root / "chat", pretrain=root / "pretrain", post_ln=root / "post_ln",
                      sft_data=root / "sft.jsonl", pretrain_data=root / "pretrain.jsonl")


@pytest.fixture(scope="module")
def sft(tiny_models):
    """The tiny SFT model and its tokenizer, loaded (once per test module)."""
    from model.loading import load_model

    return load_model(tiny_models.sft)


@pytest.fixture(scope="module")
def pretrained(tiny_models):
    """The tiny untrained Llama-compatible model and its tokenizer, loaded (once per test module)."""
    from model.loading import load_model

    return load_model(tiny_models.pretrain)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors gain nothing from intra-op threads, and on a busy 2-core machine OpenMP's thread handoffs make
    each op up to 50x slower: a module that asks for it (`pytestmark = pytest.mark.usefixtures("one_thread")`)
    runs single-threaded, and the setting is restored afterwards."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory, tokenizer, worker_id) -> Path:
    """The tool tests' memorised model (tests/tool_model.py): trained once per run, whichever worker asks first."""
    from tests.tool_model import shared_tool_model

    return shared_tool_model(tmp_path_factory, tokenizer, worker_id)


# ---------------------------------------------------------------- tiny training runs (trainer tests)
@pytest.fixture(scope="session")
def train_data(tmp_path_factory) -> Path:
    """pretrain.jsonl and sft.jsonl (uneven answer lengths) for tiny trainer runs (tests/training_runs.py)."""
    from tests.training_runs import write_train_data

    return write_train_data(tmp_path_factory.mktemp("train_data"))


@pytest.fixture(scope="session")
def reference_run(train_data, tmp_path_factory) -> Path:
    """8 optimizer steps, batch 4, one process, no dropout: the curve other pretraining runs must reproduce."""
    from tests.training_runs import pretrain_argv, run_in_process

    out_dir = tmp_path_factory.mktemp("reference")
    run_in_process("pretrain", pretrain_argv(train_data, out_dir, "--batch_size", "4"))
    return out_dir


@pytest.fixture(scope="session")
def muon_reference_run(train_data, tmp_path_factory) -> Path:
    """The reference run's 8 steps with --optimizer muon and the WSD schedule, one process."""
    from tests.training_runs import MUON_FLAGS, pretrain_argv, run_in_process

    out_dir = tmp_path_factory.mktemp("muon_reference")
    run_in_process("pretrain", pretrain_argv(train_data, out_dir, "--batch_size", "4", *MUON_FLAGS))
    return out_dir


@pytest.fixture(scope="session")
def sft_reference_run(train_data, reference_run, tmp_path_factory) -> Path:
    """SFT of the reference run on the uneven conversations, batch 4, one process."""
    from tests.training_runs import run_in_process, sft_argv

    out_dir = tmp_path_factory.mktemp("sft_reference")
    run_in_process("sft", sft_argv(train_data, reference_run, out_dir, "--batch_size", "4"))
    return out_dir


@pytest.fixture(scope="session")
def word_model(tmp_path_factory) -> Path:
    """The tiny model that writes the 22-word corpus (tests/training_runs.py pretrain_word_model), with its prompts
    and count_the reward beside it: one for GRPO's and PPO's behavioural tests."""
    from tests.training_runs import pretrain_word_model

    return pretrain_word_model(tmp_path_factory.mktemp("word_model"))


# ---------------------------------------------------------------- live servers (scripts/serve.py) on free local ports
def wait_for_health(url: str, process=None, timeout: float = 180) -> None:
    import time
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}: {process.stderr.read()}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def serve_process(model_path: Path):
    """`python scripts/serve.py` itself on a free port, serving `model_path`; yields its base URL once healthy
    (a generator for fixtures to `yield from`)."""
    import subprocess
    import sys

    from trainer.distributed import free_port

    port = free_port()
    process = subprocess.Popen([sys.executable, str(REPO / "scripts" / "serve.py"),
                                "--model_path", str(model_path), "--port", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, process)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture(scope="session")
def sft_server(tiny_models):
    """The server serving the tiny SFT model; yields its base URL."""
    yield from serve_process(tiny_models.sft)


@pytest.fixture(scope="session")
def endless_model(tmp_path_factory, tokenizer) -> Path:
    """An untrained SFT-task model with a 4096-token context that never ends its turn (its <|im_end|> embedding is
    zero, so greedy decoding never picks it): requests run to their max_tokens, long enough to watch streaming
    and disconnects."""
    import torch

    model = _perturbed(_tiny_model(tokenizer, seed=3, max_position_embeddings=4096))
    with torch.no_grad():
        model.get_input_embeddings().weight[tokenizer.eos_token_id] = 0
    return _save_tiny(model.eval(), tokenizer, tmp_path_factory.mktemp("endless") / "endless", "sft")


class ThreadedServer:
    """The server's app (scripts/server/app.py create_app) under uvicorn on a thread of this process."""

    def __init__(self, app) -> None:
        import threading

        import uvicorn

        from trainer.distributed import free_port

        self.url = f"http://127.0.0.1:{free_port()}"
        port = int(self.url.rsplit(":", 1)[1])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "ThreadedServer":
        self.thread.start()
        wait_for_health(self.url, timeout=60)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="session")
def threaded_server():
    """ThreadedServer, the class: `with threaded_server(app) as server: ... server.url`."""
    return ThreadedServer


@pytest.fixture(scope="session")
def serve_app():
    """scripts/serve.py's app for a model directory: `serve_app(path, max_batch=8, api_key=None)`."""
    from scripts.server.app import create_app
    from scripts.server.served_model import load_served_model

    def make(path: Path, max_batch: int = 8, **kwargs):
        return create_app(load_served_model(path, max_batch=max_batch), **kwargs)

    return make


@pytest.fixture
def chat_sessions(monkeypatch) -> list:
    """Every ChatSession made while the test runs (eval/chat.py builds one per run), in order."""
    from model.chat_session import ChatSession

    sessions: list[ChatSession] = []
    original = ChatSession.__init__

    def recording_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        sessions.append(self)

    monkeypatch.setattr(ChatSession, "__init__", recording_init)
    return sessions
