// The chat page: streams a reply from /v1/chat/completions and colours each piece of text by the token that
// produced it, from the `mirrorsd.segments` field of every SSE chunk ("draft": a draft token the target
// accepted; "target": the target's own token). No build step, no dependencies.
"use strict";
const $ = (id) => document.getElementById(id);
const messages = [];
let modelName = null;

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("key").value || localStorage.getItem("mirrorsd-key");
  if (key) { h.Authorization = "Bearer " + key; localStorage.setItem("mirrorsd-key", key); }
  return h;
}

async function loadModel() {
  const r = await fetch("/v1/models", { headers: headers() });
  if (!r.ok) { $("model").textContent = "(" + r.status + ": set the API key)"; return; }
  modelName = (await r.json()).data[0].id;
  $("model").textContent = modelName;
}

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  if (text) div.textContent = text;
  $("log").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function showStats(x, started) {
  $("tokens").textContent = x.completion_tokens;
  $("steps").textContent = x.steps;
  const seconds = (performance.now() - started) / 1000;
  if (x.completion_tokens && seconds > 0) $("tps").textContent = (x.completion_tokens / seconds).toFixed(1);
  if (x.steps) $("mal").textContent = (x.completion_tokens / x.steps).toFixed(2);
  if (x.method) $("used").textContent = x.method;
}

async function send(prompt) {
  if (!modelName) await loadModel();
  messages.push({ role: "user", content: prompt });
  bubble("user", prompt);
  const out = bubble("assistant", "");
  const body = { model: modelName, messages, stream: true,
                 temperature: Number($("temperature").value), max_tokens: Number($("max_tokens").value) };
  if ($("method").value) body.mirrorsd = { method: $("method").value };
  $("send").disabled = true;
  const started = performance.now();
  let reply = "";
  try {
    const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body) });
    if (!r.ok) throw new Error((await r.json()).error.message);
    const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      const events = buffer.split("\n\n");
      buffer = events.pop();
      for (const event of events) {
        const data = event.replace(/^data: /, "");
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        const x = chunk.mirrorsd;
        if (!x) continue;
        for (const seg of x.segments) {
          const span = document.createElement("span");
          span.className = "tok " + seg.source;
          span.textContent = seg.text;
          out.appendChild(span);
          reply += seg.text;
        }
        showStats(x, started);
        out.scrollIntoView({ block: "end" });
      }
    }
    messages.push({ role: "assistant", content: reply });
    document.body.dataset.done = "1";
  } catch (e) {
    bubble("error", String(e.message || e));
    messages.pop();
  } finally {
    $("send").disabled = false;
  }
}

$("form").addEventListener("submit", (e) => {
  e.preventDefault();
  const prompt = $("prompt").value.trim();
  if (!prompt) return;
  $("prompt").value = "";
  send(prompt);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("form").requestSubmit(); }
});
$("clear").addEventListener("click", () => { messages.length = 0; $("log").textContent = ""; });

// ?prompt=...&method=...&max_tokens=...&send=1 fills the form (and sends): how docs/ takes its screenshot.
const query = new URLSearchParams(location.search);
for (const id of ["method", "temperature", "max_tokens"]) if (query.has(id)) $(id).value = query.get(id);
loadModel().then(() => { if (query.has("prompt") && query.get("send") === "1") send(query.get("prompt")); });
