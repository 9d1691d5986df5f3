// WCAG contrast of what the views draw, run by Playwright as `element.evaluate(this, selector)` on
// the elements matching `selector` inside `element` (nested matches are measured once).
// Returns {texts, low_text, low_outline, free_not_background}: how many texts were measured, and
// the texts under 4.5:1, the "written this step" outlines under 3:1, and the free blocks whose fill
// is not (close to) the background, each with the colours measured and `cell`, the index of the
// notebook cell it is in (-1 outside a cell).
(root, selector) => {
  const probe = document.createElement("div");
  document.body.appendChild(probe);
  // Any CSS colour (names, var(), system colours) -> [r, g, b, a] as the browser computes it.
  const rgba = (css) => {
    probe.style.color = "";
    probe.style.color = css;
    const m = getComputedStyle(probe).color.match(/[\d.]+/g).map(Number);
    return [m[0], m[1], m[2], m.length > 3 ? m[3] : 1];
  };
  const over = (top, under) => {  // `top` (with alpha) painted over the opaque `under`
    const a = top[3];
    return [0, 1, 2].map((i) => top[i] * a + under[i] * (1 - a)).concat(1);
  };
  const luminance = (c) => {
    const [r, g, b] = c.slice(0, 3).map((v) => {
      v /= 255;
      return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4;
    });
    return 0.2126 * r + 0.7152 * g + 0.0722 * b;
  };
  const contrast = (a, b) => {
    const [hi, lo] = [luminance(a), luminance(b)].sort((x, y) => y - x);
    return (hi + 0.05) / (lo + 0.05);
  };
  // The opaque colour behind an HTML element: its own and its ancestors' backgrounds, composited.
  const htmlBackground = (el) => {
    const layers = [];
    for (let e = el; e; e = e.parentElement) {
      const c = rgba(getComputedStyle(e).backgroundColor);
      if (c[3] > 0) layers.push(c);
      if (c[3] === 1) break;
    }
    let color = [255, 255, 255, 1];  // the canvas, if nothing is opaque
    for (const layer of layers.reverse()) color = over(layer, color);
    return color;
  };
  // Behind an SVG element: the shapes drawn before it in its <svg> that cover its centre.
  const svgBackground = (el) => {
    const svg = el.ownerSVGElement;
    const box = el.getBoundingClientRect();
    const [x, y] = [box.left + box.width / 2, box.top + box.height / 2];
    let color = htmlBackground(svg);
    for (const shape of svg.querySelectorAll("rect, path, circle, polygon")) {
      if (!(shape.compareDocumentPosition(el) & Node.DOCUMENT_POSITION_FOLLOWING)) break;
      if (shape.contains(el) || shape.closest("defs, marker")) continue;
      const r = shape.getBoundingClientRect();
      if (x < r.left || x > r.right || y < r.top || y > r.bottom) continue;
      const style = getComputedStyle(shape);
      if (style.fill === "none") continue;
      const fill = rgba(style.fill);
      fill[3] *= Number(style.fillOpacity) * Number(style.opacity);
      color = over(fill, color);
    }
    return color;
  };
  const fmt = (c) => `rgba(${c.map((v) => Math.round(v * 100) / 100).join(",")})`;
  const report = { texts: 0, low_text: [], low_outline: [], free_not_background: [] };
  const cells = [...document.querySelectorAll(".jp-Cell")];
  const cellOf = (el) => cells.indexOf(el.closest(".jp-Cell"));
  const matches = [...root.querySelectorAll(selector)];
  const views = matches.filter((view) => !matches.some((other) => other !== view && other.contains(view)));
  for (const view of views) {
    for (const el of view.querySelectorAll("*")) {
      if (el.closest("title, defs") || el.getClientRects().length === 0) continue;
      const ownText = [...el.childNodes].some((n) => n.nodeType === Node.TEXT_NODE && n.textContent.trim());
      if (!ownText) continue;
      const isSvg = el instanceof SVGElement;
      const style = getComputedStyle(el);
      const bg = isSvg ? svgBackground(el) : htmlBackground(el);
      const fgRaw = rgba(isSvg ? style.fill : style.color);
      if (isSvg) fgRaw[3] *= Number(style.fillOpacity);
      const fg = over(fgRaw, bg);
      const ratio = contrast(fg, bg);
      report.texts += 1;
      if (ratio < 4.5) {
        report.low_text.push({
          cell: cellOf(el), text: el.textContent.trim().slice(0, 40), ratio: ratio.toFixed(2), fg: fmt(fg), bg: fmt(bg),
        });
      }
    }
    for (const tick of view.querySelectorAll("rect.pkv-written")) {
      const style = getComputedStyle(tick);
      const under = htmlBackground(tick.ownerSVGElement);
      const ratio = contrast(over(rgba(style.stroke), under), under);
      if (ratio < 3) {
        report.low_outline.push({ cell: cellOf(tick), ratio: ratio.toFixed(2), stroke: style.stroke, bg: fmt(under) });
      }
    }
    for (const rect of view.querySelectorAll('.pkv-block[data-state="free"] > rect')) {
      const under = htmlBackground(rect.ownerSVGElement);
      const fill = over(rgba(getComputedStyle(rect).fill), under);
      const ratio = contrast(fill, under);
      if (ratio > 1.2) {
        report.free_not_background.push({ cell: cellOf(rect), ratio: ratio.toFixed(2), fill: fmt(fill), bg: fmt(under) });
      }
    }
  }
  probe.remove();
  return report;
}
