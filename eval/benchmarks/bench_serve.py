"""Serving benchmark: scripts/serve.py under 1 and 8 concurrent clients on 127.0.0.1, with and without batching.

Starts the real server (a subprocess, `python scripts/serve.py`) once with --max_batch 1 (requests are decoded
one at a time, the rest queue) and once with --max_batch 8 (concurrent requests share each decode step), then
sends the same bounded set of streamed chat requests (plain greedy: frequency penalty 0, not the server's default,
so that the work stays what the earlier tables measured; a fixed max_tokens) from 1 and from 8 client threads. Per
configuration: requests/s, p50/p95 latency of a whole request, p50 time to the first token, generated tokens/s
(from the responses' usage counts) and the mean batch size the server decoded (from /health).
Configurations are interleaved and repeated; the table shows medians over the repeats. `--logprobs N` adds the
8-client, batched configuration with `"logprobs": true, "top_logprobs": N` in every request: what asking for
log-probabilities costs, beside the same configuration without them.

    python eval/benchmarks/bench_serve.py                    # out/sft, else an untrained cpu-default model
    python eval/benchmarks/bench_serve.py --model_path out/sft --requests 32 --max_tokens 64 --repeats 3
    python eval/benchmarks/bench_serve.py --logprobs 5   # + the batched configuration with top-5 logprobs

An untrained model decodes as fast as a trained one of the same shape; it is used when no model directory exists
(said in the output), and greedy decoding with a fixed max_tokens keeps the work the same in every configuration.

Streamed against whole (`--stream_against [REF]`, instead of the runs above): one long chat reply from
scripts/serve.py, as server-sent events and as one response. Starts two servers on 127.0.0.1 with the same model:
this checkout's, and the tree of git revision REF (given alone: the last commit whose stream read the whole reply
again at every token) exported from git into a temp directory. Each answers the same request of `--tokens` tokens
(sampled with a fixed seed), streamed and not, one request at a time; the four (server, streamed or not) are
interleaved, their order reversed every other round, after one warm-up round. The reply is plain content of exactly
`--tokens` tokens: logit_bias bans every special token (<|im_end|> and the control tokens), and the streamed content
must equal the whole reply's. The model is an untrained cpu-default (fresh weights, seed 0, a context of `--tokens`
+ 512): an untrained model decodes as fast as a trained one of the same shape, and no trained cpu preset holds a
3,000-token reply (their context is 512). Each round also times each tree's stream alone (STREAM_WORK below): what
it costs the server's event loop, beside the engine's decoding.

    python eval/benchmarks/bench_serve.py --stream_against                   # 3,000 tokens, 5 rounds
    python eval/benchmarks/bench_serve.py --stream_against HEAD~1 --tokens 1000 --rounds 3
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script, from any directory
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.cli import quiet_ctrl_c_while_loading  # noqa: E402

quiet_ctrl_c_while_loading(__name__)  # a Ctrl-C while the imports below load: one line, exit 130

import argparse  # noqa: E402
import contextlib  # noqa: E402
import http.client  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tarfile  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

from trainer.cli import MAX_COUNT, RawDescriptionDefaultsHelpFormatter, ToolParser, int_within, run_main  # noqa: E402
from trainer.inference_flags import MAX_TOP_LOGPROBS  # noqa: E402
from trainer.distributed import free_port  # noqa: E402
from trainer.machine import machine_line  # noqa: E402
from trainer.run_dir import CONFIG_FILE, REPO_ROOT, ModelNotFound, locate_model, report_error  # noqa: E402

PROMPTS = ("Hi! How are you?", "What is the capital of France?", "Tell me about the moon.", "你好，你是谁？",
           "Write a short poem about rivers.", "Why is the sky blue?", "Give me three tips for learning Python.",
           "What is a transformer?")
CONFIGS = ((1, 8, None), (8, 1, None), (8, 8, None))  # (concurrent clients, server --max_batch, top_logprobs)

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


def untrained_default_model(root: Path, context: int | None = None) -> Path:
    """The default preset (cpu-default) with fresh weights (seed 0), saved like the trainer saves an SFT model;
    `context`: its context in tokens (None: the preset's)."""
    import torch
    import yaml

    from dataset.tokenization import load_tokenizer
    from model import MiniNormConfig, MiniNormForCausalLM
    from trainer.export import save_model_dir

    torch.manual_seed(0)
    tokenizer = load_tokenizer()
    longer = {} if context is None else {"max_position_embeddings": context}
    config = MiniNormConfig.from_preset("cpu-default", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                        eos_token_id=tokenizer.eos_token_id, **longer)
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
    """`python scripts/serve.py` on a free port, stopped on exit; `tree`: that of the tree at `tree` (see tree_at),
    run there (None: this checkout's, from the working directory)."""

    def __init__(self, model_path: Path, max_batch: int, tree: Path | None = None) -> None:
        self.port = free_port()
        self.process = subprocess.Popen(
            [sys.executable, str((tree or REPO_ROOT) / "scripts" / "serve.py"), "--model_path", str(model_path),
             "--port", str(self.port), "--max_batch", str(max_batch)],
            cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server{'' if tree is None else f' of {tree}'} exited: "
                                   f"{self.process.stderr.read()}")
            try:
                self.health()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)

    def health(self) -> dict:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            connection.request("GET", "/health")
            return json.loads(connection.getresponse().read())
        finally:
            connection.close()

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


