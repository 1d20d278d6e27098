// promptcache studio: three views over the JSON routes of promptcache/server/studio.py.
"use strict";
const $ = (sel) => document.querySelector(sel);
const el = (tag, cls, text) => { const e = document.createElement(tag); if (cls) e.className = cls; if (text != null) e.textContent = text; return e; };
let info = null, cacheTimer = null;

// -- the API key (sessionStorage; asked for when a route answers 401) ---------------------------
function key() { return sessionStorage.getItem("promptcache-key") || ""; }
async function api(path, body) {
  const headers = { "content-type": "application/json" };
  if (key()) headers["authorization"] = "Bearer " + key();
  const r = await fetch(path, body === undefined ? { headers } : { method: "POST", headers, body: JSON.stringify(body) });
  const data = await r.json().catch(() => ({}));
  if (r.status === 401) { $("#key-form").hidden = false; throw new Error("an API key is needed"); }
  if (!r.ok) { const err = new Error((data.error && data.error.message) || r.statusText); err.data = data.error || {}; throw err; }
  return data;
}
$("#key-form").addEventListener("submit", (ev) => {
  ev.preventDefault(); sessionStorage.setItem("promptcache-key", $("#key").value); $("#key-form").hidden = true; start();
});

// -- tabs ----------------------------------------------------------------------------------------
function show(view) {
  for (const t of document.querySelectorAll(".tab")) t.classList.toggle("active", t.dataset.view === view);
  for (const v of document.querySelectorAll(".view")) v.hidden = v.id !== "view-" + view;
  clearInterval(cacheTimer);
  if (view === "cache") { refreshCache(); cacheTimer = setInterval(refreshCache, 1000); }
  location.hash = view;
}
for (const t of document.querySelectorAll(".tab")) t.addEventListener("click", () => show(t.dataset.view));

// -- hover: the tokens of a bar -----------------------------------------------------------------
const tip = $("#tip");
function hover(node, title, pieces) {
  node.addEventListener("mouseenter", () => {
    tip.replaceChildren(el("div", null, title));
    const toks = el("div");
    for (const p of pieces || []) toks.append(el("span", "tok", JSON.stringify(p).slice(1, -1)));
    tip.append(toks); tip.hidden = false;
  });
  node.addEventListener("mousemove", (ev) => { tip.style.left = (ev.clientX + 12) + "px"; tip.style.top = (ev.clientY + 12) + "px"; });
  node.addEventListener("mouseleave", () => { tip.hidden = true; });
}

// -- the position axis ---------------------------------------------------------------------------
function axis(box, end, rowsUsed) {
  box.replaceChildren();
  box.dataset.end = end;
  const raw = Math.max(end / 10, 1), mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = raw / mag < 2 ? mag : raw / mag < 5 ? 2 * mag : 5 * mag;  // about ten ticks
  for (let p = 0; p <= end; p += step) {
    const t = el("span", "tick", String(p)); t.style.left = (100 * p / end) + "%"; box.append(t);
  }
  box.style.height = (rowsUsed * 24 + 8) + "px";
}
function bar(box, end, start, stop, row, cls, label) {
  const b = el("div", "bar " + cls, label);
  b.style.left = (100 * start / end) + "%";
  b.style.width = `calc(${100 * Math.max(stop - start, 0.3) / end}% - 1px)`;
  b.style.top = (4 + row * 24) + "px";
  b.dataset.start = start; b.dataset.end = stop;
  box.append(b);
  return b;
}

