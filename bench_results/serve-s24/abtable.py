import json, sys, glob, os
for d in sorted(glob.glob(sys.argv[1] + "/*-*/")):
    for f in glob.glob(d + "local/*.json") or glob.glob(d + "*/results.json") or glob.glob(d + "**/*.json", recursive=True):
        if "health" in f: continue
        try: r = json.load(open(f))
        except Exception: continue
        if "summary" not in r: continue
        row = {}
        for s in r["summary"]:
            row[(s["concurrency"], s.get("variant"))] = s
        out = [os.path.basename(d.rstrip("/"))]
        for c in (1, 8):
            sp, pl = row.get((c, "speculative")), row.get((c, "plain"))
            if sp and pl:
                out.append(f"c{c} {sp['throughput_tokens_per_s']:.2f}/{pl['throughput_tokens_per_s']:.2f}={sp['throughput_tokens_per_s']/pl['throughput_tokens_per_s']:.2f} (n {sp['completed']}/{pl['completed']})")
                sv = sp.get("server", {}).get("spent", {})
                cu = sv.get("catch-up", {})
                out.append(f"catchup {cu.get('rounds',0)}r {cu.get('draft_seconds',0):.1f}s draft {sv.get('draft',{}).get('rounds',0)}r")
        print("  ".join(out))
