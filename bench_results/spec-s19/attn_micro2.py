import sys, time, torch
sys.path.insert(0, ".")
from s2d_ray.core.attention import _attend
torch.set_num_threads(1)
F = torch.nn.functional
def bench(fn, n=200):
    for _ in range(10): fn()
    t = time.perf_counter()
    for _ in range(n): fn()
    return (time.perf_counter() - t) / n * 1e6
dt = torch.float32
for b, slots, q in ((1, 200, 1), (1, 200, 9), (1, 200, 25), (1, 600, 1), (8, 200, 1), (8, 600, 1), (8, 200, 5), (1, 200, 128)):
    store = torch.randn(b, 2048, 3, 64, dtype=dt)
    k = store[:, :slots].transpose(1, 2); v = torch.randn(b, 2048, 3, 64, dtype=dt)[:, :slots].transpose(1, 2)
    qq = torch.randn(b, 9, q, 64, dtype=dt)
    allowed = torch.ones(b, 1, q, slots, dtype=torch.bool).tril(slots - q)
    add = torch.zeros(b, 1, q, slots, dtype=dt).masked_fill(~allowed, torch.finfo(dt).min)
    g = bench(lambda: _attend(qq, k, v, add, 0.125))
    s_add = bench(lambda: F.scaled_dot_product_attention(qq, k, v, attn_mask=add, scale=0.125, enable_gqa=True))
    s_bool = bench(lambda: F.scaled_dot_product_attention(qq, k, v, attn_mask=allowed, scale=0.125, enable_gqa=True))
    s_head = bench(lambda: F.scaled_dot_product_attention(qq, k, v, attn_mask=add.expand(-1, 9, -1, -1).contiguous(), scale=0.125, enable_gqa=True))
    print(f"b {b} slots {slots} q {q}: grouped {g:.0f}  sdpa add-bcast {s_add:.0f}  bool-bcast {s_bool:.0f}  add-perhead(incl copy) {s_head:.0f} us")
