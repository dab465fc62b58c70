"""Chat with a trained model.

    python eval/chat.py                          # out/sft (falls back to out/pretrain and says so)
    python eval/chat.py --model_path out/pretrain --prompt "The history of"
    python eval/chat.py --lora out/lora                # out/sft with the LoRA adapter of out/lora
    printf 'Hi!\\nWhat is the capital of France?\\n' | python eval/chat.py --temperature 0
    python eval/chat.py --prompt "What is 17 * 23?" --no_tools    # no tools in the prompt, no calls run

Interactive: streamed answers, `/reset` clears the history, `/exit` (or Ctrl-D) quits; a line that starts with `//`
is sent with one `/`, and any other `/word` is an unknown command (not sent). Ctrl-C stops an answer: on a terminal
the session goes on without that message; at the prompt, on piped input, with `--prompt` or while the model loads it
ends the run as it ends every tool (trainer/cli.py's run_main: `interrupted` on stderr, exit code 130). `--prompt`
answers once; piped stdin answers each line until EOF (a line that is not UTF-8 is refused and skipped). What is
cut to fit the model's context (the oldest exchanges; for a plain model, the start of a text too long for it) is said
on stderr; a chat message too long for the context even alone is refused, not sent. Answers go to stdout; the
banner, those notes and tokens/s go to stderr. Decoding takes chat's frequency penalty
(trainer/inference_flags.py's CHAT_FREQUENCY_PENALTY), which ends the small models' loops; `--frequency_penalty 0`
turns it off.

Chat models get the built-in tools (dataset/tools.py) unless `--no_tools`: a reply the model writes as a tool call
is run, its result fed back and the model asked again (model/chat_session.py, at most MAX_TOOL_ROUNDS rounds). Each
call shows on stdout before the answer as `[tool] calculator({"expression": "2+3"}) -> 5`, and with `--think` the
model's thinking as `[think] ...`. With tools or thinking on, each generation is printed when it is complete (a
call's JSON is not streamed as if it were the answer). A call's JSON is decoded greedily whatever `--temperature`
(`--sampled_tool_calls` draws it too).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script, from the repo root or from eval/
    # The repo root replaces eval/ on sys.path, where our module names could shadow installed packages.
    if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.cli import begin_command  # noqa: E402

begin_command(__name__)  # a Ctrl-C while the imports below load: one line, exit 130; OpenMP's spin bounded first

from trainer.threads import add_threads_flag, start_threads  # noqa: E402

import argparse  # noqa: E402
import re  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

from dataset.atomic_io import not_utf8_at  # noqa: E402
from dataset.json_text import surrogate_at  # noqa: E402
from dataset.shown_value import shown_text  # noqa: E402
from trainer.cli import (DefaultsHelpFormatter, ToolParser, add_model_source_flags, int_within, run_main,  # noqa: E402
                         seed, utf8_text)
from trainer.inference_flags import (  # noqa: E402
    CHAT_FREQUENCY_PENALTY,
    TEMPERATURE_HELP,
    add_penalty_flags,
    add_rope_scaling_flag,
    apply_rope_scaling_flag,
    device_type,
    max_new_tokens,
    penalty_settings,
    temperature,
    top_k,
    top_p,
)
from trainer.run_dir import ModelNotFound, locate_tool_model, model_task, report_error  # noqa: E402

if TYPE_CHECKING:
    from model.chat_session import MessageTooLong

RESET, EXIT = "/reset", "/exit"
COMMAND = re.compile(r"/([A-Za-z][\w-]*)(?:\s+(.*))?", re.DOTALL)  # "/usr/bin is ..." is no command: a message
MAX_ROUNDS_NOTE = "the tool-round limit was reached"
INTERRUPTED = "(interrupted: that message and its partial answer are not kept in the history)"


def _tool_names(text: str) -> list[str]:
    from dataset.tools import TOOLS

    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in TOOLS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown tool {shown_text(', '.join(unknown) or '(none given)')}; "
                                         f"allowed: {', '.join(TOOLS)}")
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:  # the prompt would list its schema twice
        raise argparse.ArgumentTypeError(f"tool {shown_text(', '.join(twice))} named more than once")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = ToolParser(description="Chat with a MiniNorm model (or any causal-LM directory)",
                                     formatter_class=DefaultsHelpFormatter)
    add_model_source_flags(parser)
    parser.add_argument("--prompt", type=utf8_text, help="answer this one message and exit")
    parser.add_argument("--system", type=utf8_text, default=None, help="system prompt (chat models)")
    parser.add_argument("--history", type=int_within(0, note="0: none"), default=2,
                        help="past exchanges kept in the prompt (0: none)")
    parser.add_argument("--temperature", type=temperature, default=0.7, help=TEMPERATURE_HELP)
    parser.add_argument("--top_p", type=top_p, default=0.9,
                        help="nucleus sampling: sample among the most likely tokens whose probabilities add up to "
                             "top_p (1: all)")
    parser.add_argument("--top_k", type=top_k, default=0, help="0 means off")
    add_penalty_flags(parser, frequency_penalty=CHAT_FREQUENCY_PENALTY)
    parser.add_argument("--max_new_tokens", type=max_new_tokens, default=256,
                        help="the most tokens the model writes in one turn (each tool call's turn its own)")
    parser.add_argument("--seed", type=seed, default=None, help="fix the sampling for reproducible answers")
    parser.add_argument("--mode", choices=("auto", "chat", "plain"), default="auto",
                        help="chat template or plain continuation; auto: chat for SFT models, plain for "
                             "pretrained ones")
    parser.add_argument("--device", type=device_type(), default="auto",
                        help="cpu, cuda or cuda:N; auto: a GPU if there is one")
    add_threads_flag(parser)
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                        help="the weights' precision; auto: bfloat16 on a GPU, float32 on a CPU")
    parser.add_argument("--no_stream", action="store_true", help="print each answer when it is complete")
    offered = parser.add_mutually_exclusive_group()  # --tools with --no_tools was taken, and --tools ignored
    offered.add_argument("--no_tools", action="store_true",
                         help="offer no tools: the prompt lists none and a call the model writes stays text "
                              "(without it, chat models are offered the built-in tools of --tools)")
    offered.add_argument("--tools", type=_tool_names, default=None, metavar="NAMES",
                        help="the built-in tools to offer, comma-separated (default: all of them; "
                             "`python dataset/tools.py --schemas` lists them)")
    parser.add_argument("--sampled_tool_calls", action="store_true",
                        help="draw a tool call's tokens like the answer's; without it a call's JSON is decoded "
                             "greedily whatever --temperature (its one right spelling)")
    parser.add_argument("--think", action="store_true",
                        help="open_thinking: the model may think before answering, shown as [think] lines; "
                             "without it an empty think block is injected and the model answers directly")
    add_rope_scaling_flag(parser)
    return parser


THINK_PREFIX, TOOL_PREFIX = "[think] ", "[tool] "


def _write(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


def _show_round(round_) -> None:
    """Before the answer: the thinking, the text beside a call, each call with its result, calls not run."""
    if round_.reasoning:
        _write("".join(f"{THINK_PREFIX}{line}\n" for line in round_.reasoning.splitlines()))
    if round_.results and round_.content:
        _write(round_.content + "\n")
    for result in round_.results:
        _write(f"{TOOL_PREFIX}{result.describe()}\n")
    for call in round_.unrun:
        _write(f"{TOOL_PREFIX}{call['name']}: not run, {MAX_ROUNDS_NOTE}\n")


def _fit_notes(fit, max_context: int, max_new_tokens: int) -> list[str]:
    """What was cut from the prompt to fit the context, in words (nothing when nothing was cut)."""
    notes = []
    if fit is not None and fit.dropped_exchanges:
        count = fit.dropped_exchanges
        notes.append(f"(the oldest {count} exchange{'s' if count > 1 else ''} of the history "
                     f"{'were' if count > 1 else 'was'} left out of the prompt: the model's context is {max_context} "
                     f"tokens, with room for --max_new_tokens {max_new_tokens})")
    if fit is not None and fit.uncut_tokens:
        notes.append(f"(the prompt is {fit.uncut_tokens} tokens, over the model's context of {max_context}: only its "
                     f"last {len(fit.ids)} tokens were kept)")
    return notes


def _answer(session, text: str, stream: bool) -> None:
    # With tools or thinking, a generation is shown once it is read back: its call or thought is not the answer.
    stream = stream and not session.tools and not session.open_thinking
    try:
        reply = session.reply(text, on_text=_write if stream else None, on_round=_show_round)
    except KeyboardInterrupt:
        _write("\n")  # ends a partly streamed answer's line, whether the session goes on or the run ends
        raise
    if not stream:
        _write(reply.text)
    _write("\n")
    for note in _fit_notes(reply.fit, session.max_context, session.settings.max_new_tokens):
        print(note, file=sys.stderr)
    ending = "" if reply.stopped_at_eos else ", stopped at max_new_tokens"
    # One write with its newline: print's separate write of the end left a Ctrl-C between the two (the user's next
    # key) to put "interrupted" on this line.
    sys.stderr.write(f"[{reply.new_tokens} tokens, {reply.tokens_per_s:.1f} tokens/s{ending}]\n")
    sys.stderr.flush()


def _lines(interactive: bool):
    """User messages: prompted input() on a terminal, else the lines of stdin until EOF."""
    # Bytes that are not UTF-8 come through as lone surrogates, for _read to refuse that line alone (a strict
    # decoder would end the whole run at the first bad byte).
    if callable(getattr(sys.stdin, "reconfigure", None)):
        sys.stdin.reconfigure(errors="surrogateescape")
    if not interactive:
        yield from (line.rstrip("\n") for line in sys.stdin)
        return
    while True:
        try:
            yield input("\nyou> ")
        except EOFError:  # Ctrl-D: the session is over, as with /exit
            print(file=sys.stderr)
            return
        except KeyboardInterrupt:  # Ctrl-C: run_main ends the run; the newline moves its line off the prompt's
            print(file=sys.stderr)
            raise


def _read(line: str, where: str) -> tuple[str, str]:
    """What a line of input is: ("command", /reset or /exit), ("message", its text), ("error", why it is not sent)
    or ("nothing", "") for a blank line."""
    text = line.strip()  # stray spaces and a CR are not the user's words
    index = surrogate_at(text)
    if index is not None:
        return "error", f"{where} is {not_utf8_at(text, index)}; not sent"
    if text.startswith("//"):  # the way to send a line that starts with "/"
        return "message", text[1:]
    command = COMMAND.fullmatch(text)
    if command is None:
        return ("message", text) if text else ("nothing", "")
    name = "/" + command[1]
    if name not in (RESET, EXIT):
        return "error", (f"unknown command {name} (commands: {RESET}, {EXIT}; start a message with // to send a line "
                         f"that begins with /); not sent")
    if command[2]:
        return "error", f"{name} takes no words after it; not sent"
    return "command", name


def _ways_out(error: MessageTooLong, what: str) -> str:
    """What to shorten or leave out when `what` (the message, --system) does not fit the context."""
    system = " or --system" if error.with_system and what != "--system" else ""
    tools = ", or leave the tools out with --no_tools" if error.with_tools else ""
    return f"shorten {'it' if what != '--system' else what}{system}{tools}"


def not_sent(error: MessageTooLong) -> str:
    """A message too long for the context: what does not fit (the library's words), then what to do here."""
    return f"{error}; not sent ({_ways_out(error, 'message')})"


def _converse(session, stream: bool, interactive: bool) -> int:
    """Answer each line of input until /exit or its end. Ctrl-C during an answer on a terminal drops that answer
    and the session goes on; elsewhere (piped input, the prompt) it ends the run through run_main. The session's
    history never keeps the interrupted exchange."""
    from model.chat_session import MessageTooLong

    for number, line in enumerate(_lines(interactive), start=1):
        where = "that message" if interactive else f"line {number}"
        kind, value = _read(line, where)
        if kind == "error":
            print(f"error: {value}", file=sys.stderr, flush=True)
        elif kind == "command" and value == EXIT:
            break
        elif kind == "command" and value == RESET:
            session.reset()
            print("(history cleared)", file=sys.stderr, flush=True)
        elif kind == "message":
            if interactive:
                sys.stdout.write("bot> ")
            try:
                _answer(session, value, stream)
            except MessageTooLong as error:
                print(f"error: {where} {not_sent(error)}", file=sys.stderr, flush=True)
            except KeyboardInterrupt:
                if not interactive:  # no one to go on with: the run ends as any tool's Ctrl-C does
                    raise
                print(INTERRUPTED, file=sys.stderr, flush=True)
    return 0


# The flags that shape a chat prompt: a plain continuation has no turns for them, and would drop them silently.
CHAT_ONLY_FLAGS = {"--system": "system", "--think": "think", "--tools": "tools"}


def _check_plain_flags(args: argparse.Namespace, path: Path) -> None:
    given = [flag for flag, name in CHAT_ONLY_FLAGS.items() if getattr(args, name) not in (None, False)]
    if given:
        one = len(given) == 1
        why, use = (("--mode plain writes none", "--mode chat") if args.mode == "plain" else
                    (f"{path} is a pretrained model, which continues plain text", "an SFT model or --mode chat"))
        raise ValueError(f"{', '.join(given)} shape{'s' if one else ''} a chat prompt, and {why}; use {use}, or "
                         f"leave {'it' if one else 'them'} out")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        path, lora = locate_tool_model(args)
    except ModelNotFound as error:
        return report_error(error)

    from dataset.chat_format import check_chatml_tokenizer
    from dataset.tools import tool_schemas
    from model.chat_session import ChatSession, MessageTooLong, uses_chat_template
    from model.generation import GenerationSettings
    from model.loading import load_model

    if args.seed is not None:
        from transformers import set_seed
        set_seed(args.seed)
    print(start_threads(args.threads), file=sys.stderr)
    try:
        model, tokenizer = load_model(path, device=args.device, dtype=args.dtype, lora=lora)
        extended = apply_rope_scaling_flag(model, path, lora, args.rope_scaling_factor)
        use_template = uses_chat_template(args.mode, model_task(lora or path), tokenizer)
        if use_template:
            check_chatml_tokenizer(tokenizer)  # its control tokens and template, before the first message
        else:
            _check_plain_flags(args, path)
        settings = GenerationSettings(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                      top_p=args.top_p, top_k=args.top_k, **penalty_settings(args))
        session = ChatSession(model, tokenizer, use_template, args.system, args.history, settings,
                              tools=None if args.no_tools else tool_schemas(args.tools), open_thinking=args.think,
                              greedy_tool_calls=not args.sampled_tool_calls)
        if session.system_prompt is not None:  # alone too long for the context: no message could be sent
            session.fit_prompt("")
    except MessageTooLong as error:  # each message was refused as if it were the long one
        holds = "--system and the tools' schemas" if error.with_tools else "--system"
        return report_error(f"the system turn ({holds}) takes {error.tokens} tokens in the chat format, over the "
                            f"model's context of {error.context}, with no message yet: no message fits; "
                            f"{_ways_out(error, '--system')}")
    except ValueError as error:  # a damaged model directory, a scaling the model cannot take, a context too short
        return report_error(error)
    params = sum(p.numel() for p in model.parameters())
    tools = f"tools: {', '.join(t['function']['name'] for t in session.tools)}" if session.tools else "no tools"
    thinking = ", thinking on" if session.open_thinking else ""
    style = (f"chat template, {args.history} exchanges of history, {tools}{thinking}" if use_template
             else "pretrained model: plain continuation, no chat template, no history, no tools")
    adapter = f" + LoRA {lora}" if lora else ""
    extended = f"; {extended}" if extended else ""
    print(f"model {path}{adapter} ({params / 1e6:.2f}M parameters, {model.device}); {style}{extended}",
          file=sys.stderr, flush=True)
    stream = not args.no_stream

    if args.prompt is not None:
        try:
            _answer(session, args.prompt, stream)
        except MessageTooLong as error:
            return report_error(f"--prompt {not_sent(error)}")
        return 0
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"type a message; {RESET} clears the history, {EXIT} quits", file=sys.stderr)
    return _converse(session, stream, interactive)


if __name__ == "__main__":
    run_main(main)
