"""Serve a trained model: OpenAI's chat-completions API and a web chat page.

    python scripts/serve.py                                   # out/sft (else out/pretrain), http://127.0.0.1:8000
    python scripts/serve.py --model_path out/sft --port 8001 --api_key secret
    python scripts/serve.py --lora out/lora                   # out/sft with the LoRA adapter, merged at load

Endpoints: POST /v1/chat/completions (streamed as server-sent events when "stream": true), GET /v1/models,
GET /v1/models/{id}, GET /tools and POST /tools/run (the built-in tools, for clients' tool loops), GET /health,
GET /openapi.json (the request schema), and the chat page at /. Requests run through the library's
GenerationEngine (model/generation.py): concurrent requests are decoded together in one batch (--max_batch), and a
client that disconnects gives its slot back at the next step. Bad requests get OpenAI-style
JSON errors, each request's alone; messages are encoded as text, so a control-token string inside one never
becomes a control token. OpenAI's `tools` and `tool_choice` and `chat_template_kwargs: {"open_thinking": true}` are
taken; replies carry `tool_calls` and `reasoning_content` (docs/serving.md, "Tools and thinking").

This file is the command (its flags); the server itself is the package scripts/server/.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script, from the repo root or from scripts/
    if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.cli import begin_command  # noqa: E402

begin_command(__name__)  # a Ctrl-C while the imports below load: one line, exit 130; OpenMP's spin bounded first

from trainer.threads import add_threads_flag, start_threads  # noqa: E402

import argparse  # noqa: E402
import socket  # noqa: E402

from trainer.cli import DefaultsHelpFormatter, ToolParser, add_model_source_flags, int_within, run_main  # noqa: E402
from trainer.inference_flags import add_rope_scaling_flag, device_type  # noqa: E402
from trainer.run_dir import ModelNotFound, locate_tool_model, report_error  # noqa: E402


def api_key(text: str) -> str:
    """--api_key's type: a key a client can send. An empty one was matched by a bare 'Bearer' header (no key at all,
    and no warning on 0.0.0.0); one outside printable ASCII no client sends as it is (HTTP headers are latin-1, the
    openai client refuses it)."""
    if not text or not all("!" <= character <= "~" for character in text):
        from dataset.shown_value import shown_value  # here: the model package loads torch, which --help never needs

        raise argparse.ArgumentTypeError(f"{shown_value(text)} is not a key a client can send; use printable ASCII "
                                         f"characters, no spaces")
    return text


def _host(text: str) -> str:
    """--host's type: an empty value (an unset shell variable) bound every interface, as 0.0.0.0 does."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a host name or address (0.0.0.0: every interface), got an empty "
                                         "value")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = ToolParser(description="Serve a MiniNorm model: OpenAI's chat API and a chat page",
                                     formatter_class=DefaultsHelpFormatter)
    add_model_source_flags(parser)
    parser.add_argument("--host", type=_host, default="127.0.0.1", help="0.0.0.0 listens on every interface")
    parser.add_argument("--port", type=int_within(0, 65535, "0: a free port, printed at start"), default=8000,
                        help="the port to listen on")
    parser.add_argument("--api_key", type=api_key, default=None,
                        help="require 'Authorization: Bearer KEY' on /v1/ and /tools requests (printable ASCII, no "
                             "spaces)")
    parser.add_argument("--model_name", default=None, help="the model id clients see; default: the directory name")
    parser.add_argument("--mode", choices=("auto", "chat", "plain"), default="auto",
                        help="chat template or plain continuation of the last message; auto: chat for SFT models")
    parser.add_argument("--max_batch", type=int_within(1), default=8, help="requests decoded together")
    parser.add_argument("--max_waiting", type=int_within(1), default=64,
                        help="queued requests beyond which 503 is returned")
    parser.add_argument("--device", type=device_type(), default="auto",
                        help="cpu, cuda, cuda:1, ...; auto: cuda when there is one")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                        help="the weights' dtype; auto: bfloat16 on CUDA, float32 elsewhere")
    parser.add_argument("--no_tools", action="store_true", help="offer clients no built-in tools (GET /tools)")
    add_threads_flag(parser)
    add_rope_scaling_flag(parser)
    return parser


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (port 0: a free one), as uvicorn binds its own (IPv6 for a host with a colon).
    Bound before the model loads, so that a port in use or a host that is not this machine's is a one-line error
    at once, not a log line from uvicorn after the load."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # listening now: a second server bound but not yet listening could share the port
    except OSError as error:  # address in use, not this machine's, a name that does not resolve
        sock.close()
        raise ValueError(f"cannot listen on --host {host} --port {port}: {error.strerror or error}") from None
    return sock


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        path, lora = locate_tool_model(args)
        sock = listening_socket(args.host, args.port)
    except (ModelNotFound, ValueError) as error:
        return report_error(error)
    # The server (FastAPI, torch) is imported only now: --help and a wrong flag stay fast.
    from scripts.server.app import create_app
    from scripts.server.served_model import load_served_model

    print(start_threads(args.threads), file=sys.stderr)  # the engine's thread takes this count too
    try:
        served = load_served_model(path, args.mode, args.max_batch, args.model_name, args.device, args.dtype, lora,
                                   args.rope_scaling_factor)
    except ValueError as error:
        sock.close()
        return report_error(error)
    import uvicorn

    style = "chat template" if served.use_template else "plain continuation of the last message (pretrained model)"
    adapter = f" + LoRA {lora}" if lora else ""
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"model {path}{adapter} as {served.name!r} ({style}, context {served.max_context}, up to {args.max_batch} "
          f"requests per batch); chat page and API at http://{host}:{sock.getsockname()[1]}/", file=sys.stderr,
          flush=True)
    if args.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: listening on {args.host} without --api_key: anyone who can reach it can use it",
              file=sys.stderr)
    app = create_app(served, args.api_key, args.max_waiting, tools=not args.no_tools)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    run_main(main)
