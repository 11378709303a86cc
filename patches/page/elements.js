// Building blocks: elements, sections, sortable tables.
function element(tag, attributes, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attributes || {})) {
    if (key === "text") node.textContent = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) if (child != null) node.append(child);
  return node;
}

function section(parent, id, title, help) {  // id: the section's class (several reports: several of each)
  const node = element("section", {class: id}, element("h2", {text: title}));
  if (help) node.append(element("p", {class: "help", text: help}));
  parent.append(node);
  return node;
}

function orNa(value, format) {
  return value == null ? "n/a" : format(value);
}

function table(headers, rows, sortable) {
  const head = element("tr");
  const body = element("tbody");
  const node = element("table", {class: sortable ? "sortable" : ""}, element("thead", {}, head), body);
  const fill = (ordered) => {
    body.replaceChildren(...ordered.map((row) => element("tr", {}, ...row.map((cell) => element("td", {
      text: cell.text, class: typeof cell.value === "number" ? "number" : ""})))));
  };
  let order = rows.slice();
  headers.forEach((header, column) => {
    const cell = element("th", {text: header, title: sortable ? "sort by this column" : ""});
    if (sortable) {
      cell.addEventListener("click", () => {
        const descending = cell.dataset.sorted !== "descending";
        head.querySelectorAll("th").forEach((th) => delete th.dataset.sorted);
        cell.dataset.sorted = descending ? "descending" : "ascending";
        order = rows.slice().sort((a, b) => {
          const [x, y] = [a[column].value, b[column].value];
          const compared = typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y));
          return descending ? -compared : compared;
        });
        fill(order);
      });
    }
    head.append(cell);
  });
  fill(order);
  return node;
}

function cell(value, format) {
  return {value: value == null ? -Infinity : value, text: value == null ? "n/a" : (format ? format(value) : value)};
}
