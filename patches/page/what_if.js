// The planner's model (patches/partition/what_if.py): the same terms, the same formulas, sums in the same order, so
// that a what-if here is megatron-plan-partition's --parts (and --recompute) to the last digit.
function modelIterS(stageS, microBatches, sharedCpus) {  // planner.model_iter_s
  if (sharedCpus != null) {  // SharedCpus.micro_batch_work_s, then shared_schedule.shared_cpus_iter_s
    const forward = sharedCpus.forward_share != null ? sharedCpus.forward_share : 1 / 3;
    const share = sharedCpus.stage_shares == null ? sharedCpus.share : 1.0;  // else taken out of each layer already
    const together = sharedCpus.together_rate != null ? sharedCpus.together_rate : 1.0;
    const togetherThreads = Math.min(sharedCpus.ranks * sharedCpus.threads, sharedCpus.cpus);
    return sharedCpusIterS(stageS.map((seconds) => seconds * share * forward / microBatches),
                           stageS.map((seconds) => seconds * share * (1 - forward) / microBatches),
                           microBatches, sharedCpus.cpus, sharedCpus.threads * sharedCpus.ranks_per_stage,
                           together, togetherThreads);
  }
  const perMicroBatch = stageS.map((seconds) => seconds / microBatches);
  let sum = 0;
  for (const value of perMicroBatch) sum += value;
  return sum + (microBatches - 1) * Math.max(...perMicroBatch);
}

function scheduleOrder(stage, stages, microBatches) {  // shared_schedule.schedule_order: [isForward, micro-batch]
  const warmUp = Math.min(stages - stage - 1, microBatches);
  const order = [];
  for (let i = 0; i < warmUp; i++) order.push([true, i]);
  for (let i = 0; i < microBatches - warmUp; i++) order.push([true, warmUp + i], [false, i]);
  for (let i = microBatches - warmUp; i < microBatches; i++) order.push([false, i]);
  return order;
}

// shared_schedule.running_rate: each running thread's speed, the busy CPUs slowed as they fill.
function runningRate(threads, cpus, togetherRate, togetherThreads) {
  const busy = Math.min(threads, cpus);
  const crowding = togetherThreads > 1 ? Math.min(1.0, (busy - 1) / (togetherThreads - 1)) : 0.0;
  return busy * (1.0 - (1.0 - togetherRate) * crowding) / threads;
}

// shared_schedule.shared_cpus_iter_s: 1F1B with the CPUs split among the ranks that have work, step for step.
function sharedCpusIterS(forwardS, backwardS, microBatches, cpus, threadsPerStage, togetherRate, togetherThreads) {
  const stages = forwardS.length;
  const orders = [];
  for (let stage = 0; stage < stages; stage++) orders.push(scheduleOrder(stage, stages, microBatches));
  const nextStep = new Array(stages).fill(0);
  const forwardsDone = new Array(stages).fill(0), backwardsDone = new Array(stages).fill(0);
  const workLeft = new Array(stages).fill(null);
  let now = 0;
  while (orders.some((order, stage) => nextStep[stage] < order.length)) {
    const running = [];
    for (let stage = 0; stage < stages; stage++) {
      if (nextStep[stage] === orders[stage].length) continue;
      const [isForward, microBatch] = orders[stage][nextStep[stage]];
      const ready = isForward ? (stage === 0 || forwardsDone[stage - 1] > microBatch)
                              : (stage === stages - 1 || backwardsDone[stage + 1] > microBatch);
      if (ready) {
        if (workLeft[stage] === null) workLeft[stage] = isForward ? forwardS[stage] : backwardS[stage];
        running.push(stage);
      }
    }
    const rate = runningRate(running.length * threadsPerStage, cpus, togetherRate, togetherThreads);
    const step = Math.min(...running.map((stage) => workLeft[stage] / rate));
    now += step;
    for (const stage of running) {
      if (workLeft[stage] / rate <= step) {
        if (orders[stage][nextStep[stage]][0]) forwardsDone[stage] += 1; else backwardsDone[stage] += 1;
        nextStep[stage] += 1;
        workLeft[stage] = null;
      } else {
        workLeft[stage] -= step * rate;
      }
    }
  }
  return now;
}

function floorDiv(a, b) {  // Python's // on integers, exact (BigInt) and rounding down for negatives too
  const [x, y] = [BigInt(a), BigInt(b)];
  let quotient = x / y;
  if ((x % y !== 0n) && ((x < 0n) !== (y < 0n))) quotient -= 1n;
  return Number(quotient);
}

function stagePeak(stateBytes, layerActivationBytes, position, recomputeTransientBytes, largestParamBytes) {
  // memory_model.stage_peak
  const activation = layerActivationBytes + position.outside_layers_bytes;
  const held = position.base_bytes + stateBytes;
  const transient = position.holds_the_loss
    ? Math.max(position.compute_transient_bytes, recomputeTransientBytes)
    : Math.max(0, position.compute_transient_bytes - position.recomputed_transient_bytes) + recomputeTransientBytes;
  const compute = held + position.in_flight_micro_batches * activation + transient;
  let scaled = position.step_transient_bytes - position.fixed_buffer_bytes;
  if (position.step_state_bytes) scaled = floorDiv(BigInt(scaled) * BigInt(stateBytes), position.step_state_bytes);
  if (position.step_floor_param_bytes) {  // the step floor
    scaled = Math.max(scaled, floorDiv(BigInt(position.step_floor_bytes) * BigInt(largestParamBytes),
                                       position.step_floor_param_bytes));
  }
  const step = held + position.fixed_buffer_bytes + scaled;
  return Math.max(compute, step);
}

function prefix(values) {
  const sums = [0];
  for (const value of values) sums.push(sums[sums.length - 1] + value);
  return sums;
}

