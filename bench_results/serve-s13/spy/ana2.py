import collections, sys
from ana import load, fn
rows=load(sys.argv[1]); must=sys.argv[2]
rows=[(fr,n) for fr,n in rows if must in [fn(x) for x in fr]]
c=collections.Counter()
for fr,n in rows:
    names=[fn(x) for x in fr]
    # leaf-most interesting frame
    key=None
    for k in ['grouped_attention','apply_rotary_pos_emb','SlotKVCache.update','LlamaMLP.forward','LlamaRMSNorm.forward','LlamaAttention.forward','LayerStack.head_logits','LlamaDecoderLayer.forward','LayerStack.run_layers','TargetVerifier._forward_sorted']:
        if k in names: key=k; break
    c[key or names[-1]]+=n
print(sum(c.values()))
for k,v in c.most_common(25): print(f'{v:6d} {k}')
