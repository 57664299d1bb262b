#!/usr/bin/env bash
# Runs the staged test binaries (../shared/gpu/stage) on the GPU machine, several at a time, in
# the modes the CUDA and wgpu issues' acceptance names (one log per mode, packed into
# $OUT/suites.tar.gz), under compute-sanitizer, and checks the CUDA disk cache.
#
#   bash tests/gpu_suite.sh pack                here, after ../shared/gpu/stage: fixes the staged names
#                                               (bench targets are bench-*, and tests/streams.rs,
#                                               attention.rs, layouts.rs and quant.rs are not replaced by the
#                                               benches of their names) and packs .gpu/bin
#                                               into .gpupack/bin.tar.xz (about 20 MiB; the staged
#                                               binaries are about 250 MiB). Send with carry
#                                               [".gpupack"] and start the command there with
#                                               `bash tests/gpu_suite.sh unpack && ...`
#   bash tests/gpu_suite.sh suites [FILTER]     every test binary in each mode of GPU_SUITE_MODES
#                                               ("cuda cuda-poison" by default; also wgpu,
#                                               wgpu-poison): BRAID_DEVICE=cuda|wgpu, with
#                                               BRAID_POISON=1 for -poison; all at once
#   bash tests/gpu_suite.sh sanitize TOOL BIN [TEST ARGS]   compute-sanitizer --tool TOOL on one binary
#   bash tests/gpu_suite.sh cache               the disk cache of compiled kernels: one program run
#                                               three times on a fresh cache (the third after one
#                                               entry was truncated), with what each run compiled
#
# GPU_SUITE_SANITIZE="memcheck:test-cuda_kernels racecheck:test-cuda_kernels ..." makes `suites`
# also run those sanitizer jobs, beside the suites (their logs: $OUT/sanitize-TOOL-BIN.log).
#
# tests/cuda_device.rs times kernels and fills the GPU's memory, so it runs alone, after the
# others (without poison). Each binary gets a time limit (GPU_SUITE_LIMIT seconds, 420 by
# default) so that one hang cannot eat the device call, and the whole parallel phase
# GPU_SUITE_BUDGET seconds (480); a binary cut off by either counts as failed (rc 124). The
# property suites run GPU_SUITE_CASES programs per test (1000), each test a job of its own.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
case "${1:-}" in
  pack)
    set -e
    cd .gpu/bin
    for b in card overhead fusion_guard streams attention layouts quant generate gpu_card data_parallel; do rm -f "test-$b"; done
    # The stage names every target test-NAME, so a bench overwrote the test of its name
    # (streams, attention, layouts, quant, generate); both are rebuilt (no-ops when fresh) to find them by kind.
    json=$(mktemp)
    cargo test --release --no-run --test streams --test attention --test layouts --test quant --test generate --message-format=json >"$json"
    cargo build --release --bench gpu_card --bench data_parallel --bench attention --bench layouts --bench quant --bench generate \
      --message-format=json >>"$json"
    python3 - "$json" <<'PY'
import json, shutil, sys
for line in open(sys.argv[1]):
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        kind = m["target"]["kind"][0]
        if kind in ("test", "bench"):  # not the `braid` binary the tests need built
            shutil.copy2(m["executable"], f'{kind}-{m["target"]["name"]}')
