import collections, sys
def load(f):
    rows=[]
    for line in open(f):
        s,_,n=line.rstrip().rpartition(' ')
        if not s: continue
        rows.append((s.split(';'),int(n)))
    return rows
def fn(fr): return fr.split(' (')[0]
def tree(rows, root, depth=3, minn=20):
    """Aggregate counts by the `depth` frames below the first frame whose function is `root`."""
    c=collections.Counter(); tot=0
    for fr,n in rows:
        names=[fn(x) for x in fr]
        if root in names:
            i=names.index(root); tot+=n
            c[' > '.join(names[i+1:i+1+depth])]+=n
    print(f'== {root}: {tot}')
    for k,v in c.most_common(40):
        if v>=minn: print(f'{v:6d} {k}')
if __name__=="__main__":
  rows=load(sys.argv[1])
  print('total', sum(n for _,n in rows))
  for spec in sys.argv[2:]:
    root,_,d=spec.partition(':')
    tree(rows, root, int(d or 3))
