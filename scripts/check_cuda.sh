#!/usr/bin/env bash
# faccel's CUDA checks in one step, on a machine with a GPU and a CUDA build of torch:
#   the tests marked `cuda` (device placement, bf16/fp16, bitwise resume with the CUDA
#   generator, saved models, the functional path, context parallelism, the meter's MFU against the
#   device's peak and the CUDA allocator's peak, the experts dispatch), the digits and observe
#   examples on the GPU, and, with two GPUs or more, the digits example under torchrun over NCCL.
# Set PYTHON to choose the interpreter (default python3). faccel is used from this checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; print('torch', torch.__version__, '|', torch.cuda.get_device_name(0), '| GPUs:', torch.cuda.device_count())"
"$PY" -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda.py
# context parallelism (torch's ring attention: CUDA only); the two-rank case needs two GPUs
"$PY" -m pytest -q -p no:cacheprovider -m cuda tests/test_context_cuda.py
"$PY" examples/digits.py
"$PY" examples/observe.py "$(mktemp -d)"  # items/s, MFU (the table's peak for this GPU), peak memory
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
  "$PY" -m torch.distributed.run --standalone --nproc-per-node "$gpus" examples/digits.py
else
  echo "one GPU: the NCCL job needs two (run this on a machine with several GPUs)"
fi
