#!/usr/bin/env bash
# GPU checks of the connector's CUDA gather/scatter (cargo feature `cuda`).
#   scripts/gpu-check.sh build   # here (no GPU needed): builds the CUDA test binaries into
#                                # target/gpu-check/
#   scripts/gpu-check.sh run     # on a GPU machine: runs them, prints and saves the output
#                                # (to $OUT/gpu-check.log when OUT is set)
# Without a CUDA driver the tests say SKIPPED and pass; on a GPU they must print
# "byte-exact" for every layout.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
build)
    mkdir -p target/gpu-check
    cargo test --locked -p kvtier-connector --features cuda --no-run --message-format=json 2>/dev/null |
        python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    exe = m.get("executable")
    if m.get("reason") == "compiler-artifact" and exe and m["target"]["name"] in ("cuda", "layouts"):
        shutil.copy(exe, "target/gpu-check/" + m["target"]["name"])
        print("built", "target/gpu-check/" + m["target"]["name"])
'
    strip --strip-debug target/gpu-check/* 2>/dev/null || true
    du -sh target/gpu-check
    ;;
run)
    log="${OUT:-target/gpu-check}/gpu-check.log"
    {
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
        for t in target/gpu-check/cuda target/gpu-check/layouts; do
            echo "== $t"
            "$t" --nocapture --test-threads=1
        done
    } 2>&1 | tee "$log"
    grep -q "SKIPPED" "$log" && { echo "gpu-check: no GPU used"; exit 1; }
    echo "gpu-check: ok"
    ;;
*)
    echo "usage: $0 build|run" >&2
    exit 2
    ;;
esac
