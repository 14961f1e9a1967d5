// hora dashboard: one page, routes by #/..., polls /ui/api/* (no library, no build step).
// Everything from the service is put in the page as text (textContent), never as HTML.
"use strict";

const POLL_MS = 1500;
// behind JupyterHub the service lives under a prefix (/services/hora), and signs in there
const ROOT = document.documentElement.dataset.root || "";
const HUB = document.documentElement.dataset.hub === "1";
let me = null;
let timer = null;
let logs = null; // {job, attempt, next: {rank: offset}}
let jobFilters = { state: "", kind: "", user: "" };
let gen = 0; // moves on at every route change: answers for an older view are dropped
let busy = false; // one refresh at a time (a slow answer must not append a log chunk twice)

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function table(headers, rows, rowClass) {
  return el("table", {},
    el("thead", {}, el("tr", {}, headers.map((h) => el("th", {}, h)))),
    el("tbody", {}, rows.map((r, i) => el("tr", { class: rowClass ? rowClass(i) : null },
      r.map((c) => el("td", {}, c))))));
}

function ago(seconds) {
  if (seconds === null || seconds === undefined) return "";
  seconds = Math.max(0, seconds);
  if (seconds < 120) return `${Math.round(seconds)}s`;
  if (seconds < 5400) return `${Math.round(seconds / 60)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

function since(when) {
  if (!when) return "";
  const t = typeof when === "number" ? when * 1000 : Date.parse(when);
  return `${new Date(t).toLocaleTimeString()} (${ago((Date.now() - t) / 1000)} ago)`;
}

function stateTag(state) { return el("span", { class: `state ${state}` }, state); }

class HttpError extends Error {
  constructor(status, detail) { super(detail); this.status = status; }
}

async function call(path, method, body) {
  const asked = gen;
  const opts = { method: method || "GET", credentials: "same-origin", headers: {} };
  if (method === "POST") {
    opts.headers["X-Hora-CSRF"] = me ? me.csrf : "";
    if (body !== undefined) {
      opts.headers["Content-Type"] = "application/json";
      opts.body = JSON.stringify(body);
    }
  }
  const resp = await fetch(ROOT + path, opts);
  const data = await resp.json().catch(() => ({}));
  if (asked !== gen && opts.method === "GET") throw new HttpError(0, "stale");
  if (resp.status === 401 && path !== "/ui/login") { showLogin(); throw new HttpError(401, "signed out"); }
  if (!resp.ok) {
    const d = data.detail;
    throw new HttpError(resp.status, typeof d === "string" ? d : JSON.stringify(d));
  }
  return data;
}

function showLogin(message) {
  me = null;
  clearInterval(timer);
  document.getElementById("nav").hidden = true;
  document.getElementById("logout").hidden = true;
  document.getElementById("who").textContent = "";
  document.getElementById("main").replaceChildren();
  document.getElementById("login").hidden = false;
  document.getElementById("login-error").textContent = message || "";
  const hub = document.getElementById("hub-login");
  hub.hidden = !HUB;
  hub.querySelector("a").href = `${ROOT}/ui/hub/login`;
}

function signedIn(who) {
  me = who;
  document.getElementById("login").hidden = true;
  document.getElementById("nav").hidden = false;
  document.getElementById("nav-users").hidden = !who.is_admin;
  document.getElementById("logout").hidden = false;
  document.getElementById("who").textContent = `${who.user}${who.is_admin ? " (admin)" : ""}`;
  route();
}

function current() {
  const parts = (location.hash || "#/pool").slice(2).split("/");
  return { view: parts[0] || "pool", id: parts[1] };
}

function route() {
  if (!me) return;
  const { view } = current();
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.view === view || (view === "job" && a.dataset.view === "jobs"));
  logs = null;
  gen += 1;
  busy = false;
  document.getElementById("main").replaceChildren();
  clearInterval(timer);
  refresh();
  timer = setInterval(refresh, POLL_MS);
}

async function refresh() {
  if (busy) return;
  busy = true;
  const mine = gen;
  const { view, id } = current();
  const views = { pool: viewPool, queue: viewQueue, jobs: viewJobs, job: viewJob, sessions: viewSessions, users: viewUsers };
  try {
    await (views[view] || viewPool)(id);
    document.getElementById("status").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (e) {
    if (e.status === 401 || e.status === 0) return;
    document.getElementById("status").textContent = `update failed: ${e.message}`;
    if (e.status === 404 || e.status === 403) {
      clearInterval(timer);
      document.getElementById("main").replaceChildren(el("p", { class: "error", id: "page-error" }, e.message));
    }
  } finally {
    if (mine === gen) busy = false;
  }
}

function page(title, ...content) {
  document.getElementById("main").replaceChildren(el("h1", {}, title), ...content);
}

// --- views --------------------------------------------------------------------------

async function viewPool() {
  const data = await call("/ui/api/pool");
  const nodes = data.nodes.map((node) => {
    const rows = node.slots.map((s) => {
      const h = s.holder;
      const mine = h && (me.is_admin || h.user === me.user); // another user's job is not shown
      // h.what: a holder outside this service (another hora service, a notebook's engines)
      const holder = !h ? "" : h.what ? h.what : mine ? el("a", { href: `#/job/${h.id}` }, `${h.kind} ${h.id}`) : `${h.kind} ${h.id}`;
      const g = s.gpu;
      const mem = g && g.memory_total_mib ? `${Math.round(g.memory_used_mib)} / ${Math.round(g.memory_total_mib)} MiB` : "";
      const util = g && g.utilization_pct !== null ? [el("span", { class: "barbox" }, bar(g.utilization_pct)), `${g.utilization_pct}%`] : "";
      return [`${s.kind} ${s.index}`, s.name, stateTag(s.state), holder, h ? h.user : "", h && !h.what ? since(h.since) : "", mem, util];
    });
    const held = node.slots.filter((s) => s.state !== "free").length;
    return [el("h2", {}, `${node.name} — ${node.slots.length - held} of ${node.slots.length} free`),
      table(["slot", "name", "state", "holder", "user", "since", "GPU memory", "utilisation"], rows, (i) => node.slots[i].state)];
  });
  const parked = (data.parked || []).map((p) => [
    me.is_admin || p.user === me.user ? el("a", { href: `#/job/${p.id}` }, `session ${p.id}`) : `session ${p.id}`,
    p.name, p.user, since(p.since), mib(p.bytes),
  ]);
  const held = parked.length ? [el("h2", {}, "Parked sessions (holding no slot)"),
    table(["session", "name", "user", "parked since", "snapshot"], parked)] : [];
  page("Pool", el("div", { id: "pool" }, nodes, el("div", { id: "parked" }, held)));
}

