"""Offline: modelled tokens/step of lookup-only rounds, one estimate per depth vs per (ngram, depth)."""
import json, sys
from collections import defaultdict
sys.path.insert(0, ".")
from s2d_ray.core.lookup import find_continuations
grids = {"fp32-avx2": {1: 1, 2: 1.54, 4: 1.70, 8: 1.89, 16: 2.4}, "bf16-avx512": {1: 1, 2: 1.03, 4: 1.06, 8: 1.16, 16: 1.33}}
def cost(g, n):  # n positions, interpolate
    ks = sorted(g); 
    for a, b in zip(ks, ks[1:]):
        if a <= n <= b: return g[a] + (g[b] - g[a]) * (n - a) / (b - a)
    return g[ks[-1]]
rounds = []  # (ngram, accepted, contlen)
for f in sys.argv[1:]:
    for line in open(f):
        r = json.loads(line); toks = r["prompt_ids"] + r["response_ids"]; t = len(r["prompt_ids"])
        while t < len(toks):
            m = find_continuations(toks[:t], 4, 10, 1)
            if not m: rounds.append((0, 0, 0)); t += 1; continue
            cont = m[0].tokens; acc = 0
            while acc < len(cont) and t + acc < len(toks) and cont[acc] == toks[t + acc]: acc += 1
            rounds.append((m[0].ngram, acc, len(cont))); t += acc + 1
def table(key):
    h = defaultdict(lambda: [0, 0])
    for ng, acc, L in rounds:
        if not L: continue
        for d in range(1, L + 1):
            c = h[(key(ng), d)]; c[0] += acc >= d; c[1] += 1
    return {k: a / o for k, (a, o) in h.items()}
for gname, g in grids.items():
    for name, key in (("global", lambda ng: 0), ("ngram", lambda ng: ng), ("none", None)):
        p = table(key) if key else None
        tok = sec = 0.0
        for ng, acc, L in rounds:
            n = 0
            if p and L:
                best, gain = 1 / cost(g, 1), 0
                for m in range(1, L + 1):
                    gain += p[(key(ng), m)]
                    if (1 + gain) / cost(g, m + 1) > best: best, n = (1 + gain) / cost(g, m + 1), m
            tok += 1 + min(acc, n); sec += cost(g, n + 1)
        print(gname, name, "tokens/step-cost", round(tok / sec, 3))
