// The dashboard: subscribes to /dashboard/events and draws each snapshot: the cards,
// and per engine instance a stacked bar per iteration (decode tokens, prefill-chunk
// tokens, unused token budget) with the iteration time and the TBT target over it.
"use strict";

const RECENT_ROWS = 8;
const $ = (id) => document.getElementById(id);

function ms(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  if (seconds >= 10) return seconds.toFixed(1) + " s";
  return (seconds * 1000).toFixed(seconds < 0.1 ? 1 : 0) + " ms";
}

function pct(x) {
  return (100 * x).toFixed(1) + " %";
}

function engineSection(instance) {
  let el = document.querySelector(`section.engine[data-instance="${instance}"]`);
  if (el) return el;
  el = $("engine-template").content.firstElementChild.cloneNode(true);
  el.dataset.instance = String(instance);
  el.querySelector(".instance").textContent = String(instance);
  $("engines").appendChild(el);
  return el;
}

function drawChart(canvas, iterations, tbtSlo) {
  const ctx = canvas.getContext("2d");
  const W = canvas.width, H = canvas.height;
  const left = 48, right = 56, top = 10, bottom = 22;
  const plotW = W - left - right, plotH = H - top - bottom;
  ctx.clearRect(0, 0, W, H);
  const css = getComputedStyle(document.documentElement);
  const color = (name) => css.getPropertyValue(name).trim();
  let maxUsed = 1, maxBudget = 0, maxTime = tbtSlo > 0 ? tbtSlo * 1.25 : 0;
  for (const it of iterations) {
    maxUsed = Math.max(maxUsed, it.prefill + it.decode);
    maxBudget = Math.max(maxBudget, it.budget);
    maxTime = Math.max(maxTime, it.end - it.start);
  }
  // a budget far above what ran (vLLM's whole-prompt limit is the context length) would
  // flatten the bars: the axis then follows the tokens and the budget is cut at the top
  const maxTokens = maxBudget > 4 * maxUsed ? Math.ceil(maxUsed * 1.25) : Math.max(maxUsed, maxBudget);
  maxTime = maxTime || 1e-3;
  // axes and labels
  ctx.strokeStyle = color("--line");
  ctx.fillStyle = color("--muted");
  ctx.font = "11px system-ui, sans-serif";
  ctx.beginPath();
  ctx.moveTo(left, top); ctx.lineTo(left, top + plotH); ctx.lineTo(left + plotW, top + plotH);
  ctx.lineTo(left + plotW, top);
  ctx.stroke();
  ctx.textAlign = "right";
  ctx.fillText(String(maxTokens), left - 4, top + 10);
  ctx.fillText("0", left - 4, top + plotH);
  ctx.save(); ctx.translate(12, top + plotH / 2); ctx.rotate(-Math.PI / 2);
  ctx.textAlign = "center"; ctx.fillText("tokens", 0, 0); ctx.restore();
  ctx.textAlign = "left";
  ctx.fillText(ms(maxTime), left + plotW + 4, top + 10);
  ctx.fillText("0 ms", left + plotW + 4, top + plotH);
  if (!iterations.length) {
    ctx.textAlign = "center";
    ctx.fillText("no iterations yet", left + plotW / 2, top + plotH / 2);
    return;
  }
  ctx.textAlign = "center";
  ctx.fillText(`step ${iterations[0].step} … ${iterations[iterations.length - 1].step}`,
               left + plotW / 2, H - 6);
  const n = iterations.length;
  const slot = plotW / Math.max(n, 40);
  const bar = Math.max(1, slot * 0.8);
  const y = (tokens) => top + plotH - (tokens / maxTokens) * plotH;
  iterations.forEach((it, i) => {
    const x = left + i * slot + (slot - bar) / 2;
    const used = it.decode + it.prefill;
    if (it.budget > used) {
      const cut = Math.min(it.budget, maxTokens);
      ctx.fillStyle = color("--unused");
      ctx.fillRect(x, y(cut), bar, y(used) - y(cut));
    }
    ctx.fillStyle = color("--decode");
    ctx.fillRect(x, y(it.decode), bar, y(0) - y(it.decode));
    ctx.fillStyle = color("--prefill");
    ctx.fillRect(x, y(used), bar, y(it.decode) - y(used));
  });
  const yt = (s) => top + plotH - (s / maxTime) * plotH;
  if (tbtSlo > 0) {
    ctx.strokeStyle = color("--slo");
    ctx.setLineDash([6, 4]);
    ctx.beginPath(); ctx.moveTo(left, yt(tbtSlo)); ctx.lineTo(left + plotW, yt(tbtSlo)); ctx.stroke();
    ctx.setLineDash([]);
  }
  ctx.strokeStyle = color("--time");
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  iterations.forEach((it, i) => {
    const x = left + i * slot + slot / 2;
    const yy = yt(it.end - it.start);
    if (i === 0) ctx.moveTo(x, yy); else ctx.lineTo(x, yy);
  });
  ctx.stroke();
  ctx.lineWidth = 1;
}

