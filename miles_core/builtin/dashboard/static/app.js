// The dashboard page: one view per URL, data from the JSON API, refreshed while the run is running.
"use strict";

const CHARTS = [
  { id: "reward", title: "Reward", keys: ["rollout/reward_mean", "eval/reward_mean"] },
  { id: "loss", title: "Loss", keys: ["train/loss"] },
  { id: "kl", title: "KL to the reference", keys: ["train/kl"] },
  { id: "entropy", title: "Entropy", keys: ["train/entropy"] },
  { id: "step-time", title: "Step time by phase (s)",
    keys: ["time/step", "time/rollout", "time/train", "time/weight_update", "time/eval", "time/checkpoint"] },
  { id: "transfer", title: "Weight transfer (GB/s)", keys: ["weight_transfer/gb_per_s"] },
];
const PHASE_COLORS = { rollout: "#2563eb", train: "#dc2626", weight_update: "#16a34a", eval: "#d97706",
  checkpoint: "#7c3aed" };
const PAGE_SIZE = 200;
const REFRESH_MS = 2000;

let run = null;
let renderToken = 0;

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") el.className = v;
    else if (k === "dataset") Object.assign(el.dataset, v);
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    el.appendChild(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

async function api(path) {
  const response = await fetch(path, { cache: "no-store" });
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || `${response.status} ${response.statusText}`);
  return body;
}

function fmt(value, digits) {
  if (value === null || value === undefined) return "–";
  return typeof value === "number" ? Number(value.toFixed(digits ?? 3)).toString() : String(value);
}

// -- routing ---------------------------------------------------------------------------------------------------

function navigate(path) {
  history.pushState(null, "", path);
  render();
}

document.addEventListener("click", (event) => {
  const link = event.target.closest("a[data-link]");
  if (link && !event.ctrlKey && !event.metaKey && !event.shiftKey && event.button === 0) {
    event.preventDefault();
    navigate(link.getAttribute("href"));
  }
});
window.addEventListener("popstate", () => render());

function parseRoute(path) {
  const parts = path.split("/").filter(Boolean);
  if (parts.length === 0) return { view: "overview" };
  if (parts[0] === "samples") {
    return { view: parts.length >= 4 ? "sample" : "samples", step: parts[1], index: parts[2], occurrence: parts[3] };
  }
  return { view: parts[0] };
}

async function render(refresh) {
  const token = ++renderToken;
  const route = parseRoute(location.pathname);
  if (!refresh) document.getElementById("view").dataset.ready = "false";
  document.querySelectorAll("nav a").forEach((a) => {
    const view = route.view === "sample" ? "samples" : route.view;
    a.classList.toggle("active", a.dataset.view === view);
  });
  let content;
  try {
    run = await api("/api/run");
    renderHeader();
    content = await VIEWS[route.view](route);
  } catch (error) {
    content = h("div", { class: "error", id: "error" }, String(error.message || error));
  }
  if (token !== renderToken) return; // a newer render started meanwhile
  const main = document.getElementById("view");
  main.replaceChildren(content);
  main.dataset.view = route.view;
  main.dataset.ready = "true";
  if (!refresh) window.scrollTo(0, 0);
}

function renderHeader() {
  document.getElementById("run-dir").textContent = run.run_dir || "";
  const status = document.getElementById("run-status");
  status.textContent = run.status;
  status.className = "badge " + run.status;
  const done = run.last_step === null ? 0 : run.last_step; // steps count from 1; step 0 is the eval before training
  document.getElementById("run-progress").textContent = run.num_steps ? `step ${done} / ${run.num_steps}` : "";
  document.title = `Miles dashboard: ${run.run_dir || ""} (${run.status})`;
}

// -- views -----------------------------------------------------------------------------------------------------

