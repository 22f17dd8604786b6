// The chat page: talks to the server's OpenAI routes (GET v1/models, POST v1/chat/completions
// with stream: true). Model output is only ever put in the page through textContent, never as HTML.
// An answer shows its reasoning (`reasoning_content`, with --reasoning-parser) in a collapsible block
// above the text, and its tool calls (when the Tools setting offers some) in blocks below it.
// When v1/models says the model takes images (`input_modalities`), images can be attached, pasted or dropped;
// they go with the next message as OpenAI image_url parts holding data: URLs, before its text.
"use strict";

const $ = (id) => document.getElementById(id);

const state = {
  history: [],       // the conversation sent with each request (no system prompt); reasoning is not sent back
  controller: null,  // AbortController of the answer being generated; null when idle
  model: null,       // id from v1/models, sent as `model`
  conversation: 0,   // bumped by "New chat", so a turn that ends afterwards stays out of the new one
  takesImages: false,  // the model's input_modalities include "image"
  attached: [],      // data: URLs of the images for the next message, in order
};

const SETTINGS_KEY = "llmserve.chat.settings";
const API_KEY_KEY = "llmserve.chat.apiKey";  // sessionStorage: a secret should not outlive the tab

// --- settings -----------------------------------------------------------------------------

function loadSettings() {
  let saved = {};
  try { saved = JSON.parse(localStorage.getItem(SETTINGS_KEY) || "{}"); } catch { /* corrupt: defaults */ }
  if (typeof saved.system === "string") $("system-prompt").value = saved.system;
  if (typeof saved.temperature === "string") $("temperature").value = saved.temperature;
  if (typeof saved.maxTokens === "string") $("max-tokens").value = saved.maxTokens;
  if (typeof saved.tools === "string") $("tools").value = saved.tools;
  $("api-key").value = sessionStorage.getItem(API_KEY_KEY) || "";
}

function saveSettings() {
  localStorage.setItem(SETTINGS_KEY, JSON.stringify({
    system: $("system-prompt").value, temperature: $("temperature").value, maxTokens: $("max-tokens").value,
    tools: $("tools").value,
  }));
  sessionStorage.setItem(API_KEY_KEY, $("api-key").value);
}

// An empty or invalid number field is left out of the request, so the server's default applies.
function numberField(id, parse) {
  const el = $(id);
  if (el.value.trim() === "" || !el.checkValidity()) return undefined;
  const value = parse(el.value);
  return Number.isFinite(value) ? value : undefined;
}

// The Tools setting: empty for none, else a JSON list (the server checks each tool and says what is wrong).
function toolsField() {
  const text = $("tools").value.trim();
  if (!text) return undefined;
  let tools;
  try { tools = JSON.parse(text); } catch (e) { throw new Error(`Tools: not valid JSON (${e.message})`); }
  if (!Array.isArray(tools)) throw new Error("Tools: expected a JSON list of tools");
  return tools.length ? tools : undefined;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

// --- server -------------------------------------------------------------------------------

// The OpenAI error body is {"error": {"message": ...}}; anything else is shown as the status line.
async function errorMessage(resp) {
  const text = await resp.text();
  try {
    const body = JSON.parse(text);
    const msg = body?.error?.message ?? body?.detail ?? body?.message;
    if (msg) return `${resp.status}: ${typeof msg === "string" ? msg : JSON.stringify(msg)}`;
  } catch { /* not JSON */ }
  return `${resp.status} ${resp.statusText}${text ? `: ${text.slice(0, 300)}` : ""}`;
}

function chooseModel() {
  state.model = $("model-select").value || state.model;
}

async function loadModel() {
  try {
    const resp = await fetch("v1/models", { headers: headers() });
    if (!resp.ok) throw new Error(await errorMessage(resp));
    const models = (await resp.json()).data || [];
    state.model = models.length ? models[0].id : null;
    $("model-name").textContent = state.model ?? "no model";
    // LoRA adapters come after the base model (their `parent`): a picker, whose choice goes out as `model`
    const select = $("model-select");
    select.replaceChildren(...models.map((m) => new Option(m.parent ? `${m.id} (LoRA)` : m.id, m.id)));
    select.hidden = models.length < 2;
    $("model-name").hidden = models.length >= 2;
    state.takesImages = (models[0]?.input_modalities || []).includes("image");
    $("attach").hidden = !state.takesImages;
  } catch (e) {
    $("model-name").textContent = "model unknown";
    showError(`Could not list models: ${e.message}`);
  }
}

// Calls onData(parsed JSON) per Server-Sent Event; resolves true on `data: [DONE]`, false when
// the stream ended without it (the server went away mid-answer).
async function readEvents(resp, onData) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return false;
    buffer += decoder.decode(value, { stream: true });
    const events = buffer.split(/\r?\n\r?\n/);
    buffer = events.pop();  // an incomplete event waits for the next read
    for (const event of events) {
      const data = event.split(/\r?\n/).filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (data === "[DONE]") return true;
      if (data) onData(JSON.parse(data));
    }
  }
}

