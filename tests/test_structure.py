"""The layering the code promises (docs/ARCHITECTURE.md), checked by reading the source with `ast`:

- no method-name string test (`method == "h2o"`, `x in ("full", ...)`) outside rocketkv_jax/methods/;
- no import of a private (underscore) name across modules, no `module._name` reach-in;
- layers in one direction: the core never imports Flax, `models` or `serving`; kernels never import the core;
  `models` never imports `serving` (the top layer);
- no import cycle among the project's modules;
- the package (rocketkv_jax, kernels, models) never imports `benchmarks` (a checkout's scripts, not installed),
  by an import statement or by `importlib.import_module("benchmarks...")`;
- nothing imports the removed fused selection kernel (`kernels/hsa_select.py`, issue 38);
- the KV core's op table (`rocketkv_jax/ops.py`) holds no model op: the model's RMSNorm / RoPE kernels are
  imported by `models/layer_ops.py` only, never by the core (issue 38);
- no capability probes in the package: no `hasattr(...)`, no `getattr(config, "name", default)`; a
  method's capabilities are ClassVars its parts declare (`MethodConfig.uses_kt_pages`, `scores_channels`, issue 38);
- methods by composition, not mixins: every class in rocketkv_jax/methods/ has one base and none is or inherits a
  `*Mixin`; every registered config is a stage-1 `Policy` plus a stage-2 `Selector`, its capabilities theirs
  (issue 38);
- one compile cache: only `models/executables.py` calls `.compile()` in the package (issue 38).
"""
import ast
import pathlib

import pytest

import rocketkv_jax as rk

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Folder -> the module prefix it is installed as.
PACKAGES = {"rocketkv_jax": "rocketkv_jax", "kernels": "rocketkv_jax.kernels", "models": "rocketkv_jax.models",
            "benchmarks": "benchmarks", "tests": "tests"}


def _modules():
  """{module name: (path, ast)} of every project source file."""
  out = {}
  for folder, prefix in PACKAGES.items():
    for path in sorted((ROOT / folder).rglob("*.py")):
      rel = path.relative_to(ROOT / folder).with_suffix("")
      parts = [p for p in rel.parts if p != "__init__"]
      out[".".join([prefix, *parts])] = (path, ast.parse(path.read_text(encoding="utf-8"), str(path)))
  return out


MODULES = _modules()


def _layer(name: str) -> str:
  if name.startswith("rocketkv_jax.kernels"):
    return "kernels"
  if name.startswith("rocketkv_jax.models"):
    return "models"
  if name.startswith("rocketkv_jax.serving"):
    return "serving"
  if name.startswith("rocketkv_jax.eval"):  # the accuracy suite: on top of the models, beside serving
    return "eval"
  if name.startswith("rocketkv_jax"):
    return "core"
  return name.split(".")[0]


def _imports(name: str, tree: ast.AST, *, top_level_only: bool = False):
  """(imported module, imported names, line) for each import; relative imports resolved."""
  package = name if (MODULES[name][0].name == "__init__.py") else name.rsplit(".", 1)[0]
  nodes = tree.body if top_level_only else ast.walk(tree)
  for node in nodes:
    if isinstance(node, ast.Import):
      for a in node.names:
        yield a.name, [], node.lineno
    elif isinstance(node, ast.ImportFrom):
      mod = node.module or ""
      if node.level:
        base = package.split(".")
        base = base[:len(base) - node.level + 1]
        mod = ".".join(base + ([mod] if mod else []))
      yield mod, [a.name for a in node.names], node.lineno


_PROJECT = ("core", "kernels", "models", "serving", "eval", "benchmarks", "tests")


def test_no_method_name_tests_outside_methods():
  names = set(rk.METHODS)
  found = []
  for name, (path, tree) in MODULES.items():
    if name.startswith("rocketkv_jax.methods") or name.startswith("tests."):
      continue
    for node in ast.walk(tree):
      if not isinstance(node, ast.Compare):
        continue
      for side in [node.left, *node.comparators]:
        consts = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
        if any(isinstance(c, ast.Constant) and c.value in names for c in consts):
          found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
  assert not found, "method-name tests outside rocketkv_jax/methods/:\n" + "\n".join(found)


