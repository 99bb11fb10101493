"""Probe: draft fwd/bwd step time, fp32 against bf16 autocast (no KD: the draft's own cost)."""
import sys, time, torch
sys.path.insert(0, "/work/main")
from s2d_ray.train.soft import Run, SoftConfig
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
cfg = SoftConfig(target="smollm2-135m-instruct", out="/tmp/probe-run", data=["/work/main/data/draftq/sd-multi"],
                 num_layers=6, exit_layers=[2, 4, 6], vocab_size=8192, train_norm_head=True, seq_len=256, batch_size=2,
                 steps=100, kd_weight=0.0, val_examples=2, limit_examples=400, init="/work/main/s2d_ray/assets/drafts/smollm2-135m-s2d")
run = Run(cfg)
def step(i, ac):
    b = run.batch_at(i)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ac):
        loss, _ = run.loss_on(b)
    run.opt.zero_grad(); loss.backward()
    return float(loss)
for ac in (False, True, False, True):
    step(0, ac)
    t = time.perf_counter()
    ls = [step(i, ac) for i in range(1, 9)]
    print("autocast" if ac else "fp32", f"{(time.perf_counter()-t)/8*1000:.0f} ms/step", f"loss {sum(ls)/8:.4f}", flush=True)
