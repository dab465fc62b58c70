"""Chat with a trained model.

    python eval/chat.py                          # out/sft (falls back to out/pretrain and says so)
    python eval/chat.py --model_path out/pretrain --prompt "The history of"
    python eval/chat.py --lora out/lora                # out/sft with the LoRA adapter of out/lora
    printf 'Hi!\\nWhat is the capital of France?\\n' | python eval/chat.py --temperature 0

Interactive: streamed answers, `/reset` clears the history, `/exit` (or Ctrl-D) quits. `--prompt` answers once;
piped stdin answers each line until EOF. Answers go to stdout; the banner and tokens/s go to stderr.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script, from the repo root or from eval/
    # The repo root replaces eval/ on sys.path, where our module names could shadow installed packages.
    if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.threads import add_threads_flag, bound_openmp_waits, start_threads  # noqa: E402

bound_openmp_waits()  # before anything imports torch: OpenMP reads its wait policy when torch loads

import argparse  # noqa: E402

from trainer.cli import ToolParser  # noqa: E402
from trainer.inference_flags import add_rope_scaling_flag  # noqa: E402
from trainer.run_dir import ModelNotFound, add_model_source_flags, locate_model_and_adapter, model_task, report_error  # noqa: E402

RESET, EXIT = "/reset", "/exit"


def build_parser() -> argparse.ArgumentParser:
    parser = ToolParser(description="Chat with a MiniNorm model (or any causal-LM directory)",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_source_flags(parser)
    parser.add_argument("--prompt", help="answer this one message and exit")
    parser.add_argument("--system", default=None, help="system prompt (chat models)")
    parser.add_argument("--history", type=int, default=2, help="past exchanges kept in the prompt (0: none)")
    parser.add_argument("--temperature", type=float, default=0.7, help="0 means greedy decoding")
    parser.add_argument("--top_p", type=float, default=0.9)
    parser.add_argument("--top_k", type=int, default=0, help="0 means off")
    parser.add_argument("--repetition_penalty", type=float, default=1.0)
    parser.add_argument("--max_new_tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=None, help="fix the sampling for reproducible answers")
    parser.add_argument("--mode", choices=("auto", "chat", "plain"), default="auto",
                        help="chat template or plain continuation; auto: chat for SFT models, plain for "
                             "pretrained ones")
    parser.add_argument("--device", default="auto")
    add_threads_flag(parser)
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    parser.add_argument("--no_stream", action="store_true", help="print each answer when it is complete")
    add_rope_scaling_flag(parser)
    return parser


def _answer(session, text: str, stream: bool) -> None:
    def write(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    reply = session.reply(text, on_text=write if stream else None)
    if not stream:
        write(reply.text)
    write("\n")
    ending = "" if reply.stopped_at_eos else ", stopped at max_new_tokens"
    print(f"[{reply.new_tokens} tokens, {reply.tokens_per_s:.1f} tokens/s{ending}]", file=sys.stderr, flush=True)


def _lines(interactive: bool):
    """User messages: prompted input() on a terminal, else the lines of stdin until EOF."""
    if not interactive:
        yield from (line.rstrip("\n") for line in sys.stdin)
        return
    while True:
        try:
            yield input("\nyou> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        path, lora, note = locate_model_and_adapter(args.model_path, args.lora)
    except ModelNotFound as error:
        return report_error(error)
    if note:
        print(f"note: {note}", file=sys.stderr)

    from model.chat_session import ChatSession, uses_chat_template
    from model.generation import GenerationSettings
    from model.loading import load_model
    from model.rope import extend_context

    if args.seed is not None:
        from transformers import set_seed
        set_seed(args.seed)
    print(start_threads(args.threads), file=sys.stderr)
    model, tokenizer = load_model(path, device=args.device, dtype=args.dtype, lora=lora)
    try:
        extend_context(model, args.rope_scaling_factor)
    except ValueError as error:
        return report_error(error)
    use_template = uses_chat_template(args.mode, model_task(lora or path), tokenizer)
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  top_p=args.top_p, top_k=args.top_k, repetition_penalty=args.repetition_penalty)
    session = ChatSession(model, tokenizer, use_template, args.system, args.history, settings)
    params = sum(p.numel() for p in model.parameters())
    style = (f"chat template, {args.history} exchanges of history" if use_template
             else "pretrained model: plain continuation, no chat template, no history")
    adapter = f" + LoRA {lora}" if lora else ""
    print(f"model {path}{adapter} ({params / 1e6:.2f}M parameters, {model.device}); {style}", file=sys.stderr,
          flush=True)
    stream = not args.no_stream

    if args.prompt is not None:
        _answer(session, args.prompt, stream)
        return 0
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"type a message; {RESET} clears the history, {EXIT} quits", file=sys.stderr)
    for line in _lines(interactive):
        command = line.strip()
        if command == EXIT:
            break
        if command == RESET:
            session.reset()
            print("(history cleared)", file=sys.stderr, flush=True)
            continue
        if not command:
            continue
        if interactive:
            sys.stdout.write("bot> ")
        _answer(session, command, stream)  # stripped: stray spaces and a CR are not the user's words
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
