// The chat: conversations (store.js), an answer streamed from /v1/chat/completions and
// rendered as Markdown as it comes, Stop (the fetch aborted: the server cancels the
// generation on every stage), regenerate, edit-and-resend, and each answer's figures.

import { ApiError, chatStream, humanError, modelName, sseEvents } from "/web/api.js";
import { escapeHtml, renderMarkdown, wireCopyButtons } from "/web/markdown.js";
import { loadSettings, saveSettings, Store } from "/web/store.js";

const $ = (id) => document.getElementById(id);
const SETTINGS = ["temperature", "top_p", "max_tokens", "speculative", "k"];
const SAVE_EVERY_MS = 1000; // a streaming answer is saved this often (a reload keeps it)

function number(value) {
  return value === "" || value == null ? undefined : Number(value);
}

// The request's sampling and zctl's extras, from the settings (blank: the server's).
export function requestOptions(settings) {
  const options = {};
  for (const name of ["temperature", "top_p", "max_tokens"]) {
    const value = number(settings[name]);
    if (value !== undefined) options[name] = value;
  }
  const zctl = {};
  if (settings.speculative) zctl.speculative = settings.speculative;
  if (number(settings.k) !== undefined) zctl.k = number(settings.k);
  if (Object.keys(zctl).length) options.zctl = zctl;
  return options;
}

function statsText(stats) {
  const parts = [`${stats.tokens} tokens`];
  if (stats.ttft_ms != null) parts.push(`TTFT ${Math.round(stats.ttft_ms)} ms`);
  if (stats.tok_s != null) parts.push(`${stats.tok_s.toFixed(1)} tok/s`);
  if (stats.cached_tokens != null) parts.push(`${stats.cached_tokens} prompt tokens from the prefix cache`);
  return parts.join(" · ");
}

export class Chat {
  constructor({ askKey, onBusy, onUnreachable }) {
    this.store = new Store();
    this.askKey = askKey;
    this.onUnreachable = onUnreachable;
    this.onBusy = onBusy;
    this.controller = null;
    this.editing = null; // the index of the user message being edited
    this.model = null;
    this.settings = loadSettings();
    this.pendingRender = 0;
    wireCopyButtons($("messages"));
    this.wire();
    this.render();
  }

  get busy() {
    return this.controller !== null;
  }