function mib(bytes) {
  return bytes >= 1 << 30 ? `${(bytes / (1 << 30)).toFixed(1)} GiB` : `${(bytes / (1 << 20)).toFixed(1)} MiB`;
}

function bar(pct) {
  const b = el("span", { class: "bar" });
  b.style.width = `${Math.max(0, Math.min(100, pct)) * 0.8}px`;
  return b;
}

function reasonCell(r) {
  if (!r) return "";
  return el("span", { class: "reason" }, el("span", { class: "kind" }, r.kind), r.text);
}

async function viewQueue() {
  const entries = await call("/ui/api/queue");
  const rows = entries.map((e) => [
    e.position,
    e.id ? el("a", { href: `#/job/${e.id}` }, `${e.kind} ${e.id}`) : el("span", { class: "muted" }, "another user's"),
    e.name || "", e.user || "", e.need, e.priority, e.queued_at ? since(e.queued_at) : "",
    reasonCell(e.reason),
  ]);
  page("Queue", entries.length ? table(["#", "job", "name", "user", "slots", "priority", "queued", "why it waits"], rows)
    : el("p", { class: "muted", id: "queue-empty" }, "Nothing is waiting."));
  document.querySelector("#main table")?.setAttribute("id", "queue");
}

async function viewJobs() {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(jobFilters)) if (v) q.set(k, v);
  const data = await call(`/ui/api/jobs?${q}`);
  const filters = document.getElementById("filters") || jobFilterBar();
  const rows = data.items.map((j) => [
    el("a", { href: `#/job/${j.id}` }, String(j.id)), j.kind, j.name, j.user, stateTag(j.state),
    `${j.workers}x${j.gpus_per_worker}`, j.priority, j.attempt, since(j.created_at), j.reason || "",
  ]);
  page("Jobs", filters, table(["id", "kind", "name", "user", "state", "workers", "priority", "attempt", "submitted", "reason"], rows),
    el("p", { class: "muted" }, `${data.items.length} shown of ${data.total}`));
  document.querySelector("#main table").setAttribute("id", "jobs");
}

