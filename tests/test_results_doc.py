"""docs/RESULTS.md is generated from the current result files (benchmarks/make_results_doc.py): it cannot drift.
The manuals' links resolve, and every markdown file's code fences pair up."""
import pathlib
import re

from benchmarks import make_results_doc

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_results_doc_is_what_the_script_writes():
  committed = (ROOT / "docs" / "RESULTS.md").read_text()
  assert committed == make_results_doc.render(), (
    "docs/RESULTS.md differs from the result files: run `python -m benchmarks.make_results_doc` and commit it")


def test_every_source_exists():
  missing = [rel for rel in make_results_doc.SOURCES.values() if not (ROOT / rel).is_file()]
  assert not missing, f"SOURCES names files that are not there: {missing}"


def test_links_in_the_manuals_resolve():
  """Every relative link of the README, docs/, the changelog, kernels/ and the results index names a file or folder
  that exists (moving a result file breaks this test, not a reader's click)."""
  import re
  pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "kernels" / "README.md", ROOT / "models" / "README.md",
           ROOT / "benchmarks" / "results" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
  for page in pages:
    if not page.exists():
      continue
    for target in re.findall(r"\]\(([^)#]+)\)", page.read_text()):
      if "://" in target:
        continue
      assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to {target}, which is not there"


# A fence line: up to 3 spaces (more inside a list item), then ``` or ~~~ (3 or more), then the info string.
FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*(.*?)\s*$")
# One word naming the block's language, or nothing (plain text: trees, tables of figures).
INFO = re.compile(r"^[a-z][a-z0-9_+-]*$")


def _markdown_files():
  """Every .md of the checkout outside hidden folders (.venv, .git, .pytest_cache, ...) and build output."""
  for path in sorted(ROOT.rglob("*.md")):
    rel = path.relative_to(ROOT)
    if not any(part.startswith(".") or part == "build" or part.endswith(".egg-info") for part in rel.parts[:-1]):
      yield path


def fence_problems(text: str) -> list[str]:
  """Unpaired code fences of one markdown text, as "line N: ..." strings. A block opens with a fence that carries a
  language or nothing and closes with a bare fence of the same character; a fence carrying a language where a block
  would close means the block above lost its opening fence (everything after renders inverted)."""
  problems, opened = [], None  # opened: (line, fence) of the block being read
  for n, line in enumerate(text.splitlines(), 1):
    m = FENCE.match(line)
    if not m:
      continue
    fence, info = m.groups()
    if opened is None:
      if info and not INFO.match(info):
        problems.append(f"line {n}: opening fence's info {info!r} is not one language word")
      opened = (n, fence)
    elif info:
      problems.append(f"line {n}: fence {fence}{info} inside the block opened at line {opened[0]}: an opening fence "
                      "is missing above it")
      opened = None
    elif fence[0] == opened[1][0] and len(fence) >= len(opened[1]):
      opened = None
  if opened is not None:
    problems.append(f"line {opened[0]}: code block never closed")
  return problems


def test_fence_check_finds_a_missing_opening_fence():
  ok = "text\n\n```bash\nls\n```\n\n```\ntree\n```\n"
  assert fence_problems(ok) == []
  lost = "## API\n\nx = 1\n```\n\n```bash\nls\n```\n"  # the first block's opening fence is gone
  assert [p.split(":")[0] for p in fence_problems(lost)] == ["line 6", "line 8"]
  assert fence_problems("```python\nx = 1\n") == ["line 1: code block never closed"]


def test_every_markdown_files_fences_pair_up():
  files = list(_markdown_files())
  assert ROOT / "docs" / "GUIDE.md" in files and ROOT / "README.md" in files
  bad = {str(p.relative_to(ROOT)): fence_problems(p.read_text(encoding="utf-8")) for p in files}
  bad = {k: v for k, v in bad.items() if v}
  assert not bad, bad
