// The gpuctl web console: plain JavaScript, no build step, no framework.
// Every piece of data comes from the master's /api (a gateway to the same
// gRPC API gpuctl calls, with this tab's token); pages are chosen by the
// URL's hash: #/ (the cluster), #/jobs, #/jobs/ID, #/services,
// #/services/NAME, #/submit, #/usage.
"use strict";

const TOKEN_KEY = "gpuctl-token";
const POLL_MS = 3000;
const JOB_POLL_MS = 2000;
// The most log text kept on a job's page; older text is dropped.
const MAX_LOG_CHARS = 2 * 1024 * 1024;
const TERMINAL = new Set(["SUCCEEDED", "FAILED", "CANCELLED"]);

// ------------------------------------------------------------------ helpers

// An element: h("td", {class: "x"}, "text", child...). Text is always set
// as text (job names and logs are other people's words), never as HTML.
function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v;
    else if (k === "dataset") Object.assign(el.dataset, v);
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : String(c));
  }
  return el;
}

const $ = (sel, root = document) => root.querySelector(sel);

function fmtAge(ms) {
  if (!ms) return "";
  const s = Math.max(0, Math.round((Date.now() - ms) / 1000));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m`;
  if (s < 86400) return `${Math.floor(s / 3600)}h`;
  return `${Math.floor(s / 86400)}d`;
}

function fmtTime(ms) {
  return ms ? new Date(ms).toLocaleString() : "";
}

function gib(mib) {
  return mib === 0 ? "0" : (mib / 1024).toFixed(mib >= 10240 ? 0 : 1);
}

function fmtRes(r) {
  const parts = [];
  if (r.gpus) parts.push(`${r.gpus} GPU${r.gpus === 1 ? "" : "s"}`);
  parts.push(`${r.cpus} cpu${r.cpus === 1 ? "" : "s"}`);
  if (r.mem_mib) parts.push(`${r.mem_mib} MiB`);
  if (r.ports) parts.push(`${r.ports} port${r.ports === 1 ? "" : "s"}`);
  return parts.join(", ");
}

function badge(state) {
  return h("span", { class: `badge s-${String(state).toLowerCase()}` }, state);
}

// A bar from 0 to 100 with its label.
function meter(pct, label) {
  const p = Math.max(0, Math.min(100, pct));
  const level = p >= 90 ? "hot" : p >= 60 ? "warm" : "ok";
  const fill = h("div", { class: `fill ${level}` });
  // Through the CSSOM: the page's policy forbids style attributes.
  fill.style.width = `${p}%`;
  return h("div", { class: "meter", title: label }, fill, h("span", {}, label));
}

// A line chart in SVG, drawn here (no library): `series` is
// [{name, cls, points: [number|null]}], one point per `periodMs` from
// `startMs`, values 0..`max`; a null is a gap. The element carries the
// last value of each series as data-last-<name>, for tests and tooltips.
const SVG = "http://www.w3.org/2000/svg";
function svg(tag, attrs, ...children) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
  for (const c of children) el.append(c);
  return el;
}
function chart(series, { startMs, periodMs, max = 100, unit = "%", width = 480, height = 120 }) {
  const n = Math.max(2, ...series.map((s) => s.points.length));
  const pad = 28;
  const x = (i) => pad + (i * (width - pad - 4)) / (n - 1);
  const y = (v) => 4 + (height - 20) * (1 - Math.min(v, max) / max);
  const root = svg("svg", { class: "chart", viewBox: `0 0 ${width} ${height}`, width, height, role: "img" });
  for (const v of [0, max / 2, max]) {
    root.append(svg("line", { class: "grid-line", x1: pad, x2: width - 4, y1: y(v), y2: y(v) }));
    root.append(svg("text", { class: "axis", x: 2, y: y(v) + 4 }, `${Math.round(v)}${unit}`));
  }
  if (startMs && periodMs) {
    const span = (n - 1) * periodMs;
    root.append(svg("text", { class: "axis", x: pad, y: height - 2 }, fmtTime(startMs)));
    root.append(svg("text", { class: "axis", x: width - 4, y: height - 2, "text-anchor": "end" },
      fmtTime(startMs + span)));
  }
  for (const s of series) {
    // One polyline per run of readings: gaps stay gaps.
    let run = [];
    const flush = () => {
      if (run.length === 1) run.push(run[0].replace(/^([\d.]+)/, (m) => String(Number(m) + 1)));
      if (run.length) root.append(svg("polyline", { class: `line ${s.cls}`, points: run.join(" ") }));
      run = [];
    };
    s.points.forEach((v, i) => {
      if (v === null || v === undefined) flush();
      else run.push(`${x(i).toFixed(1)},${y(v).toFixed(1)}`);
    });
    flush();
    const last = [...s.points].reverse().find((v) => v !== null && v !== undefined);
    root.setAttribute(`data-last-${s.name}`, last === undefined ? "" : String(last));
  }
  if (periodMs) root.setAttribute("data-period-ms", String(periodMs));
  return root;
}

function legend(items) {
  return h("div", { class: "legend" }, items.map(([cls, text]) => h("span", { class: `key ${cls}` }, text)));
}

function randomHex(bytes) {
  const b = new Uint8Array(bytes);
  crypto.getRandomValues(b);
  return Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
}

// ---------------------------------------------------------------------- API

class ApiError extends Error {
  constructor(status, message, data) {
    super(message);
    this.status = status;
    this.data = data || null;
  }
}

function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

function headers(extra) {
  const hd = Object.assign({ Accept: "application/json" }, extra || {});
  const t = token();
  if (t) hd.Authorization = `Bearer ${t}`;
  return hd;
}

async function api(path, opts = {}) {
  const init = { headers: headers(opts.headers), signal: opts.signal };
  if (opts.body !== undefined) {
    init.method = "POST";
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(opts.body);
  }
  let resp;
  try {
    resp = await fetch(path, init);
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ApiError(0, `the console's master does not answer (${e.message})`);
  }
  let data = null;
  try {
    data = await resp.json();
  } catch (_) {
    data = null;
  }
  if (!resp.ok) {
    const msg = (data && data.error) || `${resp.status} ${resp.statusText}`;
    throw new ApiError(resp.status, msg, data);
  }
  return data;
}

