#!/usr/bin/env bash
# The device returns at most 8 files from $OUT: above that, pack everything under DIR into DIR/bundle.tgz.
# Usage: benchmarks/bundle_out.sh DIR
set -u
dir=${1:?dir}
n=$(find "$dir" -type f | wc -l)
if [ "$n" -gt 8 ]; then
  tar czf /tmp/bundle.tgz -C "$dir" . && find "$dir" -mindepth 1 -delete && mv /tmp/bundle.tgz "$dir/" &&
    echo "packed $n files into $dir/bundle.tgz (tar xzf it)"
fi
