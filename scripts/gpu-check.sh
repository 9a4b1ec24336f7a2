#!/usr/bin/env bash
# GPU checks of kvtier's HBM path (issue 13).
#   scripts/gpu-check.sh build   # here (no GPU needed): builds the CUDA test binaries, a
#                                # stripped release kvtierd and the abi3 Python wheel into
#                                # target/gpu-check/ (carry that folder: ~40 MiB)
#   scripts/gpu-check.sh run     # on a GPU machine (torch, no network): runs the Rust CUDA
#                                # tests (byte-exact GPU gather/scatter for every layout, odd
#                                # strides and offsets; layer-by-layer save and load through a
#                                # registered arena; loads count only verified blocks), installs
#                                # the wheel and runs scripts/gpu_check.py (vLLM-shaped bf16 KV:
#                                # byte-exact, against the CPU path, event ordering, D2H/H2D
#                                # against torch's pinned copies, verification's share, layer
#                                # overlap, a kvtierd's shared arena); prints its JSON line last,
#                                # saves the log to $OUT/gpu-check.log. Every step is bounded in
#                                # time (the whole run: under 8 minutes).
# Without a CUDA driver and GPU everything says SKIPPED and `run` exits 1.
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
    strip --strip-debug target/gpu-check/cuda target/gpu-check/layouts 2>/dev/null || true
    cargo build --locked --release -p kvtierd
    strip -o target/gpu-check/kvtierd target/release/kvtierd
    rm -f target/gpu-check/*.whl
    maturin=.venv/bin/maturin
    [ -x "$maturin" ] || maturin=maturin
    "$maturin" build --release -q --manifest-path connector/python/Cargo.toml -o target/gpu-check
    du -sh target/gpu-check
    ;;
run)
    out="${OUT:-target/gpu-check}"
    mkdir -p "$out"
    log="$out/gpu-check.log"
    py="$(mktemp -d)"
    set +e
    {
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
        echo "cores: $(nproc); $(grep -m1 "model name" /proc/cpuinfo)"
        echo "shmem THP: $(cat /sys/kernel/mm/transparent_hugepage/shmem_enabled 2>&1)"
        for t in target/gpu-check/cuda target/gpu-check/layouts; do
            echo "== $t"
            # A test that finds no GPU fails here instead of saying SKIPPED.
            KVTIER_REQUIRE_GPU=1 timeout 120 "$t" --nocapture --test-threads=1 ||
                echo "FAILED: $t"
        done
        echo "== scripts/gpu_check.py"
        python3 -m pip install -q --no-deps --no-index --target "$py" target/gpu-check/*.whl &&
            PYTHONUNBUFFERED=1 PYTHONPATH="$py" KVTIERD="$PWD/target/gpu-check/kvtierd" \
                timeout 300 python3 scripts/gpu_check.py ||
            echo "FAILED: scripts/gpu_check.py"
    } 2>&1 | tee "$log"
    set -e
    grep -q "SKIPPED" "$log" && { echo "gpu-check: no GPU used"; exit 1; }
    grep -q "^FAILED" "$log" && { echo "gpu-check: FAILED"; exit 1; }
    echo "gpu-check: ok"
    ;;
*)
    echo "usage: $0 build|run" >&2
    exit 2
    ;;
esac