def test_no_private_names_across_modules():
  found = []
  for name, (path, tree) in MODULES.items():
    aliases = set()  # local names bound to project modules or project names
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        aliases.update(a.asname or a.name.split(".")[0] for a in node.names if _layer(a.name) in _PROJECT)
      elif isinstance(node, ast.ImportFrom) and (node.level or _layer(node.module or "") in _PROJECT):
        aliases.update(a.asname or a.name for a in node.names)
    for mod, imported, line in _imports(name, tree):
      if _layer(mod) not in _PROJECT:
        continue
      for n in imported:
        if n.startswith("_") and not n.startswith("__"):
          found.append(f"{path.relative_to(ROOT)}:{line}: from {mod} import {n}")
      if any(part.startswith("_") and not part.startswith("__") for part in mod.split(".")):
        found.append(f"{path.relative_to(ROOT)}:{line}: import of private module {mod}")
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
          and node.attr.startswith("_") and not node.attr.startswith("__")):
        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
  assert not found, "private names used across modules:\n" + "\n".join(found)


@pytest.mark.parametrize("layer,forbidden", [
    ("core", ("flax", "rocketkv_jax.models", "rocketkv_jax.serving", "rocketkv_jax.eval")),
    ("kernels", ("flax", "rocketkv_jax.models", "rocketkv_jax.serving", "rocketkv_jax.eval")),
    ("models", ("rocketkv_jax.serving", "rocketkv_jax.eval")),
    ("eval", ("rocketkv_jax.serving",)),
])
def test_layers_import_downwards(layer, forbidden):
  found = []
  for name, (path, tree) in MODULES.items():
    if _layer(name) != layer:
      continue
    for mod, _, line in _imports(name, tree):
      bad = any(mod == f or mod.startswith(f + ".") for f in forbidden)
      if layer == "kernels" and _layer(mod) == "core":
        bad = True
      if bad:
        found.append(f"{path.relative_to(ROOT)}:{line}: imports {mod}")
  assert not found, f"{layer} imports upwards:\n" + "\n".join(found)


def test_no_import_cycles():
  graph = {}
  for name, (_, tree) in MODULES.items():
    deps = set()
    for mod, imported, _ in _imports(name, tree, top_level_only=True):
      for cand in [f"{mod}.{n}" for n in imported] + [mod]:
        if cand in MODULES and cand != name:
          deps.add(cand)
          break
    graph[name] = deps
  cycles, state = [], {}

  def visit(node, stack):
    state[node] = "open"
    for dep in graph[node]:
      if state.get(dep) == "open":
        cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
      elif dep not in state:
        visit(dep, stack + [dep])
    state[node] = "done"

  for node in graph:
    if node not in state:
      visit(node, [node])
  assert not cycles, "import cycles:\n" + "\n".join(cycles)


def _is(mod: str, target: str) -> bool:
  return mod == target or mod.startswith(target + ".")