// ----------------------------------------------------------- banner, login

function showBanner(msg) {
  const b = $("#banner");
  b.textContent = msg;
  b.hidden = !msg;
}

// An error of a page's call: a missing or refused token opens the login
// box with the master's words; anything else goes in the banner.
function report(err) {
  if (err && err.name === "AbortError") return;
  if (err instanceof ApiError && err.status === 401) {
    openLogin(err.message);
    showBanner("");
    return;
  }
  showBanner(err instanceof Error ? err.message : String(err));
}

function openLogin(message) {
  $("#login").hidden = false;
  const e = $("#login-error");
  e.textContent = message || "";
  e.hidden = !message;
  $("#token-input").focus();
}

function closeLogin() {
  $("#login").hidden = true;
}

async function whoami() {
  try {
    const w = await api("/api/whoami");
    let text;
    if (w.kind === "open") text = "open cluster (no tokens)";
    else if (w.token) text = `${w.token.role}${w.token.tenant ? ` · ${w.token.tenant}` : ""} · ${w.token.id}`;
    else text = w.kind;
    $("#who").textContent = text;
    return w;
  } catch (e) {
    $("#who").textContent = "";
    throw e;
  }
}

async function login(ev) {
  ev.preventDefault();
  const value = $("#token-input").value.trim();
  if (!value) {
    openLogin("Paste a token first.");
    return;
  }
  sessionStorage.setItem(TOKEN_KEY, value);
  try {
    await whoami();
    $("#token-input").value = "";
    closeLogin();
    showBanner("");
    route();
  } catch (e) {
    sessionStorage.removeItem(TOKEN_KEY);
    openLogin(e.message);
  }
}

// ------------------------------------------------------------------- router

// The page now shown: its timers and streams stop when another is shown.
let page = { stop() {} };

