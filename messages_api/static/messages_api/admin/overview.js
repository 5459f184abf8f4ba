// The cluster overview refreshes its live part in place (messages_api/overview.py): every few
// seconds it fetches /admin/overview/live/ and swaps the answer in, without reloading the page.
// Only an answer marked X-Overview-Live is swapped in: after the session expires the admin answers
// with its login page, which is reported instead. Paused while the tab is hidden.
(function () {
  "use strict";
  const root = document.getElementById("overview");
  if (!root) return;
  const url = root.dataset.liveUrl;
  const every = Number(root.dataset.refreshMs) || 5000;
  const status = document.getElementById("overview-status");
  let timer = null;
  let busy = false;

  function schedule() {
    clearTimeout(timer);
    timer = setTimeout(refresh, every);
  }

  async function refresh() {
    if (busy || document.hidden) return schedule();
    busy = true;
    try {
      const response = await fetch(url, { credentials: "same-origin", cache: "no-store", headers: { Accept: "text/html" } });
      if (!response.ok) throw new Error("HTTP " + response.status);
      if (response.headers.get("X-Overview-Live") !== "1") throw new Error("signed out? Reload the page");
      const html = await response.text();
      const next = new DOMParser().parseFromString(html, "text/html").getElementById("overview-live");
      const live = document.getElementById("overview-live");
      if (!next || !live) throw new Error("unexpected answer");
      live.replaceWith(document.adoptNode(next));
      root.dataset.refreshes = String(Number(root.dataset.refreshes || 0) + 1);
      root.classList.remove("gw-stale");
      status.textContent = "";
    } catch (error) {
      root.classList.add("gw-stale");
      status.textContent = "Not refreshed (" + new Date().toLocaleTimeString() + "): " + error.message;
    } finally {
      busy = false;
      schedule();
    }
  }

  document.addEventListener("visibilitychange", function () {
    if (!document.hidden) refresh();
  });
  schedule();
})();
