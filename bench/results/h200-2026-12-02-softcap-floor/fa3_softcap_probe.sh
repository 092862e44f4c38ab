#!/bin/bash
OUT=$1
mkdir -p /tmp/m && gunzip -c .carry/A.so.gz > /tmp/m/A.so
.ci/gpu $OUT/inst prebuilt=/tmp/m/A.so > $OUT/inst.log 2>&1; tail -3 $OUT/inst.log
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
export PYTHONPATH=/tmp/jax_flash_wheels
F=/tmp/jax_flash_wheels/flash_attn3_jax/flash_hlo.py
grep -c "softcap=0.0," $F
sed -i "s/softcap=0.0,/softcap=float(__import__('os').environ.get('FA3_SOFTCAP', '0')),/" $F
FA3_SOFTCAP=50 timeout 120 python3 .carry/fa3check.py > $OUT/fa3check.log 2>&1; cat $OUT/fa3check.log | tail -8
for round in 1 2; do
for mode in fwd fwd_bwd; do for cap in 0 50; do
  FA3_SOFTCAP=$cap timeout 150 python3 bench/bench_attention.py --platform gpu --grid gpu --mode $mode --head-dims 128 --seqlens 1024,4096 --causal both --impls jax_flash,jax_flash_softcap,cudnn,fa3 --softcap 50 --out $OUT/r${round}_${mode}_fa3cap$cap --no-plot > $OUT/r${round}_${mode}_fa3cap$cap.log 2>&1
  echo "== r$round $mode fa3 cap $cap"; grep -E "jax_flash|cudnn|fa3" $OUT/r${round}_${mode}_fa3cap$cap.log | grep -v "^#" | tail -16
done; done; done
cd $OUT && tar czf all.tgz r* fa3check.log inst.log && rm -rf r1_* r2_*
