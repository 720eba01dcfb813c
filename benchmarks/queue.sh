#!/usr/bin/env bash
# A queue of benchmark commands run one after another on the lent GPU machine, detached (setsid), so that runs
# longer than one 600-s device command, and many short ones, share one machine start. `start` installs the wheels,
# freezes a copy of src/ and benchmarks/ (later calls re-send the working tree; the queue keeps running the copy)
# and starts the queue; `wait` calls, made back to back (the machine goes back after 30 s without a call, and the
# queue with it), wait up to WAIT_S each and bring back everything done so far as one file, $OUT/queue.tar.gz.
#
#   bash benchmarks/queue.sh start benchmarks/queues/h200_pending.txt   # carry .wheels (and any WHEELS dirs)
#   bash benchmarks/queue.sh wait                                       # again until it prints "queue done"
#
# A queue file: one shell command per line, run from the frozen copy's root with python3 finding foak and the
# wheels; blank lines and lines starting with # are skipped. Each command writes its results under $RESULTS (its
# own folder, out/NN) and its output goes to logs/NN.log. A `wait` on a fresh machine (the queue's went back)
# exits at once with status 3: read the reply's "warm" and rc before the next call.
set -uo pipefail
cd "$(dirname "$0")/.."
Q=/tmp/foak_queue
WAIT_S=${WAIT_S:-570}
WHEELS=${WHEELS-.wheels}  # folders of wheels to install (WHEELS="" none)

case ${1:-} in
    start)
        file=${2:?usage: $0 start QUEUE_FILE}
        [ -e $Q/queue.txt ] && { echo "a queue is already here ($Q): wait for it" >&2; exit 2; }
        mkdir -p $Q/logs $Q/out $Q/repo /tmp/site
        for dir in $WHEELS; do
            python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/site "$dir"/*.whl || exit 1
        done
        grep -v -e '^[[:space:]]*#' -e '^[[:space:]]*$' "$file" > $Q/queue.txt
        cp -r src benchmarks $Q/repo/
        {
            echo "foak ${FOAK_COMMIT:-(FOAK_COMMIT not given)}, queue $file, started $(date -u +%FT%TZ)"
            nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        } > $Q/progress
        cat > $Q/run.sh <<EOF
cd $Q/repo
export PYTHONPATH=/tmp/site:$Q/repo/src PYTHONUNBUFFERED=1
n=0
while IFS= read -r line; do
    n=\$((n + 1)); id=\$(printf %02d \$n)
    export RESULTS=$Q/out/\$id; mkdir -p \$RESULTS
    echo "\$id start \$(date -u +%T): \$line" >> $Q/progress
    SECONDS=0
    bash -c "\$line" > $Q/logs/\$id.log 2>&1 < /dev/null
    echo "\$id rc \$? after \${SECONDS} s" >> $Q/progress
done < $Q/queue.txt
touch $Q/DONE
EOF
        setsid nohup bash $Q/run.sh > $Q/run.log 2>&1 < /dev/null &
        ;& # then wait for the rest of this command
    wait)
        if [ ! -e $Q/progress ]; then
            echo "no queue on this machine: it is a fresh one (the queue's went back); start it again" >&2
            exit 3
        fi
        end=$((SECONDS + WAIT_S))
        while [ ! -e $Q/DONE ] && [ $SECONDS -lt $end ]; do sleep 5; done
        tar czf "${OUT:-/tmp}/queue.tar.gz" -C $Q progress logs out run.log 2>/dev/null
        cat $Q/progress
        nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
        free -g | sed -n 2p
        last=$(ls $Q/logs 2>/dev/null | tail -1)
        [ -n "$last" ] && { echo "== logs/$last (tail)"; tail -c 1500 "$Q/logs/$last"; echo; }
        [ -e $Q/DONE ] && echo "queue done"
        ;;
    *) echo "usage: $0 start QUEUE_FILE | wait" >&2; exit 2 ;;
esac
