import json,glob,sys
for d in sorted(glob.glob(sys.argv[1] + "/*-*/local/serve.json")):
    r=json.load(open(d)); row={}
    for s in r["summary"]: row[(s["concurrency"],s["variant"])]=s
    out=[d.split("/")[-3]]
    for c in (1,8):
        sp,pl=row[(c,"speculative")],row[(c,"plain")]
        sv=sp.get("server",{}); pv=pl.get("server",{})
        ds=sum(v["draft_seconds"] for v in sv.get("spent",{}).values())
        cu=sv.get("spent",{}).get("catch-up",{})
        t=sv["target"]; tp=pv["target"]
        out.append(f"c{c} {sp['throughput_tokens_per_s']:.2f} {pl['throughput_tokens_per_s']:.2f} {sp['throughput_tokens_per_s']/pl['throughput_tokens_per_s']:.2f} n{sp['completed']}/{pl['completed']} draft_s {ds:.1f} catchup {cu.get('rounds',0)}/{cu.get('draft_seconds',0):.1f} rep {t['calls']*t['replica_ms']/1e3:.1f}/{tp['calls']*tp['replica_ms']/1e3:.1f} rounds_s {sv['rounds']*sv['round_ms']/1e3:.1f}/{pv['rounds']*pv['round_ms']/1e3:.1f}")
    print(" | ".join(out))