@contextlib.contextmanager
def chat_completion(port: int, body: str) -> Iterator[http.client.HTTPResponse]:
    """The server's response to POST /v1/chat/completions with the JSON `body` (a status other than 200: a
    RuntimeError), its connection closed after."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
        yield response
    finally:
        connection.close()


def stream_chunks(response: http.client.HTTPResponse) -> Iterator[dict]:
    """The JSON chunks of a streamed response's server-sent events (the closing [DONE] aside)."""
    for line in response:
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
            yield json.loads(line[6:])


def streamed_request(port: int, prompt: str, max_tokens: int, top_logprobs: int | None = None
                     ) -> tuple[float, float, int]:
    """(latency s, time to the first content s, completion tokens) of one streamed chat request; `top_logprobs`:
    ask for log-probabilities with that many of the most likely tokens (None: none)."""
    request = {"messages": [{"role": "user", "content": prompt}], "stream": True, "temperature": 0,
               "frequency_penalty": 0, "max_tokens": max_tokens, "stream_options": {"include_usage": True}}
    if top_logprobs is not None:
        request.update(logprobs=True, top_logprobs=top_logprobs)
    body = json.dumps(request)
    started = time.perf_counter()
    first = None
    tokens = entries = 0
    with chat_completion(port, body) as response:
        for chunk in stream_chunks(response):
            if first is None and any(c["delta"].get("content") for c in chunk["choices"]):
                first = time.perf_counter() - started
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            entries += sum(len((c.get("logprobs") or {}).get("content", [])) for c in chunk["choices"])
    latency = time.perf_counter() - started
    if top_logprobs is not None and entries != tokens:  # the work measured must be the work asked for
        raise RuntimeError(f"{entries} logprobs entries for {tokens} completion tokens")
    return latency, first if first is not None else latency, tokens


def run_load(server: Server, clients: int, requests: int, max_tokens: int,
             top_logprobs: int | None = None) -> dict[str, float]:
    """`requests` streamed requests spread over `clients` threads, each sending its share one after another."""
    results: list[tuple[float, float, int]] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def client(index: int) -> None:
        try:
            for number in range(index, requests, clients):
                result = streamed_request(server.port, PROMPTS[number % len(PROMPTS)], max_tokens, top_logprobs)
                with lock:
                    results.append(result)
        except BaseException as error:  # reported after the run
            errors.append(error)

    before = server.health()
    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    if errors:
        raise errors[0]
    after = server.health()
    latencies = sorted(r[0] for r in results)
    steps = after["decode_steps"] - before["decode_steps"]
    return {
        "requests_per_s": len(results) / wall,
        "p50_latency": statistics.median(latencies),
        "p95_latency": latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))],
        "p50_first_token": statistics.median(r[1] for r in results),
        "tokens_per_s": sum(r[2] for r in results) / wall,
        "mean_batch": (after["batched_rows"] - before["batched_rows"]) / steps if steps else float("nan"),
    }


def sampled_request(port: int, tokens: int, banned: list[int], stream: bool) -> tuple[float, str, int]:
    """(seconds to the whole answer, its content, its completion tokens) of one chat request, sampled with a fixed
    seed: the same reply every time, and text of every kind (an untrained model's greedy reply repeats one token)."""
    body = json.dumps({"messages": [{"role": "user", "content": PROMPT}], "stream": stream, "temperature": 1,
                       "top_p": 1, "seed": 0, "frequency_penalty": 0, "max_tokens": tokens,
                       "logit_bias": {str(i): -100 for i in banned},
                       **({"stream_options": {"include_usage": True}} if stream else {})})
    started = time.perf_counter()
    with chat_completion(port, body) as response:
        if not stream:
            answer = json.loads(response.read())
            content, used = answer["choices"][0]["message"]["content"], answer["usage"]["completion_tokens"]
        else:
            pieces, used = [], 0
            for chunk in stream_chunks(response):
                pieces += [c["delta"].get("content") or "" for c in chunk["choices"]]
                used = chunk["usage"]["completion_tokens"] if chunk.get("usage") else used
            content = "".join(pieces)
    return time.perf_counter() - started, content, used