function jobFilterBar() {
  const states = ["", "queued", "starting", "running", "retrying", "succeeded", "failed", "cancelled"];
  const pick = (name, values) => el("select", { id: `filter-${name}`, onchange: (e) => { jobFilters[name] = e.target.value; refresh(); } },
    values.map((v) => { const o = el("option", { value: v }, v || `any ${name}`); o.selected = jobFilters[name] === v; return o; }));
  const bar = el("div", { class: "filters", id: "filters" }, pick("state", states), pick("kind", ["", "job", "session"]));
  if (me.is_admin) {
    const input = el("input", { id: "filter-user", placeholder: "user", value: jobFilters.user,
      onchange: (e) => { jobFilters.user = e.target.value.trim(); refresh(); } });
    bar.append(input);
  }
  return bar;
}

async function viewJob(id) {
  const job = await call(`/ui/api/jobs/${encodeURIComponent(id)}`);
  if (!logs || logs.job !== job.id || logs.attempt !== job.attempt) {
    logs = { job: job.id, attempt: job.attempt, next: {}, done: {}, built: false, timeline: false };
  }
  if (!logs.built) buildJobPage(job);
  fillJob(job);
  await pollLogs(job);
  if (!logs.timeline && job.spec.env && job.spec.env.HOROVOD_TIMELINE && job.state !== "queued") await drawTimeline(job);
}

function buildJobPage(job) {
  const ranks = Math.min(job.spec.workers, 16);
  const panes = [];
  for (let r = 0; r < ranks; r++) {
    panes.push(el("div", { class: "rank" }, el("h3", { id: `log-head-${r}` }, `rank ${r}`), el("pre", { id: `log-${r}` })));
  }
  const cancel = el("button", { id: "cancel", class: "danger", type: "button", onclick: () => act(job.id, "cancel") },
    job.kind === "session" ? "Stop session" : "Cancel");
  const resubmit = el("button", { id: "resubmit", type: "button", onclick: () => act(job.id, "resubmit") }, "Resubmit");
  page(`${job.kind} ${job.id} — ${job.spec.name}`,
    el("div", { class: "box" }, "state: ", el("span", { id: "job-state" }), " ", el("span", { id: "job-reason", class: "muted" })),
    el("div", { class: "box wait", id: "job-wait", hidden: true }),
    el("div", { class: "box", id: "job-session", hidden: true }),
    el("div", { class: "actions" }, cancel, resubmit, el("span", { id: "action-msg", class: "muted" })),
    el("div", { class: "box", id: "job-preflight", hidden: true }),
    el("div", { class: "grid2" },
      el("div", {}, el("h2", {}, "Transitions"), el("div", { id: "transitions" }), el("h2", {}, "Exit codes"), el("div", { id: "exit-codes" })),
      el("div", {}, el("h2", {}, "Spec"), el("pre", { class: "spec", id: "spec" }, JSON.stringify(job.spec, null, 2)))),
    el("h2", {}, "Logs", job.spec.workers > ranks ? ` (first ${ranks} of ${job.spec.workers} ranks)` : ""),
    el("div", { class: "ranks" }, panes),
    el("div", { id: "timeline-box" }),
    el("div", { id: "scaling-box" }));
  logs.built = true;
}