// --- conversation view --------------------------------------------------------------------

// A call's arguments indented when they are JSON (they are once the call is complete), else as they came.
function prettyJson(text) {
  try { return JSON.stringify(JSON.parse(text), null, 2); } catch { return text; }
}

function addMessage(role, text, images = []) {
  $("empty-hint").hidden = true;
  const article = document.createElement("article");
  article.className = `msg ${role}`;
  article.dataset.role = role;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = role === "user" ? "You" : "Assistant";
  article.append(who);
  if (images.length) article.append(thumbnails(images));
  const body = document.createElement("div");
  body.className = "body";
  body.textContent = text;
  article.append(body);
  $("conversation").append(article);
  scrollToEnd(true);
  return article;
}

function thumbnails(urls) {
  const box = document.createElement("div");
  box.className = "images";
  urls.forEach((url, i) => box.append(imageElement(url, `image ${i + 1}`)));
  return box;
}

function imageElement(url, alt) {
  const img = document.createElement("img");
  img.src = url;  // a data: URL read from the user's own file
  img.alt = alt;
  return img;
}

// --- images for the next message ----------------------------------------------------------

function readAsDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

// Image files only (the server checks the rest: format, size, pixels, and how many a prompt may have).
async function attachFiles(files) {
  const images = [...files].filter((f) => f.type.startsWith("image/"));
  if (!state.takesImages || !images.length) return false;
  try {
    for (const file of images) state.attached.push(await readAsDataUrl(file));
  } catch (e) {
    showError(`Could not read the image: ${e.message}`);
  }
  renderAttachments();
  return true;
}

function renderAttachments() {
  const box = $("attachments");
  box.replaceChildren(...state.attached.map((url, i) => {
    const item = document.createElement("div");
    item.className = "attachment";
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "secondary remove";
    remove.textContent = "×";
    remove.setAttribute("aria-label", `Remove image ${i + 1}`);
    remove.addEventListener("click", () => { state.attached.splice(i, 1); renderAttachments(); });
    item.append(imageElement(url, `image ${i + 1} for the next message`), remove);
    return item;
  }));
  box.hidden = state.attached.length === 0;
}

function imageFiles(dataTransfer) {
  return [...(dataTransfer?.files || [])].filter((f) => f.type.startsWith("image/"));
}

function scrollToEnd(force) {
  const log = $("conversation");
  // Follow the answer only if the reader has not scrolled up to read something earlier.
  const nearEnd = log.scrollHeight - log.scrollTop - log.clientHeight < 80;
  if (force || nearEnd) log.scrollTop = log.scrollHeight;
}

function showError(message) {
  $("error-text").textContent = message;
  $("error").hidden = false;
}

function hideError() {
  $("error").hidden = true;
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("conversation").setAttribute("aria-busy", String(busy));  // screen readers wait for the whole answer
}

// --- one turn -----------------------------------------------------------------------------

class Answer {
  constructor(article) {
    this.article = article;
    this.body = article.querySelector(".body");
    this.text = "";
    this.reasoning = "";
    this.thinking = null;      // the reasoning's <details>, made when the first reasoning arrives
    this.calls = [];           // {id, name, arguments, el}, by the index the server gives each call
    this.chunks = 0;           // SSE chunks that carried text
    this.usageTokens = null;   // completion_tokens from the usage chunk, when the server sends it
    this.finishReason = null;
    this.start = performance.now();
    this.first = null;         // ms timestamps of the first and latest text chunk
    this.last = null;
    article.dataset.chunks = "0";
    article.dataset.state = "streaming";
  }

  onChunk(chunk) {
    if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
    if (chunk.usage) this.usageTokens = chunk.usage.completion_tokens;
    const choice = (chunk.choices || [])[0];
    if (!choice) return;
    if (choice.finish_reason) this.finishReason = choice.finish_reason;
    const delta = choice.delta || {};
    if (!delta.content && !delta.reasoning_content && !delta.tool_calls?.length) return;
    this.last = performance.now();
    this.first ??= this.last;
    if (delta.reasoning_content) this.addReasoning(delta.reasoning_content);
    if (delta.content) {
      this.text += delta.content;
      this.chunks += 1;
      this.body.textContent = this.text;
      this.article.dataset.chunks = String(this.chunks);
    }
    for (const call of delta.tool_calls || []) this.addCall(call);
    // The answer has begun: the reasoning folds away (a click opens it again).
    if (this.thinking && (delta.content || delta.tool_calls?.length)) this.thinking.open = false;
    scrollToEnd(false);
  }

