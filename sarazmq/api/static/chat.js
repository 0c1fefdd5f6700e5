// The chat page: keeps the conversation, streams each answer from
// /v1/chat/completions, and Stop aborts the HTTP request (the server then aborts the
// generation and frees its KV blocks).
"use strict";

const $ = (id) => document.getElementById(id);
const history = [];  // {role, content} of finished turns
let model = null;
let inflight = null;  // AbortController of the answer being streamed

const keyForm = wireKeyForm(() => loadModel());

function addMessage(role, text) {
  const el = document.createElement("div");
  el.className = "msg " + role;
  el.dataset.role = role;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  el.appendChild(body);
  $("messages").appendChild(el);
  $("messages").scrollTop = $("messages").scrollHeight;
  return el;
}

function setMeta(el, text) {
  let meta = el.querySelector(".meta");
  if (!meta) {
    meta = document.createElement("span");
    meta.className = "meta";
    el.appendChild(meta);
  }
  meta.textContent = text;
}

async function loadModel() {
  const response = await apiFetch("/v1/models");
  if (response.status === 401) {
    keyForm.show();
    return;
  }
  if (!response.ok) {
    $("error").textContent = await errorMessage(response);
    return;
  }
  const body = await response.json();
  model = body.data[0].id;
  $("model").textContent = model;
  $("error").textContent = "";
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...history);
  const body = {
    model: model,
    messages: messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number($("temperature").value),
    top_p: Number($("top-p").value),
    max_tokens: Number($("max-tokens").value),
  };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  if ($("ignore-eos").checked) body.ignore_eos = true;
  return body;
}

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
  document.body.dataset.streaming = on ? "1" : "0";
}

async function send(text) {
  if (!model) await loadModel();
  if (!model) return;
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const el = addMessage("assistant", "");
  const textEl = el.querySelector(".text");
  inflight = new AbortController();
  busy(true);
  let answer = "";
  let finish = "";
  const started = performance.now();
  try {
    const response = await apiFetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(requestBody()),
      signal: inflight.signal,
    });
    if (response.status === 401) {
      keyForm.show();
      throw new Error("needs the API key");
    }
    if (!response.ok) throw new Error(await errorMessage(response));
    let tokens = 0;
    for await (const chunk of readEvents(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      for (const choice of chunk.choices || []) {
        if (choice.delta && choice.delta.content) {
          answer += choice.delta.content;
          textEl.textContent = answer;
          $("messages").scrollTop = $("messages").scrollHeight;
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
    }
    const secs = (performance.now() - started) / 1000;
    setMeta(el, `${tokens} tokens in ${secs.toFixed(1)} s · ${finish || "done"}`);
    el.dataset.finish = finish || "done";
  } catch (e) {
    if (e.name === "AbortError") {
      setMeta(el, "stopped");
      el.dataset.finish = "stopped";
    } else {
      setMeta(el, "error: " + e.message);
      el.dataset.finish = "error";
      $("error").textContent = e.message;
    }
  } finally {
    // the (partial) answer stays in the conversation, as in other chat UIs
    history.push({ role: "assistant", content: answer });
    inflight = null;
    busy(false);
  }
}

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || inflight) return;
  $("prompt").value = "";
  send(text);
});

$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) {
    ev.preventDefault();
    $("composer").requestSubmit();
  }
});

$("stop").addEventListener("click", () => {
  if (inflight) inflight.abort();
});

$("clear").addEventListener("click", () => {
  if (inflight) inflight.abort();
  history.length = 0;
  $("messages").replaceChildren();
});

busy(false);
loadModel();
