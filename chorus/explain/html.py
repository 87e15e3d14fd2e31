"""A walkthrough as one self-contained HTML page: an SVG drawing of every rank (and the
shared-memory window) with its buffers' cells, arrows for what moves in the step, and
controls that step through or play the algorithm.  No network: the data and the script
are inside the page."""

from __future__ import annotations

import html
import json

from chorus.explain.walk import Walkthrough

PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.2em; color: #222; }
h1 { font-size: 1.3em; margin: 0 0 .3em; }
#bar { display: flex; gap: .5em; align-items: center; margin: .6em 0; flex-wrap: wrap; }
#bar button { font-size: 1em; padding: .2em .8em; }
#title { font-weight: 600; min-width: 18em; }
svg { border: 1px solid #ddd; background: #fcfcfc; max-width: 100%; height: auto; }
.cell rect { stroke: #888; stroke-width: .6; transition: fill .4s; }
.cell.changed rect { stroke: #000; stroke-width: 2; }
.cell text { font: 10px monospace; text-anchor: middle; dominant-baseline: central; pointer-events: none; }
.holder > rect { fill: #fff; stroke: #555; }
.holder .name { font: bold 12px sans-serif; }
.buf { font: 10px monospace; fill: #555; text-anchor: end; dominant-baseline: central; }
.arrow { stroke: #d33; stroke-width: 2; fill: none; marker-end: url(#head); opacity: .85; }
.arrow-label { font: 11px monospace; fill: #b00; paint-order: stroke; stroke: #fff; stroke-width: 3px; }
#actions { font: 12px monospace; white-space: pre-wrap; background: #f6f6f6; padding: .5em; max-height: 16em; overflow: auto; }
details pre { background: #f6f6f6; padding: .6em; overflow: auto; }
.legend { color: #555; }
</style></head>
<body>
<h1>__TITLE__</h1>
<div class="legend">__LEGEND__</div>
<div id="bar">
  <button id="first" title="before">&#x23EE;</button><button id="prev">&#x25C0;</button>
  <button id="play">play</button><button id="next">&#x25B6;</button>
  <input id="slider" type="range" min="0" value="0">
  <span id="title"></span>
</div>
<svg id="view" xmlns="http://www.w3.org/2000/svg"></svg>
<div id="actions"></div>
<details><summary>How the algorithm works (its docstring)</summary><pre>__DOC__</pre></details>
<p class="legend">__FOOTER__</p>
<script>
const WALK = __DATA__;
const NS = "http://www.w3.org/2000/svg";
const holders = WALK.holders, nh = holders.length, W = WALK.world;
const hasWindow = holders[nh - 1] === "window";
const states = [WALK.initial].concat(WALK.steps.map(s => s.state));
let longest = 3;
for (const st of states) for (const h of st) for (const b in h) for (const c of h[b]) longest = Math.max(longest, c[0].length);
const CW = Math.max(36, 7 * longest + 10), CH = 20, PAD = 8;
function el(tag, attrs, parent, text) {
  const e = document.createElementNS(NS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}
function bufsOf(h) {  // every buffer a holder ever has, in order
  const names = [];
  for (const st of states) for (const n in st[h]) if (!names.includes(n)) names.push(n);
  return names;
}
const layout = holders.map((name, h) => {
  const bufs = bufsOf(h);
  const cols = Math.max(1, ...bufs.map(b => Math.max(...states.map(st => (st[h][b] || []).length))));
  const lw = 8 + 7 * Math.max(4, ...bufs.map(b => b.length));
  return {bufs, cols, lw, w: lw + cols * CW + 2 * PAD, h: 22 + bufs.length * (CH + 4) + PAD};
});
const rankW = Math.max(...layout.slice(0, W).map(l => l.w)), rankH = Math.max(...layout.slice(0, W).map(l => l.h));
const radius = W <= 2 ? rankW * 0.75 : Math.max(rankW, rankH) * 0.62 / Math.sin(Math.PI / W) + 20;
const winL = hasWindow ? layout[nh - 1] : {w: 0, h: 0};
const R = Math.max(radius, hasWindow ? (winL.w / 2 + rankW / 2 + 30) : 0);
const cx = R + rankW / 2 + 20, cy = R + rankH / 2 + 20;
const pos = layout.map((l, h) => {
  if (h === W) return {x: cx - l.w / 2, y: cy - l.h / 2};
  const a = -Math.PI / 2 + 2 * Math.PI * h / W;
  return {x: cx + R * Math.cos(a) - rankW / 2, y: cy + R * Math.sin(a) - rankH / 2};
});
const svg = document.getElementById("view");
const width = 2 * cx, height = 2 * cy;
svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
svg.setAttribute("width", width);
const defs = el("defs", {}, svg);
const marker = el("marker", {id: "head", viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse"}, defs);
el("path", {d: "M0,0 L10,5 L0,10 z", fill: "#d33"}, marker);
const cells = [];  // cells[h][buf][i] = {g, rect, text}
holders.forEach((name, h) => {
  const l = layout[h], p = pos[h];
  const g = el("g", {class: "holder", transform: `translate(${p.x},${p.y})`}, svg);
  el("rect", {width: h === W ? l.w : rankW, height: h === W ? l.h : rankH, rx: 6}, g);
  el("text", {x: PAD, y: 14, class: "name"}, g, name + (h < W && W <= 26 ? ` (${String.fromCharCode(97 + h)})` : ""));
  cells[h] = {};
  l.bufs.forEach((b, j) => {
    const y = 22 + j * (CH + 4);
    el("text", {x: l.lw, y: y + CH / 2, class: "buf"}, g, b);
    cells[h][b] = [];
    for (let i = 0; i < l.cols; i++) {
      const c = el("g", {class: "cell", transform: `translate(${l.lw + 4 + i * CW},${y})`}, g);
      const rect = el("rect", {width: CW - 2, height: CH}, c);
      const text = el("text", {x: (CW - 2) / 2, y: CH / 2}, c, "");
      cells[h][b].push({g: c, rect, text});
    }
  });
});
const arrowLayer = el("g", {}, svg);
function color(cell) {
  if (!cell) return "none";
  const [label, hue, fill] = cell;
  if (label === "" ) return "none";
  if (fill <= 0) return "#fff";
  if (hue >= 0) return `hsl(${(hue * 360 / Math.max(W, 1) + 20) % 360}, 70%, ${88 - 30 * fill}%)`;
  return `hsl(210, 65%, ${92 - 50 * fill}%)`;
}
function centre(h) { const p = pos[h], l = layout[h]; return {x: p.x + (h === W ? l.w : rankW) / 2, y: p.y + (h === W ? l.h : rankH) / 2}; }
function edge(from, to) {  // the point where the line from centre(from) to centre(to) leaves from's box
  const a = centre(from), b = centre(to);
  const hw = (from === W ? layout[W].w : rankW) / 2, hh = (from === W ? layout[W].h : rankH) / 2;
  const dx = b.x - a.x, dy = b.y - a.y;
  const s = Math.min(hw / Math.abs(dx || 1e-9), hh / Math.abs(dy || 1e-9));
  return {x: a.x + dx * s, y: a.y + dy * s};
}
let at = 0, timer = null;
const slider = document.getElementById("slider");
slider.max = WALK.steps.length;
function show(k) {
  at = Math.max(0, Math.min(WALK.steps.length, k));
  slider.value = at;
  const st = states[at], before = states[Math.max(0, at - 1)];
  holders.forEach((_, h) => {
    for (const b in cells[h]) cells[h][b].forEach((c, i) => {
      const cell = (st[h][b] || [])[i];
      c.rect.setAttribute("fill", color(cell));
      c.rect.style.display = cell ? "" : "none";
      c.text.textContent = cell ? cell[0] : "";
      const old = (before[h][b] || [])[i];
      c.g.classList.toggle("changed", at > 0 && !!cell && (!old || old[0] !== cell[0]));
    });
  });
  arrowLayer.innerHTML = "";
  const step = at > 0 ? WALK.steps[at - 1] : null;
  const seen = new Map();
  if (step) for (const a of step.actions) for (const [f, t] of (a.arrows || [])) {
    const key = f + ">" + t;
    if (!seen.has(key)) seen.set(key, []);
    if (a.content && !seen.get(key).includes(a.content)) seen.get(key).push(a.content);
  }
  for (const [key, labels] of seen) {
    const [f, t] = key.split(">").map(Number);
    const p = edge(f, t), q = edge(t, f);
    const mx = (p.x + q.x) / 2, my = (p.y + q.y) / 2, nx = -(q.y - p.y) * 0.12, ny = (q.x - p.x) * 0.12;
    el("path", {class: "arrow", d: `M${p.x},${p.y} Q${mx + nx},${my + ny} ${q.x},${q.y}`}, arrowLayer);
    const text = labels.slice(0, 3).join(", ") + (labels.length > 3 ? ", ..." : "");
    el("text", {class: "arrow-label", x: mx + nx, y: my + ny}, arrowLayer, text);
  }
  document.getElementById("title").textContent = step ? `${step.title} (${at}/${WALK.steps.length})` + (step.note ? "  " + step.note : "") : `before (0/${WALK.steps.length})`;
  document.getElementById("actions").textContent = step ? step.actions.map(a => a.text).join("\\n") : "every rank holds its input";
}
function play() {
  if (timer) { clearInterval(timer); timer = null; document.getElementById("play").textContent = "play"; return; }
  if (at >= WALK.steps.length) show(0);
  document.getElementById("play").textContent = "pause";
  timer = setInterval(() => { if (at >= WALK.steps.length) play(); else show(at + 1); }, 1400);
}
document.getElementById("first").onclick = () => show(0);
document.getElementById("prev").onclick = () => show(at - 1);
document.getElementById("next").onclick = () => show(at + 1);
document.getElementById("play").onclick = play;
slider.oninput = () => show(Number(slider.value));
document.addEventListener("keydown", e => { if (e.key === "ArrowRight") show(at + 1); if (e.key === "ArrowLeft") show(at - 1); if (e.key === " ") { e.preventDefault(); play(); } });
show(0);
</script>
</body></html>
"""


def render_html(walk: Walkthrough) -> str:
    """The page (a string)."""
    title = (f"chorus explain: {walk.collective} / {walk.algorithm}, {walk.world} ranks, "
             f"{walk.count} element(s) per rank")
    if walk.collective in ("all_reduce", "reduce", "reduce_scatter", "barrier"):
        legend = ("Ranks are a, b, c, ...; a cell shows whose inputs it holds (a+b: ranks 0 and 1, Σ: every "
                  "rank's, ·: nothing yet); darker = more of the result. Arrows: what arrives in the step.")
    else:
        legend = ("Ranks are a, b, c, ...; a cell shows where its data came from (b: rank 1's input, b2: "
                  "block 2 of it, ·: nothing yet); colour = origin rank. Arrows: what arrives in the step.")
    data = json.dumps(walk.to_dict(), ensure_ascii=False).replace("</", "<\\/")
    return (PAGE.replace("__TITLE__", html.escape(title))
            .replace("__LEGEND__", html.escape(legend) + " Keys: left/right arrows, space plays.")
            .replace("__DOC__", html.escape(walk.doc))
            .replace("__FOOTER__", "<br>".join(html.escape(line) for line in walk.footer))
            .replace("__DATA__", data))