  addReasoning(text) {
    if (!this.thinking) {
      this.thinking = document.createElement("details");
      this.thinking.className = "thinking";
      this.thinking.open = true;
      const summary = document.createElement("summary");
      summary.textContent = "Thinking";
      const reasoning = document.createElement("div");
      reasoning.className = "reasoning";
      this.thinking.append(summary, reasoning);
      this.body.before(this.thinking);
    }
    this.reasoning += text;
    this.thinking.querySelector(".reasoning").textContent = this.reasoning;
  }

  // OpenAI's tool-call deltas: the first of a call has its id and name, later ones append arguments.
  addCall(delta) {
    let call = this.calls[delta.index];
    if (!call) {
      const el = document.createElement("div");
      el.className = "tool-call";
      const name = document.createElement("div");
      name.className = "tool-name";
      const args = document.createElement("pre");
      args.className = "tool-args";
      el.append(name, args);
      let list = this.article.querySelector(".tool-calls");
      if (!list) {
        list = document.createElement("div");
        list.className = "tool-calls";
        this.body.after(list);
      }
      list.append(el);
      call = this.calls[delta.index] = { id: delta.id, name: "", arguments: "", el };
    }
    call.name += delta.function?.name || "";
    call.arguments += delta.function?.arguments || "";
    call.el.querySelector(".tool-name").textContent = `Tool call: ${call.name}`;
    call.el.querySelector(".tool-args").textContent = prettyJson(call.arguments);
  }

  // What goes back in the conversation: the text, and the calls as OpenAI's tool_calls.
  message() {
    if (!this.calls.length) return { role: "assistant", content: this.text };
    return {
      role: "assistant", content: this.text || null,
      tool_calls: this.calls.map((c) => ({ id: c.id, type: "function", function: { name: c.name, arguments: c.arguments } })),
    };
  }

  get empty() {
    return !this.text && !this.reasoning && !this.calls.length;
  }

  finish(stateName) {
    this.article.dataset.state = stateName;
    const tokens = this.usageTokens ?? this.chunks;  // without usage, one chunk is one token
    const parts = [`${tokens} token${tokens === 1 ? "" : "s"}`];
    if (tokens > 1 && this.last > this.first) {
      // Decode speed: tokens after the first over the time they took (TTFT is shown apart).
      parts.push(`${((tokens - 1) / ((this.last - this.first) / 1000)).toFixed(1)} tok/s`);
    }
    if (this.first !== null) parts.push(`TTFT ${Math.round(this.first - this.start)} ms`);
    if (stateName === "stopped") parts.push("stopped");
    else if (this.finishReason === "length") parts.push("cut at max tokens");
    if (this.calls.length) parts.push(`${this.calls.length} tool call${this.calls.length === 1 ? "" : "s"}`);
    const stats = document.createElement("div");
    stats.className = "stats";
    stats.textContent = parts.join(" · ");
    this.article.append(stats);
  }
}

function requestBody(messages) {
  const body = { messages, stream: true, stream_options: { include_usage: true } };
  const tools = toolsField();
  if (tools) body.tools = tools;
  if (state.model) body.model = state.model;
  const temperature = numberField("temperature", parseFloat);
  if (temperature !== undefined) body.temperature = temperature;
  const maxTokens = numberField("max-tokens", (v) => parseInt(v, 10));
  if (maxTokens !== undefined) body.max_tokens = maxTokens;
  return body;
}

// A user message: a string, or with images the parts OpenAI takes (the images first, then the text).
function userMessage(text, images) {
  if (!images.length) return { role: "user", content: text };
  const parts = images.map((url) => ({ type: "image_url", image_url: { url } }));
  return { role: "user", content: text ? [...parts, { type: "text", text }] : parts };
}

