// The profiled iteration as it ran, from the trace: one row per stage and tensor rank.
const COLOURS = {
  ForwardPass: "#4c72b0", BackwardPass: "#dd8452", BackwardOnlyPass: "#dd8452", WeightPass: "#e8a87c",
  SendActivation: "#8c8c8c", RecvActivation: "#b0b0b0", SendGrad: "#8c8c8c", RecvGrad: "#b0b0b0",
  LoadMicroBatch: "#55a868", OptimizerStep: "#8172b3", ReduceGrads: "#937860", ReduceTiedGrads: "#da8bc3",
};
const RECOMPUTE_COLOUR = "#c44e52";
const STAGE_COLOURS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c",
                       "#ccb974", "#64b5cd"];
const PLOT_CONFIG = {displaylogo: false, responsive: true, modeBarButtonsToRemove: ["sendDataToCloud"]};

const LABELLED_SLICES = 3000;  // micro-batch numbers written on the passes up to this many slices
const FOLDED_SLICES = 12000;  // above this many, each stage's tensor rank 0 alone is drawn until asked

function onlyRows(t, shownRows) {
  const keep = (columns) => {
    const picked = columns.row ? columns.row.map((row, i) => i).filter((i) => shownRows.has(columns.row[i])) : [];
    return Object.fromEntries(Object.entries(columns).map(([key, values]) => [key, picked.map((i) => values[i])]));
  };
  return Object.assign({}, t, {instructions: keep(t.instructions), recompute: keep(t.recompute)});
}

function segments(indices, rowOf, startOf, endOf, labelOf) {
  const x = [], y = [], text = [];
  for (const i of indices) {
    const row = rowOf(i), label = labelOf(i);
    x.push(startOf(i), endOf(i), null);
    y.push(row, row, null);
    text.push(label, label, null);
  }
  return {x, y, text};
}

function drawTimeline(article, page) {
  const t = page.timeline;
  if (!t) return;
  const node = section(article, "timeline", "The profiled iteration as it ran",
    "One row per stage and tensor rank (the reported data-parallel replica), every schedule instruction with its " +
    "micro-batch; recompute (red) inside the backward passes that ran it; gaps are idle time. Milliseconds from " +
    "the first instruction, on global rank 0's clock.");
  const plot = element("div", {class: "plot timeline-plot"});
  const firstRanks = t.rows.map((row, i) => i).filter((i) => / · tp 0$/.test(t.rows[i]));
  if (t.instructions.row.length > FOLDED_SLICES && firstRanks.length < t.rows.length) {
    // Tens of thousands of slices take seconds to draw: each stage's tensor rank 0 first, the others on request.
    const note = element("p", {class: "folded", text: `${t.rows.length} rows, ${t.instructions.row.length} slices: ` +
      `each stage's tensor rank 0 drawn (${firstRanks.length} rows); the others lie in the trace. `});
    const button = element("button", {type: "button", text: "draw every tensor rank (slower)"});
    button.addEventListener("click", () => { note.remove(); drawTimelinePlot(plot, t, null); });
    note.append(button);
    node.append(note, plot);
    return () => drawTimelinePlot(plot, t, new Set(firstRanks));
  }
  node.append(plot);
  return () => drawTimelinePlot(plot, t, null);  // drawn after the other parts: the largest one
}

function drawTimelinePlot(plot, whole, shownRows) {
  const t = shownRows ? onlyRows(whole, shownRows) : whole;
  const ins = t.instructions, rowHeight = t.rows.length > 32 ? 12 : 28;
  const traces = [];
  const label = (i) => `${t.kinds[ins.kind[i]]}${ins.micro_batch[i] >= 0 ? " mb" + ins.micro_batch[i] : ""}` +
    ` · ${(ins.dur_us[i] / 1e3).toFixed(3)} ms`;
  t.kinds.forEach((kind, k) => {
    const picked = [];
    ins.kind.forEach((value, i) => { if (value === k) picked.push(i); });
    traces.push(Object.assign({
      type: "scatter", mode: "lines", name: kind, line: {color: COLOURS[kind] || "#999999", width: 0.7 * rowHeight},
      hovertemplate: "%{text}<br>at %{x:.3f} ms<extra></extra>",
    }, segments(picked, (i) => t.rows[ins.row[i]], (i) => ins.ts_us[i] / 1e3,
                (i) => (ins.ts_us[i] + ins.dur_us[i]) / 1e3, label)));
  });
  const r = t.recompute;
  if (r.row && r.row.length) {
    traces.push(Object.assign({
      type: "scatter", mode: "lines", name: "recompute (a layer)", line: {color: RECOMPUTE_COLOUR, width: 0.3 * rowHeight},
      hovertemplate: "%{text}<br>at %{x:.3f} ms<extra></extra>",
    }, segments(r.row.map((_, i) => i), (i) => t.rows[r.row[i]], (i) => r.ts_us[i] / 1e3,
                (i) => (r.ts_us[i] + r.dur_us[i]) / 1e3,
                (i) => `recompute of layer ${r.layer[i]} mb${r.micro_batch[i]} · ${(r.dur_us[i] / 1e3).toFixed(3)} ms`)));
  }
  if (ins.row.length <= LABELLED_SLICES) {  // the micro-batch of each pass, written on it
    const passes = ins.kind.map((k, i) => i).filter((i) => ins.micro_batch[i] >= 0 && /Pass$/.test(t.kinds[ins.kind[i]]));
    traces.push({type: "scatter", mode: "text", showlegend: false, hoverinfo: "skip",
      x: passes.map((i) => (ins.ts_us[i] + ins.dur_us[i] / 2) / 1e3), y: passes.map((i) => t.rows[ins.row[i]]),
      text: passes.map((i) => String(ins.micro_batch[i])), textfont: {color: "white", size: 10}});
  }
  Plotly.newPlot(plot, traces, {
    height: 120 + rowHeight * (shownRows ? shownRows.size : t.rows.length), margin: {l: 110, r: 20, t: 60, b: 40}, hovermode: "closest",
    xaxis: {title: {text: "ms"}, zeroline: false},
    yaxis: {type: "category", categoryorder: "array", showgrid: false,
            categoryarray: t.rows.filter((row, i) => !shownRows || shownRows.has(i)).reverse()},
    legend: {orientation: "h", x: 0, y: 1, yanchor: "bottom"},
  }, PLOT_CONFIG);
}
