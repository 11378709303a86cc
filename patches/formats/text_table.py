"""Plain-text tables and labelled lines, in the layout of DeepSpeed's flops profiler (the report's printer)."""


def table(headers: list, rows: list, indent: str = "  ") -> list:
    """The rows under their headers, each column as wide as its widest cell."""
    widths = [max(len(str(row[i])) for row in [headers] + rows) for i in range(len(headers))]
    return [indent + "  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip()
            for row in [headers] + rows]


def labelled_line(label: str, value) -> str:
    """'label   value', the value in one column at 74 characters (the summary's layout)."""
    return f"{label:<72}  {value}"


def percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.2f}%" if whole else "0%"
