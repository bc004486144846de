// The results table's compare checkboxes (no inline script: the pages' Content-Security-Policy):
// the "compare selected" button is enabled while 2 to data-max configurations are ticked, and says how
// many are. Without this script the form still submits and the server says what is wrong.
(function () {
  "use strict";
  var button = document.getElementById("compare-button");
  if (!button) return;
  var count = document.getElementById("compare-count");
  var min = parseInt(button.getAttribute("data-min"), 10) || 2;
  var max = parseInt(button.getAttribute("data-max"), 10) || 8;
  var boxes = document.querySelectorAll('input[type="checkbox"][name="c"][form="' + button.form.id + '"]');

  function update() {
    var n = 0;
    boxes.forEach(function (b) { if (b.checked) n += 1; });
    button.disabled = n < min || n > max;
    if (count) {
      count.textContent = n === 0 ? "tick " + min + " to " + max + " configurations"
        : n + " ticked" + (n > max ? " (at most " + max + ")" : n < min ? " (at least " + min + ")" : "");
    }
  }
  boxes.forEach(function (b) { b.addEventListener("change", update); });
  update();
})();
