"""Rollouts that call tools (GRPO's and PPO's --tools): an episode is sampled turn by turn, and the tool calls a turn
ends with are run between its turns, as model/chat_session.py runs them for the chat and the server.

One episode per prompt and sample: the policy samples an assistant turn after the prompt; when the turn ends (its
end-of-turn token) with tool calls read from its control ids (dataset/chat_format.py, parse_assistant_ids; any name
counts as a call, one the run does not offer gets run_tool's "Error: unknown tool" back), each call is run
(dataset/tools.py, run_tool, within its result budget), and the tool messages and the next assistant header are
appended as the chat template renders them (tool_context_ids); then sampling goes on, at most `max_tool_rounds`
rounds of calls (the calls of a turn after the last round are not run: the episode ends there). Everything after
the prompt -- the sampled turns and the appended context -- is at most `max_length` tokens; an episode that
reaches it (in a turn, or in the context the tools add) is cut, not ended.

The appended tokens are context, not actions: the episode's `action_mask` is False on them, so the policy loss, the
KL and the entropy (trainer/grpo.py reads this mask as its completion mask; so does trainer/ppo.py, whose rewards,
value loss and GAE step over them too) count the sampled tokens only. Each
turn's seed comes from `round_seed(episode, round)` (trainer/grpo.py derives it from the step, the prompt's place
in the global batch, the sample's in its group and the round), so a resumed run and several processes sample the
same episodes as one process. A call's JSON is sampled like any other token (the chat decodes it greedily,
model/chat_session.py's greedy_tool_calls): the log-probs the loss reads are those of the distribution that drew
the tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dataset.chat_format import encode_chatml, encode_text, parse_assistant_ids
from dataset.tools import is_tool_error, run_tool
from model.generation import GenerationSettings

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# (prompt ids, one settings each) -> the sampled ids of each (the end-of-turn token included when sampled):
# trainer/grpo.py's sample_completions with its policy and tokenizer bound; a test's fake.
Sampler = Callable[[Sequence[Sequence[int]], Sequence[GenerationSettings]], list[list[int]]]
TURN_END = "\n"  # what the template writes after an assistant turn's <|im_end|>, before the tool messages' turn


@dataclass
class ToolEpisode:
    """One sampled episode after its prompt: `token_ids` (the sampled turns and the tool results' context, in order),
    `action_mask` (True where the policy sampled the token), `messages` (the episode as OpenAI messages: each
    assistant turn read back with its content, reasoning_content and tool_calls, each tool message with the result
    -- what the rewards read as completion_messages), the calls run and how many of them came back as an error,
    and whether its last turn ended with an end-of-turn token (False: cut at the length limit)."""

    token_ids: list[int] = field(default_factory=list)
    action_mask: list[bool] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    calls: int = 0
    errors: int = 0
    ended: bool = False

    def add(self, ids: Sequence[int], sampled: bool) -> None:
        self.token_ids += ids
        self.action_mask += [sampled] * len(ids)


def tool_context_ids(tokenizer: PreTrainedTokenizerBase, results: Sequence[str],
                     open_thinking: bool = False) -> list[int]:
    """The ids the chat template puts between an assistant turn that ended with calls (its <|im_end|>) and the next
    assistant turn's first sampled token: the newline after the turn, the tool messages' turn (each result in its
    <tool_response>) and the generation prompt (dataset/chat_format.py, encode_chatml; with `open_thinking` the
    thinking block left open, as the prompts are)."""
    messages = [{"role": "tool", "content": result} for result in results]
    return encode_text(tokenizer, TURN_END) + encode_chatml(tokenizer, messages, add_generation_prompt=True,
                                                            open_thinking=open_thinking).input_ids


def assistant_message(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> dict[str, Any]:
    """A sampled turn read back as an OpenAI assistant message (any tool name read as a call)."""
    reply = parse_assistant_ids(tokenizer, ids)
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.reasoning_content:
        message["reasoning_content"] = reply.reasoning_content
    if reply.tool_calls:
        message["tool_calls"] = reply.tool_calls
    return message


def sample_tool_episodes(sample: Sampler, tokenizer: PreTrainedTokenizerBase, prompt_ids: Sequence[Sequence[int]],
                         settings: Sequence[GenerationSettings], round_seed: Callable[[int, int], int | None],
                         tools: Collection[str], max_tool_rounds: int, max_length: int, stops: Collection[int],
                         open_thinking: bool = False) -> list[ToolEpisode]:
    """One episode per prompt (see the module's docstring), every round's turns sampled in one batch: `settings`
    each prompt's sampling (its max_new_tokens and seed are replaced: the length left, `round_seed(prompt's
    index, round)`), `tools` the names whose calls run, `stops` the ids that end a turn (the engine's)."""
    episodes = [ToolEpisode() for _ in prompt_ids]
    active = list(range(len(prompt_ids)))
    for round_index in range(max_tool_rounds + 1):
        if not active:
            break
        requests = [list(prompt_ids[i]) + episodes[i].token_ids for i in active]
        turn_settings = [dataclasses.replace(settings[i], max_new_tokens=max_length - len(episodes[i].token_ids),
                                             seed=round_seed(i, round_index)) for i in active]
        going_on = []
        for index, ids in zip(active, sample(requests, turn_settings)):
            episode = episodes[index]
            episode.add(ids, sampled=True)
            message = assistant_message(tokenizer, ids)
            episode.messages.append(message)
            episode.ended = bool(ids) and ids[-1] in stops
            calls = message.get("tool_calls", [])
            if not (episode.ended and calls and round_index < max_tool_rounds):
                continue
            results = [run_tool(call["name"], call["arguments"], offered=tools) for call in calls]
            episode.calls += len(results)
            episode.errors += sum(is_tool_error(result) for result in results)
            episode.messages += [{"role": "tool", "content": result} for result in results]
            context = tool_context_ids(tokenizer, results, open_thinking)
            room = max_length - len(episode.token_ids)
            episode.add(context[:room], sampled=False)
            if len(context) >= room:  # no token of the next turn fits: cut
                episode.ended = False
                continue
            going_on.append(index)
        active = going_on
    return episodes
