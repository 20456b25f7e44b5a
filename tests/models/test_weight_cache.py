"""Hardening of the converted-weights cache and of the HF config reader, on the tiny HF checkpoint of
test_loaders: a damaged or edited cache is reported and rebuilt (never served), temp folders of killed
saves are removed (never a live process's), and bad config.json values are clear CheckpointErrors."""

import json
import os
import socket
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

from rocketkv_jax.models import CheckpointError, LlamaConfig, TextTokenizer, forward_full, load
from rocketkv_jax.models.weight_cache import MANIFEST, OWNER, STALE_TMP_S, CacheIntegrityWarning

from .conftest import tiny_config
from .test_loaders import CFG, TOKS, flat_params, write_gguf, write_hf_dir


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
  """The tiny GGUF (the cached kind of source) and its conversion without any cache: what every rebuilt cache
  must equal."""
  src = write_gguf(str(tmp_path_factory.mktemp("src") / "tiny.gguf"))
  model, tok = load(src, use_cache=False)
  return src, flat_params(model), np.asarray(forward_full(model, TOKS))


def cache_folder(root):
  names = [n for n in os.listdir(root) if ".tmp" not in n]
  assert len(names) == 1, names
  return os.path.join(root, names[0])


def quiet_load(src, root, logs):
  with warnings.catch_warnings():
    warnings.simplefilter("error", CacheIntegrityWarning)  # an intact cache must load without a warning
    return load(src, cache_dir=root, log=logs.append)


def flip_byte(path):
  data = bytearray(open(path, "rb").read())
  data[len(data) // 2] ^= 0xFF
  open(path, "wb").write(bytes(data))


def largest_params_file(cdir):
  files = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(cdir, "params")) for f in fs]
  return max(files, key=os.path.getsize)


def edit_config(cdir):
  p = os.path.join(cdir, "config.json")
  d = json.load(open(p))
  d["max_len"] = 256
  json.dump(d, open(p, "w"))


def damage(kind, cdir):
  """Damages the cache folder one way; returns text the warning must contain."""
  if kind == "flipped params byte":
    p = largest_params_file(cdir)
    size = os.path.getsize(p)
    flip_byte(p)
    assert os.path.getsize(p) == size
    return os.path.relpath(p, cdir) + ": contents changed"
  if kind == "edited config.json":
    edit_config(cdir)
    return "config.json"
  if kind == "removed params file":
    p = largest_params_file(cdir)
    os.remove(p)
    return os.path.relpath(p, cdir) + ": missing"
  if kind == "added file":
    open(os.path.join(cdir, "params", "stray"), "w").write("x")
    return "params/stray: not in the manifest"
  if kind == "garbage manifest":
    open(os.path.join(cdir, MANIFEST), "w").write("{not json")
    return "unreadable"
  if kind == "no manifest":
    os.remove(os.path.join(cdir, MANIFEST))
    return f"no {MANIFEST}"
  raise AssertionError(kind)


KINDS = ["flipped params byte", "edited config.json", "removed params file", "added file", "garbage manifest",
         "no manifest"]


@pytest.mark.parametrize("kind", KINDS)
def test_damaged_cache_is_reported_and_rebuilt(tmp_path, fresh, kind):
  src, want_params, want_logits = fresh
  root = str(tmp_path / "cache")
  logs = []
  quiet_load(src, root, logs)
  cdir = cache_folder(root)
  assert os.path.isfile(os.path.join(cdir, MANIFEST))
  assert not os.path.exists(os.path.join(cdir, OWNER))
  what = damage(kind, cdir)

  logs.clear()
  with pytest.warns(CacheIntegrityWarning) as rec:
    model, _ = load(src, cache_dir=root, log=logs.append)
  msg = str(rec[0].message)
  assert cdir in msg and what in msg and "rebuilding" in msg, msg
  assert any(cdir in m and what in m for m in logs), logs  # the same report through `log`
  assert any("saved converted weights" in m for m in logs), logs
  assert not any("loaded converted weights" in m for m in logs), logs
  assert model.config == CFG
  got = flat_params(model)
  assert got.keys() == want_params.keys()
  for k in got:
    np.testing.assert_array_equal(got[k], want_params[k], err_msg=k)

  # the rebuilt cache is intact: it loads without a warning and gives the fresh conversion's logits
  logs.clear()
  model, _ = quiet_load(src, root, logs)
  assert any("loaded converted weights" in m for m in logs), logs
  np.testing.assert_array_equal(np.asarray(forward_full(model, TOKS)), want_logits)
  assert os.listdir(root) == [os.path.basename(cdir)]


