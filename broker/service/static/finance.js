// The finance page's script (broker/service/api_finance.py): reads /v1/usage/summary (by team, provider, day and
// ledger line: the idle cost is the unallocated lines'), /v1/usage/savings and /v1/budgets with the
// token the user pastes (kept in sessionStorage, sent as the bearer header; never in a URL) and draws SVG charts.
// Every name and figure is written with textContent / setAttribute, never parsed as HTML.
"use strict";

(function () {
  const SVG = "http://www.w3.org/2000/svg";
  const KEY = "fedbroker.finance.token";
  const main = document.getElementById("finance");
  const period = { from: main.dataset.from, to: main.dataset.to };
  const statusLine = document.getElementById("status");

  function el(name, attrs, text) {
    const e = document.createElementNS(SVG, name);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
    if (text !== undefined) e.textContent = text;
    return e;
  }

  // Figures as text by broker/money.py's rule (one home; the Playwright test checks both give the same text):
  // every figure of one column or chart with the same decimals, enough for its smallest non-zero figure to keep
  // SIGNIFICANT significant digits, at least LEAST (cents), at most QUANTUM_DECIMALS; half away from zero;
  // never "-0.00", never an exponent. The API's figures are already at 1e-10 (broker.money.exact); a sum made
  // here is brought back to 1e-10 first (scaled), so float noise never shows (no "2.2e-16").
  const QUANTUM_DECIMALS = 10, SIGNIFICANT = 2, LEAST = 2;
  function scaled(x) {  // x in units of 1e-10, as a BigInt (broker.money.exact)
    return BigInt(Number(x).toFixed(QUANTUM_DECIMALS).replace(".", ""));
  }
  function decimalsFor(values) {
    let small = null;
    for (const v of values) {
      if (v === null || v === undefined) continue;
      let n = scaled(v);
      if (n < 0n) n = -n;
      if (n !== 0n && (small === null || n < small)) small = n;
    }
    if (small === null) return LEAST;
    const exponent = small.toString().length - 1 - QUANTUM_DECIMALS;  // 0.0125 -> -2
    return Math.max(LEAST, Math.min(QUANTUM_DECIMALS, SIGNIFICANT - 1 - exponent));
  }
  function figureText(x, decimals) {
    if (x === null || x === undefined) return "unknown";
    const n = scaled(x), neg = n < 0n, unit = 10n ** BigInt(QUANTUM_DECIMALS - decimals);
    const q = ((neg ? -n : n) + unit / 2n) / unit;  // half away from zero
    const digits = q.toString().padStart(decimals + 1, "0");
    const whole = digits.slice(0, digits.length - decimals).replace(/\B(?=(\d{3})+(?!\d))/g, ",");
    return (neg && q !== 0n ? "-" : "") + whole + (decimals ? "." + digits.slice(digits.length - decimals) : "");
  }
  function fmt(x, values) { return figureText(x, decimalsFor(values || [x])); }
  window.fedbrokerFigures = { decimalsFor: decimalsFor, figureText: figureText };

  function say(text, error) {
    statusLine.textContent = text;
    statusLine.className = error ? "error" : "";
  }

  function caption(fig) {
    fig.replaceChildren();
    const c = document.createElement("figcaption");
    c.textContent = fig.dataset.title + " (" + fig.dataset.unit + ")";
    fig.appendChild(c);
  }

  function empty(fig, text) {
    const p = document.createElement("p");
    p.className = "empty";
    p.textContent = text;
    fig.appendChild(p);
  }

  // A bar chart of groups [{key, value}]: one <rect class="bar" data-key data-value> per group.
  function bars(fig, groups) {
    caption(fig);
    if (!groups.length) { empty(fig, "No ledger lines in the period."); return; }
    const W = 460, H = 240, left = 56, bottom = 64, top = 12, right = 8;
    const vals = groups.map(g => g.value);
    const hi = Math.max(0, ...vals), lo = Math.min(0, ...vals);
    const span = (hi - lo) || 1;
    const y = v => top + (hi - v) / span * (H - top - bottom);
    const bw = (W - left - right) / groups.length;
    const places = decimalsFor(vals), f = v => figureText(v, places);  // one number of decimals a chart
    const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: "img",
                            "aria-label": fig.dataset.title });
    svg.appendChild(el("line", { class: "axis", x1: left, x2: W - right, y1: y(0), y2: y(0) }));
    svg.appendChild(el("text", { x: left - 4, y: y(hi) + 4, "text-anchor": "end" }, f(hi)));
    if (lo < 0) svg.appendChild(el("text", { x: left - 4, y: y(lo), "text-anchor": "end" }, f(lo)));
    groups.forEach((g, i) => {
      const x = left + i * bw + bw * 0.1, y0 = y(Math.max(g.value, 0)), h = Math.abs(y(g.value) - y(0));
      const r = el("rect", { class: "bar" + (g.value < 0 ? " negative" : ""), x: x, y: y0, width: bw * 0.8,
                             height: Math.max(h, 0.5), "data-key": g.key, "data-value": g.value });
      r.appendChild(el("title", {}, `${g.key}: ${f(g.value)} ${fig.dataset.unit}`));
      svg.appendChild(r);
      svg.appendChild(el("text", { x: x + bw * 0.4, y: y0 - 3, "text-anchor": "middle" }, f(g.value)));
      svg.appendChild(el("text", { x: x + bw * 0.4, y: H - bottom + 14, "text-anchor": "end",
                                   transform: `rotate(-30 ${x + bw * 0.4} ${H - bottom + 14})` }, g.key));
    });
    fig.appendChild(svg);
  }

  function groupsOf(summary, field) {
    return summary.groups.map(g => ({ key: g.key === null ? "(none)" : g.key === "" ? "(unallocated)" : g.key,
                                      value: g[field] }));
  }

  // USD of the unallocated lines (broker/usage.py UNALLOCATED_LINES) in a summary by line
  const UNALLOCATED = ["idle", "idle_amortised"];
  function idleUsd(byLine) {
    const sum = byLine.groups.filter(g => UNALLOCATED.includes(g.key)).reduce((a, g) => a + scaled(g.cost_usd), 0n);
    return Number(sum) / 10 ** QUANTUM_DECIMALS;
  }

  // Burn-down of each team's monthly cloud budget: USD left at the month's start (the cap), now (cap - spent -
  // committed) and, dashed, at the month's end by the linear forecast (cap - forecast), broker/service/budgets.py.
  function burndown(fig, states) {
    caption(fig);
    if (!states.length) { empty(fig, "No budget set for this scope (GET /v1/budgets is empty)."); return; }
    const W = 460, H = 240, left = 56, bottom = 28, top = 12, right = 150;
    const [yy, mm] = states[0].month.split("-").map(Number);
    const t0 = Date.UTC(yy, mm - 1, 1), t1 = Date.UTC(yy, mm, 1);
    const series = states.map(s => ({ team: s.team, cap: s.cap_usd, pts: [
      { kind: "start", t: t0, v: s.cap_usd },
      { kind: "now", t: Date.parse(s.as_of), v: s.remaining_usd },
      { kind: "forecast", t: t1, v: Number(scaled(s.cap_usd) - scaled(s.forecast_usd)) / 10 ** QUANTUM_DECIMALS }] }));
    const all = series.flatMap(s => s.pts.map(p => p.v));
    const hi = Math.max(0, ...all), lo = Math.min(0, ...all), span = (hi - lo) || 1;
    const x = t => left + (t - t0) / (t1 - t0) * (W - left - right);
    const y = v => top + (hi - v) / span * (H - top - bottom);
    const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: "img",
                            "aria-label": fig.dataset.title });
    const fmt = v => figureText(v, decimalsFor(all));  // one number of decimals for the chart
    svg.appendChild(el("line", { class: "axis", x1: left, x2: W - right, y1: y(0), y2: y(0) }));
    svg.appendChild(el("text", { x: left - 4, y: y(hi) + 4, "text-anchor": "end" }, fmt(hi)));
    svg.appendChild(el("text", { x: left, y: H - 8 }, states[0].month + "-01"));
    svg.appendChild(el("text", { x: W - right, y: H - 8, "text-anchor": "end" }, "month end"));
    series.forEach((s, i) => {
      const g = el("g", { class: `series s${i % 6}`, "data-team": s.team });
      const [a, b, c] = s.pts;
      g.appendChild(el("polyline", { class: "actual", points: `${x(a.t)},${y(a.v)} ${x(b.t)},${y(b.v)}` }));
      g.appendChild(el("polyline", { class: "forecast", points: `${x(b.t)},${y(b.v)} ${x(c.t)},${y(c.v)}` }));
      for (const p of s.pts) {
        const dot = el("circle", { class: "point", cx: x(p.t), cy: y(p.v), r: 3.5, "data-team": s.team,
                                   "data-point": p.kind, "data-value": p.v });
        dot.appendChild(el("title", {}, `${s.team} ${p.kind}: ${fmt(p.v)} USD left`));
        g.appendChild(dot);
      }
      g.appendChild(el("text", { x: x(c.t) + 4, y: y(c.v) + 4 }, `${s.team} ${fmt(c.v)}`));
      svg.appendChild(g);
    });
    fig.appendChild(svg);
    const n = document.createElement("p");
    n.className = "note";
    n.textContent = "Cloud spend only, this calendar month (UTC) whatever the period above; forecast = spent + " +
      "committed + the month-to-date rate of spend carried to the month's end.";
    fig.appendChild(n);
  }

  function totals(t, idle) {
    const row = document.createElement("tr");
    for (const v of [fmt(t.cost_usd), fmt(idle), fmt(t.gpu_hours), fmt(t.energy_kwh), fmt(t.carbon_kg), t.lines,
                     t.unpriced_lines, t.estimated_lines]) {
      const td = document.createElement("td");
      td.textContent = String(v);
      row.appendChild(td);
    }
    document.querySelector("#totals tbody").replaceChildren(row);
  }

  function savingsTable(sv) {
    const row = document.createElement("tr");
    for (const v of [sv.gpu_hours, sv.actual_usd, sv.cheapest_cloud_usd, sv.onprem_only_usd,
                     sv.saved_vs_cheapest_cloud_usd, sv.saved_vs_onprem_only_usd, sv.not_compared_gpu_hours]) {
      const td = document.createElement("td");
      td.textContent = fmt(v);
      row.appendChild(td);
    }
    document.querySelector("#savings tbody").replaceChildren(row);
    const notes = [...sv.reasons, ...sv.rate_notes].map(t => {
      const li = document.createElement("li");
      li.textContent = t;
      return li;
    });
    document.getElementById("savings-notes").replaceChildren(...notes);
  }

  async function get(path, token) {
    const r = await fetch(path, { headers: { Authorization: "Bearer " + token }, cache: "no-store",
                                  credentials: "omit", referrerPolicy: "no-referrer" });
    if (!r.ok) {
      let detail = r.statusText;
      try { const b = await r.json(); detail = typeof b.detail === "string" ? b.detail : JSON.stringify(b.detail); }
      catch (e) { /* not JSON */ }
      const err = new Error(`${path.split("?")[0]}: ${r.status} ${detail}`);
      err.status = r.status;
      throw err;
    }
    return r.json();
  }

  async function load(token) {
    say("Loading...");
    const q = by => `/v1/usage/summary?by=${by}&from=${encodeURIComponent(period.from)}` +
                    `&to=${encodeURIComponent(period.to)}`;
    try {
      const sq = `/v1/usage/savings?from=${encodeURIComponent(period.from)}&to=${encodeURIComponent(period.to)}`;
      const [team, provider, day, line, budgets, sv] = await Promise.all(
        [get(q("team"), token), get(q("provider"), token), get(q("day"), token), get(q("line"), token),
         get("/v1/budgets", token), get(sq, token)]);
      document.getElementById("scope").textContent = team.team === null
        ? "All teams (admin or finance token)." : `Team ${team.team} only (your token's team).`;
      totals(team.total, idleUsd(line));
      bars(document.getElementById("chart-team"), groupsOf(team, "cost_usd"));
      bars(document.getElementById("chart-provider"), groupsOf(provider, "cost_usd"));
      bars(document.getElementById("chart-line"), groupsOf(line, "cost_usd"));
      bars(document.getElementById("chart-day-cost"), groupsOf(day, "cost_usd"));
      bars(document.getElementById("chart-day-gpu"), groupsOf(day, "gpu_hours"));
      bars(document.getElementById("chart-day-kwh"), groupsOf(day, "energy_kwh"));
      bars(document.getElementById("chart-day-co2"), groupsOf(day, "carbon_kg"));
      burndown(document.getElementById("chart-budget"), budgets);
      bars(document.getElementById("chart-savings"), sv.units ? [
        { key: "actual", value: sv.actual_usd }, { key: "all on cheapest cloud now", value: sv.cheapest_cloud_usd },
        { key: "on-prem only", value: sv.onprem_only_usd }] : []);
      savingsTable(sv);
      document.getElementById("report").hidden = false;
      const t = team.total;
      say(t.unpriced_lines || t.unknown_energy_lines || t.unknown_carbon_lines
        ? `Loaded. Not counted (unknown, never summed as 0): ${t.unpriced_lines} line(s) of unknown cost, ` +
          `${t.unknown_energy_lines} of unknown energy, ${t.unknown_carbon_lines} of unknown carbon.`
        : "Loaded.");
      main.dataset.loaded = "true";
    } catch (e) {
      if (e.status === 401) sessionStorage.removeItem(KEY);
      document.getElementById("report").hidden = true;
      say(e.message, true);
      main.dataset.loaded = "error";
    }
  }

  document.getElementById("login").addEventListener("submit", ev => {
    ev.preventDefault();
    const input = document.getElementById("token");
    const token = input.value.trim();
    input.value = "";
    if (!token) return;
    sessionStorage.setItem(KEY, token);
    load(token);
  });
  document.getElementById("forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY);
    document.getElementById("report").hidden = true;
    say("Token forgotten.");
  });
  const kept = sessionStorage.getItem(KEY);
  if (kept) load(kept); else say("Paste an API token to see the figures.");
})();
