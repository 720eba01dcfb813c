#!/usr/bin/env bash
# The long-context issue's longest-context runs on the H200, which outlast one 600-s device command: started
# detached (setsid) by `start`, then followed by `wait` calls made back to back (the machine goes back after 30 s
# idle), each waiting up to WAIT_S and copying what is done into $OUT. A `wait` on a fresh machine (the runs'
# machine went back because no call came within 30 s) exits at once: check the reply's "warm" before the next.
#
#   bash benchmarks/long_context_longest.sh start   # installs .wheels (carry it), pin probe, starts the runs
#   bash benchmarks/long_context_longest.sh wait    # again until it prints ALL DONE
#
# Runs, in this order, each (framework, length) in its own process (benchmarks/long_context.py):
#   1. LoRA, foak-long (= foak train --long_context), 409,600 tokens, host budget 90 GiB, no warm-up
#   2. QLoRA (NF4 base), foak-long, 512,000 tokens, host budget 90 GiB, no warm-up
#   3. LoRA, Liger, 229,376 tokens (its longest: 196,608 fitted in 115.1 GiB on 2026-11-30)
# Each run's JSON and log land in /tmp/lc; RUNS overrides the list (space-separated names below).
set -uo pipefail
cd "$(dirname "$0")/.."
LC=/tmp/lc
WAIT_S=${WAIT_S:-570}
RUNS=${RUNS:-"lora409k qlora512k liger229k"}

run_one() {
    local name=$1
    local args
    case $name in
        lora409k) args="--lengths 409600 --frameworks foak-long --offload-budget-gib 90" ;;
        qlora512k) args="--qlora --lengths 512000 --frameworks foak-long --offload-budget-gib 90" ;;
        liger229k) args="--lengths 229376 --frameworks liger" ;;
        *) echo "unknown run $name" >&2; return 1 ;;
    esac
    # shellcheck disable=SC2086
    python3 $LC/repo/benchmarks/long_context.py --out $LC --json-name "lc_$name.json" --timeout 1500 $PIN $args \
        > "$LC/$name.log" 2>&1
}

case ${1:-} in
    start)
        mkdir -p $LC
        python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/site .wheels/*.whl || exit 1
        # the runs use a copy of the tree as it was at the start: a later call re-sends the working tree
        mkdir -p $LC/repo && cp -r src benchmarks $LC/repo/
        export PYTHONPATH=/tmp/site:$LC/repo/src PYTHONUNBUFFERED=1
        { echo "foak ${FOAK_COMMIT:-?}"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; } \
            > $LC/pin_probe.log
        # pinning speed with torch's default (cudaHostAlloc) and with cudaHostRegister on 8 threads; the faster
        # one runs the offload (the host copies of the first, timed step are pinned inside it)
        python3 $LC/repo/benchmarks/long_context.py --pin-probe 8 --timeout 120 >> $LC/pin_probe.log 2>&1
        PIN=$(python3 - <<'EOF'
import json
rows = [json.loads(l[4:]) for l in open("/tmp/lc/pin_probe.log") if l.startswith("PIN ")]
ok = [r for r in rows if "pin_s" in r and r["all_pinned"]]
best = min(ok, key=lambda r: r["pin_s"]) if ok else None
print("--pinned-register" if best and "host_register" in best["alloc_conf"] else "")
EOF
)
        echo "pin option: '${PIN}'" >> $LC/pin_probe.log
        export PIN
        export -f run_one
        export LC
        setsid nohup bash -c "for r in $RUNS; do run_one \$r; echo \"\$r done \$(date +%T)\" >> $LC/pin_probe.log; done; touch $LC/ALL_DONE" \
            > /dev/null 2>&1 < /dev/null &
        cat $LC/pin_probe.log
        ;& # fall through: wait the rest of this command
    wait)
        if [ ! -e $LC/pin_probe.log ]; then  # a fresh machine: the one that ran `start` went back (idle > 30 s)
            echo "no runs on this machine: it is a fresh one (the last went back); call start again" >&2
            exit 3
        fi
        end=$((SECONDS + WAIT_S))
        while [ ! -e $LC/ALL_DONE ] && [ $SECONDS -lt $end ]; do sleep 5; done
        cp $LC/*.json $LC/*.log "${OUT:-/tmp}/" 2>/dev/null  # at most 3 JSON + 4 logs: the tool brings back 8 files
        grep " done " $LC/pin_probe.log
        nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
        free -g | head -2
        for f in $LC/*.log; do echo "== $f"; tail -c 600 "$f"; echo; done
        [ -e $LC/ALL_DONE ] && echo "ALL DONE"
        ;;
    *) echo "usage: $0 start|wait" >&2; exit 2 ;;
esac
