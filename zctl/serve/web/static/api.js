// The server's API as the page uses it: requests with the key, Server-Sent Events read
// from a fetch (so they carry the key, which an EventSource cannot), and errors in words.

const KEY = "zctl.key";

export class ApiError extends Error {
  constructor(status, message, code = "") {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export function storedKey() {
  return localStorage.getItem(KEY) || "";
}

export function storeKey(key) {
  if (key) localStorage.setItem(KEY, key);
  else localStorage.removeItem(KEY);
}

function headers(extra = {}) {
  const key = storedKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

// What went wrong, as a person would want to read it.
export function humanError(error) {
  if (error.name === "AbortError") return "Stopped.";
  if (!(error instanceof ApiError)) {
    return "The server cannot be reached (is zctl serve running, is the network up?). " +
      "The page keeps trying; nothing on screen is lost.";
  }
  const detail = error.message;
  switch (error.status) {
    case 401:
      return "The server needs an API key, and the one this page has is missing or wrong.";
    case 429:
      return "The server is busy: its queue is full. Try again in a moment.";
    case 503:
      return `The cluster cannot serve right now (${detail}). If a node was lost it is ` +
        "healing: try again in a few seconds.";
    case 400:
      if (/context|too long|max_tokens/i.test(detail)) {
        return `The conversation is too long for the model (${detail}). Shorten it, lower ` +
          "Max tokens, or start a new conversation.";
      }
      return `The server refused the request: ${detail}`;
    default:
      return `The server answered ${error.status}: ${detail}`;
  }
}

async function failure(response) {
  let message = response.statusText, code = "";
  try {
    const body = await response.json();
    const error = body.error || body;
    message = error.message || JSON.stringify(body);
    code = error.code || error.type || "";
  } catch {
    // not JSON: the status line says it
  }
  return new ApiError(response.status, message, code);
}

// The events of a text/event-stream response, as {event, data} (data: the joined lines).
export async function* sseEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value.replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        let event = "message";
        const data = [];
        for (const line of block.split("\n")) {
          if (line.startsWith("event:")) event = line.slice(6).trim();
          else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
        }
        if (data.length) yield { event, data: data.join("\n") };
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

// A streamed chat completion: the response once it answers 200 (ApiError otherwise).
export async function chatStream(body, signal) {
  const response = await fetch("/v1/chat/completions", {
    method: "POST", signal, body: JSON.stringify({ ...body, stream: true,
      stream_options: { include_usage: true } }),
    headers: headers({ "Content-Type": "application/json" }),
  });
  if (!response.ok) throw await failure(response);
  return response;
}

// The cluster view's stream: the response once it answers 200 (ApiError otherwise).
export async function clusterStream(signal) {
  const response = await fetch("/zctl/cluster/stream", { signal, headers: headers() });
  if (!response.ok) throw await failure(response);
  return response;
}

// The model's name, as replies carry it (the first of /v1/models).
export async function modelName() {
  const response = await fetch("/v1/models", { headers: headers() });
  if (!response.ok) throw await failure(response);
  const body = await response.json();
  return body.data[0].id;
}
