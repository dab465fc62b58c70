// The chat page of scripts/serve.py: plain JavaScript against the server's own OpenAI-style API. With tools on,
// the page runs the tool loop as OpenAI's clients do: a reply that ends in tool calls gets each call run through
// the server's POST /tools/run, the results go back as "tool" messages, and the model is asked again (at most the
// server's max_tool_rounds rounds of calls per message). Model and tool text only ever enters the page as text.
"use strict";

const $ = (id) => document.getElementById(id);
const history = [];     // the conversation so far, OpenAI's messages, sent whole with every request
let controller = null;  // aborts the answer being streamed (or the tool being run)
let conversation = 0;   // counts resets: an answer that ends after one does not join the new history
const tools = { offered: [], maxRounds: 0, loaded: false };  // what GET /tools gave
const LONG_RESULT = 120;  // characters: a longer tool result is shown collapsed

function headers() {
  const result = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) result.Authorization = `Bearer ${key}`;
  return result;
}

// source: what the message is about ("model": the model or its tools could not be loaded; "chat": a request)
function showError(message, source = "chat") {
  $("error").textContent = message;
  $("error").dataset.source = source;
  $("error").hidden = false;
}

// With a source, only that source's message goes: a model load finishing late leaves a chat's error shown.
function clearError(source) {
  if (source !== undefined && $("error").dataset.source !== source) return;
  $("error").hidden = true;
  $("error").textContent = "";
}

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;  // text, never HTML
  return node;
}

function addMessage(role, text) {
  const div = element("div", `message ${role}`, text);
  $("messages").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

async function errorMessage(response) {
  if (response.status === 401) $("api-key-label").hidden = false;
  try {
    const body = await response.json();
    if (body.error && body.error.message) return `${response.status}: ${body.error.message}`;
  } catch (ignored) { /* not JSON */ }
  return `${response.status} ${response.statusText}`;
}

async function loadTools() {
  const box = $("tools");
  const response = await fetch("/tools", { headers: headers() });
  const body = response.ok ? await response.json() : { tools: [], max_tool_rounds: 0, note: "" };
  tools.offered = body.tools || [];
  tools.maxRounds = body.max_tool_rounds || 0;
  const names = tools.offered.map((tool) => tool.function.name).join(", ");
  box.disabled = tools.offered.length === 0;
  if (box.disabled) box.checked = false;
  else if (!tools.loaded) box.checked = true;  // on by default; later reloads keep the user's choice
  tools.loaded = tools.loaded || response.ok;
  $("tools-label").title = names ? `let the model call the server's tools: ${names}` :
    body.note || "the server offers no tools";
}

async function loadModel() {
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    if (!response.ok) {
      $("model-name").textContent = response.status === 401 ? "enter the API key" : "";
      showError(await errorMessage(response), "model");
      return;
    }
    const model = (await response.json()).data[0];
    $("model-name").textContent = `${model.id} · context ${model.max_context} tokens`;
    $("max-tokens").max = model.max_context - 1;
    await loadTools();
    clearError("model");
  } catch (error) {
    showError(`the server cannot be reached (${error.message})`, "model");
  }
}

function numberOrNothing(id) {
  const text = $(id).value.trim();
  return text === "" ? undefined : Number(text);
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").hidden = !busy;
}

// Server-sent events from a fetch() body: "data: {...}" lines, events separated by a blank line.
async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data !== "[DONE]") yield JSON.parse(data);
      }
    }
  }
}

// One assistant reply in the transcript: its thinking, collapsed in a <details> above the answer, and its text.
class Bubble {
  constructor() {
    this.div = addMessage("assistant", "");
    this.div.classList.add("streaming");
    this.thinking = null;
    this.content = null;
  }

  showThinking(text) {
    if (!this.thinking) {
      const details = element("details", "thinking");
      details.append(element("summary", "", "thinking"));
      this.thinking = element("div", "thinking-text");
      details.append(this.thinking);
      this.div.prepend(details);
    }
    this.thinking.textContent = text;
  }

  showContent(text) {
    if (!this.content) this.div.append(this.content = element("div", "content"));
    this.content.textContent = text;
    this.div.scrollIntoView({ block: "end" });
  }

  // Streaming is over; a reply that only called tools leaves no empty bubble behind.
  end(finish) {
    this.div.classList.remove("streaming");
    this.div.dataset.finish = finish || "";
    if (!this.thinking && !this.content) this.div.remove();
  }
}

