"""The plain-text tables the benchmarks and the main job print."""


def format_cell(value, pattern: str) -> str:
    """A table cell: ``value`` through ``pattern``, or "-" for a value not measured."""
    return "-" if value is None else pattern.format(value)


def format_table(head: list[str], rows: list[list[str]], left: int = 1) -> str:
    """Columns as wide as their widest cell, two spaces apart, the head over a rule of dashes; the first
    ``left`` columns (the labels) align left, the others (the numbers) right."""
    widths = [max(len(row[i]) for row in [head] + rows) for i in range(len(head))]

    def line(row):
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(row) for row in rows])
