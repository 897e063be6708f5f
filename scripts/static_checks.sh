#!/usr/bin/env bash
# The package's static checks: ruff (lint) and mypy (types), configured in pyproject.toml.
# mypy resolves modules by folder, and the package maps dataloader/, ft/ and kernels/ into freescale.*
# (pyproject.toml's package-dir), so it checks a tree of links laid out as the installed package.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
py=${PY:-$repo/.venv/bin/python}
"$py" -m ruff check --quiet freescale dataloader ft kernels
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/freescale"
for f in freescale/*.py freescale/py.typed freescale/models freescale/sim freescale/report; do
  ln -s "$repo/$f" "$tree/freescale/"
done
for p in dataloader ft kernels; do ln -s "$repo/$p" "$tree/freescale/$p"; done
cd "$tree"
"$py" -m mypy --config-file "$repo/pyproject.toml" --cache-dir "$repo/.mypy_cache" --no-error-summary -p freescale
# The GPU-only scripts too (they never run on a CPU machine, so only the type check sees their code).
gpu_scripts=(gpu_all gpu_checks gpu_sm_free_backend compile_kernels bench_kernels bench_sm_free)
MYPYPATH="$repo/benchmarks" "$py" -m mypy --config-file "$repo/pyproject.toml" --cache-dir "$repo/.mypy_cache" \
  --no-error-summary $(printf "$repo/benchmarks/%s.py " "${gpu_scripts[@]}")
echo "static checks: ruff and mypy clean"
