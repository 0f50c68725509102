"""Scaling analysis of hpcpar run records (pandas tables, plots, reports).

>>> runs, steps = load(["sweep/"])            # run or sweep directories
>>> table = scaling_table(runs, steps)         # one row per (config, ranks)

May import: hpcpar.errors, hpcpar.formats (the record format and the job spec).
"""

from .expect import check_expectations, read_expectations
from .load import find_runs, load, load_run, load_run_parts
from .scaling import TABLE_COLUMNS, detect_mode, scaling_table
from .settings import resolved_settings, settings_hash, split_unlike
from .stats import PHASES, drop_warmup
from .synthetic import synthetic_run

__all__ = ["load", "load_run", "load_run_parts", "find_runs", "scaling_table", "detect_mode",
           "drop_warmup",
           "TABLE_COLUMNS", "PHASES", "synthetic_run", "write_report", "write_comparison",
           "resolved_settings", "settings_hash", "split_unlike", "read_expectations",
           "check_expectations"]


def __getattr__(name):
    if name == "write_report":  # matplotlib loads only when a report is written
        from .render import write_report  # deferred: loads matplotlib, jinja2

        return write_report
    if name == "write_comparison":
        from .compare import write_comparison  # deferred: loads matplotlib, jinja2

        return write_comparison
    raise AttributeError(f"module 'hpcpar.analysis' has no attribute {name!r}")
