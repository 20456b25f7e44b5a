"""The stage-2 table renderer (benchmarks/stage2_table.py) on two tiny synthetic benchmark files: the rows it
picks for each kernel, later files winning, floors from the record or the file's copy bandwidth, x-floor ratios,
batches in order and '-' where a kernel has no record."""
import json

import pytest

from benchmarks import stage2_table as st


def point(kind, impl, B, us, nbytes=None, floor=None, L=32768, t=256):
  return dict(kind=kind, impl=impl, B=B, L=L, t=t, device_us=us, bytes=nbytes, floor_us=floor,
              capacity=1617, page_size=3, top_r=60, top_k=128)


OLD = [
    dict(kind="ceiling", copy_GBps=1000.0, date="2026-12-01T09:00:00+00:00", device="NVIDIA H200", command="old"),
    point("append", "pallas", 1, 10.0, 1e6, 1.0),
    point("append", "xla", 1, 1.0, 1e6, 1.0),  # not the decode path's impl
    point("append", "pallas", 1, 1.0, 1e6, 1.0, L=4096),  # another context
    point("hsa_select", "pallas two-kernel", 1, 20.0, 2e6, 2.0),
    point("hsa_select", "pallas fused", 1, 1.0, 2e6, 2.0),
    point("sparse_attn", "pallas default", 1, 5.0, 4e6),  # no floor_us: bytes at 1000 GB/s = 4 us
    point("layer_step", "pallas", 1, 40.0, 8e6, 7.0),
    point("append", "pallas", 8, 12.0, 2e6, 2.0),
]
NEW = [
    dict(kind="ceiling", copy_GBps=2000.0, date="2026-12-01T20:00:00+00:00", device="NVIDIA H200", command="new"),
    point("hsa_scores", "pallas rank split_pages=True", 32, 99.0, 3e6, 3.0),
    point("hsa_scores", "pallas gather split_pages=True", 32, 30.0, 3e6, 3.0),  # what auto picks at 256 rows
    point("append", "pallas", 1, 8.0, 1e6, 0.5),
]
TUNE = [  # tune_hsa.py records: the launch parameters; at 391 rows block_p 64, 2 warps, 2 stages are pick_tuning's
    dict(B=391, L=32768, t=256, layout="gather", split=False, block_p=128, warps=2, stages=2, device_us=1.0,
         floor_us=50.0),
    dict(B=391, L=32768, t=256, layout="gather", split=False, block_p=64, warps=4, stages=1, device_us=2.0,
         floor_us=50.0),
    dict(B=391, L=32768, t=256, layout="gather", split=False, block_p=64, warps=2, stages=2, device_us=200.0,
         floor_us=50.0),
]


@pytest.fixture
def rendered(tmp_path, capsys):
  paths = []
  for name, recs in (("old", OLD), ("new", NEW), ("tune", TUNE)):
    p = tmp_path / f"{name}.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    paths.append(str(p))
  argv = [*paths, "--out", str(tmp_path / "table")]
  text = st.main(argv)
  assert capsys.readouterr().out.strip() == text.strip() == (tmp_path / "table.md").read_text().strip()
  sources = [st.Source(p, st.LETTERS[i]) for i, p in enumerate(paths)]
  return text, st.build(sources, 32768, 256), argv


def table_rows(text):
  """{B: {column: cell}} of the first markdown table (repeated column names keep the first kernel's prefix)."""
  lines = [ln for ln in text.splitlines() if ln.startswith("| ")]
  head = lines[0].strip("| ").split(" | ")
  names, kernel = [], ""
  for h in head:
    first = h.endswith(" us") and h != "floor us"  # a kernel's first column
    kernel = h[:-3] if first else kernel
    names.append(h if first or h in ("B", "rows") else f"{kernel} {h}")
  rows = {}
  for ln in lines[1:]:
    cells = ln.strip("| ").split(" | ")
    if cells[0] == "B":
      break  # the second table
    rows[int(cells[0])] = dict(zip(names, cells))
  return rows


