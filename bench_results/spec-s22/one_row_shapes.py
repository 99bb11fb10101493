"""MKL one-row packed GEMM against stock F.linear at one row per SmolLM2-135M shape (fp32, one thread, 40 weights
per shape; the copy's size in elements). Run alone: .venv/bin/python bench_results/spec-s22/one_row_shapes.py"""
import time, torch, torch.nn.functional as F
torch.set_num_threads(1)
for N,K,c in [(1536,576,40),(576,1536,40),(576,576,40),(192,576,40),(49152,576,2),(8192,576,6)]:
    ws=[torch.randn(N,K) for _ in range(c)]
    mk=[torch.ops.mkl._mkl_reorder_linear_weight(w,1) for w in ws]
    x=torch.randn(1,K)
    for w,m in zip(ws,mk):
        a=F.linear(x,w); b=torch.ops.mkl._mkl_linear(x,m,w,None,1)
    d=(a-b).abs().max().item()
    best={0:9,1:9}
    for r in range(5):
        for k in (0,1):
            t=time.perf_counter()
            for w,m in zip(ws,mk):
                F.linear(x,w) if k==0 else torch.ops.mkl._mkl_linear(x,m,w,None,1)
            best[k]=min(best[k],time.perf_counter()-t)
    x2=torch.randn(3,K); e=(torch.ops.mkl._mkl_linear(x2,mk[0],ws[0],None,1)-F.linear(x2,ws[0])).abs().max().item()
    print(N,K,"stock %.1f us mkl %.1f us diff %.1e  3rows-ok %.1e"%(best[0]/c*1e6,best[1]/c*1e6,d,e), mk[0].shape, mk[0].dtype)