function fillJob(job) {
  const state = document.getElementById("job-state");
  state.className = `state ${job.state}`;
  state.textContent = job.state;
  document.getElementById("job-reason").textContent = `attempt ${job.attempt}${job.reason ? " — " + job.reason : ""}`;
  const wait = document.getElementById("job-wait");
  const q = job.queue;
  wait.hidden = !q;
  if (q) {
    const pos = q.position ? `position ${q.position} in the queue; ` : "";
    wait.replaceChildren(el("strong", {}, "Waiting: "), pos, reasonCell(q.why || { kind: "wait", text: q.reason }));
    wait.lastChild.id = "queue-reason";
  }
  const s = job.session;
  const box = document.getElementById("job-session");
  const p = job.park;
  box.hidden = !(s && job.state === "running") && !(p && job.state === "parked");
  if (p && job.state === "parked") box.textContent = `parked since ${new Date(Date.parse(p.parked_at)).toLocaleString()} (${p.reason}); snapshot ${mib(p.bytes)} of ${p.world} ranks; the next %%distributed cell resumes it`;
  else if (s) box.textContent = `engines idle ${ago(s.idle_s)}` + (s.stop_in_s !== null ? `; parked or stopped in ${ago(s.stop_in_s)} unless a cell runs` : "; no idle timeout");
  document.getElementById("cancel").hidden = ["succeeded", "failed", "cancelled"].includes(job.state);
  document.getElementById("resubmit").hidden = !job.can_resubmit;
  document.getElementById("transitions").replaceChildren(table(["state", "at", "reason"],
    job.transitions.map((t) => [stateTag(t.state), new Date(Date.parse(t.at)).toLocaleTimeString(), t.reason || ""])));
  fillPreflight(job.preflight, job.kind);
  const codes = Object.entries(job.exit_codes || {});
  document.getElementById("exit-codes").replaceChildren(codes.length
    ? table(["rank", "exit code"], codes.map(([r, c]) => [r, c === null ? "running" : c]))
    : el("p", { class: "muted" }, ["starting", "running"].includes(job.state) ? "every rank is running" : "no rank has run yet"));
}

// The communication preflight rank 0 logged at hora.torch.init(): its line, what is far below
// its reference, and each rank's figures on each path.
function fillPreflight(p, kind) {
  const box = document.getElementById("job-preflight");
  box.hidden = !p;
  if (!p) return;
  const slow = (p.findings || []).map((f) => el("li", { class: "slow" }, f.text));
  const rows = [];
  for (const path of p.paths) {
    for (const r of path.ranks) {
      rows.push([path.path, r.rank, r.host, r.latency_us.toFixed(0), r.copy_gbps.toFixed(2), r.busbw_gbps.toFixed(2), r.wait_s.toFixed(3)]);
    }
  }
  const failed = p.failed ? [el("p", { class: "error", id: "preflight-failed" }, `${kind === "session" ? "failed %dist_start" : "failed the job"}: ${p.failed}`)] : [];
  box.replaceChildren(el("h2", {}, "Preflight"), el("p", { id: "preflight-line" }, p.line), ...failed,
    slow.length ? el("ul", { id: "preflight-slow" }, slow) : el("p", { class: "muted" }, "no rank or link far below its reference"),
    table(["path", "rank", "host", "latency us", "copy GB/s", "busbw GB/s", "waited s"], rows));
}

