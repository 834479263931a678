#!/usr/bin/env bash
# A real Slurm on this one machine, for the tests: slurmctld and two slurmd as two nodes (node1, node2),
# from Debian's slurm-wlm and munge (installed when missing: needs root and apt).
#   scripts/local_slurm.sh start   # prints `export SLURM_CONF=...` on its last line; exit 0 when both nodes are idle
#   scripts/local_slurm.sh stop    # stops exactly the daemons it started (their pid files), removes its hosts lines
#   scripts/local_slurm.sh status
# Exit 3 (with the reason on stderr) when Slurm cannot be had here: the tests then skip, saying why.
# Tasks are bound to their CPUs (task/affinity; both nodes share this machine's first CPUs), so a job sees
# its allocation, not the host. Everything lives under ${DISTBENCH_SLURM_DIR:-/tmp/distbench-slurm}; node1
# and node2 resolve to 127.0.0.1 through lines it adds to /etc/hosts (marked, and removed by stop).
set -uo pipefail
dir=${DISTBENCH_SLURM_DIR:-/tmp/distbench-slurm}
conf=$dir/slurm.conf
mark="# distbench local slurm"
cant() { echo "local_slurm: $*" >&2; exit 3; }

install_if_missing() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null && return
    [[ $(id -u) == 0 ]] || cant "slurm-wlm/munge are not installed and this is not root (cannot apt-get)"
    command -v apt-get >/dev/null || cant "slurm-wlm/munge are not installed and there is no apt-get"
    echo "local_slurm: installing slurm-wlm and munge (apt-get)" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null 2>&1 || cant "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null 2>&1 \
        || cant "apt-get install slurm-wlm munge failed"
}

running() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
    install_if_missing
    [[ $(id -u) == 0 ]] || cant "slurmd must run as root here (two slurmd on one host, no cgroup setup)"
    mkdir -p "$dir"/{state,spool/node1,spool/node2,munge}
    grep -q "$mark" /etc/hosts || printf '127.0.0.1 node1 %s\n127.0.0.1 node2 %s\n' "$mark" "$mark" >>/etc/hosts
    # munge: its own key, socket and pid under $dir, so a system munge (if any) is untouched
    [[ -f $dir/munge/munge.key ]] || { dd if=/dev/urandom bs=1 count=1024 of="$dir/munge/munge.key" 2>/dev/null; }
    chmod 700 "$dir/munge"; chmod 600 "$dir/munge/munge.key"
    if ! running "$dir/munge/munged.pid"; then
        munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
            --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/seed" \
            || cant "munged did not start ($dir/munge/munged.log)"
    fi
    local cpus mem
    cpus=$(nproc); mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 4 ))
    cat >"$conf" <<EOF
ClusterName=distbench
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.%n.log
SlurmctldPort=16817
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
KillWait=30
NodeName=node1 NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=16818 CPUs=$((cpus / 2 > 0 ? cpus / 2 : 1)) RealMemory=$mem State=UNKNOWN
NodeName=node2 NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=16819 CPUs=$((cpus / 2 > 0 ? cpus / 2 : 1)) RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
    export SLURM_CONF=$conf
    running "$dir/slurmctld.pid" || slurmctld -f "$conf" || cant "slurmctld did not start ($dir/slurmctld.log)"
    for n in node1 node2; do
        running "$dir/slurmd.$n.pid" || slurmd -f "$conf" -N "$n" || cant "slurmd $n did not start ($dir/slurmd.$n.log)"
    done
    for _ in $(seq 60); do
        if [[ $(sinfo -h -N -o '%N %t' 2>/dev/null | grep -c ' idle') == 2 ]]; then
            echo "export SLURM_CONF=$conf"
            return 0
        fi
        sleep 1
    done
    sinfo -N >&2
    cant "the two nodes did not come up idle within 60 s (logs in $dir)"
}

stop() {
    for pidfile in "$dir"/slurmd.node1.pid "$dir"/slurmd.node2.pid "$dir"/slurmctld.pid "$dir"/munge/munged.pid; do
        running "$pidfile" && kill "$(cat "$pidfile")"
    done
    for _ in $(seq 20); do
        alive=0
        for pidfile in "$dir"/slurmd.*.pid "$dir"/slurmctld.pid "$dir"/munge/munged.pid; do
            running "$pidfile" && alive=1
        done
        ((alive)) || break
        sleep 0.5
    done
    [[ -w /etc/hosts ]] && sed -i "/$mark/d" /etc/hosts
    return 0
}

case ${1:-} in
    start) start ;;
    stop) stop ;;
    status) SLURM_CONF=$conf sinfo -N ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
