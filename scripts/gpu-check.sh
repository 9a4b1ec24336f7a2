#!/usr/bin/env bash
# GPU checks of kvtier's HBM path (issue 13).
#   scripts/gpu-check.sh build   # here (no GPU needed): builds the CUDA test binaries and the
#                                # abi3 Python wheel into target/gpu-check/ (carry that folder)
#   scripts/gpu-check.sh run     # on a GPU machine (torch, no network): runs the Rust CUDA
#                                # tests (byte-exact GPU gather/scatter, layer-by-layer save and
#                                # load through a registered arena), installs the wheel and runs
#                                # scripts/gpu_check.py (vLLM-shaped bf16 KV, 32 layers: byte-
#                                # exact, D2H/H2D against torch's pinned copies, layer overlap);
#                                # prints its JSON line last, saves the log to $OUT/gpu-check.log
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
        for t in target/gpu-check/cuda target/gpu-check/layouts; do
            echo "== $t"
            # A test that finds no GPU fails here instead of saying SKIPPED.
            KVTIER_REQUIRE_GPU=1 "$t" --nocapture --test-threads=1 || echo "FAILED: $t"
        done
        echo "== scripts/gpu_check.py"
        python3 -m pip install -q --no-deps --no-index --target "$py" target/gpu-check/*.whl &&
            PYTHONPATH="$py" python3 scripts/gpu_check.py || echo "FAILED: scripts/gpu_check.py"
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
