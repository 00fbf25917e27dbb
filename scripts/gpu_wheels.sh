#!/usr/bin/env bash
# Download into .whl/ (git-ignored) the wheels that the GPU machine's image lacks, for its Python
# 3.12 on x86-64 Linux, then check that they and the working tree fit the 64 MiB the device tool
# carries. scripts/gpu_suite.sh installs them there.
#
#   bash scripts/gpu_wheels.sh               # download (needs the package index), then check
#   bash scripts/gpu_wheels.sh --check-only  # only the size check, nothing downloaded
#
# Only what `shardpool finetune`, `shardpool devices`, scripts/gpu_check.py and the CUDA tests
# import and the image lacks (its package list: the device tool's KINDS.md):
#   - bitsandbytes: every stage is NF4;
#   - pydantic (+ pydantic-core, annotated-types, typing-inspection; typing-extensions, new enough
#     for this pydantic): the config and the job contract;
#   - cryptography (+ cffi's backend): the CLI builds the mesh commands' parser, which imports it.
# Not carried: datasets, dill, multiprocess (only a non-JSON dataset reads through `datasets`, and
# torch uses dill only when present), pyroute2 (the mesh's WireGuard, never on these paths),
# pycparser (cffi needs it to compile, not to load). The pins are the versions this repo is
# tested with. Exit status 1, with one line, when the total is over 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
LIMIT_MIB=${GPU_WHEELS_LIMIT_MIB:-64}

WHEELS=(
    bitsandbytes==0.50.2
    pydantic==2.13.4
    pydantic-core==2.46.4
    annotated-types==0.7.0
    typing-inspection==0.4.2
    typing-extensions==4.16.0
    cryptography==48.0.0
    cffi==2.0.0
)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
    manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_34_x86_64)

case "${1:-}" in
    --check-only) ;;
    "")
        mkdir -p .whl
        platform_flags=()
        for platform in "${PLATFORMS[@]}"; do platform_flags+=(--platform "$platform"); done
        "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp "${platform_flags[@]}" -d .whl "${WHEELS[@]}"
        ;;
    -h | --help)
        sed -n '2,8p' "$0"
        exit 0
        ;;
    *)
        echo "gpu_wheels: unknown argument $1; use --check-only or no argument" >&2
        exit 2
        ;;
esac
exec "$PYTHON" scripts/gpu_suite_tools.py size-check --wheels .whl --limit-mib "$LIMIT_MIB"