// -- schema view ---------------------------------------------------------------------------------
function drawSchema(v) {
  $("#schema-error").hidden = true;
  $("#schema-summary").textContent = `schema '${v.name}': ${v.summary}, ${v.modules.length} modules, ${v.unions.length} unions`;
  const box = $("#schema-axis"), end = Math.max(v.end, 1);
  const modRows = Math.max(0, ...v.modules.map((m) => m.lane + 1));
  const spanTop = modRows + (v.unions.length ? 1 : 0);
  axis(box, end, spanTop + Math.max(1, ...v.spans.map((s) => s.lane + 1)));
  for (const u of v.unions) {
    const b = bar(box, end, u.start, u.end, modRows, "union", `union (${u.members.join(" | ")})`);
    b.dataset.union = u.index;
    hover(b, `union at [${u.start}, ${u.end}) line ${u.line}: members ${u.members.join(", ")}; scaffold ${u.scaffold || "(none)"}`);
  }
  for (const m of v.modules) {
    const b = bar(box, end, m.start, m.end, m.lane, "module" + (m.cache ? "" : " nocache"), `${m.name} ${m.tokens}t`);
    b.dataset.name = m.name;
    const params = Object.entries(m.params).map(([n, l]) => `${n}: ${l} positions`).join(", ");
    hover(b, `module ${m.name} [${m.start}, ${m.end}) line ${m.line}: ${m.tokens} tokens${params ? "; parameters " + params : ""}${m.cache ? "" : "; not cached"}`);
  }
  for (const s of v.spans) {
    const kind = s.kind === "text" ? (s.module ? "k-text" : "k-anon") : "k-" + s.kind;
    const label = s.kind === "param" ? `${s.param} [len ${s.tokens}]` : s.kind === "glue" ? "role" : s.name;
    const b = bar(box, end, s.start, s.end, spanTop + s.lane, "span " + kind, label);
    b.dataset.name = s.name; b.dataset.kind = s.kind;
    hover(b, `${s.name} (${s.kind}) [${s.start}, ${s.end}): ${s.tokens} tokens${s.stored ? ", stored" : ""}`, s.pieces);
  }
}
function schemaError(e) {
  const d = e.data || {};
  const box = $("#schema-error");
  box.hidden = false;
  box.dataset.line = d.line == null ? "" : d.line;
  const each = (d.errors || []).map((x) => x.line != null ? `line ${x.line}: ${x.reason}` : x.reason);
  if (d.more) each.push(`${d.more} more errors not shown`);
  box.textContent = each.length ? each.join("\n") : e.message;  // every error, the first line selected
  $("#schema-axis").replaceChildren(); $("#schema-summary").textContent = "";
  if (d.line != null) {  // select the line in the editor
    const ta = $("#schema-text"), lines = ta.value.split("\n");
    const a = lines.slice(0, d.line - 1).join("\n").length + (d.line > 1 ? 1 : 0);
    ta.focus(); ta.setSelectionRange(a, a + (lines[d.line - 1] || "").length);
  }
}
async function loadSchema() {
  const name = $("#schema-select").value;
  if (!name) return;
  if (info.sources && info.sources[name] != null) $("#schema-text").value = info.sources[name];
  try { drawSchema(await api("/studio/api/schema", { name })); } catch (e) { schemaError(e); }
}
$("#schema-load").addEventListener("click", loadSchema);
$("#schema-show").addEventListener("click", async () => {
  try { drawSchema(await api("/studio/api/schema", { pml: $("#schema-text").value })); } catch (e) { schemaError(e); }
});

// -- prompt view ---------------------------------------------------------------------------------
function promptBody() {
  const text = $("#prompt-text").value, body = {};
  if ($("#prompt-kind").value === "pml") body.pml = text;
  else {
    body.messages = [];
    for (const line of text.split("\n")) {
      const m = line.match(/^(system|user|assistant):\s?(.*)$/);
      if (m) body.messages.push({ role: m[1], content: m[2] });
      else if (body.messages.length) body.messages[body.messages.length - 1].content += "\n" + line;
      else body.messages.push({ role: "user", content: line });
    }
  }
  const r = $("#prompt-recompute").value.trim();
  if (r && r !== "auto") body.recompute = Number(r);
  return body;
}
function drawPrompt(v) {
  $("#prompt-error").hidden = true;
  const box = $("#prompt-axis"), end = Math.max(v.end, 1);
  axis(box, end, 2);
  for (const g of v.gaps) { const b = bar(box, end, g[0], g[1], 0, "gap", "gap"); hover(b, `gap [${g[0]}, ${g[1]}): positions the layout leaves empty`); }
  for (const s of v.spans) {
    const origin = s.drift || s.origin;
    const b = bar(box, end, s.start, s.end, 1, "span o-" + origin + (s.drift ? " drift" : ""), s.name);
    b.dataset.origin = origin; b.dataset.name = s.name;
    hover(b, `${s.name} (${s.kind}, ${s.source}) [${s.start}, ${s.end}): ${s.tokens} tokens; states: ${s.origin}${s.drift ? " (" + s.drift + ")" : ""}`, s.pieces);
  }
  let text = `${v.cached_tokens} cached + ${v.new_tokens} new tokens, positions [0, ${v.end}); ` + (v.exact ? "exact" : "approximate: " + v.why);
  if (v.recompute) text += `; recompute ${v.recompute.fraction}: about ${v.recompute.budget} of ${v.recompute.drifted_tokens} drifted tokens`;
  const s = $("#prompt-summary"); s.textContent = text; s.dataset.exact = v.exact;
}
async function showPrompt() {
  try { drawPrompt(await api("/studio/api/prompt", promptBody())); return true; }
  catch (e) { const b = $("#prompt-error"); b.hidden = false; b.textContent = e.message; return false; }
}
$("#prompt-show").addEventListener("click", showPrompt);

