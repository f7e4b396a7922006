#!/usr/bin/env bash
# The long fuzz run: every hypothesis fuzzer of descriptors, headers, layouts and config
# files with FUZZ_EXAMPLES inputs each (default 100,000; the normal suite uses hundreds).
#   bash bench/fuzz.sh [N]
set -euo pipefail
cd "$(dirname "$0")/.."
FUZZ_EXAMPLES="${1:-100000}" exec python -m pytest -q -p no:cacheprovider \
    tests/test_ipc_fuzz.py tests/test_config_fuzz.py
