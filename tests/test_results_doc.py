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