def _dynamic_imports(tree: ast.AST):
  """(module, line) of each `importlib.import_module("...")` / `__import__("...")` with a constant name."""
  for node in ast.walk(tree):
    if (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
        and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
             or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__")))):
      yield node.args[0].value, node.lineno


def test_the_package_does_not_import_benchmarks():
  """`rocketkv eval` and every other command run from a wheel, where `benchmarks` does not exist: the benchmarks
  import the package, never the other way round."""
  found = []
  for name, (path, tree) in MODULES.items():
    if not name.startswith("rocketkv_jax"):
      continue
    imports = [(mod, line) for mod, _, line in _imports(name, tree)] + list(_dynamic_imports(tree))
    found += [f"{path.relative_to(ROOT)}:{line}: imports {mod}" for mod, line in imports if _is(mod, "benchmarks")]
  assert not found, "the package imports benchmarks:\n" + "\n".join(found)


def test_nothing_imports_the_removed_fused_selection():
  """`kernels/hsa_select.py` (the fused scoring + selection experiment, never on the decode path) was removed in
  issue 38; no module may bring it back by an import."""
  assert not (ROOT / "kernels" / "hsa_select.py").exists()
  found = []
  for name, (path, tree) in MODULES.items():
    if (ROOT / "benchmarks" / "results") in path.parents:  # the scratch scripts of past runs stay as history
      continue
    imports = [(mod, names, line) for mod, names, line in _imports(name, tree)]
    imports += [(mod, [], line) for mod, line in _dynamic_imports(tree)]
    for mod, names, line in imports:
      if (any(_is(mod, m) for m in ("rocketkv_jax.kernels.hsa_select", "kernels.hsa_select"))
          or (mod in ("rocketkv_jax.kernels", "kernels") and "hsa_select" in names)):
        found.append(f"{path.relative_to(ROOT)}:{line}: imports {mod} {names}")
  assert not found, "imports of the removed kernels/hsa_select.py:\n" + "\n".join(found)


def test_no_capability_probes_in_the_package():
  """A method says what it can do by ClassVars (`uses_kt_pages`, `scores_channels`, ..., derived from its policy
  and selector), read as plain attributes; probing an object for an attribute (`hasattr(c, "topr")`,
  `getattr(self, "kt_pages", None)`) hides which methods have it. Checked in the whole package: core (methods
  included), kernels, models, serving, eval."""
  found = []
  for name, (path, tree) in MODULES.items():
    if _layer(name) not in ("core", "kernels", "models", "serving", "eval"):
      continue
    for node in ast.walk(tree):
      if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        continue
      if node.func.id == "hasattr" or (
          node.func.id == "getattr" and len(node.args) == 3 and isinstance(node.args[0], ast.Name)
          and node.args[0].id in ("self", "cls", "c", "config") and isinstance(node.args[1], ast.Constant)):
        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
  assert not found, "capability probes (declare a ClassVar instead):\n" + "\n".join(found)


def test_the_models_ops_stay_out_of_the_core():
  """The model's own kernels (kernels/rms_norm.py, kernels/qkv_rope.py) are the model's ops (`models/layer_ops.py`);
  the KV core never imports them."""
  model_kernels = ("rocketkv_jax.kernels.rms_norm", "rocketkv_jax.kernels.qkv_rope")
  found = []
  for name, (path, tree) in MODULES.items():
    if _layer(name) != "core":
      continue
    for mod, names, line in _imports(name, tree):
      if any(_is(mod, m) for m in model_kernels) or (
          mod == "rocketkv_jax.kernels" and {"rms_norm", "qkv_rope"} & set(names)):
        found.append(f"{path.relative_to(ROOT)}:{line}: imports {mod} {names}")
  assert not found, "the core imports the model's kernels:\n" + "\n".join(found)


def test_one_compile_cache():
  """Everything the package compiles ahead of time goes through `models/executables.py` (`Executables`): no other
  module calls `.compile()` on a lowered function or keeps executables of its own (issue 38)."""
  found = []
  for name, (path, tree) in MODULES.items():
    if _layer(name) not in ("core", "kernels", "models", "serving", "eval") or name == "rocketkv_jax.models.executables":
      continue
    for node in ast.walk(tree):
      if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "compile"
          and not node.args and not node.keywords):
        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
  assert not found, "compiles outside models/executables.py (use an Executables):\n" + "\n".join(found)


def test_methods_compose_a_policy_and_a_selector():
  """A method is a config naming a stage-1 policy and a stage-2 selector (methods/base.py), not a stack of mixins:
  no class in rocketkv_jax/methods/ is or inherits a `*Mixin`, and each has at most one base; every registered config
  derives from MethodConfig (or from one registered config: a variant, rocketkv_plus), names a `Policy` and a
  `Selector`, and its capabilities are theirs."""
  from rocketkv_jax.methods.base import MethodConfig, Policy, Selector
  found = []
  for name, (path, tree) in MODULES.items():
    if not name.startswith("rocketkv_jax.methods"):
      continue
    for node in ast.walk(tree):
      if not isinstance(node, ast.ClassDef):
        continue
      bases = [ast.unparse(b) for b in node.bases]
      if node.name.endswith("Mixin") or any(b.endswith("Mixin") for b in bases) or len(bases) > 1:
        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: class {node.name}({', '.join(bases)})")
  assert not found, "mixins or several bases in rocketkv_jax/methods/ (compose a Policy and a Selector):\n" + \
      "\n".join(found)
  configs = set(rk.REGISTRY.values())
  for cls in configs:
    (base,) = cls.__bases__
    assert base is MethodConfig or base in configs, f"{cls.__name__} derives from {base.__name__}"
    policy, selector = cls.policy, cls.selector
    assert isinstance(policy, Policy) and isinstance(selector, Selector), cls.__name__
    assert (cls.evicts, cls.budgeted, cls.uses_kt_pages, cls.scores_channels) == (
        policy.evicts, policy.budgeted or selector.budgeted, selector.uses_kt_pages, selector.scores_channels)
    states = {policy.state_class, selector.state_class} - {None}  # the one part that keeps cache state, if any
    assert len(states) <= 1 and cls.state_class == (states.pop() if states else None), cls.__name__