async function readSSE(resp, onEvent) {
  const reader = resp.body.getReader(), dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += dec.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const line = buf.slice(0, i); buf = buf.slice(i + 2);
      if (line.startsWith("data: ") && line !== "data: [DONE]") onEvent(JSON.parse(line.slice(6)));
    }
  }
}
async function post(path, body) {
  const headers = { "content-type": "application/json" };
  if (key()) headers["authorization"] = "Bearer " + key();
  const r = await fetch(path, { method: "POST", headers, body: JSON.stringify(body) });
  if (!r.ok) { const d = await r.json().catch(() => ({})); throw new Error((d.error && d.error.message) || r.statusText); }
  return r;
}
async function sendCached(body, max) {
  const out = $("#answer"), stats = $("#answer-stats");
  out.textContent = ""; stats.textContent = "running ..."; out.dataset.done = "false";
  const req = { model: info.model, stream: true, stream_options: { include_usage: true }, max_tokens: max, temperature: 0 };
  if (body.pml) req.pml = body.pml; else req.messages = body.messages;
  if (body.recompute !== undefined) req.recompute = body.recompute;
  const t0 = performance.now(); let ttft = null;
  const r = await post("/v1/chat/completions", req);
  await readSSE(r, (ev) => {
    if (ev.error) { stats.textContent = "error: " + ev.error.message; return; }
    if (ttft === null) { ttft = performance.now() - t0; stats.textContent = `TTFT ${ttft.toFixed(0)} ms`; }
    const d = ev.choices && ev.choices[0] && ev.choices[0].delta;
    if (d && d.content) out.textContent += d.content;
    if (ev.usage) {
      const u = ev.usage;
      stats.textContent = `TTFT ${ttft.toFixed(0)} ms · ${u.prompt_tokens} prompt tokens · ${u.prompt_tokens_details.cached_tokens} cached · ` +
        `${u.recomputed_tokens} recomputed · ${u.completion_tokens} generated · ${u.exact ? "exact" : "approximate"}`;
      stats.dataset.cached = u.prompt_tokens_details.cached_tokens;
    }
  });
  out.dataset.done = "true";
}
async function sendFull(body, max) {
  const out = $("#full-answer"), stats = $("#full-stats");
  out.textContent = ""; stats.textContent = "running ..."; out.dataset.done = "false";
  const t0 = performance.now();
  const r = await post("/studio/api/full", { ...body, max_tokens: max });
  await readSSE(r, (ev) => {
    if (ev.type === "prefilled") stats.textContent = `TTFT ${(performance.now() - t0).toFixed(0)} ms (prefill ${ev.ttft_ms.toFixed(0)} ms) · ${ev.prompt_tokens} prompt tokens · 0 cached`;
    else if (ev.type === "text") out.textContent += ev.text;
    else if (ev.type === "error") stats.textContent = "error: " + ev.message;
  });
  out.dataset.done = "true";
}
$("#prompt-send").addEventListener("click", async () => {
  if (!(await showPrompt())) return;
  const body = promptBody(), max = Number($("#prompt-max").value) || 32, full = $("#prompt-full").checked;
  $("#full-box").hidden = !full;
  try {
    await sendCached(body, max);  // one after the other: the full prefill's TTFT is not the cached one's queue
    if (full) await sendFull(body, max);
    await showPrompt();  // what is stored now
  } catch (e) { const b = $("#prompt-error"); b.hidden = false; b.textContent = e.message; }
});

