/* Model page: ask the effective model a question (any key); disable / enable an adapter (admin keys) with a
   reason and a confirmation; both via the JSON API. */
"use strict";
(() => {
  const form = document.getElementById("ask-form");
  if (!form) return;
  const model = decodeURIComponent(location.pathname.split("/").pop());
  const tenant = new URLSearchParams(location.search).get("tenant"); // the operator, on another tenant's model
  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    const question = document.getElementById("ask-question").value.trim();
    if (!question) return;
    const button = document.getElementById("ask-btn");
    button.disabled = true;
    try {
      const query = tenant ? `?tenant=${encodeURIComponent(tenant)}` : "";
      const d = await Blade.api("POST", `/base-models/${encodeURIComponent(model)}/generate${query}`, { question });
      document.getElementById("ask-stack").textContent =
        `Answered by the base model${d.stack.length ? ` + ${d.stack.length} active version(s)` : " alone"}, to: ${d.prompt}`;
      document.getElementById("ask-text").textContent = d.text;
      document.getElementById("ask-answer").hidden = false;
    } catch (err) {
      Blade.toast(err.message, "bad");
    } finally {
      button.disabled = false;
    }
  });
})();

(() => {
  const dialog = document.getElementById("state-dialog");
  if (!dialog) return; // read-only key: no buttons, no dialog
  const reason = document.getElementById("dlg-reason");
  const cascade = document.getElementById("dlg-cascade");
  let pending = null;

  document.addEventListener("click", (e) => {
    const btn = e.target.closest(".state-btn");
    if (!btn) return;
    pending = { id: btn.dataset.id, version: btn.dataset.version, action: btn.dataset.action,
                dependents: btn.dataset.dependents || "" };
    const disabling = pending.action === "disable";
    document.getElementById("dlg-title").textContent = `${disabling ? "Disable" : "Enable"} version ${pending.version}`;
    document.getElementById("dlg-text").textContent = disabling
      ? "It will be removed from the effective model. Say why: the reason goes to the audit log with your key."
      : "It will be part of the effective model again. Say why: the reason goes to the audit log with your key.";
    document.getElementById("dlg-cascade-row").style.display = disabling ? "" : "none";
    cascade.checked = false;
    reason.value = "";
    dialog.classList.remove("confirming");
    dialog.showModal();
    reason.focus();
  });

  dialog.querySelector("[data-close]").addEventListener("click", () => dialog.close());
  document.getElementById("dlg-back").addEventListener("click", () => dialog.classList.remove("confirming"));
  document.getElementById("dlg-next").addEventListener("click", () => {
    if (!reason.value.trim()) { reason.focus(); reason.style.borderColor = "var(--bad)"; return; }
    reason.style.borderColor = "";
    const verb = pending.action === "disable" ? "Disable" : "Enable";
    document.getElementById("dlg-confirm-text").textContent =
      `${verb} version ${pending.version}` + (cascade.checked && pending.action === "disable" ? " and every version trained on top of it" : "") +
      ` with the reason “${reason.value.trim()}”?` +
      (pending.action === "disable" && pending.dependents && !cascade.checked
        ? ` ${pending.dependents} trained on top of it will stay active, flagged as trained on a different stack.` : "");
    document.getElementById("dlg-confirm").textContent = verb;
    dialog.classList.add("confirming");
  });

  document.getElementById("dlg-confirm").addEventListener("click", async () => {
    const body = { reason: reason.value.trim() };
    if (pending.action === "disable") body.cascade = cascade.checked;
    const confirmBtn = document.getElementById("dlg-confirm");
    confirmBtn.disabled = true;
    try {
      const d = await Blade.api("POST", `/adapters/${pending.id}/${pending.action}`, body);
      dialog.close();
      const flagged = (d && (d.flagged || d.affected || d.trained_on_different_stack)) || [];
      const names = flagged.map((a) => (typeof a === "object" ? `v${a.version}` : a)).join(", ");
      Blade.toast(`Version ${pending.version} ${pending.action}d.` +
                  (names ? ` Trained on a different stack now: ${names}.` : ""), "ok");
      await Blade.refreshNow();
    } catch (err) {
      dialog.close();
      Blade.toast(err.message, "bad");
    } finally {
      confirmBtn.disabled = false;
    }
  });
})();
