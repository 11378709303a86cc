// The report's sections: summary, what to read first, stages, memory, layers, the printed text, a comparison.
function drawSummary(article, page) {
  const s = page.summary;
  const cards = [
    ["iteration", durationToString(s.iteration_s), `${s.iteration_basis}; step ${s.step}`],
    ["hardware TFLOPs per GPU", orNa(s.tflops_per_gpu, (v) => v.toPrecision(3)),
     `model TFLOPs per GPU ${orNa(s.model_tflops_per_gpu, (v) => v.toPrecision(3))}`],
    ["MFU", orNa(s.mfu, (v) => (100 * v).toFixed(1) + "%"),
     s.peak_tflops ? `of ${s.peak_tflops} TFLOPs peak (${s.device})` : `the peak of ${s.device} is not known`],
    ["bubble", orNa(s.bubble, (v) => (100 * v).toFixed(1) + "%"),
     s.ideal_bubble == null ? "no schedule ideal" : `${s.ideal_name} ideal ${(100 * s.ideal_bubble).toFixed(1)}%`],
    ["bounding stage", orNa(s.bounding_stage, String), "the largest fwd + bwd + step time"],
    ["parallelism", `pp ${s.pipeline_parallel_size} × tp ${s.tensor_parallel_size} × dp ${s.data_parallel_size}`,
     `${s.micro_batches} micro-batches of ${orNa(s.micro_batch_size, String)}, sequence ${orNa(s.seq_length, String)}`],
    ["profiling cost", orNa(s.perturbation, (v) => v.toFixed(2) + "x"), "profiled iteration / steady ones"],
  ];
  const node = section(article, "summary", "Summary");
  node.append(element("div", {class: "cards"}, ...cards.map(([name, value, detail]) => element("div", {class: "card"},
    element("div", {class: "card-name", text: name}), element("div", {class: "card-value", text: value}),
    element("div", {class: "card-detail", text: detail})))));
}

function drawReadFirst(article, page) {
  const lines = page.read_first.concat(page.missing.map((line) => `missing: ${line}`));
  if (!lines.length) return;
  const node = section(article, "read-first", "Read first");
  node.append(element("ul", {}, ...lines.map((line) => element("li", {text: line}))));
}

// Each kind of instruction is one line trace, a segment per slice (start to end, then a gap): one SVG path per kind,
// so that a timeline of tens of thousands of slices draws at once, where a bar per slice would not.
function drawStages(article, page) {
  const node = section(article, "stages", "Stages",
    "Per stage (its slowest tensor rank): times of the profiled iteration; idle against the schedule's span.");
  const headers = ["stage", "ranks", "layers", "recomputed", "fwd", "bwd", "step", "comm + wait", "other",
                   "train_batch", "idle", "TFLOPs per GPU", "params per GPU"];
  node.append(table(headers, page.stages.map((s) => [
    cell(s.stage), cell((s.ranks || []).join(","), String), cell(s.layers.length ? s.layers.join(", ") : "", String),
    cell(s.recomputed_layers.length ? s.recomputed_layers.join(", ") : "none", String),
    cell(s.fwd_s, durationToString), cell(s.bwd_s, durationToString), cell(s.step_s, durationToString),
    cell(s.comm_s, durationToString), cell(s.other_s, durationToString), cell(s.train_batch_s, durationToString),
    cell(s.idle_fraction, (v) => (100 * v).toFixed(1) + "%"), cell(s.tflops_per_gpu, (v) => v.toPrecision(3)),
    cell(s.params_per_gpu, numberToString),
  ]), false));
}

function drawMemory(article, page) {
  if (!page.memory) return;
  const node = section(article, "memory", "Memory per stage",
    "Each stage's predicted peak as its parts (what it holds, the activations times the micro-batches in flight, " +
    "the largest transient), beside the peak torch's allocator measured.");
  const plot = element("div", {class: "plot"});
  node.append(plot);
  const stages = page.memory.map((m) => `stage ${m.stage} (${m.in_flight_micro_batches} in flight)`);
  const names = [];
  page.memory.forEach((m) => Object.keys(m.parts).forEach((name) => { if (!names.includes(name)) names.push(name); }));
  const traces = names.map((name) => ({
    type: "bar", name, x: stages, y: page.memory.map((m) => (m.parts[name] || 0) / 1e6),
    hovertemplate: `${name}: %{y:.3f} MB<extra></extra>`,
  }));
  traces.push({type: "scatter", mode: "markers", name: "measured peak", x: stages,
    y: page.memory.map((m) => (m.measured_peak_bytes == null ? null : m.measured_peak_bytes / 1e6)),
    marker: {symbol: "diamond", size: 13, color: "black"},
    hovertemplate: page.memory.map((m) => `measured ${orNa(m.measured_peak_bytes, bytesToString)} (predicted ` +
      `${bytesToString(m.predicted_peak_bytes)}), at ${m.measured_at || "n/a"}<extra></extra>`)});
  Plotly.newPlot(plot, traces, {barmode: "stack", height: 380, margin: {l: 60, r: 20, t: 10, b: 40},
    yaxis: {title: {text: "MB"}}}, PLOT_CONFIG);
}

function drawLayers(article, page) {
  if (!page.layers) return;
  const node = section(article, "layers", "Layers", "Per layer, per iteration (click a heading to sort).");
  const headers = ["layer", "type", "stage", "params", "fwd", "bwd", "recompute", "fwd FLOPs", "bwd FLOPs",
                   "recompute FLOPs", "kept per micro-batch", "kept whole", "kept as checkpoint", "state"];
  node.append(table(headers, page.layers.map((l) => [
    cell(l.index), cell(l.type, String), cell(l.stage), cell(l.params, numberToString),
    cell(l.fwd_latency_s, durationToString), cell(l.bwd_latency_s, durationToString),
    cell(l.recompute_latency_s, durationToString), cell(l.fwd_flops, numberToString),
    cell(l.bwd_flops, numberToString), cell(l.recompute_flops, numberToString),
    cell(l.activation_bytes, bytesToString), cell(l.kept_whole_bytes, bytesToString),
    cell(l.kept_as_checkpoint_bytes, bytesToString), cell(l.state_bytes, bytesToString),
  ]), true));
}

function drawPrinted(article, page) {
  const node = section(article, "printed", "The report as printed", "The text report, as the run printed it.");
  node.append(element("pre", {class: "printed", text: page.printed}));
}

function drawComparison(main, pages) {
  const node = section(main, "comparison", "Side by side");
  const rows = [
    ["iteration", (p) => durationToString(p.summary.iteration_s)],
    ["hardware TFLOPs per GPU", (p) => orNa(p.summary.tflops_per_gpu, (v) => v.toPrecision(3))],
    ["MFU", (p) => orNa(p.summary.mfu, (v) => (100 * v).toFixed(1) + "%")],
    ["bubble", (p) => orNa(p.summary.bubble, (v) => (100 * v).toFixed(1) + "%")],
    ["bounding stage", (p) => orNa(p.summary.bounding_stage, String)],
    ["parallelism", (p) => `pp ${p.summary.pipeline_parallel_size} × tp ${p.summary.tensor_parallel_size} × dp ` +
      `${p.summary.data_parallel_size}, ${p.summary.micro_batches} micro-batches`],
    ["partition", (p) => (p.plan ? `[${p.plan.current_parts.join(", ")}]` : "n/a")],
  ];
  node.append(table([""].concat(pages.map((p) => p.title)),
                    rows.map(([name, value]) => [cell(name, String)].concat(pages.map((p) => cell(value(p), String)))),
                    false));
}
