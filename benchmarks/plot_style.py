"""The benchmarks' plot look is the package's, `rocketkv_jax.eval.plot_style` (the accuracy suite's plots use it
from the installed package): one colour per method in every figure."""
from rocketkv_jax.eval.plot_style import (BUDGET_STYLES, EMPHASIS, LINE_WIDTH, METHOD_COLORS, budget_style,
                                          method_color, method_width, model_label, tokens_label)

__all__ = ["BUDGET_STYLES", "EMPHASIS", "LINE_WIDTH", "METHOD_COLORS", "budget_style", "method_color",
           "method_width", "model_label", "tokens_label"]
