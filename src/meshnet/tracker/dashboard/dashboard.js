// The meshnet dashboard: polls the tracker's /v1/coverage and redraws. No build step.
"use strict";

const POLL_MS = Number(new URLSearchParams(location.search).get("poll")) || 500;
const KEY_STORE = "meshnet-api-key";
let apiKey = sessionStorage.getItem(KEY_STORE) || "";

// el("td", {class: "num"}, "text", child): every string goes in as text, never as HTML.
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  for (const child of children) node.append(child instanceof Node ? child : String(child));
  return node;
}

const span = (s) => `${s.start}:${s.end}`;
const ago = (seconds) => (seconds < 60 ? `${seconds.toFixed(1)} s ago` : `${(seconds / 60).toFixed(1)} min ago`);
const badge = (text) => el("span", {class: `badge ${text}`}, text);

function bytes(n) {
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i += 1; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function fill(tableId, rows) {
  const body = document.querySelector(`#${tableId} tbody`);
  body.replaceChildren(...rows);
}

function layerRuns(model) {
  const gaps = model.gaps.map(span);
  return gaps.length ? `gap at layers ${gaps.join(", ")}` : "no gaps";
}

function drawModel(model, nodes) {
  const n = model.num_layers;
  const gapLayers = model.layers.filter((l) => l.serving.length === 0).length;
  const status = el("span", {class: gapLayers ? "status bad" : "status"},
    `${n - gapLayers}/${n} layers served · ${layerRuns(model)} · ` +
    (model.routable ? "routable" : "not routable"));
  const map = el("div", {class: "map"});
  map.style.gridTemplateColumns = `minmax(8em, 16em) repeat(${n}, minmax(6px, 1fr))`;
  map.append(el("span", {class: "label"}, "layer"));
  for (let i = 0; i < n; i++) map.append(el("span", {class: "axis"}, i % 5 === 0 ? i : ""));
  map.append(el("span", {class: "label"}, "coverage"));
  for (const layer of model.layers) {
    const served = layer.serving.length > 0;
    const title = served ? `layer ${layer.layer}: ${layer.serving.join(", ")}` : `layer ${layer.layer}: no live node`;
    map.append(el("span", {class: `cell ${served ? "served" : "gap"}`, "data-layer": layer.layer,
      "data-state": served ? "served" : "gap", title}, layer.serving.length));
  }
  for (const node of nodes) drawNodeRow(map, model, node);
  return el("div", {class: "model", "data-model": model.model, "data-gaps": gapLayers,
    "data-routable": model.routable}, el("h2", {}, model.model, status), map);
}

function drawNodeRow(map, model, node) {
  const held = (list) => list.filter((s) => s.model === model.model).map((s) => s.span);
  const loaded = held(node.loaded), loading = held(node.loading);
  if (!loaded.length && !loading.length) return;
  const dead = node.state === "late" || node.state === "suspect";
  map.append(el("span", {class: "label", title: `${node.address} (${node.state})`}, node.node_id));
  for (let i = 0; i < model.num_layers; i++) {
    const inside = (s) => s.start <= i && i < s.end;
    let kind = "";
    if (loaded.some(inside)) kind = dead ? "late" : "loaded";
    else if (loading.some(inside)) kind = "loading";
    map.append(el("span", {class: `cell ${kind}`, "data-node": node.node_id, "data-layer": i}));
  }
}

// how far a node's fetch of a span's weights has come (ADR-0054), or "loading"
function loadingNote(node, shard) {
  const fetch = (node.fetching || []).find((f) => f.shard.model === shard.model &&
    f.shard.span.start === shard.span.start && f.shard.span.end === shard.span.end);
  if (!fetch) return "loading";
  const left = fetch.rate_bytes_s > 0 ? `, ${((fetch.total_bytes - fetch.done_bytes) / fetch.rate_bytes_s).toFixed(0)} s left` : "";
  return `fetching ${bytes(fetch.done_bytes)} of ${bytes(fetch.total_bytes)}${left}`;
}

function nodeRow(node) {
  const spans = [...node.loaded.map((s) => `${s.model} ${span(s.span)}`),
    ...node.loading.map((s) => `${s.model} ${span(s.span)} (${loadingNote(node, s)})`)].join(", ") || "none";
  return el("tr", {"data-node": node.node_id, "data-state": node.state},
    el("td", {}, node.node_id), el("td", {}, node.address), el("td", {}, badge(node.state)),
    el("td", {class: "num"}, bytes(node.budget_bytes)), el("td", {}, node.quant), el("td", {}, spans),
    el("td", {class: "num"}, node.throughput.toFixed(0)),
    el("td", {class: "num"}, node.threads || "–"), el("td", {class: "num"}, node.sessions),
    el("td", {class: "num"}, ago(node.last_heartbeat_age_s)));
}

function requestRow(r) {
  return el("tr", {title: r.error || r.session},
    el("td", {}, ago(r.age_s)), el("td", {}, r.entry), el("td", {}, r.model),
    el("td", {}, badge(r.outcome)), el("td", {class: "num"}, r.prompt_tokens),
    el("td", {class: "num"}, r.completion_tokens),
    el("td", {class: "num"}, `${r.time_to_first_token_s.toFixed(2)} s`),
    el("td", {class: "num"}, r.decode_tokens_per_s.toFixed(1)), el("td", {class: "num"}, r.failovers));
}

function directiveRow(d) {
  return el("tr", {}, el("td", {}, ago(d.age_s)), el("td", {}, badge(d.op)), el("td", {}, d.model),
    el("td", {}, span(d.span)), el("td", {}, d.node_id), el("td", {}, d.reason));
}

function render(coverage) {
  document.getElementById("models").replaceChildren(
    ...coverage.models.map((m) => drawModel(m, coverage.nodes)));
  fill("nodes", coverage.nodes.map(nodeRow));
  fill("requests", [...coverage.recent_requests].reverse().map(requestRow));
  fill("directives", [...coverage.recent_directives].reverse().map(directiveRow));
  const gaps = coverage.models.filter((m) => m.gaps.length).map((m) => m.model);
  const late = coverage.nodes.filter((n) => n.state === "late" || n.state === "suspect").length;
  setSummary(`${coverage.nodes.length} nodes · ${coverage.models.length} models · ` +
    (gaps.length ? `gaps in ${gaps.join(", ")}` : "every layer covered") +
    (late ? ` · ${late} late or failing` : ""));
  document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
}

function setSummary(text) {
  document.getElementById("summary").textContent = text;
}

async function refresh() {
  const headers = apiKey ? {Authorization: `Bearer ${apiKey}`} : {};
  try {
    const response = await fetch("/v1/coverage", {headers, cache: "no-store"});
    if (response.status === 401) {
      document.getElementById("login").hidden = false;
      setSummary("this tracker needs an API key");
      return;
    }
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    render(await response.json());
    document.body.dataset.live = "yes";
  } catch (error) {
    document.body.dataset.live = "no";
    setSummary(`tracker unreachable (${error.message}); retrying`);
  } finally {
    setTimeout(refresh, POLL_MS);
  }
}

document.getElementById("login").addEventListener("submit", (event) => {
  event.preventDefault();
  apiKey = document.getElementById("api-key").value.trim();
  sessionStorage.setItem(KEY_STORE, apiKey);
  document.getElementById("login").hidden = true;
});

refresh();