def stream_work(tree: Path, content: str) -> tuple[int, float]:
    """(ids, seconds) of the tree's DeltaStream reading the reply whose content is `content` (STREAM_WORK)."""
    out = subprocess.run([sys.executable, "-c", STREAM_WORK], cwd=tree, input=content, check=True,
                         capture_output=True, text=True).stdout.split()
    return int(out[0]), float(out[1])


def compare_streams(old_ref: str, tokens: int, rounds: int) -> None:
    """--stream_against: this checkout's server and the one at `old_ref`, streamed and whole (the docstring)."""
    from dataset.tokenization import load_tokenizer

    banned = sorted(load_tokenizer().added_tokens_decoder)  # <|endoftext|>, <|im_end|>, the control tokens, ...
    with tempfile.TemporaryDirectory() as temp:
        model = untrained_default_model(Path(temp), tokens + 512)
        trees = {"ours": REPO_ROOT, f"old ({old_ref[:7]})": tree_at(old_ref, Path(temp))}
        servers = {name: Server(model, 1, tree) for name, tree in trees.items()}
        print(f"machine: {machine_line()}; load average {os.getloadavg()[0]:.2f} at start")
        runs = [(name, stream) for name in servers for stream in (False, True)]
        seconds: dict[tuple[str, bool], list[float]] = {run: [] for run in runs}
        work: dict[str, list[float]] = {name: [] for name in trees}
        try:
            for index in range(rounds + 1):
                contents = set()
                for name, stream in runs if index % 2 else runs[::-1]:
                    took, content, used = sampled_request(servers[name].port, tokens, banned, stream)
                    if used != tokens:
                        raise RuntimeError(f"{name}: {used} tokens generated, not {tokens}")
                    contents.add(content)
                    if index:  # round 0 warms up
                        seconds[(name, stream)].append(took)
                if len(contents) != 1:
                    raise RuntimeError("the streamed and whole answers differ")
                for name in trees if index % 2 else list(trees)[::-1]:
                    ids, took = stream_work(trees[name], next(iter(contents)))
                    if index:
                        work[name].append(took)
                print(f"  round {index}/{rounds} done, load average {os.getloadavg()[0]:.2f}", file=sys.stderr)
        finally:
            for server in servers.values():
                server.close()
        print(f"load average (1, 5, 15 min) at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"\none sampled reply (seed 0) of {tokens} tokens (plain content), one request at a time, median of "
          f"{rounds} interleaved rounds (+1 warm-up): seconds to the whole answer, and the stream's own work "
          f"(its DeltaStream reading the reply's {ids} ids re-encoded from its content, in a process of its own)")
    print("\n| server | whole (s) | streamed (s) | streamed / whole | the stream's own work (s) |")
    print("|---|---|---|---|---|")
    for name in servers:
        whole, streamed = (statistics.median(seconds[(name, stream)]) for stream in (False, True))
        own = statistics.median(work[name])
        print(f"| {name} | {whole:.2f} | {streamed:.2f} | {streamed / whole:.2f} | {own:.3f} |")


def build_parser() -> ToolParser:
    parser = ToolParser(description=__doc__, formatter_class=RawDescriptionDefaultsHelpFormatter, allow_abbrev=False)
    parser.add_argument("--model_path", default=None, help="model directory; default: out/sft, else out/pretrain, "
                                                           "else an untrained cpu-default model")
    parser.add_argument("--requests", type=int_within(1, MAX_COUNT), default=32,
                        help="requests per configuration and repeat")
    parser.add_argument("--max_tokens", type=int_within(1), default=64, help="tokens each request asks for (greedy)")
    parser.add_argument("--repeats", type=int_within(1, MAX_COUNT), default=3,
                        help="interleaved repeats of every configuration")
    parser.add_argument("--logprobs", type=int_within(0, MAX_TOP_LOGPROBS), default=None,
                        help="also run 8 clients, --max_batch 8, asking for logprobs with this many top_logprobs")
    parser.add_argument("--stream_against", nargs="?", const=OLD_STREAM_REF, default=None, metavar="REF",
                        help="the git revision of the old server: streamed against whole, this checkout's server "
                             "against that one (see above), instead of the load runs; given alone: " + OLD_STREAM_REF)
    parser.add_argument("--tokens", type=int_within(1, 8192), default=None,
                        help="with --stream_against: the reply's length in tokens (unset: 3000)")
    parser.add_argument("--rounds", type=int_within(1, MAX_COUNT), default=None,
                        help="with --stream_against: measured rounds (after one warm-up) (unset: 5)")
    return parser


