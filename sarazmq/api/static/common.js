// Shared by the pages: the API key (kept in sessionStorage, sent as a bearer token),
// fetch with it, and a reader of server-sent events over fetch (EventSource cannot
// send an Authorization header).
"use strict";

const KEY_NAME = "sarazmq-api-key";

function apiKey() {
  return sessionStorage.getItem(KEY_NAME) || "";
}

function setApiKey(key) {
  sessionStorage.setItem(KEY_NAME, key.trim());
}

function authHeaders(extra) {
  const headers = Object.assign({}, extra || {});
  const key = apiKey();
  if (key) headers["Authorization"] = "Bearer " + key;
  return headers;
}

function apiFetch(path, options) {
  const opts = Object.assign({}, options || {});
  opts.headers = authHeaders(opts.headers);
  return fetch(path, opts);
}

// A form#key-form with an input#key-input: shown when the server wants a key; calls
// onKey() once one is entered.
function wireKeyForm(onKey) {
  const form = document.getElementById("key-form");
  const input = document.getElementById("key-input");
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    setApiKey(input.value);
    form.classList.remove("shown");
    onKey();
  });
  return {
    show() { form.classList.add("shown"); input.focus(); },
  };
}

// Yields each event's data (parsed JSON) of a text/event-stream response.
async function* readEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trimStart()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (e) { /* not JSON */ }
  return "HTTP " + response.status;
}
