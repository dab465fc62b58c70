"""How well a chat model uses the built-in tools on questions it never trained on.

    python eval/tool_eval.py                                  # out/sft, the default held-out questions
    python eval/tool_eval.py --model_path out/sft --wiki 200 --arithmetic 200 --json out/sft/tools.json

The questions are the held-out side of dataset/tool_dialogues.py: "What is X?" about the default corpus's validation
articles (in no training file), arithmetic problems and unit conversions whose hash puts them outside training, and
small talk (the openings of held-out chit-chat conversations). Each is asked once, greedily (with eval/chat.py's
penalties on repeats if given), through the same tool loop as eval/chat.py (model/chat_session.py, every built-in tool
offered, no system prompt). The table gives, per tool, the fraction of questions where the model's first call is the
right tool with the right argument, and the fraction whose final answer contains the fact; for small talk, the fraction
answered without a call (dataset/tool_scoring.py says exactly what counts); and the fraction whose final answer never
ended (it ran into --max_new_tokens: a small model's repetition loop) and the mean share of its answers' word trigrams
that repeat an earlier one (the GRPO reward repetition_penalty, trainer/rewards.py). A second table counts the wrong
calls by where they go wrong: no call, another tool, the argument copied from the question wrong from its first token or
only later, or another argument. `--show N` prints N transcripts of each kind. `--after_other` asks each question
second, as a chat that goes on: one held-out exchange of the other kind is in the history (a small-talk opening and the
corpus's reply before a tool question; a lookup, calculation or conversion with its call, result and answer before small
talk); a question whose call would not see that exchange stops the run, one whose answer did not (a long tool result
pushed it out of the context) is named on stderr and counted.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script, from the repo root or from eval/
    if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.cli import begin_command  # noqa: E402

begin_command(__name__)  # a Ctrl-C while the imports below load: one line, exit 130; OpenMP's spin bounded first

from trainer.threads import add_threads_flag, start_threads  # noqa: E402

import argparse  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator, Sequence  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from functools import partial  # noqa: E402
from itertools import cycle  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

from dataset.atomic_io import atomic_write_text  # noqa: E402
from dataset.chat_format import normalize_messages  # noqa: E402
from dataset.corpus import SMALL_TALK_VAL, TOOL_DIALOGUES_SEED, TOOL_DIALOGUES_VAL  # noqa: E402
from dataset.json_text import strict_json  # noqa: E402
from dataset.tokenization import token_starts  # noqa: E402
from dataset.tool_dialogues import (TooFewProblems, first_exchange, small_talk_dialogues,  # noqa: E402
                                    tool_dialogues)
from dataset.tool_scoring import (SMALL_TALK, WRONG_CALLS, ToolQuestion, answer_has_fact,  # noqa: E402
                                  where_call_goes_wrong)

from trainer.cli import (DefaultsHelpFormatter, ToolParser, add_model_source_flags, int_within,  # noqa: E402
                         output_file, run_main, seed)
from trainer.inference_flags import add_penalty_flags, max_new_tokens, penalty_settings  # noqa: E402
from trainer.rewards import repetition_penalty  # noqa: E402
from trainer.run_dir import (ModelNotFound, check_report_file, locate_tool_model, report_error,  # noqa: E402
                             resolve_path)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from model.chat_session import ChatSession

TOOL_KINDS = ("wiki", "calculator", "convert_units")


@dataclass
class Outcome:
    kind: str
    question: str
    calls: list[str]  # every call the model made, as "name(arguments) -> result"
    right_call: bool  # small talk: no call
    answer: str
    has_fact: bool
    before: list[dict]  # the exchange in the history when the question was asked (--after_other), else []
    wrong_at: str | None  # where a wrong call goes wrong (dataset/tool_scoring.WRONG_CALLS); None if right
    ended: bool  # the last generation ended its turn, rather than running into --max_new_tokens
    unreadable_call: bool  # no call read, but the reply opened one (its <tool_call> token): left in the answer
    # --after_other: the answer, after a tool's result, was generated without `before` (the call saw it)
    history_left_out: bool = False


def build_parser() -> argparse.ArgumentParser:
    parser = ToolParser(description="Tool use on held-out questions: the right call, the fact in the answer",
                        formatter_class=DefaultsHelpFormatter)
    add_model_source_flags(parser)
    # The defaults are the questions of the embedded sft_tools_val file (dataset/corpus.py).
    wiki, arithmetic, conversions = TOOL_DIALOGUES_VAL
    parser.add_argument("--wiki", type=int_within(0), default=wiki, help="held-out 'What is X?' questions (wiki)")
    parser.add_argument("--arithmetic", type=int_within(0), default=arithmetic,
                        help="held-out arithmetic questions (calculator)")
    parser.add_argument("--conversions", type=int_within(0), default=conversions,
                        help="held-out unit questions (convert_units)")
    parser.add_argument("--small_talk", type=int_within(0), default=SMALL_TALK_VAL,
                        help="held-out chit-chat openings, right when answered without a call")
    parser.add_argument("--seed", type=seed, default=TOOL_DIALOGUES_SEED, help="which held-out questions are drawn")
    parser.add_argument("--max_new_tokens", type=max_new_tokens, default=160,
                        help="tokens per generation (call or answer)")
    add_penalty_flags(parser)  # greedy decoding, with these penalties if given (each call and each answer apart)
    parser.add_argument("--show", type=int_within(0), default=2, help="transcripts printed per tool")
    parser.add_argument("--after_other", action="store_true",
                        help="ask each question after one held-out exchange of the other kind (small talk before a "
                             "tool question, a tool exchange before small talk): the multi-turn case")
    parser.add_argument("--json", type=output_file, default=None,
                        help="also write every outcome and the table to this file")
    add_threads_flag(parser)
    return parser


class HistoryLeftOut(ValueError):
    """--after_other's exchange does not fit the context beside the question and --max_new_tokens: asked without
    it, the question would be scored as asked after it."""


def ask(session: ChatSession, question: ToolQuestion, history: list[dict],
        tokenize: Callable[[str], Sequence[tuple[int, int]]]) -> Outcome:
    """The question asked after `history`, scored; `tokenize` (the model's, as token_starts) places a wrong call.
    HistoryLeftOut when the context had no room for `history` in the first generation (the call, or the reply
    without one); when only a later one (the answer, after a long tool result) had none, the outcome says so."""
    session.reset()
    session.history += history  # history_turns=1 keeps exactly this exchange
    before = list(session.history)
    reply = session.reply(question.question)
    # Each round's prompt is fitted once, by reply, and records what it left out. The first must see the history,
    # or the question was not asked after it; a later one, after a long tool result, may lose it as the chat's
    # would: counted, not refused, since the call it follows was made with the history.
    left_out = [bool(history) and round_.fit is not None and round_.fit.dropped_exchanges > 0
                for round_ in reply.rounds]
    if left_out[:1] == [True]:
        raise HistoryLeftOut(f"would leave its --after_other exchange out of the prompt: with it, the prompt and "
                             f"--max_new_tokens {session.settings.max_new_tokens} do not fit the model's context of "
                             f"{session.max_context}; lower --max_new_tokens or evaluate a model with more positions "
                             f"(max_position_embeddings)")
    results = [result for round_ in reply.rounds for result in round_.results]
    calls = [(result.name, result.arguments) for result in results]
    unreadable = not calls and any(round_.unread_calls for round_ in reply.rounds)
    wrong_at = where_call_goes_wrong(question, calls, tokenize, unreadable)
    return Outcome(question.kind, question.question, [r.describe() for r in results], wrong_at is None, reply.text,
                   answer_has_fact(question, reply.text), before, wrong_at, reply.stopped_at_eos, unreadable,
                   any(left_out))


def histories(dialogues: list[dict], questions: list[ToolQuestion]) -> list[list[dict]]:
    """For each question, the first exchange of a question of the other kind, in turn, as chat history (tool calls
    parsed): small talk before a tool question, a tool exchange before small talk. Both kinds must be asked."""
    def exchanges_of(small_talk: bool) -> Iterator[list[dict]]:
        return cycle([normalize_messages(first_exchange(d)) for d, q in zip(dialogues, questions)
                      if (q.kind == SMALL_TALK) == small_talk])

    others = {True: exchanges_of(False), False: exchanges_of(True)}  # keyed by: the question is small talk
    return [next(others[q.kind == SMALL_TALK]) for q in questions]


def shown_message(message: dict) -> str:
    """A history message as --show prints it: its text, or where it has none its tool calls as JSON (as the report
    and the calls' lines write them), not as Python's repr."""
    if message["content"] or not message.get("tool_calls"):
        return message["content"]
    return strict_json(message["tool_calls"], ensure_ascii=False)


def table(outcomes: list[Outcome]) -> list[dict]:
    """One row per tool, "all" over the tool questions, and small talk (its right call is no call; no fact)."""
    groups = {kind: [o for o in outcomes if o.kind == kind] for kind in TOOL_KINDS}
    groups["all"] = [o for o in outcomes if o.kind in TOOL_KINDS]
    groups[SMALL_TALK] = [o for o in outcomes if o.kind == SMALL_TALK]
    rows = []
    for kind, mine in groups.items():
        if not mine:
            continue
        n = len(mine)
        rows.append({"tool": kind, "questions": n,
                     "called_a_tool": sum(bool(o.calls) for o in mine) / n,
                     "unreadable_call": sum(o.unreadable_call for o in mine) / n,
                     "right_call": sum(o.right_call for o in mine) / n,
                     "fact_in_answer": None if kind == SMALL_TALK else sum(o.has_fact for o in mine) / n,
                     "never_ended": sum(not o.ended for o in mine) / n,
                     "repeated_trigrams": 0.0 - sum(repetition_penalty([], [o.answer for o in mine])) / n})  # not -0.0
    return rows


def wrong_calls(outcomes: list[Outcome]) -> dict[str, dict[str, int]]:
    """Per tool, how many wrong calls go wrong where (every WRONG_CALLS entry, zeros included)."""
    return {kind: {where: sum(o.kind == kind and o.wrong_at == where for o in outcomes) for where in WRONG_CALLS}
            for kind in TOOL_KINDS if any(o.kind == kind for o in outcomes)}


def print_table(rows: list[dict]) -> None:
    print(f"{'tool':<14} {'questions':>9} {'called a tool':>14} {'unreadable call':>16} {'right call':>11} "
          f"{'fact in answer':>15} {'never ended':>12} {'repeated trigrams':>18}")
    for row in rows:
        fact = "-" if row["fact_in_answer"] is None else f"{row['fact_in_answer']:.1%}"
        right = f"{row['right_call']:.1%}" + (" (none)" if row["tool"] == SMALL_TALK else "")
        print(f"{row['tool']:<14} {row['questions']:>9} {row['called_a_tool']:>14.1%} {row['unreadable_call']:>16.1%} "
              f"{right:>11} {fact:>15} {row['never_ended']:>12.1%} {row['repeated_trigrams']:>18.1%}")


COUNT_FLAGS = {"wiki": "--wiki", "calculator": "--arithmetic", "convert_units": "--conversions",
               SMALL_TALK: "--small_talk"}  # each kind's count flag


def held_out_questions(args: argparse.Namespace) -> tuple[list[dict], list[ToolQuestion]]:
    """The held-out dialogues the count flags ask for, and their questions; a ValueError names the flag whose count
    is above what the held-out split holds, and that maximum (the draws would give fewer, or none)."""
    try:
        dialogues = tool_dialogues("held_out", args.seed, args.wiki, args.arithmetic, args.conversions)
    except TooFewProblems as error:
        flag = COUNT_FLAGS[error.tool]
        raise ValueError(f"{flag} {getattr(args, flag[2:])}: the held-out questions hold at most {error.available} "
                         f"(--seed {args.seed})") from None
    dialogues += small_talk_dialogues("held_out", args.seed, args.small_talk)
    questions = [ToolQuestion.from_dialogue(d) for d in dialogues]
    for kind, flag in COUNT_FLAGS.items():  # wiki and small talk: fewer than asked when the split has fewer
        found, asked = sum(q.kind == kind for q in questions), getattr(args, flag[2:])
        if found < asked:
            raise ValueError(f"{flag} {asked}: the held-out questions hold at most {found}")
    return dialogues, questions


def chat_session(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, args: argparse.Namespace
                 ) -> ChatSession:
    """The session every question is asked through: greedy (with the penalties asked for), every built-in tool
    offered, the chat template, one exchange of history kept (--after_other's)."""
    from dataset.tools import tool_schemas
    from model.chat_session import ChatSession
    from model.generation import GenerationSettings

    settings = GenerationSettings(max_new_tokens=args.max_new_tokens, temperature=0.0, **penalty_settings(args))
    return ChatSession(model, tokenizer, use_template=True, history_turns=1, settings=settings, tools=tool_schemas())


class ModelTooShort(ValueError):
    """A question that, with every tool's schema (and its --after_other exchange), does not fit the model's context:
    the run stops there (scored as unanswered, or as asked without its history, it would only measure the
    context)."""


def _which(number: int, questions: list[ToolQuestion]) -> str:
    """``question 3 of 300 (wiki: 'What is X?')``"""
    question = questions[number - 1]
    return f"question {number} of {len(questions)} ({question.kind}: {question.question!r})"


def ask_all(session: ChatSession, questions: list[ToolQuestion], before: list[list[dict]],
            tokenize: Callable[[str], Sequence[tuple[int, int]]]) -> list[Outcome]:
    """Each question asked after its history (ask), the progress every 25 questions on stderr, and there a note
    naming each question whose answer was generated without its history; ModelTooShort names the first question
    that does not fit the context (or its history does not, beside --max_new_tokens)."""
    from model.chat_session import MessageTooLong

    started = time.perf_counter()
    outcomes = []
    for number, (question, history) in enumerate(zip(questions, before), 1):
        try:
            outcomes.append(ask(session, question, history, tokenize))
        except MessageTooLong as error:
            raise ModelTooShort(f"{_which(number, questions)} {error}; every question is asked with every tool's "
                                f"schema: evaluate a model with more positions (max_position_embeddings)") from None
        except HistoryLeftOut as error:
            raise ModelTooShort(f"{_which(number, questions)} {error}") from None
        if outcomes[-1].history_left_out:
            print(f"note: {_which(number, questions)} was answered without its --after_other exchange: after the "
                  f"tool's result, the prompt and --max_new_tokens {session.settings.max_new_tokens} did not fit "
                  f"the model's context of {session.max_context} beside it (the call saw it); scored as asked after "
                  "it, counted as history left out", file=sys.stderr, flush=True)
        if number % 25 == 0:
            print(f"{number}/{len(questions)} questions, {time.perf_counter() - started:.0f} s", file=sys.stderr,
                  flush=True)
    return outcomes


def run_line(args: argparse.Namespace, parser: argparse.ArgumentParser, path: Path, lora: Path | None,
             questions: int) -> str:
    """The report's first line: the model (and its adapter), the questions, and the decoding, with each penalty
    set away from its default."""
    after = ", each after an exchange of the other kind" if args.after_other else ""
    penalties = "".join(f", {name} {value:g}" for name, value in penalty_settings(args).items()
                        if value != parser.get_default(name))
    return f"model {path}{' + ' + str(lora) if lora else ''}: {questions} held-out questions{after}, greedy{penalties}"


def print_history_left_out(outcomes: list[Outcome]) -> None:
    """--after_other: how many answers were generated without their exchange (each named on stderr as it came)."""
    left_out = sum(o.history_left_out for o in outcomes)
    if left_out:
        print(f"history left out: {left_out} of {len(outcomes)} answers were generated without their --after_other "
              "exchange (after a long tool result; the call saw it), scored as asked after it")


def print_wrong_calls(wrong: dict[str, dict[str, int]]) -> None:
    print("\nwrong calls, by where they go wrong (the copied argument: the title, the expression, the value)")
    print(f"{'tool':<14}" + "".join(f" {where:>16}" for where in WRONG_CALLS))
    for kind, counts in wrong.items():
        print(f"{kind:<14}" + "".join(f" {counts[where]:>16}" for where in WRONG_CALLS))


def print_transcripts(outcomes: list[Outcome], show: int) -> None:
    """The first `show` transcripts of each kind (--show): history, question, calls, answer and how it scored."""
    for kind in (*TOOL_KINDS, SMALL_TALK):
        for outcome in [o for o in outcomes if o.kind == kind][:show]:
            print(f"\n[{kind}]" + "".join(f"\n  before, {m['role']}: {shown_message(m)}" for m in outcome.before))
            print(f"  user: {outcome.question}")
            for call in outcome.calls:
                print(f"  call: {call}")
            print(f"  answer: {outcome.answer}")
            wrong_at = f" (wrong at: {outcome.wrong_at})" if outcome.wrong_at else ""
            unended = "" if outcome.ended else " (never ended: it ran into --max_new_tokens)"
            print(f"  right call: {outcome.right_call}{wrong_at}, fact in answer: {outcome.has_fact}{unended}")


def write_report(json_path: str, args: argparse.Namespace, path: Path, rows: list[dict],
                 wrong: dict[str, dict[str, int]], outcomes: list[Outcome]) -> None:
    """--json: the model, the decoding, both tables and every outcome, written atomically."""
    target = resolve_path(json_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    report = {"model": str(path), "decoding": penalty_settings(args), "table": rows, "wrong_calls": wrong,
              "outcomes": [asdict(o) for o in outcomes]}
    atomic_write_text(target, strict_json(report, indent=1, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.after_other and (args.small_talk == 0 or args.wiki + args.arithmetic + args.conversions == 0):
        return report_error(ValueError("--after_other needs small talk and tool questions: --small_talk and one of "
                                       "--wiki, --arithmetic, --conversions above 0"))
    try:
        path, lora = locate_tool_model(args)
        if args.json:  # before the work: a report written over the model would destroy it
            check_report_file(Path(args.json), "--json", path, lora)
    except (ModelNotFound, ValueError) as error:
        return report_error(error)

    from dataset.chat_format import check_chatml_tokenizer
    from model.loading import load_model

    try:  # before the model loads: a count above what the held-out split holds is refused first
        dialogues, questions = held_out_questions(args)
    except ValueError as error:
        return report_error(error)
    print(start_threads(args.threads), file=sys.stderr)
    try:
        model, tokenizer = load_model(path, lora=lora)
    except ValueError as error:  # a damaged model directory
        return report_error(error)
    try:  # every question is asked through the chat template: a damaged one was a traceback at the first question
        check_chatml_tokenizer(tokenizer)
    except ValueError as error:
        return report_error(f"{lora or path}: {error}")
    before = histories(dialogues, questions) if args.after_other else [[] for _ in questions]
    try:
        outcomes = ask_all(chat_session(model, tokenizer, args), questions, before, partial(token_starts, tokenizer))
    except ModelTooShort as error:
        return report_error(error)
    rows, wrong = table(outcomes), wrong_calls(outcomes)
    print(run_line(args, parser, path, lora, len(questions)))
    print_table(rows)
    print_history_left_out(outcomes)
    print_wrong_calls(wrong)
    print_transcripts(outcomes, args.show)
    if args.json:
        write_report(args.json, args, path, rows, wrong, outcomes)
    return 0


if __name__ == "__main__":
    run_main(main)
