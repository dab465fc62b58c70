"""eval/chat.py and model/chat_session.py on tiny model directories written like the trainer's."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.chat_session import ChatSession, uses_chat_template
from model.generation import GenerationSettings
from trainer.inference_flags import CHAT_FREQUENCY_PENALTY
from trainer.run_dir import (EXIT_INTERRUPTED, REPO_ROOT, ModelNotFound, locate_model, model_task, resolve_input_path,
                              resolve_path)
from tests.paths import REPO

CHAT = REPO / "eval" / "chat.py"
# The generic tiny models were not trained with tools: these tests run without them (test_chat_tools.py has the loop).
GREEDY = ["--temperature", "0", "--max_new_tokens", "40", "--no_tools"]


def greedy_session(loaded, use_template: bool = True, **kwargs) -> ChatSession:
    model, tokenizer = loaded
    return ChatSession(model, tokenizer, use_template,
                       settings=GenerationSettings(max_new_tokens=40, temperature=0.0,
                                                   frequency_penalty=CHAT_FREQUENCY_PENALTY), **kwargs)


def start_chat(*args: str, cwd: Path = REPO) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONIOENCODING": "utf-8"}
    return subprocess.Popen([sys.executable, str(CHAT), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, encoding="utf-8", cwd=cwd, env=env)


def finish(process: subprocess.Popen, stdin: str = "") -> subprocess.CompletedProcess:
    out, err = process.communicate(stdin, timeout=300)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


PIPED = "Who are you?\n/reset\n\n你好\n/exit\nnever answered\n"


@pytest.fixture(scope="module")
def cli_runs(tiny_models) -> dict[str, subprocess.CompletedProcess]:
    """The two subprocess runs, started together: interpreter start-up dominates them."""
    # The piped run starts in eval/ with a relative model path, to check the script's own path handling.
    relative = os.path.relpath(tiny_models.sft, REPO / "eval")
    processes = {
        "prompt": start_chat("--model_path", str(tiny_models.sft), "--prompt", "What is the capital of France?",
                             *GREEDY),
        "piped": start_chat("--model_path", relative, "--history", "2", *GREEDY, cwd=REPO / "eval"),
    }
    return {"prompt": finish(processes["prompt"]), "piped": finish(processes["piped"], PIPED)}


def test_greedy_answer_stops_at_im_end(sft, tiny_models) -> None:
    model, tokenizer = sft
    reply = greedy_session(sft).reply("Who are you?")
    assert reply.text == tiny_models.reply
    assert reply.stopped_at_eos and reply.token_ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    assert reply.new_tokens < 40
    assert reply.tokens_per_s > 0


def test_prompt_answers_once_and_exits(sft, cli_runs) -> None:
    expected = greedy_session(sft).reply("What is the capital of France?").text
    result = cli_runs["prompt"]
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected + "\n"
    assert "tokens/s" in result.stderr and "max_new_tokens" not in result.stderr  # it stopped at <|im_end|>


def test_piped_stdin_answers_each_line_with_reset_and_exit(sft, cli_runs) -> None:
    session = greedy_session(sft, history_turns=2)
    first = session.reply("Who are you?").text
    session.reset()
    second = session.reply("你好").text
    result = cli_runs["piped"]
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [first, second]
    assert "(history cleared)" in result.stderr
    assert result.stderr.count("tokens/s") == 2


def chat_in_process(monkeypatch, capsys, *args: str, stdin: str = "") -> tuple[int, str, str]:
    """eval/chat.py's main() in this process (no interpreter start-up): exit code, stdout, stderr."""
    from eval import chat

    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))  # not a terminal: the piped-input path
    code = chat.main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def sent(monkeypatch) -> list[str]:
    """The user messages chat hands to ChatSession.reply, in order (the real reply still runs)."""
    messages: list[str] = []
    original = ChatSession.reply

    def recording_reply(self, user_text, **kwargs):
        messages.append(user_text)
        return original(self, user_text, **kwargs)

    monkeypatch.setattr(ChatSession, "reply", recording_reply)
    return messages


def test_stdin_eof_ends_the_session(monkeypatch, capsys, tiny_models) -> None:
    code, out, err = chat_in_process(monkeypatch, capsys, "--model_path", str(tiny_models.sft), *GREEDY,
                                     "--history", "0", "--no_stream", stdin="Hello\nBye")
    assert code == 0, err
    assert out == f"{tiny_models.reply}\n{tiny_models.reply}\n"


def test_piped_lines_are_sent_stripped(monkeypatch, capsys, tiny_models, sent) -> None:
    code, _, err = chat_in_process(monkeypatch, capsys, "--model_path", str(tiny_models.sft), *GREEDY,
                                   "--no_stream", stdin="  Who are you?  \r\n\t/reset \n")
    assert code == 0, err
    assert sent == ["Who are you?"] and "(history cleared)" in err