def test_decode_tuning_is_the_kernels_heuristic():
  from rocketkv_jax.kernels.hsa_scores import pick_tuning
  assert st.decode_tuning(1).split_pages and st.decode_tuning(32).split_pages  # 8, 256 rows: page blocks
  assert not st.decode_tuning(391).split_pages  # 3128 rows: past GATHER_ROW_PROGRAMS_MIN_ROWS, row programs
  assert st.decode_tuning(391) == pick_tuning(391, 8, 544, 60)  # 32k, t=256: 544 KT pages, top-r 60


def test_chosen_rows_and_later_files_win(rendered):
  text, table, argv = rendered
  assert list(table) == [1, 8, 32, 391]  # batches sorted, whatever the record order
  append, lost = table[1]["append"]
  assert (append.us, append.src.letter, append.floor) == (8.0, "b", 0.5)
  assert [p.us for p in lost] == [10.0]
  select = table[1]["select"][0]
  assert (select.us, select.rec["impl"], select.src.letter) == (20.0, "pallas two-kernel", "a")
  attn = table[1]["attn"][0]
  assert attn.floor == pytest.approx(4.0) and attn.x == pytest.approx(1.25)  # bytes at the file's copy bandwidth
  # No two-kernel record: the scoring kernel on the grid the code picks (not the faster-looking rank row or
  # the tune rows at launch parameters that are not pick_tuning's).
  assert table[32]["hsa_fallback"] and table[32]["select"][0].us == 30.0
  assert table[391]["select"][0].us == 200.0 and table[391]["select"][0].src.letter == "c"
  assert "python -m benchmarks.stage2_table " + " ".join(argv) in text


def test_table_numbers(rendered):
  rows = table_rows(rendered[0])
  assert list(rows) == [1, 8, 32, 391]
  r1 = rows[1]
  assert r1["rows"] == "8"
  assert (r1["append us"], r1["append floor us"], r1["append x"]) == ("8.0 (b)", "0.5", "16.0x")
  assert (r1["HSA selection us"], r1["HSA selection MB"], r1["HSA selection x"]) == ("20.0 (a)", "2.00", "10.0x")
  assert (r1["sparse attention floor us"], r1["sparse attention x"]) == ("4.00", "1.2x")
  # 8 + 20 + 5 us against 0.5 + 2 + 4 us.
  assert (r1["stage 2 us"], r1["stage 2 floor us"], r1["stage 2 x"]) == ("33.0 (a,b)", "6.50", "5.1x")
  assert (r1["layer step us"], r1["layer step x"]) == ("40.0 (a)", "5.7x")
  r8 = rows[8]
  assert r8["append us"] == "12.0 (a)" and r8["append x"] == "6.0x"
  assert all(r8[c] == "-" for c in ("HSA selection us", "HSA selection x", "sparse attention us", "stage 2 us",
                                    "layer step us"))
  assert rows[32]["HSA selection us"] == "30.0 (b)*" and rows[32]["HSA selection x"] == "10.0x"
  assert rows[391]["HSA selection MB"] == "-" and rows[391]["HSA selection x"] == "4.0x"  # tune rows: no bytes


def test_notes_name_the_overridden_records(rendered):
  text = rendered[0]
  assert "- append, B=1: 8.0 us (b) used over 10.0 us (a, 10.0x floor)." in text
  assert "(a) `" in text and "copy 1000 GB/s" in text and "copy 2000 GB/s" in text


def test_benchmark_loop_copies_are_left_out(tmp_path):
  rec = point("append", "pallas", 391, 248.6, 4.8e6, 1.43)
  rec["top_kernels"] = [["memcpy32_post", 173.2], ["rocketkv_cache_append", 73.0], ["loop_add_fusion", 0.9]]
  p = tmp_path / "k.jsonl"
  p.write_text(json.dumps(rec) + "\n")
  append = st.build([st.Source(str(p), "a")], 32768, 256)[391]["append"][0]
  assert append.us == pytest.approx(248.6 - 173.2) and append.copy_us == pytest.approx(173.2)
  assert append.x == pytest.approx((248.6 - 173.2) / 1.43)
