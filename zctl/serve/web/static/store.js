// Conversations and settings, kept in this browser's localStorage.
//
// A conversation: {id, title, system, messages: [{role, content, stats?, error?}], updated}.
// Saved after every change, so a reload, a lost network or a server restart never loses
// what is on screen.

const CONVERSATIONS = "zctl.conversations";
const CURRENT = "zctl.current";
const SETTINGS = "zctl.settings";

function read(key, fallback) {
  try {
    const value = JSON.parse(localStorage.getItem(key));
    return value ?? fallback;
  } catch {
    return fallback;
  }
}

export class Store {
  constructor() {
    this.conversations = read(CONVERSATIONS, []).filter((c) => c && Array.isArray(c.messages));
    this.currentId = localStorage.getItem(CURRENT);
    if (!this.current()) this.create();
  }

  current() {
    return this.conversations.find((c) => c.id === this.currentId);
  }

  create() {
    const conversation = { id: crypto.randomUUID(), title: "New conversation", system: "",
      messages: [], updated: Date.now() };
    this.conversations.unshift(conversation);
    this.select(conversation.id);
    return conversation;
  }

  select(id) {
    this.currentId = id;
    localStorage.setItem(CURRENT, id);
  }

  remove(id) {
    this.conversations = this.conversations.filter((c) => c.id !== id);
    if (this.currentId === id) {
      if (this.conversations.length) this.select(this.conversations[0].id);
      else this.create();
    }
    this.save();
  }

  save() {
    const current = this.current();
    if (current) {
      current.updated = Date.now();
      const first = current.messages.find((m) => m.role === "user");
      if (first) current.title = first.content.slice(0, 60);
    }
    this.conversations.sort((a, b) => b.updated - a.updated);
    try {
      localStorage.setItem(CONVERSATIONS, JSON.stringify(this.conversations));
    } catch {
      // storage full: the conversation stays on screen, unsaved
    }
  }
}

export function loadSettings() {
  return read(SETTINGS, {});
}

export function saveSettings(settings) {
  localStorage.setItem(SETTINGS, JSON.stringify(settings));
}
