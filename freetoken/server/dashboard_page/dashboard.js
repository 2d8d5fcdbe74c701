// The live dashboard: reads /v1/dashboard/events (one engine snapshot per event) and draws it.
// Rates come from the difference of two snapshots, so the server sends only raw counters.
// fetch() rather than EventSource: EventSource cannot send the API key header.
"use strict";

const HISTORY = 120; // snapshots kept for the charts and the heatmap
const history = []; // {time, tokRate, ttftMs, running, waiting, layerRates: [hit rate per layer | null]}
let previous = null;

const $ = (id) => document.getElementById(id);

function authHeaders(token) {
  const key = token || $("api-key").value.trim();
  return key ? { Authorization: "Bearer " + key } : {};
}

function counter(snap, name) {
  const value = snap.metrics.counters[name];
  return typeof value === "number" ? value : 0;
}

function fmt(value, digits) {
  return value === null || value === undefined || Number.isNaN(value) ? "–" : value.toFixed(digits);
}

function bytes(n) {
  if (n === null || n === undefined) return "n/a";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return n.toFixed(i ? 1 : 0) + " " + units[i];
}

// One history entry from two consecutive snapshots.
function step(prev, snap) {
  const dt = prev ? snap.time - prev.time : 0;
  const gauges = snap.metrics.gauges;
  const entry = { time: snap.time, running: gauges.running_requests, waiting: gauges.waiting_requests,
                  tokRate: null, ttftMs: null, fillRate: null, cpuRate: null, hitRate: null, layerRates: [] };
  if (prev && dt > 0) {
    entry.tokRate = (counter(snap, "generation_tokens_total") - counter(prev, "generation_tokens_total")) / dt;
    const h = snap.metrics.histograms.time_to_first_token_seconds;
    const hp = prev.metrics.histograms.time_to_first_token_seconds;
    if (h && hp && h.count > hp.count) entry.ttftMs = 1000 * (h.sum - hp.sum) / (h.count - hp.count);
    const layers = snap.cache.layers, before = prev.cache.layers;
    if (layers && before) {
      let hits = 0, looked = 0, fills = 0, cpu = 0;
      entry.layerRates = layers.hits.map((hit, l) => {
        const dh = hit - (before.hits[l] || 0), dm = layers.misses[l] - (before.misses[l] || 0);
        hits += dh; looked += dh + dm;
        fills += layers.fetched[l] - (before.fetched[l] || 0);
        cpu += layers.cpu_routes[l] - (before.cpu_routes[l] || 0);
        return dh + dm > 0 ? dh / (dh + dm) : null;
      });
      entry.hitRate = looked > 0 ? hits / looked : null;
      entry.fillRate = fills / dt;
      entry.cpuRate = cpu / dt;
    }
  }
  return entry;
}

function gbps(bytesPerSecond) {
  return (bytesPerSecond / 1e9).toFixed(bytesPerSecond < 1e9 ? 3 : 1) + " GB/s";
}

// Live vs profile bandwidth per link: the engine's own timings (cache/live_bandwidth.py) beside
// the profile's figures the split came from.
function bandwidths(cache) {
  const live = cache.live_bandwidth || {}, profile = cache.profile_bandwidth;
  for (const link of ["pcie_fill", "cpu_expert"]) {
    const cell = $(`bw-${link}-live`), found = live[link];
    if (!found) {
      cell.textContent = "not reported";
    } else if (found.estimate) {
      cell.textContent = `${gbps(found.estimate.bytes_per_s)} (${found.estimate.samples} samples)`;
    } else {
      cell.textContent = found.samples_total ? "no recent samples" : "no samples yet";
    }
    cell.title = found ? found.source : "";
    $(`bw-${link}-profile`).textContent = profile ? gbps(profile[`${link}_bytes_per_s`])
      : "none (the split is a parameter, or unused)";
  }
  $("bw-sources").textContent = live.pcie_fill && live.cpu_expert
    ? `Timed: PCIe, ${live.pcie_fill.source}. CPU, ${live.cpu_expert.source}.` : "";
}

