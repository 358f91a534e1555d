#!/usr/bin/env bash
# The one prepared script for a CUDA machine: GPU tests, then GPU benchmarks, in < 10 minutes.
# Usage (repo root): bash benchmarks/gpu/run.sh; the logs and JSON land in ${OUT:-gpu-out}/.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true

# The machine's own torch (a CUDA build, maybe older than pyproject's range) and packages, no pip; this checkout.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name())" || exit 1
python -c "
import importlib.util as u
missing = [m for m in ('triton', 'pytest', 'pytest_timeout', 'xdist', 'hypothesis', 'rich', 'tqdm') if u.find_spec(m) is None]
assert not missing, f'missing packages: {missing} (carry them as wheels)'
import triton; print('triton', triton.__version__)" || exit 1

unset TRITON_INTERPRET  # the real kernels run on the GPU
# up to 25 failures (one run must name the failing tests), 8 workers; the sm_90 / sm_80 compile checks need no GPU
timeout 200 python -m pytest -q -ra --maxfail 25 -n 8 -k "not compile_for_cuda and not compiles_for_cuda" tests/kernels/test_triton_softmax.py tests/kernels/test_softmax_numerics.py \
  tests/kernels/test_triton_linear_ce.py tests/kernels/test_triton_attention.py tests/kernels/test_triton_softmax_topk.py \
  tests/kernels/test_triton_op.py tests/kernels/test_triton_quant_softmax.py tests/kernels/test_triton_sampling.py \
  tests/kernels/test_triton_fused_lce.py -p no:cacheprovider 2>&1 \
  | tee "$OUT/pytest.txt" | tail -15
# vocabulary-parallel cut CE: 2 gloo ranks on the GPU, every shard on the Triton kernels
timeout 150 python -m pytest -q -ra tests/kernels/test_vocab_parallel_ce.py -k on_cuda -p no:cacheprovider 2>&1 \
  | tee "$OUT/check_vocab_parallel.txt" | tail -8
timeout 90 python benchmarks/gpu/bench_attention_cuda.py 2>&1 | tee "$OUT/bench_attention.txt" | tail -30
timeout 90 python benchmarks/gpu/bench_linear_ce_cuda.py 2>&1 | tee "$OUT/bench_linear_ce.txt" | tail -20
# a subset of shapes keeps compile time (one compile per backend x case x pass) inside the budget
timeout 75 python benchmarks/bench_softmax.py --device cuda --rounds 2 --shapes 4096x1024 64x32000 8x262144 12288x256 1024x256 --json "$OUT/bench_softmax.json" 2>&1 | tee "$OUT/bench.txt" | tail -40
timeout 65 python benchmarks/bench_softmax_topk.py --device cuda --families router,vocab,argmax --rounds 2 --no-memory --json "$OUT/bench_softmax_topk.json" 2>&1 | tee "$OUT/bench_softmax_topk.txt" | tail -40
timeout 45 python benchmarks/bench_quant_softmax.py --device cuda --quick --json "$OUT/bench_quant_softmax.json" 2>&1 | tee "$OUT/bench_quant_softmax.txt" | tail -40
# --backends smx-rewrite: the default smx keeps the sampling site on CUDA
timeout 40 python benchmarks/bench_sampling.py --device cuda --shapes 1x128256 64x128256 --families top_k,temperature+top_k+top_p --backends smx-rewrite --min-run-time 0.2 --markdown 2>&1 | tee "$OUT/bench_sampling.txt" | tail -12
# compare_model.py gets what the steps above left of the 10 minutes (40..170 s; its JSON is written per case)
left=$(( 585 - SECONDS )); (( left > 170 )) && left=170; (( left < 40 )) && left=40
timeout $left python benchmarks/gpu/compare_model.py --only 4096x4096 --only "64x131072 k=50" --only 1x16x4096x128 \
  --only "N8192 D4096 V128256" --only 8192x128256 --only "64x128256" --budget $(( left - 30 )) --json "$OUT/compare_model.json" 2>&1 \
  | tee "$OUT/compare_model.txt" | tail -30
