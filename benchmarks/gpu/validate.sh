#!/usr/bin/env bash
# One command for a GPU check (issue 36): set-up, then benchmarks/gpu/validate.py's parts.
#
#   benchmarks/gpu/validate.sh [--cpu] [--out DIR] [validate.py's options]
#                                    (DIR default: $OUT, else results/validate)
#
# Set-up (GPU): the wheels in .whl/ (benchmarks/gpu/fetch_wheels.sh, fetched where PyPI is reachable)
# go into a target directory on PYTHONPATH beside the image's own packages, with this checkout first
# (the same code an editable install would import; the config schema is a real file in the
# package). --cpu: the tiny presets on the CPU with gloo, using the Python on PATH (the suite's check).
set -uo pipefail
cd "$(dirname "$0")/../.."
MODE=()
EXTRA=()  # passed on to validate.py (--reuse DIR, --memory-gb N)
DIR=${OUT:-results/validate}
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu) MODE=(--cpu); shift ;;
        --out) DIR=$2; shift 2 ;;
        *) EXTRA+=("$1"); shift ;;
    esac
done
mkdir -p "$DIR"
PYTHON=${PYTHON:-python3}
if [ ${#MODE[@]} -eq 0 ] && compgen -G ".whl/*.whl" > /dev/null; then
    SITE=${DFLOP_SITE:-/tmp/dflop-site}
    began=$(date +%s)
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        || { echo "validate.sh: installing the carried wheels failed" >&2; exit 1; }
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    echo "set-up: wheels installed in $(( $(date +%s) - began )) s" | tee "$DIR/setup.log"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" benchmarks/gpu/validate.py --out "$DIR" "${MODE[@]}" "${EXTRA[@]}"
