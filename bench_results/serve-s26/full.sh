#!/usr/bin/env bash
# Session 26 (Intel Xeon with AMX, `--dtype auto` = bfloat16): session 8's full served run with local.yaml as shipped
# (instruct target placed in the router, one model thread per process): in-process twins first, then served S2D vs
# served AR in ONE app at c 1,2,4,8,16 with the greedy check. Run alone, under quiet.sh. usage: full.sh OUT
CHECK=--check-greedy exec bash "$(dirname "$0")/../serve-s8/servebench8.sh" "$@"
