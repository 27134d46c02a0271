#!/usr/bin/env bash
# A local Slurm test cluster on this host: munged, slurmctld and two emulated nodes (one
# `slurmd -N NODE` each), so the Slurm end-to-end tests submit real jobs through sbatch.
#
#   bash tests/slurm/cluster.sh up       # install slurm-wlm + munge when missing (root), start
#   bash tests/slurm/cluster.sh status   # which daemons run, sinfo; exit 0 only when all run
#   bash tests/slurm/cluster.sh env      # prints `export SLURM_CONF=...` for sbatch/squeue
#   bash tests/slurm/cluster.sh down     # stop exactly the daemons `up` started
#
# Everything lives in $DFLOP_SLURM_DIR (default /tmp/dflop-slurm): slurm.conf, a private munge
# key and socket, state, spool, logs and the daemons' PID files. Two things go outside it, and
# `down` removes both: /etc/slurm/slurm.conf becomes a symlink to this slurm.conf (the Snakemake
# plugin strips SLURM_CONF from a job's environment, so `srun` inside a job only finds the default
# path; `up` refuses to replace a slurm.conf it did not write), and the node names get 127.0.0.1
# aliases in /etc/hosts (marked lines). /etc/munge is not touched: munged uses its own key and socket.
#
# Works without systemd and cgroups (proctrack/linuxproc, task/none). No slurmdbd: use
# `squeue` for job status; MinJobAge=3600 keeps finished jobs visible to squeue/scontrol for an
# hour (the Snakemake Slurm plugin needs MinJobAge >= 3x its first status-check delay).
# Both nodes share this host's cores: CPUs=$DFLOP_SLURM_CPUS per node oversubscribes on
# purpose, so a 2-node job runs on a 2-core machine.
set -euo pipefail

DIR=${DFLOP_SLURM_DIR:-/tmp/dflop-slurm}
PORT=${DFLOP_SLURM_PORT:-16817}          # slurmctld; node i listens on PORT + i
CPUS=${DFLOP_SLURM_CPUS:-2}              # per emulated node
NODES=(dflop-node1 dflop-node2)
PARTITION=debug
HOSTS_MARK="# dflop-slurm-test cluster.sh"
CONF="$DIR/slurm.conf"
DEFAULT_CONF=/etc/slurm/slurm.conf       # where slurm commands look without SLURM_CONF
MUNGE_SOCKET="$DIR/munge/munge.socket"

export SLURM_CONF="$CONF"

log() { echo "cluster.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }

# --- processes -----------------------------------------------------------------------------

pid_of() {  # pidfile -> pid on stdout when that process runs and is the named daemon
    local pidfile=$1 name=$2 pid
    [[ -s $pidfile ]] || return 1
    pid=$(<"$pidfile")
    [[ $pid =~ ^[0-9]+$ && -r /proc/$pid/comm ]] || return 1
    [[ $(<"/proc/$pid/comm") == "$name"* ]] || return 1
    echo "$pid"
}

munged_pidfile() { echo "$DIR/munge/munged.pid"; }
ctld_pidfile() { echo "$DIR/run/slurmctld.pid"; }
slurmd_pidfile() { echo "$DIR/run/slurmd-$1.pid"; }

stop_pid() {  # pidfile name: TERM, wait up to 15 s, then KILL
    local pidfile=$1 name=$2 pid i
    if ! pid=$(pid_of "$pidfile" "$name"); then
        rm -f "$pidfile"
        return 0
    fi
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 30; i++)); do
        [[ -d /proc/$pid ]] || break
        sleep 0.5
    done
    if [[ -d /proc/$pid ]]; then
        log "$name (pid $pid) ignored SIGTERM; sending SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$pidfile"
    log "stopped $name (pid $pid)"
}

# --- install and configure -----------------------------------------------------------------

