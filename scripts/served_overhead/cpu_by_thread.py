"""CPU seconds every thread of every process spent while a command ran (from /proc/*/task/*/stat, utime + stime),
largest first, one row per thread: where a served round's CPU goes besides the model thread.
Usage: python cpu_by_thread.py [--top N] -- COMMAND..."""
import os, subprocess, sys, time
from collections import defaultdict

TICK = os.sysconf("SC_CLK_TCK")


def snapshot() -> dict[tuple[int, int], tuple[str, str, float]]:
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")[:60]
            for tid in os.listdir(f"/proc/{pid}/task"):
                stat = open(f"/proc/{pid}/task/{tid}/stat").read()
                name = stat[stat.index("(") + 1:stat.rindex(")")]
                fields = stat[stat.rindex(")") + 2:].split()
                out[(int(pid), int(tid))] = (cmd, name, (int(fields[11]) + int(fields[12])) / TICK)
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
    return out


args = sys.argv[1:]
top = 25
if args[:1] == ["--top"]:
    top, args = int(args[1]), args[2:]
if args[:1] == ["--"]:
    args = args[1:]
before, t0 = snapshot(), time.perf_counter()
rc = subprocess.call(args)
after, wall = snapshot(), time.perf_counter() - t0
by = defaultdict(float)  # one row per thread: a process's Python threads share its name
for (pid, tid), (cmd, name, cpu) in after.items():
    by[(pid, tid, cmd, name)] += cpu - (before[(pid, tid)][2] if (pid, tid) in before else 0.0)
total = sum(by.values())
print(f"# wall {wall:.1f} s, CPU {total:.1f} s over all threads ({total / wall:.2f} vCPU)")
for (pid, tid, cmd, name), cpu in sorted(by.items(), key=lambda kv: -kv[1])[:top]:
    if cpu > 0:
        print(f"{cpu:7.2f} s {100 * cpu / wall:5.1f}%  pid {pid:<7} tid {tid:<7} {name:<16} {cmd}")
sys.exit(rc)
