#!/usr/bin/env bash
# The wheels a bare GPU device (no package index) needs to run `rocketkv serve` beyond its image, at the versions
# this checkout's .venv holds, for Python 3.12 on x86-64 Linux, into .carry/wheels (git-ignored locally via
# .git/info/exclude; carried to the device with `carry: [".carry"]`). run_h200.sh's serve_load parts install them.
# Usage: benchmarks/device_wheels.sh   (run from the repository root, with .venv built)
set -eu
py=.venv/bin/python
mkdir -p .carry/wheels
ver() { "$py" -c "import importlib.metadata as m; print(m.version('$1'))"; }
pkgs=""
for p in fastapi fastapi-offline starlette pydantic pydantic_core uvicorn annotated-types typing-inspection opentelemetry-api; do
  pkgs="$pkgs $p==$(ver "$p")"
done
# shellcheck disable=SC2086
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  --implementation cp -d .carry/wheels $pkgs
ls .carry/wheels