def test_unreadable_intact_cache_warns_and_rebuilds(tmp_path, fresh, monkeypatch):
  src, want_params, _ = fresh
  root = str(tmp_path / "cache")
  quiet_load(src, root, [])

  def broken(cls, text):
    raise RuntimeError("cannot parse")
  monkeypatch.setattr(LlamaConfig, "from_json", classmethod(broken))
  logs = []
  with pytest.warns(CacheIntegrityWarning, match="unreadable: RuntimeError: cannot parse"):
    model, _ = load(src, cache_dir=root, log=logs.append)
  assert any("saved converted weights" in m for m in logs), logs
  np.testing.assert_array_equal(flat_params(model)["embed"], want_params["embed"])


def dead_pid():
  p = subprocess.Popen([sys.executable, "-c", "pass"])
  p.wait()
  try:
    os.kill(p.pid, 0)
  except ProcessLookupError:
    return p.pid
  pytest.skip(f"pid {p.pid} was reused at once")


def make_tmp(root, pid, owner=None, suffix="", age_s=0.0):
  d = os.path.join(root, f"tiny-float32-0123456789abcdef.tmp{pid}{suffix}")
  os.makedirs(os.path.join(d, "params"))
  open(os.path.join(d, "params", "data"), "wb").write(b"\0" * 1000)
  if owner is not None:
    json.dump(owner, open(os.path.join(d, OWNER), "w"))
  if age_s:
    t = time.time() - age_s
    for r, ds, fs in os.walk(d):
      for n in ds + fs:
        os.utime(os.path.join(r, n), (t, t))
    os.utime(d, (t, t))
  return d


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="process start times come from /proc")
def test_stale_temp_folders_of_dead_processes_are_removed(tmp_path, fresh):
  src = fresh[0]
  root = str(tmp_path / "cache")
  os.makedirs(root)
  me, host = os.getpid(), socket.gethostname()
  with open(f"/proc/{me}/stat") as f:
    my_start = int(f.read().rsplit(")", 1)[1].split()[19])
  gone = dead_pid()
  removed = {
      "legacy, dead pid": make_tmp(root, gone),
      "owner record, dead pid": make_tmp(root, gone, {"pid": gone, "host": host, "start": 1}, "-ab12cd34"),
      "live pid reused (other start time)": make_tmp(root, me, {"pid": me, "host": host, "start": my_start + 1},
                                                     "-00000001"),
      "other host, idle past the limit": make_tmp(root, 12345, {"pid": 12345, "host": "elsewhere"}, "-00000002",
                                                  age_s=STALE_TMP_S + 60),
      "legacy, live pid, idle past the limit": make_tmp(root, me, suffix="-00000003", age_s=STALE_TMP_S + 60),
  }
  kept = {
      "legacy, live pid (this test)": make_tmp(root, me),
      "owner record, live process": make_tmp(root, me, {"pid": me, "host": host, "start": my_start}, "-00000004",
                                             age_s=STALE_TMP_S + 60),
      "other host, recently written": make_tmp(root, 12345, {"pid": 12345, "host": "elsewhere"}, "-00000005"),
  }
  other = os.path.join(root, "notes.tmp123")  # not a cache temp folder's name: never touched
  os.makedirs(other)
  logs = []
  quiet_load(src, root, logs)
  for why, d in removed.items():
    assert not os.path.exists(d), why
    assert any(d in m and "removed stale temp folder" in m for m in logs), (why, logs)
  for why, d in kept.items():
    assert os.path.isdir(d), why
  assert os.path.isdir(other)
  assert os.path.isfile(os.path.join(cache_folder_with_manifest(root), MANIFEST))


