cd /work/main
for d in bf16 fp32 bf16 fp32; do
  cp /tmp/cal14/$d.json /tmp/cal14/$d-new.json
  /usr/bin/time -f "%e s" .venv/bin/s2d calibrate --costs-only --profile /tmp/cal14/$d-new.json --threads 1 > /tmp/cal14/$d.log 2>&1
  python3 -c "
import json;d=json.load(open('/tmp/cal14/$d-new.json'));g=d['costs_ms']['verify_grid'];print('$d', d['dtype'], 'exits', d['costs_ms']['exit_token'], {b: [g[b][p] for p in ('1','8','32')] for b in g})"
done
