// The cluster view: the pipeline drawn as its stages in order, each on its node (address,
// device, layers, memory, KV slots, compute p50/p95), the hops between them (network
// p50/p95), tok/s, requests running and waiting, the placement with its predicted speed
// against the measured one, and the timeline of events; from /zctl/cluster/stream.

import { escapeHtml } from "/web/markdown.js";

const $ = (id) => document.getElementById(id);

function bytes(n) {
  if (!n) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(n >= 10 || i === 0 ? 0 : 1)} ${units[i]}`;
}

function ms(value) {
  return value == null ? "–" : `${value < 10 ? value.toFixed(2) : value.toFixed(1)} ms`;
}

function latency(figure) {
  return `p50 <b>${ms(figure.p50)}</b> · p95 ${ms(figure.p95)}`;
}

function field(name, value) {
  return `<dt>${name}</dt><dd>${value}</dd>`;
}

function stageCard(stage) {
  const used = stage.ram_total ? stage.ram_total - stage.ram_free : 0;
  return `<li class="stage ${stage.up ? "up" : "down"}" data-stage="${stage.index}">
    <h3>stage ${stage.index} <span class="state">${escapeHtml(stage.state)}</span></h3>
    <dl>
      ${field("node", escapeHtml(stage.node || "none"))}
      ${field("address", escapeHtml(stage.address || stage.host || "–"))}
      ${field("device", escapeHtml(stage.device || "–"))}
      ${field("layers", `<span class="layers">${escapeHtml(stage.layers || "–")}</span>`)}
      ${field("memory", stage.ram_total ? `${bytes(used)} used · ${bytes(stage.ram_free)} free` : "–")}
      ${field("KV slots", stage.kv_slots < 0 ? "–" : stage.kv_slots)}
      ${field("compute", `<span class="compute">${latency(stage.compute_ms)}</span>`)}
    </dl></li>`;
}

function hopItem(hop) {
  return `<li class="hop" data-hop="${escapeHtml(hop.name)}"><span class="arrow">↓</span>
    hop ${escapeHtml(hop.name)} · network <span class="network">${latency(hop.network_ms)}</span>
    ${hop.bytes_per_s ? ` · ${bytes(hop.bytes_per_s)}/s` : ""}</li>`;
}

function summary(view) {
  const predicted = view.prediction;
  let speed = `<b class="tok-s">${view.tok_s == null ? "–" : view.tok_s.toFixed(1)}</b> tok/s`;
  if (predicted && predicted.tok_s != null) {
    speed += ` <span class="predicted">(predicted ${predicted.tok_s.toFixed(1)} for ` +
      `${predicted.streams} stream${predicted.streams > 1 ? "s" : ""})</span>`;
  } else if (predicted && predicted.error) {
    speed += ` <span class="predicted">(no prediction: ${escapeHtml(predicted.error)})</span>`;
  }
  return `<div><span class="pipeline-state" data-state="${escapeHtml(view.pipeline)}">` +
    `${escapeHtml(view.pipeline)}</span> ${escapeHtml(view.model)} · epoch ${view.epoch}</div>
    <div>${speed}</div>
    <div><b class="running">${view.running}</b> running · <b class="waiting">${view.waiting}</b> waiting</div>` +
    (view.health ? `<div class="error">${escapeHtml(view.health)}</div>` : "");
}

function eventItem(event) {
  const when = new Date(event.time * 1000).toLocaleTimeString();
  return `<li class="event ${escapeHtml(event.kind)}" data-kind="${escapeHtml(event.kind)}">` +
    `<time>${when}</time> <span class="kind">${escapeHtml(event.kind.replace("_", " "))}</span> ` +
    `${escapeHtml(event.text)}</li>`;
}

// Draw one view of the cluster.
export function renderCluster(view) {
  if (view.error) {
    $("summary").innerHTML = `<div class="error">${escapeHtml(view.error)}</div>`;
  } else {
    $("summary").innerHTML = summary(view);
    const hops = Object.fromEntries(view.hops.map((h) => [h.name, h]));
    const items = [];
    for (const stage of view.stages) {  // each stage, then the hop after it (the last: back)
      items.push(stageCard(stage));
      if (stage.hop && hops[stage.hop]) items.push(hopItem(hops[stage.hop]));
    }
    $("pipeline").innerHTML = items.join("");
    const spares = view.nodes.filter((n) => n.stage == null);
    $("spares").innerHTML = spares.length ? spares.map((n) =>
      `<li>${escapeHtml(n.id)} · ${escapeHtml(n.address || n.host)} · ${escapeHtml(n.state)} · ` +
      `${escapeHtml(n.devices.join(", "))} · ${bytes(n.ram_free)} free</li>`).join("")
      : "<li>none</li>";
    const plan = view.plan;
    $("plan").textContent = plan ? [plan.placement, plan.error,
      ...Object.entries(plan.left_out).map(([n, why]) => `${n} left out: ${why}`)]
      .filter(Boolean).join(" · ") || "–" : "–";
  }
  const events = view.events || [];
  $("timeline").innerHTML = events.length ? [...events].reverse().map(eventItem).join("")
    : "<li>nothing yet</li>";
}