const VIEWS = {
  async overview() {
    const [topology, metrics] = await Promise.all([api("/api/topology"), api("/api/metrics")]);
    return h("div", {}, h("h2", {}, "Topology"), topologyView(topology), h("h2", {}, "Charts"), chartsView(metrics));
  },
  async topology() {
    return h("div", {}, h("h2", {}, "Topology"), topologyView(await api("/api/topology")));
  },
  async charts() {
    return h("div", {}, h("h2", {}, "Charts"), chartsView(await api("/api/metrics")));
  },
  async timeline() {
    return h("div", {}, h("h2", {}, "Timeline of phases"), timelineView((await api("/api/phases")).phases));
  },
  async samples(route) {
    if (route.step === undefined) {
      const steps = (await api("/api/steps")).steps;
      const withSamples = steps.filter((s) => s.num_samples > 0);
      if (steps.length === 0) return h("div", { class: "empty" }, "No step recorded yet.");
      route.step = String((withSamples.length ? withSamples : steps).at(-1).step);
      history.replaceState(null, "", `/samples/${route.step}`);
    }
    return samplesView(route.step);
  },
  async sample(route) {
    const s = await api(`/api/steps/${route.step}/samples/${route.index}/${route.occurrence}`);
    const fields = { step: s.step, sample_index: s.sample_index, occurrence: s.occurrence, reward: s.reward,
      prompt: s.prompt, response: s.response, ...s.data };
    return h("div", { id: "sample-detail" },
      h("p", {}, h("a", { href: `/samples/${s.step}`, "data-link": "" }, `← all samples of step ${s.step}`)),
      h("h2", {}, `Step ${s.step}, sample ${s.sample_index} (occurrence ${s.occurrence})`),
      transcriptView(s.data && s.data.transcript),
      h("dl", { class: "fields" }, Object.entries(fields).flatMap(([k, v]) =>
        [h("dt", {}, k), h("dd", { dataset: { field: k } }, typeof v === "object" && v !== null ? JSON.stringify(v) : fmt(v, 4))])));
  },
};

// An agent's sample turn by turn: the policy's turns (trained on) and the messages its agent added (masked off).
function transcriptView(transcript) {
  if (!Array.isArray(transcript) || transcript.length === 0) return null;
  const label = { policy: "policy (trained)", agent: "agent (masked)" };
  return h("div", { id: "transcript" }, h("h3", {}, `Turns (${transcript.filter((t) => t.source === "policy").length} by the policy)`),
    transcript.map((span, i) => h("div", { class: `turn turn-${span.source}`, dataset: { turn: i, source: span.source } },
      h("small", {}, `${label[span.source] || span.source}, ${span.tokens} token(s)`),
      h("pre", {}, span.text))));
}

function topologyView(topology) {
  const engines = topology.engines.map((e) => h("div", { class: `node state-${e.state}`, dataset: { cell: e.cell_id } },
    h("b", {}, e.cell_id),
    h("small", {}, `health: ${e.state}${e.restarts ? `, ${e.restarts} restart(s)` : ""}`),
    h("small", { dataset: { field: "weight-version" } }, `weight version: ${fmt(e.weight_version)}`),
    (e.workers || []).map((w) => h("small", {}, `${w.name || "worker"} ${w.url || ""}${w.pid ? ` pid ${w.pid}` : ""}`))));
  const routers = topology.routers.map((r) => h("div", { class: "node" }, h("b", {}, r.name || "router"),
    h("small", {}, r.url || ""), h("small", {}, r.pid ? `pid ${r.pid}` : "")));
  const trainer = topology.trainer;
  const ranks = trainer ? trainer.ranks.map((name, i) => h("div", { class: "node", dataset: { rank: i } },
    h("b", {}, `rank ${i}`), h("small", {}, name))) : [];
  return h("div", { class: "topology", id: "topology" },
    h("div", { class: "column" }, h("h3", {}, `Trainer${trainer ? `: ${trainer.backend} (${trainer.implementation})` : ""}`),
      ranks.length ? ranks : h("div", { class: "empty" }, "no trainer registered yet")),
    h("div", { class: "arrow" }, "⟶ weights ⟶"),
    h("div", { class: "column" }, h("h3", {}, "Engines (cells)"),
      engines.length ? engines : h("div", { class: "empty" }, "no engine registered yet")),
    h("div", { class: "column" }, h("h3", {}, "Router"),
      routers.length ? routers : h("div", { class: "empty" }, "none: the rollout talks to the engines directly")));
}

function chartsView(metrics) {
  return h("div", { class: "grid", id: "charts" }, CHARTS.map((chart) => lineChart(chart.id, chart.title,
    chart.keys.filter((k) => metrics.series[k]).map((k) => ({ name: k, points: metrics.series[k] })))));
}