async function pollLogs(job) {
  const ranks = Math.min(job.spec.workers, 16);
  if (job.state === "queued") return;
  await Promise.all([...Array(ranks).keys()].map(async (r) => {
    if (logs.done[r]) return;
    for (let i = 0; i < 8; i++) { // drain what is there, up to 2 MiB a poll
      const chunk = await call(`/ui/api/jobs/${job.id}/logs?rank=${r}&offset=${logs.next[r] || 0}`);
      if (logs.job !== job.id) return;
      const pre = document.getElementById(`log-${r}`);
      if (chunk.text && pre) {
        const bottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
        pre.append(chunk.text);
        if (bottom) pre.scrollTop = pre.scrollHeight;
      }
      logs.next[r] = chunk.next;
      if (chunk.complete) logs.done[r] = true;
      if (!chunk.text || chunk.complete) break;
    }
  }));
}

async function act(id, what) {
  const msg = document.getElementById("action-msg");
  try {
    const done = await call(`/ui/api/jobs/${id}/${what}`, "POST");
    msg.textContent = what === "resubmit" ? `submitted job ${done.id}` : `${done.state}`;
    if (what === "resubmit") location.hash = `#/job/${done.id}`;
    else refresh();
  } catch (e) {
    msg.textContent = `${what} failed: ${e.message}`;
  }
}

async function drawTimeline(job) {
  const data = await call(`/ui/api/jobs/${job.id}/timeline`);
  const box = document.getElementById("timeline-box");
  if (box && data.error) {  // the job named a file the service does not read (a link, a FIFO...)
    logs.timeline = true;
    box.replaceChildren(el("h2", {}, "Timeline"), el("p", { id: "timeline-error", class: "muted" }, data.error));
    return;
  }
  if (!box || !data.events.length) return;
  logs.timeline = ["succeeded", "failed", "cancelled"].includes(job.state);
  const ev = data.events;
  const t0 = Math.min(...ev.map((e) => e.ts));
  const t1 = Math.max(...ev.map((e) => e.ts + e.dur));
  const ranks = [...new Set(ev.map((e) => e.rank))].sort((a, b) => a - b);
  const W = 1000, lane = 26, left = 60;
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("class", "timeline");
  svg.setAttribute("viewBox", `0 0 ${W + left} ${ranks.length * lane + 20}`);
  const colors = { QUEUED: "#c9cfdb", MEMCPY_IN_FUSION_BUFFER: "#f0b35b", MEMCPY_OUT_FUSION_BUFFER: "#f0b35b", PREFLIGHT: "#8fbf9f" };
  ranks.forEach((r, i) => {
    const label = document.createElementNS(ns, "text");
    label.setAttribute("x", 4); label.setAttribute("y", i * lane + 17);
    label.textContent = `rank ${r}`;
    svg.append(label);
  });
  for (const e of ev) {
    const rect = document.createElementNS(ns, "rect");
    const x = left + ((e.ts - t0) / Math.max(1, t1 - t0)) * W;
    rect.setAttribute("x", x.toFixed(1));
    rect.setAttribute("y", ranks.indexOf(e.rank) * lane + 4);
    rect.setAttribute("width", Math.max(0.5, (e.dur / Math.max(1, t1 - t0)) * W).toFixed(1));
    rect.setAttribute("height", lane - 8);
    rect.setAttribute("fill", colors[e.name] || "#2f5fd0");
    const title = document.createElementNS(ns, "title");
    title.textContent = `rank ${e.rank} ${data.rows[`${e.rank}:${e.row}`] || ""} ${e.name} ${(e.dur / 1000).toFixed(2)} ms`;
    rect.append(title);
    svg.append(rect);
  }
  box.replaceChildren(el("h2", {}, `Timeline (${span(t1 - t0)}, ${ev.length} events${data.truncated ? ", cut" : ""})`), svg);
  await drawScaling(job);
}