function route() {
  page.stop();
  showBanner("");
  const [path, query] = (location.hash.replace(/^#/, "") || "/").split("?");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  let view = "overview";
  if (parts[0] === "jobs" && parts[1]) view = "job";
  else if (parts[0] === "jobs") view = "jobs";
  else if (parts[0] === "services" && parts[1]) view = "service";
  else if (parts[0] === "services") view = "services";
  else if (parts[0] === "submit") view = "submit";
  else if (parts[0] === "usage") view = "usage";
  for (const a of document.querySelectorAll("nav a")) {
    a.classList.toggle("active", a.dataset.nav === view || (view === "job" && a.dataset.nav === "jobs") ||
      (view === "service" && a.dataset.nav === "services"));
  }
  document.body.dataset.view = view;
  delete document.body.dataset.loaded;
  const root = $("#view");
  root.replaceChildren();
  if (view === "overview") page = overviewPage(root);
  else if (view === "jobs") page = jobsPage(root, new URLSearchParams(query || ""));
  else if (view === "job") page = jobPage(root, parts[1]);
  else if (view === "services") page = servicesPage(root);
  else if (view === "service") page = servicePage(root, parts[1]);
  else if (view === "usage") page = usagePage(root, new URLSearchParams(query || ""));
  else page = submitPage(root);
}

// Calls `load` now and every `ms` until the page goes; `load` returns
// false to stop polling.
function poller(load, ms) {
  let timer = null;
  let stopped = false;
  const tick = async () => {
    let again = true;
    try {
      again = (await load()) !== false;
      document.body.dataset.loaded = "1";
      showBanner("");
    } catch (e) {
      report(e);
    }
    if (!stopped && again) timer = setTimeout(tick, ms);
  };
  tick();
  return () => {
    stopped = true;
    clearTimeout(timer);
  };
}

// ------------------------------------------------------------- the cluster

function overviewPage(root) {
  const summary = h("div", { class: "cards", id: "summary" });
  let windowSel = "1h";
  const windowPick = h("select", { id: "util-window", "aria-label": "window" },
    [["1h", "last hour"], ["1d", "last day"], ["7d", "last week (hourly)"]].map(([w, label]) => h("option", { value: w }, label)));
  windowPick.addEventListener("change", () => { windowSel = windowPick.value; });
  const masters = h("tbody");
  const agents = h("tbody");
  const gpus = h("tbody");
  root.append(
    h("h1", {}, "Cluster"),
    summary,
    h("h2", {}, "GPUs"),
    h("table", { id: "gpus", class: "grid" },
      h("thead", {}, h("tr", {},
        ["Agent", "GPU", "Model", "Utilization", "Memory", "Temp", "Power", "Health", "Task"].map((c) => h("th", {}, c)))),
      gpus),
    h("div", { class: "title-row" }, h("h2", {}, "Utilization"), windowPick),
    h("div", { id: "cluster-chart", class: "chart-box" }),
    h("div", { id: "gpu-charts", class: "charts" }),
    h("h2", {}, "Agents"),
    h("table", { id: "agents", class: "grid" },
      h("thead", {}, h("tr", {},
        ["Agent", "Host", "State", "GPUs", "CPUs", "Memory", "Runtimes", "Driver", "Registered"].map((c) => h("th", {}, c)))),
      agents),
    h("h2", {}, "Masters"),
    h("table", { id: "masters", class: "grid" },
      h("thead", {}, h("tr", {}, ["Id", "Address", "Role", "Term", "Applied"].map((c) => h("th", {}, c)))),
      masters),
  );
  const stop = poller(async () => {
    const [a, g, m, u] = await Promise.all([api("/api/agents"), api("/api/gpus"), api("/api/masters"),
      api(`/api/utilization?window=${windowSel}`)]);
    renderGpus(gpus, g.gpus);
    renderUtilization(u, g.gpus);
    renderAgents(agents, a.agents);
    renderMasters(masters, m.masters);
    const busy = g.gpus.filter((x) => x.task_id).length;
    const bad = g.gpus.filter((x) => x.health !== "healthy").length;
    const active = a.agents.filter((x) => x.state === "ACTIVE").length;
    const leader = m.masters.find((x) => x.role === "leader");
    summary.replaceChildren(
      card("GPUs", `${busy} / ${g.gpus.length} busy`, bad ? `${bad} not healthy` : "all healthy"),
      card("Agents", `${active} / ${a.agents.length} active`, ""),
      card("Masters", `${m.masters.length}`, leader ? `leader: master ${leader.id}` : "no leader known"),
    );
  }, POLL_MS);
  return { stop };
}

// The cluster's GPUs held against busy, and a curve per GPU.
function renderUtilization(u, gpus) {
  const c = u.cluster;
  $("#cluster-chart").replaceChildren(
    h("div", { class: "chart-title" }, "GPUs held by tasks against GPUs busy (sum of utilization)"),
    chart([
      { name: "allocated", cls: "l-alloc", points: c.allocated },
      { name: "used", cls: "l-used", points: c.used },
    ], { startMs: c.start_ms, periodMs: c.period_ms, max: Math.max(1, gpus.length), unit: "" }),
    legend([["l-alloc", "held"], ["l-used", "busy"]]));
  const names = new Map(gpus.map((s) => [s.uuid, `${s.hostname || s.agent_id} GPU ${s.index}`]));
  const list = u.gpus.filter((s) => names.has(s.gpu));
  if (!list.length) {
    $("#gpu-charts").replaceChildren(h("p", { class: "muted" },
      "No readings yet: agents send them with their heartbeats, recorded once a period (--utilization-period)."));
    return;
  }
  $("#gpu-charts").replaceChildren(...list.map((s) => h("div", { class: "chart-box", dataset: { gpu: s.gpu } },
    h("div", { class: "chart-title", title: s.gpu }, names.get(s.gpu)),
    chart([
      { name: "util", cls: "l-util", points: s.util },
      { name: "mem", cls: "l-mem", points: s.mem },
    ], { startMs: s.start_ms, periodMs: s.period_ms, width: 320, height: 100 }))));
}

function card(title, value, note) {
  return h("div", { class: "card" }, h("div", { class: "card-title" }, title),
    h("div", { class: "card-value" }, value), h("div", { class: "card-note" }, note));
}

function empty(tbody, cols, text) {
  tbody.replaceChildren(h("tr", {}, h("td", { colspan: cols, class: "muted" }, text)));
}

function renderGpus(tbody, list) {
  if (!list.length) return empty(tbody, 9, "No GPUs: no agent has registered one.");
  tbody.replaceChildren(...list.map((s) => {
    const m = s.sample;
    const util = m ? meter(m.utilization_pct, `${m.utilization_pct}%`) : h("span", { class: "muted" }, "–");
    const mem = m && m.memory_total_mib
      ? meter(100 * m.memory_used_mib / m.memory_total_mib, `${gib(m.memory_used_mib)} / ${gib(m.memory_total_mib)} GiB`)
      : h("span", { class: "muted" }, `${gib(s.memory_mib)} GiB`);
    const task = s.task_id
      ? (s.job_id ? h("a", { href: `#/jobs/${encodeURIComponent(s.job_id)}` }, s.task_id) : s.task_id)
      : h("span", { class: "muted" }, "free");
    const health = h("span", { class: `health h-${s.health}`, title: s.unhealthy_reason || "" }, s.health);
    return h("tr", { dataset: { gpu: s.uuid, agent: s.agent_id } },
      h("td", {}, s.hostname || s.agent_id),
      h("td", { title: s.uuid }, String(s.index)),
      h("td", {}, s.model),
      h("td", { class: "util" }, util),
      h("td", { class: "mem" }, mem),
      h("td", { class: "temp" }, m && m.temperature_c != null ? `${m.temperature_c} °C` : "–"),
      h("td", { class: "power" }, m && m.power_w != null ? `${Math.round(m.power_w)} W` : "–"),
      h("td", { class: "health" }, health),
      h("td", { class: "task" }, task));
  }));
}

function renderAgents(tbody, list) {
  if (!list.length) return empty(tbody, 9, "No agent has registered.");
  tbody.replaceChildren(...list.map((a) => h("tr", { dataset: { agent: a.id } },
    h("td", {}, a.id),
    h("td", {}, a.hostname),
    h("td", {}, badge(a.draining ? `${a.state} (draining)` : a.state)),
    h("td", {}, `${a.allocated.gpus} / ${a.total.gpus}`),
    h("td", {}, `${a.allocated.cpus} / ${a.total.cpus}`),
    h("td", {}, `${gib(a.allocated.mem_mib)} / ${gib(a.total.mem_mib)} GiB`),
    h("td", {}, a.runtimes.join(", ")),
    h("td", {}, a.driver_version || (a.simulated_gpus ? "simulated" : "")),
    h("td", { title: fmtTime(a.registered_at_ms) }, fmtAge(a.registered_at_ms)))));
}

function renderMasters(tbody, list) {
  tbody.replaceChildren(...list.map((m) => h("tr", { class: m.answered ? "self" : "" },
    h("td", {}, String(m.id)),
    h("td", {}, m.address),
    h("td", {}, badge(m.reachable ? m.role : "unreachable")),
    h("td", {}, m.reachable ? String(m.term) : ""),
    h("td", {}, m.reachable ? String(m.applied_index) : ""))));
}

// -------------------------------------------------------------------- jobs

// `params`: the hash's query, e.g. #/jobs?state=QUEUED.
function jobsPage(root, params) {
  const states = ["", "QUEUED", "STARTING", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"];
  const filter = h("select", { id: "state-filter", "aria-label": "state" },
    states.map((s) => h("option", { value: s, selected: s === (params.get("state") || "") }, s || "any state")));
  const tbody = h("tbody");
  const more = h("p", { class: "muted" });
  root.append(
    h("div", { class: "title-row" }, h("h1", {}, "Jobs"), filter,
      h("a", { class: "button", href: "#/submit" }, "Submit a job")),
    h("table", { id: "jobs", class: "grid" },
      h("thead", {}, h("tr", {},
        ["Job", "Name", "State", "GPUs", "Priority", "Tenant", "Age", "Why"].map((c) => h("th", {}, c)))),
      tbody),
    more);
  let stop = () => {};
  const start = () => {
    stop();
    const q = filter.value ? `&state=${encodeURIComponent(filter.value)}` : "";
    stop = poller(async () => {
      const r = await api(`/api/jobs?limit=200${q}`);
      if (!r.jobs.length) empty(tbody, 8, "No jobs.");
      else tbody.replaceChildren(...r.jobs.map(jobRow));
      more.textContent = r.more ? "Showing the newest 200 jobs." : "";
    }, POLL_MS);
  };
  filter.addEventListener("change", start);
  start();
  return { stop: () => stop() };
}

// A running job whose GPUs stayed under the idle threshold (docs/usage.md).
function idleBadge(j) {
  return h("span", { class: "badge s-idle", title: `GPUs idle since ${new Date(j.idle_since_ms).toLocaleString()}` }, "idle");
}

// What each task of a job holds, as `gpuctl jobs list` says it: GPUs, a
// MIG profile or a fraction's memory (and compute); Rx for a gang.
function gpusCell(j) {
  const p = j.placement || {};
  let each = String(j.resources.gpus);
  if (p.mig) each = `mig:${p.mig}`;
  else if (p.gpu_mem_mib) each = `frac:${gib(p.gpu_mem_mib)}GiB${p.gpu_compute_pct ? `/${p.gpu_compute_pct}%` : ""}`;
  return j.replicas > 1 ? `${j.replicas}x${each}` : each;
}

function jobRow(j) {
  return h("tr", { dataset: { job: j.id } },
    h("td", {}, h("a", { href: `#/jobs/${encodeURIComponent(j.id)}` }, j.id)),
    h("td", {}, j.name),
    h("td", { class: "state" }, badge(j.state), j.idle_since_ms ? idleBadge(j) : null),
    h("td", { class: "gpus" }, gpusCell(j)),
    h("td", {}, String(j.priority)),
    h("td", {}, j.tenant),
    h("td", { title: fmtTime(j.submitted_at_ms) }, fmtAge(j.submitted_at_ms)),
    h("td", { class: "why" }, j.reason || j.message || ""));
}

// --------------------------------------------------------------- one job

function jobPage(root, id) {
  const title = h("h1", {}, id);
  const state = h("span", { id: "job-state" });
  const cancel = h("button", { id: "cancel", type: "button", class: "danger", hidden: true }, "Cancel job");
  const why = h("p", { id: "job-why", class: "why" });
  const details = h("dl", { class: "details" });
  const tasks = h("tbody");
  const events = h("tbody");
  const logStatus = h("span", { id: "log-status", class: "muted" });
  const logs = h("pre", { id: "logs", class: "logs" });
  root.append(
    h("div", { class: "title-row" }, title, state, h("span", { class: "spacer" }), cancel),
    why, details,
    h("h2", {}, "Tasks"),
    h("table", { id: "tasks", class: "grid" },
      h("thead", {}, h("tr", {},
        ["Task", "Rank", "Agent", "GPUs", "Ports", "State", "Exit", "Updated", "Message"].map((c) => h("th", {}, c)))),
      tasks),
    h("h2", {}, "GPU utilization"),
    h("div", { id: "job-charts", class: "charts" }, h("p", { class: "muted" }, "No readings yet.")),
    legend([["l-util", "utilization"], ["l-mem", "memory used"]]),
    h("h2", {}, "Events"),
    h("table", { id: "events", class: "grid" },
      h("thead", {}, h("tr", {}, ["Type", "Reason", "Age", "Message"].map((c) => h("th", {}, c)))),
      events),
    h("div", { class: "title-row" }, h("h2", {}, "Output"), logStatus),
    logs);

  let job = null;
  cancel.addEventListener("click", async () => {
    if (!confirm(`Cancel ${id}?`)) return;
    cancel.disabled = true;
    try {
      await api(`/api/jobs/${encodeURIComponent(id)}/cancel`, { body: {} });
    } catch (e) {
      report(e);
    } finally {
      cancel.disabled = false;
    }
  });

  const stopPoll = poller(async () => {
    const [j, u] = await Promise.all([api(`/api/jobs/${encodeURIComponent(id)}`),
      api(`/api/utilization?job=${encodeURIComponent(id)}`)]);
    job = j;
    renderJob(job, { title, state, cancel, why, details, tasks, events });
    if (u.gpus.length) {
      // A fraction's curve is its own processes' share of the shared GPU.
      $("#job-charts").replaceChildren(...u.gpus.map((s) => h("div", { class: "chart-box", dataset: { gpu: s.gpu, task: s.task_id, own: s.own ? "1" : "" } },
        h("div", { class: "chart-title", title: s.gpu }, `${s.task_id}: ${s.gpu}${s.own ? " (its processes' share)" : ""}`),
        chart([
          { name: "util", cls: "l-util", points: s.util },
          { name: "mem", cls: "l-mem", points: s.mem },
        ], { startMs: s.start_ms, periodMs: s.period_ms, width: 420, height: 110 }))));
    }
    return !TERMINAL.has(job.state);
  }, JOB_POLL_MS);
  const stopLogs = followLogs(id, logs, logStatus);
  return { stop: () => { stopPoll(); stopLogs(); } };
}

function renderJob(j, el) {
  el.title.textContent = `${j.name} `;
  el.title.append(h("span", { class: "muted" }, j.id));
  el.state.replaceChildren(badge(j.state), ...(j.idle_since_ms ? [idleBadge(j)] : []));
  // A service's replica is the service's to stop (scale or delete it).
  el.cancel.hidden = TERMINAL.has(j.state) || !!j.service;
  el.why.textContent = j.reason || j.message || "";
  const row = (k, v) => [h("dt", {}, k), h("dd", {}, v)];
  el.details.replaceChildren(
    ...row("Runs", j.image ? `image ${j.image}` : "host process"),
    ...row("Command", h("code", {}, j.command.map(shellQuote).join(" "))),
    ...row("Resources", `${fmtRes(j.resources)} per task`),
    ...row("Replicas", String(j.replicas)),
    ...row("Priority", String(j.priority)),
    ...row("Retries", `${j.retries} of ${j.max_retries}`),
    ...row("Tenant", j.tenant || "–"),
    ...(j.service ? row("Service", h("a", { id: "job-service", href: `#/services/${encodeURIComponent(j.name)}` },
      `${j.name} (${j.service}); restarted whenever it ends`)) : []),
    ...row("Submitted", fmtTime(j.submitted_at_ms)),
    ...(j.placement.gpu_model ? row("GPU model", j.placement.gpu_model) : []),
    ...(Object.keys(j.env).length ? row("Env", Object.entries(j.env).map(([k, v]) => `${k}=${v}`).join(" ")) : []),
  );
  if (!j.tasks.length) empty(el.tasks, 9, "Not placed yet.");
  else el.tasks.replaceChildren(...j.tasks.map((t) => h("tr", { dataset: { task: t.id } },
    h("td", {}, t.id),
    h("td", {}, String(t.rank)),
    h("td", {}, t.agent_id),
    // A fraction of a shared GPU says what its agent enforces of it.
    h("td", { title: t.gpus.join("\n") },
      t.enforcement ? `fraction, enforced: ${t.enforcement}` : String(t.gpus.length)),
    h("td", {}, (t.ports || []).join(",")),
    h("td", { class: "state" }, badge(t.state)),
    h("td", {}, t.exit_code == null ? "" : String(t.exit_code)),
    h("td", { title: fmtTime(t.updated_at_ms) }, fmtAge(t.updated_at_ms)),
    h("td", {}, t.message))));
  renderEvents(el.events, j.events, j.events_dropped);
}

// A job's or a service's events, oldest first.
function renderEvents(tbody, events, dropped) {
  if (!events.length) empty(tbody, 4, "No events.");
  else tbody.replaceChildren(...events.map((e) => h("tr", { class: e.type === "Warning" ? "warning" : "" },
    h("td", {}, e.type),
    h("td", { class: "kind" }, e.reason),
    h("td", { title: fmtTime(e.last_ms) },
      fmtAge(e.last_ms) + (e.count > 1 ? ` (x${e.count} over ${fmtAge(e.first_ms)})` : "")),
    h("td", {}, e.message))));
  if (dropped) {
    tbody.append(h("tr", {}, h("td", { colspan: 4, class: "muted" }, `${dropped} older events dropped`)));
  }
}

function shellQuote(a) {
  return /^[\w@%+=:,./-]+$/.test(a) ? a : `'${a.replace(/'/g, "'\\''")}'`;
}

// Streams the job's output into `pre` (newline-delimited JSON from the
// gateway, read as it comes: fetch can send the token, EventSource not).
function followLogs(id, pre, status) {
  const ctl = new AbortController();
  let chars = 0;
  status.textContent = "waiting for output…";
  const append = (text) => {
    pre.append(document.createTextNode(text));
    chars += text.length;
    // Keep the page light on a long log: drop the oldest pieces.
    while (chars > MAX_LOG_CHARS && pre.firstChild) {
      chars -= pre.firstChild.textContent.length;
      pre.firstChild.remove();
    }
    const atEnd = pre.scrollHeight - pre.scrollTop - pre.clientHeight < 40;
    if (atEnd) pre.scrollTop = pre.scrollHeight;
  };
  (async () => {
    let resp;
    try {
      resp = await fetch(`/api/jobs/${encodeURIComponent(id)}/logs?follow=true`,
        { headers: headers(), signal: ctl.signal });
    } catch (e) {
      if (e.name !== "AbortError") status.textContent = `output unavailable: ${e.message}`;
      return;
    }
    if (!resp.ok) {
      let msg = `${resp.status}`;
      try { msg = (await resp.json()).error || msg; } catch (_) { /* not JSON */ }
      status.textContent = `output unavailable: ${msg}`;
      status.classList.add("error");
      return;
    }
    status.textContent = "streaming…";
    pre.dataset.streaming = "1";
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += decoder.decode(value, { stream: true });
        let nl;
        while ((nl = buf.indexOf("\n")) >= 0) {
          const lineText = buf.slice(0, nl);
          buf = buf.slice(nl + 1);
          if (!lineText) continue;
          const ev = JSON.parse(lineText);
          if (ev.text) append(ev.text);
          else if (ev.end) status.textContent = "end of output";
          else if (ev.error) {
            status.textContent = `output stopped: ${ev.error}`;
            status.classList.add("error");
          }
        }
      }
    } catch (e) {
      if (e.name !== "AbortError") status.textContent = `output stopped: ${e.message}`;
    } finally {
      delete pre.dataset.streaming;
      if (status.textContent === "streaming…") status.textContent = "end of output";
    }
  })();
  return () => ctl.abort();
}

// ---------------------------------------------------------------- services

// Services (docs/services.md): replicas that run until the service is
// deleted, each a job of one task restarted whenever it ends.
function servicesPage(root) {
  const tbody = h("tbody");
  root.append(
    h("div", { class: "title-row" }, h("h1", {}, "Services")),
    h("p", { class: "muted" },
      "Created with gpuctl services create; each replica is a job, started again whenever it ends."),
    h("table", { id: "services", class: "grid" },
      h("thead", {}, h("tr", {},
        ["Name", "Replicas", "GPUs per replica", "Image", "Tenant", "Age"].map((c) => h("th", {}, c)))),
      tbody));
  const stop = poller(async () => {
    const r = await api("/api/services");
    if (!r.services.length) return empty(tbody, 6, "No services.");
    tbody.replaceChildren(...r.services.map(serviceRow));
  }, POLL_MS);
  return { stop };
}

function serviceRow(s) {
  const t = s.template;
  return h("tr", { dataset: { service: s.name } },
    h("td", {}, h("a", { href: `#/services/${encodeURIComponent(s.name)}` }, s.name)),
    h("td", { class: "replicas" }, replicasText(s)),
    h("td", { class: "gpus" }, gpusCell({ resources: t.resources, placement: t.placement, replicas: 1 })),
    h("td", {}, t.image || h("span", { class: "muted" }, "host process")),
    h("td", {}, s.tenant),
    h("td", { title: fmtTime(s.created_at_ms) }, fmtAge(s.created_at_ms)));
}

// Ready against asked, as `gpuctl services list` says it.
function replicasText(s) {
  return `${s.ready}/${s.replicas}`;
}

function servicePage(root, name) {
  const title = h("h1", {}, name);
  const replicasBadge = h("span", { id: "service-replicas", class: "badge" });
  const del = h("button", { id: "delete-service", type: "button", class: "danger" }, "Delete service");
  const details = h("dl", { class: "details" });
  const count = h("input", { id: "scale-replicas", type: "number", min: 0, required: true, "aria-label": "replicas" });
  const scaleButton = h("button", { id: "scale-submit", type: "submit" }, "Scale");
  const scaleError = h("p", { id: "scale-error", class: "error", hidden: true });
  const scaleForm = h("form", { id: "scale-form", class: "form", autocomplete: "off" },
    h("div", { class: "row" },
      h("label", { class: "field" }, h("span", { class: "label" }, "Replicas"), count),
      h("div", { class: "field" }, h("span", { class: "label" }, "\u00a0"), scaleButton)),
    h("span", { class: "hint" }, "More replicas are queued as jobs; fewer stop the newest ones."),
    scaleError);
  const replicas = h("tbody");
  const events = h("tbody");
  root.append(
    h("div", { class: "title-row" }, title, replicasBadge, h("span", { class: "spacer" }), del),
    details,
    h("h2", {}, "Scale"),
    scaleForm,
    h("h2", {}, "Replicas"),
    h("table", { id: "replicas", class: "grid" },
      h("thead", {}, h("tr", {},
        ["Replica", "Job", "State", "Ready", "Agent", "Restarts", "Age", "Why"].map((c) => h("th", {}, c)))),
      replicas),
    h("h2", {}, "Events"),
    h("table", { id: "events", class: "grid" },
      h("thead", {}, h("tr", {}, ["Type", "Reason", "Age", "Message"].map((c) => h("th", {}, c)))),
      events));

  const path = `/api/services/${encodeURIComponent(name)}`;
  let shown = null;
  // The form shows the number asked until something is typed in it.
  let typed = false;
  count.addEventListener("input", () => { typed = true; });
  const load = async () => {
    const s = await api(path);
    if (!typed) count.value = String(s.replicas);
    shown = s;
    renderService(s, { title, replicasBadge, details, replicas, events });
  };
  scaleForm.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    scaleError.hidden = true;
    const n = Number(count.value.trim());
    if (count.value.trim() === "" || !Number.isInteger(n) || n < 0) {
      scaleError.textContent = `replicas: ${JSON.stringify(count.value)} is not a whole number of 0 or more`;
      scaleError.hidden = false;
      return;
    }
    scaleButton.disabled = true;
    try {
      await api(`${path}/scale`, { body: { replicas: n } });
      typed = false;
      await load();
    } catch (e) {
      if (e instanceof ApiError && e.status === 401) report(e);
      scaleError.textContent = e.message;
      scaleError.hidden = false;
    } finally {
      scaleButton.disabled = false;
    }
  });
  del.addEventListener("click", async () => {
    const n = shown ? shown.replicas : 0;
    if (!confirm(`Delete service ${name}? Its ${n} replica${n === 1 ? "" : "s"} will be stopped.`)) return;
    del.disabled = true;
    try {
      await api(`${path}/delete`, { body: {} });
      location.hash = "#/services";
    } catch (e) {
      report(e);
    } finally {
      del.disabled = false;
    }
  });
  const stop = poller(load, JOB_POLL_MS);
  return { stop };
}

