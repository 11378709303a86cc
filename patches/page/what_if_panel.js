// The what-if: move a boundary or a stage's recompute, see each stage's predicted time and peak (what_if.js).
function ranCounts(page) {
  return page.stages.map((s) => s.recomputed_layers.length);
}

// What the module asks for `parts` (the plan without a recompute choice keeps it): every recomputable layer where the
// run recomputed every one, none where it recomputed none, else the counts that ran.
function moduleCounts(page, parts) {
  const model = page.what_if, ran = ranCounts(page);
  const every = model.current_parts.slice(1).map((stop, s) => recomputableIn(model, model.current_parts[s], stop));
  if (ran.every((count, s) => count === every[s])) {
    return parts.slice(1).map((stop, s) => recomputableIn(model, parts[s], stop));
  }
  return ran;
}

function drawWhatIf(article, page) {
  const model = page.what_if;
  if (!model) return;
  const plan = page.plan || {};
  const stages = model.current_parts.length - 1, count = model.layers.length;
  const limit = model.memory_limit_bytes;
  const node = section(article, "what-if", "What if: another cut" + (model.recompute_terms ? ", another recompute" : ""),
    "Move a stage boundary (drag or type)" + (model.recompute_terms ? " or a stage's recompute" : "") +
    ": each stage's predicted time and peak and the predicted iteration follow, by the planner's model " +
    "(megatron-plan-partition REPORT --parts ..." + (model.recompute_terms ? " --recompute ..." : "") + ").");
  const controls = element("div", {class: "controls"});
  const limitInput = element("input", {type: "number", min: "0", step: "any", class: "limit",
                                       value: limit ? String(limit / 1e6) : ""});
  const boundaryInputs = [], countInputs = [];
  for (let b = 1; b < stages; b++) {
    const slider = element("input", {type: "range", min: "1", max: String(count - 1), step: "1",
                                     class: "boundary-slider", "data-boundary": String(b)});
    const number = element("input", {type: "number", min: "1", max: String(count - 1), step: "1",
                                     class: "boundary", "data-boundary": String(b)});
    slider.addEventListener("input", () => { number.value = slider.value; update(b); });
    number.addEventListener("input", () => { slider.value = number.value; update(b); });
    boundaryInputs.push([slider, number]);
    controls.append(element("label", {}, `stage ${b} starts at layer `, number, slider));
  }
  if (model.recompute_terms) {
    for (let s = 0; s < stages; s++) {
      const input = element("input", {type: "number", min: "0", step: "1", class: "recompute",
                                      "data-stage": String(s)});
      input.addEventListener("input", () => update(null));
      countInputs.push(input);
      controls.append(element("label", {}, `stage ${s} recomputes its first `, input, " layers"));
    }
  }
  controls.append(element("label", {}, "memory limit (MB) ", limitInput));
  const buttons = element("div", {class: "buttons"});
  const choose = (parts, counts) => {
    boundaryInputs.forEach(([slider, number], i) => { slider.value = number.value = String(parts[i + 1]); });
    countInputs.forEach((input, s) => { input.value = String(counts ? counts[s] : 0); });
    update(null);
  };
  const addButton = (text, parts, counts) => {
    const button = element("button", {type: "button", text});
    button.addEventListener("click", () => choose(parts, counts));
    buttons.append(button);
  };
  addButton("as it ran", model.current_parts, ranCounts(page));
  if (plan.parts) addButton("the plan", plan.parts, model.recompute_terms ? moduleCounts(page, plan.parts) : null);
  if (plan.recompute_plan && plan.recompute_plan.memory_fits) {
    addButton("the plan with recompute", plan.recompute_plan.parts, plan.recompute_plan.recompute_layers);
  }
  const output = element("pre", {class: "what-if-lines"});
  const strip = element("div", {class: "plot"});
  const loads = element("div", {class: "plot half"}), peaks = element("div", {class: "plot half"});
  node.append(controls, buttons, output, strip, element("div", {class: "row"}, loads, peaks));
  const asRan = predictWhatIf(model, model.current_parts, model.recompute_terms ? ranCounts(page) : null);

  function chosenParts() {
    return [0, ...boundaryInputs.map(([, number]) => Number(number.value)), count];
  }

  function update(moved) {
    let parts = chosenParts();
    // keep every stage non-empty: push the neighbours of the boundary moved
    if (moved != null) {
      for (let b = moved + 1; b < stages; b++) parts[b] = Math.max(parts[b], parts[b - 1] + 1);
      for (let b = moved - 1; b >= 1; b--) parts[b] = Math.min(parts[b], parts[b + 1] - 1);
      boundaryInputs.forEach(([slider, number], i) => { slider.value = number.value = String(parts[i + 1]); });
    }
    const valid = parts.every((p, i) => i === 0 || p > parts[i - 1]) && parts[stages] === count;
    const chosenLimit = limitInput.value === "" ? null : Math.round(Number(limitInput.value) * 1e6);
    if (!valid) {
      output.textContent = `parts [${parts.join(", ")}] leave a stage empty`;
      return;
    }
    const counts = model.recompute_terms ? countInputs.map((input) => Math.max(0, Number(input.value) || 0)) : null;
    countInputs.forEach((input, s) => { input.max = String(recomputableIn(model, parts[s], parts[s + 1])); });
    const result = predictWhatIf(model, parts, counts);
    node.dataset.result = JSON.stringify(result);
    output.textContent = `parts [${parts.join(", ")}]` + (counts ? `, recompute ${counts.join(",")}` : "") + "\n" +
      whatIfLines(model, result, chosenLimit || limit || null).join("\n");
    drawStrip(strip, page, parts);
    drawBars(loads, "stage time, per iteration (ms)", asRan.stage_s.map((v) => v * 1e3),
             result.stage_s.map((v) => v * 1e3), null);
    if (result.predicted_peak_bytes) {
      drawBars(peaks, "stage peak (MB)", asRan.predicted_peak_bytes.map((v) => v / 1e6),
               result.predicted_peak_bytes.map((v) => v / 1e6), (chosenLimit || limit || 0) / 1e6 || null);
    }
  }
  limitInput.addEventListener("input", () => update(null));
  choose(model.current_parts, ranCounts(page));
}

