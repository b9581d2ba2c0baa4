# Sourced by the machine-check scripts (gpu_check.sh, native_check.sh); needs $OUT.
step() {  # step NAME SECONDS COMMAND...: run with a limit, keep its log and exit code
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/steps.txt"
}
