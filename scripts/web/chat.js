// The chat page of scripts/serve.py: plain JavaScript against the server's own OpenAI-style API.
"use strict";

const $ = (id) => document.getElementById(id);
const history = [];     // the conversation so far: {role, content}, sent whole with every request
let controller = null;  // aborts the answer being streamed

function headers() {
  const result = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) result.Authorization = `Bearer ${key}`;
  return result;
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = false;
}

function clearError() {
  $("error").hidden = true;
  $("error").textContent = "";
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `message ${role}`;
  div.textContent = text;  // text, never HTML
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

async function loadModel() {
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    if (!response.ok) {
      $("model-name").textContent = response.status === 401 ? "enter the API key" : "";
      showError(await errorMessage(response));
      return;
    }
    const model = (await response.json()).data[0];
    $("model-name").textContent = `${model.id} · context ${model.max_context} tokens`;
    $("max-tokens").max = model.max_context - 1;
    clearError();
  } catch (error) {
    showError(`the server cannot be reached (${error.message})`);
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

async function send(text) {
  clearError();
  const userDiv = addMessage("user", text);
  const answer = addMessage("assistant", "");
  answer.classList.add("streaming");
  setBusy(true);
  controller = new AbortController();
  let content = "", failure = null, usage = null, finish = null;
  const started = performance.now();
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal: controller.signal,
      body: JSON.stringify({
        messages: [...history, { role: "user", content: text }], stream: true,
        stream_options: { include_usage: true },
        temperature: numberOrNothing("temperature"), max_tokens: numberOrNothing("max-tokens"),
      }),
    });
    if (!response.ok) {
      failure = await errorMessage(response);
    } else {
      for await (const chunk of events(response)) {
        if (chunk.error) { failure = chunk.error.message; continue; }
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          if (choice.delta && choice.delta.content) {
            content += choice.delta.content;
            answer.textContent = content;
            answer.scrollIntoView({ block: "end" });
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }
    }
  } catch (error) {
    if (error.name === "AbortError") finish = "stopped";
    else failure = `the server cannot be reached (${error.message})`;
  }
  controller = null;
  answer.classList.remove("streaming");
  if (failure !== null && content === "") {
    // Nothing was answered: take the question back into the box, so it can be sent again.
    answer.remove();
    userDiv.remove();
    $("input").value = text;
    showError(failure);
  } else {
    if (failure !== null) showError(failure);
    history.push({ role: "user", content: text }, { role: "assistant", content });
    answer.dataset.finish = finish || "";
    const seconds = (performance.now() - started) / 1000;
    const note = finish === "length" ? ", stopped at max tokens" : finish === "stopped" ? ", stopped" : "";
    $("stats").textContent = usage
      ? `${usage.completion_tokens} tokens in ${seconds.toFixed(2)} s ` +
        `(${(usage.completion_tokens / seconds).toFixed(1)} tokens/s)${note}`
      : note.slice(2);
  }
  setBusy(false);
  $("input").focus();
}

function reset() {
  if (controller) controller.abort();
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
