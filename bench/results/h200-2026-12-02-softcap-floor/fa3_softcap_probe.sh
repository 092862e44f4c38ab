#!/bin/bash
# The 2026-12-02 soft-cap probe (bench/RESULTS.md), from the repository root:
#   fa3_softcap_probe.sh OUTDIR MODULE.so
# with the flash_attn3_jax wheel in .whl/ (as .ci/gpu takes it). flash_attn3_jax passes
# softcap=0.0 in every lowering; the installed copy is edited to read FA3_SOFTCAP instead, and
# each setting runs in a process of its own. (The recorded run read its module and the check
# script from a scratch folder; the steps are these.)
OUT=$1
MODULE=$2
HERE=$(dirname "$0")
.ci/gpu "$OUT/inst" "prebuilt=$MODULE" > "$OUT/inst.log" 2>&1; tail -3 "$OUT/inst.log"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
export PYTHONPATH=/tmp/jax_flash_wheels
F=/tmp/jax_flash_wheels/flash_attn3_jax/flash_hlo.py
grep -c "softcap=0.0," "$F"
sed -i "s/softcap=0.0,/softcap=float(__import__('os').environ.get('FA3_SOFTCAP', '0')),/" "$F"
FA3_SOFTCAP=50 timeout 120 python3 "$HERE/fa3_softcap_check.py" > "$OUT/fa3_softcap_check.log" 2>&1
tail -8 "$OUT/fa3_softcap_check.log"
for round in 1 2; do
  for mode in fwd fwd_bwd; do
    for cap in 0 50; do
      run=${mode}_r${round}_fa3cap$cap
      FA3_SOFTCAP=$cap timeout 150 python3 bench/bench_attention.py --platform gpu --grid gpu \
        --mode $mode --head-dims 128 --seqlens 1024,4096 --causal both \
        --impls jax_flash,jax_flash_softcap,cudnn,fa3 --softcap 50 --out "$OUT/$run" --no-plot \
        > "$OUT/$run.log" 2>&1
      echo "== $run"; grep -E "jax_flash|cudnn|fa3" "$OUT/$run.log" | tail -16
    done
  done
done