function drawStrip(plot, page, parts) {
  const model = page.what_if, plan = page.plan || {};
  const rows = [["as it ran", model.current_parts]];
  if (plan.parts) rows.push(["the plan", plan.parts]);
  if (plan.recompute_plan) rows.push(["the plan with recompute", plan.recompute_plan.parts]);
  rows.push(["your cut", parts]);
  const traces = [];
  for (let s = 0; s < parts.length - 1; s++) {  // one trace per stage, a bar in each row
    traces.push({type: "bar", orientation: "h", y: rows.map(([name]) => name),
      base: rows.map(([, cut]) => cut[s]), x: rows.map(([, cut]) => cut[s + 1] - cut[s]),
      marker: {color: STAGE_COLOURS[s % STAGE_COLOURS.length], line: {color: "white", width: 2}},
      showlegend: false, text: rows.map(([, cut]) => `stage ${s}: ${cut[s]}–${cut[s + 1] - 1}`), textposition: "inside",
      hovertext: rows.map(([name, cut]) => `${name}: stage ${s} holds layers ${cut[s]} to ${cut[s + 1] - 1}`),
      hoverinfo: "text"});
  }
  Plotly.react(plot, traces, {barmode: "overlay", height: 60 + 34 * rows.length, margin: {l: 170, r: 20, t: 10, b: 30},
    xaxis: {title: {text: "layer"}, range: [0, model.layers.length], dtick: 1},
    yaxis: {categoryorder: "array", categoryarray: rows.map(([name]) => name).reverse()}}, PLOT_CONFIG);
}

function drawBars(plot, title, ran, chosen, limit) {
  const stages = chosen.map((_, s) => `stage ${s}`);
  const layout = {barmode: "group", height: 320, margin: {l: 60, r: 20, t: 30, b: 40}, title: {text: title},
    legend: {orientation: "h"}, shapes: []};
  if (limit) {
    layout.shapes.push({type: "line", xref: "paper", x0: 0, x1: 1, y0: limit, y1: limit,
                        line: {color: "#c44e52", dash: "dash"}});
    layout.annotations = [{xref: "paper", x: 1, y: limit, text: "limit", showarrow: false, yanchor: "bottom",
                           xanchor: "right", font: {color: "#c44e52"}}];
  }
  Plotly.react(plot, [
    {type: "bar", name: "as it ran (predicted)", x: stages.slice(0, ran.length), y: ran, marker: {color: "#bbbbbb"}},
    {type: "bar", name: "your cut", x: stages, y: chosen, marker: {color: "#4c72b0"}},
  ], layout, PLOT_CONFIG);
}
