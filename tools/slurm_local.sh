#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for the Slurm executor's tests and for trying
# `checks run --backend slurm` without a site cluster.
#
#   tools/slurm_local.sh start    # write the configuration, start munged, slurmctld and slurmd; wait until idle
#   tools/slurm_local.sh stop     # stop the three daemons started by `start`
#   tools/slurm_local.sh status   # exit 0 when the node is up and the controller answers
#   tools/slurm_local.sh env      # the SLURM_CONF line clients need (`eval "$(tools/slurm_local.sh env)"`)
#
# Needs root and Debian's slurm-wlm and munge packages (Slurm 22.05 in Debian 12). Everything lives in
# $STACKPROBE_SLURM_DIR (default /var/tmp/stackprobe-slurm): configuration, state, spool, logs, pids.
# /etc/slurm/slurm.conf becomes a link to that configuration only where no site configuration exists,
# so that plain `sbatch` finds it; a real configuration there is never replaced.
#
# Accounting without slurmdbd: Slurm 22.05 has no file-based accounting storage, and `sacct` without
# slurmdbd reads nothing. The job completion log (jobcomp/filetxt) records every finished job's state,
# exit code and reason, which `sacct --completion` reads; the executor also asks `scontrol show job`,
# which knows a finished job for MinJobAge seconds.
set -euo pipefail

DIR=${STACKPROBE_SLURM_DIR:-/var/tmp/stackprobe-slurm}
CONF=$DIR/slurm.conf
ETC=/etc/slurm/slurm.conf
NODE=localhost
PARTITION=${STACKPROBE_SLURM_PARTITION:-debug}
MARK="# written by stackprobe tools/slurm_local.sh"

die() { echo "slurm_local: $*" >&2; exit 1; }

pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

cgroup_v1_writable() {
    local c
    for c in memory freezer; do
        [ -d "/sys/fs/cgroup/$c" ] && mkdir "/sys/fs/cgroup/$c/stackprobe-probe.$$" 2>/dev/null || return 1
        rmdir "/sys/fs/cgroup/$c/stackprobe-probe.$$"
    done
}

# How slurmd tracks and confines a job. With a writable cgroup v1 memory and freezer hierarchy (as in this
# container), cgroups: a job over its --mem is killed by the kernel and ends as OUT_OF_MEMORY. Otherwise
# (no cgroups, or cgroup v2, whose Slurm 22.05 plugin wants systemd) processes are tracked through /proc
# and the accounting poller kills a job over its memory (the job then ends as FAILED, signal 9, and its
# output says "Exceeded job memory limit").
tracking_conf() {
    if cgroup_v1_writable; then
        cat >"$DIR/cgroup.conf.tmp" <<CG
$MARK
CgroupPlugin=cgroup/v1
CgroupMountpoint=/sys/fs/cgroup
ConstrainRAMSpace=yes
ConstrainSwapSpace=no
ConstrainCores=no
ConstrainDevices=no
CG
        mv "$DIR/cgroup.conf.tmp" "$DIR/cgroup.conf"
        printf '%s\n' ProctrackType=proctrack/cgroup TaskPlugin=task/cgroup JobAcctGatherParams=NoOverMemoryKill
    else
        rm -f "$DIR/cgroup.conf"
        printf '%s\n' ProctrackType=proctrack/linuxproc TaskPlugin=task/none JobAcctGatherParams=OverMemoryKill
    fi
}

# The NVIDIA GPUs of this machine (/dev/nvidia0, /dev/nvidia1, ...), declared as gres so that jobs asking
# --gres=gpu:N get N of them and CUDA_VISIBLE_DEVICES; none on a machine without GPUs.
gpu_count() { find /dev -maxdepth 1 -regex '/dev/nvidia[0-9]+' 2>/dev/null | wc -l; }

gpu_conf() {
    local n
    n=$(gpu_count)
    if [ "$n" -gt 0 ]; then
        printf '%s\nNodeName=%s Name=gpu File=/dev/nvidia[0-%d]\n' "$MARK" "$NODE" $((n - 1)) >"$DIR/gres.conf"
        echo GresTypes=gpu
    else
        rm -f "$DIR/gres.conf"
    fi
}

gpu_gres() {
    local n
    n=$(gpu_count)
    [ "$n" -gt 0 ] && printf ' Gres=gpu:%d' "$n"
    return 0
}