def cache_folder_with_manifest(root):
  names = [n for n in os.listdir(root) if os.path.isfile(os.path.join(root, n, MANIFEST))]
  assert len(names) == 1, os.listdir(root)
  return os.path.join(root, names[0])


def test_save_in_progress_is_recognisable_and_kept(tmp_path, fresh, monkeypatch):
  """While a save runs, its temp folder carries this process's owner record, and another load's clean-up
  in the same cache folder (a nested load of another checkpoint here) keeps it; a failed save leaves no
  temp folder behind."""
  src = fresh[0]
  other = write_gguf(str(tmp_path / "other.gguf"))
  root = str(tmp_path / "cache")
  real_save = TextTokenizer.save
  seen = []

  def save_then_load_another(self, directory):
    real_save(self, directory)
    if seen:  # the nested load's own save
      return
    owner = json.load(open(os.path.join(directory, OWNER)))
    assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname()
    seen.append(os.path.basename(directory))
    logs = []
    load(other, cache_dir=root, log=logs.append)
    assert os.path.isdir(directory) and not any("removed" in m for m in logs), logs
  monkeypatch.setattr(TextTokenizer, "save", save_then_load_another)
  quiet_load(src, root, [])
  assert len(seen) == 1 and ".tmp" in seen[0], seen
  assert len(os.listdir(root)) == 2 and not any(".tmp" in n for n in os.listdir(root)), os.listdir(root)

  def fail(self, directory):
    raise OSError("disk full")
  monkeypatch.setattr(TextTokenizer, "save", fail)
  logs = []
  load(src, cache_dir=str(tmp_path / "cache2"), log=logs.append)
  assert any("could not save the weight cache" in m and "disk full" in m for m in logs), logs
  assert os.listdir(tmp_path / "cache2") == []


# ----------------------------------------------------------------------------- bad config values


def edited_hf_dir(tmp_path, **changes):
  d = write_hf_dir(str(tmp_path / "hf"))
  p = os.path.join(d, "config.json")
  hf = json.load(open(p))
  for k, v in changes.items():
    if v is DELETE:
      del hf[k]
    else:
      hf[k] = v
  json.dump(hf, open(p, "w"))
  return d


DELETE = object()
BAD = [
    ("hidden_size", "abc", "hidden_size='abc' must be an integer"),
    ("hidden_size", 64.5, "hidden_size=64.5 must be an integer"),
    ("num_hidden_layers", 2.0, "num_hidden_layers=2.0 must be an integer"),
    ("vocab_size", True, "vocab_size=True must be an integer"),
    ("num_attention_heads", 0, "num_attention_heads=0 must be >= 1"),
    ("intermediate_size", None, "intermediate_size=None must be an integer"),
    ("num_key_value_heads", "2", "num_key_value_heads='2' must be an integer"),
    ("num_key_value_heads", 3, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ("head_dim", 15, "head_dim=15 must be even"),
    ("max_position_embeddings", -1, "max_position_embeddings=-1 must be >= 1"),
    ("rms_norm_eps", "1e-5", "rms_norm_eps='1e-5' must be a positive number"),
    ("rope_theta", 0, "rope_theta=0 must be a positive number"),
    ("tie_word_embeddings", "false", "tie_word_embeddings='false' must be true or false"),
    ("bos_token_id", -1, "bos_token_id=-1 must be >= 0"),
    ("eos_token_id", "</s>", "eos_token_id='</s>' must be an integer"),
    ("eos_token_id", [2, "x"], r"eos_token_id=\[2, 'x'\] must be a token id"),
    ("rope_scaling", "llama3", "rope_scaling='llama3' must be null or an object"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, "rope_scaling of type 'llama3' needs the key"),
    ("rope_scaling", {"rope_type": "linear", "factor": "2"}, r"rope_scaling\['factor'\]='2'"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 2.0}, "rope_scaling type 'yarn' is not supported"),
    ("vocab_size", DELETE, "required key 'vocab_size' is missing"),
    ("num_attention_heads", DELETE, "required key 'num_attention_heads' is missing"),
]