// -- cache view ----------------------------------------------------------------------------------
const CODES = { ".": "b-free", r: "b-request", s: "b-shared", p: "b-pinned", i: "b-idle" };
const mib = (n) => n == null ? "unbounded" : (n / 2 ** 20).toFixed(1) + " MiB";
async function refreshCache() {
  let v;
  try { v = await api("/studio/api/cache"); } catch (e) { $("#cache-namespace").textContent = e.message; return; }
  $("#cache-namespace").textContent = `namespace '${v.namespace}' · ${v.totals.requests} requests · ` +
    `${v.totals.cached_tokens} of ${v.totals.prompt_tokens} prompt tokens from stored states` +
    (v.totals.recomputed_tokens ? ` (${v.totals.recomputed_tokens} more laid out from them but recomputed)` : "");
  $("#cache-totals").textContent = v.series.length ? `last ${v.series.length} intervals of 10 s` : "no requests in the last 10 minutes";
  const blocks = $("#cache-blocks");
  blocks.replaceChildren();
  if (v.pool) {
    const c = v.pool.counts;
    $("#cache-counts").textContent = `${c.blocks} blocks of ${v.pool.block_size} tokens: ${c.free} free · ${c.request} running requests' · ` +
      `${c.shared} shared · ${c.pinned} pinned · ${c.idle} idle · ${c.yours} yours · ${v.pool.evictions} evicted so far`;
    for (const ch of v.pool.codes) {
      const b = el("i", CODES[ch.toLowerCase()] + (ch !== ch.toLowerCase() ? " yours" : ""));
      blocks.append(b);
    }
  } else $("#cache-counts").textContent = "this model is served without the KV pool";
  chart(v.series);
  const rows = $("#cache-entries tbody");
  rows.replaceChildren();
  for (const e of (v.pool ? v.pool.entries : [])) addRow(rows, [e.label, e.tokens, `KV pool, ${e.state}${e.refs ? ", read by " + e.refs : ""}`], "pool");
  for (const m of v.modules) addRow(rows, [m.label, m.tokens, m.where], "module");
  const tiers = $("#tiers tbody");
  tiers.replaceChildren();
  for (const t of v.tiers) addRow(tiers, [t.name + (t.shared ? " (shared)" : ""), mib(t.bytes), mib(t.budget), bytesBar(t.bytes, t.budget)]);
  if (v.pins) addRow(tiers, ["pins (cache_control)", mib(v.pins.bytes), mib(v.pins.budget), bytesBar(v.pins.bytes, v.pins.budget)]);
}
function addRow(tbody, cells, cls) {
  const tr = el("tr", cls);
  for (const c of cells) { const td = el("td"); if (c instanceof Node) td.append(c); else td.textContent = c; tr.append(td); }
  tbody.append(tr);
}
function bytesBar(used, budget) {
  const m = el("meter"); m.max = budget || Math.max(used, 1); m.value = used; return m;
}
function chart(series) {
  const svg = $("#hit-chart"), ns = "http://www.w3.org/2000/svg";
  svg.replaceChildren();
  svg.dataset.points = series.length;
  const x = (age) => 600 - age, y = (r) => 110 - 100 * r;  // 600 s window, hit rate 0..1
  for (const [tx, ty, label, anchor] of [[2, 12, "hit rate 100%", "start"], [2, 108, "10 min ago", "start"], [598, 12, "now", "end"]]) {
    const t = document.createElementNS(ns, "text");
    t.setAttribute("x", tx); t.setAttribute("y", ty); t.setAttribute("font-size", "9"); t.setAttribute("fill", "#78909c");
    t.setAttribute("text-anchor", anchor); t.textContent = label; svg.append(t);
  }
  const line = document.createElementNS(ns, "line");
  line.setAttribute("x1", 0); line.setAttribute("x2", 600); line.setAttribute("y1", 10); line.setAttribute("y2", 10);
  line.setAttribute("stroke", "#eceff1"); svg.append(line);
  for (const p of series) {
    const r = document.createElementNS(ns, "rect");
    r.setAttribute("x", x(p.age_s) - 9); r.setAttribute("width", 8);
    r.setAttribute("y", y(p.hit_rate)); r.setAttribute("height", Math.max(110 - y(p.hit_rate), 1));
    r.setAttribute("fill", "#2e7d32");
    const t = document.createElementNS(ns, "title");
    t.textContent = `${p.requests} requests, hit rate ${(100 * p.hit_rate).toFixed(0)}%` + (p.ttft_ms ? `, mean TTFT ${p.ttft_ms.toFixed(0)} ms` : "");
    r.append(t); svg.append(r);
  }
}

// -- start ---------------------------------------------------------------------------------------
async function start() {
  try { info = await api("/studio/api/info"); } catch (e) { $("#whoami").textContent = e.message; return; }
  $("#whoami").textContent = `model '${info.model}' · namespace '${info.namespace}'`;
  const sel = $("#schema-select");
  sel.replaceChildren(...info.schemas.map((n) => el("option", null, n)));
  if (info.schemas.length) {
    await loadSchema();
    if (!$("#prompt-text").value) $("#prompt-text").value = `<prompt schema="${info.schemas[0]}">\n  \n</prompt>`;
  }
  document.body.dataset.ready = "true";
}
show((location.hash || "#schema").slice(1));
start();