async function send(text, images = []) {
  if (state.controller || (!text.trim() && !images.length)) return;
  const controller = new AbortController();
  const conversation = state.conversation;
  state.controller = controller;
  setBusy(true);
  hideError();
  if (!state.model) await loadModel();
  if (conversation !== state.conversation) return;  // "New chat" while the model list loaded
  const user = userMessage(text, images);
  const system = $("system-prompt").value.trim();
  const messages = [...(system ? [{ role: "system", content: system }] : []), ...state.history, user];
  const userArticle = addMessage("user", text, images);
  const answer = new Answer(addMessage("assistant", ""));
  try {
    const resp = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody(messages)), signal: controller.signal,
    });
    if (!resp.ok) throw new Error(await errorMessage(resp));
    const complete = await readEvents(resp, (chunk) => answer.onChunk(chunk));
    if (!complete) throw new Error("the server closed the stream before the answer was complete");
    answer.finish("done");
  } catch (e) {
    const stopped = e.name === "AbortError";
    if (conversation !== state.conversation) return;
    if (!stopped) showError(e.message);
    if (answer.empty) {
      // Nothing came back: take the turn out again and give the question (and its images) back for a retry.
      userArticle.remove();
      answer.article.remove();
      if (!$("prompt").value) $("prompt").value = text;
      if (!state.attached.length) {
        state.attached = images;
        renderAttachments();
      }
      $("empty-hint").hidden = state.history.length > 0;
      return;
    }
    answer.finish(stopped ? "stopped" : "error");
  } finally {
    if (state.controller === controller) {
      state.controller = null;
      setBusy(false);
    }
  }
  // A turn with any answer stays in the conversation, stopped or not: the user saw it.
  if (conversation === state.conversation) state.history.push(user, answer.message());
}

function newChat() {
  state.conversation += 1;
  state.controller?.abort();
  state.controller = null;
  setBusy(false);
  state.history = [];
  state.attached = [];
  renderAttachments();
  $("conversation").querySelectorAll(".msg").forEach((m) => m.remove());
  $("empty-hint").hidden = false;
  hideError();
  $("prompt").focus();
}

// --- wiring -------------------------------------------------------------------------------

function autoGrow(el) {
  el.style.height = "auto";
  el.style.height = `${Math.min(el.scrollHeight, 240)}px`;
}

function submitPrompt() {
  const prompt = $("prompt");
  const text = prompt.value;
  const images = state.attached;
  if (state.controller || (!text.trim() && !images.length)) return;
  prompt.value = "";
  autoGrow(prompt);
  state.attached = [];
  renderAttachments();
  send(text, images);
}

document.addEventListener("DOMContentLoaded", () => {
  if (window.matchMedia("(max-width: 760px)").matches) $("settings").open = false;
  loadSettings();
  loadModel();
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); submitPrompt(); });
  $("prompt").addEventListener("keydown", (e) => {
    // Enter sends; Shift+Enter is a new line; Enter while an IME composes a word is the IME's.
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      submitPrompt();
    } else if (e.key === "Escape" && state.controller) {
      state.controller.abort();
    }
  });
  $("prompt").addEventListener("input", (e) => autoGrow(e.target));
  $("attach").addEventListener("click", () => $("image-input").click());
  $("image-input").addEventListener("change", async (e) => {
    await attachFiles(e.target.files);
    e.target.value = "";  // the same file may be attached again
  });
  // A pasted image is attached (pasted text stays text); a model that takes no images pastes as usual.
  $("prompt").addEventListener("paste", (e) => {
    const files = imageFiles(e.clipboardData);
    if (state.takesImages && files.length) {
      e.preventDefault();
      attachFiles(files);
    }
  });
  const chat = document.querySelector(".chat");
  chat.addEventListener("dragover", (e) => {
    if (!state.takesImages || !e.dataTransfer?.types.includes("Files")) return;
    e.preventDefault();
    chat.classList.add("dragging");
  });
  chat.addEventListener("dragleave", () => chat.classList.remove("dragging"));
  chat.addEventListener("drop", (e) => {
    chat.classList.remove("dragging");
    if (!state.takesImages || !imageFiles(e.dataTransfer).length) return;
    e.preventDefault();
    attachFiles(imageFiles(e.dataTransfer));
  });
  $("stop").addEventListener("click", () => { state.controller?.abort(); $("prompt").focus(); });
  $("new-chat").addEventListener("click", newChat);
  $("model-select").addEventListener("change", chooseModel);
  $("error-close").addEventListener("click", hideError);
  for (const id of ["system-prompt", "temperature", "max-tokens", "tools", "api-key"]) {
    $(id).addEventListener("change", saveSettings);
  }
  $("api-key").addEventListener("change", async () => {
    if (!state.model && !state.controller) {
      await loadModel();
      if (state.model) hideError();  // the error was the missing key
    }
  });
  $("prompt").focus();
});
