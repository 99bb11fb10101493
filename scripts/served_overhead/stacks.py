"""Summarise py-spy raw (collapsed) stacks: per thread, samples, then the functions holding the most wall time
(inclusive, each counted once per stack) and the leaves (where the thread was when sampled).
usage: python stacks.py FILE[.gz]... [--top 25] [--threads 3]"""
import argparse
import gzip
import re
from collections import Counter, defaultdict

ap = argparse.ArgumentParser()
ap.add_argument("files", nargs="+")
ap.add_argument("--top", type=int, default=25)
ap.add_argument("--threads", type=int, default=3)
args = ap.parse_args()


def short(frame: str) -> str:
    m = re.match(r"(.*) \((.*?):(\d+)\)$", frame.strip())
    if not m:
        return frame.strip()
    fn, path, _ = m.groups()
    return f"{fn} ({'/'.join(path.split('/')[-2:])})"


for f in args.files:
    threads: dict[str, Counter] = defaultdict(Counter)
    leaves: dict[str, Counter] = defaultdict(Counter)
    totals: Counter = Counter()
    for line in (gzip.open(f, "rt") if f.endswith(".gz") else open(f)):
        line = line.rstrip("\n")
        if not line:
            continue
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        n = int(n)
        frames = stack.split(";")
        thread, frames = frames[0], [short(x) for x in frames[1:]]
        totals[thread] += n
        for fn in set(frames):
            threads[thread][fn] += n
        if frames:
            leaves[thread][frames[-1]] += n
    print(f"== {f}")
    for thread, total in totals.most_common(args.threads):
        print(f"-- {thread}: {total} samples")
        for fn, n in threads[thread].most_common(args.top):
            print(f"  {100 * n / total:5.1f}%  {fn}")
        print("  leaves:")
        for fn, n in leaves[thread].most_common(8):
            print(f"  {100 * n / total:5.1f}%  {fn}")
