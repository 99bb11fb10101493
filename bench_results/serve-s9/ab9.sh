#!/usr/bin/env bash
# Session 9 A/B: session 8's ab8.sh once per YAML, in turn, each into its own numbered folder (a YAML may repeat:
# alternate the variants). usage: ab9.sh OUT yaml...   (LEVELS as ab8.sh; raw in OUT/<n>/)
set -u
OUT=$1; shift
n=0
for y in "$@"; do
  n=$((n + 1))
  bash "$(dirname "$0")/../serve-s8/ab/ab8.sh" "$OUT/$n" "$y"
done