@pytest.mark.parametrize("which", ["sft", "pretrained"])
def test_streaming_equals_non_streaming(which: str, request) -> None:
    loaded = request.getfixturevalue(which)
    for prompt in ("Tell me a joke.", "中国的首都是", "The history of"):
        pieces: list[str] = []
        streamed = greedy_session(loaded, use_template=which == "sft").reply(prompt, on_text=pieces.append)
        plain = greedy_session(loaded, use_template=which == "sft").reply(prompt)
        assert streamed.token_ids == plain.token_ids
        assert "".join(pieces) == plain.text


def test_history_is_rendered_with_the_chat_template(sft) -> None:
    session = greedy_session(sft, system_prompt="Be brief.", history_turns=2)
    first = session.reply("Who are you?").text.strip()
    second = session.reply("Hello").text.strip()
    think = "<think>\n\n</think>\n\n"  # the empty think block before every answer without reasoning
    assert session.render("Third?") == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWho are you?<|im_end|>\n"
        f"<|im_start|>assistant\n{think}{first}<|im_end|>\n"
        "<|im_start|>user\nHello<|im_end|>\n"
        f"<|im_start|>assistant\n{think}{second}<|im_end|>\n"
        "<|im_start|>user\nThird?<|im_end|>\n"
        f"<|im_start|>assistant\n{think}")
    session.history_turns = 1
    assert session.render("Third?") == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHello<|im_end|>\n"
        f"<|im_start|>assistant\n{think}{second}<|im_end|>\n"
        "<|im_start|>user\nThird?<|im_end|>\n"
        f"<|im_start|>assistant\n{think}")
    session.reset()
    assert session.render("Hi") == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                                    f"<|im_start|>assistant\n{think}")