install_if_missing() {
    local missing=()
    for tool in munged slurmctld slurmd sbatch squeue scontrol; do
        command -v "$tool" >/dev/null || PATH="$PATH:/usr/sbin:/sbin" command -v "$tool" >/dev/null || missing+=("$tool")
    done
    ((${#missing[@]} == 0)) && return 0
    [[ $(id -u) == 0 ]] || die "missing ${missing[*]}; run as root to install slurm-wlm and munge (apt-get)"
    command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get to install slurm-wlm and munge"
    log "installing slurm-wlm and munge (apt-get)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
}

node_memory_mb() {  # 40% of this host's memory per node (two nodes share it)
    local kb
    kb=$(awk '/^MemTotal:/ {print $2}' /proc/meminfo)
    echo $((kb * 4 / 10 / 1024))
}

write_config() {
    local mem i
    mem=$(node_memory_mb)
    mkdir -p "$DIR"/{munge,run,state,spool,log}
    chmod 755 "$DIR" "$DIR/munge"
    {
        echo "# Written by tests/slurm/cluster.sh: a local test cluster, not for production."
        echo "ClusterName=dflop-test"
        echo "SlurmctldHost=$(hostname)(127.0.0.1)"
        echo "SlurmctldPort=$PORT"
        echo "SlurmUser=root"
        echo "SlurmdUser=root"
        echo "AuthType=auth/munge"
        echo "AuthInfo=socket=$MUNGE_SOCKET"
        echo "CredType=cred/munge"
        echo "StateSaveLocation=$DIR/state"
        echo "SlurmdSpoolDir=$DIR/spool/%n"
        echo "SlurmctldPidFile=$(ctld_pidfile)"
        echo "SlurmdPidFile=$DIR/run/slurmd-%n.pid"
        echo "SlurmctldLogFile=$DIR/log/slurmctld.log"
        echo "SlurmdLogFile=$DIR/log/slurmd-%n.log"
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "SwitchType=switch/none"
        echo "MpiDefault=none"
        echo "ReturnToService=2"
        echo "SchedulerType=sched/backfill"
        echo "SelectType=select/cons_tres"
        echo "SelectTypeParameters=CR_CPU_Memory"
        echo "AccountingStorageType=accounting_storage/none"
        echo "JobAcctGatherType=jobacct_gather/none"
        echo "JobCompType=jobcomp/none"
        echo "MinJobAge=3600"
        echo "KillWait=5"
        echo "InactiveLimit=0"
        for i in "${!NODES[@]}"; do
            echo "NodeName=${NODES[$i]} NodeAddr=127.0.0.1 Port=$((PORT + i + 1)) CPUs=$CPUS RealMemory=$mem State=UNKNOWN"
        done
        echo "PartitionName=$PARTITION Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP"
    } >"$CONF.new"
    mv "$CONF.new" "$CONF"
}

add_host_aliases() {
    grep -q "$HOSTS_MARK" /etc/hosts 2>/dev/null && return 0
    local missing=()
    for node in "${NODES[@]}"; do
        getent hosts "$node" >/dev/null || missing+=("$node")
    done
    ((${#missing[@]} == 0)) && return 0
    [[ -w /etc/hosts ]] || die "node names ${missing[*]} do not resolve and /etc/hosts is not writable"
    [[ -z $(tail -c 1 /etc/hosts) ]] || echo >>/etc/hosts  # the file may lack its last newline
    echo "127.0.0.1 ${missing[*]} $HOSTS_MARK" >>/etc/hosts
}

remove_host_aliases() {
    grep -q "$HOSTS_MARK" /etc/hosts 2>/dev/null || return 0
    # Rewrite in place (not sed -i): /etc/hosts may be a bind mount that cannot be replaced.
    local kept
    kept=$(grep -v "$HOSTS_MARK" /etc/hosts)
    printf '%s\n' "$kept" >/etc/hosts
}

link_default_config() {
    if [[ -L $DEFAULT_CONF && $(readlink "$DEFAULT_CONF") == "$CONF" ]]; then
        return 0
    fi
    [[ -e $DEFAULT_CONF || -L $DEFAULT_CONF ]] &&
        die "$DEFAULT_CONF exists and is not this test cluster's; move it away or use a machine without Slurm"
    mkdir -p "$(dirname "$DEFAULT_CONF")"
    ln -s "$CONF" "$DEFAULT_CONF"
}

unlink_default_config() {
    if [[ -L $DEFAULT_CONF && $(readlink "$DEFAULT_CONF") == "$CONF" ]]; then
        rm -f "$DEFAULT_CONF"
    fi
}

# --- daemons -------------------------------------------------------------------------------

start_munged() {
    pid_of "$(munged_pidfile)" munged >/dev/null && return 0
    if [[ ! -s $DIR/munge/munge.key ]]; then
        (umask 077 && dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none)
    fi
    chmod 400 "$DIR/munge/munge.key"
    # --force: this munged runs as root with a private key and socket.
    munged --force --socket="$MUNGE_SOCKET" --key-file="$DIR/munge/munge.key" \
        --log-file="$DIR/munge/munged.log" --pid-file="$(munged_pidfile)" --seed-file="$DIR/munge/munged.seed"
    log "started munged (pid $(<"$(munged_pidfile)"))"
}

wait_for_pidfile() {  # pidfile name what: the daemon writes its PID file once it runs
    local i
    for ((i = 0; i < 40; i++)); do
        pid_of "$1" "$2" >/dev/null && return 0
        sleep 0.25
    done
    die "$3 did not start; see $DIR/log/"
}

start_slurmctld() {
    pid_of "$(ctld_pidfile)" slurmctld >/dev/null && return 0
    # -c: a test cluster starts with no jobs left over from an earlier run.
    slurmctld -c -f "$CONF"
    wait_for_pidfile "$(ctld_pidfile)" slurmctld slurmctld
    log "started slurmctld (pid $(<"$(ctld_pidfile)"))"
}

start_slurmd() {
    local node=$1
    pid_of "$(slurmd_pidfile "$node")" slurmd >/dev/null && return 0
    slurmd -f "$CONF" -N "$node"
    wait_for_pidfile "$(slurmd_pidfile "$node")" slurmd "slurmd -N $node"
    log "started slurmd -N $node (pid $(<"$(slurmd_pidfile "$node")"))"
}

wait_until_idle() {  # every node registered and schedulable
    local i states
    for ((i = 0; i < 60; i++)); do
        states=$(sinfo -h -N -p "$PARTITION" -o "%t" 2>/dev/null | sort -u | tr '\n' ' ')
        if [[ -n $states && ! $states =~ (down|drain|unk|fail|\*) ]]; then
            return 0
        fi
        sleep 0.5
    done
    sinfo -N >&2 || true
    tail -n 20 "$DIR"/log/*.log >&2 || true
    die "nodes not ready (states: ${states:-none})"
}

all_running() {
    pid_of "$(munged_pidfile)" munged >/dev/null || return 1
    pid_of "$(ctld_pidfile)" slurmctld >/dev/null || return 1
    for node in "${NODES[@]}"; do
        pid_of "$(slurmd_pidfile "$node")" slurmd >/dev/null || return 1
    done
}

# --- commands ------------------------------------------------------------------------------

cmd_up() {
    if all_running; then
        log "already up ($CONF)"
        return 0
    fi
    [[ $(id -u) == 0 ]] || die "needs root (runs slurmctld/slurmd as root, edits /etc/hosts)"
    install_if_missing
    export PATH="$PATH:/usr/sbin:/sbin"
    # Keep the config of daemons that still run; a fresh start gets a fresh config.
    pid_of "$(ctld_pidfile)" slurmctld >/dev/null || write_config
    link_default_config
    add_host_aliases
    start_munged
    start_slurmctld
    for node in "${NODES[@]}"; do
        start_slurmd "$node"
    done
    wait_until_idle
    log "up: partition $PARTITION, nodes ${NODES[*]} ($CPUS CPUs each); export SLURM_CONF=$CONF"
}

cmd_down() {
    if pid_of "$(ctld_pidfile)" slurmctld >/dev/null; then
        # Cancel this cluster's jobs first, so no job step outlives its slurmd.
        local i
        scancel --quiet --full $(squeue -h -o %i 2>/dev/null) 2>/dev/null || true
        for ((i = 0; i < 30; i++)); do
            [[ -z $(squeue -h -t running,completing -o %i 2>/dev/null) ]] && break
            sleep 0.5
        done
    fi
    for node in "${NODES[@]}"; do
        stop_pid "$(slurmd_pidfile "$node")" slurmd
    done
    stop_pid "$(ctld_pidfile)" slurmctld
    stop_pid "$(munged_pidfile)" munged
    remove_host_aliases
    unlink_default_config
    log "down (logs kept in $DIR/log)"
}

cmd_status() {
    local ok=0 pid
    for spec in "munged:$(munged_pidfile)" "slurmctld:$(ctld_pidfile)" \
        $(for n in "${NODES[@]}"; do echo "slurmd:$(slurmd_pidfile "$n")"; done); do
        local name=${spec%%:*} pidfile=${spec#*:}
        if pid=$(pid_of "$pidfile" "$name"); then
            echo "running  $name (pid $pid, $pidfile)"
        else
            echo "stopped  $name ($pidfile)"
            ok=3
        fi
    done
    if ((ok == 0)); then
        sinfo -N
    fi
    return $ok
}

case "${1:-}" in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *)
        echo "usage: $0 up|down|status|env" >&2
        exit 2
        ;;
esac
