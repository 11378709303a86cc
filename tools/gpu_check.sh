#!/usr/bin/env bash
# The CUDA path, checked on a machine with one or more NVIDIA GPUs (nothing else in this repository needs one).
#
#   bash tools/gpu_check.sh [OUTPUT_DIR]
#
# Uses the machine's own torch (never reinstalls it). DeepSpeed and what it needs are installed if missing:
# from wheels in ./.whl when that folder exists (an offline machine), else from the package registry.
# Then, on CUDA with NCCL and bf16, a GPT of 8 layers x 1024 wide (sequence 1024, micro-batch 4, 4 micro-batches):
#   1. a one-stage pipeline on one GPU, iteration 3 profiled: the report's fwd, bwd and recompute FLOPs and
#      params are checked against the hand count (patches.to_megatron.analytic_flops, exact), and the profiled
#      iteration's time is compared with the median of the unprofiled ones of the same run;
#   2. a two-stage pipeline when two GPUs exist, the same checks.
# Prints one line per check and exits non-zero on the first failed one.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu_check_output}
mkdir -p "$out"
python=${PYTHON:-python3}

if ! "$python" -c "import deepspeed" 2>/dev/null; then
  if [ -d .whl ]; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu_check_site .whl/*.whl
    export PYTHONPATH="/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}"
  else
    "$python" -m pip install -q deepspeed hjson pydantic
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$python" -c "import torch, deepspeed; assert torch.cuda.is_available(), 'no CUDA device'; \
print(f'gpu check: torch {torch.__version__}, deepspeed {deepspeed.__version__}, {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}')"
gpus=$("$python" -c "import torch; print(torch.cuda.device_count())")
launcher=("$python" -m deepspeed.launcher.runner)

run() {  # run NAME NGPUS PP
  local name=$1 ngpus=$2 pp=$3
  "${launcher[@]}" --num_gpus "$ngpus" --master_port $((29500 + RANDOM % 1000)) pretrain_gpt.py \
    --pipeline-model-parallel-size "$pp" --num-layers 8 --hidden-size 1024 --num-attention-heads 16 \
    --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 16 \
    --train-iters 8 --lr 1e-4 --log-interval 1 --eval-iters 0 --bf16 --distributed-backend nccl \
    --synthetic-vocab-size 32000 --checkpoint-activations --peak-tflops 989 \
    --profile-flops-step 3 --profile-flops-output "$out/$name" --loss-record-file "$out/$name/losses.jsonl" \
    > "$out/$name.log" 2>&1 || { echo "gpu check: $name FAILED (log: $out/$name.log)"; tail -30 "$out/$name.log"; exit 1; }
  "$python" tools/gpu_check_report.py "$name" "$out/$name.log" "$out/$name/flops_profile_step3.json" \
    --num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --micro-batch-size 4 \
    --global-batch-size 16 --synthetic-vocab-size 32000 --pipeline-model-parallel-size "$pp"
}

mkdir -p "$out/one_stage" && run one_stage 1 1
if [ "$gpus" -ge 2 ]; then
  mkdir -p "$out/two_stages" && run two_stages 2 2
else
  echo "gpu check: two-stage pipeline skipped (one GPU)"
fi
echo "gpu check: passed"
