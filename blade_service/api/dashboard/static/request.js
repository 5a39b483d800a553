/* Request page: live progress and the training-dynamics charts (uPlot), polled from the JSON API. */
"use strict";
(() => {
  const initial = JSON.parse(document.getElementById("initial").textContent);
  const rid = initial.id;
  const COLORS = { L_fgt: "#1f6feb", L_ret: "#1a7f4b", epsilon: "#9a6700", lambda: "#7446c8", ttrans: "#7446c8" };
  const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
  const STEP_INCRS = [1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 5000, 10000];  // whole steps only
  let events = normalise(initial.events || []);
  let status = initial.status;
  let charts = null;

  function num(v) { return typeof v === "number" && Number.isFinite(v) ? v : null; }

  // Events arrive as flat history records or as {step, record: {...}}; keyed by step (a resumed run re-sends).
  function normalise(items) {
    const byStep = new Map();
    for (const item of items) {
      const rec = Object.assign({}, item.record || {}, item);
      delete rec.record;
      if (typeof rec.step === "number") byStep.set(rec.step, rec);
    }
    return [...byStep.values()].sort((a, b) => a.step - b.step);
  }

  // T_trans: as the method recorded it, else BLADE's rule (first step ending 3 consecutive steps with r > epsilon).
  function transitionStep(recs) {
    for (const r of recs) {
      for (const k of ["T_trans", "t_trans"]) if (num(r[k]) !== null) return r[k];
    }
    let streak = 0;
    for (const r of recs) {
      const ok = num(r.r) !== null && num(r.epsilon) !== null && r.r > r.epsilon;
      streak = ok ? streak + 1 : 0;
      if (streak >= 3) return r.step;
    }
    return null;
  }

  function columns(recs) {
    const steps = recs.map((r) => r.step);
    return {
      losses: [steps, recs.map((r) => num(r.L_fgt)), recs.map((r) => num(r.L_ret)), recs.map((r) => num(r.epsilon))],
      lambda: [steps, recs.map((r) => num(r.lambda))],
    };
  }

  // Draws T_trans as a dashed vertical line with a label.
  function ttransPlugin() {
    return {
      hooks: {
        draw: [(u) => {
          const t = transitionStep(events);
          if (t === null) return;
          const x = Math.round(u.valToPos(t, "x", true));
          if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) return;
          const ctx = u.ctx;
          ctx.save();
          ctx.strokeStyle = COLORS.ttrans;
          ctx.lineWidth = 1.5 * devicePixelRatio;
          ctx.setLineDash([6 * devicePixelRatio, 4 * devicePixelRatio]);
          ctx.beginPath();
          ctx.moveTo(x, u.bbox.top);
          ctx.lineTo(x, u.bbox.top + u.bbox.height);
          ctx.stroke();
          ctx.setLineDash([]);
          ctx.fillStyle = COLORS.ttrans;
          ctx.font = `${11 * devicePixelRatio}px system-ui, sans-serif`;
          ctx.fillText(`T_trans = ${t}`, x + 5 * devicePixelRatio, u.bbox.top + 13 * devicePixelRatio);
          ctx.restore();
        }],
      },
    };
  }

  function makeCharts() {
    const lossesEl = document.getElementById("chart-losses");
    const lambdaEl = document.getElementById("chart-lambda");
    const width = Math.max(320, lossesEl.clientWidth);
    const cols = columns(events);
    const sync = uPlot.sync("dynamics");
    const fmtAxis = (u, vals) => vals.map((v) => Blade.fmt(v, 3));
    const common = {
      width,
      cursor: { sync: { key: sync.key }, drag: { x: true, y: false } },
      legend: { live: false },
      plugins: [ttransPlugin()],
    };
    // L_ret and its budget epsilon share the left axis; L_fgt (often on another scale) has the right one.
    const losses = new uPlot(Object.assign({}, common, {
      height: 270,
      title: "Losses",
      scales: { x: { time: false }, ret: {}, fgt: {} },
      series: [
        { label: "step" },
        { label: "L_fgt (right axis)", scale: "fgt", stroke: COLORS.L_fgt, width: 1.75 },
        { label: "L_ret", scale: "ret", stroke: COLORS.L_ret, width: 1.75 },
        { label: "ε", scale: "ret", stroke: COLORS.epsilon, width: 1.5, dash: [8, 5], points: { show: false } },
      ],
      axes: [
        { label: "outer step", incrs: STEP_INCRS },
        { scale: "ret", label: "L_ret, ε", size: 60, values: fmtAxis },
        { scale: "fgt", label: "L_fgt", side: 1, size: 60, values: fmtAxis, grid: { show: false } },
      ],
    }), cols.losses, lossesEl);
    // Same plot width as the losses chart (an empty right axis), so the two x axes line up.
    const lambda = new uPlot(Object.assign({}, common, {
      height: 180,
      title: "Dual variable λ",
      scales: { x: { time: false } },
      series: [
        { label: "step" },
        { label: "λ", stroke: COLORS.lambda, width: 1.75, fill: "rgba(116,70,200,0.08)" },
      ],
      axes: [
        { label: "outer step", incrs: STEP_INCRS },
        { label: "λ", size: 60, values: fmtAxis },
        { side: 1, size: 60, values: (u, vals) => vals.map(() => ""), grid: { show: false }, ticks: { show: false } },
      ],
    }), cols.lambda, lambdaEl);
    sync.sub(losses);
    sync.sub(lambda);
    window.addEventListener("resize", () => {
      const w = Math.max(320, lossesEl.clientWidth);
      losses.setSize({ width: w, height: 270 });
      lambda.setSize({ width: w, height: 180 });
    });
    return { losses, lambda };
  }

  function redraw() {
    const empty = document.getElementById("chart-empty");
    const lambdaEl = document.getElementById("chart-lambda");
    if (!events.length) {
      const text = TERMINAL.has(status) ? "No training steps were run."
        : "No steps yet: the chart draws as the worker reports them.";
      document.getElementById("chart-losses").innerHTML = `<div class="chart-empty" id="chart-empty">${text}</div>`;
      lambdaEl.style.display = "none";
      return;
    }
    if (empty) empty.remove();
    lambdaEl.style.display = "";
    if (!charts) { charts = makeCharts(); } else {
      const cols = columns(events);
      charts.losses.setData(cols.losses);
      charts.lambda.setData(cols.lambda);
    }
    const t = transitionStep(events);
    const last = events[events.length - 1];
    document.getElementById("chart-status").textContent =
      `${events.length} steps · last step ${last.step}` + (t !== null ? ` · T_trans ${t}` : "");
    document.getElementById("chart-losses").dataset.points = String(events.length);
  }

  function isoTime(v) { return v ? new Date(v).toISOString().replace("T", " ").replace(/\.\d+Z$/, " UTC") : "—"; }

  function duration(s) {
    return s < 90 ? `${Math.round(s)} s` : s < 5400 ? `${(s / 60).toFixed(1)} min` : `${(s / 3600).toFixed(1)} h`;
  }

  function elapsed(startIso, endIso) {
    if (!startIso) return "—";
    return duration(Math.max(0, ((endIso ? new Date(endIso) : new Date()) - new Date(startIso)) / 1000));
  }

  function showStatus(d) {
    const st = d.status || d.state;
    const p = (typeof d.progress === "object" && d.progress) || {};
    const step = num(d.step) ?? num(p.step) ?? (events.length ? events[events.length - 1].step : 0);
    const total = num(d.total_steps) ?? num(p.total_steps) ?? num(p.total) ?? initial.total_steps;
    const frac = st === "succeeded" ? 1 : (total ? Math.min(1, step / total) : 0);
    const bar = document.getElementById("progress");
    bar.className = "progress large " + st;
    bar.firstElementChild.style.width = (frac * 100).toFixed(1) + "%";
    const eta = num(p.eta_seconds);
    const where = d.converged === true
      ? `step ${step}, converged` + (total ? ` (cap ${total})` : "")  // the cap is no total it fell short of
      : (total ? `step ${step} of ${total}` : `step ${step}`);
    document.getElementById("progress-text").textContent = where
      + (eta !== null && st === "running" ? ` · ETA ${duration(eta)}` : "");
    const badge = document.querySelector("#status-badge .badge");
    if (badge) { badge.className = "badge " + st; badge.textContent = st; }
    if (d.started_at !== undefined) {
      document.getElementById("meta-started").textContent = isoTime(d.started_at);
      document.getElementById("meta-elapsed").textContent = elapsed(d.started_at, d.finished_at);
    }
    if (num(d.attempts) !== null) document.getElementById("meta-attempts").textContent = d.attempts;
    const queue = document.getElementById("meta-queue");
    if (queue && !d.queue_position) queue.remove();
    const cancelBtn = document.getElementById("cancel-btn");
    if (cancelBtn) {
      if (TERMINAL.has(st)) cancelBtn.remove();
      else if (st === "cancelling") { cancelBtn.disabled = true; cancelBtn.textContent = "Cancelling…"; }
    }
    return st;
  }

  // The "before" metrics are measured ahead of step 1: swap the panel in from the server once they exist.
  async function refreshMetrics() {
    const r = await fetch(location.pathname + "?fragment=1", { credentials: "same-origin", headers: { Accept: "text/html" } });
    if (r.ok) document.getElementById("metrics-panel").innerHTML = await r.text();
  }

  // Only the steps after the last one shown; every 30th poll takes them all (a resumed run re-sends steps).
  let polls = 0;
  async function poll() {
    try {
      const after = polls++ % 30 === 0 || !events.length ? "" : `?after_step=${events[events.length - 1].step}`;
      const [req, ev] = await Promise.all([
        Blade.api("GET", `/unlearn-requests/${rid}`),
        Blade.api("GET", `/unlearn-requests/${rid}/events${after}`),
      ]);
      const list = Array.isArray(ev) ? ev : (ev.events || ev.items || ev.records || ev.history || []);
      events = normalise(after ? events.concat(list) : list);
      redraw();
      const st = showStatus(req);
      if (TERMINAL.has(st) && !TERMINAL.has(status)) { setTimeout(() => location.reload(), 600); return; }
      if (!document.getElementById("metrics") && (st === "running" || st === "evaluating")) refreshMetrics().catch(() => {});
      status = st;
    } catch (err) {
      if (err.status === 401) { location.href = "/dashboard/login?next=" + encodeURIComponent(location.pathname); return; }
    }
    if (!TERMINAL.has(status)) setTimeout(poll, 1000);
  }

  const cancel = document.getElementById("cancel-btn");
  if (cancel) {
    cancel.addEventListener("click", async () => {
      if (!confirm("Cancel this request? Training stops at the next step and no adapter is created.")) return;
      cancel.disabled = true;
      try {
        const d = await Blade.api("POST", `/unlearn-requests/${rid}/cancel`);
        Blade.toast(`Cancel requested: the request is ${d.status || "cancelling"}.`, "info");
        showStatus(d);
      } catch (err) {
        cancel.disabled = false;
        Blade.toast(err.message, "bad");
      }
    });
  }

  redraw();
  if (!TERMINAL.has(status)) setTimeout(poll, 1000);
})();