function timelineView(phases) {
  if (phases.length === 0) return h("div", { class: "empty" }, "No phase recorded yet.");
  const names = [...new Set(phases.map((p) => p.phase))];
  const t0 = Math.min(...phases.map((p) => p.started)), t1 = Math.max(...phases.map((p) => p.ended));
  const width = 1000, lane = 26, left = 110, top = 10;
  const height = top + names.length * lane + 30;
  const sx = (t) => left + ((t - t0) / Math.max(t1 - t0, 1e-9)) * (width - left - 10);
  const svg = svgEl("svg", { viewBox: `0 0 ${width} ${height}`, id: "timeline", "data-phases": phases.length });
  names.forEach((name, i) => {
    const label = svgEl("text", { x: 6, y: top + i * lane + 16, "font-size": 12 });
    label.textContent = name;
    svg.appendChild(label);
  });
  for (const p of phases) {
    const rect = svgEl("rect", { x: sx(p.started).toFixed(1), y: top + names.indexOf(p.phase) * lane + 3,
      width: Math.max(sx(p.ended) - sx(p.started), 0.8).toFixed(1), height: lane - 8,
      fill: PHASE_COLORS[p.phase] || "#6b7280", class: "phase", "data-step": p.step });
    const tip = svgEl("title");
    tip.textContent = `step ${p.step} ${p.phase}: ${p.seconds.toFixed(3)} s`;
    rect.appendChild(tip);
    svg.appendChild(rect);
  }
  for (const t of [t0, (t0 + t1) / 2, t1]) {
    const label = svgEl("text", { x: sx(t), y: height - 8, "text-anchor": "middle", "font-size": 11 });
    label.textContent = `${(t - t0).toFixed(1)} s`;
    svg.appendChild(label);
  }
  return h("div", { class: "timeline" }, svg);
}

async function samplesView(step) {
  const [info, page] = await Promise.all([api(`/api/steps/${step}`), api(`/api/steps/${step}/samples?limit=${PAGE_SIZE}`)]);
  const n = info.step;
  const stepper = h("form", { class: "stepper", onsubmit: (e) => {
      e.preventDefault();
      navigate(`/samples/${e.target.elements.step.value}`);
    } },
    h("a", { href: `/samples/${Math.max(n - 1, 0)}`, "data-link": "", id: "previous-step" }, "← previous"),
    h("label", {}, "step ", h("input", { name: "step", type: "number", min: 0, value: n })),
    h("a", { href: `/samples/${n + 1}`, "data-link": "", id: "next-step" }, "next →"),
    h("span", {}, `reward mean ${fmt(info.metrics["rollout/reward_mean"])}`));
  if (page.total === 0) {
    return h("div", {}, h("h2", {}, `Samples of step ${n}`), stepper,
      h("div", { class: "empty", id: "samples-empty" }, `Step ${n} has no samples${run.status === "running" ? " yet" : ""}.`));
  }
  const rows = page.samples.map((s) => {
    const href = `/samples/${n}/${s.sample_index}/${s.occurrence}`;
    return h("tr", { class: "sample-row", dataset: { key: `${s.sample_index}.${s.occurrence}` }, onclick: (event) => { if (!event.target.closest("a")) navigate(href); } },
      h("td", {}, h("a", { href, "data-link": "" }, `${s.sample_index}.${s.occurrence}`)),
      h("td", {}, fmt(s.reward)), h("td", { class: "text" }, s.prompt), h("td", { class: "text" }, s.response));
  });
  return h("div", {}, h("h2", {}, `Samples of step ${n}`), stepper,
    h("p", {}, `${page.total} samples, keyed (sample_index.occurrence)${page.total > page.samples.length ? `; the first ${page.samples.length} shown` : ""}.`),
    h("table", { id: "samples" }, h("thead", {}, h("tr", {}, h("th", {}, "key"), h("th", {}, "reward"), h("th", {}, "prompt"), h("th", {}, "response"))),
      h("tbody", {}, rows)));
}

// -- live refresh ----------------------------------------------------------------------------------------------

setInterval(() => {
  const editing = document.activeElement && document.activeElement.tagName === "INPUT";
  if (run && run.status === "running" && !editing) render(true);
}, REFRESH_MS);

render();
