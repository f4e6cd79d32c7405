/* stepmill's dashboard: charts of the lifecycle page and the live page's polling.
   Chart.js (vendored beside this file) draws; text goes in through textContent only. */
(function () {
  "use strict";
  var COLORS = ["#4a7fb5", "#e07b39", "#1a8a4a", "#b3261e", "#6b4fa0", "#c0a000", "#2aa198", "#777777"];
  var charts = {};

  function color(i) { return COLORS[i % COLORS.length]; }

  function draw(id, config, title) {
    var canvas = document.getElementById(id);
    if (!canvas || !window.Chart) return null;
    config.options = Object.assign({animation: false, responsive: true, maintainAspectRatio: false},
                                   config.options || {});
    if (title) config.options.plugins = {title: {display: true, text: title}};
    if (charts[id]) charts[id].destroy();
    charts[id] = new window.Chart(canvas, config);
    return charts[id];
  }

  function unique(values) { return values.filter(function (v, i) { return values.indexOf(v) === i; }); }

  function lifecycleCharts(data) {
    var c = data.charts;
    draw("sm-chart-steps", {type: "bar", data: {labels: c.steps.labels, datasets: [
      {label: "steps per " + c.steps.unit, data: c.steps.counts, backgroundColor: color(0)}]}}, "Steps over time");
    var versions = unique(c.reward.map(function (r) { return r.policy_version; }));
    var agents = unique(c.reward.map(function (r) { return r.agent; }));
    draw("sm-chart-reward", {type: "bar", data: {labels: versions.map(function (v) { return "policy " + v; }),
      datasets: agents.map(function (a, i) {
        return {label: a, backgroundColor: color(i), data: versions.map(function (v) {
          var row = c.reward.find(function (r) { return r.agent === a && r.policy_version === v; });
          return row ? row.mean : null; })};
      })}, options: {scales: {y: {title: {display: true, text: "mean reward"}}}}}, "Reward per policy version and agent");
    var trajAgents = unique(c.trajectories.map(function (t) { return t.agent; }));
    draw("sm-chart-length", {type: "scatter", data: {datasets: trajAgents.map(function (a, i) {
      return {label: a, backgroundColor: color(i), data: c.trajectories.filter(function (t) { return t.agent === a; })
        .map(function (t) { return {x: t.turns, y: t.response_tokens}; })};
    })}, options: {scales: {x: {ticks: {stepSize: 1}, title: {display: true, text: "turns (steps) per trajectory"}},
                            y: {title: {display: true, text: "response tokens"}}}}}, "Response length and turns per trajectory");
    var gate = data.gate, reasons = Object.keys(gate.removed_by_reason);
    draw("sm-chart-gate", {type: "bar", data: {labels: ["kept"].concat(reasons), datasets: [{label: "steps",
      data: [gate.kept].concat(reasons.map(function (r) { return gate.removed_by_reason[r]; })),
      backgroundColor: [color(2)].concat(reasons.map(function () { return color(3); }))}]},
      options: {indexAxis: "y"}}, "The gate: steps kept and removed, by reason");
    var groups = c.groups.filter(function (g) { return g.token_ratio !== null; });
    draw("sm-chart-ratio", {type: "bar", data: {labels: groups.map(function (g) { return g.group_id; }), datasets: [
      {label: "packed / original tokens (all steps)", data: groups.map(function (g) { return g.token_ratio; }),
       backgroundColor: color(0)},
      {label: "what the gate lets through", data: groups.map(function (g) { return g.gated_token_ratio; }),
       backgroundColor: color(1)}]}, options: {scales: {y: {min: 0, max: 1}}}}, "Token ratio of packed groups (lower: more shared)");
  }

  function cell(row, text) {
    var td = document.createElement("td");
    td.textContent = text === null || text === undefined ? "" : String(text);
    row.appendChild(td);
    return td;
  }

  function fillTable(table, rows, columns) {
    var body = table.tBodies[0];
    while (body.firstChild) body.removeChild(body.firstChild);
    rows.forEach(function (r) {
      var tr = document.createElement("tr");
      columns.forEach(function (c) { cell(tr, r[c]); });
      body.appendChild(tr);
    });
  }

  var LIVE_COLUMNS = ["key", "starting", "running", "ok", "failed", "timeout", "steps", "tokens", "steps_per_min", "tokens_per_min"];

  function showLive(data) {
    Object.keys(data.totals).forEach(function (k) {
      var el = document.querySelector("[data-sm=live-" + k + "]");
      if (el) el.textContent = String(data.totals[k]);
    });
    ["agent", "model", "policy_version"].forEach(function (d) {
      var table = document.getElementById("sm-live-" + d);
      if (table) fillTable(table, data.by[d], LIVE_COLUMNS);
    });
    var list = document.getElementById("sm-live-running");
    while (list.firstChild) list.removeChild(list.firstChild);
    data.running.forEach(function (run) {
      var li = document.createElement("li"), a = document.createElement("a");
      a.href = run.url;  // encoded by the server (stepmill_path)
      a.textContent = run.trajectory_id;
      li.appendChild(a);
      li.appendChild(document.createTextNode(" · " + run.state + " · " + run.agent + " · policy " + (run.policy_version === null ? "—" : run.policy_version) +
                                             " · started " + run.started.slice(11, 19)));
      list.appendChild(li);
    });
    var agents = Object.keys(data.series.steps);
    var config = {type: "bar", data: {labels: data.series.minutes, datasets: agents.map(function (a, i) {
      return {label: a, data: data.series.steps[a], backgroundColor: color(i)};
    })}, options: {scales: {x: {stacked: true}, y: {stacked: true, title: {display: true, text: "steps per minute"}}}}};
    var chart = charts["sm-live-chart"];
    if (chart && chart.data.datasets.length === config.data.datasets.length) {
      chart.data = config.data;  // same chart, new numbers: no flicker, no reload
      chart.update("none");
    } else {
      draw("sm-live-chart", config, "Steps per minute, by agent");
    }
    document.querySelector("[data-sm=live-updated]").textContent = data.now.slice(11, 19) + " UTC";
    window.stepmillLiveRefreshes = (window.stepmillLiveRefreshes || 0) + 1;
  }

  function live(url, every) {
    function tick() {
      fetch(url, {credentials: "same-origin", cache: "no-store"})
        .then(function (r) { if (!r.ok) throw new Error("HTTP " + r.status); return r.json(); })
        .then(function (data) { showLive(data); document.querySelector("[data-sm=live-error]").textContent = ""; })
        .catch(function (e) { document.querySelector("[data-sm=live-error]").textContent = "refresh failed: " + e; })
        .finally(function () { setTimeout(tick, every); });
    }
    tick();
  }

  window.stepmillDashboard = {lifecycleCharts: lifecycleCharts, live: live};
})();
