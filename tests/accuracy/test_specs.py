"""Method specs: NAME[key=value,...] picks a registered method and passes the pairs to make_config; the spec
is the label; a bad spec fails before any work, naming what is wrong."""
import pytest

from rocketkv_jax.eval.runner import plan_configs, parse_args, parse_method, parse_methods, split_specs
from rocketkv_jax.models import LlamaConfig


def test_split_keeps_commas_inside_brackets():
  assert split_specs("full, rocketkv[topr=16,page_size=4] ,snapkv") == ["full", "rocketkv[topr=16,page_size=4]",
                                                                       "snapkv"]


def test_parse_values_and_names():
  assert parse_method("rocketkv") == ("rocketkv", {})
  assert parse_method("rocketkv[topr=16,page_size=4]") == ("rocketkv", {"topr": 16, "page_size": 4})
  name, o = parse_method("rocketkv[ sink_tokens = 4 , kt_cache_dtype=float8_e5m2, impl='xla']")
  assert name == "rocketkv" and o == {"sink_tokens": 4, "kt_cache_dtype": "float8_e5m2", "impl": "xla"}
  assert parse_methods("full,rocketkv[topr = 16],full") == ("full", "rocketkv[topr=16]")


@pytest.mark.parametrize("spec, message", [
    ("rocketkv[topz=16]", "'topz' is not an option of rocketkv"),
    ("nope[topr=16]", "unknown method 'nope'"),
    ("rocketkv[topr]", "'topr' is not key=value"),
    ("rocketkv[topr=1,topr=2]", "'topr' is given twice"),
    ("rocketkv[]", "empty brackets"),
    ("rocketkv[topr=16", "is not NAME or NAME[key=value,...]"),
])
def test_bad_specs_name_the_problem(spec, message):
  with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
    parse_method(spec)


def test_cli_rejects_a_bad_key_before_any_work(capsys):
  with pytest.raises(SystemExit) as e:
    parse_args(["--methods", "full,rocketkv[page_size=4,bogus=1]"])
  assert e.value.code == 2 and "'bogus' is not an option of rocketkv" in capsys.readouterr().err


def test_overrides_reach_the_config_and_the_spec_is_the_label():
  cfg = LlamaConfig(vocab_size=100, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
                    max_len=2048)
  rows = plan_configs(("rocketkv", "rocketkv[topr=4,page_size=8]"), (128,), 1024, 8, cfg)
  (m0, b0, c0), (m1, b1, c1) = rows
  assert (m0, m1) == ("rocketkv", "rocketkv[topr=4,page_size=8]") and b0 == b1 == 128
  assert (c1.topr, c1.page_size) == (4, 8) and (c0.topr, c0.page_size) != (4, 8)
  # a value the method refuses is a skipped config (the message names it), not a crash
  (_, _, bad), = plan_configs(("rocketkv[topr=99]",), (128,), 1024, 8, cfg)
  assert isinstance(bad, str) and "topr" in bad


def test_fit_batch_caps_the_prefill_batch_to_memory(monkeypatch):
  """A batch whose dense prefill would not fit half the available memory is split, and the log says so."""
  from types import SimpleNamespace

  from rocketkv_jax.eval import runner as R
  cfg = SimpleNamespace(n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64)
  per = R.prefill_bytes_per_prompt(4096, cfg)
  assert per == 4096 * 30 * 15 * 64 * 4  # above the dense-attention length: no [T, T] scores
  assert R.prefill_bytes_per_prompt(1024, cfg) == 1024 * 30 * 15 * 64 * 4 + 9 * 1024 * 1024 * 8
  monkeypatch.setattr(R, "available_bytes", lambda: 10 * per)
  said = []
  assert R.fit_batch(32, 4096, cfg, said.append) == 5
  assert "prefilling 5 prompts at a time" in said[0]
  assert R.fit_batch(4, 4096, cfg, said.append) == 4 and len(said) == 1
  monkeypatch.setattr(R, "available_bytes", lambda: None)
  assert R.fit_batch(32, 4096, cfg, said.append) == 32
