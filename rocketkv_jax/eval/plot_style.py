"""One look for every benchmark plot (the accuracy suite's report.py, benchmarks/render_decode.py through
benchmarks/plot_style.py): a fixed colour per method, so a method has the same colour in every figure, and the
small helpers the plots share."""
from __future__ import annotations

# Method -> colour (matplotlib's tab10 by name). RocketKV is the emphasised line of every plot.
METHOD_COLORS = {
    "full": "black",
    "rocketkv": "tab:red",
    "snapkv": "tab:blue",
    "quest": "tab:orange",
    "sparq": "tab:green",
    "streaming_llm": "tab:purple",
    "h2o": "tab:brown",
    "hsa": "tab:pink",
    "exact_topk": "tab:gray",
}
_SPARE = ("tab:olive", "tab:cyan", "gold", "teal", "navy", "lime")
EMPHASIS = {"rocketkv": 2.6}  # line width of the emphasised method; others get LINE_WIDTH
LINE_WIDTH = 1.3
# Budget -> line style / marker, for plots that show one method at several budgets (one colour per method).
BUDGET_STYLES = (("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"))


def method_color(method: str) -> str:
  """The method's colour; a method missing from METHOD_COLORS gets a spare colour fixed by its name."""
  if method in METHOD_COLORS:
    return METHOD_COLORS[method]
  return _SPARE[sum(map(ord, method)) % len(_SPARE)]


def method_width(method: str) -> float:
  return EMPHASIS.get(method, LINE_WIDTH)


def budget_style(budget, budgets) -> tuple[str, str]:
  """(line style, marker) of a budget among the plot's budgets (sorted; None, full KV's, gets the first)."""
  order = sorted(b for b in set(budgets) if b is not None)
  i = order.index(budget) if budget in order else 0
  return BUDGET_STYLES[i % len(BUDGET_STYLES)]


def tokens_label(n: int) -> str:
  """16384 -> '16k', 131072 -> '128k', 8000 -> '8000', 1024 -> '1k'."""
  return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def model_label(model: str) -> str:
  """The model's name as a title shows it ('smollm2' and a path to its GGUF both name SmolLM2-135M-Instruct)."""
  known = {"llama-3.1-8b-shape": "Llama-3.1-8B shape", "smollm2": "SmolLM2-135M-Instruct Q4_1",
           "tiny": "tiny test model"}
  if model in known:
    return known[model]
  name = model.rstrip("/").rsplit("/", 1)[-1]
  return name[:-len(".gguf")].replace(".Q", " Q") if name.endswith(".gguf") else name
