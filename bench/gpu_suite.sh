#!/usr/bin/env bash
# The GPU checks and benchmarks behind docs/BENCHMARKS.md, by section:
#   bash bench/gpu_suite.sh tests kernels r50 r50b64 r18 cifar1 ...
# Logs go to $OUT (or ./gpu_logs). The CIFAR sections read $CIFAR (default ../shared/data/cifar10-jpeg.tgz);
# the cifar* sections and coldsetup run +experiment=$EXP (default cifar10_speed); cifar5c and cifarprobe
# add the overrides in $ARGS; cifar5c names its sweep cifar5$TAG. r18c, r50b64c, r50compile, r50cdt
# firststep and compilecache add $ARGS too and name their logs with $TAG (r50p, r18p and bnsweep too):
#   TAG=_autotune ARGS="model.cudnn_benchmark=true" bash bench/gpu_suite.sh r50b64c r50compile
#   TAG=_freeze3 ARGS="trainer.stem_norm_freeze_epochs=3" bash bench/gpu_suite.sh cifar5c
#   TAG=full ARGS="bench.profile_rows=400" bash bench/gpu_suite.sh r50p   # every kernel of both steps
#   TAG=_eager ARGS="compile=false bench.baselines=[eager_bf16]" bash bench/gpu_suite.sh r50p r18p   # the uncompiled step
#   TAG=_normalize ARGS="--passes normalize" bash bench/gpu_suite.sh bnsweep
# firststep: bench/first_step_probe.py on ResNet-50 b256 with compile=true, on a fresh inductor cache.
# compilecache: ours alone on ResNet-50 b256 with compile_cache: a cold run fills an empty folder, then a new machine's
# first and second process run on a copy of it at another path.
# compilecacheprobe: bench/first_step_probe.py on the $EXP recipe's model, the same way.
# disttests and r50dp need two GPUs (r50dp: one GPU, then $GPUS (default 2), $GPUS with the optimizer state sharded,
# $GPUS with compile=true);
# fusionprobe needs the nvidia-cudnn-frontend package (docs/BENCHMARKS.md, "Session I"); with
# ARGS="512 resnet18_cifar" (and TAG=_r18 to name its log) it times the 32x32 ResNet-18's layers, not ResNet-50's.
# convprobe: bench/conv_probe.py, each convolution of the 32x32 ResNet-18 timed on its own (ARGS="resnet50 256": ResNet-50's).
# streamprobe: bench/stream_probe.py, the weight gradients on a second stream; ARGS="256 resnet50" for ResNet-50's.
set -u
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"
TAG=${TAG:-}; ARGS=${ARGS:-}; export EXP=${EXP:-cifar10_speed}
CIFAR=${CIFAR:-../shared/data/cifar10-jpeg.tgz}
export PYTHONUNBUFFERED=1
R50="model=resnet50 data.resolution=224 data.num_classes=1000 amp=true"
section() {  # name, timeout, command...; the run or sweep folder it names starts empty: a new
  # run refuses a folder that holds another run's records, as a section run again would
  local name=$1 limit=$2; shift 2
  for a in "$@"; do case $a in hydra.run.dir=*|hydra.sweep.dir=*) rm -rf "${a#*=}";; esac; done
  echo "=== $name"; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc $((SECONDS - t0))s"; tail -n 25 "$OUT/$name.log"
}
new_machine() {  # name, timeout, command...: a cold run into an empty compile_cache folder, then two runs
  # on a copy of it at another path, as a new machine's first process and its next
  local C="$(mktemp -d)/cache"
  section $1"1"$TAG $2 "${@:3}" compile_cache=$C; cp -r "$C" "$C.2"
  for run in 2 3; do section $1$run$TAG $2 "${@:3}" compile_cache=$C.2; done; du -sh "$C" "$C.2"
}
for s in "$@"; do case $s in
  env) nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.backends.cudnn.version())";;
  tests) section tests 540 python3 -m pytest -q tests/test_gpu.py tests/test_data_gpu.py tests/test_kernels.py -p no:cacheprovider;;
  disttests) section disttests 480 python3 -m pytest -q -s -m gpu tests/test_dist.py -p no:cacheprovider;;
  r50dp) G=${GPUS:-2}; for run in "1 false false" "$G false false" "$G false true" "$G true false"; do set -- $run  # GPUs, compile, sharded
          section r50dp$1$2$3 300 python3 -m torch.distributed.run --nproc_per_node=$1 run.py model=resnet50 data.resolution=224 \
            amp=true compile=$2 dist.shard_optimizer=$3 trainer.batch_size=256 data.train_size=$(($1 * 256 * 12)) \
            data.val_size=512 trainer.epochs=2 trainer.log_every=1 hydra.run.dir=$OUT/r50dp$1$2$3; done
          python3 bench/throughput.py $OUT/r50dp1falsefalse $OUT/r50dp${G}falsefalse $OUT/r50dp${G}falsetrue $OUT/r50dp${G}truefalse;;
  fusionprobe) section fusionprobe$TAG 540 python3 bench/fusion_probe.py ${ARGS:-256};;  # ARGS="512 resnet18_cifar"
  convprobe) section convprobe$TAG 300 python3 bench/conv_probe.py ${ARGS:-resnet18_cifar 512};;  # ARGS="resnet50 256"
  streamprobe) section streamprobe$TAG 200 python3 bench/stream_probe.py ${ARGS:-512 resnet18_cifar};;
  kernels) section kernels 120 python3 bench/kernels_bench.py;;
  bnsweep) section bnsweep$TAG 420 python3 bench/batch_norm_sweep.py $ARGS;;
  poolsweep) section poolsweep 200 python3 bench/max_pool_sweep.py;;
  poolprobe) section poolprobe 300 python3 bench/pool_probe.py $R50 trainer.batch_size=256 compile=true;;
  r50) section r50 330 python3 run.py mode=bench $R50 trainer.batch_size=256 "bench.optimizers=[momentum,lars,adamw]" hydra.run.dir=$OUT/r50;;
  r50nocompile) section r50nocompile 200 python3 run.py mode=bench $R50 trainer.batch_size=256 "bench.baselines=[eager_bf16,eager_fp16]" "bench.optimizers=[momentum,lars,adamw]" hydra.run.dir=$OUT/r50nc;;
  r50compile) section r50compile$TAG 300 python3 run.py mode=bench $R50 trainer.batch_size=256 "bench.baselines=[eager_bf16,compile_bf16]" compile=true $ARGS hydra.run.dir=$OUT/r50c$TAG;;
  r50cdt) section r50cdt$TAG 480 python3 run.py mode=bench $R50 trainer.batch_size=256 "bench.baselines=[eager_bf16,compile_bf16]" compile=true +compile_options.coordinate_descent_tuning=true $ARGS hydra.run.dir=$OUT/r50cdt$TAG;;
  r50p) section r50p$TAG 300 python3 run.py mode=bench $R50 trainer.batch_size=256 "bench.baselines=[compile_bf16]" compile=true bench.profile=10 $ARGS hydra.run.dir=$OUT/r50p$TAG;;
  r50b64) section r50b64 120 python3 run.py mode=bench $R50 trainer.batch_size=64 "bench.baselines=[eager_bf16,eager_fp16]" hydra.run.dir=$OUT/r50b64;;
  r18) section r18 120 python3 run.py mode=bench model=resnet18_cifar data.resolution=32 amp=true trainer.batch_size=512 "bench.baselines=[eager_bf16,eager_fp16]" hydra.run.dir=$OUT/r18;;
  cifar1) section cifar1 180 python3 run.py +experiment=$EXP data.root=$CIFAR hydra.run.dir=$OUT/cifar1;;
  cifar1c) section cifar1c 300 python3 run.py +experiment=$EXP compile=true data.root=$CIFAR hydra.run.dir=$OUT/cifar1c;;
  cifar5auto) c=false; grep -q '"val_top1"' $OUT/cifar1c/summary.json 2>/dev/null && c=true
          section cifar5 360 python3 run.py -m +experiment=$EXP compile=$c data.root=$CIFAR trainer.seed=0,1,2,3,4 hydra.sweep.dir=$OUT/cifar5
          python3 bench/seeds.py $OUT/cifar5;;
  r18c) section r18c$TAG 200 python3 run.py mode=bench model=resnet18_cifar data.resolution=32 amp=true trainer.batch_size=512 "bench.baselines=[eager_bf16,eager_fp16]" compile=true $ARGS hydra.run.dir=$OUT/r18c$TAG;;
  r50b64c) section r50b64c$TAG 200 python3 run.py mode=bench $R50 trainer.batch_size=64 "bench.baselines=[eager_bf16]" compile=true $ARGS hydra.run.dir=$OUT/r50b64c$TAG;;
  cifar5c) section cifar5$TAG 420 python3 run.py -m +experiment=$EXP compile=true data.root=$CIFAR trainer.seed=0,1,2,3,4 $ARGS hydra.sweep.dir=$OUT/cifar5$TAG
          python3 bench/seeds.py $OUT/cifar5$TAG;;
  cifar5) section cifar5 300 python3 run.py -m +experiment=$EXP data.root=$CIFAR trainer.seed=0,1,2,3,4 hydra.sweep.dir=$OUT/cifar5
          python3 bench/seeds.py $OUT/cifar5;;
  cifarprobe) section cifarprobe$TAG 200 python3 bench/cifar_probe.py data.root=$CIFAR compile=true $ARGS;;
  resnet18) section resnet18 560 python3 run.py -m +experiment=cifar10_resnet18 data.root=$CIFAR trainer.checkpoint_every=0 trainer.seed=0,1,2,3,4 hydra.sweep.dir=$OUT/resnet18
          python3 bench/seeds.py $OUT/resnet18;;
  memprobe) section memprobe 120 python3 bench/memory_probe.py model=resnet18_cifar data.resolution=32 amp=true trainer.batch_size=512;;
  r18p) section r18p$TAG 200 python3 run.py mode=bench model=resnet18_cifar data.resolution=32 amp=true trainer.batch_size=512 "bench.baselines=[eager_bf16]" compile=true bench.profile=20 $ARGS hydra.run.dir=$OUT/r18p$TAG;;
  coldsetup) export TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)"  # cold, then fresh processes on the cache it filled
          section coldsetup 200 env TORCH_LOGS=recompiles,dynamo python3 run.py +experiment=$EXP compile=true data.root=$CIFAR hydra.run.dir=$OUT/coldsetup
          grep -E "Step 2|Recompiling" $OUT/coldsetup.log
          for i in 1 2 3; do section warmsetup$i 120 python3 run.py +experiment=$EXP compile=true data.root=$CIFAR hydra.run.dir=$OUT/warmsetup$i; done
          grep -h "set-up" $OUT/coldsetup.log $OUT/warmsetup?.log
          section setupprobe 200 python3 bench/setup_probe.py data.root=$CIFAR compile=true
          unset TORCHINDUCTOR_CACHE_DIR;;
  firststep) export TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)"  # cold, then warm, then warm with cuDNN's autotuning
          P="python3 bench/first_step_probe.py $R50 trainer.batch_size=256 compile=true $ARGS"
          section firststep_cold$TAG 300 $P; section firststep_warm$TAG 200 $P
          section firststep_bench$TAG 200 $P model.cudnn_benchmark=true
          unset TORCHINDUCTOR_CACHE_DIR;;
  compilecache) new_machine compilecache 400 python3 run.py mode=bench $R50 trainer.batch_size=256 "bench.baselines=[]" compile=true $ARGS;;
  compilecacheprobe) new_machine ccprobe 300 python3 bench/first_step_probe.py +experiment=$EXP data.root=$CIFAR compile=true $ARGS;;
  loader) python3 -m trainer.data.make_jpeg_tree /tmp/tree --classes 100 --per-class 130 --val-per-class 10 > /dev/null
          section loader 200 python3 bench/loader_bench.py data.root=/tmp/tree;;
  loader8) section loader8 200 python3 bench/loader_bench.py data.root=/tmp/tree data.threads=8;;
  loadersplit) for f in 0.0 0.45 0.6 0.9 1.0; do section loader_host$f 150 python3 bench/loader_bench.py data.root=/tmp/tree data.host_decode=$f; done;;
  decoderprobe) section decoderprobe 150 python3 bench/decoder_probe.py /tmp/tree;;
  greenprobe) python3 -m trainer.data.make_jpeg_tree /tmp/small --classes 16 --per-class 256 --val-per-class 1 > /dev/null
          for q in 8 32 1; do section greenprobe$q 120 env CUDA_DEVICE_MAX_CONNECTIONS=$q python3 bench/green_probe.py /tmp/small; done;;
  *) echo "unknown section $s";;
esac; done
