// A small SVG line chart, hand-written so the dashboard needs no CDN and no build step.
// lineChart(title, series, options) returns a card element; series: [{name, points: [[x, y], ...]}].
"use strict";

const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777"];
const SVG_NS = "http://www.w3.org/2000/svg";

function svgEl(tag, attrs) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
  return el;
}

function niceNumber(value, span) {
  // Enough digits to tell ticks ``span`` apart (the entropy of a run moves in its third decimal).
  if (!isFinite(value)) return "";
  const abs = Math.abs(value);
  if (abs !== 0 && (abs >= 1e5 || abs < 1e-4)) return value.toExponential(2);
  const digits = span ? Math.min(8, Math.max(3, Math.ceil(Math.log10(Math.max(abs, span) / span)) + 2)) : 3;
  return String(Number(value.toPrecision(digits)));
}

function lineChart(id, title, series, options) {
  const opts = Object.assign({ width: 420, height: 200, xLabel: "step" }, options || {});
  const card = document.createElement("div");
  card.className = "card chart";
  card.id = "chart-" + id;
  const heading = document.createElement("h3");
  heading.textContent = title;
  card.appendChild(heading);
  const clean = series
    .map((s) => ({ name: s.name, points: s.points.filter((p) => p[1] !== null && isFinite(p[1])) }))
    .filter((s) => s.points.length > 0);
  const total = clean.reduce((n, s) => n + s.points.length, 0);
  card.dataset.points = String(total);
  if (total === 0) {
    const empty = document.createElement("div");
    empty.className = "empty";
    empty.textContent = "no data yet";
    card.appendChild(empty);
    return card;
  }
  const all = clean.flatMap((s) => s.points);
  let [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { const pad = Math.abs(y0) * 0.1 || 1; y0 -= pad; y1 += pad; }
  const m = { left: 48, right: 10, top: 8, bottom: 24 };
  const w = opts.width, h = opts.height;
  const sx = (x) => m.left + ((x - x0) / (x1 - x0)) * (w - m.left - m.right);
  const sy = (y) => h - m.bottom - ((y - y0) / (y1 - y0)) * (h - m.top - m.bottom);
  const svg = svgEl("svg", { viewBox: `0 0 ${w} ${h}`, role: "img", "aria-label": title });
  for (let i = 0; i <= 4; i++) {
    const y = y0 + ((y1 - y0) * i) / 4;
    svg.appendChild(svgEl("line", { class: "grid-line", x1: m.left, x2: w - m.right, y1: sy(y), y2: sy(y) }));
    const label = svgEl("text", { x: m.left - 4, y: sy(y) + 3, "text-anchor": "end" });
    label.textContent = niceNumber(y, (y1 - y0) / 4);
    svg.appendChild(label);
  }
  svg.appendChild(svgEl("line", { class: "axis", x1: m.left, x2: w - m.right, y1: h - m.bottom, y2: h - m.bottom }));
  svg.appendChild(svgEl("line", { class: "axis", x1: m.left, x2: m.left, y1: m.top, y2: h - m.bottom }));
  for (const x of new Set([x0, (x0 + x1) / 2, x1].map(Math.round))) { // steps are integers
    const label = svgEl("text", { x: sx(x), y: h - 8, "text-anchor": "middle" });
    label.textContent = String(x);
    svg.appendChild(label);
  }
  const legend = document.createElement("div");
  legend.className = "legend";
  clean.forEach((s, i) => {
    const color = PALETTE[i % PALETTE.length];
    const d = s.points.map((p, j) => `${j ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join("");
    svg.appendChild(svgEl("path", { class: "line", d, stroke: color, "data-series": s.name }));
    const dots = svgEl("g", { fill: color, "data-series": s.name });
    const radius = s.points.length > 60 ? 1.2 : 2.4;
    for (const p of s.points) {
      const dot = svgEl("circle", { class: "point", cx: sx(p[0]).toFixed(1), cy: sy(p[1]).toFixed(1), r: radius });
      const tip = svgEl("title");
      tip.textContent = `${s.name} @ ${opts.xLabel} ${p[0]}: ${niceNumber(p[1])}`;
      dot.appendChild(tip);
      dots.appendChild(dot);
    }
    svg.appendChild(dots);
    const item = document.createElement("span");
    const swatch = document.createElement("i");
    swatch.style.background = color;
    item.appendChild(swatch);
    item.appendChild(document.createTextNode(s.name));
    legend.appendChild(item);
  });
  card.appendChild(svg);
  card.appendChild(legend);
  return card;
}
