/* Shared helpers for the dashboard pages: the signed-in key, JSON API calls, toasts, live refresh. */
"use strict";
const Blade = (() => {
  const COOKIE = "blade_key";

  function key() {
    for (const part of document.cookie.split(";")) {
      const [name, ...rest] = part.trim().split("=");
      if (name === COOKIE) return decodeURIComponent(rest.join("="));
    }
    return "";
  }

  // Calls the JSON API with the signed-in key as a Bearer token; throws an Error carrying the API's message.
  async function api(method, path, body) {
    const response = await fetch(path, {
      method,
      headers: Object.assign({ Authorization: "Bearer " + key(), Accept: "application/json" },
                             body === undefined ? {} : { "Content-Type": "application/json" }),
      body: body === undefined ? undefined : JSON.stringify(body),
      credentials: "omit",
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

  document.addEventListener("DOMContentLoaded", startLiveRefresh);
  return { key, api, toast, refreshNow, fmt, isAdmin: () => document.getElementById("who")?.dataset.admin === "true" };
})();