function lineChart(canvas, series, colors, label) {
  const ctx = canvas.getContext("2d"), w = canvas.width, h = canvas.height;
  ctx.clearRect(0, 0, w, h);
  const values = series.flat().filter((v) => v !== null && v !== undefined);
  const top = Math.max(1e-9, ...values) * 1.1;
  ctx.fillStyle = "#8b96a1";
  ctx.font = "11px sans-serif";
  ctx.fillText(label + " (max " + (values.length ? Math.max(...values).toFixed(1) : "–") + ")", 6, 13);
  series.forEach((points, k) => {
    ctx.strokeStyle = colors[k];
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let drawing = false;
    points.forEach((v, i) => {
      if (v === null || v === undefined) { drawing = false; return; }
      const x = (i / Math.max(1, HISTORY - 1)) * w, y = h - 2 - (v / top) * (h - 18);
      if (drawing) ctx.lineTo(x, y); else ctx.moveTo(x, y);
      drawing = true;
    });
    ctx.stroke();
  });
}

function heatmap(canvas) {
  const ctx = canvas.getContext("2d"), w = canvas.width, h = canvas.height;
  ctx.clearRect(0, 0, w, h);
  const layers = Math.max(0, ...history.map((e) => e.layerRates.length));
  if (!layers) return;
  const cw = w / HISTORY, ch = h / layers, offset = HISTORY - history.length;
  history.forEach((entry, i) => {
    entry.layerRates.forEach((rate, l) => {
      if (rate === null) return;
      ctx.fillStyle = `hsl(${Math.round(20 + 180 * rate)}, 80%, ${Math.round(18 + 45 * rate)}%)`;
      ctx.fillRect((offset + i) * cw, l * ch, Math.ceil(cw), Math.ceil(ch));
    });
  });
}

function memoryBar(cache) {
  const canvas = $("memory-bar"), ctx = canvas.getContext("2d"), w = canvas.width, h = canvas.height;
  const parts = [["dense weights", cache.dense_bytes, "#6c7bd9"], ["KV", cache.kv_bytes, "#4fb3ff"],
                 ["expert slots", cache.expert_slot_bytes, "#f5b84f"],
                 ["headroom", cache.device_free_bytes, "#2e3a44"]];
  const total = parts.reduce((s, p) => s + (p[1] || 0), 0);
  ctx.clearRect(0, 0, w, h);
  let x = 0;
  for (const [, n, color] of parts) {
    const width = total ? ((n || 0) / total) * w : 0;
    ctx.fillStyle = color;
    ctx.fillRect(x, 0, width, h);
    x += width;
  }
  $("memory-legend").textContent = parts.map(([name, n]) => `${name} ${bytes(n)}`).join(" · ") +
    (cache.device_free_bytes === null ? " (headroom: no device memory to report on CPU)" : "");
}

function timeline(spans) {
  const svg = $("timeline"), ns = "http://www.w3.org/2000/svg";
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  if (!spans.length) {
    $("timeline-note").textContent = "No trace: start serve with --trace FILE to see the last steps here.";
    return;
  }
  const tracks = [...new Set(spans.map((s) => s.track))];
  const start = Math.min(...spans.map((s) => s.start_ms));
  const end = Math.max(...spans.map((s) => s.start_ms + s.dur_ms));
  const w = Number(svg.getAttribute("width")), rowH = 18, labelW = 110;
  svg.setAttribute("height", String(tracks.length * rowH + 4));
  $("timeline-note").textContent = `${spans.length} spans over ${(end - start).toFixed(1)} ms`;
  tracks.forEach((track, row) => {
    const text = document.createElementNS(ns, "text");
    text.setAttribute("x", "2"); text.setAttribute("y", String(row * rowH + 13));
    text.setAttribute("fill", "#8b96a1"); text.setAttribute("font-size", "11");
    text.textContent = track;
    svg.appendChild(text);
  });
  for (const s of spans) {
    const rect = document.createElementNS(ns, "rect");
    const scale = (w - labelW) / Math.max(1e-6, end - start);
    rect.setAttribute("x", String(labelW + (s.start_ms - start) * scale));
    rect.setAttribute("y", String(tracks.indexOf(s.track) * rowH + 2));
    rect.setAttribute("width", String(Math.max(1, s.dur_ms * scale)));
    rect.setAttribute("height", String(rowH - 4));
    rect.setAttribute("fill", s.name.includes("cpu") ? "#f5b84f" : s.name.includes("fill") ? "#ff8a5c" : "#4fb3ff");
    const title = document.createElementNS(ns, "title");
    title.textContent = `${s.track}: ${s.name} ${s.dur_ms.toFixed(3)} ms`;
    rect.appendChild(title);
    svg.appendChild(rect);
  }
}