// A tool call in the transcript: name(arguments), then its result (collapsed when long).
function addToolCall(call) {
  const div = element("div", "message tool");
  div.append(element("div", "tool-call", `${call.function.name}(${call.function.arguments})`));
  $("messages").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function showToolResult(div, text, isError) {
  if (isError) div.classList.add("failed");
  if (text.length <= LONG_RESULT && !text.includes("\n")) {
    div.append(element("div", "tool-result", `→ ${text}`));
    return;
  }
  const details = element("details", "tool-result");
  details.append(element("summary", "", `→ ${text.slice(0, 60)}… (${text.length} characters)`));
  details.append(element("div", "tool-result-text", text));
  div.append(details);
}

function showNote(div, text) {
  div.append(element("div", "tool-note", text));
}

// One streamed completion of `messages`, shown in `bubble` as it arrives: {content, reasoning, calls, finish,
// usage, failure}; calls are OpenAI's [{id, type, function: {name, arguments}}].
async function complete(messages, bubble, useTools) {
  const reply = { content: "", reasoning: "", calls: [], finish: null, usage: null, failure: null };
  const request = {
    messages, stream: true, stream_options: { include_usage: true },
    temperature: numberOrNothing("temperature"), frequency_penalty: numberOrNothing("frequency-penalty"),
    max_tokens: numberOrNothing("max-tokens"),
  };
  if (useTools) request.tools = tools.offered;
  if ($("think").checked) request.chat_template_kwargs = { open_thinking: true };
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal: controller.signal, body: JSON.stringify(request),
    });
    if (!response.ok) {
      reply.failure = await errorMessage(response);
      return reply;
    }
    for await (const chunk of events(response)) {
      if (chunk.error) { reply.failure = chunk.error.message; continue; }
      if (chunk.usage) reply.usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        if (delta.reasoning_content) {
          reply.reasoning += delta.reasoning_content;
          bubble.showThinking(reply.reasoning);
        }
        if (delta.content) {
          reply.content += delta.content;
          bubble.showContent(reply.content);
        }
        for (const part of delta.tool_calls || []) {  // the server sends each call whole; join pieces all the same
          const call = reply.calls[part.index] ||= { id: "", type: "function", function: { name: "", arguments: "" } };
          if (part.id) call.id = part.id;
          if (part.function && part.function.name) call.function.name += part.function.name;
          if (part.function && part.function.arguments) call.function.arguments += part.function.arguments;
        }
        if (choice.finish_reason) reply.finish = choice.finish_reason;
      }
    }
  } catch (error) {
    if (error.name === "AbortError") reply.finish = "stopped";
    else reply.failure = `the server cannot be reached (${error.message})`;
  }
  return reply;
}

// The reply as the history keeps it; its calls only when they were answered (OpenAI wants every call answered).
function assistantMessage(reply, answered) {
  const message = { role: "assistant", content: reply.content };
  if (reply.reasoning) message.reasoning_content = reply.reasoning;
  if (answered && reply.calls.length) {
    message.tool_calls = reply.calls;
    if (!reply.content) message.content = null;
  }
  return message;
}

async function runTool(call) {
  const response = await fetch("/tools/run", {
    method: "POST", headers: headers(), signal: controller.signal,
    body: JSON.stringify({ name: call.function.name, arguments: call.function.arguments }),
  });
  if (!response.ok) throw new Error(await errorMessage(response));
  return response.json();
}

// The tool calls of one reply run, each shown with its result; the "tool" messages, or null when stopped.
async function runCalls(calls, outcome) {
  const results = [];
  for (const call of calls) {
    const div = addToolCall(call);
    try {
      const answer = await runTool(call);
      showToolResult(div, answer.result, answer.is_error);
      results.push({ role: "tool", tool_call_id: call.id, content: answer.result });
    } catch (error) {
      if (error.name === "AbortError") outcome.finish = "stopped";
      else outcome.failure = `the tool ${call.function.name} failed (${error.message})`;
      showNote(div, "not run");
      return null;
    }
  }
  return results;
}

async function send(text) {
  clearError();
  const userDiv = addMessage("user", text);
  setBusy(true);
  controller = new AbortController();
  const started = performance.now(), since = conversation;
  const useTools = $("tools").checked && tools.offered.length > 0;
  const turn = [{ role: "user", content: text }];  // this message's exchange: calls and results included
  const outcome = { finish: null, failure: null, tokens: 0, usage: false, calls: 0 };
  for (let round = 0; ; round++) {
    const bubble = new Bubble();
    const reply = await complete([...history, ...turn], bubble, useTools);
    bubble.end(reply.finish);
    outcome.finish = reply.finish;
    outcome.failure = reply.failure;
    if (reply.usage) { outcome.tokens += reply.usage.completion_tokens; outcome.usage = true; }
    const nothing = !reply.content && !reply.reasoning && reply.calls.length === 0;
    if (reply.failure !== null && nothing) {
      if (round === 0) {
        // Nothing was answered: take the question back into the box, so it can be sent again.
        userDiv.remove();
        $("input").value = text;
        turn.length = 0;
      }
      break;
    }
    const calling = reply.finish === "tool_calls" && reply.calls.length > 0 && reply.failure === null;
    if (calling && round >= tools.maxRounds) {
      for (const call of reply.calls) {
        showNote(addToolCall(call), `not run: at most ${tools.maxRounds} rounds of tool calls per message`);
      }
    }
    if (!calling || round >= tools.maxRounds) {
      turn.push(assistantMessage(reply, false));
      break;
    }
    const results = await runCalls(reply.calls, outcome);
    turn.push(assistantMessage(reply, results !== null));
    if (results === null) break;
    turn.push(...results);
    outcome.calls += results.length;
  }
  controller = null;
  if (outcome.failure !== null) showError(outcome.failure);
  if (since === conversation) history.push(...turn);
  if (turn.length) {
    const seconds = (performance.now() - started) / 1000;
    const note = (outcome.calls ? `, ${outcome.calls} tool call${outcome.calls > 1 ? "s" : ""}` : "") +
      (outcome.finish === "length" ? ", stopped at max tokens" : outcome.finish === "stopped" ? ", stopped" : "");
    $("stats").textContent = outcome.usage
      ? `${outcome.tokens} tokens in ${seconds.toFixed(2)} s ` +
        `(${(outcome.tokens / seconds).toFixed(1)} tokens/s)${note}`
      : note.slice(2);
  }
  setBusy(false);
  $("input").focus();
}

function reset() {
  if (controller) controller.abort();
  conversation += 1;
  history.length = 0;
  $("messages").replaceChildren();
  $("stats").textContent = "";
  clearError();
  $("input").focus();
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("input").value.trim();
  if (!text || controller) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("reset").addEventListener("click", reset);
$("api-key").addEventListener("change", loadModel);
loadModel();
