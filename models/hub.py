"""Finding a checkpoint by its Hugging Face hub id ("org/name") in the local Hugging Face cache.

Nothing is downloaded here: a load that names a hub id reads what `huggingface_hub` has already cached
(`hf download org/name`, or any earlier `from_pretrained`), so a load never reaches the network, whatever
HF_HUB_OFFLINE says. When the checkpoint is absent, the error names the cache folder that was searched and
the command that fetches it.
"""
from __future__ import annotations

import os
import re

__all__ = ["HubCheckpointMissing", "hub_cache_dir", "is_hub_id", "resolve"]

# the files a safetensors checkpoint needs (weights, their index, config, tokenizer and chat template)
PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


class HubCheckpointMissing(ValueError):
  """A hub id that the local Hugging Face cache does not hold."""


def is_hub_id(source: str) -> bool:
  """True for "org/name" that is not an existing local path (a local folder of that name wins)."""
  return bool(_HUB_ID.match(source)) and not os.path.exists(os.path.expanduser(source))


def hub_cache_dir(default: str) -> str:
  """The Hugging Face hub cache as the environment says now (huggingface_hub reads it once, at import):
  HF_HUB_CACHE, else HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub, else `default`."""
  env = os.environ
  if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
    return os.path.expanduser(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"])
  if env.get("HF_HOME"):
    return os.path.join(os.path.expanduser(env["HF_HOME"]), "hub")
  return default


def resolve(repo_id: str, *, revision: str | None = None, cache_dir: str | None = None) -> str:
  """The local snapshot folder of `repo_id` in the Hugging Face cache (HF_HUB_CACHE / HF_HOME, or
  `cache_dir`). HubCheckpointMissing, naming where it looked and how to download, when it is not there."""
  try:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
  except ImportError as e:  # pragma: no cover - a core dependency
    raise HubCheckpointMissing(f"loading {repo_id!r} by hub id needs huggingface_hub (pip install "
                               f"huggingface_hub): {e}") from None
  where = cache_dir or hub_cache_dir(constants.HF_HUB_CACHE)
  try:
    path = snapshot_download(repo_id, revision=revision, cache_dir=where, local_files_only=True,
                             allow_patterns=PATTERNS)
  except LocalEntryNotFoundError:
    raise HubCheckpointMissing(
        f"{repo_id!r} is not in the local Hugging Face cache (looked in {where}); download it first: "
        f"`hf download {repo_id}` (or `huggingface-cli download {repo_id}`), or pass a local folder") from None
  if not os.path.isfile(os.path.join(path, "config.json")):
    raise HubCheckpointMissing(f"{repo_id!r}: the cached snapshot {path} has no config.json (a partial "
                               f"download?); download it again: `hf download {repo_id}`")
  return path
