// The dflash-serve chat page: one conversation, streamed over /v1/chat/completions (SSE),
// with the thinking toggle and each reply's tau, acceptance and tokens/s under it.
"use strict";

const $ = (id) => document.getElementById(id);
const history = [];
let controller = null;

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function addMessage(role) {
  const el = document.createElement("div");
  el.className = "msg " + role;
  el.innerHTML = '<div class="role"></div><details hidden><summary>thinking</summary><div class="reasoning"></div></details>' +
                 '<div class="content"></div><div class="stats"></div>';
  el.querySelector(".role").textContent = role;
  $("messages").appendChild(el);
  return el;
}

function statsLine(timings, spec) {
  const parts = [];
  if (spec && spec.mode === "speculative") {
    parts.push("τ " + spec.tau.toFixed(2));
    parts.push("acceptance " + (100 * spec.acceptance_rate).toFixed(0) + "%");
  }
  parts.push(timings.predicted_per_second.toFixed(1) + " tok/s");
  parts.push(timings.predicted_n + " tokens");
  return parts.join(" · ");
}

async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith("data: ")) yield line.slice(6);
      }
    }
  }
}

async function send(text) {
  history.push({ role: "user", content: text });
  addMessage("user").querySelector(".content").textContent = text;
  const reply = addMessage("assistant");
  const content = reply.querySelector(".content");
  const reasoning = reply.querySelector(".reasoning");
  const body = {
    messages: history, stream: true, max_tokens: Number($("max-tokens").value) || 256,
    chat_template_kwargs: { enable_thinking: $("thinking").checked },
  };
  controller = new AbortController();
  $("send").disabled = true; $("stop").disabled = false;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal });
    if (!response.ok) throw new Error((await response.json()).error.message);
    for await (const data of sseEvents(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const delta = (chunk.choices[0] || {}).delta || {};
      if (delta.reasoning_content) {
        const details = reply.querySelector("details");
        if (details.hidden) details.hidden = false, details.open = true;
        reasoning.textContent += delta.reasoning_content;
      }
      if (delta.content) content.textContent += delta.content;
      if (chunk.timings) reply.querySelector(".stats").textContent = statsLine(chunk.timings, chunk.dflash);
      $("messages").scrollTop = $("messages").scrollHeight;
    }
    history.push({ role: "assistant", content: content.textContent });
  } catch (err) {
    const e = document.createElement("div");
    e.className = "error";
    e.textContent = err.name === "AbortError" ? "stopped" : "error: " + err.message;
    reply.appendChild(e);
    history.pop();
  } finally {
    reply.dataset.done = "true";
    controller = null;
    $("send").disabled = false; $("stop").disabled = true;
  }
}

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("composer").requestSubmit(); }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("clear").addEventListener("click", () => { history.length = 0; $("messages").innerHTML = ""; });
$("api-key").value = localStorage.getItem("dflash-serve-key") || "";
$("api-key").addEventListener("change", () => { localStorage.setItem("dflash-serve-key", $("api-key").value); loadModel(); });

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    const j = await r.json();
    $("model").textContent = r.ok ? j.data[0].id : j.error.message;
    if (r.ok) $("thinking").checked = j.data[0].meta.chat_template_kwargs.enable_thinking !== false;
  } catch (err) {
    $("model").textContent = "server unreachable";
  }
}
loadModel();