@pytest.mark.parametrize("system_prompt", [None, "Be brief."])
def test_history_is_dropped_oldest_first_to_fit_the_context(sft, system_prompt) -> None:
    session = greedy_session(sft, history_turns=10, system_prompt=system_prompt)
    for index in range(6):
        session.history += [{"role": "user", "content": f"question {index} " * 5},
                            {"role": "assistant", "content": f"answer {index} " * 5}]
    session.max_context = 120
    ids, budget = session.fit_prompt("last")[:2]
    text = session.tokenizer.decode(ids)
    assert len(ids) + session.settings.max_new_tokens <= 120 and budget == 40
    assert "question 5" in text and "question 0" not in text
    assert text.endswith("last<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert ("Be brief." in text) == bool(system_prompt)  # the system prompt is kept, only exchanges go
    # Whole exchanges go: every kept question still has its answer (the last "assistant" opens the reply).
    assert text.count("<|im_start|>user") == text.count("<|im_start|>assistant") and "answer 5" in text


def test_pretrained_model_continues_plain_text(pretrained, tiny_models) -> None:
    model, tokenizer = pretrained
    assert model_task(tiny_models.pretrain) == "pretrain" and model_task(tiny_models.sft) == "sft"
    assert not uses_chat_template("auto", "pretrain", tokenizer) and uses_chat_template("auto", "sft", tokenizer)
    session = greedy_session(pretrained, use_template=False)
    # A document starts after an eos in packed pretraining (the tokenizer has no bos); no template, no history.
    assert session.render("The history of") == "<|im_end|>The history of"
    session.reply("The history of")
    assert session.history == []

def test_cli_uses_plain_continuation_for_a_pretrained_model(monkeypatch, capsys, pretrained, tiny_models) -> None:
    code, out, err = chat_in_process(monkeypatch, capsys, "--model_path", str(tiny_models.pretrain),
                                     "--prompt", "The history of", *GREEDY)
    assert code == 0, err
    assert "plain continuation" in err
    # Independently: the argmax token, one full forward pass per step, after the eos that starts a document, less
    # chat's default frequency penalty (OpenAI's formula: the penalty times the answer's own uses of the token).
    model, tokenizer = pretrained
    ids = tokenizer("<|im_end|>The history of", add_special_tokens=False, return_tensors="pt")["input_ids"]
    prompt_length = ids.shape[1]
    uses = torch.zeros(model.config.vocab_size, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(40):
            next_id = (model(ids).logits[0, -1].double() - CHAT_FREQUENCY_PENALTY * uses).argmax()
            uses[next_id] += 1
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
            if next_id == tokenizer.eos_token_id:
                break
    assert out == tokenizer.decode(ids[0, prompt_length:], skip_special_tokens=True) + "\n"


@pytest.mark.parametrize("flags, message", [
    (["--mode", "plain", "--think", "--system", "Be brief."],
     "error: --system, --think shape a chat prompt, and --mode plain writes none; use --mode chat, or leave them "
     "out"),
    (["--tools", "wiki"], "error: --tools shapes a chat prompt, and {pretrain} is a pretrained model, which continues "
                          "plain text; use an SFT model or --mode chat, or leave it out"),
])
def test_chat_flags_a_plain_continuation_would_drop_are_refused(flags, message, monkeypatch, capsys,
                                                                tiny_models) -> None:
    """A plain continuation has no system turn, no thinking and no tools: they were taken and dropped silently."""
    model = tiny_models.sft if "plain" in flags else tiny_models.pretrain
    code, out, err = chat_in_process(monkeypatch, capsys, "--model_path", str(model), "--prompt", "Hi", *flags)
    assert code == 2 and out == ""
    assert err.splitlines()[-1] == message.format(pretrain=tiny_models.pretrain), err


def test_missing_model_is_one_line_naming_the_command(tmp_path) -> None:
    result = finish(start_chat("--model_path", str(tmp_path / "nothing_here"), "--prompt", "hi"))
    assert result.returncode != 0
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "python trainer/train_full_sft.py" in lines[0] and "nothing_here" in lines[0]


def test_default_model_falls_back_to_pretrain(tmp_path, monkeypatch, tiny_models) -> None:
    from trainer import run_dir

    monkeypatch.setitem(run_dir.DEFAULT_OUT_DIRS, "sft", str(tmp_path / "sft"))
    monkeypatch.setitem(run_dir.DEFAULT_OUT_DIRS, "pretrain", str(tmp_path / "pretrain"))
    with pytest.raises(ModelNotFound, match="python trainer/train_pretrain.py"):
        locate_model()
    (tmp_path / "pretrain").symlink_to(tiny_models.pretrain)
    path, note = locate_model()
    assert path == tmp_path / "pretrain" and "no SFT model" in note and "train_full_sft.py" in note
    (tmp_path / "sft").symlink_to(tiny_models.sft)
    assert locate_model() == (tmp_path / "sft", None)


def test_a_path_that_holds_no_model_says_what_it_holds(tmp_path) -> None:
    from trainer.run_dir import CHECKPOINT_DIR, CONFIG_FILE, STATE_FILE, checkpoint_name

    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a model")
    with pytest.raises(ModelNotFound, match=f"^{a_file} is a file, not a model folder"):
        locate_model(a_file)
    stopped = tmp_path / "stopped"
    for step in (10, 20):
        (stopped / CHECKPOINT_DIR / checkpoint_name(step)).mkdir(parents=True)
        (stopped / CHECKPOINT_DIR / checkpoint_name(step) / STATE_FILE).write_text("{}")
    (stopped / CHECKPOINT_DIR / checkpoint_name(30)).mkdir()  # incomplete: no trainer state
    with pytest.raises(ModelNotFound) as refused:
        locate_model(stopped)
    assert str(refused.value) == (f"no model at {stopped} yet: its run has not finished (newest checkpoint "
                                  f"{checkpoint_name(20)}); if it is no longer training, finish it by running its "
                                  f"command again with --resume auto")
    (stopped / CONFIG_FILE).write_text("task: sft\nrun_id: abc\n")  # the run's own flags: the command to finish it
    with pytest.raises(ModelNotFound) as refused:
        locate_model(stopped)
    assert str(refused.value).endswith(f"finish it with `python trainer/train_full_sft.py --config "
                                       f"{stopped / CONFIG_FILE} --out_dir {stopped} --resume auto` (its own "
                                       f"flags)"), refused.value
    with pytest.raises(ModelNotFound, match=f"^no model at {tmp_path}; create it with"):
        locate_model(tmp_path)


def test_paths_resolve_from_the_repo_root(tmp_path, monkeypatch) -> None:
    assert resolve_path("out/sft") == REPO_ROOT / "out" / "sft" and resolve_path("/tmp/x") == Path("/tmp/x")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_path("~/runs") == tmp_path / "runs"
    # Inputs: as typed from the current directory when that exists, else from the repo root.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.jsonl").write_text("")
    assert resolve_input_path("mine.jsonl") == tmp_path / "mine.jsonl"
    assert resolve_input_path("out/sft") == REPO_ROOT / "out" / "sft"
    # Made absolute, not resolved: a link stays the link (a run records and a resume compares the path it read),
    # and from the repo root an input is the very path resolve_path gives (it used to be the link's target).
    (tmp_path / "linked.jsonl").symlink_to(tmp_path / "mine.jsonl")
    assert resolve_input_path("linked.jsonl") == tmp_path / "linked.jsonl"
    monkeypatch.chdir(REPO_ROOT)
    assert resolve_input_path("README.md") == resolve_path("README.md")


def test_seed_makes_sampling_reproducible(monkeypatch, capsys, tiny_models) -> None:
    args = ("--model_path", str(tiny_models.pretrain), "--prompt", "The history of", "--temperature", "1.0",
            "--top_k", "0", "--top_p", "1.0", "--max_new_tokens", "20", "--seed", "7")
    first = chat_in_process(monkeypatch, capsys, *args)
    second = chat_in_process(monkeypatch, capsys, *args)
    assert first[0] == second[0] == 0
    assert first[1] == second[1] and first[1].strip()


def test_penalty_flags_reach_the_session(monkeypatch, capsys, tiny_models, chat_sessions) -> None:
    code, _, err = chat_in_process(monkeypatch, capsys, "--model_path", str(tiny_models.pretrain), "--prompt", "The",
                                   "--temperature", "0", "--max_new_tokens", "4", "--repetition_penalty", "1.3",
                                   "--presence_penalty", "0.5", "--frequency_penalty", "-1")
    assert code == 0, err
    (settings,) = [session.settings for session in chat_sessions]
    assert (settings.repetition_penalty, settings.presence_penalty, settings.frequency_penalty) == (1.3, 0.5, -1.0)
    chat_sessions.clear()  # without the flags: chat's own frequency penalty, which 0 turns off
    for flags, expected in (((), CHAT_FREQUENCY_PENALTY), (("--frequency_penalty", "0"), 0.0)):
        code, _, err = chat_in_process(monkeypatch, capsys, "--model_path", str(tiny_models.pretrain), "--prompt",
                                       "The", "--temperature", "0", "--max_new_tokens", "4", *flags)
        assert code == 0, err
        settings = chat_sessions.pop().settings
        assert (settings.repetition_penalty, settings.presence_penalty, settings.frequency_penalty) == (1.0, 0.0,
                                                                                                        expected)
    assert CHAT_FREQUENCY_PENALTY > 0


NOT_UTF8 = "a\udcffb"  # how Python's argv holds the byte 0xff, which no UTF-8 text has
TEMPERATURE_RANGE = "is not 0 (greedy) or a number in 1e-05 .. 2 (OpenAI's range)"  # the server's request range too


@pytest.mark.parametrize("flags, message", [
    (["--seed", "-1"], "argument --seed: -1 is not an integer in 0 .. 4294967295"),
    (["--prompt", NOT_UTF8], "argument --prompt: not valid UTF-8 (byte 0xff at character 1)"),
    (["--system", NOT_UTF8], "argument --system: not valid UTF-8 (byte 0xff at character 1)"),
    (["--device", "bogus"], "argument --device: expected auto, cpu, cuda or cuda:N, got 'bogus'"),
    (["--temperature", "nan"], f"argument --temperature: nan {TEMPERATURE_RANGE}"),
    (["--temperature", "-1"], f"argument --temperature: -1 {TEMPERATURE_RANGE}"),
    (["--temperature", "1e-9"], f"argument --temperature: 1e-9 {TEMPERATURE_RANGE}"),
    (["--temperature", "1e308"], f"argument --temperature: 1e308 {TEMPERATURE_RANGE}"),
    (["--top_p", "2"], "argument --top_p: 2 is outside (0, 1]"),
    (["--top_p", "nan"], "argument --top_p: nan is outside (0, 1]"),
    (["--top_p", "0"], "argument --top_p: 0 is outside (0, 1]"),
    (["--top_k", "-1"], "argument --top_k: -1 is not an integer >= 0 (0: off)"),
    (["--history", "-1"], "argument --history: -1 is not an integer >= 0 (0: none)"),
    (["--max_new_tokens", "0"], "argument --max_new_tokens: 0 is not an integer >= 1"),
    # each was taken and the second flag ignored (the tools offered, or offered twice)
    (["--no_tools", "--tools", "wiki"], "argument --tools: not allowed with argument --no_tools"),
    (["--tools", "wiki,calculator,wiki"], "argument --tools: tool wiki named more than once"),
])
def test_bad_flags_are_one_line_naming_the_flag(flags, message, capsys) -> None:
    from eval.chat import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(flags)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[0] == f"error: {message}"


def test_a_cuda_device_must_exist(monkeypatch, capsys) -> None:
    from eval.chat import build_parser

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert build_parser().parse_args(["--device", "cuda:1"]).device == "cuda:1"
    for device in ("cuda:2", "cuda:-1", "cuda:x"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--device", device])
        assert capsys.readouterr().err.splitlines()[0] == (
            f"error: argument --device: {device} is not a device of this machine: auto, cpu, cuda or cuda:0 .. cuda:1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--device", "cuda"])
    assert capsys.readouterr().err.splitlines()[0] == (
        "error: argument --device: cuda is not a device of this machine: auto or cpu (no CUDA device)")


# ------------------------------------------------------------------------ hostile stdin, commands, Ctrl-C, context
class TerminalInput(io.StringIO):
    """A terminal's input for eval/chat.py: input() reads it line by line (it has no file descriptor of its own)."""

    def isatty(self) -> bool:
        return True


def chat_with_stdin(monkeypatch, capsys, stdin, *args: str) -> tuple[int, str, str]:
    """main() with `stdin` as sys.stdin, whatever kind of stream it is."""
    from eval import chat

    monkeypatch.setattr(sys, "stdin", stdin)
    code = chat.main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("errors", ["strict", "surrogateescape"])  # a UTF-8 locale's stdin, and the C locale's
def test_a_line_that_is_not_utf8_is_refused_and_the_session_goes_on(monkeypatch, capsys, tiny_models,
                                                                  errors) -> None:
    stdin = io.TextIOWrapper(io.BytesIO(b"\xff\xfe bad\nWho are you?\n"), encoding="utf-8", errors=errors)
    code, out, err = chat_with_stdin(monkeypatch, capsys, stdin, "--model_path", str(tiny_models.sft), *GREEDY,
                                     "--no_stream")
    assert code == 0, err
    assert out == f"{tiny_models.reply}\n"
    assert "error: line 1 is not valid UTF-8 (byte 0xff at character 0); not sent" in err.splitlines()
    assert "Traceback" not in err


def test_commands_take_no_words_and_unknown_ones_are_not_sent(monkeypatch, capsys, tiny_models, sent) -> None:
    stdin = "/reset extra\n/help\n//etc is a folder\n/exit now\n/usr/bin is a path\nHi\n/exit\nnever sent\n"
    code, _, err = chat_in_process(monkeypatch, capsys, "--model_path", str(tiny_models.sft), *GREEDY,
                                   "--no_stream", stdin=stdin)
    assert code == 0, err
    assert sent == ["/etc is a folder", "/usr/bin is a path", "Hi"]  # "//" sends a line that starts with "/"
    lines = err.splitlines()
    assert "error: /reset takes no words after it; not sent" in lines
    assert "error: /exit takes no words after it; not sent" in lines
    assert "error: unknown command /help (commands: /reset, /exit; start a message with // to send a line that " \
           "begins with /); not sent" in lines
    assert "(history cleared)" not in err


def interrupt_generation(monkeypatch, times: int = 1) -> None:
    """Ctrl-C in the middle of the next `times` generations: the third decode step of each raises it."""
    from model.generation import GenerationEngine

    original, steps = GenerationEngine.step, {"count": 0}

    def step(self) -> None:
        steps["count"] += 1
        if steps["count"] % 3 == 0 and steps["count"] <= 3 * times:
            raise KeyboardInterrupt
        original(self)

    monkeypatch.setattr(GenerationEngine, "step", step)


def test_ctrl_c_on_a_terminal_drops_that_answer_and_says_so(monkeypatch, capsys, tiny_models, chat_sessions) -> None:
    interrupt_generation(monkeypatch)
    code, out, err = chat_with_stdin(monkeypatch, capsys, TerminalInput("Tell me a story\nWho are you?\n"),
                                     "--model_path", str(tiny_models.sft), *GREEDY)
    assert code == 0, err
    assert "Traceback" not in err and out.endswith(f"bot> {tiny_models.reply}\n\nyou> ")
    assert "(interrupted: that message and its partial answer are not kept in the history)" in err.splitlines()
    (session,) = chat_sessions
    assert [m["content"] for m in session.history if m["role"] == "user"] == ["Who are you?"]
    assert session.engine.load == (0, 0)  # the interrupted request left the engine


def chat_as_a_script(monkeypatch, capsys, stdin, *args: str) -> tuple[int, str, str]:
    """main() as the script runs it, through trainer/cli.py's run_main (which owns the Ctrl-C exit): exit code,
    stdout, stderr."""
    from eval import chat
    from trainer.cli import run_main

    monkeypatch.setattr(sys, "stdin", stdin)
    with pytest.raises(SystemExit) as exit_info:
        try:
            run_main(lambda: chat.main(list(args)))
        except KeyboardInterrupt:  # left to escape, it would stop the whole test session
            pytest.fail("KeyboardInterrupt went through run_main")
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def test_ctrl_c_on_piped_input_ends_the_run_in_one_line(monkeypatch, capsys, tiny_models) -> None:
    """No one is there for the session to go on with: the run ends with every tool's Ctrl-C line and code."""
    interrupt_generation(monkeypatch)
    code, out, err = chat_as_a_script(monkeypatch, capsys, io.StringIO("Tell me a story\nnever answered\n"),
                                      "--model_path", str(tiny_models.sft), *GREEDY)
    assert code == EXIT_INTERRUPTED
    assert "Traceback" not in err and tiny_models.reply not in out
    assert out.endswith("\n")  # the partly streamed answer's line is ended
    assert err.splitlines()[-1] == "interrupted" and "not kept in the history" not in err


class _CtrlCAfterTheCount:
    """stderr whose user presses Ctrl-C the moment the answer's token count is written (as the signal may arrive
    between any two writes)."""

    def __init__(self, stream) -> None:
        self.stream, self.pressed = stream, False

    def write(self, text: str) -> int:
        written = self.stream.write(text)
        if text.startswith("[") and "tokens/s" in text and not self.pressed:
            self.pressed = True
            raise KeyboardInterrupt
        return written

    def flush(self) -> None:
        self.stream.flush()


def test_ctrl_c_right_after_an_answer_is_a_line_of_its_own(monkeypatch, capsys, tiny_models) -> None:
    """The count's line was two writes (print's text, then its end): a Ctrl-C between them put "interrupted" at its
    end (seen once in the full suite, in test_ctrl_c.py's piped chat)."""
    monkeypatch.setattr(sys, "stderr", _CtrlCAfterTheCount(sys.stderr))
    code, out, err = chat_as_a_script(monkeypatch, capsys, io.StringIO("Who are you?\nnever answered\n"),
                                      "--model_path", str(tiny_models.sft), *GREEDY)
    assert code == EXIT_INTERRUPTED and out == f"{tiny_models.reply}\n"
    *_, count, last = err.splitlines()
    assert count.startswith("[7 tokens, ") and count.endswith(" tokens/s]") and last == "interrupted", err


def test_ctrl_c_during_a_prompts_answer_ends_the_run_in_one_line(monkeypatch, capsys, tiny_models) -> None:
    interrupt_generation(monkeypatch)
    code, out, err = chat_as_a_script(monkeypatch, capsys, io.StringIO(""), "--model_path", str(tiny_models.sft),
                                      *GREEDY, "--prompt", "Tell me a story")
    assert code == EXIT_INTERRUPTED and "Traceback" not in err
    assert out.endswith("\n") and tiny_models.reply not in out
    assert err.splitlines()[-1] == "interrupted"


class CtrlCAfterInput(TerminalInput):
    """A terminal where the user presses Ctrl-C at the prompt once the given lines are read."""

    def readline(self, *args) -> str:
        line = super().readline(*args)
        if not line:
            raise KeyboardInterrupt
        return line


def test_ctrl_c_at_the_prompt_ends_the_session_in_one_line(monkeypatch, capsys, tiny_models) -> None:
    """Ctrl-C at `you>` (not during an answer) ends the run as every tool's Ctrl-C does; Ctrl-D stays a plain end
    (test_ctrl_c_on_a_terminal_drops_that_answer_and_says_so ends on it with 0)."""
    code, out, err = chat_as_a_script(monkeypatch, capsys, CtrlCAfterInput("Who are you?\n"),
                                      "--model_path", str(tiny_models.sft), *GREEDY)
    assert code == EXIT_INTERRUPTED and "Traceback" not in err
    assert out.endswith(f"bot> {tiny_models.reply}\n\nyou> ")
    assert err.splitlines()[-2:] == ["", "interrupted"]  # the line after the prompt's, as Ctrl-D's blank line


def test_what_is_cut_to_fit_the_context_is_said(monkeypatch, capsys, tiny_models) -> None:
    # The tiny model's context is 128 tokens: 100 new tokens leave no room for the first exchange beside the second
    # message, and a message of 300 words does not fit at all.
    code, out, err = chat_in_process(monkeypatch, capsys, "--model_path", str(tiny_models.sft), "--temperature",
                                     "0", "--max_new_tokens", "100", "--no_tools", "--no_stream",
                                     stdin="Who are you?\nAnd you?\n" + "word " * 300 + "\n")
    assert code == 0, err
    notes = [line for line in err.splitlines() if line.startswith("(") and "context" in line]
    # The first message fitted: nothing said. The second left out the first exchange; the third is refused: cut to
    # its end it would lose the system turn and its own header (the server answers it with a 400 too).
    assert notes == [
        "(the oldest 1 exchange of the history was left out of the prompt: the model's context is 128 tokens, with "
        "room for --max_new_tokens 100)"]
    refused = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(refused) == 1 and refused[0].startswith("error: line 3 takes ") and refused[0].endswith(
        " tokens in the chat format, over the model's context of 128; not sent (shorten it)"), err
    assert out.count("\n") == 2  # two answers, none for the refused line

    # A plain continuation (a pretrained model) keeps the end of a text too long for its context, and says so.
    code, out, err = chat_in_process(monkeypatch, capsys, "--model_path", str(tiny_models.pretrain),
                                     "--temperature", "0", "--max_new_tokens", "4", "--no_stream",
                                     stdin="word " * 300 + "\n")
    assert code == 0 and "(the prompt is " in err and "only its last 64 tokens were kept)" in err, err


@pytest.mark.parametrize("module", ["eval.chat", "eval.tool_eval", "eval.evaluate", "eval.copy_probe",
                                    "eval.long_context"])
def test_a_damaged_model_is_one_line_in_every_tool_that_loads_one(module, tiny_models, tmp_path, capsys) -> None:
    """The strict loader's refusal (a weight missing from model.safetensors) is the tools' one error line, not a
    traceback (chat and tool_eval let it through)."""
    import importlib
    import shutil

    from safetensors.torch import load_file, save_file

    damaged = Path(shutil.copytree(tiny_models.sft, tmp_path / "damaged"))
    weights = load_file(damaged / "model.safetensors")
    save_file({name: tensor for name, tensor in weights.items() if name != "model.norm.weight"},
              damaged / "model.safetensors", metadata={"format": "pt"})
    code = importlib.import_module(module).main(["--model_path", str(damaged)])
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("threads: ")]
    assert code == 2 and len(err) == 1 and err[0].startswith("error: cannot load ") and "model.norm.weight" in err[0]


@pytest.mark.parametrize("mode", ["chat", "plain"])
def test_a_model_whose_context_holds_less_than_a_prompt_and_a_token_is_one_line(mode, tokenizer, tmp_path,
                                                                                 capsys) -> None:
    """A stock Llama folder with max_position_embeddings 1 (MiniNorm's own config refuses it at load): the plain
    continuation kept "the last 0 tokens" of the prompt, that is all of it, and the engine's refusal of the prompt
    was a traceback. The engine refuses such a model when it is built, and chat says so in one line."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eval.chat import main

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    tokenizer.save_pretrained(tmp_path / "llama")
    capsys.readouterr()  # the save's progress bar
    code = main(["--model_path", str(tmp_path / "llama"), "--mode", mode, "--no_tools", "--prompt", "Hi there"])
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("threads: ")]
    assert code == 2 and err == ["error: the model's context (max_position_embeddings) is 1; generating needs at "
                                 "least 2 positions (a prompt token and a new one)"], err


def test_a_reader_that_stops_early_ends_chat_without_a_traceback(tiny_models) -> None:
    """`chat.py ... | head -c 3`: once the reader has gone, writing the answer raised BrokenPipeError, printed as a
    traceback. The tool ends quietly with 128 + SIGPIPE, as a program killed by the signal would."""
    process = start_chat("--model_path", str(tiny_models.sft), *GREEDY, "--no_stream", "--prompt", "Hi")
    process.stdout.close()  # the reader is gone before the answer is written (loading takes seconds)
    err = process.stderr.read()
    assert process.wait(timeout=300) == 141 and "Traceback" not in err and "BrokenPipeError" not in err, err


def test_a_prompt_too_long_for_the_context_is_refused_in_one_line(monkeypatch, capsys, tiny_models) -> None:
    code, out, err = chat_in_process(monkeypatch, capsys, "--model_path", str(tiny_models.sft), "--no_tools",
                                     "--prompt", "word " * 300)
    lines = [line for line in err.splitlines() if not line.startswith(("threads: ", "model "))]
    assert code == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith("error: --prompt takes ") and lines[0].endswith("over the model's context of 128; "
                                                                             "not sent (shorten it)")


def test_a_prompt_the_tools_schemas_make_too_long_says_to_leave_them_out(monkeypatch, capsys, tiny_models,
                                                                         tokenizer) -> None:
    """'Hi' is a few tokens, the three tools' schemas in the system turn over a hundred: on a 128-position model
    "shorten it" alone was no way out."""
    from dataset.chat_format import encode_chatml
    from dataset.tools import tool_schemas

    tokens = len(encode_chatml(tokenizer, [{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                               tools=tool_schemas()).input_ids)
    code, out, err = chat_in_process(monkeypatch, capsys, "--model_path", str(tiny_models.sft), "--prompt", "Hi")
    lines = [line for line in err.splitlines() if not line.startswith(("threads: ", "model "))]
    assert code == 2 and out == "" and lines == [
        f"error: --prompt takes {tokens} tokens in the chat format, the tools' schemas included, over the model's "
        "context of 128; not sent (shorten it, or leave the tools out with --no_tools)"], err


def test_a_system_prompt_too_long_for_any_message_is_named_before_the_first(monkeypatch, capsys, tiny_models,
                                                                          sent) -> None:
    """A --system of 300 words on a 128-position model: every message was refused in its turn as "line N takes 325
    tokens ...; not sent (shorten it)", the message blamed for the system prompt; it is one line naming --system
    before any message is read."""
    code, out, err = chat_in_process(monkeypatch, capsys, "--model_path", str(tiny_models.sft), *GREEDY,
                                     "--system", "word " * 300, stdin="Hi\nHello\n")
    lines = [line for line in err.splitlines() if not line.startswith("threads: ")]
    assert code == 2 and out == "" and sent == [] and len(lines) == 1, err
    assert re.fullmatch(r"error: the system turn \(--system\) takes \d+ tokens in the chat format, over the model's "
                        r"context of 128, with no message yet: no message fits; shorten --system", lines[0]), err


def test_a_message_too_long_beside_the_system_prompt_names_both(monkeypatch, capsys, tiny_models) -> None:
    """60 words of --system fit alone, not with 60 words of --prompt: the refusal says the system prompt is counted
    and that shortening it is a way out too."""
    code, out, err = chat_in_process(monkeypatch, capsys, "--model_path", str(tiny_models.sft), *GREEDY,
                                     "--system", "word " * 60, "--prompt", "word " * 60)
    lines = [line for line in err.splitlines() if not line.startswith(("threads: ", "model "))]
    assert code == 2 and out == "" and len(lines) == 1, err
    assert re.fullmatch(r"error: --prompt takes \d+ tokens in the chat format, the system prompt included, over the "
                        r"model's context of 128; not sent \(shorten it or --system\)", lines[0]), err


def test_a_line_escaped_with_two_slashes_is_sent_even_when_it_spells_a_command(monkeypatch, capsys, tiny_models,
                                                                                sent) -> None:
    """'//exit' and '//reset' are the messages '/exit' and '/reset' (they ended the session and cleared the
    history: the command check looked at the text, not at what the line was read as)."""
    code, _, err = chat_in_process(monkeypatch, capsys, "--model_path", str(tiny_models.sft), *GREEDY,
                                   "--no_stream", stdin="//reset\n//exit\nHi\n")
    assert code == 0 and sent == ["/reset", "/exit", "Hi"] and "(history cleared)" not in err, err


def test_a_message_that_fills_the_context_exactly_is_too_long(sft) -> None:
    """A chat message of exactly max_context tokens leaves no position to answer in: cut to its end it would lose
    the system turn and its own header, so it is a MessageTooLong as a longer one is; one position more fits, with
    a budget of one token."""
    from model.chat_session import MessageTooLong

    session = greedy_session(sft)
    tokens = len(session.fit_prompt("word " * 20).ids)  # the default context holds it whole
    session.max_context = tokens
    with pytest.raises(MessageTooLong) as refused:
        session.fit_prompt("word " * 20)
    assert (refused.value.tokens, refused.value.context, refused.value.with_tools) == (tokens, tokens, False)
    session.max_context = tokens + 1
    fit = session.fit_prompt("word " * 20)
    assert (len(fit.ids), fit.budget, fit.uncut_tokens) == (tokens, 1, 0)


def test_a_message_its_length_proves_too_long_is_refused_untokenized(sft, monkeypatch) -> None:
    """A 15 MB line took ~30 s to be refused: the whole prompt was tokenized first. A message of more characters
    than the context's tokens times the longest token's 16 bytes (the tokenizer's bound, text_token_range) cannot
    fit, and is refused with the fewest tokens it can take; a shorter one is still counted exactly."""
    import model.chat_session as chat_session
    from model.chat_session import MessageTooLong

    session = greedy_session(sft)
    counted = len(session.fit_prompt("word " * 20).ids)

    def tokenized(*args, **kwargs):
        raise AssertionError("the message was tokenized")

    monkeypatch.setattr(chat_session, "encode_prompt", tokenized)
    with pytest.raises(MessageTooLong) as refused:
        session.fit_prompt("word " * 2000)  # 10,000 characters, at least 625 tokens: over 128
    assert (refused.value.tokens, refused.value.context, refused.value.at_least) == (625, 128, True)
    assert str(refused.value) == "takes at least 625 tokens in the chat format, over the model's context of 128"
    monkeypatch.undo()
    session.max_context = counted  # 100 characters, at least 7 tokens: tokenized, and refused by its count
    with pytest.raises(MessageTooLong) as refused:
        session.fit_prompt("word " * 20)
    assert (refused.value.tokens, refused.value.at_least) == (counted, False)
