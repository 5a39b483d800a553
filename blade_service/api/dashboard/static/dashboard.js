/* Shared helpers for the dashboard pages: JSON calls, toasts, live refresh, auto-submitting filters. */
"use strict";
const Blade = (() => {
  // The session's CSRF token (the page never sees the API key nor the HttpOnly session cookie).
  function csrf() {
    const meta = document.querySelector('meta[name="csrf-token"]');
    return meta ? meta.content : "";
  }

  // Calls the JSON API through the dashboard's bridge (`/dashboard/api` + the API path), authorised by the
  // session cookie and the CSRF token; throws an Error carrying the API's message.
  async function api(method, path, body) {
    const response = await fetch("/dashboard/api" + path, {
      method,
      headers: Object.assign({ "X-CSRF-Token": csrf(), Accept: "application/json" },
                             body === undefined ? {} : { "Content-Type": "application/json" }),
      body: body === undefined ? undefined : JSON.stringify(body),
      credentials: "same-origin",
    });
    let data = null;
    try { data = await response.json(); } catch (_) { /* empty body */ }
    if (!response.ok) {
      const err = (data && data.error) || {};
      const detail = data && data.detail;
      const error = new Error(err.message || (typeof detail === "string" ? detail : "") ||
                              `${method} ${path} failed (HTTP ${response.status})`);
      error.status = response.status;
      error.code = err.code;
      throw error;
    }
    return data;
  }

  let toastTimer = null;
  function toast(message, kind = "info", ms = 6000) {
    const el = document.getElementById("toast");
    if (!el) return;
    el.className = "notice " + kind;
    el.textContent = message;
    el.style.display = "block";
    clearTimeout(toastTimer);
    toastTimer = setTimeout(() => { el.style.display = "none"; }, ms);
  }

  // Re-fetches the page's live part (#live[data-refresh]) and swaps it in; paused while a dialog is open.
  function refreshNow() {
    const live = document.getElementById("live");
    if (!live || !live.dataset.refresh) return Promise.resolve();
    return fetch(live.dataset.refresh, { credentials: "same-origin", headers: { Accept: "text/html" } })
      .then((r) => {
        if (r.status === 401) { location.href = "/dashboard/login?next=" + encodeURIComponent(location.pathname); return null; }
        return r.ok ? r.text() : null;
      })
      .then((html) => {
        if (html === null) return;
        live.innerHTML = html;
        const stamp = document.getElementById("updated");
        if (stamp) stamp.textContent = "updated " + new Date().toLocaleTimeString();
        document.dispatchEvent(new CustomEvent("blade:refreshed"));
      })
      .catch(() => { /* offline for a moment: keep the last view */ });
  }

  function startLiveRefresh() {
    const live = document.getElementById("live");
    if (!live || !live.dataset.refresh) return;
    const every = parseInt(live.dataset.interval || "4000", 10);
    setInterval(() => {
      if (document.hidden || document.querySelector("dialog[open]")) return;
      refreshNow();
    }, every);
  }

  function fmt(value, digits = 4) {
    if (value === null || value === undefined || Number.isNaN(value)) return "—";
    if (typeof value !== "number") return String(value);
    if (Number.isInteger(value)) return value.toLocaleString();
    const a = Math.abs(value);
    if (a !== 0 && (a >= 1e5 || a < 1e-3)) return value.toExponential(digits - 1);
    return Number(value.toPrecision(digits)).toString();
  }

  // <select class="autosubmit"> submits its filter form on change (no inline handlers: the CSP forbids them).
  document.addEventListener("change", (e) => {
    if (e.target.matches && e.target.matches("select.autosubmit") && e.target.form) e.target.form.submit();
  });

  document.addEventListener("DOMContentLoaded", startLiveRefresh);
  return { csrf, api, toast, refreshNow, fmt, isAdmin: () => document.getElementById("who")?.dataset.admin === "true" };
})();