function renderService(s, el) {
  const t = s.template;
  el.title.textContent = `${s.name} `;
  el.title.append(h("span", { class: "muted" }, s.id));
  el.replicasBadge.textContent = `${replicasText(s)} ready`;
  el.replicasBadge.className = `badge ${s.ready >= s.replicas ? "s-running" : "s-queued"}`;
  const row = (k, v) => [h("dt", {}, k), h("dd", {}, v)];
  el.details.replaceChildren(
    ...row("Runs", t.image ? `image ${t.image}` : "host process"),
    ...row("Command", h("code", {}, t.command.map(shellQuote).join(" "))),
    ...row("Resources", `${fmtRes(t.resources)} per replica`),
    ...row("Replicas", `${s.replicas} asked, ${s.running} running, ${s.ready} ready`),
    ...row("Checks", checksText(t)),
    ...row("Priority", String(t.priority)),
    ...row("Tenant", s.tenant || "–"),
    ...row("Created", fmtTime(s.created_at_ms)),
    ...(t.placement.gpu_model ? row("GPU model", t.placement.gpu_model) : []),
    ...(Object.keys(t.env).length ? row("Env", Object.entries(t.env).map(([k, v]) => `${k}=${v}`).join(" ")) : []),
  );
  if (!s.replica_jobs.length) empty(el.replicas, 8, "No replicas: scaled to 0.");
  else el.replicas.replaceChildren(...s.replica_jobs.map(replicaRow));
  renderEvents(el.events, s.events, 0);
}

