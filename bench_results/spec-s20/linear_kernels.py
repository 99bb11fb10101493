"""fp32 linear cost by rows M, one thread, SmolLM2-135M shapes: stock F.linear (MKL sgemm/sgemv) against the
prepacked kernels torch ships for CPU inference (MKL packed GEMM, oneDNN linear with a reordered weight), and whether
a row's result depends on M (batch invariance: a verify kernel must give the decode step's numbers, or fp32 outputs
part at near-ties).  Run alone: python bench_results/spec-s20/linear_kernels.py"""
import time, torch
torch.set_num_threads(1)
torch.manual_seed(0)
SHAPES = [(576, 1536), (1536, 576), (576, 576), (576, 192), (576, 49152)]  # up/gate, down, q/o, k/v, head
MS = (1, 2, 3, 4, 8, 16)

def timeit(fn, xs, ws, reps=5):
    for x, w in zip(xs[:2], ws[:2]):
        fn(x, w)
    best = 1e9
    for _ in range(reps):
        t = time.perf_counter()
        for x, w in zip(xs, ws):
            fn(x, w)
        best = min(best, time.perf_counter() - t)
    return best / len(ws) * 1e6

for K, N in SHAPES:
    n = max(2, min(40, int(2e8 // (K * N * 4))))  # enough distinct weights that they do not sit in cache
    ws = [torch.randn(N, K) / K ** 0.5 for _ in range(n)]
    print(f"K={K} N={N} ({n} weights): M  stock  mkl-packed  onednn-packed  (us)  | max |row0(M) - row0(1)| stock mkl onednn")
    for M in MS:
        xs = [torch.randn(M, K) for _ in ws]
        stock = timeit(lambda x, w: torch.nn.functional.linear(x, w), xs, ws)
        mp = [torch.ops.mkl._mkl_reorder_linear_weight(w, M) for w in ws]
        mkl = timeit(lambda x, i: torch.ops.mkl._mkl_linear(x, mp[i], ws[i], None, M), xs, list(range(n)))
        dp = [torch.ops.mkldnn._reorder_linear_weight(w, M) for w in ws]
        dnn = timeit(lambda x, i: torch.ops.mkldnn._linear_pointwise(x, dp[i], None, "none", [None], ""), xs, list(range(n)))
        x1 = xs[0][:1]
        d = [(f(xs[0])[:1] - f(x1)).abs().max().item() for f in (
            lambda x: torch.nn.functional.linear(x, ws[0]),
            lambda x: torch.ops.mkl._mkl_linear(x, torch.ops.mkl._mkl_reorder_linear_weight(ws[0], x.shape[0]), ws[0], None, x.shape[0]),
            lambda x: torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(ws[0], x.shape[0]), None, "none", [None], ""))]
        print(f"  {M:3d} {stock:8.1f} {mkl:8.1f} {dnn:8.1f}   | {d[0]:.1e} {d[1]:.1e} {d[2]:.1e}")
