#!/usr/bin/env bash
# Runs every test of kvtier: the Rust workspace (unit, property, integration, doc tests) and the
# Python tests. Installs what it needs (a virtualenv in .venv with pinned packages) idempotently.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo >/dev/null; then
    echo "cargo not found: install the Rust toolchain (https://rustup.rs)" >&2
    exit 1
fi
# fio: the disk benchmark's baseline (its smoke test runs here).
if ! command -v fio >/dev/null; then
    apt-get install -y -q fio >/dev/null || { echo "could not install fio (apt-get install fio)" >&2; exit 1; }
fi
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -r tests/python/requirements.txt

echo "== cargo test"
cargo test --workspace --locked

echo "== pytest"
.venv/bin/python -m pytest -q tests/python
