#!/usr/bin/env bash
# What a session lent a CUDA card runs on it, in one command (the device tool allows 10 minutes a command and
# 15 minutes in all, the start included): bench/gpu_truth.py (meters, #29's 1B floor, levers, plans, faults, host
# link) and the GPU-marked tests, each under its own timeout, their outputs under OUT.
#
#   bash bench/gpu_session.sh "$OUT"              # on the card (about 8 minutes at most)
#   bash bench/gpu_session.sh /tmp/gs --dry-run   # the same steps on the CPU: gpu_truth's tiny sizes, tests skipped
#
# Wheels the card's Python lacks (optuna, torchao, ...) are installed from .whl/ when it is there (carry it).
# Exits 1 when any step failed; every step runs whatever the one before did.
set -u
out=${1:?usage: bash bench/gpu_session.sh OUT [--dry-run]}
dry=${2:-}
mkdir -p "$out"
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" > /dev/null; then
    site=$(mktemp -d)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
        > "$out/wheels.log" 2>&1 && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
{ nvidia-smi 2>&1 || echo "no nvidia-smi"; python3 -c "import torch; print('torch', torch.__version__)"; } > "$out/machine.txt"
status=0
step() {  # step NAME SECONDS COMMAND...: its output in OUT/NAME.log, its exit status and seconds in OUT/steps.txt
    local name=$1 seconds=$2 started=$SECONDS code
    shift 2
    timeout "$seconds" "$@" > "$out/$name.log" 2>&1
    code=$?
    echo "$name: exit $code, $((SECONDS - started)) s" | tee -a "$out/steps.txt"
    [ "$code" -eq 0 ] || status=1
}
step gpu_truth 420 python3 bench/gpu_truth.py --out "$out/gpu_truth" --time-limit 360 $dry
step gpu_tests 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests
exit $status
