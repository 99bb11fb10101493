#!/usr/bin/env bash
# Session 25 (Intel Xeon with AMX, `--dtype auto` = bfloat16): session 8's full served run on this host: in-process
# twins (ar, s2d at c1 and c8), then served S2D vs served AR in ONE app (deployments/local.yaml, --compare-plain) at
# c 1,2,4,8,16 with the greedy check. Run alone, under quiet.sh. usage: full.sh OUT
CHECK=--check-greedy exec bash "$(dirname "$0")/../serve-s8/servebench8.sh" "$@"
