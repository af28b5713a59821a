// The dashboard's chat box: streams an answer from /v1/chat/completions on this origin (the
// tracker answers it or forwards it to an entry), with the page's API key, and shows the
// speed while it streams, then the route the answer took. No build step.
"use strict";

const chat = {
  form: document.getElementById("chat"),
  model: document.getElementById("chat-model"),
  prompt: document.getElementById("chat-prompt"),
  answer: document.getElementById("chat-answer"),
  stats: document.getElementById("chat-stats"),
};

const authHeaders = () => (apiKey ? {Authorization: `Bearer ${apiKey}`} : {});  // dashboard.js

async function loadModels() {
  try {
    const response = await fetch("/v1/models", {headers: authHeaders()});
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const ids = (await response.json()).data.map((m) => m.id);
    chat.model.replaceChildren(...ids.map((id) => el("option", {value: id}, id)));
  } catch (error) {
    setTimeout(loadModels, 2000);  // no key yet, or no entry yet
  }
}

// Server-sent events of one answer: every `data:` JSON object, until [DONE].
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {done, value} = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, {stream: true});
    const parts = buffer.split("\n\n");
    buffer = parts.pop();
    for (const part of parts) {
      if (part.startsWith("data: {")) yield JSON.parse(part.slice(6));
    }
  }
}

function showSpeed(pieces, firstAt) {
  const seconds = (performance.now() - firstAt) / 1000;
  const rate = pieces > 1 && seconds > 0 ? ((pieces - 1) / seconds).toFixed(1) : "…";
  chat.stats.textContent = `${pieces} pieces · ${rate} tok/s`;
}

function showEnd(meshnet) {
  const route = meshnet.route.map((h) => `${h.node_id} ${h.span}`).join(" → ");
  chat.stats.dataset.route = meshnet.route.map((h) => h.span).join(",");
  chat.stats.dataset.tokensPerS = meshnet.decode_tokens_per_s;
  chat.stats.textContent = `${meshnet.decode_tokens_per_s.toFixed(1)} tok/s · first token ` +
    `${meshnet.time_to_first_token_s.toFixed(2)} s · route ${route}`;
}

async function ask(event) {
  event.preventDefault();
  const question = chat.prompt.value.trim();
  if (!question) return;
  chat.answer.textContent = "";
  chat.stats.textContent = "asking…";
  delete chat.form.dataset.done;
  const body = {model: chat.model.value, messages: [{role: "user", content: question}],
    temperature: 0, max_tokens: 256, stream: true};
  try {
    const response = await fetch("/v1/chat/completions", {method: "POST", body: JSON.stringify(body),
      headers: {"Content-Type": "application/json", ...authHeaders()}});
    if (!response.ok) throw new Error((await response.json()).error?.message || `HTTP ${response.status}`);
    let pieces = 0, firstAt = 0;
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      const text = chunk.choices[0]?.delta?.content;
      if (text) {
        firstAt = firstAt || performance.now();
        pieces += 1;
        chat.answer.append(text);
        showSpeed(pieces, firstAt);
      }
      if (chunk.meshnet) showEnd(chunk.meshnet);
    }
  } catch (error) {
    chat.stats.textContent = `error: ${error.message}`;
  } finally {
    chat.form.dataset.done = "yes";
  }
}

chat.form.addEventListener("submit", ask);
loadModels();
