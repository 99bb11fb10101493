#!/usr/bin/env bash
# quiet.sh TIMEOUT CMD...: run CMD with the background jobs (process groups in /tmp/s2d-train.pids) paused, one at a time.
exec 9>/tmp/s2d-quiet.lock; flock 9
t=$1; shift
pids=$(cat /tmp/s2d-train.pids 2>/dev/null)
resume() { for p in $pids; do kill -CONT -- -$p 2>/dev/null; done; }
trap resume EXIT
for p in $pids; do kill -STOP -- -$p 2>/dev/null; done
timeout "$t" "$@"