// The template's health checks, as `services get` writes them.
function checksText(t) {
  const checks = [["readiness", t.readiness], ["liveness", t.liveness]].filter(([, c]) => c);
  return checks.length ? checks.map(([k, c]) => `${k} ${c}`).join("; ") : "none (a running replica is ready)";
}

// One replica: its job, whether it serves, where its latest task runs, how
// often it restarted, and why it is not running (or not ready).
function replicaRow(r) {
  const j = r.job;
  const task = j && j.tasks.length ? j.tasks[j.tasks.length - 1] : null;
  const running = j && j.state === "RUNNING";
  const why = running && !r.ready && r.check_failure ? r.check_failure : j ? j.reason || j.message || "" : "";
  return h("tr", { dataset: { replica: String(r.index), job: r.job_id } },
    h("td", {}, String(r.index)),
    h("td", {}, h("a", { href: `#/jobs/${encodeURIComponent(r.job_id)}` }, r.job_id)),
    h("td", { class: "state" }, j ? badge(j.state) : ""),
    h("td", { class: "ready" }, running ? (r.ready ? "yes" : "no") : ""),
    h("td", { class: "agent" }, task ? task.agent_id : ""),
    h("td", { class: "restarts" }, j ? String(j.retries) : ""),
    h("td", { title: j ? fmtTime(j.submitted_at_ms) : "" }, j ? fmtAge(j.submitted_at_ms) : ""),
    h("td", { class: "why" }, why));
}