def refuse_mixed_flags(parser: ToolParser, args: argparse.Namespace, argv: list[str] | None) -> None:
    """A parser error where a flag of one mode is given with the other: --tokens and --rounds go only with
    --stream_against, the load runs' flags never with it."""
    given = {arg.split("=")[0] for arg in (sys.argv[1:] if argv is None else argv) if arg.startswith("--")}
    stream_flags = {"--tokens", "--rounds"}
    if args.stream_against is None and given & stream_flags:
        parser.error(f"argument {min(given & stream_flags)}: goes only with --stream_against")
    if args.stream_against is not None:
        other = given & {"--model_path", "--requests", "--max_tokens", "--repeats", "--logprobs"}
        if other:
            parser.error(f"argument {min(other)}: not with --stream_against (which takes --tokens and --rounds)")


def served_model(model_path: str | None, scratch: Path) -> tuple[Path, str | None]:
    """(the model directory, a note on how it was found): --model_path, else out/sft or out/pretrain, else an
    untrained cpu-default model saved in `scratch` (not when --model_path names one that is not there)."""
    try:
        return locate_model(model_path)
    except ModelNotFound:
        if model_path is not None:
            raise
        return untrained_default_model(scratch), "no trained model: an untrained cpu-default one"


def measure_configs(model_path: Path, configs: Sequence[tuple[int, int, int | None]], args: argparse.Namespace
                    ) -> dict[tuple[int, int, int | None], list[dict[str, float]]]:
    """Each configuration's run_load results, --repeats times, interleaved, after a warm-up of every server (one
    per --max_batch); the servers stopped after."""
    servers = {batch: Server(model_path, batch) for batch in sorted({b for _, b, _ in configs})}
    try:
        for server in servers.values():  # warm up: first requests pay for lazy initialisation
            run_load(server, 2, 4, args.max_tokens)
        runs: dict[tuple[int, int, int | None], list[dict[str, float]]] = {config: [] for config in configs}
        for repeat in range(args.repeats):
            for clients, batch, top in configs:
                runs[(clients, batch, top)].append(run_load(servers[batch], clients, args.requests,
                                                            args.max_tokens, top))
                asked = "" if top is None else f", top_logprobs {top}"
                print(f"  repeat {repeat + 1}: {clients} clients, --max_batch {batch}{asked} done",
                      file=sys.stderr)
    finally:
        for server in servers.values():
            server.close()
    return runs


def print_load_table(runs: dict[tuple[int, int, int | None], list[dict[str, float]]]) -> None:
    """One row per configuration: the medians over its repeats."""
    header = ("| clients | --max_batch | top_logprobs | requests/s | p50 latency (s) | p95 latency (s) "
              "| p50 first token (s) | generated tokens/s | mean batch |")
    print("\n" + header + "\n|" + "---|" * 9)
    for config in runs:
        clients, batch, top = config
        med = {key: statistics.median(run[key] for run in runs[config]) for key in runs[config][0]}
        print(f"| {clients} | {batch} | {'-' if top is None else top} | {med['requests_per_s']:.2f} | "
              f"{med['p50_latency']:.3f} | "
              f"{med['p95_latency']:.3f} | {med['p50_first_token']:.3f} | {med['tokens_per_s']:.0f} | "
              f"{med['mean_batch']:.2f} |")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    refuse_mixed_flags(parser, args, argv)
    if args.stream_against is not None:
        compare_streams(args.stream_against, args.tokens or 3000, args.rounds or 5)
        return 0
    configs = CONFIGS + (((8, 8, args.logprobs),) if args.logprobs is not None else ())
    with tempfile.TemporaryDirectory() as scratch:
        try:
            model_path, note = served_model(args.model_path, Path(scratch))
        except ModelNotFound as error:  # as eval/chat.py says it: one line, which command makes the model
            return report_error(error)
        print(f"model {model_path}" + (f" ({note})" if note else ""))
        print(f"machine: {machine_line()}; {args.requests} streamed requests "
              f"per run, greedy, max_tokens {args.max_tokens}; medians of {args.repeats} interleaved repeats")
        runs = measure_configs(model_path, configs, args)
    print_load_table(runs)
    return 0


if __name__ == "__main__":
    run_main(main)
