#!/usr/bin/env bash
# Run every `equivalence` test under each CPU code path this machine has: ATen's
# kernel capability (default, avx2, avx512), oneDNN's highest ISA (AVX2, AVX512_CORE)
# and 1 or 2 intra-op threads per rank. One line per code path; exit 1 if any failed.
# Usage: scripts/equivalence_code_paths.sh [extra pytest args]   (inside the project's venv)
set -uo pipefail
cd "$(dirname "$0")/.."
flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
aten=(default)
[[ $flags == *" avx2 "* ]] && aten+=(avx2)
[[ $flags == *" avx512bw "* && $flags == *" avx512vl "* ]] && aten+=(avx512)
onednn=(ALL)
[[ $flags == *" avx2 "* ]] && onednn+=(AVX2)
[[ $flags == *" avx512bw "* ]] && onednn+=(AVX512_CORE)
failed=0
for cap in "${aten[@]}"; do
  for isa in "${onednn[@]}"; do
    for threads in 1 2; do
      line=$(ATEN_CPU_CAPABILITY=$cap ONEDNN_MAX_CPU_ISA=$isa TUNEKIT_RANK_THREADS=$threads \
        python -m pytest -m "equivalence and not gpu" -n 0 -q -p no:cacheprovider "$@" 2>&1 | tail -n 1)
      [[ $line == *failed* || $line == *error* || $line != *passed* ]] && failed=1
      printf 'ATEN_CPU_CAPABILITY=%-8s ONEDNN_MAX_CPU_ISA=%-12s threads=%s  %s\n' "$cap" "$isa" "$threads" "$line"
    done
  done
done
exit $failed