write_conf() {
    mkdir -p "$DIR"/state "$DIR"/spool "$DIR"/log "$DIR"/run
    # CPUs, sockets, cores and memory as slurmd itself detects them, else the node is drained as a mismatch
    local hw
    hw=$(slurmd -C | head -1 | sed 's/^NodeName=[^ ]* //')
    local cpus mem
    cpus=$(sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' <<<"$hw")
    mem=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$hw")
    cat >"$CONF.tmp" <<CONF
$MARK
ClusterName=stackprobe
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldPort=${STACKPROBE_SLURMCTLD_PORT:-6817}
SlurmdPort=${STACKPROBE_SLURMD_PORT:-6818}
ReturnToService=2
$(tracking_conf)
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# a job that names no memory gets its CPUs' share, not the whole node, so jobs can run side by side
DefMemPerCPU=$((mem / cpus))
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=task=5
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.txt
# finished jobs stay visible to scontrol for an hour; no grace beyond a job's time limit
MinJobAge=3600
OverTimeLimit=0
KillWait=5
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=60
MpiDefault=none
$(gpu_conf)
NodeName=$NODE NodeAddr=127.0.0.1 $hw$(gpu_gres) State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
CONF
    if cmp -s "$CONF.tmp" "$CONF"; then rm -f "$CONF.tmp"; else mv "$CONF.tmp" "$CONF"; CHANGED=1; fi
    if [ -L "$ETC" ] || [ ! -e "$ETC" ]; then
        mkdir -p "$(dirname "$ETC")"
        ln -sfn "$CONF" "$ETC"
    elif ! head -1 "$ETC" | grep -qF "$MARK"; then
        echo "slurm_local: $ETC is a site configuration; clients here need SLURM_CONF=$CONF" >&2
    fi
}

start_munge() {
    if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then return; fi
    [ -s /etc/munge/munge.key ] || { mungekey --create 2>/dev/null || create-munge-key -f; }
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge /var/lib/munge /var/log/munge
    chown munge:munge /run/munge /var/lib/munge /var/log/munge
    runuser -u munge -- /usr/sbin/munged
    touch "$DIR/run/munged.ours"
    for _ in $(seq 50); do munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && return; sleep 0.1; done
    die "munged does not answer"
}

node_state() { SLURM_CONF=$CONF sinfo -h -n "$NODE" -o %T 2>/dev/null | head -1; }

start() {
    [ "$(id -u)" = 0 ] || die "run as root (the daemons run as root)"
    for b in munged slurmctld slurmd; do command -v "$b" >/dev/null || die "$b not installed (apt-get install slurm-wlm munge)"; done
    CHANGED=0
    write_conf
    start_munge
    export SLURM_CONF=$CONF
    [ "$CHANGED" = 0 ] || stop_slurm  # daemons of an older configuration
    pid_alive "$DIR/run/slurmctld.pid" || slurmctld -f "$CONF"
    pid_alive "$DIR/run/slurmd.pid" || slurmd -f "$CONF" -N "$NODE"
    local state=""
    for _ in $(seq 120); do
        state=$(node_state)
        case "$state" in
            idle*|mixed*|allocated*) echo "slurm_local: node $NODE $state, partition $PARTITION, SLURM_CONF=$CONF"; return ;;
            drain*|down*) scontrol update NodeName="$NODE" State=RESUME 2>/dev/null || true ;;
        esac
        sleep 0.5
    done
    tail -5 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" >&2 || true
    die "node $NODE not ready (state: ${state:-no answer})"
}

stop_one() {
    local pidfile=$1
    pid_alive "$pidfile" || return 0
    local pid
    pid=$(cat "$pidfile")
    kill "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
}

stop_slurm() {
    stop_one "$DIR/run/slurmd.pid"
    stop_one "$DIR/run/slurmctld.pid"
}

stop() {
    stop_slurm
    if [ -e "$DIR/run/munged.ours" ]; then
        stop_one /run/munge/munged.pid
        rm -f "$DIR/run/munged.ours"
    fi
}

status() {
    pid_alive "$DIR/run/slurmctld.pid" && pid_alive "$DIR/run/slurmd.pid" || return 1
    case "$(node_state)" in idle*|mixed*|allocated*) return 0 ;; *) return 1 ;; esac
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
