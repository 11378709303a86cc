// Numbers as the report prints them (patches/formats/units.py), so that the page prints what the commands print.
const SCALES = [[1e18, "E"], [1e15, "P"], [1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "K"]];

function decimals(value) {
  return value.toFixed(2).replace(/0+$/, "").replace(/\.$/, "");
}

function numberToString(num) {
  for (const [scale, unit] of SCALES) {
    if (Math.abs(num) >= scale) return `${decimals(num / scale)} ${unit}`;
  }
  return decimals(num);
}

function bytesToString(num) {
  const text = numberToString(num);
  return /[A-Za-z]$/.test(text) ? `${text}B` : `${text} B`;
}

function durationToString(seconds) {
  if (seconds === 0 || seconds >= 1) return `${decimals(seconds)} s`;
  if (seconds >= 1e-3) return `${decimals(seconds * 1e3)} ms`;
  return `${decimals(seconds * 1e6)} us`;
}

function signedPercent(fraction) {
  const value = 100 * fraction;
  return (value >= 0 || Object.is(value, 0) ? "+" : "") + value.toFixed(1) + "%";
}

function groupedInteger(value) {  // Python's f"{value:,}"
  return String(value).replace(/\B(?=(\d{3})+(?!\d))/g, ",");
}
