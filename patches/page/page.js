// The profile page's start: unpack the library and the data (render.py packs them), draw every part of every
// report, the largest last. The other scripts of this folder come before this one in the page (render.py).
const TIMINGS = {};  // milliseconds each step of the start took (bench/page_scaling.py reads them)

function timed(name, work) {
  const start = performance.now();
  const result = work();
  TIMINGS[name] = (TIMINGS[name] || 0) + performance.now() - start;
  return result;
}

function drawPage(main, page, index) {
  const article = element("article", {"data-page": String(index)}, element("h1", {text: page.title}));
  main.append(article);
  for (const draw of [drawSummary, drawReadFirst, drawTimeline, drawStages, drawMemory, drawLayers, drawWhatIf,
                      drawPrinted]) {
    const later = drawn(article, draw.name, () => draw(article, page));
    if (typeof later === "function") deferred.push([later, article, draw.name]);
  }
}

const deferred = [];  // the parts drawn once every other part is: [draw, article, name]

function drawn(article, name, draw) {
  try {
    return timed(name, draw);
  } catch (error) {  // one part that cannot be drawn leaves the others
    article.append(element("p", {class: "error", text: `${name}: ${error}`}));
    console.error(error);
    return null;
  }
}

// The library and the data lie in the file gzip-compressed, base64-encoded (a third of their size): unpacked by the
// browser's own DecompressionStream.
async function unpacked(id) {
  const bytes = Uint8Array.from(atob(document.getElementById(id).textContent.trim()), (c) => c.charCodeAt(0));
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
  return new Response(stream).text();
}

async function start() {
  const main = document.getElementById("pages");
  if (typeof DecompressionStream === "undefined") {
    main.append(element("p", {class: "error", text: "This browser cannot unpack the page (no DecompressionStream): " +
      "open it in Chromium 80+, Firefox 113+ or Safari 16.4+."}));
    return;
  }
  let start = performance.now();
  const library = element("script", {});
  library.textContent = await unpacked("plotly-js");
  TIMINGS.unpack_library = performance.now() - start;
  timed("run_library", () => document.head.append(library));  // runs at once: window.Plotly
  start = performance.now();
  const text = await unpacked("page-data");
  TIMINGS.unpack_data = performance.now() - start;
  const pages = timed("parse_data", () => JSON.parse(text));
  if (pages.length > 1) {
    main.classList.add("several");
    drawComparison(main, pages);
  }
  const articles = element("div", {class: "articles"});
  main.append(articles);
  pages.forEach((page, index) => drawPage(articles, page, index));
  for (const [draw, article, name] of deferred) drawn(article, `${name} (plot)`, draw);
  window.profilePage = {pages, predictWhatIf, whatIfLines, timings: TIMINGS, ready: true};
}

start().catch((error) => {
  document.getElementById("pages").append(element("p", {class: "error", text: `the page failed: ${error}`}));
  console.error(error);
});