// ------------------------------------------------------------------ submit

// ----------------------------------------------------------------- usage

// Who used what (`gpuctl usage`): GPU-hours against how busy they were.
function usagePage(root, params) {
  const windowPick = h("select", { id: "usage-window", "aria-label": "window" },
    ["1d", "7d", "30d"].map((w) => h("option", { value: w, selected: w === (params.get("window") || "7d") }, `last ${w}`)));
  const byPick = h("select", { id: "usage-by", "aria-label": "by" },
    ["tenant", "user", "job", "gpu-model"].map((b) => h("option", { value: b, selected: b === (params.get("by") || "tenant") }, `by ${b}`)));
  const rows = h("tbody");
  root.append(
    h("div", { class: "title-row" }, h("h1", {}, "Usage"), h("span", { class: "spacer" }), windowPick, byPick),
    h("p", { class: "muted" }, "GPUs held from launch to end, and how busy they were over that time (docs/usage.md)."),
    h("table", { id: "usage", class: "grid" },
      h("thead", {}, h("tr", {},
        ["Who", "Tenant", "GPU-hours", "Startup", "Share", "GPU utilization", "CPU-hours", "Tasks", "Running"].map((c) => h("th", {}, c)))),
      rows));
  const reload = () => {
    location.hash = `#/usage?window=${windowPick.value}&by=${byPick.value}`;
  };
  windowPick.addEventListener("change", reload);
  byPick.addEventListener("change", reload);
  const stop = poller(async () => {
    const u = await api(`/api/usage?window=${windowPick.value}&by=${byPick.value}`);
    const total = u.rows.reduce((a, r) => a + r.gpu_hours, 0) || 1;
    if (!u.rows.length) return empty(rows, 9, "Nothing ran in this window.");
    rows.replaceChildren(...u.rows.map((r) => h("tr", { dataset: { key: r.key } },
      h("td", {}, r.key || "(no GPU)"),
      h("td", {}, r.tenant || ""),
      h("td", { class: "gpu-hours" }, r.gpu_hours.toFixed(2)),
      h("td", { class: "gpu-startup", title: "GPU-hours held before the tasks ran (image pull, preflight)" },
        (r.gpu_startup_hours || 0).toFixed(2)),
      h("td", {}, meter(100 * r.gpu_hours / total, `${Math.round(100 * r.gpu_hours / total)}%`)),
      h("td", { class: "gpu-util" }, r.gpu_util_pct == null ? h("span", { class: "muted" }, "–")
        : meter(r.gpu_util_pct, `${Math.round(r.gpu_util_pct)}%`)),
      h("td", {}, r.cpu_hours.toFixed(2)),
      h("td", {}, String(r.tasks)),
      h("td", {}, String(r.running)))));
  }, POLL_MS * 5);
  return { stop };
}