function show(snap) {
  const entry = step(previous, snap);
  previous = snap;
  history.push(entry);
  if (history.length > HISTORY) history.shift();
  const cache = snap.cache, gauges = snap.metrics.gauges;
  $("model").textContent = `${snap.health.model || ""} · ${snap.health.device || ""}`;
  $("tok-rate").textContent = fmt(entry.tokRate, 1);
  $("ttft").textContent = fmt(entry.ttftMs, 0);
  $("running").textContent = String(gauges.running_requests);
  $("waiting").textContent = String(gauges.waiting_requests);
  $("gen-tokens").textContent = String(counter(snap, "generation_tokens_total"));
  $("hit-rate").textContent = entry.hitRate === null ? "–" : (100 * entry.hitRate).toFixed(0) + "%";
  $("fills").textContent = fmt(entry.fillRate, 1);
  $("cpu-routes").textContent = fmt(entry.cpuRate, 1);
  // auto: the mode it runs now (hybrid's plan at hybrid's share, or at transfer's or cpu's)
  $("policy").textContent = cache.live_policy
    ? `auto: ${cache.live_policy.mode}${cache.live_policy.probing ? " (probing)" : ""}` : cache.policy;
  $("split-ratio").textContent = cache.split_ratio === null || cache.split_ratio === undefined
    ? "no split (this policy does not divide misses)" : `r = ${cache.split_ratio.toFixed(3)} of misses over PCIe`;
  $("split-source").textContent = cache.split_ratio_source ? `(${cache.split_ratio_source})` : "";
  bandwidths(cache);
  $("expert-slots").textContent = String(cache.expert_slots);
  $("kv-tokens").textContent = String(cache.kv_tokens);
  lineChart($("chart-rate"), [history.map((e) => e.tokRate)], ["#4fb3ff"], "tokens/s");
  lineChart($("chart-ttft"), [history.map((e) => e.ttftMs)], ["#f5b84f"], "TTFT ms");
  lineChart($("chart-queue"), [history.map((e) => e.running), history.map((e) => e.waiting)],
            ["#7ddc8c", "#ff8a5c"], "running (green) / waiting (red)");
  heatmap($("heatmap"));
  memoryBar(cache);
  timeline(snap.spans);
}

function setConnection(text, cls) {
  const badge = $("conn");
  badge.textContent = text;
  badge.className = "badge " + cls;
}

async function follow() {
  for (;;) {
    try {
      const interval = new URLSearchParams(location.search).get("interval");
      const url = "/v1/dashboard/events" + (interval ? "?interval=" + encodeURIComponent(interval) : "");
      const response = await fetch(url, { headers: authHeaders() });
      if (!response.ok) throw new Error(`the event stream answered ${response.status}`);
      setConnection("live", "live");
      const reader = response.body.getReader(), decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const event = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          const data = event.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
          if (data) show(JSON.parse(data));
        }
      }
      setConnection("reconnecting", "down");
    } catch (error) {
      setConnection(String(error.message || error), "down");
    }
    await new Promise((resolve) => setTimeout(resolve, 2000));
  }
}

async function resize(event) {
  event.preventDefault();
  const body = {};
  const slots = $("resize-slots").value.trim(), kv = $("resize-kv").value.trim();
  if (slots) body.moe_slots = Number(slots);
  if (kv) body.kv_tokens = Number(kv);
  const result = $("resize-result");
  const response = await fetch("/v1/cache/resize", {
    method: "POST",
    headers: { "Content-Type": "application/json", ...authHeaders($("admin-token").value.trim()) },
    body: JSON.stringify(body),
  });
  const answer = await response.json();
  if (response.ok) {
    result.className = "ok";
    result.textContent = `Resized: ${answer.expert_slots} expert slots, ${answer.kv_tokens} KV tokens.`;
  } else {
    result.className = "refused";
    result.textContent = `Refused (${response.status}): ${answer.error ? answer.error.message : "no reason given"}`;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("resize-form").addEventListener("submit", (event) => {
    resize(event).catch((error) => {
      $("resize-result").className = "refused";
      $("resize-result").textContent = `Resize failed: ${error.message || error}`;
    });
  });
  follow();
});