function directSum(values) {
  let sum = 0;
  for (const value of values) sum += value;
  return sum;
}

// What the measured run predicts for `parts` (and, where the model has recompute terms and `counts` is given, stage
// s recomputing its first counts[s] recomputable layers): report_plan.plan_of(PlanRequest(parts=...)) and
// report_plan.recompute_what_if.
function predictWhatIf(model, parts, counts) {
  const layers = model.layers, micro = model.micro_batches, stages = parts.length - 1;
  const positions = model.positions, withRecompute = model.recompute_terms && counts != null;
  const stageS = [], peaks = [], pricedFromForward = [];
  const recomputable = layers.map((layer, place) => (layer.recomputable ? place : -1)).filter((p) => p >= 0);
  const chosen = recomputable.map((place) => layers[place]);
  const base = prefix(layers.map((layer) => layer.base_s));
  const saved = prefix(chosen.map((layer) => Math.max(0, layer.whole_bytes - layer.checkpoint_bytes)));
  const recomputeS = prefix(chosen.map((layer) => layer.recompute_s));
  const whole = prefix(layers.map((layer) => layer.whole_bytes));
  const state = prefix(layers.map((layer) => layer.state_bytes));
  const kept = prefix(layers.map((layer) => layer.activation_bytes));
  for (let s = 0; s < stages; s++) {
    const first = parts[s], stop = parts[s + 1], overhead = model.overhead_s[s];
    let largestParam = 0;
    for (let i = first; i < stop; i++) largestParam = Math.max(largestParam, layers[i].largest_param_bytes);
    if (withRecompute) {  // recompute_plan.StageOptions.choice
      const start = recomputable.filter((place) => place < first).length;
      const end = recomputable.filter((place) => place < stop).length;
      const k = Math.min(counts[s], end - start);
      let largest = 0;
      for (let i = start; i < start + k; i++) largest = Math.max(largest, chosen[i].whole_bytes);
      for (let i = start; i < start + k; i++) if (!chosen[i].recomputed) pricedFromForward.push(chosen[i].index);
      stageS.push(base[stop] - base[first] + overhead + recomputeS[start + k] - recomputeS[start]);
      if (positions) {  // StageOptions._choice and _rise
        const activation = whole[stop] - whole[first] - (saved[start + k] - saved[start]);
        const rise = k ? Math.max(0, largest - (whole[stop] - whole[recomputable[start + k - 1] + 1])) : 0;
        peaks.push(stagePeak(state[stop] - state[first], activation, positions[s], rise, largestParam));
      }
    } else {  // planner.predict's loads; report_plan.peak_of
      stageS.push(directSum(layers.slice(first, stop).map((layer) => layer.seconds)) + overhead);
      if (positions) {  // as it ran: the measured transient (report_plan.peak_of reads no recompute terms)
        const asRan = Object.assign({}, positions[s], {recomputed_transient_bytes: 0});
        peaks.push(stagePeak(state[stop] - state[first], kept[stop] - kept[first], asRan, 0, largestParam));
      }
    }
  }
  const modelled = modelIterS(stageS, micro, model.shared_cpus);
  const predicted = withRecompute ? modelled + model.measured_iter_s - model.ran_model_s
                                  : modelled + (model.measured_iter_s - model.ran_model_s);
  return {parts: parts.slice(), counts: withRecompute ? counts.slice() : null, stage_s: stageS,
          predicted_iter_s: predicted, predicted_change: predicted / model.measured_iter_s - 1,
          predicted_peak_bytes: positions ? peaks : null,
          recompute_priced_from_forward: withRecompute ? pricedFromForward : null};
}

// plan_lines.priced_from_forward_words: the layers a choice recomputes that the run kept whole, said.
function pricedFromForwardWords(layers) {
  if (!layers || !layers.length) return "";
  const one = layers.length === 1, their = one ? "its" : "their";
  const names = one ? `layer ${layers[0]}` : `layers ${layers.slice(0, -1).join(", ")} and ${layers[layers.length - 1]}`;
  return `; ${names} kept ${their} activations whole in this run: ${their} recompute is priced at that forward, `
    + "not measured (a profile of a run that recomputes them measures it)";
}

function recomputableIn(model, first, stop) {
  return model.layers.slice(first, stop).filter((layer) => layer.recomputable).length;
}

// The lines megatron-plan-partition prints for the same choice (--parts, and --recompute).
function whatIfLines(model, result, limit) {
  const label = result.counts ? "with recompute" : "with parts";
  const lines = [`stage loads ${label}: ` + result.stage_s.map(durationToString).join(", ")];
  if (result.predicted_peak_bytes) {
    lines.push(`stage peaks ${label}: ` + result.predicted_peak_bytes.map(bytesToString).join(", ")
               + (limit ? ` (limit ${bytesToString(limit)})` : ""));
  }
  let words = `iteration ${durationToString(result.predicted_iter_s)} predicted against `
              + `${durationToString(model.measured_iter_s)} measured, ${signedPercent(result.predicted_change)}`;
  if (limit && result.predicted_peak_bytes) {
    const peaks = result.predicted_peak_bytes, worst = peaks.indexOf(Math.max(...peaks));
    words += peaks[worst] <= limit
      ? `; every stage within ${bytesToString(limit)}, stage ${worst} the closest at ${bytesToString(peaks[worst])}`
      : `; stage ${worst}'s predicted memory peak, ${bytesToString(peaks[worst])}, exceeds ${bytesToString(limit)}`
        + ` by ${groupedInteger(peaks[worst] - limit)} bytes`;
  }
  lines.push(words + pricedFromForwardWords(result.recompute_priced_from_forward));
  if (model.shared_cpus_words) lines.push(model.shared_cpus_words);  // the ranks shared too few CPUs, said
  return lines;
}
