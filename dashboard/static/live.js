// The pages' scripts (their Content-Security-Policy allows no inline script, style or handler):
// a [data-autosubmit] field submits its form when it changes (the filters);
// live progress: a page with [data-poll] fetches that JSON every data-every ms and updates the stage bars,
// the sweep status badges and the job rows in place (new jobs are appended), without a reload.
(function () {
  "use strict";
  document.querySelectorAll("[data-autosubmit]").forEach(function (f) {
    f.addEventListener("change", function () { if (f.form) f.form.submit(); });
  });
})();

(function () {
  "use strict";
  var root = document.querySelector("[data-poll]");
  if (!root) return;
  var url = root.getAttribute("data-poll");
  var every = parseInt(root.getAttribute("data-every"), 10) || 1500;
  var state = document.getElementById("live-state");
  var ORDER = ["succeeded", "running", "dead", "failed", "pending"];

  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function bars(box, stages) {
    box.textContent = "";
    var names = Object.keys(stages);
    if (!names.length) { box.appendChild(el("span", "muted", "no jobs")); return; }
    names.forEach(function (stage) {
      var per = stages[stage], total = 0;
      Object.keys(per).forEach(function (k) { total += per[k]; });
      var row = el("div", "stage");
      row.title = Object.keys(per).map(function (k) { return k + " " + per[k]; }).join(", ");
      row.appendChild(el("span", "stage-name", stage));
      var bar = el("span", "bar");
      ORDER.forEach(function (st) {
        if (per[st]) bar.appendChild(el("i", "s-" + st + " w" + Math.round(100 * per[st] / total)));
      });
      row.appendChild(bar);
      row.appendChild(el("span", "stage-n", (per.succeeded || 0) + "/" + total));
      box.appendChild(row);
    });
  }

  function setStatus(name, status) {
    document.querySelectorAll("[data-status-of]").forEach(function (b) {
      if (b.getAttribute("data-status-of") === name && b.textContent !== status) {
        b.textContent = status;
        b.className = "badge b-" + status.replace(/ /g, "-");
      }
    });
  }

  function sweepStatus(stages) {
    var t = {};
    Object.keys(stages).forEach(function (s) { Object.keys(stages[s]).forEach(function (k) { t[k] = (t[k] || 0) + stages[s][k]; }); });
    if (!Object.keys(t).length) return "not started";
    return t.running ? "running" : t.failed ? "failed" : t.pending ? "pending" : "finished";
  }

  function progressBox(name) {
    var found = null;
    document.querySelectorAll("[data-progress]").forEach(function (b) { if (b.getAttribute("data-progress") === name) found = b; });
    return found;
  }

  function duration(v) {  // as the page's `dur` filter writes it
    return v < 120 ? v.toFixed(1) + " s" : v < 7200 ? (v / 60).toFixed(1) + " min" : (v / 3600).toFixed(1) + " h";
  }

  function jobs(list) {
    var body = document.querySelector("tbody[data-jobs]");
    if (!body) return;
    var rows = {};
    body.querySelectorAll("tr[data-job]").forEach(function (r) { rows[r.getAttribute("data-job")] = r; });
    list.forEach(function (j) {
      var r = rows[j.key];
      if (!r) {
        r = el("tr"); r.setAttribute("data-job", j.key);
        r.appendChild(el("td", "", j.stage));
        var td = el("td"), a = el("a"); a.href = "/jobs/" + encodeURIComponent(j.key);
        a.appendChild(el("code", "", j.key.slice(0, 12))); td.appendChild(a); r.appendChild(td);
        var st = el("td"); st.appendChild(el("span", "status")); r.appendChild(st);
        r.appendChild(el("td", "num attempts")); r.appendChild(el("td", "num duration")); r.appendChild(el("td", "err"));
        body.appendChild(r);
      }
      var s = r.querySelector(".status");
      if (s.textContent !== j.status) { s.textContent = j.status; s.className = "status s-" + j.status; }
      var at = r.querySelector(".attempts");
      if (at) at.textContent = j.attempts;
      var du = r.querySelector(".duration");
      if (du && j.duration_s !== null) du.textContent = duration(j.duration_s);
      var er = r.querySelector(".err");
      if (er) er.textContent = j.error || "";
    });
  }

  function apply(d) {
    if (d.sweeps) {
      d.sweeps.forEach(function (s) {
        var box = progressBox(s.name);
        if (box) bars(box, s.stages);
        setStatus(s.name, s.status);
      });
    } else {
      var box = progressBox(d.sweep);
      if (box) bars(box, d.stages);
      setStatus(d.sweep, sweepStatus(d.stages));
      jobs(d.jobs || []);
    }
  }

  function tick() {
    fetch(url, { cache: "no-store", headers: { "Accept": "application/json" } })
      .then(function (r) { if (!r.ok) throw new Error(r.status); return r.json(); })
      .then(function (d) {
        apply(d);
        if (state) state.textContent = "live · " + new Date().toLocaleTimeString();
        document.body.setAttribute("data-polls", String((parseInt(document.body.getAttribute("data-polls"), 10) || 0) + 1));
      })
      .catch(function () { if (state) state.textContent = "not updating (server unreachable)"; })
      .then(function () { setTimeout(tick, every); });
  }
  setTimeout(tick, every);
})();
