#!/usr/bin/env bash
# Session 8's full served runs: session 7's script, with the in-process twins run as local.yaml runs the replicas
# (1 thread, wide passes on 2). Run under quiet.sh. usage: servebench8.sh OUT   (CHECK=--check-greedy: greedy check)
WIDE=2 exec bash "$(dirname "$0")/../serve-s7/servebench7.sh" "$@"
