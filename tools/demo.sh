#!/usr/bin/env bash
# Sets everything up on a fresh machine, then pre-trains a small GPT on the demo corpus with
# pipeline 2 x tensor 2 (4 CPU processes over gloo, or 4 GPUs over nccl) and profiles iteration 3.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
export PATH="$PWD/.venv/bin:$PATH"
out=demo_output
mkdir -p "$out"
corpus=tools/demo_corpus
if [ ! -f "$out/demo_text_document.idx" ]; then
  python tools/preprocess_data.py --input "$corpus/docs.jsonl" --json-keys text \
    --output-prefix "$out/demo" --vocab-file "$corpus/vocab.json" --merge-file "$corpus/merges.txt" \
    --tokenizer-type GPT2BPETokenizer --append-eod --workers 2
fi
deepspeed --num_gpus 4 pretrain_gpt.py \
  --pipeline-model-parallel-size 2 --tensor-model-parallel-size 2 \
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 \
  --micro-batch-size 4 --global-batch-size 16 \
  --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 5 --train-iters 40 \
  --weight-decay 0.01 --clip-grad 1.0 --checkpoint-activations \
  --data-path "$out/demo_text_document" --vocab-file "$corpus/vocab.json" --merge-file "$corpus/merges.txt" \
  --split 949,50,1 --log-interval 5 --eval-interval 20 --eval-iters 2 \
  --profile-flops-step 3 --profile-flops-output "$out" "$@"
