/* The printable certificate's one action (a static file: the Content-Security-Policy allows no inline script). */
"use strict";
document.getElementById("print-btn")?.addEventListener("click", () => window.print());
