#!/bin/bash
# The GPU checks, for a lent GPU machine (Python 3.12 with torch, transformers,
# peft and accelerate; no index), sized to fit its 15 minutes of device time:
# the trainer's memory and speed on a card (issue 32's table, the estimate
# against NVML's peak, lorafleet against HF Trainer), each step bounded.
#
#   bash bench/agent_gpu_check.sh [STEP ...]   # default: every step, in this order
#
# Steps (seconds they are allowed): trl-large (150), estimate (170),
# trl-small (110), hf (80), agent (240: tests/agent on the card, when time is left).
# Everything printed also goes to $OUT/gpu_check.log where $OUT is set.
#
# Here, first (wheels the machine lacks, into the ignored .whl/; about 4 MB):
#   P="--only-binary=:all: --python-version 3.12 --implementation cp \
#      --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64"
#   pip download --no-deps $P -d .whl nats-py==2.16.0 msgspec structlog stamina \
#     tenacity greenlet sniffio peft==0.21.2
#   pip download --no-deps $P -d .whl/trl trl==1.16.0 datasets==5.2.0 dill==0.4.1 \
#     multiprocess==0.70.19
# then run it there with .whl carried. Colocation (bench/colocation.py --device
# cuda) needs a vLLM for the card, which cannot be carried (its wheel is over
# the 64 MiB a call carries): run it where one is installed.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
LOG=${OUT:-/tmp}/gpu_check.log
exec > >(tee -a "$LOG") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/trl .whl/trl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/trainer:$PWD/schemas:$PWD/libs:$PWD/services:$PWD
nvidia-smi --query-gpu=index,name,memory.total,memory.free,driver_version --format=csv
python3 -c "import torch, transformers, peft, accelerate; print('torch', torch.__version__, torch.cuda.is_available(), 'transformers', transformers.__version__, 'peft', peft.__version__, 'accelerate', accelerate.__version__)"

step() {  # name, seconds, command...
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  echo "=== $name (at most $limit s)"
  timeout "$limit" "$@"
  echo "=== $name: rc $? in $((SECONDS - start)) s"
}

steps=("$@")
((${#steps[@]})) || steps=(trl-large estimate trl-small hf)
for s in "${steps[@]}"; do
  case $s in
    # Issue 32's table on a card: TRL's SFTTrainer, then lorafleet at TRL's peak,
    # half of it and the smallest it accepts; the peak by NVML.
    trl-large) PYTHONPATH=/tmp/trl:$PYTHONPATH step "$s" 150 python3 bench/trainer_trl.py --device cuda --case large --records 256 ;;
    trl-small) PYTHONPATH=/tmp/trl:$PYTHONPATH step "$s" 110 python3 bench/trainer_trl.py --device cuda --case small --records 512 ;;
    # The estimate against NVML's peak (Qwen2.5-0.5B shapes, three configurations) and the budget cap.
    estimate) step "$s" 170 python3 bench/trainer_estimate.py ;;
    # lorafleet against transformers.Trainer + PEFT on a 134M Llama: tokens/s and peak.
    hf) step "$s" 80 python3 bench/trainer_gpu.py --steps 40 ;;
    agent) step "$s" 240 python3 -m pytest tests/agent/test_real_trainer.py -v -p no:cacheprovider -p no:xdist -W ignore::DeprecationWarning ;;
    *) echo "unknown step $s" ;;
  esac
done
