"""Widgets shared by the screens: metric charts, the breakdown bar, the trials plot, config
panels, tables that fit their width."""

from tunekit.tui.widgets.breakdown import BreakdownBar
from tunekit.tui.widgets.chart import Chart, Series
from tunekit.tui.widgets.config import ConfigPanel
from tunekit.tui.widgets.metric import MetricRow
from tunekit.tui.widgets.plot import TrialPoint, TrialsPlot
from tunekit.tui.widgets.table import Column, FitTable

__all__ = [
    "BreakdownBar",
    "Chart",
    "Column",
    "ConfigPanel",
    "FitTable",
    "MetricRow",
    "Series",
    "TrialPoint",
    "TrialsPlot",
]