@pytest.mark.parametrize("key,value,match", BAD, ids=[f"{k}={v!r}" if v is not DELETE else f"no {k}" for k, v, _ in BAD])
def test_bad_config_values_raise_checkpoint_error_before_reading_tensors(tmp_path, monkeypatch, key, value, match):
  d = edited_hf_dir(tmp_path, **{key: value})
  import safetensors

  def no_tensors(*a, **k):
    raise AssertionError("a tensor was read before the config was checked")
  monkeypatch.setattr(safetensors, "safe_open", no_tensors)
  with pytest.raises(CheckpointError, match=match) as e:
    load(d, use_cache=False)
  assert os.path.join(d, "config.json") in str(e.value)


def test_optional_config_keys_may_be_null_or_absent(tmp_path):
  d = edited_hf_dir(tmp_path, head_dim=None, bos_token_id=None, eos_token_id=[2, 3],
                    rope_scaling=None, rope_theta=DELETE, rms_norm_eps=DELETE, max_position_embeddings=DELETE)
  model, _ = load(d, use_cache=False)
  c = model.config
  assert (c.head_dim, c.bos_id, c.eos_id) == (CFG.dim // CFG.n_heads, None, 2)
  assert (c.rope_theta, c.norm_eps, c.max_len) == (10000.0, 1e-5, 8192)


def test_config_json_that_is_not_an_object(tmp_path):
  d = write_hf_dir(str(tmp_path / "hf"))
  open(os.path.join(d, "config.json"), "w").write("[1, 2]")
  with pytest.raises(CheckpointError, match="expected a JSON object, got list"):
    load(d, use_cache=False)


@pytest.mark.parametrize("changes,match", [
    (dict(dim=0), "dim=0 must be a positive int"),
    (dict(n_layers=2.0), "n_layers=2.0 must be a positive int"),
    (dict(vocab_size="128"), "vocab_size='128' must be a positive int"),
    (dict(n_kv_heads=3), "n_heads=4 must be a multiple of n_kv_heads=3"),
    (dict(head_dim=15), "head_dim=15 must be even"),
    (dict(rope_theta="1e4"), "rope_theta='1e4' must be a positive finite number"),
    (dict(norm_eps=float("nan")), "norm_eps=nan must be a positive finite number"),
    (dict(tie_embeddings="no"), "tie_embeddings='no' must be a bool"),
    (dict(eos_id=-1), "eos_id=-1 must be None or a token id"),
    (dict(bos_id=1.0), "bos_id=1.0 must be None or a token id"),
    (dict(rope_scaling=(("rope_type", "llama3"), ("factor", 8.0))), "needs the key 'low_freq_factor'"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                        "original_max_position_embeddings": 8192}), "high_freq_factor=1.0 must be greater"),
    (dict(rope_scaling={"rope_type": "factors", "factors": [1.0, 2.0]}), r"must be 8 \(head_dim / 2\) positive"),
    (dict(rope_scaling=5), "rope_scaling=5 must be None, a dict"),
])
def test_llama_config_validation(changes, match):
  with pytest.raises(ValueError, match=match):
    tiny_config(**changes)


def test_llama_config_json_errors():
  good = json.loads(tiny_config().to_json())
  assert LlamaConfig.from_json(json.dumps(good)) == tiny_config()
  with pytest.raises(ValueError, match=r"unknown keys \['hidden'\]"):
    LlamaConfig.from_json(json.dumps(dict(good, hidden=1)))
  with pytest.raises(ValueError, match="vocab_size"):
    LlamaConfig.from_json(json.dumps({k: v for k, v in good.items() if k != "vocab_size"}))
  with pytest.raises(ValueError, match="malformed"):
    LlamaConfig.from_json("{")
  llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
  c = tiny_config(rope_scaling=llama3)
  assert LlamaConfig.from_json(c.to_json()) == c
