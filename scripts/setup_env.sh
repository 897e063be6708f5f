#!/usr/bin/env bash
# Create .venv and install freescale with the right torch/fbgemm/torchrec stack.
#
#   scripts/setup_env.sh            # runtime + test tools
#   FREESCALE_STACK=cpu|cuda ...    # force a stack (default: cuda when nvidia-smi sees a GPU)
#   PYTHON=python3.11 ...           # interpreter used to create the venv
#
# Order matters: torch is pinned first so nothing later can pull a CUDA wheel on a
# CPU machine, then fbgemm, then torchrec with --no-deps (its metadata names the
# CUDA fbgemm-gpu), then everything else.  A stamp file records what was
# installed, so re-running is a no-op unless these files changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
if [[ -z "${FREESCALE_STACK:-}" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    FREESCALE_STACK=cuda
  else
    FREESCALE_STACK=cpu
  fi
fi
case "$FREESCALE_STACK" in
  cpu|cuda) ;;
  *) echo "setup_env: FREESCALE_STACK must be cpu or cuda, got '$FREESCALE_STACK'" >&2; exit 2 ;;
esac

stamp="$VENV/.freescale-stack"
want="$FREESCALE_STACK $(cat requirements/"$FREESCALE_STACK".txt requirements/test.txt pyproject.toml scripts/setup_env.sh | sha256sum | cut -c1-16)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "setup_env: creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
pip_install() {
  # pip's resolver reports that torchrec's metadata wants `fbgemm-gpu`: expected,
  # since the matching fbgemm build was installed under its own name above.
  # pip byte-compiles every file it installs (12 of torch's 18 s here); keep it: where
  # PYTHONDONTWRITEBYTECODE is set (as on these machines) nothing else ever writes the .pyc files,
  # and every process would compile torch again (imports 8.7 s instead of 3.8 s).
  "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@" 2> >(
    grep -vE "dependency resolver does not currently take into account|torchrec .* requires fbgemm-gpu" >&2)
}

echo "setup_env: installing the $FREESCALE_STACK stack"
# One package per call, in file order: each later call sees the pinned torch.
grep -vE '^\s*(#|$)' "requirements/$FREESCALE_STACK.txt" | while read -r req; do
  pip_install "$req"
done
pip_install --no-deps "torchrec==1.8.0"
# The project itself (its dependencies are index-safe: torch is already pinned),
# then the test tools.
pip_install --no-build-isolation -e ".[report,tensorboard]"  # matplotlib: `freescale report`, the ETTR plot; TensorBoard scalars
pip_install -r requirements/test.txt
"$VENV/bin/python" - <<'PY'
import torch, torchrec, fbgemm_gpu  # noqa: F401  fail here, not in the first test
import freescale, freescale.dataloader, freescale.kernels, freescale.ft  # noqa: F401
from freescale.dataloader import balance_kernels, gather
balance_kernels.warm_up()  # compile the planner's and the reads' kernels once into their cache,
gather.warm_up()  # not in the first training's ranks
print(f"setup_env: torch {torch.__version__}, torchrec ok, cuda={torch.cuda.is_available()}")
PY
echo "$want" > "$stamp"