PY
    strip test-streams test-attention test-layouts test-quant test-generate bench-gpu_card bench-data_parallel bench-attention bench-layouts bench-quant bench-generate
    cd ../..
    mkdir -p .gpupack && cp -r .gpu/debs .gpu/run .gpupack/
    grep -qx '/.gpupack/' .git/info/exclude 2>/dev/null || echo '/.gpupack/' >>.git/info/exclude
    # Every binary links the same engine, wgpu and cudarc: a dictionary larger than one binary
    # lets xz store those bytes once (about 250 MiB of binaries pack into about 20 MiB).
    strip .gpu/bin/* 2>/dev/null || true
    tar -C .gpu -cf - bin | xz -T1 --lzma2=preset=6,dict=256MiB >.gpupack/bin.tar.xz
    du -sh .gpupack; exit 0 ;;
  unpack)
    mkdir -p .gpu && cp -r .gpupack/debs .gpupack/run .gpu/ && tar -xJf .gpupack/bin.tar.xz -C .gpu && ls .gpu/bin | wc -l
    exit $? ;;
esac
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for f in .gpu/debs/*.deb; do dpkg -x "$f" / 2>/dev/null; done; ldconfig 2>/dev/null
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export VK_DRIVER_FILES=${VK_DRIVER_FILES:-/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json}
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp} NCCL_NVLS_ENABLE=0
limit=${GPU_SUITE_LIMIT:-420}
logs=$(mktemp -d)

# run MODE BIN[:TEST]: one binary (or one test of it) in one mode; its output in
# $logs/MODE/BIN[:TEST].log, its status in .rc.
run() {
  local mode=$1 job=$2 env=(BRAID_DEVICE=${1%-poison}) args=()
  [[ $mode == *-poison ]] && env+=(BRAID_POISON=1)
  [[ $job == test-properties:* ]] && env+=(BRAID_PROPTEST_CASES="$GPU_SUITE_CASES")
  [[ $job == *:* ]] && args=(--exact "${job#*:}")
  mkdir -p "$logs/$mode"
  local start=$SECONDS
  env "${env[@]}" timeout "$limit" ".gpu/bin/${job%%:*}" "${args[@]}" >"$logs/$mode/$job.log" 2>&1
  echo "$? $((SECONDS - start))" >"$logs/$mode/$job.rc"
}
export -f run; export logs limit

case "${1:-suites}" in
  suites)
    filter=${2:-}
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    sanitizers=()
    for s in ${GPU_SUITE_SANITIZE:-}; do
      BRAID_PROPTEST_CASES=${GPU_SUITE_SANITIZE_CASES:-40} bash "$0" sanitize "${s%%:*}" "${s#*:}" &
      sanitizers+=($!)
    done
    bins=$(cd .gpu/bin && ls test-* | grep -v '^test-cuda_device$' | grep -- "$filter")
    # The property suites compile a kernel or more per random program with NVRTC: each of their
    # tests is a job of its own, with BRAID_PROPTEST_CASES programs (GPU_SUITE_CASES, 1000).
    export GPU_SUITE_CASES=${GPU_SUITE_CASES:-1000}
    # They go first: they take longest.
    jobs=$(for b in $bins; do
      [ "$b" = test-properties ] && ".gpu/bin/$b" --list --format terse 2>/dev/null | sed -n "s/^\(.*\): test$/$b:\1/p"
    done; for b in $bins; do [ "$b" = test-properties ] || echo "$b"; done)
    modes=${GPU_SUITE_MODES:-cuda cuda-poison}
    for j in $jobs; do for mode in $modes; do echo "$mode $j"; done; done |
      timeout "${GPU_SUITE_BUDGET:-480}" xargs -P "${GPU_SUITE_JOBS:-6}" -n 2 bash -c 'run "$0" "$1"'
    pkill -f '[.]gpu/bin/test-' 2>/dev/null; sleep 1   # whatever the budget cut off
    [ -z "$filter" ] || [[ cuda_device == *"$filter"* ]] && limit=${GPU_SUITE_DEVICE_LIMIT:-90} run cuda test-cuda_device
    fail=0
    for mode in $modes; do
      for log in "$logs/$mode"/*.log; do
        [ -e "${log%.log}.rc" ] || echo "124 -" >"${log%.log}.rc"   # cut off by the budget
      done
      for rc in "$logs/$mode"/*.rc; do
        bin=$(basename "$rc" .rc); read -r code secs <"$rc" || true
        bin=${bin#test-}
        summary=$(grep -E '^test result:' "${rc%.rc}.log" | tail -n 1 | sed 's/ 0 ignored; 0 measured;//')
        printf '%-11s %-60s rc=%-3s %4ss %s\n' "$mode" "$bin" "$code" "$secs" "$summary"
        [ "$code" = 0 ] || fail=$((fail + 1))
        { echo "===== $mode $bin rc=$code ${secs}s"; cat "${rc%.rc}.log"; } >>"$OUT/suite-$mode.log"
      done
    done
    grep -h '^skipped' "$logs"/*/*.log | sort | uniq -c | head -n 20
    for p in "${sanitizers[@]}"; do wait "$p" || fail=$((fail + 1)); done
    tar -C "$OUT" -czf "$OUT/suites.tar.gz" $(cd "$OUT" && ls suite-*.log) && rm -f "$OUT"/suite-*.log
    echo "gpu suites: $fail failed jobs"
    [ "$fail" -eq 0 ] ;;
  sanitize)
    tool=$2 bin=$3; shift 3
    BRAID_DEVICE=cuda timeout "$limit" /usr/local/cuda/bin/compute-sanitizer --tool "$tool" --error-exitcode 9 \
      --print-limit 20 ".gpu/bin/$bin" "$@" >"$OUT/sanitize-$tool-$bin.log" 2>&1
    code=$?
    grep -E 'ERROR SUMMARY|test result:' "$OUT/sanitize-$tool-$bin.log" | tail -n 3 | sed "s/^/$tool $bin: /"
    echo "sanitize $tool $bin: rc=$code"
    exit "$code" ;;
  cache)
    export BRAID_CUDA_CACHE=$(mktemp -d) RUST_LOG=braid=debug
    program() { BRAID_DEVICE=cuda ".gpu/bin/test-cuda_device" --exact a_training_program_and_its_compiled_kernels --nocapture 2>&1; }
    counts() { echo "$1: $(grep -c 'compiled by NVRTC' "$2") compiled, $(grep -c 'disk cache hit' "$2") disk hits, $(grep -c 'not trusted' "$2") entries not trusted; $(grep -E '^test result' "$2")"; }
    program >"$OUT/cache.log"; cp "$OUT/cache.log" /tmp/first.log
    program >/tmp/second.log
    entry=$(find "$BRAID_CUDA_CACHE" -type f | head -n 1)
    truncate -s "$(($(stat -c %s "$entry") / 2))" "$entry"
    program >/tmp/third.log
    { counts "first run (empty cache)" /tmp/first.log; counts "second run" /tmp/second.log
      counts "third run ($(basename "$entry") truncated)" /tmp/third.log
      grep -m 2 -E 'not trusted|disk cache hit' /tmp/third.log; } | tee -a "$OUT/cache.log" ;;
  *) echo "usage: bash tests/gpu_suite.sh pack | unpack | suites [FILTER] | sanitize TOOL BIN [ARGS] | cache"; exit 2 ;;
esac
