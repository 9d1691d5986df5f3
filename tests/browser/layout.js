// Layout of a notebook's outputs, run by Playwright as `notebook.evaluate(this, lightTheme)` on the
// `.jp-Notebook` element. Returns {outputs, figures_checked, overflow, cut, wraps, figures, bare_figures}:
// how many outputs and show_figure figures were looked at, and the findings, each with `cell`
// (index of its cell in the notebook) and what it is:
//   overflow      an output area that scrolls sideways, or an element whose right edge lies beyond
//                 its output area's (an inner sideways scroller counts: the widget is still wider
//                 than the column); only the outermost such element of a subtree is reported
//   cut           text cut by its own box: ellipsis labels, a dropdown narrower than its choice
//   wraps         printed text (stream / plain text) laid out in columns (two or more spaces between
//                 words) whose lines wrap in the column: a table that falls apart (prose may wrap)
//   figures       a show_figure / PlotView figure showing the rendering of the other theme, or a
//                 rendering whose background does not match the theme
//   bare_figures  an image output not drawn through show_figure (it stays white in the dark theme)
//   code          a code cell whose editor scrolls sideways: a line longer than the column
(notebook, lightTheme) => {
  const cells = [...notebook.querySelectorAll(".jp-Cell")];
  const cellOf = (el) => cells.indexOf(el.closest(".jp-Cell"));
  const describe = (el) => {
    const cls = typeof el.className === "string" ? el.className : (el.className && el.className.baseVal) || "";
    const name = el.tagName.toLowerCase() + (cls ? "." + cls.trim().split(/\s+/).slice(0, 3).join(".") : "");
    return `${name} "${(el.textContent || "").trim().replace(/\s+/g, " ").slice(0, 50)}"`;
  };
  const visible = (el) => el.getClientRects().length > 0 && getComputedStyle(el).visibility !== "hidden";
  const theme = lightTheme ? "light" : "dark";
  const report = {
    outputs: 0, figures_checked: 0, overflow: [], cut: [], wraps: [], figures: [], bare_figures: [], code: [],
  };
  const canvas = document.createElement("canvas");
  const ctx = canvas.getContext("2d");
  // Mean colour of an image's top-left 4x4 pixels: the figure's background.
  const corner = (img) => {
    canvas.width = img.naturalWidth;
    canvas.height = img.naturalHeight;
    ctx.drawImage(img, 0, 0);
    const d = ctx.getImageData(0, 0, 4, 4).data;
    let sum = 0;
    for (let i = 0; i < d.length; i += 4) sum += (d[i] + d[i + 1] + d[i + 2]) / 3;
    return sum / (d.length / 4) / 255;
  };
  for (const out of notebook.querySelectorAll(".jp-OutputArea-output")) {
    if (!visible(out)) continue;
    report.outputs += 1;
    const cell = cellOf(out);
    const box = out.getBoundingClientRect();
    if (out.scrollWidth > out.clientWidth + 1) {
      report.overflow.push({
        cell, element: describe(out), by_px: out.scrollWidth - out.clientWidth, what: "output area scrolls sideways",
      });
    }
    const reported = [];
    for (const el of out.querySelectorAll("*")) {
      if (el.closest("style, script, title, defs") || !visible(el)) continue;
      if (reported.some((r) => r.contains(el))) continue;
      const r = el.getBoundingClientRect();
      if (r.width > 0 && r.right > box.right + 1) {
        reported.push(el);
        report.overflow.push({
          cell, element: describe(el), by_px: Math.round(r.right - box.right), what: "right edge beyond the output area",
        });
        continue;
      }
      // A box that scrolls or clips sideways although it lies inside the output area: its content is wider.
      const style = getComputedStyle(el);
      const clips = style.overflowX !== "visible";
      if (clips && el.scrollWidth > el.clientWidth + 1 && !(el instanceof SVGElement)) {
        reported.push(el);
        const textLike = style.textOverflow === "ellipsis" || el.children.length === 0;
        const scrolls = style.overflowX === "auto" || style.overflowX === "scroll";
        const kind = scrolls ? "scrolls sideways" : "clips its content";
        (textLike ? report.cut : report.overflow).push({
          cell, element: describe(el), by_px: el.scrollWidth - el.clientWidth, what: textLike ? "text cut" : kind,
        });
      }
    }
    for (const select of out.querySelectorAll("select")) {
      const option = select.options[select.selectedIndex];
      if (!option || !visible(select) || select.multiple || select.size > 1) continue;
      const style = getComputedStyle(select);
      ctx.font = `${style.fontWeight} ${style.fontSize} ${style.fontFamily}`;
      const room = select.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
      const need = ctx.measureText(option.text).width;
      if (need > room + 1) {
        report.cut.push({
          cell, element: `select "${option.text}"`, by_px: Math.round(need - room), what: "dropdown narrower than its choice",
        });
      }
    }
    for (const pre of out.querySelectorAll(".jp-RenderedText pre")) {
      // Monospace: a line longer than the column's characters wraps. Prose may; aligned columns may not.
      const style = getComputedStyle(pre);
      ctx.font = `${style.fontWeight} ${style.fontSize} ${style.fontFamily}`;
      const width = pre.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
      const perLine = Math.floor(width / ctx.measureText("0").width);
      const lines = pre.textContent.split("\n");
      const wrapped = lines.filter((line) => line.length > perLine && /\S {2,}\S/.test(line.trim()));
      if (wrapped.length) {
        const longest = wrapped.reduce((a, b) => (b.length > a.length ? b : a));
        report.wraps.push({
          cell, element: `printed line of ${longest.length} chars: "${longest.trim().slice(0, 60)}"`,
          what: `${wrapped.length} line(s) laid out in columns wrap (${perLine} characters fit a line)`,
        });
      }
    }
    for (const figure of out.querySelectorAll(".pkv-figure")) {
      const light = figure.querySelector(".pkv-figure-light");
      const dark = figure.querySelector(".pkv-figure-dark");
      const [shown, hidden] = lightTheme ? [light, dark] : [dark, light];
      const alt = (shown || light || figure).getAttribute("alt") || "";
      if (!shown || !visible(shown) || (hidden && visible(hidden))) {
        report.figures.push({ cell, element: `figure "${alt}"`, what: `the ${theme} rendering is not the one shown` });
        continue;
      }
      report.figures_checked += 1;
      const lightness = corner(shown);
      if (lightTheme ? lightness < 0.8 : lightness > 0.25) {
        report.figures.push({
          cell, element: `figure "${alt}"`, what: `background lightness ${lightness.toFixed(2)} in the ${theme} theme`,
        });
      }
    }
    for (const img of out.querySelectorAll("img, svg")) {
      if (img.closest(".pkv-figure") || !visible(img)) continue;
      // An <svg> is a figure only as an image/svg+xml output (widgets and HTML draw their own).
      if (img.tagName.toLowerCase() === "svg" && !out.matches('[data-mime-type="image/svg+xml"]')) continue;
      const lightness = img.tagName.toLowerCase() === "img" ? corner(img) : null;
      report.bare_figures.push({
        cell, element: describe(img), what: "image output not drawn through show_figure"
          + (lightness === null ? "" : ` (background lightness ${lightness.toFixed(2)})`),
      });
    }
  }
  for (const scroller of notebook.querySelectorAll(".jp-CodeCell .jp-InputArea-editor .cm-scroller")) {
    if (visible(scroller) && scroller.scrollWidth > scroller.clientWidth + 1) {
      const first = (scroller.textContent || "").trim().slice(0, 50);
      report.code.push({
        cell: cellOf(scroller), element: `code "${first}"`, by_px: scroller.scrollWidth - scroller.clientWidth,
        what: "code cell scrolls sideways",
      });
    }
  }
  return report;
}