function renderEngine(engine, iterations) {
  const el = engineSection(engine.instance);
  const q = (cls) => el.querySelector("." + cls);
  q("alive").textContent = engine.alive ? "" : "(down)";
  q("running").textContent = String(engine.num_running);
  q("waiting").textContent = String(engine.num_waiting);
  q("kv").textContent = pct(engine.kv_usage);
  q("hits").textContent = engine.prefix_caching
    ? `${engine.prefix_cache_hits} / ${engine.prefix_cache_queries}` : "off";
  q("hits").title = engine.prefix_caching ? pct(engine.prefix_cache_hit_rate) + " of prompt tokens" : "";
  q("iterations").textContent = String(engine.num_iterations);
  q("preemptions").textContent = String(engine.num_preemptions);
  q("budget-card").style.display = engine.tbt_slo > 0 ? "" : "none";
  q("budget").textContent = `${ms(engine.tbt_slo)} / ${engine.budget_mean_chunk.toFixed(0)}`;
  drawChart(el.querySelector("canvas"), iterations, engine.tbt_slo);
  const body = el.querySelector("tbody");
  body.replaceChildren();
  for (const it of iterations.slice(-RECENT_ROWS).reverse()) {
    const tr = document.createElement("tr");
    tr.dataset.step = String(it.step);
    const budget = it.budget ? String(it.budget) : "—";
    for (const v of [it.step, it.prefill, it.decode, budget, it.seqs,
                     (1000 * (it.end - it.start)).toFixed(1)]) {
      const td = document.createElement("td");
      td.textContent = String(v);
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }
}

function render(snap) {
  $("model").textContent = snap.model;
  $("label").textContent = snap.label ? "· " + snap.label : "";
  $("api-links").style.display = snap.api ? "" : "none";
  $("finished").textContent = String(snap.requests.finished);
  $("output-tokens").textContent = String(snap.requests.output_tokens);
  const lat = snap.latency;
  $("ttft-p50").textContent = lat.num_requests ? ms(lat.ttft_s.p50) : "-";
  $("ttft-p99").textContent = lat.num_requests ? ms(lat.ttft_s.p99) : "-";
  $("tbt-p50").textContent = lat.num_gaps ? ms(lat.tbt_s.p50) : "-";
  $("tbt-p99").textContent = lat.num_gaps ? ms(lat.tbt_s.p99) : "-";
  $("window").textContent = `${lat.num_requests} req / ${lat.window_s.toFixed(0)} s`;
  $("error").textContent = snap.error ? "engine: " + snap.error : "";
  setStatus(snap.error ? "error" : "live", snap.error || "live");
  const present = new Set();
  for (const engine of snap.engines) {
    present.add(String(engine.instance));
    renderEngine(engine, snap.iterations[String(engine.instance)] || []);
  }
  for (const el of document.querySelectorAll("section.engine")) {
    if (!present.has(el.dataset.instance)) el.remove();
  }
  document.body.dataset.snapshots = String(Number(document.body.dataset.snapshots || 0) + 1);
}

function setStatus(kind, title) {
  const s = $("status");
  s.className = "status " + kind;
  s.title = title;
}

const keyForm = wireKeyForm(() => connect());

async function connect() {
  for (;;) {
    try {
      const response = await apiFetch("/dashboard/events");
      if (response.status === 401) {
        setStatus("error", "needs the API key");
        keyForm.show();
        return;
      }
      if (!response.ok) throw new Error(await errorMessage(response));
      for await (const snap of readEvents(response)) render(snap);
      throw new Error("the server closed the stream");
    } catch (e) {
      setStatus("error", String(e));
      $("error").textContent = "disconnected: " + e.message + " (retrying)";
      await new Promise((r) => setTimeout(r, 2000));
    }
  }
}

connect();