// The job's scaling report, computed from its timeline as %%distributed --profile computes a
// cell's (hora.scaling): the per-rank table, a bar per rank, and the slowest rank and why.
async function drawScaling(job) {
  const r = await call(`/ui/api/jobs/${job.id}/scaling`);
  const box = document.getElementById("scaling-box");
  if (!box || !r) return;
  const headers = Object.keys(r.rows[0] || {});
  const wall = Math.max(1e-9, ...r.ranks.map((x) => x.wall_s));
  const part = (cls, seconds) => {
    const s = el("span", { class: `seg ${cls}`, title: `${cls} ${seconds.toFixed(3)} s` });
    s.style.width = `${(Math.max(0, seconds) / wall) * 100}%`;
    return s;
  };
  const bars = r.ranks.map((x) => el("div", { class: "sbar" }, el("span", { class: "who" }, `rank ${x.rank}`),
    el("span", { class: "track" }, part("compute", x.compute_s), part("transfer", x.comm_s - x.wait_s), part("waiting", x.wait_s))));
  const pre = r.preflight_busbw_gbps ? `; preflight busbw ${r.preflight_busbw_gbps.toFixed(2)} GB/s` : "; no preflight figures";
  box.replaceChildren(el("h2", {}, "Scaling"), el("p", { id: "scaling-verdict" }, r.verdict),
    table(headers, r.rows.map((row) => headers.map((h) => row[h]))),
    el("div", { id: "scaling-bars" }, bars),
    el("p", { class: "muted" }, `compute (blue), transfer (orange), waiting for other ranks (grey); full width ${wall.toFixed(3)} s${pre}`));
  box.querySelector("table").id = "scaling";
}

function span(us) {
  return us >= 1e6 ? `${(us / 1e6).toFixed(2)} s` : `${(us / 1e3).toFixed(2)} ms`;
}

async function viewSessions() {
  const items = await call("/ui/api/sessions");
  const rows = items.map((s) => [
    el("a", { href: `#/job/${s.id}` }, String(s.id)), s.name, s.user, stateTag(s.state), s.workers,
    (s.slots || []).join(","), s.state === "running" ? ago(s.idle_s) : "",
    s.stop_in_s !== null && s.stop_in_s !== undefined ? ago(s.stop_in_s) : (s.state === "running" ? "no timeout" : ""),
    s.park ? mib(s.park.bytes) : "",
    s.warning || s.reason || "",
  ]);
  page("Sessions", items.length ? table(["id", "name", "user", "state", "engines", "slots", "idle", "culled in", "snapshot", "note"], rows)
    : el("p", { class: "muted" }, "No sessions."));
}

async function viewUsers() {
  const data = await call("/ui/api/users");
  const rows = data.users.map((u) => [u.name, u.is_admin ? "admin" : "", u.gpu_quota ?? "default", u.os_uid ?? "", u.idle_timeout_s ? ago(u.idle_timeout_s) : "default"]);
  const limits = Object.entries(data.limits).map(([k, v]) => [k, v === null ? "none" : v]);
  page("Users", table(["user", "role", "GPU quota", "OS uid", "idle timeout"], rows), el("h2", {}, "Service limits"), table(["setting", "value"], limits));
}

// --- start --------------------------------------------------------------------------

async function start() {
  document.getElementById("login-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    const input = document.getElementById("token");
    try {
      const who = await call("/ui/login", "POST", { token: input.value.trim() });
      input.value = "";
      signedIn(who);
    } catch (err) {
      showLogin(err.status === 401 ? "Unknown token." : `Sign-in failed: ${err.message}`);
    }
  });
  document.getElementById("logout").addEventListener("click", async () => {
    await call("/ui/logout", "POST").catch(() => null);
    showLogin();
  });
  window.addEventListener("hashchange", route);
  try {
    signedIn(await call("/ui/api/me"));
  } catch (e) {
    if (e.status !== 401) showLogin(e.message);
  }
}

start();
