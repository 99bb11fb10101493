"""Offline: lookup-only greedy rounds over held-out target paths; acceptance by depth, conditioned on match ngram and on
the row's previous lookup round."""
import json, sys
from collections import defaultdict
sys.path.insert(0, ".")
from s2d_ray.core.lookup import find_continuations
stats = defaultdict(lambda: [0, 0])  # key -> [hits, offered]
for f in sys.argv[1:]:
    for line in open(f):
        r = json.loads(line)
        toks = r["prompt_ids"] + r["response_ids"]
        t = len(r["prompt_ids"]); prev = "none"
        while t < len(toks):
            m = find_continuations(toks[:t], 4, 10, 1)
            if not m:
                t += 1; continue
            cont = m[0].tokens; acc = 0
            while acc < len(cont) and t + acc < len(toks) and cont[acc] == toks[t + acc]:
                acc += 1
            for d in range(1, min(len(cont), 4) + 1):
                if d - 1 <= acc:  # offered depth d given path so far accepted (conditional) -- count marginal instead
                    pass
                for key in (("all", d), ("ngram", m[0].ngram, d), ("prev", prev, d), ("ng+prev", min(m[0].ngram, 3), prev, d)):
                    stats[key][0] += acc >= d; stats[key][1] += 1
            prev = "hit" if acc >= 1 else "miss"
            t += acc + 1
for k in sorted(stats, key=str):
    h, o = stats[k]
    print(k, o, round(h / o, 3))
