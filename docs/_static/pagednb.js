/* pagednb docs: small glue, loaded on every page before the widget manager.
 *
 * The ipywidgets controls typeset widget labels through MathJax 2's API (MathJax.Hub.Queue) whenever a
 * window.MathJax exists; this site serves MathJax 3, which has no Hub. Give it one that forwards to MathJax 3,
 * before the widget manager renders the saved widgets (it does so on the window's load event). */
(function () {
  function addHub() {
    var mj = window.MathJax;
    if (!mj || mj.Hub) return;
    mj.Hub = {
      Queue: function () {
        for (var i = 0; i < arguments.length; i++) {
          var job = arguments[i];
          if (Array.isArray(job) && job[0] === "Typeset" && window.MathJax.typesetPromise) {
            window.MathJax.typesetPromise(job[2] ? [job[2]] : undefined).catch(function () {});
          }
        }
      }
    };
  }
  addHub();
  document.addEventListener("DOMContentLoaded", addHub);
  window.addEventListener("load", addHub);
})();

/* Saved plotly FigureWidgets reach the page as HTML widgets holding the figure (see docs/build.py,
 * _static_figure_widgets): draw each one with the site's plotly.js once the widget manager has put it on the page. */
(function () {
  function draw() {
    if (!window.Plotly) return;
    document.querySelectorAll(".pagednb-figurewidget:not([data-drawn])").forEach(function (el) {
      el.setAttribute("data-drawn", "1");
      var fig = JSON.parse(el.getAttribute("data-figure"));
      window.Plotly.newPlot(el, fig.data, fig.layout, fig.config);
    });
  }
  document.addEventListener("DOMContentLoaded", function () {
    draw();
    new MutationObserver(draw).observe(document.body, { childList: true, subtree: true });
  });
})();
