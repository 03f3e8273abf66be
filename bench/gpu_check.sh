#!/usr/bin/env bash
# The prepared GPU check (docs/ARCHITECTURE.md, "GPU machine"): installs nothing from the network.
# A session is lent about 15 minutes of GPU time, the machine's start included, so every section is
# time-boxed (a hang costs its box, not the session) and they run in order of what they decide:
#   build     the CUDA (and this CPU's) kernels, timed
#   crashes   bench/gpu_pinpoint.py: each bad-input call of the attention kernels that crashed its process
#             on the first GPU run, in a process of its own, with a native stack where one crashes
#   tests     every CUDA test (tests/test_cuda_*.py: the kernels against their CPU twins, CUDA graphs,
#             whole HF models with their losses against eager), 8 pytest workers
#   models    whole LMs with their losses, training steps under a bf16 autocast: eager / Inductor / dmfx
#   profile   bench/gpu_profile.py: the same steps kernel by kernel, Inductor against dmfx's fuse="all"
#   generate  compiled static-cache generate() (HF's CompileConfig default: mode reduce-overhead)
#   attention dmfx's CUDA flash kernel and GEMM form against SDPA
#   loss      the fused cross-entropy and the chunked LM head + loss against eager / Inductor
#   layer     one BertLayer at BERT-large sizes (the paper's benchmark), bf16
# Run from the repository root on the lent GPU machine:
#   bash bench/gpu_check.sh [build,crashes,tests,...]   (default: build,crashes,tests,models; "all": every section)
# Logs go under ${OUT:-bench/results}; each section prints "-- <name>: rc R in S s" when it ends.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export DMFX_CACHE_DIR="${DMFX_CACHE_DIR:-/tmp/dmfx-gpu}"
sections="${1:-build,crashes,tests,models}"
# every section ends by this deadline (GPU_CHECK_SECONDS from now), so the run returns its logs inside
# the device call's own time limit; a section that would start with under 20 s left is skipped
deadline=$(( $(date +%s) + ${GPU_CHECK_SECONDS:-1800} ))
[ "$sections" = all ] && sections="build,crashes,tests,models,profile,generate,attention,loss,layer"
want() { [[ ",$sections," == *",$1,"* ]]; }
section() {  # section NAME SECONDS LOG CMD...: CMD under a timeout, its output to the terminal and LOG
  local name=$1 secs=$2 log=$3 t0 rc left
  shift 3
  left=$(( deadline - $(date +%s) - 5 ))
  if (( left < 20 )); then echo "-- $name: skipped, past the deadline" | tee -a "$out/$log"; return; fi
  (( secs > left )) && secs=$left
  echo "== $name (at most ${secs} s)"
  t0=$(date +%s)
  timeout -k 10 "$secs" "$@" 2>&1 | tee -a "$out/$log"
  rc=${PIPESTATUS[0]}
  echo "-- $name: rc $rc in $(( $(date +%s) - t0 )) s" | tee -a "$out/$log"
}

python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "editable install failed (running from the tree)"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), 'cpus', __import__('os').cpu_count())"
want build && section build 360 gpu_build.log python3 -c "
import time
from dmfx.cuda_ops import build
for f in ('cpu', 'cuda'):
    t = time.time(); build.load(f); print(f'{f} kernels built/loaded in {time.time() - t:.1f} s')"
want crashes && section crashes 150 gpu_crashes.txt python3 bench/gpu_pinpoint.py
# one thread per worker (8 workers x 16 threads oversubscribed the 16 cores); failures logged as they happen
want tests && DMFX_FAILURE_LOG="$out/gpu_failures.txt" OMP_NUM_THREADS=1 section tests 240 gpu_tests.log \
  python3 -m pytest -q -n 14 -rfE -p no:cacheprovider --timeout 90 tests/test_cuda_*.py \
  --deselect tests/test_cuda_build.py::test_cuda_extension_compiles  # (the build section built them; a rebuild outlasts --timeout)
want models && section models 240 gpu_models.txt python3 -m bench.lm_step --device cuda --autocast bf16 \
  --models bert-mlm,llama-lm --layers 4 --rounds 10 --threads 16 --candidates eager,inductor,dmfx,dmfx-all,floor --json "$out/gpu_models.json"
want profile && section profile 180 gpu_profile.txt python3 -m bench.gpu_profile --device cuda --autocast bf16 \
  --models bert-mlm,llama-lm --layers 4 --candidates inductor,dmfx-all --steps 5 --top 20
want generate && section generate 150 gpu_generate.txt python3 -m bench.generate --device cuda --rounds 5 --threads 16 \
  --json "$out/gpu_generate.json"
want attention && section attention 120 gpu_attention.txt python3 -m bench.attention --device cuda --dtype bfloat16 \
  --seq 128,512 --dropout 0.0,0.1 --mode train --rounds 10 --threads 16
want loss && section loss 150 gpu_loss.txt bash -c '
  for dt in bfloat16 float32; do
    python3 -m bench.cross_entropy --device cuda --tokens 4096 --vocab 32000 --dtype $dt --rounds 20
    python3 -m bench.linear_cross_entropy --device cuda --tokens 8192 --hidden 1024 --vocab 32000 --dtype $dt --rounds 20 --threads 16
  done'
want layer && section layer 150 gpu_layer.txt python3 bench/bert_layer.py --device cuda --dtype bf16 --batch 8 --seq 512 \
  --hidden 1024 --heads 16 --ffn 4096 --rounds 20 --warmup 3 --threads 16 --json "$out/gpu_bert_layer.json"
# the finished kernel modules (not their object files), for a second call on a fresh machine of the
# same kind to carry and skip the build: tar xzf kernels.tgz -C "$DMFX_CACHE_DIR"
want build && tar czf "$out/kernels.tgz" -C "$DMFX_CACHE_DIR" $(cd "$DMFX_CACHE_DIR" && ls | grep -E '^dmfx_(cpu|cuda)_[0-9a-f]{16}$') 2>/dev/null
echo "== done: $sections"
