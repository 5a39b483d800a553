/* Request page: live progress and the training-dynamics charts (uPlot), polled from the JSON API. */
"use strict";
(() => {
  const initial = JSON.parse(document.getElementById("initial").textContent);
  const rid = initial.id;
  const COLORS = { L_fgt: "#1f6feb", L_ret: "#1a7f4b", epsilon: "#9a6700", lambda: "#7446c8", ttrans: "#7446c8" };
  const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
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
    const common = {
      width,
      cursor: { sync: { key: sync.key }, drag: { x: true, y: false } },
      scales: { x: { time: false } },
      plugins: [ttransPlugin()],
    };
    const losses = new uPlot(Object.assign({}, common, {
      height: 270,
      title: "Losses",
      series: [
        { label: "step" },
        { label: "L_fgt", stroke: COLORS.L_fgt, width: 1.75, value: (u, v) => Blade.fmt(v) },
        { label: "L_ret", stroke: COLORS.L_ret, width: 1.75, value: (u, v) => Blade.fmt(v) },
        { label: "ε", stroke: COLORS.epsilon, width: 1.5, dash: [8, 5], points: { show: false },
          value: (u, v) => Blade.fmt(v) },
      ],
      axes: [{ label: "outer step" }, { label: "loss", size: 56 }],
    }), cols.losses, lossesEl);
    const lambda = new uPlot(Object.assign({}, common, {
      height: 180,
      title: "Dual variable λ",
      series: [
        { label: "step" },
        { label: "λ", stroke: COLORS.lambda, width: 1.75, fill: "rgba(116,70,200,0.08)", value: (u, v) => Blade.fmt(v) },
      ],
      axes: [{ label: "outer step" }, { label: "λ", size: 56 }],
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
    if (!events.length) {
      if (!empty) {
        document.getElementById("chart-losses").innerHTML =
          '<div class="chart-empty" id="chart-empty">No steps yet: the chart draws as the worker reports them.</div>';
      }
      return;
    }
    if (empty) empty.remove();
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

  function showStatus(d) {
    const st = d.status || d.state;
    const p = (typeof d.progress === "object" && d.progress) || {};
    const step = num(d.step) ?? num(p.step) ?? (events.length ? events[events.length - 1].step : 0);
    const total = num(d.total_steps) ?? num(p.total_steps) ?? num(p.total) ?? initial.total_steps;
    const frac = st === "succeeded" ? 1 : (total ? Math.min(1, step / total) : 0);
    const bar = document.getElementById("progress");
    bar.className = "progress large " + st;
    bar.firstElementChild.style.width = (frac * 100).toFixed(1) + "%";
    document.getElementById("progress-text").textContent = total ? `step ${step} of ${total}` : `step ${step}`;
    const badge = document.querySelector("#status-badge .badge");
    if (badge) { badge.className = "badge " + st; badge.textContent = st; }
    return st;
  }

  async function poll() {
    try {
      const [req, ev] = await Promise.all([
        Blade.api("GET", `/unlearn-requests/${rid}`),
        Blade.api("GET", `/unlearn-requests/${rid}/events`),
      ]);
      const list = Array.isArray(ev) ? ev : (ev.events || ev.items || ev.records || ev.history || []);
      events = normalise(list);
      redraw();
      const st = showStatus(req);
      if (TERMINAL.has(st) && !TERMINAL.has(status)) { setTimeout(() => location.reload(), 800); return; }
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
