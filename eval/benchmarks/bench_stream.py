"""Streamed against whole: one long chat reply from scripts/serve.py, as server-sent events and as one response.

Starts two servers on 127.0.0.1 with the same model: this checkout's, and the tree of `--old_ref` (by default the
last commit whose stream read the whole reply again at every token) exported from git into a temp directory. Each
answers the same request of `--tokens` tokens (sampled with a fixed seed), streamed and not, one request at a time;
the four (server, streamed or not) are interleaved, their order reversed every other round, after one warm-up round.
The reply is plain content of exactly `--tokens` tokens: logit_bias bans every special token (<|im_end|> and the
control tokens), and the streamed content must equal the whole reply's. The model is an untrained cpu-default
(fresh weights, seed 0, a context of `--tokens` + 512): an untrained model decodes as fast as a trained one of the
same shape, and no trained cpu preset holds a 3,000-token reply (their context is 512). Each round also times each
tree's stream alone (STREAM_WORK below): what it costs the server's event loop, beside the engine's decoding.

    python eval/benchmarks/bench_stream.py                       # 3,000 tokens, 5 rounds
    python eval/benchmarks/bench_stream.py --tokens 1000 --rounds 3 --old_ref HEAD~1
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script, from any directory
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.cli import quiet_ctrl_c_while_loading  # noqa: E402

quiet_ctrl_c_while_loading(__name__)  # a Ctrl-C while the imports below load: one line, exit 130

import http.client  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tarfile  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from trainer.cli import RawDescriptionDefaultsHelpFormatter, ToolParser, int_within, run_main  # noqa: E402
from trainer.distributed import free_port  # noqa: E402
from trainer.machine import machine_line  # noqa: E402
from trainer.run_dir import CONFIG_FILE, REPO_ROOT  # noqa: E402

# The last commit whose DeltaStream parsed the whole reply at every token (before the incremental ReplyLayout).
OLD_STREAM_REF = "e1e457c3a56b6a567557146659cdba3f351c2bc3"
PROMPT = "Tell me a long story about a river."
# The stream's own work, without a model or a server: the tree's DeltaStream fed the reply's ids one more at a
# time, as its server feeds it (the engine's list uncopied where deltas() takes end=, else a copy of the ids so
# far), then the final deltas. Run with the tree as the working directory, so that its modules are imported.
STREAM_WORK = """
import inspect, sys, time
from dataset.chat_format import encode_text
from dataset.tokenization import load_tokenizer
from scripts.server.replies import DeltaStream, ReplyReader
tokenizer = load_tokenizer()
ids = encode_text(tokenizer, sys.stdin.read())
uncopied = "end" in inspect.signature(DeltaStream.deltas).parameters
stream = DeltaStream(ReplyReader(tokenizer, []))
start = time.perf_counter()
for n in range(1, len(ids) + 1):
    stream.deltas(ids, end=n) if uncopied else stream.deltas(ids[:n])
