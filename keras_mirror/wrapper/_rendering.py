"""Tables in Keras's own style: `rich`, as `model.summary()` draws them.

Keras renders its summary with `rich` (`keras/src/utils/summary_utils.py`):
a bold title, a table with a heavy header, printed with colours to a
terminal, or captured as plain text when a `print_fn` is given. keras-mirror's
summary header and the demo's per-replica table use the same rendering, and
long cells wrap inside their column instead of running off the screen.
"""

import shutil

import rich.console
import rich.markup
import rich.table

# Keras's summary is 88 columns wide at most (its Sequential default).
LINE_LENGTH = 88


def line_length():
    """Keras's rule: at most 88 columns, at most the terminal's width - 4."""
    return min(LINE_LENGTH, shutil.get_terminal_size().columns - 4)


def table(title, header, rows, print_fn=None, justify=None, width=None):
    """Prints a `rich` table the way Keras prints `model.summary()`.

    Args:
        title: str. Printed above the table, in bold.
        header: list of str. Column titles.
        rows: list of lists of str. The cells, as text (no markup).
        print_fn: callable or None. As in `keras.Model.summary`: given, the
            table is rendered to plain text and passed to it in one call;
            None prints to the terminal (with colours when it is one).
        justify: list of str or None. Per column `"left"` or `"right"`;
            default all left.
        width: int or None. Total width; default `line_length()`.
    """
    width = width or line_length()
    justify = justify or ["left"] * len(header)
    columns = [rich.table.Column(name, justify=side)
               for name, side in zip(header, justify)]
    grid = rich.table.Table(*columns, width=width)
    for row in rows:
        grid.add_row(*(rich.markup.escape(str(cell)) for cell in row))
    if print_fn:
        console = rich.console.Console(highlight=False, force_terminal=False,
                                       color_system=None, width=width)
        console.begin_capture()
    else:
        console = rich.console.Console(highlight=False, width=width)
    console.print(f"[bold]{rich.markup.escape(title)}[/]")
    console.print(grid)
    if print_fn:
        print_fn(console.end_capture().rstrip("\n"))


def summary_header(mirrored, kwargs):
    """Prints `MirroredModel.summary()`'s table: replicas, path, statistics.

    `kwargs` are `summary`'s own (`print_fn`, `line_length`).
    """
    keys = mirrored._stat_keys()
    stats = ", ".join(keys) if keys else "none"
    if not mirrored.replica_stats:
        stats += " (replica_stats=False)"
    table(
        f'MirroredModel: "{mirrored.name}"', ["Setting", "Value"], [
            ["Replicas", f"{mirrored.num_replicas}: "
             + ", ".join(mirrored.devices)],
            ["Batch", repr(mirrored.batch_mode)],
            ["Execution path", mirrored.execution_summary],
            ["Per-replica statistics", stats],
        ], print_fn=kwargs.get("print_fn"),
        width=kwargs.get("line_length"))
