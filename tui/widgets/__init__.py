"""Widgets shared by the screens: metric sparklines, the breakdown bar, the plot, config panels."""

from tunekit.tui.widgets.breakdown import BreakdownBar
from tunekit.tui.widgets.config import ConfigPanel
from tunekit.tui.widgets.metric import MetricRow
from tunekit.tui.widgets.plot import PredictedVsMeasured

__all__ = ["BreakdownBar", "ConfigPanel", "MetricRow", "PredictedVsMeasured"]