stream.deltas(ids, final=True)
print(len(ids), time.perf_counter() - start)
"""


def untrained_model(root: Path, context: int) -> Path:
    """The cpu-default preset with fresh weights (seed 0) and a context of `context` tokens, saved as an SFT
    model directory."""
    import torch
    import yaml

    from dataset.tokenization import load_tokenizer
    from model import MiniNormConfig, MiniNormForCausalLM
    from trainer.export import save_model_dir

    torch.manual_seed(0)
    tokenizer = load_tokenizer()
    config = MiniNormConfig.from_preset("cpu-default", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                        eos_token_id=tokenizer.eos_token_id, max_position_embeddings=context)
    path = root / "cpu-default-untrained"
    save_model_dir(MiniNormForCausalLM(config).eval(), tokenizer, path)
    (path / CONFIG_FILE).write_text(yaml.safe_dump({"task": "sft"}))
    return path


def tree_at(ref: str, root: Path) -> Path:
    """The library and the server (model/, dataset/, trainer/, scripts/) as they are at git revision `ref`."""
    archive = subprocess.run(["git", "archive", "--format=tar", ref, "model", "dataset", "trainer", "scripts"],
                             cwd=REPO_ROOT, check=True, capture_output=True).stdout
    path = root / f"tree_{ref[:12]}"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(path, filter="data")
    return path


class Server:
    """`python scripts/serve.py` of the tree at `tree` on a free port, one request decoded at a time."""

    def __init__(self, tree: Path, model_path: Path) -> None:
        self.port = free_port()
        self.process = subprocess.Popen(
            [sys.executable, str(tree / "scripts" / "serve.py"), "--model_path", str(model_path),
             "--port", str(self.port), "--max_batch", "1"],
            cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server of {tree} exited: {self.process.stderr.read()}")
            try:
                connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
                connection.request("GET", "/health")
                connection.getresponse().read()
                connection.close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def request(port: int, tokens: int, banned: list[int], stream: bool) -> tuple[float, str, int]:
    """(seconds to the whole answer, its content, its completion tokens) of one chat request, sampled with a fixed
    seed: the same reply every time, and text of every kind (an untrained model's greedy reply repeats one token)."""
    body = json.dumps({"messages": [{"role": "user", "content": PROMPT}], "stream": stream, "temperature": 1,
                       "top_p": 1, "seed": 0, "frequency_penalty": 0, "max_tokens": tokens,
                       "logit_bias": {str(i): -100 for i in banned},
                       **({"stream_options": {"include_usage": True}} if stream else {})})
    started = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
        if not stream:
            answer = json.loads(response.read())
            content, used = answer["choices"][0]["message"]["content"], answer["usage"]["completion_tokens"]
        else:
            pieces, used = [], 0
            for line in response:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                pieces += [c["delta"].get("content") or "" for c in chunk["choices"]]
                used = chunk["usage"]["completion_tokens"] if chunk.get("usage") else used
            content = "".join(pieces)
    finally:
        connection.close()
    return time.perf_counter() - started, content, used


def stream_work(tree: Path, content: str) -> tuple[int, float]:
    """(ids, seconds) of the tree's DeltaStream reading the reply whose content is `content` (STREAM_WORK)."""
    out = subprocess.run([sys.executable, "-c", STREAM_WORK], cwd=tree, input=content, check=True,
                         capture_output=True, text=True).stdout.split()
    return int(out[0]), float(out[1])


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(description=__doc__, formatter_class=RawDescriptionDefaultsHelpFormatter)
    parser.add_argument("--tokens", type=int_within(1, 8192), default=3000, help="the reply's length in tokens")
    parser.add_argument("--rounds", type=int_within(1), default=5, help="measured rounds (after one warm-up)")
    parser.add_argument("--old_ref", default=OLD_STREAM_REF, help="the git revision of the old server")
    args = parser.parse_args(argv)
    from dataset.tokenization import load_tokenizer

    banned = sorted(load_tokenizer().added_tokens_decoder)  # <|endoftext|>, <|im_end|>, the control tokens, ...
    with tempfile.TemporaryDirectory() as temp:
        model = untrained_model(Path(temp), args.tokens + 512)
        trees = {"ours": REPO_ROOT, f"old ({args.old_ref[:7]})": tree_at(args.old_ref, Path(temp))}
        servers = {name: Server(tree, model) for name, tree in trees.items()}
        print(f"machine: {machine_line()}; load average {os.getloadavg()[0]:.2f} at start")
        runs = [(name, stream) for name in servers for stream in (False, True)]
        seconds: dict[tuple[str, bool], list[float]] = {run: [] for run in runs}
        work: dict[str, list[float]] = {name: [] for name in trees}
        try:
            for index in range(args.rounds + 1):
                contents = set()
                for name, stream in runs if index % 2 else runs[::-1]:
                    took, content, used = request(servers[name].port, args.tokens, banned, stream)
                    if used != args.tokens:
                        raise RuntimeError(f"{name}: {used} tokens generated, not {args.tokens}")
                    contents.add(content)
                    if index:  # round 0 warms up
                        seconds[(name, stream)].append(took)
                if len(contents) != 1:
                    raise RuntimeError("the streamed and whole answers differ")
                for name in trees if index % 2 else list(trees)[::-1]:
                    ids, took = stream_work(trees[name], next(iter(contents)))
                    if index:
                        work[name].append(took)
                print(f"  round {index}/{args.rounds} done, load average {os.getloadavg()[0]:.2f}", file=sys.stderr)
        finally:
            for server in servers.values():
                server.close()
        print(f"load average (1, 5, 15 min) at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"\none sampled reply (seed 0) of {args.tokens} tokens (plain content), one request at a time, median of "
          f"{args.rounds} interleaved rounds (+1 warm-up): seconds to the whole answer, and the stream's own work "
          f"(its DeltaStream reading the reply's {ids} ids re-encoded from its content, in a process of its own)")
    print("\n| server | whole (s) | streamed (s) | streamed / whole | the stream's own work (s) |")
    print("|---|---|---|---|---|")
    for name in servers:
        whole, streamed = (statistics.median(seconds[(name, stream)]) for stream in (False, True))
        own = statistics.median(work[name])
        print(f"| {name} | {whole:.2f} | {streamed:.2f} | {streamed / whole:.2f} | {own:.3f} |")
    return 0


if __name__ == "__main__":
    run_main(main)
