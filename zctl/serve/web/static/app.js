// The page: two views (chat, cluster), the API key asked once and kept in this browser,
// the cluster stream kept open (reconnecting after a server restart or a network drop),
// and the chat told when the cluster heals.

import { clusterStream, humanError, sseEvents, storedKey, storeKey } from "/web/api.js";
import { Chat } from "/web/chat.js";
import { renderCluster } from "/web/cluster.js";

const $ = (id) => document.getElementById(id);
const STALL_MS = 5000; // no view for this long: the stream is taken as dropped
const HEALED_SHOWN_S = 15; // how long the chat says a heal happened

let keyWaiter = null;

// Ask for the API key (once, however many ask together); resolves once it is given.
function askKey(why) {
  if (keyWaiter) return keyWaiter;
  $("key-why").textContent = why || "This server asks for an API key (zctl serve --api-key).";
  $("key").value = storedKey();
  const dialog = $("key-dialog");
  keyWaiter = new Promise((resolve) => {
    dialog.addEventListener("close", () => {
      storeKey($("key").value.trim());
      keyWaiter = null;
      resolve();
    }, { once: true });
  });
  if (!dialog.open) dialog.showModal();
  return keyWaiter;
}

function showView(name) {
  for (const tab of document.querySelectorAll("[role=tab]")) {
    tab.setAttribute("aria-selected", String(tab.dataset.view === name));
  }
  $("view-chat").hidden = name !== "chat";
  $("view-cluster").hidden = name !== "cluster";
  history.replaceState(null, "", name === "chat" ? location.pathname : `#${name}`);
}

function setLink(state, text) {
  const link = $("link-state");
  link.dataset.state = state;
  link.textContent = { live: "live", connecting: "connecting…", offline: "offline",
    key: "needs a key" }[state];
  const notice = $("notice");
  notice.hidden = !text;
  notice.textContent = text || "";
}

// What the chat says of the cluster's health: healing while the pipeline does not serve,
// healed for a while after it serves again.
function showHealth(view) {
  const banner = $("heal");
  if (view.error) return;
  const events = view.events || [];
  const lost = [...events].reverse().find((e) => e.kind === "lost" || e.kind === "left");
  if (view.pipeline !== "serving") {
    banner.hidden = false;
    banner.dataset.state = "healing";
    banner.textContent = `The cluster is healing${lost ? `: ${lost.text}` : ""}. ` +
      "A running answer pauses and resumes where it was once the cluster serves again.";
    return;
  }
  const healed = [...events].reverse().find((e) => e.kind === "healed");
  if (healed && Date.now() / 1000 - healed.time < HEALED_SHOWN_S) {
    banner.hidden = false;
    banner.dataset.state = "healed";
    banner.textContent = `The cluster healed (${healed.text}); answers go on.`;
    return;
  }
  banner.hidden = true;
}

let streamController = null;

// Take the cluster stream as dropped and connect again (the chat could not reach the
// server: the stream may be as cut, with nothing to tell so yet).
function reconnect() {
  if (streamController) streamController.abort();
}

async function watchCluster() {
  let delay = 500;
  for (;;) {
    const controller = streamController = new AbortController();
    let stall = setTimeout(() => controller.abort(), STALL_MS);
    try {
      const response = await clusterStream(controller.signal);
      for await (const { event, data } of sseEvents(response)) {
        if (event !== "cluster") continue;
        clearTimeout(stall);
        stall = setTimeout(() => controller.abort(), STALL_MS);
        const view = JSON.parse(data);
        setLink("live", view.error || "");
        renderCluster(view);
        showHealth(view);
        delay = 500;
      }
      setLink("connecting", "The server closed the cluster stream; reconnecting…");
    } catch (error) {
      if (error.status === 401) {
        setLink("key", humanError(error));
        await askKey(humanError(error));
        continue;
      }
      setLink("offline", humanError(error));
    } finally {
      clearTimeout(stall);
    }
    await new Promise((resolve) => setTimeout(resolve, delay));
    delay = Math.min(delay * 2, 8000);
  }
}

for (const tab of document.querySelectorAll("[role=tab]")) {
  tab.addEventListener("click", () => showView(tab.dataset.view));
}
$("forget-key").addEventListener("click", () => {
  storeKey("");
  askKey("Give the API key to use.");
});
new Chat({ askKey, onUnreachable: reconnect,
  onBusy: (busy) => document.body.classList.toggle("busy", busy) });
showView(location.hash === "#cluster" ? "cluster" : "chat");
watchCluster();