function submitPage(root) {
  const field = (label, input, hint) => h("label", { class: "field" },
    h("span", { class: "label" }, label), input, hint ? h("span", { class: "hint" }, hint) : null);
  const num = (id, value, attrs) => h("input", Object.assign({ id, type: "number", value }, attrs || {}));
  const error = h("p", { id: "form-error", class: "error", hidden: true });
  const form = h("form", { id: "submit-form", class: "form", autocomplete: "off" },
    field("Name", h("input", { id: "f-name", required: true, placeholder: "train-resnet" }),
      "letters, digits, '.', '_', '-'"),
    field("Image", h("input", { id: "f-image", placeholder: "busybox" }),
      "a container image; leave empty to run a host process"),
    field("Command", h("textarea", { id: "f-command", rows: 3, required: true, placeholder: "echo hello from $GPUCTL_JOB_ID" })),
    h("label", { class: "check" }, h("input", { id: "f-shell", type: "checkbox", checked: true }),
      " run it with sh -c (else: split on spaces)"),
    h("div", { class: "row" },
      field("GPUs", num("f-gpus", 0, { min: 0 })),
      field("CPUs", num("f-cpus", 1, { min: 0, step: "any" })),
      field("Memory (MiB)", num("f-mem", 0, { min: 0 }), "0: no limit"),
      field("Ports", num("f-ports", 0, { min: 0 }), "host ports per task (GPUCTL_PORTS)"),
      field("Priority", num("f-priority", 0)),
      field("Replicas", num("f-replicas", 1, { min: 1 }), "a gang: all or nothing"),
      field("Retries", num("f-retries", 0, { min: 0 }))),
    field("GPU model", h("input", { id: "f-gpu-model", placeholder: "A100*" }), "a glob; empty: any"),
    field("Environment", h("textarea", { id: "f-env", rows: 3, placeholder: "KEY=VALUE, one a line" })),
    h("div", { class: "row" }, h("button", { id: "f-submit", type: "submit" }, "Submit")),
    error);
  root.append(h("h1", {}, "Submit a job"), form);
  // One key per form shown: submitting twice (a double click, a retry after
  // an unknown outcome) makes one job. The master refuses the key with
  // another job (the form changed after an unknown outcome made the job).
  const requestId = randomHex(16);
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    error.hidden = true;
    let body;
    try {
      body = formJob(requestId);
    } catch (e) {
      error.textContent = e.message;
      error.hidden = false;
      return;
    }
    const button = $("#f-submit");
    button.disabled = true;
    try {
      const r = await api("/api/jobs", { body });
      location.hash = `#/jobs/${encodeURIComponent(r.job_id)}`;
    } catch (e) {
      if (e instanceof ApiError && e.status === 401) report(e);
      // No answer at all, or the gateway's "unknown": the job may exist.
      const unknown = e instanceof ApiError &&
        (e.status === 0 || (e.data && e.data.outcome === "unknown"));
      const why = e.status === 0
        ? `the outcome is unknown: the job may or may not have been made (${e.message})`
        : e.message;
      error.textContent = unknown
        ? `${why}. Press Submit again without changing the form: it resends request id ` +
          `${requestId}, which makes at most one job.`
        : e.message;
      error.hidden = false;
    } finally {
      button.disabled = false;
    }
  });
  document.body.dataset.loaded = "1";
  return { stop() {} };
}

