#!/usr/bin/env bash
# Kept for the commands that name it: tests/gpu/run_all.sh runs chorus's GPU tests (every
# tests/gpu file and chorus.cuda's CPU-side tests, each bounded, logs in $OUT).
exec bash "$(dirname "$0")/run_all.sh" "$@"
