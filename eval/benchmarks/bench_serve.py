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
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script, from any directory
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.cli import quiet_ctrl_c_while_loading  # noqa: E402

quiet_ctrl_c_while_loading(__name__)  # a Ctrl-C while the imports below load: one line, exit 130

import http.client  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

from trainer.cli import DefaultsHelpFormatter, ToolParser, int_within, run_main  # noqa: E402
from trainer.inference_flags import MAX_TOP_LOGPROBS  # noqa: E402
from trainer.distributed import free_port  # noqa: E402
from trainer.machine import machine_line  # noqa: E402
from trainer.run_dir import CONFIG_FILE, REPO_ROOT, ModelNotFound, locate_model  # noqa: E402

PROMPTS = ("Hi! How are you?", "What is the capital of France?", "Tell me about the moon.", "你好，你是谁？",
           "Write a short poem about rivers.", "Why is the sky blue?", "Give me three tips for learning Python.",
           "What is a transformer?")
CONFIGS = ((1, 8, None), (8, 1, None), (8, 8, None))  # (concurrent clients, server --max_batch, top_logprobs)


def untrained_default_model(root: Path) -> Path:
    """The default preset (cpu-default) with fresh weights, saved like the trainer saves an SFT model."""
    import yaml

    from dataset.tokenization import load_tokenizer
    from model import MiniNormConfig, MiniNormForCausalLM
    from trainer.export import save_model_dir

    tokenizer = load_tokenizer()
    config = MiniNormConfig.from_preset("cpu-default", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                        eos_token_id=tokenizer.eos_token_id)
    path = root / "cpu-default-untrained"
    save_model_dir(MiniNormForCausalLM(config).eval(), tokenizer, path)
    (path / CONFIG_FILE).write_text(yaml.safe_dump({"task": "sft"}))
    return path


class Server:
    """`python scripts/serve.py` on a free port, stopped on exit."""

    def __init__(self, model_path: Path, max_batch: int) -> None:
        self.port = free_port()
        self.process = subprocess.Popen(
            [sys.executable, str(REPO_ROOT / "scripts" / "serve.py"), "--model_path", str(model_path),
             "--port", str(self.port), "--max_batch", str(max_batch)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited: {self.process.stderr.read()}")
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
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
        for line in response:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c["delta"].get("content") for c in chunk["choices"]):
                first = time.perf_counter() - started
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            entries += sum(len((c.get("logprobs") or {}).get("content", [])) for c in chunk["choices"])
    finally:
        connection.close()
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


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(description=__doc__.split("\n")[0],
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--model_path", default=None, help="model directory; default: out/sft, else out/pretrain, "
                                                           "else an untrained cpu-default model")
    parser.add_argument("--requests", type=int, default=32, help="requests per configuration and repeat")
    parser.add_argument("--max_tokens", type=int, default=64, help="tokens each request asks for (greedy)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every configuration")
    parser.add_argument("--logprobs", type=int_within(0, MAX_TOP_LOGPROBS), default=None,
                        help="also run 8 clients, --max_batch 8, asking for logprobs with this many top_logprobs")
    args = parser.parse_args(argv)
    configs = CONFIGS + (((8, 8, args.logprobs),) if args.logprobs is not None else ())

    with tempfile.TemporaryDirectory() as scratch:
        try:
            model_path, note = locate_model(args.model_path)
        except ModelNotFound:
            if args.model_path is not None:
                raise
            model_path, note = untrained_default_model(Path(scratch)), "no trained model: an untrained cpu-default one"
        print(f"model {model_path}" + (f" ({note})" if note else ""))
        print(f"machine: {machine_line()}; {args.requests} streamed requests "
              f"per run, greedy, max_tokens {args.max_tokens}; medians of {args.repeats} interleaved repeats")
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

    header = ("| clients | --max_batch | top_logprobs | requests/s | p50 latency (s) | p95 latency (s) "
              "| p50 first token (s) | generated tokens/s | mean batch |")
    print("\n" + header + "\n|" + "---|" * 9)
    for config in configs:
        clients, batch, top = config
        med = {key: statistics.median(run[key] for run in runs[config]) for key in runs[config][0]}
        print(f"| {clients} | {batch} | {'-' if top is None else top} | {med['requests_per_s']:.2f} | "
              f"{med['p50_latency']:.3f} | "
              f"{med['p95_latency']:.3f} | {med['p50_first_token']:.3f} | {med['tokens_per_s']:.0f} | "
              f"{med['mean_batch']:.2f} |")
    return 0


if __name__ == "__main__":
    run_main(main)