// The form as the gateway's JSON; the master checks the values.
function formJob(requestId) {
  const v = (id) => $(`#${id}`).value;
  const int = (id, name) => {
    const s = v(id).trim();
    if (s === "") return 0;
    const n = Number(s);
    if (!Number.isInteger(n)) throw new Error(`${name}: ${JSON.stringify(s)} is not a whole number`);
    return n;
  };
  const text = v("f-command").trim();
  if (!text) throw new Error("command: say what to run");
  const command = $("#f-shell").checked ? ["sh", "-c", text] : text.split(/\s+/);
  const env = {};
  for (const [i, raw] of v("f-env").split("\n").entries()) {
    const line = raw.trim();
    if (!line) continue;
    const eq = line.indexOf("=");
    if (eq <= 0) throw new Error(`env line ${i + 1}: ${JSON.stringify(line)} is not KEY=VALUE`);
    env[line.slice(0, eq)] = line.slice(eq + 1);
  }
  const cpus = v("f-cpus").trim();
  return {
    name: v("f-name").trim(),
    image: v("f-image").trim(),
    command,
    gpus: int("f-gpus", "gpus"),
    cpus: cpus === "" ? null : Number(cpus),
    mem_mib: int("f-mem", "memory"),
    ports: int("f-ports", "ports"),
    priority: int("f-priority", "priority"),
    replicas: int("f-replicas", "replicas"),
    max_retries: int("f-retries", "retries"),
    gpu_model: v("f-gpu-model").trim(),
    env,
    request_id: requestId,
  };
}

// -------------------------------------------------------------------- start

document.addEventListener("DOMContentLoaded", () => {
  $("#login-form").addEventListener("submit", login);
  $("#login-open").addEventListener("click", () => openLogin(""));
  $("#login-cancel").addEventListener("click", closeLogin);
  $("#logout").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    $("#who").textContent = "";
    openLogin("Token forgotten.");
  });
  window.addEventListener("hashchange", route);
  whoami().catch(report);
  route();
});
