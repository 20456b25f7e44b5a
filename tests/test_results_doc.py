"""docs/RESULTS.md is generated from the current result files (benchmarks/make_results_doc.py): it cannot drift."""
import pathlib

from benchmarks import make_results_doc

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_results_doc_is_what_the_script_writes():
  committed = (ROOT / "docs" / "RESULTS.md").read_text()
  assert committed == make_results_doc.render(), (
    "docs/RESULTS.md differs from the result files: run `python -m benchmarks.make_results_doc` and commit it")


def test_every_source_exists():
  missing = [rel for rel in make_results_doc.SOURCES.values() if not (ROOT / rel).is_file()]
  assert not missing, f"SOURCES names files that are not there: {missing}"


def test_links_in_the_results_pages_resolve():
  """Every relative link of docs/RESULTS.md and benchmarks/results/README.md names a file or folder that exists."""
  import re
  for page in (ROOT / "docs" / "RESULTS.md", ROOT / "benchmarks" / "results" / "README.md"):
    if not page.exists():
      continue
    for target in re.findall(r"\]\(([^)#]+)\)", page.read_text()):
      if "://" in target:
        continue
      assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to {target}, which is not there"