  wire() {
    for (const name of SETTINGS) {
      const input = $(name);
      input.value = this.settings[name] ?? "";
      input.addEventListener("change", () => {
        this.settings[name] = input.value;
        saveSettings(this.settings);
      });
    }
    $("system").addEventListener("change", () => {
      this.store.current().system = $("system").value;
      this.store.save();
    });
    $("new-chat").addEventListener("click", () => {
      if (this.busy) return;
      this.store.create();
      this.store.save();
      this.render();
      $("prompt").focus();
    });
    $("composer").addEventListener("submit", (event) => {
      event.preventDefault();
      this.send();
    });
    $("prompt").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        this.send();
      }
    });
    $("stop").addEventListener("click", () => this.stop());
    $("conversations").addEventListener("click", (event) => {
      const item = event.target.closest("[data-id]");
      if (!item || this.busy) return;
      if (event.target.closest(".delete")) this.store.remove(item.dataset.id);
      else this.store.select(item.dataset.id);
      this.editing = null;
      this.render();
    });
    $("messages").addEventListener("click", (event) => {
      const button = event.target.closest("button[data-action]");
      if (!button || this.busy) return;
      const index = Number(button.closest("li").dataset.index);
      if (button.dataset.action === "edit") this.edit(index);
      if (button.dataset.action === "regenerate") this.regenerate();
    });
  }

  // -- actions --------------------------------------------------------------------------
  send() {
    const text = $("prompt").value.trim();
    if (!text || this.busy) return;
    const conversation = this.store.current();
    if (this.editing !== null) {
      conversation.messages.splice(this.editing);
      this.editing = null;
    }
    conversation.messages.push({ role: "user", content: text });
    $("prompt").value = "";
    this.answer();
  }

  edit(index) {
    const message = this.store.current().messages[index];
    this.editing = index;
    $("prompt").value = message.content;
    $("prompt").focus();
    this.render();
  }

  regenerate() {
    const messages = this.store.current().messages;
    if (messages.length && messages.at(-1).role === "assistant") messages.pop();
    if (messages.length && messages.at(-1).role === "user") this.answer();
  }

  stop() {
    if (this.controller) this.controller.abort();
  }

  async answer() {
    const conversation = this.store.current();
    const history = conversation.messages.filter((m) => !m.error || m.content)
      .map((m) => ({ role: m.role, content: m.content }));
    const reply = { role: "assistant", content: "", pending: true };
    conversation.messages.push(reply);
    this.store.save();
    this.controller = new AbortController();
    this.setBusy(true);
    this.render();
    let started = performance.now();
    let first = null, saved = started;
    try {
      this.model = this.model || await modelName();
      started = performance.now(); // TTFT: from the request, as the API's own is
      const system = conversation.system.trim();
      const body = { model: this.model, ...requestOptions(this.settings),
        messages: system ? [{ role: "system", content: system }, ...history] : history };
      const response = await chatStream(body, this.controller.signal);
      for await (const { data } of sseEvents(response)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new ApiError(chunk.error.status || 500, chunk.error.message);
        const delta = chunk.choices?.[0]?.delta?.content;
        if (delta) {
          if (first === null) first = performance.now();
          reply.content += delta;
          this.renderSoon();
          if (performance.now() - saved > SAVE_EVERY_MS) {
            saved = performance.now();
            this.store.save();
          }
        }
        if (chunk.usage) {
          const tokens = chunk.usage.completion_tokens;
          const seconds = (performance.now() - (first ?? started)) / 1000;
          reply.stats = { tokens, ttft_ms: first === null ? null : first - started,
            tok_s: tokens > 1 && seconds > 0 ? (tokens - 1) / seconds : null,
            cached_tokens: chunk.usage.prompt_tokens_details?.cached_tokens ?? null };
        }
      }
    } catch (error) {
      reply.error = humanError(error);
      reply.stopped = error.name === "AbortError";
      if (error instanceof ApiError && error.status === 401) {
        this.model = null;
        this.askKey(reply.error);
      } else if (!(error instanceof ApiError) && !reply.stopped) {
        this.onUnreachable();
      }
    } finally {
      delete reply.pending;
      this.controller = null;
      this.store.save();
      this.setBusy(false);
      this.render();
    }
  }

  setBusy(busy) {
    $("send").hidden = busy;
    $("stop").hidden = !busy;
    this.onBusy(busy);
  }

  // -- drawing --------------------------------------------------------------------------
  renderSoon() {
    if (this.pendingRender) return;
    this.pendingRender = requestAnimationFrame(() => {
      this.pendingRender = 0;
      this.renderMessages();
    });
  }

  render() {
    const conversation = this.store.current();
    $("system").value = conversation.system;
    $("conversations").innerHTML = this.store.conversations.map((c) =>
      `<li data-id="${c.id}" class="${c.id === conversation.id ? "current" : ""}">` +
      `<span class="title">${escapeHtml(c.title)}</span>` +
      `<button type="button" class="delete" title="Delete" aria-label="Delete">×</button></li>`).join("");
    this.renderMessages();
  }

  renderMessages() {
    const messages = this.store.current().messages;
    const last = messages.length - 1;
    const list = $("messages");
    const following = list.scrollHeight - list.scrollTop - list.clientHeight < 40;
    list.innerHTML = messages.map((m, i) => {
      const body = m.role === "assistant" ? renderMarkdown(m.content || (m.pending ? "…" : ""))
        : `<p>${escapeHtml(m.content).replace(/\n/g, "<br>")}</p>`;
      const actions = [];
      if (m.role === "user" && !m.pending) actions.push(`<button type="button" data-action="edit">Edit</button>`);
      if (m.role === "assistant" && i === last && !m.pending) {
        actions.push(`<button type="button" data-action="regenerate">Regenerate</button>`);
      }
      const meta = m.stats ? `<p class="stats">${escapeHtml(statsText(m.stats))}</p>` : "";
      const error = m.error ? `<p class="error" role="alert">${escapeHtml(m.error)}</p>` : "";
      const editing = i === this.editing ? " editing" : "";
      return `<li class="message ${m.role}${m.pending ? " pending" : ""}${editing}" data-index="${i}">` +
        `<div class="body">${body}</div>${meta}${error}` +
        `<div class="message-actions">${actions.join("")}</div></li>`;
    }).join("");
    if (following) list.scrollTop = list.scrollHeight; // (unless the reader scrolled up)
  }
}
